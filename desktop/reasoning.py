"""Reasoning blocks of models that think out loud (``<think> ... </think>`` before the answer).

The chat view shows the reasoning collapsed above the answer, Markdown export leaves it out and
the prompt for the next turn drops it (as the thinking models' own chat templates do).
"""

from __future__ import annotations

OPEN_TAGS = ("<think>", "<thinking>", "<reasoning>")
_CLOSE_FOR = {"<think>": "</think>", "<thinking>": "</thinking>", "<reasoning>": "</reasoning>"}


def split_reasoning(text: str) -> tuple[str, str]:
    """``(reasoning, answer)`` of a reply. A reply that opens a reasoning tag but has not closed
    it yet (still streaming) is all reasoning; a reply without one is all answer."""
    stripped = text.lstrip()
    for tag in OPEN_TAGS:
        if stripped.startswith(tag):
            body = stripped[len(tag):]
            close = _CLOSE_FOR[tag]
            end = body.find(close)
            if end < 0:
                return body.strip(), ""
            return body[:end].strip(), body[end + len(close):].lstrip()
    return "", text


def is_reasoning_open(text: str) -> bool:
    """True while a reply is inside an unclosed reasoning block."""
    stripped = text.lstrip()
    return any(stripped.startswith(tag) and _CLOSE_FOR[tag] not in stripped for tag in OPEN_TAGS)
