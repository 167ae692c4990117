"""`blockdraft bench`: methods side by side in one process, on the same prompts, interleaved
prompt by prompt after a warm-up, with an identical-output check at temperature 0.

Methods: `dflash` (our engine as it ships: the drafter, and prompt-lookup proposals where they pay,
see lookup.py), `dflash-lookup` (the drafter alone), `ar` (our engine, no drafter: plain decoding),
`ar+lookup` (plain decoding plus prompt lookup), `hf` (transformers
`generate`, as a user would call it), `hf-pld` (transformers prompt-lookup decoding),
`hf-assisted` (transformers assisted generation with a given assistant model), and `oracle`: the
drafter's real forward, but proposing the target's own greedy continuation, each token kept with
probability `oracle_keep` (`oracle@K` sets K per method, so several run side by side), which
gives the engine's speed at a controlled tau, apart from drafter quality. A `:B` suffix fixes
the block of one engine method (`oracle@0.9:16`, `dflash:8`) while the others keep
`--block-size` or the adaptive policy; a `/DTYPE` suffix runs one method's own copy of the drafter
in that dtype (`dflash/float32` beside `dflash`; methods.py parses the names).

Speedups are ratios of end-to-end tokens/s (prefill included) measured in this run;
`decode_tok_s` excludes prefill where it is known (our engine), and `decode_speedup_vs_ar`, their
ratio, is what the cost model's ceiling bounds (decode steps only, at tokens per step over all
steps). transformers reports no acceptance, so its methods have no tau (plain `hf`: 1). With a journal
(journal.py) each prompt's figures are on disk as soon as it ends, and a killed run resumes.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import torch

from ..decoding.engine import LOOKUP_BLOCK, Engine, GenerationConfig, add_counts
from ..errors import BlockdraftError
from ..ops.int8_activations import int8_activations, require as require_int8
from ..ops.packed import packed_kernel
from ..ops.switch import use_packed
from ..decoding.oracle import OracleDraft
from .methods import EXACT_PEERS, PEER_NAMES, check_methods, check_peer_greedy, parse_method, peer_of
from .results import MethodResult
from ..decoding.verify import SamplingParams

PLD_TOKENS = 10  # prompt_lookup_num_tokens for hf-pld (transformers' documented example value)


def _drafter_in(draft, dtype: str | None, target):
    """The drafter a method runs: the caller's as it was set up, or (`/DTYPE`) a copy of it made from
    its weights as they are now, set up in that dtype (the caller's keeps its own packing)."""
    if draft is None or dtype is None:
        return draft
    from ..models.draft import DraftModel

    copy = DraftModel(draft.cfg)
    copy.load_state_dict({k: v.float() for k, v in draft.state_dict().items()})
    copy.vocab_ids = draft.vocab_ids
    Engine(target, copy.eval(), draft_dtype=getattr(torch, dtype))
    return copy


def _setup(draft) -> dict:
    """Engine arguments that keep a drafter's dtype and weight storage as they were set up."""
    return dict(draft_dtype=draft.weight_storage or draft.dtype) if draft is not None else {}


def _run_engine(engine: Engine, ids, cfg: GenerationConfig, res: MethodResult) -> list[int]:
    t0 = time.perf_counter()
    out = engine.generate(ids, cfg)
    res.seconds += time.perf_counter() - t0
    res.tokens += out.num_new_tokens
    res.decode_seconds += out.stats.decode_seconds
    res.decode_tokens += max(out.num_new_tokens - 1, 0)
    res.acceptance_lengths += out.stats.acceptance_lengths
    res.taus.append(out.stats.tau)
    res.lookup_steps += out.stats.lookup_steps
    res.drafted += out.stats.drafted
    res.accepted += out.stats.accepted
    res.tree_sizes += out.stats.tree_sizes
    add_counts(res.tree_nodes_by_depth, out.stats.tree_nodes_by_depth)
    for phase, seconds in out.stats.step_seconds.as_dict().items():
        res.step_seconds[phase] = res.step_seconds.get(phase, 0.0) + seconds
    return out.token_ids


def _run_hf(target, ids, cfg: GenerationConfig, res: MethodResult, **extra) -> list[int]:
    s = cfg.sampling
    kwargs = dict(do_sample=False) if s.greedy else dict(do_sample=True, temperature=s.temperature,
                                                         top_k=s.top_k or None, top_p=s.top_p)
    stop = target.stop_token_ids
    t0 = time.perf_counter()
    with torch.inference_mode(), use_packed(False):  # transformers as a user calls it: its own kernels
        out = target.reference_model().generate(
            torch.tensor([ids], device=target.device), attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                                                 device=target.device),
            max_new_tokens=cfg.max_new_tokens, eos_token_id=stop or None,
            pad_token_id=stop[0] if stop else 0, **kwargs, **extra,
        )[0, len(ids):].tolist()
    res.seconds += time.perf_counter() - t0
    res.tokens += len(out)
    if not extra:
        res.taus.append(1.0)  # plain generate: one token per forward
    return out


@torch.inference_mode()
def measure_costs(target, draft, prompt_ids: list[int], block_size: int, repeats: int = 9,
                  verify_size: int | None = None) -> dict:
    """Seconds of a target forward over b new tokens (b = 1..max(B, verify_size), after the prompt)
    and of one draft forward for a block of B: the cost model behind the ceiling speedup."""
    from ..models.draft import DraftCache
    from ..lab.profiling import timed as timed_on

    def timed(fn) -> float:
        return timed_on(fn, target.device, repeats)

    cache = target.new_cache()
    taps = draft.cfg.target_layer_ids if draft is not None else None
    out = target.forward(torch.tensor([prompt_ids], device=target.device), cache, taps, logits_at=1)
    n = len(prompt_ids)
    t_target = {}
    for b in range(1, max(block_size, verify_size or 0) + 1):
        ids = torch.zeros(1, b, dtype=torch.long, device=target.device)

        def verify(ids=ids):
            target.forward(ids, cache, taps).logits  # the body and the head over all b rows
            target.rollback(cache, n)

        t_target[b] = timed(verify)
    t_draft = 0.0
    if draft is not None:
        dcache = DraftCache(len(draft.layers))
        head = draft.head_for(target.lm_head)
        draft.block_logits(target.embed_tokens, head, dcache, out.taps, 0, n, block_size)
        empty = out.taps[:, :0]
        t_draft = timed(lambda: draft.block_logits(target.embed_tokens, head, dcache, empty, 0, n,
                                                   block_size))
    return {"t_target": t_target, "t_draft": t_draft, "block_size": block_size}


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def median_costs(samples: list[dict]) -> dict:
    """The per-prompt cost measurements combined: the median of each forward's time."""
    return {"t_target": {b: _median([s["t_target"][b] for s in samples]) for b in samples[0]["t_target"]},
            "t_draft": _median([s["t_draft"] for s in samples]), "block_size": samples[0]["block_size"],
            "samples": len(samples)}


def ceiling_speedup(costs: dict, tau: float, block_size: int | None = None) -> float:
    """tau * t(1) / (t_verify(B) + t_draft): the speedup over plain decoding if nothing but the
    two forwards cost time (B: the measured block unless given; the draft cost is the measured one)."""
    b = block_size or costs["block_size"]
    return tau * costs["t_target"][1] / (costs["t_target"][b] + costs["t_draft"])


def run_bench(target, draft, prompts: list[list[int]], methods=("dflash", "ar", "hf", "oracle"), max_new_tokens: int = 256,
              block_size: int | None = None, temperature: float = 0.0, warmup: int = 1,
              progress: bool = True, oracle_keep: float = 0.9, assistant=None,
              references: list[list[int]] | None = None, cost_repeats: int = 3, profile: bool = True,
              packed: bool = True, peer=None, journal=None, journal_tags: dict | None = None,
              coupling: str = "gumbel") -> dict:
    """`references`: each prompt's greedy continuation for the oracle (computed here when None).
    `cost_repeats`: timings of each forward per prompt for the cost model. `profile`: after the
    prompts, the cost of each part of a step by number of tokens (lab/profiling.py), in this run.
    `packed=False`: our engine on transformers' own linear kernels too (ops/packed.py), the
    "before" of the fast forward; hf methods always run those. `peer`: {method: a started
    peer_vllm.VllmPeer or peer_llamacpp.LlamaCppPeer} for the other engines' methods. `journal`: a file where each prompt's figures are
    appended as it ends; the prompts it already holds (from an interrupted run of the same
    configuration) are not run again (journal.py). `journal_tags`: what else names the
    configuration there (the target and drafter the caller loaded, the dataset). `coupling`: how
    sampled methods draw (gumbel.py; with the Gumbel coupling every method of ours samples the same
    text from the same seed, which is checked as greedy text is)."""
    from tqdm import tqdm

    methods = check_methods(tuple(methods))
    if not 0 <= oracle_keep <= 1:
        raise BlockdraftError(f"--oracle-keep must be in [0, 1] (got {oracle_keep})")
    specs = {m: parse_method(m, oracle_keep) for m in methods}
    oracles = [m for m in methods if specs[m].name == "oracle"]
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, block_size=block_size, lookup=False,
                           sampling=SamplingParams(temperature=temperature, seed=0), coupling=coupling)
    cfgs = {m: replace(cfg, block_size=specs[m].block_size or block_size, lookup=specs[m].lookup,
                       tree_budget=specs[m].tree_budget) for m in methods}
    if any(specs[m].name in ("dflash", "oracle") for m in methods) and draft is None:
        raise BlockdraftError("methods dflash and oracle need a drafter (--draft PATH, or a bundled one)")
    for m in methods:
        if engine_name := peer_of(specs[m].name):
            check_peer_greedy(engine_name, temperature)
            if m not in (peer or {}):
                raise BlockdraftError(f"the {engine_name} methods need a started {PEER_NAMES[engine_name]} peer "
                                      "(`blockdraft bench` starts one)")
    if any(specs[m].q8 for m in methods):
        require_int8(target)
    if "hf-assisted" in methods and assistant is None:
        raise BlockdraftError("method hf-assisted needs an assistant model (--assistant ID|PATH)")
    if references is not None and len(references) != len(prompts):
        raise BlockdraftError(f"{len(references)} references for {len(prompts)} prompts")
    # one engine per method: what one method's adaptive policies learn must not help another
    drafters = {m: _drafter_in(draft, specs[m].draft_dtype, target) for m in methods if specs[m].name in ("dflash", "oracle")}
    engines = {m: Engine(target, drafters.get(m), **_setup(drafters.get(m)))
               for m in methods if specs[m].name in ("dflash", "ar")}
    plain = engines.get("ar") or Engine(target)

    if journal is not None:
        from .journal import Journal, prompts_digest

        journal = Journal.open(journal, {
            "prompts": prompts_digest(prompts), "methods": list(methods), "max_new_tokens": max_new_tokens,
            "block_size": block_size, "temperature": temperature, "oracle_keep": oracle_keep, "packed": packed,
            "cost_repeats": cost_repeats, "device": str(target.device), "dtype": str(target.dtype),
            "draft_dtype": draft.precision if draft is not None else None, **(journal_tags or {})})
    truth = {tuple(p): r for p, r in zip(prompts, references or [])}  # greedy continuations, for the oracle

    def run(method, ids, res):
        with use_packed(packed), int8_activations(specs[method].q8):
            return run_method(method, ids, res)

    def run_method(method, ids, res):
        name = specs[method].name
        if name == "hf":
            return _run_hf(target, ids, cfg, res)
        if name == "hf-pld":
            return _run_hf(target, ids, cfg, res, prompt_lookup_num_tokens=PLD_TOKENS)
        if name == "hf-assisted":
            return _run_hf(target, ids, cfg, res, assistant_model=assistant.model)
        if peer_of(name):
            from ..lab.peer_vllm import run_peer

            return run_peer(peer[method], method, ids, cfg.max_new_tokens, res)
        if name == "oracle":
            key = tuple(ids)
            if key not in truth:  # computed beforehand, outside the timing
                truth[key] = plain.generate(ids, cfg).token_ids
            oracle = OracleDraft(drafters[method], truth[key], len(ids), specs[method].keep, seed=len(truth))
            return _run_engine(Engine(target, oracle, **_setup(drafters[method])), ids, cfgs[method], res)
        return _run_engine(engines[method], ids, cfgs[method], res)

    done = set(journal.done) if journal is not None else set()
    for ids in prompts[:warmup] if len(done) < len(prompts) else []:  # warm-up: allocator, kernels, caches
        for m in methods:
            run(m, ids, MethodResult())
    b = block_size or (draft.block_size if draft is not None else 1)
    blocks = {m: specs[m].block_size or block_size or (max(b, LOOKUP_BLOCK) if specs[m].lookup else b)
              for m in methods}  # the largest block each method may run
    verified = {m: specs[m].tree_budget or blocks[m] for m in methods}  # tokens its largest verify runs
    # the cost model bounds a drafter's block steps; lookup steps run no draft forward
    ceilings = [m for m in methods if specs[m].name in ("dflash", "oracle") and not specs[m].lookup
                and not specs[m].q8]  # (the cost model times the exact mode)
    results = {m: MethodResult() for m in methods}
    samples = []  # cost-model measurements, one per prompt, taken between its methods' runs
    for i, ids in enumerate(tqdm(prompts, desc="bench", disable=not progress)):
        if i in done:  # figures of an interrupted run, from its journal
            for m, r in journal.results(i).items():
                results[m].add(r)
            sample = journal.cost_sample(i)
            if sample:
                samples.append(sample)
            continue
        mine = {m: MethodResult() for m in methods}  # this prompt's figures, journaled alone
        order = methods[i % len(methods):] + methods[: i % len(methods)]  # rotate who goes first
        for m in order:
            out = run(m, ids, mine[m])
            mine[m].outputs.append(out)
        sample = None
        if ceilings:  # measured under the run's own conditions (a one-off measurement drifts with
            # the machine's state), at a context halfway through this prompt's generation
            with use_packed(packed):
                sample = measure_costs(target, draft, ids + out[: len(out) // 2], max(blocks.values()),
                                       cost_repeats, max(verified.values()))
            samples.append(sample)
        for m in methods:
            results[m].add(mine[m])
        if journal is not None:
            journal.record(i, mine, sample)
    step_profile = None
    if profile:  # at the first prompt's context halfway through its generation, as the cost model
        from ..lab.profiling import BLOCKS, profile_step

        first = prompts[0] + next(iter(results.values())).outputs[0][: max_new_tokens // 2]
        with use_packed(packed):
            step_profile = profile_step(target, draft, first, sorted(set(BLOCKS) | {max(verified.values())}))
    report = {m: r.summary(blocks[m]) for m, r in results.items()}
    costs = median_costs(samples) if ceilings else None
    for m in methods:
        if specs[m].name in ("dflash", "oracle") or specs[m].lookup:
            report[m]["block_size"] = cfgs[m].block_size or "adaptive"
        if specs[m].draft_dtype:
            report[m]["draft_precision"] = drafters[m].precision
        if specs[m].tree_budget:
            report[m]["tree_budget"] = specs[m].tree_budget if cfgs[m].block_size else f"adaptive <= {specs[m].tree_budget}"
        if m in ceilings and report[m]["tau"]:
            # the cost model is per decode step: tokens per step over all steps (not per request)
            lengths = results[m].acceptance_lengths
            tokens_per_step = sum(lengths) / len(lengths)
            # a fixed block's or tree's verify size; an adaptive method's largest (a bound, not a forecast)
            report[m]["ceiling_speedup_vs_ar"] = round(ceiling_speedup(costs, tokens_per_step, verified[m]), 3)
    mismatches = []
    # plain decoding: greedy, transformers' or ours; sampled with the Gumbel coupling, ours (the same
    # seed's text; transformers' sampler draws otherwise); with rejection sampling nothing compares
    coupled = temperature == 0 or coupling == "gumbel"
    reference = "hf" if "hf" in results and temperature == 0 else "ar" if "ar" in results and coupled else None
    q8_reference = "ar+q8" if "ar+q8" in results and coupled else None  # the int8 mode's own plain decoding
    for m, r in results.items() if coupled else ():
        if temperature > 0 and specs[m].name.startswith("hf"):
            continue
        peer_name, q8 = peer_of(specs[m].name), specs[m].q8
        if reference and ((peer_name and peer_name not in EXACT_PEERS) or q8):  # other numerics: how far the texts agree
            report[m]["agreement"] = agreement(r.outputs, results[reference].outputs)
        if q8 and "llamacpp" in results:  # llama.cpp computes with int8 activations too
            report[m]["agreement_with_llamacpp"] = agreement(r.outputs, results["llamacpp"].outputs)
        against = q8_reference if q8 else None if peer_name and peer_name not in EXACT_PEERS else reference
        if against is None or m == against:
            continue
        for i, (a, h) in enumerate(zip(r.outputs, results[against].outputs)):
            if a != h:
                mismatches.append({"method": m, "prompt": i, "against": against})
    for base in ("hf", "ar"):
        if base in report and report[base]["tok_s"]:
            for m in report:
                if report[m]["tok_s"]:
                    report[m][f"speedup_vs_{base}"] = round(report[m]["tok_s"] / report[base]["tok_s"], 3)
    if "ar" in report and report["ar"]["decode_tok_s"]:  # decode only: what the ceiling models
        for m in report:
            if report[m]["decode_tok_s"]:
                report[m]["decode_speedup_vs_ar"] = round(report[m]["decode_tok_s"] / report["ar"]["decode_tok_s"], 3)
    return {"methods": report, "mismatches": mismatches,
            "compared_against": reference or q8_reference, "coupling": coupling if temperature > 0 else None,
            "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "oracle_keep": {m: specs[m].keep for m in oracles} or None,
            "cost_model_seconds": costs and {"target_forward_by_tokens": costs["t_target"], "draft_forward": costs["t_draft"],
                                            "prompts_measured": costs["samples"], "repeats_per_prompt": cost_repeats},
            "step_profile_ms": step_profile, "packed_kernels": packed and packed_kernel(target.device, target.dtype),
            "draft_precision": draft.precision if draft is not None else None,
            **({"resumed_prompts": len(done)} if done else {}),
            "block_size": b, "temperature": temperature, "device": str(target.device)}


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """How far a peer's greedy texts agree with ours: the share of prompts with the same tokens, and
    the mean number of leading tokens two texts share (greedy texts that part once go their own
    ways, so the first difference is what says how close two engines' arithmetic is)."""
    same = sum(a == b for a, b in zip(outputs, reference))
    prefixes = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                for a, b in zip(outputs, reference)]
    return {"identical": f"{same}/{len(reference)}",
            "mean_common_prefix": round(sum(prefixes) / max(len(prefixes), 1), 1),
            "mean_tokens": round(sum(map(len, reference)) / max(len(reference), 1), 1)}


def format_table(report: dict) -> str:
    cols = ["tok_s", "decode_tok_s", "tau", "accepted_per_verified", "speedup_vs_hf", "speedup_vs_ar",
            "decode_speedup_vs_ar", "ceiling_speedup_vs_ar"]
    lines = ["method          " + "".join(f"{c:>22}" for c in cols)]
    for m, r in report["methods"].items():
        lines.append(f"{m:<16}" + "".join(f"{str(r.get(c) if r.get(c) is not None else '-'):>22}" for c in cols))
    against = report.get("compared_against")
    if report["mismatches"]:
        lines.append(f"!!! OUTPUT MISMATCH against {against}: {report['mismatches'][:10]}")
    elif against:
        lines.append(f"outputs identical to {against}'s for every method and prompt")
    elif report["temperature"] == 0:
        lines.append("outputs not compared (add hf or ar to --methods)")
    for m, r in report["methods"].items():
        for key, label, name in (("agreement", "int8 activations; " if "+q8" in m else "its own kernels; ", against),
                                 ("agreement_with_llamacpp", "", "llamacpp")):
            if r.get(key):
                a = r[key]
                lines.append(f"{m}: {label}same text as {name} on {a['identical']} prompts, the first "
                             f"{a['mean_common_prefix']} of {a['mean_tokens']} tokens alike on average")
        if r.get("trees"):
            t = r["trees"]
            lines.append(f"{m}: trees on {t['steps']} of {t['of_steps']} steps, {t['mean_nodes']} nodes on average, "
                         f"by depth {t['nodes_by_depth']}")
    phased = {m: r["step_ms"] for m, r in report["methods"].items() if r.get("step_ms")}
    if phased:
        phases = list(next(iter(phased.values())))
        lines.append("ms per decode step by phase (our engine)")
        lines.append(f"{'method':<16}" + "".join(f"{p:>10}" for p in phases) + f"{'total':>10}")
        for m, ph in phased.items():
            lines.append(f"{m:<16}" + "".join(f"{ph[p]:>10}" for p in phases) + f"{round(sum(ph.values()), 2):>10}")
    if report.get("step_profile_ms"):
        from ..lab.profiling import format_profile

        lines.append(format_profile(report["step_profile_ms"]))
    return "\n".join(lines)


def dump(report: dict) -> str:
    return json.dumps(report)
