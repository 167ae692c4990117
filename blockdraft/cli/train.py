"""Commands that make drafters: init, data, train, vocab, and the steps around training:
prompts (prompt sets for data), merge-data, average (weight soups), accuracy (held-out scores),
plot-training (training curves), ablate (the ablation studies)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import BlockdraftError


def cmd_init(target: str, out: str, num_layers: int, block_size: int, target_layer_ids: str | None,
             mask_token_id: int | None, seed: int) -> None:
    """Write a fresh (untrained) drafter sized for the target."""
    import torch

    from ..models.checkpoint import check_fits, save_draft
    from ..models.draft import DraftModel, build_draft_config, init_scale_check
    from ..models.target import default_mask_token_id, load_target

    tgt = load_target(target, device="cpu")
    try:
        taps = [int(x) for x in target_layer_ids.split(",")] if target_layer_ids else None
    except ValueError as err:
        raise BlockdraftError(f"--target-layer-ids must be comma-separated integers ({target_layer_ids!r})") from err
    cfg = build_draft_config(tgt.config, num_layers, block_size, taps,
                             default_mask_token_id(tgt) if mask_token_id is None else mask_token_id,
                             vocab_size=tgt.vocab_size)
    init_scale_check(cfg)
    check_fits(cfg, tgt)
    torch.manual_seed(seed)
    save_draft(DraftModel(cfg), out)
    print(f"fresh drafter ({num_layers} layers, block {block_size}, taps {cfg.target_layer_ids}, "
          f"mask id {cfg.mask_token_id}) written to {out}")


def cmd_data(out: str, source: str, target: str, responses: str, limit: int, batch_size: int,
             max_prompt_tokens: int, max_new_tokens: int, heldout_percent: float, features: bool,
             dtype: str) -> None:
    from ..training.data import generate_data
    from .common import parse_dtype

    generate_data(out, source, target, responses, limit, batch_size, max_prompt_tokens, max_new_tokens,
                  heldout_percent, features=features, dtype=parse_dtype(dtype))


def cmd_train(resume: bool, **kwargs) -> None:
    from ..training.train import TrainConfig, train

    path = train(TrainConfig(**kwargs), resume=resume)
    print(f"drafter written to {path}")


def cmd_vocab(draft: str, size: int, data: str | None, source: str | None, limit: int, target: str) -> None:
    """Give a drafter a draft vocabulary subset (vocab.py) of the `size` most frequent response
    tokens, counted in a `blockdraft data` directory or in a prompt source's own answers."""
    from tqdm import tqdm

    from ..models.checkpoint import config_from_json
    from ..models.vocab import coverage, most_frequent, remove_vocab, save_vocab

    cfg_path = Path(draft) / "config.json"
    if not cfg_path.is_file():
        raise BlockdraftError(f"drafter checkpoint {draft!r} has no config.json")
    vocab = config_from_json(json.loads(cfg_path.read_text()), str(cfg_path)).vocab_size
    if size == 0:
        remove_vocab(draft)
        print(f"{draft}: draft vocabulary subset removed (the full {vocab} tokens)")
        return
    if (data is None) == (source is None):
        raise BlockdraftError("give exactly one of --data (a `blockdraft data` directory) or --source")
    if data is not None:
        from ..training.data import load_samples

        lists = [[t for t, m in zip(s["input_ids"], s["loss_mask"]) if m] for s in load_samples(data)]
    else:
        from transformers import AutoTokenizer

        from ..training.data import iter_jsonl, iter_sharegpt
        from ..models.target import resolve_target_path

        tok = AutoTokenizer.from_pretrained(resolve_target_path(target))
        answers = (p.response for p in (iter_sharegpt() if source == "sharegpt" else iter_jsonl(source)) if p.response)
        lists = [tok(a, add_special_tokens=False)["input_ids"]
                 for a, _ in tqdm(zip(answers, range(limit)), total=limit, desc="counting tokens")]
    ids = most_frequent(lists, size, vocab)
    path = save_vocab(draft, ids, vocab)
    print(f"{path}: {len(ids)} of {vocab} tokens, covering {coverage(lists, ids):.1%} "
          f"of the {sum(len(x) for x in lists)} counted tokens")


def cmd_merge_data(out: str, sources: list[str], cache_from: list[str]) -> None:
    from ..training.merge import merge_data

    print(merge_data(out, sources, cache_from))


def cmd_average(out: str, drafters: list[str], weights: list[float] | None, dtype: str) -> None:
    import torch

    from ..models.checkpoint import save_draft
    from ..training.average import average

    save_draft(average(drafters, weights), out, getattr(torch, dtype))
    print(f"wrote {out}: mean of {len(drafters)} drafters, weights {weights or 'equal'}")


def cmd_prompts(out: str, kind: str, root: list[str] | None, per_module: int, exclude: list[str],
                limit: int | None) -> None:
    from ..training.prompts import code_roots, sharegpt_code_prompts, source_prompts, write_jsonl

    if limit is not None and limit < 1:
        raise BlockdraftError(f"--limit must be positive (got {limit})")
    if kind == "code":
        if exclude:
            raise BlockdraftError("--exclude applies to --kind sharegpt-code")
        rows = source_prompts(code_roots(root), per_module=per_module)[:limit]
        note = ""
    else:
        if root:
            raise BlockdraftError("--root applies to --kind code")
        rows, seen, excluded = sharegpt_code_prompts(exclude, limit or 3000)
        note = f" with code of {seen} read ({excluded} excluded ids)"
    write_jsonl(out, rows)
    print(f"{out}: {len(rows)} prompts{note}")


def cmd_accuracy(data: str, drafters: list[str], target: str, device: str | None) -> None:
    """Held-out accuracy per block position and held-out tau by replay, as training logs them, of
    saved drafters on one data directory's held-out split: drafters trained on different data,
    scored on the same sequences."""
    from ..models.checkpoint import check_fits, load_draft
    from ..models.target import load_target
    from ..training.data import load_samples
    from ..training.features import OnlineFeatures
    from ..training.train import TrainConfig, heldout_accuracy, heldout_tau

    tgt = load_target(target, device=device)
    heldout = load_samples(data, "heldout")
    if not heldout:
        raise BlockdraftError(f"{data} has no held-out samples")
    for path in drafters:
        draft = load_draft(path, device=tgt.device, dtype=tgt.dtype)  # exported: tap scale folded into fc
        check_fits(draft.cfg, tgt)
        cfg = TrainConfig(data=data, out="-", num_layers=len(draft.layers), block_size=draft.block_size)
        feats = OnlineFeatures(tgt, heldout, draft.cfg.target_layer_ids)
        acc = heldout_accuracy(draft, tgt, heldout, feats, cfg, None, draft.cfg.mask_token_id)
        tau = heldout_tau(draft, tgt, heldout, cfg.eval_prompts, cfg.eval_tokens)
        print(f"{path}: " + " ".join(f"acc@{k} {a:.4f}" for k, a in enumerate(acc, 1))
              + f" ({len(heldout)} held-out sequences), held-out tau {tau:.3f}", flush=True)


def cmd_ablate(studies: list[str], data: str, runs: str, out: str, target: str, steps: int, prompts: int,
               max_new_tokens: int, init: str, batch_size: int, labels: str, features: str, target_dtype: str,
               jobs: int, list_studies: bool, lr: float = 1e-3, anchors: int = 16, gamma: float | None = None) -> None:
    """DFlash's ablations, one change at a time, scored by held-out acceptance (lab/ablate.py)."""
    import shlex
    import sys

    from ..lab.ablate import STUDIES, StudySettings, run_studies

    if list_studies or not studies:
        for name, (runs_, blocks) in STUDIES.items():
            print(f"{name}: " + "; ".join(f"{r.name} ({r.change})" for r in runs_) + f"  [inference blocks {list(blocks)}]")
        return
    if data is None:
        raise BlockdraftError("--data is required: a `blockdraft data` directory with the target's labels")
    chosen = list(STUDIES) if studies == ["all"] else studies
    command = "blockdraft " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["ablate"] else \
        f"blockdraft ablate {' '.join(studies)} --data {data} --steps {steps} --prompts {prompts} --init {init}"
    if init == "bundled":
        from .common import bundled_drafter

        found = bundled_drafter(target)
        if found is None:
            raise BlockdraftError(f"no bundled drafter for {target}; pass --init DIR")
        init = str(found)
    run_studies(StudySettings(data=data, runs=runs, out=out, target=target, steps=steps, prompts=prompts,
                              max_new_tokens=max_new_tokens, init=init, batch_size=batch_size, labels=labels,
                              features=features, target_dtype=target_dtype, jobs=jobs, lr=lr, anchors=anchors,
                              gamma=gamma), chosen, command)


def cmd_plot_training(logs: list[str], out: str, start: list[float] | None, bench: list[str]) -> None:
    from ..training.plot import plot_training

    plot_training(logs, out, tuple(start) if start else None, bench)
    print(f"wrote {out}")


def _add_train_args(t: argparse.ArgumentParser) -> None:
    from dataclasses import MISSING, fields

    from ..training.train import TrainConfig

    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        required = f.default is MISSING
        default = None if required else f.default
        if isinstance(default, bool):
            t.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" ")[0], None)
            if kind is None:  # optional float fields (gamma, time budget)
                kind = float
            t.add_argument(flag, type=kind, default=default, required=required)
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")


def add_parsers(sub) -> None:
    i = sub.add_parser("init", help="write a fresh, untrained drafter for a target")
    i.add_argument("--target", default="smollm2-135m")
    i.add_argument("--out", required=True)
    i.add_argument("--num-layers", type=int, default=5)
    i.add_argument("--block-size", type=int, default=16)
    i.add_argument("--target-layer-ids", default=None, help="comma-separated, default: the paper's spread")
    i.add_argument("--mask-token-id", type=int, default=None)
    i.add_argument("--seed", type=int, default=0)
    i.set_defaults(run=cmd_init)

    d = sub.add_parser("data", help="regenerate training responses with the target")
    d.add_argument("--out", required=True, help="output directory (resumable)")
    d.add_argument("--source", default="sharegpt", help="'sharegpt' or a JSONL of prompts / messages")
    d.add_argument("--target", default="smollm2-135m")
    d.add_argument("--responses", default="target", choices=["target", "dataset"])
    d.add_argument("--limit", type=int, default=1000)
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--max-prompt-tokens", type=int, default=256)
    d.add_argument("--max-new-tokens", type=int, default=192)
    d.add_argument("--heldout-percent", type=float, default=2.0)
    d.add_argument("--features", action="store_true",
                   help="also cache the train samples' target features for `train` (about 5.8 KB per token for "
                        "SmolLM2); nearly free with --responses dataset, which runs that prefill anyway")
    d.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the target's (auto: fp32 on the CPU, bf16 on CUDA; float32 makes the labels the "
                        "target's fp32 greedy tokens, what decoding on the CPU produces)")
    d.set_defaults(run=cmd_data)

    v = sub.add_parser("vocab", help="give a drafter a draft vocabulary subset: its head scores only the "
                       "most frequent tokens (output unchanged)")
    v.add_argument("--draft", required=True, help="drafter directory (the subset is written to its vocab/ folder)")
    v.add_argument("--size", type=int, required=True, help="tokens in the subset (0: remove the subset)")
    v.add_argument("--data", default=None, help="count the response tokens of a `blockdraft data` directory")
    v.add_argument("--source", default=None, help="or count the answers of 'sharegpt' or a JSONL of prompts")
    v.add_argument("--limit", type=int, default=20000, help="with --source: answers to count")
    v.add_argument("--target", default="smollm2-135m", help="with --source: whose tokenizer counts")
    v.set_defaults(run=cmd_vocab)

    t = sub.add_parser("train", help="train a drafter on data from `blockdraft data`")
    _add_train_args(t)
    t.set_defaults(run=cmd_train)

    m = sub.add_parser("merge-data", help="merge `blockdraft data` directories into one for `train --labels target`",
                       description="Every sample gets the target's next-token labels; ids become "
                       "'<source dir>/<id>'; held-out samples come from sources of the target's own responses; "
                       "cached train features are copied, not recomputed.")
    m.add_argument("out", help="a new directory (written as OUT.partial, renamed when complete)")
    m.add_argument("sources", nargs="+", help="`blockdraft data` directories")
    m.add_argument("--cache-from", action="append", default=[], metavar="EARLIER_MERGE",
                   help="also copy features from an earlier merge of the same sources (repeatable)")
    m.set_defaults(run=cmd_merge_data)

    a = sub.add_parser("average", help="average drafters of one lineage (a model soup) into a new drafter")
    a.add_argument("out")
    a.add_argument("drafters", nargs="+", help="two or more drafter directories with the same config.json")
    a.add_argument("--weights", type=float, nargs="+", default=None, help="one per drafter (default: equal)")
    a.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="the written weights' dtype")
    a.set_defaults(run=cmd_average)

    pr = sub.add_parser("prompts", help="write a prompt set (JSONL) for `blockdraft data --source`",
                        description="code: HumanEval-style prompts (signature and docstring; the whole function "
                        "as the response, for --responses dataset) from Python source trees, the standard library "
                        "by default. sharegpt-code: ShareGPT first turns whose answer holds a code block.")
    pr.add_argument("out", help="the JSONL to write")
    pr.add_argument("--kind", choices=["code", "sharegpt-code"], default="code")
    pr.add_argument("--root", action="append", default=None,
                    help="code: a directory of .py files, or 'stdlib' (repeatable; default: stdlib)")
    pr.add_argument("--per-module", type=int, default=8, help="code: at most this many functions per module")
    pr.add_argument("--exclude", nargs="*", default=[], help="sharegpt-code: data directories whose ids to leave out")
    pr.add_argument("--limit", type=int, default=None, help="at most this many prompts (sharegpt-code: 3000)")
    pr.set_defaults(run=cmd_prompts)

    ac = sub.add_parser("accuracy", help="held-out accuracy per block position and held-out tau of saved drafters "
                        "on one data directory's held-out split")
    ac.add_argument("data", help="a `blockdraft data` directory")
    ac.add_argument("drafters", nargs="+")
    ac.add_argument("--target", default="smollm2-135m")
    ac.add_argument("--device", default=None)
    ac.set_defaults(run=cmd_accuracy)

    pt = sub.add_parser("plot-training", help="plot held-out tau and accuracy against sequences seen from "
                        "training logs (several logs: stages that continued each other)")
    pt.add_argument("logs", nargs="+", help="log.jsonl files of `blockdraft train` runs, in stage order")
    pt.add_argument("--out", required=True, metavar="FILE.png")
    pt.add_argument("--start", type=float, nargs=2, default=None, metavar=("TAU", "ACC1"),
                    help="the point at 0 sequences (the initial drafter, scored by `blockdraft accuracy`)")
    pt.add_argument("--bench", action="append", default=[], metavar="TAU.json",
                    help="`blockdraft tau --json` file with one drafter per stage (repeatable)")
    pt.set_defaults(run=cmd_plot_training)

    ab = sub.add_parser("ablate", help="DFlash's ablations by short training runs, scored by held-out acceptance "
                        "(resumable)")
    ab.add_argument("studies", nargs="*", help="layers, taps, more-taps, injection, context, block, decay, anchors, "
                    "soft-labels, noise, or all (none: list them)")
    ab.add_argument("--data", default=None, help="a `blockdraft data` directory with the target's labels")
    ab.add_argument("--runs", default="runs/ablate", help="where the runs are trained (shared between studies)")
    ab.add_argument("--out", default="docs/ablations", help="where each study's table, JSON and plot go")
    ab.add_argument("--target", default="smollm2-135m")
    ab.add_argument("--steps", type=int, default=300, help="training steps per run")
    ab.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    ab.add_argument("--labels", choices=("target", "data"), default="target",
                    help="target: the target's stored predictions (data --responses dataset); data: the "
                    "sequence's own tokens (right for data --responses target)")
    ab.add_argument("--features", choices=("cache", "online"), default="cache",
                    help="the target's taps cached on disk once, or a target forward each step (a GPU)")
    ab.add_argument("--target-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="float32 keeps a CUDA target exact (auto: fp32 on the CPU, bf16 on CUDA)")
    ab.add_argument("--jobs", type=int, default=1, help="runs trained and scored side by side (worker "
                    "processes: on a GPU, which small runs leave mostly idle)")
    ab.add_argument("--prompts", type=int, default=10, help="HumanEval problems and MT-Bench questions scored, each")
    ab.add_argument("--max-new-tokens", type=int, default=256)
    ab.add_argument("--init", default="target", help="target (from the target's layers), bundled, or a drafter "
                    "directory to continue (the studies that keep the architecture)")
    ab.add_argument("--lr", type=float, default=1e-3, help="every run's peak learning rate (a continued drafter: "
                    "lower, e.g. 3e-4)")
    ab.add_argument("--anchors", type=int, default=16, help="anchor blocks per sequence (the block-8 run: twice this)")
    ab.add_argument("--gamma", type=float, default=None, help="the loss decay (default: the trainer's for the block)")
    ab.add_argument("--list", dest="list_studies", action="store_true", help="list the studies and their runs")
    ab.set_defaults(run=cmd_ablate)
