"""How many tokens to draft each round: the depth that maximizes committed tokens per second.

With per-position acceptance ``a_j`` (the chance that draft j is accepted given drafts 1..j-1
were) a round of depth N commits on average ``E(N) = 1 + sum_{k<=N} prod_{j<=k} a_j`` tokens and
costs ``cost(N)`` seconds (drafting + one verify forward; depth 0 is one plain decode step). The
controller picks ``argmax E(N) / cost(N)`` over ``0 .. limit``, so it falls back to plain decoding
(depth 0) when drafting does not pay, and speculation never stays slower for long.

Both are running estimates: ``a_j`` an exponentially weighted mean of the outcomes at position j
(updated only where a round reached j; its first outcomes averaged with the prior, so a few
misses already count), kept apart by context, whether the previous round kept
any of its drafts: acceptance comes in runs (a passage being copied, a formulaic stretch; a
copying run misses now and then, late in a round, while a free stretch misses at once), so
after a round that kept drafts drafting deep pays, after one that kept none or a plain step
plain decoding or a shallow probe does, and one average of both would price every round between
the two. ``cost(N)`` one per depth, each slower sample clamped to
within 25% of the estimate so one stall of the host cannot flip the choice (a faster one moves
the estimate half way at once: a first sample taken during a stall, or a draft model catching
up a long plain stretch, must not keep a depth looking dear for hundreds of rounds). Depths
never tried are priced by linear interpolation between the tried ones, or outside them by the slope
over the widest span of tried drafting depths; every ``probe_every``
rounds the controller tries one deeper than its choice, backing off while probes change nothing.
The controller outlives requests (one per engine and drafter kind), and several replies
decoding in one batch share it: what one reply carries from round to round (its context, its
last choice) is that reply's own ``Rounds``, while costs and acceptance are pooled.

A fresh controller knows no costs and would price plain decoding first and the depths one by one
within the reply, so a short reply drafts little; ``seed(costs)`` gives it the round costs
measured before the first round (``speculation/profile.py``), which real rounds then refine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ACCEPT_EWMA = 0.1
COST_EWMA = 0.3
COST_CLAMP = 0.25
FASTER_EWMA = 0.5
# From plain decoding a depth must beat it by this much: the prices leave out what a switch
# costs (a draft model catching up the plain stretch, a first round that waits for the queued
# plain step), and near break-even, flipping back and forth on noise loses more than it wins.
SWITCH_MARGIN = 0.1
PRIOR_ACCEPTANCE = 0.7  # before any evidence at a position
# The prior counts as this many outcomes: a position's first outcomes move its estimate as their
# mean with the prior would (weight 1 / (n + PRIOR_WEIGHT)), later ones by ACCEPT_EWMA. With the
# costs known before the first round (``seed``), a fresh reply where nothing is copied then
# stops drafting after a few misses instead of a dozen at the prior.
PRIOR_WEIGHT = 4
TRUST_AFTER = 2  # outcomes before a position's own estimate is trusted
# Contexts of the acceptance estimates: what the previous round did.
AFTER_MISS = 0  # the first draft was rejected, or the round was a plain step
AFTER_HIT = 1  # at least one draft was accepted


@dataclass
class Rounds:
    """What one reply carries from one round to the next."""

    context: int = AFTER_MISS  # the next round's (AFTER_MISS / AFTER_HIT)
    last_choice: int = -1  # the depth last chosen (not a probe); -1 before the first round
    # The last drafting round's (depth, seconds, after a plain step, its depth's price before
    # it): repriced if the next step says it broke plain decoding's pipeline (see ``record``).
    pending: tuple[int, float, bool, float | None] | None = None


@dataclass
class DepthController:
    max_depth: int = 8
    probe_every: int = 8
    fixed: int | None = None  # always this depth (tests, benchmarks), within the limit
    # a_j (j = 1 .. max_depth) and the rounds that reached j, per context (AFTER_MISS/HIT)
    acceptance: list[list[float]] = field(default_factory=list)
    reached: list[list[int]] = field(default_factory=list)
    cost: dict[int, float] = field(default_factory=dict)  # seconds per round by depth
    rounds: int = 0
    _probe_interval: int = 0
    _own: Rounds = field(default_factory=Rounds)  # for callers that keep no ``Rounds``

    def __post_init__(self) -> None:
        self.acceptance = [[PRIOR_ACCEPTANCE] * self.max_depth for _ in (AFTER_MISS, AFTER_HIT)]
        self.reached = [[0] * self.max_depth for _ in (AFTER_MISS, AFTER_HIT)]
        self._probe_interval = self.probe_every

    @property
    def context(self) -> int:
        """The next round's context, for a caller that keeps no ``Rounds`` of its own."""
        return self._own.context

    def seed(self, costs: dict[int, float]) -> None:
        """Round costs by depth measured beforehand (``speculation/profile.py``): the first
        round is then chosen by them instead of by a plain step priced first. Real rounds
        refine them as any estimate (a cost already learned here is kept)."""
        for depth, seconds in costs.items():
            if 0 <= depth <= self.max_depth and seconds > 0:
                self.cost.setdefault(depth, seconds)

    # -- estimates -------------------------------------------------------------------------------
    def expected_tokens(self, depth: int, context: int | None = None) -> float:
        """E(depth) in ``context`` (by default the next round's)."""
        context = self.context if context is None else context
        total, run = 1.0, 1.0
        for j in range(depth):
            run *= self._acceptance(context, j)
            total += run
        return total

    def _acceptance(self, context: int, j: int) -> float:
        acceptance, reached = self.acceptance[context], self.reached[context]
        if reached[j] >= TRUST_AFTER:
            return acceptance[j]
        trusted = [acceptance[i] for i in range(j) if reached[i] >= TRUST_AFTER]
        return trusted[-1] if trusted else PRIOR_ACCEPTANCE

    def round_cost(self, depth: int) -> float | None:
        if depth in self.cost:
            return self.cost[depth]
        known = sorted(self.cost)
        if not known:
            return None
        if len(known) == 1:
            base = self.cost[known[0]]
            return base * (1.0 + 0.15 * (depth - known[0]))  # a guess until a second sample
        lo = max([d for d in known if d < depth], default=None)
        hi = min([d for d in known if d > depth], default=None)
        if lo is None or hi is None:
            # Outside the tried depths: the slope over the widest span of drafting depths.
            # Neighbouring depths differ by little more than noise and kernel tiling (an odd
            # row left over from two-row tiles costs nearly a pass of its own), so the slope
            # of the last two can be far off, and it would price every deeper round by it.
            drafting = [d for d in known if d > 0]
            lo, hi = (drafting[0], drafting[-1]) if len(drafting) >= 2 else (known[0], known[-1])
        slope = (self.cost[hi] - self.cost[lo]) / (hi - lo)
        return max(1e-6, self.cost[lo] + slope * (depth - lo))

    # -- decisions -------------------------------------------------------------------------------
    def choose(self, limit: int, rounds: Rounds | None = None) -> int:
        """Depth for the next round of the reply ``rounds`` tracks, at most ``limit``."""
        rounds = self._own if rounds is None else rounds
        limit = max(0, min(limit, self.max_depth))
        self.rounds += 1
        if limit == 0:
            return 0
        if self.fixed is not None:
            return min(self.fixed, limit)
        if 0 not in self.cost:
            return 0  # price plain decoding first
        untried = [d for d in range(1, limit + 1) if d not in self.cost]
        if len(self.cost) < 2 and untried:
            return untried[0]
        best, best_rate = 0, 0.0
        for depth in range(limit + 1):
            cost = self.round_cost(depth)
            rate = self.expected_tokens(depth, rounds.context) / cost if cost else 0.0
            if depth and rounds.last_choice <= 0:
                rate /= 1.0 + SWITCH_MARGIN  # leaving plain decoding must pay for the switch
            if rate > best_rate:
                best, best_rate = depth, rate
        if best != rounds.last_choice:
            self._probe_interval = self.probe_every
        rounds.last_choice = best
        if self.rounds % self._probe_interval == 0 and best < limit:
            self._probe_interval = min(self._probe_interval * 2, 512)
            return best + 1
        return best

    def record(self, depth: int, accepted: int, seconds: float | None,
               after_plain_step: bool = False, after_round: bool = False,
               rounds: Rounds | None = None) -> None:
        """A round of ``depth`` drafts kept ``accepted`` of them and took ``seconds`` (None:
        its time says nothing of its cost, e.g. it shared a step with another's prefill; only
        the acceptance counts). ``rounds``: the reply's (see ``choose``).

        In a batch the caller passes the round's share of the batched step it ran in, not the
        step's whole time: the rows of every sequence share the step, and a round priced at
        the whole step would look as dear as if it had run alone beside idle others.

        ``after_plain_step``: the round followed a plain step, so it also waited for the
        forward that step queued (its row judges draft 1). A round after a verify round puts
        that row into its own block instead, nearly free; depths are priced as the latter (what
        a run of drafting rounds costs), so one plain step is taken off: otherwise the probes
        made from plain decoding, always of the first kind, would overprice every depth.

        ``after_round``: a plain step right after a verify round. Nothing was queued ahead of
        it, so it waited for its whole forward and the graph building before it, where a run
        of plain steps overlaps each step's building with the one before (measured here: 30-37
        ms against 26-28). Plain decoding is priced as such a run, so this step is not priced
        as a plain step (with most plain steps taken between rounds, depth 0 would look ~20%
        dearer than it is); what it took beyond a plain step is the round's doing: the round
        is priced again with it. A round that leads into another costs what it took, one that
        falls back to plain decoding also the pipeline it broke (on open text, where lookup
        finds a stray match now and then, that is most of what a missed round costs:
        unpriced, it kept the controller drafting at 0.91x plain decoding)."""
        rounds = self._own if rounds is None else rounds
        pending, rounds.pending = rounds.pending, None
        if depth == 0 and after_round:
            if pending is not None and seconds is not None and 0 in self.cost:
                self._reprice(pending, seconds - self.cost[0])
            rounds.context = AFTER_MISS
            return
        if seconds is not None:
            before = self.cost.get(depth)
            self._price(depth, seconds, after_plain_step)
            if depth:
                rounds.pending = (depth, seconds, after_plain_step, before)
        acceptance, reached = self.acceptance[rounds.context], self.reached[rounds.context]
        for j in range(min(depth, accepted + 1)):  # positions the round reached
            outcome = 1.0 if j < accepted else 0.0
            reached[j] += 1
            weight = max(ACCEPT_EWMA, 1.0 / (reached[j] + PRIOR_WEIGHT))
            acceptance[j] += weight * (outcome - acceptance[j])
        rounds.context = AFTER_HIT if depth and accepted else AFTER_MISS

    def _reprice(self, pending: tuple[int, float, bool, float | None], extra: float) -> None:
        """Price a round again from its depth's earlier price, ``extra`` seconds dearer."""
        if extra <= 0:
            return
        depth, seconds, after_plain_step, before = pending
        if before is None:
            self.cost.pop(depth, None)
        else:
            self.cost[depth] = before
        self._price(depth, seconds + extra, after_plain_step)

    def _price(self, depth: int, seconds: float, after_plain_step: bool) -> None:
        if after_plain_step and depth and 0 in self.cost:
            seconds = max(seconds - self.cost[0], 0.1 * seconds)
        old = self.cost.get(depth)
        if old is None:
            self.cost[depth] = seconds
        else:
            if seconds < old:  # nothing makes a round spuriously fast: believe it sooner
                self.cost[depth] = old + FASTER_EWMA * (seconds - old)
            else:
                sample = min(seconds, old * (1 + COST_CLAMP))
                self.cost[depth] = old + COST_EWMA * (sample - old)
