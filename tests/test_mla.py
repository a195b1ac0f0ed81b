"""MLA latent caches (issue 34): V-less layers (``v_head_dim=0``), the rope-only shift over the
trailing dims of the latent row (``RopeShift(offset=...)``), q8_0 latents, and the refusals."""

import numpy as np
import pytest

import numbakv as nkv
from numbakv.errors import NotSupportedError, StateError

from helpers import as_f32, host, random_storage, same, seq_rows

#: a tiny DeepSeek-shaped latent: kv_lora_rank 64 + 32 rope dims (multiples of 32: q8_0 blocks)
RANK, ROPE = 64, 32
D = RANK + ROPE


def mla_config(device="cpu", **kw):
    base = dict(n_layers=2, n_kv_heads=1, head_dim=D, v_head_dim=0, capacity=32, max_seqs=2,
                device=device)
    base.update(kw)
    return nkv.CacheConfig(**base)


def mla_shift(**kw):
    return nkv.RopeShift(base=10000.0, dim=ROPE, offset=RANK, **kw)


def rope_reference(rows: np.ndarray, deltas: np.ndarray, shift: nkv.RopeShift) -> np.ndarray:
    """float32 ``rows [k, H, D]`` with dims ``offset .. offset + dim`` turned by ``deltas``
    (float64 angles, float32 rotation: what the kernels promise)."""
    out = rows.astype(np.float32).copy()
    inv = shift.inv_freq(rows.shape[-1]).astype(np.float64)
    half = inv.size
    ang = deltas.astype(np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
    o = shift.offset
    if shift.neox:
        i0, i1 = np.arange(half) + o, np.arange(half) + o + half
    else:
        i0, i1 = 2 * np.arange(half) + o, 2 * np.arange(half) + 1 + o
    a, b = out[..., i0].copy(), out[..., i1].copy()
    out[..., i0] = a * c - b * s
    out[..., i1] = a * s + b * c
    return out


def fill(cache, seq, n, rng, dtype="float16"):
    """Put ``n`` random latent rows at positions 0..n-1 of ``seq`` in every layer; returns them
    (storage dtype, ``[n_layers, n, 1, D]``)."""
    cfg = cache.config
    cache.start_forward(np.arange(n, dtype=np.int32), np.full(n, seq, np.int32))
    rows = []
    for layer in range(cfg.n_layers):
        cache.set_layer(layer)
        k = random_storage(rng, (n, 1, D), dtype)
        v_width = cfg.v_head_dim
        cache.put(k, None if v_width == 0 and layer else np.zeros((n, 1, v_width), k.dtype))
        rows.append(k)
    return np.stack(rows)


def apply_pending_shifts(cache):
    """seq_add/seq_div record shifts that the next forward pass applies (llama.cpp's K-shift):
    run one on sequence 1."""
    cache.start_forward(np.array([0], np.int32), np.array([1], np.int32))


# ------------------------------------------------------------------ V-less layers
def test_v_less_config_allocates_no_v():
    cfg = mla_config()
    assert cfg.v_less and cfg.v_row_bytes == 0
    assert cfg.nbytes() == cfg.n_stored_layers * cfg.n_cells() * D * 2   # K only
    cache = nkv.CausalCache(cfg, shift=mla_shift())
    assert cache.storage.values.nbytes == 0
    assert cache.storage.nbytes == cache.storage.keys.nbytes
    with pytest.raises(ValueError, match="v_head_dim=0"):
        mla_config(v_dtype="q8_0")
    with pytest.raises(ValueError, match="v_head_dim=0"):
        mla_config(permuted_v=True)
    with pytest.raises(ValueError, match="v_head_dim"):
        mla_config(v_head_dim=-1)


def test_v_less_get_layer_pool_and_sequence_ops(device):
    rng = np.random.default_rng(0)
    cache = nkv.CausalCache(mla_config(device), shift=mla_shift())
    rows = fill(cache, 0, 6, rng)
    cache.set_layer(1)
    k, v, mask = cache.get()
    assert tuple(k.shape) == (6, 1, D) and tuple(v.shape) == (6, 1, 0)
    assert same(host(k), rows[1])
    pk, pv = cache.layer_pool(0)
    assert tuple(pv.shape) == (cache.n_cells, 1, 0)
    cache.seq_cp(0, 1, 0, 3)
    cache.seq_rm(0, 4, 5)
    cache.defrag()
    pos, kk, vv = seq_rows(cache, 0)
    assert pos.tolist() == [0, 1, 2, 3, 5] and vv.shape[-1] == 0
    assert same(kk[:, :4], rows[:, :4]) and same(kk[:, 4], rows[:, 5])


def test_v_less_snapshot_state_and_prefix_store_roundtrip(device, tmp_path):
    rng = np.random.default_rng(1)
    cache = nkv.CausalCache(mla_config(device), shift=mla_shift())
    rows = fill(cache, 0, 5, rng)
    snap = cache.export_seq(0)
    assert snap.nbytes == 2 * 5 * D * 2
    snap = nkv.SeqSnapshot.from_bytes(snap.to_bytes())
    assert cache.import_seq(1, snap, at=10) == 5
    path = tmp_path / "mla.safetensors"
    cache.save_state(path)
    other = nkv.CausalCache(mla_config(device), shift=mla_shift())
    other.load_state(path)
    for seq in (0, 1):
        a, b = seq_rows(cache, seq), seq_rows(other, seq)
        assert same(a[0], b[0]) and same(a[1], b[1]) and b[2].shape[-1] == 0
    # moved by 10: the rope dims turned, the latent dims untouched
    pos, k1, _ = seq_rows(cache, 1)
    assert pos.tolist() == list(range(10, 15))
    assert same(k1[..., :RANK], rows[..., :RANK])
    other.seq_rm(1)
    store = nkv.PrefixStore(other, retain_seqs=(1,), block_tokens=2, host_bytes=1 << 20)
    tokens = list(range(100, 105))
    store.save(0, tokens)
    other.seq_rm(0)
    assert store.load(0, tokens) == 5
    assert same(seq_rows(other, 0)[1], rows)
    store.close()


def test_states_across_layouts_refused_and_nothing_changed():
    rng = np.random.default_rng(2)
    cache = nkv.CausalCache(mla_config(), shift=mla_shift())
    fill(cache, 0, 4, rng)
    data = cache.state_bytes()
    per_head = nkv.CausalCache(mla_config(v_head_dim=RANK), shift=mla_shift())
    fill(per_head, 0, 3, rng)
    before = per_head.state_bytes()
    with pytest.raises(StateError, match="v_head_dim"):
        per_head.load_state_bytes(data)
    with pytest.raises(StateError):
        per_head.import_seq(1, cache.export_seq(0))
    assert per_head.state_bytes() == before
    quant = nkv.CausalCache(mla_config(k_dtype="q8_0"), shift=mla_shift())
    with pytest.raises(StateError, match="k_dtype"):
        quant.load_state_bytes(data)


# ------------------------------------------------------------------ the rope-only shift
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("neox", [True, False])
def test_rope_only_shift_turns_trailing_dims(device, dtype, neox):
    rng = np.random.default_rng(3)
    shift = mla_shift(neox=neox)
    cache = nkv.CausalCache(mla_config(device, dtype=dtype), shift=shift)
    rows = fill(cache, 0, 8, rng, dtype)
    cache.remove(0, 2, 5)      # positions 5..7 move down by 3
    pos, k, _ = seq_rows(cache, 0)
    assert pos.tolist() == [0, 1, 2, 3, 4]
    # the latent dims are bit-identical (the shift never touched their bytes)
    assert same(k[..., :RANK], np.concatenate([rows[:, :2], rows[:, 5:]], axis=1)[..., :RANK])
    for layer in range(2):
        want = rope_reference(as_f32(rows[layer, 5:], dtype), np.full(3, -3), shift)
        got = as_f32(k[layer, 2:], dtype)
        tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_rope_only_shift_cpu_twin_equals_kernel():
    """The strided rope view through the CUDA kernel (simulator) and its CPU twin: bit-equal."""
    from conftest import KERNEL_DEVICE
    out = []
    for device in ("cpu", KERNEL_DEVICE):
        rng = np.random.default_rng(4)
        cache = nkv.CausalCache(mla_config(device), shift=mla_shift())
        fill(cache, 0, 6, rng)
        cache.seq_add(0, 2, 6, 7)
        apply_pending_shifts(cache)
        out.append(seq_rows(cache, 0)[1])
    assert same(out[0], out[1])


def test_rope_only_shift_on_q8_0_latent_requantizes_rope_blocks_only(device):
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType as T
    rng = np.random.default_rng(5)
    shift = mla_shift()
    cache = nkv.CausalCache(mla_config(device, k_dtype="q8_0"), shift=shift)
    rows = fill(cache, 0, 6, rng)
    raw = np.array(host(cache.storage.keys))
    # put quantizes as ggml does
    cells = np.asarray(cache.cells.seq_cells(0))
    order = np.argsort(cache.cells.cells["pos"][cells])
    want = gguf_quants.quantize(rows.astype(np.float32).reshape(-1, D), T.Q8_0)
    assert same(raw[:, cells[order]].reshape(want.shape), want)
    cache.seq_add(0, 3, 6, 4)
    apply_pending_shifts(cache)
    after = np.array(host(cache.storage.keys))
    rope_bytes = RANK // 32 * 34
    moved = cells[order][3:]
    assert same(after[..., :rope_bytes], raw[..., :rope_bytes])     # latent blocks untouched
    deq = gguf_quants.dequantize(raw[:, moved].reshape(-1, 1, D // 32 * 34), T.Q8_0)
    turned = rope_reference(deq.reshape(-1, 1, D), np.full(deq.shape[0], 4), shift)
    want = gguf_quants.quantize(turned.reshape(-1, D), T.Q8_0)
    assert same(after[:, moved].reshape(want.shape)[:, rope_bytes:], want[:, rope_bytes:])
    # get() hands out the dequantized latent
    cache.start_forward(np.array([10], np.int32), np.array([0], np.int32))
    cache.set_layer(0)
    k, v, _ = cache.get()
    assert tuple(v.shape[1:]) == (1, 0)


def test_mla_shift_refusals_change_nothing():
    # a V-less latent row keeps its rope dims last
    with pytest.raises(NotSupportedError, match="rope dims last"):
        nkv.CausalCache(mla_config(), shift=nkv.RopeShift(dim=ROPE))
    with pytest.raises(NotSupportedError, match="rope dims last"):
        nkv.CausalCache(mla_config(), shift=nkv.RopeShift(dim=16, offset=RANK))
    with pytest.raises(ValueError, match="whole blocks"):
        nkv.CausalCache(mla_config(k_dtype="q8_0"), shift=nkv.RopeShift(dim=16, offset=D - 16))
    with pytest.raises(ValueError, match="offset"):
        nkv.RopeShift(dim=16, offset=-1)
    with pytest.raises(ValueError, match="fit head_dim"):
        nkv.CausalCache(mla_config(v_head_dim=None), shift=nkv.RopeShift(dim=64, offset=64))
    # on a cache without a shift, a move is refused and changes nothing
    rng = np.random.default_rng(6)
    cache = nkv.CausalCache(mla_config())
    fill(cache, 0, 4, rng)
    before = cache.state_bytes()
    with pytest.raises(NotSupportedError):
        cache.remove(0, 1, 2)
    assert cache.state_bytes() == before


def test_rope_shift_offset_fingerprinted():
    a = nkv.CausalCache(mla_config(), shift=mla_shift())
    b = nkv.CausalCache(mla_config(v_head_dim=None), shift=nkv.RopeShift(dim=ROPE))
    assert a.export_seq(0).fingerprint["shift"]["offset"] == RANK
    assert "offset" not in b.export_seq(0).fingerprint["shift"]   # older states keep matching


# ------------------------------------------------------------------ FlashMLA's fp8_ds_mla row
def flashmla_quantize(x: np.ndarray) -> np.ndarray:
    """FlashMLA's ``quantize_k_cache`` (V32_FP8Sparse), re-implemented with numpy + ml_dtypes:
    ``x`` float32 ``[n, 576]`` (values of the cache's dtype) -> uint8 ``[n, 656]``."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    n = x.shape[0]
    out = np.zeros((n, 656), np.uint8)
    out[:, 528:] = x[:, 512:].astype(ml_dtypes.bfloat16).view(np.uint8)
    for t in range(4):
        tile = x[:, t * 128:(t + 1) * 128]
        inv = np.abs(tile).max(axis=-1).astype(np.float32) / np.float32(448.0)
        inv = np.power(np.float32(2), np.ceil(np.log2(np.maximum(inv, np.float32(1e-4)))))
        inv = inv.astype(np.float32)
        out[:, 512 + 4 * t:516 + 4 * t] = inv.view(np.uint8).reshape(n, 4)
        q = (tile / inv[:, None]).astype(ml_dtypes.float8_e4m3fn)
        out[:, t * 128:(t + 1) * 128] = q.view(np.uint8)
    return out


def flashmla_dequantize(q: np.ndarray) -> np.ndarray:
    """FlashMLA's ``dequantize_k_cache`` (V32_FP8Sparse) -> float32 ``[n, 576]`` (bf16 values)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    n = q.shape[0]
    out = np.zeros((n, 576), np.float32)
    out[:, 512:] = q[:, 528:].copy().view(ml_dtypes.bfloat16).astype(np.float32)
    scales = q[:, 512:528].copy().view(np.float32)
    for t in range(4):
        vals = q[:, t * 128:(t + 1) * 128].copy().view(ml_dtypes.float8_e4m3fn)
        y = vals.astype(np.float32) * scales[:, t:t + 1]
        out[:, t * 128:(t + 1) * 128] = y.astype(ml_dtypes.bfloat16).astype(np.float32)
    return out


def ds_rows(rng, n: int) -> np.ndarray:
    """bfloat16 latent rows (as float32 values) with tiles of very different magnitudes: a zero
    tile, a tiny one, a large one, values that land exactly on powers of two."""
    x = rng.standard_normal((n, 576)).astype(np.float32)
    x[:, 128:256] *= 1e-6
    x[0, :128] = 0.0
    x[1 % n, 256:384] *= 3000.0
    x[2 % n, 384:512] = 7 * 2.0 ** -3        # amax / 448 exactly a power of two
    return bf16_round(x)


def bf16_round(x):
    from helpers import bf16_bits_to_f32, f32_to_bf16_bits
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


def ds_cache(device, dtype="bfloat16", **kw):
    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=1, head_dim=576, v_head_dim=0, dtype=dtype,
                          k_dtype="fp8_ds_mla", capacity=16, max_seqs=2, device=device, **kw)
    return nkv.CausalCache(cfg, shift=nkv.RopeShift(dim=64, offset=512))


def put_rows(cache, rows_f32, dtype):
    from helpers import f32_to_bf16_bits
    n = rows_f32.shape[1]
    cache.start_forward(np.arange(n, dtype=np.int32), np.zeros(n, np.int32))
    for layer in range(rows_f32.shape[0]):
        cache.set_layer(layer)
        x = rows_f32[layer][:, None]
        x = f32_to_bf16_bits(x) if dtype == "bfloat16" else x.astype(dtype)
        cache.put(x, None)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_fp8_ds_mla_rows_are_flashmla_bytes(device, dtype):
    rng = np.random.default_rng(7)
    rows = np.stack([ds_rows(rng, 5), ds_rows(rng, 5)])
    if dtype == "float16":
        rows = rows.astype(np.float16).astype(np.float32)
        rows[:, :, 128:256] = 0.0      # float16 flushes 1e-6 values: keep the tile plain
    cache = ds_cache(device, dtype)
    assert cache.config.k_row_bytes == 656 and cache.storage.values.nbytes == 0
    put_rows(cache, rows, dtype)
    raw = np.array(host(cache.storage.keys))[:, :5, 0]
    for layer in range(2):
        want = flashmla_quantize(rows[layer])
        if dtype != "bfloat16":        # the rope values are rounded to bfloat16 either way
            want[:, 528:] = flashmla_quantize(bf16_round(rows[layer]))[:, 528:]
        assert same(raw[layer], want), f"layer {layer}: bytes differ from FlashMLA's"
    # get() dequantizes as FlashMLA does
    cache.start_forward(np.array([5], np.int32), np.array([0], np.int32))
    cache.set_layer(1)
    k, v, _ = cache.get()
    assert k.shape[0] == 6
    assert tuple(v.shape[1:]) == (1, 0)
    got = as_f32(host(k)[:5, 0], dtype)
    deq = flashmla_dequantize(raw[1])
    if dtype == "bfloat16":
        assert same(got, deq)
    else:   # rounded to float16/float32 from the same float32 products
        np.testing.assert_allclose(got, deq, rtol=1e-2, atol=1e-6)
    kq, _ = cache.get_quantized()
    assert same(np.array(host(kq))[:5, 0], raw[1])


def test_fp8_ds_mla_shift_touches_only_the_rope_bytes(device):
    rng = np.random.default_rng(8)
    rows = np.stack([ds_rows(rng, 6), ds_rows(rng, 6)])
    cache = ds_cache(device)
    plain = nkv.CausalCache(nkv.CacheConfig(n_layers=2, n_kv_heads=1, head_dim=576, v_head_dim=0,
                                            dtype="bfloat16", capacity=16, max_seqs=2,
                                            device=device),
                            shift=nkv.RopeShift(dim=64, offset=512))
    put_rows(cache, rows, "bfloat16")
    put_rows(plain, rows, "bfloat16")
    before = np.array(host(cache.storage.keys))
    for c in (cache, plain):
        c.seq_add(0, 2, 6, 9)
        apply_pending_shifts(c)
    after = np.array(host(cache.storage.keys))
    assert same(after[..., :528], before[..., :528])          # fp8 values and scales untouched
    assert not same(after[:, 2:6, :, 528:], before[:, 2:6, :, 528:])
    # the rope bytes hold exactly what a bfloat16 latent cache's rope dims hold after the shift
    rope_bits = after[:, :6, 0, 528:].copy().view(np.uint16)
    assert same(rope_bits, np.array(host(plain.storage.keys))[:, :6, 0, 512:])


def test_fp8_ds_mla_cpu_twin_equals_kernel():
    from conftest import KERNEL_DEVICE
    rng = np.random.default_rng(9)
    rows = np.stack([ds_rows(rng, 4), ds_rows(rng, 4)])
    out = []
    for device in ("cpu", KERNEL_DEVICE):
        cache = ds_cache(device, "float32")
        put_rows(cache, rows, "float32")
        cache.start_forward(np.array([4], np.int32), np.array([0], np.int32))
        cache.set_layer(0)
        k, _, _ = cache.get()
        out.append((np.array(host(cache.storage.keys)), np.array(host(k))))
    assert same(out[0][0], out[1][0]) and same(out[0][1], out[1][1])


def test_fp8_ds_mla_refusals():
    with pytest.raises(ValueError, match="head_dim=576"):
        nkv.CacheConfig(1, 1, 2 * 576, v_head_dim=0, k_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match="v_head_dim=0"):
        nkv.CacheConfig(1, 1, 576, k_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match="key"):
        nkv.CacheConfig(1, 1, 576, v_head_dim=0, v_dtype="fp8_ds_mla")
    cfg = nkv.CacheConfig(1, 1, 576, v_head_dim=0, k_dtype="fp8_ds_mla", capacity=4,
                          device="cpu")
    with pytest.raises(NotSupportedError, match="fp8_ds_mla"):
        nkv.CausalCache(cfg, shift=nkv.RopeShift(dim=32, offset=544))
    rng = np.random.default_rng(10)
    a = ds_cache("cpu")
    put_rows(a, np.stack([ds_rows(rng, 3), ds_rows(rng, 3)]), "bfloat16")
    b = nkv.CausalCache(nkv.CacheConfig(n_layers=2, n_kv_heads=1, head_dim=576, v_head_dim=0,
                                        dtype="bfloat16", capacity=16, max_seqs=2, device="cpu"),
                        shift=nkv.RopeShift(dim=64, offset=512))
    before = b.state_bytes()
    with pytest.raises(StateError, match="k_dtype"):
        b.load_state_bytes(a.state_bytes())
    with pytest.raises(StateError):
        b.import_seq(0, a.export_seq(0))
    assert b.state_bytes() == before
    # and the format survives snapshots bit-exactly
    c = ds_cache("cpu")
    c.import_seq(1, nkv.SeqSnapshot.from_bytes(a.export_seq(0).to_bytes()))
    assert same(seq_rows(c, 1)[1], seq_rows(a, 0)[1])


def test_head_shard_replicates_the_latent_and_says_so():
    for rank in range(4):
        cfg = mla_config(head_shard=(rank, 4))
        assert cfg.head_range == (0, 1) and cfg.local_kv_heads == 1
        assert cfg.head_replicas == 4            # every rank keeps the whole latent
    assert mla_config().head_replicas == 1
    assert nkv.CacheConfig(1, 8, 64, head_shard=(1, 4)).head_replicas == 1   # heads split
    # a replica's snapshot carries the whole latent and loads into any other replica
    rng = np.random.default_rng(11)
    a = nkv.CausalCache(mla_config(head_shard=(0, 2)), shift=mla_shift())
    b = nkv.CausalCache(mla_config(head_shard=(1, 2)), shift=mla_shift())
    rows = fill(a, 0, 4, rng)
    snap = a.export_seq(0)
    assert snap.head_range == (0, 1)
    assert b.import_seq(0, snap) == 4
    assert same(seq_rows(b, 0)[1], rows)


# ------------------------------------------------------------------ attend: absorbed MLA
def absorbed_reference(q, lat, visible, scale, v_dim):
    """float64 softmax(q . lat * scale) @ lat[:, :v_dim] per head over the visible rows."""
    s = np.einsum("bhd,nd->bhn", q.astype(np.float64), lat.astype(np.float64)) * scale
    s = np.where(visible[:, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhn,nd->bhd", p, lat[:, :v_dim].astype(np.float64))


@pytest.mark.parametrize("backend,dtype,k_dtype", [
    ("torch", "float32", None), ("torch", "bfloat16", None), ("torch", "float16", None),
    ("dense", "float32", None), ("dense", "float32", "q8_0")])
def test_attend_absorbed_mla_equals_a_reference(device, backend, dtype, k_dtype):
    torch = pytest.importorskip("torch")
    from numbakv.attention import attend
    from helpers import f32_to_bf16_bits
    rng = np.random.default_rng(12)
    cache = nkv.CausalCache(mla_config(device, dtype=dtype, k_dtype=k_dtype), shift=mla_shift())

    def rows(n):
        x = rng.standard_normal((n, 1, D)).astype(np.float32)
        return f32_to_bf16_bits(x) if dtype == "bfloat16" else x.astype(dtype)
    # two sequences, then a mixed pass: a decode of seq 0 and a 3-token prefill of seq 1
    for seq, n in ((0, 7), (1, 2)):
        cache.start_forward(np.arange(n, dtype=np.int32), np.full(n, seq, np.int32))
        for layer in range(2):
            cache.set_layer(layer)
            cache.put(rows(n), None)
    pos = np.array([7, 2, 3, 4], np.int32)
    sq = np.array([0, 1, 1, 1], np.int32)
    cache.start_forward(pos, sq)
    cache.set_layer(1)
    cache.put(rows(4), None)
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    q = torch.from_numpy(rng.standard_normal((4, 8, D)).astype(np.float32)).to(tdt)
    out = attend(q, cache, backend=backend)
    assert tuple(out.shape) == (4, 8, RANK)
    key, _, mask = cache.get()
    lat = torch.from_dlpack(key)[:, 0].float().numpy()
    want = absorbed_reference(q.float().numpy(), lat, np.asarray(host(mask))[:4] == 0,
                              1 / np.sqrt(D), RANK)
    tol = 2e-4 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(out.float().numpy(), want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="v_dim"):
        attend(q, cache, backend=backend, v_dim=D + 1)
    narrow = attend(q, cache, backend=backend, v_dim=16)
    np.testing.assert_allclose(narrow.float().numpy(), want[..., :16], rtol=tol, atol=tol)


# ------------------------------------------------------------ FlashMLA pages, FlashInfer views
def test_page_table_in_pages_of_64_and_split_views(device):
    pytest.importorskip("torch")
    from helpers import shares_memory
    rng = np.random.default_rng(13)
    cfg = mla_config(device, capacity=128, max_seqs=2, cache_padding=64, max_batch=128)
    cache = nkv.CausalCache(cfg, shift=mla_shift())
    # one prefill pass of two sequences: 64 tokens of sequence 0 (cells 0..63, page 0), then 40
    # of sequence 1 (cells 64..103, page 1): each sequence one run from a page boundary
    pos = np.concatenate([np.arange(64), np.arange(40)]).astype(np.int32)
    sq = np.concatenate([np.zeros(64), np.ones(40)]).astype(np.int32)
    cache.start_forward(pos, sq)
    for layer in range(2):
        cache.set_layer(layer)
        cache.put(rng.standard_normal((104, 1, D)).astype(np.float16), None)
    pt = cache.page_table(page_size=64)
    assert host(pt.seq_ids).tolist() == [0, 1]
    assert host(pt.cache_seqlens).tolist() == [64, 40]
    assert host(pt.block_table).tolist() == [[0], [1]]
    assert host(pt.kv_indptr).tolist() == [0, 1, 2]
    assert host(pt.kv_indices).tolist() == [0, 1]
    assert host(pt.kv_last_page_len).tolist() == [64, 40]
    # sequence 1 decodes alone: its token lands on cell 104, the run goes on (page 1, slot 40)
    cache.start_forward(np.array([40], np.int32), np.array([1], np.int32))
    cache.set_layer(1)
    cache.put(rng.standard_normal((1, 1, D)).astype(np.float16), None)
    pt = cache.page_table(page_size=64)
    assert host(pt.cache_seqlens).tolist() == [41]
    assert host(pt.block_table).tolist() == [[1]]
    assert host(pt.kv_last_page_len).tolist() == [41]
    # FlashInfer's split ckv/kpe: strided views of the one latent row, pages of 64
    ckv, kpe = cache.mla_views(1, page_size=64)
    key, _ = cache.layer_pool(1)
    assert tuple(ckv.shape) == (cache.n_cells // 64, 64, RANK)
    assert tuple(kpe.shape) == (cache.n_cells // 64, 64, ROPE)
    assert shares_memory(ckv, key) and shares_memory(kpe, key)
    k = np.asarray(host(key))
    assert same(np.asarray(host(ckv))[1, 40], k[104, 0, :RANK])
    assert same(np.asarray(host(kpe))[1, 40], k[104, 0, RANK:])
    flat_ckv, flat_kpe = cache.mla_views(1)
    assert tuple(flat_ckv.shape) == (cache.n_cells, RANK)
    assert tuple(flat_kpe.shape) == (cache.n_cells, ROPE)
    # a layout pages cannot describe is refused, naming the sequence (both decode: sequence 0's
    # next token cannot follow its run, which sequence 1 holds)
    cache.start_forward(np.array([64, 41], np.int32), np.array([0, 1], np.int32))
    with pytest.raises(NotSupportedError, match="sequence 0"):
        cache.page_table(page_size=64)
    with pytest.raises(ValueError, match="page_size"):
        cache.page_table(page_size=0)
    with pytest.raises(ValueError, match="divide"):
        cache.page_table(page_size=48)
    with pytest.raises(ValueError, match="MLA latent"):
        nkv.CausalCache(mla_config(v_head_dim=None)).mla_views()


@pytest.mark.parametrize("k_dtype", [None, "fp8_ds_mla"])
def test_disk_tier_keeps_latent_rows_bit_exact(tmp_path, k_dtype):
    """A PrefixStore's disk tier: a later store of the same model loads the latent rows (float
    or FlashMLA's fp8 row) bit-exactly, and a store of the other layout does not match them."""
    rng = np.random.default_rng(14)
    kw = dict(n_layers=2, n_kv_heads=1, head_dim=576, v_head_dim=0, dtype="bfloat16",
              capacity=32, max_seqs=2, device="cpu")
    shift = nkv.RopeShift(dim=64, offset=512)
    rows = np.stack([ds_rows(rng, 8), ds_rows(rng, 8)])
    toks = list(range(300, 308))
    a = nkv.CausalCache(nkv.CacheConfig(**kw, k_dtype=k_dtype), shift=shift)
    put_rows(a, rows, "bfloat16")
    want = seq_rows(a, 0)[1]
    with nkv.PrefixStore(a, block_tokens=4, disk_dir=str(tmp_path), disk_bytes=1 << 22,
                         model_id="mla-toy") as first:
        assert first.save(0, toks) == 8
        first.flush()
    b = nkv.CausalCache(nkv.CacheConfig(**kw, k_dtype=k_dtype), shift=shift)
    with nkv.PrefixStore(b, block_tokens=4, disk_dir=str(tmp_path), disk_bytes=1 << 22,
                         model_id="mla-toy") as second:
        assert second.load(1, toks + [1]) == 8
    assert same(seq_rows(b, 1)[1], want)
    other = None if k_dtype else "fp8_ds_mla"
    c = nkv.CausalCache(nkv.CacheConfig(**kw, k_dtype=other), shift=shift)
    with nkv.PrefixStore(c, block_tokens=4, disk_dir=str(tmp_path), disk_bytes=1 << 22,
                         model_id="mla-toy") as third:
        assert third.match(toks + [1]) == 0
