"""Adaptive block size: the policy's choices, and losslessness with it on."""

import time

import pytest

from blockdraft.decoding.adaptive import AdaptiveBlockPolicy
from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.decoding.oracle import OracleDraft

from conftest import tiny_draft, tiny_target


def simulate(accept_run: int, block_cost, steps=60, max_block=16):
    """Feed the policy steps where the first `accept_run` drafts are accepted."""
    policy = AdaptiveBlockPolicy(max_block)
    chosen = []
    for _ in range(steps):
        b = policy.choose()
        chosen.append(b)
        policy.update(b, min(accept_run, b - 1), block_cost(b))
    return chosen[-20:]


DRAFT_COST = 0.6  # one draft forward, in one-token target steps


def verify_cost(b):  # a target forward over b tokens: verifying 16 costs ~2.2x a one-token step
    return 1.0 + 1.2 * (b - 1) / 15


def cpu_like(b):  # a step with block b: the target's forward, plus the draft's when b > 1
    return verify_cost(b) + (DRAFT_COST if b > 1 else 0.0)


def test_unmeasured_blocks_cost_the_line_between_their_nearest_measured_neighbours():
    policy = AdaptiveBlockPolicy(16)
    assert policy.step_cost(4) is None
    for block, seconds in ((1, 1.0), (16, 2.5), (2, 1.9), (8, 1.6)):
        policy.update(block, 0, seconds)
    assert policy.step_cost(2) == pytest.approx(1.0 + (1.6 - 1.0) / 7)  # one measure: at most the line
    for block, seconds in ((2, 1.9), (2, 1.9), (8, 1.6), (8, 1.6)):
        policy.update(block, 0, seconds)
    assert policy.step_cost(2) == 1.9 and policy.step_cost(8) == pytest.approx(1.6)  # three: its own cost
    assert policy.step_cost(5) == pytest.approx(1.9 + (1.6 - 1.9) * 3 / 6)  # between 2 and 8, not 1 and 16
    assert policy.step_cost(12) == pytest.approx(1.6 + (2.5 - 1.6) * 4 / 8)
    # a block whose measured cost dips (t(8) < t(2) here) is chosen where it pays
    policy.passed[1:] = [0.9 * 100] * 15
    policy.tried[1:] = [100] * 15
    assert policy.choose() not in (2, 3)


def test_a_block_measured_slow_once_is_tried_again():
    """Block 2 pays (its one draft is always accepted, and it costs little more than a plain
    step), but its first step was slow (a kernel's first call at two rows): it must be measured
    again and then chosen, not written off for the rest of the engine's life."""
    first = {2: True}

    def cost(b):
        if b == 2 and first.pop(2, False):
            return 5.0
        return {1: 1.0, 2: 1.15}.get(b, 2.0)

    policy = AdaptiveBlockPolicy(16)
    policy.passed[1], policy.tried[1] = 200.0, 200  # draft 1 is accepted, draft 2 never
    policy.tried[2] = 200
    chosen = []
    for _ in range(40):
        b = policy.choose()
        chosen.append(b)
        policy.update(b, min(1, b - 1), cost(b))
    assert chosen.count(2) >= 30 and chosen[-10:] == [2] * 10


@pytest.mark.parametrize("recheck", [True, False])
def test_costs_measured_in_a_slow_phase_are_measured_again(recheck):
    """Blocks of 3 or more tokens cost 3x for the first 40 steps (first calls at new row counts, a
    busy machine), then their true cost. Three drafts are always accepted, so block 4 pays best
    (4 tokens for 1.84 against 2 for 1.68): the policy must find it once the slow phase is over,
    where without re-measures it stayed on the block the slow phase left it (tested as the
    control: `recheck=False`)."""
    policy = AdaptiveBlockPolicy(16, recheck_every=32 if recheck else 10**9)
    chosen = []
    for step in range(400):
        b = policy.choose()
        chosen.append(b)
        policy.update(b, min(3, b - 1), cpu_like(b) * (3.0 if step < 40 and b >= 3 else 1.0))
    tail = chosen[-100:]
    if recheck:
        assert tail.count(4) >= 90  # the rest: a re-measure of a stale block every 32 steps at most
    else:
        assert tail.count(4) < 50


@pytest.mark.parametrize("recheck", [True, False])
def test_a_plain_step_measured_slow_is_measured_again_while_the_drafter_runs(recheck):
    """The first plain steps cost 1.6 (another process), then their true 1.0. One draft in four is
    accepted and block 2 costs 1.35: with the true costs plain steps pay (1 token for 1.0 against
    1.25 for 1.35), with the slow ones the drafter seemed to (1.25 for 1.35 against 1 for 1.6). The
    policy must measure the plain step again and go back to it (the control: without re-measures,
    as before plain steps were among them, it stayed on the drafter)."""
    policy = AdaptiveBlockPolicy(16, recheck_every=32 if recheck else 10**9)
    policy.passed[1], policy.tried[1] = 50.0, 200  # draft 1 accepted a quarter of the time
    policy.tried[2] = 200
    chosen = []
    for step in range(600):
        b = policy.choose()
        chosen.append(b)
        cost = 1.0 if b == 1 else 1.35 + 0.05 * (b - 2)
        policy.update(b, 1 if b > 1 and step % 4 == 0 else 0, cost * (1.6 if b == 1 and step < 10 else 1.0))
    tail = chosen[-100:]
    if recheck:
        assert tail.count(1) >= 95
    else:
        assert tail.count(1) < 50


def test_poor_acceptance_chooses_plain_decoding():
    tail = simulate(0, cpu_like)
    assert tail.count(1) >= 18  # plain steps, with an occasional full-block probe


def test_probes_back_off_while_nothing_is_accepted_and_stay_within_budget():
    policy = AdaptiveBlockPolicy(16, probe_budget=0.02)
    chosen = []
    for _ in range(3000):
        b = policy.choose()
        chosen.append(b)
        policy.update(b, 0, cpu_like(b))
    probes = [i for i, b in enumerate(chosen) if b == 16][2:]  # after the two first cost measurements
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    floor = (cpu_like(16) - cpu_like(1)) / (0.02 * cpu_like(1))  # 90 plain steps per probe
    assert len(gaps) >= 5 and all(g >= round(floor) for g in gaps)
    assert gaps == sorted(gaps) and gaps[-1] == 256  # they back off to the longest interval
    extra = sum(cpu_like(b) - cpu_like(1) for b in chosen[2:])
    assert extra <= 0.02 * len(chosen) * cpu_like(1)  # within the probe budget


def test_short_probe_intervals_when_probes_are_cheap():
    policy = AdaptiveBlockPolicy(16)
    chosen = []
    for _ in range(600):
        b = policy.choose()
        chosen.append(b)
        policy.update(b, 0, 1.0 if b == 1 else 1.05)  # a GPU-like cost curve: probing is cheap
    probes = [i for i, b in enumerate(chosen) if b == 16]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[-5:] == [16, 32, 64, 128, 256]  # the budget floor (3 steps) does not bind: plain doubling


def test_high_acceptance_chooses_a_large_block():
    tail = simulate(15, cpu_like)
    assert min(tail) >= 12


def test_middling_acceptance_chooses_a_middling_block():
    tail = simulate(3, cpu_like)
    assert all(2 <= b <= 8 for b in tail)


def test_expected_tokens_formula():
    p = AdaptiveBlockPolicy(4, prior_weight=0.0)
    p.tried, p.passed = [0, 10, 10, 10], [0, 5.0, 5.0, 10.0]
    assert p.expected_tokens(1) == 1.0
    assert p.expected_tokens(4) == pytest.approx(1 + 0.5 + 0.25 + 0.25)


@pytest.mark.parametrize("keep", [0.0, 0.7, 1.0])
def test_adaptive_decoding_is_lossless(keep):
    target = tiny_target("qwen3")
    prompt = [3, 9, 27, 81 % 96]
    truth = Engine(target).generate(prompt, GenerationConfig(max_new_tokens=80, stop_token_ids=())).token_ids
    oracle = OracleDraft(tiny_draft(target, block_size=8), truth, len(prompt), keep, seed=5)
    chains = GenerationConfig(max_new_tokens=80, stop_token_ids=(), tree_budget=None)  # the chain's policy
    got = Engine(target, oracle).generate(prompt, chains)
    assert got.token_ids == truth
    if keep == 1.0:  # (prompt lookup is on: it must not displace a drafter that does better)
        assert got.stats.tau > 3


def test_policy_rates():
    p = AdaptiveBlockPolicy(4)
    assert p.rate(2) is None and p.best_rate() is None  # no cost measured yet
    p.update(4, 3, 0.2)
    p.update(1, 0, 0.1)
    assert p.rate(1) == pytest.approx(10.0)
    assert p.best_rate() == max(p.rate(b) for b in range(1, 5)) > 10.0


class SimulatedClock:
    """Seconds that advance only by the modelled cost of each forward (`verify_cost` per target
    forward, `DRAFT_COST` per draft block), so that the policy sees the same costs on every run."""

    def __init__(self, target, draft):
        self.now = 0.0
        forward, block_hidden = target.forward, draft.block_hidden  # (a draft block's logits or tokens: its hidden states first)

        def timed_forward(ids, *args, **kwargs):
            self.now += verify_cost(ids.shape[1])
            return forward(ids, *args, **kwargs)

        def timed_block_hidden(*args, **kwargs):
            self.now += DRAFT_COST
            return block_hidden(*args, **kwargs)

        target.forward, draft.block_hidden = timed_forward, timed_block_hidden

    def __call__(self) -> float:
        return self.now


def test_the_engine_keeps_what_the_policy_learned_across_requests():
    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=8)  # random drafter: accepts ~nothing
    engine = Engine(target, draft, clock=SimulatedClock(target, draft))
    cfg = GenerationConfig(max_new_tokens=40, lookup=False, tree_budget=None)  # the drafter chain's policy alone
    first = engine.generate([1, 2, 3], cfg)
    second = engine.generate([4, 5, 6], cfg)
    assert first.stats.drafted > 0  # the first request probed the drafter
    assert second.stats.drafted < first.stats.drafted  # the second starts from what it learned
    assert second.token_ids == Engine(target).generate([4, 5, 6], cfg).token_ids  # still lossless


def test_a_slow_first_draft_step_does_not_hand_the_drafter_to_prompt_lookup():
    """The first draft forward of a process is slow (kernels measure and pack themselves on their
    first call; here it also sleeps 0.1 s, many times the tiny model's step): a perfect drafter
    must still win over prompt lookup on this repetitive text, as it does when it is measured
    again (the policy measures the full block twice and keeps the lower cost)."""
    target = tiny_target("qwen3")
    prompt = [3, 9, 27, 81 % 96]
    config = GenerationConfig(max_new_tokens=80, stop_token_ids=(), tree_budget=None)  # chains
    truth = Engine(target).generate(prompt, config).token_ids
    oracle = OracleDraft(tiny_draft(target, block_size=8), truth, len(prompt), 1.0, seed=5)
    first = oracle.block_logits
    calls = []

    def slow_first_call(*args, **kwargs):
        if not calls:
            time.sleep(0.1)
        calls.append(1)
        return first(*args, **kwargs)

    oracle.block_logits = slow_first_call
    got = Engine(target, oracle).generate(prompt, config)
    assert got.token_ids == truth
    assert got.stats.tau > 3
