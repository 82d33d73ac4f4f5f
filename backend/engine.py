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
5. Record what the caches now hold in the prefix cache, emit ``DoneEvent`` with the statistics,
   then (once the caller asks for more) write new states to the disk tier.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from backend.api import CacheStats, DoneEvent, GenerateRequest, ModelInfo, TokenEvent
from backend.errors import ContextLengthError, InvalidRequestError
from backend.memory.budgets import CacheBudgets, CacheConfig
from backend.memory.disk import DiskStore
from backend.memory.fingerprint import model_fingerprint
from backend.memory.prefix_cache import PrefixCache
from backend.models.files import weight_files
from backend.models.loading import LoadedModel, load_model
from backend.models.quantize import describe_quantization
from backend.sampling import Sampler
from backend.tokenizer import StopMatcher, Tokenizer

PREFILL_CHUNK = 2048

Event = TokenEvent | DoneEvent


class Engine:
    """A loaded model, its tokenizer and its prefix cache; ``generate`` streams events (see
    the module docstring)."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, name: str,
                 cache: CacheConfig | None = None, prefill_chunk: int | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = tokenizer
        self.name = name
        self.prefill_chunk = prefill_chunk  # None: PREFILL_CHUNK
        self.cache_config = cache if cache is not None else CacheConfig.default()
        self.caches = self.model.make_caches()
        self.prefix = self._prefix_cache(self.cache_config)
        self._busy = threading.Lock()

    @classmethod
    def load(cls, model: str | Path | None = None, dtype: str | None = None,
             cache: CacheConfig | None = None, prefill_chunk: int | None = None) -> "Engine":
        """Load a store name, an HF folder or a .gguf file (None: the default model)."""
        from backend.models.store import ModelStore

        folder = ModelStore().resolve(model)
        loaded = load_model(folder, dtype)
        return cls(loaded, Tokenizer.from_folder(folder), Path(folder).name, cache,
                   prefill_chunk)

    def _prefix_cache(self, config: CacheConfig) -> PrefixCache:
        disk = None
        if config.directory is not None:
            folder = Path(self.loaded.folder)
            fingerprint = model_fingerprint(
                folder, weight_files(folder), str(self.loaded.dtype).replace("mlx.core.", ""),
                "kernels" if self.loaded.cpu_kernels else "mlx",
                memo_file=Path(config.directory) / "hashes.json")
            disk = DiskStore(Path(config.directory), fingerprint)
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
            chunk = prompt[begin:min(begin + chunk_size, len(prompt) - 1)]
            hidden = self.model.hidden(mx.array(chunk)[None], self.caches)  # (1, n, hidden)
            mx.eval(hidden, [c.arrays() for c in self.caches])
            held.extend(chunk)
        if cancel is not None and cancel.is_set():
            return None
        logits = self._step(prompt[-1:])
        held.append(prompt[-1])
        return logits

    def _step(self, tokens: list[int] | mx.array) -> mx.array:
        """Lazy logits (vocab,) after feeding ``tokens`` to the live caches."""
        ids = tokens if isinstance(tokens, mx.array) else mx.array(tokens)
        hidden = self.model.hidden(ids.reshape(1, -1), self.caches)
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
        resume = self.prefix.begin(prompt)  # 2
        held = list(prompt[:resume.cached])  # the ids the live caches hold, at every step
        try:
            yield from self._run(request, prompt, resume, held, sampler, budget, cancel,
                                 t_start)
        except GeneratorExit:  # the caller stopped reading: the caches hold exactly ``held``
            if self.prefix.running:
                self.prefix.commit(held)
            raise
        except BaseException:
            if self.prefix.running:
                self.prefix.abort()  # a half-written cache is never reused
            raise

    def _run(self, request, prompt, resume, held, sampler, budget, cancel,
             t_start) -> Iterator[Event]:
        logits = self._prefill(prompt, resume.cached, held, cancel)  # 3
        self.prefix.attach_captures(held)
        generated: list[int] = []
        detok = self.tokenizer.detokenizer()
        stops = StopMatcher(request.stop)
        pieces: list[str] = []
        finish = "cancelled" if logits is None else "length"
        t_first = time.perf_counter()
        params = request.sampling
        uses_history = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                        or params.frequency_penalty != 0.0)

        def history() -> mx.array | None:
            if not uses_history:
                return None
            return mx.array((prompt + generated)[-params.penalty_window:], dtype=mx.int32)

        def sample(logits: mx.array) -> tuple[mx.array, mx.array | None]:
            token = sampler.distribution(logits, history()).sample()
            logprob = None
            if request.logprobs:  # log-softmax of the model's own logits at the sampled token
                logprob = logits[token] - mx.logsumexp(logits)
            mx.async_eval(token if logprob is None else [token, logprob])
            return token, logprob

        if logits is not None:  # 4
            token, logprob = sample(logits)
            while True:
                # Queue the next step before waiting on this token so the device never idles;
                # when this token turns out to be the last, that one step is wasted work.
                ahead = None
                if len(generated) + 1 < budget:
                    ahead = self._step(token.reshape(1))
                token_id = int(token.item())
                if not generated:
                    t_first = time.perf_counter()
                if ahead is not None:
                    held.append(token_id)
                generated.append(token_id)
                if token_id in self.tokenizer.eos_token_ids and not request.ignore_eos:
                    finish = "stop"
                    break
                text, stopped = stops.feed(detok.add(token_id))
                pieces.append(text)
                yield TokenEvent(text, token_id,
                                 logprob=None if logprob is None else float(logprob.item()))
                if stopped:
                    finish = "stop"
                    break
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
                if ahead is None:
                    break
                token, logprob = sample(ahead)
            if not stops.stopped:  # release text held back for a stop string or a partial char
                tail, stopped = stops.feed(detok.finalize())
                tail += "" if stopped else stops.flush()
                if tail:
                    pieces.append(tail)
                    yield TokenEvent(tail, -1)
        mx.eval([c.arrays() for c in self.caches])
        self.prefix.commit(held)  # 5
        t_end = time.perf_counter()
        n_new = len(prompt) - resume.cached
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
            cached_by_tier=dict(resume.by_tier),
            restore_s=resume.restore_s,
        )
