"""cache.page_table() and cache.layer_pool(): the per-sequence page tables must list exactly the
cells get()'s mask lets each sequence see, in FlashInfer's CSR form, and FlashInfer's causal
convention must hold wherever the attention backend relies on it."""

from __future__ import annotations

import numpy as np
import pytest

import numbakv as nkv
from numbakv.attention import _flashinfer_mode
from numbakv.pages import FIELDS, PageTable, _sort_runs, build_pages, check_pages, token_mask
from helpers import dev, host as to_host, shares_memory
from scenario_pages import make_cache, mask_visibility, random_forwards

SCENARIOS = {
    "plain": {},
    "window": dict(swa_window=3),
    "chunk": dict(chunk=4),
    "padded": dict(cache_padding=8, mask_batch_padding=4),
}


def _host(table):
    return PageTable(*[to_host(getattr(table, f)) for f in FIELDS])


def _check_against_mask(cache, pos, sq):
    """Invariants of the page table of the current pass, against get()'s mask."""
    pt = _host(cache.page_table())
    check_pages(pt, cache.n_cells)
    host = cache._host_pages()
    batch = len(pos)
    assert (pt.q_positions == pos).all()
    assert pt.seq_ids.tolist() == list(dict.fromkeys(sq.tolist()))
    seen = mask_visibility(cache, batch)
    cell_pos = cache.cells._pos
    for b, s in enumerate(pt.seq_ids):
        toks = pt.token_order[pt.qo_indptr[b]:pt.qo_indptr[b + 1]]
        assert (sq[toks] == s).all()
        cells = pt.kv_indices[pt.kv_indptr[b]:pt.kv_indptr[b + 1]]
        kv_pos = pt.kv_positions[pt.kv_indptr[b]:pt.kv_indptr[b + 1]]
        # exactly the union of what the sequence's tokens see in the dense mask
        assert set(cells.tolist()) == set().union(*(seen[i] for i in toks))
        assert (cell_pos[cells] == kv_pos).all()
        # the per-token mask over the list is the dense mask's rows
        m = token_mask(host, b)
        for r, i in enumerate(toks):
            assert set(cells[m[r]].tolist()) == seen[i]
    # FlashInfer's conventions, where attend's FlashInfer backend relies on them
    mode = _flashinfer_mode(host)
    for b in range(len(pt.seq_ids)):
        toks = pt.token_order[pt.qo_indptr[b]:pt.qo_indptr[b + 1]]
        cells = pt.kv_indices[pt.kv_indptr[b]:pt.kv_indptr[b + 1]]
        qo_len, kv_len = len(toks), len(cells)
        for r, i in enumerate(toks):
            j = np.arange(kv_len)
            if mode == "decode":
                ok = np.ones(kv_len, bool)
            elif mode == "causal":     # query r sees kv j <= kv_len - qo_len + r (window_left)
                ok = j <= kv_len - qo_len + r
                if host.rule.window >= 0:
                    ok &= j >= kv_len - qo_len + r - host.rule.window
            else:
                continue
            assert set(cells[ok].tolist()) == seen[i], (mode, b, r)
    return pt


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("seed", [0, 1])
def test_page_table_matches_mask(device, name, seed):
    rng = np.random.default_rng(seed)
    cache = make_cache(device, **SCENARIOS[name])
    steps = 14 if device == "cpu" else 6
    modes = set()
    for pos, sq in random_forwards(cache, rng, steps):
        _check_against_mask(cache, pos, sq)
        modes.add(_flashinfer_mode(cache._host_pages()))
    assert modes  # at least one pass ran


def test_page_table_arrays_on_device(device):
    cache = make_cache(device)
    cache.start_forward([0, 1, 0], [0, 0, 1])
    pt = cache.page_table()
    xp = np if device != "cuda" else __import__("cupy")
    for name in FIELDS:
        arr = getattr(pt, name)
        assert isinstance(arr, xp.ndarray) and arr.dtype == np.int32, name
    assert pt.seq_ids.tolist() == [0, 1]
    assert pt.qo_indptr.tolist() == [0, 2, 3] and pt.token_order.tolist() == [0, 1, 2]
    assert pt.kv_indptr.tolist() == [0, 2, 3] and pt.kv_indices.tolist() == [0, 1, 2]
    assert pt.kv_positions.tolist() == [0, 1, 0] and pt.kv_last_page_len.tolist() == [1, 1]


def test_page_table_follows_set_causal_and_forward():
    cache = make_cache("cpu")
    cache.start_forward([0, 1, 2], [0, 0, 0])
    first = cache.page_table()
    assert cache.page_table() is first           # built once per pass
    assert cache._host_pages().trailing
    cache.set_causal([0])                        # token 0 now sees positions 1 and 2
    second = cache.page_table()
    assert second is not first and not cache._host_pages().trailing
    assert _flashinfer_mode(cache._host_pages()) == "custom"
    m = token_mask(cache._host_pages(), 0)
    assert m.tolist() == [[True, True, True], [True, True, False], [True, True, True]]
    cache.start_forward([3], [0])
    assert cache.page_table().kv_indices.tolist() == [0, 1, 2, 3]


def test_window_lists_only_cells_inside_a_token_window():
    cache = make_cache("cpu", swa_window=2, capacity=40)
    cache.start_forward(list(range(10)), [0] * 10)
    cache.start_forward([10, 11], [0, 0])
    pt = cache.page_table()
    assert pt.kv_positions.tolist() == list(range(8, 12))   # 10-2 .. 11
    assert _flashinfer_mode(cache._host_pages()) == "causal"


def test_chunk_splits_the_union():
    cache = make_cache("cpu", chunk=4)
    cache.start_forward(list(range(6)), [0] * 6)
    cache.start_forward([6], [0])
    assert cache.page_table().kv_positions.tolist() == [4, 5, 6]


def test_copy_prefix_shares_cells():
    cache = make_cache("cpu")
    cache.start_forward(list(range(5)), [0] * 5)
    cache.copy_prefix(0, 1, 3)
    cache.start_forward([5, 3], [0, 1])
    pt = cache.page_table()
    assert pt.kv_indices[:6].tolist() == [0, 1, 2, 3, 4, 5]
    assert pt.kv_indices[6:].tolist() == [0, 1, 2, 6]       # the shared prefix, then its own
    assert pt.kv_positions[6:].tolist() == [0, 1, 2, 3]


def test_positions_sorted_when_cells_are_not():
    # a sequence filled out of position order: cell order and position order disagree
    cache = make_cache("cpu")
    cache.start_forward([5, 6, 7], [0, 0, 0])
    cache.start_forward([0, 1], [0, 0])
    cache.set_causal([0, 1])
    pt = cache.page_table()
    assert pt.kv_indices.tolist() == [3, 4, 0, 1, 2]
    assert pt.kv_positions.tolist() == [0, 1, 5, 6, 7]


def test_positions_sorted_over_many_runs():
    # decode tokens of seq 0 land in holes in front of its older cells: its cells, in cell order,
    # hold the positions 9 10 | 0 1 2 11 12 | 3 4 5 13 14 | 6 7 8 (four ascending runs)
    cache = make_cache("cpu")
    for pos, sq in (([0, 1], 1), ([0, 1, 2], 0), ([2, 3], 1), ([3, 4, 5], 0), ([0, 1], 2),
                    ([6, 7, 8], 0)):
        cache.start_forward(pos, [sq] * len(pos))
    cache.seq_rm(1)
    cache.seq_rm(2)
    for p in range(9, 15):
        cache.start_forward([p], [0])
    cache.start_forward([15, 2], [0, 3])
    pt = _check_against_mask(cache, np.array([15, 2]), np.array([0, 3]))
    assert pt.kv_positions[:16].tolist() == list(range(16))
    assert pt.kv_indices[:16].tolist() == [2, 3, 4, 7, 8, 9, 12, 13, 14, 0, 1, 5, 6, 10, 11, 15]


@pytest.mark.parametrize("seed", range(4))
def test_sort_runs_is_a_stable_sort(seed):
    # the builder's run merge against numpy's stable sort, on a slice of a larger buffer, with
    # ties (a page list has none, but the helper promises the stable order)
    rng = np.random.default_rng(seed)
    for _ in range(50):
        runs = [np.sort(rng.integers(0, 40, int(rng.integers(1, 30))))
                for _ in range(int(rng.integers(1, 12)))]
        pos = np.concatenate(runs).astype(np.int32)
        start, n = int(rng.integers(0, 5)), len(pos)
        poss = rng.integers(-9, 9, start + n + 3).astype(np.int32)
        cells = rng.permutation(len(poss)).astype(np.int32)
        poss[start:start + n] = pos
        want_c, want_p = cells.copy(), poss.copy()
        order = np.argsort(pos, kind="stable")
        want_c[start:start + n] = cells[start:start + n][order]
        want_p[start:start + n] = pos[order]
        _sort_runs(cells, poss, start, start + n)
        assert cells.tolist() == want_c.tolist() and poss.tolist() == want_p.tolist()


def _reference_pages(pos, seqs, bpos, bseq, causal, window, chunk):
    """The page table by definition: per batch sequence (first appearance order), the cells of
    the sequence any of its tokens sees, in cell order, stably sorted by position."""
    out = []
    for s in dict.fromkeys(bseq.tolist()):
        toks = np.flatnonzero(bseq == s)
        mine = np.flatnonzero((seqs[:, s >> 6] >> np.uint64(s & 63)) & np.uint64(1))
        seen = np.zeros(len(mine), bool)
        for i in toks:
            p = int(bpos[i])
            lo = max(0, p - window if window >= 0 else 0, p - p % chunk if chunk > 0 else 0)
            hi = p if causal[i] else 2**31
            seen |= (pos[mine] >= lo) & (pos[mine] <= hi)
        cells = mine[seen]
        cells = cells[np.argsort(pos[cells], kind="stable")]
        out.append((s, toks, cells))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_builder_matches_the_definition_on_scattered_tables(seed):
    # tables no cache would make quickly: each sequence's cells in runs whose positions come in
    # shuffled order (leaves to put in position order), shared cells, now and then a position a
    # sequence holds twice, small leaves; batches with windows, chunks and set_causal
    from numbakv.cells import CellTable, cell_dtype
    rng = np.random.default_rng(seed)
    for trial in range(40):
        n_cells, n_seqs = int(rng.integers(20, 300)), int(rng.integers(1, 6))
        table = CellTable(n_cells, n_seqs, block_size=int(rng.choice([1, 4, 8, 64])))
        rec = np.zeros(n_cells, cell_dtype(table.words))
        rec["pos"] = -1
        free = rng.permutation(n_cells)
        for s in range(n_seqs):
            mine = np.sort(free[:int(rng.integers(0, n_cells // n_seqs + 1))])
            free = free[len(mine):]
            runs = np.array_split(mine, int(rng.integers(1, 6)))
            start = 0
            for r in rng.permutation(len(runs)):
                rec["pos"][runs[r]] = start + np.arange(len(runs[r]))
                start += len(runs[r]) + int(rng.integers(0, 3))
            if len(mine) > 2 and rng.random() < 0.2:
                rec["pos"][mine[0]] = rec["pos"][mine[-1]]          # a position held twice
            rec["seqs"][mine, 0] |= np.uint64(1) << np.uint64(s)
            if s and len(mine) and rng.random() < 0.3:              # shared with sequence 0
                rec["seqs"][mine[:len(mine) // 2], 0] |= np.uint64(1)
        table.load_cells(rec)
        batch = int(rng.integers(1, 6))
        bseq = rng.integers(0, n_seqs, batch).astype(np.int32)
        bpos = rng.integers(0, n_cells // max(1, n_seqs) + 5, batch).astype(np.int32)
        causal = (rng.random(batch) < 0.8).astype(np.uint8)
        # read-only, as a cache's flags are (start_forward, set_causal): the builder's compiled
        # code is typed by the array's flags, and the shipped code holds the read-only form
        causal.flags.writeable = False
        window = int(rng.choice([-1, -1, 0, 3, 20]))
        chunk = int(rng.choice([0, 0, 4, 16]))
        host = build_pages(table._pos, table._seqs, table._stree, table.block_size.bit_length() - 1,
                           bpos, bseq, causal, window=window, chunk=chunk)
        held = [rec["pos"][(rec["seqs"][:, 0] >> np.uint64(s)) & np.uint64(1) == 1]
                for s in range(n_seqs)]
        if all(len(np.unique(h)) == len(h) for h in held):
            check_pages(host, n_cells)
        ref = _reference_pages(table._pos, table._seqs, bpos, bseq, causal, window, chunk)
        assert host.seq_ids.tolist() == [s for s, _, _ in ref]
        trailing = True
        for b, (s, toks, cells) in enumerate(ref):
            assert host.token_order[host.qo_indptr[b]:host.qo_indptr[b + 1]].tolist() == \
                toks.tolist()
            got = host.kv_indices[host.kv_indptr[b]:host.kv_indptr[b + 1]]
            assert got.tolist() == cells.tolist(), (trial, b)
            assert (host.kv_positions[host.kv_indptr[b]:host.kv_indptr[b + 1]]
                    == table._pos[cells]).all()
            lo, hi = (cells.min(), cells.max() + 1) if len(cells) else (-1, -1)
            assert (host.cell_lo[b], host.cell_hi[b]) == (lo, hi)
            tail = table._pos[cells[len(cells) - len(toks):]] if len(toks) <= len(cells) else None
            trailing &= tail is not None and bool(causal[toks].all()) and \
                tail.tolist() == bpos[toks].tolist()
        assert host.trailing == trailing


def test_builder_reads_only_the_blocks_of_the_batch_sequences():
    # a table whose sequence trees say "no cell here" must not be read there: poison the cells
    # outside seq 0's blocks with seq 0's bit, and the builder must not list them
    n_cells, block = 1024, 64
    # positions as the cell table keeps them (a strided field of its records, numba layout
    # 'A') and read-only causal flags as a cache's: the builder runs its shipped code instead
    # of compiling another signature (~8 CPU s)
    pos = np.full((n_cells, 2), -1, np.int32)[:, 0]
    seqs = np.zeros((n_cells, 4), np.uint64)
    pos[:10] = np.arange(10)
    seqs[:10, 0] = 1
    seqs[500:600, 0] = 1            # not in the tree: a scan of every cell would list them
    pos[500:600] = np.arange(100)
    n_leaves = n_cells // block
    stree = np.empty((2, 2 * n_leaves, 1), np.int32)
    stree[0] = 2**31 - 1
    stree[1] = -1
    stree[0, n_leaves, 0], stree[1, n_leaves, 0] = 0, 9
    for k in range(n_leaves - 1, 0, -1):
        stree[0, k] = np.minimum(stree[0, 2 * k], stree[0, 2 * k + 1])
        stree[1, k] = np.maximum(stree[1, 2 * k], stree[1, 2 * k + 1])
    causal = np.ones(1, np.uint8)
    causal.flags.writeable = False
    host = build_pages(pos, seqs, stree, 6, np.array([10], np.int32), np.array([0], np.int32),
                       causal)
    assert host.kv_indices.tolist() == list(range(10))


def test_reserve_pass_sees_every_cell():
    cache = make_cache("cpu")
    cache.start_forward([0, 1], [0, 1], reserve=True)
    pt = cache.page_table()
    assert pt.kv_indptr.tolist() == [0, cache.n_cells, 2 * cache.n_cells]


def test_layer_pool_is_zero_copy(device):
    cache = make_cache(device, permuted_v=True)
    cache.start_forward([0, 1], [0, 0])
    cache.set_layer(1)
    k = np.arange(2 * 2 * 8, dtype=np.float32).reshape(2, 2, 8)
    cache.put(dev(k, device), dev(k + 100, device))
    key, value = cache.layer_pool()
    assert key.shape == (cache.n_cells, 2, 8) and value.shape == (2, 8, cache.n_cells)
    np.testing.assert_array_equal(to_host(key)[:2], k)
    np.testing.assert_array_equal(to_host(value)[:, :, :2], np.moveaxis(k + 100, 0, -1))
    assert shares_memory(key, cache.storage.keys)
    key0, _ = cache.layer_pool(0)
    assert not to_host(key0)[:2].any()


def test_wrapper_and_encoder_caches():
    full = make_cache("cpu")
    swa = make_cache("cpu", swa_window=2)
    wrap = nkv.WrapperCache([swa, full])
    wrap.start_forward(list(range(6)), [0] * 6)
    wrap.set_layer_type(0)
    assert wrap.page_table().kv_indices.tolist() == list(range(6))
    wrap.start_forward([6], [0])
    assert wrap.page_table().kv_positions.tolist() == [4, 5, 6]
    wrap.set_layer_type(1)
    assert wrap.page_table().kv_positions.tolist() == list(range(7))
    assert wrap.layer_pool()[0].shape[0] == full.n_cells

    cfg = nkv.CacheConfig(1, 2, 8, dtype="float32", capacity=5, max_seqs=2, device="cpu")
    enc = nkv.EncoderCache(cfg)
    enc.start_forward([0, 0, 1], [0, 1, 0], encoder_pos=0)
    enc.put(np.ones((3, 2, 8), np.float32), np.ones((3, 2, 8), np.float32))
    pt = enc.page_table()
    assert pt.seq_ids.tolist() == [0, 1] and pt.token_order.tolist() == [0, 2, 1]
    assert pt.kv_indptr.tolist() == [0, 3, 6] and pt.kv_indices.tolist() == [0, 1, 2] * 2
    assert enc.layer_pool()[0].shape == (3, 2, 8)


def test_page_table_needs_a_forward_pass():
    cache = make_cache("cpu")
    with pytest.raises(ValueError, match="start_forward"):
        cache.page_table()
    with pytest.raises(ValueError, match="layer"):
        cache.layer_pool(5)


def test_disjoint_windows_of_one_sequence():
    # two tokens of one sequence far apart: the cells between their windows are not listed
    cache = make_cache("cpu", chunk=4, capacity=60)
    cache.start_forward(list(range(10)), [0] * 10)
    cache.start_forward(list(range(11, 20)), [0] * 9)
    cache.start_forward(list(range(20, 30)), [0] * 10)
    cache.start_forward([10, 30], [0, 0])
    pt = cache.page_table()
    assert pt.kv_positions.tolist() == [8, 9, 10, 28, 29, 30]
    _check_against_mask(cache, np.array([10, 30]), np.array([0, 0]))
