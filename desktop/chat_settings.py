"""Per-chat settings: the system prompt, the sampling knobs, speculative decoding and what to do
when the chat outgrows the model's context, with app-wide defaults.

A conversation stores only the values the user changed (``ChatSettings.to_overrides``); the
effective settings are the app defaults updated with those overrides, so changing a default later
reaches every chat that never touched that knob.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from backend.api import SamplingParams
from backend.context_policy import DEFAULT_POLICY, POLICIES

#: (minimum, maximum) of each numeric knob, used by the settings dialog and by ``validated``.
LIMITS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "top_k": (0, 1000),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.5, 2.0),
    "max_tokens": (1, 32768),
}

#: Speculative decoding per chat, as ``GenerateRequest.draft`` takes it, with the words the
#: settings dialog shows. "auto" is the model's own default: its paired draft (a draft model
#: or a DFlash block drafter), else the checkpoint's MTP head, else prompt lookup. Drafting
#: never changes the reply, only how fast it comes.
SPECULATION_CHOICES: dict[str, str] = {
    "auto": "Automatic (the model's paired draft or MTP head, else prompt lookup)",
    "model": "Paired draft (a draft model, a Gemma 4 assistant or a DFlash drafter)",
    "mtp": "Multi-token prediction (the checkpoint's own head)",
    "lookup": "Prompt lookup",
    "none": "Off",
}

#: What a chat does when it outgrows the model's context (``backend.context_policy``).
CONTEXT_CHOICES: dict[str, str] = POLICIES


@dataclass(frozen=True)
class ChatSettings:
    """What shapes one chat's replies. ``seed=None`` means a fresh random seed per reply;
    ``speculation`` is one of ``SPECULATION_CHOICES``, ``context_overflow`` one of
    ``CONTEXT_CHOICES``."""

    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    max_tokens: int = 1024
    seed: int | None = None
    speculation: str = "auto"
    context_overflow: str = DEFAULT_POLICY

    def sampling(self) -> SamplingParams:
        """The engine's ``SamplingParams`` for these settings."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
        )

    def validated(self) -> "ChatSettings":
        """A copy with every numeric knob clamped into ``LIMITS`` and an unknown speculation
        choice back to "auto" (imported files may hold anything)."""
        changes: dict[str, Any] = {}
        if self.speculation not in SPECULATION_CHOICES:
            changes["speculation"] = "auto"
        if self.context_overflow not in CONTEXT_CHOICES:
            changes["context_overflow"] = DEFAULT_POLICY
        for name, (low, high) in LIMITS.items():
            value = getattr(self, name)
            kind = int if isinstance(low, int) and isinstance(high, int) else float
            clamped = kind(min(max(value, low), high))
            if clamped != value:
                changes[name] = clamped
        return replace(self, **changes) if changes else self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_overrides(self, defaults: "ChatSettings") -> dict[str, Any]:
        """Only the values that differ from ``defaults`` (what a conversation stores)."""
        mine, theirs = asdict(self), asdict(defaults)
        return {key: value for key, value in mine.items() if theirs[key] != value}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, base: "ChatSettings | None" = None) -> "ChatSettings":
        """``base`` (default: the built-in defaults) updated with the known keys of ``data``;
        unknown keys and values of the wrong type are ignored."""
        result = base or cls()
        if not data:
            return result
        known = {f.name: f for f in fields(cls)}
        changes: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                continue
            if key == "system_prompt" and isinstance(value, str):
                changes[key] = value
            elif key == "speculation" and isinstance(value, str) and value in SPECULATION_CHOICES:
                changes[key] = value
            elif key == "context_overflow" and isinstance(value, str) and value in CONTEXT_CHOICES:
                changes[key] = value
            elif key == "seed" and (value is None or (isinstance(value, int) and not isinstance(value, bool))):
                changes[key] = value
            elif key in ("top_k", "max_tokens") and isinstance(value, int) and not isinstance(value, bool):
                changes[key] = value
            elif key in ("temperature", "top_p", "min_p", "repetition_penalty") and isinstance(
                value, (int, float)
            ) and not isinstance(value, bool):
                changes[key] = float(value)
        return replace(result, **changes).validated()
