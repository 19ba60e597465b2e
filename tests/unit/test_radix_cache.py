"""Radix cache: exact unit tests plus a stateful test against a flat reference model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.mem_cache.radix_cache import NoPrefixCache, RadixCache, TreeNode, _common_prefix_len


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def slots(x: torch.Tensor) -> list[int]:
    return x.tolist()


def child(node: TreeNode, *key: int) -> TreeNode:
    """The child of `node` whose key is exactly `key` (fails otherwise)."""
    c = node.children[key[0]]
    assert c.key == key, f"expected key {key}, got {c.key}"
    return c


# ---- insert / match / split -------------------------------------------------------------------------


def test_insert_and_match():
    c = RadixCache()
    assert c.insert([1, 2, 3], t(10, 11, 12)) == 0
    m = c.match_prefix([1, 2, 3, 4])
    assert slots(m.indices) == [10, 11, 12] and m.indices.dtype == torch.int64
    assert m.last_node is child(c.root, 1, 2, 3)
    for miss in ([5, 1], []):
        m = c.match_prefix(miss)
        assert m.indices.numel() == 0 and m.last_node is c.root
    assert (c.total_size(), c.evictable_size(), c.protected_size()) == (3, 3, 0)
    c.check_integrity()


def test_split_on_partial_overlap_tree_shape():
    c = RadixCache()
    c.insert([1, 2, 3, 4], t(0, 1, 2, 3))
    assert c.insert([1, 2, 5], t(10, 11, 12)) == 2  # caller frees 10, 11
    upper = child(c.root, 1, 2)
    assert slots(upper.value) == [0, 1] and set(upper.children) == {3, 5}
    assert slots(child(upper, 3, 4).value) == [2, 3]
    assert slots(child(upper, 5).value) == [12]
    assert child(upper, 3, 4).parent is upper and upper.parent is c.root
    assert c.num_nodes() == 3 and c.total_size() == 5
    assert slots(c.match_prefix([1, 2, 5, 7]).indices) == [0, 1, 12]
    assert sorted(slots(c.all_slots())) == [0, 1, 2, 3, 12]
    c.check_integrity()


def test_insert_returns_duplicate_counts():
    c = RadixCache()
    assert c.insert([1, 2, 3], t(0, 1, 2)) == 0
    assert c.insert([1, 2, 3], t(5, 6, 7)) == 3  # full duplicate
    assert c.insert([1, 2], t(8, 9)) == 2  # ends inside a node: nothing new, no split needed
    assert c.num_nodes() == 1
    assert c.insert([1, 2, 3, 4, 5], t(20, 21, 22, 23, 24)) == 3  # extension appends a child
    assert slots(child(child(c.root, 1, 2, 3), 4, 5).value) == [23, 24]
    assert c.insert([], t()) == 0
    assert c.total_size() == 5
    c.check_integrity()


def test_insert_with_matched_slots_keeps_cache_slots():
    """The scheduler's pattern: reuse matched slots, append new ones, insert; nothing is held twice."""
    c = RadixCache()
    c.insert([1, 2, 3], t(0, 1, 2))
    m = c.match_prefix([1, 2, 3, 4, 5])
    value = torch.cat([m.indices, t(7, 8)])
    assert c.insert([1, 2, 3, 4, 5], value) == len(m.indices)
    assert sorted(slots(c.all_slots())) == [0, 1, 2, 7, 8]
    c.check_integrity()


def test_insert_copies_value_and_validates():
    c = RadixCache()
    buf = torch.tensor([4, 5, 6], dtype=torch.int32)  # e.g. a reused req_to_token row
    c.insert([1, 2, 3], buf)
    buf.fill_(-1)
    out = c.match_prefix([1, 2, 3]).indices
    assert slots(out) == [4, 5, 6] and out.dtype == torch.int64
    out.fill_(-2)  # the returned indices are not a view into the tree
    assert slots(c.match_prefix([1, 2, 3]).indices) == [4, 5, 6]
    with pytest.raises(ValueError):
        c.insert([1, 2], t(1))
    with pytest.raises(TypeError):
        c.insert([1], torch.tensor([1.0]))
    c.check_integrity()


def test_match_does_not_modify_cache():
    c = RadixCache()
    c.insert([1, 2, 3, 4], t(0, 1, 2, 3))
    before = c.pretty()
    m = c.match_prefix([1, 2, 9])
    assert slots(m.indices) == [0, 1]
    assert m.last_node is child(c.root, 1, 2, 3, 4)  # partial: no split
    assert c.pretty() == before and c.num_nodes() == 1
    c.lock(m.last_node)  # protects the whole node, including the two matched slots
    assert (c.protected_size(), c.evictable_size()) == (4, 0)
    assert c.evict(10).numel() == 0


def test_match_stops_inside_partially_matched_node():
    c = RadixCache()
    c.insert([1, 2, 3], t(0, 1, 2))
    c.insert([1, 2, 3, 9], t(0, 1, 2, 3))  # chain [1,2,3] -> [9]
    m = c.match_prefix([1, 2, 9])  # diverges inside [1,2,3]; must not continue into its child [9]
    assert slots(m.indices) == [0, 1] and m.last_node is child(c.root, 1, 2, 3)


@pytest.mark.parametrize("mismatch", [0, 1, 63, 64, 65, 127, 128, 500, 999])
def test_common_prefix_len_across_chunks(mismatch):
    a = tuple(range(1000))
    b = a[:mismatch] + (-1,) + a[mismatch + 1 :]
    assert _common_prefix_len(a, 0, b) == mismatch
    assert _common_prefix_len((7,) + a, 1, b) == mismatch
    assert _common_prefix_len(a, 0, a[:mismatch]) == mismatch  # node key shorter than the query
    assert _common_prefix_len(a[:mismatch], 0, a) == mismatch  # query shorter than the node key


# ---- locking ----------------------------------------------------------------------------------------


def _two_branch_cache() -> tuple[RadixCache, TreeNode, TreeNode, TreeNode]:
    c = RadixCache()
    c.insert([1, 2, 3, 4], t(0, 1, 2, 3))
    c.insert([1, 2, 5], t(10, 11, 12))
    upper = child(c.root, 1, 2)
    return c, upper, child(upper, 3, 4), child(upper, 5)


def test_lock_unlock_propagation_and_sizes():
    c, upper, left, right = _two_branch_cache()
    c.lock(right)
    assert (upper.lock_ref, left.lock_ref, right.lock_ref) == (1, 0, 1)
    assert (c.protected_size(), c.evictable_size()) == (3, 2)
    c.lock(left)
    assert (upper.lock_ref, left.lock_ref, right.lock_ref) == (2, 1, 1)
    assert (c.protected_size(), c.evictable_size()) == (5, 0)
    c.check_integrity()
    c.unlock(right)
    assert (upper.lock_ref, left.lock_ref, right.lock_ref) == (1, 1, 0)
    assert (c.protected_size(), c.evictable_size()) == (4, 1)
    c.unlock(left)
    assert (c.protected_size(), c.evictable_size()) == (0, 5)
    with pytest.raises(RuntimeError):
        c.unlock(left)
    assert upper.lock_ref == 0  # the failed unlock changed nothing
    c.lock(c.root)
    c.unlock(c.root)  # root lock is a no-op
    c.check_integrity()


def test_split_of_locked_node_inherits_lock():
    c = RadixCache()
    c.insert([1, 2, 3, 4], t(0, 1, 2, 3))
    node = c.match_prefix([1, 2, 3, 4]).last_node
    c.lock(node)
    assert c.insert([1, 2, 9], t(7, 8, 9)) == 2  # splits the locked node
    upper = child(c.root, 1, 2)
    assert node.parent is upper and node.key == (3, 4)
    assert (upper.lock_ref, node.lock_ref) == (1, 1)
    assert upper.last_access >= node.last_access
    assert (c.protected_size(), c.evictable_size()) == (4, 1)
    c.check_integrity()
    assert slots(c.evict(10)) == [9]
    c.unlock(node)
    assert (upper.lock_ref, c.protected_size(), c.evictable_size()) == (0, 0, 4)
    c.check_integrity()


def test_lock_of_detached_node_raises():
    c = RadixCache()
    c.insert([1, 2], t(0, 1))
    node = c.match_prefix([1, 2]).last_node
    c.evict(2)
    with pytest.raises(ValueError):
        c.lock(node)
    with pytest.raises((ValueError, RuntimeError)):
        c.unlock(node)
    assert (c.protected_size(), c.evictable_size()) == (0, 0)


# ---- eviction ---------------------------------------------------------------------------------------


def test_eviction_is_lru_over_leaves_with_exact_slots():
    c = RadixCache()
    c.insert([1, 2, 3], t(0, 1, 2))  # tick 1
    c.insert([1, 2, 4, 5], t(10, 11, 12, 13))  # tick 2: [1,2] -> {[3] t1, [4,5] t2}
    c.insert([7, 8], t(20, 21))  # tick 3
    assert slots(c.evict(1)) == [2]  # oldest leaf [3]
    # [4,5] goes next; then [1,2] becomes a leaf, older (t2) than [7,8] (t3), and is taken before it
    assert slots(c.evict(3)) == [12, 13, 0, 1]
    assert c.root.children.keys() == {7}
    assert slots(c.evict(5)) == [20, 21]  # asks for more than there is: returns what exists
    assert c.total_size() == 0 and c.evict(1).numel() == 0
    c.check_integrity()


def test_insert_and_lock_refresh_lru():
    c = RadixCache()
    c.insert([1], t(0))
    c.insert([2], t(1))
    c.insert([3], t(2))
    c.insert([1], t(9))  # touches [1]: now [2] is the oldest
    n3 = c.match_prefix([3]).last_node
    c.lock(n3)
    c.unlock(n3)  # lock touched [3]: order is [2], [1], [3]
    assert slots(c.evict(1)) == [1]
    assert slots(c.evict(1)) == [0]
    assert slots(c.evict(1)) == [2]


def test_match_does_not_refresh_lru():
    c = RadixCache()
    c.insert([1], t(0))
    c.insert([2], t(1))
    c.match_prefix([1])
    assert slots(c.evict(1)) == [0]


def test_locked_nodes_never_evicted():
    c, upper, left, right = _two_branch_cache()
    c.insert([6, 6], t(30, 31))
    c.lock(left)
    freed = c.evict(100)
    assert sorted(slots(freed)) == [12, 30, 31]
    assert c.root.children.keys() == {1} and upper.children.keys() == {3}
    assert (c.evictable_size(), c.protected_size()) == (0, 4)
    c.unlock(left)
    assert slots(c.evict(100)) == [2, 3, 0, 1]  # child before parent
    c.check_integrity()


def test_parent_evicted_only_after_children():
    c = RadixCache()
    c.insert([1, 2, 3], t(0, 1, 2))
    c.insert([1, 2, 4], t(5, 6, 7))  # [1,2] t2 -> [3] t1, [4] t2
    c.insert([9], t(8))  # t3
    # The parent [1,2] is older than [9] but is not a leaf until both of its children are gone.
    assert slots(c.evict(2)) == [2, 7]
    assert slots(c.evict(1)) == [0, 1]
    assert slots(c.evict(1)) == [8]


def test_evict_nonpositive_is_noop():
    c = RadixCache()
    c.insert([1], t(0))
    assert c.evict(0).numel() == 0 and c.evict(-3).numel() == 0 and c.total_size() == 1


def test_deep_chain_has_no_recursion_limit():
    c = RadixCache()
    depth = 1100
    key = list(range(depth))
    c.insert(key, torch.arange(depth))
    for i in range(depth - 1, 0, -1):  # split from the bottom up: each split walks a short path
        c.insert(key[:i] + [-1], torch.tensor(list(range(i)) + [10_000 + i]))
    assert c.num_nodes() == 2 * depth - 1
    c.check_integrity()
    assert c.pretty().count("\n") == c.num_nodes()
    assert slots(c.match_prefix(key).indices) == list(range(depth))
    assert c.evict(10**6).numel() == 2 * depth - 1 and c.total_size() == 0


# ---- reset ------------------------------------------------------------------------------------------


def test_reset_returns_all_slots_and_refuses_when_locked():
    c, upper, left, right = _two_branch_cache()
    c.lock(right)
    with pytest.raises(RuntimeError):
        c.reset()
    assert c.total_size() == 5  # refused reset left the tree alone
    c.unlock(right)
    assert sorted(slots(c.reset())) == [0, 1, 2, 3, 12]
    assert (c.total_size(), c.num_nodes()) == (0, 0)
    c.unlock(c.root)  # a request that matched nothing before the reset still holds a valid root
    with pytest.raises(ValueError):
        c.lock(right)  # stale handle from before the reset
    assert c.match_prefix([1, 2]).indices.numel() == 0
    c.check_integrity()


# ---- disabled cache ---------------------------------------------------------------------------------


def test_no_prefix_cache():
    c = NoPrefixCache()
    assert c.enabled is False and RadixCache().enabled is True
    assert c.insert([1, 2, 3], t(0, 1, 2)) == 3  # the caller frees everything
    m = c.match_prefix([1, 2, 3])
    assert m.indices.numel() == 0 and m.indices.dtype == torch.int64 and m.last_node is c.root
    c.lock(m.last_node)
    c.unlock(m.last_node)
    assert (c.evictable_size(), c.protected_size(), c.total_size()) == (0, 0, 0)
    assert c.evict(10).numel() == 0 and c.all_slots().numel() == 0 and c.reset().numel() == 0
    with pytest.raises(ValueError):
        c.insert([1, 2], t(0))
    c.check_integrity()


# ---- stateful test against a reference model ----------------------------------------------------------

SEQS = st.lists(st.integers(0, 2), max_size=7)  # small alphabet so that prefixes collide


class RadixCacheMachine(RuleBasedStateMachine):
    """Reference: `ref` maps every cached prefix (a token tuple) to the slot of its last token.

    It is prefix-closed while the cache evicts only leaves, and a lookup is "longest prefix in ref".
    """

    def __init__(self) -> None:
        super().__init__()
        self.cache = RadixCache()
        self.ref: dict[tuple[int, ...], int] = {}
        self.next_slot = 0  # slots 0..next_slot-1 have been handed to the cache
        self.freed: list[int] = []  # slots the cache handed back (duplicates, evicted, reset)
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []  # (locked node, matched prefix)

    def _fresh(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next_slot, self.next_slot + n)
        self.next_slot += n
        return out

    def _ref_match(self, seq: tuple[int, ...]) -> list[int]:
        out = []
        for i in range(len(seq)):
            slot = self.ref.get(seq[: i + 1])
            if slot is None:
                break
            out.append(slot)
        return out

    def _check_match(self, seq: tuple[int, ...]):
        before = self.cache.pretty()
        m = self.cache.match_prefix(list(seq))
        assert slots(m.indices) == self._ref_match(seq)
        assert self.cache.pretty() == before, "match_prefix modified the cache"
        return m

    @rule(seq=SEQS)
    def insert_fresh(self, seq):
        seq = tuple(seq)
        value = self._fresh(len(seq))
        expected = len(self._ref_match(seq))
        dup = self.cache.insert(seq, value)
        assert dup == expected
        self.freed += slots(value[:dup])
        for i in range(dup, len(seq)):
            self.ref[seq[: i + 1]] = int(value[i])

    @rule(seq=SEQS)
    def match_then_extend(self, seq):
        """The scheduler's pattern: matched slots + new slots; only value[matched:dup] is freed."""
        seq = tuple(seq)
        k = len(self._check_match(seq).indices)
        m = self.cache.match_prefix(list(seq))
        value = torch.cat([m.indices, self._fresh(len(seq) - k)])
        dup = self.cache.insert(list(seq), value)
        assert dup == k
        self.freed += slots(value[k:dup])
        for i in range(dup, len(seq)):
            self.ref[seq[: i + 1]] = int(value[i])

    @rule(seq=SEQS)
    def match(self, seq):
        self._check_match(tuple(seq))

    @rule(seq=SEQS)
    def lock(self, seq):
        seq = tuple(seq)
        m = self._check_match(seq)
        self.cache.lock(m.last_node)
        self.locks.append((m.last_node, seq[: m.indices.numel()]))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _ = self.locks.pop(i)
        self.cache.unlock(node)

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        evictable = self.cache.evictable_size()
        out = slots(self.cache.evict(n))
        assert len(out) <= evictable
        assert len(out) >= n if n <= evictable else len(out) == evictable
        assert self.cache.evictable_size() == evictable - len(out)
        by_slot = {s: p for p, s in self.ref.items()}
        for s in out:
            del self.ref[by_slot[s]]  # KeyError: evicted a slot the cache should not hold
        self.freed += out
        assert all(p[:-1] in self.ref for p in self.ref if len(p) > 1), "evicted a non-leaf"
        for _, prefix in self.locks:
            assert all(prefix[: i + 1] in self.ref for i in range(len(prefix))), "evicted a locked slot"

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self):
        out = slots(self.cache.reset())
        assert sorted(out) == sorted(self.ref.values())
        self.freed += out
        self.ref.clear()

    @invariant()
    def integrity(self):
        self.cache.check_integrity()

    @invariant()
    def contents_and_accounting(self):
        held = slots(self.cache.all_slots())
        assert sorted(held) == sorted(self.ref.values())
        assert self.cache.total_size() == len(self.ref)
        # every slot ever handed in is either held or freed, exactly once
        assert sorted(held + self.freed) == list(range(self.next_slot))

    @invariant()
    def locks_hold(self):
        locked_prefixes = {p[: i + 1] for _, p in self.locks for i in range(len(p))}
        assert self.cache.protected_size() >= len(locked_prefixes)
        if not self.locks:
            assert self.cache.protected_size() == 0
        for node, prefix in self.locks:
            assert node is self.cache.root or node.lock_ref > 0
            while node is not self.cache.root:  # still attached to the tree
                assert node.parent is not None and node.parent.children[node.key[0]] is node
                node = node.parent
            self._check_match(prefix)


RadixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestRadixCacheStateful = RadixCacheMachine.TestCase
