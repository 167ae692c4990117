"""How often one draft is accepted under each coupling (docs/sampling.md): the target's and the
drafter's logits at the first draft position, collected along seeded sampled decoding (block 2,
no lookup, the first MT-Bench prompts), then per pair the acceptance of rejection sampling
(sum of min(p, q)) and of the Gumbel coupling (the drafter's perturbed argmax, or its k best,
holding the target's; Monte Carlo over the noise), at several scales of the drafter's logits.

    python scripts/coupling_acceptance.py [--temperature 0.7] [--prompts 12] [--tokens 128]
"""

import argparse

import torch

from blockdraft.cli.common import load_engine
from blockdraft.decoding import engine as engine_module
from blockdraft.decoding.engine import GenerationConfig
from blockdraft.decoding.proposers import chain as chain_proposer
from blockdraft.decoding.verify import SamplingParams
from blockdraft.evaluation.datasets import load_prompts


def collect(temperature: float, prompts: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits, drafter logits) [N, V] at the first draft position of each drafting step."""
    engine = load_engine("smollm2-135m", None, None, "auto", "auto")
    pairs, drafted = [], {}
    chain, verdict = chain_proposer.propose, engine_module.verify

    def spy_chain(p, logits, *rest):
        drafted["q"] = logits[0].float().clone()
        return chain(p, logits, *rest)

    def spy_verify(draft, rows, *rest):
        if len(draft) > 1 and draft.is_chain and "q" in drafted:
            pairs.append((rows(0, 1)[0].float().clone(), drafted.pop("q")))
        return verdict(draft, rows, *rest)

    chain_proposer.propose, engine_module.verify = spy_chain, spy_verify
    try:
        for i, text in enumerate(load_prompts("mt-bench", prompts)):
            ids = engine.target.encode_prompt(text, True)
            engine.generate(ids, GenerationConfig(max_new_tokens=tokens, block_size=2, lookup=False,
                                                  sampling=SamplingParams(temperature, seed=i)))
    finally:
        chain_proposer.propose, engine_module.verify = chain, verdict
    return torch.stack([p for p, _ in pairs]), torch.stack([q for _, q in pairs])


def gumbel_acceptance(target: torch.Tensor, draft: torch.Tensor, temperature: float, scale: float, k: int,
                      reps: int, gen: torch.Generator) -> float:
    hits = 0.0
    for _ in range(reps):
        noise = -(-torch.rand(target.shape, generator=gen).clamp_min(1e-20).log()).log()
        chosen = (target / temperature + noise).argmax(-1)  # [N]
        best = (draft * scale / temperature + noise).topk(k, -1).indices  # [N, k]
        hits += (best == chosen[:, None]).any(-1).float().mean().item()
    return hits / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    target, draft = collect(args.temperature, args.prompts, args.tokens)
    t = args.temperature
    p = torch.softmax(target / t, -1)
    gen = torch.Generator().manual_seed(0)
    print(f"{len(target)} pairs; the drafter's argmax is the target's on "
          f"{(target.argmax(-1) == draft.argmax(-1)).float().mean().item():.3f}")
    print(f"{'drafter scale':>14} {'rejection':>10} {'gumbel':>8} {'gumbel, 4 best':>15}")
    for scale in (0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 100.0):
        q = torch.softmax(draft * scale / t, -1)
        rejection = torch.minimum(p, q).sum(-1).mean().item()
        print(f"{scale:>14} {rejection:>10.3f} {gumbel_acceptance(target, draft, t, scale, 1, 20, gen):>8.3f} "
              f"{gumbel_acceptance(target, draft, t, scale, 4, 5, gen):>15.3f}")


if __name__ == "__main__":
    main()
