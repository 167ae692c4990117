"""How sensitive the bundled drafter's acceptance is to small perturbations of the target's taps:
relative Gaussian noise eps on every tap the engine hands the drafter (the output cannot change),
on the vLLM check's prompts and settings (scripts/check_vllm.py). Prints, per eps, the steps and
the accepted drafts at positions 1..8 summed over the prompts (docs/vllm.md).

    python scripts/tap_noise.py 0 1e-6 1e-4 1e-3 1e-2      (about 2 minutes per eps here)
"""
import sys

import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from check_vllm import our_side
from blockdraft.models import target as T
from blockdraft.evaluation.datasets import load_prompts
tgt = T.load_target("smollm2-135m", device="cpu")
prompts = [tgt.encode_prompt(x, True) for d in ("humaneval", "mt-bench") for x in load_prompts(d, 4)]
del tgt
real = T.Target.forward
for eps in [float(e) for e in sys.argv[1:]]:
    gen = torch.Generator().manual_seed(0)
    def fwd(self, *a, **k):
        out = real(self, *a, **k)
        if out.taps is not None and eps > 0:
            out.taps = out.taps * (1 + eps * torch.randn(out.taps.shape, generator=gen))
        return out
    T.Target.forward = fwd
    res = our_side(prompts, 128)
    tot = [sum(r["accepted_per_position"][k] for r in res) for k in range(15)]
    print(eps, sum(r["drafts"] for r in res), tot[:8], flush=True)
