"""Model-based random tests of the prefix store (index + tiers) against a plain reference: a
dict of every saved prompt (token tuples per salt) and of the pins held.

Checked after every step: a load serves exactly what ``match`` promised, every row it loads is
the K/V written for that token at that position (nothing lost or mixed up), the match is never
longer than some saved prompt allows (soundness) and is the longest any live entry allows
(completeness), pinned prefixes always stay matchable, every entry's retained sequence holds
its tokens' K/V, the host budget holds, per-tier byte accounts sum to their budgets, and the
cache holds nothing but the retained sequences' cells between requests.

Small by default; ``pytest -m slow`` runs >= 100k operations (the count is printed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import numbakv as nkv
from numbakv.errors import KVCacheFullError
from numbakv.prefix import PrefixStore

from prefix_helpers import check_holds, prefill, small_cache

HAVE_SNAPSHOT = hasattr(nkv.CausalCache, "export_seq")
OPS = {"count": 0, "violations": 0}

tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=28)
salt_st = st.sampled_from([None, b"t"])


def lcp(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = small_cache(max_seqs=4, capacity=24)          # 96 cells
        self.host = (self.cache.config.nbytes(1) * 40) if HAVE_SNAPSHOT else 0
        self.policy = "lru"
        self.store = PrefixStore(self.cache, retain_seqs=[2, 3], block_tokens=4,
                                 host_bytes=self.host, policy=self.policy)
        self.saved = {None: set(), b"t": set()}
        self.pins = []     # (tokens, salt, length)

    def teardown(self):
        self.store.close()

    def _op(self):
        OPS["count"] += 1

    @rule(tokens=tokens_st, salt=salt_st)
    def save(self, tokens, salt):
        self._op()
        try:
            prefill(self.cache, 0, tokens, chunk=16)
        except KVCacheFullError:
            assert self.cache.seq_pos_max(0) < len(tokens) - 1
            self.cache.seq_rm(0)
            return
        kept = self.store.save(0, tokens, salt=salt)
        assert kept in (0, len(tokens))
        self.saved[salt].add(tuple(tokens))
        self.cache.seq_rm(0)
        if kept:
            assert self.store.match(tokens, salt=salt) == len(tokens)

    @rule(tokens=tokens_st, salt=salt_st)
    def load(self, tokens, salt):
        self._op()
        n = self.store.match(tokens, salt=salt)
        # soundness: never more than some saved prompt of this salt shares with it
        assert n <= max((lcp(tokens, p) for p in self.saved[salt]), default=0)
        # completeness: the longest any live entry of this salt shares
        root = self.store._root(salt)
        live = [e["tokens"] for e in self.store.entries() if e["salt_root"] == root]
        assert n == max((lcp(tokens, p) for p in live), default=0)
        try:
            got = self.store.load(1, tokens, salt=salt)
        except KVCacheFullError:
            assert self.cache.seq_pos_max(1) == -1
            return
        assert got == n
        if n:
            check_holds(self.cache, 1, tokens, n)
        else:
            assert self.cache.seq_pos_max(1) == -1
        self.cache.seq_rm(1)

    @rule(k=st.integers(1, 90))
    def occupy(self, k):
        """A request that needs room: the store must give up cells (never pinned ones)."""
        self._op()
        try:
            prefill(self.cache, 0, [9] * k, chunk=90)
        except KVCacheFullError:
            pass
        self.cache.seq_rm(0)

    @rule(tokens=tokens_st, salt=salt_st)
    def pin(self, tokens, salt):
        self._op()
        n = self.store.pin(tokens, salt=salt)
        assert n == self.store.match(tokens, salt=salt)
        if n:
            self.pins.append((tokens, salt, n))

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 100))
    def unpin(self, i):
        self._op()
        tokens, salt, n = self.pins.pop(i % len(self.pins))
        assert self.store.unpin(tokens, salt=salt)

    @rule(roll=st.integers(0, 6))
    def clear_sometimes(self, roll):
        self._op()
        if roll == 0:
            self.store.clear()
            self.pins.clear()

    @invariant()
    def pins_hold(self):
        for tokens, salt, n in self.pins:
            assert self.store.match(tokens, salt=salt) >= n

    @invariant()
    def entries_hold_their_kv(self):
        for e in self.store.entries():
            if e["tier"] == "cells":
                check_holds(self.cache, e["seq"], e["tokens"], e["length"])

    @invariant()
    def index_holds_only_covered_blocks(self):
        """Every block node the index keeps is covered by a live entry (a stale node would
        shadow a real match)."""
        stack = list(self.store.index.roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                assert node.entries, "a block no entry covers stayed in the index"
                assert all(e.id in self.store.index.entries for e in node.entries.values())
            stack.extend(node.children.values())

    @invariant()
    def budgets(self):
        s = self.store.stats()
        for name, t in s["tiers"].items():
            assert t["bytes_used"] == t["bytes_evictable"] + t["bytes_pinned"]
            assert t["bytes_used"] + t["bytes_free"] == t["budget"]
            assert t["bytes_used"] <= t["budget"]
        if self.host:
            assert s["tiers"]["host"]["bytes_used"] <= self.host
        # between requests the cache holds the retained sequences' cells only
        cells = set()
        for r in (2, 3):
            cells.update(self.cache.cells.seq_cells(r).tolist())
        assert self.cache.n_used == len(cells)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None,
                                     suppress_health_check=list(HealthCheck))


class LfuMachine(StoreMachine):
    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        self.cache = small_cache(max_seqs=4, capacity=24)
        self.host = (self.cache.config.nbytes(1) * 40) if HAVE_SNAPSHOT else 0
        self.store = PrefixStore(self.cache, retain_seqs=[2, 3], block_tokens=4,
                                 host_bytes=self.host, policy="lfu")
        self.saved = {None: set(), b"t": set()}
        self.pins = []


TestLfuMachine = LfuMachine.TestCase
TestLfuMachine.settings = settings(max_examples=10, stateful_step_count=30, deadline=None,
                                   suppress_health_check=list(HealthCheck))


@pytest.mark.slow
def test_store_machine_100k_operations():
    from hypothesis.stateful import run_state_machine_as_test
    OPS["count"] = 0
    run_state_machine_as_test(StoreMachine, settings=settings(
        max_examples=1700, stateful_step_count=60, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))
    run_state_machine_as_test(LfuMachine, settings=settings(
        max_examples=300, stateful_step_count=60, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))
    print(f"\nprefix store model test: {OPS['count']} operations, 0 violations")
    assert OPS["count"] >= 100_000


class SlidingStoreMachine(RuleBasedStateMachine):
    """Sliding-window caches (issue 37 #1 and #6): prompts evaluated in small chunks (so the
    window prunes as it goes) and saved whole or cut anywhere, also after the window pruned the
    cut (a prompt saved after a long generation). Checked: ``load`` serves exactly what
    ``match`` promised, every row bit-exact, resumable (``can_resume``) at the length served;
    a pinned length stays reachable for every prompt extending it."""

    def __init__(self):
        super().__init__()
        cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=2, head_dim=4, dtype="float32",
                              capacity=48, max_seqs=4, device="cpu")
        self.cache = nkv.CausalCache(cfg, swa_window=4, swa_memory=8)
        self.store = PrefixStore(self.cache, retain_seqs=[2, 3], block_tokens=4,
                                 host_bytes=self.cache.config.nbytes(1) * 64,
                                 checkpoint_tail=3)
        self.pins = []

    def teardown(self):
        self.store.close()

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30), cut=st.integers(0, 30),
          chunk=st.sampled_from([1, 3, 4, 30]))
    def save(self, tokens, cut, chunk):
        OPS["count"] += 1
        try:
            prefill(self.cache, 0, tokens, chunk=chunk)
        except KVCacheFullError:
            self.cache.seq_rm(0)
            return
        k = min(cut, len(tokens)) or len(tokens)
        kept = self.store.save(0, tokens[:k])
        assert kept in (0, k)
        if kept:
            assert self.store.match(tokens[:k]) == k
        self.cache.seq_rm(0)

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=34))
    def load(self, tokens):
        OPS["count"] += 1
        n = self.store.match(tokens)
        try:
            got = self.store.load(1, tokens)
        except KVCacheFullError:
            assert self.cache.seq_pos_max(1) == -1
            return
        assert got == n
        if n:
            assert self.cache.can_resume(1, n)
            check_holds(self.cache, 1, tokens, n)
        else:
            assert self.cache.seq_pos_max(1) == -1
        self.cache.seq_rm(1)

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30))
    def pin(self, tokens):
        n = self.store.pin(tokens)
        if n:
            self.pins.append((tokens[:n], n))

    @invariant()
    def pinned_prefixes_stay_reachable(self):
        for prefix, n in self.pins:
            for extra in ([], [0], [1, 2, 3, 0, 1]):
                assert self.store.match(prefix + extra) >= n


TestSlidingStoreMachine = SlidingStoreMachine.TestCase
TestSlidingStoreMachine.settings = settings(max_examples=25, stateful_step_count=25,
                                            deadline=None,
                                            suppress_health_check=list(HealthCheck))
