"""The `blockdraft` command: generate, chat, serve, init, data, train, vocab, bench, bench-serve,
tau. Each subcommand is one typed function (bench-serve's lives in benchserve.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import BlockdraftError

BUNDLED_DRAFTERS = Path(__file__).parent / "drafters"


def bundled_drafter(target: str) -> Path | None:
    path = BUNDLED_DRAFTERS / target
    return path if (path / "model.safetensors").exists() else None


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[dict]:
    if (prompt is None) == (prompts_file is None):
        raise BlockdraftError("give exactly one of --prompt or --prompts-file")
    if prompt is not None:
        return [{"prompt": prompt}]
    rows = []
    try:
        lines = Path(prompts_file).read_text().splitlines()
    except OSError as err:
        raise BlockdraftError(f"cannot read --prompts-file: {err}") from err
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise BlockdraftError(f"{prompts_file}:{n}: invalid JSON ({err.msg})") from err
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise BlockdraftError(f'{prompts_file}:{n}: expected {{"prompt": "...", "seed": optional int}}')
        if rec.get("seed") is not None and not isinstance(rec["seed"], int):
            raise BlockdraftError(f"{prompts_file}:{n}: seed must be an integer")
        rows.append(rec)
    if not rows:
        raise BlockdraftError(f"{prompts_file}: no prompts")
    return rows


DTYPES = ("auto", "float32", "bfloat16", "float16")


def parse_dtype(name: str):
    """'auto' -> None (the default for the device), else the torch dtype of that name."""
    import torch

    if name not in DTYPES:
        raise BlockdraftError(f"unknown dtype {name!r}; choose from {list(DTYPES)}")
    return None if name == "auto" else getattr(torch, name)


def load_engine(target: str, draft: str | None, device: str | None = None, dtype: str = "auto",
                draft_dtype: str = "auto"):
    """The target plus the drafter: a path, 'none', or None for the bundled one (if any).
    dtype: the target's ('auto': fp32 on the CPU, bf16 on CUDA); draft_dtype: the drafter's
    ('auto': `fast_draft_dtype`)."""
    from .checkpoint import load_draft
    from .decoding import Engine
    from .kernels import fast_draft_dtype
    from .target import load_target

    if draft is not None and draft != "none" and not Path(draft).exists():
        raise BlockdraftError(f"drafter checkpoint {draft!r} does not exist")
    target_dtype, chosen_draft_dtype = parse_dtype(dtype), parse_dtype(draft_dtype)
    tgt = load_target(target, device=device, dtype=target_dtype)
    path = bundled_drafter(target) if draft is None else (None if draft == "none" else Path(draft))
    drafter = load_draft(path, device=tgt.device, dtype=tgt.dtype) if path else None
    return Engine(tgt, drafter, draft_dtype=chosen_draft_dtype or fast_draft_dtype(tgt.device, tgt.dtype))


def cmd_generate(
    target: str, draft: str | None, prompt: str | None, prompts_file: str | None, chat: bool | None,
    max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None,
    block_size: int | None, stop: list[str], as_json: bool, device: str | None, lookup: bool = True,
    dtype: str = "auto", draft_dtype: str = "auto", tree: int | None = None,
) -> None:
    from .decoding import GenerationConfig, GenerationStats, TextStream
    from .verify import SamplingParams

    rows = read_prompts(prompt, prompts_file)
    base = GenerationConfig(
        max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature, top_k, top_p, seed).validate(),
        block_size=block_size, stop_strings=tuple(stop), lookup=lookup, tree_budget=tree,
    )
    engine = load_engine(target, draft, device, dtype, draft_dtype)
    tgt = engine.target
    use_chat = tgt.has_chat_template if chat is None else chat
    if use_chat and not tgt.has_chat_template:
        raise BlockdraftError(f"target {target!r} has no chat template; use --raw")
    for row in rows:
        ids = tgt.encode_prompt(row["prompt"], use_chat)
        cfg = base
        if row.get("seed") is not None:
            cfg = GenerationConfig(**{**base.__dict__, "sampling": SamplingParams(temperature, top_k, top_p, row["seed"]).validate()})
        if as_json:
            res = engine.generate(ids, cfg)
            st = res.stats
            print(json.dumps({
                "prompt": row["prompt"], "text": res.text, "token_ids": res.token_ids,
                "num_new_tokens": res.num_new_tokens, "finish_reason": res.finish_reason,
                "tau": round(st.tau, 4), "acceptance_lengths": st.acceptance_lengths,
                "prefill_seconds": round(st.prefill_seconds, 4), "decode_seconds": round(st.decode_seconds, 4),
                "decode_tokens_per_second": round(max(res.num_new_tokens - 1, 0) / st.decode_seconds, 2)
                if st.decode_seconds > 0 else None,
            }), flush=True)
            continue
        stats = GenerationStats()
        text = TextStream(tgt.tokenizer, cfg.stop_strings)
        for step in engine.stream(ids, cfg, stats):
            sys.stdout.write(text.push(step.tokens))
            sys.stdout.flush()
        sys.stdout.write(text.finish())
        tokens = text.tokens
        n = len(tokens)
        tps = (n - 1) / stats.decode_seconds if stats.decode_seconds > 0 else float("nan")
        print(f"\n[{n} tokens, tau {stats.tau:.2f}, {tps:.1f} tok/s decode, prefill {stats.prefill_seconds:.2f}s]",
              file=sys.stderr)


def cmd_init(target: str, out: str, num_layers: int, block_size: int, target_layer_ids: str | None,
             mask_token_id: int | None, seed: int) -> None:
    """Write a fresh (untrained) drafter sized for the target."""
    import torch

    from .checkpoint import check_fits, save_draft
    from .draft import DraftModel, build_draft_config, init_scale_check
    from .target import default_mask_token_id, load_target

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
             max_prompt_tokens: int, max_new_tokens: int, heldout_percent: float, features: bool) -> None:
    from .data import generate_data

    generate_data(out, source, target, responses, limit, batch_size, max_prompt_tokens, max_new_tokens,
                  heldout_percent, features=features)


def cmd_bench(target: str, draft: str | None, dataset: str, limit: int | None, max_new_tokens: int,
              block_size: int | None, temperature: float, methods: str, warmup: int, as_json: str | None,
              device: str | None, oracle_keep: float, assistant: str | None, plot: str | None,
              dtype: str = "auto", draft_dtype: str = "auto", packed: bool = True) -> None:
    from .bench import check_methods, dump, format_table, parse_method, run_bench
    from .benchplot import plot_report
    from .benchdata import load_prompts
    from .target import load_target

    chosen = check_methods(tuple(m.strip() for m in methods.split(",") if m.strip()))
    texts = load_prompts(dataset, limit)
    engine = load_engine(target, draft, device, dtype, draft_dtype)
    helper = load_target(assistant, device=engine.target.device, dtype=engine.target.dtype) if assistant else None
    prompts = [engine.target.encode_prompt(t, engine.target.has_chat_template) for t in texts]
    refs = None
    if temperature == 0 and any(parse_method(m).name == "oracle" for m in chosen):
        # the oracle's greedy continuations: batched and cached, shared with `blockdraft tau`
        from .replay import default_references_path, reference_continuations

        refs = reference_continuations(engine.target, prompts, max_new_tokens, default_references_path(target))
    report = run_bench(engine.target, engine.draft, prompts, chosen, max_new_tokens, block_size, temperature, warmup,
                       oracle_keep=oracle_keep, assistant=helper, references=refs, packed=packed)
    report["dataset"] = dataset
    print(format_table(report))
    if as_json:
        Path(as_json).write_text(dump(report) + "\n")
    if plot:
        plot_report(report, plot)


def cmd_tau(target: str, draft: list[str] | None, dataset: str, limit: int | None, max_new_tokens: int,
            block_size: int | None, references: str | None, as_json: str | None, device: str | None) -> None:
    """tau of drafters at temperature 0 and a fixed block size, by replay (see replay.py)."""
    from .benchdata import load_prompts
    from .checkpoint import check_fits, load_draft
    from .decoding import GenerationStats
    from .replay import default_references_path, reference_continuations, replay
    from .target import load_target
    from tqdm import tqdm

    texts = load_prompts(dataset, limit)
    if max_new_tokens < 1:
        raise BlockdraftError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    if block_size is not None and block_size < 2:
        raise BlockdraftError(f"--block-size must be >= 2 to draft anything (got {block_size})")
    paths = [Path(d) for d in draft] if draft else [bundled_drafter(target)]
    for path in paths:
        if path is None or not path.exists():
            raise BlockdraftError(f"drafter {str(path) if path else '(bundled)'} does not exist; pass --draft DIR")
    tgt = load_target(target, device=device)
    drafters = [load_draft(path, device=tgt.device, dtype=tgt.dtype) for path in paths]
    for d in drafters:
        check_fits(d.cfg, tgt)
    prompts = [tgt.encode_prompt(t, tgt.has_chat_template) for t in texts]
    path = references or default_references_path(target)
    refs = reference_continuations(tgt, prompts, max_new_tokens, path)
    report = {"dataset": dataset, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
              "reference_tokens": sum(len(r) for r in refs), "drafters": {}}
    for path, d in zip(paths, drafters):
        name, b = str(path), block_size or d.block_size
        per_prompt = [replay(tgt, d, p, r, b, max_new_tokens)
                      for p, r in tqdm(list(zip(prompts, refs)), desc=f"replay {path.name}", unit="prompt")]
        taus = [r.tau for r in per_prompt]
        lengths = [a for r in per_prompt for a in r.acceptance_lengths]
        report["drafters"][name] = {"block_size": b, "tau": round(sum(taus) / len(taus), 3),
                                    "tau_per_prompt": [round(t, 3) for t in taus],
                                    "steps": len(lengths), "acceptance_lengths_total": sum(lengths),
                                    "acceptance_histogram": GenerationStats(acceptance_lengths=lengths).histogram(b)}
        hist = report["drafters"][name]["acceptance_histogram"]
        print(f"{name}: tau {report['drafters'][name]['tau']:.3f} (block {b}, {len(prompts)} prompts of "
              f"{dataset}, {max_new_tokens} new tokens, {len(lengths)} steps)\n  steps by tokens committed: "
              + " ".join(f"{k}:{c}" for k, c in enumerate(hist, 1) if c))
    if as_json:
        Path(as_json).write_text(json.dumps(report, indent=1) + "\n")


def cmd_serve(target: str, draft: str | None, host: str, port: int, api_key: str | None, model_name: str | None,
              max_queue: int, default_max_tokens: int, device: str | None, lookup: bool = True,
              dtype: str = "auto", draft_dtype: str = "auto", max_batch: int = 16,
              max_step_tokens: int | None = None) -> None:
    import os

    try:
        from .server import create_app, serve_in_main_thread
    except ImportError as err:
        raise BlockdraftError(f"serving needs the 'serve' extra: pip install 'blockdraft[serve]' ({err})") from err
    if not 1 <= port <= 65535:
        raise BlockdraftError(f"--port must be in [1, 65535] (got {port})")
    if max_queue < 1 or default_max_tokens < 1 or max_batch < 1 or (max_step_tokens is not None and max_step_tokens < 1):
        raise BlockdraftError("--max-queue, --default-max-tokens, --max-batch and --max-step-tokens must be positive")
    api_key = api_key or os.environ.get("BLOCKDRAFT_API_KEY") or None
    engine = load_engine(target, draft, device, dtype, draft_dtype)
    app = create_app(engine, model_name or target, api_key, max_queue, default_max_tokens, lookup, max_batch,
                     max_step_tokens, worker_thread=False)
    serve_in_main_thread(app, host, port, f"blockdraft serve: {model_name or target} on http://{host}:{port}/v1 "
                         f"({'API key required' if api_key else 'no API key'}; up to {max_batch} requests "
                         "decoded together)")


def cmd_chat(target: str, draft: str | None, max_new_tokens: int, temperature: float, top_p: float,
             seed: int | None, system: str | None, device: str | None, lookup: bool = True,
             dtype: str = "auto", draft_dtype: str = "auto") -> None:
    from .chat import chat_loop
    from .decoding import GenerationConfig
    from .verify import SamplingParams

    config = GenerationConfig(max_new_tokens=max_new_tokens,
                              sampling=SamplingParams(temperature, 0, top_p, seed).validate(), lookup=lookup)
    if not 1 <= max_new_tokens <= 1_000_000:
        raise BlockdraftError(f"--max-new-tokens must be in [1, 1000000] (got {max_new_tokens})")
    engine = load_engine(target, draft, device, dtype, draft_dtype)
    if not engine.target.has_chat_template:
        raise BlockdraftError(f"target {target!r} has no chat template")
    chat_loop(engine, config, system)


def cmd_vocab(draft: str, size: int, data: str | None, source: str | None, limit: int, target: str) -> None:
    """Give a drafter a draft vocabulary subset (vocab.py) of the `size` most frequent response
    tokens, counted in a `blockdraft data` directory or in a prompt source's own answers."""
    from tqdm import tqdm

    from .checkpoint import config_from_json
    from .vocab import VOCAB_FILE, coverage, most_frequent, save_vocab

    cfg_path = Path(draft) / "config.json"
    if not cfg_path.is_file():
        raise BlockdraftError(f"drafter checkpoint {draft!r} has no config.json")
    vocab = config_from_json(json.loads(cfg_path.read_text()), str(cfg_path)).vocab_size
    if size == 0:
        (Path(draft) / VOCAB_FILE).unlink(missing_ok=True)
        print(f"{draft}: draft vocabulary subset removed (the full {vocab} tokens)")
        return
    if (data is None) == (source is None):
        raise BlockdraftError("give exactly one of --data (a `blockdraft data` directory) or --source")
    if data is not None:
        from .data import load_samples

        lists = [[t for t, m in zip(s["input_ids"], s["loss_mask"]) if m] for s in load_samples(data)]
    else:
        from transformers import AutoTokenizer

        from .data import iter_jsonl, iter_sharegpt
        from .target import resolve_target_path

        tok = AutoTokenizer.from_pretrained(resolve_target_path(target))
        answers = (p.response for p in (iter_sharegpt() if source == "sharegpt" else iter_jsonl(source)) if p.response)
        lists = [tok(a, add_special_tokens=False)["input_ids"]
                 for a, _ in tqdm(zip(answers, range(limit)), total=limit, desc="counting tokens")]
    ids = most_frequent(lists, size, vocab)
    save_vocab(draft, ids, vocab)
    print(f"{Path(draft) / VOCAB_FILE}: {len(ids)} of {vocab} tokens, covering {coverage(lists, ids):.1%} "
          f"of the {sum(len(x) for x in lists)} counted tokens")


def _bench_serve(**kwargs) -> None:
    from .benchserve import cmd_bench_serve

    cmd_bench_serve(**kwargs)


def cmd_train(resume: bool, **kwargs) -> None:
    from .train import TrainConfig, train

    path = train(TrainConfig(**kwargs), resume=resume)
    print(f"drafter written to {path}")


def _add_dtype_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the target's dtype (auto: float32 on the CPU, exact; bfloat16 on CUDA). bf16 on the CPU "
                        "is an opt-in whose speculative output may differ from plain bf16 decoding (see docs)")
    p.add_argument("--draft-dtype", default="auto", choices=DTYPES,
                   help="the drafter's dtype; it cannot change the output (auto: bfloat16 where this CPU has "
                        "native bf16 kernels or on CUDA, else the target's)")


def _add_lookup_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                   help="also verify prompt-lookup proposals (text repeated from the context) where they pay "
                        "(default: on; --no-lookup: the drafter alone)")


def _add_train_args(t: argparse.ArgumentParser) -> None:
    from dataclasses import MISSING, fields

    from .train import TrainConfig

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blockdraft", description="Lossless DFlash speculative decoding")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with speculative decoding")
    g.add_argument("--target", default="smollm2-135m", help="smollm2-135m or a local HF model directory")
    g.add_argument("--draft", default=None, help="drafter directory, or 'none' for plain decoding "
                   "(default: the bundled drafter when one exists)")
    g.add_argument("--prompt")
    g.add_argument("--prompts-file", help='JSONL lines {"prompt": ..., "seed": optional int}')
    chat = g.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt as one user message (default when the tokenizer has a chat template)")
    chat.add_argument("--raw", dest="chat", action="store_false", help="feed the prompt as plain text")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    g.add_argument("--tree", type=int, default=None, metavar="N",
                   help="verify token trees of up to N nodes instead of chains, the lookup continuation "
                        "as one more branch (N adaptive per step unless --block-size is given)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    _add_lookup_arg(g)
    _add_dtype_args(g)
    g.add_argument("--json", dest="as_json", action="store_true", help="one JSON object per prompt per line")
    g.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when present)")

    i = sub.add_parser("init", help="write a fresh, untrained drafter for a target")
    i.add_argument("--target", default="smollm2-135m")
    i.add_argument("--out", required=True)
    i.add_argument("--num-layers", type=int, default=5)
    i.add_argument("--block-size", type=int, default=16)
    i.add_argument("--target-layer-ids", default=None, help="comma-separated, default: the paper's spread")
    i.add_argument("--mask-token-id", type=int, default=None)
    i.add_argument("--seed", type=int, default=0)

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

    b = sub.add_parser("bench", help="tokens/s and tau of methods side by side, same prompts, same process")
    b.add_argument("--target", default="smollm2-135m")
    b.add_argument("--draft", default=None)
    b.add_argument("--dataset", default="humaneval", help="humaneval, mt-bench or a JSONL of {\"prompt\": ...}")
    b.add_argument("--limit", type=int, default=None)
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--block-size", type=int, default=None)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--methods", default="dflash,ar,hf,hf-pld",
                   help="comma-separated: dflash, ar, hf, hf-pld, hf-assisted, oracle, oracle@K; "
                        "NAME:B fixes the block of dflash or an oracle (oracle@0.9:16); "
                        "+treeN verifies token trees of up to N nodes (dflash+tree32: adaptive; "
                        "dflash-lookup+tree16:16: always 16 nodes at block 16; +tree: N = 32)")
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--json", dest="as_json", default=None, metavar="FILE", help="write all raw figures here")
    b.add_argument("--device", default=None)
    b.add_argument("--oracle-keep", type=float, default=0.9, help="oracle: probability each proposal is right "
                   "(per method: oracle@0.8)")
    b.add_argument("--assistant", default=None, help="assistant model for hf-assisted (an ID or HF directory)")
    _add_dtype_args(b)
    b.add_argument("--packed", action=argparse.BooleanOptionalAction, default=True,
                   help="our engine on oneDNN-prepacked linear layers (default); --no-packed: on transformers' "
                        "own kernels, as before the fast forward")
    b.add_argument("--plot", default=None, metavar="FILE.png", help="speedup bars and acceptance histograms")

    r = sub.add_parser("tau", help="a drafter's tau at temperature 0 by replay against cached greedy references")
    r.add_argument("--target", default="smollm2-135m")
    r.add_argument("--draft", action="append", default=None, help="drafter directory (repeatable; default: bundled)")
    r.add_argument("--dataset", default="humaneval", help="humaneval, mt-bench or a JSONL of {\"prompt\": ...}")
    r.add_argument("--limit", type=int, default=None)
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    r.add_argument("--references", default=None, metavar="FILE",
                   help="cache of the target's greedy continuations (default: in the blockdraft cache)")
    r.add_argument("--json", dest="as_json", default=None, metavar="FILE")
    r.add_argument("--device", default=None)

    c = sub.add_parser("chat", help="interactive terminal chat (streaming, multi-turn, /reset, /exit)")
    c.add_argument("--target", default="smollm2-135m")
    c.add_argument("--draft", default=None, help="drafter directory, or 'none' (default: the bundled one)")
    c.add_argument("--max-new-tokens", type=int, default=512)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--system", default=None, help="a system message to start every conversation")
    _add_lookup_arg(c)
    _add_dtype_args(c)
    c.add_argument("--device", default=None)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the 'serve' extra)")
    s.add_argument("--target", default="smollm2-135m")
    s.add_argument("--draft", default=None, help="drafter directory, or 'none' (default: the bundled one)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set BLOCKDRAFT_API_KEY)")
    s.add_argument("--model-name", default=None, help="the model id clients ask for (default: --target)")
    s.add_argument("--max-queue", type=int, default=64, help="requests that may wait; beyond it: 429")
    s.add_argument("--default-max-tokens", type=int, default=256, help="when a request gives no max_tokens")
    s.add_argument("--max-batch", type=int, default=16, help="requests decoded together, continuously batched "
                   "(1: one at a time)")
    s.add_argument("--max-step-tokens", type=int, default=None,
                   help="tokens one decode step may verify, the whole batch together (default: no cap)")
    _add_lookup_arg(s)
    _add_dtype_args(s)
    s.add_argument("--device", default=None)

    v = sub.add_parser("vocab", help="give a drafter a draft vocabulary subset: its head scores only the "
                       "most frequent tokens (output unchanged)")
    v.add_argument("--draft", required=True, help="drafter directory (draft_vocab.safetensors is written there)")
    v.add_argument("--size", type=int, required=True, help="tokens in the subset (0: remove the subset)")
    v.add_argument("--data", default=None, help="count the response tokens of a `blockdraft data` directory")
    v.add_argument("--source", default=None, help="or count the answers of 'sharegpt' or a JSONL of prompts")
    v.add_argument("--limit", type=int, default=20000, help="with --source: answers to count")
    v.add_argument("--target", default="smollm2-135m", help="with --source: whose tokenizer counts")

    from .benchserve import add_parser as add_bench_serve  # stdlib imports only, like this module

    _add_dtype_args(add_bench_serve(sub))

    t = sub.add_parser("train", help="train a drafter on data from `blockdraft data`")
    _add_train_args(t)
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    try:
        commands = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "init": cmd_init,
                    "data": cmd_data, "train": cmd_train, "bench": cmd_bench,
                    "tau": cmd_tau, "vocab": cmd_vocab, "bench-serve": _bench_serve}
        commands[command](**args)
    except BlockdraftError as err:
        print(f"blockdraft {command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
