"""End to end on the real SmolLM2-135M-Instruct target (slow: loads the model; runs in CI)."""

import json

import pytest
import torch

from blockdraft.cli import bundled_drafter, main
from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.models.draft import DraftModel, build_draft_config
from blockdraft.decoding.oracle import OracleDraft
from blockdraft.models.target import SMOLLM2_MASK_TOKEN_ID, load_target

pytestmark = pytest.mark.slow

PROMPTS = ["Write a Python function that reverses a string.", "What is the capital of France?",
           "List three colors."]


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    return load_target("smollm2-135m", device="cpu")


def test_alias_loads_from_cache_with_chat_template(smollm2):
    assert smollm2.num_layers == 30 and smollm2.hidden_size == 576 and smollm2.vocab_size == 49152
    assert smollm2.has_chat_template and 2 in smollm2.stop_token_ids  # <|im_end|>
    assert smollm2.tokenizer.convert_ids_to_tokens(SMOLLM2_MASK_TOKEN_ID) == "<empty_output>"


def test_greedy_speculative_equals_plain_on_smollm2(smollm2):
    torch.manual_seed(0)
    cfg = build_draft_config(smollm2.config, num_layers=1, block_size=16, mask_token_id=SMOLLM2_MASK_TOKEN_ID)
    drafts = [DraftModel(cfg)]
    if bundled_drafter("smollm2-135m"):
        from blockdraft.models.checkpoint import load_draft

        drafts.append(load_draft(bundled_drafter("smollm2-135m")))
    plain = Engine(smollm2)
    gen = GenerationConfig(max_new_tokens=40)
    for text in PROMPTS:
        ids = smollm2.encode_prompt(text, chat=True)
        expected = plain.generate(ids, gen)
        assert expected.num_new_tokens > 5
        for d in drafts:
            assert Engine(smollm2, d).generate(ids, gen).token_ids == expected.token_ids
        oracle = OracleDraft(drafts[0], expected.token_ids, len(ids), keep=0.8, seed=1)
        got = Engine(smollm2, oracle).generate(ids, gen)
        assert got.token_ids == expected.token_ids and got.stats.tau > 1.5


def test_seeded_sampling_as_shipped_equals_plain_sampling_on_smollm2(smollm2):
    """The Gumbel coupling on the real target and the bundled drafter (docs/sampling.md): at
    temperature 0.8, top-p 0.95, the shipped setup (adaptive blocks, token trees, prompt lookup)
    and fixed blocks give plain sampling's text for the same seed, token for token; drafts are
    accepted along the way (the speculation did run)."""
    from blockdraft.decoding.verify import SamplingParams
    from blockdraft.models.checkpoint import load_draft

    engine = Engine(smollm2, load_draft(bundled_drafter("smollm2-135m")))
    plain = Engine(smollm2)
    accepted = 0
    for seed, text in enumerate(PROMPTS):
        ids = smollm2.encode_prompt(text, chat=True)
        base = dict(max_new_tokens=48, sampling=SamplingParams(0.8, 0, 0.95, seed))
        expected = plain.generate(ids, GenerationConfig(**base)).token_ids
        for schedule in (dict(tree_budget=16), dict(block_size=8), dict(block_size=3, lookup=False)):
            got = engine.generate(ids, GenerationConfig(**base, **schedule))
            assert got.token_ids == expected, (text, schedule)
            accepted += got.stats.accepted
    assert accepted > 10


def test_cli_json_contract(capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": PROMPTS[1]}) + "\n" + json.dumps({"prompt": PROMPTS[2], "seed": 3}) + "\n")
    assert main(["generate", "--prompts-file", str(f), "--max-new-tokens", "12", "--json", "--device", "cpu"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    for r in rows:
        for key in ("text", "token_ids", "num_new_tokens", "tau", "acceptance_lengths",
                    "prefill_seconds", "decode_seconds"):
            assert key in r
        assert r["num_new_tokens"] == len(r["token_ids"]) <= 12
    assert main(["generate", "--prompt", PROMPTS[1], "--max-new-tokens", "12", "--json", "--draft", "none",
                 "--no-lookup", "--device", "cpu"]) == 0  # plain decoding
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plain["token_ids"] == rows[0]["token_ids"] and plain["tau"] == 1.0
