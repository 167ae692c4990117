"""A drafter written as GGUF for llama.cpp (`llama-server -md DRAFT.gguf --spec-type draft-dflash`).

llama.cpp's DFlash model (`src/models/dflash.cpp`, arch "dflash") reads what its converter
(`convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET`, class DFlashModel) writes, and this
module writes the same keys and tensors with the `gguf` package, which has no MODEL_ARCH.DFLASH in
the version we pin, so keys are written by name:

- `dflash.*` hyperparameters as Qwen3's (the draft's layers are Qwen3-style whatever the target),
  `dflash.block_size`, and `dflash.target_layers`: the tap layer ids + 1 (llama.cpp counts the
  embedding output as layer 0, as HF's `hidden_states` do);
- the target's tokenizer: every `tokenizer.*` key of the target's own GGUF, copied as it is (llama
  .cpp refuses a draft whose vocabulary differs from the target's), plus
  `tokenizer.ggml.mask_token_id`;
- the draft's own tensors only. token_embd and output are TENSOR_NOT_REQUIRED in dflash.cpp: a
  full-vocabulary draft takes the target's embedding and head through the target's context, and
  the converter writes neither (our checkpoints do not hold them; DFLASH.md).

`write_f32_gguf` writes a GGUF's tensors dequantized to F32 beside all its keys: the bundled
target (Q4_1) as the fp32 weights blockdraft computes with, for comparing llama.cpp with us.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BlockdraftError

ARCH = "dflash"
MASK_TOKEN_KEY = "tokenizer.ggml.mask_token_id"
OUTTYPES = ("auto", "f32", "f16", "bf16")  # auto: matrices keep the checkpoint's float type

# the drafter's safetensors names (unprefixed, z-lab's format) -> llama.cpp's; {i} is the layer
GLOBAL_TENSORS = {
    "fc.weight": "fc.weight",  # [H, K*H]: the K taps fused into one context feature
    "hidden_norm.weight": "enc.output_norm.weight",  # [H]: RMSNorm after fc
    "norm.weight": "output_norm.weight",  # [H]: the final norm before the target's head
}
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",  # [heads*head_dim, H]
    "self_attn.k_proj.weight": "attn_k.weight",  # [kv_heads*head_dim, H]
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",  # [H, heads*head_dim]
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # [head_dim]
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",  # [I, H]
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",  # [H, I]
}


@dataclass
class Field:
    """One GGUF key as read from a file, written back unchanged."""

    key: str
    value: Any
    vtype: Any  # gguf.GGUFValueType
    sub_type: Any = None  # the element type of an array


@dataclass
class Tensor:
    """One tensor to write: numpy data in GGUF's row order, and its GGML type where numpy has none."""

    data: np.ndarray  # [out, in] floats (GGUF shape [in, out]), or BF16 bytes [out, 2*in]
    raw_dtype: Any = None  # gguf.GGMLQuantizationType.BF16, else None (the dtype says F32 / F16)


@dataclass
class TargetGGUF:
    """What a drafter's GGUF takes from its target's GGUF."""

    path: Path
    tokenizer: list[Field]  # every tokenizer.* key
    n_vocab: int  # len(tokenizer.ggml.tokens): llama.cpp's vocabulary size
    n_layers: int | None  # {arch}.block_count
    n_embd: int | None  # {arch}.embedding_length


@dataclass
class DraftGGUF:
    """A written drafter GGUF: what llama.cpp will read from it."""

    path: Path
    target: Path  # the target GGUF whose tokenizer it carries (llama-server's -m)
    block_size: int
    target_layers: list[int]  # as written: tap layer ids + 1
    mask_token_id: int
    n_tensors: int
    n_bytes: int


def read_target(path: str | Path) -> TargetGGUF:
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise BlockdraftError(f"target GGUF {str(path)!r} does not exist")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as err:
        raise BlockdraftError(f"{path} is not a readable GGUF file ({err})") from err
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise BlockdraftError(f"{path} holds no tokenizer (tokenizer.ggml.tokens): the draft needs the target's")
    tokenizer = [_field(f) for k, f in reader.fields.items() if k.startswith("tokenizer.") and k != MASK_TOKEN_KEY]
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None

    def scalar(name: str) -> int | None:
        f = reader.fields.get(f"{arch}.{name}")
        return None if f is None else int(f.contents())

    return TargetGGUF(path, tokenizer, len(tokens.data), scalar("block_count"), scalar("embedding_length"))


def export_drafter(draft_dir: str | Path, target: TargetGGUF, out: str | Path, outtype: str = "auto") -> DraftGGUF:
    """Writes the drafter in `draft_dir` (config.json + model.safetensors) as a llama.cpp DFlash GGUF."""
    import gguf

    from .checkpoint import STUDY_ARCHITECTURE, config_from_json

    draft_dir, out = Path(draft_dir), Path(out)
    if outtype not in OUTTYPES:
        raise BlockdraftError(f"outtype must be one of {list(OUTTYPES)} (got {outtype!r})")
    config_path, weights_path = draft_dir / "config.json", draft_dir / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise BlockdraftError(f"{draft_dir} is not a drafter (needs config.json and model.safetensors)")
    raw = json.loads(config_path.read_text())
    cfg = config_from_json(raw, str(config_path))
    if STUDY_ARCHITECTURE in (raw.get("architectures") or []) or not cfg.standard:
        raise BlockdraftError(f"{draft_dir} is a `blockdraft ablate` variant (input fusion or no target context), "
                              "which only blockdraft runs; llama.cpp runs standard DFlash drafters")
    if cfg.rope_scaling is not None:
        raise BlockdraftError(f"{draft_dir}: a scaled RoPE ({cfg.rope_scaling.get('rope_type')}) is not exported to "
                              "GGUF here; llama.cpp's convert_hf_to_gguf.py --target-model-dir converts it")
    _check_fits(cfg, target, draft_dir)
    tensors = _draft_tensors(weights_path, cfg.num_layers, outtype)

    writer = gguf.GGUFWriter(None, ARCH)
    writer.add_type("model")
    writer.add_name(f"{draft_dir.name} (DFlash drafter, blockdraft)")
    u32 = lambda key, v: writer.add_uint32(f"{ARCH}.{key}", int(v))  # noqa: E731
    u32("block_count", cfg.num_layers)
    u32("context_length", cfg.max_position_embeddings)
    u32("embedding_length", cfg.hidden_size)
    u32("feed_forward_length", cfg.intermediate_size)
    u32("attention.head_count", cfg.num_heads)
    u32("attention.head_count_kv", cfg.num_kv_heads)
    writer.add_float32(f"{ARCH}.rope.freq_base", cfg.rope_theta)
    writer.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    u32("attention.key_length", cfg.head_dim)
    u32("attention.value_length", cfg.head_dim)
    u32("block_size", cfg.block_size)
    target_layers = [i + 1 for i in cfg.target_layer_ids]
    writer.add_key_value(f"{ARCH}.target_layers", target_layers, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    if cfg.layer_types is not None:  # sliding-window layers, as the converter writes them (not run by a check)
        u32("attention.sliding_window", cfg.sliding_window)
        writer.add_array(f"{ARCH}.attention.sliding_window_pattern",
                         [t == "sliding_attention" for t in cfg.layer_types])
    if cfg.is_causal is not None:
        writer.add_bool(f"{ARCH}.attention.causal", cfg.is_causal)
    writer.add_file_type(_file_type(tensors))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for f in target.tokenizer:
        writer.add_key_value(f.key, f.value, f.vtype, f.sub_type)
    writer.add_uint32(MASK_TOKEN_KEY, cfg.mask_token_id)
    for name, t in tensors.items():
        writer.add_tensor(name, t.data, raw_dtype=t.raw_dtype)
    n_bytes = _write(writer, out)
    return DraftGGUF(out, target.path, cfg.block_size, target_layers, cfg.mask_token_id, len(tensors), n_bytes)


def write_f32_gguf(src: str | Path, out: str | Path) -> Path:
    """Every key of `src` and every tensor dequantized to F32 (gguf's own dequantization, which
    transformers' GGUF loading uses too), general.file_type set to ALL_F32."""
    import gguf

    reader = gguf.GGUFReader(src)
    fields = [_field(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")]
    arch = next(f.value for f in fields if f.key == "general.architecture")
    writer = gguf.GGUFWriter(None, arch)
    for f in fields:
        if f.key == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        elif f.key != "general.architecture":
            writer.add_key_value(f.key, f.value, f.vtype, f.sub_type)
    for t in reader.tensors:
        # t.data: [rows, row bytes] of blocks (or [rows, cols] of floats) -> [rows, cols] fp32
        data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape(tuple(int(d) for d in reversed(t.shape))))
    _write(writer, Path(out))
    return Path(out)


def _field(f) -> Field:
    from gguf import GGUFValueType

    if f.types[0] == GGUFValueType.ARRAY:
        if len(f.types) != 2:
            raise BlockdraftError(f"GGUF key {f.name}: nested arrays are not copied")
        return Field(f.name, f.contents(), f.types[0], f.types[1])
    return Field(f.name, f.contents(), f.types[0])


def _check_fits(cfg, target: TargetGGUF, draft_dir: Path) -> None:
    if cfg.vocab_size != target.n_vocab:
        raise BlockdraftError(f"{draft_dir} has vocab_size {cfg.vocab_size} but the target GGUF {target.path} has "
                              f"{target.n_vocab} tokens: the drafter shares the target's embedding and head")
    if not 0 <= cfg.mask_token_id < target.n_vocab:
        raise BlockdraftError(f"mask_token_id {cfg.mask_token_id} is outside the target's {target.n_vocab} tokens")
    if target.n_embd is not None and target.n_embd != cfg.hidden_size:
        raise BlockdraftError(f"{draft_dir} has hidden_size {cfg.hidden_size} but the target GGUF's "
                              f"embedding_length is {target.n_embd}")
    if target.n_layers is not None and max(cfg.target_layer_ids) >= target.n_layers:
        raise BlockdraftError(f"{draft_dir} taps layers {cfg.target_layer_ids} but the target GGUF has "
                              f"{target.n_layers} layers")


def _draft_tensors(weights_path: Path, n_layers: int, outtype: str) -> dict[str, Tensor]:
    """GGUF name -> Tensor, in the converter's order. Vectors (norms) are F32 whatever
    the outtype, as the converter writes them; matrices [out, in] become GGUF [in, out] as they are."""
    import torch
    from gguf import GGMLQuantizationType as Q
    from gguf import quants
    from safetensors.torch import load_file

    state = load_file(str(weights_path))
    names = dict(GLOBAL_TENSORS)
    for i in range(n_layers):
        names.update({f"layers.{i}.{k}": f"blk.{i}.{v}" for k, v in LAYER_TENSORS.items()})
    optional = {f"layers.{i}.self_attn.v_proj.weight" for i in range(n_layers)}
    missing = [k for k in names if k not in state and k not in optional]
    unknown = [k for k in state if k not in names]
    if missing or unknown:
        raise BlockdraftError(f"{weights_path}: not a DFlash drafter's tensors "
                              f"(missing {missing[:4]}, unexpected {unknown[:4]})")
    kinds = {torch.float32: Q.F32, torch.float16: Q.F16, torch.bfloat16: Q.BF16}
    out = {}
    for name, gguf_name in names.items():
        if name not in state:
            continue
        t = state[name]
        if t.dtype not in kinds:
            raise BlockdraftError(f"{weights_path}: {name} is {t.dtype}; a float type is expected")
        kind = Q.F32 if t.dim() == 1 else {"auto": kinds[t.dtype], "f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16}[outtype]
        data = t.float().numpy()
        if kind == Q.F16:
            data = data.astype(np.float16)
        elif kind == Q.BF16:
            data = quants.quantize(data, Q.BF16)  # uint8 [rows, 2*cols]; exact for bf16 weights
        out[gguf_name] = Tensor(data, Q.BF16 if kind == Q.BF16 else None)
    return out


def _file_type(tensors: dict[str, Tensor]) -> int:
    from gguf import GGMLQuantizationType as Q
    from gguf import LlamaFileType

    if any(t.raw_dtype == Q.BF16 for t in tensors.values()):
        return LlamaFileType.MOSTLY_BF16
    if any(t.data.dtype == np.float16 for t in tensors.values()):
        return LlamaFileType.MOSTLY_F16
    return LlamaFileType.ALL_F32


def _write(writer, out: Path) -> int:
    """Writes into a temporary file beside `out` and renames it: a cut-short write leaves no GGUF."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    try:
        writer.write_header_to_file(path=Path(tmp))
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out.stat().st_size
