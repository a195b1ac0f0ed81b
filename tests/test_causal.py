"""Scenario tests of ``numbakv.CausalCache`` against Ollama's ``kvcache/causal.go`` (the seed 004)
and llama.cpp's sequence operations. Every expected cell range, row and mask below was derived
by hand from causal.go's rules (contiguous first-fit placement, updateSlidingWindow, buildMask,
Remove/shift, CopyPrefix, CanResume), not from an implementation.

Keys written by ``enc_key`` say whose they are: ``key[:, h, 0] = seq``, ``key[:, h, 1] = pos``,
``key[:, h, 2] = layer``; values are ``-(key + 0.5)``. ``B.rows()`` decodes every returned row.
Masks are written as text: ``0`` visible, ``x`` masked (-inf), rows separated by ``/``.
"""

import numpy as np
import pytest

import numbakv as nkv
from numbakv import KVCacheFullError, NotSupportedError

from causal_reference import (AddShift, assert_same_state, attention_ref, enc_key, enc_value,
                              forward, mask_from_text, ref_sizing, rope_ref, state_snapshot,
                              to_device, to_host, to_storage)

L, H, D = 2, 2, 8


def make(device, *, shift=None, swa_window=None, swa_memory=None, chunk_size=None, **cfg):
    base = dict(n_layers=L, n_kv_heads=H, head_dim=D, dtype="float16", capacity=16,
                max_seqs=1, max_batch=16)
    base.update(cfg)
    config = nkv.CacheConfig(device=device, **base)
    return nkv.CausalCache(config, shift=shift, swa_window=swa_window, swa_memory=swa_memory,
                           chunk_size=chunk_size)


def assert_mask(got, text):
    want = mask_from_text(text)
    got = np.asarray(got, np.float32)
    assert got.shape == want.shape, f"mask shape {got.shape}, want {want.shape}"
    assert np.all((got == 0) | (got == -np.inf)), "mask entries must be 0 or -inf"
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"mask differs at {bad.tolist()}:\n{got}\nwant\n{want}"


def assert_rows(b, expected):
    """``expected[r]`` is ``(seq, pos)`` for a live cell (its K/V must be exactly the encoded
    data, in every layer) or ``None`` for a free cell (only finiteness is required)."""
    assert b.hi - b.lo == len(expected), \
        f"range {b.range} has {b.hi - b.lo} rows, want {len(expected)}"
    for layer in range(len(b.keys)):
        k, v = b.k(layer), b.v(layer)
        assert k.shape[0] == v.shape[0] == len(expected)
        assert np.all(np.isfinite(k)) and np.all(np.isfinite(v)), "returned K/V must be finite"
        for r, sp in enumerate(expected):
            if sp is None:
                continue
            want_k = enc_key([sp[0]], [sp[1]], layer, k.shape[1], k.shape[2])[0]
            want_v = enc_value([sp[0]], [sp[1]], layer, v.shape[1], v.shape[2])[0]
            assert np.array_equal(k[r], want_k), f"layer {layer} row {r}: key {k[r][0]} is not {sp}"
            assert np.array_equal(v[r], want_v), f"layer {layer} row {r}: value is not {sp}'s"


@pytest.fixture(params=[False, True], ids=["v-rows", "v-permuted"])
def permuted_v(request):
    return request.param


# ------------------------------------------------------------------------------------------
# 1. sizing
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, cells", [
    (dict(max_seqs=3, capacity=5, cache_padding=4), 16),
    (dict(max_seqs=2, capacity=8), 16),
    # SWA: memory defaults to the window; cells = max_seqs * memory + max_batch
    (dict(max_seqs=1, capacity=16, max_batch=8, swa_window=4), 12),
    (dict(max_seqs=1, capacity=16, max_batch=8, swa_window=4, cache_padding=8), 16),
    # more than one sequence: memory >= window + 1
    (dict(max_seqs=2, capacity=16, max_batch=8, swa_window=4), 18),
    (dict(max_seqs=2, capacity=16, max_batch=8, swa_window=4, swa_memory=6), 20),
    (dict(max_seqs=2, capacity=16, max_batch=8, swa_window=4, swa_memory=6, cache_padding=3), 21),
    # memory >= capacity: unlimited (nothing is evicted), sized like a plain cache
    (dict(max_seqs=2, capacity=16, max_batch=8, swa_window=4, swa_memory=16), 32),
    (dict(max_seqs=1, capacity=4, max_batch=8, swa_window=4), 4),
    (dict(max_seqs=2, capacity=5, max_batch=8, swa_window=4), 10),
    # causal.go raises memory to window + 1 *before* checking memory >= window
    (dict(max_seqs=2, capacity=64, max_batch=4, swa_window=8, swa_memory=4), 22),
    (dict(max_seqs=1, capacity=4, max_batch=4, swa_window=8, swa_memory=4), 4),
    # chunked attention keeps everything
    (dict(max_seqs=2, capacity=8, chunk_size=3), 16),
])
def test_sizing(device, kw, cells):
    kw = dict(kw)
    want = ref_sizing(max_seqs=kw.get("max_seqs", 1), capacity=kw["capacity"],
                      max_batch=kw.get("max_batch", 16), cache_padding=kw.get("cache_padding", 1),
                      swa_window=kw.get("swa_window"), swa_memory=kw.get("swa_memory"))[0]
    assert want == cells
    cache = make(device, **kw)
    assert cache.n_cells == cells
    assert cache.device == device
    assert cache.config.max_seqs == kw.get("max_seqs", 1)


def test_sizing_memory_smaller_than_window_is_an_error(device):
    with pytest.raises(ValueError, match="swa_memory|swa_window"):
        make(device, max_seqs=1, capacity=64, max_batch=4, swa_window=8, swa_memory=4)


# ------------------------------------------------------------------------------------------
# 2. placement
# ------------------------------------------------------------------------------------------

def test_placement_first_fit_and_hole_reuse(device, permuted_v):
    c = make(device, max_seqs=3, capacity=8, max_batch=8, permuted_v=permuted_v)
    assert c.n_cells == 24
    b = forward(c, [0, 1, 2], [0, 0, 0])
    assert b.range == (0, 3)
    assert_rows(b, [(0, 0), (0, 1), (0, 2)])
    assert_mask(b.mask, "0xx/00x/000")

    b = forward(c, [0, 1], [1, 1])                      # right after seq 0's cells
    assert b.range == (3, 5)
    assert_rows(b, [(1, 0), (1, 1)])
    assert_mask(b.mask, "0x/00")

    b = forward(c, [3], [0])                            # seq 0's range + its new cell 5
    assert b.range == (0, 6)
    assert_rows(b, [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (0, 3)])
    assert_mask(b.mask, "000xx0")

    assert c.seq_rm(1) is True                          # frees cells 3, 4
    b = forward(c, [0, 1], [2, 2])                      # the hole is reused
    assert b.range == (3, 5)
    assert_rows(b, [(2, 0), (2, 1)])

    b = forward(c, [2, 3, 4], [2, 2, 2])                # no run of 3 before cell 6
    assert b.range == (3, 9)
    assert_rows(b, [(2, 0), (2, 1), (0, 3), (2, 2), (2, 3), (2, 4)])
    assert_mask(b.mask, "00x0xx/00x00x/00x000")


def test_cache_padding_and_mask_batch_padding(device, permuted_v):
    c = make(device, max_seqs=2, capacity=8, cache_padding=4, mask_batch_padding=4,
             permuted_v=permuted_v)
    assert c.n_cells == 16
    b = forward(c, [0, 1, 2], [0, 0, 0])
    assert b.range == (0, 4)
    assert_rows(b, [(0, 0), (0, 1), (0, 2), None])
    assert_mask(b.mask, "0xxx/00xx/000x/xxxx")
    for m in b.masks:
        assert m.shape == (4, 4)

    b = forward(c, [0, 1], [1, 1])                      # cells 3, 4 -> range [0, 8)
    assert b.range == (0, 8)
    assert_rows(b, [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), None, None, None])
    assert_mask(b.mask, "xxx0xxxx/xxx00xxx/xxxxxxxx/xxxxxxxx")


def test_full_cache_defrags_then_retries(device, permuted_v):
    c = make(device, max_seqs=2, capacity=4, max_batch=8, permuted_v=permuted_v)
    assert c.n_cells == 8
    forward(c, [0, 1], [0, 0])
    forward(c, [0, 1], [1, 1])
    forward(c, [2, 3], [0, 0])
    forward(c, [2, 3], [1, 1])
    c.seq_rm(0)                                         # free: 0, 1, 4, 5 (no run of 3)
    b = forward(c, [4, 5, 6], [1, 1, 1])
    # after the defrag seq 1's four cells are packed at 0..3, the batch lands on 4..6
    assert b.range == (0, 7)
    rows = b.rows()
    assert sorted(rows[:4]) == [(1, 0), (1, 1), (1, 2), (1, 3)]
    assert rows[4:] == [(1, 4), (1, 5), (1, 6)]
    assert_rows(b, rows)                                # every row carries its own K/V
    for i, p in enumerate([4, 5, 6]):
        seen = sorted(rows[j] for j in np.flatnonzero(b.mask[i] == 0))
        assert seen == [(1, q) for q in range(p + 1)]
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (-1, -1)
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (0, 6)


def test_full_cache_raises_and_changes_nothing(device, permuted_v):
    c = make(device, max_seqs=1, capacity=4, permuted_v=permuted_v)
    forward(c, [0, 1, 2], [0, 0, 0])
    before = state_snapshot(c)
    with pytest.raises(KVCacheFullError):
        c.start_forward([3, 4], [0, 0])
    assert_same_state(before, state_snapshot(c))
    b = forward(c, [3], [0])                            # one cell is still free
    assert b.range == (0, 4)
    assert_rows(b, [(0, 0), (0, 1), (0, 2), (0, 3)])


def test_failed_start_forward_keeps_window_evictions_undone(device):
    # window 2, memory 2: 2 + max_batch 4 = 6 cells
    c = make(device, max_seqs=1, capacity=16, max_batch=4, swa_window=2)
    assert c.n_cells == 6
    forward(c, [20], [0])                               # a far position is never evicted
    forward(c, [0, 1, 2, 3], [0] * 4)
    forward(c, [4, 5], [0, 0])                          # evicts 0, 1; stored 2..5 and 20
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (2, 20)
    before = state_snapshot(c)
    # lowest 6 would evict positions 2, 3 (two cells), leaving 3 free for 4 tokens: full.
    # Ollama keeps that eviction on failure; numbakv must not.
    with pytest.raises(KVCacheFullError):
        c.start_forward([6, 7, 8, 9], [0] * 4)
    assert_same_state(before, state_snapshot(c))


# ------------------------------------------------------------------------------------------
# 3. get() ranges and masks (the spirit of Ollama's causal_test.go)
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_store(device, permuted_v, dtype):
    c = make(device, dtype=dtype, permuted_v=permuted_v)
    b = forward(c, [0, 1, 2, 3], [0] * 4)
    assert b.range == (0, 4)
    assert_rows(b, [(0, p) for p in range(4)])
    assert_mask(b.mask, "0xxx/00xx/000x/0000")
    b = forward(c, [4, 5], [0, 0])
    assert b.range == (0, 6)
    assert_rows(b, [(0, p) for p in range(6)])
    assert_mask(b.mask, "00000x/000000")
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 5)


def test_swa(device, permuted_v):
    c = make(device, max_batch=4, swa_window=1, permuted_v=permuted_v)
    assert c.n_cells == 5                               # memory 1 + max_batch 4
    b = forward(c, [0, 1, 2, 3], [0] * 4)
    assert b.range == (0, 4)
    assert_rows(b, [(0, 0), (0, 1), (0, 2), (0, 3)])
    assert_mask(b.mask, "0xxx/00xx/x00x/xx00")

    # lowest 4 evicts positions < 3: cells 0..2 free; the batch takes 0, 1; pos 3 stays at 3
    b = forward(c, [4, 5], [0, 0])
    assert b.range == (0, 4)
    assert_rows(b, [(0, 4), (0, 5), None, (0, 3)])
    assert_mask(b.mask, "0xx0/00xx")
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (3, 5)

    # lowest 6 evicts < 5 (cells 0 and 3); new token at cell 0; pos 5 at cell 1
    b = forward(c, [6], [0])
    assert b.range == (0, 2)
    assert_rows(b, [(0, 6), (0, 5)])
    assert_mask(b.mask, "00")
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (5, 6)


def test_swa_memory(device, permuted_v):
    c = make(device, max_batch=4, swa_window=1, swa_memory=3, permuted_v=permuted_v)
    assert c.n_cells == 7
    b = forward(c, [0, 1, 2, 3], [0] * 4)
    assert_mask(b.mask, "0xxx/00xx/x00x/xx00")

    # evicts pos 0 (cell 0: a run of one), the batch goes to 4, 5; range: pos >= 3 + new
    b = forward(c, [4, 5], [0, 0])
    assert b.range == (3, 6)
    assert_rows(b, [(0, 3), (0, 4), (0, 5)])
    assert_mask(b.mask, "00x/x00")
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (1, 5)

    # evicts pos < 3 (cells 1, 2); the token goes to cell 0; range: pos >= 5 (cell 5) + cell 0
    b = forward(c, [6], [0])
    assert b.range == (0, 6)
    assert_rows(b, [(0, 6), None, None, (0, 3), (0, 4), (0, 5)])
    assert_mask(b.mask, "0xxxx0")
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (3, 6)


def test_swa_unlimited_memory_masks_but_keeps_everything(device):
    # memory 16 >= capacity 16: nothing evicted, range = the whole sequence, window still masks
    c = make(device, max_batch=4, swa_window=1, swa_memory=16)
    assert c.n_cells == 16
    forward(c, [0, 1, 2, 3], [0] * 4)
    b = forward(c, [4, 5], [0, 0])
    assert b.range == (0, 6)
    assert_rows(b, [(0, p) for p in range(6)])
    assert_mask(b.mask, "xxx00x/xxxx00")
    assert c.seq_pos_min(0) == 0


def test_swa_idle_sequences_are_trimmed_too(device):
    # Ollama #10127: a sequence outside the batch must also drop what left its memory.
    c = make(device, max_seqs=2, max_batch=4, swa_window=2)
    assert c.n_cells == 10                              # memory 3 (window + 1), 2 * 3 + 4
    forward(c, [0, 1, 2, 3], [0] * 4)                   # cells 0..3
    forward(c, [0, 1, 2, 3], [1] * 4)                   # cells 4..7
    b = forward(c, [4], [1])
    # seq 1 evicts pos 0 (cell 4); idle seq 0 (lowest 3 + 1) evicts pos 0 (cell 0): the token
    # takes cell 0; seq 1's range is its positions >= 2 (cells 6, 7)
    assert b.range == (0, 8)
    assert_rows(b, [(1, 4), (0, 1), (0, 2), (0, 3), None, (1, 1), (1, 2), (1, 3)])
    assert_mask(b.mask, "0xxxxx00")
    assert c.seq_pos_min(0) == 1 and c.seq_pos_min(1) == 1
    for p in range(5, 17):                              # decoding never runs out of cells
        b = forward(c, [p], [1])
        rows = b.rows()
        assert sorted(rows[j] for j in np.flatnonzero(b.mask[0] == 0)) == \
            [(1, q) for q in range(p - 2, p + 1)]
        assert c.seq_pos_min(1) == p - 3 and c.seq_pos_max(1) == p
        assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (1, 3)


def test_chunked_attention(device, permuted_v):
    c = make(device, chunk_size=2, permuted_v=permuted_v)
    b = forward(c, [0, 1, 2, 3], [0] * 4)
    assert_mask(b.mask, "0xxx/00xx/xx0x/xx00")
    b = forward(c, [4, 5, 6], [0] * 3)
    assert b.range == (0, 7)
    assert_rows(b, [(0, p) for p in range(7)])
    assert_mask(b.mask, "xxxx0xx/xxxx00x/xxxxxx0")


def test_sequences(device, permuted_v):
    c = make(device, max_seqs=2, capacity=8, permuted_v=permuted_v)
    b = forward(c, [0, 1, 0, 1], [0, 0, 1, 1])
    assert b.range == (0, 4)
    assert_rows(b, [(0, 0), (0, 1), (1, 0), (1, 1)])
    assert_mask(b.mask, "0xxx/00xx/xx0x/xx00")
    b = forward(c, [2, 2], [0, 1])
    assert b.range == (0, 6)
    assert_rows(b, [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2)])
    assert_mask(b.mask, "00xx0x/xx00x0")
    assert (c.seq_pos_max(0), c.seq_pos_max(1)) == (2, 2)


def test_interleaved_sequences_in_one_batch(device):
    c = make(device, max_seqs=2, capacity=8)
    b = forward(c, [0, 0, 1, 1], [0, 1, 0, 1])
    assert_rows(b, [(0, 0), (1, 0), (0, 1), (1, 1)])
    assert_mask(b.mask, "0xxx/x0xx/0x0x/x0x0")


def test_set_causal(device):
    c = make(device, max_seqs=1, capacity=16)
    c.start_forward([0, 1, 2, 3], [0] * 4)
    c.set_causal([1, 2])
    for layer in range(L):
        c.set_layer(layer)
        c.put(to_device(enc_key([0] * 4, range(4), layer, H, D).astype(np.float16), device),
              to_device(enc_value([0] * 4, range(4), layer, H, D).astype(np.float16), device))
    c.set_layer(0)
    _, _, m = c.get()
    assert_mask(to_host(m), "0xxx/0000/0000/0000")
    c.set_causal(None)                                   # back to causal in this batch
    _, _, m = c.get()
    assert_mask(to_host(m), "0xxx/00xx/000x/0000")
    c.set_causal([0])
    _, _, m = c.get()
    assert_mask(to_host(m), "0000/00xx/000x/0000")
    b = forward(c, [4, 5], [0, 0])                       # reset at the next start_forward
    assert_mask(b.mask, "00000x/000000")


def test_set_causal_flags_are_read_only_like_the_default_ones():
    """The flags set_causal makes are read-only, as start_forward's all-ones are: the compiled
    functions they reach are typed by the array's flags, and a writable array compiled another
    signature of each (pages, mask, every CPU attention form: ~23 s of first-use compiles)."""
    c = make("cpu", max_seqs=1, capacity=16)
    c.start_forward([0, 1, 2], [0] * 3)
    assert not c._forward.causal.flags.writeable
    c.set_causal([1])
    assert not c._forward.causal.flags.writeable
    assert c._forward.causal.tolist() == [1, 0, 1]


def test_set_causal_keeps_window_and_chunk(device):
    c = make(device, max_batch=4, swa_window=1)
    b = forward(c, [0, 1, 2, 3], [0] * 4, except_=[2])
    assert_mask(b.mask, "0xxx/00xx/x000/xx00")      # pos 2 sees 1.. (window) incl. future 3
    c = make(device, chunk_size=2)
    b = forward(c, [0, 1, 2, 3], [0] * 4, except_=[0, 2])
    assert_mask(b.mask, "0000/00xx/xx00/xx00")      # no future test; chunk start still masks


def test_mask_dtype_float16(device):
    c = make(device, mask_dtype="float16", mask_batch_padding=2)
    c.start_forward([0, 1, 2], [0] * 3)
    c.set_layer(0)
    c.put(to_device(enc_key([0] * 3, range(3), 0, H, D).astype(np.float16), device),
          to_device(enc_value([0] * 3, range(3), 0, H, D).astype(np.float16), device))
    _, _, m = c.get()
    m = to_host(m)
    assert m.dtype == np.float16
    assert_mask(m.astype(np.float32), "0xx/00x/000/xxx")


def test_reserve_changes_nothing(device, permuted_v):
    c = make(device, max_seqs=2, capacity=8, mask_batch_padding=4, permuted_v=permuted_v)
    forward(c, [0, 1, 2], [0, 0, 0])
    before = state_snapshot(c)
    c.start_forward([5, 6, 7], [0, 1, 1], reserve=True)
    for layer in range(L):
        c.set_layer(layer)
        c.put(to_device(np.full((3, H, D), 7, np.float16), device),
              to_device(np.full((3, H, D), 7, np.float16), device))
        k, v, m = c.get()
        assert to_host(k).shape == (16, H, D)
        assert to_host(m).shape == (4, 16)
        assert to_host(v).shape == ((H, D, 16) if permuted_v else (16, H, D))
    assert_same_state(before, state_snapshot(c))          # the reserve put wrote nothing
    assert (c.seq_pos_max(0), c.seq_pos_max(1)) == (2, -1)
    b = forward(c, [3], [0])                               # as if the reserve never happened
    assert b.range == (0, 4)
    assert_rows(b, [(0, 0), (0, 1), (0, 2), (0, 3)])


def test_reserve_does_not_slide_the_window(device):
    c = make(device, max_batch=4, swa_window=1)
    forward(c, [0, 1, 2, 3], [0] * 4)
    c.start_forward([10], [0], reserve=True)
    assert c.seq_pos_min(0) == 0
    b = forward(c, [4], [0])                                # evicts < 3 now
    assert c.seq_pos_min(0) == 3
    assert b.range == (0, 4)
    assert_rows(b, [(0, 4), None, None, (0, 3)])
    assert_mask(b.mask, "0xx0")


def test_v_head_dim_differs(device, permuted_v):
    c = make(device, v_head_dim=4, permuted_v=permuted_v, max_seqs=2, capacity=4)
    b = forward(c, [0, 1, 0], [0, 0, 1])
    assert b.values[0].shape == (3, H, 4)
    assert_rows(b, [(0, 0), (0, 1), (1, 0)])


# ------------------------------------------------------------------------------------------
# 4. remove
# ------------------------------------------------------------------------------------------

def test_remove_to_the_end(device, permuted_v):
    c = make(device, max_seqs=2, capacity=8, permuted_v=permuted_v)
    forward(c, [0, 1, 0, 1], [0, 0, 1, 1])
    c.remove(0, 1)                                           # seq 0 keeps pos 0 (cell 0)
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 0)
    b = forward(c, [1, 2], [0, 1])                           # cell 1 alone is too small
    assert b.range == (0, 6)
    assert_rows(b, [(0, 0), None, (1, 0), (1, 1), (0, 1), (1, 2)])
    assert_mask(b.mask, "0xxx0x/xx00x0")


def test_remove_middle_with_a_shift_callable(device, permuted_v):
    shift = AddShift()
    c = make(device, max_seqs=2, capacity=8, shift=shift, permuted_v=permuted_v)
    forward(c, [0, 1, 0, 1], [0, 0, 1, 1])
    c.remove(0, 1)
    forward(c, [1, 2], [0, 1])                               # seq 0: cells 0 (pos 0), 4 (pos 1)
    assert shift.calls == []
    c.remove(0, 0, 1)                                        # cell 4 moves to pos 0: delta -1
    layers = sorted(call[0] for call in shift.calls)
    assert layers == list(range(L))
    for _, n, d in shift.calls:
        assert n == len(d) and set(d.tolist()) <= {0, -1} and (d == -1).sum() == 1
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 0)
    b = forward(c, [1, 2], [0, 0])                           # cells 0, 1
    assert b.range == (0, 5)
    assert_rows(b, [(0, 1), (0, 2), (1, 0), (1, 1), None])
    assert_mask(b.mask, "0xxx0/00xx0")
    for layer in range(L):                                   # the moved key got key + (-1)
        want_k = enc_key([0], [1], layer, H, D)[0] - 1
        want_v = enc_value([0], [1], layer, H, D)[0]
        assert np.array_equal(b.k(layer)[4], want_k)
        assert np.array_equal(b.v(layer)[4], want_v)


def test_remove_shift_is_called_in_batches_of_max_batch(device):
    shift = AddShift()
    c = make(device, max_batch=2, shift=shift)
    for p in range(0, 10, 2):
        forward(c, [p, p + 1], [0, 0])
    c.remove(0, 1, 2)                                        # cells 2..9 move by -1
    assert sorted({call[0] for call in shift.calls}) == list(range(L))
    for layer in range(L):
        calls = [call for call in shift.calls if call[0] == layer]
        for _, n, d in calls:
            assert n == len(d) <= 2
            assert set(d.tolist()) <= {0, -1}
        assert sum(int((d == -1).sum()) for _, _, d in calls) == 8
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 8)
    b = forward(c, [9], [0])                                 # takes the freed cell 1
    assert b.range == (0, 10)
    assert_mask(b.mask, "0" * 10)
    for layer in range(L):
        k = b.k(layer)
        assert np.array_equal(k[0], enc_key([0], [0], layer, H, D)[0])
        assert np.array_equal(k[1], enc_key([0], [9], layer, H, D)[0])
        for cell in range(2, 10):
            assert np.array_equal(k[cell], enc_key([0], [cell], layer, H, D)[0] - 1)


@pytest.mark.parametrize("neox, dim, freq_scale, base", [
    (True, None, 1.0, 10000.0), (False, None, 1.0, 10000.0),
    (True, 4, 0.5, 500.0), (False, 6, 2.0, 1e6)])
def test_remove_middle_with_rope_shift(device, neox, dim, freq_scale, base):
    # the rotary shift touches keys only (V layouts are covered by the other remove tests)
    rope = nkv.RopeShift(base=base, dim=dim, neox=neox, freq_scale=freq_scale)
    c = make(device, dtype="float32", shift=rope)
    rng = np.random.default_rng(7)
    raw = rng.standard_normal((L, 10, H, D)).astype(np.float32)     # un-roped keys
    pos = np.arange(10)
    kw = dict(base=base, dim=dim, neox=neox, freq_scale=freq_scale)
    keys = np.stack([rope_ref(raw[l], pos, **kw) for l in range(L)]).astype(np.float32)
    values = rng.standard_normal((L, 10, H, D)).astype(np.float32)
    forward(c, pos, [0] * 10, keys=keys, values=values)
    c.remove(0, 2, 5)                                        # 5..9 become 2..6
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 6)
    nk = rng.standard_normal((L, 1, H, D)).astype(np.float32)
    b = forward(c, [7], [0], keys=nk, values=nk)             # first free cell: 2
    assert b.range == (0, 10)
    assert_mask(b.mask, "000xx00000")
    for layer in range(L):
        k, v = b.k(layer), b.v(layer)
        np.testing.assert_array_equal(k[:2], keys[layer, :2])
        np.testing.assert_array_equal(k[2], nk[layer, 0])
        # a moved key equals the raw key roped at its new position
        want = rope_ref(raw[layer, 5:10], np.arange(2, 7), **kw)
        np.testing.assert_allclose(k[5:10], want, rtol=1e-5, atol=2e-5)
        np.testing.assert_array_equal(v[5:10], values[layer, 5:10])
        np.testing.assert_array_equal(v[:2], values[layer, :2])


def test_remove_without_shift(device):
    c = make(device, max_seqs=2, capacity=8)
    forward(c, list(range(6)), [0] * 6)
    before = state_snapshot(c)
    with pytest.raises(NotSupportedError):
        c.remove(0, 2, 4)
    assert_same_state(before, state_snapshot(c))
    with pytest.raises(NotSupportedError):                   # keeps 0, 1 (causal.go still shifts)
        c.remove(0, 2, 100)
    assert_same_state(before, state_snapshot(c))
    c.remove(1, 0, 5)                                        # nothing stored: fine
    c.remove(0, 4)                                           # truncation needs no shift
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 3)
    c.remove(0, 0, 100)                                      # nothing left: nothing to shift
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (-1, -1)


def test_remove_shared_cells(device):
    shift = AddShift()
    c = make(device, max_seqs=2, capacity=8, shift=shift)
    forward(c, [0, 1, 2, 3], [0] * 4)
    c.copy_prefix(0, 1, 2)                                   # cells 0, 1 shared
    before = state_snapshot(c)
    with pytest.raises(NotSupportedError):
        c.remove(0, 0, 1)                                    # cell 1 would move
    assert_same_state(before, state_snapshot(c))
    assert shift.calls == []
    c.remove(0, 2, 3)                                        # only cell 3 moves
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 2)
    c.remove(0, 1)                                           # shared cell 1 only drops seq 0
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 0)
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (0, 1)
    b = forward(c, [2], [1])                                 # cells 2, 3 are free again
    assert b.range == (0, 3)
    assert_rows(b, [(0, 0), (0, 1), (1, 2)])
    assert_mask(b.mask, "000")


# ------------------------------------------------------------------------------------------
# 5. copy_prefix, can_resume
# ------------------------------------------------------------------------------------------

def test_copy_prefix(device, permuted_v):
    c = make(device, max_seqs=2, capacity=8, permuted_v=permuted_v)
    forward(c, [0, 1, 2, 3], [0] * 4)
    c.copy_prefix(0, 1, 2)
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (0, 1)
    b = forward(c, [2], [1])
    assert b.range == (0, 5)
    assert_rows(b, [(0, 0), (0, 1), (0, 2), (0, 3), (1, 2)])
    assert_mask(b.mask, "00xx0")
    b = forward(c, [4, 3], [0, 1])                           # cells 5, 6
    assert b.range == (0, 7)
    assert_mask(b.mask, "0000x0x/00xx0x0")
    c.copy_prefix(0, 1, 1)                                   # dst is replaced, not merged
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (0, 0)
    b = forward(c, [1], [1])                                 # seq 1's cells 4, 6 were freed
    assert b.range == (0, 5)
    assert_rows(b, [(0, 0), (0, 1), (0, 2), (0, 3), (1, 1)])
    assert_mask(b.mask, "0xxx0")


def test_copy_prefix_undo_record():
    """An edit's undo record holds exactly the rows of the blocks it may touch, in block order
    (whole-block slice copies in cells._save_blocks), for edits into an empty and a non-empty
    destination, and a failed copy_prefix puts the table back exactly."""
    from numbakv.cells import _INF, _M_BSHIFT, _block_cells
    c = make("cpu", max_seqs=3, capacity=200, max_batch=256)
    forward(c, list(range(150)), [0] * 150)                  # blocks 0..2 (64-cell leaves)
    forward(c, list(range(200)), [2] * 200)                  # cells 150..349
    forward(c, list(range(150, 170)), [0] * 20)              # block 5: seq 0 spans two runs
    t = c.cells
    bshift = int(t._meta[_M_BSHIFT])
    for src, dst, n in ((0, 1, 150), (0, 1, 100), (2, 1, 40), (0, 2, 150), (2, 1, 200),
                        (0, 1, 170), (0, 2, 170)):
        rec: list = []
        t._record(rec, dst, 0, _INF, src, 0, n)
        j = rec[0]
        assert len(j.blocks) and (np.diff(j.blocks) > 0).all()
        rows = np.concatenate([np.arange(*_block_cells(b, bshift, t.n_cells)) for b in j.blocks])
        assert np.array_equal(j.pos, t._pos[rows]) and j.pos.dtype == t._pos.dtype
        assert np.array_equal(j.shift, t._shift[rows]) and j.shift.dtype == t._shift.dtype
        assert np.array_equal(j.seqs, t._seqs[rows]) and j.seqs.dtype == t._seqs.dtype

    before = (c.cells.cells, c.cells._sidx.copy(), c.cells._stree.copy())
    real = c.cells.copy_prefix

    def failing(*args, **kw):
        real(*args, **kw)
        raise RuntimeError("injected")

    c.cells.copy_prefix = failing
    try:
        with pytest.raises(RuntimeError, match="injected"):
            c.copy_prefix(0, 2, 150)
    finally:
        del c.cells.copy_prefix
    after = (c.cells.cells, c.cells._sidx, c.cells._stree)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert (c.seq_pos_min(2), c.seq_pos_max(2)) == (0, 199)
    c.copy_prefix(0, 2, 150)
    assert (c.seq_pos_min(2), c.seq_pos_max(2)) == (0, 149)


def test_can_resume_unlimited(device):
    c = make(device, max_seqs=2, capacity=8)
    assert c.can_resume(0, 0) and c.can_resume(1, 100)
    forward(c, [0, 1, 2], [0] * 3)
    assert all(c.can_resume(0, p) for p in range(10))


def test_can_resume_swa(device):
    c = make(device, max_batch=16, swa_window=4)
    assert c.n_cells == 20
    assert not c.can_resume(0, 0)                            # nothing stored
    forward(c, [0, 1, 2, 3, 4], [0] * 5)
    assert [c.can_resume(0, p) for p in range(8)] == [True] * 6 + [False] * 2
    forward(c, [5], [0])                                     # evicts pos 0
    assert [c.can_resume(0, p) for p in range(8)] == [False] * 5 + [True] * 2 + [False]


def test_can_resume_swa_memory(device):
    c = make(device, max_batch=16, swa_window=4, swa_memory=5)
    assert c.n_cells == 21
    forward(c, list(range(7)), [0] * 7)
    assert [c.can_resume(0, p) for p in range(10)] == [True] * 8 + [False] * 2
    forward(c, [7], [0])                                     # evicts pos < 2
    assert [c.can_resume(0, p) for p in range(10)] == [False] * 6 + [True] * 3 + [False]


# ------------------------------------------------------------------------------------------
# 6. defrag
# ------------------------------------------------------------------------------------------

def test_defrag_keeps_each_cell_with_its_data(device, permuted_v):
    # Ollama's defrag merges the moves 7->0 and 6->1 into one block copy 6..7 -> 0..1 and so
    # swaps the data of (0, 3) and (1, 3). numbakv must keep every (seq, pos) with its K/V.
    c = make(device, max_seqs=2, capacity=4, max_batch=8, permuted_v=permuted_v)
    forward(c, [0, 1, 0, 1, 2, 2, 3, 3], [0, 0, 1, 1, 0, 1, 0, 1])
    c.seq_rm(0, 0, 2)                                        # frees cells 0, 1
    c.defrag()
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (2, 3)
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (0, 3)
    b = forward(c, [4, 4], [0, 1])
    assert b.range == (0, 8)                                 # packed: the batch lands on 6, 7
    rows = b.rows()
    assert sorted(rows[:6]) == [(0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert rows[6:] == [(0, 4), (1, 4)]
    assert_rows(b, rows)
    for i, s in enumerate([0, 1]):
        seen = sorted(rows[j] for j in np.flatnonzero(b.mask[i] == 0))
        want = [(0, 2), (0, 3), (0, 4)] if s == 0 else [(1, q) for q in range(5)]
        assert seen == want


def test_defrag_many_holes(device, permuted_v):
    c = make(device, max_seqs=3, capacity=5, max_batch=15, permuted_v=permuted_v)
    seqs = [0, 1, 2] * 5
    pos = [p for p in range(5) for _ in range(3)]
    forward(c, pos, seqs)
    c.seq_rm(1, 1, 4)                                        # holes at 4, 7, 10
    c.seq_rm(0, 0, 2)                                        # holes at 0, 3
    c.defrag()
    b = forward(c, [5, 5, 5], [0, 1, 2])
    assert b.range == (0, 13)                                # 10 used cells, then the batch
    rows = b.rows()
    assert_rows(b, rows)
    assert rows[10:] == [(0, 5), (1, 5), (2, 5)]
    want = {0: [2, 3, 4, 5], 1: [0, 4, 5], 2: [0, 1, 2, 3, 4, 5]}
    for i, s in enumerate([0, 1, 2]):
        seen = sorted(rows[j] for j in np.flatnonzero(b.mask[i] == 0))
        assert seen == [(s, q) for q in want[s]]


# ------------------------------------------------------------------------------------------
# 7. llama.cpp sequence operations
# ------------------------------------------------------------------------------------------

def visible(b, i):
    rows = b.rows()
    return sorted(rows[j] for j in np.flatnonzero(b.mask[i] == 0))


def test_seq_rm(device):
    c = make(device, max_seqs=2, capacity=8)
    forward(c, [0, 1, 2, 3, 4, 5], [0] * 6)
    forward(c, [0, 1, 2], [1] * 3)
    assert c.seq_rm(0, 2, 4) is True                         # a gap; nothing moves
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 5)
    b = forward(c, [6], [0])                                 # first free cell: 2
    assert b.range == (0, 6)
    assert visible(b, 0) == [(0, 0), (0, 1), (0, 4), (0, 5), (0, 6)]
    assert c.seq_rm(-1, 1) is True                           # every sequence, 1.. to the end
    assert (c.seq_pos_max(0), c.seq_pos_max(1)) == (0, 0)
    assert c.seq_rm(1) is True
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (-1, -1)
    assert c.seq_rm(-1) is True
    assert c.seq_pos_max(0) == -1
    b = forward(c, list(range(16)), [1] * 16)                # everything is free again
    assert b.range == (0, 16)


def test_seq_cp_and_keep(device):
    c = make(device, max_seqs=3, capacity=4)
    forward(c, [0, 1, 2, 3], [0] * 4)
    c.seq_cp(0, 1, 1, 3)
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (1, 2)
    b = forward(c, [3], [1])
    assert visible(b, 0) == [(0, 1), (0, 2), (1, 3)]
    c.seq_cp(0, 2)                                           # p0=0, p1=None: everything
    assert (c.seq_pos_min(2), c.seq_pos_max(2)) == (0, 3)
    c.seq_keep(1)
    assert [c.seq_pos_max(s) for s in range(3)] == [-1, 3, -1]
    b = forward(c, [0], [0])                                 # cell 0 was freed
    assert b.range == (0, 1)
    b = forward(c, [4], [1])                                 # seq 1: cells 1, 2, 4 + new 3
    assert b.range == (1, 5)
    assert visible(b, 0) == [(0, 1), (0, 2), (1, 3), (1, 4)]


def _roped(rng, n, kw):
    raw = rng.standard_normal((L, n, H, D)).astype(np.float32)
    keys = np.stack([rope_ref(raw[l], np.arange(n), **kw) for l in range(L)]).astype(np.float32)
    return raw, keys


def test_seq_add_makes_room(device):
    rope = nkv.RopeShift(base=10000.0, neox=True)
    c = make(device, dtype="float32", shift=rope, max_batch=8)
    rng = np.random.default_rng(3)
    raw, keys = _roped(rng, 6, {})
    forward(c, range(6), [0] * 6, keys=keys, values=keys)
    c.seq_add(0, 3, 6, 4)                                    # 0 1 2 7 8 9
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 9)
    b = forward(c, [3, 4, 5, 6], [0] * 4)                    # fill the gap: cells 6..9
    assert b.range == (0, 10)
    assert_mask(b.mask, "000xxx0xxx/000xxx00xx/000xxx000x/000xxx0000")
    for layer in range(L):
        k, v = b.k(layer), b.v(layer)
        np.testing.assert_array_equal(k[:3], keys[layer, :3])
        np.testing.assert_allclose(k[3:6], rope_ref(raw[layer, 3:6], [7, 8, 9]),
                                   rtol=1e-5, atol=2e-5)
        np.testing.assert_array_equal(v[3:6], keys[layer, 3:6])
    b = forward(c, [10], [0])
    assert_mask(b.mask, "0" * 11)


def test_seq_add_negative_drops_cells(device):
    rope = nkv.RopeShift(base=10000.0, neox=False)
    c = make(device, dtype="float32", shift=rope)
    rng = np.random.default_rng(4)
    raw, keys = _roped(rng, 6, dict(neox=False))
    forward(c, range(6), [0] * 6, keys=keys, values=keys)
    c.seq_add(0, 0, 6, -2)                                   # 0, 1 -> dropped; 2..5 -> 0..3
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 3)
    b = forward(c, [4], [0])
    assert b.range == (0, 6)
    assert_mask(b.mask, "0x0000")
    for layer in range(L):
        np.testing.assert_allclose(b.k(layer)[2:6], rope_ref(raw[layer, 2:6], [0, 1, 2, 3],
                                                             neox=False), rtol=1e-5, atol=2e-5)


def test_seq_add_twice_before_a_forward(device, permuted_v):
    shift = AddShift()
    c = make(device, shift=shift, permuted_v=permuted_v)
    forward(c, range(4), [0] * 4)
    c.seq_add(0, 2, 4, 3)                                    # 0 1 5 6
    c.seq_add(0, 5, 6, 2)                                    # 0 1 7 6
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 7)
    b = forward(c, [8], [0])
    for layer in range(L):
        k = b.k(layer)
        assert np.array_equal(k[2], enc_key([0], [2], layer, H, D)[0] + 5)
        assert np.array_equal(k[3], enc_key([0], [3], layer, H, D)[0] + 3)
    c2 = make(device, shift=AddShift())
    forward(c2, range(4), [0] * 4)
    c2.seq_add(0, 2, 4, 3)
    b = forward(c2, [4], [0])                                # sees 0, 1, 4 but not 5, 6
    assert_mask(b.mask, "00xx0")


def test_seq_add_on_shared_cells_is_not_supported(device):
    c = make(device, max_seqs=2, shift=AddShift())
    forward(c, range(4), [0] * 4)
    c.seq_cp(0, 1)
    before = state_snapshot(c)
    with pytest.raises(NotSupportedError):
        c.seq_add(0, 2, 4, 1)
    assert_same_state(before, state_snapshot(c))
    c.seq_add(0, 10, 20, 1)                                  # nothing in range: no-op
    assert_same_state(before, state_snapshot(c))


def test_seq_div(device):
    rope = nkv.RopeShift(base=10000.0)
    c = make(device, dtype="float32", shift=rope)
    rng = np.random.default_rng(5)
    raw, keys = _roped(rng, 8, {})
    forward(c, range(8), [0] * 8, keys=keys, values=keys)
    c.seq_div(0, 0, 8, 2)                                    # 0 0 1 1 2 2 3 3
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 3)
    b = forward(c, [4], [0])                  # a held position may not be re-put: sees all
    assert_mask(b.mask, "000000000")
    for layer in range(L):
        np.testing.assert_allclose(b.k(layer)[:8], rope_ref(raw[layer], np.arange(8) // 2),
                                   rtol=1e-5, atol=2e-5)


def test_seq_pos_of_empty_sequences(device):
    c = make(device, max_seqs=3, capacity=4)
    assert [(c.seq_pos_min(s), c.seq_pos_max(s)) for s in range(3)] == [(-1, -1)] * 3
    forward(c, [5, 7], [2, 2])
    assert (c.seq_pos_min(2), c.seq_pos_max(2)) == (5, 7)


# ------------------------------------------------------------------------------------------
# 8. dtypes
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_dtype_round_trip(device, permuted_v, dtype):
    c = make(device, dtype=dtype, permuted_v=permuted_v, v_head_dim=4, capacity=8)
    rng = np.random.default_rng(11)
    k32 = rng.standard_normal((3, H, D)).astype(np.float32)
    v32 = rng.standard_normal((3, H, 4)).astype(np.float32)
    ks, vs = to_storage(k32, dtype), to_storage(v32, dtype)
    c.start_forward([0, 1, 2], [0, 0, 0])
    c.set_layer(1)
    c.put(to_device(ks, device), to_device(vs, device))
    k, v, _ = c.get()
    if dtype == "bfloat16":
        assert hasattr(k, "bits") and hasattr(k, "__dlpack__")
        assert hasattr(v, "bits") and hasattr(v, "__dlpack__")
    k, v = to_host(k), to_host(v)
    if permuted_v:
        assert v.shape == (H, 4, 3)
        v = v.transpose(2, 0, 1)
    assert k.dtype == ks.dtype and v.dtype == vs.dtype
    assert np.array_equal(k, ks) and np.array_equal(v, vs)


# ------------------------------------------------------------------------------------------
# 9. bad input: ValueError naming the argument, nothing changed
# ------------------------------------------------------------------------------------------

BAD_CALLS = [
    ("start_forward", lambda c: c.start_forward([3, 4], [0]), "positions|seqs"),
    ("negative position", lambda c: c.start_forward([-1], [0]), "positions"),
    ("seq >= max_seqs", lambda c: c.start_forward([3], [2]), "seqs"),
    ("seq < 0", lambda c: c.start_forward([3], [-1]), "seqs"),
    ("batch > max_batch", lambda c: c.start_forward(list(range(3, 8)), [0] * 5),
     "positions|seqs|batch"),
    ("layer too big", lambda c: c.set_layer(L), "layer"),
    ("layer negative", lambda c: c.set_layer(-1), "layer"),
    ("remove seq", lambda c: c.remove(2, 0), "seq"),
    ("copy_prefix dst", lambda c: c.copy_prefix(0, 2, 1), "seq|dst"),
    ("copy_prefix src", lambda c: c.copy_prefix(-1, 1, 1), "seq|src"),
    ("seq_rm seq", lambda c: c.seq_rm(2), "seq"),
    ("seq_rm -2", lambda c: c.seq_rm(-2), "seq"),
    ("seq_cp dst", lambda c: c.seq_cp(0, 2), "seq|dst"),
    ("seq_cp src", lambda c: c.seq_cp(-1, 1), "seq|src"),
    ("seq_keep", lambda c: c.seq_keep(2), "seq"),
    ("seq_add", lambda c: c.seq_add(2, 0, 1, 1), "seq"),
    ("seq_div", lambda c: c.seq_div(2, 0, 1, 2), "seq"),
    ("seq_pos_min", lambda c: c.seq_pos_min(2), "seq"),
    ("seq_pos_max", lambda c: c.seq_pos_max(2), "seq"),
    ("can_resume", lambda c: c.can_resume(2, 0), "seq"),
]


@pytest.mark.parametrize("name, call, match", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_input(device, name, call, match):
    c = make(device, max_seqs=2, capacity=8, max_batch=4, shift=AddShift())
    forward(c, [0, 1, 2], [0, 0, 0])
    forward(c, [0], [1])
    before = state_snapshot(c)
    with pytest.raises(ValueError, match=match):
        call(c)
    assert_same_state(before, state_snapshot(c))
    b = forward(c, [3], [0])                                 # still works as before
    assert b.range == (0, 5)
    assert_mask(b.mask, "000x0")


@pytest.mark.parametrize("what", ["key dim", "value dim", "heads", "batch", "key dtype",
                                  "value dtype"])
def test_bad_put(device, what):
    c = make(device, max_seqs=2, capacity=8, max_batch=4)
    forward(c, [0, 1], [0, 0])
    before = state_snapshot(c)
    c.start_forward([2, 3], [0, 0])
    c.set_layer(0)
    k = np.zeros((2, H, D), np.float16)
    v = np.zeros((2, H, D), np.float16)
    if what == "key dim":
        k, match = np.zeros((2, H, D + 1), np.float16), "key"
    elif what == "value dim":
        v, match = np.zeros((2, H, D - 1), np.float16), "value"
    elif what == "heads":
        k, match = np.zeros((2, H + 1, D), np.float16), "key"
    elif what == "batch":
        k, v, match = np.zeros((3, H, D), np.float16), np.zeros((3, H, D), np.float16), "key|batch"
    elif what == "key dtype":
        k, match = np.zeros((2, H, D), np.float32), "key"
    else:
        v, match = np.zeros((2, H, D), np.float32), "value"
    with pytest.raises(ValueError, match=match):
        c.put(to_device(k, device), to_device(v, device))
    after = state_snapshot(c)
    assert after[0][0] == (0, 3)                             # the batch is placed...
    assert_same_state((after[0],) + before[1:], after)       # ...but no K/V was written


def test_put_before_start_forward(device):
    c = make(device)
    before = state_snapshot(c)
    c2 = make(device)
    c2.set_layer(0)
    with pytest.raises(ValueError, match="start_forward"):
        c2.put(to_device(np.zeros((1, H, D), np.float16), device),
               to_device(np.zeros((1, H, D), np.float16), device))
    assert_same_state(before, state_snapshot(c2))


# ------------------------------------------------------------------------------------------
# 10. attention through the cache equals attention over each sequence's own tokens
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["plain", "swa", "chunked"])
def test_attention(device, kind):
    kw = dict(n_layers=1, dtype="float32", max_seqs=3, capacity=12, max_batch=6)
    window = chunk = None
    if kind == "swa":
        kw.update(capacity=16, swa_window=3)
        window = 3
    elif kind == "chunked":
        kw.update(chunk_size=3)
        chunk = 3
    c = make(device, **kw)
    rng = np.random.default_rng(21)
    hist = {s: {} for s in range(3)}
    schedule = [[0, 0, 0, 0, 1, 1], [2, 2, 2, 0], [1], [0, 2], [1, 2, 0], [1, 1, 1],
                [2], [0, 1], [2, 0], [1, 2], [0], [2, 1, 0]]
    for step in schedule:
        nxt = {s: max(hist[s], default=-1) + 1 for s in range(3)}
        pos = []
        for s in step:
            pos.append(nxt[s])
            nxt[s] += 1
        k = rng.standard_normal((1, len(step), H, D)).astype(np.float32)
        v = rng.standard_normal((1, len(step), H, D)).astype(np.float32)
        for i, (s, p) in enumerate(zip(step, pos)):
            hist[s][p] = (k[0, i], v[0, i])
        b = forward(c, pos, step, keys=k, values=v)
        q = rng.standard_normal((len(step), H, D)).astype(np.float32)
        got = attention_ref(q, b.k(), b.v(), b.mask[:len(step)])
        for i, (s, p) in enumerate(zip(step, pos)):
            seen = [t for t in sorted(hist[s]) if t <= p
                    and (window is None or t >= p - window)
                    and (chunk is None or t >= p - p % chunk)]
            ks = np.stack([hist[s][t][0] for t in seen])
            vs = np.stack([hist[s][t][1] for t in seen])
            want = attention_ref(q[i:i + 1], ks, vs, np.zeros((1, len(seen))))
            np.testing.assert_allclose(got[i], want[0], rtol=1e-6, atol=1e-7)
    c.close()


def test_mask_is_built_at_first_get_and_equals_the_eager_one(device):
    # every device leaves a pass's dense mask for its first get() (attention over page_table()
    # never reads it); the mask is the one start_forward would have built, set_causal rebuilds
    # it, and a start_forward that fails leaves the previous pass's mask readable and unchanged
    cfg = nkv.CacheConfig(1, 2, 4, dtype="float32", capacity=12, max_seqs=2, max_batch=8,
                          device=device)
    lazy = nkv.CausalCache(cfg, swa_window=3)
    eager = nkv.CausalCache(cfg, swa_window=3)
    eager._lazy_mask = False
    kv = to_device(np.ones((5, 2, 4), np.float32), device)
    for pos, seqs in (([0, 1, 2, 0, 1], [0, 0, 0, 1, 1]), ([3, 2, 4], [0, 1, 0]),
                      ([5, 3], [0, 1])):
        for cache in (lazy, eager):
            cache.start_forward(pos, seqs)
            cache.put(kv[:len(pos)], kv[:len(pos)])
        assert lazy._forward.mask is None and eager._forward.mask is not None
        lazy.page_table()
        assert lazy._forward.mask is None
        assert np.array_equal(to_host(lazy.get()[2]), to_host(eager.get()[2]))
        for cache in (lazy, eager):
            cache.set_causal([0])
        assert np.array_equal(to_host(lazy.get()[2]), to_host(eager.get()[2]))
    held = to_host(lazy.get()[2]).copy()
    with pytest.raises(ValueError, match="already stored"):
        lazy.start_forward([6, 5], [0, 0])
    assert np.array_equal(to_host(lazy.get()[2]), held)
