"""How the prefix store's byte tiers move rows (issue 36 item 6): runs written from the
snapshot's own arrays (``to_chunks`` + one ``writev``), lower-tier hits read straight into the
cells (``open_run`` + ``import_run``, crc32 checked as the rows arrive, rolled back when bad),
owned rows recycled through a ``BufferPool``, and scattered cells gathered into one buffer."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import numbakv as nkv
from numbakv.errors import StateError
from numbakv.prefix.tiers import DiskTier
from numbakv.prefix.tiers.base import RunReader, check_chunks
from numbakv.prefix.tiers.host import BufferPool, owned_copy
from numbakv.state.snapshot import SeqSnapshot, export_seq, import_run, open_run

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from prefix_helpers import check_holds, prefill, small_cache  # noqa: E402

NS = "nkv1-00000000moves000"


def _filled(tokens, capacity=256, **kw):
    cache = small_cache(capacity=capacity, **kw)
    prefill(cache, 0, tokens)
    return cache


def _rows(snap):
    return [np.asarray(a).tobytes() for p in snap.parts for a in (*p.keys, *p.values)]


def test_to_chunks_joined_is_to_bytes_and_views_the_rows():
    cache = _filled(list(range(40)))
    snap = owned_copy(cache.export_seq(0))
    chunks = snap.to_chunks({"x": "1"})
    assert b"".join(chunks) == snap.to_bytes({"x": "1"})
    # the rows are not copied: a chunk shares memory with each layer's array
    for a in snap.parts[0].keys:
        assert any(np.shares_memory(np.frombuffer(c, np.uint8), a) for c in chunks[1:])
    back = SeqSnapshot.from_bytes(b"".join(chunks))
    assert _rows(back) == _rows(snap) and back.metadata["x"] == "1"


def test_disk_tier_writes_pieces_and_check_chunks_names_the_bad_one(tmp_path):
    keys = [f"{i:032x}" for i in range(1, 4)]
    pieces = [b"abc", memoryview(b"defg"), np.arange(5, dtype=np.uint8)]
    with DiskTier(NS, 1 << 20, str(tmp_path)) as tier:
        assert tier.write_run(keys[-1], keys, pieces)
        assert tier.read_runs([keys[-1]]) == [b"abcdefg" + bytes(range(5))]
        with tier.open_run(keys[-1]) as reader:
            assert reader.size == 12
            a, b = bytearray(4), bytearray(3)
            assert reader.read_into(2, [memoryview(a), memoryview(b)])
            assert bytes(a) == b"cdef" and bytes(b) == b"g\x00\x01"
            assert not reader.read_into(10, [memoryview(bytearray(3))])   # past the end
        assert tier.open_run(f"{99:032x}") is None
        st = tier.stats()
        assert st["hits"] == 2 and st["misses"] == 1
    with pytest.raises(ValueError, match=r"data\[1\]"):
        check_chunks([b"x", 3])


def _disk_store(cache, tmp_path, **kw):
    return nkv.PrefixStore(cache, disk_dir=str(tmp_path / "d"), disk_bytes=1 << 24,
                           model_id="test/moves", **kw)


@pytest.mark.parametrize("scatter", [False, True])
def test_disk_hit_reads_into_the_cells_bit_exact(tmp_path, scatter):
    toks = list(range(100, 160))
    cache = _filled(toks, capacity=256)
    store = _disk_store(cache, tmp_path)
    assert store.save(0, toks) == 60
    assert store.flush(10)
    want = cache.export_seq(0, 0, 48)
    if scatter:   # no run of 48 free cells: seq 2 takes every other cell past seq 0's
        cells = np.arange(60, cache.n_cells, 2, dtype=np.int32)
        cache.cells.apply_batch(cells, np.arange(len(cells), dtype=np.int32),
                                np.full(len(cells), 2, np.int32))
        assert cache.cells.find_contiguous(48) < 0
    # a prompt sharing 48 tokens (3 blocks): only the first 48 rows land, the rest are checked
    n = store.load(1, toks[:48] + [1, 2, 3])
    assert n == 48
    got = cache.export_seq(1)
    assert np.array_equal(got.positions, np.arange(48))
    assert _rows(got) == _rows(want)
    assert store.stats()["tiers"]["disk"]["hits"] >= 1


def test_corrupt_run_read_into_cells_is_rolled_back(tmp_path):
    toks = list(range(64))
    cache = _filled(toks)
    store = _disk_store(cache, tmp_path)
    store.save(0, toks)
    assert store.flush(10)
    runs = tmp_path / "d"
    files = [p for p in runs.rglob("*.run")]
    assert len(files) == 1
    raw = bytearray(files[0].read_bytes())
    raw[-3] ^= 0xFF                       # one row byte: only the crc32 can tell
    files[0].write_bytes(bytes(raw))
    free = cache.cells.n_free
    assert store.load(1, toks) == 0       # a miss, never an exception
    assert cache.seq_pos_max(1) == -1 and cache.cells.n_free == free
    disk = store.stats()["tiers"]["disk"]
    assert disk["invalid"] == 1 and disk["entries"] == 0


def test_open_run_refuses_bytes_that_are_not_a_snapshot():
    with pytest.raises(StateError):
        open_run(RunReader(b"\x10" + b"\0" * 7 + b"{}" + b" " * 14))
    with pytest.raises(StateError):
        open_run(RunReader(b"short"))


def test_import_run_from_memory_reader_and_upto():
    toks = list(range(30))
    cache = _filled(toks)
    snap = cache.export_seq(0)
    dst = small_cache()
    run = open_run(RunReader(snap.to_bytes()))
    assert import_run(dst, 1, run, upto=20) == 20
    check_holds(dst, 1, toks, 20)
    with pytest.raises(ValueError, match="already holds"):
        import_run(dst, 1, run)


def test_buffer_pool_reuses_only_unreferenced_buffers():
    pool = BufferPool(1 << 24)
    cache = _filled(list(range(1024)), capacity=2048)   # 128 KiB: the pool skips tiny ones
    a = owned_copy(cache.export_seq(0), pool)
    base_id = id(a.parts[0].keys[0].base)
    assert pool.allocated == 1
    pool.give(a)
    b = owned_copy(cache.export_seq(0), pool)      # `a` still holds its rows: not reused
    assert pool.reused == 0 and not np.shares_memory(b.parts[0].keys[0], a.parts[0].keys[0])
    del a
    pool.give(b)
    c = owned_copy(cache.export_seq(0), pool)      # now a's buffer is free
    assert pool.reused == 1 and id(c.parts[0].keys[0].base) == base_id
    assert _rows(c) == _rows(cache.export_seq(0))
    pool.trim(0)
    assert pool.idle_bytes == 0


def test_export_gathers_scattered_cells_into_one_buffer():
    cache = small_cache(capacity=64)
    # seq 0 at even cells, seq 1 at odd cells
    cache.cells.apply_batch(np.arange(0, 40, 2, dtype=np.int32), np.arange(20, dtype=np.int32),
                            np.zeros(20, np.int32))
    cache.cells.apply_batch(np.arange(1, 40, 2, dtype=np.int32), np.arange(20, dtype=np.int32),
                            np.ones(20, np.int32))
    cache.storage.keys[...] = np.arange(cache.storage.keys.size, dtype=np.float32).reshape(
        cache.storage.keys.shape)
    taken = []

    def alloc(n):
        taken.append(n)
        return np.empty(n, np.uint8)
    snap = export_seq(cache, 0, alloc=alloc)
    assert len(taken) == 1
    for layer, k in enumerate(snap.parts[0].keys):
        assert np.array_equal(k, cache.storage.keys[layer][0:40:2])
    assert np.array_equal(snap.parts[0].values[1], cache.storage.values[1][0:40:2])
    with pytest.raises(ValueError, match="alloc"):
        export_seq(cache, 0, alloc=3)


# -- chained runs: a growing conversation writes each block once --------------------------------
def _run_files(tmp_path):
    return sorted((tmp_path / "d").rglob("*.run"), key=lambda p: p.stat().st_mtime_ns)


def test_growing_prompt_writes_only_new_blocks_and_loads_through_the_chain(tmp_path):
    turn1 = list(range(1000, 1064))                 # 4 blocks of 16
    turn2 = turn1 + list(range(2000, 2056))         # + 3.5 blocks
    cache = _filled(turn2)
    store = _disk_store(cache, tmp_path)
    assert store.save(0, turn1) == 64 and store.flush(10)
    first = _run_files(tmp_path)
    assert len(first) == 1
    assert store.save(0, turn2) == 120 and store.flush(10)
    files = _run_files(tmp_path)
    assert len(files) == 2
    row_bytes = cache.config.nbytes(1)
    grown = files[-1].stat().st_size
    # the second run holds the 56 new tokens' rows, not the whole 120-token prompt
    assert 56 * row_bytes <= grown < 64 * row_bytes + 8192
    want = cache.export_seq(0, 0, 120)
    # another cache (a restarted process) loads the whole prompt through the chain
    other = small_cache()
    store2 = _disk_store(other, tmp_path)
    assert store2.load(1, turn2) == 120
    assert _rows(other.export_seq(1)) == _rows(want)
    other.seq_rm(1)
    # a prompt that stops inside the chained run's blocks still loads its parents first
    assert store2.load(1, turn2[:100] + [7]) == 96
    assert _rows(other.export_seq(1)) == _rows(cache.export_seq(0, 0, 96))
    other.seq_rm(1)
    # the chained run corrupted: a miss with nothing changed (the parent's rows go too), the
    # bad run dropped; match then promises the parent's blocks only
    raw = bytearray(files[-1].read_bytes())
    raw[-5] ^= 0x55
    files[-1].write_bytes(bytes(raw))
    free = other.cells.n_free
    assert store2.load(1, turn2) == 0
    assert other.seq_pos_max(1) == -1 and other.cells.n_free == free
    assert store2.stats()["tiers"]["disk"]["invalid"] == 1
    assert store2.match(turn2) == 64 and store2.load(1, turn2) == 64
    other.seq_rm(1)
    # the parent gone (evicted elsewhere): the child alone serves nothing and is dropped
    store._writer.forget()
    store.save(0, turn2)                            # writes the chained run again
    assert store.flush(10)
    assert len(_run_files(tmp_path)) == 2
    first[0].unlink()
    assert store2.load(1, turn2) == 0 and other.seq_pos_max(1) == -1
    assert other.cells.n_free == free
    assert len(_run_files(tmp_path)) == 0          # the chained run is gone too
    # (the parent's index line outlives its hand-deleted file until a read finds it gone)
    assert store2.load(1, turn2) == 0 and store2.match(turn2) == 0


def test_chained_run_that_does_not_start_at_its_first_block_is_refused(tmp_path):
    turn1 = list(range(64))
    turn2 = turn1 + list(range(500, 532))
    cache = _filled(turn2)
    store = _disk_store(cache, tmp_path)
    store.save(0, turn1)
    store.save(0, turn2)
    assert store.flush(10)
    tier = store._lower[0]
    from numbakv.prefix.keys import block_keys
    keys = block_keys(np.asarray(turn2, "<i8"), store.block_tokens, store._root(None))
    # forge: a chained run's bytes claiming first block 4 but holding rows from position 0
    from numbakv.prefix.tiers.base import BIND_FIRST, binding
    forged = cache.export_seq(0, 0, 96).copy().to_bytes({**binding(keys), BIND_FIRST: "4"})
    tier.remove_run(keys[-1])
    assert tier.write_run(keys[-1], keys[4:], forged)
    other = small_cache()
    store2 = _disk_store(other, tmp_path)
    assert store2.load(1, turn2) == 0 and other.seq_pos_max(1) == -1
    assert store2.stats()["tiers"]["disk"]["invalid"] == 1


def test_request_thread_hands_over_only_the_new_blocks(tmp_path):
    turn1 = list(range(3000, 3064))
    turn2 = turn1 + list(range(4000, 4040))
    cache = _filled(turn2)
    store = _disk_store(cache, tmp_path)
    sizes = []
    submit = store._writer.submit

    def spy(job):
        sizes.append((int(job.snap.parts[0].positions[0]), job.nbytes))
        return submit(job)
    store._writer.submit = spy
    store.save(0, turn1)
    store.save(0, turn2)          # turn1's job may still be queued: its blocks count as handed
    assert store.flush(10)
    row = cache.config.nbytes(1)
    assert sizes == [(0, 64 * row), (64, 40 * row)]
    other = small_cache()
    assert _disk_store(other, tmp_path).load(1, turn2) == 104
    assert _rows(other.export_seq(1)) == _rows(cache.export_seq(0, 0, 104))


def test_large_run_checksum_overlaps_the_reads_and_still_refuses_damage(tmp_path):
    """Runs of >= 8 MiB compute their crc32 on a helper thread beside the reads."""
    from numbakv.state import snapshot as sn
    cfg = nkv.CacheConfig(4, 8, 64, dtype="float16", capacity=4096, max_seqs=4, device="cpu")
    cache = nkv.CausalCache(cfg)
    toks = list(range(2304))
    rng = np.random.default_rng(3)
    for lo in range(0, len(toks), 512):
        pos = np.arange(lo, lo + 512)
        cache.start_forward(pos, np.zeros(512, np.int32))
        for layer in range(4):
            cache.set_layer(layer)
            kv = rng.standard_normal((512, 8, 64)).astype("float16")
            cache.put(kv, -kv)
    data = cache.export_seq(0).to_bytes()
    assert len(data) >= sn._PIPELINE_BYTES
    dst = nkv.CausalCache(cfg)
    assert import_run(dst, 1, open_run(RunReader(data)), upto=2000) == 2000
    assert _rows(dst.export_seq(1)) == _rows(cache.export_seq(0, 0, 2000))
    assert sn._CRC_WORKER[1] is not None       # the helper thread took the checksum
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 1
    free = dst.cells.n_free
    with pytest.raises(StateError, match="checksum"):
        import_run(dst, 2, open_run(RunReader(bytes(bad))))
    assert dst.seq_pos_max(2) == -1 and dst.cells.n_free == free
