"""The plain-data half of the engine's public surface (no MLX import).

The desktop worker, the terminal chat, the local server and the benchmarks all talk to the
engine with these dataclasses, so code on the Qt side can build requests and read events without
importing MLX. ``backend.engine.Engine.generate(request, cancel)`` yields ``TokenEvent`` for every
token and exactly one ``DoneEvent`` last.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}
FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into the next token. ``temperature == 0`` means greedy (argmax).

    top_k = 0, top_p = 1.0 and min_p = 0.0 disable those filters; penalties of 1.0 (repetition)
    or 0.0 (presence, frequency) are off. Penalties look at the last ``penalty_window`` tokens of
    prompt + output. ``seed`` makes sampling reproducible.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_window: int = 64
    seed: int | None = None


@dataclass(frozen=True)
class GenerateRequest:
    """One generation. Give either ``messages`` (rendered with the model's chat template) or
    ``prompt_ids`` (fed as-is, no template). ``max_tokens`` counts generated tokens.
    ``ignore_eos`` keeps generating past end-of-sequence tokens (benchmarks)."""

    messages: list[Message] | None = None
    prompt_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # report each sampled token's log-probability under the model
    # Speculative decoding: "auto" (the engine's default drafter), "model" (the loaded draft:
    # a draft model, a Gemma 4 assistant or a DFlash block drafter), "mtp" (the checkpoint's
    # multi-token-prediction head), "dflash" (the loaded DFlash block drafter), "lookup"
    # (prompt n-grams) or "none". The reply is the model's own either way.
    draft: Literal["auto", "model", "mtp", "dflash", "lookup", "none"] = "auto"
    # What to do when ``messages`` do not fit the context (``backend.context_policy``): "stop"
    # refuses with ContextLengthError; "drop_old_turns", "rolling_window" and
    # "truncate_middle" leave old turns out (``DoneEvent.dropped_messages`` says how many).
    context_overflow: Literal["stop", "drop_old_turns", "rolling_window",
                              "truncate_middle"] = "stop"
    # The last message is an assistant reply that stopped early (max tokens, or stopped by
    # the user): write on from its end instead of starting a new turn.
    continue_reply: bool = False


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. ``text`` is the newly printable text (may be empty while a multi-byte
    character is incomplete, or while text that may start a stop string is held back)."""

    text: str
    token_id: int
    from_draft: bool = False
    logprob: float | None = None  # log p(token) under the model's logits, when asked for


@dataclass(frozen=True)
class DoneEvent:
    """The last event of every generation, with its statistics."""

    text: str  # the whole reply, stop string excluded
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_s: float  # request start -> first token available
    prefill_tps: float
    decode_tps: float
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafter: str = ""  # "lookup", "model", "assistant", "mtp", "dflash" or "" (plain)
    acceptance_by_position: tuple[float, ...] = ()  # of draft position j, when reached
    mean_accepted: float = 0.0  # accepted drafts per verify round
    draft_rounds: int = 0  # verify rounds (plain decoding steps not counted)
    # Where the cached prompt tokens came from: "live" (already in the live caches), "device",
    # "host", "disk" (the prefix cache's tiers; a state a prefetch brought to the device counts
    # as the tier the prefetch read it from); the values sum to ``cached_tokens``. And how long
    # restoring them took.
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    restore_s: float = 0.0
    dropped_messages: int = 0  # old messages the context-overflow policy left out


def collect_reply(events: Iterable[TokenEvent | DoneEvent]) -> tuple[list[int], DoneEvent | None]:
    """The token ids one generation's ``events`` streamed (``token_id >= 0``) and its
    ``DoneEvent`` (None if it sent none)."""
    ids, done = [], None
    for event in events:
        if isinstance(event, DoneEvent):
            done = event
        elif isinstance(event, TokenEvent) and event.token_id >= 0:
            ids.append(event.token_id)
    return ids, done


@dataclass(frozen=True)
class TierStats:
    """One tier of the prefix cache: bytes held and allowed, stored nodes, prompt tokens served
    from it, and copies moved out of it (to a lower tier or dropped) to stay within budget."""

    bytes: int
    budget: int
    entries: int
    hits: int
    evictions: int


@dataclass(frozen=True)
class CacheStats:
    """``Engine.cache_stats()``: the prefix cache's tiers ("device", "host", "disk")."""

    tiers: dict[str, TierStats]
    nodes: int
    live_tokens: int  # token ids the live caches hold
    live_hits: int  # prompt tokens reused from the live caches without any restore
    disk_read_only: bool = False  # the disk tier serves reads but stores nothing new
    # The disk tier's state: "on" (reads and writes), "read-only" (another process holds its
    # writer lock, or writes failed: a full disk, a read-only mount; retried with back-off),
    # "off" (unusable: no directory configured, or it cannot be opened at all); and one line
    # saying why it is not "on" ("" when it is).
    disk_mode: Literal["on", "read-only", "off"] = "on"
    disk_note: str = ""


@dataclass(frozen=True)
class ModelInfo:
    """What the UI shows about a loaded model."""

    name: str
    architecture: str  # config model_type, e.g. "llama"
    dtype: str  # compute dtype, e.g. "float32"
    quantization: str | None  # e.g. "4-bit g32" or None
    context_length: int
    parameter_bytes: int
    # Drafters beyond prompt lookup that requests can ask for: "model" (a paired draft model is
    # loaded), "mtp" (the checkpoint's multi-token-prediction head is in use).
    drafters: tuple[str, ...] = ()
