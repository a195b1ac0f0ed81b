"""Round-2 rules of CausalCache / WrapperCache (issue 12): all-or-nothing by undo logs, the
tightened contract (duplicates, sequence operations end the forward pass, bounded seq_div),
bfloat16 / float16 masks, mask buffers reused, and sequence operations that touch only the
blocks of the table holding what they change."""

import numpy as np
import pytest

import numbakv as nkv
from numbakv.cells import CellTable, _st_blocks


def _cfg(n_layers=2, **kw):
    base = dict(dtype="float32", capacity=16, max_seqs=2, max_batch=4, device="cpu")
    base.update(kw)
    return nkv.CacheConfig(n_layers, 2, 4, **base)


def _table(cache):
    t = cache.cells
    return (t.cells.tobytes(), t._occ.tobytes(), t._ftree.tobytes(), t._stree.tobytes(),
            t._sidx.tobytes(), t._meta.tobytes())


def _fill(cache, positions, seq=0, value=None):
    cache.start_forward(positions, [seq] * len(positions))
    cfg = cache.config
    for layer in range(cfg.n_layers):
        cache.set_layer(layer)
        x = np.zeros((len(positions), cfg.n_kv_heads, cfg.head_dim), np.float32)
        x[:, :, 0] = np.asarray(positions if value is None else value, np.float32)[:, None]
        x[:, :, 1] = layer
        cache.put(x, x)


def test_failing_shift_in_start_forward_places_nothing_and_leaks_nothing():
    """The issue's repro: a shift function returning the wrong shape fails inside
    start_forward; the batch must not stay placed, and retries must not leak cells."""
    c = nkv.CausalCache(_cfg(n_layers=1), shift=lambda layer, k, d: k[:1])
    c.start_forward([0, 1, 2], [0] * 3)
    c.seq_add(0, 1, None, 5)
    before = _table(c)
    for _ in range(3):
        with pytest.raises(ValueError, match="shift result"):
            c.start_forward([10], [0])
        assert _table(c) == before
        assert c.n_used == 3
    with pytest.raises(ValueError, match="forward pass"):
        c.get()                       # seq_add ended the pass; the failed one left none behind
    c.cells.check_consistency()


def test_failing_rope_rotation_leaves_keys_and_shifts(monkeypatch):
    """A rotation that fails part-way: the keys it touched are put back with the shifts."""
    c = nkv.CausalCache(_cfg(), shift=nkv.RopeShift())
    _fill(c, list(range(4)))
    keys = c.storage.keys.copy()
    before = _table(c)

    def half_then_fail(cells, deltas, rope, layers=None):
        c.storage.keys[:, cells[:1]] += 100.0       # wrote part of it
        raise RuntimeError("device error")
    monkeypatch.setattr(c.storage, "rotate", half_then_fail)
    with pytest.raises(RuntimeError, match="device error"):
        c.remove(0, 0, 1)
    assert _table(c) == before
    assert np.array_equal(c.storage.keys, keys)
    monkeypatch.undo()
    c.remove(0, 0, 1)                                # works afterwards
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 2)


def test_duplicate_and_held_positions_are_refused():
    c = nkv.CausalCache(_cfg())
    _fill(c, [0, 1, 2])
    before = _table(c)
    for positions, seqs in (([3, 3], [0, 0]), ([2], [0]), ([4, 0], [0, 0])):
        with pytest.raises(ValueError, match="already stored or repeated"):
            c.start_forward(positions, seqs)
        assert _table(c) == before
    c.start_forward([3, 3], [0, 1])                 # the same position in two sequences is fine
    c.seq_rm(0, 2)
    c.start_forward([2], [0])                       # removed, so it may be put again
    c.start_forward([0, 0, 0, 0], [0, 0, 0, 0], reserve=True)   # reserve stores nothing


@pytest.mark.parametrize("op", [
    lambda c: c.remove(0, 1), lambda c: c.seq_rm(0, 5), lambda c: c.seq_cp(0, 1),
    lambda c: c.seq_keep(0), lambda c: c.seq_add(0, 0, None, 0), lambda c: c.seq_div(0, 0, 1, 2),
    lambda c: c.copy_prefix(0, 1, 1), lambda c: c.defrag(),
    lambda c: c.load_state_bytes(c.state_bytes())])
def test_sequence_operations_end_the_forward_pass(op):
    c = nkv.CausalCache(_cfg(), shift=nkv.RopeShift())
    _fill(c, [0, 1, 2])
    c.start_forward([3], [0])
    op(c)
    for call in (lambda: c.put(np.zeros((1, 2, 4), np.float32), np.zeros((1, 2, 4), np.float32)),
                 c.get):
        with pytest.raises(ValueError, match="start_forward"):
            call()
    c.start_forward([7], [1])                       # and the next pass works
    c.get()


def test_seq_div_d_is_bounded():
    c = nkv.CausalCache(_cfg(), shift=nkv.RopeShift())
    _fill(c, [0, 1, 2])
    before = _table(c)
    for d in (2**63, 2**31, 0, -3):
        with pytest.raises(ValueError, match="d must be"):
            c.seq_div(0, 1, 100, d)
        assert _table(c) == before
    c.seq_div(0, 1, 100, 2**31 - 1)                 # the largest d: positions 1, 2 -> 0
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 0)
    with pytest.raises(ValueError):
        CellTable(4, 1).seq_div(0, 0, None, 2**31)


def test_wrapper_rollback_keeps_own_kv_after_swa_evicted_and_defragmented():
    """The issue's repro: the SWA group evicts and defrags to place [3, 4] while the full group
    is full; after the rollback every (sequence, position) holds its own K/V."""
    def cache(capacity, **kw):
        cfg = nkv.CacheConfig(1, 1, 1, dtype="float32", capacity=capacity, max_batch=2,
                              device="cpu")
        return nkv.CausalCache(cfg, **kw)
    a, b = cache(8, swa_window=1, swa_memory=2), cache(4)
    w = nkv.WrapperCache([a, b], layer_groups=[0, 1])
    for ps in ([0], [1, 2]):
        w.start_forward(ps, [0] * len(ps))
        for layer in range(2):
            w.set_layer(layer)
            x = np.array(ps, np.float32).reshape(-1, 1, 1)
            w.put(x, x)
    before = (_table(a), _table(b))
    with pytest.raises(nkv.KVCacheFullError):
        w.start_forward([3, 4], [0, 0])
    assert (_table(a), _table(b)) == before
    for c in (a, b):
        for cell in c.cells.seq_cells(0):
            p = int(c.cells.cells["pos"][cell])
            assert c.storage.keys[0, cell, 0, 0] == p and c.storage.values[0, cell, 0, 0] == p


def test_wrapper_start_forward_takes_back_a_sibling_rotation():
    """The first cache applies its pending shift, the second fails: the first cache's keys are
    put back unrotated and its shift is pending again."""
    good = nkv.CausalCache(_cfg(n_layers=1), shift=nkv.RopeShift())
    bad = nkv.CausalCache(_cfg(n_layers=1), shift=lambda layer, k, d: k[:1])
    w = nkv.WrapperCache([good, bad], layer_groups=[0, 1])
    w.start_forward([0, 1, 2], [0] * 3)
    for layer in range(2):
        w.set_layer(layer)
        x = np.random.default_rng(layer).standard_normal((3, 2, 4)).astype(np.float32)
        w.put(x, x)
    w.seq_add(0, 1, None, 3)
    keys = good.storage.keys.copy()
    before = (_table(good), _table(bad))
    with pytest.raises(ValueError, match="shift result"):
        w.start_forward([9], [0])
    assert (_table(good), _table(bad)) == before
    assert np.array_equal(good.storage.keys, keys) and good.cells.has_pending_shifts()


def test_wrapper_sequence_op_rolls_back_by_undo_log():
    """seq_add refused by the second cache (a shared cell) after the first applied it: the
    first cache's table is back, without a copy of it having been taken."""
    a = nkv.CausalCache(_cfg(), shift=nkv.RopeShift())
    b = nkv.CausalCache(_cfg(), shift=nkv.RopeShift())
    w = nkv.WrapperCache([a, b])
    w.start_forward([0, 1, 2], [0] * 3)
    b.seq_cp(0, 1)                                   # only b shares seq 0's cells
    before = (_table(a), _table(b))
    with pytest.raises(nkv.NotSupportedError):
        w.seq_add(0, 0, None, 2)
    assert (_table(a), _table(b)) == before
    a.cells.check_consistency()


@pytest.mark.parametrize("mask_dtype", ["float16", "bfloat16"])
def test_half_masks(mask_dtype):
    torch = pytest.importorskip("torch")
    c = nkv.CausalCache(_cfg(mask_dtype=mask_dtype, mask_batch_padding=4))
    _fill(c, [0, 1, 2])
    _, _, mask = c.get()
    t = torch.from_dlpack(mask)
    assert t.dtype == getattr(torch, mask_dtype)
    want = torch.tensor([[0, -np.inf, -np.inf], [0, 0, -np.inf], [0, 0, 0]] + [[-np.inf] * 3],
                        dtype=torch.float32)
    assert torch.equal(t.float(), want)


def test_mask_buffer_is_reused_while_it_fits():
    c = nkv.CausalCache(_cfg())
    _fill(c, [0, 1, 2, 3])
    m1 = c.get()[2]
    c.start_forward([4], [0])
    m2 = c.get()[2]
    assert np.shares_memory(m1, m2)                  # no fresh allocation per step
    assert (m2 == 0).all() and m2.shape == (1, 5)


def test_sequence_operations_touch_only_their_blocks():
    """At 64k cells one sequence spans 1024 blocks; a tail operation visits one of them (the
    cost of every sequence operation follows what it touches, not the table)."""
    t = CellTable(65536, 2)
    n = 65000
    t.apply_batch(np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32),
                  np.zeros(n, np.int32))
    assert len(_st_blocks(t._stree, 0, n - 3, 2**62)) == 1
    assert len(_st_blocks(t._stree, 0, 0, 512)) == 8
    assert len(_st_blocks(t._stree, 0, 0, 2**62)) == -(-n // 64)
    journal = []
    t.seq_rm(0, n - 3, None, journal=journal)
    assert journal[0].pos.shape == (64,)             # the undo log holds one block, not the table
    t.rollback(journal)
    t.check_consistency()
    assert t.seq_pos_max(0) == n - 1
