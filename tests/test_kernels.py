"""Every kernel family on every device here (the CPU twin and the real @cuda.jit kernel in the
simulator, or on a GPU) against plain numpy / pure-Python references."""

import numpy as np
import pytest
from numba import njit

from numbakv.kernels import _common, launch, mask, move, put, rope
from helpers import (as_f32, bf16_bits_to_f32, f32_to_bf16_bits, gpu_compiler_missing, random_storage,
                     reference_moves)

DTYPES = ["float16", "float32", "bfloat16"]
STORAGE = {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16}


def xp_for(device):
    if device == "cuda":
        import cupy
        return cupy
    return np


def to_dev(device, x):
    return xp_for(device).asarray(x) if device == "cuda" else x


def to_host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def bits(x):
    x = to_host(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.itemsize])


# ------------------------------------------------------------------ float conversions

_f16_to_f32 = _common.f16_bits_to_f32.cpu
_f32_to_f16 = _common.f32_to_f16_bits.cpu
_f32_to_bf16 = _common.f32_to_bf16_bits.cpu
_bf16_to_f32 = _common.bf16_bits_to_f32.cpu


@njit
def _run_f16_to_f32(a, out):
    for i in range(a.size):
        out[i] = _f16_to_f32(a[i])


@njit
def _run_f32_to_f16(a, out):
    for i in range(a.size):
        out[i] = _f32_to_f16(a[i])


@njit
def _run_f32_to_bf16(a, out):
    for i in range(a.size):
        out[i] = _f32_to_bf16(a[i])


@njit
def _run_bf16_to_f32(a, out):
    for i in range(a.size):
        out[i] = _bf16_to_f32(a[i])


def _interesting_f32(rng):
    x = np.concatenate([
        rng.standard_normal(20000).astype(np.float32),
        (rng.standard_normal(5000) * 1e-5).astype(np.float32),   # half subnormals
        (rng.standard_normal(5000) * 1e-8).astype(np.float32),   # below half's range
        (rng.standard_normal(5000) * 6e4).astype(np.float32),    # near half's overflow
        np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, 65536, 2.0**-24,
                  2.0**-25, 2.0**-25 * 1.0000001, 3 * 2.0**-26, 2.0**-14, 2.0**-14 * (1 - 2**-11),
                  1.0 + 2**-11, 1.0 + 3 * 2**-11, 3e38, -3e38], dtype=np.float32),
    ])
    # exact ties of float32 -> half and -> bfloat16 rounding
    ties = (rng.integers(0, 2**16, 4000).astype(np.uint32) << 16 | 0x8000).view(np.float32)
    ties_h = ((rng.integers(0x38000000, 0x47000000, 4000).astype(np.uint32) & ~np.uint32(0x1FFF))
              | 0x1000).view(np.float32)
    x = np.concatenate([x, ties[np.isfinite(ties)], ties_h])
    return x


def test_half_conversions_match_numpy():
    all_bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(all_bits.size, np.float32)
    _run_f16_to_f32(all_bits, out)
    ref = all_bits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(out[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.isnan(out[nan]).all()

    x = _interesting_f32(np.random.default_rng(1))
    got = np.empty(x.size, np.uint16)
    _run_f32_to_f16(x, got)
    with np.errstate(over="ignore"):
        assert np.array_equal(got, x.astype(np.float16).view(np.uint16))
    nanbits = np.empty(1, np.uint16)
    _run_f32_to_f16(np.array([np.nan], np.float32), nanbits)
    assert np.isnan(nanbits.view(np.float16)[0])
    # the pure-Python form (what the simulator runs) agrees
    sample = x[::97]
    py = np.array([_common.f32_to_f16_bits.py_func(v) for v in sample], np.uint16)
    assert np.array_equal(py, got[::97])


def test_bfloat16_conversions_match_reference():
    x = _interesting_f32(np.random.default_rng(2))
    got = np.empty(x.size, np.uint16)
    _run_f32_to_bf16(x, got)
    assert np.array_equal(got, f32_to_bf16_bits(x))
    back = np.empty(x.size, np.float32)
    _run_bf16_to_f32(got, back)
    assert np.array_equal(back.view(np.uint32), bf16_bits_to_f32(got).view(np.uint32))
    nanbits = np.empty(1, np.uint16)
    _run_f32_to_bf16(np.array([np.nan], np.float32), nanbits)
    assert np.isnan(bf16_bits_to_f32(nanbits)[0])


# ------------------------------------------------------------------ put

def _input(rng, device, shape, dtype, layout):
    """A batch input of ``shape`` in one of several memory layouts (built on the device, so a
    GPU input keeps its strides)."""
    b, h, d = shape
    if layout == "contiguous":
        return to_dev(device, random_storage(rng, shape, dtype))
    if layout == "dim_slice":       # rows of heads not adjacent (a slice of a fused tensor)
        return to_dev(device, random_storage(rng, (b, h, d + 4), dtype))[:, :, 2:2 + d]
    if layout == "heads_major":     # [heads, batch, dim] transposed
        return to_dev(device, random_storage(rng, (h, b, d), dtype)).transpose(1, 0, 2)
    if layout == "strided_dim":     # the last axis itself strided: element-wise path
        return to_dev(device, random_storage(rng, (b, h, 2 * d), dtype))[:, :, ::2]
    if layout == "odd_offset":      # misaligned for wide words
        flat = to_dev(device, random_storage(rng, (b * h * d + 1,), dtype))
        return flat[1:].reshape(b, h, d)
    raise AssertionError(layout)


def _ref_put(k_store, v_store, slots, key, value, permuted):
    k_store, v_store = k_store.copy(), v_store.copy()
    for t, s in enumerate(slots):
        if s < 0:
            continue
        k_store[s] = key[t]
        if permuted:
            v_store[:, :, s] = value[t]
        else:
            v_store[s] = value[t]
    return k_store, v_store


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "dim_slice", "heads_major", "strided_dim",
                                    "odd_offset"])
def test_put_matches_reference(device, dtype, permuted, layout):
    rng = np.random.default_rng(hash((dtype, permuted, layout)) % 2**32)
    n, h, d, dv, b = 13, 2, 8, 4, 4
    k_store = random_storage(rng, (n, h, d), dtype)
    v_store = random_storage(rng, (h, dv, n) if permuted else (n, h, dv), dtype)
    key = _input(rng, device, (b, h, d), dtype, layout)
    value = _input(rng, device, (b, h, dv), dtype, layout)
    for slots, start in ((np.array([7, -1, 0, 12], np.int32), -1), (None, 5)):
        ks, vs = to_dev(device, k_store.copy()), to_dev(device, v_store.copy())
        put.launch(device, ks, vs, slots, key, value, permuted, start=start)
        eff = slots if slots is not None else np.arange(start, start + b, dtype=np.int32)
        rk, rv = _ref_put(k_store, v_store, eff, to_host(key), to_host(value), permuted)
        assert np.array_equal(bits(ks), bits(rk))
        assert np.array_equal(bits(vs), bits(rv))


def _force(monkeypatch, module, name, parallel):
    """Pin a CPU twin to its single-thread or its parallel form whatever the size."""
    monkeypatch.setattr(module, name, 0 if parallel else 2**62)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("batch", [1, 64, 300])
@pytest.mark.parametrize("parallel", [False, True])
def test_put_cpu_large_batches(dtype, permuted, batch, parallel, monkeypatch):
    """The CPU twin's single-thread and parallel forms on realistic row sizes."""
    _force(monkeypatch, put, "PARALLEL_MIN_BYTES", parallel)
    rng = np.random.default_rng(batch)
    n, h, d, dv = 700, 4, 64, 32
    k_store = random_storage(rng, (n, h, d), dtype)
    v_store = random_storage(rng, (h, dv, n) if permuted else (n, h, dv), dtype)
    key = random_storage(rng, (batch, h, d), dtype)
    value = random_storage(rng, (batch, h, dv), dtype)
    slots = rng.permutation(n)[:batch].astype(np.int32)
    slots[::7] = -1
    ks, vs = k_store.copy(), v_store.copy()
    put.launch("cpu", ks, vs, slots, key, value, permuted)
    rk, rv = _ref_put(k_store, v_store, slots, key, value, permuted)
    assert np.array_equal(bits(ks), bits(rk)) and np.array_equal(bits(vs), bits(rv))


def test_put_word_plan():
    """Rows are copied as 16-byte words when lengths, strides and both addresses (input and
    storage) allow, else the widest narrower word that tiles them."""
    assert put._plan((4, 8, 128), (2048, 256, 2), 2, 4096) == (True, 16)
    assert put._plan((4, 8, 128), (4096, 256, 2), 2, 4096) == (True, 16)  # padded batch stride
    assert put._plan((4, 8, 128), (256, 1024, 2), 2, 4096) == (False, 16)  # heads-major
    assert put._plan((4, 8, 128), (2048, 256, 2), 2, 4104) == (True, 8)   # 8-aligned input
    assert put._plan((4, 8, 128), (2048, 256, 2), 2, 4096, 8) == (True, 8)  # 8-aligned storage
    assert put._plan((4, 8, 128), (2056, 256, 2), 2, 4096) == (True, 8)   # batch stride 8 mod 16
    assert put._plan((4, 8, 128), (2048, 256, 2), 2, 4098) == (True, 2)   # misaligned on GPU
    assert put._plan((4, 8, 3), (48, 6, 2), 2, 0) == (True, 16)
    assert put._plan((4, 4, 3), (24, 6, 2), 2, 0) == (True, 8)            # 24-byte rows
    assert put._plan((4, 2, 3), (12, 6, 2), 2, 0) == (True, 4)
    assert put._plan((4, 8, 64), (2048, 256, 4), 2, 0) == (False, 2)       # strided last axis
    assert put._plan((4, 1, 64), (256, 256, 4), 2, 0) == (False, 2)       # one head, strided


# ------------------------------------------------------------------ mask

def _ref_mask(rows, cell_pos, cell_seqs, batch_pos, batch_seq, causal, window, symmetric, chunk):
    """The visibility rules spelled out entry by entry in plain Python."""
    n = len(cell_pos)
    out = np.full((rows, n), -np.inf, dtype=np.float64)
    for i in range(len(batch_pos)):
        p, s = int(batch_pos[i]), int(batch_seq[i])
        for j in range(n):
            q = int(cell_pos[j])
            has = (int(cell_seqs[j, s // 64]) >> (s % 64)) & 1
            ok = bool(has)
            if causal[i] and q > p:
                ok = False
            if chunk > 0 and q < p - p % chunk:
                ok = False
            if window >= 0:
                if symmetric:
                    if abs(p - q) > window // 2:
                        ok = False
                elif q < p - window:
                    ok = False
            if ok:
                out[i, j] = 0.0
    return out


def _mask_case(rng, n, b, n_seqs):
    cell_pos = rng.integers(-1, 40, n).astype(np.int32)
    cell_seqs = np.zeros((n, 4), np.uint64)
    for j in range(n):
        for s in rng.choice(n_seqs, rng.integers(0, 3), replace=False):
            cell_seqs[j, s // 64] |= np.uint64(1) << np.uint64(s % 64)
    batch_pos = rng.integers(0, 40, b).astype(np.int32)
    batch_seq = rng.integers(0, n_seqs, b).astype(np.int32)
    for j in range(n):  # most cells hold one of the batch's sequences, so most tests bite
        if rng.random() < 0.7:
            s = int(rng.choice(batch_seq))
            cell_seqs[j, s // 64] |= np.uint64(1) << np.uint64(s % 64)
    causal = rng.integers(0, 2, b).astype(bool)
    return cell_pos, cell_seqs, batch_pos, batch_seq, causal


@pytest.mark.parametrize("mask_dtype", ["float32", "float16"])
@pytest.mark.parametrize("rule", [dict(), dict(window=5), dict(window=6, symmetric=True),
                                  dict(chunk=8), dict(window=3, chunk=4), dict(window=0)])
def test_mask_matches_reference(device, mask_dtype, rule):
    rng = np.random.default_rng(len(str(rule)) + (mask_dtype == "float16"))
    n, b, rows = 24, 3, 4
    n_seqs = 130  # spans three bitset words
    case = _mask_case(rng, n, b, n_seqs)
    out = xp_for(device).full((rows, n), 7.0, dtype=mask_dtype)
    mask.launch(device, out, *case, **rule)
    ref = _ref_mask(rows, *case, rule.get("window", -1), rule.get("symmetric", False),
                    rule.get("chunk", 0))
    got = to_host(out).astype(np.float64)
    assert np.array_equal(got, ref)
    assert (got[b:] == -np.inf).all()  # padding rows


def test_mask_many_row_groups(device):
    """More rows than one GPU thread fills (ROWS_PER_THREAD), padding rows included."""
    rng = np.random.default_rng(6)
    rows, b, n = 2 * mask.ROWS_PER_THREAD + 5, 2 * mask.ROWS_PER_THREAD + 1, 6
    case = _mask_case(rng, n, b, 3)
    out = xp_for(device).zeros((rows, n), dtype="float32")
    mask.launch(device, out, *case, chunk=16)
    assert np.array_equal(to_host(out).astype(np.float64),
                          _ref_mask(rows, *case, -1, False, 16))


@pytest.mark.parametrize("parallel", [False, True])
def test_mask_cpu_large(parallel, monkeypatch):
    _force(monkeypatch, mask, "PARALLEL_MIN_ENTRIES", parallel)
    rng = np.random.default_rng(5)
    n, b = 3000, 40
    case = _mask_case(rng, n, b, 4)
    out = np.empty((48, n), np.float32)
    mask.launch("cpu", out, *case, window=20)
    assert np.array_equal(out, _ref_mask(48, *case, 20, False, 0).astype(np.float32))


def test_mask_packs_only_used_words():
    cell_seqs = np.zeros((3, 4), np.uint64)
    cell_seqs[:, 2] = [1, 2, 4]
    cell_seqs[:, 0] = [8, 8, 8]
    _, words, row_word, _, _, _ = mask.prepare_inputs(np.zeros(3, np.int32), cell_seqs,
                                                      np.zeros(2), np.array([130, 131]),
                                                      np.ones(2))
    assert words.shape == (3, 1) and list(words[:, 0]) == [1, 2, 4]
    assert list(row_word) == [0, 0]
    _, words, row_word, _, _, _ = mask.prepare_inputs(np.zeros(3, np.int32), cell_seqs,
                                                      np.zeros(2), np.array([1, 3]),
                                                      np.ones(2))
    assert words.shape == (3, 1) and list(words[:, 0]) == [8, 8, 8] and list(row_word) == [0, 0]
    _, words, row_word, _, _, _ = mask.prepare_inputs(np.zeros(3, np.int32), cell_seqs,
                                                      np.zeros(2), np.array([131, 3]),
                                                      np.ones(2))
    assert words.shape == (3, 2) and list(row_word) == [1, 0]
    assert words[:, 0].tolist() == [8, 8, 8] and words[:, 1].tolist() == [1, 2, 4]
    # strided views of the cell table's records are gathered the same way
    table = np.zeros(3, dtype=[("pos", np.int32), ("shift", np.int32), ("seqs", np.uint64, (4,))])
    table["pos"] = [5, 6, 7]
    table["seqs"] = cell_seqs
    pos, words, row_word, _, _, _ = mask.prepare_inputs(table["pos"], table["seqs"], np.zeros(2),
                                                        np.array([131, 3]), np.ones(2))
    assert pos.tolist() == [5, 6, 7] and pos.flags.c_contiguous
    assert words.tolist() == [[8, 1], [8, 2], [8, 4]] and list(row_word) == [1, 0]


# ------------------------------------------------------------------ move / copy

PLANS = {
    "defrag": (np.array([[20, 2, 2], [17, 5, 3], [12, 9, 1]]), True),
    "overlap_down": (np.array([[4, 1, 9]]), False),
    "overlap_up": (np.array([[1, 4, 9]]), False),
    "chain": (np.array([[0, 8, 3], [8, 16, 3], [16, 1, 2]]), False),
    "dst_twice": (np.array([[0, 10, 2], [5, 11, 2]]), False),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_move_matches_sequential_reference(device, dtype, permuted, plan):
    moves, fast = PLANS[plan]
    n = 22
    assert move.independent(move.normalize(moves), n) is fast
    rng = np.random.default_rng(len(plan))
    keys = random_storage(rng, (2, n, 2, 8), dtype)
    values = random_storage(rng, (2, 2, 4, n) if permuted else (2, n, 2, 4), dtype)
    kd, vd = to_dev(device, keys.copy()), to_dev(device, values.copy())
    move.launch(device, kd, vd, moves, permuted)
    rk, rv = reference_moves(keys, values, moves, permuted)
    assert np.array_equal(bits(kd), bits(rk)) and np.array_equal(bits(vd), bits(rv))


@pytest.mark.parametrize("permuted", [False, True])
def test_copy_cells_in_order(device, permuted):
    rng = np.random.default_rng(9)
    n = 16
    keys = random_storage(rng, (2, n, 2, 8), "float16")
    values = random_storage(rng, (2, 2, 8, n) if permuted else (2, n, 2, 8), "float16")
    for src, dst in ((np.array([0, 3, 5]), np.array([10, 11, 12])),   # independent
                     (np.array([1, 2]), np.array([2, 3]))):            # a chain: in order
        kd, vd = to_dev(device, keys.copy()), to_dev(device, values.copy())
        move.copy_launch(device, kd, vd, src, dst, permuted)
        rk, rv = reference_moves(keys, values, [(s, d, 1) for s, d in zip(src, dst)], permuted)
        assert np.array_equal(bits(kd), bits(rk)) and np.array_equal(bits(vd), bits(rv))


@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("parallel", [False, True])
def test_move_cpu_large(permuted, parallel, monkeypatch):
    _force(monkeypatch, move, "PARALLEL_MIN_BYTES", parallel)
    rng = np.random.default_rng(3)
    n = 400
    keys = random_storage(rng, (6, n, 4, 64), "bfloat16")
    values = random_storage(rng, (6, 4, 32, n) if permuted else (6, n, 4, 32), "bfloat16")
    moves = np.array([[300, 0, 50], [100, 60, 120], [390, 380, 10], [0, 350, 40]])
    kd, vd = keys.copy(), values.copy()
    move.launch("cpu", kd, vd, moves, permuted)
    rk, rv = reference_moves(keys, values, moves, permuted)
    assert np.array_equal(kd, rk) and np.array_equal(vd, rv)


def test_move_plan_helpers():
    pairs = move.expand(np.array([[5, 0, 3], [9, 7, 2]]))
    assert list(pairs[0]) == [5, 6, 7, 9, 10] and list(pairs[1]) == [0, 1, 2, 7, 8]
    assert move.normalize([[1, 1, 4], [2, 3, 0], [0, 5, 2]]).tolist() == [[0, 5, 2]]
    assert move.independent(np.array([[0, 4, 2], [0, 6, 2]]), 10)       # shared source is fine
    assert not move.independent(np.array([[0, 4, 2], [4, 8, 1]]), 10)   # a destination is read


# ------------------------------------------------------------------ rotary shift

def _inv_freq_ref(dim, base, freq_scale, factors):
    """inv_freq as models hold it (float32), from its textbook definition."""
    i = np.arange(dim // 2, dtype=np.float64)
    f = freq_scale / base ** (2 * i / dim)
    if factors is not None:
        f = f / np.asarray(factors, np.float64)
    return f.astype(np.float32).astype(np.float64)


def _rope_ref(x, pos, dim, neox, inv):
    """Rotate ``x [..., cells, heads, head_dim]`` (float64) roped at positions ``pos [cells]``."""
    x = np.array(x, dtype=np.float64)
    ang = np.asarray(pos, np.float64)[:, None] * inv[None, :]          # [cells, dim/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = dim // 2
    if neox:
        i0, i1 = np.arange(half), np.arange(half) + half
    else:
        i0, i1 = np.arange(0, dim, 2), np.arange(1, dim, 2)
    a, b = x[..., i0].copy(), x[..., i1].copy()
    x[..., i0] = a * c - b * s
    x[..., i1] = a * s + b * c
    return x


def _to_storage(x64, dtype):
    x32 = x64.astype(np.float32)
    return f32_to_bf16_bits(x32) if dtype == "bfloat16" else x32.astype(dtype)


TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}  # relative to the data's scale

ROPES = {
    "neox": dict(base=10000.0, dim=None, neox=True, freq_scale=1.0, freq_factors=None),
    "normal": dict(base=10000.0, dim=None, neox=False, freq_scale=1.0, freq_factors=None),
    "partial_neox": dict(base=500000.0, dim=4, neox=True, freq_scale=0.25, freq_factors=None),
    "partial_normal_factors": dict(base=1e6, dim=6, neox=False, freq_scale=1.0,
                                   freq_factors=[1.0, 4.0, 32.0]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", sorted(ROPES))
def test_rotate_equals_rope_at_new_position(device, dtype, variant):
    from numbakv.config import RopeShift
    params = ROPES[variant]
    rs = RopeShift(**params)
    n_layers, n, h, hd = 2, 10, 2, 8
    dim = rs.rotary_dim(hd)
    inv = _inv_freq_ref(dim, params["base"], params["freq_scale"], params["freq_factors"])
    np.testing.assert_allclose(rs.inv_freq(hd), inv, rtol=1e-7)
    rng = np.random.default_rng(dim + params["neox"])
    x = rng.standard_normal((n_layers, n, h, hd))
    pos = rng.integers(0, 3000, n)
    stored = _to_storage(_rope_ref(x, pos, dim, params["neox"], inv), dtype)
    cells = np.array([1, 4, 5, 8, 2], np.int32)
    deltas = np.array([-7, 1, 2500, -300, 0])
    keys = to_dev(device, stored.copy())
    rope.launch(device, keys, dtype, cells, deltas, rs.inv_freq(hd), rs.neox)
    new_pos = pos.copy()
    new_pos[cells] += deltas
    want = _rope_ref(x, new_pos, dim, params["neox"], inv)
    got = as_f32(to_host(keys), dtype).astype(np.float64)
    scale = np.abs(x).max()
    err = np.abs(got - want)
    assert err.max() <= TOL[dtype] * scale, err.max()
    # cells not listed, cells with delta 0 and dims past the rotary dim keep their bits
    untouched = np.setdiff1d(np.arange(n), cells[deltas != 0])
    assert np.array_equal(bits(keys)[:, untouched], bits(stored)[:, untouched])
    assert np.array_equal(bits(keys)[..., dim:], bits(stored)[..., dim:])
    # and the rotation really moved the listed cells
    moved = cells[deltas != 0]
    assert np.abs(got[:, moved] - as_f32(stored, dtype)[:, moved]).max() > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
def test_rotate_there_and_back(device, dtype, neox):
    rng = np.random.default_rng(11)
    stored = random_storage(rng, (2, 6, 2, 8), dtype)
    inv = _inv_freq_ref(8, 10000.0, 1.0, None).astype(np.float32)
    cells = np.array([0, 2, 3, 5], np.int32)
    deltas = np.array([5, -9, 1000, 33])
    keys = to_dev(device, stored.copy())
    rope.launch(device, keys, dtype, cells, deltas, inv, neox)
    rope.launch(device, keys, dtype, cells, -deltas, inv, neox)
    got = as_f32(to_host(keys), dtype)
    want = as_f32(stored, dtype)
    assert np.abs(got - want).max() <= TOL[dtype] * np.abs(want).max()


def test_rotate_layers_subset_and_repeated_cells(device):
    rng = np.random.default_rng(12)
    stored = random_storage(rng, (3, 5, 2, 8), "float32")
    inv = _inv_freq_ref(8, 10000.0, 1.0, None).astype(np.float32)
    keys = to_dev(device, stored.copy())
    # cell 1 listed twice: turns by the sum (3 + 4)
    rope.launch(device, keys, "float32", np.array([1, 1, 3]), np.array([3, 4, 2]), inv, True,
                layers=np.array([0, 2]))
    once = to_dev(device, stored.copy())
    rope.launch(device, once, "float32", np.array([1, 3]), np.array([7, 2]), inv, True,
                layers=np.array([0, 2]))
    got, ref = to_host(keys), to_host(once)
    assert np.array_equal(got[1], stored[1])  # layer 1 untouched
    np.testing.assert_allclose(got, ref, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_cpu_twin_agrees_with_kernel(kernel_device, dtype):
    """The CPU twin and the @cuda.jit kernel compute the same float32 math."""
    rng = np.random.default_rng(13)
    stored = random_storage(rng, (2, 6, 2, 8), dtype)
    inv = _inv_freq_ref(8, 10000.0, 1.0, None).astype(np.float32)
    cells, deltas = np.array([0, 1, 4], np.int32), np.array([3, -2, 77])
    a = stored.copy()
    rope.launch("cpu", a, dtype, cells, deltas, inv, False)
    b = to_dev(kernel_device, stored.copy())
    rope.launch(kernel_device, b, dtype, cells, deltas, inv, False)
    fa, fb = as_f32(a, dtype), as_f32(to_host(b), dtype)
    ulp = {"float32": 2.0**-22, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
    assert np.abs(fa - fb).max() <= ulp * np.abs(fa).max()


@pytest.mark.parametrize("parallel", [False, True])
def test_rotate_cpu_large(parallel, monkeypatch):
    _force(monkeypatch, rope, "PARALLEL_MIN_PAIRS", parallel)
    rng = np.random.default_rng(14)
    n = 300
    x = rng.standard_normal((4, n, 4, 64))
    inv = _inv_freq_ref(64, 10000.0, 1.0, None)
    pos = rng.integers(0, 1000, n)
    stored = _rope_ref(x, pos, 64, True, inv).astype(np.float32)
    cells = np.arange(0, n, 2, dtype=np.int32)
    deltas = -np.ones(cells.size, np.int64) * 17
    keys = stored.copy()
    rope.launch("cpu", keys, "float32", cells, deltas, inv.astype(np.float32), True)
    new_pos = pos.copy()
    new_pos[cells] -= 17
    assert np.abs(keys - _rope_ref(x, new_pos, 64, True, inv)).max() < 2e-5 * np.abs(x).max()


# ------------------------------------------------------------------ the CUDA launch path, emulated
# Without a GPU the ``cuda`` code path (CuPy arrays described by pointer/shape/strides, packed
# host-to-device copies, cached slot buffers) still runs here: a stand-in ``cupy`` over numpy
# memory, and the descriptors turned back into numpy views for the simulator.

from fake_cupy import FakeDeviceArray as _FakeDeviceArray  # noqa: E402
from helpers import clear_launch_caches, emulate_cuda  # noqa: E402


@pytest.fixture
def emulated_cuda(kernel_device, monkeypatch):
    """The kernels launched on the emulated ``cuda`` path, in order."""
    if kernel_device != "sim":
        pytest.skip("a real GPU runs the cuda path itself")
    launched = []

    def record(kernel, args):
        for a in args:  # exactly what the fast path would flatten
            assert isinstance(a, (_common.Desc, int)), type(a)
        launched.append(kernel)

    emulate_cuda(monkeypatch, record)
    yield launched
    clear_launch_caches()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("permuted", [False, True])
def test_emulated_cuda_put(emulated_cuda, dtype, permuted):
    rng = np.random.default_rng(21)
    n, h, d, dv, b = 11, 2, 8, 4, 3
    k_store = random_storage(rng, (n, h, d), dtype)
    v_store = random_storage(rng, (h, dv, n) if permuted else (n, h, dv), dtype)
    for layout in ("heads_major", "strided_dim", "odd_offset"):
        key = _input(rng, "cpu", (b, h, d), dtype, layout)
        value = _input(rng, "cpu", (b, h, dv), dtype, layout)
        for slots, start in ((np.array([4, -1, 10], np.int32), -1), (None, 2),
                             (np.array([4, -1, 10], np.int32), -1)):   # cached slot buffer
            ks, vs = k_store.copy(), v_store.copy()
            put.launch("cuda", _FakeDeviceArray(ks), _FakeDeviceArray(vs), slots,
                       _FakeDeviceArray(key), _FakeDeviceArray(value), permuted, start=start)
            eff = slots if slots is not None else np.arange(start, start + b, dtype=np.int32)
            rk, rv = _ref_put(k_store, v_store, eff, key, value, permuted)
            assert np.array_equal(bits(ks), bits(rk)), layout
            assert np.array_equal(bits(vs), bits(rv)), layout
    assert emulated_cuda and set(emulated_cuda) == {put.put_kv_kernel}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("permuted", [False, True])
def test_emulated_cuda_put_into_a_cell_slice(emulated_cuda, dtype, permuted):
    """A per-sequence stream's layer is a cell slice of the pool: a permuted V slice ``[h, dv,
    cells]`` keeps the pool's head and dim strides. The first H100 run found the GPU launch
    describing it with the slice's own cell count (values landed in the wrong rows), which the
    simulator's numpy views never did. Cells outside the slice stay untouched."""
    rng = np.random.default_rng(29)
    n_pool, lo, hi, h, d, dv, b = 20, 6, 13, 2, 8, 4, 3
    k_pool = random_storage(rng, (n_pool, h, d), dtype)
    v_pool = random_storage(rng, (h, dv, n_pool) if permuted else (n_pool, h, dv), dtype)
    for slots, start in ((np.array([1, -1, 5], np.int32), -1), (None, 2)):
        key = _input(rng, "cpu", (b, h, d), dtype, "heads_major")
        value = _input(rng, "cpu", (b, h, dv), dtype, "strided_dim")
        ks, vs = k_pool.copy(), v_pool.copy()
        v_slice = vs[:, :, lo:hi] if permuted else vs[lo:hi]
        put.launch("cuda", _FakeDeviceArray(ks[lo:hi]), _FakeDeviceArray(v_slice), slots,
                   _FakeDeviceArray(key), _FakeDeviceArray(value), permuted, start=start)
        eff = slots if slots is not None else np.arange(start, start + b, dtype=np.int32)
        rk, rv = _ref_put(k_pool, v_pool, np.where(eff >= 0, eff + lo, -1), key, value, permuted)
        assert np.array_equal(bits(ks), bits(rk))
        assert np.array_equal(bits(vs), bits(rv))


def test_emulated_cuda_put_fast_path_parameters(emulated_cuda, monkeypatch):
    """The fast path patches pointers into a cached parameter list: it must equal, value for
    value, the list the general path builds for the same call."""
    rng = np.random.default_rng(25)
    recorded = []

    class Recorder:
        def launch_flat(self, grid, block, stream, vals):
            recorded.append((tuple(grid), block, list(vals)))

    general = []
    monkeypatch.setattr(put, "_launch", lambda device, kernel, grid, block, args:
                        general.append((tuple(grid), block, launch._flatten(args))))
    calls = []
    for permuted in (False, True):
        for layout in ("contiguous", "heads_major"):
            ks = _FakeDeviceArray(random_storage(rng, (9, 2, 8), "bfloat16"))
            vs = _FakeDeviceArray(random_storage(rng, (2, 4, 9) if permuted else (9, 2, 4),
                                                 "bfloat16"))
            for slots, start in ((np.array([3, -1], np.int32), -1), (None, 4), (None, 6)):
                key = _FakeDeviceArray(_input(rng, "cpu", (2, 2, 8), "bfloat16", layout))
                value = _FakeDeviceArray(_input(rng, "cpu", (2, 2, 4), "bfloat16", layout))
                calls.append((ks, vs, slots, key, value, permuted, start))
    for fast in (False, True):  # each mode reuses its cached plans across calls
        put._CUDA_PLANS.clear()
        monkeypatch.setattr(launch, "_fast_kernel", lambda *a: Recorder() if fast else None)
        monkeypatch.setattr(launch, "_FAST_ENABLED", fast)
        for ks, vs, slots, key, value, permuted, start in calls:
            put.launch("cuda", ks, vs, slots, key, value, permuted, start=start)
    assert len(put._CUDA_PLANS) < len(calls)
    assert len(recorded) == len(general) == 12
    assert recorded == general


@pytest.mark.parametrize("mask_dtype", ["float32", "float16"])
def test_emulated_cuda_mask(emulated_cuda, mask_dtype):
    rng = np.random.default_rng(22)
    case = _mask_case(rng, 20, 3, 140)
    out = np.full((4, 20), 3.0, mask_dtype)
    mask.launch("cuda", _FakeDeviceArray(out), *case, window=7)
    assert np.array_equal(out.astype(np.float64), _ref_mask(4, *case, 7, False, 0))


@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("plan", ["defrag", "chain"])
def test_emulated_cuda_move(emulated_cuda, permuted, plan):
    moves, _ = PLANS[plan]
    rng = np.random.default_rng(23)
    keys = random_storage(rng, (2, 22, 2, 8), "float32")
    values = random_storage(rng, (2, 2, 4, 22) if permuted else (2, 22, 2, 4), "float32")
    kd, vd = keys.copy(), values.copy()
    move.launch("cuda", _FakeDeviceArray(kd), _FakeDeviceArray(vd), moves, permuted)
    rk, rv = reference_moves(keys, values, moves, permuted)
    assert np.array_equal(kd, rk) and np.array_equal(vd, rv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_cuda_rotate(emulated_cuda, dtype):
    rng = np.random.default_rng(24)
    stored = random_storage(rng, (2, 6, 2, 8), dtype)
    inv = _inv_freq_ref(8, 10000.0, 1.0, None).astype(np.float32)
    cells, deltas = np.array([0, 1, 4], np.int32), np.array([3, -2, 77])
    a = stored.copy()
    rope.launch("cpu", a, dtype, cells, deltas, inv, True)
    b = stored.copy()
    rope.launch("cuda", _FakeDeviceArray(b), dtype, cells, deltas, inv, True)
    fa, fb = as_f32(a, dtype), as_f32(b, dtype)
    ulp = {"float32": 2.0**-22, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
    assert np.abs(fa - fb).max() <= ulp * np.abs(fa).max()
    assert not np.array_equal(bits(b), bits(stored))


@pytest.mark.gpu
def test_cuda_fast_launch_matches_dispatcher():
    """On a GPU: the CuPy-driver fast path and Numba's dispatcher give identical results."""
    import cupy
    results = {}
    for fast in (True, False):
        rng = np.random.default_rng(30)   # both passes draw the same data
        launch.set_fast_launch(fast)
        put._CUDA_PLANS.clear()
        try:
            ks = cupy.zeros((40, 4, 64), cupy.float16)
            vs = cupy.zeros((4, 32, 40), cupy.float16)
            key = _input(np.random.default_rng(1), "cuda", (5, 4, 64), "float16", "heads_major")
            value = _input(np.random.default_rng(2), "cuda", (5, 4, 32), "float16", "dim_slice")
            put.launch("cuda", ks, vs, np.array([3, -1, 9, 30, 0], np.int32), key, value, True)
            put.launch("cuda", ks, vs, None, key, value, True, start=20)
            keys = cupy.asarray(random_storage(rng, (3, 40, 4, 64), "bfloat16"))
            values = cupy.asarray(random_storage(rng, (3, 40, 4, 32), "bfloat16"))
            move.launch("cuda", keys, values, np.array([[30, 0, 5], [2, 4, 3]]), False)
            rope.launch("cuda", keys, "bfloat16", np.array([1, 2, 3]), np.array([5, -5, 9]),
                        _inv_freq_ref(64, 1e4, 1.0, None).astype(np.float32), True)
            out = cupy.empty((17, 40), cupy.float16)
            mask.launch("cuda", out, *_mask_case(np.random.default_rng(3), 40, 16, 70), window=9)
            results[fast] = [to_host(x) for x in (ks, vs, keys, values, out)]
        finally:
            launch.set_fast_launch(True)
            put._CUDA_PLANS.clear()
    for a, b in zip(results[True], results[False]):
        assert np.array_equal(bits(a), bits(b))


# ------------------------------------------------------------------ launch geometry
# Every launcher's blocks against its useful work, for the shapes the issue measured and for
# random ones: each index space gets exactly the blocks its items fill (the last one partial),
# capped at the SM-sized grid beyond which threads loop.

H100_CAP = 132 * _common.BLOCKS_PER_SM


def _space_ok(blocks, items, block, cap):
    """``blocks`` is right for ``items`` work items: all useful (< one block of slack) or capped."""
    if items == 0:
        return blocks == 0
    return blocks == min(-(-items // block), cap) and (blocks - 1) * block < items


@pytest.mark.parametrize("seed", range(40))
def test_put_geometry_blocks_match_useful_work(seed):
    rng = np.random.default_rng(seed)
    batch = int(rng.choice([1, 3, 31, 32, 33, 512, 4096, 100_000]))
    kh, kw = int(rng.integers(1, 9)), int(rng.integers(1, 65))
    vh, vw = int(rng.integers(1, 9)), int(rng.integers(1, 65))
    for permuted in (False, True):
        grid, nb, nbk, mode = put.geometry("cuda", (batch, kh, kw), (batch, vh, vw), permuted,
                                           H100_CAP)
        assert len(grid) == 1 and nb == _common.BLOCK_CUDA
        # K: a warp per token row (one thread per word when there is a single row)
        assert _space_ok(nbk, batch * 32 if batch > 1 else kh * kw, nb, H100_CAP)
        nbv = grid[0] - nbk
        if mode == put.V_CELLS_TILED:
            assert permuted and batch >= put.TILE and vh * vw >= put.TILE
            tiles = -(-batch // put.TILE) * -(-(vh * vw) // put.TILE)
            assert nbv == min(tiles, H100_CAP)
            # only edge tiles are partial: at least a quarter of all tile slots are useful
            assert batch * vh * vw >= 0.25 * tiles * put.TILE ** 2
        else:
            assert mode == (put.V_CELLS_DIRECT if permuted else put.V_ROWS)
            rows = batch * 32 if batch > 1 else vh * vw
            assert _space_ok(nbv, batch * vh * vw if permuted else rows, nb, H100_CAP)


def test_put_geometry_the_measured_cases():
    """Issue 15: a decode put (1 token, 8 KV heads x 128 float16: K as 8-byte words, permuted V
    element-wise) launched 2,048 blocks for 1,280 useful threads."""
    grid, nb, nbk, mode = put.geometry("cuda", (1, 1, 256), (1, 8, 128), True, H100_CAP)
    useful = 256 + 8 * 128
    assert grid[0] * nb < useful + 2 * nb and mode == put.V_CELLS_DIRECT
    # the same put with K as 16-byte words (aligned input and storage): half K's threads
    grid, nb, nbk, mode = put.geometry("cuda", (1, 1, 128), (1, 8, 128), True, H100_CAP)
    assert nbk == 1 and grid[0] == 1 + 4 and mode == put.V_CELLS_DIRECT
    # a row-layout prefill of 4096 tokens in 16-byte words: a warp per token row (each lane
    # four words in flight), capped
    grid, nb, nbk, mode = put.geometry("cuda", (4096, 1, 128), (4096, 1, 128), False, H100_CAP)
    assert nbk == min(4096 * 32 // nb, H100_CAP) and grid[0] == 2 * nbk and mode == put.V_ROWS
    # a decode put of 8 tokens (8 heads x 128 bfloat16 rows as 16-byte words): one block of
    # 8 warps for K and one for V, not 4 + 4 blocks of one word per thread
    grid, nb, nbk, mode = put.geometry("cuda", (8, 1, 128), (8, 1, 128), False, H100_CAP)
    assert nbk == 1 and grid[0] == 2
    # a 32k-token prefill: both spaces capped at the SM-sized grid, V through tiles
    grid, nb, nbk, mode = put.geometry("cuda", (32768, 1, 256), (32768, 8, 128), True, H100_CAP)
    assert nbk == H100_CAP and grid[0] - nbk == H100_CAP and mode == put.V_CELLS_TILED


@pytest.mark.parametrize("permuted", [False, True])
def test_move_geometry_defrag_of_100k_cells_x_32_layers(permuted):
    """Issue 15: such a defrag launched ~822M blocks, 807M of them idle. K and V now have their
    own index spaces: each gets the blocks its work fills, at most the SM-sized cap."""
    k_shape = (32, 100_000, 1, 256)                       # K rows as 8-byte words
    v_shape = (32, 100_000, 8, 128) if permuted else (32, 100_000, 1, 256)
    grid, nbk = move.cells_geometry(k_shape, v_shape, 100_000, 256, H100_CAP)
    assert grid == (2 * H100_CAP,) and nbk == H100_CAP
    for npairs in (1, 7, 300):
        grid, nbk = move.cells_geometry(k_shape, v_shape, npairs, 256, H100_CAP)
        assert _space_ok(nbk, 32 * npairs * 256, 256, H100_CAP)
        assert _space_ok(grid[0] - nbk, 32 * npairs * v_shape[2] * v_shape[3], 256, H100_CAP)
    grid, nbk = move.lanes_geometry(k_shape, v_shape, 256, H100_CAP)
    assert _space_ok(nbk, 32 * 256, 256, H100_CAP)
    assert _space_ok(grid[0] - nbk, 32 * v_shape[2] * v_shape[3], 256, H100_CAP)


@pytest.mark.parametrize("cells,layers,heads,half", [(1, 1, 1, 1), (3, 32, 8, 64),
                                                     (100_000, 32, 8, 64), (5, 1, 2, 3)])
def test_rope_geometry_blocks_match_useful_work(cells, layers, heads, half):
    grid = rope.geometry(cells, layers, heads, half, 256, H100_CAP)
    assert len(grid) == 1 and _space_ok(grid[0], cells * layers * heads * half, 256, H100_CAP)


def test_the_prepared_launches_use_those_geometries(kernel_device):
    """The move and rope launchers hand the kernels the grids the geometry functions give."""
    rng = np.random.default_rng(9)
    keys = to_dev(kernel_device, random_storage(rng, (3, 40, 2, 8), "float16"))
    values = to_dev(kernel_device, random_storage(rng, (3, 2, 4, 40), "float16"))
    cap = _common.max_blocks(kernel_device)
    nb = _common.block_size(kernel_device)
    p = move.prepare(kernel_device, keys, values, np.array([[30, 0, 5]]), True)
    k, v = move.storage_args(kernel_device, keys, values, True)
    assert p.kernel is move.move_cells_kernel
    assert (p.grid, p.args[-1]) == move.cells_geometry(k.shape, v.shape, 5, nb, cap)
    p = move.prepare(kernel_device, keys, values, np.array([[0, 1, 3], [1, 0, 1]]), True)
    assert p.kernel is move.move_lanes_kernel
    assert (p.grid, p.args[-1]) == move.lanes_geometry(k.shape, v.shape, nb, cap)
    p = rope.prepare(kernel_device, keys, "float16", np.array([1, 2, 3]), np.array([1, 1, 2]),
                     np.ones(4, np.float32), True)
    assert p.grid == rope.geometry(3, 3, 2, 4, nb, cap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "heads_major"])
def test_put_permuted_v_through_shared_memory_tiles(kernel_device, dtype, layout):
    """A prefill-sized batch with a row of >= TILE elements takes the tiled path (edge tiles in
    both directions, skipped tokens, grid-striding over more tiles than the simulator's cap)."""
    rng = np.random.default_rng(77)
    n, h, d, dv, b = 90, 3, 4, 13, 70      # V row of 39 elements: 3 x 2 tiles
    _, _, _, mode = put.geometry(kernel_device, (b, 1, h * d), (b, h, dv), True,
                                 _common.max_blocks(kernel_device))
    assert mode == put.V_CELLS_TILED
    k_store = random_storage(rng, (n, h, d), dtype)
    v_store = random_storage(rng, (h, dv, n), dtype)
    key = _input(rng, kernel_device, (b, h, d), dtype, layout)
    value = _input(rng, kernel_device, (b, h, dv), dtype, layout)
    slots = rng.permutation(n)[:b].astype(np.int32)
    slots[::9] = -1
    for sl, start in ((slots, -1), (None, 11)):
        ks, vs = to_dev(kernel_device, k_store.copy()), to_dev(kernel_device, v_store.copy())
        put.launch(kernel_device, ks, vs, sl, key, value, True, start=start)
        eff = sl if sl is not None else np.arange(start, start + b, dtype=np.int32)
        rk, rv = _ref_put(k_store, v_store, eff, to_host(key), to_host(value), True)
        assert np.array_equal(bits(ks), bits(rk)) and np.array_equal(bits(vs), bits(rv))


# ------------------------------------------------------------------ float16 through F16C (CPU)

@pytest.mark.skipif(not _common.cpu_has_f16c(), reason="this CPU converts halves in software")
def test_hardware_half_conversions_are_bit_identical_with_numpy():
    """Every half to float32, and float32 values covering normals, subnormals, halfway cases,
    overflow to inf, inf and every kind of NaN (quiet, signalling, payload-less after the
    shift) to half: bit for bit what numpy gives."""
    from numba import njit
    up_hw, down_hw = _common.f16_bits_to_f32_hw, _common.f32_to_f16_bits_hw

    @njit
    def up(a, out):
        for i in range(a.size):
            out[i] = up_hw(a[i])

    @njit
    def down(a, out):
        for i in range(a.size):
            out[i] = down_hw(a[i])
    halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    got = np.empty(halves.size, np.float32)
    up(halves, got)
    assert np.array_equal(got.view(np.uint32), halves.view(np.float16).astype(np.float32)
                          .view(np.uint32))
    rng = np.random.default_rng(5)
    bits32 = np.concatenate([
        rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),
        np.arange(0x7F800000, 0x7F800000 + 20_000, dtype=np.uint32),       # inf, sNaNs
        np.arange(0xFFC00000, 0xFFC00000 + 20_000, dtype=np.uint32),       # quiet NaNs
        np.arange(0x7F800001, 0x7F802001, dtype=np.uint32),                 # payload below half's
        np.arange(0x33000000 - 4096, 0x38800000 + 4096, 16, dtype=np.uint32),  # subnormal halves
        np.arange(0x477FE000 - 4096, 0x47800000 + 4096, dtype=np.uint32),  # around the largest half
        np.array([0, 0x80000000], np.uint32)])
    floats = bits32.view(np.float32)
    out = np.empty(floats.size, np.uint16)
    down(floats, out)
    with np.errstate(over="ignore", invalid="ignore"):
        want = floats.astype(np.float16).view(np.uint16)
    bad = out != want
    assert not bad.any(), [hex(x) for x in bits32[bad][:5]]


@pytest.mark.parametrize("neox", [True, False])
def test_f16_rotation_on_the_cpu_hardware_and_software_agree(neox, monkeypatch):
    """The F16C twin and the software twin give the same bits (specials included); without
    F16C the CPU falls back to the software conversions."""
    rng = np.random.default_rng(11)
    stored = rng.standard_normal((2, 9, 3, 16)).astype(np.float16)
    specials = np.array([np.inf, -np.inf, np.nan, 6e-8, -6e-8, 65504, 1e-5, 0.0], np.float16)
    stored[1, 4, 0, :8] = specials
    stored.view(np.uint16)[0, 2, 1, 3] = 0x7C01   # a signalling NaN
    inv = _inv_freq_ref(16, 10000.0, 1.0, None).astype(np.float32)
    cells, deltas = np.array([0, 2, 4, 8], np.int32), np.array([5, -7, 1000, 3])
    results = {}
    for hw in ([True, False] if _common.cpu_has_f16c() else [False]):
        monkeypatch.setattr(rope, "F16_HW", hw)
        assert rope.storage_kind("cpu", "float16")[1] == (rope.KIND_F16_HW if hw
                                                          else rope.KIND_F16_BITS)
        k = stored.copy()
        rope.launch("cpu", k, "float16", cells, deltas, inv, neox)
        results[hw] = k.view(np.uint16)
    if len(results) == 2:
        # equal bits, except NaN payloads: the hardware twin keeps numpy's NaN bits (the payload
        # carried through), the software conversion makes every NaN 0x7E00 (sign kept)
        hw, sw = results[True], results[False]
        nan = (sw & 0x7C00) == 0x7C00
        nan &= (sw & 0x3FF) != 0
        assert nan.sum() >= 2 and np.array_equal(nan, ((hw & 0x7C00) == 0x7C00) & ((hw & 0x3FF) != 0))
        assert np.array_equal(hw[~nan], sw[~nan]) and np.array_equal(hw[nan] >> 15, sw[nan] >> 15)
    assert not np.array_equal(results[False], stored.view(np.uint16))


def test_f16c_detection_follows_numbas_cpu_target(monkeypatch):
    import platform
    from numba.core import config as nb_config
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 only")
    monkeypatch.setattr(nb_config, "CPU_FEATURES", "+avx2,-f16c")
    assert not _common.cpu_has_f16c()
    monkeypatch.setattr(nb_config, "CPU_FEATURES", "+avx2,+f16c")
    assert _common.cpu_has_f16c()
    monkeypatch.setattr(nb_config, "CPU_FEATURES", None)
    monkeypatch.setattr(nb_config, "CPU_NAME", "generic")
    assert not _common.cpu_has_f16c()


def test_mask_geometry_blocks_match_useful_work(monkeypatch):
    """The mask launcher (kernels/mask.py): x blocks cover the cells with less than one block of
    slack, y covers the rows ROWS_PER_THREAD at a time."""
    grids = []
    monkeypatch.setattr(mask, "_launch", lambda device, kernel, grid, block, args:
                        grids.append((tuple(grid), block)))
    rng = np.random.default_rng(4)
    for n, rows in ((1, 1), (37, 3), (4096, 512), (300, 17)):
        case = _mask_case(rng, n, min(rows, 8), 100)
        mask.launch("sim", np.empty((rows, n), np.float32), *case)
        (gx, gy), nb = grids[-1]
        assert (gx - 1) * nb < n <= gx * nb
        assert (gy - 1) * mask.ROWS_PER_THREAD < rows <= gy * mask.ROWS_PER_THREAD


@pytest.mark.skipif(bool(gpu_compiler_missing()), reason=gpu_compiler_missing() or "-")
def test_fast_kernel_loads_a_cubin_for_the_device_and_caches_it(tmp_path):
    """Without a GPU: a stand-in CuPy driver receives what FastKernel loads. It must be a cubin
    (ELF) linked for the device's compute capability (e_flags' low byte: 80 / 90), and a second
    process-like load must come from the disk cache without compiling."""
    import os
    import subprocess
    import sys
    code = (
        "import sys, struct, types\n"
        "sys.path.insert(0, 'tests')\n"
        "from fake_cupy import fake_cupy\n"
        "for cc in ('80', '90'):\n"
        "    cp = fake_cupy(device_cc=cc)\n"
        "    loaded = []\n"
        "    cp.cuda.driver = types.SimpleNamespace(\n"
        "        moduleLoadData=lambda image: loaded.append(image) or 'module',\n"
        "        moduleGetFunction=lambda m, name: ('fn', name), launchKernel=None)\n"
        "    sys.modules['cupy'] = cp\n"
        "    from numbakv.kernels import launch, put\n"
        "    from numbakv.kernels.ptx import _offline_device\n"
        "    sig = put._SIGS[0]\n"
        "    with _offline_device((int(cc[0]), int(cc[1]))):\n"
        "        fk = launch.FastKernel(put.put_kv_kernel.py_func, sig, 0)\n"
        "    assert fk.image_kind == 'cubin' and loaded[0][:4] == b'\\x7fELF'\n"
        "    flags = struct.unpack_from('<I', loaded[0], 48)[0]\n"
        # CUDA 13's cubins (ELF ABI version 8) keep the SM in e_flags bits 8-15, older ones in
        # bits 0-7
        "    arch = (flags >> 8) & 0xFF if loaded[0][8] >= 8 else flags & 0xFF\n"
        "    assert arch == int(cc), (cc, hex(flags), loaded[0][7:9])\n"
        "    real = launch.ptx_entry\n"
        "    launch.ptx_entry = lambda *a: (_ for _ in ()).throw(AssertionError('compiled'))\n"
        "    fk2 = launch.FastKernel(put.put_kv_kernel.py_func, sig, 0)\n"
        "    assert loaded[1] == loaded[0] and fk2.n_params == fk.n_params\n"
        "    launch.ptx_entry = real\n"
        "print('ok')\n")
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env["NUMBAKV_CACHE_DIR"] = str(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
    assert len(list(tmp_path.iterdir())) == 2


# ------------------------------------------------------------------ 16-byte copies
# put and block move copy rows as 16-byte words (one 128-bit load and store per thread) where the
# row length, the strides and every base address allow it; the launcher decides once per launch
# and otherwise falls back to 8-, 4- or 2-byte words, or elements.

def _aligned(shape, dtype, offset=0, device="cpu"):
    """A zeroed array (numpy; CuPy on ``cuda``) whose data starts ``offset`` bytes past a 64-byte
    boundary."""
    dt = np.dtype(STORAGE.get(dtype, dtype))
    nbytes = int(np.prod(shape)) * dt.itemsize
    raw = xp_for(device).zeros(nbytes + 128, np.uint8)
    ptr = int(raw.data.ptr) if device == "cuda" else raw.ctypes.data
    start = -ptr % 64 + offset
    return raw[start:start + nbytes].view(dt).reshape(shape)


def _placed(device, host, offset=0):
    """``host``'s bits in a new array on ``device`` starting ``offset`` bytes past a 64-byte
    boundary. The alignment is what the word-size choice reads, so it is set on the array the
    kernel gets: a plain copy to the GPU (``cupy.asarray``) would drop a host offset, since CuPy
    allocations start 256-byte aligned."""
    out = _aligned(host.shape, host.dtype, offset, device)
    out[...] = to_dev(device, host)
    return out


def _no_fast_put(monkeypatch):
    """On a GPU, put launches through Numba's dispatcher (``_launch``, which the tests record)
    instead of the fast path, with a plan cache of its own for this test."""
    monkeypatch.setattr(launch, "_FAST_ENABLED", False)
    monkeypatch.setattr(put, "_CUDA_PLANS", {})


def _random_bits(rng, shape, dtype, offset=0):
    """Every bit pattern of the storage dtype, NaN payloads included (a copy must keep them)."""
    out = _aligned(shape, dtype, offset)
    ubits = {2: np.uint16, 4: np.uint32}[out.itemsize]
    out.view(ubits)[...] = rng.integers(0, np.iinfo(ubits).max, shape, dtype=ubits,
                                        endpoint=True)
    return out


def _recording(monkeypatch, module):
    """Record the arguments of every launch of ``module``'s kernels (still run for real)."""
    seen = []
    real = module._launch

    def rec(device, kernel, grid, block, args):
        seen.append((kernel, tuple(grid), block, args))
        real(device, kernel, grid, block, args)
    monkeypatch.setattr(module, "_launch", rec)
    return seen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("permuted", [False, True])
def test_put_takes_16_byte_words_when_aligned(kernel_device, dtype, permuted, monkeypatch):
    seen = _recording(monkeypatch, put)
    _no_fast_put(monkeypatch)
    rng = np.random.default_rng(hash((dtype, permuted)) % 2**32)
    n, h, d, dv, b = 13, 2, 8, 8, 5      # rows of 32 (2-byte) or 64 bytes: whole 16-byte words
    k_store, v_store = _random_bits(rng, (n, h, d), dtype), _random_bits(
        rng, (h, dv, n) if permuted else (n, h, dv), dtype)
    key, value = _random_bits(rng, (b, h, d), dtype), _random_bits(rng, (b, h, dv), dtype)
    for slots, start in ((np.array([7, -1, 0, 12, 3], np.int32), -1), (None, 6)):
        ks, vs = _placed(kernel_device, k_store), _placed(kernel_device, v_store)
        put.launch(kernel_device, ks, vs, slots, _placed(kernel_device, key),
                   _placed(kernel_device, value), permuted, start=start)
        eff = slots if slots is not None else np.arange(start, start + b, dtype=np.int32)
        rk, rv = _ref_put(k_store, v_store, eff, key, value, permuted)
        assert np.array_equal(bits(ks), bits(rk)) and np.array_equal(bits(vs), bits(rv))
        kernel, grid, block, args = seen[-1]
        kd, vd, _, k_src, v_src = args[:5]
        row = h * d * ks.itemsize
        assert kd.dtype == k_src.dtype == _common.WORD16 and k_src.shape == (b, 1, row // 16)
        if permuted:   # permuted V is written element by element
            assert vd.dtype.itemsize == v_src.dtype.itemsize == ks.itemsize
        else:
            assert vd.dtype == v_src.dtype == _common.WORD16
        # blocks against useful work: K's index space is a warp per token row
        nbk = args[-1]
        assert _space_ok(nbk, put.row_threads(b, 1, row // 16), block,
                         _common.max_blocks(kernel_device))


@pytest.mark.parametrize("shape", [(3, 8, 64), (4, 5, 80), (1, 8, 64)])
def test_put_rows_with_four_words_in_flight(kernel_device, shape, monkeypatch):
    """Rows of 128 and 100 16-byte words: a warp per token row, each lane copying four words at
    once while four remain (the 100-word row ends in a tail of single words); a single token
    grid-strides over its words. Slot lists with a skipped token and contiguous starts."""
    seen = _recording(monkeypatch, put)
    _no_fast_put(monkeypatch)
    rng = np.random.default_rng(sum(shape))
    b, h, d = shape
    n = 9
    k_store, v_store = (_random_bits(rng, (n, h, d), "float32") for _ in range(2))
    key, value = (_random_bits(rng, (b, h, d), "float32") for _ in range(2))
    slot_list = np.array([7, -1, 0, 3][:b], np.int32) if b > 1 else np.array([5], np.int32)
    for slots, start in ((slot_list, -1), (None, 2)):
        ks, vs = _placed(kernel_device, k_store), _placed(kernel_device, v_store)
        put.launch(kernel_device, ks, vs, slots, _placed(kernel_device, key),
                   _placed(kernel_device, value), False, start=start)
        eff = slots if slots is not None else np.arange(start, start + b, dtype=np.int32)
        rk, rv = _ref_put(k_store, v_store, eff, key, value, False)
        assert np.array_equal(bits(ks), bits(rk)) and np.array_equal(bits(vs), bits(rv))
        _, _, _, args = seen[-1]
        assert args[3].dtype == _common.WORD16 and args[3].shape == (b, 1, h * d // 4)


# (shape [batch, heads, dim], input offset in elements, storage offset in bytes, expected word)
_FALLBACKS = {
    "row_24_bytes": ((3, 3, 4), "float16", 0, 0, 8),
    "row_12_bytes": ((3, 1, 3), "float32", 0, 0, 4),
    "row_10_bytes": ((3, 1, 5), "bfloat16", 0, 0, 2),
    "input_off_by_one_f32": ((3, 2, 8), "float32", 1, 0, 4),
    "input_off_by_one_f16": ((3, 2, 8), "float16", 1, 0, 2),
    "storage_8_aligned": ((3, 2, 8), "bfloat16", 0, 8, 8),
}


@pytest.mark.parametrize("case", sorted(_FALLBACKS))
def test_put_falls_back_below_16_byte_words(kernel_device, case, monkeypatch):
    """Rows whose length is no multiple of 16 bytes, inputs one element off a 16-byte boundary,
    or storage only 8-byte aligned: narrower words, the same bits."""
    (b, h, d), dtype, in_off, st_off, want = _FALLBACKS[case]
    seen = _recording(monkeypatch, put)
    _no_fast_put(monkeypatch)
    rng = np.random.default_rng(len(case))
    n = 9
    k_store = _random_bits(rng, (n, h, d), dtype, st_off)
    v_store = _random_bits(rng, (n, h, d), dtype, st_off)
    flat = _random_bits(rng, (2, b * h * d + 1), dtype)
    key, value = (f[in_off:in_off + b * h * d].reshape(b, h, d) for f in flat)
    # the same slices of the same layout on the kernel's device (offsets kept)
    dkey, dvalue = (f[in_off:in_off + b * h * d].reshape(b, h, d)
                    for f in _placed(kernel_device, flat))
    slots = np.array([4, -1, 8], np.int32)
    ks, vs = _placed(kernel_device, k_store, st_off), _placed(kernel_device, v_store, st_off)
    put.launch(kernel_device, ks, vs, slots, dkey, dvalue, False)
    rk, rv = _ref_put(k_store, v_store, slots, key, value, False)
    assert np.array_equal(bits(ks), bits(rk)) and np.array_equal(bits(vs), bits(rv))
    k_src = seen[-1][3][3]
    assert k_src.dtype.itemsize == want and k_src.dtype != _common.WORD16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plan", ["defrag", "chain"])
@pytest.mark.parametrize("offset,want", [(0, 16), (8, 8)])
def test_move_takes_16_byte_words_when_aligned(kernel_device, dtype, plan, offset, want,
                                               monkeypatch):
    """Block moves: 16-byte words on 16-byte aligned storage, 8-byte words on storage 8 bytes
    off; bit-identical to the sequential reference either way."""
    seen = _recording(monkeypatch, move)
    moves, _ = PLANS[plan]
    rng = np.random.default_rng(31)
    keys = _random_bits(rng, (2, 22, 2, 8), dtype, offset)
    values = _random_bits(rng, (2, 22, 2, 8), dtype, offset)
    kd = _placed(kernel_device, keys, offset)
    vd = _placed(kernel_device, values, offset)
    move.launch(kernel_device, kd, vd, moves, False)
    rk, rv = reference_moves(keys, values, moves, False)
    assert np.array_equal(bits(kd), bits(rk)) and np.array_equal(bits(vd), bits(rv))
    k, v = seen[-1][3][:2]
    assert k.dtype.itemsize == v.dtype.itemsize == want
    assert (k.dtype == _common.WORD16) == (want == 16)


def test_move_geometry_counts_16_byte_words(kernel_device):
    """The prepared block move over 16-byte words: blocks against layers x pairs x 16-byte
    words of each row (half the 8-byte count), K and V each their own space."""
    rng = np.random.default_rng(5)
    keys = _placed(kernel_device, _random_bits(rng, (3, 40, 2, 8), "float32"))  # 64-byte rows:
    values = _placed(kernel_device, _random_bits(rng, (3, 40, 2, 4), "float32"))  # 4, 2 words
    p = move.prepare(kernel_device, keys, values, np.array([[30, 0, 5]]), False)
    k, v = p.args[:2]
    assert k.shape[3] == 4 and v.shape[3] == 2 and k.dtype == v.dtype == _common.WORD16
    nb, cap = p.block, _common.max_blocks(kernel_device)
    nbk = p.args[-1]
    assert _space_ok(nbk, 3 * 5 * 4, nb, cap) and _space_ok(p.grid[0] - nbk, 3 * 5 * 2, nb, cap)


@pytest.mark.parametrize("permuted", [False, True])
def test_emulated_cuda_put_and_move_choose_16_byte_words(emulated_cuda, permuted):
    """The ``cuda`` launcher's own decision (from CuPy pointers, per launch): 16-byte words for
    aligned inputs and storage, narrower for an input one element off; results bit-identical."""
    rng = np.random.default_rng(41)
    n, h, d, b = 11, 2, 8, 3
    seen = []
    real = put._launch
    put._launch = lambda device, kernel, grid, block, args: (seen.append(args),
                                                             real(device, kernel, grid, block,
                                                                  args))
    try:
        for in_off, want in ((0, 16), (1, 2)):
            k_store = _random_bits(rng, (n, h, d), "float16")
            v_store = _random_bits(rng, (h, d, n) if permuted else (n, h, d), "float16")
            flat = _random_bits(rng, (2, b * h * d + 1), "float16")
            key, value = (f[in_off:in_off + b * h * d].reshape(b, h, d) for f in flat)
            slots = np.array([4, -1, 10], np.int32)
            ks, vs = k_store.copy(), v_store.copy()
            ks, vs = _aligned(ks.shape, "float16"), _aligned(vs.shape, "float16")
            ks[...], vs[...] = k_store, v_store
            put.launch("cuda", _FakeDeviceArray(ks), _FakeDeviceArray(vs), slots,
                       _FakeDeviceArray(key), _FakeDeviceArray(value), permuted)
            rk, rv = _ref_put(k_store, v_store, slots, key, value, permuted)
            assert np.array_equal(bits(ks), bits(rk)) and np.array_equal(bits(vs), bits(rv))
            assert seen[-1][3].dtype.itemsize == want
            assert isinstance(seen[-1][3], _common.Desc)
    finally:
        put._launch = real
    keys = _random_bits(rng, (2, 22, 2, 8), "float16")
    values = _random_bits(rng, (2, 2, 8, 22) if permuted else (2, 22, 2, 8), "float16")
    k, v = move.storage_args("cuda", _FakeDeviceArray(keys), _FakeDeviceArray(values), permuted)
    assert k.dtype == _common.WORD16 and (v.dtype == _common.WORD16) != permuted
    kd, vd = keys.copy(), values.copy()
    move.launch("cuda", _FakeDeviceArray(kd), _FakeDeviceArray(vd), PLANS["defrag"][0],
                permuted)
    rk, rv = reference_moves(keys, values, PLANS["defrag"][0], permuted)
    assert np.array_equal(bits(kd), bits(rk)) and np.array_equal(bits(vd), bits(rv))


@pytest.mark.skipif(bool(gpu_compiler_missing()), reason=gpu_compiler_missing() or "-")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot_dim, col, row", [(64, 512, 576), (128, 0, 128), (64, 0, 96)])
def test_cpu_vector_rope_rows_match_float32_numpy(dtype, neox, rot_dim, col, row):
    """The CPU twins' vector row form (16-bit rows, rotary dim 64 or 128, e.g. an MLA latent's
    64 trailing rope dims at dim 512) gives the bits of rotate_pair's float32 math done in numpy
    with numpy's conversions, specials included, and touches nothing outside the rope dims."""
    rng = np.random.default_rng(rot_dim + col)
    vals = (rng.standard_normal((2, 5, 2, row)) * 50).astype(np.float32)
    vals[0, 1, 0, col:col + 6] = [np.nan, np.inf, -np.inf, 1e-6, -0.0, 65000.0]
    if dtype == "float16":
        stored = vals.astype(np.float16).view(np.uint16)
        stored[1, 2, 1, col + 3] = 0x7C01      # a signalling NaN
    else:
        stored = f32_to_bf16_bits(vals)
        stored[1, 2, 1, col + 3] = 0x7F81
    inv = _inv_freq_ref(rot_dim, 10000.0, 1.0, None).astype(np.float32)
    cells, deltas = np.array([0, 2, 3], np.int32), np.array([7, -300, 2])
    keys = stored.copy()
    storage = keys.view(np.float16) if dtype == "float16" else keys
    rope.launch("cpu", storage, dtype, cells, deltas, inv, neox, col=col)
    tab, cos_t, sin_t = rope.tables(deltas, inv)
    half = rot_dim // 2
    idx = np.arange(half)
    first, second = (idx, idx + half) if neox else (2 * idx, 2 * idx + 1)
    want = stored.copy()
    for k, c in enumerate(cells):
        part = stored[:, c, :, col:col + rot_dim]
        x = part.view(np.float16).astype(np.float32) if dtype == "float16" \
            else bf16_bits_to_f32(part)
        a, b = x[..., first], x[..., second]
        with np.errstate(invalid="ignore", over="ignore"):
            y = np.empty_like(x)
            cs, sn = cos_t[tab[k]], sin_t[tab[k]]
            y[..., first] = a * cs - b * sn
            y[..., second] = a * sn + b * cs
            want[:, c, :, col:col + rot_dim] = (y.astype(np.float16).view(np.uint16)
                                                if dtype == "float16" else f32_to_bf16_bits(y))
    nan = np.zeros(want.shape, bool)
    if dtype == "bfloat16":   # a NaN: any quiet NaN bits (numpy has no bfloat16 to follow)
        nan = ((want & 0x7F80) == 0x7F80) & ((want & 0x7F) != 0)
        assert np.array_equal(nan, ((keys & 0x7F80) == 0x7F80) & ((keys & 0x7F) != 0))
    assert np.array_equal(keys[~nan], want[~nan])


@pytest.mark.skipif(bool(gpu_compiler_missing()), reason=gpu_compiler_missing() or "-")
def test_16_byte_copy_kernels_use_128_bit_loads_and_stores_in_ptx(tmp_path_factory):
    """Compiled offline (by the PTX check of the copy kernels, tests/ptx_runs.py: a fresh process,
    the simulator has no PTX compiler; its PTX is read here, not compiled again): the put and
    block move kernels' 16-byte signatures load and store with ld.global.v2.u64 /
    st.global.v2.u64, at sm_80 and sm_90; their 8-byte signatures do not (so the test would
    notice if the 128-bit path fell back to two 8-byte accesses). A put whose V is in 16-byte
    rows declares no shared tile (only element-wise permuted V is tiled)."""
    import re
    from numba import types
    from numbakv.kernels.ptx import ptx_file_name
    from ptx_runs import ptx_check
    run = ptx_check("copies", tmp_path_factory)
    assert run.returncode == 0, run.stdout + run.stderr
    vec = re.compile(r"\b(ld|st)\.global\.v(2\.(u|b|s|f)64|4\.(u|b|s|f)32)\b")
    wide_with_v2_loads = 0
    for kernel, sigs in (("put_kv", put._SIGS), ("move_cells", move._CELL_SIGS),
                         ("move_lanes", move._LANE_SIGS)):
        assert kernel in run.kernels
        for k, sig in enumerate(sigs):
            wide = sig[0].dtype == types.complex128
            for cc in ((8, 0), (9, 0)):
                ptx = (run.ptx_dir / ptx_file_name(kernel, k, cc)).read_text()
                assert f".target sm_{cc[0]}{cc[1]}" in ptx, (kernel, k, cc)
                kinds = {m.group(1) for m in vec.finditer(ptx)}
                assert kinds == ({"ld", "st"} if wide else set()), (kernel, str(sig[0]), cc, kinds)
                if sig[1].dtype == types.complex128:  # V in rows: never tiled
                    assert ".shared" not in ptx, (kernel, cc)
                if wide:
                    wide_with_v2_loads += any(m.group(0) == "ld.global.v2.u64"
                                              for m in vec.finditer(ptx))
    assert wide_with_v2_loads >= 3 * 2


@pytest.mark.parametrize("permuted", [False, True])
def test_emulated_cuda_move_on_a_cell_slice(emulated_cuda, permuted):
    """A block move on a cell slice of a larger storage (per-sequence streams share one
    allocation): the cuda launcher must use the slice's own layer stride, not cells x row.
    Layers past the first moved the wrong cells, or other streams' cells, before."""
    rng = np.random.default_rng(43)
    keys = _random_bits(rng, (3, 30, 2, 8), "float32")
    values = _random_bits(rng, (3, 2, 8, 30) if permuted else (3, 30, 2, 8), "float32")
    ref_k, ref_v = keys.copy(), values.copy()
    moves = np.array([[15, 0, 3], [12, 4, 2]])
    sk, sv = ref_k[:, 5:25], (ref_v[..., 5:25] if permuted else ref_v[:, 5:25])
    rk, rv = reference_moves(sk, sv, moves, permuted)
    sk[...], sv[...] = rk, rv
    k_slice = keys[:, 5:25]
    v_slice = values[..., 5:25] if permuted else values[:, 5:25]
    k, _ = move.storage_args("cuda", _FakeDeviceArray(k_slice), _FakeDeviceArray(v_slice),
                             permuted)
    assert k.strides[0] == 30 * 64 and k.dtype == _common.WORD16
    move.launch("cuda", _FakeDeviceArray(k_slice), _FakeDeviceArray(v_slice), moves, permuted)
    assert np.array_equal(bits(keys), bits(ref_k)) and np.array_equal(bits(values), bits(ref_v))
