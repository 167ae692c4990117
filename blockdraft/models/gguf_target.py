"""A target's linear layers kept in their GGUF blocks (issue 50).

transformers loads a GGUF by dequantizing every tensor to fp32 (`gguf.dequantize`), then un-permutes
the rows of Q and K that llama.cpp's converter permuted. `keep_blocks` swaps each linear layer whose
GGUF tensor is of a kind the few-row kernel computes (gguf_blocks.py) for a `BlockLinear` over the
file's own blocks, rows put in transformers' order, and frees the fp32 weight. The block kernel
dequantizes in registers to those very fp32 weights and sums as the fp32 kernel sums, so every
output is bitwise what the dequantized layer gave: greedy output is unchanged, at a fifth to a third
of the bytes a step streams. Each swap is checked against the loaded weight (a few columns of every
row, bitwise) before the weight is dropped, so a wrong name or row order is refused, never computed
with.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from ..ops import few_rows, int8_activations
from ..ops.gguf_blocks import KINDS, BlockPanels, block_linear, dequantize, kind_name, pack_blocks
from ..ops.switch import packed_enabled

# calls of this many rows or more (a long prompt's prefill) multiply the dequantized fp32 weight
# with oneDNN, as the fp32 target does above the few-row kernel's 64 rows: 2,000 prompt tokens took
# 4.9 s through the block kernel 64 rows at a time, 2.6 s on the fp32 weights. At most
# few_rows.MAX_ROWS, so that any fewer rows are one kernel call.
DENSE_ROWS = 256
CHECK_COLUMNS = 3  # input columns of each weight compared bitwise with the loaded fp32 before it is dropped


class BlockLinear(nn.Module):
    """A linear layer computed from GGUF blocks (fp32 in, fp32 out): fewer than DENSE_ROWS rows by
    the block kernel (`rows_kernel`), calls of DENSE_ROWS or more (a long prompt) by oneDNN on the
    dequantized weight, as the fp32 target's prefill runs; within `switch.use_packed(False)`, and
    where a gradient must flow through it, transformers' way, on the dequantized weight."""

    def __init__(self, panels: BlockPanels, bias: torch.Tensor | None):
        super().__init__()
        self.panels = panels
        self.in_features, self.out_features = panels.in_features, panels.out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)
        self._rows_kernel = None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized fp32 weight [N, K], made on each access (the drafter's vocabulary subset
        copies rows of the head once)."""
        return dequantize(self.panels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the kernel has no backward: a gradient through the layer (training a drafter against the
        # target's head) takes transformers' way, on the same fp32 weight
        if not packed_enabled() or x.dtype != torch.float32 or x.device.type != "cpu" \
                or (x.requires_grad and torch.is_grad_enabled()):
            return nn.functional.linear(x, self.weight.to(x), self.bias)
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        if len(rows) >= DENSE_ROWS:  # a long prompt: the weight made once beats re-reading blocks per 64 rows
            return nn.functional.linear(x, self.weight, self.bias)
        return self.rows_kernel()(rows).view(*x.shape[:-1], self.out_features)

    def rows_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The call `forward` makes on fp32 CPU rows [M, K], M < DENSE_ROWS -> [M, N] (+ bias): the
        exact block kernel, or the int8 one in that mode (int8_activations.py), without forward's
        checks. Made once, over the layer's tensors as they are (a block layer runs on the CPU
        only): a decode step (llama_step.py) calls it directly, 120 times a token."""
        if self._rows_kernel is None:
            p, bias, ext = self.panels, self.bias, few_rows.library()
            m, kind, n = p.m if p.m is not None else p.d.new_empty(0), KINDS[p.kind].number, p.out_features

            def call(rows: torch.Tensor) -> torch.Tensor:
                if int8_activations.MODE.on:
                    y = ext.block_linear_q8(rows, int8_activations.vnni_codes(p), p.d, m, n, kind)
                else:
                    y = ext.block_linear(rows, p.codes, p.d, m, n, kind)
                if bias is not None:
                    y += bias
                return y

            self._rows_kernel = call
        return self._rows_kernel

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={self.panels.kind}"


@dataclass
class BlockReport:
    """What `keep_blocks` did: layers by block kind, the bytes the kept layers now hold against
    their fp32 weights, and the tensors left dequantized (kind or reason)."""

    kinds: dict[str, int] = field(default_factory=dict)
    block_bytes: int = 0
    fp32_bytes: int = 0
    left: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items()))
        return (f"{sum(self.kinds.values())} linear layers kept in GGUF blocks ({kinds}): "
                f"{self.block_bytes / 2**20:.0f} MiB against {self.fp32_bytes / 2**20:.0f} MiB in fp32")


def _row_order(processor, name: str, rows: int) -> np.ndarray | None:
    """The order transformers gives a GGUF tensor's rows (Q/K un-permuted), found by running its
    tensor processor on the row numbers; None where it does more than reorder rows."""
    index = np.arange(rows, dtype=np.float64)[:, None]  # [N, 1]
    try:
        out = processor.process(weights=index, name=name, tensor_key_mapping={}, parsed_parameters={"tensors": {}})
    except Exception:  # a processor that needs the real weights (MoE experts, fused tensors)
        return None
    w = np.asarray(getattr(out, "weights", None))
    if getattr(out, "name", None) != name or w.shape != index.shape:
        return None
    order = w[:, 0].astype(np.int64)
    return order if np.array_equal(np.sort(order), np.arange(rows)) else None


def keep_blocks(model: nn.Module, gguf_path: str | Path, cache: Path | None = None) -> BlockReport:
    """Swap `model`'s linear layers (loaded by transformers from `gguf_path`, fp32, CPU) for
    `BlockLinear`s over the file's blocks where the kernel computes their kind. `cache`: a
    safetensors file of the packed blocks, read if it exists (reading the GGUF and packing its
    blocks took 10-30 s for SmolLM2), written after packing otherwise."""
    packed = _read_cache(cache) if cache is not None and cache.is_file() else None
    if packed is None:
        packed = _pack_file(model, gguf_path)
        if cache is not None:
            _write_cache(cache, packed)
    modules = dict(model.named_modules())
    report = BlockReport(left=dict(packed.left))
    for owner, panels in packed.layers.items():
        linear = modules.get(owner)
        if not isinstance(linear, nn.Linear) or (linear.out_features, linear.in_features) != \
                (panels.out_features, panels.in_features):
            raise RuntimeError(f"{owner}: no linear layer of shape [{panels.out_features}, {panels.in_features}]")
        _check(owner, panels, linear.weight.detach())
        parent, _, attr = owner.rpartition(".")
        setattr(modules[parent] if parent else model, attr, BlockLinear(panels, linear.bias))
        report.kinds[panels.kind] = report.kinds.get(panels.kind, 0) + 1
        report.block_bytes += panels.nbytes
        report.fp32_bytes += panels.out_features * panels.in_features * 4
    # The loaded weights may be views of one memory-mapped file, whose pages the checks above
    # touched: a copy of what stays fp32 (norms, the embedding) lets the whole mapping go.
    for param in model.parameters():
        param.data = param.data.clone()
    if report.left:
        kinds = sorted(set(report.left.values()))
        print(f"blockdraft: {len(report.left)} GGUF tensors stay dequantized to fp32 ({', '.join(kinds)})",
              file=sys.stderr)
    return report


def _check(owner: str, panels: BlockPanels, weight: torch.Tensor) -> None:
    """Refuse blocks that do not dequantize, in the kernel, to the loaded weight: a few input
    columns of every row, compared bitwise (a wrong name or row order fails here)."""
    k = panels.in_features
    cols = torch.linspace(0, k - 1, CHECK_COLUMNS).long()
    got = block_linear(torch.eye(k)[cols], panels)  # [C, N]: column c of the weight, exactly
    if not torch.equal(got, weight[:, cols].T):
        raise RuntimeError(f"{owner}: the GGUF blocks do not dequantize to the loaded weight")


@dataclass
class _Packed:
    layers: dict[str, BlockPanels]  # module name -> its blocks
    left: dict[str, str]  # tensors left dequantized: name -> kind or reason


def _pack_file(model: nn.Module, gguf_path: str | Path) -> _Packed:
    """The blocks of every linear layer the kernel computes, rows in transformers' order."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, read_field)

    reader = GGUFReader(str(gguf_path))
    arch = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)  # GGUF tensor name -> HF parameter name
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    tied = bool(getattr(model.config, "tie_word_embeddings", False)) and isinstance(head, nn.Linear) \
        and "output.weight" not in {t.name for t in reader.tensors}
    head_name = next(name for name, m in modules.items() if m is head) if tied else None
    packed = _Packed({}, {})
    for tensor in reader.tensors:
        hf = names.get(tensor.name)
        if tied and tensor.name == "token_embd.weight":  # the tied head: the embedding's blocks (it stays fp32)
            hf = f"{head_name}.weight"
        if hf is None or not hf.endswith(".weight") or not isinstance(modules.get(hf[:-7]), nn.Linear):
            continue
        linear = modules[hf[:-7]]
        kind = kind_name(tensor.tensor_type)
        if kind is None:
            packed.left[hf] = tensor.tensor_type.name
            continue
        n, k = linear.out_features, linear.in_features
        order = _row_order(processor, tensor.name, n)
        if order is None or tuple(int(s) for s in reversed(tensor.shape)) != (n, k):
            packed.left[hf] = "rows not a plain reordering"
            continue
        raw = np.asarray(tensor.data).reshape(n, -1)[order]  # [N, K / 32 * block bytes], transformers' row order
        packed.layers[hf[:-7]] = pack_blocks(raw, kind, n, k)
    return packed


def _write_cache(path: Path, packed: _Packed) -> None:
    """The packed blocks as safetensors (never a pickle), written to a temporary name and renamed."""
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for name, p in packed.layers.items():
        tensors[f"{name}.codes"], tensors[f"{name}.d"] = p.codes, p.d
        if p.m is not None:
            tensors[f"{name}.m"] = p.m
        meta[name] = [p.kind, p.out_features, p.in_features]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"layers": json.dumps(meta), "left": json.dumps(packed.left)})
    os.replace(tmp, path)


def _read_cache(path: Path) -> _Packed | None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            layers = {}
            stored = set(f.keys())
            for name, (kind, n, k) in json.loads(meta["layers"]).items():
                m = f.get_tensor(f"{name}.m") if f"{name}.m" in stored else None  # the kinds with offsets
                layers[name] = BlockPanels(kind, f.get_tensor(f"{name}.codes"), f.get_tensor(f"{name}.d"), m, n, k)
            return _Packed(layers, json.loads(meta.get("left", "{}")))
    except (SafetensorError, OSError, KeyError, ValueError):
        return None  # unreadable or from another version: packed again
