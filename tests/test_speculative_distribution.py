"""Speculative sampling preserves the target distribution, and a wrong acceptance rule is caught.

On a small vocabulary with fixed target and draft logits, each trial is one verify round through
the real ``acceptance.judge`` and the real ``Sampler`` (its filters and penalties applied to both
the target's and the drafter's rows, the drafts drawn from the drafter's distributions). The
committed token at each position must follow the target's processed distribution at that
position over ``TRIALS`` rounds: chi-square p > 1e-3 (the sharp criterion) and total variation
< 0.02 (a coarse one: the right rule's TV at this many rounds is 0.003-0.011 over seeds). The same
check at the same number of rounds (the same power) must fail for wrong rules: gross ones
(rejecting to the target instead of the residual, keeping every draft), one that treats sampled
drafts as point masses (the residual p without the draft instead of max(p - q, 0)), and a subtle
one (the drafter's distribution taken at a slightly other temperature: TV 0.02 from the target).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
import torch

from backend.api import SamplingParams
from backend.sampling import Sampler
from backend.speculation import acceptance

V = 6
TRIALS = 20_000  # rounds per check, the same for the right rule and the wrong ones
TARGET = [[2.0, 1.0, 0.5, 0.0, -0.5, -1.0],
          [0.0, 1.5, -1.0, 0.7, 0.2, -0.3],
          [1.0, -0.5, 0.3, 1.2, 0.0, 0.5],
          [0.4, 0.4, -0.2, -1.0, 1.0, 0.0]]
DRAFT = [[0.5, 2.0, 0.0, -1.0, 0.3, 0.0],  # a biased drafter, unlike the target
         [1.0, 0.0, 0.0, 0.7, -1.0, 0.5],
         [-0.5, 0.5, 1.5, 0.0, 0.0, 0.2]]


def chi_square_p(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Upper tail of the chi-square statistic (cells with probability 0 must be empty)."""
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was committed"
    n = counts.sum()
    expected = expected_probs[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def run_trials(params: SamplingParams, drafts: int, trials: int, rule=None, seed: int = 0):
    """Committed-token counts per position over ``trials`` verify rounds, the target's processed
    distribution at each position, and how many positions that distribution is fixed for
    (every one without penalties; with them, row i's window holds the drafts before i)."""
    sampler = Sampler(SamplingParams(**{**params.__dict__, "seed": seed}))
    penalties = params.repetition_penalty != 1.0
    history = mx.array([1, 1, 3], dtype=mx.int32) if penalties else None
    target = mx.array(TARGET[:drafts + 1])
    draft_logits = mx.array(DRAFT[:drafts])
    judge = rule or acceptance.judge
    fixed_p = sampler.distributions(target, [history] * (drafts + 1))
    fixed_q = sampler.distributions(draft_logits, [history] * drafts)
    q_logprobs = mx.stack([d.logprobs for d in fixed_q])
    mx.eval([d.logprobs for d in fixed_p], q_logprobs)
    counts = np.zeros((drafts + 1, V), dtype=np.int64)
    for _ in range(trials):
        tokens = mx.stack([d.sample() for d in fixed_q])
        if penalties:  # as in the engine: row i's window ends with the drafts before it
            histories = [mx.concatenate([history, tokens[:i]]) for i in range(drafts + 1)]
            p = sampler.distributions(target, histories)
        else:
            p = fixed_p
        verdict = judge(p, tokens, q_logprobs, sampler)
        mx.eval(verdict.accepted, verdict.next_token, tokens)
        a, ids = int(verdict.accepted.item()), tokens.tolist()
        for pos, t in enumerate(ids[:a] + [int(verdict.next_token.item())]):
            counts[pos, t] += 1
    probs = np.array(mx.stack([d.probs() for d in fixed_p]), dtype=np.float64)
    return counts, probs, (1 if penalties else drafts + 1)


def assert_matches(counts: np.ndarray, probs: np.ndarray, positions: int) -> None:
    for pos in range(positions):
        n = counts[pos].sum()
        tv = 0.5 * np.abs(counts[pos] / n - probs[pos]).sum()
        p_value = chi_square_p(counts[pos], probs[pos])
        assert p_value > 1e-3 and tv < 0.02, f"position {pos}: p={p_value:.2e}, TV={tv:.4f}"


PLAIN = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
PENALIZED = SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.3)


def test_speculative_sampling_follows_the_target():
    counts, probs, positions = run_trials(PLAIN, drafts=3, trials=TRIALS)
    assert_matches(counts, probs, positions=min(positions, 2))


@pytest.mark.parametrize("params", [FILTERED, PENALIZED], ids=["top-k top-p", "penalties"])
def test_with_filters_and_penalties_too(params):
    counts, probs, positions = run_trials(params, drafts=2, trials=TRIALS)
    assert_matches(counts, probs, positions=min(positions, 2))


def _reject_to_target(p, drafts, draft_logprobs, sampler):
    """Wrong: on rejection, draw from p instead of the residual max(p - q, 0)."""
    right = acceptance.judge(p, drafts, draft_logprobs, sampler)
    a = right.accepted
    fallback = mx.stack([d.sample() for d in p])
    return acceptance.Verdict(a, fallback[a], right.accept_probability)


def _accept_everything(p, drafts, draft_logprobs, sampler):
    """Wrong: keep every draft (what a drafter proposes is then what comes out)."""
    right = acceptance.judge(p, drafts, draft_logprobs, sampler)
    return acceptance.Verdict(mx.array(drafts.shape[0], dtype=mx.int32), p[-1].sample(),
                              right.accept_probability)


def _point_mass_residual(p, drafts, draft_logprobs, sampler):
    """Wrong: a sampled draft judged as if it were a point mass (ratio p/q kept, but the
    residual is p without the draft, as for prompt lookup, instead of max(p - q, 0))."""
    right = acceptance.judge(p, drafts, draft_logprobs, sampler)
    as_lookup = acceptance.judge(p, drafts, None, sampler)
    return acceptance.Verdict(right.accepted, as_lookup.next_token, right.accept_probability)


def _other_temperature(p, drafts, draft_logprobs, sampler):
    """Subtly wrong: the drafter's distribution at another temperature (its log-probabilities
    scaled by 1.1 and renormalized: a temperature applied twice) in both the ratio and the
    residual, while the drafts were drawn from the true one."""
    sharpened = draft_logprobs * 1.1
    sharpened = sharpened - mx.logsumexp(sharpened, axis=-1, keepdims=True)
    return acceptance.judge(p, drafts, sharpened, sampler)


@pytest.mark.parametrize("rule", [_reject_to_target, _accept_everything, _point_mass_residual,
                                  _other_temperature])
def test_a_wrong_rule_fails_the_same_check(rule):
    counts, probs, _ = run_trials(PLAIN, drafts=3, trials=TRIALS, rule=rule)
    with pytest.raises(AssertionError, match="position 0"):
        assert_matches(counts, probs, positions=1)


def test_greedy_is_the_point_mass_case():
    sampler = Sampler(SamplingParams(temperature=0.0))
    target = mx.array(TARGET)
    p = sampler.distributions(target, [None] * 4)
    argmax = [int(np.argmax(row)) for row in TARGET]
    good = mx.array(argmax[:2] + [(argmax[2] + 1) % V], dtype=mx.int32)
    verdict = acceptance.judge(p, good, None, sampler)
    assert int(verdict.accepted.item()) == 2 and int(verdict.next_token.item()) == argmax[2]
    everything = acceptance.judge(p, mx.array(argmax[:3], dtype=mx.int32), None, sampler)
    assert int(everything.accepted.item()) == 3 and int(everything.next_token.item()) == argmax[3]
    assert math.isclose(float(mx.sum(verdict.accept_probability).item()), 2.0)
    # A drafter's own (not point-mass) distributions change nothing when the target is greedy.
    q = mx.log(mx.softmax(mx.random.normal((3, V), key=mx.random.key(1)), axis=-1))
    with_q = acceptance.judge(p, good, q, sampler)
    assert int(with_q.accepted.item()) == 2 and int(with_q.next_token.item()) == argmax[2]
