"""The engine: load a model and stream generations from it.

Scope: one loaded model (and later an optional drafter), one generation at a time, called from
one thread (the desktop's worker thread, the terminal chat, the server or a benchmark).
Not in scope: Qt (the desktop wraps this), conversation storage, multi-request batching.

Public surface (see docs/ARCHITECTURE.md):

    engine = Engine.load("SmolLM2-135M-Instruct")          # store name, HF folder or .gguf
    for event in engine.generate(GenerateRequest(messages=[...]), cancel=threading.Event()):
        TokenEvent(text, token_id, from_draft) ... then exactly one DoneEvent(stats)

``generate`` in numbered steps:

1. Turn the request into prompt token ids (chat template or raw ids) and check it fits.
2. Reuse the live caches' common prefix with the previous request (rewind to it).
3. Prefill the rest in chunks (``PREFILL_CHUNK`` tokens), checking ``cancel`` between chunks;
   only the last position goes through the vocabulary projection.
4. Decode: sample token t while the device already computes t+1 (``mx.async_eval`` one step
   ahead), stream text through the detokenizer and stop-string matcher, check ``cancel``.
5. Emit ``DoneEvent`` with the statistics; remember which tokens the caches now hold.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from backend.api import DoneEvent, GenerateRequest, ModelInfo, TokenEvent
from backend.caches.base import Cache
from backend.errors import ContextLengthError, InvalidRequestError
from backend.models.loading import LoadedModel, load_model
from backend.models.quantize import describe_quantization
from backend.sampling import Sampler
from backend.tokenizer import StopMatcher, Tokenizer

PREFILL_CHUNK = 2048

Event = TokenEvent | DoneEvent


@dataclass
class _LiveState:
    """The live caches and exactly which token ids they hold (prefix reuse across requests)."""

    caches: list[Cache]
    tokens: list[int] = field(default_factory=list)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Engine:
    """A loaded model plus its tokenizer; ``generate`` streams events (see module docstring)."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, name: str):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = tokenizer
        self.name = name
        self._live = _LiveState(self.model.make_caches())
        self._busy = threading.Lock()

    @classmethod
    def load(cls, model: str | Path | None = None, dtype: str | None = None) -> "Engine":
        """Load a store name, an HF folder or a .gguf file (None: the default model)."""
        from backend.models.store import ModelStore

        folder = ModelStore().resolve(model)
        loaded = load_model(folder, dtype)
        return cls(loaded, Tokenizer.from_folder(folder), Path(folder).name)

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

    # -- step 2 --------------------------------------------------------------------------------
    def _reuse_prefix(self, prompt: list[int]) -> int:
        """Rewind the live caches to the longest prefix they share with ``prompt``."""
        live = self._live
        keep = common_prefix_length(live.tokens, prompt)
        keep = min(keep, len(prompt) - 1)  # the last prompt token must run to give logits
        if keep < len(live.tokens):
            if not all(c.restore(None, keep) for c in live.caches):
                self._reset()
                return 0
            del live.tokens[keep:]
        return keep

    def clear_cache(self) -> None:
        """Forget every cached token (the next request prefills from scratch)."""
        self._reset()

    def _reset(self) -> None:
        for cache in self._live.caches:
            cache.free()
        self._live = _LiveState(self.model.make_caches())

    # -- steps 3 and 4 -------------------------------------------------------------------------
    def _prefill(self, tokens: list[int], cancel: threading.Event | None) -> mx.array | None:
        """Feed ``tokens`` through the model; logits (vocab,) of the last one, None if cancelled."""
        caches = self._live.caches
        for start in range(0, len(tokens) - 1, PREFILL_CHUNK):
            if cancel is not None and cancel.is_set():
                return None
            chunk = tokens[start:min(start + PREFILL_CHUNK, len(tokens) - 1)]
            hidden = self.model.hidden(mx.array(chunk)[None], caches)  # (1, n, hidden)
            mx.eval(hidden, [c.arrays() for c in caches])
            self._live.tokens.extend(chunk)
        if cancel is not None and cancel.is_set():
            return None
        return self._step(tokens[-1:])

    def _step(self, tokens: list[int] | mx.array) -> mx.array:
        """Lazy logits (vocab,) after feeding ``tokens``; records them as held by the caches."""
        ids = tokens if isinstance(tokens, mx.array) else mx.array(tokens)
        hidden = self.model.hidden(ids.reshape(1, -1), self._live.caches)
        return self.model.logits(hidden[:, -1:, :])[0, -1]  # (vocab,)

    def generate(self, request: GenerateRequest,
                 cancel: threading.Event | None = None) -> Iterator[Event]:
        if not self._busy.acquire(blocking=False):
            raise InvalidRequestError("the engine is already generating")
        try:
            yield from self._generate(request, cancel)
        finally:
            self._busy.release()

    def _generate(self, request: GenerateRequest,
                  cancel: threading.Event | None) -> Iterator[Event]:
        t_start = time.perf_counter()
        prompt = self.prompt_ids(request)  # 1
        sampler = Sampler(request.sampling)
        budget = min(request.max_tokens, self.context_length - len(prompt))
        cached = self._reuse_prefix(prompt)  # 2
        try:
            logits = self._prefill(prompt[cached:], cancel)  # 3
        except BaseException:
            self._reset()  # a half-written cache must not be reused
            raise
        self._live.tokens = list(prompt) if logits is not None else self._live.tokens
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

        if logits is not None:  # 4
            token = sampler.distribution(logits, history()).sample()
            mx.async_eval(token)
            while True:
                # Queue the next step before waiting on this token so the device never idles;
                # when this token turns out to be the last, that one step is wasted work.
                ahead = None
                if len(generated) + 1 < budget:
                    ahead_logits = self._step(token.reshape(1))
                    ahead = ahead_logits
                token_id = int(token.item())
                if not generated:
                    t_first = time.perf_counter()
                if ahead is not None:
                    self._live.tokens.append(token_id)
                generated.append(token_id)
                if token_id in self.tokenizer.eos_token_ids and not request.ignore_eos:
                    finish = "stop"
                    break
                text, stopped = stops.feed(detok.add(token_id))
                pieces.append(text)
                yield TokenEvent(text, token_id)
                if stopped:
                    finish = "stop"
                    break
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
                if ahead is None:
                    break
                token = sampler.distribution(ahead, history()).sample()
                mx.async_eval(token)
            if not stops.stopped:  # release text held back for a stop string or a partial char
                tail, stopped = stops.feed(detok.finalize())
                tail += "" if stopped else stops.flush()
                if tail:
                    pieces.append(tail)
                    yield TokenEvent(tail, -1)
        t_end = time.perf_counter()
        n_new = len(prompt) - cached
        decode_time = t_end - t_first
        yield DoneEvent(
            text="".join(pieces),
            token_ids=generated,
            finish_reason=finish,
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            generated_tokens=len(generated),
            ttft_s=(t_first - t_start) if generated else 0.0,
            # The first token is only known once the last prefill chunk ran: TTFT bounds prefill.
            prefill_tps=n_new / max(t_first - t_start, 1e-9) if generated else 0.0,
            decode_tps=(len(generated) - 1) / decode_time if len(generated) > 1 else 0.0,
        )
