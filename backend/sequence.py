"""One request from its prompt to its ``DoneEvent``, as a coroutine the scheduler drives.

``Sequence.run()`` is the engine's generation in numbered steps (see ``backend/engine.py``),
written so that it never runs the target model itself: wherever it needs a forward it yields a
``Feed`` (token ids into its own caches; which rows it wants logits of) and receives
``(hidden, logits)``. The scheduler (``backend/scheduler.py``) collects the feeds of every
running sequence and answers them with one batched forward per group of rows, so many
sequences decode together while each one's logic (prefill, plain or speculative decoding,
stop strings, the turn end, the prefix cache) stays the sequential code of one request. Its
other yields are the request's ``TokenEvent``s and, last, its ``DoneEvent``.

Everything here runs on the scheduler's thread; answers may be lazy MLX arrays.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Generator

import mlx.core as mx

from backend.api import DoneEvent, GenerateRequest, TokenEvent
from backend.decoding import Decoding, Emitted, plain_tokens, speculative_tokens
from backend.feeds import Answer, Feed, forward
from backend.sampling import Sampler
from backend.tokenizer import StopMatcher

if TYPE_CHECKING:
    from backend.engine import Engine, Lane

#: Most ids a chat template writes between a reply and the next user's words.
MAX_TURN_END = 16

Event = TokenEvent | DoneEvent


Coroutine = Generator["Feed | Event", "Answer | None", None]


class Sequence:
    """A request on its lane (target caches, drafter, prefix-cache slot): ``run()`` is the
    coroutine. ``t_submit``: when the caller handed it over (time to first token counts from
    there, the wait in the queue included)."""

    def __init__(self, engine: "Engine", request: GenerateRequest, prompt: list[int],
                 cancel: threading.Event | None, t_submit: float) -> None:
        self.engine = engine
        self.request = request
        self.prompt = prompt
        self.cancel = cancel
        self.t_submit = t_submit
        self.lane: Lane | None = None  # given by the scheduler when it admits the sequence
        # The most live-cache bytes the request can come to (its admission reserve).
        self.reserve_bytes = engine.bytes_per_token * min(
            len(prompt) + request.max_tokens, engine.context_length)
        self.held: list[int] = []  # the ids the lane's live caches hold, at every yield
        self.dropped_messages = 0  # old messages the context-overflow policy left out
        self.read_ahead = False  # its stored prefix was read from disk while it waited
        self.prefilling = True  # until its prompt's last token is fed

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    # -- the whole request ------------------------------------------------------------------------
    def run(self) -> Coroutine:
        lane, prefix = self.lane, self.engine.prefix
        try:
            # 2. The prefix cache never fails a turn: a fault inside it restores nothing.
            resume = prefix.begin(self.prompt, lane.slot)
            self.held.extend(self.prompt[:resume.cached])
            yield from self._run(resume)
        except GeneratorExit:  # stopped early: keep what the caches hold, if it is ``held``
            if lane.slot.running:
                if all(c.offset == len(self.held) for c in lane.target_caches):
                    self._commit()
                else:  # stopped with a forward built but not yet taken: its writes are extra
                    prefix.abort(lane.slot)
            raise
        except BaseException:
            if lane.slot.running:
                prefix.abort(lane.slot)  # a half-written cache is never reused
            raise

    def _run(self, resume) -> Coroutine:
        engine, request, prompt, lane = self.engine, self.request, self.prompt, self.lane
        t_start = self.t_submit
        sampler = Sampler(request.sampling)
        budget = min(request.max_tokens, engine.context_length - len(prompt))
        logits = yield from self._prefill(resume.cached)  # 3
        engine.prefix.attach_captures(self.held, lane.slot)
        eos = frozenset() if request.ignore_eos else engine.tokenizer.eos_token_ids
        drafter = lane.drafter
        decoding = Decoding(engine.model, lane.target_caches, sampler, list(prompt), self.held,
                            budget, eos, request.logprobs,
                            observe=drafter.observe if drafter else None)
        detok = engine.tokenizer.detokenizer()
        stops = StopMatcher(request.stop)
        pieces: list[str] = []
        finish = "cancelled" if logits is None else "length"
        t_first = time.perf_counter()
        if logits is not None:  # 4
            chosen = engine.drafter_for(request, lane)
            tokens = (plain_tokens(decoding, logits) if chosen is None else
                      speculative_tokens(decoding, logits, chosen, engine.depth(chosen.kind)))
            answer = None
            while True:
                try:
                    item = tokens.send(answer)
                except StopIteration:
                    break
                if isinstance(item, Feed):
                    answer = yield item
                    continue
                answer = None
                emitted: Emitted = item
                if len(decoding.generated) == 1:
                    t_first = time.perf_counter()
                if emitted.token_id in eos:
                    finish = "stop"
                    break
                text, stopped = stops.feed(detok.add(emitted.token_id))
                pieces.append(text)
                yield TokenEvent(text, emitted.token_id, emitted.from_draft, emitted.logprob)
                if stopped:
                    finish = "stop"
                    break
                if self.cancelled():
                    finish = "cancelled"
                    break
            tokens.close()
            if not stops.stopped:  # release text held back for a stop string or a partial char
                tail, stopped = stops.feed(detok.finalize())
                tail += "" if stopped else stops.flush()
                if tail:
                    pieces.append(tail)
                    yield TokenEvent(tail, -1)
        t_end = time.perf_counter()
        if request.messages is not None and finish != "cancelled":
            yield from self._close_turn(request.messages, "".join(pieces))
        self._commit()  # 5
        n_new = len(prompt) - resume.cached
        generated, stats = decoding.generated, decoding.stats
        decode_time = t_end - t_first
        yield DoneEvent(
            text="".join(pieces),
            token_ids=generated,
            finish_reason=finish,
            prompt_tokens=len(prompt),
            cached_tokens=resume.cached,
            generated_tokens=len(generated),
            ttft_s=(t_first - t_start) if generated else 0.0,
            # The first token is only known once the last prefill chunk ran: TTFT bounds prefill.
            prefill_tps=n_new / max(t_first - t_start, 1e-9) if generated else 0.0,
            decode_tps=(len(generated) - 1) / decode_time if len(generated) > 1 else 0.0,
            drafted_tokens=stats.drafted,
            accepted_tokens=stats.accepted,
            drafter=stats.drafter,
            acceptance_by_position=stats.acceptance_by_position,
            mean_accepted=stats.mean_accepted,
            draft_rounds=stats.rounds,
            cached_by_tier=dict(resume.by_tier),
            restore_s=resume.restore_s,
            dropped_messages=self.dropped_messages,
        )

    # -- step 3: prefill ----------------------------------------------------------------------
    def _prefill(self, start: int) -> Generator[Feed, Answer, "mx.array | None"]:
        """Feed ``prompt[start:]``; logits (vocab,) of the last token, None if cancelled."""
        prompt = self.prompt
        begin = start
        while begin < len(prompt) - 1:
            if self.cancelled():
                return None
            end = min(begin + self.engine.prefill_rows(self), len(prompt) - 1)
            yield from self._feed(prompt[begin:end])
            begin = end
        if self.cancelled():
            return None
        _, logits = yield from self._forward(mx.array(prompt[-1:]), "last")
        self.held.append(prompt[-1])
        self.prefilling = False
        return logits[-1]

    def _forward(self, ids: mx.array, logits: str) -> Generator[Feed, Answer, Answer]:
        drafter = self.lane.drafter
        return (yield from forward(Feed(ids, self.lane.target_caches, logits),
                                   drafter.observe if drafter else None))

    def _feed(self, chunk: list[int]) -> Generator[Feed, Answer, None]:
        """Run ``chunk`` through the model into the live caches (no vocabulary projection)."""
        hidden, _ = yield from self._forward(mx.array(chunk), "none")
        mx.eval(hidden, [c.arrays() for c in self.lane.target_caches])
        if self.lane.drafter is not None:
            self.lane.drafter.feed(chunk)  # the drafter's caches stay in step
        self.held.extend(chunk)

    # -- step 5: the turn end, the prefix cache ----------------------------------------------
    def _close_turn(self, messages: list, reply: str) -> Generator[Feed, Answer, None]:
        """Feed the end of this turn and the next user turn's header, as the chat template
        writes them after ``reply`` (ChatML: ``<|im_end|>\\n<|im_start|>user\\n``, and the
        reply's last token, which decoding samples but never feeds): the conversation's next
        turn then starts prefilling at the user's own words. Done once the reply's text is out.
        Skipped when the template would render the reply with other ids than the caches hold
        (a reply cut by a stop string, text that tokenizes otherwise when read back)."""
        engine, prompt, held = self.engine, self.prompt, self.held
        tail = engine.tokenizer.turn_end_ids(messages, reply, prompt)
        fed = held[len(prompt):]
        if tail is None or tail[:len(fed)] != fed:
            return
        close = tail[len(fed):]
        if 0 < len(close) <= MAX_TURN_END and len(held) + len(close) < engine.context_length:
            if self.lane.drafter is not None:
                self.lane.drafter.catch_up(held)  # a draft model lags the target after decoding
            yield from self._feed(close)

    def _commit(self) -> None:
        """Record what the live caches hold (the drafter's caches first catch up)."""
        lane = self.lane
        if lane.drafter is not None:
            lane.drafter.catch_up(self.held)
        mx.eval([c.arrays() for c in lane.slot.caches])
        self.engine.prefix.commit(self.held, lane.slot)

