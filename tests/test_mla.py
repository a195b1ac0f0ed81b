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
