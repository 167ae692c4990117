"""Tiny random targets and drafters for the mechanics; the real SmolLM2 only in `slow` tests."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from blockdraft.models.draft import DraftModel, build_draft_config
from blockdraft.models.target import Target

VOCAB = 96
torch.set_num_threads(1)  # tiny models gain nothing from threads; keeps CI runs steady


def tiny_target(kind: str = "llama", vocab: int = VOCAB, seed: int = 0, layers: int = 6) -> Target:
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16))
    return Target(model.float(), tokenizer=None, name=f"tiny-{kind}")


def record_draft_contexts(monkeypatch, draft: DraftModel) -> list[tuple[int, int]]:
    """Spy on the draft forward: per call, (context length the draft cache will hold, position of
    the anchor). Decoding must give the drafter context up to its anchor, no more, no less."""
    seen = []
    real = type(draft).block_hidden

    def spy(self, embed, cache, taps, anchor, position, block):
        seen.append((cache.length + taps.shape[1], position))
        return real(self, embed, cache, taps, anchor, position, block)

    monkeypatch.setattr(type(draft), "block_hidden", spy)
    return seen


def tiny_draft(target: Target, block_size: int = 8, layers: int = 2, seed: int = 1) -> DraftModel:
    torch.manual_seed(seed)
    cfg = build_draft_config(target.config, num_layers=layers, block_size=block_size,
                             mask_token_id=target.vocab_size - 1, num_taps=3)
    return DraftModel(cfg).eval()


@pytest.fixture(params=["llama", "qwen3"])
def target(request) -> Target:
    return tiny_target(request.param)
