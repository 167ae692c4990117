"""A decode step's forward without transformers' modules (models/llama_step.py): the rotary
embedding and cache append kernel is transformers' `apply_rotary_pos_emb` bit for bit, and a Llama
target's step (one token, a chain, a tree, a batch of slots) computes bitwise the logits, taps and
cache the module path computes; a model it does not repeat keeps the module path (issue 50)."""

import pytest
import torch
from conftest import tiny_target
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from blockdraft.decoding.slots import RowBlock, SlotCache
from blockdraft.decoding.tree import Tree
from blockdraft.ops import few_rows
from blockdraft.models.llama_step import LlamaStep, matches_model

pytestmark = pytest.mark.skipif(not few_rows.available(), reason="the few-row kernels do not run here")


def test_rotary_embedding_and_cache_append_are_transformers_bit_for_bit():
    torch.manual_seed(0)
    b, t, hq, hk, d, n = 2, 5, 6, 2, 16, 7
    qkv = torch.randn(b, t, (hq + 2 * hk) * d) * 3
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)  # views of one projection's output, as a layer has them
    cos, sin = torch.randn(b, t, d), torch.randn(b, t, d)  # a row's own positions per sequence
    kbuf, vbuf = torch.zeros(b, hk, 20, d), torch.zeros(b, hk, 20, d)
    got = few_rows.rope_append(q, k, v, d, cos, sin, kbuf, vbuf, n)
    want_q, want_k = apply_rotary_pos_emb(q.reshape(b, t, hq, d).transpose(1, 2), k.reshape(b, t, hk, d).transpose(1, 2),
                                          cos, sin)
    assert torch.equal(got, want_q)
    assert torch.equal(kbuf[:, :, n:n + t], want_k)
    assert torch.equal(vbuf[:, :, n:n + t], v.reshape(b, t, hk, d).transpose(1, 2))
    assert not kbuf[:, :, :n].any() and not kbuf[:, :, n + t:].any()  # nothing written outside the slots


def _both(target, run):
    """`run(target)` on the step and on the module path: their outputs, each from a fresh cache
    (and that the step did run)."""
    step, outs, calls = target.step, [], []
    forward = step.forward
    step.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    try:
        for s in (step, None):
            target.step = s
            with torch.inference_mode():  # as the engine runs (a tree's kept path moves K/V in place)
                outs.append(run(target))
    finally:
        target.step = step
        del step.forward
    assert calls
    return outs


def test_a_llama_targets_step_computes_what_its_modules_do_bit_for_bit():
    target = tiny_target("llama")
    assert target.step is not None
    taps = [-1, 0, 2, 5]  # -1: the embedding's output; 5: the last layer (transformers records it final-normed)
    prompt = list(range(3, 20))

    def run(t):
        cache = t.new_cache()
        t.forward(torch.tensor([prompt]), cache, logits_at=1)  # the prefill takes the module path
        one = t.forward(torch.tensor([[7]]), cache, taps)
        chain = t.forward(torch.tensor([[8, 9, 10, 11]]), cache, taps)
        t.rollback(cache, len(prompt) + 2)
        tree = Tree(tokens=[12, 13, 14, 15], parents=[-1, 0, 0, 1], depths=[0, 1, 1, 2], ranks=[0, 0, 1, 0])
        branch = t.forward(torch.tensor([tree.tokens]), cache, taps, tree=tree)
        t.keep_path(cache, len(prompt) + 2, [0, 2])
        after = t.forward(torch.tensor([[16]]), cache, taps)
        kv = [(l.keys.clone(), l.values.clone()) for l in cache.kv.layers]
        return [(o.logits, o.taps) for o in (one, chain, branch, after)], kv

    (step_out, step_kv), (module_out, module_kv) = _both(target, run)
    for (logits, taps_got), (want_logits, want_taps) in zip(step_out, module_out):
        assert torch.equal(logits, want_logits) and torch.equal(taps_got, want_taps)
    for (k, v), (wk, wv) in zip(step_kv, module_kv):
        assert torch.equal(k, wk) and torch.equal(v, wv)


def test_a_batch_of_slots_takes_the_step_with_its_mask_and_matches_the_modules():
    target = tiny_target("llama")

    def run(t):
        slots = SlotCache()
        for prompt in (list(range(3, 12)), list(range(20, 26))):  # rows of different lengths: a mask
            cache = t.new_cache()
            t.forward(torch.tensor([prompt]), cache, logits_at=1)
            slots.join(cache)
        tree = Tree(tokens=[30, 31, 32], parents=[-1, 0, 0], depths=[0, 1, 1], ranks=[0, 0, 1])
        out = slots.forward(t, [RowBlock([40, 41, 42]), RowBlock(tree.tokens, tree)], [1, 3])
        return out.logits, out.taps

    (logits, taps), (want_logits, want_taps) = _both(target, run)
    assert torch.equal(logits, want_logits) and torch.equal(taps, want_taps)


def test_a_model_the_step_does_not_repeat_keeps_its_modules():
    assert tiny_target("qwen3").step is None  # not a LlamaModel (per-head norms)
    target = tiny_target("llama")
    step = LlamaStep.build(target.model)
    assert matches_model(step, target.model)
    step.layers[1].act = torch.nn.functional.gelu  # a layer computing something else: the probe sees it
    assert not matches_model(step, target.model)


def test_the_step_is_off_when_asked(monkeypatch):
    monkeypatch.setenv("BLOCKDRAFT_LLAMA_STEP", "0")
    assert tiny_target("llama").step is None
