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
