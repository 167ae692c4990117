"""Held-out accuracy per block position of saved drafters on one data directory's held-out split
(full vocabulary, fixed anchors, the sequences' own next tokens as labels), and held-out tau by
replay (as training logs it: up to 16 responses, 192 tokens), so that drafters trained on
different data are scored on the same sequences:
    python scripts/heldout_accuracy.py runs/data-sharegpt runs/table/*/drafter"""

import sys

import torch

from blockdraft.checkpoint import load_draft
from blockdraft.data import load_samples
from blockdraft.features import OnlineFeatures
from blockdraft.train import TrainConfig, heldout_accuracy, heldout_tau
from blockdraft.target import load_target


def main(data: str, drafters: list[str]) -> None:
    target = load_target("smollm2-135m", device="cpu")
    heldout = load_samples(data, "heldout")
    for path in drafters:
        draft = load_draft(path)  # exported: the tap scale is folded into fc, so no scale here
        cfg = TrainConfig(data=data, out="-", num_layers=len(draft.layers), block_size=draft.block_size)
        feats = OnlineFeatures(target, heldout, draft.cfg.target_layer_ids)
        acc = heldout_accuracy(draft, target, heldout, feats, cfg, None, draft.cfg.mask_token_id)
        tau = heldout_tau(draft, target, heldout, cfg.eval_prompts, cfg.eval_tokens)
        print(f"{path}: acc@1 {acc[0]:.4f} acc@2 {acc[1]:.4f} ({len(heldout)} held-out sequences), "
              f"held-out tau {tau:.3f}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(sys.argv[1], sys.argv[2:])
