"""The disk and Redis tiers under a real PrefixStore, across processes: process A (a child) saves
a prefix that the store demotes to the lower tier; this process, with a fresh cache and store,
loads it bit-exact. Faults (server killed, corrupted bytes) are misses, never exceptions."""

from __future__ import annotations

import json
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


def _cache_and_store(spec_kw, model_id):
    import numbakv as nkv
    cache = tw.store_cache()
    return cache, nkv.PrefixStore(cache, retain_seqs=(1,), model_id=model_id, **spec_kw)


@pytest.mark.parametrize("salt", [b"", b"tenant"])
def test_two_same_shaped_models_never_see_each_other(tmp_path, redis_url, salt):
    """Two models of identical shapes (same cache config: only the weights differ) sharing one
    disk directory AND one Redis server: neither ever sees the other's entries, in any tier,
    whichever saved first; each still hits its own, bit-exact."""
    pytest.importorskip("redis")
    shared = {"disk_dir": str(tmp_path / "d"), "disk_bytes": 1 << 24, "remote": redis_url,
              "salt": salt}
    cache_a, a = _cache_and_store(shared, "org/base@r1")
    cache_b, b = _cache_and_store(shared, "org/base-instruct@r1")
    assert a.namespace != b.namespace
    tw.fill(cache_a, 0, 40, seed=11)          # model A's K/V for the prompt
    assert a.save(0, tw.prompt()) == 40
    a_rows = cache_a.export_seq(0)
    cache_a.seq_rm(0)
    a.flush() if hasattr(a, "flush") else a.close()   # down to disk AND Redis
    assert sum(a.stats()["tiers"][t]["entries"] for t in ("disk", "redis")) >= 1 \
        if not a._closed else True
    # model B: same tokens, same shapes, same directory and server: a miss everywhere
    assert b.match(tw.prompt()) == 0
    assert b.load(0, tw.prompt()) == 0 and cache_b.seq_pos_max(0) == -1
    st = b.stats()["tiers"]
    assert st["disk"]["entries"] == 0 and st["redis"]["entries"] == 0
    # B saves its own K/V for the same tokens: A (a fresh store of model A) still reads A's
    tw.fill(cache_b, 0, 40, seed=99)
    assert b.save(0, tw.prompt()) == 40
    cache_b.seq_rm(0)
    b.close()
    if not a._closed:
        a.close()
    for only in ({"disk_dir": shared["disk_dir"], "disk_bytes": 1 << 24},
                 {"remote": redis_url}):
        cache_c, c = _cache_and_store({**only, "salt": salt}, "org/base@r1")
        assert c.load(0, tw.prompt()) == 40
        assert_same_snapshot(cache_c.export_seq(0), a_rows)
        c.close()
    # and a third model id sees nothing at all
    cache_d, d = _cache_and_store(shared, "org/base@r2")
    assert d.match(tw.prompt()) == 0
    d.close()


def test_model_id_required_for_shared_tiers(tmp_path):
    import numbakv as nkv
    cache = tw.store_cache()
    for kw in ({"disk_dir": str(tmp_path), "disk_bytes": 1 << 20},
               {"remote": "redis://127.0.0.1:1/0"}):
        with pytest.raises(ValueError, match="model_id"):
            nkv.PrefixStore(cache, retain_seqs=(1,), **kw)
    for bad in ("", "  ", b"org/m", 3):
        with pytest.raises(ValueError, match="model_id"):
            nkv.PrefixStore(cache, retain_seqs=(1,), model_id=bad)
    assert getattr(cache, "_room_provider", None) is None   # nothing changed
    store = nkv.PrefixStore(cache, retain_seqs=(1,))       # tiers 0/1 only: optional
    assert store.model_id is None
    store.close()
    store = nkv.PrefixStore(cache, retain_seqs=(1,), model_id="m")
    assert store.model_id == "m" and store.fingerprint["model_id"] == "m"
    store.close()


@pytest.mark.parametrize("mode", ["flush", "through"])
def test_saves_reach_the_lower_tiers_live_and_survive_sigkill(spec, mode):
    """Write-through: process A saves a prefix (kept in its cells, never evicted) and, after
    ``flush()`` or just after its background writer finished (no flush, no close), a second
    LIVE process sharing the directory / server hits it; then A is killed with SIGKILL (no
    close, no atexit) and a fresh process still loads it bit-exact."""
    import json
    import signal
    import subprocess
    from test_tiers_disk import ENV
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "tier_worker.py"),
                             "store_save_live", spec, mode], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:] if proc.poll() is not None else "no output"
        assert json.loads(line)["saved"]["written"] == 1
        live_cache = tw.store_cache()
        live = tw.open_store(live_cache, spec)           # process B, while A still runs
        assert live.match(tw.prompt()) == 40
        live.close()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    cache = tw.store_cache()
    with tw.open_store(cache, spec) as store:             # a fresh process after the crash
        assert store.load(0, tw.prompt()) == 40
        assert_same_snapshot(cache.export_seq(0), reference_rows())
        cache.seq_rm(0)


def test_exit_without_close_still_writes(spec):
    """A process that saves and simply exits (no flush, no close): the exit hook closes the
    store, so the next process finds the prefix."""
    assert worker("store_save_live", spec, "exit").returncode == 0
    cache = tw.store_cache()
    with tw.open_store(cache, spec) as store:
        assert store.load(0, tw.prompt()) == 40
        assert_same_snapshot(cache.export_seq(0), reference_rows())
        cache.seq_rm(0)


def test_write_through_keeps_the_disk_budget(tmp_path):
    """Every save is written through, and the disk tier still never holds more than its
    budget: older runs are evicted (least recently used) to make room."""
    import numbakv as nkv
    cache = tw.store_cache(capacity=256)
    budget = 3 * cache.config.nbytes(40) + 4096       # about three 40-token runs
    with nkv.PrefixStore(cache, retain_seqs=(1,), disk_dir=str(tmp_path), disk_bytes=budget,
                         model_id=tw.MODEL_ID) as store:
        for i in range(8):
            toks = [5000 + 100 * i + j for j in range(40)]
            tw.fill(cache, 0, 40, seed=i)
            store.save(0, toks)
            cache.seq_rm(0)
            assert store.flush(30)
            st = store.stats()["tiers"]["disk"]
            assert st["bytes_used"] <= budget and st["bytes_used"] + st["bytes_free"] == budget
        assert store.stats()["writer"]["written"] == 8 and 1 <= st["entries"] <= 3
        assert st["evictions"] >= 5


def test_runs_record_the_model_id_and_store_stats_shows_it(spec, capsys):
    """Every run's bytes record the store's model id, so `numbakv store stats` tells an
    operator which model each namespace of a shared directory or server serves."""
    from test_tiers_disk import cli_main
    cache = tw.store_cache()
    with tw.open_store(cache, spec, model_id="org/base@r1") as store:
        tw.fill(cache, 0, 40, seed=11)
        store.save(0, tw.prompt())
        assert store.flush(30)
        ns = store.namespace
    main = cli_main()
    assert main(["store", "stats", spec, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["namespaces"][ns]["fingerprint"]["model_id"] == "org/base@r1"
    assert main(["store", "stats", spec]) == 0
    assert "model_id=org/base@r1" in capsys.readouterr().out


def _forked_child_saves(store, cache, out):
    toks = [7000 + i for i in range(40)]
    tw.fill(cache, 0, 40, seed=5)
    store.save(0, toks)
    out.put(bool(store.flush(20)))


def test_a_forked_child_writes_through_with_a_writer_of_its_own(tmp_path):
    """multiprocessing's fork start method copies the store without its writer thread: the
    child starts its own, so its saves still reach the directory (flush does not hang)."""
    import multiprocessing as mp
    if "fork" not in mp.get_all_start_methods():
        pytest.skip("no fork on this platform")
    spec = str(tmp_path / "store")
    cache = tw.store_cache(capacity=128)
    with tw.open_store(cache, spec) as store:
        tw.fill(cache, 0, 40, seed=11)
        store.save(0, tw.prompt())                # the parent's writer thread is running
        assert store.flush(30)
        cache.seq_rm(0)
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_forked_child_saves, args=(store, cache, out))
        child.start()
        try:
            assert out.get(timeout=60) is True
        finally:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
        assert child.exitcode == 0
        assert store.match([7000 + i for i in range(40)]) == 40   # found on the shared disk
