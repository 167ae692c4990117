"""Commands that decode: generate, chat, serve."""

from __future__ import annotations

import json
import sys

from ..errors import BlockdraftError
from .common import add_activations_arg, add_coupling_arg, add_dtype_args, add_lookup_arg, add_tree_arg, load_engine, read_prompts, tree_option


def cmd_generate(
    target: str, draft: str | None, prompt: str | None, prompts_file: str | None, chat: bool | None,
    max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None,
    block_size: int | None, stop: list[str], as_json: bool, device: str | None, lookup: bool = True,
    dtype: str = "auto", draft_dtype: str = "auto", tree: int | None = None, activations: str = "float32",
    coupling: str = "gumbel",
) -> None:
    from ..decoding.engine import GenerationConfig, GenerationStats, TextStream
    from ..decoding.verify import SamplingParams

    rows = read_prompts(prompt, prompts_file)
    base = GenerationConfig(
        max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature, top_k, top_p, seed),
        block_size=block_size, stop_strings=tuple(stop), lookup=lookup, tree_budget=tree_option(tree),
        coupling=coupling,
    ).validate()  # before any work
    engine = load_engine(target, draft, device, dtype, draft_dtype, activations)
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


def cmd_chat(target: str, draft: str | None, max_new_tokens: int, temperature: float, top_p: float,
             seed: int | None, system: str | None, device: str | None, lookup: bool = True,
             dtype: str = "auto", draft_dtype: str = "auto", tree: int | None = None,
             activations: str = "float32") -> None:
    from ..serving.chat import chat_loop
    from ..decoding.engine import GenerationConfig
    from ..decoding.verify import SamplingParams

    config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature, 0, top_p, seed),
                              lookup=lookup, tree_budget=tree_option(tree)).validate()  # before any work
    engine = load_engine(target, draft, device, dtype, draft_dtype, activations)
    if not engine.target.has_chat_template:
        raise BlockdraftError(f"target {target!r} has no chat template")
    chat_loop(engine, config, system)


def cmd_serve(target: str, draft: str | None, host: str, port: int, api_key: str | None, model_name: str | None,
              max_queue: int, default_max_tokens: int, device: str | None, lookup: bool = True,
              dtype: str = "auto", draft_dtype: str = "auto", max_batch: int = 16,
              max_step_tokens: int | None = None, backend: str = "blockdraft", vllm_python: str = "python",
              shutdown_grace: float = 10.0, max_body_bytes: int | None = None, activations: str = "float32",
              tree: int | None = None) -> None:
    import math
    import os

    if backend == "vllm":  # vLLM's OpenAI server with this drafter, in place of this process
        return _exec_vllm(target, draft, host, port, api_key, model_name, dtype, device, vllm_python)
    from ..decoding.state import GenerationConfig, check_trees
    try:
        from ..serving.lifecycle import serve_in_main_thread
        from ..serving.server import create_app
    except ImportError as err:
        raise BlockdraftError(f"serving needs the 'serve' extra: pip install 'blockdraft[serve]' ({err})") from err
    if not 1 <= port <= 65535:
        raise BlockdraftError(f"--port must be in [1, 65535] (got {port})")
    if max_queue < 1 or default_max_tokens < 1 or max_batch < 1 or (max_step_tokens is not None and max_step_tokens < 1):
        raise BlockdraftError("--max-queue, --default-max-tokens, --max-batch and --max-step-tokens must be positive")
    if not (math.isfinite(shutdown_grace) and shutdown_grace >= 0):
        raise BlockdraftError(f"--shutdown-grace must be a number of seconds >= 0 (got {shutdown_grace})")
    if max_body_bytes is not None and max_body_bytes < 1024:
        raise BlockdraftError(f"--max-body-bytes must be at least 1024 (got {max_body_bytes})")
    trees = GenerationConfig(tree_budget=tree_option(tree)).validate().tree_budget
    api_key = api_key or os.environ.get("BLOCKDRAFT_API_KEY") or None
    engine = load_engine(target, draft, device, dtype, draft_dtype, activations)
    check_trees(engine.target, trees)  # refused at start, not on every request
    app = create_app(engine, model_name or target, api_key, max_queue, default_max_tokens, lookup, max_batch,
                     max_step_tokens, worker_thread=False, max_body_bytes=max_body_bytes, tree_budget=trees)
    serve_in_main_thread(app, host, port, f"blockdraft serve: {model_name or target} on http://{host}:{port}/v1 "
                         f"({'API key required' if api_key else 'no API key'}; up to {max_batch} requests "
                         "decoded together)", shutdown_grace)


def _exec_vllm(target, draft, host, port, api_key, model_name, dtype, device, python) -> None:
    """Replace this process with vLLM's server (`blockdraft export --format vllm`'s command); its
    own options (batching, queue) are vLLM's. On a machine without CUDA: vLLM's CPU build's flags.
    The API key goes in vLLM's environment (VLLM_API_KEY), never in its command line, which any
    user of the machine can read (ps, /proc); the line printed shows it as ***."""
    import os
    import shutil

    from .export import peer_command

    cpu = device == "cpu" or (device is None and shutil.which("nvidia-smi") is None)
    cmd = peer_command("vllm", target, draft, None, dtype, port, model_name, python, cpu, host,
                       api_key or os.environ.get("BLOCKDRAFT_API_KEY"))
    print(f"blockdraft serve --backend vllm: {cmd.shell()}", flush=True)
    try:
        os.execvpe(cmd.argv[0], cmd.argv, {**os.environ, **cmd.environment()})
    except OSError as err:
        raise BlockdraftError(f"cannot start vLLM with {cmd.argv[0]!r} ({err}); pass --vllm-python, the python "
                              "of an environment with vLLM (make vllm-env builds .venv-vllm)") from err


def add_parsers(sub) -> None:
    g = sub.add_parser("generate", help="generate text with speculative decoding")
    g.add_argument("--target", default="smollm2-135m",
                   help="smollm2-135m (the bundled GGUF), a GGUF file, or a local HF model directory")
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
    add_coupling_arg(g)
    g.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    add_tree_arg(g)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_lookup_arg(g)
    add_dtype_args(g)
    add_activations_arg(g)
    g.add_argument("--json", dest="as_json", action="store_true", help="one JSON object per prompt per line")
    g.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when present)")
    g.set_defaults(run=cmd_generate)

    c = sub.add_parser("chat", help="interactive terminal chat (streaming, multi-turn, /reset, /exit)")
    c.add_argument("--target", default="smollm2-135m")
    c.add_argument("--draft", default=None, help="drafter directory, or 'none' (default: the bundled one)")
    c.add_argument("--max-new-tokens", type=int, default=512)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--system", default=None, help="a system message to start every conversation")
    add_tree_arg(c)
    add_lookup_arg(c)
    add_dtype_args(c)
    add_activations_arg(c)
    c.add_argument("--device", default=None)
    c.set_defaults(run=cmd_chat)

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
    add_lookup_arg(s)
    add_tree_arg(s)
    add_dtype_args(s)
    add_activations_arg(s)
    s.add_argument("--device", default=None)
    s.add_argument("--backend", choices=["blockdraft", "vllm"], default="blockdraft",
                   help="vllm: run vLLM's OpenAI server with this target and drafter instead (the command "
                        "`blockdraft export --format vllm` prints; --host, --port, --api-key, --model-name and "
                        "--dtype carry over, batching and queue options are vLLM's own)")
    s.add_argument("--vllm-python", default="python", help="with --backend vllm: the python of vLLM's environment")
    s.add_argument("--shutdown-grace", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C: stop admitting (503), finish the requests accepted for up to this "
                        "long, then cut the rest (finish_reason \"abort\") and exit 0 (default: 10)")
    s.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body, refused with 413 (default: 1 MiB, or 32 bytes per context token "
                        "where that is more)")
    s.set_defaults(run=cmd_serve)
