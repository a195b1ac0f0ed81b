"""Quantized K/V (issue 18): q8_0 and q4_0 bit-exact with ggml (the ``gguf`` package's numpy
reference), float8_e4m3 bit-exact with ml_dtypes/torch float8_e4m3fn, the rotary shift on
quantized keys, every cache operation on quantized caches, and a tiny Llama run through a
quantized cache."""

from __future__ import annotations

import numpy as np
import pytest

import numbakv as nkv
from numbakv.errors import StateError

gguf_quants = pytest.importorskip("gguf.quants")
ml_dtypes = pytest.importorskip("ml_dtypes")
from gguf import GGMLQuantizationType  # noqa: E402

GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
F8 = ml_dtypes.float8_e4m3fn


def host(x) -> np.ndarray:
    """A cache output (numpy, CuPy or a bfloat16 view) as a host numpy array."""
    x = getattr(x, "array", x)
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


# ------------------------------------------------------------------------------ references
def ref_quantize(x: np.ndarray, kind: str, scale: float = 1.0) -> np.ndarray:
    """Independent reference: raw blocks ``uint8 [..., row_bytes]`` of float32 rows ``x``."""
    x = np.asarray(x, dtype=np.float32)
    if kind == "float8_e4m3":
        # vLLM: stored = x / scale, saturated to the finite range (CUDA __NV_SATFINITE)
        y = np.clip(x / np.float32(scale), -448, 448)
        return y.astype(F8).view(np.uint8)
    d = x.shape[-1]
    blocks = gguf_quants.quantize(x.reshape(-1, d), GGML[kind])
    return blocks.reshape(x.shape[:-1] + (blocks.shape[-1],))


def ref_dequantize(q: np.ndarray, kind: str, dim: int, scale: float = 1.0) -> np.ndarray:
    """float32 values of raw blocks ``q [..., row_bytes]``."""
    if kind == "float8_e4m3":
        return q.view(F8).astype(np.float32) * np.float32(scale)
    out = gguf_quants.dequantize(q.reshape(-1, q.shape[-1]), GGML[kind])
    return out.reshape(q.shape[:-1] + (dim,)).astype(np.float32)


def edge_rows(rng, n_heads: int, dim: int) -> np.ndarray:
    """``[5, n_heads, dim]`` float32 rows holding the edge cases of the block formats: all-zero
    and all-negative-zero blocks, equal magnitudes of both signs (ties of the largest
    magnitude), a negative largest magnitude (q4_0's signed scale), values that round half-way,
    tiny and large magnitudes."""
    x = rng.standard_normal((5, n_heads, dim)).astype(np.float32)
    x[0, 0, :32] = 0.0
    if n_heads > 1:
        x[0, 1, :32] = -0.0
    x[1, 0, :32] = 1.0
    x[1, 0, 3] = -1.0                       # tie: the first of equal magnitudes wins
    x[1, -1, :32] = -1.0
    x[1, -1, 7] = 1.0
    x[2, 0, :32] = rng.standard_normal(32)
    x[2, 0, 5] = -9.0                       # q4_0: the signed maximum is negative
    x[2, -1, :32] = np.arange(-16, 16) * np.float32(127 / 32.0) / 4  # many half-way products
    x[3] *= 1e-4                            # small (f16 subnormal scales)
    x[4] *= 300.0                           # large
    return x


def in_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to the cache dtype, given back as float32 (the values the cache sees)."""
    return x.astype(dtype).astype(np.float32)


def make_cache(device, k_dtype, v_dtype=None, *, dtype="float16", n_layers=2, n_kv_heads=2,
               head_dim=32, capacity=16, max_seqs=2, shift=True, **kw):
    kw.setdefault("kv_rotation", "off")   # unrotated ggml blocks (rotation: test_rotation.py)
    cfg = nkv.CacheConfig(n_layers, n_kv_heads, head_dim, dtype=dtype, capacity=capacity,
                          max_seqs=max_seqs, device=device, k_dtype=k_dtype,
                          v_dtype=k_dtype if v_dtype is None else v_dtype, **kw)
    return nkv.CausalCache(cfg, shift=nkv.RopeShift() if shift else None)


QTYPES = ["q8_0", "q4_0", "float8_e4m3"]


# ------------------------------------------------------------------------------ config
def test_config_fields_and_nbytes_are_exact():
    f16 = nkv.CacheConfig(4, 8, 64, capacity=100)
    assert (f16.k_dtype, f16.v_dtype, f16.k_scale, f16.v_scale) == ("float16", "float16", 1.0, 1.0)
    q8 = f16.replace(k_dtype="q8_0", v_dtype="q8_0")
    q4 = f16.replace(k_dtype="q4_0", v_dtype="q4_0")
    f8 = f16.replace(k_dtype="float8_e4m3", v_dtype="float8_e4m3")
    # memory per token: q8_0 = 34/64 and q4_0 = 18/64 of float16, float8 = 1/2
    assert q8.nbytes() * 64 == f16.nbytes() * 34
    assert q4.nbytes() * 64 == f16.nbytes() * 18
    assert f8.nbytes() * 2 == f16.nbytes()
    mixed = nkv.CacheConfig(2, 3, 64, v_head_dim=96, capacity=7, k_dtype="q4_0", v_dtype="q8_0")
    assert mixed.nbytes() == 7 * 2 * 3 * (2 * 18 + 3 * 34)
    for cfg in (q8, q4, f8, mixed.replace(device="cpu")):
        cache = nkv.CausalCache(cfg.replace(device="cpu"))
        assert cache.storage.nbytes == cfg.nbytes()


def test_config_rejects_bad_quantized_settings():
    with pytest.raises(ValueError, match="head_dim must be a multiple of 32"):
        nkv.CacheConfig(1, 1, 48, k_dtype="q8_0")
    with pytest.raises(ValueError, match="v_head_dim must be a multiple of 32"):
        nkv.CacheConfig(1, 1, 64, v_head_dim=40, v_dtype="q4_0")
    nkv.CacheConfig(1, 1, 40, k_dtype="float8_e4m3")  # float8 has no blocks
    with pytest.raises(ValueError, match="permuted_v"):
        nkv.CacheConfig(1, 1, 64, v_dtype="q8_0", permuted_v=True)
    nkv.CacheConfig(1, 1, 64, k_dtype="q8_0", permuted_v=True)  # quantized K, permuted float V
    with pytest.raises(ValueError, match="k_dtype"):
        nkv.CacheConfig(1, 1, 64, k_dtype="q5_1")
    with pytest.raises(ValueError, match="k_dtype must be dtype"):
        nkv.CacheConfig(1, 1, 64, dtype="float16", k_dtype="float32")
    with pytest.raises(ValueError, match="k_scale"):
        nkv.CacheConfig(2, 1, 64, k_dtype="float8_e4m3", k_scale=0.0)
    with pytest.raises(ValueError, match="v_scale"):
        nkv.CacheConfig(2, 1, 64, v_dtype="float8_e4m3", v_scale=[1.0, 2.0, 3.0])
    assert nkv.CacheConfig(2, 1, 64, k_scale=[0.5, 2]).k_scale == (0.5, 2.0)
    # a side that defaulted to dtype follows a new dtype; a quantized one stays
    mixed = nkv.CacheConfig(1, 1, 64, v_dtype="q4_0").replace(dtype="float32")
    assert (mixed.k_dtype, mixed.v_dtype) == ("float32", "q4_0")
    cfg = nkv.CacheConfig(1, 1, 64, k_dtype="q8_0", device="cpu")
    with pytest.raises(ValueError, match="shift"):
        nkv.CausalCache(cfg, shift=lambda layer, k, d: k)


# ------------------------------------------------------------------------------ bit-exactness
@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_ggml_blocks_bit_exact(device, kind, dtype):
    """put() stores exactly gguf.quants.quantize's blocks; get() returns exactly
    gguf.quants.dequantize's values rounded to dtype."""
    rng = np.random.default_rng(1)
    H, D = 2, 64
    x = edge_rows(rng, H, D)
    cache = make_cache(device, kind, dtype=dtype, n_kv_heads=H, head_dim=D, n_layers=1,
                       max_seqs=1)
    xin = x.astype(np.float32)
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch")  # the bfloat16 reference rounding
        xt = torch.from_numpy(xin).to(torch.bfloat16)
        seen = xt.float().numpy()
        k_in = v_in = xt
    else:
        k_in = v_in = xin.astype(dtype)
        seen = in_dtype(xin, dtype)
    cache.start_forward(np.arange(5), np.zeros(5, np.int32))
    cache.put(k_in, v_in)
    kq, vq = cache.get_quantized()
    expect = ref_quantize(seen, kind)
    assert host(kq).dtype == np.uint8 and host(kq).shape == expect.shape
    np.testing.assert_array_equal(host(kq), expect)
    np.testing.assert_array_equal(host(vq), expect)
    k, v, _ = cache.get()
    want = ref_dequantize(expect, kind, D)
    if dtype == "bfloat16":
        import torch
        got = torch.from_dlpack(k).float().numpy()
        want = torch.from_numpy(want).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(got, want)
    else:
        assert host(k).dtype == np.dtype(dtype)
        np.testing.assert_array_equal(host(k).view(np.uint8), want.astype(dtype).view(np.uint8))
        np.testing.assert_array_equal(host(v).view(np.uint8), want.astype(dtype).view(np.uint8))


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_float8_bit_exact_with_ml_dtypes_and_torch(device, dtype):
    """stored = x / scale as float8_e4m3fn (nearest even), per-layer scales, saturation at 448;
    get() = float8 * scale."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    H, D = 2, 40
    scales = [0.25, 3.0]
    x = edge_rows(rng, H, D)
    x[4, 0, :4] = [5000.0, -5000.0, 448.0 * 3.0, 464.0 * 3.0]  # saturate in layer 1 (scale 3)
    x[3, 1, :3] = [2.0**-12, 2.0**-10 * 0.75, -(2.0**-9)]     # float8 subnormals at scale .25
    x = in_dtype(x, dtype)
    cache = make_cache(device, "float8_e4m3", dtype=dtype, n_kv_heads=H, head_dim=D,
                       max_seqs=1, k_scale=scales, v_scale=2.0)
    cache.start_forward(np.arange(5), np.zeros(5, np.int32))
    for layer, scale in enumerate(scales):
        cache.set_layer(layer)
        cache.put(x.astype(dtype), x.astype(dtype))
        kq, vq = cache.get_quantized()
        expect = ref_quantize(x, "float8_e4m3", scale)
        np.testing.assert_array_equal(host(kq), expect)
        np.testing.assert_array_equal(host(vq), ref_quantize(x, "float8_e4m3", 2.0))
        # torch agrees with ml_dtypes on the same (saturated) inputs
        y = torch.from_numpy(np.clip(x / np.float32(scale), -448, 448))
        np.testing.assert_array_equal(y.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), expect)
        k, _, _ = cache.get()
        want = ref_dequantize(expect, "float8_e4m3", D, scale).astype(dtype)
        np.testing.assert_array_equal(host(k).view(np.uint8), want.view(np.uint8))


def test_float8_decode_covers_every_code():
    from numbakv.kernels.quant import e4m3_to_f32, f32_to_e4m3
    codes = np.arange(256, dtype=np.uint8)
    got = np.array([e4m3_to_f32.cpu(c) for c in codes], dtype=np.float32)
    np.testing.assert_array_equal(got, codes.view(F8).astype(np.float32))
    finite = codes[(codes & 0x7F) != 0x7F]
    back = np.array([f32_to_e4m3.cpu(v) for v in got[finite]], dtype=np.uint8)
    np.testing.assert_array_equal(back, finite)  # every finite code round-trips


@pytest.mark.parametrize("kind", QTYPES)
def test_non_finite_inputs(device, kind):
    """Documented choice (ggml leaves it undefined): a q8_0/q4_0 block with a NaN or an
    infinity dequantizes to NaN in every value (scale stored as f16 NaN); other blocks are
    untouched. float8: NaN stays NaN, +-inf saturate to +-448 * scale."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 1, 64)).astype(np.float16)
    x[0, 0, 3] = np.nan
    x[1, 0, 40] = -np.inf
    cache = make_cache(device, kind, n_kv_heads=1, head_dim=64, n_layers=1, max_seqs=1)
    cache.start_forward([0, 1], [0, 0])
    cache.put(x, x)
    k = host(cache.get()[0]).astype(np.float32)
    clean = ref_dequantize(ref_quantize(np.nan_to_num(x.astype(np.float32), posinf=0, neginf=0),
                                        kind), kind, 64) if kind != "float8_e4m3" else None
    if kind == "float8_e4m3":
        assert np.isnan(k[0, 0, 3]) and k[1, 0, 40] == -448.0
        ok = np.ones_like(k, dtype=bool)
        ok[0, 0, 3] = ok[1, 0, 40] = False
        np.testing.assert_array_equal(
            k[ok], ref_dequantize(ref_quantize(x.astype(np.float32), kind), kind, 64)[ok]
            .astype(np.float16).astype(np.float32))
        return
    assert np.isnan(k[0, 0, :32]).all() and np.isnan(k[1, 0, 32:]).all()
    np.testing.assert_array_equal(k[0, 0, 32:], clean[0, 0, 32:].astype(np.float16))
    np.testing.assert_array_equal(k[1, 0, :32], clean[1, 0, :32].astype(np.float16))


# ------------------------------------------------------------------------------ rotary shift
def rotate_ref(x: np.ndarray, delta: int, rope: nkv.RopeShift) -> np.ndarray:
    """numpy float32 rotation of rows ``x [..., head_dim]`` by ``delta`` (the cos/sin tables as
    the cache forms them: float64 angles rounded to float32)."""
    d = x.shape[-1]
    inv = rope.inv_freq(d)
    ang = np.float64(delta) * inv.astype(np.float64)
    c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    half = inv.size
    i0 = np.arange(half) if rope.neox else 2 * np.arange(half)
    i1 = i0 + half if rope.neox else i0 + 1
    out = x.astype(np.float32).copy()
    a, b = out[..., i0].copy(), out[..., i1].copy()
    out[..., i0] = a * c - b * s
    out[..., i1] = a * s + b * c
    return out


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("kind", QTYPES)
def test_shift_on_quantized_keys_equals_quantize_rotate_dequantize(device, kind, neox):
    """remove() from the middle re-rotates the keys that move: each moved key's blocks equal
    quantize(rotate(dequantize(blocks), -removed)) exactly; values and unmoved keys keep their
    bytes."""
    rope = nkv.RopeShift(base=10000.0, neox=neox)
    cfg = nkv.CacheConfig(2, 2, 64, capacity=8, device=device, k_dtype=kind, v_dtype=kind,
                          k_scale=[0.5, 2.0], kv_rotation="off")
    cache = nkv.CausalCache(cfg, shift=rope)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((2, 6, 2, 64)) * 2).astype(np.float16)
    cache.start_forward(np.arange(6), np.zeros(6, np.int32))
    before = []
    for layer in range(2):
        cache.set_layer(layer)
        cache.put(x[layer], x[layer][::-1].copy())
        before.append(tuple(host(a).copy() for a in cache.get_quantized()))
    cache.remove(0, 1, 3)  # positions 3..5 move down by 2
    cache.start_forward([4], [0])
    for layer in range(2):
        cache.set_layer(layer)
        cache.put(x[layer][:1], x[layer][:1])
        kq, vq = (host(a) for a in cache.get_quantized())
        kb, vb = before[layer]
        scale = cfg.k_scale[layer]
        # cells 3..5 hold positions 1..3 now: rotated by -2
        expect = ref_quantize(rotate_ref(ref_dequantize(kb[3:6], kind, 64, scale), -2, rope),
                              kind, scale)
        np.testing.assert_array_equal(kq[3:6], expect)
        np.testing.assert_array_equal(kq[0], kb[0])
        kept = [0, 3, 4, 5]  # cell 1 took the new token
        np.testing.assert_array_equal(vq[kept], vb[kept])


def test_rotation_of_a_quantized_key_matches_a_float_cache_closely(device):
    """Sanity on the meaning (not the bytes): a q8_0 key shifted in place decodes close to the
    float16 cache's shifted key."""
    rope = nkv.RopeShift()
    caches = {k: make_cache(device, k, n_layers=1, max_seqs=1, head_dim=64, n_kv_heads=1)
              for k in ("float16", "q8_0")}
    x = np.random.default_rng(5).standard_normal((6, 1, 64)).astype(np.float16)
    out = {}
    for kind, cache in caches.items():
        cache.start_forward(np.arange(6), np.zeros(6, np.int32))
        cache.put(x, x)
        cache.remove(0, 0, 2)
        cache.start_forward([4], [0])
        cache.put(x[:1], x[:1])
        out[kind] = host(cache.get()[0]).astype(np.float32)
    assert np.abs(out["q8_0"] - out["float16"]).max() < 0.05


# ------------------------------------------------------------------------------ cache operations
class Twin:
    """A quantized cache and a float32 cache fed the same data and the same operations: every
    get() of the quantized one must equal dequantize(quantize(the float one's get())), which
    checks that each (sequence, position) keeps its own key and value through every move."""

    def __init__(self, device, k_dtype, v_dtype, permuted_v=False):
        common = dict(capacity=12, max_seqs=3, device=device, cache_padding=1)
        self.kinds = (k_dtype, v_dtype)
        self.q = nkv.CausalCache(nkv.CacheConfig(2, 2, 32, dtype="float32", k_dtype=k_dtype,
                                                 v_dtype=v_dtype, permuted_v=permuted_v,
                                                 **common))
        self.f = nkv.CausalCache(nkv.CacheConfig(2, 2, 32, dtype="float32", **common))
        self.rng = np.random.default_rng(6)

    def forward(self, positions, seqs):
        for c in (self.q, self.f):
            c.start_forward(positions, seqs)
        for layer in range(2):
            k = self.rng.standard_normal((len(positions), 2, 32)).astype(np.float32)
            v = self.rng.standard_normal((len(positions), 2, 32)).astype(np.float32)
            for c in (self.q, self.f):
                c.set_layer(layer)
                c.put(k, v)
            self.check()

    def check(self):
        qk, qv, qm = (host(a) for a in self.q.get())
        fk, fv, fm = (host(a) for a in self.f.get())
        np.testing.assert_array_equal(qm, fm)
        for got, ref, kind in ((qk, fk, self.kinds[0]), (qv, fv, self.kinds[1])):
            if self.q.config.permuted_v and got is qv:  # [H, Dv, n] against the row layout
                np.testing.assert_array_equal(got.transpose(2, 0, 1), ref)
                continue
            if kind == "float32":
                np.testing.assert_array_equal(got, ref)
            else:
                np.testing.assert_array_equal(got, ref_dequantize(ref_quantize(ref, kind),
                                                                  kind, 32))

    def both(self, name, *args):
        for c in (self.q, self.f):
            getattr(c, name)(*args)


@pytest.mark.parametrize("kinds", [("q8_0", "q4_0"), ("float8_e4m3", "q8_0"),
                                   ("q4_0", "float32")])
def test_defrag_remove_copy_prefix_on_quantized_caches(device, kinds):
    t = Twin(device, *kinds)
    t.forward(np.arange(4), [0] * 4)
    t.forward(np.arange(3), [1] * 3)
    t.forward(np.arange(5), [2] * 5)
    t.both("remove", 1, 0, None)      # a hole in the middle
    t.both("remove", 0, 2, None)
    t.both("defrag")                  # moves seq 2's cells down
    assert t.q.defrag_count == t.f.defrag_count == 1
    t.forward([5, 2], [2, 0])
    t.both("copy_prefix", 2, 1, 3)
    t.forward([3], [1])
    t.both("seq_rm", 1, 0, 1)         # seq 1 holds position 0: seq_cp into it is refused
    t.both("seq_cp", 0, 1, 0, 1)      # llama.cpp's sequence copy (metadata)
    t.forward([6], [2])


def test_quantized_k_with_permuted_float_v(device):
    t = Twin(device, "q8_0", "float32", permuted_v=True)
    t.forward(np.arange(4), [0] * 4)
    t.forward(np.arange(3), [1] * 3)
    t.both("remove", 0, 0, None)
    t.both("defrag")
    t.forward([3], [1])


def test_raw_moves_follow_the_cells(device):
    """defrag moves raw blocks: after it, get_quantized() of a sequence's cells holds the bytes
    that were put for it."""
    cache = make_cache(device, "q4_0", "float8_e4m3", max_seqs=2, capacity=6)
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((3, 2, 32)).astype(np.float16) for _ in range(2)]
    for s in range(2):
        cache.start_forward(np.arange(3), [s] * 3)
        for layer in range(2):
            cache.set_layer(layer)
            cache.put(xs[s], -xs[s])
    cache.remove(0, 0, None)
    cache.defrag()
    cache.start_forward([3], [1])
    cache.set_layer(1)
    cache.put(xs[0][:1], xs[0][:1])
    kq, vq = (host(a) for a in cache.get_quantized())
    np.testing.assert_array_equal(kq[:3], ref_quantize(in_dtype(xs[1], "float16"), "q4_0"))
    np.testing.assert_array_equal(vq[:3], ref_quantize(in_dtype(-xs[1], "float16"),
                                                       "float8_e4m3"))


@pytest.mark.parametrize("kind", QTYPES)
def test_state_round_trip_keeps_raw_blocks(device, kind, tmp_path):
    cache = make_cache(device, kind, max_seqs=2, k_scale=[0.5, 1.5])
    rng = np.random.default_rng(8)
    cache.start_forward(np.arange(4), [1] * 4)
    blocks = []
    for layer in range(2):
        cache.set_layer(layer)
        x = rng.standard_normal((4, 2, 32)).astype(np.float16)
        cache.put(x, x * 2)
        blocks.append(tuple(host(a).copy() for a in cache.get_quantized()))
    data = cache.state_bytes(1)
    whole = tmp_path / "whole.safetensors"
    cache.save_state(whole)
    for load in ("seq", "whole"):
        other = make_cache(device, kind, max_seqs=2, k_scale=[0.5, 1.5])
        if load == "seq":
            other.load_state_bytes(data, 0)
            seq = 0
        else:
            other.load_state(whole)
            seq = 1
        other.start_forward([4], [seq])
        for layer in range(2):
            other.set_layer(layer)
            other.put(np.zeros((1, 2, 32), np.float16), np.zeros((1, 2, 32), np.float16))
            kq, vq = (host(a) for a in other.get_quantized())
            np.testing.assert_array_equal(kq[:4], blocks[layer][0])
            np.testing.assert_array_equal(vq[:4], blocks[layer][1])
    # the types (and float8 scales) are part of the saved config
    wrong = make_cache(device, "q8_0" if kind != "q8_0" else "q4_0", max_seqs=2)
    with pytest.raises(StateError, match="k_dtype"):
        wrong.load_state_bytes(data, 0)
    plain = make_cache(device, "float16", max_seqs=2)
    with pytest.raises(StateError, match="k_dtype"):
        plain.load_state_bytes(data, 0)
    if kind == "float8_e4m3":
        other_scale = make_cache(device, kind, max_seqs=2, k_scale=0.5)
        with pytest.raises(StateError, match="k_scale"):
            other_scale.load_state_bytes(data, 0)


def test_get_scratch_is_reused_and_float_sides_stay_views():
    cache = make_cache("cpu", "q8_0", "float16")
    cache.start_forward(np.arange(3), [0] * 3)
    x = np.ones((3, 2, 32), np.float16)
    cache.put(x, x)
    k1, v1, _ = cache.get()
    assert np.shares_memory(v1, cache.storage.values)       # float V: a view
    cache.set_layer(1)
    cache.put(2 * x, x)
    k2, _, _ = cache.get()
    assert np.shares_memory(k1, k2)                           # one scratch per cache
    np.testing.assert_array_equal(k2, 2 * x)


# ------------------------------------------------------------------------------ a tiny Llama
def _llama_logits(k_dtype: "str | None", prompt, steps):
    """Logits of a tiny random-weight transformers Llama whose attention reads its K/V from a
    numbakv cache of ``k_dtype`` (K and V), glued through transformers' AttentionInterface:
    prefill ``prompt`` then ``steps`` decode tokens (teacher-forced)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=256, rope_theta=10000.0)
    model = LlamaForCausalLM(config).eval()
    cache = nkv.CausalCache(nkv.CacheConfig(2, 2, 64, capacity=128, device="cpu",
                                            k_dtype=k_dtype, v_dtype=k_dtype,
                                            kv_rotation="off"))

    def numbakv_attention(module, query, key, value, attention_mask, scaling=None, **kw):
        # query [1, H, q, D]; key/value [1, kv, q, D] already roped
        cache.set_layer(module.layer_idx)
        cache.put(key[0].transpose(0, 1).to(torch.float16).contiguous(),
                  value[0].transpose(0, 1).to(torch.float16).contiguous())
        k, v, mask = cache.get()
        k = torch.from_dlpack(k).float().transpose(0, 1)       # [kv, n, D]
        v = torch.from_dlpack(v).float().transpose(0, 1)
        m = torch.from_dlpack(mask)[:query.shape[2]].float()  # [q, n]
        rep = query.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        scores = query[0].float() @ k.transpose(1, 2) * scaling + m
        out = torch.softmax(scores, dim=-1) @ v                # [H, q, D]
        return out.transpose(0, 1)[None].to(query.dtype), None

    tokens = torch.tensor(prompt + steps)
    if k_dtype is None:  # the model's own attention over the whole sequence, no cache
        model.config._attn_implementation = "eager"
        with torch.no_grad():
            return model(input_ids=tokens[None]).logits[0].numpy()
    AttentionInterface.register("numbakv_test_glue", numbakv_attention)
    model.config._attn_implementation = "numbakv_test_glue"
    logits = []
    with torch.no_grad():
        n = len(prompt)
        spans = [(0, n)] + [(n + i, n + i + 1) for i in range(len(steps))]
        for lo, hi in spans:
            cache.start_forward(np.arange(lo, hi), np.zeros(hi - lo, np.int32))
            out = model(input_ids=tokens[None, lo:hi],
                        position_ids=torch.arange(lo, hi)[None]).logits[0]
            logits.append(out)
    return torch.cat(logits).numpy()


@pytest.mark.slow
@pytest.mark.torch
def test_tiny_llama_through_quantized_caches():
    """A tiny random-weight Llama (2 layers, 4 heads, 2 KV heads, head_dim 64) prefilling 24
    tokens and decoding 6 through a numbakv cache: with float16 K/V it matches the model's own
    attention; q8_0 moves the logits by at most 4% of their standard deviation (observed 1.9%),
    float8_e4m3 (scale 1) by at most 15% (observed 7.6%), q4_0 by at most 50% (observed 27%).
    Tolerances relative to std(logits) because the random model's logits are tiny."""
    rng = np.random.default_rng(9)
    prompt = rng.integers(0, 97, 24).tolist()
    steps = rng.integers(0, 97, 6).tolist()
    ref = _llama_logits("float16", prompt, steps)
    spread = ref.std()
    own = _llama_logits(None, prompt, steps)
    assert np.abs(own - ref).max() < 0.005 * spread  # the glue is right (f16 rounding only)
    errors = {}
    for kind in QTYPES:
        got = _llama_logits(kind, prompt, steps)
        errors[kind] = float(np.abs(got - ref).max() / spread)
        # the model sees quantization noise, not garbage: the top token mostly agrees
        agree = float((got.argmax(-1) == ref.argmax(-1)).mean())
        assert agree >= (0.9 if kind == "q8_0" else 0.6), (kind, agree)
    print("max |logits - f16 logits| / std(f16 logits):", errors)
    assert errors["q8_0"] < 0.04
    assert errors["float8_e4m3"] < 0.15
    assert errors["q4_0"] < 0.5
    assert errors["q8_0"] < errors["q4_0"]


@pytest.mark.parametrize("kinds", [("q8_0", "float8_e4m3"), ("q4_0", "float16")])
def test_storage_put_with_slots(device, kinds):
    """KVStorage.put with a slot per token (scatter; a negative slot skips its token) on a
    quantized storage, K and V each in its own type."""
    from numbakv.storage import KVStorage
    cfg = nkv.CacheConfig(2, 2, 32, capacity=8, k_dtype=kinds[0], v_dtype=kinds[1],
                          device=device)
    st = KVStorage(cfg, 8, device)
    x = np.random.default_rng(10).standard_normal((3, 2, 32)).astype(np.float16)
    st.put(1, np.array([5, -1, 2], np.int32), x, -x)
    k, v = (host(a) for a in st.quantized_views(1, 0, 8))
    for got, kind, src in ((k, kinds[0], x), (v, kinds[1], -x)):
        want = (ref_quantize(in_dtype(src, "float16"), kind) if kind != "float16"
                else src.view(np.uint8))
        np.testing.assert_array_equal(got[[5, 2]], want[[0, 2]])
        assert not got[[0, 1, 3, 4, 6, 7]].any()  # untouched cells stay zero
    assert not host(st.keys[0]).any()              # other layers too


def test_attend_on_a_quantized_cache_matches_its_dequantized_get():
    """attend() on quantized storage equals attention over get()'s dequantized K/V: on the CPU
    numbakv's kernel reads the raw blocks of the cell pool (dequantized per tile); FlashInfer,
    which cannot read them, is refused naming the way out."""
    torch = pytest.importorskip("torch")
    from numbakv.attention import attend
    rng = np.random.default_rng(9)
    cache = make_cache("cpu", "q8_0", dtype="float32", n_kv_heads=2, head_dim=32, n_layers=1,
                       max_seqs=2)
    cache.start_forward([0, 1, 2, 0], [0, 0, 0, 1])
    x = rng.standard_normal((4, 2, 32)).astype(np.float32)
    cache.put(x, x)
    q = torch.from_numpy(rng.standard_normal((4, 4, 32)).astype(np.float32))
    got = attend(q, cache)
    key, value, mask = cache.get()
    k, v = torch.from_numpy(np.asarray(key)), torch.from_numpy(np.asarray(value))
    m = torch.from_numpy(np.asarray(mask))[:4]
    s = torch.einsum("bhd,nhd->bhn", q.reshape(4, 2, 2, 32).flatten(1, 2),
                     k.repeat_interleave(2, dim=1)) / 32 ** 0.5 + m[:, None, :]
    want = torch.einsum("bhn,nhd->bhd", torch.softmax(s, -1), v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(attend(q, cache, backend="torch"), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="quantized blocks"):
        attend(q, cache, backend="flashinfer")


@pytest.mark.parametrize("rotation", ["off", "auto"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kinds", [("q8_0", "q8_0"), ("q4_0", "q8_0"), ("q8_0", None),
                                   ("float8_e4m3", "q4_0")])
def test_cpu_attend_reads_quantized_blocks_in_place(dtype, kinds, rotation):
    """The CPU kernel reads quantized rows where they lie (no dequantized copy of the range):
    equal to the dense reference for every format pair, storage dtype, a sliding window, several
    sequences, a prefill pass and a decode pass; no get() scratch is allocated."""
    torch = pytest.importorskip("torch")
    import numbakv as nkv
    from numbakv.attention import attend
    rng = np.random.default_rng(3)
    kd, vd = kinds
    cfg = nkv.CacheConfig(2, 2, 64, capacity=64, max_seqs=3, dtype=dtype, k_dtype=kd,
                          v_dtype=vd or dtype, v_scale=0.5, kv_rotation=rotation,
                          device="cpu")
    cache = nkv.CausalCache(cfg, swa_window=20)
    tt = getattr(torch, dtype)
    passes = [([0] * 30 + [1] * 25 + [2] * 5, list(range(30)) + list(range(25)) + list(range(5))),
              ([0, 1, 2, 2, 2], [30, 25, 5, 6, 7])]
    for seqs, pos in passes:
        cache.start_forward(pos, seqs)
        for layer in range(2):
            cache.set_layer(layer)
            k = torch.from_numpy(rng.standard_normal((len(seqs), 2, 64)).astype(np.float32))
            cache.put(k.to(tt), (k * 0.5).to(tt))
            q = torch.from_numpy(rng.standard_normal((len(seqs), 8, 64)).astype(np.float32))
            q = q.to(tt)
            got = attend(q, cache, soft_cap=30.0)
            if (pos, layer) == (passes[0][1], 0):     # before the dense reference's own get():
                assert cache.storage._k_scratch is None   # nothing dequantized out of place
            want = attend(q, cache, soft_cap=30.0, backend="dense")
            tol = 1e-4 if dtype == "float32" else 2e-2
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_cpu_attend_over_quantized_keys_beside_permuted_values():
    """A float V stored permuted ([n_kv_heads, v_head_dim, n_cells]) beside q4_0 keys: the CPU
    kernel reads V through the permuted layout (it read it as [cell, head, dim] before: a
    result n_cells wide), equal to the dense reference."""
    torch = pytest.importorskip("torch")
    import numbakv as nkv
    from numbakv.attention import attend
    cfg = nkv.CacheConfig(1, 2, 32, v_head_dim=8, capacity=24, max_seqs=2, dtype="float16",
                          k_dtype="q4_0", permuted_v=True, device="cpu")
    cache = nkv.CausalCache(cfg)
    rng = np.random.default_rng(8)
    for pos, seqs in ((list(range(9)) + [0, 1], [0] * 9 + [1, 1]), ([9, 2], [0, 1])):
        n = len(pos)
        cache.start_forward(pos, seqs)
        cache.put(rng.standard_normal((n, 2, 32)).astype(np.float16),
                  rng.standard_normal((n, 2, 8)).astype(np.float16))
        q = torch.from_numpy(rng.standard_normal((n, 4, 32)).astype(np.float32)).half()
        got = attend(q, cache, soft_cap=20.0)
        want = attend(q, cache, soft_cap=20.0, backend="dense")
        assert got.shape == (n, 4, 8)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "float8_e4m3"])
def test_large_cpu_puts_gets_and_shifts_thread_without_changing_a_bit(kind):
    """A CPU put large enough to spread its tokens over numba's threads (float16 rows, widened
    by numpy first) writes exactly the blocks the one-thread form writes from the same values:
    every float16 bit pattern (subnormals, infinities, NaNs) included, scattered slots with
    skips (negative) included. The threaded get and rotary shift match their one-thread forms
    too. (Widening is exact, so the blocks are those of the per-value half conversion:
    test_ggml_blocks_bit_exact and test_non_finite_inputs check float16 caches against the
    references.)"""
    from numbakv.kernels import quant as Q
    from numbakv.kernels.rope import KIND_F16_BITS, KIND_FLOAT, _merge, tables
    fmt = Q.FORMATS[kind]
    heads, dim = 2, 64
    batch = -(-Q.PARALLEL_MIN_VALUES // (heads * dim))   # just at the threaded size
    bits = np.arange(batch * heads * dim, dtype=np.uint32) % 65536
    x = bits.astype(np.uint16).view(np.float16).reshape(batch, heads, dim)
    rng = np.random.default_rng(3)
    slots = rng.permutation(batch + 16)[:batch].astype(np.int32)
    slots[::97] = -1
    row = dim // Q.BLOCK_VALUES[fmt] * Q.BLOCK_BYTES[fmt]
    scales = np.full(1, 0.5, np.float32)
    fast = np.zeros((1, batch + 16, heads, row), np.uint8)
    Q.put_launch("cpu", fast, 0, x, slots, -1, fmt, scales, "float16")
    slow = np.zeros_like(fast)
    Q.quant_put_cpu(slow, x.astype(np.float32), slots, -1, 0, fmt, scales, KIND_FLOAT)
    np.testing.assert_array_equal(fast, slow)
    assert fast.any()

    got = np.zeros((batch, heads, dim), np.float16)
    Q.get_launch("cpu", fast, 0, 0, got, fmt, scales, "float16")
    want = np.zeros_like(got)
    Q.quant_get_cpu(fast, 0, 0, fmt, scales, want.view(np.uint16), KIND_F16_BITS)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))

    finite = np.where(np.isfinite(x), x, np.float16(1.0))   # rotations of finite keys
    Q.put_launch("cpu", fast, 0, finite, None, 0, fmt, scales, "float16")
    slow = fast.copy()
    cells = np.arange(batch, dtype=np.int32)
    deltas = (cells % 7 - 3).astype(np.int32)
    inv_freq = 1e4 ** (-np.arange(0, dim, 2, dtype=np.float32) / dim)
    Q.rope_launch("cpu", fast, dim, cells, deltas, inv_freq, True, fmt, scales)
    c2, d2 = _merge(cells, deltas)
    tab, cos_t, sin_t = tables(d2, inv_freq)
    Q.quant_rope_cpu(slow, c2, tab, np.zeros(1, np.int32), cos_t, sin_t, 1, dim, scales, fmt)
    np.testing.assert_array_equal(fast, slow)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_cpu_vector_get_matches_the_element_form_for_every_scale(kind):
    """The CPU's vector get (quant_get_fused_cpu, what get_launch runs for q8_0/q4_0) gives
    the element form's bits (quant_get_cpu, which test_ggml_blocks_bit_exact holds to gguf's
    dequantize) for every float16 scale pattern -- subnormal, overflowing products, infinities
    and NaNs (redone by the element form) -- and random quants, into float32, float16 and
    bfloat16, in calls of four blocks and of one (rows of 96 and of MLA's 576 values), one
    thread and threaded, from a cell range not starting at 0."""
    from numbakv.kernels import quant as Q
    from numbakv.kernels.rope import KIND_BF16_BITS, KIND_F16_BITS, KIND_FLOAT
    if not Q._F16C:
        pytest.skip("the vector get needs F16C")
    fmt = Q.FORMATS[kind]
    nbytes = Q.BLOCK_BYTES[fmt]
    rng = np.random.default_rng(5)
    heads = 2
    for dim in (96, 576):
        nblk = dim // 32
        cells = -(-65536 // (heads * nblk)) + 3
        q = rng.integers(0, 256, (2, cells, heads, nblk * nbytes), dtype=np.uint8)
        scale_bits = np.arange(cells * heads * nblk, dtype=np.uint32) % 65536
        blocks = q[1].reshape(cells, heads, nblk, nbytes)
        blocks[..., 0] = (scale_bits & 0xFF).reshape(cells, heads, nblk)
        blocks[..., 1] = (scale_bits >> 8).reshape(cells, heads, nblk)
        scales = np.ones(2, np.float32)
        for out_kind, dt in ((KIND_FLOAT, np.float32), (KIND_F16_BITS, np.uint16),
                             (KIND_BF16_BITS, np.uint16)):
            n = cells - 3
            want = np.zeros((n, heads, dim), dt)
            Q.quant_get_cpu(q, 1, 3, fmt, scales, want, out_kind)
            for fn in (Q.quant_get_fused_cpu, Q.quant_get_fused_cpu_par):
                got = np.full((n, heads, dim), 7, dt)
                fn(q, 1, 3, fmt, scales, got, out_kind)
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("src", ["float16", "bfloat16", "float32"])
def test_cpu_vector_float8_put_and_get_match_the_element_form(src):
    """The CPU's vector float8_e4m3 put (quant_put_f8_cpu, what put_launch runs) writes the
    element form's bytes (quant_put_cpu on the same values in float32, which
    test_float8_bit_exact_with_ml_dtypes_and_torch holds to ml_dtypes) for every 16-bit input
    pattern (random float32 bits with the specials), with scales that are powers of two
    (taken as a multiply) and not, down to a subnormal reciprocal's edge, rows of 32 values
    and rows with a tail of fewer (80); the vector get (quant_get_fused_cpu) gives the element
    form's bits back into float32, float16 and bfloat16, NaN codes included."""
    from numbakv.kernels import quant as Q
    from numbakv.kernels.rope import KIND_BF16_BITS, KIND_F16_BITS, KIND_FLOAT
    if not Q._F16C:
        pytest.skip("the vector float8 put and get need F16C")
    rng = np.random.default_rng(7)
    for dim in (64, 80):
        n = -(-65536 // (2 * dim)) + 5
        if src == "float32":
            x = rng.integers(0, 1 << 32, (n, 2, dim), dtype=np.uint64).astype(np.uint32)
            x.flat[:12] = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,
                           0x43E00000, 0x43DFFFFF, 0x3C800000, 0x3C7FFFFF, 0x3B000000,
                           0x3A800000]
            x = x.view(np.float32)
            wide = x
        else:
            x = (np.arange(n * 2 * dim, dtype=np.uint32) % 65536).astype(np.uint16)
            x = x.reshape(n, 2, dim)
            wide = (x.view(np.float16).astype(np.float32) if src == "float16" else
                    (x.astype(np.uint32) << 16).view(np.float32))
        for scale in (1.0, 0.37, 2.0 ** -126, 2.0 ** 127, -2.0):
            scales = np.full(2, scale, np.float32)
            slots = rng.permutation(n + 9)[:n].astype(np.int32)
            slots[::13] = -1
            got = np.zeros((2, n + 9, 2, dim), np.uint8)
            want = np.zeros_like(got)
            Q.put_launch("cpu", got, 1, x, slots, -1, Q.FMT_F8, scales, src)
            Q.quant_put_cpu(want, np.ascontiguousarray(wide), slots, -1, 1, Q.FMT_F8, scales,
                            KIND_FLOAT)
            np.testing.assert_array_equal(got, want)
            for kind, dt in ((KIND_FLOAT, np.float32), (KIND_F16_BITS, np.uint16),
                             (KIND_BF16_BITS, np.uint16)):
                back = np.zeros((n, 2, dim), dt)
                ref = np.zeros_like(back)
                Q.quant_get_fused_cpu(got, 1, 3, Q.FMT_F8, scales, back, kind)
                Q.quant_get_cpu(got, 1, 3, Q.FMT_F8, scales, ref, kind)
                np.testing.assert_array_equal(back.view(np.uint8), ref.view(np.uint8))


def test_cpu_float8_shift_in_registers_matches_the_element_form():
    """The float8_e4m3 rotary shift in registers (quant_rope_fused_cpu, what rope_launch runs
    for rows of 64 and 128 values) writes the element form's bytes (quant_rope_cpu) for
    random codes -- NaN codes, subnormals and saturating results included -- NeoX and
    interleaved pairs, two layers with different scales, cells listed twice."""
    from numbakv.kernels import quant as Q
    from numbakv.kernels.rope import _merge, tables
    if not Q._F16C:
        pytest.skip("the in-register shift needs F16C")
    rng = np.random.default_rng(4)
    scales = np.array([1.0, 0.37], np.float32)
    layers = np.array([0, 1], np.int32)
    for dim in (64, 128):
        q = rng.integers(0, 256, (2, 300, 2, dim), dtype=np.uint8)
        cells = np.concatenate([rng.permutation(300)[:200], [5, 5]]).astype(np.int32)
        deltas = rng.integers(-9, 9, cells.size).astype(np.int32)
        inv_freq = 1e4 ** (-np.arange(0, dim, 2, dtype=np.float32) / dim)
        merged, summed = _merge(cells, deltas)
        tab, cos_t, sin_t = tables(summed, inv_freq)
        for neox in (0, 1):
            got, want = q.copy(), q.copy()
            Q.quant_rope_fused_cpu(got, 0, merged, tab, layers, cos_t, sin_t, neox, dim, scales,
                                   Q.FMT_F8, 0, np.float32(1.0))
            Q.quant_rope_cpu(want, merged, tab, layers, cos_t, sin_t, neox, dim, scales,
                             Q.FMT_F8)
            np.testing.assert_array_equal(got, want)
            assert (got != q).any()


def test_cpu_fused_rope_rows_match_the_work_row_form():
    """The CPU's in-register quantized shift (rows of 64 values: an MLA latent's rope blocks
    after two latent blocks, Walsh-Hadamard-rotated or not, NeoX or interleaved pairs) writes
    the bytes the work-row form (quant_rope_cpu on a view of the same blocks) writes, a row
    with an infinity (redone by the work-row form) and a zero row included; the latent blocks
    before them are untouched."""
    from numbakv.kernels import quant as Q
    from numbakv.kernels.hadamard import rotation_scale
    from numbakv.kernels.rope import shift_plan
    rng = np.random.default_rng(13)
    layers, n_cells, heads, dim, lead = 2, 12, 2, 64, 64
    for fmt in (Q.FMT_Q8_0, Q.FMT_Q4_0):
        nbytes = Q.BLOCK_BYTES[fmt]
        col = lead // 32 * nbytes
        x = (rng.standard_normal((layers, n_cells, heads, lead + dim)) * 3).astype(np.float16)
        x[1, 3, 0, -5] = np.inf
        x[0, 5, 1, :] = 0
        scales = np.ones(layers, np.float32)
        for rot in (0, dim):
            q = np.zeros((layers, n_cells, heads, (lead + dim) // 32 * nbytes), np.uint8)
            for layer in range(layers):
                Q.put_launch("cpu", q, layer, x[layer], None, 0, fmt, scales, "float16", rot)
            cells = np.arange(0, n_cells, 2, dtype=np.int32)
            deltas = rng.integers(-40, 40, cells.size)
            inv_freq = 1e4 ** (-np.arange(0, dim, 2, dtype=np.float32) / dim)
            rscale = rotation_scale(rot) if rot else np.float32(1.0)
            for neox in (0, 1):
                fast, slow = q.copy(), q.copy()
                Q.rope_launch("cpu", fast, dim, cells, deltas, inv_freq, bool(neox), fmt,
                              scales, None, rot, col=col)
                c2, layer_list, tab, cos_t, sin_t = shift_plan(cells, deltas, inv_freq, layers)
                Q.quant_rope_cpu(slow[..., col:], c2, tab, layer_list, cos_t, sin_t, neox, dim,
                                 scales, fmt, rot, rscale)
                np.testing.assert_array_equal(fast, slow)
                assert (fast[..., :col] == q[..., :col]).all() and (fast != q).any()
