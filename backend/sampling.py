"""Logits -> next-token distribution -> token, lazily.

Scope: turn a model's logits (plus the recent token history) into a ``Distribution`` by a fixed
chain of logits processors, and draw tokens from it with a key stream the ``Sampler`` owns.
Non-scope: choosing when to stop, speculative acceptance (``backend/speculation`` builds that on
``Distribution.logprobs`` and ``Sampler.next_key``), detokenization.

Everything here builds MLX graphs and never evaluates them: no ``.item()``, no ``mx.eval``, no
Python branching on array values (only on the request's ``SamplingParams``). The engine can
therefore queue step ``t + 1`` with ``mx.async_eval`` while step ``t`` is still running.

Processor order (each step sees the output of the one before):

1. repetition penalty (Hugging Face style): for every id present in the history window, a
   positive logit is divided by the penalty and a negative one multiplied by it;
2. presence / frequency penalties (OpenAI style): ``logit -= presence * [count > 0] +
   frequency * count``, counting repeated ids in the window;
3. temperature: ``logit / temperature``; temperature 0 stops here and puts all mass on the
   argmax of the penalized logits (the filters below cannot remove the top token anyway);
4. top-k: keep the ``k`` most likely tokens (exactly ``k``; ties broken by sort order);
5. top-p: over the distribution renormalized after top-k, keep the smallest most-likely-first set
   whose cumulative probability reaches ``top_p`` (the top token is always kept);
6. min-p: drop tokens with ``p < min_p * p_max`` (a ratio, so unaffected by renormalization);
7. renormalize over the survivors.

Batched form: ``Sampler.distributions(logits (N, V), histories)`` runs the same chain for all N
rows in one graph (one sort, one scatter) and returns one row-``Distribution`` per row; this is
what speculative verification uses. ``Sampler.distribution(logits (V,), history)`` is the
single-row case.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import mlx.core as mx

from backend.api import SamplingParams
from backend.errors import InvalidRequestError

_NEG_INF = float("-inf")


class Distribution:
    """Next-token distribution after all logits processors, for one position.

    ``logprobs`` has shape (V,), float32, ``-inf`` outside the support; for a greedy distribution
    it is 0 at the argmax and ``-inf`` elsewhere. ``greedy`` is True when temperature == 0.
    Instances are made by ``Sampler``; ``sample`` draws with that sampler's key stream.
    """

    __slots__ = ("logprobs", "greedy", "_sampler", "_argmax")

    def __init__(
        self, logprobs: mx.array, greedy: bool, sampler: Sampler, argmax: mx.array | None = None
    ) -> None:
        self.logprobs = logprobs
        self.greedy = greedy
        self._sampler = sampler
        self._argmax = argmax  # greedy only: the token, already known (saves a pass over V)

    def sample(self) -> mx.array:
        """A lazy scalar int32 token id. Greedy returns the argmax and consumes no key."""
        if self.greedy:
            if self._argmax is not None:
                return self._argmax
            return mx.argmax(self.logprobs).astype(mx.int32)
        key = self._sampler.next_key()
        return mx.random.categorical(self.logprobs, key=key).astype(mx.int32)

    def probs(self) -> mx.array:
        """Probabilities, shape (V,): ``exp(logprobs)`` (exactly 0 outside the support)."""
        return mx.exp(self.logprobs)


class Sampler:
    """Applies one request's ``SamplingParams`` to logits; owns that request's random key stream.

    The key stream starts from ``params.seed`` (a fresh random seed when None), so two samplers
    with the same seed draw the same tokens from the same sequence of distributions. No global
    MLX random state is read or changed. Not thread-safe: one sampler per generation.
    """

    def __init__(self, params: SamplingParams) -> None:
        _validate(params)
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self._key = mx.random.key(seed % 2**64)  # mx.random.key takes an unsigned 64-bit seed

    @property
    def greedy(self) -> bool:
        """True when the distribution is a point mass on the argmax (temperature 0)."""
        return self.params.temperature == 0.0

    def next_key(self) -> mx.array:
        """Advance the key stream and return a fresh key (lazy). Speculative acceptance draws its
        uniforms with these so one seed fixes the whole generation."""
        self._key, sub = mx.random.split(self._key)
        return sub

    def distribution(self, logits: mx.array, history: mx.array | None = None) -> Distribution:
        """The distribution for one position.

        logits: shape (V,), any float dtype (computed in float32). history: 1-D integer array of
        prior token ids (prompt + generated), ids in [0, V); may be lazy; only its last
        ``penalty_window`` entries count. None means no history (penalties do nothing).
        """
        if logits.ndim != 1:
            raise ValueError(f"distribution() takes logits of shape (V,), got {logits.shape}")
        return self.distributions(logits[None], [history])[0]

    def distributions(
        self, logits: mx.array, histories: Sequence[mx.array | None]
    ) -> list[Distribution]:
        """The distributions for N positions in one graph.

        logits: shape (N, V). histories: N entries, each like ``distribution``'s ``history``
        for that row (for speculative verification, row i's history ends with the drafts before
        position i). Returns N row distributions sharing this sampler's key stream.
        """
        if logits.ndim != 2 or len(histories) != logits.shape[0]:
            raise ValueError(
                f"distributions() needs logits (N, V) and N histories, "
                f"got {logits.shape} and {len(histories)}"
            )
        logits = self._penalized(logits.astype(mx.float32), histories)  # (N, V)
        if self.greedy:
            top = mx.argmax(logits, axis=-1).astype(mx.int32)  # (N,)
            vocab = mx.arange(logits.shape[-1])[None]  # (1, V)
            logprobs = mx.where(vocab == top[:, None], 0.0, _NEG_INF).astype(mx.float32)
            return [Distribution(logprobs[i], True, self, top[i]) for i in range(len(histories))]
        logprobs = self._filtered_logprobs(logits)  # (N, V)
        return [Distribution(logprobs[i], False, self) for i in range(len(histories))]

    # -- the processor chain -----------------------------------------------------------------------

    def _penalized(self, logits: mx.array, histories: Sequence[mx.array | None]) -> mx.array:
        """Steps 1-2: (N, V) logits after the repetition / presence / frequency penalties."""
        p = self.params
        if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
            return logits
        counts = self._history_counts(histories, logits.shape[1])  # (N, V) float32
        return _apply_penalties(logits, counts, p)

    def _filtered_logprobs(self, logits: mx.array) -> mx.array:
        """Steps 3-7: (N, V) penalized logits -> renormalized logprobs (temperature > 0)."""
        p = self.params
        logprobs = _log_softmax(logits / p.temperature)
        keep = None  # (N, V) bool, None while every token survives
        if p.top_p < 1.0:
            keep = _top_k_top_p_mask(logprobs, p.top_k, p.top_p)
        elif p.top_k > 0 and p.top_k < logprobs.shape[-1]:
            keep = _top_k_mask(logprobs, p.top_k)
        if p.min_p > 0.0:
            floor = mx.max(logprobs, axis=-1, keepdims=True) + math.log(p.min_p)  # log(min_p*p_max)
            above = logprobs >= floor
            keep = above if keep is None else mx.logical_and(keep, above)
        if keep is None:
            return logprobs
        return _log_softmax(mx.where(keep, logprobs, _NEG_INF))

    def _history_counts(self, histories: Sequence[mx.array | None], vocab: int) -> mx.array:
        """(N, V) float32: how often each id occurs in each row's last ``penalty_window`` ids."""
        window = self.params.penalty_window
        flat = []  # indices into the flattened (N * V) count matrix
        for row, history in enumerate(histories):
            if history is None or window == 0 or history.size == 0:
                continue
            recent = history.reshape(-1)[-window:].astype(mx.int32)
            flat.append(recent + row * vocab)
        counts = mx.zeros((len(histories) * vocab,), dtype=mx.float32)
        if flat:
            # scatter-add so that repeated ids count once per occurrence
            counts = counts.at[mx.concatenate(flat)].add(1.0)
        return counts.reshape(len(histories), vocab)


def _apply_penalties(logits: mx.array, counts: mx.array, p: SamplingParams) -> mx.array:
    seen = counts > 0
    if p.repetition_penalty != 1.0:
        penalized = mx.where(
            logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty
        )
        logits = mx.where(seen, penalized, logits)
    if p.presence_penalty != 0.0:
        logits = logits - p.presence_penalty * seen.astype(mx.float32)
    if p.frequency_penalty != 0.0:
        logits = logits - p.frequency_penalty * counts
    return logits


def _log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _top_k_mask(logprobs: mx.array, k: int) -> mx.array:
    """(N, V) bool marking exactly the k largest entries per row (argpartition: no full sort)."""
    top = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]  # (N, k)
    return _scatter_true(top, logprobs.shape)


def _top_k_top_p_mask(logprobs: mx.array, k: int, top_p: float) -> mx.array:
    """(N, V) bool: top-k (k == 0: off), then top-p over the renormalized survivors."""
    order = mx.argsort(-logprobs, axis=-1)  # (N, V) most likely first
    probs = mx.exp(mx.take_along_axis(logprobs, order, axis=-1))  # (N, V) sorted probabilities
    if k > 0:
        rank = mx.arange(probs.shape[-1])[None]
        probs = mx.where(rank < k, probs, 0.0)
    probs = probs / mx.sum(probs, axis=-1, keepdims=True)  # renormalize after top-k
    mass_before = mx.cumsum(probs, axis=-1) - probs  # probability of strictly likelier tokens
    # a token stays while the likelier ones have not yet reached top_p; the top token has
    # mass_before == 0 < top_p, so it always stays. Zero-probability (top-k-dropped) tokens go.
    keep_sorted = mx.logical_and(mass_before < top_p, probs > 0)
    return mx.put_along_axis(
        mx.zeros(logprobs.shape, dtype=mx.bool_), order, keep_sorted, axis=-1
    )


def _scatter_true(indices: mx.array, shape: tuple[int, ...]) -> mx.array:
    ones = mx.ones(indices.shape, dtype=mx.bool_)
    return mx.put_along_axis(mx.zeros(shape, dtype=mx.bool_), indices, ones, axis=-1)


def _validate(p: SamplingParams) -> None:
    """Raise InvalidRequestError naming the first bad value (NaN fails every range check)."""

    def bad(message: str) -> InvalidRequestError:
        return InvalidRequestError(f"invalid sampling parameter: {message}")

    def is_int(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not (isinstance(p.temperature, (int, float)) and 0.0 <= p.temperature < math.inf):
        raise bad(f"temperature must be a finite number >= 0, got {p.temperature!r}")
    if not (isinstance(p.top_p, (int, float)) and 0.0 < p.top_p <= 1.0):
        raise bad(f"top_p must be in (0, 1], got {p.top_p!r}")
    if not (is_int(p.top_k) and p.top_k >= 0):
        raise bad(f"top_k must be an integer >= 0, got {p.top_k!r}")
    if not (isinstance(p.min_p, (int, float)) and 0.0 <= p.min_p < 1.0):
        raise bad(f"min_p must be in [0, 1), got {p.min_p!r}")
    if not (isinstance(p.repetition_penalty, (int, float)) and 0 < p.repetition_penalty < math.inf):
        raise bad(f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty!r}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value)):
            raise bad(f"{name} must be a finite number, got {value!r}")
    if not (is_int(p.penalty_window) and p.penalty_window >= 0):
        raise bad(f"penalty_window must be an integer >= 0, got {p.penalty_window!r}")
    if p.seed is not None and not is_int(p.seed):
        raise bad(f"seed must be an integer or None, got {p.seed!r}")
