"""Radix-tree KV prefix cache: token-id sequences -> KV slot indices (page size 1).

The cache is pure bookkeeping. It never allocates or frees KV slots: `insert` reports how many of the
caller's slots were duplicates, `evict` and `reset` hand slots back, and the caller (the cache manager)
returns them to the allocator. That keeps the tree testable without a model or a device.

Tree invariants (checked by `RadixCache.check_integrity`):
  * the root has an empty key; every other node has a non-empty key and `len(key) == len(value)`;
  * `parent.children[node.key[0]] is node` (children are keyed by their first token; siblings never share
    a first token, so a path is determined by the tokens);
  * `lock_ref` counts the locks held on a node or on any descendant: `lock(n)` increments `n` and every
    ancestor, so `parent.lock_ref >= sum(child.lock_ref)` and a locked node's ancestors are locked;
  * `evictable_size() + protected_size() == total_size()`; a node's tokens are protected iff its
    `lock_ref > 0`; the two counters always equal a recomputation over the tree;
  * no slot is held twice.

Why `match_prefix` does not modify the cache: a lookup may end inside a node (a partial match). Splitting
there would fragment the tree for every probe (the scheduler matches every waiting request each step to
rank them), and touching LRU times would make a merely-probed prefix look hot. Instead the partially
matched node is returned as `last_node`; `lock(last_node)` protects all of its slots, including the
matched ones, and every ancestor. A later split keeps that protection: the new upper half inherits the
lower half's `lock_ref` and LRU time, so `unlock(last_node)` still releases exactly what `lock` took.

Matched indices are only safe to use while `last_node` is locked (or until the next `evict`).

Sliding-window layers' K/V (`memory_pool`'s sliding pool) is tracked per node, not stored: with
`sliding_held` set (a function telling which slots still hold a sliding row), each node counts its tokens
that do (`TreeNode.sliding`), and the tree sums them over unlocked and locked nodes
(`sliding_evictable_size`, `sliding_protected_size`). `evict_sliding` drops the sliding K/V of unlocked
nodes, least recently used first and inner nodes as well as leaves, and keeps the nodes: their full
layers' K/V still serves prefixes. The tree does not decide what such a node is still good for; the cache
manager cuts a match back to where every sliding layer's window is held (`cache_manager.sliding_usable_len`).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Key = tuple[int, ...]

# A prefix comparison first tries one C-level tuple compare of the whole overlap; on a mismatch it bisects
# with slice compares (about 2x the overlap in copied elements) down to a window of this many tokens, which
# it scans one by one.
_SCAN = 32


def _empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


def _as_key(key: Sequence[int] | torch.Tensor) -> Key:
    if isinstance(key, torch.Tensor):
        return tuple(key.tolist())
    return tuple(key)


def _as_value(value: torch.Tensor, n: int) -> torch.Tensor:
    """Validate a slot tensor and return a private int64 copy (the caller's may be a reused buffer row)."""
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        raise TypeError("value must be a 1-D tensor of KV slot indices")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"value must hold integer slot indices, got {value.dtype}")
    if value.numel() != n:
        raise ValueError(f"len(key) == {n} but len(value) == {value.numel()}")
    return value.to(dtype=torch.int64, copy=True)


def _common_prefix_len(key: Key, start: int, node_key: Key) -> int:
    """Length of the common prefix of `key[start:]` and `node_key`."""
    n = min(len(node_key), len(key) - start)
    if key[start : start + n] == node_key[:n]:
        return n
    lo, hi = 0, n  # invariant: the first mismatch lies in [lo, hi)
    while hi - lo > _SCAN:
        mid = (lo + hi) // 2
        if key[start + lo : start + mid] == node_key[lo:mid]:
            lo = mid
        else:
            hi = mid
    while key[start + lo] == node_key[lo]:  # stops before hi
        lo += 1
    return lo


class TreeNode:
    """One edge of the radix tree: a run of tokens and their KV slots."""

    _ids = itertools.count()

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id", "sliding")

    def __init__(self, key: Key = (), value: torch.Tensor | None = None, parent: TreeNode | None = None):
        self.children: dict[int, TreeNode] = {}  # first token of the child's key -> child
        self.parent = parent
        self.key = key
        self.value = _empty_slots() if value is None else value  # [len(key)] int64
        self.lock_ref = 0
        self.last_access = 0  # cache-local monotonic tick; larger == more recently used
        self.id = next(TreeNode._ids)  # creation order: deterministic LRU tie-break
        self.sliding = 0  # tokens whose slots still hold sliding-layer K/V (with `RadixCache.sliding_held`)

    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, t={self.last_access})"


@dataclass
class MatchResult:
    indices: torch.Tensor  # [matched_tokens] int64 KV slots of the matched prefix
    last_node: TreeNode  # deepest node touched; possibly matched only partially (lock it to protect all)


class BasePrefixCache(ABC):
    """Interface shared by the radix cache and the disabled (never-matching) cache."""

    enabled: bool
    root: TreeNode

    @abstractmethod
    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `key`. Does not modify the cache (no split, no LRU touch)."""

    @abstractmethod
    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        """Cache `key -> value` and return how many leading tokens were already cached.

        The cache keeps its own slots for those tokens, so `value[:returned]` is not stored. Slots in that
        range that the caller allocated are duplicates to free; slots it got from `match_prefix` (the first
        `len(match.indices)`) belong to the cache and must not be freed.
        """

    def exact_node(self, node: TreeNode, matched: int) -> TreeNode:
        """The node whose path is exactly the first `matched` tokens of `node`'s path (`node` from a match
        of that length): a match that ends inside `node` splits it there, so a lock protects only what the
        request uses and not the rest of a long cached sequence that merely shares its first tokens."""
        return node

    @abstractmethod
    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (reference counted); refresh their LRU time."""

    @abstractmethod
    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`; raises RuntimeError if `node` is not locked."""

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Evict unlocked leaves, oldest first, until >= num_tokens slots are freed or none are left."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    def num_nodes(self) -> int:
        """Number of non-root nodes."""
        return 0

    def sliding_evictable_size(self) -> int:
        """Tokens of unlocked nodes holding sliding-layer K/V (see `RadixCache`)."""
        return 0

    def sliding_protected_size(self) -> int:
        return 0

    def evict_sliding(self, num_tokens: int) -> torch.Tensor:
        """Slots whose sliding-layer K/V the caller may free, the nodes kept (see `RadixCache`)."""
        return _empty_slots()

    @abstractmethod
    def all_slots(self) -> torch.Tensor:
        """Every slot held by the cache (for accounting checks)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant."""

    @abstractmethod
    def reset(self) -> torch.Tensor:
        """Drop everything and return all slots; raises RuntimeError while anything is locked."""


class RadixCache(BasePrefixCache):
    enabled = True

    def __init__(self) -> None:
        self._clock = itertools.count(1)
        self.root = TreeNode()
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0  # kept as nodes come and go: the memory report reads it every few seconds
        # Called with (path key, path slots) of each leaf `evict` is about to drop, while its slots still
        # hold its KV: the host tier (`host_tier.HostTier.save`) copies it there first.
        self.on_evict: Callable[[Key, torch.Tensor], None] | None = None
        # Told what the tree caches and drops, as (path key, where the change starts on it), and of resets:
        # `stored(key, start)`, `removed(key, start)`, `cleared()` (the scheduler's KV events, `kv_events`)
        self.events: Any = None
        # bool [n] of n slots: which still hold sliding-layer K/V (a sliding pool); None: no such pool
        self.sliding_held: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._sliding_evictable = 0
        self._sliding_protected = 0

    def _count_sliding(self, value: torch.Tensor) -> int:
        return int(self.sliding_held(value).sum()) if self.sliding_held is not None else 0

    # ---- lookup / insert -------------------------------------------------------------------------
    def _descend(self, key: Key) -> list[tuple[TreeNode, int]]:
        """The nodes the longest cached prefix of `key` passes through, each with how many of its tokens
        match (all of it but possibly the last's)."""
        node, pos, steps = self.root, 0, []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_prefix_len(key, pos, child.key)
            steps.append((child, n))
            pos += n
            node = child
            if n < len(child.key):
                break
        return steps

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        steps = self._descend(_as_key(key))
        pieces = [child.value if n == len(child.key) else child.value[:n] for child, n in steps]
        if not pieces:
            indices = _empty_slots()
        elif len(pieces) == 1:
            indices = pieces[0].clone()  # never hand out a view of the cache's own storage
        else:
            indices = torch.cat(pieces)
        return MatchResult(indices=indices, last_node=steps[-1][0] if steps else self.root)

    def prefix_len(self, key: Sequence[int]) -> int:
        """`match_prefix(key)`'s length without gathering its slots (lpm ranks a whole queue by it)."""
        return sum(n for _, n in self._descend(_as_key(key)))

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        key = _as_key(key)
        value = _as_value(value, len(key))
        now = next(self._clock)
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = TreeNode(key[pos:], value[pos:].clone(), parent=node)
                leaf.last_access = now
                node.children[key[pos]] = leaf
                self._evictable += len(leaf.key)
                leaf.sliding = self._count_sliding(leaf.value)
                self._sliding_evictable += leaf.sliding
                self._num_nodes += 1
                if self.events is not None:
                    self.events.stored(key, pos)
                return pos
            n = _common_prefix_len(key, pos, child.key)
            if n < len(child.key) and pos + n < len(key):
                child = self._split(child, n)  # the new key branches off inside `child`
            child.last_access = now
            pos += n
            node = child
        return pos  # everything was cached already (possibly ending inside a node: no split needed)

    def exact_node(self, node: TreeNode, matched: int) -> TreeNode:
        depth = sum(len(n.key) for n in self._path_to_root(node))  # tokens from the root to node's end
        while node is not self.root and depth - len(node.key) >= matched:
            depth -= len(node.key)  # split since the match (another request's lock): the match ends above
            node = node.parent
        inside = matched - (depth - len(node.key))  # tokens of `node` the match covers
        return self._split(node, inside) if 0 < inside < len(node.key) else node

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Split `node` so that its first `at` tokens become a new parent; returns that parent.

        The new parent inherits `lock_ref` (every lock through `node` also covers its upper half) and
        `last_access`; sizes are unchanged because both halves keep the same protection state.
        """
        assert node.parent is not None and 0 < at < len(node.key)
        upper = TreeNode(node.key[:at], node.value[:at].clone(), parent=node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        if node.sliding:
            upper.sliding = self._count_sliding(upper.value)
            node.sliding -= upper.sliding
        self._num_nodes += 1
        node.parent.children[node.key[0]] = upper
        node.key = node.key[at:]
        node.value = node.value[at:].clone()
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    # ---- locking --------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        path = self._path_to_root(node)
        now = next(self._clock)
        for node in path:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                self._sliding_evictable -= node.sliding
                self._sliding_protected += node.sliding
            node.lock_ref += 1
            node.last_access = now

    def unlock(self, node: TreeNode) -> None:
        path = self._path_to_root(node)
        if path and path[0].lock_ref <= 0:  # ancestors hold >= the node's count, so this check suffices
            raise RuntimeError(f"unlock of an unlocked node {node!r}")
        for node in path:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
                self._sliding_protected -= node.sliding
                self._sliding_evictable += node.sliding

    def path(self, node: TreeNode) -> tuple[Key, torch.Tensor]:
        """The whole key from the root to the end of `node`, and its slots."""
        nodes = self._path_to_root(node)[::-1]
        key = tuple(t for n in nodes for t in n.key)
        return key, torch.cat([n.value for n in nodes]) if nodes else _empty_slots()

    def path_key(self, node: TreeNode) -> Key:
        """The whole key from the root to the end of `node` (`path` without gathering the slots)."""
        return tuple(t for n in self._path_to_root(node)[::-1] for t in n.key)

    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """`node` and its ancestors, root excluded; raises ValueError for a node not in this tree."""
        path = []
        while node is not self.root:
            if node.parent is None:
                raise ValueError(f"{node!r} is not attached to this cache (evicted or reset?)")
            path.append(node)
            node = node.parent
        return path

    # ---- eviction -------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> torch.Tensor:
        if num_tokens <= 0:
            return _empty_slots()
        # O(nodes) scan per call, like SGLang; evict runs only when the pool is short of slots.
        heap = [(n.last_access, n.id, n) for n in self._nodes() if n.is_leaf() and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            if self.on_evict is not None:
                self.on_evict(*self.path(leaf))
            if self.events is not None:
                key = self.path_key(leaf)
                self.events.removed(key, len(key) - len(leaf.key))
            del parent.children[leaf.key[0]]
            leaf.parent = None  # detached: a stale lock/unlock on it now fails loudly
            self._evictable -= len(leaf.key)
            self._sliding_evictable -= leaf.sliding
            self._num_nodes -= 1
            freed.append(leaf.value)
            num_freed += len(leaf.key)
            if parent is not self.root and parent.is_leaf() and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return torch.cat(freed) if freed else _empty_slots()

    def evict_sliding(self, num_tokens: int) -> torch.Tensor:
        """Drop the sliding-layer K/V of unlocked nodes that hold some, least recently used first, until
        >= num_tokens of it is dropped or none is left; returns the nodes' slots (the caller frees their
        sliding rows only: the nodes and their full-layer K/V stay)."""
        if num_tokens <= 0 or self.sliding_held is None:
            return _empty_slots()
        nodes = sorted(
            (n for n in self._nodes() if n.sliding and n.lock_ref == 0), key=lambda n: (n.last_access, n.id)
        )
        freed: list[torch.Tensor] = []
        num_freed = 0
        for node in nodes:
            if num_freed >= num_tokens:
                break
            freed.append(node.value)
            num_freed += node.sliding
            self._sliding_evictable -= node.sliding
            node.sliding = 0
        return torch.cat(freed) if freed else _empty_slots()

    # ---- sizes and accounting -------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable

    def sliding_evictable_size(self) -> int:
        """Tokens of unlocked nodes that hold sliding-layer K/V (0 without `sliding_held`)."""
        return self._sliding_evictable

    def sliding_protected_size(self) -> int:
        return self._sliding_protected

    def protected_size(self) -> int:
        return self._protected

    def all_slots(self) -> torch.Tensor:
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else _empty_slots()

    def num_nodes(self) -> int:
        """Number of non-root nodes (a counter: O(1))."""
        return self._num_nodes

    def reset(self) -> torch.Tensor:
        if self._protected or any(n.lock_ref for n in self._nodes()):
            raise RuntimeError("reset() while nodes are locked")
        slots = self.all_slots()
        for node in self._nodes():
            node.parent = None  # stale handles now fail loudly in lock()
        self.root.children = {}  # keep the root object: requests that matched nothing still hold it
        self._evictable = 0
        self._protected = 0
        self._sliding_evictable = self._sliding_protected = 0
        self._num_nodes = 0
        if self.events is not None:
            self.events.cleared()
        return slots

    def _nodes(self) -> Iterator[TreeNode]:
        """All non-root nodes, iteratively (chains can be deeper than Python's recursion limit)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- checks and debugging -------------------------------------------------------------------
    def check_integrity(self) -> None:
        root = self.root
        assert root.parent is None and root.key == () and root.value.numel() == 0, "malformed root"
        evictable = protected = sliding_evictable = sliding_protected = 0
        seen: set[int] = set()
        stack = [root]
        while stack:
            node = stack.pop()
            assert node.id not in seen, f"{node!r} reachable twice (cycle or shared child)"
            seen.add(node.id)
            child_locks = 0
            for first, child in node.children.items():
                assert child.parent is node, f"{child!r} has a wrong parent pointer"
                assert len(child.key) > 0, f"{child!r} has an empty key"
                assert child.key[0] == first, f"{child!r} is keyed by {first}, not its first token"
                assert child.value.dtype == torch.int64 and child.value.dim() == 1, f"{child!r} bad value"
                assert child.value.numel() == len(child.key), f"{child!r}: len(key) != len(value)"
                assert child.lock_ref >= 0, f"{child!r} has a negative lock_ref"
                child_locks += child.lock_ref
                if self.sliding_held is not None:
                    held = self._count_sliding(child.value)
                    assert child.sliding == held, f"{child!r}: sliding count {child.sliding} != held {held}"
                if child.lock_ref > 0:
                    protected += len(child.key)
                    sliding_protected += child.sliding
                else:
                    evictable += len(child.key)
                    sliding_evictable += child.sliding
                stack.append(child)
            if node is not root:
                assert node.lock_ref >= child_locks, f"{node!r}: lock_ref < sum of children's ({child_locks})"
        assert evictable == self._evictable, f"evictable_size {self._evictable} != recomputed {evictable}"
        assert protected == self._protected, f"protected_size {self._protected} != recomputed {protected}"
        assert (sliding_evictable, sliding_protected) == (self._sliding_evictable, self._sliding_protected), (
            f"sliding sizes ({self._sliding_evictable}, {self._sliding_protected}) != recomputed "
            f"({sliding_evictable}, {sliding_protected})"
        )
        assert len(seen) - 1 == self._num_nodes, f"num_nodes {self._num_nodes} != counted {len(seen) - 1}"
        slots = self.all_slots()
        assert torch.unique(slots).numel() == slots.numel(), "a KV slot is held by two tree positions"

    def pretty(self, max_tokens: int = 8) -> str:
        """Indented dump, one node a line: key preview, slot preview, lock_ref, LRU tick."""
        lines = [f"root (evictable={self._evictable}, protected={self._protected})"]
        stack = [(c, 1) for c in sorted(self.root.children.values(), key=lambda c: c.key[0], reverse=True)]
        while stack:
            node, depth = stack.pop()
            more = "..." if len(node.key) > max_tokens else ""
            keys = ",".join(map(str, node.key[:max_tokens])) + more
            slots = ",".join(map(str, node.value[:max_tokens].tolist())) + more
            lines.append(
                f"{'  ' * depth}[{keys}] slots=[{slots}] len={len(node.key)} lock={node.lock_ref} "
                f"t={node.last_access}"
            )
            kids = sorted(node.children.values(), key=lambda c: c.key[0], reverse=True)
            stack.extend((c, depth + 1) for c in kids)
        return "\n".join(lines)


class NoPrefixCache(BasePrefixCache):
    """`--disable-radix-cache`: same interface, never matches, never holds a slot."""

    enabled = False

    def __init__(self) -> None:
        self.root = TreeNode()

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        return MatchResult(indices=_empty_slots(), last_node=self.root)

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        key = _as_key(key)
        _as_value(value, len(key))
        return len(key)  # nothing is kept: the caller frees every slot

    def lock(self, node: TreeNode) -> None:
        if node is not self.root:
            raise ValueError("NoPrefixCache only hands out its root")

    def unlock(self, node: TreeNode) -> None:
        if node is not self.root:
            raise ValueError("NoPrefixCache only hands out its root")

    def evict(self, num_tokens: int) -> torch.Tensor:
        return _empty_slots()

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def all_slots(self) -> torch.Tensor:
        return _empty_slots()

    def check_integrity(self) -> None:
        assert not self.root.children and self.root.lock_ref == 0, "NoPrefixCache holds nodes"

    def reset(self) -> torch.Tensor:
        return _empty_slots()
