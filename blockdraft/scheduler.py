"""One engine, many clients: a FIFO queue in front of a single engine worker thread.

The engine decodes one request at a time (its caches are per request), so requests never
interfere: each waits its turn in arrival order, then runs alone to the end. A request whose
client has gone is dropped from the queue at once, or stopped after the current step if it is
running. The worker reports to the asyncio side through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from .decoding import Engine, GenerationConfig, GenerationStats, TextStream


@dataclass
class Completion:
    text: str
    finish_reason: str  # "stop" or "length" (or "cancelled" when the client left)
    prompt_tokens: int
    completion_tokens: int
    stats: GenerationStats

    def extra(self) -> dict:
        """The speculative statistics, for the response's `blockdraft` field."""
        st = self.stats
        decode_tps = (self.completion_tokens - 1) / st.decode_seconds if st.decode_seconds > 0 else None
        return {"tau": round(st.tau, 4), "acceptance_lengths": st.acceptance_lengths,
                "drafted": st.drafted, "accepted": st.accepted,
                "prefill_seconds": round(st.prefill_seconds, 4), "decode_seconds": round(st.decode_seconds, 4),
                "decode_tokens_per_second": round(decode_tps, 2) if decode_tps is not None else None}


@dataclass
class Job:
    prompt_ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    # ("delta", str) as text becomes final, then ("done", Completion) or ("error", str)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def report(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancelled.set()


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int = 64):
        self.engine = engine
        self.max_queue = max_queue
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self.running: Job | None = None
        self.cancelled_total = 0
        self._thread = threading.Thread(target=self._work, name="blockdraft-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for job in self._queue:
                job.cancelled.set()
            self._queue.clear()
            if self.running is not None:
                self.running.cancelled.set()
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def depth(self) -> int:
        """Requests waiting, not counting the one running."""
        return len(self._queue)

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full (the caller answers 429)."""
        with self._cv:
            if self._closed or len(self._queue) >= self.max_queue:
                return False
            self._queue.append(job)
            self._cv.notify()
            return True

    def cancel(self, job: Job) -> None:
        """The client left: free its place now, or stop it after the current step."""
        with self._cv:
            if job.cancelled.is_set():
                return
            job.cancelled.set()
            self.cancelled_total += 1
            if job in self._queue:
                self._queue.remove(job)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                self.running = job
            try:
                self._run(job)
            except Exception as err:  # a failure ends this request, never the worker
                job.report("error", f"{type(err).__name__}: {err}")
            finally:
                with self._cv:
                    self.running = None

    def _run(self, job: Job) -> None:
        stats = GenerationStats()
        text = TextStream(self.engine.target.tokenizer, job.config.stop_strings)
        steps = self.engine.stream(job.prompt_ids, job.config, stats)
        for step in steps:
            if job.cancelled.is_set():
                steps.close()
                return
            delta = text.push(step.tokens)
            if delta:
                job.report("delta", delta)
        rest = text.finish()
        if rest:
            job.report("delta", rest)
        job.report("done", Completion(text.text, stats.finish_reason or "length", len(job.prompt_ids),
                                      len(text.tokens), stats))
