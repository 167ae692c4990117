"""`blockdraft data` end to end on a tiny target that uses SmolLM2's tokenizer (for its chat
template): resume after a kill without duplicates, and the feature cache it writes with
`--features` equals the one `blockdraft train` would build, also across a kill between the
samples and their features (slow: reads SmolLM2's tokenizer from the target cache)."""

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from blockdraft.training import data as D
from blockdraft.models.draft import default_target_layer_ids
from blockdraft.training.features import CachedFeatures, build_feature_cache, feature_dir
from blockdraft.models.target import load_target, resolve_target_path

pytestmark = pytest.mark.slow

N_LAYERS = 6


@pytest.fixture(scope="module")
def tiny_chat_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-chat")
    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=N_LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(root)
    tok.save_pretrained(root)
    src = root / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Question {i}: what is {i} + {i}?",
                                       "response": f"The answer is {2 * i}. " * (1 + i % 3)}) + "\n"
                           for i in range(14)))
    return root, src


def _ids(path):
    return [json.loads(line)["id"] for line in open(path / "samples.jsonl")]


@pytest.mark.parametrize("responses", ["dataset", "target"])
def test_data_resumes_and_its_feature_cache_equals_the_trainers(tiny_chat_target, tmp_path, monkeypatch, responses):
    root, src = tiny_chat_target
    out = tmp_path / "data"
    kw = dict(source=str(src), target_name=str(root), responses=responses, batch_size=3, max_new_tokens=12,
              heldout_percent=25.0, progress=False, features=True)
    D.generate_data(out, limit=5, **kw)
    # a kill after a batch's samples are written but before their features: samples ahead of the cache
    real = D.append_features
    calls = []

    def killed(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(*args)

    monkeypatch.setattr(D, "append_features", killed)
    with pytest.raises(KeyboardInterrupt):
        D.generate_data(out, limit=14, **kw)
    monkeypatch.setattr(D, "append_features", real)
    taps = default_target_layer_ids(N_LAYERS)
    cdir = feature_dir(out, "train", taps)
    assert len(json.loads((cdir / "index.json").read_text())["ids"]) < len(D.load_samples(out, "train"))
    D.generate_data(out, limit=14, **kw)  # resumes: levels the cache, then goes on

    ids = _ids(out)
    assert sorted(ids) == sorted(f"p{i}" for i in range(14))  # every prompt once
    train = D.load_samples(out, "train")
    assert 0 < len(train) < 14  # some held out, and those are not in the cache
    assert json.loads((cdir / "index.json").read_text())["ids"] == [s["id"] for s in train]
    if responses == "dataset":
        assert all(len(s["target_next"]) == len(s["input_ids"]) for s in train)
    got = CachedFeatures(cdir)
    target = load_target(str(root), device="cpu")
    fresh = build_feature_cache(tmp_path / "fresh", "train", train, target, taps, progress=False)
    for i in range(len(train)):
        torch.testing.assert_close(got.get(i), fresh.get(i), rtol=2e-3, atol=2e-3)


def test_length_sorted_batches_keep_every_prompt_once_and_group_similar_lengths():
    lengths = [7, 1, 9, 3, 3, 8, 2, 6, 5, 4, 10]
    items = [(D.Prompt(id=f"p{i}", messages=[]), [0] * n) for i, n in enumerate(lengths)]
    batches = list(D.length_sorted_batches(iter(items), batch_size=2, window=2))
    assert [len(b) for b in batches] == [2, 2, 2, 2, 2, 1]
    assert sorted(p.id for b in batches for p, _ in b) == sorted(p.id for p, _ in items)
    # each window of 4 prompts is sorted by length before it is cut; the windows keep their order
    assert [[len(ids) for _, ids in b] for b in batches] == [[1, 3], [7, 9], [2, 3], [6, 8], [4, 5], [10]]
