"""An OpenAI-compatible HTTP server over the engine (`blockdraft serve`).

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (with
`stream: true` as server-sent events in OpenAI's chunk format), GET /metrics (Prometheus text).
Requests are checked here, before they queue, so bad input gets a 4xx with an OpenAI-shaped error
body and never reaches the engine; scheduling is in scheduler.py (FIFO into a continuous batch,
one engine worker).
Speculative statistics ride along in an extra `blockdraft` field of each final response.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..decoding.engine import Engine, GenerationConfig, validate_request
from ..errors import BlockdraftError
from .metrics import Metrics
from .scheduler import Completion, Job, Scheduler
from ..decoding.verify import SamplingParams

MAX_STOP_STRINGS = 4
UNSUPPORTED = {"logprobs": "logprobs", "top_logprobs": "logprobs", "echo": "echo", "tools": "tools",
               "functions": "function calling", "suffix": "suffix"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    config: GenerationConfig
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default, low: float, high: float, integer: bool = False, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    kind_ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not kind_ok or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}", name)
    if value < low or value > high or (low_open and value == low):
        raise ApiError(400, f"'{name}' must be in {'(' if low_open else '['}{low:g}, {high:g}] (got {value})", name)
    return value


def _text_content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", "messages")


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required: a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "content" not in m:
            raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        role = {"developer": "system"}.get(m.get("role"), m.get("role"))
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}].role must be system, developer, user or assistant "
                                f"(got {m.get('role')!r})", "messages")
        out.append({"role": role, "content": _text_content(m["content"], f"messages[{i}]")})
    return out


def parse_prompt(body: dict, target) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return target.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)  # token ids; their range is checked with the rest of the request
    raise ApiError(400, "'prompt' is required: a string, a list of one string, or a list of token ids", "prompt")


def parse_request(body, engine: Engine, model_name: str, chat: bool, default_max_tokens: int,
                  lookup: bool = True) -> ParsedRequest:
    """Every check a request gets before it may queue; raises ApiError with the 4xx to answer."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required", "model")
    if model != model_name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{model_name}'", "model",
                       "model_not_found")
    for key, what in UNSUPPORTED.items():
        if body.get(key) not in (None, False, 0, [], ""):
            raise ApiError(400, f"'{key}' is not supported by this server ({what})", key)
    if _number(body, "n", 1, 1, 1_000_000, integer=True) != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "only best_of=1 is supported", "best_of")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' must be {\"include_usage\": bool}", "stream_options")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS}", "stop")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    seed = _number(body, "seed", None, 0, 2**63 - 1, integer=True)
    target = engine.target
    if chat:
        if not target.has_chat_template:
            raise ApiError(400, f"the model '{model_name}' has no chat template; use /v1/completions")
        ids = target.encode_messages(parse_messages(body))
    else:
        ids = parse_prompt(body, target)
    room = target.max_context - len(ids)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, min(default_max_tokens, max(room, 1)), 1, 1_000_000, integer=True)
    if len(ids) >= target.max_context or max_tokens > room:
        raise ApiError(400, f"this model's context is {target.max_context} tokens; the prompt has {len(ids)} "
                            f"and {max_tokens} more were asked for", "messages" if chat else "prompt",
                       "context_length_exceeded")
    config = GenerationConfig(max_new_tokens=max_tokens, sampling=SamplingParams(temperature, 0, top_p, seed),
                              stop_strings=tuple(stop), lookup=lookup)
    try:
        validate_request(target, ids, config)
    except BlockdraftError as err:
        raise ApiError(400, str(err)) from err
    return ParsedRequest(ids, config, stream, options.get("include_usage", False))


def _usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def create_app(engine: Engine, model_name: str, api_key: str | None = None, max_queue: int = 64,
               default_max_tokens: int = 256, lookup: bool = True, max_batch: int = 16,
               max_step_tokens: int | None = None, worker_thread: bool = True) -> FastAPI:
    """`max_batch`: requests decoded together (1: one at a time); `max_step_tokens`: tokens one
    step may verify over the whole batch (None: no cap beyond the blocks' own). `worker_thread`:
    the app starts its engine worker in a thread; False: the caller runs `app.state.scheduler.run()`
    (in the main thread, where the engine runs faster: see scheduler.py)."""
    scheduler = Scheduler(engine, max_queue, max_batch, max_step_tokens)
    metrics = Metrics()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        if worker_thread:
            scheduler.start()
        yield
        scheduler.close()

    app = FastAPI(title="blockdraft", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                metrics.count(request.url.path, 401)
                return ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                code="invalid_api_key", kind="authentication_error").response()
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        metrics.count(request.url.path, err.status)
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        return ApiError(err.status_code, str(err.detail), kind="invalid_request_error").response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        metrics.count(request.url.path, 500)
        return ApiError(500, f"internal error: {type(err).__name__}", kind="server_error").response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "queue_depth": scheduler.depth,
                "running": scheduler.running, "max_batch": scheduler.max_batch}

    @app.get("/v1/models")
    async def models():
        metrics.count("/v1/models", 200)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "blockdraft"}]}

    @app.get("/metrics")
    async def prometheus():
        with scheduler.lock:
            text = metrics.render(scheduler.depth, scheduler.running, scheduler.cancelled_total,
                                  [scheduler.batch_sizes, scheduler.step_tokens])
        return PlainTextResponse(text,
                                 media_type="text/plain; version=0.0.4")

    async def serve(request: Request, chat: bool):
        endpoint = request.url.path
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the request body is not valid JSON ({err})") from err
        req = parse_request(body, engine, model_name, chat, default_max_tokens, lookup)
        job = Job(req.prompt_ids, req.config, asyncio.get_running_loop())
        if not scheduler.submit(job):
            raise ApiError(429, f"the server is at capacity ({max_queue} requests waiting); retry later",
                           code="queue_full", kind="rate_limit_error")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        shape = _ChunkShape(rid, model_name, chat)
        if req.stream:
            metrics.count(endpoint, 200)
            return StreamingResponse(_sse(job, shape, req.include_usage, scheduler, metrics),
                                     media_type="text/event-stream")
        completion = await _wait(job, request, scheduler)
        metrics.count(endpoint, 200)
        metrics.completed(completion.prompt_tokens, completion.completion_tokens, completion.stats.tau,
                          time.perf_counter() - job.submitted)
        return shape.final(completion)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


def serve_in_main_thread(app: FastAPI, host: str, port: int, banner: str) -> None:
    """Serve an app made with `worker_thread=False`: HTTP (uvicorn) in a background thread, the
    engine worker in the calling (main) thread, where its CPU kernels run fastest (scheduler.py),
    until the HTTP server stops, SIGTERM or Ctrl-C."""
    import signal
    import sys
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    http = threading.Thread(target=server.run, name="blockdraft-http", daemon=True)
    http.start()
    while not server.started:
        if not http.is_alive():
            raise BlockdraftError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.05)
    print(banner, file=sys.stderr, flush=True)
    scheduler = app.state.scheduler
    signal.signal(signal.SIGTERM, lambda *_: scheduler.close_soon())
    try:
        scheduler.run()  # until the HTTP server stops (its lifespan closes the scheduler) or a signal
    finally:
        server.should_exit = True
        scheduler.close_soon()
        http.join(timeout=30)


@dataclass
class _ChunkShape:
    """OpenAI's response and chunk objects for one request, chat or text completion."""

    rid: str
    model: str
    chat: bool

    def _base(self, kind: str) -> dict:
        return {"id": self.rid, "object": kind, "created": int(time.time()), "model": self.model}

    def final(self, c: Completion) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                      "finish_reason": c.finish_reason}
        else:
            choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
        return {**self._base("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": _usage(c), "blockdraft": c.extra()}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._base("text_completion"), "choices": [choice]}


async def _wait(job: Job, request: Request, scheduler: Scheduler) -> Completion:
    """The finished completion; gives the job up as soon as the client disconnects."""
    done = False
    try:
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise ApiError(499, "client closed the request") from None
                continue
            if kind == "done":
                done = True
                return payload
            if kind == "error":
                done = True
                raise ApiError(500, f"generation failed: {payload}", kind="server_error")
    finally:
        if not done:  # disconnected, or this task was cancelled
            scheduler.cancel(job)


async def _sse(job: Job, shape: _ChunkShape, include_usage: bool, scheduler: Scheduler, metrics: Metrics):
    def event(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    done = False
    try:
        if shape.chat:
            yield event(shape.chunk(role=True))
        while True:
            kind, payload = await job.events.get()
            if kind == "delta":
                yield event(shape.chunk(text=payload))
            elif kind == "error":
                yield event({"error": {"message": f"generation failed: {payload}", "type": "server_error",
                                       "param": None, "code": None}})
                done = True
                break
            else:
                done = True
                c: Completion = payload
                metrics.completed(c.prompt_tokens, c.completion_tokens, c.stats.tau,
                                  time.perf_counter() - job.submitted)
                last = shape.chunk(finish_reason=c.finish_reason)
                last.update(usage=_usage(c), blockdraft=c.extra())
                yield event(last)
                if include_usage:
                    yield event({**shape._base(last["object"]), "choices": [], "usage": _usage(c)})
                break
        yield "data: [DONE]\n\n"
    finally:
        if not done:  # the client went away mid-stream: free the engine now
            scheduler.cancel(job)
