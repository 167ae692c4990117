"""The draft vocabulary subset (vocab.py): output unchanged, stored beside an unchanged checkpoint."""

import json

import pytest
import torch

from blockdraft.models.checkpoint import load_draft, save_draft
from blockdraft.cli import main
from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.errors import BlockdraftError
from blockdraft.models.draft import DraftCache
from blockdraft.models.vocab import VOCAB_FILE, SubsetHead, coverage, load_vocab, most_frequent, save_vocab

from conftest import VOCAB, tiny_draft, tiny_target


def test_most_frequent_counts_and_breaks_ties_by_id():
    ids = most_frequent([[5, 5, 7, 1], [7, 5, 9, 1]], 3, 12)
    assert ids.tolist() == [1, 5, 7]  # 5 x3, 7 x2, 1 x2 (ties: lower id first), 9 x1 left out
    assert most_frequent([[3]], 10, 12).tolist() == [3]  # never more than the tokens seen
    assert coverage([[5, 5, 9]], ids) == pytest.approx(2 / 3)
    with pytest.raises(BlockdraftError):
        most_frequent([[]], 4, 12)


def test_save_and_load_round_trip_and_refuse_bad_files(tmp_path):
    ids = torch.tensor([0, 3, 4, 90])
    save_vocab(tmp_path, ids, VOCAB)
    assert torch.equal(load_vocab(tmp_path, VOCAB), ids)
    from safetensors.torch import load_file, save_file

    data = load_file(str(tmp_path / VOCAB_FILE))
    assert torch.equal(data["d2t"] + torch.arange(4), ids) and int(data["t2d"].sum()) == 4  # speculators' maps
    with pytest.raises(BlockdraftError, match="outside"):
        load_vocab(tmp_path, 50)  # a subset made for a bigger vocabulary
    save_file({"d2t": torch.tensor([3, 0])}, str(tmp_path / VOCAB_FILE))  # ids 3, 1: not sorted
    with pytest.raises(BlockdraftError, match="sorted"):
        load_vocab(tmp_path, VOCAB)
    (tmp_path / VOCAB_FILE).write_bytes(b"junk")
    with pytest.raises(BlockdraftError, match="safetensors"):
        load_vocab(tmp_path, VOCAB)
    assert load_vocab(tmp_path / "elsewhere", VOCAB) is None


def test_the_subset_lives_in_a_subfolder_peers_never_load_and_a_top_level_one_is_migrated(tmp_path):
    """vLLM loads every top-level *.safetensors of a drafter and refused one with a d2t beside it;
    the subset sits in vocab/, and a drafter saved with the old layout still loads, then moves."""
    from safetensors.torch import load_file

    from blockdraft.models.vocab import LEGACY_VOCAB_FILE, remove_vocab

    assert "/" in VOCAB_FILE and not LEGACY_VOCAB_FILE.count("/")
    target = tiny_target()
    draft = tiny_draft(target)
    save_draft(draft, tmp_path / "d")
    ids = torch.tensor([1, 5, 7])
    save_vocab(tmp_path / "d", ids, VOCAB)
    assert sorted(p.name for p in (tmp_path / "d").glob("*.safetensors")) == ["model.safetensors"]
    (tmp_path / "d" / VOCAB_FILE).rename(tmp_path / "d" / LEGACY_VOCAB_FILE)  # as drafters had it before
    old = load_draft(tmp_path / "d")
    assert torch.equal(old.vocab_ids, ids)
    save_draft(old, tmp_path / "d")  # saved again: moved into vocab/
    assert not (tmp_path / "d" / LEGACY_VOCAB_FILE).exists()
    assert torch.equal(load_file(str(tmp_path / "d" / VOCAB_FILE))["d2t"] + torch.arange(3), ids)
    remove_vocab(tmp_path / "d")
    assert load_draft(tmp_path / "d").vocab_ids is None


def test_subset_head_scores_only_the_subset():
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, 64)
    ids = torch.tensor([2, 10, 50])
    head = SubsetHead(weight, ids)
    h = torch.randn(4, 64)
    with torch.inference_mode():
        logits = head(h)  # [4, V]
    assert logits.shape == (4, VOCAB)
    assert torch.allclose(logits[:, ids], h @ weight[ids].T, atol=1e-5)
    assert torch.isinf(logits[:, [0, 1, 3]]).all()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_subset_drafter_keeps_greedy_output_and_proposes_only_subset_tokens(kind, monkeypatch):
    target = tiny_target(kind)
    plain = Engine(target)
    prompt = [5, 17, 33, 2]
    cfg = GenerationConfig(max_new_tokens=40, block_size=6, stop_token_ids=(), lookup=False)
    truth = plain.generate(prompt, cfg).token_ids
    draft = tiny_draft(target, block_size=6)
    draft.vocab_ids = most_frequent([truth], 12, VOCAB)  # the subset holds much of the output
    from blockdraft.decoding.proposers import chain

    proposed = []
    real = chain.propose

    def spy(p, logits, *rest):
        proposal = real(p, logits, *rest)
        proposed.extend(proposal.draft.tokens[1:])
        return proposal

    monkeypatch.setattr(chain, "propose", spy)
    got = Engine(target, draft).generate(prompt, cfg)
    assert got.token_ids == truth
    assert proposed and set(proposed) <= set(draft.vocab_ids.tolist())


def test_a_subset_heads_best_ids_are_those_of_its_full_logits_ties_included():

    torch.manual_seed(0)
    weight = torch.randn(VOCAB, 16)
    ids = torch.tensor([2, 5, 9, 40, 41, 77])
    weight[41] = weight[5]  # a tie inside the subset: the lower id wins, as in the full row
    weight[3] = weight[5]  # an equal row outside the subset never scores
    head = SubsetHead(weight, ids)
    hidden = torch.randn(7, 16)
    hidden[0] = weight[5]  # rows where the tied tokens win
    full = head(hidden)
    assert torch.equal(head.top(hidden, 1)[:, 0], full.argmax(-1))
    assert int(head.top(hidden, 1)[0, 0]) == 5
    assert torch.equal(full.gather(-1, head.top(hidden, 3)), full.topk(3).values)  # the same scores (tied ids in any order)
    assert head.top(hidden, 9).shape == (7, 6)  # never past the subset: no -inf token is a candidate
    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=6)
    draft.vocab_ids = torch.tensor([1, 4, 9, 33, 50])
    with torch.inference_mode():
        out = target.forward(torch.tensor([[5, 17, 33, 2]]), target.new_cache(), draft.cfg.target_layer_ids)
        head = draft.head_for(target.lm_head)
        args = (target.embed_tokens, head)
        tokens = draft.block_top(*args, DraftCache(len(draft.layers)), out.taps, 2, 4, 6, 1)
        logits = draft.block_logits(*args, DraftCache(len(draft.layers)), out.taps, 2, 4, 6)
    assert torch.equal(tokens[:, 0], logits.argmax(-1)) and set(tokens.flatten().tolist()) <= {1, 4, 9, 33, 50}


def test_checkpoint_with_a_subset_round_trips_and_the_reference_still_loads_it(tmp_path):
    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=8)
    draft.vocab_ids = torch.tensor([1, 4, 9, 33])
    save_draft(draft, tmp_path / "d")
    assert (tmp_path / "d" / VOCAB_FILE).exists()
    again = load_draft(tmp_path / "d")
    assert torch.equal(again.vocab_ids, draft.vocab_ids)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert "draft_vocab_size" not in cfg  # peers would size a head by it: the subset stays ours
    draft.vocab_ids = None
    save_draft(draft, tmp_path / "d")  # saving without a subset removes the stale file
    assert not (tmp_path / "d" / VOCAB_FILE).exists()
    save_vocab(tmp_path / "d", torch.tensor([1, 4, 9, 33]), VOCAB)
    pytest.importorskip("dflash")
    from dflash.model import DFlashDraftModel

    ref = DFlashDraftModel.from_pretrained(str(tmp_path / "d"), dtype=torch.float32).eval()
    ours = load_draft(tmp_path / "d")
    for name, tensor in ours.state_dict().items():
        assert torch.equal(ref.state_dict()[name], tensor), name


def test_cli_vocab_from_a_data_directory(tmp_path, capsys):
    target = tiny_target("llama")
    draft = tiny_draft(target)
    save_draft(draft, tmp_path / "d")
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"id": str(i), "split": "train", "input_ids": [1, 2, 3, 7, 7, 8], "loss_mask": [0, 0, 0, 1, 1, 1]}
            for i in range(3)]
    (data / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["vocab", "--draft", str(tmp_path / "d"), "--size", "5", "--data", str(data)]) == 0
    assert "covering 100.0%" in capsys.readouterr().out
    assert load_draft(tmp_path / "d").vocab_ids.tolist() == [7, 8]  # only response tokens count
    assert main(["vocab", "--draft", str(tmp_path / "d"), "--size", "0"]) == 0
    assert load_draft(tmp_path / "d").vocab_ids is None
    assert main(["vocab", "--draft", str(tmp_path / "d"), "--size", "5"]) == 2  # neither --data nor --source
