"""One engine, many clients: a FIFO queue in front of one engine worker that decodes a continuous
batch (decoding.Batch).

Between two steps the worker admits waiting requests, in arrival order, up to `max_batch`
sequences (a target whose cache is not slots of plain attention decodes one at a time); each
admitted request is prefilled alone, then joins the next step. A request leaves the batch when it
stops, or after the current step when its client has gone (a waiting one leaves the queue at once).
The worker reports to the asyncio side through `loop.call_soon_threadsafe`.

Failures stay with the request that caused them. An exception while admitting or delivering a
request fails that request only. A failed step may leave its batch half-updated, so the batch is
rebuilt from what each request has been given (`_rebuild`): each request first steps alone, the
one whose lone step fails too ends with an error, the others go on together. An exception anywhere
else ends the worker: every request gets an error, `failure` says why (/health answers 503 with
it), and the exception propagates (in `blockdraft serve` the process exits non-zero).

Lifecycle: `drain(grace)` (SIGTERM) stops admitting new requests; the worker decodes what it has
(waiting requests included) and, at the deadline, cuts what is left: each gets its text so far
with finish_reason "abort". `close()` cuts everything at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from enum import Enum

from ..decoding.engine import Engine, GenerationConfig, GenerationStats, Sequence, TextStream, cut_at_stop_string
from .metrics import Metrics

log = logging.getLogger("blockdraft.serving")
ABORT = "abort"  # the finish_reason of a request cut at shutdown (vLLM's word for it)
POLL_SECONDS = 0.1  # how often an idle worker looks at a drain's deadline (set by a signal handler)


class Admission(Enum):
    QUEUED = "queued"
    FULL = "full"  # the queue is full: 429, retry later
    SHUTTING_DOWN = "shutting_down"  # draining or closed: 503
    FAILED = "failed"  # the worker died: 503


@dataclass
class Health:
    ok: bool
    status: str  # "ok", "draining", "stopped" or "error"
    reason: str | None = None


@dataclass
class Completion:
    text: str
    finish_reason: str  # "stop", "length", or "abort" (cut at shutdown)
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


@dataclass(eq=False)  # compared by identity: a job is in the queue or not
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


@dataclass(eq=False)
class _Active:
    """A request in the batch: its job, its decoding state and the text streamed so far."""

    job: Job
    seq: Sequence
    text: TextStream
    rejoined: bool = False  # decoding again after a failed step (see _rejoin)


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int = 64, max_batch: int = 16, max_step_tokens: int | None = None,
                 metrics: Metrics | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.metrics = metrics or Metrics()
        self.metrics.watch(lambda: self.depth, lambda: self.running)
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self.active: list[_Active] = []
        self._closed = False  # close(): cut everything now
        self._deadline: float | None = None  # drain(): admit no more; cut what is left at this time
        self._working = False  # a worker is in `run`
        self._broken = False  # a batch operation failed outside a step: rebuild before the next step
        self.failure: str | None = None  # why the worker died
        self._thread = threading.Thread(target=self.run, name="blockdraft-engine", daemon=True)

    # --- the HTTP side -------------------------------------------------------------------------

    def start(self) -> None:
        """Run the engine worker in a thread of its own (see `run` for the faster alternative)."""
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting, not counting those being decoded."""
        return len(self._queue)

    @property
    def running(self) -> int:
        """Requests being decoded (the batch)."""
        return len(self.active)

    @property
    def accepting(self) -> bool:
        return self.failure is None and not self._closed and self._deadline is None

    def health(self) -> Health:
        if self.failure is not None:
            return Health(False, "error", f"the engine worker died: {self.failure}")
        if self._thread.ident is not None and not self._thread.is_alive() and self.accepting:
            return Health(False, "error", "the engine worker thread has exited")
        if self._closed or (self._deadline is not None and not self._working):
            return Health(False, "stopped", "the server is shutting down")
        if self._deadline is not None:
            return Health(False, "draining", "the server is shutting down: finishing the requests it has")
        return Health(True, "ok")

    def submit(self, job: Job) -> Admission:
        with self._cv:
            if self.failure is not None:
                return Admission.FAILED
            if not self.accepting:
                return Admission.SHUTTING_DOWN
            if len(self._queue) >= self.max_queue:
                return Admission.FULL
            self._queue.append(job)
            self._cv.notify()
            return Admission.QUEUED

    def cancel(self, job: Job) -> None:
        """The client left: free its place now, or take it out of the batch after the current step."""
        with self._cv:
            if job.cancelled.is_set():
                return
            job.cancelled.set()
            self.metrics.cancelled.inc()
            if job in self._queue:
                self._queue.remove(job)

    def drain(self, grace: float) -> None:
        """Admit no new request; finish those accepted, and cut what is left after `grace` seconds.
        Safe in a signal handler: it takes no lock (the worker looks at the deadline between steps,
        and at least every POLL_SECONDS while idle). A second call can only bring the deadline closer."""
        deadline = time.monotonic() + max(grace, 0.0)
        self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)

    def close(self) -> None:
        """Cut every request now and stop the worker (waiting for its current step)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        if not self._working:  # no worker will cut them
            with self._cv:
                self._cut_everything()

    # --- the engine worker ---------------------------------------------------------------------

    def run(self) -> None:
        """The engine worker, in the calling thread, until it is closed or drained. `blockdraft serve`
        runs it in the main thread: CPU kernels there run up to 2x faster than in a thread started
        later (OpenMP's thread pool waits differently for a thread that is not the initial one;
        measured in docs/serving.md)."""
        self._working = True
        try:
            self._work()
        except BaseException as err:
            self.failure = f"{type(err).__name__}: {err}"
            log.exception("the engine worker died")
            with self._cv:
                for job in [*self._queue, *(a.job for a in self.active)]:
                    job.report("error", f"the engine worker died ({self.failure})")
                self._queue.clear()
                self.active.clear()
            raise
        finally:
            self._working = False

    def _work(self) -> None:
        batch = self._new_batch()
        cap = min(self.max_batch, batch.capacity or self.max_batch)
        while True:
            admitted = self._next_admissions(cap)
            if admitted is None:
                return
            for job in admitted:
                self._admit(batch, job)
            for a in [a for a in self.active if a.job.cancelled.is_set()]:
                self._drop(batch, a)
            if self._broken:
                batch = self._rebuild()
            if not batch.sequences:
                continue
            try:
                steps = batch.step()
            except Exception:
                log.exception("a decode step of %d sequences failed; finding the request that caused it",
                              len(batch.sequences))
                batch = self._rebuild()
                continue
            self.metrics.step(len(steps), sum(1 + st.num_drafted for _, st in steps))
            by_seq = {id(a.seq): a for a in self.active}
            for seq, step in steps:
                self._deliver_or_fail(batch, by_seq[id(seq)], step.tokens)

    def _next_admissions(self, cap: int) -> list[Job] | None:
        """The jobs to admit before the next step (waiting for work while there is none), or None
        when the worker should stop: closed, past a drain's deadline (what is left is cut), or
        drained (nothing left)."""
        with self._cv:
            while True:
                if self._closed or (self._deadline is not None and time.monotonic() >= self._deadline):
                    self._cut_everything()
                    return None
                if self._queue or self.active:
                    break
                if self._deadline is not None:
                    return None  # drained: every accepted request has its answer
                self._cv.wait(timeout=POLL_SECONDS)
            admitted = []
            while self._queue and len(self.active) + len(admitted) < cap:
                admitted.append(self._queue.popleft())
            return admitted

    def _cut_everything(self) -> None:
        """End every request now with its text so far and finish_reason "abort" (under the lock)."""
        for job in self._queue:
            job.report("done", Completion("", ABORT, len(job.prompt_ids), 0, GenerationStats()))
        self._queue.clear()
        for a in self.active:
            try:
                rest = a.text.finish()
                if rest:
                    a.job.report("delta", rest)
                a.job.report("done", Completion(a.text.text, ABORT, len(a.job.prompt_ids), len(a.text.tokens),
                                                a.seq.stats))
            except Exception as err:  # its text could not be decoded: it ends all the same
                a.job.report("error", f"{type(err).__name__}: {err}")
        self.active.clear()

    def _new_batch(self):
        return self.engine.batch(self.max_step_tokens)

    def _admit(self, batch, job: Job) -> None:
        """Prefill a request and add it to the batch (or finish it, if its first token ends it)."""
        try:
            text = TextStream(self.engine.target.tokenizer, job.config.stop_strings)
            seq, first = batch.join(job.prompt_ids, job.config, GenerationStats())
        except Exception as err:  # only this request fails (the server checked it already)
            log.exception("a request failed to join the batch")
            self.metrics.failed.inc()
            job.report("error", f"{type(err).__name__}: {err}")
            return
        a = _Active(job, seq, text)
        with self._cv:
            self.active.append(a)
        self._deliver_or_fail(batch, a, first.tokens)

    def _deliver_or_fail(self, batch, a: _Active, tokens: list[int]) -> None:
        try:
            self._deliver(batch, a, tokens)
        except Exception as err:
            self._fail(batch, a, err)

    def _deliver(self, batch, a: _Active, tokens: list[int]) -> None:
        """Stream a step's tokens as text; at the request's end, its completion."""
        delta = a.text.push(tokens)
        if delta:
            a.job.report("delta", delta)
        reason = a.seq.stats.finish_reason if a.seq.done else None
        if reason is None and a.rejoined and a.text.stop_strings:
            # after a rejoin the engine looks for stop strings in the new tokens only: one that
            # straddles the rejoin is found here, in the whole text
            full = self.engine.target.tokenizer.decode(a.text.tokens, skip_special_tokens=True)
            reason = "stop" if cut_at_stop_string(full, a.text.stop_strings) != full else None
        if reason is None:
            return
        rest = a.text.finish()
        if rest:
            a.job.report("delta", rest)
        a.job.report("done", Completion(a.text.text, reason, len(a.job.prompt_ids), len(a.text.tokens),
                                        a.seq.stats))
        self._drop(batch, a)

    def _fail(self, batch, a: _Active, err: Exception) -> None:
        log.error("a request failed: %s: %s", type(err).__name__, err, exc_info=err)
        self.metrics.failed.inc()
        a.job.report("error", f"{type(err).__name__}: {err}")
        self._drop(batch, a)

    def _drop(self, batch, a: _Active) -> None:
        with self._cv:
            if a in self.active:
                self.active.remove(a)
        if any(s is a.seq for s in batch.sequences):
            try:
                batch.leave(a.seq)
            except Exception:
                log.exception("a sequence could not leave the batch; rebuilding the batch")
                self._broken = True

    def _rebuild(self):
        """A new batch for the requests of one that failed (a step raised, or a sequence could not
        leave): its cache and sequences may be half-updated, so each request joins again with what
        it has been given (`_rejoin`). Each first takes one step alone: a request whose lone step
        fails too caused the failure and ends with an error; the others go on together. (A failure
        that only a batch shows costs its requests a re-prefill each, and they still progress: each
        lone step commits at least one token.)"""
        self._broken = False
        survivors = []
        for a in list(self.active):
            if a.job.cancelled.is_set():  # its client has gone: nothing to rebuild
                with self._cv:
                    self.active.remove(a)
                continue
            alone = self._new_batch()
            try:
                self._rejoin(alone, a)
                if a in self.active:  # its first token did not end it
                    for _, step in alone.step():
                        self._deliver(alone, a, step.tokens)
            except Exception as err:
                self._fail(alone, a, err)
                continue
            if a in self.active:
                survivors.append(a)
        batch = self._new_batch()
        for a in survivors:
            try:
                self._rejoin(batch, a)
            except Exception as err:
                self._fail(batch, a, err)
        return batch

    def _rejoin(self, batch, a: _Active) -> None:
        """Join `batch` again, the prompt followed by the tokens generated so far (greedy text is
        unchanged: the target's next token depends only on the tokens before it; a sampled request
        keeps its random generator's state)."""
        generated = list(a.text.tokens)
        config = replace(a.job.config, max_new_tokens=a.job.config.max_new_tokens - len(generated))
        if a.seq.choose.noise is not None:  # Gumbel-coupled: the same seed's noise at the same positions
            config = replace(config, sampling=replace(config.sampling, seed=a.seq.choose.noise.seed))
        seq, first = batch.join(a.job.prompt_ids + generated, config, a.seq.stats)
        if a.seq.gen is not None and seq.gen is not None:
            seq.gen.set_state(a.seq.gen.get_state())
        a.seq, a.rejoined = seq, True
        self._deliver(batch, a, first.tokens)
