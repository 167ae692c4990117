"""The OpenAI API as this server speaks it: the request bodies it accepts (read within a size limit,
then pydantic models of the fields it supports, each with its range), the fields it refuses, and the
error body every refusal carries. Nothing here tokenizes: that is inputs.py's work, off the event
loop."""

from __future__ import annotations

import json
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from ..decoding.state import STOP_WINDOW_TOKENS
from ..decoding.verify import MIN_TEMPERATURE

MAX_STOP_STRINGS = 4
# decoding.state.Stopper looks for stop strings in the text of the last 32 generated tokens. Every
# token is at least one byte, so a stop string of up to 31 UTF-8 bytes always lies inside that
# window when its last byte arrives, with a token to spare before it (some tokenizers drop the
# decoded window's leading space). A longer one could be missed, and generation run to max_tokens.
MAX_STOP_BYTES = STOP_WINDOW_TOKENS - 1
MAX_TOKENS_LIMIT = 1_000_000
# Fields of OpenAI's API this server does not implement, with what they ask for (for the message).
# Any field not in the models below is refused once it asks for something (`_asks_for_something`),
# these and unknown ones alike: a request is served as asked or refused, never half-served.
UNSUPPORTED = {"logprobs": "logprobs", "top_logprobs": "logprobs", "echo": "echo", "tools": "tools",
               "tool_choice": "tools", "parallel_tool_calls": "tools", "functions": "function calling",
               "function_call": "function calling", "suffix": "suffix", "logit_bias": "logit_bias",
               "presence_penalty": "penalties", "frequency_penalty": "penalties",
               "response_format": "structured output", "modalities": "audio", "audio": "audio",
               "prediction": "predicted outputs"}


class ApiError(Exception):
    """A refusal: its HTTP status and OpenAI's error body {message, type, param, code}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _refuse(message: str) -> PydanticCustomError:
    """A field's own refusal; the error names the field (`_describe`)."""
    return PydanticCustomError("blockdraft", message)


def _only_one(value: int, name: str) -> int:
    """`n` and `best_of`: one completion per request is all this server makes."""
    if value != 1:
        raise _refuse(f"only {name}=1 is supported")
    return value


def _asks_for_something(value) -> bool:
    """Whether an unsupported field's value asks for its feature: null, false, 0, "", [] and {}
    are what clients send for "off", and are accepted."""
    if value is None or isinstance(value, bool):
        return value is True
    if isinstance(value, (int, float)):
        return value != 0
    return value not in ("", [], {})


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # e.g. `name`: accepted, unused
    role: Literal["system", "developer", "user", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value):
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                           and isinstance(p.get("text"), str) for p in value):
            return "".join(p["text"] for p in value)
        raise _refuse("must be a string or a list of text parts")

    def for_template(self) -> dict:
        """The message as a chat template reads it (OpenAI's "developer" is the system role)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    """What both endpoints accept. Strict: "1" is not a number and true is not 1, as in OpenAI's."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # 1, as in OpenAI's API
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[str] = []
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, unused

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        stop = [value] if isinstance(value, str) else ([] if value is None else value)
        if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or \
                not all(isinstance(s, str) and s for s in stop):
            raise _refuse(f"must be a non-empty string or a list of up to {MAX_STOP_STRINGS} non-empty strings")
        for s in stop:
            if len(s.encode()) > MAX_STOP_BYTES:
                raise _refuse(f"a stop string may be up to {MAX_STOP_BYTES} bytes of UTF-8 (one is "
                              f"{len(s.encode())}): stops are looked for in the last {STOP_WINDOW_TOKENS} "
                              "tokens' text")
        return stop

    @field_validator("n", mode="after")
    @classmethod
    def _one(cls, value):
        return _only_one(value, "n")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def sampling_temperature(self) -> float:
        return 0.0 if self.temperature < MIN_TEMPERATURE else self.temperature  # (verify.py: as vLLM does)

    def unsupported(self) -> list[str]:
        """The fields given that this server does not implement, with a value that asks for them."""
        return [k for k, v in (self.model_extra or {}).items() if _asks_for_something(v)]


class CompletionRequest(_Request):
    """POST /v1/completions: raw text (or token ids), no template."""

    prompt: str | list[int]
    best_of: int = 1

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            value = value[0]
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value  # token ids; their range is checked with the rest of the request (inputs.py)
        raise _refuse("must be a string, a list of one string, or a non-empty list of token ids")

    @field_validator("best_of", mode="after")
    @classmethod
    def _best_of(cls, value):
        return _only_one(value, "best_of")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens


class ChatRequest(_Request):
    """POST /v1/chat/completions: messages through the target's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


def _describe(err: dict) -> str:
    where = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(err["loc"]))
    if err["type"] == "missing":
        return f"'{where}' is required"
    return f"'{where}': {err['msg']}" if where else err["msg"]


def parse_body(body, chat: bool, model_name: str) -> ChatRequest | CompletionRequest:
    """The request as its model, or the ApiError (4xx) naming what is wrong: every field's type and
    range, the model, and each unsupported field given."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if isinstance(model, str) and model and model != model_name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{model_name}'", "model",
                       "model_not_found")
    try:
        req = (ChatRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as err:
        errors = err.errors(include_url=False)
        param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
        raise ApiError(400, "; ".join(dict.fromkeys(_describe(e) for e in errors)), param) from None
    fields = req.unsupported()
    if fields:
        named = ", ".join(f"'{k}'" + (f" ({UNSUPPORTED[k]})" if k in UNSUPPORTED else "") for k in fields)
        verb = "is" if len(fields) == 1 else "are"
        raise ApiError(400, f"{named} {verb} not supported by this server", fields[0])
    return req


async def read_json(request: Request, limit: int):
    """The body as JSON, refused with 413 as soon as it is known to exceed `limit` bytes: from its
    Content-Length before a byte of it is read, else while it streams in (chunked uploads)."""
    too_large = ApiError(413, f"the request body is larger than this server's limit of {limit} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "the Content-Length header is not a number")
        if int(declared) > limit:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON ({err})") from err
