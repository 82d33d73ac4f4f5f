"""The engine: load a model and stream generations from it, over one shared prefix cache.

Scope: one loaded model (and an optional drafter), any number of requests generating at once
(``max_batch`` of them together, the rest queued), run by whichever thread steps it (the
desktop's worker thread, the terminal chat, the server's engine thread or a benchmark: one
at a time). Not in scope: Qt (the desktop wraps this), conversation storage.

Public surface (see docs/ARCHITECTURE.md):

    engine = Engine.load("SmolLM2-135M-Instruct", max_batch=8)   # name, HF folder or .gguf
    for event in engine.generate(GenerateRequest(messages=[...]), cancel=threading.Event()):
        TokenEvent(text, token_id, from_draft) ... then exactly one DoneEvent(stats)
    stream = engine.submit(request, cancel); while engine.step(): read stream.events
    engine.prefetch(messages=[...])  engine.cache_stats()  engine.clear_cache()  engine.close()
    engine.fit(request)                 # what the model would see under the request's policy

The engine is a thin orchestrator: a request becomes a ``Sequence`` (``sequence.py``, the
steps below as a coroutine that yields the forwards it needs), the ``Scheduler``
(``scheduler.py``) runs every admitted sequence's forwards together, one batched forward per
step, each sequence on its own ``Lane`` (live caches, drafter, prefix-cache slot). A reply is
the same, bit for bit, whatever else runs beside it.

A request in numbered steps:

1. Turn the request into prompt token ids (chat template or raw ids) and check it fits; under a
   context-overflow policy other than "stop", old turns are left out first (``fit``,
   ``backend.context_policy``).
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
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from backend import context_policy, kernels
from backend.api import CacheStats, DoneEvent, GenerateRequest, ModelInfo, TokenEvent
from backend.context_policy import ContextFit
from backend.errors import ContextLengthError, InvalidRequestError, ModelLoadError
from backend.memory.budgets import CacheBudgets, CacheConfig
from backend.memory.disk import DiskStore, RetryPolicy
from backend.memory.fingerprint import model_fingerprint
from backend.memory.prefix_cache import PrefixCache
from backend.models.dflash import Model as DFlashModel
from backend.models.dflash import is_dflash_folder
from backend.models.cpu_setup import has_panels, products_all_on_panels
from backend.models.state_size import state_bytes_per_token
from backend.scheduler import Scheduler, Stream
from backend.sequence import Sequence
from backend.speculation.depth import DepthController
from backend.models import gemma4_assistant
from backend.speculation.assistant import AssistantDrafter
from backend.speculation.dflash import DFlashDrafter
from backend.speculation.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from backend.speculation.mtp import mtp_drafter
from backend.speculation.profile import ProfileStore, measure_round_costs, profiled_costs
from backend.tokenizer import Tokenizer
from backend.weights.files import weight_files
from backend.weights.loading import LoadedModel, load_model
from backend.weights.quantize import describe_quantization
from backend.paths import profiles_dir

PREFILL_CHUNK = 2048
# Exact prefill (``exact_prefill=True``, ``--exact-prefill``): chunks the row-invariant kernels
# take whole (kernels.MAX_KERNEL_ROWS), so every prompt row computes alike however the prompt is
# cut (a restored prefix, another request's prefill that stored it, a batch): a reply from a
# cached prefix equals a cold start's, bit for bit, and a prompt may be fed a few rows per step
# beside other replies. The default where it costs nothing: float32 models, whose products run
# on panels (prefill 1.1-1.15x faster than 2048-token chunks through BLAS); quantized weights
# prefill 1.5-1.7x slower so (``arbor bench`` prints it by prompt length): opt-in there.
EXACT_PREFILL_CHUNK = kernels.MAX_KERNEL_ROWS
MAX_DRAFT = 8  # most draft tokens per verify round (verify blocks of up to 16 are exact)
# Prompt lookup proposes from 3-token matches until a proposal is kept, then from 2-token ones
# (``PromptLookupDrafter``). Fresh `arbor generate` processes, 128 greedy tokens, 8 pairs: two
# open prompts went from 0.98x and 0.90x plain decoding (11-21 stray drafts, few kept) to 0.97x
# (no draft at all) and 1.04x; copying a passage or a list stays at 1.75x.
LOOKUP_COLD_MIN_NGRAM = 3
SPECULATION_CHOICES = ("auto", "model", "mtp", "dflash", "lookup", "none")

Event = TokenEvent | DoneEvent


def _fingerprint(loaded: LoadedModel, memo: Path) -> str:
    folder = Path(loaded.folder)
    return model_fingerprint(folder, weight_files(folder),
                             str(loaded.dtype).replace("mlx.core.", ""),
                             _compute_path(loaded), memo_file=memo)


def _compute_path(loaded: LoadedModel) -> str:
    """How the model's numbers are computed (the disk tier never mixes two ways). Float32
    weights in panels compute other bits than row-major ones: such models say so, and states
    stored before (or with ``ARBOR_PANELS=0``) are measured again; others keep theirs."""
    if not loaded.cpu_kernels:
        return "mlx"
    return f"kernels-{kernels.numerics()}" + ("-panels" if has_panels(loaded.model) else "")


class Lane:
    """What one running sequence needs of its own: the target's live caches, the drafter (its
    caches too) and the prefix-cache slot over all of them. The engine makes lanes as
    sequences need them (at most ``max_batch``) and keeps them: an idle lane's live caches are
    the warmest resume there is."""

    def __init__(self, target_caches: list, drafter: Drafter | None, slot) -> None:
        self.target_caches = target_caches
        self.drafter = drafter
        self.slot = slot


class Engine:
    """A loaded model, its tokenizer and its prefix cache; ``generate`` streams events, and
    ``submit`` / ``step`` run several requests at once (see the module docstring)."""

    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, name: str,
                 cache: CacheConfig | None = None, prefill_chunk: int | None = None,
                 draft: LoadedModel | None = None, speculation: str = "auto",
                 draft_depth: int | None = None, max_batch: int = 1,
                 cost_profiles: bool = True) -> None:
        """``draft``: a draft model with this tokenizer's vocabulary, a Gemma 4 assistant fit
        for this model, or a DFlash block drafter for it (``load`` checks each);
        ``speculation``: the drafter requests get by default ("auto": the draft if there is
        one, else the checkpoint's multi-token-prediction head if it ships one, else prompt
        lookup; "model" (any paired draft: a draft model, an assistant, a DFlash drafter),
        "mtp", "dflash", "lookup", or "none" for plain decoding; the head's caches are kept
        only under "auto" and "mtp");
        ``draft_depth``: draft exactly this many tokens per round (None: the depth controller
        chooses, 0 .. MAX_DRAFT); ``max_batch``: most requests generating at once (the others
        wait their turn); ``cost_profiles``: seed the depth controller with round costs
        measured before the first round and stored per model, dtype and machine
        (``speculation/profile.py``; False: it learns them within the replies)."""
        if speculation not in SPECULATION_CHOICES:
            raise InvalidRequestError(f"speculation must be one of {SPECULATION_CHOICES}")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = tokenizer
        self.name = name
        self.prefill_chunk = prefill_chunk  # None: PREFILL_CHUNK
        self.cache_config = cache if cache is not None else CacheConfig.default()
        self.draft = draft
        is_assistant = draft is not None and isinstance(draft.model, gemma4_assistant.Model)
        if is_assistant:
            reason = draft.model.check_target(self.model.args)
            if reason:
                raise ModelLoadError(f"{Path(draft.folder).name} cannot draft for {name}: "
                                     f"{reason}")
        self._drafter_kind = (("assistant" if is_assistant else
                               "dflash" if isinstance(draft.model, DFlashModel) else "model")
                              if draft else
                              "mtp" if speculation in ("auto", "mtp")
                              and self.model.draft_head() is not None else None)
        if self._drafter_kind == "dflash":  # every forward keeps what the drafter reads
            self.model.model.capture(draft.model.args.target_layer_ids)
        self.target_caches = self.model.make_caches()
        first = self._new_drafter(self.target_caches)
        self.speculation = (first.kind if first else "lookup") \
            if speculation == "auto" else speculation
        # The drafter's caches are live caches too: the prefix cache stores them alongside.
        self.caches = self.target_caches + (first.caches if first else [])
        self.drafter = first
        self.prefix = self._prefix_cache(self.cache_config)
        self._controllers: dict[str, DepthController] = {}
        self.draft_depth = draft_depth
        self.profiles = ProfileStore(profiles_dir()) if cost_profiles else None
        self.lanes = [Lane(self.target_caches, first, self.prefix.slots[0])]
        self.bytes_per_token = self._bytes_per_token()
        features = (lambda: self.model.model.captured) if self._drafter_kind == "dflash" \
            else (lambda: None)
        self.scheduler = Scheduler(self.lanes, self._new_lane, max_batch, self.model.hidden,
                                   self.model.logits, self.prefix.choose_slot, features,
                                   device_budget=lambda: self.prefix.budgets.device_bytes)
        self._lock = threading.RLock()  # guards the scheduler and the prefix cache
        # MLX's streams belong to a thread: the first thread that steps runs every step.
        self._owner: threading.Thread | None = None

    def _bytes_per_token(self) -> int:
        """Live-cache bytes a token adds, target and draft model (the batch's admission)."""
        total = 0
        for loaded in (self.loaded, self.draft):
            if loaded is not None:
                total += state_bytes_per_token(loaded.config, loaded.dtype.size)
        return total

    def _new_drafter(self, target_caches: list) -> Drafter | None:
        """The drafter of a lane whose target caches are ``target_caches``."""
        if self._drafter_kind == "model":
            return ModelDrafter(self.draft.model, Path(self.draft.folder).name)
        if self._drafter_kind == "assistant":
            return AssistantDrafter(self.model, self.draft.model, target_caches,
                                    Path(self.draft.folder).name)
        if self._drafter_kind == "mtp":
            return mtp_drafter(self.model)
        if self._drafter_kind == "dflash":
            return DFlashDrafter(self.model, self.draft.model)
        return None

    def _new_lane(self) -> Lane:
        target = self.model.make_caches()
        drafter = self._new_drafter(target)
        slot = self.prefix.new_slot(target + (drafter.caches if drafter else []))
        return Lane(target, drafter, slot)

    @classmethod
    def load(cls, model: str | Path | None = None, dtype: str | None = None,
             cache: CacheConfig | None = None, prefill_chunk: int | None = None,
             draft: str | Path | None = None, speculation: str = "auto",
             draft_depth: int | None = None, max_batch: int = 1,
             exact_prefill: bool | None = None, cost_profiles: bool = True) -> "Engine":
        """Load a store name, an HF folder or a .gguf file (None: the default model), and
        optionally a draft model for speculative decoding (same kinds of reference; without
        one, a stored model's paired draft unless ``speculation`` rules drafting models out).
        ``exact_prefill``: prefill in ``EXACT_PREFILL_CHUNK``-token chunks (cached == cold);
        None: where that costs nothing, a model whose products all run on float32 panels
        (``cpu_setup.products_all_on_panels``), unless ``prefill_chunk`` is given."""
        from backend.weights.store import ModelStore, draft_mismatch

        store = ModelStore()
        folder = store.resolve(model)
        if draft is None and speculation in ("auto", "model"):
            draft = store.paired_draft(folder)  # a stored model's own draft (`models import`)
        loaded = load_model(folder, dtype)
        if isinstance(loaded.model, gemma4_assistant.Model):
            raise ModelLoadError(f"{Path(folder).name} is a Gemma 4 assistant: it drafts for "
                                 f"its target (arbor models import TARGET --draft "
                                 f"{Path(folder).name}) and cannot reply on its own")
        tokenizer = Tokenizer.from_folder(folder)
        draft_loaded = None
        if draft is not None:
            draft_folder = store.resolve(draft)
            if is_dflash_folder(draft_folder):  # a block drafter: checked against the model
                draft_loaded = load_model(draft_folder, dtype)
                reason = draft_loaded.model.check_target(loaded.model)
            else:
                reason = draft_mismatch(Path(folder), Path(draft_folder))
            if reason:
                raise ModelLoadError(f"{Path(draft_folder).name} cannot draft for "
                                     f"{Path(folder).name}: {reason}")
            draft_loaded = draft_loaded or load_model(draft_folder, dtype)
        if exact_prefill is None:  # a chunk size asked for decides
            exact_prefill = (prefill_chunk is None and loaded.cpu_kernels
                             and products_all_on_panels(loaded.model))
        if exact_prefill:
            prefill_chunk = EXACT_PREFILL_CHUNK
        return cls(loaded, tokenizer, Path(folder).name, cache, prefill_chunk, draft_loaded,
                   speculation, draft_depth, max_batch, cost_profiles)

    def _prefix_cache(self, config: CacheConfig) -> PrefixCache:
        disk = None
        if config.directory is not None:
            memo = Path(config.directory) / "hashes.json"
            fingerprint = _fingerprint(self.loaded, memo)
            if self._drafter_kind in ("model", "dflash"):  # the stored states hold the draft's
                fingerprint = f"{fingerprint}-{_fingerprint(self.draft, memo)[:12]}"
            elif self._drafter_kind == "mtp":  # ... or the MTP head's (an assistant has none)
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
    def chunk_size(self) -> int:
        """Prompt tokens per prefill forward (at most: see ``prefill_rows``)."""
        return self.prefill_chunk or PREFILL_CHUNK

    @property
    def exact_prefill(self) -> bool:
        """Whether prompts prefill in chunks the row-invariant kernels take whole (then how a
        prompt is cut changes no bit of its states)."""
        return self.loaded.cpu_kernels and self.chunk_size <= kernels.MAX_KERNEL_ROWS

    def prefill_rows(self, sequence: Sequence) -> int:
        """Prompt tokens ``sequence`` feeds next: ``chunk_size``; with exact prefill, fewer
        while others decode beside it (``Scheduler.prefill_rows_beside``), so their tokens do
        not wait behind a long prompt. Without it a prompt's cut must depend on the request
        alone, or its states (and reply) would depend on what else runs."""
        beside = self.scheduler.prefill_rows_beside(sequence) if self.exact_prefill else None
        return self.chunk_size if beside is None else min(self.chunk_size, beside)

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(
            name=self.name,
            architecture=str(self.loaded.config.get("model_type")),
            dtype=str(self.loaded.dtype).replace("mlx.core.", ""),
            quantization=describe_quantization(self.loaded.config),
            context_length=self.context_length,
            parameter_bytes=self.loaded.parameter_bytes,
            drafters=(self.drafter.kind,) if self.drafter is not None else (),
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
        elif request.continue_reply:
            ids = self._continuation_ids(request.messages)
        else:
            ids = self.tokenizer.apply_chat_template(request.messages)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) >= self.context_length:
            raise ContextLengthError(
                f"prompt is {len(ids)} tokens but the model's context is {self.context_length}")
        return ids

    def _continuation_ids(self, messages: list) -> list[int]:
        """The prompt that writes on from the last message, an assistant reply cut short: the
        conversation before it with the assistant's turn opened, then the reply's text."""
        if not messages or messages[-1].get("role") != "assistant":
            raise InvalidRequestError("continue_reply needs an assistant message last")
        opened = self.tokenizer.render_chat_template(messages[:-1], add_generation_prompt=True)
        return self.tokenizer.encode(opened + str(messages[-1].get("content") or ""))

    def fit(self, request: GenerateRequest, fresh: bool = False) -> ContextFit:
        """What the model sees of ``request``'s messages under its context-overflow policy
        (``backend.context_policy``; ``fresh``: no earlier cut is known for this conversation):
        old turns left out when the conversation outgrows the context. A continued reply and
        raw ids are taken as they are (or refused as too long)."""
        if request.messages is None or request.continue_reply:
            ids = self.prompt_ids(request)
            return ContextFit(request.messages or [], ids, 0, len(ids), self.context_length)
        if request.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {request.max_tokens}")

        def measure(message) -> int:
            content = message.get("content")
            return len(self.tokenizer.encode(content if isinstance(content, str) else "")) \
                + context_policy.MESSAGE_OVERHEAD

        return context_policy.fit_conversation(
            request.messages, request.context_overflow, self.context_length, request.max_tokens,
            self.tokenizer.apply_chat_template, measure, fresh=fresh)

    # -- the prefix cache -----------------------------------------------------------------------
    def cache_stats(self) -> CacheStats:
        """Bytes, entries, hits and evictions per tier of the prefix cache."""
        with self._lock:
            return self.prefix.stats()

    def prefetch(self, messages: list | None = None, prompt_ids: list[int] | None = None,
                 cancel: threading.Event | None = None) -> int:
        """Bring the stored part of this conversation's prompt onto the device without running
        the model (so sending it next starts at once); returns how many tokens are ready.
        Stops early when ``cancel`` is set. Other requests may be generating meanwhile."""
        ids = self.prompt_ids(GenerateRequest(messages=messages, prompt_ids=prompt_ids,
                                              max_tokens=1))
        with self._lock:
            stop = cancel.is_set if cancel is not None else (lambda: False)
            return self.prefix.prefetch(ids, should_stop=stop)

    def set_cache_budgets(self, budgets: CacheBudgets) -> None:
        """New byte budgets for the prefix cache's tiers, applied at once (copies move down or
        go until each tier fits). A disk tier needs a cache directory (``CacheConfig``)."""
        with self._lock:
            self.prefix.set_budgets(budgets)

    def clear_cache(self) -> None:
        """Forget every stored prefix, on every tier (the next request prefills from scratch)."""
        with self._lock:
            if self.scheduler.busy:
                raise InvalidRequestError("the cache cannot be cleared while generating")
            self.prefix.clear()

    def close(self) -> None:
        """End the requests still running or queued (on the stepping thread: their caches are
        recorded as they stand), write pending states to disk and release the disk tier (its
        writer lock)."""
        with self._lock:
            if self._owner in (None, threading.current_thread()) or not self._owner.is_alive():
                self.scheduler.stop_all()
            self.prefix.close()

    # -- generation ----------------------------------------------------------------------------
    def submit(self, request: GenerateRequest, cancel: threading.Event | None = None) -> Stream:
        """Queue a request (checked at once: ``InvalidRequestError``, ``ContextLengthError``);
        its events arrive in the returned ``Stream`` as ``step`` runs."""
        t_submit = time.perf_counter()
        dropped = 0
        if request.context_overflow != "stop":  # 1: old turns left out under the policy
            fit = self.fit(request)  # ("stop" is step 1's own check: no second rendering)
            if fit.dropped:
                request, dropped = replace(request, messages=fit.messages), fit.dropped
        prompt = self.prompt_ids(request)  # 1
        self._drafter_check(request)
        stream = Stream()
        sequence = Sequence(self, request, prompt, cancel, t_submit)
        sequence.dropped_messages = dropped
        with self._lock:
            self.scheduler.submit(sequence, stream)
        return stream

    def step(self) -> bool:
        """One scheduler step over every running request (see ``backend/scheduler.py``);
        whether work is left. When nothing runs any more, new states go to disk."""
        with self._lock:
            self._check_owner()
            busy = self.scheduler.step()
            if busy:
                self.prefix.enforce_budgets()
                self._read_ahead_for_the_queue()
            else:
                self.prefix.persist()
                self.prefix.drop_reads_ahead()
            return busy

    def _read_ahead_for_the_queue(self) -> None:
        """Requests waiting for a place in the batch have their stored prefixes read from disk
        meanwhile (``memory/read_ahead.py``): joining then costs no disk read."""
        for sequence, _ in self.scheduler.waiting:
            if not sequence.read_ahead:
                sequence.read_ahead = True
                self.prefix.read_ahead_for(sequence.prompt)

    def activity(self) -> tuple[int, int, int]:
        """(generating, of them still prefilling, waiting for a place in the batch)."""
        with self._lock:
            return self.scheduler.counts()

    def _check_owner(self) -> None:
        thread = threading.current_thread()
        if self._owner is None or not self._owner.is_alive():
            self._owner = thread
        elif self._owner is not thread:
            raise InvalidRequestError(
                f"the engine runs on thread {self._owner.name!r}: submit requests from any "
                f"thread, but step (and generate) on that one")

    def stop(self, stream: Stream) -> None:
        """The caller of ``stream`` left: its request ends now (what its caches hold is kept)."""
        with self._lock:
            self.scheduler.stop(stream)

    def generate(self, request: GenerateRequest,
                 cancel: threading.Event | None = None) -> Iterator[Event]:
        """One request's events: ``TokenEvent``s then one ``DoneEvent``. The caller's thread
        runs the steps (other requests submitted meanwhile advance with them)."""
        with self._lock:
            self._check_owner()
        stream = self.submit(request, cancel)
        try:
            while True:
                while stream.events:
                    yield stream.events.popleft()
                if stream.error is not None:
                    raise stream.error
                if stream.done:
                    break
                self.step()
        finally:
            if not stream.done:
                self.stop(stream)
        with self._lock:  # 5: new states to disk, after the reply is out
            if not self.scheduler.busy:
                self.prefix.persist()

    # -- speculation ---------------------------------------------------------------------------
    def _drafter_check(self, request: GenerateRequest) -> None:
        choice = request.draft if request.draft != "auto" else self.speculation
        kinds = {"model": ("model", "assistant", "dflash"), "mtp": ("mtp",),
                 "dflash": ("dflash",)}
        if choice in kinds and self._drafter_kind not in kinds[choice]:
            raise InvalidRequestError(
                "no multi-token-prediction head is in use (the checkpoint ships none, or "
                "the engine was loaded with a draft model or without speculation)"
                if choice == "mtp" else
                f"no {'DFlash block drafter' if choice == 'dflash' else 'draft model'} is "
                "loaded: pair one with this model (the model manager, or arbor models import "
                "--draft) or load one with --draft")

    def drafter_for(self, request: GenerateRequest, lane: Lane) -> Drafter | None:
        """The drafter this request drafts with on ``lane`` (None: plain decoding)."""
        choice = request.draft if request.draft != "auto" else self.speculation
        if choice == "none":
            return None
        if choice in ("model", "mtp", "assistant", "dflash"):  # "model": any paired draft
            return lane.drafter
        return PromptLookupDrafter(cold_min_ngram=LOOKUP_COLD_MIN_NGRAM)

    def prepare(self) -> None:
        """Settle now what the first drafting reply would otherwise stop to settle: the default
        drafter's round costs (``round_costs``: the stored profile, or measured once per model,
        dtype and machine, a second or two on a CPU). Loading leaves it out so that a window
        can show the model at once: the app runs this right after, and ``arbor serve`` before
        it answers."""
        drafter = self.drafter_for(GenerateRequest(), self.lanes[0])  # a request's default
        if drafter is not None:
            with self._lock:
                self.depth(drafter.kind)

    def depth(self, kind: str) -> DepthController:
        """One controller per drafter kind, kept across requests (costs and acceptance),
        knowing the round costs from the first round on where they can be measured."""
        if kind not in self._controllers:
            # A block drafter proposes up to a block in one forward: its depths go further.
            most = self.lanes[0].drafter.max_drafts if kind == "dflash" else MAX_DRAFT
            controller = DepthController(max_depth=most, fixed=self.draft_depth)
            costs = self.round_costs(kind) if self.draft_depth is None else None
            if costs:
                controller.seed(costs)
            self._controllers[kind] = controller
        return self._controllers[kind]

    def round_costs(self, kind: str) -> dict[int, float] | None:
        """Seconds per round by depth for drafter ``kind`` before any round ran: the target's
        (``speculation/profile.py``, stored per model, dtype and machine), plus, for a draft
        model, a draft step per draft; None for drafters whose drafting is not measured
        beforehand (they learn it within the replies) or with ``cost_profiles`` off."""
        if self.profiles is None or kind not in ("lookup", "model"):
            return None
        costs = self._profiled(self.loaded, self.scheduler.answer, MAX_DRAFT)
        if kind == "model":
            draft = self.draft
            answer = _model_answer(draft.model)
            step = self._profiled(draft, answer, 0)[0]
            costs = {depth: seconds + depth * step for depth, seconds in costs.items()}
        return costs

    def _hash_memo(self) -> Path:
        """Where weight digests are remembered: the disk tier's memo when there is one (its
        fingerprint hashed the same files already), else beside the profiles."""
        directory = self.cache_config.directory
        return Path(directory if directory is not None else self.profiles.directory) \
            / "hashes.json"

    def _profiled(self, loaded: LoadedModel, answer, max_depth: int) -> dict[int, float]:
        dtype = str(loaded.dtype).replace("mlx.core.", "")
        name = f"{Path(loaded.folder).name}-{dtype}-{'kernels' if loaded.cpu_kernels else 'mlx'}"
        return profiled_costs(
            self.profiles, name,
            lambda: _fingerprint(loaded, self._hash_memo()),
            lambda: measure_round_costs(answer, loaded.model.make_caches,
                                        int(loaded.model.args.vocab_size), max_depth))


def _model_answer(model):
    """Feeds answered by running ``model`` alone (a draft model's steps, for its profile)."""
    def answer(feeds):
        answers = []
        for feed in feeds:
            hidden = model.hidden(feed.tokens[None], feed.caches)
            rows = {"none": None, "last": hidden[:, -1:, :], "all": hidden}[feed.logits]
            answers.append((hidden, None if rows is None else model.logits(rows)[0]))
        return answers
    return answer
