"""The disk and Redis tiers under a real PrefixStore, across processes: process A (a child) saves
a prefix that the store demotes to the lower tier; this process, with a fresh cache and store,
loads it bit-exact. Faults (server killed, corrupted bytes) are misses, never exceptions."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import numbakv as nkv

if not hasattr(nkv, "PrefixStore"):
    pytest.skip("needs nkv.PrefixStore", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tier_worker as tw  # noqa: E402
from redis_server import own_redis_server, redis_server, redis_url  # noqa: E402,F401
from test_tiers_disk import last_json, worker  # noqa: E402


@pytest.fixture(params=["disk", "redis"])
def spec(request, tmp_path):
    if request.param == "disk":
        return str(tmp_path / "store")
    pytest.importorskip("redis")
    return request.getfixturevalue("redis_url")


def reference_rows():
    """seq 0's snapshot in a cache filled exactly as process A filled it."""
    cache = tw.store_cache()
    tw.fill(cache, 0, 40, seed=11)
    return cache.export_seq(0)


def assert_same_snapshot(a, b):
    assert np.array_equal(a.positions, b.positions)
    for pa, pb in zip(a.parts, b.parts):
        for xa, xb in zip(list(pa.keys) + list(pa.values), list(pb.keys) + list(pb.values)):
            assert np.asarray(xa).tobytes() == np.asarray(xb).tobytes()


def test_another_process_hits_bit_exact(spec):
    out = last_json(worker("store_save", spec))
    assert sum(out["lower_entries"].values()) == 1
    cache = tw.store_cache()
    store = tw.open_store(cache, spec)
    try:
        assert store.match(tw.prompt()) == 40
        # the lower tiers hold whole runs keyed by block: a longer prompt reuses the full
        # blocks (its partial last block differs from the stored 8-token tail)
        assert store.match(tw.prompt() + [7, 8, 9]) == 32
        assert store.load(0, tw.prompt()) == 40
        assert_same_snapshot(cache.export_seq(0), reference_rows())
        name = "disk" if "://" not in spec else "redis"
        st = store.stats()["tiers"][name]
        assert st["hits"] >= 1 and st["entries"] == 1
    finally:
        cache.seq_rm(0)


def test_salts_isolate_tenants(spec):
    assert sum(last_json(worker("store_save", spec, "tenant-a"))["lower_entries"].values()) == 1
    cache = tw.store_cache()
    other = tw.open_store(cache, spec, salt=b"tenant-b")
    assert other.match(tw.prompt()) == 0 and other.load(0, tw.prompt()) == 0
    assert other.match(tw.prompt(), salt=b"tenant-a") == 40
    assert other.load(0, tw.prompt(), salt=b"tenant-a") == 40
    assert_same_snapshot(cache.export_seq(0), reference_rows())


def test_corrupted_run_is_a_miss_and_dropped(spec):
    assert sum(last_json(worker("store_save", spec))["lower_entries"].values()) == 1
    if "://" in spec:
        import redis
        raw = redis.Redis.from_url(spec)
        [key] = raw.keys("nkv:t1:*:r:*")
        value = bytearray(raw.get(key))
        value[-5] ^= 0x40
        raw.set(key, bytes(value))
        raw.close()
    else:
        runs = [os.path.join(dp, f) for dp, _, fs in os.walk(spec) for f in fs
                if f.endswith(".run")]
        with open(runs[0], "r+b") as f:
            f.seek(-5, os.SEEK_END)
            b = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x40]))
    cache = tw.store_cache()
    store = tw.open_store(cache, spec)
    assert store.load(0, tw.prompt()) == 0
    assert cache.seq_pos_max(0) == -1                 # nothing placed
    name = "disk" if "://" not in spec else "redis"
    st = store.stats()["tiers"][name]
    assert st["invalid"] == 1 and st["entries"] == 0  # counted and dropped
    assert store.load(0, tw.prompt()) == 0


def test_server_killed_mid_run_load_is_a_miss(own_redis_server):
    url = own_redis_server.url + "?socket_timeout=0.5"
    assert last_json(worker("store_save", url))["lower_entries"] == {"redis": 1}
    cache = tw.store_cache()
    store = tw.open_store(cache, url)
    assert store.match(tw.prompt()) == 40
    own_redis_server.stop()
    assert store.match(tw.prompt()) == 0
    assert store.load(0, tw.prompt()) == 0 and cache.seq_pos_max(0) == -1
    # the engine keeps serving: save and load through the cells still work
    tw.fill(cache, 0, 40, seed=11)
    store.save(0, tw.prompt())
    cache.seq_rm(0)
    assert store.load(0, tw.prompt()) == 40
    assert store.stats()["tiers"]["redis"]["errors"] >= 1
