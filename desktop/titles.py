"""Automatic conversation titles.

A chat is titled by the user's first message (``heuristic_title``, cut to whole words) the
moment it is sent. Only when the user opts in (the Chat menu's "Let the model title new chats")
does the controller, after the first reply, queue a short, low-priority generation
(``title_request``) behind it, cancelled if the user sends again first; its answer replaces the
first-message title only if ``clean_title`` accepts it, and never a title the user typed.
"""

from __future__ import annotations

import re

from backend.api import GenerateRequest, SamplingParams
from desktop.reasoning import split_reasoning

MAX_TITLE_CHARS = 48
TITLE_MAX_TOKENS = 16

_INSTRUCTION = (
    "Write a short title (at most six words) for the conversation below. "
    "Answer with the title only, no quotes.\n\n"
)


def heuristic_title(first_message: str) -> str:
    """The first line of the user's first message, trimmed to whole words."""
    line = next((ln.strip() for ln in first_message.splitlines() if ln.strip()), "")
    line = re.sub(r"\s+", " ", line).strip(" #>*`-")
    if len(line) <= MAX_TITLE_CHARS:
        return line
    cut = line[:MAX_TITLE_CHARS].rsplit(" ", 1)[0]
    return (cut or line[:MAX_TITLE_CHARS]).rstrip(",.;:") + "…"


def title_request(user_text: str, reply_text: str) -> GenerateRequest:
    """A greedy, short generation asking the model for a title of the first exchange."""
    _, answer = split_reasoning(reply_text)
    excerpt = f"User: {user_text[:600]}\nAssistant: {answer[:600]}"
    return GenerateRequest(
        messages=[{"role": "user", "content": _INSTRUCTION + excerpt}],
        max_tokens=TITLE_MAX_TOKENS,
        sampling=SamplingParams(temperature=0.0),
    )


def clean_title(text: str) -> str | None:
    """A model's answer as a title, or None when it does not look like one (empty, control or
    replacement characters, mostly punctuation)."""
    _, text = split_reasoning(text)
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = re.sub(r"^(title\s*:\s*)", "", line, flags=re.IGNORECASE)
    line = line.strip(" \"'`*#.")
    if not line or any(ord(ch) < 32 or ch == "\ufffd" for ch in line):
        return None
    letters = sum(ch.isalnum() for ch in line)
    if letters < max(2, len(line) // 2):
        return None
    if len(line) > MAX_TITLE_CHARS:
        line = line[:MAX_TITLE_CHARS].rsplit(" ", 1)[0] + "…"
    return line
