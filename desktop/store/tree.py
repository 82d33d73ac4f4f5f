"""One conversation's message tree, built from its stored parent links and safe to walk.

Links Arbor never writes are repaired here, in memory only (the rows stay as stored):

* a parent that is not a message of this conversation (deleted while foreign keys were off, or
  a message of another chat): the message counts as a first message, as
  ``desktop.store.rows`` reports it;
* parents that form a loop (no first message above them): the loop is cut above its oldest
  message, which counts as a first message; ``problems`` says so for that message.

Every walk (``chain``, ``newest_leaf``) therefore ends.
"""

from __future__ import annotations

from typing import Any, Iterable

LOOP_PROBLEM = "its earlier messages loop back to it (shown as a first message)"


class MessageTree:
    """``children[parent]``: child ids oldest first (``None``: the first messages);
    ``parent_of[id]``: the repaired parent; ``problems[id]``: one line per repaired loop."""

    def __init__(self, links: Iterable[tuple[int, Any]]) -> None:
        """``links``: ``(id, parent_id)`` of every message of one conversation."""
        stored = sorted(links)
        ids = {message_id for message_id, _ in stored}
        self.parent_of: dict[int, int | None] = {
            message_id: parent if parent in ids else None for message_id, parent in stored
        }
        self.problems: dict[int, str] = {}
        self._cut_loops()
        self.children: dict[int | None, list[int]] = {}
        for message_id, _ in stored:
            self.children.setdefault(self.parent_of[message_id], []).append(message_id)

    def __contains__(self, message_id: object) -> bool:
        return message_id in self.parent_of

    def siblings(self, message_id: int) -> tuple[int, ...]:
        """``message_id`` and the other children of its parent, oldest first."""
        return tuple(self.children.get(self.parent_of[message_id], [message_id]))

    def chain(self, leaf: int) -> list[int]:
        """The ids from a first message down to ``leaf`` (a message of this tree)."""
        chain: list[int] = []
        node: int | None = leaf
        while node is not None:
            chain.append(node)
            node = self.parent_of[node]
        chain.reverse()
        return chain

    def newest_leaf(self, start: int | None) -> int | None:
        """The leaf reached from ``start`` by following the newest child (``None``: from the
        newest message of the tree; ``None`` back when the tree is empty)."""
        node = start if start is not None else max(self.parent_of, default=None)
        while node is not None and self.children.get(node):
            node = self.children[node][-1]
        return node

    def _cut_loops(self) -> None:
        done: set[int] = set()
        for start in self.parent_of:
            walk: list[int] = []
            on_walk: set[int] = set()
            node: int | None = start
            while node is not None and node not in done and node not in on_walk:
                walk.append(node)
                on_walk.add(node)
                node = self.parent_of[node]
            if node is not None and node in on_walk:  # the walk came back to itself: a loop
                oldest = min(walk[walk.index(node):])
                self.parent_of[oldest] = None
                self.problems[oldest] = LOOP_PROBLEM
            done.update(walk)
