"""The depth controller on synthetic rounds: it drafts the depth that commits the most tokens per
second, falls back to plain decoding when drafting does not pay, is not flipped by one stall,
believes a faster round soon, prices depths as back-to-back drafting rounds cost, and, seeded
with known costs, stops drafting after a few misses."""

from __future__ import annotations

import random

from backend.speculation.depth import AFTER_MISS, DepthController


def drive(controller: DepthController, acceptance: float, cost, rounds: int = 400,
          seed: int = 0) -> dict[int, int]:
    """Run ``rounds`` synthetic rounds: draft j is accepted with probability ``acceptance``,
    a round of depth N takes ``cost(N)`` seconds; returns how often each depth was chosen."""
    rng = random.Random(seed)
    chosen: dict[int, int] = {}
    for _ in range(rounds):
        depth = controller.choose(8)
        chosen[depth] = chosen.get(depth, 0) + 1
        accepted = 0
        while accepted < depth and rng.random() < acceptance:
            accepted += 1
        controller.record(depth, accepted, cost(depth))
    return chosen


def mostly(chosen: dict[int, int]) -> int:
    return max(chosen, key=chosen.get)


def test_drafts_the_depth_with_the_most_tokens_per_second():
    # Cheap drafts, high acceptance: the rate E(N) / cost(N) peaks at 3 here.
    controller = DepthController()
    acceptance, cost = 0.8, (lambda n: 1.0 + 0.25 * n)
    chosen = drive(controller, acceptance, cost, rounds=1500)
    rate = {n: controller.expected_tokens(n) / cost(n) for n in range(9)}
    assert mostly(chosen) == max(rate, key=rate.get) == 3


def test_falls_back_to_plain_decoding_when_drafting_does_not_pay():
    controller = DepthController()
    chosen = drive(controller, 0.3, lambda n: 1.0 + 0.8 * n)  # dear drafts, rarely accepted
    assert chosen[0] > 0.9 * sum(chosen.values())


def test_one_stall_does_not_flip_the_choice_and_a_faster_round_is_believed_soon():
    controller = DepthController()
    cost = (lambda n: 1.0 + (0.05 * n if n <= 2 else n))  # depth 2 clearly best
    assert mostly(drive(controller, 0.9, cost, rounds=1500)) == 2
    before = controller.cost[2]
    controller.record(2, 2, 50.0)  # the host stalls for one round
    assert controller.cost[2] <= before * 1.08
    assert mostly(drive(controller, 0.9, cost, rounds=50, seed=1)) == 2
    controller = DepthController()
    controller.record(0, 0, 1.0)
    controller.record(2, 2, 20.0)  # the first sample of depth 2 was taken during a stall
    for _ in range(8):
        controller.record(2, 2, 1.3)
    assert controller.cost[2] < 1.5


def test_a_round_after_a_plain_step_is_priced_as_one_after_a_verify_round():
    # Waiting for the step that plain decoding queued is one plain step more than the same
    # depth costs within a run of drafting rounds.
    controller = DepthController()
    controller.record(0, 0, 1.0)
    controller.record(2, 2, 2.4, after_plain_step=True)
    assert abs(controller.cost[2] - 1.4) < 1e-9


def test_a_round_that_falls_back_to_plain_decoding_pays_for_the_pipeline_it_broke():
    # The plain step after it waited for its whole forward (0.4 more than a pipelined one):
    # that is the round's cost, not plain decoding's. A round followed by another is not.
    controller = DepthController()
    controller.record(0, 0, 1.0)
    controller.record(1, 0, 1.5)
    controller.record(0, 0, 1.4, after_round=True)
    assert abs(controller.cost[1] - 1.9) < 1e-9 and controller.cost[0] == 1.0
    controller.record(1, 1, 1.5)
    controller.record(1, 1, 1.5)  # the first led into the second: priced as it took
    assert abs(controller.cost[1] - 1.6) < 1e-9  # 1.9 -> 1.7 -> 1.6, the faster moving half way


def test_a_plain_step_right_after_a_verify_round_is_not_priced():
    # It waited for its whole forward and graph building: a run of plain steps overlaps them.
    controller = DepthController()
    controller.record(0, 0, 1.0)
    controller.record(1, 1, 1.5)
    controller.record(0, 0, 1.3, after_round=True)
    assert controller.cost[0] == 1.0 and controller.context == AFTER_MISS
    controller.record(0, 0, 0.9)
    assert controller.cost[0] < 1.0


def test_leaving_plain_decoding_needs_a_margin():
    controller = DepthController()
    controller.record(0, 0, 1.0)
    controller.record(1, 1, 1.0)
    controller.acceptance[controller.context][0] = 0.05
    controller.reached[controller.context][0] = 100
    controller.cost[1] = 0.99 * controller.expected_tokens(1)  # 1% better than plain
    assert controller.choose(1) == 0
    controller.cost[1] = 0.5 * controller.expected_tokens(1)  # twice as fast
    assert controller.choose(1) == 1


def run_in_runs(controller: DepthController, rounds: int = 4000, seed: int = 0) -> float:
    """Committed tokens per second over synthetic rounds whose acceptance comes in runs: a
    "copying" stretch (each draft accepted with probability 0.95) or a free one (0.1), the
    stretch changing at each committed token with probability 0.03. A round of depth N costs
    1 + 0.25 N seconds."""
    rng = random.Random(seed)
    copying, tokens, seconds = False, 0, 0.0
    for _ in range(rounds):
        depth = controller.choose(8)
        accepted = 0
        while accepted < depth and rng.random() < (0.95 if copying else 0.1):
            accepted += 1
        for _ in range(accepted + 1):
            if rng.random() < 0.03:
                copying = not copying
        controller.record(depth, accepted, 1.0 + 0.25 * depth)
        tokens += accepted + 1
        seconds += 1.0 + 0.25 * depth
    return tokens / seconds


def test_acceptance_in_runs_is_followed_by_context():
    """Drafting deep after a round that kept everything and shallow after a miss beats every
    fixed depth, which a controller pricing all rounds with one average cannot."""
    adaptive = run_in_runs(DepthController())
    fixed = max(run_in_runs(DepthController(fixed=n)) for n in range(9))
    assert adaptive > 1.02 * fixed


def test_untried_depths_are_priced_by_the_widest_span():
    controller = DepthController()
    controller.cost.update({0: 1.0, 1: 1.0, 2: 1.1, 3: 1.6})  # an odd row costs a pass
    assert abs(controller.round_cost(8) - (1.6 + 5 * (1.6 - 1.0) / 2)) < 1e-9
    assert abs(controller.round_cost(2) - 1.1) < 1e-9
    controller.cost.pop(2)
    assert abs(controller.round_cost(2) - 1.3) < 1e-9  # between tried depths: interpolated


def test_a_seeded_controller_gives_up_after_a_few_misses():
    # Costs known beforehand and the prior say drafting pays; where nothing is copied the
    # first misses must count at once (held at the prior for 8 outcomes, it took 9 here; at
    # these costs an acceptance of 0.3 is break-even, so ~6 misses to get there from 0.7).
    controller = DepthController()
    controller.seed({n: 1.0 + 0.3 * n for n in range(9)})
    misses = 0
    while (depth := controller.choose(8)) > 0:
        controller.record(depth, 0, None)
        misses += 1
    assert 1 <= misses <= 6
