"""Speculative acceptance by the Leviathan/Chen rule, as one lazy graph.

Given N draft tokens ``d_i`` with the drafter's distributions ``q_i`` (or point masses, for a
drafter that proposes without a distribution, like prompt lookup) and the target's N + 1
distributions ``p_0 .. p_N`` (row i sees the drafts before ``d_i``; row N is the bonus row):

* draft i is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``;
* at the first rejection the next token is drawn from ``normalize(max(p_i - q_i, 0))``;
* when all N are accepted the next token is drawn from ``p_N``.

The committed tokens are then distributed exactly as the target's own samples would be (Leviathan
et al. 2023, Chen et al. 2023). Greedy decoding is the point-mass case of the same formulas: p_i
is a point mass on the target's argmax, so a draft is accepted iff it is that argmax and the
"residual" is the argmax itself; no random key is consumed then, as in plain greedy decoding.

Not sample-and-match: accepting only when a target sample equals the draft has acceptance
``sum p q`` instead of ``sum min(p, q)`` and collapses as the temperature rises.

Everything is built lazily; the caller evaluates ``Verdict.accepted`` and ``Verdict.next_token``
with one host sync per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from backend.sampling import Distribution, Sampler


@dataclass
class Verdict:
    accepted: mx.array  # int32 scalar: how many leading drafts are accepted (0 .. N)
    next_token: mx.array  # int32 scalar: the residual draw at the first rejection, or the bonus
    accept_probability: mx.array  # (N,) float32 min(1, p_i(d_i) / q_i(d_i)), for statistics


def judge(target: list[Distribution], drafts: mx.array, draft_logprobs: mx.array | None,
          sampler: Sampler) -> Verdict:
    """``target``: N + 1 distributions; ``drafts``: (N,) int32; ``draft_logprobs``: (N, V) the
    drafter's log-distributions, or None for point-mass drafts."""
    n = drafts.shape[0]
    if len(target) != n + 1:
        raise ValueError(f"{n} drafts need {n + 1} target distributions, got {len(target)}")
    if sampler.greedy:
        # Point masses: draft i stands iff it is the target's argmax of row i (p_i(d_i) = 1
        # then, whatever q_i), and max(p_i - q_i, 0) is the point mass on that argmax, so the
        # next token is row i's argmax at the first miss and the bonus row's after the last
        # draft. The same outcome as the rows below, without their passes over the vocabulary.
        top = mx.stack([d.sample() for d in target])  # (N + 1,)
        hit = top[:n] == drafts
        accepted = mx.sum(mx.cumprod(hit.astype(mx.int32))).astype(mx.int32)
        return Verdict(accepted, top[accepted], hit.astype(mx.float32))
    p_log = mx.stack([d.logprobs for d in target[:n]])  # (N, V)
    p_draft = mx.exp(mx.take_along_axis(p_log, drafts[:, None], axis=-1)[:, 0])  # (N,)
    if draft_logprobs is None:  # point masses: q_i(d_i) = 1
        ratio = p_draft
        residual_log = mx.where(mx.arange(p_log.shape[-1])[None] == drafts[:, None],
                                -mx.inf, p_log)  # max(p - onehot, 0): p without d_i
    else:
        q_draft = mx.exp(mx.take_along_axis(draft_logprobs, drafts[:, None], axis=-1)[:, 0])
        ratio = p_draft / q_draft  # q_draft > 0: the drafter sampled d_i from q_i
        diff = mx.maximum(mx.exp(p_log) - mx.exp(draft_logprobs), 0.0)  # (N, V)
        # p == q leaves nothing: rejection then has probability 0, any row is fine (use p).
        residual_log = mx.where(mx.sum(diff, axis=-1, keepdims=True) > 0, mx.log(diff), p_log)
    accept_probability = mx.minimum(ratio, 1.0)
    uniform = mx.random.uniform(shape=(n,), key=sampler.next_key())
    accept = uniform < ratio
    residual = mx.random.categorical(residual_log, key=sampler.next_key()).astype(mx.int32)
    accepted = mx.sum(mx.cumprod(accept.astype(mx.int32))).astype(mx.int32)
    bonus = target[n].sample()
    candidates = mx.concatenate([residual, bonus.reshape(1)])  # (N + 1,)
    return Verdict(accepted, candidates[accepted], accept_probability)
