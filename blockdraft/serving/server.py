"""An OpenAI-compatible HTTP server over the engine (`blockdraft serve`).

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (with
`stream: true` as server-sent events in OpenAI's chunk format), GET /metrics (Prometheus text).
A request is checked before it queues: its size (api.read_json), its fields (api.parse_body), then
its tokens (inputs.py, in a thread of its own: a chat template or a long prompt would otherwise hold
up every other client); bad input gets a 4xx with an OpenAI-shaped error body and never reaches the
engine. Scheduling is in scheduler.py (FIFO into a continuous batch, one engine worker), what the
client receives in responses.py, the API key and request counts in access.py, how the process runs
and stops in lifecycle.py. Speculative statistics ride along in an extra `blockdraft` field of each
final response.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..decoding.engine import Engine
from .access import Access
from .api import ApiError, parse_body, read_json
from .inputs import Inputs
from .metrics import CONTENT_TYPE, Metrics
from .responses import ChunkShape, reply, stream
from .scheduler import Admission, Job, Scheduler

log = logging.getLogger("blockdraft.serving")
MIN_BODY_BYTES = 1 << 20  # 1 MiB; more for long contexts (see `body_limit`)
BODY_BYTES_PER_TOKEN = 32  # room for a full context of text or token ids, JSON-escaped


def body_limit(max_context: int) -> int:
    """The default largest request body: 1 MiB, or more where a full context needs it."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_context)


def _unavailable(admission: Admission, max_queue: int) -> ApiError:
    if admission is Admission.FULL:
        return ApiError(429, f"the server is at capacity ({max_queue} requests waiting); retry later",
                        code="queue_full", kind="rate_limit_error")
    if admission is Admission.FAILED:
        return ApiError(503, "the engine worker has failed; see /health", code="engine_failed", kind="server_error")
    return ApiError(503, "the server is shutting down", code="shutting_down", kind="server_error")


def create_app(engine: Engine, model_name: str, api_key: str | None = None, max_queue: int = 64,
               default_max_tokens: int = 256, lookup: bool = True, max_batch: int = 16,
               max_step_tokens: int | None = None, worker_thread: bool = True,
               max_body_bytes: int | None = None, tree_budget: int | str | None = "auto") -> FastAPI:
    """`max_batch`: requests decoded together (1: one at a time); `max_step_tokens`: tokens one
    step may verify over the whole batch (None: no cap beyond the blocks' own); `max_body_bytes`:
    the largest request body (None: `body_limit`); `tree_budget`: every request's
    (`GenerationConfig.tree_budget`: "auto", trees for greedy requests as the library decodes them;
    None, chains). `worker_thread`: the app starts its engine
    worker in a thread; False: the caller runs `app.state.scheduler.run()` (in the main thread,
    where the engine runs faster: see scheduler.py, and lifecycle.serve_in_main_thread)."""
    metrics = Metrics()
    scheduler = Scheduler(engine, max_queue, max_batch, max_step_tokens, metrics)
    inputs = Inputs(engine.target, model_name, default_max_tokens, lookup, tree_budget)
    body_bytes = max_body_bytes or body_limit(engine.target.max_context)
    # One thread for templates and tokenizers: off the event loop, and never two at once (a fast
    # tokenizer refuses concurrent use that changes its settings: "Already borrowed").
    tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blockdraft-tokenize")
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        if worker_thread:
            scheduler.start()
        yield
        scheduler.close()
        tokenizing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="blockdraft", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.add_middleware(Access, metrics=metrics, api_key=api_key)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        return ApiError(err.status_code, str(err.detail)).response()

    @app.get("/health")
    async def health():
        h = scheduler.health()
        body = {"status": h.status, "model": model_name, "queue_depth": scheduler.depth,
                "running": scheduler.running, "max_batch": scheduler.max_batch}
        if h.reason:
            body["reason"] = h.reason
        return JSONResponse(body, status_code=200 if h.ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "blockdraft"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def complete(request: Request, chat: bool):
        if not scheduler.accepting:  # refused before any work on the request
            raise _unavailable(Admission.FAILED if scheduler.failure else Admission.SHUTTING_DOWN, max_queue)
        body = await read_json(request, body_bytes)
        req = parse_body(body, chat, model_name)
        loop = asyncio.get_running_loop()
        parsed = await loop.run_in_executor(tokenizing, inputs.prepare, req)
        job = Job(parsed.prompt_ids, parsed.config, loop)
        admission = scheduler.submit(job)
        if admission is not Admission.QUEUED:
            raise _unavailable(admission, max_queue)
        shape = ChunkShape(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, model_name, chat)
        if parsed.stream:
            return StreamingResponse(stream(job, request, shape, parsed.include_usage, scheduler, metrics),
                                     media_type="text/event-stream")
        return await reply(job, request, shape, scheduler, metrics)

    async def answer(request: Request, chat: bool):
        try:
            return await complete(request, chat)
        except ApiError:
            raise
        except Exception as err:  # a bug: answered 500 here, so that access.py counts it too
            log.exception("a request failed")
            raise ApiError(500, f"internal error: {type(err).__name__}", kind="server_error") from err

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    return app
