"""From a validated request (api.py) to what the engine decodes: the prompt's token ids (the chat
template or the tokenizer) and its GenerationConfig, with the checks that need the tokens (the
context, the ids' range). This is the costly part of a request's checks, so the server runs it off
the event loop (`Inputs.prepare` in an executor)."""

from __future__ import annotations

from dataclasses import dataclass

from ..decoding.engine import GenerationConfig, validate_request
from ..decoding.verify import SamplingParams
from ..errors import BlockdraftError
from .api import ApiError, ChatRequest, CompletionRequest


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    config: GenerationConfig
    stream: bool
    include_usage: bool


@dataclass
class Inputs:
    """What every request's preparation shares: the engine's target and the server's defaults."""

    target: object  # models.target.Target
    model_name: str
    default_max_tokens: int
    lookup: bool
    tree_budget: int | str | None = "auto"  # GenerationConfig's: "auto" decodes as the library and the CLI do

    def prompt_ids(self, req: ChatRequest | CompletionRequest) -> list[int]:
        target = self.target
        if isinstance(req, ChatRequest):
            if not target.has_chat_template:
                raise ApiError(400, f"the model '{self.model_name}' has no chat template; use /v1/completions")
            return target.encode_messages([m.for_template() for m in req.messages])
        if isinstance(req.prompt, str):
            return target.tokenizer(req.prompt, add_special_tokens=True)["input_ids"]
        return list(req.prompt)

    def prepare(self, req: ChatRequest | CompletionRequest) -> ParsedRequest:
        """Every check that needs the prompt's tokens; raises ApiError with the 4xx to answer."""
        chat = isinstance(req, ChatRequest)
        ids = self.prompt_ids(req)
        context = self.target.max_context
        room = context - len(ids)
        max_tokens = req.max_new_tokens
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, max(room, 1))
        if len(ids) >= context or max_tokens > room:
            raise ApiError(400, f"this model's context is {context} tokens; the prompt has {len(ids)} "
                                f"and {max_tokens} more were asked for", "messages" if chat else "prompt",
                           "context_length_exceeded")
        sampling = SamplingParams(req.sampling_temperature, 0, req.top_p, req.seed)
        config = GenerationConfig(max_new_tokens=max_tokens, sampling=sampling, stop_strings=tuple(req.stop),
                                  lookup=self.lookup, tree_budget=self.tree_budget)
        try:
            validate_request(self.target, ids, config)
        except BlockdraftError as err:
            raise ApiError(400, str(err)) from err
        return ParsedRequest(ids, config, req.stream, req.include_usage)
