"""The ablation study's drafter variants on tiny models: input fusion (EAGLE-3's way) and no
target context; their training forward, decoding, save/load and refusals elsewhere."""

import json
from pathlib import Path

import pytest
import torch

from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.errors import BlockdraftError
from blockdraft.models.checkpoint import STUDY_ARCHITECTURE, load_draft, save_draft
from blockdraft.models.draft import DraftCache, DraftModel, build_draft_config
from blockdraft.training import train as T

from conftest import tiny_target
from test_train import _cfg, tiny_run  # noqa: F401  (the module's fixture)


def _variant(target, conditioning="input", num_taps=3, block_size=6, seed=1):
    torch.manual_seed(seed)
    cfg = build_draft_config(target.config, num_layers=2, block_size=block_size, num_taps=num_taps,
                             mask_token_id=target.vocab_size - 1, conditioning=conditioning)
    return DraftModel(cfg).eval()


def test_input_fusion_packed_training_forward_equals_incremental_inference():
    target = tiny_target("llama")
    draft = _variant(target)
    torch.manual_seed(0)
    S, B, anchors = 30, 6, torch.tensor([7, 15, 21])
    taps = torch.randn(1, S, 3 * 64)
    ids = torch.randint(0, 90, (S,))
    block_ids = torch.full((1, 3 * B), draft.cfg.mask_token_id)
    block_ids[0, ::B] = ids[anchors]
    pos = (anchors[:, None] + torch.arange(B)).reshape(1, -1)
    with torch.no_grad():
        packed = draft(target.embed_tokens(block_ids), pos, taps, torch.arange(S), None,
                       T.block_mask(anchors, S, B)[None, None])
        for b, a in enumerate(anchors.tolist()):
            block = target.embed_tokens(block_ids[:, B * b: B * b + B])
            cache = DraftCache(len(draft.layers))
            whole = draft(block, torch.arange(a, a + B), taps[:, :a], torch.arange(a), cache)
            # the context in two pieces, as decoding commits it, with a block in between
            cache = DraftCache(len(draft.layers))
            draft(block, torch.arange(4, 4 + B), taps[:, :4], torch.arange(4), cache)
            split = draft(block, torch.arange(a, a + B), taps[:, 4:a], torch.arange(4, a), cache)
            torch.testing.assert_close(packed[:, B * b: B * b + B], whole, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    # input fusion is not KV injection: the same weights give other outputs
    kv = _variant(target, conditioning="kv")
    kv.load_state_dict(draft.state_dict())
    with torch.no_grad():
        other = kv(target.embed_tokens(block_ids[:, :B]), torch.arange(7, 7 + B), taps[:, :7], torch.arange(7),
                   DraftCache(2))
    assert not torch.allclose(other, packed[:, :B], atol=1e-3)


@pytest.mark.parametrize("conditioning,num_taps", [("input", 3), ("kv", 0), ("input", 0)])
def test_variants_decode_losslessly_and_round_trip(tmp_path, conditioning, num_taps):
    target = tiny_target("llama")
    draft = _variant(target, conditioning, num_taps)
    assert not draft.cfg.standard
    if num_taps == 0:
        assert draft.cfg.target_layer_ids == [-1]
    save_draft(draft, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == [STUDY_ARCHITECTURE]
    back = load_draft(tmp_path / "d")
    assert back.cfg.conditioning == conditioning and back.cfg.target_layer_ids == draft.cfg.target_layer_ids
    for k, v in draft.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v)
    prompt = torch.randint(0, 90, (12,)).tolist()
    plain = Engine(target).generate(prompt, GenerationConfig(max_new_tokens=30)).token_ids
    out = Engine(target, back).generate(prompt, GenerationConfig(max_new_tokens=30, block_size=6))
    assert out.token_ids == plain


def test_a_variant_is_refused_by_export(tmp_path):
    from blockdraft.cli.export import peer_command

    target = tiny_target("llama")
    save_draft(_variant(target), tmp_path / "d")
    with pytest.raises(BlockdraftError, match="ablate"):
        peer_command("vllm", "smollm2-135m", str(tmp_path / "d"), None, "float32", 8000, None, "python", True)


def test_bad_conditioning_is_refused():
    from blockdraft.models.draft import init_scale_check

    cfg = build_draft_config(tiny_target("llama").config, num_layers=1, conditioning="cross")
    with pytest.raises(BlockdraftError, match="conditioning"):
        init_scale_check(cfg)


def test_split_anchors_cut_the_response_into_consecutive_blocks():
    mask = [0] * 10 + [1] * 40
    gen = torch.Generator().manual_seed(0)
    a = T.sample_anchors(mask, 16, 8, gen, "split")
    assert a.tolist() == [10, 18, 26, 34, 42]  # all grid points that leave room for a block
    assert T.sample_anchors(mask, 2, 8, gen, "split").tolist() in ([10, 18], [10, 26], [10, 34], [10, 42],
                                                                 [18, 26], [18, 34], [18, 42], [26, 34],
                                                                 [26, 42], [34, 42])


@pytest.mark.parametrize("kw", [dict(conditioning="input"), dict(num_taps=0, conditioning="input"),
                                dict(num_taps=1), dict(gamma=float("inf"), anchor_mode="split")])
def test_a_variant_trains_and_saves(tiny_run, kw):  # noqa: F811
    name = "-".join(f"{k}{v}" for k, v in kw.items())
    path = T.train(_cfg(tiny_run, tiny_run / f"v-{name}", max_steps=4, **kw), progress=False)
    losses = [json.loads(line)["loss"] for line in open(tiny_run / f"v-{name}" / "log.jsonl") if "loss" in line]
    assert len(losses) == 4 and all(x == x for x in losses)
    d = load_draft(path)
    assert d.cfg.conditioning == kw.get("conditioning", "kv")
    assert len(d.cfg.target_layer_ids) == max(1, kw.get("num_taps", 5))


def test_fewer_taps_read_the_columns_of_a_wider_cache(tiny_run):  # noqa: F811
    from blockdraft.training.data import load_samples
    from blockdraft.training.features import SlicedFeatures, build_feature_cache, sliced_cache
    from blockdraft.models.target import load_target

    target = load_target(str(tiny_run / "target"))
    samples = load_samples(str(tiny_run / "data"), "train")
    wide = build_feature_cache(str(tiny_run / "data"), "train", samples, target, [0, 2, 4], progress=False)
    sub = sliced_cache(str(tiny_run / "data"), "train", samples, [2, 4], target.hidden_size)
    assert isinstance(sub, SlicedFeatures)
    for i in (0, 5):
        ids = torch.tensor([samples[i]["input_ids"]])
        direct = target.forward(ids, target.new_cache(), [2, 4], logits_at=1).taps[0].half().float()
        torch.testing.assert_close(sub.get(i), direct, rtol=2e-3, atol=1e-4)  # fp16 storage; batched prefill
        assert sub.get(i).shape[1] == wide.get(i).shape[1] * 2 // 3
    assert sliced_cache(str(tiny_run / "data"), "train", samples[:3], [2], target.hidden_size) is None


def _study(tiny_run, tmp_path, monkeypatch, **kw):  # noqa: F811
    """Study settings over a small random data directory; the prompt sets replaced by random ones."""
    from blockdraft.lab import ablate as A

    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    gen = torch.Generator().manual_seed(3)
    with open(data / "samples.jsonl", "w") as f:
        for i in range(14):
            ids = torch.randint(0, 90, (40,), generator=gen).tolist()
            f.write(json.dumps({"id": str(i), "split": "heldout" if i < 2 else "train", "input_ids": ids,
                                "loss_mask": [0] * 8 + [1] * 32, "target_next": ids[1:] + [0]}) + "\n")
    prompts = [torch.randint(0, 90, (10,), generator=gen).tolist() for _ in range(2)]
    refs = [torch.randint(0, 90, (12,), generator=gen).tolist() for _ in range(2)]
    monkeypatch.setattr(A, "load_prompt_sets", lambda s, target: {"humaneval": (prompts, refs),
                                                                  "mt-bench": (prompts, refs)})
    return A.StudySettings(**{**dict(data=str(data), runs=str(tmp_path / "runs"), out=str(tmp_path / "out"),
                                     target=str(tiny_run / "target"), steps=3, prompts=2, max_new_tokens=12), **kw})


def test_a_killed_study_continues_with_the_runs_it_lacks(tiny_run, tmp_path, monkeypatch):  # noqa: F811
    from blockdraft.lab import ablate as A

    s = _study(tiny_run, tmp_path, monkeypatch)
    trained = []
    real_train = A.train_run

    def spy(settings, run):
        trained.append(run.name)
        if run.name == "uniform-loss" and trained.count("uniform-loss") == 1:
            raise KeyboardInterrupt  # killed before its second run trains
        return real_train(settings, run)

    monkeypatch.setattr(A, "train_run", spy)
    with pytest.raises(KeyboardInterrupt):
        A.run_studies(s, ["decay"], "blockdraft ablate decay")
    assert (tmp_path / "runs" / "base" / "score.json").exists() and not (tmp_path / "out" / "decay.md").exists()
    trains, real_t = [], T.train
    monkeypatch.setattr(T, "train", lambda cfg, resume=False, progress=True: trains.append(cfg.out) or
                        real_t(cfg, resume=resume, progress=False))
    A.run_studies(s, ["decay"], "blockdraft ablate decay")
    assert [Path(p).name for p in trains] == ["uniform-loss"]  # the base run was not trained again
    table = (tmp_path / "out" / "decay.md").read_text()
    assert "| base |" in table and "| uniform-loss |" in table and "blockdraft ablate decay" in table
    report = json.loads((tmp_path / "out" / "decay.json").read_text())
    assert [r["run"] for r in report["runs"]] == ["base", "uniform-loss"]
    assert all(len(r["heldout_acc"]) == 15 for r in report["runs"])  # block 16: positions 1..15
    # one shape, one cost measurement: the predicted speeds differ by tau only
    a, b = (r["blocks"]["16"] for r in report["runs"])
    assert a["costs"] == b["costs"] and a["costs"]["t_verify_ms"] > 0
    assert a["predicted_speedup"]["humaneval"] == pytest.approx(A.predicted_speedup(a["tau"]["humaneval"], a["costs"]),
                                                                abs=1e-3)
    assert (tmp_path / "out" / "decay.png").stat().st_size > 0
    # another setting in the same runs directory is refused, not mixed in
    with pytest.raises(BlockdraftError, match="other settings"):
        A.run_studies(A.StudySettings(**{**s.__dict__, "steps": 4}), ["decay"], "x")
    # a continued drafter: its own score comes first, as where every run started
    cont = A.StudySettings(**{**s.__dict__, "init": str(tmp_path / "runs" / "base" / "drafter"),
                              "runs": str(tmp_path / "cont"), "out": str(tmp_path / "out-cont")})
    A.run_studies(cont, ["decay"], "blockdraft ablate decay --init DIR")
    runs = json.loads((tmp_path / "out-cont" / "decay.json").read_text())["runs"]
    assert [r["run"] for r in runs] == ["start", "base", "uniform-loss"]
    base_log = [json.loads(line) for line in open(tmp_path / "cont" / "base" / "log.jsonl")]
    assert runs[0]["heldout_acc"] == base_log[0]["heldout_acc"] and base_log[0]["step"] == 0


def test_runs_side_by_side_score_as_the_serial_study_does(tiny_run, tmp_path, monkeypatch):  # noqa: F811
    """--jobs 2: worker processes train and score the runs (the prompt sets travel from the parent);
    same seeds, same data, so the same scores as one after the other; the table is written once
    all are in, and its costs come from fresh drafters of each run's shape."""
    from blockdraft.lab import ablate as A

    serial = _study(tiny_run, tmp_path, monkeypatch, runs=str(tmp_path / "serial"), out=str(tmp_path / "o1"))
    A.run_studies(serial, ["injection"], "x")
    jobs = A.StudySettings(**{**serial.__dict__, "runs": str(tmp_path / "jobs"), "out": str(tmp_path / "o2"),
                              "jobs": 2})
    A.run_studies(jobs, ["injection"], "x")
    for name in ("base", "input-fusion"):
        a, b = (json.loads((tmp_path / d / name / "score.json").read_text()) for d in ("serial", "jobs"))
        assert a["heldout_acc"] == b["heldout_acc"] and a["blocks"] == b["blocks"]
    runs = json.loads((tmp_path / "o2" / "injection.json").read_text())["runs"]
    assert [r["run"] for r in runs] == ["base", "input-fusion"]
    # two shapes: each its own draft forward, one measurement of the target shared by both
    c0, c1 = (r["blocks"]["16"]["costs"] for r in runs)
    assert (c0["t1_ms"], c0["t_verify_ms"]) == (c1["t1_ms"], c1["t_verify_ms"])
    # the weights are not needed to time a run's shape
    (tmp_path / "jobs" / "base" / "drafter" / "model.safetensors").unlink()
    from blockdraft.models.target import load_target

    cost = A.step_costs(jobs, A.BASE, 16, load_target(jobs.target), [1, 2, 3])
    assert cost["t_draft_ms"] > 0


def test_soft_labels_of_one_token_give_the_hard_loss_and_a_run_trains_on_them(tiny_run):  # noqa: F811
    from dataclasses import replace

    from blockdraft.models.target import load_target
    from blockdraft.training.soft_labels import soft_dir, split_rows
    from blockdraft.training.features import CachedFeatures, OnlineFeatures
    from blockdraft.training.data import load_samples

    target = load_target(str(tiny_run / "target"))
    draft = _variant(target, "kv", 3, block_size=6)
    samples = load_samples(str(tiny_run / "data"), "train")
    feats = OnlineFeatures(target, samples, draft.cfg.target_layer_ids)
    cfg = _cfg(tiny_run, tiny_run / "unused")
    batch = T.make_batch(samples, feats, [0, 1], cfg, draft.cfg.mask_token_id, lambda j: torch.Generator().manual_seed(j))
    one_hot = replace(batch, soft_ids=batch.labels[..., None], soft_p=torch.ones(*batch.labels.shape, 1))
    rows = torch.arange(target.vocab_size)
    for r in (None, rows):
        hard, soft = (T.training_forward(draft, target, b, None, r)[0] for b in (batch, one_hot))
        torch.testing.assert_close(hard, soft)
    path = T.train(_cfg(tiny_run, tiny_run / "soft", max_steps=3, soft_labels=4, head_vocab=16), progress=False)
    prompt = samples[0]["input_ids"][:6]  # the trained drafter loads and decodes exactly
    cfg = GenerationConfig(max_new_tokens=12, stop_token_ids=(), lookup=False)
    plain = Engine(target).generate(prompt, cfg).token_ids
    assert Engine(target, load_draft(path)).generate(prompt, cfg).token_ids == plain
    cache = CachedFeatures(soft_dir(str(tiny_run / "data"), "train", 4), __import__("numpy").float32, "topk.f32")
    ids, p = split_rows(cache.get(2))
    logits = target.forward(torch.tensor([samples[2]["input_ids"]]), target.new_cache()).logits[0]  # [S, V]
    assert ids[:, 0].tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(p.sum(-1), torch.ones(len(ids)))
    assert (p[:, 0] >= p[:, 1]).all()


def test_a_continued_drafter_is_refused_for_studies_that_change_its_shape(tmp_path):
    from blockdraft.lab import ablate as A

    s = A.StudySettings(data=str(tmp_path), init=str(tmp_path / "drafter"))
    for study in ("layers", "taps", "injection", "context"):
        with pytest.raises(BlockdraftError, match="--init target"):
            A.run_studies(s, [study], "x")
    with pytest.raises(BlockdraftError, match="unknown studies"):
        A.run_studies(s, ["depth"], "x")


def test_a_continued_drafter_gains_taps_and_predicts_as_before(tiny_run, tmp_path, monkeypatch):  # noqa: F811
    """The more-taps study continues a drafter with more taps: its fc columns move to its taps'
    places among the new ones and the new taps' columns start at zero, so the widened drafter
    projects the context exactly as before; fewer or other taps are refused."""
    from blockdraft.models.target import load_target
    from blockdraft.lab import ablate as A
    from blockdraft.training.warmstart import init_from_drafter, tap_columns

    assert tap_columns([1, 8, 14, 20, 27], [1, 4, 8, 11, 14, 17, 20, 24, 27]) == [0, 2, 4, 6, 8]
    assert tap_columns([1, 2, 2], [2, 1, 2]) == [1, 0, 2]  # a repeated layer takes one place each
    assert tap_columns([1, 3], [1, 2]) is None and tap_columns([2, 2], [2, 1]) is None
    target = load_target(str(tiny_run / "target"))
    torch.manual_seed(4)
    src = DraftModel(build_draft_config(target.config, num_layers=3, block_size=16, num_taps=5,
                                        mask_token_id=target.vocab_size - 1))
    save_draft(src, tmp_path / "five", dtype=torch.float32)
    src = load_draft(tmp_path / "five")
    wide = DraftModel(build_draft_config(target.config, num_layers=3, block_size=16, num_taps=9,
                                         mask_token_id=target.vocab_size - 1))
    init_from_drafter(wide, str(tmp_path / "five"), None)
    cols = tap_columns(src.cfg.target_layer_ids, wide.cfg.target_layer_ids)
    h = target.hidden_size
    x = torch.randn(3, len(wide.cfg.target_layer_ids) * h)  # [T, 9 * H]
    x_old = torch.cat([x[:, i * h:(i + 1) * h] for i in cols], -1)  # [T, 5 * H]: the old taps' blocks
    torch.testing.assert_close(wide.fc(x), src.fc(x_old))
    assert all(torch.equal(v, src.state_dict()[k]) for k, v in wide.state_dict().items() if k != "fc.weight")
    with pytest.raises(BlockdraftError, match="taps may only be added"):
        init_from_drafter(_variant(target, "kv", 3), str(tmp_path / "five"), None)
    # the study continues the drafter: the 9-tap run starts where the base run starts
    s = _study(tiny_run, tmp_path, monkeypatch, init=str(tmp_path / "five"), lr=3e-4, anchors=8)
    with pytest.raises(BlockdraftError, match="--init target"):
        A.run_studies(s, ["taps"], "x")  # fewer taps than the drafter has
    A.run_studies(s, ["more-taps"], "blockdraft ablate more-taps --init DIR")
    runs = json.loads((tmp_path / "out" / "more-taps.json").read_text())["runs"]
    assert [r["run"] for r in runs] == ["start", "base", "taps-9"]
    first = [json.loads(open(tmp_path / "runs" / n / "log.jsonl").readline()) for n in ("base", "taps-9")]
    assert first[0]["step"] == first[1]["step"] == 0
    assert first[0]["heldout_acc"] == pytest.approx(first[1]["heldout_acc"], abs=1e-3)
    assert len(load_draft(tmp_path / "runs" / "taps-9" / "drafter").cfg.target_layer_ids) == 9
    cfg = json.loads((tmp_path / "runs" / "taps-9" / "config.json").read_text())
    assert (cfg["lr"], cfg["anchors"], cfg["num_taps"]) == (3e-4, 8, 9)
