"""Drafter training (DFLASH.md's recipe), read top to bottom.

Per sequence: the target's taps over the clean sequence (cached or online), N random anchor
positions among response tokens, and for each a block [x_a, mask x (B-1)] at positions
a..a+B-1 with labels x_{a+1}..x_{a+B-1}. All blocks of all sequences in a step go through one
packed forward; a boolean mask lets block b see context positions < a_b and its own block only.
Loss: cross entropy at block position k weighted exp(-(k-1)/gamma), normalised by the weights
(the batch and its loss: batch.py).

Everything random is derived from (seed, step), so `--resume` needs only the step number and
continues exactly where an uninterrupted run would be; checkpoints survive kills at any point
(state.py), and a resumed command must keep the run's settings (`MAY_CHANGE_ON_RESUME`).
`torchrun` gives data-parallel training, DDP or FSDP (`--parallel`, parallel.py).
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..models.checkpoint import save_draft
from .batch import (  # noqa: F401  (re-exported: the batch and its loss, beside the loop that uses them)
    Batch, block_mask, default_gamma, frequent_tokens, head_rows, loss_weights, make_batch, sample_anchors,
    training_forward,
)
from ..models.draft import DraftModel, build_draft_config, init_scale_check
from ..models.draft_config import EMBEDDING_TAP
from ..errors import BlockdraftError
from .parallel import setup
from .state import (TrainState, config_changes, has_state, latest_state, load_state, save_state,
                    write_json_atomic)
from .warmstart import exportable, init_from_drafter, init_from_target


@dataclass
class TrainConfig:
    data: str  # directory written by `blockdraft data`
    out: str  # run directory: checkpoints, logs, the exported drafter
    target: str = "smollm2-135m"
    num_layers: int = 5
    num_taps: int = 5  # target layers tapped (0: no target context, the drafter sees the tokens' embeddings)
    conditioning: str = "kv"  # "kv" (DFlash's KV injection) or "input" (fused into the input; an ablation)
    block_size: int = 16
    anchors: int = 16  # N anchor blocks per sequence
    anchor_mode: str = "random"  # "random" anchors among response tokens, or "split": the response cut
    #                              into consecutive blocks from its first token (N of them drawn per step)
    batch_size: int = 4  # sequences per step, over all ranks
    parallel: str = "ddp"  # under torchrun: "ddp" (whole drafter per process) or "fsdp" (sharded), parallel.py
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of steps
    max_steps: int = 1000
    gamma: float | None = None  # loss decay; None: 7 for B=16, 5 for B=10, 4 for B=8; inf: uniform weights
    grad_clip: float = 1.0
    tap_norm: bool = True  # divide each tap channel by its RMS (folded into fc on export)
    init: str = "random"  # "random", "target" (draft layers copied from the target's last ones), or a
    #                       drafter directory to continue from (e.g. the bundled one, on more data)
    head_vocab: int = 0  # 0: full-vocabulary loss; n: the n most frequent response tokens plus
    #                      n/2 random others per step (a sampled softmax: the LM head dominates cost)
    features: str = "cache"  # "cache" (fp16 on disk) or "online"
    labels: str = "data"  # "data": the sequence's own next tokens; "target": the target's greedy
    #                       predictions stored by `blockdraft data --responses dataset`
    soft_labels: int = 0  # k > 0: the loss against the target's top-k distribution (soft_labels.py)
    #                       instead of the one label; accuracy is still against the label
    max_seq_len: int = 512
    seed: int = 0
    log_every: int = 10
    save_every: int = 100
    eval_every: int = 0  # steps between held-out tau measurements (0: only at the end)
    eval_prompts: int = 16  # held-out responses for tau (by replay: cheap)
    eval_sequences: int = 0  # held-out sequences for accuracy (0: all of them)
    eval_tokens: int = 192
    time_budget_minutes: float | None = None  # stop (and save) after this much training time; the
    #                                          learning-rate schedule then runs to whichever end comes first
    target_dtype: str = "auto"  # the target's: "auto" (fp32 on the CPU, bf16 on CUDA), "float32", "bfloat16"


# What `--resume` lets a command change: how long the run goes on, how it is spread over processes,
# how the target's features reach it, and what is logged. Every other field changes what the run
# learns (its shape, data, labels, recipe, seed), so a resumed run with another value would be a
# different run under the old one's name: it is refused, naming the fields. A new TrainConfig field
# is checked on resume unless it is added here.
MAY_CHANGE_ON_RESUME = frozenset({
    "out",  # the run directory, moved
    "max_steps",  # not below the step reached (the schedule follows it: a 3-step run continued to 6
    #               is not a 6-step run)
    "time_budget_minutes", "parallel", "features", "target_dtype",
    "log_every", "save_every", "eval_every", "eval_prompts", "eval_sequences", "eval_tokens",
})


def lr_at(step: int, cfg: TrainConfig, elapsed: float = 0.0) -> float:
    """Linear warmup, then cosine decay to 10% of the peak. With a time budget the decay follows
    whichever is further along, the steps or the time (elapsed seconds), so a run the budget cuts
    short still ends at the low rate instead of stopping at its peak."""
    warm = max(1, int(cfg.warmup * cfg.max_steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, cfg.max_steps - warm))
    if cfg.time_budget_minutes:
        progress = max(progress, min(1.0, elapsed / (60 * cfg.time_budget_minutes)))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _as_json(cfg: TrainConfig) -> dict:
    return json.loads(json.dumps(asdict(cfg)))  # as trainer.json will read back (inf, tuples)


def _resumable(out: Path, cfg: TrainConfig) -> TrainState | None:
    """The checkpoint `--resume` continues from (None: the run never saved one, so it starts at
    step 0), after checking that this command continues the same run. Runs before any heavy work."""
    path = latest_state(out)
    saved = load_state(path) if path else None
    # before the first checkpoint, the config the run started with (written at its start)
    before = saved.config if saved else _read_json(out / "config.json")
    if before:
        defaults = _as_json(TrainConfig(data=cfg.data, out=cfg.out))
        changed = config_changes(before, _as_json(cfg), MAY_CHANGE_ON_RESUME, defaults)
        if changed:
            free = ", ".join(sorted(MAY_CHANGE_ON_RESUME - {"out"}))
            raise BlockdraftError(f"--resume: {out} holds a run with other settings: {'; '.join(changed)}. "
                                  f"Resume it with its own (only {free} may change), or train in a new --out")
    if saved and saved.step > cfg.max_steps:
        raise BlockdraftError(f"--resume: {path} is at step {saved.step}, past --max-steps {cfg.max_steps}")
    return saved


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent, or torn by a kill under the code before issue 49 (it wrote in place)


def _open_log(path: Path):
    """log.jsonl for appending, without a line a kill cut short (which would glue itself to the
    next record and make the file unreadable as JSON lines)."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.seek(0)
                f.truncate(f.read().rfind(b"\n") + 1)
    return open(path, "a")


def heldout_tau(draft, target, samples, n_prompts: int, max_new: int) -> float:
    """Mean tau at the drafter's block size over up to n_prompts held-out samples, by replay
    (replay.py: the engine's greedy steps without the target's verify forwards) against their
    responses. Only responses that are the target's own greedy continuation count: regenerated
    data, not a dataset's answers (their stored target predictions disagree with the response)."""
    from ..evaluation.replay import replay

    taus = []
    for s in samples:
        if len(taus) == n_prompts:
            break
        p = s["loss_mask"].index(1) if 1 in s["loss_mask"] else len(s["loss_mask"])
        ref = s["input_ids"][p : p + max_new]
        if not ref or p == 0 or ("target_next" in s and s["target_next"][p - 1 : p - 1 + len(ref)] != ref):
            continue
        taus.append(replay(target, draft, s["input_ids"][:p], ref, draft.block_size, len(ref)).tau)
    return sum(taus) / len(taus) if taus else float("nan")


@torch.no_grad()
def heldout_accuracy(draft, target, samples, feats, cfg: TrainConfig, tap_scale, mask_id: int) -> list[float]:
    """Per-position accuracy over the full vocabulary on held-out responses, at fixed anchors
    (up to 64 per sequence, seeded): comparable across runs whatever their training loss."""
    from dataclasses import replace

    eval_cfg = replace(cfg, anchors=64, anchor_mode="random")
    correct = counts = None
    draft.eval()
    for lo in range(0, len(samples), 4):
        idx = list(range(lo, min(lo + 4, len(samples))))
        batch = make_batch(samples, feats, idx, eval_cfg, mask_id, lambda j: torch.Generator().manual_seed(idx[j]))
        _, _, c, n = training_forward(draft, target, batch, tap_scale, None)
        correct, counts = (c, n) if correct is None else (correct + c, counts + n)
    draft.train()
    return [round(float(a), 4) for a in (correct / counts.clamp_min(1))] if correct is not None else []


def train(cfg: TrainConfig, resume: bool = False, progress: bool = True) -> Path:
    from tqdm import tqdm

    from .data import load_samples
    from .features import (CachedFeatures, EmbeddingFeatures, OnlineFeatures, build_feature_cache,
                           sliced_cache, tap_channel_scale)
    import numpy as np

    from ..models.target import default_mask_token_id, load_target

    par = setup(cfg.parallel)
    rank, world = par.rank, par.world
    if cfg.batch_size % world:
        raise BlockdraftError(f"batch size {cfg.batch_size} is not divisible by {world} processes")
    if cfg.labels not in ("data", "target"):
        raise BlockdraftError(f"--labels must be 'data' or 'target' (got {cfg.labels!r})")
    if cfg.block_size < 2 or cfg.anchors < 1 or cfg.max_steps < 1:
        raise BlockdraftError("block size >= 2, anchors >= 1 and max steps >= 1 are required")
    if cfg.anchor_mode not in ("random", "split"):
        raise BlockdraftError(f"--anchor-mode must be 'random' or 'split' (got {cfg.anchor_mode!r})")
    if cfg.soft_labels < 0:
        raise BlockdraftError(f"--soft-labels must be >= 0 (got {cfg.soft_labels})")
    if cfg.num_taps < 0 or (cfg.gamma is not None and not cfg.gamma > 0):
        raise BlockdraftError("--num-taps must be >= 0 and --gamma > 0 (inf: uniform weights)")
    if cfg.target_dtype not in ("auto", "float32", "bfloat16"):
        raise BlockdraftError(f"--target-dtype must be auto, float32 or bfloat16 (got {cfg.target_dtype!r})")
    out = Path(cfg.out)
    saved = _resumable(out, cfg) if resume else None
    if not resume and has_state(out):
        raise BlockdraftError(f"{out} already holds a run; pass --resume to continue it or use a new --out")
    torch.manual_seed(cfg.seed)
    target = load_target(cfg.target, device=f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() and world > 1 else None,
                         dtype=None if cfg.target_dtype == "auto" else getattr(torch, cfg.target_dtype))
    samples = load_samples(cfg.data, "train")
    heldout = load_samples(cfg.data, "heldout")
    if not samples:
        raise BlockdraftError(f"no training samples in {cfg.data}")
    if cfg.labels == "target" and any("target_next" not in s for s in samples + heldout):
        raise BlockdraftError(f"--labels target needs data made with `blockdraft data --responses dataset` "
                              f"(the target's predictions); {cfg.data} has none")
    dcfg = build_draft_config(target.config, cfg.num_layers, cfg.block_size, num_taps=cfg.num_taps,
                              mask_token_id=default_mask_token_id(target), vocab_size=target.vocab_size,
                              conditioning=cfg.conditioning)
    init_scale_check(dcfg)
    draft = DraftModel(dcfg).to(target.device)
    if cfg.init == "target":
        init_from_target(draft, target)
    elif cfg.init != "random" and not Path(cfg.init).is_dir():
        raise BlockdraftError(f"--init must be 'random', 'target' or a drafter directory (got {cfg.init!r})")
    if dcfg.target_layer_ids == [EMBEDDING_TAP]:  # no target context: an embedding lookup, no cache
        feats = EmbeddingFeatures(target, samples)
    elif cfg.features == "cache":
        feats = sliced_cache(cfg.data, "train", samples, dcfg.target_layer_ids, target.hidden_size)
        if feats is None and rank == 0:  # one writer; the other ranks wait, then only read
            feats = build_feature_cache(cfg.data, "train", samples, target, dcfg.target_layer_ids, progress)
        if world > 1:
            par.barrier()
            feats = sliced_cache(cfg.data, "train", samples, dcfg.target_layer_ids, target.hidden_size)
    else:
        feats = OnlineFeatures(target, samples, dcfg.target_layer_ids)
    tap_scale = tap_channel_scale(feats) if cfg.tap_norm else None
    soft = None
    if cfg.soft_labels:
        from .soft_labels import build_soft_labels, soft_dir

        if rank == 0:
            soft = build_soft_labels(cfg.data, "train", samples, target, cfg.soft_labels, progress)
        if world > 1:
            par.barrier()
            soft = CachedFeatures(soft_dir(cfg.data, "train", cfg.soft_labels), np.float32, "topk.f32")
    if cfg.init not in ("random", "target"):
        init_from_drafter(draft, cfg.init, tap_scale)
    frequent = frequent_tokens(samples, cfg.head_vocab, target.vocab_size) if cfg.head_vocab else None
    step, elapsed = 0, 0.0
    if saved:
        draft.load_state_dict(saved.model)
        tap_scale, step, elapsed = saved.tap_scale, saved.step, saved.elapsed
    model = par.wrap(draft)  # FSDP shards draft's parameters in place: the optimizer comes after
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    if saved:
        par.load_optimizer(draft, opt, saved.optimizer)
    out.mkdir(parents=True, exist_ok=True)
    log = _open_log(out / "log.jsonl") if rank == 0 else None
    if rank == 0:
        write_json_atomic(out / "config.json", asdict(cfg))

    @functools.lru_cache(maxsize=2)  # a step spans at most two epochs; don't redraw per sample
    def epoch_order(epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        return torch.randperm(len(samples), generator=gen).tolist()

    def sample_index(g: int) -> int:
        """Global sample slot g -> sample index, a fresh permutation each epoch."""
        epoch, pos = divmod(g, len(samples))
        return epoch_order(epoch)[pos]

    heldout_feats = EmbeddingFeatures(target, heldout) if dcfg.target_layer_ids == [EMBEDDING_TAP] else \
        OnlineFeatures(target, heldout, dcfg.target_layer_ids)  # an embedding needs no target forward

    def evaluate(whole: DraftModel) -> dict:
        acc = heldout_accuracy(whole, target, heldout[: cfg.eval_sequences or None], heldout_feats, cfg, tap_scale,
                               dcfg.mask_token_id)
        tau = heldout_tau(exportable(whole, tap_scale), target, heldout, cfg.eval_prompts, cfg.eval_tokens)
        return {"step": step, "heldout_tau": round(tau, 3) if tau == tau else None, "heldout_acc": acc}

    def gather(with_optimizer: bool):
        """(model state, optimizer state or None, the whole drafter on rank 0): every rank calls it."""
        msd, osd = par.full_state(draft, opt if with_optimizer else None)
        return msd, osd, par.whole(draft, msd, lambda: DraftModel(dcfg).to(target.device)) if rank == 0 else None

    def save(msd: dict, osd: dict, whole: DraftModel) -> None:
        # the checkpoint first: a kill between the two leaves a drafter one save behind (or torn,
        # which load_draft refuses), and the resumed run's next save writes it again
        save_state(out, TrainState(msd, osd, tap_scale, step, time.perf_counter() - t_start, _as_json(cfg)))
        save_draft(exportable(whole, tap_scale), out / "drafter")

    per_rank = cfg.batch_size // world
    if heldout and cfg.eval_every and step == 0:  # where a run starts (e.g. from --init DIR)
        whole = gather(with_optimizer=False)[2]
        if rank == 0:
            log.write(json.dumps({**evaluate(whole), "elapsed": 0.0}) + "\n")
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not progress or rank > 0, desc="train", unit="step")
    t_start, window_tokens, t_window = time.perf_counter() - elapsed, 0, time.perf_counter()
    while step < cfg.max_steps:
        run_time = 0.0  # seconds trained, only with a time budget (without, the schedule is by steps alone)
        if cfg.time_budget_minutes:  # every rank stops at the same step, and sets the same rate (clocks differ)
            run_time = par.all_reduce(torch.tensor(time.perf_counter() - t_start, dtype=torch.float64)).item() / world
            if run_time > 60 * cfg.time_budget_minutes:
                break
        slots = [step * cfg.batch_size + rank * per_rank + j for j in range(per_rank)]
        batch = make_batch(samples, feats, [sample_index(g) for g in slots], cfg, dcfg.mask_token_id,
                           lambda j: torch.Generator().manual_seed(cfg.seed * 7_919 + slots[j]), soft)
        lr = lr_at(step, cfg, run_time)
        for group in opt.param_groups:
            group["lr"] = lr
        model.train()
        wanted = batch.labels if batch.soft_ids is None else torch.cat([batch.labels.flatten(),
                                                                        batch.soft_ids.flatten()])
        rows = head_rows(frequent, target.vocab_size, wanted,  # every label and soft label in the softmax
                         torch.Generator().manual_seed(cfg.seed * 104_729 + step))
        # bf16 autocast on CUDA (mixed precision: fp32 master weights and optimizer); fp32 on the CPU
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=target.device.type == "cuda"):
            loss_sum, w_sum, correct, counts = training_forward(model, target, batch, tap_scale, rows)
        total_w = w_sum.detach().clone()
        par.all_reduce(total_w)  # normalise by the global batch's weight, so N ranks == 1 process
        loss = loss_sum * world / total_w.clamp_min(1e-6)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm  # FSDP: a DTensor
        opt.step()
        step += 1
        window_tokens += int(counts.sum())
        bar.update(1)
        if rank == 0 and (step % cfg.log_every == 0 or step == cfg.max_steps):
            now = time.perf_counter()
            acc = (correct / counts.clamp_min(1)).tolist()
            rec = {"step": step, "loss": round(loss.item() / world, 4), "lr": lr,
                   "grad_norm": round(float(gnorm), 3), "acc": [round(a, 3) for a in acc],
                   "block_tokens_per_s": round(window_tokens * world / (now - t_window), 1),
                   "elapsed": round(now - t_start, 1), "samples_seen": step * cfg.batch_size}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            bar.set_postfix(loss=rec["loss"], acc1=rec["acc"][0])
            window_tokens, t_window = 0, now
        # the last step is saved after the loop, which also ends runs a time budget cut short
        saving = step % cfg.save_every == 0 and step < cfg.max_steps
        evaluating = bool(heldout) and cfg.eval_every and step % cfg.eval_every == 0
        if saving or evaluating:  # the same steps on every rank: gathering is a collective
            msd, osd, whole = gather(with_optimizer=saving)
            if rank == 0 and saving:
                save(msd, osd, whole)
            if rank == 0 and evaluating:
                log.write(json.dumps({**evaluate(whole), "elapsed": round(time.perf_counter() - t_start, 1)}) + "\n")
                log.flush()
    bar.close()
    msd, osd, whole = gather(with_optimizer=True)
    if rank == 0:
        save(msd, osd, whole)
        if heldout:
            log.write(json.dumps({**evaluate(whole), "final": True}) + "\n")
        log.close()
    return out / "drafter"
