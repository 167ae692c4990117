"""A quick check of the GPU code paths on a tiny random target (no SmolLM2 needed): the target's
batched greedy generation, and a drafter training run with online features on the target's device,
fp32 target, bf16 autocast, checkpoint and export. Run first on a lent GPU, before the long run.

    python scripts/gpu/smoke.py
"""

import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from blockdraft.models.checkpoint import load_draft
from blockdraft.models.target import load_target
from blockdraft.training.train import TrainConfig, train


def main() -> None:
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 bos_token_id=None, eos_token_id=None, pad_token_id=None)).save_pretrained(root / "target")
    target = load_target(str(root / "target"), dtype=torch.float32)
    print("target on", target.device, target.model.dtype)
    outs = target.greedy_batch([[1, 2, 3], [4, 5, 6, 7, 8]], 12)
    assert all(len(o) == 12 for o in outs), outs
    gen = torch.Generator().manual_seed(0)
    (root / "data").mkdir()
    with open(root / "data" / "samples.jsonl", "w") as f:
        for i in range(24):
            n_prompt, n_resp = 5 + i % 4, 30 + 3 * i
            ids = torch.randint(0, 90, (n_prompt + n_resp,), generator=gen).tolist()
            f.write(json.dumps({"id": str(i), "split": "heldout" if i < 2 else "train", "input_ids": ids,
                                "loss_mask": [0] * n_prompt + [1] * n_resp}) + "\n")
    path = train(TrainConfig(data=str(root / "data"), out=str(root / "run"), target=str(root / "target"), num_layers=2,
                             block_size=6, anchors=4, batch_size=8, max_steps=20, lr=3e-3, log_every=5, save_every=10,
                             features="online", target_dtype="float32", time_budget_minutes=1.0, eval_sequences=2,
                             eval_prompts=0), progress=False)
    log = [json.loads(x) for x in open(root / "run" / "log.jsonl")]
    print("losses", [r["loss"] for r in log if "loss" in r], "final", log[-1])
    assert load_draft(path) is not None
    print(f"smoke OK in {time.perf_counter() - t0:.1f} s")

    # `blockdraft ablate --jobs 2` on the GPU: spawned workers, each with its own CUDA target
    from blockdraft.lab import ablate as A

    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
    refs = [torch.randint(0, 90, (12,), generator=gen).tolist() for _ in prompts]
    A.load_prompt_sets = lambda s, target: {"humaneval": (prompts, refs), "mt-bench": (prompts, refs)}
    s = A.StudySettings(data=str(root / "data"), runs=str(root / "abl"), out=str(root / "abl-out"),
                        target=str(root / "target"), steps=4, prompts=2, max_new_tokens=12, labels="data",
                        features="online", target_dtype="float32", jobs=2)
    A.run_studies(s, ["decay"], "smoke")
    print((root / "abl-out" / "decay.md").read_text().splitlines()[-2:])
    print(f"ablate smoke OK in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":  # the ablate workers are spawned: they import this file
    main()
