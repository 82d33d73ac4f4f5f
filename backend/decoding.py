"""The decode loops: plain (one token per step, pipelined) and speculative (verify blocks).

Both are generators of ``Emitted`` tokens that the engine turns into events (detokenizing,
stop strings, cancellation); the consumer simply stops iterating when the reply is done. They
never run the target themselves: each forward is a ``Feed`` they yield and the scheduler
answers (``feeds.py``), so the forwards of many sequences' loops batch together. They
keep ``Decoding.held`` (the ids the live caches hold) and ``Decoding.generated`` exact at every
yield, so the engine can record the caches in the prefix cache whenever it stops.

Plain: sample token t lazily, queue the step that feeds it (``mx.async_eval``), and only then
wait for t, so the device computes t+1 while the host emits t.

Speculative, in rounds, keeping that pipelining: the step feeding the current token ``c`` is
already queued; once ``c`` is known the drafter proposes up to ``depth`` tokens (the depth
controller's choice, 0 = a plain step). With drafts ``d_1..d_N``:

1. schedule snapshots at every draft offset (``SpeculativeWrite``), one batched forward of the N
   drafts; its N rows plus the queued step's row give the N + 1 target distributions;
2. accept by the rejection rule (``speculation.acceptance.judge``), one host sync per round;
3. restore every cache to the accepted count (an accepted EOS is emitted, its state not kept),
   queue the step feeding the next token, emit the accepted drafts (``from_draft``).

Because verify blocks are row-invariant (tests/test_row_invariance.py) the target rows equal what
one-token steps would have computed, so greedy speculative output is plain greedy output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator

import mlx.core as mx

from backend.caches.base import Cache
from backend.feeds import Answer, Feed, forward
from backend.sampling import Sampler
from backend.speculation.acceptance import judge
from backend.speculation.depth import DepthController
from backend.speculation.drafters import Drafter
from backend.speculation.rollback import SpeculativeWrite


@dataclass(frozen=True)
class Emitted:
    token_id: int
    from_draft: bool
    logprob: float | None


@dataclass
class DraftStats:
    """What speculation did in one reply."""

    drafter: str = ""
    rounds: int = 0  # verify rounds (plain steps not counted)
    drafted: int = 0
    accepted: int = 0
    reached: list[int] = field(default_factory=list)  # per draft position: rounds that got there
    kept: list[int] = field(default_factory=list)  # ... and accepted it

    def record(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        while len(self.reached) < drafted:
            self.reached.append(0)
            self.kept.append(0)
        for j in range(min(drafted, accepted + 1)):
            self.reached[j] += 1
            self.kept[j] += j < accepted

    @property
    def acceptance_by_position(self) -> tuple[float, ...]:
        return tuple(k / r for k, r in zip(self.kept, self.reached) if r)

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0


@dataclass
class Decoding:
    """One reply's decode state, shared by the loops and the engine."""

    model: object
    caches: list[Cache]  # the target's live caches
    sampler: Sampler
    prompt: list[int]
    held: list[int]  # ids the caches hold
    budget: int  # most tokens to emit
    eos: frozenset[int]
    logprobs: bool = False
    generated: list[int] = field(default_factory=list)
    stats: DraftStats = field(default_factory=DraftStats)
    # Told of every forward (``Drafter.observe``: start position, ids, hidden states), so a
    # drafter that drafts from the target's hidden states gets them (speculation/mtp.py).
    observe: Callable[[int, mx.array, mx.array], None] | None = None

    def step(self, tokens: mx.array) -> Generator[Feed, Answer, mx.array]:
        """Lazy logits (vocab,) after feeding ``tokens`` (``yield from``: the scheduler runs
        the forward)."""
        _, logits = yield from forward(Feed(tokens, self.caches, "last"), self.observe)
        return logits[-1]

    def block(self, tokens: mx.array) -> Generator[Feed, Answer, mx.array]:
        """Lazy logits (N, vocab) of every position of ``tokens`` (a verify block)."""
        _, logits = yield from forward(Feed(tokens, self.caches, "all"), self.observe)
        return logits

    def history(self, drafts: mx.array | None = None) -> mx.array | None:
        """The penalty window of prompt + generated ids (+ in-flight ``drafts``), or None when
        no penalty is on."""
        p = self.sampler.params
        if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
            return None
        recent = mx.array((self.prompt + self.generated)[-p.penalty_window:], dtype=mx.int32)
        if drafts is not None and drafts.size:
            recent = mx.concatenate([recent, drafts.astype(mx.int32)])
        return recent[-p.penalty_window:] if p.penalty_window else recent[:0]

    def sample(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        token = self.sampler.distribution(logits, self.history()).sample()
        logprob = logits[token] - mx.logsumexp(logits) if self.logprobs else None
        return token, logprob


#: What the loops yield: emitted tokens, and the feeds they need answered (``feeds.py``).
Tokens = Generator["Emitted | Feed", "Answer | None", None]


def _value(x: mx.array | None) -> float | None:
    return None if x is None else float(x.item())


def plain_tokens(d: Decoding, logits: mx.array) -> Tokens:
    token, logprob = d.sample(logits)
    mx.async_eval(token if logprob is None else [token, logprob])
    while True:
        # Queue the next step before waiting on this token so the device never idles; when
        # this token turns out to be the last, that one step is wasted work.
        ahead = (yield from d.step(token.reshape(1))) if len(d.generated) + 1 < d.budget \
            else None
        token_id = int(token.item())
        if ahead is not None:
            d.held.append(token_id)
        d.generated.append(token_id)
        yield Emitted(token_id, False, _value(logprob))
        if ahead is None:
            return
        token, logprob = d.sample(ahead)
        mx.async_eval(token if logprob is None else [token, logprob])


def speculative_tokens(d: Decoding, logits: mx.array, drafter: Drafter,
                       controller: DepthController,
                       clock: Callable[[], float] = time.perf_counter) -> Tokens:
    d.stats.drafter = drafter.kind
    token, logprob = d.sample(logits)
    # ``fed``: the target already holds ``token`` (the step feeding it is queued as ``ahead``,
    # whose row judges the first draft). After a verify round the next token is known but not
    # fed: it then leads the next verify block itself, and no separate step is spent on it.
    ahead = (yield from d.step(token.reshape(1))) if d.budget > 1 else None
    fed = ahead is not None
    mx.async_eval([a for a in (token, logprob, ahead) if a is not None])
    # (depth, accepted, one-off catch-up seconds, fed, a plain step after a verify round) of
    # the round that just ended
    in_flight, t_round = None, clock()
    while True:
        token_id = int(token.item())
        # A round runs from one of these syncs to the next: the wall time the depth controller
        # weighs against the tokens the round committed.
        now = clock()
        if in_flight is not None:
            depth, accepted, catch_up_s, after_plain_step, after_round = in_flight
            controller.record(depth, accepted, now - t_round - catch_up_s, after_plain_step,
                              after_round)
        t_round = now
        if fed:
            d.held.append(token_id)
        d.generated.append(token_id)
        yield Emitted(token_id, False, _value(logprob))  # sampled by the target itself
        remaining = d.budget - len(d.generated)
        if remaining <= 0:
            return
        context = d.held if fed else d.held + [token_id]
        depth = controller.choose(remaining - 1)  # leave room for the bonus token
        draft = drafter.propose(context, depth, d.sampler, d.history) if depth else None
        if draft is None:  # a plain step, pipelined again from here
            after_round = not fed
            if after_round:
                ahead = yield from d.step(token.reshape(1))
                d.held.append(token_id)
            token, logprob = d.sample(ahead)
            # As in plain_tokens: start this token first, then build the next step's graph
            # while it computes (building it before the async_eval idled the device).
            mx.async_eval(token if logprob is None else [token, logprob])
            ahead = (yield from d.step(token.reshape(1))) if remaining > 1 else None
            fed = ahead is not None
            in_flight = (0, 0, 0.0, False, after_round)
            continue
        drafts = draft.tokens
        n = drafts.shape[0]
        block = drafts if fed else mx.concatenate([token.reshape(1).astype(mx.int32), drafts])
        tx = SpeculativeWrite(d.caches, block.shape[0])
        try:
            rows = yield from d.block(block)  # row i follows block[:i + 1]
            target_logits = mx.concatenate([ahead[None], rows]) if fed else rows  # (N + 1, V)
            histories = [d.history(drafts[:i]) for i in range(n + 1)]
            verdict = judge(d.sampler.distributions(target_logits, histories), drafts,
                            draft.logprobs, d.sampler)
            lps = (target_logits - mx.logsumexp(target_logits, axis=-1, keepdims=True)
                   if d.logprobs else None)
            mx.eval([verdict.accepted, verdict.next_token, drafts]
                    + ([] if lps is None else [lps]))  # the round's one host sync
            accepted = int(verdict.accepted.item())
            ids = draft.known if draft.known is not None else drafts.tolist()
            # An accepted EOS ends the reply there: it is emitted, its state is not kept.
            eos_at = next((j for j, t in enumerate(ids[:accepted]) if t in d.eos), None)
            keep = accepted if eos_at is None else eos_at
            tx.commit(keep + (0 if fed else 1))
        except BaseException:
            tx.abort()
            raise
        if not fed:
            d.held.append(token_id)
        d.held.extend(ids[:keep])
        drafter.settle(d.held)
        d.stats.record(n, accepted)
        in_flight = (n, accepted, draft.catch_up_s, fed, False)
        for j in range(keep if eos_at is None else eos_at + 1):
            d.generated.append(ids[j])
            yield Emitted(ids[j], True, None if lps is None else float(lps[j, ids[j]].item()))
        if eos_at is not None:
            return
        token, ahead, fed = verdict.next_token, None, False
        logprob = None if lps is None else lps[keep, token]
        if logprob is not None:
            mx.async_eval(logprob)
