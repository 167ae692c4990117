"""Drafter checkpoints in the z-lab format (DFLASH.md), loadable unchanged by vLLM, SGLang and the
reference `DFlashDraftModel`: `config.json` + `model.safetensors` with unprefixed keys (and our
draft vocabulary subset in `vocab/`, vocab.py). Safetensors only: a checkpoint never runs code.

One save is one unit. Every file of a save carries the save's stamp, a digest of what it holds
(config.json's `"blockdraft_save"`, the safetensors files' metadata), and `load_draft` refuses a
directory whose files carry different stamps: a save a kill cut short, or one under way, never
loads as a config of one save with the weights of another. Each file is replaced whole (a temp
file, fsynced, `os.replace`) and config.json comes last: it is the commit. Why not a new directory
swapped in: the drafter must stay a plain directory at the same path (vLLM, SGLang and the
reference read `config.json` and the top-level `*.safetensors` there), swapping a directory takes
two renames with a gap between them (the very bug issue 49 found in the trainer's checkpoints),
and a symlink in its place is copied as a dangling link by `cp -r` and committed as a link by git.
Readers that do not check stamps (the peers) see whole files, the config last.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from .draft import SCALED_ROPE_TYPES, DraftConfig, DraftModel, init_scale_check
from .draft_config import EMBEDDING_TAP
from .files import fsync_path, save_safetensors
from ..errors import BlockdraftError

_REQUIRED = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "vocab_size", "dflash_config",
)


def config_to_json(cfg: DraftConfig) -> dict:
    rope = {**(cfg.rope_scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}
    out = {
        **cfg.extra,
        # an ablation variant (input fusion, no target context) gets a name of its own: the
        # reference, vLLM and SGLang refuse it rather than run it as a DFlash drafter
        "architectures": ["DFlashDraftModel" if cfg.standard else STUDY_ARCHITECTURE],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": list(cfg.layer_types or ["full_attention"] * cfg.num_layers),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": cfg.sliding_window is not None,
    }
    if cfg.sliding_window is not None:
        out["sliding_window"] = cfg.sliding_window
    if cfg.is_causal is not None:
        out["is_causal"] = cfg.is_causal
    if cfg.conditioning != "kv":
        out["blockdraft_conditioning"] = cfg.conditioning
    return out


STUDY_ARCHITECTURE = "BlockdraftStudyDraft"  # `blockdraft ablate`'s variants; blockdraft runs them


# What DFlash2 drafters (and later variants) add: a convolution over the block, a token selector,
# a logit multiplier and soft-capping. Their forward is not DFlash's; mis-running one would only
# give bad drafts, but refusing it says why.
_UNSUPPORTED_DFLASH = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                       "output_multiplier", "final_logit_softcapping")
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_types(raw: dict, n_layers: int, where: str) -> tuple[list[str] | None, int | None]:
    types = raw.get("layer_types")
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    if types is None:
        return None, None
    if len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
        raise BlockdraftError(f"{where}: layer_types must list {n_layers} of {list(_LAYER_TYPES)} (got {types})")
    if "sliding_attention" not in types:
        return None, None  # all full: the plain DFlash drafter
    if not isinstance(window, int) or window < 1:
        raise BlockdraftError(f"{where}: sliding_attention layers need a positive integer sliding_window (got {window!r})")
    return list(types), window


def config_from_json(raw: dict, where: str = "config.json") -> DraftConfig:
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise BlockdraftError(f"{where}: not a DFlash drafter config, missing {missing}")
    dc = raw["dflash_config"] or {}
    arch = [a for a in raw.get("architectures") or [] if a not in ("DFlashDraftModel", STUDY_ARCHITECTURE)]
    extra_fields = [k for k in _UNSUPPORTED_DFLASH if k in dc or k in raw]
    if arch or extra_fields:
        raise BlockdraftError(
            f"{where}: a drafter variant this engine cannot run ({', '.join(arch + extra_fields)}); "
            "blockdraft runs DFlash drafters (architectures DFlashDraftModel), not DFlash2's convolution/selector heads"
        )
    if "mask_token_id" not in dc:
        raise BlockdraftError(f"{where}: dflash_config has no mask_token_id")
    n_layers = int(raw["num_hidden_layers"])
    n_target = int(raw.get("num_target_layers", 0))
    from .draft import default_target_layer_ids

    taps = dc.get("target_layer_ids") or default_target_layer_ids(n_target, n_layers)
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default",) + SCALED_ROPE_TYPES:
        raise BlockdraftError(f"{where}: rope_type {rope_type!r} is not supported "
                              f"(default, {', '.join(SCALED_ROPE_TYPES)})")
    scaling = None
    if rope_type != "default":
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")} | {"rope_type": rope_type}
    layer_types, window = _layer_types(raw, n_layers, where)
    known = set(config_to_json(_dummy()).keys()) | {"sliding_window", "is_causal", "rope_scaling",
                                                    "blockdraft_conditioning", SAVE_KEY}
    cfg = DraftConfig(
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=n_layers,
        num_heads=int(raw["num_attention_heads"]),
        num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]),
        vocab_size=int(raw["vocab_size"]),
        num_target_layers=n_target,
        target_layer_ids=[int(i) for i in taps],
        mask_token_id=int(dc["mask_token_id"]),
        block_size=int(raw.get("block_size", dc.get("block_size", 16))),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        rope_scaling=scaling,
        layer_types=layer_types,
        sliding_window=window,
        is_causal=None if raw.get("is_causal") is None else bool(raw["is_causal"]),
        conditioning=str(raw.get("blockdraft_conditioning", "kv")),
        extra={k: v for k, v in raw.items() if k not in known},
    )
    init_scale_check(cfg)
    if scaling is not None:
        from .draft import scaled_rope

        try:
            scaled_rope(cfg, "cpu")
        except (KeyError, TypeError, ValueError) as err:
            raise BlockdraftError(f"{where}: bad {rope_type} RoPE parameters {scaling} ({err})") from err
    return cfg


SAVE_KEY = "blockdraft_save"  # config.json: {"id": stamp, "subset": bool}; safetensors metadata: stamp


def _dummy() -> DraftConfig:
    return DraftConfig(8, 8, 1, 1, 1, 8, 8, 1, [0], 0)


def _stamp(config: dict, state: dict[str, torch.Tensor], vocab_ids: torch.Tensor | None) -> str:
    """A digest of a save's contents: the same drafter saved twice gives the same files, byte for byte."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    if vocab_ids is not None:
        h.update(b"vocab:" + torch.as_tensor(vocab_ids, dtype=torch.long).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _replace_file(directory: Path, name: str, write) -> None:
    """Put `name` in place whole: written to `.NAME.tmp` by `write(path)`, fsynced, renamed. A
    fixed temp name, so that one a kill leaves behind is overwritten by the next save, not piled up."""
    tmp = directory / f".{name}.tmp"
    write(str(tmp))
    os.chmod(tmp, 0o644)  # a checkpoint is meant to be shared
    fsync_path(tmp)
    os.replace(tmp, directory / name)


def save_draft(model: DraftModel, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write the drafter into `directory` as one unit (module docstring): the subset (if any), the
    weights, then config.json, the commit; a subset the new save lacks is removed last, so that a
    kill before the commit leaves the previous save whole, with its subset."""
    from .vocab import remove_vocab, save_vocab

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in model.state_dict().items()}
    config = config_to_json(model.cfg)
    stamp = _stamp(config, state, model.vocab_ids)
    if model.vocab_ids is not None:
        save_vocab(directory, model.vocab_ids, model.cfg.vocab_size, metadata={SAVE_KEY: stamp})
    _replace_file(directory, "model.safetensors",
                  lambda p: save_safetensors(state, p, {"format": "pt", SAVE_KEY: stamp}))
    config[SAVE_KEY] = {"id": stamp, "subset": model.vocab_ids is not None}
    _replace_file(directory, "config.json", lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))
    if model.vocab_ids is None:
        remove_vocab(directory)  # a stale subset of the weights this directory held before
    fsync_path(directory)
    return directory


def _save_entry(raw: dict, where: Path) -> tuple[str, bool] | None:
    """config.json's stamp (id, whether the save had a subset); None for a drafter saved before
    stamps, or by another tool (no checks then)."""
    entry = raw.get(SAVE_KEY)
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
        raise BlockdraftError(f"{where}: {SAVE_KEY} must be {{\"id\": str, \"subset\": bool}} (got {entry!r})")
    return entry["id"], bool(entry.get("subset"))


def _torn(directory: Path, what: str) -> BlockdraftError:
    return BlockdraftError(
        f"drafter {str(directory)!r}: {what} come from different saves (a save was killed part way, or is "
        f"under way now); save the drafter again (a resumed `blockdraft train` does), or, to load these files "
        f"as they are, delete the \"{SAVE_KEY}\" entry of its config.json")


def load_draft(directory: str | os.PathLike, device=None, dtype: torch.dtype | None = None) -> DraftModel:
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    cfg_path, weights = directory / "config.json", directory / "model.safetensors"
    for p in (cfg_path, weights):
        if not p.is_file():
            raise BlockdraftError(f"drafter checkpoint {str(directory)!r} has no {p.name}")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BlockdraftError(f"{cfg_path}: invalid JSON ({err})") from err
    cfg = config_from_json(raw, str(cfg_path))
    save = _save_entry(raw, cfg_path)
    try:
        with safe_open(str(weights), "pt") as f:  # the stamp and the tensors from one open file
            stamp = (f.metadata() or {}).get(SAVE_KEY)
            state = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise BlockdraftError(f"{weights}: not a readable safetensors file ({err})") from err
    if save is not None and stamp != save[0]:
        raise _torn(directory, "config.json and model.safetensors")
    model = DraftModel(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise BlockdraftError(
            f"{weights}: weights do not match config.json (missing {missing[:4]}, unexpected {unexpected[:4]})"
        )
    bad = [f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in expected.items() if state[k].shape != v.shape]
    if bad:
        raise BlockdraftError(f"{weights}: tensor shapes do not match config.json: {bad[:3]}")
    model.load_state_dict(state)
    model.vocab_ids = _subset(directory, cfg.vocab_size, save)  # a draft vocabulary subset, if it has one
    return model.to(device=device, dtype=dtype).eval()


def _subset(directory: Path, vocab: int, save: tuple[str, bool] | None) -> torch.Tensor | None:
    """The subset that belongs to the save in `directory`. A subset file without a stamp was added
    by `blockdraft vocab` (or predates stamps): it is the user's and counts. One stamped by another
    save is left over from the save before: if this save had no subset, its removal (the last
    step of a save) was cut short, and it is ignored; if this save had one, it was overwritten by
    a save cut short before its commit, and the directory is refused."""
    from .vocab import load_vocab, vocab_file

    path = vocab_file(directory)
    if save is not None and path is not None:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as f:
                stamp = (f.metadata() or {}).get(SAVE_KEY)
        except (SafetensorError, OSError, ValueError) as err:
            raise BlockdraftError(f"{path}: not a readable safetensors file ({err})") from err
        if stamp is not None and stamp != save[0]:
            if save[1]:
                raise _torn(directory, f"config.json and {path.relative_to(directory)}")
            return None
    return load_vocab(directory, vocab)


def check_fits(cfg: DraftConfig, target) -> None:
    """Refuse, before any work, a drafter that was not made for this target."""
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != target's {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target's {target.vocab_size}")
    bad_taps = [i for i in cfg.target_layer_ids if not EMBEDDING_TAP <= i < target.num_layers]
    if bad_taps:
        problems.append(f"target_layer_ids {bad_taps} outside the target's {target.num_layers} layers")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the vocabulary of {target.vocab_size}")
    if cfg.block_size < 2:
        problems.append(f"block_size {cfg.block_size} < 2")
    if problems:
        raise BlockdraftError("drafter does not fit the target: " + "; ".join(problems))
