"""One engine, many clients: a FIFO queue in front of one engine worker thread that decodes a
continuous batch (decoding.Batch).

Between two steps the worker admits waiting requests, in arrival order, up to `max_batch`
sequences (a target whose cache is not slots of plain attention decodes one at a time); each
admitted request is prefilled alone, then joins the next step. A request leaves the batch when it
stops, or after the current step when its client has gone (a waiting one is dropped from the
queue at once). A step that fails ends the requests in it with an error, never the worker. The
worker reports to the asyncio side through `loop.call_soon_threadsafe`; the step histograms are
read by /metrics under a lock.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..decoding.engine import Engine, GenerationConfig, GenerationStats, Sequence, TextStream
from .metrics import BATCH_BUCKETS, STEP_TOKEN_BUCKETS, Histogram


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


@dataclass
class _Active:
    """A request in the batch: its job, its decoding state and the text streamed so far."""

    job: Job
    seq: Sequence
    text: TextStream


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int = 64, max_batch: int = 16, max_step_tokens: int | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self.active: list[_Active] = []
        self.cancelled_total = 0
        self.lock = threading.Lock()  # the step histograms, written here and read by /metrics
        self.batch_sizes = Histogram("blockdraft_batch_size", "Sequences in each decode step.", BATCH_BUCKETS)
        self.step_tokens = Histogram("blockdraft_step_tokens", "Tokens the target verified per decode step, "
                                     "all sequences together.", STEP_TOKEN_BUCKETS)
        self._thread = threading.Thread(target=self.run, name="blockdraft-engine", daemon=True)

    def start(self) -> None:
        """Run the engine worker in a thread of its own (see `run` for the faster alternative)."""
        self._thread.start()

    def close(self) -> None:
        self.close_soon()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def close_soon(self) -> None:
        """Stop the worker after its current step (and every request with it), without waiting."""
        with self._cv:
            self._closed = True
            for job in self._queue:
                job.cancelled.set()
            self._queue.clear()
            for a in self.active:
                a.job.cancelled.set()
            self._cv.notify_all()

    @property
    def depth(self) -> int:
        """Requests waiting, not counting those being decoded."""
        return len(self._queue)

    @property
    def running(self) -> int:
        """Requests being decoded (the batch)."""
        return len(self.active)

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full (the caller answers 429)."""
        with self._cv:
            if self._closed or len(self._queue) >= self.max_queue:
                return False
            self._queue.append(job)
            self._cv.notify()
            return True

    def cancel(self, job: Job) -> None:
        """The client left: free its place now, or take it out of the batch after the current step."""
        with self._cv:
            if job.cancelled.is_set():
                return
            job.cancelled.set()
            self.cancelled_total += 1
            if job in self._queue:
                self._queue.remove(job)

    def run(self) -> None:
        """The engine worker, in the calling thread, until `close`. `blockdraft serve` runs it in
        the main thread: CPU kernels there run up to 2x faster than in a thread started later
        (OpenMP's thread pool waits differently for a thread that is not the initial one;
        measured in docs/serving.md)."""
        batch = self.engine.batch(self.max_step_tokens)
        cap = min(self.max_batch, batch.capacity or self.max_batch)
        while True:
            with self._cv:
                while not self._queue and not self.active and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                admitted = []
                while self._queue and len(self.active) + len(admitted) < cap:
                    admitted.append(self._queue.popleft())
            for job in admitted:
                self._admit(batch, job)
            for a in [a for a in self.active if a.job.cancelled.is_set()]:
                self._drop(batch, a)
            if not batch.sequences:
                continue
            try:
                steps = batch.step()
            except Exception as err:  # a failure ends the requests in this step, never the worker
                for a in list(self.active):
                    a.job.report("error", f"{type(err).__name__}: {err}")
                    self._drop(batch, a)
                batch = self.engine.batch(self.max_step_tokens)
                continue
            with self.lock:
                self.batch_sizes.observe(len(steps))
                self.step_tokens.observe(sum(1 + st.num_drafted for _, st in steps))
            by_seq = {id(a.seq): a for a in self.active}
            for seq, step in steps:
                self._deliver(batch, by_seq[id(seq)], step.tokens)

    def _admit(self, batch, job: Job) -> None:
        """Prefill a request and add it to the batch (or finish it, if its first token ends it)."""
        try:
            seq, first = batch.join(job.prompt_ids, job.config, GenerationStats())
        except Exception as err:  # only this request fails (the server checked it already)
            job.report("error", f"{type(err).__name__}: {err}")
            return
        a = _Active(job, seq, TextStream(self.engine.target.tokenizer, job.config.stop_strings))
        with self._cv:
            self.active.append(a)
        self._deliver(batch, a, first.tokens)

    def _deliver(self, batch, a: _Active, tokens: list[int]) -> None:
        delta = a.text.push(tokens)
        if delta:
            a.job.report("delta", delta)
        if not a.seq.done:
            return
        rest = a.text.finish()
        if rest:
            a.job.report("delta", rest)
        stats = a.seq.stats
        a.job.report("done", Completion(a.text.text, stats.finish_reason or "length", len(a.job.prompt_ids),
                                        len(a.text.tokens), stats))
        self._drop(batch, a)

    def _drop(self, batch, a: _Active) -> None:
        if a.seq in batch.sequences:
            batch.leave(a.seq)
        with self._cv:
            self.active.remove(a)
