"""The training pipeline on a tiny target: anchors, mask, loss, train/inference parity, resume, DDP."""

import json
import os
import subprocess
import sys

import pytest
import torch

from blockdraft.errors import BlockdraftError
from blockdraft.training import train as T
from blockdraft.training.data import _read_done, load_samples, split_of
from blockdraft.training.state import latest_state, load_state
from blockdraft.models.draft import DraftCache

from conftest import tiny_draft, tiny_target


def test_anchors_inside_response_and_before_s_minus_b():
    mask = [0] * 10 + [1] * 30
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        a = T.sample_anchors(mask, 8, 16, gen)
        assert len(a) == 8 and len(set(a.tolist())) == 8
        assert all(mask[i] == 1 and i <= len(mask) - 16 for i in a.tolist())
    assert len(T.sample_anchors([0] * 20 + [1] * 5, 8, 16, gen)) == 0  # no room for a block


def test_block_mask_equals_definition():
    anchors, S, B = torch.tensor([3, 9, 14]), 20, 4
    m = T.block_mask(anchors, S, B)
    assert m.shape == (12, 20 + 12)
    for q in range(12):
        b = q // B
        for k in range(S + 12):
            expected = k < anchors[b] if k < S else (k - S) // B == b
            assert m[q, k].item() == bool(expected)


def test_loss_weights_decay():
    w = T.loss_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0
    torch.testing.assert_close(w[7], torch.tensor(float(torch.exp(torch.tensor(-1.0)))))
    assert T.default_gamma(16) == 7 and T.default_gamma(10) == 5 and T.default_gamma(8) == 4


def test_training_forward_of_a_block_equals_inference_forward():
    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=6)
    torch.manual_seed(0)
    S, anchors = 30, torch.tensor([7, 15, 21])
    taps = torch.randn(1, S, 3 * 64)
    ids = torch.randint(0, 90, (S,))
    block_ids = torch.full((1, 18), draft.cfg.mask_token_id)
    block_ids[0, ::6] = ids[anchors]
    pos = (anchors[:, None] + torch.arange(6)).reshape(1, -1)
    with torch.no_grad():
        packed = draft(target.embed_tokens(block_ids), pos, taps, torch.arange(S), None,
                       T.block_mask(anchors, S, 6)[None, None])
        for b, a in enumerate(anchors.tolist()):
            cache = DraftCache(len(draft.layers))
            single = draft(target.embed_tokens(block_ids[:, 6 * b: 6 * b + 6]), torch.arange(a, a + 6),
                           taps[:, :a], torch.arange(a), cache)
            torch.testing.assert_close(packed[:, 6 * b: 6 * b + 6], single, rtol=1e-5, atol=1e-5)


def test_split_is_deterministic_and_data_resume_drops_partial_line(tmp_path):
    assert split_of("abc", 50) == split_of("abc", 50)
    f = tmp_path / "samples.jsonl"
    f.write_text(json.dumps({"id": "a"}) + "\n" + json.dumps({"id": "b"}) + "\n" + '{"id": "c", "inp')
    assert _read_done(f) == {"a", "b"}
    assert f.read_text().endswith("}\n")  # the torn line is gone, so appending cannot duplicate


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny target saved as a local HF directory, and a data directory in `blockdraft data` format."""
    root = tmp_path_factory.mktemp("run")
    target = tiny_target("llama")
    target.model.save_pretrained(root / "target")
    gen = torch.Generator().manual_seed(0)
    (root / "data").mkdir()
    with open(root / "data" / "samples.jsonl", "w") as f:
        for i in range(12):
            n_prompt, n_resp = 5 + i % 4, 30 + 3 * i
            ids = torch.randint(0, 90, (n_prompt + n_resp,), generator=gen).tolist()
            f.write(json.dumps({"id": str(i), "split": "train", "input_ids": ids,
                                "loss_mask": [0] * n_prompt + [1] * n_resp}) + "\n")
    return root


def _cfg(root, out, **kw):
    base = dict(data=str(root / "data"), out=str(out), target=str(root / "target"), num_layers=2,
                block_size=6, anchors=4, batch_size=4, max_steps=6, lr=3e-3, log_every=1, save_every=3)
    return T.TrainConfig(**{**base, **kw})


def _losses(out):
    rows = [json.loads(line) for line in open(out / "log.jsonl")]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_resume_after_interruption_gives_the_same_next_loss(tiny_run, monkeypatch):
    T.train(_cfg(tiny_run, tiny_run / "full"), progress=False)
    full = _losses(tiny_run / "full")
    real_lr = T.lr_at

    def crash_at_4(step, cfg, elapsed=0.0):
        if step == 4:
            raise KeyboardInterrupt  # killed after the step-3 checkpoint
        return real_lr(step, cfg, elapsed)

    monkeypatch.setattr(T, "lr_at", crash_at_4)
    with pytest.raises(KeyboardInterrupt):
        T.train(_cfg(tiny_run, tiny_run / "cut"), progress=False)
    monkeypatch.setattr(T, "lr_at", real_lr)
    with pytest.raises(Exception, match="--resume"):
        T.train(_cfg(tiny_run, tiny_run / "cut"), progress=False)
    T.train(_cfg(tiny_run, tiny_run / "cut"), resume=True, progress=False)
    cut = _losses(tiny_run / "cut")
    assert full[1] > full[6]  # it learns
    for step in (4, 5, 6):
        assert cut[step] == pytest.approx(full[step], rel=1e-4), step


def _torchrun(tiny_run, out: str, port: int, *extra: str, steps: int = 3) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "blockdraft.cli", "train", "--data", str(tiny_run / "data"), "--out", str(tiny_run / out),
           "--target", str(tiny_run / "target"), "--num-layers", "2", "--block-size", "6", "--anchors", "4",
           "--batch-size", "4", "--max-steps", str(steps), "--lr", "3e-3", "--log-every", "1", "--save-every", "3",
           *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[:4000] + "\n...\n" + proc.stderr[-2000:]


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "drafter" / "model.safetensors"))


def _assert_same_training(one: dict, two: dict) -> None:
    # fp32 all-reduce order differs from a single sum; Adam amplifies that to ~1e-4 after 3 steps
    # (a wrong shard or normalisation moves weights by ~lr = 3e-3 per step)
    assert one.keys() == two.keys()
    for k in one:
        torch.testing.assert_close(one[k], two[k], rtol=1e-3, atol=5e-4)


def test_two_process_ddp_matches_one_process(tiny_run):
    T.train(_cfg(tiny_run, tiny_run / "one", max_steps=3), progress=False)
    _torchrun(tiny_run, "two", 29517)
    _assert_same_training(_weights(tiny_run / "one"), _weights(tiny_run / "two"))


def test_two_process_fsdp_matches_one_process_and_resumes(tiny_run):
    """FSDP shards the drafter's weights, gradients and Adam moments over the processes; the run
    saves whole tensors, so it equals one process, and a sharded run resumes from them."""
    T.train(_cfg(tiny_run, tiny_run / "one3", max_steps=3), progress=False)
    _torchrun(tiny_run, "fsdp", 29518, "--parallel", "fsdp")
    _assert_same_training(_weights(tiny_run / "one3"), _weights(tiny_run / "fsdp"))
    one_state = load_state(latest_state(tiny_run / "one3"))
    fsdp_state = load_state(latest_state(tiny_run / "fsdp"))
    assert fsdp_state.step == 3
    for idx, st in one_state.optimizer["state"].items():  # the Adam moments, gathered whole
        torch.testing.assert_close(st["exp_avg"], fsdp_state.optimizer["state"][idx]["exp_avg"], rtol=1e-2, atol=1e-5)
    # 3 more steps, sharded, from the whole tensors saved; against one process doing the same (the
    # schedule follows --max-steps, so a 3-step run continued to 6 is not a 6-step run)
    T.train(_cfg(tiny_run, tiny_run / "one3", max_steps=6), resume=True, progress=False)
    _torchrun(tiny_run, "fsdp", 29519, "--parallel", "fsdp", "--resume", steps=6)
    _assert_same_training(_weights(tiny_run / "one3"), _weights(tiny_run / "fsdp"))
    with pytest.raises(BlockdraftError, match="--parallel"):
        T.train(_cfg(tiny_run, tiny_run / "bad", parallel="zero3"), progress=False)


def test_init_from_a_saved_drafter_continues_from_its_weights(tiny_run):
    from blockdraft.models.checkpoint import load_draft

    T.train(_cfg(tiny_run, tiny_run / "first", max_steps=3), progress=False)
    first = load_draft(tiny_run / "first" / "drafter")
    # lr 0: the continued run must export exactly what it started from (tap scale unfolded, refolded)
    T.train(_cfg(tiny_run, tiny_run / "again", max_steps=1, lr=0.0, init=str(tiny_run / "first" / "drafter")),
            progress=False)
    again = load_draft(tiny_run / "again" / "drafter")
    for (name, a), b in zip(first.state_dict().items(), again.state_dict().values()):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-3, atol=1e-5, msg=name)
    with pytest.raises(Exception, match="layers"):
        T.train(_cfg(tiny_run, tiny_run / "bad", num_layers=3, init=str(tiny_run / "first" / "drafter")),
                progress=False)


def test_prompt_jsonl_may_be_gzipped(tmp_path):
    import gzip

    from blockdraft.training.data import iter_jsonl

    rows = [{"id": "a", "prompt": "hi"}, {"messages": [{"role": "user", "content": "yo"}], "response": "r"}]
    with gzip.open(tmp_path / "p.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    got = list(iter_jsonl(tmp_path / "p.jsonl.gz"))
    assert [(p.id, p.messages[0]["content"], p.response) for p in got] == [("a", "hi", None), ("1", "yo", "r")]


def test_final_log_has_heldout_tau_and_full_vocabulary_accuracy(tiny_run, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_run / "data", data)
    lines = (data / "samples.jsonl").read_text().splitlines()
    for k in (0, 1):  # two held-out sequences
        rec = json.loads(lines[k])
        rec.update(id=f"h{k}", split="heldout")
        lines.append(json.dumps(rec))
    (data / "samples.jsonl").write_text("\n".join(lines) + "\n")
    T.train(_cfg(tiny_run, tmp_path / "out", data=str(data), max_steps=2, head_vocab=16, eval_prompts=2,
                 eval_every=2, eval_tokens=8), progress=False)
    rows = [json.loads(x) for x in open(tmp_path / "out" / "log.jsonl")]
    assert [r["step"] for r in rows if "heldout_tau" in r] == [0, 2, 2]  # the start, step 2, the end
    final = rows[-1]
    assert final["final"] and final["heldout_tau"] >= 1.0
    assert len(final["heldout_acc"]) == 5 and all(0 <= a <= 1 for a in final["heldout_acc"])


def test_target_labels_come_from_the_targets_own_predictions(tiny_run):
    from blockdraft.training.features import prefill

    target = tiny_target("llama")
    seqs = [[1, 5, 9, 2, 7, 7, 3], [4, 4, 8]]
    greedy = prefill(target, seqs, predictions=True, chunk=4).predictions
    for s, g in zip(seqs, greedy):  # batched with right padding == each sequence alone
        alone = target.forward(torch.tensor([s]), target.new_cache()).logits[0].argmax(-1).tolist()
        assert g == alone

    samples = [json.loads(x) for x in open(tiny_run / "data" / "samples.jsonl")][:2]
    cfg = _cfg(tiny_run, tiny_run / "unused", block_size=4, anchors=3)

    from blockdraft.training.features import Features

    class Feats(Features):
        def get(self, i):
            return torch.zeros(len(samples[i]["input_ids"]), 8)

    def batch(labels, smp):
        return T.make_batch(smp, Feats(), [0, 1], T.TrainConfig(**{**cfg.__dict__, "labels": labels}), 95,
                            lambda j: torch.Generator().manual_seed(j))
    # data whose stored predictions are its own next tokens (greedy-regenerated data) gives the same labels
    same = [{**s, "target_next": s["input_ids"][1:] + [0]} for s in samples]
    assert torch.equal(batch("data", samples).labels, batch("target", same).labels)
    # otherwise the labels are the predictions: label of block position k at anchor a = pred[a + k - 1]
    pred = [{**s, "target_next": [(t * 7 + 1) % 90 for t in range(len(s["input_ids"]))]} for s in samples]
    b = batch("target", pred)
    anchors = b.positions[:, ::4]  # [bs, N]
    for r in range(2):
        for a_i, a in enumerate(anchors[r].tolist()):
            if b.weights[r, a_i].sum() > 0:
                assert b.labels[r, a_i].tolist() == [pred[r]["target_next"][a + k - 1] for k in (1, 2, 3)]


def test_merge_data_fills_target_labels_and_copies_cached_features(tiny_run, tmp_path):
    """`blockdraft merge-data`: regenerated data gets target_next = its own next tokens, ids stay
    unique, held-out comes from the regenerated source, and copied features equal the source's."""
    import shutil

    from blockdraft.training.features import CachedFeatures, build_feature_cache, feature_dir

    target = tiny_target("llama")
    regen, orig = tmp_path / "regen", tmp_path / "orig"
    shutil.copytree(tiny_run / "data", regen)
    rows = [json.loads(x) for x in open(regen / "samples.jsonl")]
    rows[0]["split"] = "heldout"
    (regen / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    orig.mkdir()
    (orig / "samples.jsonl").write_text("".join(
        json.dumps({**r, "split": "heldout" if i == 1 else "train", "target_next": [3] * len(r["input_ids"])}) + "\n"
        for i, r in enumerate(rows[:5])))
    for d, kind in ((regen, "target"), (orig, "dataset")):
        (d / "manifest.json").write_text(json.dumps({"settings": {"responses": kind}}))
    taps = [1, 3, 5]
    build_feature_cache(regen, "train", [r for r in rows if r["split"] == "train"], target, taps, progress=False)
    from blockdraft.cli import main

    assert main(["merge-data", str(tmp_path / "mix"), str(regen), str(orig)]) == 0
    assert not (tmp_path / "mix.partial").exists()
    assert main(["merge-data", str(tmp_path / "mix"), str(regen)]) == 2  # not over an earlier merge
    assert main(["merge-data", str(tmp_path / "bad"), str(regen), str(tmp_path)]) == 2  # not a data directory
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.partial").exists()
    train = load_samples(tmp_path / "mix", "train")
    held = load_samples(tmp_path / "mix", "heldout")
    assert len(train) == 11 + 4 and [r["id"] for r in held] == ["regen/0"]  # orig's held-out left out
    assert len({r["id"] for r in train}) == len(train)
    for r in train:
        if r["id"].startswith("regen/"):
            assert r["target_next"][:-1] == r["input_ids"][1:]
        else:
            assert set(r["target_next"]) == {3}
    assert json.loads((feature_dir(tmp_path / "mix", "train", taps) / "progress.json").read_text())["done"] == 11
    feats = build_feature_cache(tmp_path / "mix", "train", train, target, taps, progress=False)  # computes the rest
    src = CachedFeatures(feature_dir(regen, "train", taps))
    assert torch.equal(feats.get(0), src.get(0)) and torch.equal(feats.get(10), src.get(10))
    alone = target.forward(torch.tensor([train[12]["input_ids"]]), target.new_cache(), taps, logits_at=1).taps[0]
    torch.testing.assert_close(feats.get(12), alone.half().float())
    # a second merge of the same sources reuses the first merge's cache (--cache-from): all rows copied
    (tmp_path / "mix2.partial").mkdir()  # left by an interrupted merge: started again
    (tmp_path / "mix2.partial" / "samples.jsonl").write_text("half")
    assert main(["merge-data", str(tmp_path / "mix2"), str(regen), str(orig), "--cache-from", str(tmp_path / "mix")]) == 0
    again = CachedFeatures(feature_dir(tmp_path / "mix2", "train", taps))
    assert json.loads((feature_dir(tmp_path / "mix2", "train", taps) / "progress.json").read_text())["done"] == 15
    assert [r["id"] for r in load_samples(tmp_path / "mix2", "train")] == [r["id"] for r in train]
    assert all(torch.equal(again.get(i), feats.get(i)) for i in range(15))


def test_a_feature_cache_grows_with_its_data_but_refuses_other_samples(tmp_path):
    from blockdraft.errors import BlockdraftError
    from blockdraft.training.features import build_feature_cache

    target = tiny_target("llama")
    rows = [{"id": str(i), "input_ids": list(range(5, 10 + i))} for i in range(4)]
    build_feature_cache(tmp_path, "train", rows[:2], target, [1, 3], progress=False)
    grown = build_feature_cache(tmp_path, "train", rows, target, [1, 3], progress=False)
    for i in (0, 3):
        alone = target.forward(torch.tensor([rows[i]["input_ids"]]), target.new_cache(), [1, 3], logits_at=1).taps[0]
        torch.testing.assert_close(grown.get(i), alone.half().float())
    with pytest.raises(BlockdraftError, match="built from other samples"):
        build_feature_cache(tmp_path, "train", rows[1:], target, [1, 3], progress=False)


def test_online_features_of_a_batch_equal_each_sample_alone(tiny_run):
    from blockdraft.models.target import load_target
    from blockdraft.training.features import OnlineFeatures

    target = load_target(str(tiny_run / "target"))
    samples = load_samples(str(tiny_run / "data"), "train")
    feats = OnlineFeatures(target, samples, [0, 1])
    many = feats.get_many([3, 0, 7], max_len=40)  # lengths 47, 35, 59: the first and last cut at 40
    assert [m.shape[0] for m in many] == [40, 35, 40]
    for got, i in zip(many, [3, 0, 7]):
        torch.testing.assert_close(got, feats.get(i)[:40], rtol=1e-4, atol=1e-5)


def test_a_time_budget_decays_the_rate_by_time_when_time_runs_out_first():
    cfg = T.TrainConfig(data="d", out="o", lr=1.0, warmup=0.0, max_steps=1000, time_budget_minutes=10)
    assert T.lr_at(10, cfg, 0.0) == pytest.approx(T.lr_at(10, T.TrainConfig(data="d", out="o", lr=1.0,
                                                                            warmup=0.0, max_steps=1000)))
    assert T.lr_at(10, cfg, 300.0) == pytest.approx(0.55)  # half the time: half way down the cosine
    assert T.lr_at(10, cfg, 600.0) == pytest.approx(0.1)  # the budget spent: the floor
    assert T.lr_at(900, cfg, 60.0) < T.lr_at(10, cfg, 60.0)  # steps further along than time: steps lead
