"""`blockdraft bench-serve`: the server under load, as its users see it.

N concurrent streaming clients (the official `openai` client) send chat requests over a prompt
set, and each level reports output tokens per second (all clients together, over the level's
wall time), time to first token (TTFT), time per output token after the first (TPOT, per
request) and the gaps between streamed chunks (ITL), at p50 and p99, at each `--temperature`
(unseeded requests, as API users send them; 1 is the OpenAI API's default). By default it starts
one `blockdraft serve` process per `--draft` and `--max-batch` setting (a process of its own, as users run it:
clients in the server's process would share its interpreter lock and slow its engine) and
drives the settings side by side at each level (`--max-batch 1,16`: one request at a time
against the continuous batch), printing each one's ratio to the first setting; `--url` drives
a running server instead. Every level is bounded by a request count and a time limit, after a
short warm-up that is not counted. The servers start once and stay up across the levels, so
their policies learn as a long-running server's do.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import BlockdraftError


@dataclass
class RequestTiming:
    ttft: float  # seconds from sending to the first text
    seconds: float  # from sending to the last chunk
    tokens: int  # completion tokens (the server's usage count)
    gaps: list[float] = field(default_factory=list)  # seconds between chunks with text

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        return (self.seconds - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class Level:
    setting: str  # "max_batch=8", or the URL
    concurrency: int
    temperature: float
    requests: int
    tokens: int
    seconds: float
    tokens_per_second: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float | None
    tpot_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    ratio: float | None = None  # tokens per second against the first setting at this concurrency


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


async def _one(client, model: str, prompt: str, max_tokens: int, temperature: float = 0.0) -> RequestTiming:
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=temperature,
        stream=True, stream_options={"include_usage": True})
    first = last = None
    gaps, tokens = [], 0
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return RequestTiming((first or end) - t0, end - t0, tokens, gaps)


async def drive(url: str, model: str, prompts: list[str], concurrency: int, requests: int, max_seconds: float,
                max_tokens: int, api_key: str | None = None, temperature: float = 0.0) -> tuple[list[RequestTiming], float]:
    """`concurrency` clients, each sending its next request as soon as its last one ended, until
    `requests` were sent or `max_seconds` passed; the timings and the wall seconds."""
    import openai

    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0,
                                timeout=max(60.0, max_seconds * 2))
    sent, timings = 0, []
    t0 = time.perf_counter()

    async def worker():
        nonlocal sent
        while sent < requests and time.perf_counter() - t0 < max_seconds:
            prompt = prompts[sent % len(prompts)]
            sent += 1
            timings.append(await _one(client, model, prompt, max_tokens, temperature))

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return timings, time.perf_counter() - t0


def summarise(setting: str, concurrency: int, timings: list[RequestTiming], seconds: float,
              temperature: float = 0.0) -> Level:
    tokens = sum(t.tokens for t in timings)
    ttft = [t.ttft for t in timings]
    tpot = [t.tpot for t in timings if t.tpot is not None]
    gaps = [g for t in timings for g in t.gaps]
    return Level(setting, concurrency, temperature, len(timings), tokens, round(seconds, 3), tokens / seconds if seconds else 0.0,
                 percentile(ttft, 50), percentile(ttft, 99), percentile(tpot, 50), percentile(tpot, 99),
                 percentile(gaps, 50), percentile(gaps, 99))


class ServerProcess:
    """`blockdraft serve` in a process of its own on a free loopback port, until the block ends."""

    def __init__(self, args: list[str], log: str | None = None):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.args = [sys.executable, "-m", "blockdraft.cli", "serve", "--port", str(port), *args]
        self.log = log

    def __enter__(self):
        import httpx

        self.out = open(self.log, "w") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.args, stdout=self.out, stderr=subprocess.STDOUT,
                                     env={**os.environ, "BLOCKDRAFT_API_KEY": ""})
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                raise BlockdraftError(f"the server exited ({' '.join(self.args[3:])})"
                                      + (f"; its log: {self.log}" if self.log else ""))
            if time.time() > deadline:
                self.__exit__()
                raise BlockdraftError("the server did not come up within 300 s")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.5)

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.log:
            self.out.close()


def run_levels(servers: list[tuple[str, str]], prompts: list[str], concurrency: list[int], requests: int | None,
               max_seconds: float, max_tokens: int, model: str, api_key: str | None = None, log=print,
               temperatures: tuple[float, ...] = (0.0,)) -> list[Level]:
    """Every concurrency level at every temperature over every server, side by side: `servers`
    are (setting, URL)."""
    levels = []
    for t in temperatures:
        for c in concurrency:
            n = requests or max(4, 2 * c)
            first = None
            for setting, url in servers:
                # warm-up, not counted: one short request per client (a batch size's first steps measure its cost)
                asyncio.run(drive(url, model, prompts, c, c, max_seconds, min(16, max_tokens), api_key, t))
                timings, seconds = asyncio.run(drive(url, model, prompts, c, n, max_seconds, max_tokens, api_key, t))
                level = summarise(setting, c, timings, seconds, t)
                first = first or level
                level.ratio = level.tokens_per_second / first.tokens_per_second if first.tokens_per_second else None
                levels.append(level)
                log(format_row(level))
    return levels


HEADER = (f"{'setting':<26} {'temp':>4} {'conc':>4} {'reqs':>4} {'tokens':>6} {'tok/s':>7} {'ratio':>6} "
          f"{'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7}")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}ms"


def format_row(v: Level) -> str:
    ratio = "-" if v.ratio is None else f"{v.ratio:.2f}x"
    return (f"{v.setting[:26]:<26} {v.temperature:>4} {v.concurrency:>4} {v.requests:>4} {v.tokens:>6} {v.tokens_per_second:>7.1f} "
            f"{ratio:>6} {_ms(v.ttft_p50):>9} {_ms(v.ttft_p99):>7} {_ms(v.tpot_p50):>9} {_ms(v.tpot_p99):>7} "
            f"{_ms(v.itl_p50):>8} {_ms(v.itl_p99):>7}")


def plot_levels(levels: list[Level], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for setting, t in dict.fromkeys((v.setting, v.temperature) for v in levels):
        mine = [v for v in levels if (v.setting, v.temperature) == (setting, t)]
        setting = setting if len({v.temperature for v in levels}) == 1 else f"{setting}, T={t}"
        x = [v.concurrency for v in mine]
        axes[0].plot(x, [v.tokens_per_second for v in mine], "o-", label=setting)
        axes[1].plot(x, [1000 * v.ttft_p50 for v in mine], "o-", label=setting)
        axes[2].plot(x, [1000 * (v.tpot_p50 or 0) for v in mine], "o-", label=setting)
    for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (ms)", "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise BlockdraftError(f"{what} must be comma-separated numbers (got {text!r})") from None
    if not values or min(values) < 0 or max(values) > 2:
        raise BlockdraftError(f"{what} must be in [0, 2] (got {text!r})")
    return values


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BlockdraftError(f"{what} must be comma-separated integers (got {text!r})") from None
    if not values or min(values) < 1:
        raise BlockdraftError(f"{what} must be positive integers (got {text!r})")
    return values


def cmd_bench_serve(target: str, draft: str | None, url: str | None, model_name: str | None, api_key: str | None,
                    dataset: str, limit: int | None, concurrency: str, max_batch: str, requests: int | None,
                    max_seconds: float, max_new_tokens: int, as_json: str | None, plot: str | None,
                    device: str | None, dtype: str = "auto", draft_dtype: str = "auto", temperature: str = "0") -> None:
    from .datasets import load_prompts

    levels_c, batches = _ints(concurrency, "--concurrency"), _ints(max_batch, "--max-batch")
    temperatures = _floats(temperature, "--temperature")
    # None: the bundled drafter (named 'bundled' in a list)
    drafts = [None if d.strip() == "bundled" else d.strip() for d in draft.split(",")] if draft else [None]
    if max_new_tokens < 1 or max_seconds <= 0 or (requests is not None and requests < 1):
        raise BlockdraftError("--max-new-tokens, --max-seconds and --requests must be positive")
    prompts = load_prompts(dataset, limit)
    model = model_name or (target if url is None else "blockdraft")
    print(HEADER, flush=True)

    def run(servers, key):
        return run_levels(servers, prompts, levels_c, requests, max_seconds, max_new_tokens, model, key,
                          log=lambda row: print(row, flush=True), temperatures=temperatures)

    if url is not None:
        levels = run([(url, url)], api_key)
    else:
        common = ["--target", target, "--model-name", model, "--default-max-tokens", str(max_new_tokens),
                  "--max-queue", str(max(64, 2 * max(levels_c))), "--dtype", dtype, "--draft-dtype", draft_dtype]
        common += ["--device", device] if device else []
        with ExitStack() as stack:
            servers = []
            for d in drafts:
                for mb in batches:
                    name = f"max_batch={mb}" if len(drafts) == 1 else f"draft={d or 'bundled'},max_batch={mb}"
                    log = f"{as_json}.serve{mb}{'' if d is None else '-' + Path(d).name}.log" if as_json else None
                    args = common + (["--draft", d] if d else []) + ["--max-batch", str(mb)]
                    servers.append((name, stack.enter_context(ServerProcess(args, log)).url))
            levels = run(servers, None)
    if as_json:
        Path(as_json).write_text(json.dumps({"dataset": dataset, "max_new_tokens": max_new_tokens,
                                             "levels": [asdict(v) for v in levels]}, indent=1) + "\n")
    if plot:
        plot_levels(levels, plot)


def add_parser(sub):
    b = sub.add_parser("bench-serve", help="drive the server with concurrent streaming clients: tokens/s, "
                       "TTFT, TPOT and ITL per concurrency level")
    b.add_argument("--target", default="smollm2-135m")
    b.add_argument("--draft", default=None, help="drafter directory, or 'none' (default: the bundled one); "
                   "comma-separated: servers side by side ('bundled' names the default: bundled,none)")
    b.add_argument("--temperature", default="0", help="request temperatures, comma-separated (0,1: greedy "
                   "beside the OpenAI API's default; unseeded requests)")
    b.add_argument("--url", default=None, help="drive a running server instead of starting one")
    b.add_argument("--model-name", default=None, help="the model id to ask for (default: --target)")
    b.add_argument("--api-key", default=None, help="with --url: the server's key")
    b.add_argument("--dataset", default="mt-bench", help="humaneval, mt-bench or a JSONL of {\"prompt\": ...}")
    b.add_argument("--limit", type=int, default=None)
    b.add_argument("--concurrency", default="1,2,4,8,16", help="client counts, comma-separated")
    b.add_argument("--max-batch", default="1,16", help="server settings run side by side, comma-separated")
    b.add_argument("--requests", type=int, default=None, help="per level (default: twice the concurrency, >= 4)")
    b.add_argument("--max-seconds", type=float, default=300.0, help="per level: stop sending after this")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--json", dest="as_json", default=None, metavar="FILE")
    b.add_argument("--plot", default=None, metavar="PNG")
    b.add_argument("--device", default=None)
    return b
