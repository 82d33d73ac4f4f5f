"""The engine: load a model and stream generations from it, over one shared prefix cache.

Scope: one loaded model (and later an optional drafter), one generation at a time, called from
one thread (the desktop's worker thread, the terminal chat, the server or a benchmark).
Not in scope: Qt (the desktop wraps this), conversation storage, multi-request batching.

Public surface (see docs/ARCHITECTURE.md):

    engine = Engine.load("SmolLM2-135M-Instruct")          # store name, HF folder or .gguf
    for event in engine.generate(GenerateRequest(messages=[...]), cancel=threading.Event()):
        TokenEvent(text, token_id, from_draft) ... then exactly one DoneEvent(stats)
    engine.prefetch(messages=[...])  engine.cache_stats()  engine.clear_cache()  engine.close()

``generate`` in numbered steps:

1. Turn the request into prompt token ids (chat template or raw ids) and check it fits.
2. Restore the longest prefix stored for any conversation (``backend.memory.PrefixCache``):
   the live caches then hold ``cached`` prompt tokens, brought from the device, host or disk.
3. Prefill the rest in chunks (``PREFILL_CHUNK`` tokens), checking ``cancel`` between chunks;
   only the last position goes through the vocabulary projection. The states the prefix cache
   scheduled are captured by these writes and attached after the prefill (also on cancel).
4. Decode: sample token t while the device already computes t+1 (``mx.async_eval`` one step
   ahead), stream text through the detokenizer and stop-string matcher, check ``cancel``.
5. For a chat reply, feed the template's end of turn and the next user turn's header; record
   what the caches now hold in the prefix cache, emit ``DoneEvent`` with the statistics, then
   (once the caller asks for more) write new states to the disk tier.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from backend.api import CacheStats, DoneEvent, GenerateRequest, ModelInfo, TokenEvent
from backend.decoding import Decoding, plain_tokens, speculative_tokens
from backend.errors import ContextLengthError, InvalidRequestError, ModelLoadError
from backend.memory.budgets import CacheBudgets, CacheConfig
from backend.memory.disk import DiskStore, RetryPolicy
from backend.memory.fingerprint import model_fingerprint
from backend.memory.prefix_cache import PrefixCache
from backend.sampling import Sampler
from backend.speculation.depth import DepthController
from backend.speculation.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from backend.speculation.mtp import mtp_drafter
from backend.tokenizer import StopMatcher, Tokenizer
from backend.weights.files import weight_files
from backend.weights.loading import LoadedModel, load_model
from backend.weights.quantize import describe_quantization

PREFILL_CHUNK = 2048
MAX_TURN_END = 16  # most ids a chat template writes between a reply and the next user's words
MAX_DRAFT = 8  # most draft tokens per verify round (verify blocks of up to 16 are exact)
SPECULATION_CHOICES = ("auto", "model", "mtp", "lookup", "none")

Event = TokenEvent | DoneEvent


def _fingerprint(loaded: LoadedModel, memo: Path) -> str:
    folder = Path(loaded.folder)
    return model_fingerprint(folder, weight_files(folder),
                             str(loaded.dtype).replace("mlx.core.", ""),
                             "kernels" if loaded.cpu_kernels else "mlx", memo_file=memo)


class Engine:
    """A loaded model, its tokenizer and its prefix cache; ``generate`` streams events (see
    the module docstring)."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, name: str,
                 cache: CacheConfig | None = None, prefill_chunk: int | None = None,
                 draft: LoadedModel | None = None, speculation: str = "auto",
                 draft_depth: int | None = None) -> None:
        """``draft``: a draft model with this tokenizer's vocabulary (``load`` checks it);
        ``speculation``: the drafter requests get by default ("auto": the draft model if there
        is one, else the checkpoint's multi-token-prediction head if it ships one, else prompt
        lookup; "model", "mtp", "lookup", or "none" for plain decoding; the head's caches are
        kept only under "auto" and "mtp");
        ``draft_depth``: draft exactly this many tokens per round (None: the depth controller
        chooses, 0 .. MAX_DRAFT)."""
        if speculation not in SPECULATION_CHOICES:
            raise InvalidRequestError(f"speculation must be one of {SPECULATION_CHOICES}")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = tokenizer
        self.name = name
        self.prefill_chunk = prefill_chunk  # None: PREFILL_CHUNK
        self.cache_config = cache if cache is not None else CacheConfig.default()
        self.draft = draft
        self.drafter = (ModelDrafter(draft.model, Path(draft.folder).name) if draft else
                        mtp_drafter(self.model) if speculation in ("auto", "mtp") else None)
        self.speculation = (self.drafter.kind if self.drafter else "lookup") \
            if speculation == "auto" else speculation
        self.target_caches = self.model.make_caches()
        # The drafter's caches are live caches too: the prefix cache stores them alongside.
        self.caches = self.target_caches + (self.drafter.caches if self.drafter else [])
        self.prefix = self._prefix_cache(self.cache_config)
        self._controllers: dict[str, DepthController] = {}
        self.draft_depth = draft_depth
        self._busy = threading.Lock()

    @classmethod
    def load(cls, model: str | Path | None = None, dtype: str | None = None,
             cache: CacheConfig | None = None, prefill_chunk: int | None = None,
             draft: str | Path | None = None, speculation: str = "auto",
             draft_depth: int | None = None) -> "Engine":
        """Load a store name, an HF folder or a .gguf file (None: the default model), and
        optionally a draft model for speculative decoding (same kinds of reference; without
        one, a stored model's paired draft unless ``speculation`` rules drafting models out)."""
        from backend.weights.store import ModelStore

        store = ModelStore()
        folder = store.resolve(model)
        if draft is None and speculation in ("auto", "model"):
            draft = store.paired_draft(folder)  # a stored model's own draft (`models import`)
        loaded = load_model(folder, dtype)
        tokenizer = Tokenizer.from_folder(folder)
        draft_loaded = None
        if draft is not None:
            draft_folder = store.resolve(draft)
            reason = tokenizer.vocabulary_mismatch(Tokenizer.from_folder(draft_folder))
            if reason:
                raise ModelLoadError(f"{Path(draft_folder).name} cannot draft for "
                                     f"{Path(folder).name}: {reason}")
            draft_loaded = load_model(draft_folder, dtype)
        return cls(loaded, tokenizer, Path(folder).name, cache, prefill_chunk, draft_loaded,
                   speculation, draft_depth)

    def _prefix_cache(self, config: CacheConfig) -> PrefixCache:
        disk = None
        if config.directory is not None:
            memo = Path(config.directory) / "hashes.json"
            fingerprint = _fingerprint(self.loaded, memo)
            if self.draft is not None:  # the stored states include the draft model's
                fingerprint = f"{fingerprint}-{_fingerprint(self.draft, memo)[:12]}"
            elif self.drafter is not None:  # ... or the MTP head's
                fingerprint = f"{fingerprint}-{self.drafter.kind}"
            disk = DiskStore(Path(config.directory), fingerprint, io=config.disk_io,
                             retry=config.disk_retry or RetryPolicy())
        return PrefixCache(self.caches, config.budgets, disk,
                           evaluate=lambda caches: mx.eval([c.arrays() for c in caches]),
                           capture_interval=config.capture_interval, pre_end=config.pre_end)

    # -- information ---------------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        return int(self.model.args.max_position_embeddings)

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(
            name=self.name,
            architecture=str(self.loaded.config.get("model_type")),
            dtype=str(self.loaded.dtype).replace("mlx.core.", ""),
            quantization=describe_quantization(self.loaded.config),
            context_length=self.context_length,
            parameter_bytes=self.loaded.parameter_bytes,
        )

    # -- step 1 --------------------------------------------------------------------------------
    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        if (request.messages is None) == (request.prompt_ids is None):
            raise InvalidRequestError("give exactly one of messages or prompt_ids")
        if request.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
            vocab = self.model.args.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        else:
            ids = self.tokenizer.apply_chat_template(request.messages)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) >= self.context_length:
            raise ContextLengthError(
                f"prompt is {len(ids)} tokens but the model's context is {self.context_length}")
        return ids

    # -- the prefix cache -----------------------------------------------------------------------
    def cache_stats(self) -> CacheStats:
        """Bytes, entries, hits and evictions per tier of the prefix cache."""
        return self.prefix.stats()

    def prefetch(self, messages: list | None = None, prompt_ids: list[int] | None = None,
                 cancel: threading.Event | None = None) -> int:
        """Bring the stored part of this conversation's prompt onto the device without running
        the model (so sending it next starts at once); returns how many tokens are ready.
        Stops early when ``cancel`` is set; returns 0 when a generation is running."""
        ids = self.prompt_ids(GenerateRequest(messages=messages, prompt_ids=prompt_ids,
                                              max_tokens=1))
        if not self._busy.acquire(blocking=False):
            return 0
        try:
            stop = cancel.is_set if cancel is not None else (lambda: False)
            return self.prefix.prefetch(ids, should_stop=stop)
        finally:
            self._busy.release()

    def set_cache_budgets(self, budgets: CacheBudgets) -> None:
        """New byte budgets for the prefix cache's tiers, applied at once (copies move down or
        go until each tier fits). A disk tier needs a cache directory (``CacheConfig``)."""
        with self._busy:
            self.prefix.set_budgets(budgets)

    def clear_cache(self) -> None:
        """Forget every stored prefix, on every tier (the next request prefills from scratch)."""
        with self._busy:
            self.prefix.clear()

    def close(self) -> None:
        """Write pending states to disk and release the disk tier (its writer lock)."""
        with self._busy:
            self.prefix.close()

    # -- steps 3 and 4 -------------------------------------------------------------------------
    def _prefill(self, prompt: list[int], start: int, held: list[int],
                 cancel: threading.Event | None) -> mx.array | None:
        """Feed ``prompt[start:]``; logits (vocab,) of the last token, None if cancelled.
        ``held`` tracks the ids the caches hold."""
        chunk_size = self.prefill_chunk or PREFILL_CHUNK
        for begin in range(start, len(prompt) - 1, chunk_size):
            if cancel is not None and cancel.is_set():
                return None
            self._feed(prompt[begin:min(begin + chunk_size, len(prompt) - 1)], held)
        if cancel is not None and cancel.is_set():
            return None
        logits = self._step(prompt[-1:])
        held.append(prompt[-1])
        return logits

    def _feed(self, chunk: list[int], held: list[int]) -> None:
        """Run ``chunk`` through the model into the live caches (no vocabulary projection)."""
        ids = mx.array(chunk)
        hidden = self.model.hidden(ids[None], self.target_caches)  # (1, n, hid)
        mx.eval(hidden, [c.arrays() for c in self.target_caches])
        if self.drafter is not None:
            self.drafter.observe(len(held), ids, hidden)  # an MTP head drafts from these
            self.drafter.feed(chunk)  # the drafter's caches stay in step
        held.extend(chunk)

    def _close_turn(self, messages: list, reply: str, prompt: list[int],
                    held: list[int]) -> None:
        """Feed the end of this turn and the next user turn's header, as the chat template
        writes them after ``reply`` (ChatML: ``<|im_end|>\n<|im_start|>user\n``, and the
        reply's last token, which decoding samples but never feeds): the conversation's next
        turn then starts prefilling at the user's own words. Done once the reply's text is out:
        the reply's end pays one small forward (a pass over the weights, ~70-100 ms for SmolLM2
        on a 2-core CPU) so the next turn's first token does not pay those ids' prefill.
        Skipped when the template would render the reply with other ids than the caches hold
        (a reply cut by a stop string, text that tokenizes otherwise when read back)."""
        tail = self.tokenizer.turn_end_ids(messages, reply, prompt)
        fed = held[len(prompt):]
        if tail is None or tail[:len(fed)] != fed:
            return
        close = tail[len(fed):]
        if 0 < len(close) <= MAX_TURN_END and len(held) + len(close) < self.context_length:
            if self.drafter is not None:
                self.drafter.catch_up(held)  # a draft model lags the target after decoding
            self._feed(close, held)

    def _step(self, tokens: list[int] | mx.array) -> mx.array:
        """Lazy logits (vocab,) after feeding ``tokens`` to the target's live caches."""
        ids = tokens if isinstance(tokens, mx.array) else mx.array(tokens)
        start = self.target_caches[0].offset
        hidden = self.model.hidden(ids.reshape(1, -1), self.target_caches)
        if self.drafter is not None:
            self.drafter.observe(start, ids, hidden)
        return self.model.logits(hidden[:, -1:, :])[0, -1]  # (vocab,)

    def generate(self, request: GenerateRequest,
                 cancel: threading.Event | None = None) -> Iterator[Event]:
        if not self._busy.acquire(blocking=False):
            raise InvalidRequestError("the engine is already generating")
        try:
            yield from self._generate(request, cancel)
        finally:
            self._busy.release()
        with self._busy:
            self.prefix.persist()  # 5: new states to disk, after the reply is out

    def _generate(self, request: GenerateRequest,
                  cancel: threading.Event | None) -> Iterator[Event]:
        t_start = time.perf_counter()
        prompt = self.prompt_ids(request)  # 1
        sampler = Sampler(request.sampling)
        budget = min(request.max_tokens, self.context_length - len(prompt))
        held: list[int] = []  # the ids the live caches hold, at every step
        try:
            # 2. The prefix cache never fails a turn: a fault inside it restores nothing.
            resume = self.prefix.begin(prompt)
            held.extend(prompt[:resume.cached])
            yield from self._run(request, prompt, resume, held, sampler, budget, cancel,
                                 t_start)
        except GeneratorExit:  # the caller stopped reading: the caches hold exactly ``held``
            if self.prefix.running:
                self._commit(held)
            raise
        except BaseException:
            if self.prefix.running:
                self.prefix.abort()  # a half-written cache is never reused
            raise

    def _run(self, request, prompt, resume, held, sampler, budget, cancel,
             t_start) -> Iterator[Event]:
        logits = self._prefill(prompt, resume.cached, held, cancel)  # 3
        self.prefix.attach_captures(held)
        eos = frozenset() if request.ignore_eos else self.tokenizer.eos_token_ids
        decoding = Decoding(self.model, self.target_caches, sampler, list(prompt), held, budget,
                            eos, request.logprobs,
                            observe=self.drafter.observe if self.drafter else None)
        detok = self.tokenizer.detokenizer()
        stops = StopMatcher(request.stop)
        pieces: list[str] = []
        finish = "cancelled" if logits is None else "length"
        t_first = time.perf_counter()
        if logits is not None:  # 4
            drafter = self._drafter_for(request)
            tokens = (plain_tokens(decoding, logits) if drafter is None else
                      speculative_tokens(decoding, logits, drafter, self._depth(drafter.kind)))
            for emitted in tokens:
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
                if cancel is not None and cancel.is_set():
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
            self._close_turn(request.messages, "".join(pieces), prompt, held)
        self._commit(held)  # 5
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
        )

    def _commit(self, held: list[int]) -> None:
        """Record what the live caches hold (the drafter's caches first catch up)."""
        if self.drafter is not None:
            self.drafter.catch_up(held)
        mx.eval([c.arrays() for c in self.caches])
        self.prefix.commit(held)

    # -- speculation ---------------------------------------------------------------------------
    def _drafter_for(self, request: GenerateRequest) -> Drafter | None:
        choice = request.draft if request.draft != "auto" else self.speculation
        if choice == "none":
            return None
        if choice in ("model", "mtp"):
            if self.drafter is None or self.drafter.kind != choice:
                raise InvalidRequestError(
                    "no draft model is loaded: pair one with this model (the model manager, "
                    "or arbor models import --draft) or load one with --draft"
                    if choice == "model" else
                    "no multi-token-prediction head is in use (the checkpoint ships none, or "
                    "the engine was loaded with a draft model or without speculation)")
            return self.drafter
        return PromptLookupDrafter()

    def _depth(self, kind: str) -> DepthController:
        """One controller per drafter kind, kept across requests (costs and acceptance)."""
        if kind not in self._controllers:
            self._controllers[kind] = DepthController(max_depth=MAX_DRAFT,
                                                      fixed=self.draft_depth)
        return self._controllers[kind]
