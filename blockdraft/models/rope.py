"""RoPE whose frequencies depend on the whole forward call, and the context where they do not.

transformers' `dynamic` (NTK) and `longrope` (Phi-3 / Phi-4-mini long context) RoPE choose their
frequencies from the largest position in the call (`modeling_rope_utils.dynamic_rope_update`):
`longrope` switches every row of the call to its long factors once any position reaches
`original_max_position_embeddings`, and `dynamic` rescales every row once any position passes
`max_position_embeddings`. Plain decoding decides this one token at a time; a verify block that
straddles the threshold, or a batch that holds one long request, would decide it for all its rows
at once and change the other rows' logits: speculation would no longer reproduce plain decoding.
Below the threshold the frequencies never change, so the engine keeps every request there
(`Target.max_context`) and refuses longer ones with the reason, before any work.
"""

from __future__ import annotations

from dataclasses import dataclass

CALL_DEPENDENT = ("dynamic", "longrope")


@dataclass(frozen=True)
class RopeLimit:
    """The context within which a model's RoPE is the same whatever the call holds."""

    tokens: int
    rope_type: str  # the call-dependent type that sets the limit

    def reason(self) -> str:
        return (f"its {self.rope_type!r} RoPE scaling picks its frequencies from the longest position in a forward "
                f"call, so past {self.tokens} tokens a verify block or a batch would change other tokens' RoPE; "
                f"blockdraft keeps requests within {self.tokens} tokens, where decoding is exact")


def _parameter_sets(config) -> list[dict]:
    """The model's RoPE parameter dicts: one, or one per layer type (Gemma-3's sliding/full)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    if "rope_type" in params or "type" in params:
        return [params]
    return [p for p in params.values() if isinstance(p, dict)]


def call_dependent_limit(config) -> RopeLimit | None:
    """The context limit that keeps a `dynamic` or `longrope` RoPE call-independent (None: the
    model's RoPE does not depend on the call)."""
    limit = None
    max_positions = getattr(config, "max_position_embeddings", None)
    for params in _parameter_sets(config):
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if not any(kind in rope_type for kind in CALL_DEPENDENT):
            continue
        # longrope switches past `original_max_position_embeddings`; dynamic grows past the
        # model's `max_position_embeddings` (transformers' `original_max_seq_len`)
        bound = params.get("original_max_position_embeddings") if rope_type == "longrope" else None
        bound = bound or max_positions
        if bound is None:
            continue
        if limit is None or int(bound) < limit.tokens:
            limit = RopeLimit(int(bound), rope_type)
    return limit
