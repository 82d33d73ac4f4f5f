"""What the model sees when a conversation outgrows its context: the overflow policies.

Plain Python (no MLX): the engine applies a request's policy (``GenerateRequest.context_overflow``),
the desktop stores one per chat and the server applies one only when a request names it (OpenAI
clients expect a 400 for a prompt that is too long).

Policies, keyed as requests name them:

``stop``             refuse with ``ContextLengthError`` (the server's and the raw API's default).
``drop_old_turns``   the app's default: keep the system prompt, leave out the oldest whole turns
                     in large steps. When the kept turns no longer fit, the cut moves forward
                     until they fill at most half the room, so the kept start then stays the
                     same for many turns and the prefix cache keeps serving it.
``rolling_window``   keep the system prompt and as many of the newest turns as fit. Each new
                     turn pushes the oldest one out, so every turn re-reads the whole kept
                     history (no prefix reuse once the window slides).
``truncate_middle``  keep the system prompt and the first exchange, then the newest turns that
                     fit; like the rolling window, every turn re-reads what follows the first
                     exchange.

A *turn* starts at a user message and runs to the next one; turns are left out whole, so the
model never sees a reply without its question. The room for the prompt is the context minus
``reply_room`` (what the reply may still need).

Why the cut replays the conversation: a client that sends the whole history every turn (the
server's) needs the cut of ``drop_old_turns`` to be a function of the messages alone, yet move
only when the room runs out. It is computed by walking the conversation's turns in order, as if
it had been carried on turn by turn: each time the turns since the cut overflow, the cut moves
to the first turn that leaves them within half the room. A conversation that grows by a turn
then keeps its cut unless that turn overflows the room. A client that remembers where the last
cut was (the desktop, per chat) sends only the turns from there; the walk then overflows at most
at the newest turn, and the cut leaves half the room free. For a conversation no cut is known
for yet (a long chat just imported), ``fresh=True`` skips the walk and leaves half the room free
at once, so the next turns do not drop again soon. The walk uses per-message token estimates
(``measure``); the chosen prompt is then rendered exactly, and the cut moves on by whole turns
in the rare case the estimates were short.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from backend.api import Message
from backend.errors import ContextLengthError, InvalidRequestError

#: The policies with the words the app shows for them.
POLICIES: dict[str, str] = {
    "drop_old_turns": "Drop old turns in large steps (keeps replies fast)",
    "rolling_window": "Rolling window (drops one old turn per new turn)",
    "truncate_middle": "Truncate the middle (keeps the first exchange)",
    "stop": "Stop at the limit",
}
DEFAULT_POLICY = "drop_old_turns"  # the app's; requests default to "stop"

#: Template tokens a message costs beyond its content, at most, in the estimates (ChatML writes
#: 5: ``<|im_start|>``, the role, a newline, ``<|im_end|>``, a newline).
MESSAGE_OVERHEAD = 8

Render = Callable[[list[Message]], list[int]]  # messages -> prompt ids (with the generation prompt)
Measure = Callable[[Message], int]  # one message -> an estimate of its tokens in the prompt


def reply_room(context_length: int, max_tokens: int) -> int:
    """Tokens kept free for the reply when a policy trims a conversation: the reply's limit, at
    most a quarter of the context (a chat allowing long replies still keeps most of its
    history)."""
    return max(1, min(max_tokens, context_length // 4))


@dataclass(frozen=True)
class ContextFit:
    """What a policy made of a conversation: the ``messages`` the model sees and their
    ``prompt_ids``; ``dropped`` messages were left out of ``total_tokens`` (the whole
    conversation's prompt)."""

    messages: list[Message]
    prompt_ids: list[int]
    dropped: int
    total_tokens: int
    context_length: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def fit_conversation(messages: Sequence[Message], policy: str, context_length: int,
                     max_tokens: int, render: Render, measure: Measure, *,
                     fresh: bool = False) -> ContextFit:
    """The part of ``messages`` the model sees under ``policy`` (see the module docstring;
    ``fresh``: no earlier cut is known, ``drop_old_turns`` leaves half the room free now).

    Raises ``InvalidRequestError`` for an unknown policy, ``ContextLengthError`` when the
    conversation does not fit under ``stop``, or when even the system prompt and the last turn
    leave no room for a reply."""
    if policy not in POLICIES:
        raise InvalidRequestError(f"context_overflow must be one of {tuple(POLICIES)}, got {policy!r}")
    messages = list(messages)
    ids = render(messages)
    if policy == "stop":
        if len(ids) >= context_length:
            raise ContextLengthError(
                f"prompt is {len(ids)} tokens but the model's context is {context_length}")
        return ContextFit(messages, ids, 0, len(ids), context_length)
    room = context_length - reply_room(context_length, max_tokens)
    if len(ids) <= room:
        return ContextFit(messages, ids, 0, len(ids), context_length)

    head = 0  # the system prompt(s) at the start are always kept
    while head < len(messages) and messages[head].get("role") == "system":
        head += 1
    system, rest = messages[:head], messages[head:]
    starts = _turn_starts(rest)
    sizes = [0]
    for message in rest:
        sizes.append(sizes[-1] + measure(message))
    fixed = sum(measure(m) for m in system) + MESSAGE_OVERHEAD  # + the generation prompt
    keep_first = policy == "truncate_middle" and len(starts) > 2
    first = sizes[starts[1]] if keep_first else 0

    def estimate(cut: int, end: int) -> int:
        return fixed + first + sizes[end] - sizes[starts[cut]]

    lowest = 1 if keep_first else 0
    if policy == "drop_old_turns" and fresh:
        cut = 0
        while cut < len(starts) - 1 and estimate(cut, len(rest)) > room // 2:
            cut += 1
    elif policy == "drop_old_turns":
        cut = _replayed_cut(starts, len(rest), room, estimate)
    else:
        cut = lowest
        while cut < len(starts) - 1 and estimate(cut, len(rest)) > room:
            cut += 1
    cut = max(cut, lowest)
    while True:
        kept = system + (rest[:starts[1]] if keep_first else []) + rest[starts[cut]:]
        kept_ids = render(kept)
        if len(kept_ids) <= room:
            return ContextFit(kept, kept_ids, len(messages) - len(kept), len(ids), context_length)
        if cut < len(starts) - 1:
            cut += 1
        elif keep_first:  # the first exchange and the last turn alone are too long: drop it too
            keep_first, first = False, 0
        else:
            raise ContextLengthError(
                f"the last message is too long: the system prompt and it take {len(kept_ids)} "
                f"tokens, the model's context is {context_length} "
                f"({context_length - room} kept for the reply)")


def _turn_starts(rest: list[Message]) -> list[int]:
    """Where each turn begins: at every user message (what precedes the first one, such as a
    greeting, belongs to the first turn)."""
    starts = [0]
    starts += [i for i, m in enumerate(rest) if m.get("role") == "user" and i > 0]
    return starts


def _replayed_cut(starts: list[int], end: int, room: int,
                  estimate: Callable[[int, int], int]) -> int:
    """``drop_old_turns``' cut: replay the conversation's requests (each user message with
    what precedes it); whenever the turns since the cut overflow ``room``, move the cut to the
    first turn that leaves them within half of it (never past the newest turn)."""
    cut = 0
    for turn in range(len(starts)):
        request_end = end if turn == len(starts) - 1 else starts[turn] + 1
        if estimate(cut, request_end) <= room:
            continue
        while cut < turn and estimate(cut, request_end) > room // 2:
            cut += 1
    return cut
