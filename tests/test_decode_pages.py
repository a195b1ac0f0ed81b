"""Page tables extended on the device (numbakv.pages.extend_pages): a decode step grows the
previous pass's lists by its own cells with one small upload and one kernel (the real @cuda.jit
kernel, in the simulator or on a GPU), instead of building every list on the host and uploading
all of it; on the CPU the host lists are copied and appended to (no walk of the cell table).
The extended table must equal the host build after any mix of sequence operations, and what a
decode step uploads must not grow with the cache."""

from __future__ import annotations

import numpy as np
import pytest

import numbakv as nkv
from numbakv import pages
from numbakv.kernels import launch
from conftest import KERNEL_DEVICE  # noqa: E402
from helpers import host  # noqa: E402


@pytest.fixture
def incremental(monkeypatch):
    """The simulator extends page tables as CUDA does (only CUDA and the CPU do by default)."""
    monkeypatch.setattr(pages, "INCREMENTAL_DEVICES", ("cuda", "cpu", "sim"))


def _cache(n_cells=64, max_seqs=4, page_size=1, device=KERNEL_DEVICE, **kw):
    cfg = nkv.CacheConfig(1, 1, 8, dtype="float32", capacity=n_cells, max_seqs=max_seqs,
                          max_batch=16, device=device, page_size=page_size)
    return nkv.CausalCache(cfg, shift=nkv.RopeShift(dim=8), **kw)


def _table_arrays(table):
    return {f: host(getattr(table, f)).astype(np.int64) for f in pages.FIELDS}


def _host_build(cache):
    fwd = cache._forward
    window = cache.swa_window or -1
    return pages.pages_of_table(cache.cells, fwd.positions, fwd.seqs, fwd.causal,
                                window=window, chunk=cache.chunk_size or 0)


def _assert_equal_to_host_build(cache):
    got = cache._host_pages()
    want = _host_build(cache)
    dev = _table_arrays(got.table)
    for f in pages.FIELDS:
        np.testing.assert_array_equal(dev[f], np.asarray(getattr(want, f), np.int64), err_msg=f)
    assert got.trailing == want.trailing
    # the host lists (filled from the host build on first read) and the list bounds
    for f in pages.LAZY_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, f), np.int64),
                                      np.asarray(getattr(want, f), np.int64), err_msg=f)
    pages.check_pages(pages.PageTable(*[host(getattr(got.table, f)) for f in pages.FIELDS]),
                      cache.n_cells)


def _next(cache, s):
    return cache.seq_pos_max(s) + 1


LAYOUTS = {
    "contiguous": dict(),
    # each step's cells scattered over the sequences' pages; copy-on-write after copy_prefix
    "paged": dict(page_size=4, n_cells=96),
    # the lists' fronts move on with the window / the chunks (no memory limit: no pruning)
    "window": dict(swa_window=3, swa_memory=10_000),
    "chunk": dict(chunk_size=4),
}


@pytest.mark.parametrize("device", [KERNEL_DEVICE, "cpu"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_extended_table_equals_the_host_build_after_random_sequence_ops(incremental, layout,
                                                                       device, monkeypatch):
    """On the device (the CUDA kernel) and on the CPU (host lists copied and appended to)."""
    rng = np.random.default_rng(3)
    cache = _cache(device=device, **LAYOUTS[layout])
    extensions = []
    real = pages.extend_pages
    monkeypatch.setattr(pages, "extend_pages",
                        lambda *a, **k: extensions.append(real(*a, **k)) or extensions[-1])
    seqs = [0, 1, 2]
    extended = full = 0
    for step in range(30):
        op = rng.random()
        try:
            if op < 0.08:
                cache.seq_rm(int(rng.choice(seqs)), int(rng.integers(0, 3)), None)
            elif op < 0.14:
                s = int(rng.choice(seqs))
                n = _next(cache, s)
                if n > 2:
                    cache.remove(s, n - 2, n - 1)               # later positions move down
            elif op < 0.18:
                cache.copy_prefix(0, 3, max(1, _next(cache, 0) // 2))
            elif op < 0.22:
                cache.defrag()
        except nkv.NotSupportedError:
            pass
        if op < 0.3 and rng.random() < 0.5:
            chosen = [int(s) for s in rng.permutation(seqs)]    # another sequence order
        else:
            chosen = seqs
        pos, sq = [], []
        for s in chosen:
            n_tok = 1 if rng.random() < 0.7 else int(rng.integers(2, 4))   # decode or verify
            start = _next(cache, s)
            pos += list(range(start, start + n_tok))
            sq += [s] * n_tok
        order = rng.permutation(len(pos)) if rng.random() < 0.3 else np.arange(len(pos))
        try:
            cache.start_forward(np.asarray(pos)[order], np.asarray(sq)[order])
        except nkv.KVCacheFullError:
            for s in range(4):
                cache.seq_rm(s)
            continue
        if rng.random() < 0.1:
            cache.set_causal(np.array([0]))
        n_ext = len(extensions)
        got = cache._host_pages()
        if len(extensions) > n_ext and extensions[-1] is not None:
            extended += 1
            assert got.host_lists_built == (device == "cpu")   # device: filled when read
        else:
            full += 1
            assert got.host_lists_built
        _assert_equal_to_host_build(cache)
    assert extended >= 8 and full >= 3, (extended, full)


def test_sequence_ops_between_steps_fall_back_to_a_build(incremental):
    cache = _cache()
    cache.start_forward(np.arange(5), np.zeros(5, np.int32))
    cache._host_pages()
    cache.start_forward(np.array([5]), np.array([0]))
    assert not cache._host_pages().host_lists_built           # extended
    cache.seq_add(0, 2, None, 3)                                # a pending shift: positions move
    cache.start_forward(np.array([9]), np.array([0]))
    assert cache._host_pages().host_lists_built                 # built again on the host
    _assert_equal_to_host_build(cache)
    cache.start_forward(np.array([10]), np.array([0]))
    assert not cache._host_pages().host_lists_built
    _assert_equal_to_host_build(cache)
    # a host-list read after the table changed is refused, never answered stale
    cache.start_forward(np.array([11]), np.array([0]))
    stale = cache._host_pages()
    assert not stale.host_lists_built
    cache.seq_rm(0, 10, None)
    with pytest.raises(RuntimeError, match="after the cell table changed"):
        stale.kv_indices


def _decode_step_cost(n_cells: int, context: int, monkeypatch):
    """Uploads (count, bytes) and host page-table builds of one warm decode step of 2
    sequences holding ``context`` tokens each."""
    cache = _cache(n_cells=n_cells, max_seqs=2)
    for s in range(2):                                      # prefill in chunks of 16
        for p0 in range(0, context, 16):
            n = min(16, context - p0)
            cache.start_forward(np.arange(p0, p0 + n), np.full(n, s))
    builds = []
    real = pages.pages_of_table
    monkeypatch.setattr(pages, "pages_of_table",
                        lambda *a, **k: builds.append(1) or real(*a, **k))
    out = []
    for step in range(3):
        before = dict(launch.UPLOADS)
        n_builds = len(builds)
        cache.start_forward(np.array([context + step] * 2), np.array([0, 1]))
        cache._host_pages()
        out.append((launch.UPLOADS["calls"] - before["calls"],
                    launch.UPLOADS["bytes"] - before["bytes"], len(builds) - n_builds))
    _assert_equal_to_host_build(cache)
    monkeypatch.setattr(pages, "pages_of_table", real)
    return out


def test_decode_step_uploads_do_not_grow_with_the_cache(incremental, monkeypatch):
    """A warm decode step uploads the same few bytes, once, and builds no list on the host,
    whether the sequences hold 8 or 1,000 cells of a 64- or 4,096-cell cache."""
    small = _decode_step_cost(64, 8, monkeypatch)
    large = _decode_step_cost(4096, 1000, monkeypatch)
    # the first step after the prefill builds once (its lists seed the extension)
    for steps in (small, large):
        assert steps[0][2] == 1
        for calls, nbytes, builds in steps[1:]:
            assert (calls, builds) == (1, 0)
            assert nbytes <= 128               # 8 small int32 fields of a 2-token batch
    assert small[1:] == large[1:]
