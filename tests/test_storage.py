"""KVStorage: allocation, views, the kernel dispatch and argument checking (a failed call changes
nothing)."""

import numpy as np
import pytest

from numbakv.config import CacheConfig, RopeShift
from numbakv.storage import KVStorage
from helpers import as_f32, random_storage

DTYPES = ["float16", "float32", "bfloat16"]


def host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def dev(storage, x):
    return storage.xp.asarray(x)


def make(device, dtype="float16", permuted=False, n_cells=12, **kw):
    cfg = CacheConfig(2, 2, 8, v_head_dim=kw.pop("v_head_dim", 4), dtype=dtype,
                      permuted_v=permuted, **kw)
    return KVStorage(cfg, n_cells, device)


def snapshot(st):
    return host(st.keys).copy(), host(st.values).copy()


def unchanged(st, snap):
    k, v = snapshot(st)
    return np.array_equal(k.view(np.uint8), snap[0].view(np.uint8)) and \
        np.array_equal(v.view(np.uint8), snap[1].view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("permuted", [False, True])
def test_allocation_and_views(device, dtype, permuted):
    st = make(device, dtype, permuted)
    assert st.n_cells == 12 and st.device == device and st.dtype == dtype
    assert st.keys.shape == (2, 12, 2, 8)
    assert st.values.shape == ((2, 2, 4, 12) if permuted else (2, 12, 2, 4))
    assert st.keys.dtype == st.config.storage_dtype
    assert st.nbytes == st.config.nbytes(12)
    assert not host(st.keys).any() and not host(st.values).any()
    kv = st.key_view(1, 3, 7)
    vv = st.value_view(1, 3, 7)
    assert kv.shape == (4, 2, 8)
    assert vv.shape == ((2, 4, 4) if permuted else (4, 2, 4))
    if device != "cuda":
        assert np.shares_memory(kv, st.keys) and np.shares_memory(vv, st.values)
    with pytest.raises(ValueError, match="cell range"):
        st.key_view(0, 5, 13)
    with pytest.raises(ValueError, match="layer"):
        st.value_view(2, 0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("permuted", [False, True])
def test_put_and_put_range_land_in_the_right_cells(device, dtype, permuted):
    st = make(device, dtype, permuted)
    rng = np.random.default_rng(0)
    key = random_storage(rng, (3, 2, 8), dtype)
    value = random_storage(rng, (3, 2, 4), dtype)
    st.put(1, np.array([9, -1, 4], np.int32), dev(st, key), dev(st, value))
    st.put_range(0, 5, dev(st, key), dev(st, value))
    k = host(st.keys)
    assert np.array_equal(k[1, 9], key[0]) and np.array_equal(k[1, 4], key[2])
    assert not k[1, [0, 1, 2, 3, 5, 6, 7, 8, 10, 11]].any()
    assert np.array_equal(k[0, 5:8], key)
    for layer, cell, t in ((1, 9, 0), (1, 4, 2), (0, 6, 1)):
        vv = host(st.value_view(layer, 0, 12))
        got = vv[:, :, cell] if permuted else vv[cell]
        assert np.array_equal(got, value[t])
    kin, vin = st.read_cells(np.array([9, 4]))
    assert kin.shape == (2, 2, 2, 8) and vin.shape == (2, 2, 2, 4)
    assert np.array_equal(kin[1], key[[0, 2]]) and np.array_equal(vin[1], value[[0, 2]])


def test_put_checks_arguments_and_changes_nothing(device):
    st = make(device)
    rng = np.random.default_rng(1)
    key = dev(st, random_storage(rng, (2, 2, 8), "float16"))
    value = dev(st, random_storage(rng, (2, 2, 4), "float16"))
    st.put(0, np.array([0, 1]), key, value)
    snap = snapshot(st)
    bad = [
        (dict(layer=2), "layer"),
        (dict(slots=np.array([0, 12])), "slots"),
        (dict(slots=np.array([3, 3])), "same cell"),
        (dict(slots=np.array([1])), "slots"),
        (dict(slots=np.array([0.5, 1.0])), "slots"),
        (dict(key=dev(st, np.zeros((2, 2, 8), np.float32))), "key must have the storage dtype"),
        (dict(key=dev(st, np.zeros((2, 3, 8), np.float16))),
         r"key must have shape \[batch, 2, 8\]"),
        (dict(value=dev(st, np.zeros((3, 2, 4), np.float16))),
         r"value must have shape \[2, 2, 4\]"),
        (dict(key=[[0.0]]), "key must be"),
    ]
    for change, msg in bad:
        args = dict(layer=0, slots=np.array([4, 5]), key=key, value=value)
        args.update(change)
        with pytest.raises(ValueError, match=msg):
            st.put(args["layer"], args["slots"], args["key"], args["value"])
        assert unchanged(st, snap), change
    for start in (-1, 11, 1.0, True):
        with pytest.raises(ValueError, match="start"):
            st.put_range(0, start, key, value)
    assert unchanged(st, snap)


@pytest.mark.parametrize("mask_dtype", ["float32", "float16"])
def test_fill_mask(device, mask_dtype):
    st = make(device, mask_dtype=mask_dtype)
    n = 6
    cell_pos = np.array([0, 1, 2, 0, 1, -1], np.int32)
    cell_seqs = np.zeros((n, 4), np.uint64)
    cell_seqs[[0, 1, 2], 0] = 1          # sequence 0 at positions 0..2
    cell_seqs[[3, 4], 3] = 1 << 5        # sequence 197 at positions 0..1
    out = st.new_mask(4, n)
    assert out.shape == (4, n) and str(out.dtype) == mask_dtype
    st.fill_mask(out, cell_pos, cell_seqs, np.array([2, 1, 1]), np.array([0, 197, 0]),
                 np.array([True, True, False]))
    z, m = 0.0, -np.inf
    want = np.array([[z, z, z, m, m, m],
                     [m, m, m, z, z, m],
                     [z, z, z, m, m, m],     # causal test off: sees position 2 too
                     [m, m, m, m, m, m]])
    assert np.array_equal(host(out).astype(np.float64), want)
    st.fill_mask(out, cell_pos, cell_seqs, np.array([2]), np.array([0]), np.array([1]), window=1)
    assert np.array_equal(host(out)[0].astype(np.float64), [m, z, z, m, m, m])
    st.fill_mask(out, cell_pos, cell_seqs, np.array([2]), np.array([0]), np.array([0]),
                 window=2, symmetric=True)
    assert np.array_equal(host(out)[0].astype(np.float64), [m, z, z, m, m, m])
    st.fill_mask(out, cell_pos, cell_seqs, np.array([2]), np.array([0]), np.array([1]), chunk=2)
    assert np.array_equal(host(out)[0].astype(np.float64), [m, m, z, m, m, m])


def test_fill_mask_checks_arguments(device):
    st = make(device)
    out = st.new_mask(2, 3)
    good = dict(cell_pos=np.zeros(3, np.int32), cell_seqs=np.zeros((3, 4), np.uint64),
                batch_pos=np.zeros(2, np.int32), batch_seq=np.zeros(2, np.int32),
                causal=np.ones(2, bool))
    bad = [
        (dict(cell_pos=np.zeros(4, np.int32)), "cell_pos"),
        (dict(cell_seqs=np.zeros((3, 5), np.uint64)), "cell_seqs"),   # 1..4 words
        (dict(batch_pos=np.zeros(3, np.int32), batch_seq=np.zeros(3, np.int32),
              causal=np.ones(3, bool)), "fit"),
        (dict(batch_seq=np.array([0, 256])), "batch_seq"),
        (dict(causal=np.ones(1, bool)), "causal"),
    ]
    for change, msg in bad:
        args = dict(good)
        args.update(change)
        with pytest.raises(ValueError, match=msg):
            st.fill_mask(out, **args)
    with pytest.raises(ValueError, match="window"):
        st.fill_mask(out, **good, window=-2)
    with pytest.raises(ValueError, match="out"):
        st.fill_mask(np.zeros((2, 3), np.int32), **good)
    with pytest.raises(ValueError, match="rows"):
        st.new_mask(-1, 3)


@pytest.mark.parametrize("permuted", [False, True])
def test_move_blocks_copy_cells_and_state(device, permuted):
    st = make(device, "bfloat16", permuted, n_cells=16)
    rng = np.random.default_rng(2)
    k = random_storage(rng, (2, 16, 2, 8), "bfloat16")
    v = random_storage(rng, (2, 16, 2, 4), "bfloat16")
    cells = np.arange(16)
    st.write_cells(cells, k, v)
    rk, rv = st.read_cells(cells)
    assert np.array_equal(rk, k) and np.array_equal(rv, v)
    st.move_blocks(np.array([[10, 2, 4], [3, 5, 6]]))   # the second overlaps the first's target
    ek, ev = k.copy(), v.copy()
    for s, d, ln in ((10, 2, 4), (3, 5, 6)):
        ek[:, d:d + ln] = ek[:, s:s + ln].copy()
        ev[:, d:d + ln] = ev[:, s:s + ln].copy()
    rk, rv = st.read_cells(cells)
    assert np.array_equal(rk, ek) and np.array_equal(rv, ev)
    st.copy_cells(np.array([0, 1]), np.array([15, 14]))
    ek[:, [15, 14]] = ek[:, [0, 1]]
    ev[:, [15, 14]] = ev[:, [0, 1]]
    rk, rv = st.read_cells(cells)
    assert np.array_equal(rk, ek) and np.array_equal(rv, ev)
    snap = snapshot(st)
    for moves in (np.array([[10, 12, 5]]), np.array([[-1, 2, 1]]), np.array([[0, 2, -1]]),
                  np.array([[0, 1]])):
        with pytest.raises(ValueError, match="moves"):
            st.move_blocks(moves)
    with pytest.raises(ValueError, match="dst"):
        st.copy_cells(np.array([0]), np.array([16]))
    with pytest.raises(ValueError, match="same length"):
        st.copy_cells(np.array([0, 1]), np.array([2]))
    with pytest.raises(ValueError, match="repeat"):
        st.write_cells(np.array([1, 1]), k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="shape"):
        st.write_cells(np.array([1, 2]), k[:, :3], v[:, :2])
    with pytest.raises(ValueError, match="dtype"):
        st.write_cells(np.array([1, 2]), k[:, :2].astype(np.float32), v[:, :2])
    assert unchanged(st, snap)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_through_storage(device, dtype):
    st = make(device, dtype, n_cells=6)
    rng = np.random.default_rng(3)
    k = random_storage(rng, (2, 6, 2, 8), dtype)
    v = random_storage(rng, (2, 6, 2, 4), dtype)
    st.write_cells(np.arange(6), k, v)
    rs = RopeShift(dim=4, neox=False)
    st.rotate(np.array([1, 2]), np.array([3, 3]), rs, layers=[1])
    rk, rv = st.read_cells(np.arange(6))
    assert np.array_equal(rk[0], k[0]) and np.array_equal(rv, v)
    assert np.array_equal(rk[1][:, :, 4:], k[1][:, :, 4:])
    assert not np.array_equal(rk[1, 1:3], k[1, 1:3])
    st.rotate(np.array([1, 2]), np.array([-3, -3]), rs, layers=[1])
    rk, _ = st.read_cells(np.arange(6))
    tol = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}[dtype]
    ref = as_f32(k, dtype)
    assert np.abs(as_f32(rk, dtype) - ref).max() <= tol * np.abs(ref).max()
    snap = snapshot(st)
    with pytest.raises(ValueError, match="head_dim"):
        st.rotate(np.array([1]), np.array([1]), RopeShift(dim=16))
    with pytest.raises(ValueError, match="cells"):
        st.rotate(np.array([6]), np.array([1]), rs)
    with pytest.raises(ValueError, match="deltas"):
        st.rotate(np.array([1, 2]), np.array([1]), rs)
    with pytest.raises(ValueError, match="layers"):
        st.rotate(np.array([1]), np.array([1]), rs, layers=[2])
    with pytest.raises(ValueError, match="rope"):
        st.rotate(np.array([1]), np.array([1]), "neox")
    assert unchanged(st, snap)


def test_constructor_checks():
    cfg = CacheConfig(1, 1, 8)
    with pytest.raises(ValueError, match="n_cells"):
        KVStorage(cfg, 0, "cpu")
    with pytest.raises(ValueError, match="device"):
        KVStorage(cfg, 4, "auto")
    with pytest.raises(ValueError, match="config"):
        KVStorage({"n_layers": 1}, 4, "cpu")


@pytest.mark.parametrize("permuted", [False, True])
def test_host_storage_is_64_byte_aligned(permuted):
    """JAX's CPU DLPack import is zero-copy only for 64-byte aligned data."""
    from numbakv.config import CacheConfig
    from numbakv.storage import KVStorage
    for n_cells in (1, 3, 17):
        cfg = CacheConfig(2, 3, 5, dtype="float16", capacity=n_cells, permuted_v=permuted)
        st = KVStorage(cfg, n_cells, "cpu")
        assert st.keys.ctypes.data % 64 == 0 and st.values.ctypes.data % 64 == 0
        assert not st.keys.any() and not st.values.any()
        assert st.keys.flags.c_contiguous and st.values.flags.c_contiguous


# Shapes whose per-head row is not a multiple of the word the whole cell row allows (issue 17):
# a head of 17 float32 / 34 halves / 3 halves, single-element heads, and V narrower than K.
ODD_SHAPES = [(2, 34, 34), (2, 17, 17), (2, 1, 1), (2, 3, 3), (2, 8, 6), (3, 5, 7)]


@pytest.mark.parametrize("heads,head_dim,v_head_dim", ODD_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("permuted", [False, True])
def test_odd_head_shapes_put_move_copy(device, heads, head_dim, v_head_dim, dtype, permuted):
    """Any shape the config accepts works on every device: put (strided and contiguous
    inputs), put_range, block moves and cell copies land exactly where a numpy reference says."""
    cfg = CacheConfig(2, heads, head_dim, v_head_dim=v_head_dim, dtype=dtype, permuted_v=permuted)
    st = KVStorage(cfg, 9, device)
    rng = np.random.default_rng(head_dim * 7 + heads)
    k = random_storage(rng, (2, 9, heads, head_dim), dtype)
    v = random_storage(rng, (2, 9, heads, v_head_dim), dtype)
    key = random_storage(rng, (3, heads, head_dim), dtype)
    wide = random_storage(rng, (3, heads, v_head_dim + 1), dtype)
    value = wide[:, :, :v_head_dim]                      # a strided input
    st.write_cells(np.arange(9), k, v)
    st.put(1, np.array([7, -1, 2], np.int32), dev(st, key), dev(st, value))
    k[1, [7, 2]] = key[[0, 2]]
    v[1, [7, 2]] = value[[0, 2]]
    st.put_range(0, 4, dev(st, key), dev(st, np.ascontiguousarray(value)))
    k[0, 4:7] = key
    v[0, 4:7] = value
    st.move_blocks(np.array([[4, 0, 3], [7, 8, 1]]))
    for s, d, ln in ((4, 0, 3), (7, 8, 1)):
        k[:, d:d + ln] = k[:, s:s + ln].copy()
        v[:, d:d + ln] = v[:, s:s + ln].copy()
    st.copy_cells(np.array([8, 1]), np.array([3, 5]))
    k[:, [3, 5]] = k[:, [8, 1]]
    v[:, [3, 5]] = v[:, [8, 1]]
    rk, rv = st.read_cells(np.arange(9))
    assert np.array_equal(rk.view(np.uint8), k.view(np.uint8))
    assert np.array_equal(rv.view(np.uint8), v.view(np.uint8))
