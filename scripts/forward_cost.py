"""The target forward's cost by number of tokens, as the engine runs it (SmolLM2 through the slot
cache at a 256-token context; a median of 15, the lowest of three such runs, the choices
alternating): on the few-row kernel (few_rows.py) against oneDNN's packed one (docs/step-cost.md).

    python scripts/forward_cost.py [--tokens 1,2,4,8,16]
    python scripts/forward_cost.py --linear       # the body's linear layers alone, by kernel and rows
    python scripts/forward_cost.py --norms        # fused RMSNorms (norms.py) against transformers' own
    python scripts/forward_cost.py --draft        # the bundled drafter's forward and head, by block and setup
    python scripts/forward_cost.py --attention    # the target forward, few-row attention against SDPA
    python scripts/forward_cost.py --small-rows   # oneDNN's few-row choice: streamed against in the cache
    python scripts/forward_cost.py --blocks       # the GGUF target's block calls: AVX-512, AVX2, int8 activations
    python scripts/forward_cost.py --step         # the target forward, llama_step.py against transformers' modules
    python scripts/forward_cost.py --prefill 2000 # a long prompt's prefill, GGUF blocks against fp32 weights
"""

import argparse

import torch

from blockdraft.decoding.slots import RowBlock, SlotCache
from blockdraft.models.llama_step import LlamaStep
from blockdraft.ops import attention, few_rows, precision
from blockdraft.ops import packed as kernels
from blockdraft.ops.norms import fuse_norms, unfuse_norms
from blockdraft.lab.profiling import evict_caches, timed
from blockdraft.models.target import load_target


def forward_ms(target, tokens: list[int]) -> dict[int, float]:
    ctx = list(range(100, 356))
    with torch.inference_mode():
        cache = target.new_cache()
        target.forward(torch.tensor([ctx]), cache, None, logits_at=1)
        slots = SlotCache()
        slots.join(cache)

        def step(b):
            slots.forward(target, [RowBlock(list(range(b)))], None)
            slots.keep([[]])  # back to the context

        for b in tokens:
            step(b)  # first calls at this row count
        return {b: round(1e3 * timed(lambda b=b: step(b), target.device, 15), 1) for b in tokens}


def linear_ms(tokens: list[int]) -> None:
    """SmolLM2's 30 layers of linear weights (random, same shapes) at each row count: the default
    kernel, oneDNN's packed one and the few-row kernel (few_rows.py, where it runs), and a large
    GEMM for the cores' arithmetic peak."""
    def best(fn) -> float:
        fn()
        return min(timed(fn, torch.device("cpu"), 1) for _ in range(5))

    shapes = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
    weights = [torch.randn(o, i) for _ in range(30) for o, i in shapes]
    packs = [torch.ops.mkldnn._reorder_linear_weight(w, kernels.PACK_HINT) for w in weights]
    panels = [few_rows.pack(w) for w in weights] if few_rows.available() else None
    panels16 = [few_rows.pack(w, torch.bfloat16) for w in weights] if panels is not None else None  # a drafter's
    flops = 2 * sum(w.numel() for w in weights)
    a = torch.randn(2048, 2048)
    gemm = 2 * 2048 ** 3 / best(lambda: a @ a)  # flop/s: the cores' arithmetic as a large GEMM reaches it
    print(f"a 2048^3 GEMM: {gemm / 1e9:.0f} GFLOPS")
    big = torch.ones(1 << 28)  # 1 GiB: the memory's read speed, what one row's weights stream at best
    print(f"a sum over 1 GiB: {big.numel() * 4 / best(big.sum) / 1e9:.1f} GB/s; the body's linear weights: "
          f"{sum(w.numel() for w in weights) * 4 / 1e6:.0f} MB")
    del big
    one = None  # the fastest kernel's time at one row: the floor's denominator
    with torch.inference_mode():
        for rows in tokens:
            x = {n: torch.randn(rows, n) for n in (576, 1536)}
            default = best(lambda: [torch.nn.functional.linear(x[w.shape[1]], w) for w in weights])
            packed = best(lambda: [kernels._onednn(x[w.shape[1]], p) for w, p in zip(weights, packs)])
            line = (f"{rows:2d} rows: default {1e3 * default:5.1f} ms, packed {1e3 * packed:5.1f} ms "
                    f"({flops * rows / packed / 1e9:.0f} GFLOPS)")
            if panels is not None:
                mine = best(lambda: [few_rows.linear(x[w.shape[1]], p, w.shape[0]) for w, p in zip(weights, panels)])
                half = best(lambda: [few_rows.linear(x[w.shape[1]], p, w.shape[0]) for w, p in zip(weights, panels16)])
                line += (f", few-row {1e3 * mine:5.1f} ms ({flops * rows / mine / 1e9:.0f} GFLOPS), "
                         f"bf16 panels {1e3 * half:5.1f} ms")
            fastest = min(packed, mine) if panels is not None else packed
            if rows == 1:
                one = fastest
            if one is not None and rows > 1:  # no kernel multiplies these rows faster than a large GEMM does
                floor = flops * rows / gemm
                line += f"; at the GEMM's rate {1e3 * floor:.1f} ms, {floor / one:.2f}x one row"
            print(line)


FEW_ROWS_APPLIES = few_rows.applies


def use_few_rows(target, on: bool) -> None:
    """Run the target's linear layers on the few-row kernel (on) or packed for oneDNN (off, as
    before it, with the few-row kernel choice of `small_rows`): each layer packs again at its next call."""
    few_rows.applies = FEW_ROWS_APPLIES if on else (lambda w: False)
    for m in target.model.modules():
        if kernels.is_packed(m):
            m.key = None


def kernels_compared(target, tokens: list[int]) -> None:
    """The target forward on the few-row kernel against oneDNN's packed one (alternating, lowest of three)."""
    best = alternating({"oneDNN packed": lambda: use_few_rows(target, False),
                        "few-row kernel": lambda: use_few_rows(target, True)}, lambda: forward_ms(target, tokens), 3)
    print_rows(best, tokens)


def blocks_compared(target, tokens: list[int]) -> None:
    """The GGUF target's block layers alone, in the forward's order (the body's layers, then the
    head), on csrc/blocks512.cpp against the AVX2 kernel and the int8-activation mode's (csrc/q8.cpp)
    where it runs (alternating, lowest of three)."""
    from blockdraft.ops import int8_activations
    from blockdraft.models.gguf_target import BlockLinear

    ext = few_rows.library()
    if not ext.set_avx512(True):
        raise SystemExit("this CPU has no AVX-512")
    head = target.lm_head
    body = [m for m in target.model.modules() if isinstance(m, BlockLinear) and m is not head]

    def measure(layers):
        out = {}
        with torch.inference_mode():
            for rows in tokens:
                x = {n: torch.randn(rows, n) for n in {l.in_features for l in layers}}
                calls = lambda: [l(x[l.in_features]) for l in layers]  # noqa: E731: as the forward calls them
                calls()
                out[rows] = 1e3 * timed(calls, torch.device("cpu"), 15)
        return out

    def mode(avx512: bool, q8: bool):
        ext.set_avx512(avx512)
        int8_activations.MODE.on = q8

    setups = {"AVX-512": lambda: mode(True, False), "AVX2": lambda: mode(False, False)}
    if int8_activations.available():  # the opt-in int8-activation mode's kernel (csrc/q8.cpp)
        setups["int8 activations"] = lambda: mode(True, True)
    try:
        print_rows(alternating(setups, lambda: measure(body), 3), tokens, f"body ({len(body)} calls), rows")
        print_rows(alternating(setups, lambda: measure([head]), 3), tokens, f"head ({head.panels.kind}), rows")
    finally:
        mode(True, False)


def step_compared(target, tokens: list[int]) -> None:
    """The target forward through llama_step.py against transformers' modules (alternating)."""
    step = target.step
    if step is None:
        raise SystemExit("this target takes transformers' modules only (llama_step.py does not apply)")

    def use(s):
        target.step = s

    best = alternating({"transformers' modules": lambda: use(None), "llama_step": lambda: use(step)},
                       lambda: forward_ms(target, tokens), 3)
    print_rows(best, tokens)


def alternating(setups: dict, measure, rounds: int) -> dict:
    """{name: {key: lowest ms}} of `measure()` under each setup in turn, `rounds` times over (the
    machine's speed drifts by minutes: alternating keeps the drift out of the comparison)."""
    best: dict = {}
    for _ in range(rounds):
        for name, setup in setups.items():
            setup()
            row = best.setdefault(name, {})
            for key, ms in measure().items():
                row[key] = min(row.get(key, ms), ms)
    return best


def print_rows(best: dict, keys: list[int], label: str = "tokens") -> None:
    print(f"{label:<30}" + "".join(f"{k:>8}" for k in keys))
    for name, row in best.items():
        print(f"{name:<30}" + "".join(f"{row[k]:8.1f}" for k in keys))


def norms_compared(target, tokens: list[int]) -> None:
    """The target forward with its RMSNorms fused (ops/norms.py) against transformers' own."""
    def unfused():  # llama_step.py runs fused norms only: transformers' modules then
        unfuse_norms(target.model)
        target.step = None

    def fused():
        fuse_norms(target.model)
        target.step = LlamaStep.build(target.model)

    best = alternating({"transformers' norms": unfused, "fused norms": fused}, lambda: forward_ms(target, tokens), 5)
    print_rows(best, tokens)


def attention_compared(target, tokens: list[int]) -> None:
    """The target forward with the few-row attention kernel against SDPA (alternating)."""
    applies = attention.few_row_attention_applies
    best = alternating({"SDPA": lambda: setattr(attention, "few_row_attention_applies", lambda *a: False),
                        "few-row attention": lambda: setattr(attention, "few_row_attention_applies", applies)},
                       lambda: forward_ms(target, tokens), 5)
    attention.few_row_attention_applies = applies
    print_rows(best, tokens)


def draft_compared(target, blocks: list[int], cold: bool = False) -> None:
    """The bundled drafter's forward over a block plus its head over the block's rows, at a
    256-token context with two new context rows per step (a step that committed two tokens), in
    four setups: fp32 as written (the drafter's linear layers packed, as before), with its norms and
    per-head norm + RoPE fused, and with bf16 or int8 weights too (precision.draft_precision); on a
    CPU with native bf16, a fifth: the drafter cast to bf16 and computed by oneDNN.
    cold: the CPU's caches are evicted before each call, as the target's forward evicts them in a
    decode step (else the drafter's 40 MB of weights partly stay in the L3 between calls)."""
    from blockdraft.decoding.engine import Engine
    from blockdraft.models.checkpoint import load_draft
    from blockdraft.models.draft import DraftCache
    from blockdraft.cli.common import bundled_drafter

    draft = load_draft(bundled_drafter("smollm2-135m"))
    ctx = list(range(100, 356))
    with torch.inference_mode():
        taps = target.forward(torch.tensor([ctx]), target.new_cache(), draft.cfg.target_layer_ids).taps

    def setup(dtype, fused):
        def apply():
            Engine(target, draft, draft_dtype=dtype)
            if not fused:
                unfuse_norms(draft)
        return apply

    def measure():
        embed, head = target.embed_tokens, draft.head_for(target.lm_head)
        with torch.inference_mode():
            cache = DraftCache(len(draft.layers))
            past = len(ctx) - 2
            draft.block_hidden(embed, cache, taps[:, :past], 0, past, 16)  # the context's K/V

            def step(b):
                head(draft.block_hidden(embed, cache, taps[:, past:], 0, len(ctx), b))
                cache.length = past  # the same two new rows at the next call

            for b in blocks:
                step(b)
            before = evict_caches if cold else None
            return {b: round(1e3 * timed(lambda b=b: step(b), target.device, 15, before), 2) for b in blocks}

    def onednn_bf16():  # what the engine ran before few-row panels were preferred on such CPUs
        Engine(target, draft, draft_dtype=torch.float32)
        draft.to(dtype=torch.bfloat16)
        draft.weight_storage = None
        kernels.prepack(draft, None)

    setups = {"fp32, as written": setup(torch.float32, False), "fp32, fused": setup(torch.float32, True),
              "bf16 weights, fused": setup(torch.bfloat16, True), "int8 weights, fused": setup(torch.int8, True)}
    if precision.native_bf16_packing(target.device):
        setups["bf16 compute (oneDNN)"] = onednn_bf16
    best = alternating(setups, measure, 3)
    print_rows(best, blocks, "block (draft forward + head)")


def draft_linear_compared(target, rows: list[int]) -> None:
    """The bundled drafter's linear layers and head (its draft-vocabulary rows) at each number of
    rows, cold (caches evicted before each call), by kernel: int8 and bf16 few-row panels, and
    oneDNN's bf16 arithmetic where the CPU has it (what a drafter's calls of more than
    kernels.MANY_ROWS rows run there)."""
    from blockdraft.cli.common import bundled_drafter
    from blockdraft.models.checkpoint import load_draft

    draft = load_draft(bundled_drafter("smollm2-135m"))
    weights = [m.weight.detach() for m in draft.modules() if isinstance(m, torch.nn.Linear)]
    weights.append(target.lm_head.weight.detach()[draft.vocab_ids])
    kinds = {"int8 panels": [few_rows.pack(w, torch.int8) for w in weights],
             "bf16 panels": [few_rows.pack(w, torch.bfloat16) for w in weights]}
    onednn = precision.native_bf16_packing(target.device)
    if onednn:
        kinds["oneDNN bf16"] = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), kernels.PACK_HINT) for w in weights]
    print("rows".ljust(16) + "".join(f"{r:>8}" for r in rows))
    with torch.inference_mode():
        for name, packs in kinds.items():
            def call(xs, packs=packs, name=name):
                for x, p, w in zip(xs, packs, weights):
                    if name == "oneDNN bf16":
                        kernels._onednn(x.bfloat16(), p).float()
                    else:
                        few_rows.linear(x, p, w.shape[0], None)
            cells = []
            for r in rows:
                xs = [torch.randn(r, w.shape[1]) for w in weights]
                cells.append(1e3 * timed(lambda: call(xs), target.device, 15, evict_caches))
            print(name.ljust(16) + "".join(f"{c:8.2f}" for c in cells))


def small_rows_compared(target, tokens: list[int]) -> None:
    """oneDNN's few-row kernel choice measured over streamed weights against one weight kept in the cache."""
    use_few_rows(target, False)
    shapes = {(m.in_features, m.out_features) for m in target.model.modules() if isinstance(m, torch.nn.Linear)}
    streamed = forward_ms(target, tokens)
    chosen = dict(kernels.SMALL_ROWS)
    with torch.inference_mode():  # the old measure: one weight of each shape, called again and again
        for n_in, n_out in shapes:
            w = torch.randn(n_out, n_in)
            key = (n_in, n_out, w.dtype, torch.get_num_threads())
            kernels.SMALL_ROWS[key] = kernels._measure_small_rows(
                [w], [torch.ops.mkldnn._reorder_linear_weight(w, kernels.PACK_HINT)])
    cached = dict(kernels.SMALL_ROWS)
    in_cache = forward_ms(target, tokens)
    for _ in range(2):  # alternate, twice more, and keep each one's lowest: the machine's speed drifts
        for choice, best in ((chosen, streamed), (cached, in_cache)):
            kernels.SMALL_ROWS.clear()
            kernels.SMALL_ROWS.update(choice)
            for b, ms in forward_ms(target, tokens).items():
                best[b] = min(best[b], ms)
    for key in sorted(chosen):
        print(f"{key[0]} x {key[1]}: default kernel below {cached[key]} rows (measured in the cache), "
              f"below {chosen[key]} (streamed)")
    print("tokens          " + "".join(f"{b:>8}" for b in tokens))
    print("in the cache    " + "".join(f"{in_cache[b]:8.1f}" for b in tokens))
    print("streamed        " + "".join(f"{streamed[b]:8.1f}" for b in tokens))


def prefill_compared(prompt_tokens: int) -> None:
    """A long prompt's prefill (one forward, the last row's logits) on the GGUF target computing
    from its blocks against the same model on its fp32 weights: three runs each after a warm-up."""
    import time

    from blockdraft.ops.gguf_blocks import dequantize, dequantize_torch
    from blockdraft.models.gguf_target import BlockLinear

    ids = torch.randint(100, 40_000, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    for blocks in (True, False):
        target = load_target("smollm2-135m", blocks=blocks)

        def prefill():
            with torch.inference_mode():
                target.forward(ids, target.new_cache(), None, logits_at=1)

        prefill()
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            prefill()
            runs.append(time.perf_counter() - t)
        print(f"{'GGUF blocks' if blocks else 'fp32 weights'}: a {prompt_tokens}-token prefill "
              + ", ".join(f"{r:.2f}" for r in runs) + " s")
        if blocks:
            layers = [m.panels for m in target.model.modules() if isinstance(m, BlockLinear)]
            for name, fn in (("the extension", dequantize), ("torch's ops", dequantize_torch)):
                t = time.perf_counter()
                for panels in layers:
                    fn(panels)
                print(f"  dequantizing its {len(layers)} block layers by {name}: {time.perf_counter() - t:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,2,4,8,16")
    parser.add_argument("--linear", action="store_true", help="the body's linear layers alone, by kernel")
    parser.add_argument("--norms", action="store_true", help="fused RMSNorms against transformers' own")
    parser.add_argument("--draft", action="store_true", help="the bundled drafter's forward and head, by setup")
    parser.add_argument("--attention", action="store_true", help="few-row attention against SDPA")
    parser.add_argument("--draft-linear", action="store_true",
                        help="the drafter's linear layers and head by rows, cold: panels against oneDNN's bf16")
    parser.add_argument("--cold", action="store_true",
                        help="with --draft: evict the CPU's caches before each call, as in a decode step")
    parser.add_argument("--blocks", action="store_true", help="the GGUF block kernel's calls, AVX-512 against AVX2")
    parser.add_argument("--step", action="store_true", help="the forward, llama_step.py against transformers' modules")
    parser.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                        help="a prompt's prefill on the GGUF blocks against the fp32 weights")
    parser.add_argument("--small-rows", action="store_true",
                        help="oneDNN's few-row kernel choice measured streamed against in the cache")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.linear:
        return linear_ms(tokens)
    if args.prefill:
        return prefill_compared(args.prefill)
    target = load_target("smollm2-135m")
    if args.small_rows:
        return small_rows_compared(target, tokens)
    if args.blocks:
        return blocks_compared(target, tokens)
    if args.step:
        return step_compared(target, tokens)
    if args.norms:
        return norms_compared(target, tokens)
    if args.draft_linear:
        return draft_linear_compared(target, tokens)
    if args.draft:
        return draft_compared(target, [b for b in tokens if b >= 2], args.cold)
    if args.attention:
        return attention_compared(target, tokens)
    kernels_compared(target, tokens)


if __name__ == "__main__":
    main()
