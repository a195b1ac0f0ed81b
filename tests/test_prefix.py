"""PrefixStore: keys, index, policies, tier 0 (cells), tier 1 (host), windows, PromptCache,
events, bad input and faults."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import numbakv as nkv
from numbakv.errors import KVCacheFullError
from numbakv.prefix import PrefixStore
from numbakv.prefix.index import BlockIndex, Entry
from numbakv.prefix.keys import block_keys, root_digest, token_bytes
from numbakv.prefix.policy import LFU, LRU, make_policy

from prefix_helpers import check_holds, prefill, small_cache, wrapper_cache

HAVE_SNAPSHOT = hasattr(nkv.CausalCache, "export_seq")
needs_snapshot = pytest.mark.skipif(not HAVE_SNAPSHOT, reason="cache.export_seq not merged yet")


# ---------------------------------------------------------------------- keys
def test_keys_chain_salt_and_fingerprint():
    root = root_digest(b"", {"a": 1}, {"l": 2})
    keys = block_keys(list(range(40)), 16, root)
    assert len(keys) == 3 and all(len(k) == 32 for k in keys)
    assert block_keys(list(range(40)), 16, root) == keys          # deterministic
    assert block_keys(list(range(32)) + [9] * 8, 16, root)[:2] == keys[:2]
    assert block_keys(list(range(32)) + [9] * 8, 16, root)[2] != keys[2]
    other = block_keys([99] + list(range(1, 40)), 16, root)
    assert all(a != b for a, b in zip(keys, other))                # chained: block 0 changes all
    assert block_keys(list(range(40)), 16, root_digest(b"t1", {"a": 1}, {"l": 2})) != keys
    assert block_keys(list(range(40)), 16, root_digest(b"", {"a": 2}, {"l": 2})) != keys
    # a partial block of 8 tokens never shares a key with a full block holding the same bytes
    assert block_keys(list(range(8)), 8, root) != block_keys(list(range(8)), 16, root)


def test_keys_same_in_processes_with_different_hash_seeds():
    code = ("from numbakv.prefix.keys import block_keys, root_digest;"
            "print(block_keys(list(range(50)), 16, root_digest(b's', {'f': [1, 'x']}, {})))")
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed,
                   PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
        outs.append(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                   capture_output=True, text=True, timeout=120).stdout)
    assert outs[0] == outs[1] and len(outs[0]) > 100


# ---------------------------------------------------------------------- policies
def test_lru_and_lfu_orders():
    lru = LRU()
    for k in "abc":
        lru.add(k)
    lru.touch("a")
    assert list(lru.victims()) == ["b", "c", "a"]
    lru.remove("c")
    assert list(lru.victims()) == ["b", "a"] and len(lru) == 2
    lfu = LFU()
    for k in "abc":
        lfu.add(k)
    lfu.touch("a")
    lfu.touch("a")
    lfu.touch("c")
    assert list(lfu.victims()) == ["b", "c", "a"]
    with pytest.raises(ValueError, match="policy"):
        make_policy("fifo")


# ---------------------------------------------------------------------- index
def _entry(index, root, tokens, tier="cells", floor=0):
    path = index.insert_path(root, token_bytes(tokens))
    e = Entry(tier, root, path, floor=floor)
    index.add(e)
    return e


def test_index_token_granular_match_and_removal():
    idx = BlockIndex(4)
    root = b"r" * 16
    a = _entry(idx, root, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])       # 2 full blocks + tail of 2
    assert idx.match(root, token_bytes([1, 2, 3, 4, 5, 6, 7])).n == 7   # partial full block
    assert idx.match(root, token_bytes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])).n == 10
    assert idx.match(root, token_bytes([1, 2, 3, 4, 5, 6, 7, 8, 9, 99])).n == 9  # into the tail
    assert idx.match(root, token_bytes([2])).n == 0
    assert idx.match(b"x" * 16, token_bytes([1, 2])).n == 0      # another salt root
    b = _entry(idx, root, [1, 2, 3, 4, 5, 6], tier="host")
    m = idx.match(root, token_bytes([1, 2, 3, 4, 5]))
    assert m.n == 5 and m.entry is a                              # cells before host
    idx.remove(a)
    m = idx.match(root, token_bytes([1, 2, 3, 4, 5, 6, 7, 8]))
    assert m.n == 6 and m.entry is b
    idx.remove(b)
    assert idx.match(root, token_bytes([1, 2, 3])).n == 0 and not idx.roots


def test_index_keys_made_lazily_equal_the_chained_keys_even_after_removal():
    """A save no longer hashes its blocks: a node's key is made on first use (events, lower
    tiers), and a removed node keeps what it needs to make it; the events name the same keys
    ``block_keys`` gives, and the many children of a root find a partial match's candidates."""
    from numbakv.prefix import events as ev
    from numbakv.prefix.index import hex_keys
    idx = BlockIndex(4)
    root = b"r" * 16
    toks = list(range(1, 12))                                    # 2 full blocks + tail of 3
    keys = block_keys(toks, 4, root)
    a = _entry(idx, root, toks)
    short = _entry(idx, root, toks[:5])                          # 1 full block + tail of 1
    assert all(n._digest is None for n in a.path)                # nothing hashed yet
    later = ev.block_removed_later(idx.remove(a), "cells")      # its blocks 2.. leave the trie
    assert later[0]()["block_hashes"] == keys[1:] == hex_keys(a.path[1:])
    assert [n.key for n in a.path] == keys
    stored = ev.block_stored(short.path, 4, "cells")
    assert stored["block_hashes"] == block_keys(toks[:5], 4, root)
    assert stored["parent_block_hash"] is None and stored["token_ids"] == toks[:5]
    for first in range(20, 40):                                  # > 8 children: a first-token map
        _entry(idx, root, [first, 1, 2, 3, 4])
    assert idx.match(root, token_bytes([1, 2, 3, 4, 5, 6])).n == 5
    assert idx.match(root, token_bytes([33, 1, 2, 9])).n == 3


def test_index_paths_of_equal_rolling_hashes_stay_apart():
    """Blocks of zero tokens hash to 0 at every depth: the fast walk's keys carry the depth,
    so a prompt of zeros matches whole (a sliding-window model check found it matched a block
    short)."""
    idx = BlockIndex(4)
    root = b"r" * 16
    _entry(idx, root, [0] * 9)
    assert idx.match(root, token_bytes([0] * 9)).n == 9
    assert idx.match(root, token_bytes([0] * 12)).n == 9
    _entry(idx, root, [0] * 16)
    assert idx.match(root, token_bytes([0] * 20)).n == 16


def test_index_window_floor():
    idx = BlockIndex(4)
    root = b"r" * 16
    _entry(idx, root, list(range(20)), floor=20)                  # resumes only at its end
    e12 = _entry(idx, root, list(range(12)), floor=10)
    assert idx.match(root, token_bytes(list(range(20)) + [7])).n == 20
    m = idx.match(root, token_bytes(list(range(18)) + [0, 0]))
    assert (m.n, m.entry) == (12, e12)                            # the deepest checkpoint <= 18
    assert idx.match(root, token_bytes(list(range(11)))).n == 11
    assert idx.match(root, token_bytes(list(range(9)))).n == 0


# ---------------------------------------------------------------------- tier 0
def test_save_load_shares_cells_and_is_token_granular():
    cache = small_cache()
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4)
    toks = list(range(100, 130))
    prefill(cache, 0, toks)
    assert store.save(0, toks) == 30
    used = cache.n_used
    cache.seq_rm(0)
    assert cache.n_used == used                     # the retained sequence keeps the cells
    q = toks[:21] + [7, 7]
    assert store.match(q) == 21
    assert store.load(1, q) == 21
    assert cache.n_used == used                     # a hit copies no K/V: shared cells
    check_holds(cache, 1, toks, 21)
    prefill(cache, 1, q, start=21)                  # the engine continues from 21
    check_holds(cache, 1, q, 23)
    s = store.stats()
    assert s["tokens_reused"] == 21 and s["tiers"]["cells"]["hits"] == 1
    t = s["tiers"]["cells"]
    assert t["bytes_used"] == t["bytes_evictable"] + t["bytes_pinned"] == t["budget"] > 0
    assert t["bytes_free"] == 0


def test_load_and_save_validate_everything_first():
    cache = small_cache()
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4)
    toks = list(range(10))
    prefill(cache, 0, toks)
    store.save(0, toks)
    before = cache.cells.copy()
    for bad in ([1.5, 2.0], "abc", [[1, 2]], [True, False], [-1, 2], np.zeros(3, np.float32),
                None, 7):
        with pytest.raises(ValueError, match="tokens"):
            store.load(1, bad)
        with pytest.raises(ValueError, match="tokens"):
            store.match(bad)
    with pytest.raises(ValueError, match="reserved"):
        store.load(3, toks)
    with pytest.raises(ValueError, match="reserved"):
        store.save(3, toks)
    with pytest.raises(ValueError, match="seq"):
        store.load(9, toks)
    with pytest.raises(ValueError, match="must be empty"):
        store.load(0, toks)
    with pytest.raises(ValueError, match="tokens has 11"):
        store.save(0, toks + [1])
    with pytest.raises(ValueError, match="salt"):
        store.load(1, toks, salt="text")
    assert np.array_equal(cache.cells.cells, before.cells)
    other = small_cache()
    with pytest.raises(ValueError, match="store"):
        nkv.PromptCache(other, store=store)
    with pytest.raises(ValueError, match="already has a prefix store"):
        PrefixStore(cache, retain_seqs=[2])
    with pytest.raises(ValueError, match="retain_seqs"):
        PrefixStore(small_cache(), retain_seqs=[0, 1, 2, 3])
    busy = small_cache()
    prefill(busy, 2, [1, 2])
    with pytest.raises(ValueError, match="retain_seqs"):
        PrefixStore(busy, retain_seqs=[2])
    assert busy._room_provider is None
    with pytest.raises(ValueError, match="policy"):
        PrefixStore(small_cache(), retain_seqs=[1], policy="mru")


def test_salts_isolate_tenants():
    cache = small_cache()
    store = PrefixStore(cache, retain_seqs=[2, 3], block_tokens=4)
    toks = list(range(12))
    prefill(cache, 0, toks)
    store.save(0, toks, salt=b"alice")
    assert store.match(toks, salt=b"alice") == 12
    assert store.match(toks, salt=b"bob") == 0 and store.match(toks) == 0
    assert store.load(1, toks, salt=b"bob") == 0 and cache.seq_pos_max(1) == -1


def test_full_cache_evicts_store_entries_lru_and_never_pinned():
    cache = small_cache(max_seqs=4, capacity=16)     # 64 cells
    store = PrefixStore(cache, retain_seqs=[2, 3], block_tokens=4)
    a, b = [1] * 20, [2] * 20
    for toks in (a, b):
        prefill(cache, 0, toks)
        store.save(0, toks)
        cache.seq_rm(0)
    assert cache.n_used == 40
    store.pin(b)
    t = store.stats()["tiers"]["cells"]
    per_cell = cache.config.nbytes(1)
    assert (t["bytes_used"], t["bytes_pinned"], t["bytes_evictable"]) == \
        (40 * per_cell, 20 * per_cell, 20 * per_cell)
    store.match(a)
    prefill(cache, 0, list(range(30)))               # needs 30 cells: only 24 free
    # a (LRU, unpinned) gave its tail: 6 cells short, 20 - 6 -> whole blocks: 12 stay; b stayed
    assert store.match(a) == 12 and store.match(b) == 20
    ev = store.take_events()
    assert [e["type"] for e in ev].count("BlockRemoved") == 1
    cache.seq_rm(0)
    with pytest.raises(KVCacheFullError):            # the pinned entry is never evicted
        prefill(cache, 0, list(range(50)), chunk=50)
    assert store.match(b) == 20 and cache.seq_pos_max(0) == -1
    assert store.match(a) == 0                       # a went whole (its 12 were not enough)
    store.unpin(b)
    prefill(cache, 0, list(range(50)), chunk=50)
    assert store.match(b) == 12                      # 6 short: b's tail went


def test_extension_reuses_the_entry_one_per_conversation():
    cache = small_cache()
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4)
    turn = list(range(10))
    for i in range(4):
        n = store.load(0, turn)
        prefill(cache, 0, turn, start=n)
        store.save(0, turn)
        cache.seq_rm(0)
        assert n == (0 if i == 0 else len(turn) - 5)
        turn = turn + [50 + i] * 5
    assert len(store.index.entries) == 1
    ev = store.take_events()
    stored = [e for e in ev if e["type"] == "BlockStored"]
    removed = [e for e in ev if e["type"] == "BlockRemoved"]
    assert len(stored) == 4                                    # each turn's new blocks only
    assert all(len(e["block_hashes"]) == 1 for e in removed)   # the old partial tail only
    assert sum(len(e["token_ids"]) for e in stored) >= 25


def test_lfu_policy_keeps_the_frequent_entry():
    cache = small_cache(max_seqs=4, capacity=16)
    store = PrefixStore(cache, retain_seqs=[2, 3], block_tokens=4, policy="lfu")
    a, b = [1] * 20, [2] * 20
    for toks in (a, b):
        prefill(cache, 0, toks)
        store.save(0, toks)
        cache.seq_rm(0)
    for _ in range(3):
        store.load(1, a)
        cache.seq_rm(1)
    prefill(cache, 0, list(range(30)))
    assert store.match(a) == 20 and store.match(b) == 12   # b, the less used, gave its tail


def test_store_clear_close_and_events():
    cache = small_cache()
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4)
    toks = list(range(10))
    prefill(cache, 0, toks)
    store.save(0, toks)
    ev = store.take_events()
    assert ev == [{"type": "BlockStored", "block_hashes": block_keys(toks, 4, store._root(None)),
                   "parent_block_hash": None, "token_ids": toks, "block_size": 4,
                   "lora_id": None, "medium": "cells", "priority": 35, "ttl": None}]
    store.clear()
    assert store.take_events() == [{"type": "AllBlocksCleared"}]
    assert store.match(toks) == 0 and cache.seq_pos_max(3) == -1
    store.save(0, toks)
    store.close()
    assert cache._room_provider is None and cache.seq_pos_max(3) == -1
    PrefixStore(cache, retain_seqs=[3])               # the cache takes a new store


def test_events_published_over_zmq_loopback():
    zmq = pytest.importorskip("zmq")
    import json
    cache = small_cache()
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4)
    endpoint = store.publish_events("tcp://127.0.0.1:*")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    try:
        toks = list(range(8))
        prefill(cache, 0, toks)
        got = None
        for _ in range(50):                  # PUB/SUB joins asynchronously: publish until seen
            store.save(0, toks)
            store.clear()
            if sub.poll(100):
                got = sub.recv_multipart()
                break
        assert got is not None and got[0] == b"kv-events"
        payload = json.loads(got[2])
        assert payload["events"][0]["type"] in ("BlockStored", "AllBlocksCleared")
    finally:
        sub.close(0)
        store.close()


# ---------------------------------------------------------------------- PromptCache
@pytest.mark.parametrize("multi_user", [False, True])
def test_prompt_cache_loads_from_store_and_saves_on_release(multi_user):
    cache = small_cache(max_seqs=5)
    store = PrefixStore(cache, retain_seqs=[2, 3, 4], block_tokens=4)
    pc = nkv.PromptCache(cache, store=store, multi_user=multi_user)
    sys_prompt = list(range(1000, 1040))

    def serve(prompt):
        slot, rem = pc.load(prompt)
        assert slot not in (2, 3, 4)
        prefill(cache, slot, prompt, start=len(prompt) - len(rem))
        pc.extend(slot, rem)
        check_holds(cache, slot, prompt, len(prompt))
        pc.release(slot)
        return len(prompt) - len(rem)

    assert serve(sys_prompt + [1, 2, 3]) == 0
    assert serve([5] * 30) == 0                        # slot 0 reused: user 1's K/V gone
    assert serve([6] * 30) == 0
    assert serve(sys_prompt + [1, 2, 3, 4]) == 43      # from the store, not a slot
    assert pc.stats.store_reused >= 43
    assert serve(sys_prompt + [9]) == 40


# ---------------------------------------------------------------------- windows
def test_sliding_window_checkpoints_causal():
    cache = small_cache(max_seqs=4, capacity=256, swa_window=8)   # memory: 9
    store = PrefixStore(cache, retain_seqs=[2, 3], block_tokens=4, checkpoint_tail=6)
    toks = list(range(200, 260))
    prefill(cache, 0, toks, chunk=16)
    store.save(0, toks)
    cache.seq_rm(0)
    prefill(cache, 1, [1, 2, 3])             # an unrelated pass: idle sequences get pruned
    assert store.match(toks + [1]) == 60
    assert store.match(toks[:57] + [0] * 5) == 54      # the checkpoint 6 before the end
    assert store.match(toks[:58] + [0]) == 54
    assert store.match(toks[:52]) == 0                  # no window held there
    n = store.load(0, toks[:58] + [0, 0])
    assert n == 54 and cache.can_resume(0, 54)
    prefill(cache, 0, toks[:58], start=54)
    assert cache.seq_pos_max(0) == 57


def test_sliding_window_explicit_checkpoint_wrapper():
    cache = wrapper_cache(max_seqs=5, window=8, memory=None)
    store = PrefixStore(cache, retain_seqs=[2, 3, 4], block_tokens=4, checkpoint_tail=4)
    toks = list(range(300, 340))
    prefill(cache, 0, toks[:30], chunk=10)
    assert store.checkpoint(0) == 30                    # e.g. a turn boundary
    prefill(cache, 0, toks, start=30, chunk=10)
    store.save(0, toks)
    cache.seq_rm(0)
    prefill(cache, 1, [1, 2, 3])
    assert store.match(toks + [5]) == 40
    assert store.match(toks[:33] + [0] * 5) == 30
    n = store.load(0, toks[:35] + [1])
    assert n == 35 and cache.can_resume(0, 35)         # the save's tail checkpoint (36) serves 35
    check_holds(cache, 0, toks, 35)
    cache.seq_rm(0)
    assert store.load(0, toks[:32] + [1]) == 30 and cache.can_resume(0, 30)
    check_holds(cache, 0, toks, 30)
    cache.seq_rm(1)
    with pytest.raises(ValueError, match="nothing to checkpoint"):
        store.checkpoint(1)


# ---------------------------------------------------------------------- tier 1
@needs_snapshot
def test_eviction_demotes_to_host_and_a_hit_promotes():
    cache = small_cache(max_seqs=4, capacity=16)
    store = PrefixStore(cache, retain_seqs=[2, 3], block_tokens=4, host_bytes=1 << 20)
    a, b = list(range(20)), list(range(100, 120))
    for toks in (a, b):
        prefill(cache, 0, toks)
        store.save(0, toks)
        cache.seq_rm(0)
    prefill(cache, 0, list(range(500, 530)))            # a is demoted to host RAM
    s = store.stats()["tiers"]
    assert s["host"]["entries"] == 1 and s["host"]["bytes_used"] > 0
    assert s["host"]["bytes_used"] + s["host"]["bytes_free"] == 1 << 20
    cache.seq_rm(0)
    assert store.match(a + [1]) == 20
    assert store.load(1, a[:17] + [0]) == 17            # promoted: imported rows
    check_holds(cache, 1, a, 17)
    assert store.stats()["tiers"]["host"]["hits"] == 1
    assert store.stats()["bytes_moved"] > 0


@needs_snapshot
def test_host_budget_is_hard_and_failed_promotion_keeps_the_entry():
    cache = small_cache(max_seqs=4, capacity=16)
    one = cache.config.nbytes(20)
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4, host_bytes=one + one // 2)
    prompts = [list(range(i * 100, i * 100 + 20)) for i in range(4)]
    for toks in prompts:
        prefill(cache, 0, toks)
        store.save(0, toks)
        cache.seq_rm(0)
        s = store.stats()["tiers"]["host"]
        assert s["bytes_used"] <= one + one // 2
    assert store.match(prompts[-1]) == 20 and store.match(prompts[-2]) == 20
    assert store.match(prompts[0]) == 0
    assert store.pin(prompts[-1]) == 20                 # its 20 cells cannot be given up
    prefill(cache, 0, list(range(40)))                  # 40 request cells + 20 retained: full
    prefill(cache, 1, [1, 2, 3])
    with pytest.raises(KVCacheFullError):
        store.load(2, prompts[-2])
    assert cache.seq_pos_max(2) == -1
    assert store.match(prompts[-2]) == 20               # still in host RAM
    assert store.stats()["tiers"]["host"]["entries"] == 1
    cache.seq_rm(0)                                     # room again: the promotion goes through
    assert store.load(2, prompts[-2]) == 20
    check_holds(cache, 2, prompts[-2], 20)


# ---------------------------------------------------------------------- hf.attach chat
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_chat_through_the_store_matches_a_chat_without_it(family):
    """A 3-turn chat on a tiny model through hf.attach: from turn 2 on nearly the whole prompt
    comes from the store (Gemma 3: sliding + full layers), and every logit equals the same chat
    without the store up to float32 rounding."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from numbakv.tools import bench_prefix as bp
    model = bp.tiny_gemma3(layers=6, hidden=64, window=8) if family == "gemma3" \
        else bp.tiny_llama(layers=2, hidden=64)
    rows, with_store, stats = bp.chat(model, turns=3, system=48, user=3, reply=3)
    _, without, _ = bp.chat(model, turns=3, system=48, user=3, reply=3, use_store=False)
    for r in rows[1:]:
        assert r["reused"] >= r["prompt"] - 5, rows
    for a, b in zip(with_store, without):
        assert float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))
    assert stats["tiers"]["cells"]["hits"] == 2 and stats["tokens_reused"] > 0


def test_cache_false_skips_the_write_and_drops_marked_checkpoints():
    cache = small_cache(swa_window=8)
    store = PrefixStore(cache, retain_seqs=[2, 3], block_tokens=4)
    toks = list(range(40))
    prefill(cache, 0, toks[:20], chunk=10)
    assert store.checkpoint(0) == 20 and cache.seq_pos_max(3) == 19
    prefill(cache, 0, toks, start=20, chunk=10)
    assert store.save(0, toks, cache=False) == 0
    assert store.match(toks) == 0 and not store.index.entries
    assert cache.seq_pos_max(2) == cache.seq_pos_max(3) == -1     # the checkpoint's cells freed


@needs_snapshot
def test_wrapper_cache_tier1_round_trip_keeps_windows():
    cache = wrapper_cache(max_seqs=3, window=8, capacity=64)
    store = PrefixStore(cache, retain_seqs=[2], block_tokens=4, host_bytes=1 << 20)
    a, b = list(range(500, 540)), list(range(600, 630))
    for toks in (a, b):
        prefill(cache, 0, toks, chunk=10)
        store.save(0, toks)
        cache.seq_rm(0)
    s = store.stats()["tiers"]
    assert s["host"]["entries"] == 1 and s["cells"]["entries"] == 1   # a was demoted
    assert store.match(a + [1]) == 40 and store.match(a[:30]) == 0    # only its end's window
    assert store.load(1, a + [7]) == 40
    check_holds(cache, 1, a, 40)
    assert cache.can_resume(1, 40)
    prefill(cache, 1, a + [7], start=40)


class _MemoryTier:
    """A byte tier held in a dict, following the ByteTier protocol of the tiers package: the
    store's wiring to the lower tiers (runs written on host eviction, one find + one read per
    load, corrupt bytes reported) checked without a disk or server."""

    name = "disk"

    def __init__(self, budget: int) -> None:
        self.budget, self.runs, self.ptr = budget, {}, {}
        self.invalid = self.finds = self.reads = 0

    def find_blocks(self, keys):
        self.finds += 1
        return [self.ptr.get(k) for k in keys]

    def read_runs(self, run_keys):
        self.reads += 1
        return [self.runs.get(k) for k in run_keys]

    def write_run(self, run_key, block_keys, data):
        if len(data) > self.budget:
            return False
        self.runs[run_key] = bytes(data)
        for i, k in enumerate(block_keys):
            self.ptr[k] = (run_key, i)
        return True

    def remove_run(self, run_key):
        self.runs.pop(run_key, None)
        self.ptr = {k: v for k, v in self.ptr.items() if v[0] != run_key}

    def report_invalid(self, run_key):
        self.invalid += 1
        self.remove_run(run_key)

    def clear(self):
        n = len(self.runs)
        self.runs.clear()
        self.ptr.clear()
        return n

    def stats(self):
        used = sum(map(len, self.runs.values()))
        return {"bytes_used": used, "bytes_evictable": used, "bytes_pinned": 0,
                "bytes_free": self.budget - used, "entries": len(self.runs), "hits": 0,
                "misses": 0, "invalid": self.invalid, "errors": 0, "budget": self.budget}

    def close(self):
        pass


@needs_snapshot
def test_lower_tier_wiring_write_on_eviction_read_on_miss_and_corrupt_bytes_miss():
    cache = small_cache(max_seqs=4, capacity=16)
    one = cache.config.nbytes(20)
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4, host_bytes=one)
    tier = _MemoryTier(1 << 20)
    from numbakv.prefix.writer import TierWriter
    store._lower = [tier]
    store._writer = TierWriter([tier])
    store.write_through = False       # this test follows eviction: write-through has its own
    store._counts["disk"] = {"hits": 0, "misses": 0}
    prompts = [list(range(i * 100, i * 100 + 20)) for i in range(3)]
    for toks in prompts:              # 1 in cells, 1 in host, the oldest written down
        prefill(cache, 0, toks)
        store.save(0, toks)
        cache.seq_rm(0)
    assert store._writer.flush(10)   # the eviction's write (store.flush would write all)
    assert len(tier.runs) == 1 and store.index.match(store._root(None),
                                                     np.asarray(prompts[0], "<i8").tobytes()).n == 0
    assert store.match(prompts[0] + [5]) == 20
    finds = tier.finds
    assert store.match(prompts[0][:18] + [5]) == 16   # lower tiers: whole blocks (keys)
    assert store.load(1, prompts[0][:18] + [5]) == 16
    assert tier.finds == finds + 2 and tier.reads == 1
    check_holds(cache, 1, prompts[0], 16)
    cache.seq_rm(1)
    key = next(iter(tier.runs))
    tier.runs[key] = tier.runs[key][:-7] + b"garbage"          # corrupt: a miss, reported
    for e in list(store.index.entries.values()):
        if e.tokens_bytes()[:8] == np.asarray(prompts[0][:1], "<i8").tobytes():
            store._drop_entry(e)
            if e.tier == "host":
                store.host.remove(e.nbytes)
            else:
                store._release_seq(e.seq)
    assert store.load(1, prompts[0]) == 0 and tier.invalid == 1
    assert cache.seq_pos_max(1) == -1 and key not in tier.runs


@needs_snapshot
def test_without_retained_sequences_save_goes_to_host_ram():
    cache = small_cache()
    store = PrefixStore(cache, block_tokens=4, host_bytes=1 << 20)
    toks = list(range(30))
    prefill(cache, 0, toks)
    assert store.save(0, toks) == 30
    cache.seq_rm(0)
    assert cache.n_used == 0 and store.stats()["tiers"]["host"]["entries"] == 1
    assert store.load(1, toks[:25]) == 25
    check_holds(cache, 1, toks, 25)


@needs_snapshot
def test_demo_segment_reuses_from_every_tier_and_checks_rows():
    from numbakv.tools.demo_prefix import format_prefix_demo, run_prefix_demo
    res = run_prefix_demo(users=6, turns=3, system=48, message=8, reply=8)
    t = res["totals"]
    assert t["cells"] > 0 and t["host"] > 0 and t["computed"] > 0
    assert "reused" in format_prefix_demo(res)


@needs_snapshot
def test_close_writes_local_entries_down_to_the_lower_tiers():
    cache = small_cache()
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4, host_bytes=1 << 20)
    tier = _MemoryTier(1 << 20)
    from numbakv.prefix.writer import TierWriter
    store._lower = [tier]
    store._writer = TierWriter([tier])
    store.write_through = False                # close() writes them down (write-through off)
    store._counts["disk"] = {"hits": 0, "misses": 0}
    for toks in (list(range(20)), list(range(50, 70))):
        prefill(cache, 0, toks)
        store.save(0, toks)
        cache.seq_rm(0)
    assert len(tier.runs) == 0                 # one in cells, one in host RAM
    store.close()
    assert len(tier.runs) == 2 and cache.n_used == 0


class _GatedTier(_MemoryTier):
    """A memory tier whose writes wait for ``gate`` (a disk or server slower than the request),
    or raise (``fail``): what the background writer must absorb."""

    def __init__(self, budget: int, fail: bool = False) -> None:
        import threading
        super().__init__(budget)
        self.gate, self.fail, self.started = threading.Event(), fail, threading.Event()

    def write_run(self, run_key, block_keys, data):
        self.started.set()
        if self.fail:
            raise OSError("tier exploded")
        assert self.gate.wait(30)
        return super().write_run(run_key, block_keys, data)

    def close(self):
        pass


def _store_with_tier(tier, cache=None, queue=256 << 20, **kw):
    from numbakv.prefix.writer import TierWriter
    cache = cache or small_cache()
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4, **kw)
    store._lower = [tier]
    store._writer = TierWriter([tier], max_bytes=queue)
    store._counts["disk"] = {"hits": 0, "misses": 0}
    return cache, store


@needs_snapshot
def test_write_through_is_asynchronous_and_flush_waits():
    """A save reaches the lower tier without waiting for it: the tier's write is held on a gate
    while save() returns and the next save proceeds; flush() then waits for both."""
    tier = _GatedTier(1 << 20)
    cache, store = _store_with_tier(tier)
    a, b = list(range(20)), list(range(50, 70))
    for toks in (a, b):
        prefill(cache, 0, toks)
        assert store.save(0, toks) == 20     # returns while the tier write is blocked
        cache.seq_rm(0)
    assert tier.started.wait(10) and len(tier.runs) == 0
    assert store.stats()["writer"]["pending"] == 2
    tier.gate.set()
    assert store.flush(30) and len(tier.runs) == 2
    st = store.stats()["writer"]
    assert st["written"] == 2 and st["pending"] == 0 and st["pending_bytes"] == 0
    stored = [e for e in store.take_events() if e["type"] == "BlockStored"
              and e["medium"] == "disk"]
    assert len(stored) == 2                  # events for the lower tier, on the store's thread
    # the same prompt saved again: nothing written twice (no copy, no job)
    prefill(cache, 0, a)
    store.save(0, a)
    cache.seq_rm(0)
    assert store.stats()["writer"]["queued"] == 2
    store.close()


@needs_snapshot
def test_write_through_queue_is_bounded_and_flush_writes_the_rest():
    tier = _GatedTier(1 << 20)
    one = small_cache().config.nbytes(20)
    # room for one run's bytes; host RAM takes what leaves the cells (no demotion write)
    cache, store = _store_with_tier(tier, queue=one, host_bytes=1 << 20)
    prompts = [list(range(i * 100, i * 100 + 20)) for i in range(4)]
    for toks in prompts[:3]:
        prefill(cache, 0, toks)
        store.save(0, toks)
        cache.seq_rm(0)
    st = store.stats()["writer"]
    assert st["refused"] >= 1 and st["pending_bytes"] <= one   # bounded, never blocking
    tier.gate.set()
    assert store.flush(30)
    # every entry the store kept reached the tier (the refused ones written by flush)
    kept = {e["tokens"][0] for e in store.entries()}
    assert len(tier.runs) >= len(kept) and store.stats()["writer"]["pending"] == 0
    store.close()


@needs_snapshot
def test_write_through_errors_are_counted_not_raised():
    tier = _GatedTier(1 << 20, fail=True)
    cache, store = _store_with_tier(tier)
    toks = list(range(20))
    prefill(cache, 0, toks)
    assert store.save(0, toks) == 20          # the tier raising never reaches the request
    cache.seq_rm(0)
    assert store.flush(30)
    assert store.stats()["writer"]["errors"] >= 1
    assert store.load(1, toks) == 20           # the local tiers still serve it
    cache.seq_rm(1)
    store.close()


@needs_snapshot
def test_context_manager_closes_and_store_is_not_kept_alive():
    import gc
    import weakref
    from numbakv.prefix import store as store_mod
    cache = small_cache()
    with PrefixStore(cache, retain_seqs=[3], block_tokens=4) as store:
        assert store in store_mod._LIVE
    assert store._closed and store not in store_mod._LIVE
    assert getattr(cache, "_room_provider", None) is None
    tier = _MemoryTier(1 << 20)
    cache2, other = _store_with_tier(tier)
    toks = list(range(20))
    prefill(cache2, 0, toks)
    other.save(0, toks)
    ref = weakref.ref(other)
    writer = other._writer
    cache2._room_provider = None               # the cache's hook is the only other reference
    del other
    gc.collect()
    assert ref() is None                        # neither the exit registry nor the writer
    assert writer.flush(10) and len(tier.runs) == 1


def test_write_through_and_queue_arguments_are_checked():
    cache = small_cache()
    for kw in ({"write_through": 1}, {"write_queue_bytes": -1}, {"write_queue_bytes": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            PrefixStore(cache, retain_seqs=[3], **kw)
    assert getattr(cache, "_room_provider", None) is None
    with PrefixStore(cache, retain_seqs=[3]) as store:
        with pytest.raises(ValueError, match="timeout"):
            store.flush(-1)
        assert store.flush() is True            # no lower tiers: nothing to wait for
