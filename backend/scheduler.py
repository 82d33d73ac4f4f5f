"""Continuous batching: many sequences' coroutines, their forwards answered together.

Scope: which sequences run (admission into lanes, the queue), and one ``step``: every running
sequence advances to its next ``Feed`` (emitting its events on the way), then the feeds are
answered with batched forwards. Not in scope: what a sequence does (``sequence.py``), the
prefix cache's policy (``memory/prefix_cache.py``), threads (the caller steps; everything runs
on the thread that calls ``step``).

Batching is exact: a group's rows run through row-invariant products (at most
``MAX_GROUP_ROWS`` rows, the native kernels' limit) and every sequence's attention, window and
recurrent state are its own (``caches/segments.py``), so each sequence's outputs equal its
outputs alone, bit for bit, whatever else shares its steps. A feed with more rows than that (a
prefill chunk) runs as its own forward in the same step; its size depends only on its own
request, never on the others, so it too computes alike alone or in company.

A sequence is admitted when a lane is free or can be made (``max_batch`` lanes at most: the
live caches, drafter and prefix-cache slot of one sequence); the others wait in arrival order.
Among the idle lanes it takes the one whose live caches share the longest prefix with its
prompt. Memory is part of admission: a sequence reserves the live-cache bytes its prompt and
``max_tokens`` can grow to, and while others run it waits (in order) until its reserve fits
beside theirs in the device budget; alone it always runs, so no request waits forever.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generator

import mlx.core as mx

from backend import kernels
from backend.api import DoneEvent, TokenEvent
from backend.caches.segments import layer_segments
from backend.feeds import Answer, Feed

#: Most rows one batched forward takes (the native kernels are row-invariant up to this many).
MAX_GROUP_ROWS = kernels.MAX_KERNEL_ROWS

#: Rows a step gives prefilling beside sequences that decode, when how a prompt is cut changes
#: no bit (exact prefill): their next tokens wait for the whole step, and a step's cost grows
#: with its rows, so a long prompt arriving mid-stream is fed in small chunks between their
#: tokens (decode rows first, a prefilling sequence at least ``MIN_PREFILL_ROWS``).
STEP_ROWS = 16
MIN_PREFILL_ROWS = 4

Event = TokenEvent | DoneEvent


@dataclass
class Stream:
    """What a caller reads of its request: events as they come, then ``done`` (or ``error``,
    raised by ``Engine.generate``)."""

    events: deque = field(default_factory=deque)
    done: bool = False
    error: BaseException | None = None
    waiting: bool = True  # still in the queue (no lane yet)


@dataclass
class _Running:
    sequence: object
    coroutine: Generator
    stream: Stream
    feed: Feed | None = None
    answer: Answer | None = None


class Scheduler:
    """See the module docstring. ``lanes``: the engine's lanes (the first made already);
    ``make_lane()`` makes another; ``hidden(ids, caches)`` and ``logits(hidden)`` run the
    target; ``choose_slot(prompt, slots)`` picks the prefix-cache slot a prompt resumes best
    from; ``features()`` gives the latest forward's captured layer outputs (or None)."""

    def __init__(self, lanes: list, make_lane: Callable[[], object], max_batch: int,
                 hidden: Callable, logits: Callable, choose_slot: Callable,
                 features: Callable[[], "mx.array | None"] = lambda: None,
                 device_budget: Callable[[], int] = lambda: 1 << 62) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.lanes = lanes
        self._make_lane = make_lane
        self.max_batch = max_batch
        self._hidden = hidden
        self._logits = logits
        self._features = features  # after a forward: its captured layers' outputs, or None
        self._choose_slot = choose_slot
        self._device_budget = device_budget  # bytes the running sequences' reserves may fill
        self.waiting: deque[tuple[object, Stream]] = deque()
        self.running: list[_Running] = []
        self.steps = 0

    # -- the queue --------------------------------------------------------------------------------
    def submit(self, sequence, stream: Stream) -> None:
        self.waiting.append((sequence, stream))

    def counts(self) -> tuple[int, int, int]:
        """(running, of them still prefilling, waiting)."""
        prefilling = sum(1 for r in self.running if r.sequence.prefilling)
        return len(self.running), prefilling, len(self.waiting)

    def prefill_rows_beside(self, sequence) -> int | None:
        """Rows ``sequence`` may prefill in this step when others decode beside it (None: no
        one decodes, the whole chunk)."""
        decoding = sum(1 for r in self.running
                       if r.sequence is not sequence and not r.sequence.prefilling)
        if not decoding:
            return None
        return max(MIN_PREFILL_ROWS, STEP_ROWS - decoding)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def _admit(self) -> None:
        while self.waiting:
            busy = {id(r.sequence.lane) for r in self.running}
            idle = [lane for lane in self.lanes if id(lane) not in busy]
            if not idle and len(self.lanes) >= self.max_batch:
                return
            if self.running and not self._fits(self.waiting[0][0]):
                return
            sequence, stream = self.waiting.popleft()
            if idle:
                sequence.lane = self._best_lane(sequence.prompt, idle)
            else:
                sequence.lane = self._make_lane()
                self.lanes.append(sequence.lane)
            stream.waiting = False
            self.running.append(_Running(sequence, sequence.run(), stream))

    def _fits(self, sequence) -> bool:
        reserved = sum(run.sequence.reserve_bytes for run in self.running)
        return reserved + sequence.reserve_bytes <= self._device_budget()

    def _best_lane(self, prompt, idle: list):
        slots = [lane.slot for lane in idle]
        best = self._choose_slot(prompt, slots)
        return next(lane for lane in idle if lane.slot is best)

    # -- a step -----------------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, advance every running sequence to its next feed, answer the feeds. Returns
        whether anything is left to do."""
        self._admit()
        for run in list(self.running):
            if run.feed is None:  # else its feed waits from the step before
                self._advance(run)
        feeds = [run for run in self.running if run.feed is not None]
        self._share([run.feed for run in feeds])
        for group in self._groups(feeds):
            for run, answer in zip(group, self.answer([r.feed for r in group])):
                run.answer, run.feed = answer, None
        # Each answer is taken at once: a reply's token comes out in the step that computed
        # it. Otherwise a decoding sequence would spend every other step only emitting, and a
        # prefill chunk running beside it would take both steps' time per token.
        for run in feeds:
            if run in self.running:
                self._advance(run)
        self.steps += 1
        return self.busy

    def _advance(self, run: _Running) -> None:
        """Send the sequence its answer and run it to its next feed or event. After an event it
        waits until the caller has taken it: cancellation is then judged with what the caller
        has seen (as a pulled generator would), and a slow reader slows only its own request."""
        if run.stream.events:
            return
        answer, run.answer = run.answer, None
        try:
            item = run.coroutine.send(answer)
            if isinstance(item, Feed):
                run.feed = item
            else:
                run.stream.events.append(item)
        except StopIteration:
            self._finish(run)
        except BaseException as exc:  # the request failed: its caller hears why
            run.stream.error = exc
            self._finish(run)

    def _finish(self, run: _Running) -> None:
        self.running = [r for r in self.running if r is not run]
        run.stream.done = True

    def stop(self, stream: Stream) -> None:
        """The caller left: a queued request goes, a running one ends where it stands (its
        caches recorded as they are)."""
        for i, (sequence, s) in enumerate(self.waiting):
            if s is stream:
                del self.waiting[i]
                stream.done = True
                return
        for run in self.running:
            if run.stream is stream:
                try:
                    run.coroutine.close()
                finally:
                    self._finish(run)
                return

    def stop_all(self) -> None:
        for _, stream in list(self.waiting):
            self.stop(stream)
        for run in list(self.running):
            self.stop(run.stream)

    @staticmethod
    def _share(feeds: list[Feed]) -> None:
        """Tell each feed its part of the step (the depth controller prices a round at that
        part of its time): its rows over all rows, or None beside another's prefill chunk."""
        total = sum(f.rows for f in feeds)
        prefilling = len(feeds) > 1 and any(f.rows > MAX_GROUP_ROWS for f in feeds)
        for feed in feeds:
            feed.share = None if prefilling else feed.rows / total

    def _groups(self, runs: list[_Running]) -> list[list[_Running]]:
        """Feeds packed in arrival order into groups of at most MAX_GROUP_ROWS rows; a bigger
        feed is a group of its own."""
        groups: list[list[_Running]] = []
        current: list[_Running] = []
        rows = 0
        for run in runs:
            n = run.feed.rows
            if n > MAX_GROUP_ROWS:
                groups.append([run])
                continue
            if rows + n > MAX_GROUP_ROWS:
                groups.append(current)
                current, rows = [], 0
            current.append(run)
            rows += n
        if current:
            groups.append(current)
        return groups

    def answer(self, feeds: list[Feed]) -> list[Answer]:
        """One forward over the feeds' rows; each gets its hidden states and the logits rows it
        asked for (lazy)."""
        if len(feeds) == 1:
            ids, lengths = feeds[0].tokens, [feeds[0].rows]
        else:
            ids = mx.concatenate([f.tokens.astype(mx.int32) for f in feeds])
            lengths = [f.rows for f in feeds]
        hidden = self._hidden(ids[None], layer_segments([f.caches for f in feeds], lengths))
        features = self._features()
        parts, extra, wanted, at = [], [], [], 0
        for feed, n in zip(feeds, lengths):
            parts.append(hidden[:, at:at + n, :])
            extra.append(None if features is None else features[:, at:at + n, :])
            if feed.logits == "last":
                wanted.append(hidden[:, at + n - 1:at + n, :])
            elif feed.logits == "all":
                wanted.append(parts[-1])
            at += n
        if not wanted:
            return [(part, None, more) for part, more in zip(parts, extra)]
        rows = wanted[0] if len(wanted) == 1 else mx.concatenate(wanted, axis=1)
        logits = self._logits(rows)[0]  # (rows, vocab)
        answers, at = [], 0
        for feed, part, more in zip(feeds, parts, extra):
            k = feed.logit_rows
            answers.append((part, logits[at:at + k] if k else None, more))
            at += k
        return answers
