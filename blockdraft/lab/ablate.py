"""`blockdraft ablate`: DFlash's ablations (DFLASH.md), one change at a time, each scored by
held-out acceptance, resumable.

Every run of every study trains from the same data, seed and start (the target's last layers
copied into the draft layers, `--init target`; or, for the studies that keep the architecture, a
drafter continued, e.g. the bundled one: `--init bundled`) for the same number of steps of the same sequences
and the same number of block tokens (`steps x batch x anchors x block`; the block study doubles
the anchors of its block-8 run), changing one setting of a shared base. A run is scored by

- held-out accuracy per block position (acc@k: the k-th block position predicts the target's
  token, over the full vocabulary, at fixed random anchors of the data's held-out split),
- tau by replay (replay.py) on the first `prompts` HumanEval problems and MT-Bench first turns at
  each inference block the study names (neither set is in any training data), and
- the speed the cost model predicts against plain decoding, tau x t(1) / (t(B) + t_draft(B)),
  with the target's and this drafter's forwards timed in the same process.

Runs live in `runs/NAME/` (a `blockdraft train` directory plus `score.json`) and are shared by the
studies that contain them (the base run is in most). A killed study continues: a finished run is
not trained again, a cut one resumes from its last checkpoint, an unscored one is only scored.
Each study writes `OUT/STUDY.md` (its table and command), `OUT/STUDY.json` and `OUT/STUDY.png`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..errors import BlockdraftError


@dataclass(frozen=True)
class Run:
    name: str
    change: str  # what differs from the base, in words
    overrides: dict = field(default_factory=dict)  # TrainConfig fields


START = Run("start", "the drafter continued, not trained here (--init DIR only)")
BASE = Run("base", "base: 3 layers, 5 taps, KV injection, block 16, decayed loss, random anchors")
STUDIES: dict[str, tuple[list[Run], tuple[int, ...]]] = {  # runs, inference blocks
    "layers": ([Run("layers-1", "1 draft layer", {"num_layers": 1}), BASE,
                Run("layers-5", "5 draft layers", {"num_layers": 5}),
                Run("layers-8", "8 draft layers", {"num_layers": 8})], (16,)),
    "taps": ([Run("taps-1", "1 target tap", {"num_taps": 1}), Run("taps-3", "3 target taps", {"num_taps": 3}),
              BASE], (16,)),
    "injection": ([BASE, Run("input-fusion", "context fused into the input (EAGLE-3's way), not into every "
                             "layer's K/V", {"conditioning": "input"})], (16,)),
    "context": ([BASE, Run("no-context", "no target context: the context tokens' embeddings only, through "
                           "the draft layers", {"num_taps": 0, "conditioning": "input"})], (16,)),
    "block": ([Run("train-block-8", "trained at block 8 (32 anchors: equal block tokens)",
                   {"block_size": 8, "anchors": 32}), BASE], (4, 8, 16)),
    "decay": ([BASE, Run("uniform-loss", "uniform loss weights over block positions", {"gamma": float("inf")})],
              (16,)),
    "anchors": ([BASE, Run("split-anchors", "anchors on a fixed split of the response into blocks",
                           {"anchor_mode": "split"})], (16,)),
    "soft-labels": ([BASE, Run("soft-top8", "loss against the target's top-8 distribution, not its argmax",
                               {"soft_labels": 8})], (16,)),
    "more-taps": ([BASE, Run("taps-9", "9 target taps: the base's 5 and one between each two (continuing: the new "
                             "taps' fc columns start at zero)", {"num_taps": 9})], (16,)),
    "noise": ([BASE, Run("base-seed-1", "the base, seed 1", {"seed": 1}),
               Run("base-seed-2", "the base, seed 2", {"seed": 2})], (16,)),
}


ARCHITECTURE = {"num_layers", "num_taps", "conditioning"}  # what a continued drafter cannot change (it
#                                                           may gain taps: warmstart.tap_columns)


@dataclass
class StudySettings:
    data: str  # a `blockdraft data` directory with the target's labels (`merge-data` or --responses dataset)
    runs: str = "runs/ablate"
    out: str = "docs/ablations"
    target: str = "smollm2-135m"
    steps: int = 300
    prompts: int = 10  # HumanEval problems and MT-Bench questions each
    max_new_tokens: int = 256
    init: str = "target"  # "target" (from the target's layers: every study), or a drafter directory to
    #                       continue (the recipe studies only: its architecture is fixed)
    batch_size: int = 4  # sequences per training step
    labels: str = "target"  # "target": the target's stored predictions (`data --responses dataset`);
    #                         "data": the sequence's own tokens (`data --responses target` made them)
    features: str = "cache"  # the target's taps: "cache" (fp16 on disk) or "online" (a forward a step)
    target_dtype: str = "auto"  # "float32" keeps a CUDA target exact (auto: bf16 there)
    jobs: int = 1  # runs trained and scored side by side in worker processes (a GPU idles otherwise)
    lr: float = 1e-3  # every run's peak learning rate (lower when continuing a long-trained drafter)
    anchors: int = 16  # anchor blocks per sequence (the block study's block-8 run: twice this)
    gamma: float | None = None  # the loss decay (None: the trainer's default for the block)


def base_config(s: StudySettings, run: Run):
    from ..training.train import TrainConfig

    cfg = TrainConfig(data=s.data, out=str(Path(s.runs) / run.name), target=s.target, num_layers=3, num_taps=5,
                      block_size=16, anchors=s.anchors, batch_size=s.batch_size, lr=s.lr, gamma=s.gamma,
                      head_vocab=8192, labels=s.labels, features=s.features, target_dtype=s.target_dtype,
                      init=s.init, max_steps=s.steps, save_every=50, log_every=10, eval_every=max(1, s.steps // 2),
                      eval_prompts=0, eval_sequences=24, seed=0)
    overrides = dict(run.overrides)
    if "anchors" in overrides:  # the block-8 run: twice the base's anchors, equal block tokens
        overrides["anchors"] = overrides["anchors"] * s.anchors // 16
    return replace(cfg, **overrides)


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in open(path)] if path.exists() else []


def train_run(s: StudySettings, run: Run) -> Path:
    """Train (or finish training) one run; its drafter."""
    from ..training.train import train

    cfg = base_config(s, run)
    out = Path(cfg.out)
    saved = out / "config.json"
    if saved.exists():
        old = json.loads(saved.read_text())
        mine = json.loads(json.dumps(asdict(cfg)))
        if old != mine:
            diff = sorted(k for k in mine if old.get(k) != mine[k])
            raise BlockdraftError(f"{out} holds a run with other settings ({', '.join(diff)}); "
                                  "use another --runs directory or delete it")
    if any(r.get("final") for r in _log(out / "log.jsonl")):
        return out / "drafter"
    return train(cfg, resume=True)


def score_run(s: StudySettings, run: Run, blocks: tuple[int, ...], target, prompts: dict) -> dict:
    """The run's score.json: held-out accuracy and tau per inference block (computed once; kept)."""
    from ..evaluation.replay import replay
    from ..models.checkpoint import load_draft

    out = Path(s.runs) / run.name
    path = out / "score.json"
    score = json.loads(path.read_text()) if path.exists() else {}
    todo = [b for b in blocks if str(b) not in score.get("blocks", {})]
    if not todo and score:
        return score
    if run is START:  # its held-out accuracy is the base run's at step 0, before any step
        log = [dict(r, final=True) for r in _log(Path(s.runs) / BASE.name / "log.jsonl")[:1]]
        out.mkdir(parents=True, exist_ok=True)
    else:
        log = _log(out / "log.jsonl")
    final = next(r for r in reversed(log) if r.get("final"))
    draft = load_draft(s.init if run is START else out / "drafter", device=target.device, dtype=target.dtype)
    score.update(run=run.name, change=run.change, overrides={k: str(v) for k, v in run.overrides.items()},
                 heldout_acc=final["heldout_acc"],
                 acc1_by_step=[[r["step"], r["heldout_acc"][0]] for r in log if r.get("heldout_acc")],
                 train_minutes=round(max(r.get("elapsed", 0) for r in log) / 60, 1))
    score.setdefault("blocks", {})
    for b in todo:
        taus = {}
        for name, (ids, refs) in prompts.items():
            per = [replay(target, draft, p, r, b, s.max_new_tokens).tau for p, r in zip(ids, refs)]
            taus[name] = round(sum(per) / len(per), 3)
        score["blocks"][str(b)] = {"tau": taus}
        path.write_text(json.dumps(score, indent=1) + "\n")
    return score


def shape_of(s: StudySettings, run: Run) -> tuple:
    """What a drafter's cost depends on: runs of one shape share one measurement, so that their
    predicted speeds differ by their tau only, not by the timing noise of separate measurements."""
    cfg = base_config(s, run)
    return cfg.num_layers, cfg.num_taps, cfg.conditioning


def step_costs(s: StudySettings, run: Run, block: int, target, prompt: list[int]) -> dict:
    """Milliseconds of the target's forward over 1 and `block` tokens and of a draft forward of this
    run's shape, after `prompt`, medians of 9 (measured in this process). The drafter is built from
    the run's config.json with fresh weights: its cost depends on its shape alone, so a study
    trained on one machine (a GPU) can be timed on the one it is meant for without its weights."""
    from ..evaluation.bench import measure_costs
    from ..models.checkpoint import config_from_json
    from ..models.draft import DraftModel

    path = Path(s.init if run is START else Path(s.runs) / run.name / "drafter") / "config.json"
    draft = DraftModel(config_from_json(json.loads(path.read_text()), str(path))).to(target.device, target.dtype)
    c = measure_costs(target, draft.eval(), prompt, block, repeats=21)
    return {"t1_ms": round(c["t_target"][1] * 1e3, 1), "t_verify_ms": round(c["t_target"][block] * 1e3, 1),
            "t_draft_ms": round(c["t_draft"] * 1e3, 1)}


def predicted_speedup(tau: float, cost: dict) -> float:
    """The cost model's tokens/s against plain decoding: tau tokens per t(B) + t_draft, one per t(1)."""
    return tau * cost["t1_ms"] / (cost["t_verify_ms"] + cost["t_draft_ms"])


def load_prompt_sets(s: StudySettings, target) -> dict:
    """{dataset: (prompt ids, greedy references)}: HumanEval and MT-Bench, first `prompts` each."""
    from ..evaluation.datasets import load_prompts
    from ..evaluation.replay import default_references_path, reference_continuations

    sets = {}
    for name in ("humaneval", "mt-bench"):
        ids = [target.encode_prompt(t, target.has_chat_template) for t in load_prompts(name, s.prompts)]
        sets[name] = (ids, reference_continuations(target, ids, s.max_new_tokens, default_references_path(s.target)))
    return sets


def write_study(s: StudySettings, study: str, scores: list[dict], blocks: tuple[int, ...], command: str,
                seconds: float, costs: dict) -> Path:
    """costs: {run name: {block: step_costs}}, shared by the runs of one shape."""
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    for sc in scores:
        for b in blocks:
            r = sc["blocks"][str(b)]
            r["costs"] = costs[sc["run"]][b]
            r["predicted_speedup"] = {k: round(predicted_speedup(v, r["costs"]), 3) for k, v in r["tau"].items()}
    (out / f"{study}.json").write_text(json.dumps({"study": study, "command": command, "runs": scores}, indent=1) + "\n")
    k = 4  # acc@1..4 in the table; all positions in the JSON
    head = ["run", "change", "train min"] + [f"acc@{i}" for i in range(1, k + 1)]
    for b in blocks:
        head += [f"tau HE (B={b})", f"tau MT (B={b})", f"speed HE/MT (B={b})"]
    lines = [f"# Study: {study}", "", "```", command, "```", "",
             f"{s.steps} steps of {s.batch_size} sequences per run; tau by replay on the first {s.prompts} HumanEval problems "
             f"(HE) and MT-Bench first turns (MT), greedy, {s.max_new_tokens} new tokens; speed: the cost model's "
             f"tau x t(1) / (t(B) + t_draft), against plain decoding, with one measurement per drafter shape "
             f"({_cost_line(scores, blocks)}). This invocation took {seconds / 60:.0f} min (runs already done "
             "elsewhere are not retrained).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for sc in scores:
        row = [sc["run"], sc["change"], f"{sc['train_minutes']:.1f}"] + [f"{a:.3f}" for a in sc["heldout_acc"][:k]]
        for b in blocks:
            r = sc["blocks"][str(b)]
            row += [f"{r['tau']['humaneval']:.3f}", f"{r['tau']['mt-bench']:.3f}",
                    f"{r['predicted_speedup']['humaneval']:.2f} / {r['predicted_speedup']['mt-bench']:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    (out / f"{study}.md").write_text("\n".join(lines) + "\n")
    plot_study(out / f"{study}.png", study, scores, blocks)
    return out / f"{study}.md"


def _cost_line(scores: list[dict], blocks: tuple[int, ...]) -> str:
    seen = {}
    for sc in scores:
        for b in blocks:
            c = sc["blocks"][str(b)]["costs"]
            seen.setdefault((c["t1_ms"], b, c["t_verify_ms"]), []).append(f"{sc['run']} {c['t_draft_ms']}")
    return "; ".join(f"t(1) {t1} ms, t({b}) {tv} ms, t_draft: " + ", ".join(d) for (t1, b, tv), d in seen.items())


def plot_study(path: Path, study: str, scores: list[dict], blocks: tuple[int, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(15, 3.8))
    for sc in scores:
        steps, acc1 = zip(*sc["acc1_by_step"])
        ax0.plot(steps, acc1, marker=".", label=sc["run"])
        acc = sc["heldout_acc"]
        ax1.plot(range(1, len(acc) + 1), acc, marker=".", label=sc["run"])
    ax0.set(xlabel="training step", ylabel="held-out acc@1", title=f"{study}: convergence")
    ax1.set(xlabel="block position k", ylabel="held-out acc@k", title=f"{study}: accuracy per position")
    ax1.legend(fontsize=8)
    width = 0.8 / (2 * len(blocks))
    for j, b in enumerate(blocks):
        for d, name in enumerate(("humaneval", "mt-bench")):
            xs = [i + (2 * j + d - len(blocks)) * width + width / 2 for i in range(len(scores))]
            ax2.bar(xs, [sc["blocks"][str(b)]["tau"][name] for sc in scores], width,
                    label=f"{'HE' if name == 'humaneval' else 'MT'} B={b}")
    ax2.set_xticks(range(len(scores)), [sc["run"] for sc in scores], rotation=20, fontsize=8)
    ax2.set(ylabel="tau by replay", title=f"{study}: tau", ylim=(1.0, None))
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _target_dtype(s: StudySettings):
    import torch

    return None if s.target_dtype == "auto" else getattr(torch, s.target_dtype)


_WORKER: dict = {}  # a worker process's target and prompt sets, loaded once


def _worker_init(s: StudySettings, prompts: dict) -> None:
    import os

    import torch

    from ..models.target import load_target

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // s.jobs))  # the workers share the cores
    _WORKER.update(target=load_target(s.target, dtype=_target_dtype(s)), prompts=prompts)


def _worker_run(s: StudySettings, run: Run, blocks: tuple[int, ...]) -> str:
    train_run(s, run)
    score_run(s, run, blocks, _WORKER["target"], _WORKER["prompts"])
    return run.name


def train_and_score_side_by_side(s: StudySettings, studies: list[str], prompts: dict) -> None:
    """Every run of the studies trained and scored (each at the union of its studies' inference
    blocks) by `s.jobs` worker processes; what is done already is skipped as in the serial path."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    todo: dict[str, tuple[Run, set]] = {}  # in the studies' order: the base run comes early
    for study in studies:
        runs, blocks = STUDIES[study]
        for run in runs:
            todo.setdefault(run.name, (run, set()))[1].update(blocks)
    # spawn, not fork: a forked child cannot use CUDA once the parent has touched it
    with ProcessPoolExecutor(s.jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                             initargs=(s, prompts)) as pool:
        futures = [pool.submit(_worker_run, s, run, tuple(sorted(blocks))) for run, blocks in todo.values()]
        try:
            for f in as_completed(futures):
                print(f"ablate: {f.result()} trained and scored", flush=True)
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise


def _adds_taps(init: str, num_taps: int) -> bool:
    """Whether a drafter continued from `init` can take `num_taps` taps: its own taps among them."""
    from ..models.checkpoint import config_from_json
    from ..models.draft_config import default_target_layer_ids
    from ..training.warmstart import tap_columns

    path = Path(init) / "config.json"
    if not path.exists():
        return False
    cfg = config_from_json(json.loads(path.read_text()), str(path))
    wanted = default_target_layer_ids(cfg.num_target_layers, num_taps)
    return len(wanted) > len(cfg.target_layer_ids) and tap_columns(cfg.target_layer_ids, wanted) is not None


def run_studies(s: StudySettings, studies: list[str], command: str) -> list[Path]:
    """Train, score and write each study in turn; returns the Markdown files written."""
    from ..models.target import load_target

    unknown = [x for x in studies if x not in STUDIES]
    if unknown:
        raise BlockdraftError(f"unknown studies {unknown}; choose from {', '.join(STUDIES)} or all")
    if min(s.steps, s.prompts, s.max_new_tokens, s.batch_size, s.jobs) < 1:
        raise BlockdraftError("--steps, --prompts, --max-new-tokens, --batch-size and --jobs must be >= 1")
    if s.target_dtype not in ("auto", "float32", "bfloat16"):
        raise BlockdraftError(f"--target-dtype must be auto, float32 or bfloat16 (got {s.target_dtype!r})")
    if s.init != "target":
        shaped = sorted({x for st in studies for r in STUDIES[st][0] for x in r.overrides
                         if not (x == "num_taps" and _adds_taps(s.init, r.overrides[x]))} & ARCHITECTURE)
        if shaped:
            raise BlockdraftError(f"--init {s.init}: a drafter to continue fixes {', '.join(shaped)}; "
                                  "run those studies from the target's layers (--init target)")
    if not (Path(s.data) / "samples.jsonl").exists():
        raise BlockdraftError(f"{s.data} is not a `blockdraft data` directory (no samples.jsonl)")
    from ..training.data import load_samples

    if not load_samples(s.data, "heldout"):
        raise BlockdraftError(f"{s.data} has no held-out samples, which score each run's accuracy")
    target = load_target(s.target, dtype=_target_dtype(s))
    prompts = load_prompt_sets(s, target)
    if s.jobs > 1:
        train_and_score_side_by_side(s, studies, prompts)
    # (shape, block) -> step costs, once per shape in this process; the target's own t(1) and t(B)
    # from the first measurement at each block, shared by every run, so that the predicted speeds
    # of two runs differ by their tau and their draft forward only, not by the target's timing noise
    written, measured, target_ms = [], {}, {}
    first = prompts["humaneval"][0][0]
    for study in studies:
        t0 = time.perf_counter()
        runs, blocks = STUDIES[study]
        scores = []
        for run in runs:
            print(f"ablate {study}: {run.name} ({run.change})", flush=True)
            train_run(s, run)
            scores.append(score_run(s, run, blocks, target, prompts))
        if s.init != "target" and BASE in runs:  # where every run started, for comparison
            scores.insert(0, score_run(s, START, blocks, target, prompts))
            runs = [START] + runs
        costs = {}
        for run in runs:
            for b in blocks:
                key = (shape_of(s, run), b)
                if key not in measured:
                    measured[key] = step_costs(s, run, b, target, first)
                    target_ms.setdefault(b, {k: measured[key][k] for k in ("t1_ms", "t_verify_ms")})
                costs.setdefault(run.name, {})[b] = {**measured[key], **target_ms[b]}
        written.append(write_study(s, study, scores, blocks, command, time.perf_counter() - t0, costs))
        print(f"wrote {written[-1]}", flush=True)
    return written
