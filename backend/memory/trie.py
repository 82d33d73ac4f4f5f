"""PrefixTrie: a compressed trie over token ids, shared by every conversation.

Scope: structure only. A node is a run of token ids (its *edge*) covering the positions
``[start, end)`` of every sequence that passes through it; siblings never share a first token, so
a sequence has at most one path. Nodes carry an opaque ``data`` handle that the prefix cache owns
(the snapshots of the edge on some tier); this module never looks inside it. No MLX here: the
trie is plain Python and is tested with fake data.

Locks: ``lock(node)`` pins the node and every ancestor (a count per node, SGLang-style), so a
node's lock count is the number of pinned paths through it. Only unlocked nodes may be evicted,
and an unlocked node never has a locked descendant.

Recency: ``touch(path)`` stamps nodes with a monotonic counter (not wall time: ties are exact
and tests are deterministic).
"""

from __future__ import annotations

from array import array
from typing import Any, Iterator, NamedTuple, Sequence

TokenIds = Sequence[int]


def as_ids(tokens: TokenIds) -> array:
    """Token ids as a compact ``array('i')`` (edges are stored this way)."""
    return tokens if isinstance(tokens, array) else array("i", tokens)


def common_prefix_length(a: TokenIds, b: TokenIds) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a whole edge matches), compared at C speed
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class TrieNode:
    """One edge of the trie: the tokens at positions ``[start, end)``."""

    __slots__ = ("tokens", "start", "parent", "children", "locks", "last_used", "data")

    def __init__(self, tokens: TokenIds, start: int, parent: "TrieNode | None") -> None:
        self.tokens = as_ids(tokens)
        self.start = start
        self.parent = parent
        self.children: dict[int, TrieNode] = {}
        self.locks = 0
        self.last_used = 0
        self.data: Any = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def path(self) -> list["TrieNode"]:
        """Nodes from the root's child down to this node (empty for the root)."""
        out = []
        node: TrieNode | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def __repr__(self) -> str:
        return f"TrieNode([{self.start}, {self.end}), locks={self.locks})"


class TrieMatch(NamedTuple):
    """The longest stored prefix of a sequence: ``length`` tokens, along ``path`` (root first,
    root excluded). The last node of the path contains position ``length - 1``; it may extend
    beyond ``length`` (a match that ends inside an edge)."""

    path: list[TrieNode]
    length: int

    def node_at(self, position: int) -> TrieNode | None:
        """The node on the path whose edge contains ``position`` (None past the match)."""
        for node in self.path:
            if node.start <= position < node.end:
                return node
        return None


class PrefixTrie:
    """See the module docstring."""

    def __init__(self) -> None:
        self.root = TrieNode((), 0, None)
        self._clock = 0

    # -- queries ---------------------------------------------------------------------------------
    def match(self, tokens: TokenIds) -> TrieMatch:
        """The longest stored prefix of ``tokens`` (the trie is not changed)."""
        tokens = as_ids(tokens)
        node, i, path = self.root, 0, []
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = common_prefix_length(child.tokens, tokens[i:i + len(child.tokens)])
            path.append(child)
            i += n
            if n < len(child.tokens):
                break
            node = child
        return TrieMatch(path, i)

    def nodes(self) -> Iterator[TrieNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def __len__(self) -> int:
        return sum(1 for _ in self.nodes())

    def tokens_of(self, node: TrieNode) -> array:
        """The whole sequence from position 0 to ``node.end``."""
        out = array("i")
        for n in node.path():
            out.extend(n.tokens)
        return out

    # -- structure -------------------------------------------------------------------------------
    def add_child(self, parent: TrieNode, tokens: TokenIds) -> TrieNode:
        """A new leaf under ``parent`` holding ``tokens`` (whose first token no sibling has)."""
        tokens = as_ids(tokens)
        if not tokens:
            raise ValueError(f"a node needs at least one token (under {parent})")
        if tokens[0] in parent.children:
            raise ValueError(f"{parent} already has a child starting with token {tokens[0]}")
        child = TrieNode(tokens, parent.end, parent)
        parent.children[tokens[0]] = child
        return child

    def split(self, node: TrieNode, at: int) -> TrieNode:
        """Cut ``node`` at position ``at``: a new parent takes ``[start, at)``, ``node`` keeps
        ``[at, end)`` (and its data, children and locks); returns the new parent, whose data is
        None for the caller to fill."""
        if not node.start < at < node.end:
            raise ValueError(f"split point {at} not inside {node}")
        cut = at - node.start
        parent = node.parent
        assert parent is not None
        upper = TrieNode(node.tokens[:cut], node.start, parent)
        upper.locks = node.locks
        upper.last_used = node.last_used
        parent.children[upper.tokens[0]] = upper
        node.tokens = node.tokens[cut:]
        node.start = at
        node.parent = upper
        upper.children[node.tokens[0]] = node
        return upper

    def remove_leaf(self, node: TrieNode) -> None:
        if node.children or node.locks or node.parent is None:
            raise ValueError(f"only an unlocked leaf can be removed, not {node}")
        del node.parent.children[node.tokens[0]]
        node.parent = None

    # -- locks and recency -----------------------------------------------------------------------
    def lock(self, node: TrieNode) -> None:
        """Pin ``node`` and its ancestors (the root is never counted)."""
        n: TrieNode | None = node
        while n is not None and n.parent is not None:
            n.locks += 1
            n = n.parent

    def unlock(self, node: TrieNode) -> None:
        n: TrieNode | None = node
        while n is not None and n.parent is not None:
            if n.locks <= 0:
                raise ValueError(f"unlock of {n}, which is not locked")
            n.locks -= 1
            n = n.parent

    def touch(self, nodes: Sequence[TrieNode]) -> None:
        """Mark ``nodes`` used now (deeper nodes count as more recent on ties)."""
        self._clock += 1
        for node in nodes:
            node.last_used = self._clock

    # -- checks ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError naming the first broken structural invariant."""
        for node in self.nodes():
            parent = node.parent
            assert parent is not None, f"{node} has no parent"
            assert len(node.tokens) >= 1, f"{node} has an empty edge"
            assert node.start == parent.end, f"{node} starts at {node.start}, parent ends {parent.end}"
            assert parent.children.get(node.tokens[0]) is node, f"{node} not indexed by its parent"
            assert node.locks >= sum(c.locks for c in node.children.values()), \
                f"{node} has fewer locks than its children together"
            assert node.locks >= 0, f"{node} has a negative lock count"
        assert self.root.locks == 0 and self.root.start == 0 and not self.root.tokens
