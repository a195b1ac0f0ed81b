"""WrapperCache (a cache per layer group), EncoderCache (cross-attention) and the up-front
memory check of CausalCache."""

import numpy as np
import pytest

import numbakv as nkv

from helpers import dev, host

H, D = 2, 8


def _cfg(device, **kw):
    base = dict(n_layers=1, n_kv_heads=H, head_dim=D, dtype="float32", capacity=8, max_seqs=2,
                max_batch=4, device=device)
    base.update(kw)
    return nkv.CacheConfig(**base)


def _rows(value, batch, device="cpu"):
    """``batch`` rows of K or V filled with ``value``, on ``device`` (the cache's)."""
    return dev(np.full((batch, H, D), value, np.float32), device)


def _table(cache):
    """Everything observable of a CausalCache's metadata."""
    cells = cache.cells.cells
    return (cells["pos"].copy(), cells["seqs"].copy(), cache.cells.n_used,
            [(cache.seq_pos_min(s), cache.seq_pos_max(s)) for s in range(cache.config.max_seqs)])


def _same(a, b):
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))


def _gemma_like(device, full_capacity=8):
    """Layers 0 and 2 slide over a window of 2; layer 1 attends to everything."""
    swa = nkv.CausalCache(_cfg(device, n_layers=2), swa_window=2, shift=nkv.RopeShift())
    full = nkv.CausalCache(_cfg(device, capacity=full_capacity), shift=nkv.RopeShift())
    return nkv.WrapperCache([swa, full], layer_groups=[0, 1, 0]), swa, full


def test_wrapper_routes_layers_and_fans_out(device):
    wrapper, swa, full = _gemma_like(device)
    assert wrapper.n_layers == 3
    for step in range(4):
        wrapper.start_forward([step], [0])
        for layer in range(3):
            wrapper.set_layer(layer)
            wrapper.put(_rows(100 * layer + step, 1, device),
                        _rows(-(100 * layer + step), 1, device))
    assert swa.seq_pos_max(0) == full.seq_pos_max(0) == wrapper.seq_pos_max(0) == 3
    for layer in range(3):
        wrapper.set_layer(layer)
        key, value, mask = wrapper.get()
        visible = host(key)[host(mask)[0] == 0][:, 0, 0]
        if layer == 1:  # full attention: every step of its own layer
            assert sorted(visible.tolist()) == [100, 101, 102, 103]
        else:           # window 2 sees positions 1..3, stored in the SWA cache's own layer
            assert sorted(visible.tolist()) == [100 * layer + p for p in (1, 2, 3)]
    wrapper.remove(0, 3)
    assert swa.seq_pos_max(0) == full.seq_pos_max(0) == 2
    wrapper.copy_prefix(0, 1, 2)
    assert (full.seq_pos_min(1), full.seq_pos_max(1)) == (0, 1)
    assert wrapper.seq_pos_max(1) == 1


def test_wrapper_start_forward_is_all_or_nothing():
    """The full-attention cache runs out of room: the SWA cache, which placed the batch first
    (and pruned its window), must be exactly as before."""
    wrapper, swa, full = _gemma_like("cpu", full_capacity=2)   # full: 4 cells
    for pos in range(3):
        wrapper.start_forward([pos], [0])
    assert swa.swa_memory == 3
    before_swa, before_full = _table(swa), _table(full)
    with pytest.raises(nkv.KVCacheFullError):
        # the SWA cache evicts positions < 5 - 3 of seq 0 and places the batch; full cannot
        wrapper.start_forward([5, 0], [0, 1])
    assert _same(_table(swa), before_swa) and _same(_table(full), before_full)
    wrapper.start_forward([3], [0])  # still usable


def test_wrapper_rolls_back_a_sibling_that_defragmented():
    """Undo must also work when the cache that succeeded had to defrag to place the batch."""
    swa = nkv.CausalCache(_cfg("cpu", capacity=4, max_seqs=3), shift=nkv.RopeShift())
    full = nkv.CausalCache(_cfg("cpu", capacity=4, max_seqs=3), shift=nkv.RopeShift())
    wrapper = nkv.WrapperCache([swa, full])
    for pos in range(4):
        wrapper.start_forward([pos, pos], [0, 1])
    wrapper.seq_rm(0, 1, 2)                 # a hole in both caches
    full.start_forward([0, 1, 2, 3], [2, 2, 2, 2])  # only full fills up
    before_swa, before_full = _table(swa), _table(full)
    defrags = swa.defrag_count
    with pytest.raises(nkv.KVCacheFullError):
        wrapper.start_forward([4, 4], [0, 1])   # swa must defrag to fit; full cannot fit at all
    assert _same(_table(swa), before_swa) and _same(_table(full), before_full)
    assert swa.defrag_count == defrags


def test_wrapper_remove_checks_every_cache_first():
    plain = nkv.CausalCache(_cfg("cpu"), shift=nkv.RopeShift())
    no_shift = nkv.CausalCache(_cfg("cpu"))
    wrapper = nkv.WrapperCache([plain, no_shift])
    wrapper.start_forward([0, 1, 2], [0, 0, 0])
    before = [_table(plain), _table(no_shift)]
    with pytest.raises(nkv.NotSupportedError):
        wrapper.remove(0, 0, 1)
    assert _same(_table(plain), before[0]) and _same(_table(no_shift), before[1])
    wrapper.remove(0, 1)  # truncation needs no shift
    assert wrapper.seq_pos_max(0) == 0


@pytest.mark.parametrize("groups, needle", [([0, 2], "layer_groups"), ([0, 0], "layers")])
def test_wrapper_validates_layer_groups(groups, needle):
    a = nkv.CausalCache(_cfg("cpu"))
    b = nkv.CausalCache(_cfg("cpu"))
    with pytest.raises(ValueError, match=needle):
        nkv.WrapperCache([a, b], layer_groups=groups)
    with pytest.raises(ValueError, match="max_seqs"):
        nkv.WrapperCache([a, nkv.CausalCache(_cfg("cpu", max_seqs=1))])
    wrapper = nkv.WrapperCache([a, b], layer_groups=[0, 1])
    with pytest.raises(ValueError, match="layer"):
        wrapper.set_layer(2)


def test_encoder_cache_stores_once_and_reuses(device):
    cfg = _cfg(device, n_layers=2, capacity=6, mask_batch_padding=4)
    enc = nkv.EncoderCache(cfg)
    enc.start_forward([0, 1, 2], [0, 0, 0], encoder_pos=0)
    for layer in range(2):
        enc.set_layer(layer)
        enc.put(_rows(layer + 1, 5, device), _rows(-(layer + 1), 5, device))
    assert enc.encoder_cached and enc.encoder_len == 5
    enc.start_forward([3], [0])  # a decode step reuses the stored output
    for layer in range(2):
        enc.set_layer(layer)
        key, value, mask = enc.get()
        assert np.all(host(key) == layer + 1) and np.all(host(value) == -(layer + 1))
        mask = host(mask)
        assert mask.shape == (4, 5) and np.all(mask[0] == 0) and np.all(np.isneginf(mask[1:]))
    with pytest.raises(ValueError, match="encoder_pos"):
        enc.put(_rows(0, 5, device), _rows(0, 5, device))
    enc.remove(0, 1)            # positions >= 1: the encoder input at 0 stays
    assert enc.encoder_cached
    enc.remove(0, 0, 1)         # its own position goes: the output is dropped
    assert not enc.encoder_cached
    with pytest.raises(nkv.KVCacheError, match="no encoder output"):
        enc.get()
    with pytest.raises(nkv.NotSupportedError):
        enc.copy_prefix(0, 1, 1)


def test_encoder_cache_rejects_bad_shapes():
    enc = nkv.EncoderCache(_cfg("cpu", capacity=4))
    enc.start_forward([0], [0], encoder_pos=0)
    with pytest.raises(ValueError, match="key"):
        enc.put(np.zeros((5, H, D), np.float32), np.zeros((5, H, D), np.float32))  # > capacity
    with pytest.raises(ValueError, match="value"):
        enc.put(np.zeros((2, H, D), np.float32), np.zeros((3, H, D), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        enc.put(np.zeros((2, H, D), np.float16), np.zeros((2, H, D), np.float16))
    assert enc.encoder_len == 0


def test_memory_is_checked_before_allocating():
    cfg = nkv.CacheConfig(80, 8, 128, dtype="float16", capacity=2**20, max_seqs=256,
                          device="cpu")
    assert cfg.nbytes() == 80 * 2**20 * 256 * 8 * 256 * 2
    with pytest.raises(ValueError, match="GiB"):
        nkv.CausalCache(cfg)


def test_failed_move_during_defrag_changes_nothing(monkeypatch):
    """A device error while the defrag moves data: the table must be exactly as before, or
    cells would point at K/V the failed move never copied."""
    cache = nkv.CausalCache(_cfg("cpu", capacity=3, max_seqs=2, max_batch=2),
                            shift=nkv.RopeShift())
    for pos in range(3):
        cache.start_forward([pos, pos], [0, 1])   # cells 0..5 full, interleaved
    cache.seq_rm(1, 0, 1)                          # frees cell 1
    cache.seq_rm(0, 2)                             # frees cell 4: two one-cell holes
    before = _table(cache)

    def broken(moves):
        raise RuntimeError("device error")
    monkeypatch.setattr(cache.storage, "move_blocks", broken)
    with pytest.raises(RuntimeError, match="device error"):
        cache.start_forward([2, 3], [0, 0])         # needs two adjacent cells: defrag
    assert _same(_table(cache), before)
    monkeypatch.undo()
    cache.start_forward([2, 3], [0, 0])
    assert cache.defrag_count == 1
