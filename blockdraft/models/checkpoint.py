"""Drafter checkpoints in the z-lab format (DFLASH.md), loadable unchanged by vLLM, SGLang and the
reference `DFlashDraftModel`: `config.json` + `model.safetensors` with unprefixed keys.
Safetensors only: a checkpoint never runs code when loaded.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from .draft import SCALED_ROPE_TYPES, DraftConfig, DraftModel, init_scale_check
from .draft_config import EMBEDDING_TAP
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
                                                    "blockdraft_conditioning"}
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


def _dummy() -> DraftConfig:
    return DraftConfig(8, 8, 1, 1, 1, 8, 8, 1, [0], 0)


def save_draft(model: DraftModel, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write config.json and model.safetensors atomically (temp files, then rename)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in model.state_dict().items()}
    for name, payload in (("model.safetensors", state), ("config.json", config_to_json(model.cfg))):
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
        os.close(fd)
        if name.endswith(".safetensors"):
            save_file(payload, tmp, metadata={"format": "pt"})
        else:
            Path(tmp).write_text(json.dumps(payload, indent=2) + "\n")
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a checkpoint is meant to be shared
        os.replace(tmp, directory / name)
    from .vocab import remove_vocab, save_vocab

    if model.vocab_ids is not None:
        save_vocab(directory, model.vocab_ids, model.cfg.vocab_size)
    else:
        remove_vocab(directory)  # a stale subset of the weights this directory held before
    return directory


def load_draft(directory: str | os.PathLike, device=None, dtype: torch.dtype | None = None) -> DraftModel:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

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
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as err:
        raise BlockdraftError(f"{weights}: not a readable safetensors file ({err})") from err
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
    from .vocab import load_vocab

    model.vocab_ids = load_vocab(directory, cfg.vocab_size)  # a draft vocabulary subset, if it has one
    return model.to(device=device, dtype=dtype).eval()


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
