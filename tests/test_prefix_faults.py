"""Regression tests of issue 37: defects found by attacking the prefix store, its tiers, the
transfer and the copy-on-write shift from outside. Each test failed on the code before its fix;
the model tests (test_prefix_stateful.py, test_tiers_model.py, model_cells.py) generate the
class of input that found each one."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import numbakv as nkv

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from prefix_helpers import check_holds, prefill, small_cache  # noqa: E402
from redis_server import redis_server, redis_url  # noqa: E402,F401


@pytest.fixture(params=["cells", "host", "disk", "redis"])
def tier(request, tmp_path):
    """Store arguments that put a save into one tier: cells (a retained sequence), host RAM,
    a disk directory, a Redis server."""
    if request.param == "cells":
        return dict(retain_seqs=[3])
    if request.param == "host":
        return dict(host_bytes=1 << 20)
    if request.param == "disk":
        return dict(disk_dir=str(tmp_path / "store"), disk_bytes=1 << 22, model_id="test/faults")
    pytest.importorskip("redis")
    return dict(remote=request.getfixturevalue("redis_url"), model_id="test/faults")


def sliding_cache(**kw):
    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=2, head_dim=4, dtype="float32", capacity=64,
                          max_seqs=4, device="cpu")
    return nkv.CausalCache(cfg, swa_window=4, swa_memory=8, **kw)


# -- 1: a sliding-window prefix the window already pruned is never served -----------------------
def test_pruned_sliding_prefix_is_not_saved_or_served(tier):
    cache = sliding_cache()
    store = nkv.PrefixStore(cache, **tier)
    try:
        tokens = list(range(100, 130))
        prefill(cache, 0, tokens, chunk=4)          # the window keeps positions 20..29 only
        assert cache.seq_pos_min(0) > 6
        assert store.save(0, tokens[:6]) == 0       # no cell holds positions 0..5
        store.flush()
        assert store.match(tokens[:6]) == 0
        assert store.load(1, tokens[:6]) == 0
        assert cache.seq_pos_max(1) == -1
        # what the window still holds is kept and served whole
        n = store.save(0, tokens)
        store.flush()
        if n:
            got = store.load(1, tokens)
            assert got == n and cache.can_resume(1, n)
            check_holds(cache, 1, tokens, n)
    finally:
        store.close()


# -- helpers of the lower-tier tests --------------------------------------------------------------
def lower_store(spec, cache=None, **kw):
    """A store whose saves go straight to one lower tier (no cells, no host RAM)."""
    cache = cache or small_cache()
    where = dict(remote=spec) if "://" in spec else dict(disk_dir=spec, disk_bytes=1 << 22)
    return cache, nkv.PrefixStore(cache, block_tokens=16, model_id="test/faults", **where, **kw)


def prompt(seed: int, n: int = 64):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 30000, n)]


def saved(spec, *prompts):
    """Save each prompt through a store that then closes (another process's runs)."""
    cache, store = lower_store(spec)
    try:
        for i, p in enumerate(prompts):
            prefill(cache, 0, p)
            store.save(0, p)
            store.flush()
            cache.seq_rm(0)
    finally:
        store.close()


def run_files(directory):
    """{run key: path} of every run file under ``directory``."""
    out = {}
    for dp, _, fs in os.walk(directory):
        for f in fs:
            if f.endswith(".run"):
                out[f[:-4]] = os.path.join(dp, f)
    return out


def run_of(store, p) -> str:
    """The run key a saved prompt ``p`` is stored under (its last block's key)."""
    from numbakv.prefix.keys import block_keys
    return block_keys(np.asarray(p, np.int64), store.block_tokens, store._root(None))[-1]


@pytest.fixture(params=["disk", "redis"])
def spec(request, tmp_path):
    if request.param == "disk":
        return str(tmp_path / "store")
    pytest.importorskip("redis")
    return request.getfixturevalue("redis_url")


def assert_miss_then_heals(spec, p, expected_tier):
    """``p``'s stored bytes are bad: a fresh store (a restart) never serves them, ``match``
    stops promising after the failed load, and saving ``p`` again serves it whole."""
    cache, store = lower_store(spec)
    try:
        if store.match(p):
            assert store.load(1, p) == 0
            assert cache.seq_pos_max(1) == -1
            st = store.stats()["tiers"][expected_tier]
            assert st["invalid"] >= 1
        else:       # refused when the tier opened (e.g. a symlink is not a run file)
            assert store.stats()["tiers"][expected_tier]["foreign_files"] >= 1
        n = store.match(p)                          # 3: never a promise load cannot keep
        assert store.load(1, p) == n
        if n:
            check_holds(cache, 1, p, n)
            cache.seq_rm(1)
        prefill(cache, 0, p)
        assert store.save(0, p) == len(p)           # 3: a fresh save replaces the bad entry
        store.flush()
        cache.seq_rm(0)
        assert store.match(p) == len(p)
        assert store.load(1, p) == len(p)
        check_holds(cache, 1, p, len(p))
    finally:
        store.close()


# -- 2: stored bytes are bound to their key ----------------------------------------------------
@pytest.mark.parametrize("how", ["copy", "symlink"])
def test_disk_run_under_another_runs_name_is_never_served(tmp_path, how):
    spec = str(tmp_path / "store")
    a, b = prompt(1), prompt(2)
    saved(spec, a, b)
    _, probe = lower_store(spec)
    ka, kb = run_of(probe, a), run_of(probe, b)
    probe.close()
    files = run_files(spec)
    os.unlink(files[ka])
    if how == "copy":
        with open(files[kb], "rb") as src, open(files[ka], "wb") as dst:
            dst.write(src.read())                   # same size: the reopen's size check passes
    else:
        os.symlink(files[kb], files[ka])
    assert_miss_then_heals(spec, a, "disk")


def test_redis_pointer_or_value_of_another_run_is_never_served(redis_url):
    import redis
    a, b, c = prompt(1), prompt(2), prompt(3)
    saved(redis_url, a, b, c)
    _, probe = lower_store(redis_url)
    ka, kb, kc = run_of(probe, a), run_of(probe, b), run_of(probe, c)
    probe.close()
    raw = redis.Redis.from_url(redis_url)
    try:
        [meta] = raw.keys("nkv:t1:*:meta")
        prefix = meta.decode()[:-len("meta")]
        blocks_a = raw.hget(meta, ka).decode().split("|")[1].split(",")
        raw.set(prefix + "b:" + blocks_a[-1], f"{kb}:3")           # pointer -> another run
        raw.set(prefix + "r:" + kc, raw.get(prefix + "r:" + kb))   # value of another run
    finally:
        raw.close()
    assert_miss_then_heals(redis_url, a, "redis")
    assert_miss_then_heals(redis_url, c, "redis")
    # b itself was never harmed
    cache, store = lower_store(redis_url)
    assert store.load(1, b) == len(b)
    check_holds(cache, 1, b, len(b))
    store.close()


# -- 3 and 4: a damaged run file is a counted miss, and a fresh save heals it -----------------
@pytest.mark.parametrize("damage", ["truncate", "payload_length", "header_length", "empty"])
def test_damaged_disk_run_is_a_miss_and_a_save_heals_it(tmp_path, damage):
    import struct
    spec = str(tmp_path / "store")
    p = prompt(5, 128)
    saved(spec, p)
    [path] = run_files(spec).values()
    with open(path, "r+b") as f:
        if damage == "truncate":
            f.truncate(os.path.getsize(path) - 100)
        elif damage == "payload_length":                 # one flipped bit of the u64 length
            f.seek(12)
            (plen,) = struct.unpack("<Q", f.read(8))
            f.seek(12)
            f.write(struct.pack("<Q", plen ^ (1 << 62)))
        elif damage == "header_length":
            f.seek(8)
            f.write(struct.pack("<I", 0xFFFFFFF0))
        else:
            f.truncate(0)
    assert_miss_then_heals(spec, p, "disk")


# -- 11: save() returns what it stored, in any tier --------------------------------------------
def test_save_returns_what_a_lower_tier_stored(spec):
    cache, store = lower_store(spec)
    try:
        p = prompt(7)
        prefill(cache, 0, p)
        assert store.save(0, p) == len(p)
        store.flush()
        assert store.save(0, p) == len(p)           # already there: still kept
        store.flush()
        cache.seq_rm(0)
        assert store.match(p) == len(p)
    finally:
        store.close()
    cache, store = lower_store(spec, host_bytes=1 << 20)
    try:
        prefill(cache, 0, p)
        assert store.save(0, p) == len(p)           # host RAM
        store.flush()
        assert store.save(0, p) == len(p)           # host RAM already keeps it
        store.flush()
    finally:
        store.close()


# -- 13, 14: shared_shift="copy" --------------------------------------------------------------
def copy_cache(capacity=16, max_seqs=2):
    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=2, head_dim=4, dtype="float32",
                          capacity=capacity, max_seqs=max_seqs, device="cpu")
    return nkv.CausalCache(cfg, shift=nkv.RopeShift(dim=4), shared_shift="copy")


def cells_of(cache, seq):
    """{cell: position} of seq."""
    cells = cache.cells.seq_cells(seq)
    return {int(c): int(cache.cells._pos[c]) for c in cells}


def test_copy_shift_of_a_position_held_twice_keeps_both_cells():
    cache = copy_cache()
    prefill(cache, 0, [10, 11])                   # seq 0 at positions 0, 1
    cache.seq_cp(0, 1, 0, 1)                      # position 0's cell shared with seq 1
    cache.seq_add(0, 1, -1, -1)                   # seq 0 now holds position 0 twice
    assert sorted(cells_of(cache, 0).values()) == [0, 0]
    keys = {c: np.asarray(cache.storage.keys[:, c]).copy() for c in cells_of(cache, 0)}
    shared = [c for c in cells_of(cache, 0) if cache.cells.has_seq(c, 1)]
    private = [c for c in cells_of(cache, 0) if c not in shared]
    cache.seq_add(0, 0, -1, 5)
    cache.apply_pending_shifts()
    held = cells_of(cache, 0)
    assert sorted(held.values()) == [5, 5]        # both of seq 0's entries moved, none lost
    assert private[0] in held                     # the private cell moved in place
    assert cells_of(cache, 1) == {shared[0]: 0}   # seq 1 untouched, K/V and all
    np.testing.assert_array_equal(np.asarray(cache.storage.keys[:, shared[0]]), keys[shared[0]])
    cache.cells.check_consistency()


def test_copy_seq_div_copies_only_cells_whose_position_moves():
    cache = copy_cache(capacity=4, max_seqs=2)    # 8 cells
    prefill(cache, 0, [10, 11, 12, 13])
    cache.seq_cp(0, 1)                            # every cell shared
    free = cache.cells.n_free
    cache.seq_div(0, 0, -1, 2)                    # positions 0..3 -> 0, 0, 1, 1: 0 stays
    assert free - cache.cells.n_free == 3         # copies of positions 1, 2, 3 only
    assert sorted(cells_of(cache, 0).values()) == [0, 0, 1, 1]
    assert sorted(cells_of(cache, 1).values()) == [0, 1, 2, 3]
    cache.cells.check_consistency()
    # with exactly the room the moving cells need, it fits (a copy of position 0 did not)
    cache = copy_cache(capacity=3, max_seqs=2)    # 6 cells
    prefill(cache, 0, [10, 11, 12])
    cache.seq_cp(0, 1)
    cache.seq_div(0, 0, -1, 2)                    # 0, 1, 2 -> 0, 0, 1: two copies, 3 free
    assert sorted(cells_of(cache, 0).values()) == [0, 0, 1]


# -- 7: a FIFO or a link in place of a run file never blocks nor leaves the directory ----------
@pytest.mark.parametrize("what", ["fifo", "outside_link"])
def test_fifo_or_link_in_place_of_a_run_is_a_bounded_miss(tmp_path, what):
    import subprocess
    spec = str(tmp_path / "store")
    p = prompt(9)
    saved(spec, p)
    [(key, path)] = run_files(spec).items()
    outside = tmp_path / "outside.run"
    with open(path, "rb") as f:
        outside.write_bytes(f.read())
    # a child process, so a blocking open cannot hang the test run
    code = f"""
import os, sys
sys.path.insert(0, {HERE!r})
import test_prefix_faults as t
spec, path = {spec!r}, {path!r}
cache, store = t.lower_store(spec)     # opened while the run file is whole
os.unlink(path)
if {what!r} == "fifo":
    os.mkfifo(path)
else:
    os.symlink({str(outside)!r}, path)
print(store.load(1, t.prompt(9)), cache.seq_pos_max(1), store.match(t.prompt(9)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "-1", "0"]


# -- 12: an unusable index.log is named --------------------------------------------------------
def test_unusable_index_log_is_named(tmp_path):
    spec = str(tmp_path / "store")
    saved(spec, prompt(1))
    [ns_dir] = [d for d in os.listdir(spec) if d.startswith("t1.")]
    log = os.path.join(spec, ns_dir, "index.log")
    os.unlink(log)
    os.mkdir(log)
    with pytest.raises(ValueError, match=r"/index\.log"):
        lower_store(spec)


# -- 10: Redis books that are not numbers are rebuilt, not the end of every write --------------
@pytest.mark.parametrize("what", ["bytes", "stats"])
def test_redis_books_that_are_not_numbers_are_rebuilt(redis_url, what):
    import redis
    from numbakv.prefix.tiers.redis import RedisTier
    ns = "nkv1-00000000000000aa"
    tier = RedisTier(ns, 1 << 20, redis_url)
    try:
        assert tier.write_run("ab" * 8, ["cd" * 8, "ab" * 8], b"x" * 1000)
        raw = redis.Redis.from_url(redis_url)
        prefix = f"nkv:t1:{{{ns}}}:"
        if what == "bytes":
            raw.set(prefix + "bytes", b"not a number")
        else:
            raw.hset(prefix + "stats", mapping={"writes": "x", "evictions": "y", "invalid": "z"})
        for i in range(3):
            assert tier.write_run(f"{i:02x}" * 8, [f"{i:02x}" * 8], b"y" * 500)
        tier.report_invalid("00" * 8)
        st = tier.stats()
        assert st["entries"] == 3
        expected = sum(int(v.decode().split("|")[0])
                       for v in raw.hgetall(prefix + "meta").values())
        assert st["bytes_used"] == expected == int(raw.get(prefix + "bytes"))
        if what == "bytes":
            assert st["books_rebuilt"] == 1
        assert tier.clear() == 3
        raw.close()
    finally:
        tier.close()


# -- 6: on sliding windows, an entry beside the query's path is still found --------------------
def test_sliding_match_finds_an_entry_ending_beside_the_query_path():
    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=2, head_dim=4, dtype="float32", capacity=48,
                          max_seqs=4, device="cpu")
    cache = nkv.CausalCache(cfg, swa_window=4, swa_memory=8)
    store = nkv.PrefixStore(cache, retain_seqs=[2, 3], block_tokens=4, checkpoint_tail=3)
    try:
        prefill(cache, 0, [1], chunk=1)
        assert store.save(0, [1]) == 1
        assert store.pin([1]) == 1
        cache.seq_rm(0)
        long = [1] + [0] * 8               # its first block [1, 0, 0, 0] is beside [1]
        prefill(cache, 0, long, chunk=1)   # the window prunes: that entry resumes from 5 only
        store.save(0, long)
        cache.seq_rm(0)
        for query in ([1, 0], [1, 0, 0], [1, 7, 7]):
            assert store.match(query) == 1     # the pinned one-token prefix, for every prompt
            assert store.load(1, query) == 1
            check_holds(cache, 1, query, 1)
            cache.seq_rm(1)
    finally:
        store.close()


# -- 8: the KV event log is bounded in bytes: RSS flat over 5,000 save/load cycles --------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_event_log_bounded_in_bytes_rss_flat_over_5000_cycles():
    import gc
    cache = small_cache(max_seqs=4, capacity=128)
    store = nkv.PrefixStore(cache, retain_seqs=[3], block_tokens=16, event_bytes=1 << 20)
    rng = np.random.default_rng(0)

    def cycle(i):
        p = [int(t) for t in rng.integers(0, 30000, 96)]   # a new prompt each time
        prefill(cache, 0, p, chunk=96)
        store.save(0, p)               # evicts the previous entry: stored + removed events
        cache.seq_rm(0)
        assert store.load(1, p) == 96
        cache.seq_rm(1)
    try:
        for i in range(300):           # warm up (numba, allocator pools)
            cycle(i)
        gc.collect()
        before = _rss()
        for i in range(5000):
            cycle(i)
        gc.collect()
        grown = _rss() - before
        # unbounded: ~10,000 events x ~4 KB = ~40 MB; bounded: the 1 MiB log + noise
        assert grown < 8 << 20, f"RSS grew {grown / 2**20:.1f} MiB over 5,000 cycles"
        assert store.events.nbytes <= 1 << 20
        assert store.stats()["events_dropped"] > 0
        assert len(store.take_events()) > 0
    finally:
        store.close()


def test_event_log_off_and_bad_bound():
    cache = small_cache()
    store = nkv.PrefixStore(cache, retain_seqs=[3], event_bytes=0)
    prefill(cache, 0, [1, 2, 3])
    store.save(0, [1, 2, 3])
    assert store.take_events() == [] and store.stats()["events_dropped"] >= 1
    store.close()
    with pytest.raises(ValueError, match="event_bytes"):
        nkv.PrefixStore(small_cache(), event_bytes=-1)


def test_damaged_run_healed_by_a_save_of_the_same_process(tmp_path):
    """3 with write-through: the process that wrote a run and then found it damaged writes it
    again at the next save (it does not trust that it was written once)."""
    spec = str(tmp_path / "store")
    cache, store = lower_store(spec)
    try:
        p = prompt(11)
        prefill(cache, 0, p)
        assert store.save(0, p) == len(p)
        store.flush()
        [path] = run_files(spec).values()
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 50)
        assert store.load(1, p) == 0 and store.match(p) == 0
        assert store.save(0, p) == len(p)
        store.flush()
        cache.seq_rm(0)
        assert store.match(p) == len(p) and store.load(1, p) == len(p)
        check_holds(cache, 1, p, len(p))
    finally:
        store.close()
