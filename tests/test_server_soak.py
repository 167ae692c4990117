"""A soak test: `blockdraft serve` in a process of its own on a tiny random target, 32 concurrent
clients for a minute of mixed load (streams and whole replies, chat and text, stop strings,
clients that leave mid-stream or before their first byte, malformed and refused requests, metric
and health probes). Every good request gets exactly the text it gets alone (greedy), the server's
memory stays flat from the first third of the load to the last, and the server stays up."""

import asyncio
import random
import statistics
import threading
import time
from dataclasses import dataclass

import httpx
import psutil
import pytest

from test_server_support import (MODEL, ServerProcess, free_port, metric, read_sse, serve_command,
                                 tiny_dir, wait_for)  # noqa: F401  (tiny_dir: a fixture)

pytestmark = pytest.mark.slow
CLIENTS = 32
WARMUP_SECONDS = 10  # the same load, not measured: allocators, policies per batch size and caches settle
LOAD_SECONDS = 60
MAX_RSS_GROWTH = 16 * 2**20  # bytes, median of the last third of the load over the first third
BODY_LIMIT = 64 * 1024
PROMPTS = ["Tell me a story.", "What is the capital of France?", "List three colors.", "Write a haiku about rain.",
           "Say hello in Spanish.", "Explain recursion briefly.", "Name a prime number.", "Describe the sea."]


@dataclass
class Case:
    """A good request and what it gets alone."""

    chat: bool
    body: dict
    text: str = ""
    finish_reason: str = ""

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


def catalogue() -> list[Case]:
    cases = []
    for i, prompt in enumerate(PROMPTS):
        for chat in (True, False):
            body = {"model": MODEL, "max_tokens": 12 + 9 * i, "temperature": 0}
            body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
            cases.append(Case(chat, body))
    return cases


def answer_alone(url: str, case: Case) -> Case:
    r = httpx.post(url + case.path, json=case.body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    case.text = choice["message"]["content"] if case.chat else choice["text"]
    case.finish_reason = choice["finish_reason"]
    return case


def with_stops(url: str, cases: list[Case]) -> list[Case]:
    """For each case a variant that stops at a piece of its own text (so the stop is hit)."""
    out = []
    for case in cases:
        words = case.text.split()
        if len(words) > 4:
            out.append(answer_alone(url, Case(case.chat, {**case.body, "stop": [words[len(words) // 2][:8]]})))
    return out


BAD = [  # (method, path, body or raw bytes, expected status)
    ("POST", "/v1/chat/completions", b"{not json", 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 3, "best_of": 2}, 400),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "temperature": 5}, 400),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["s" * 40]}, 400),
    ("POST", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x" * (BODY_LIMIT + 10)}, 413),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "word " * 3000}, 400),  # beyond the context
    ("GET", '/v1/x"y{z}', None, 404),
    ("GET", "/v1/chat/completions", None, 405),
]


class Load:
    def __init__(self, url: str, cases: list[Case], seed: int):
        self.url, self.cases, self.rng = url, cases, random.Random(seed)
        self.problems: list[str] = []
        self.counts = {"good": 0, "stream": 0, "left": 0, "bad": 0, "probe": 0}

    async def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        limits = httpx.Limits(max_connections=2 * CLIENTS)
        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits) as client:
            await asyncio.gather(*(self.client(client, deadline) for _ in range(CLIENTS)))

    async def client(self, client: httpx.AsyncClient, deadline: float) -> None:
        while time.monotonic() < deadline:
            roll = self.rng.random()
            try:
                if roll < 0.3:
                    await self.good(client, self.rng.choice(self.cases))
                elif roll < 0.6:
                    await self.good_stream(client, self.rng.choice(self.cases))
                elif roll < 0.75:
                    await self.leave(client, self.rng.choice(self.cases), mid_stream=self.rng.random() < 0.5)
                elif roll < 0.95:
                    await self.bad(client, self.rng.choice(BAD))
                else:
                    await self.probe(client)
            except Exception as err:  # any transport error is a finding too
                self.problems.append(f"{type(err).__name__}: {err}")

    async def good(self, client, case: Case) -> None:
        r = await client.post(case.path, json=case.body)
        choice = r.json()["choices"][0] if r.status_code == 200 else {}
        text = choice.get("message", {}).get("content") if case.chat else choice.get("text")
        if (r.status_code, text, choice.get("finish_reason")) != (200, case.text, case.finish_reason):
            self.problems.append(f"{case.body}: {r.status_code} {r.text[:200]!r}, alone {case.text!r}")
        self.counts["good"] += 1

    async def good_stream(self, client, case: Case) -> None:
        async with client.stream("POST", case.path, json={**case.body, "stream": True}) as r:
            lines = [line async for line in r.aiter_lines()]
        got = read_sse(lines, case.chat)
        if (r.status_code, got.done, got.text, got.finish_reason) != (200, True, case.text, case.finish_reason):
            self.problems.append(f"stream {case.body}: {r.status_code} {got}, alone {case.text!r}")
        self.counts["stream"] += 1

    async def leave(self, client, case: Case, mid_stream: bool) -> None:
        body = {**case.body, "max_tokens": 600, "stop": []}
        if mid_stream:
            async with client.stream("POST", case.path, json={**body, "stream": True}) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        break
        else:  # before its first byte
            try:
                await client.post(case.path, json=body, timeout=httpx.Timeout(120, read=0.05))
            except httpx.ReadTimeout:
                pass
        self.counts["left"] += 1

    async def bad(self, client, bad) -> None:
        method, path, body, status = bad
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
            ({"json": body} if body is not None else {})
        r = await client.request(method, path, **kw)
        if r.status_code != status or "error" not in r.json():
            self.problems.append(f"{method} {path}: {r.status_code} {r.text[:200]!r}, wanted {status}")
        self.counts["bad"] += 1

    async def probe(self, client) -> None:
        health = await client.get("/health")
        metrics = await client.get("/metrics")
        if health.status_code != 200 or metrics.status_code != 200:
            self.problems.append(f"probe: /health {health.status_code}, /metrics {metrics.status_code}")
        self.counts["probe"] += 1


class RssSampler(threading.Thread):
    """The server process's resident memory, every half second."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.process, self.samples, self.stop = psutil.Process(pid), [], threading.Event()

    def run(self):
        while not self.stop.wait(0.5):
            self.samples.append(self.process.memory_info().rss)


def test_32_clients_for_a_minute_of_mixed_load(tiny_dir):
    port = free_port()
    args = ("--max-batch", "16", "--max-queue", "64", "--max-body-bytes", str(BODY_LIMIT))
    with ServerProcess(serve_command(tiny_dir, port, *args), port) as srv:
        cases = [answer_alone(srv.url, c) for c in catalogue()]
        cases += with_stops(srv.url, cases)
        assert len(cases) >= 20 and any(c.body.get("stop") and c.finish_reason == "stop" for c in cases)

        warmup = Load(srv.url, cases, seed=1)
        asyncio.run(warmup.run(WARMUP_SECONDS))
        sampler = RssSampler(srv.proc.pid)
        sampler.start()
        load = Load(srv.url, cases, seed=2)
        began = time.monotonic()
        asyncio.run(load.run(LOAD_SECONDS))
        loaded = time.monotonic() - began
        sampler.stop.set()
        sampler.join()

        assert not warmup.problems + load.problems, (warmup.problems + load.problems)[:10]
        assert load.counts["good"] + load.counts["stream"] >= 100 and min(load.counts.values()) >= 10, load.counts
        assert loaded < LOAD_SECONDS + 60  # no client hung
        wait_for(lambda: (lambda h: h["running"] + h["queue_depth"] == 0)(httpx.get(srv.url + "/health").json()),
                 timeout=30, what="the engine to empty")
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "ok" and srv.proc.poll() is None
        text = httpx.get(srv.url + "/metrics").text
        assert metric(text, "blockdraft_failed_total") == 0 and metric(text, "blockdraft_cancelled_total") > 0
        third = len(sampler.samples) // 3
        first, last = statistics.median(sampler.samples[:third]), statistics.median(sampler.samples[-third:])
        assert last - first < MAX_RSS_GROWTH, f"RSS grew from {first / 2**20:.0f} to {last / 2**20:.0f} MiB"
        assert "Traceback" not in srv.output()
