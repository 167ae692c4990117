"""What a client receives for a completion: OpenAI's response and chunk objects, a reply awaited
whole or streamed as server-sent events. Either way the request is given up as soon as its client
disconnects, before its first byte too, so a client that leaves frees its place in the batch."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from fastapi import Request

from .api import ApiError
from .metrics import Metrics
from .scheduler import Completion, Job, Scheduler

DISCONNECT_POLL_SECONDS = 0.25


def usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens}


@dataclass
class ChunkShape:
    """OpenAI's response and chunk objects for one request, chat or text completion."""

    rid: str
    model: str
    chat: bool

    def base(self, kind: str) -> dict:
        return {"id": self.rid, "object": kind, "created": int(time.time()), "model": self.model}

    def final(self, c: Completion) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                      "finish_reason": c.finish_reason}
        else:
            choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
        return {**self.base("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(c), "blockdraft": c.extra()}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self.base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self.base("text_completion"), "choices": [choice]}


class ClientGone(Exception):
    pass


class Events:
    """A job's events as its client waits for them, watching the connection meanwhile: at least
    every DISCONNECT_POLL_SECONDS, also while events keep coming."""

    def __init__(self, job: Job, request: Request):
        self.job, self.request = job, request
        self.checked = time.monotonic()

    async def next(self) -> tuple[str, object]:
        while True:
            try:
                event = await asyncio.wait_for(self.job.events.get(), timeout=DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                event = None
            if time.monotonic() - self.checked >= DISCONNECT_POLL_SECONDS:
                self.checked = time.monotonic()
                if await self.request.is_disconnected():
                    raise ClientGone
            if event is not None:
                return event


def _record(metrics: Metrics, job: Job, c: Completion) -> None:
    metrics.completed(c.prompt_tokens, c.completion_tokens, c.stats.tau, time.perf_counter() - job.submitted)


async def reply(job: Job, request: Request, shape: ChunkShape, scheduler: Scheduler, metrics: Metrics) -> dict:
    """The whole response, once the job is done; gives the job up if the client disconnects first."""
    events, done = Events(job, request), False
    try:
        while True:
            try:
                kind, payload = await events.next()
            except ClientGone:
                raise ApiError(499, "client closed the request") from None
            if kind == "done":
                done = True
                _record(metrics, job, payload)
                return shape.final(payload)
            if kind == "error":
                done = True
                raise ApiError(500, f"generation failed: {payload}", kind="server_error")
    finally:
        if not done:  # disconnected, or this task was cancelled
            scheduler.cancel(job)


async def stream(job: Job, request: Request, shape: ChunkShape, include_usage: bool, scheduler: Scheduler,
                 metrics: Metrics):
    """Server-sent events: the text as it becomes final, then a last chunk with the finish_reason and
    usage, then `[DONE]`; a failure sends an error event, then `[DONE]`."""
    def event(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    events, done = Events(job, request), False
    try:
        if shape.chat:
            yield event(shape.chunk(role=True))
        while True:
            kind, payload = await events.next()
            if kind == "delta":
                yield event(shape.chunk(text=payload))
                continue
            done = True
            if kind == "error":
                yield event({"error": {"message": f"generation failed: {payload}", "type": "server_error",
                                       "param": None, "code": None}})
                break
            c: Completion = payload
            _record(metrics, job, c)
            last = shape.chunk(finish_reason=c.finish_reason)
            last.update(usage=usage(c), blockdraft=c.extra())
            yield event(last)
            if include_usage:
                yield event({**shape.base(last["object"]), "choices": [], "usage": usage(c)})
            break
        yield "data: [DONE]\n\n"
    except ClientGone:
        return
    finally:
        if not done:  # the client went away: free the engine now
            scheduler.cancel(job)
