"""numbakv.kernels.decode's MLA latent kernel (:func:`paged_latent_attention`: a block stages each
tile of latent rows in shared memory once for a tile of query heads) in the simulator (or on a
GPU) against the CPU attend's absorbed form, on a tiny latent (16 + 8 values; a rotated q8_0
latent of 128 + 64) with 6 heads in partial head tiles, several staged row tiles per part, and
a split-K."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numbakv as nkv  # noqa: E402
from numbakv import attention  # noqa: E402
from numbakv.kernels import decode  # noqa: E402
from conftest import KERNEL_DEVICE  # noqa: E402

pytestmark = pytest.mark.torch

RANK, ROPE = 16, 8
D = RANK + ROPE
H = 6
TOL = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 8 simulator threads (every strided loop of the kernel takes several turns)."""
    monkeypatch.setattr(decode, "block_size", lambda device: 8)


def _fill(cache, rng, dtype, d):
    def rows(n):
        x = rng.standard_normal((n, 1, d)).astype(np.float32)
        if dtype == "bfloat16":
            return torch.from_numpy(x).bfloat16()
        return x.astype(dtype)
    for seq, n in ((0, 7), (1, 3)):
        cache.start_forward(np.arange(n, dtype=np.int32), np.full(n, seq, np.int32))
        for layer in range(2):
            cache.set_layer(layer)
            cache.put(rows(n), None)
    # a mixed pass: one decode token of seq 0, a 2-token prefill of seq 1
    cache.start_forward(np.array([7, 3, 4], np.int32), np.array([0, 1, 1], np.int32))
    cache.set_layer(1)
    cache.put(rows(3), None)


def _kernel(cache, q, scale, soft_cap, v_dim, **force):
    """The latent kernel over the cache's pass (pools as attend's CUDA route reads them)."""
    host = cache._host_pages()
    tok_dev, causal_dev, lens = attention._gpu_pass_plan(host, KERNEL_DEVICE)
    kp, kw = attention._latent_pool(cache._attention_cache)
    qd = np.ascontiguousarray(q.float().numpy())
    out, lse = decode.paged_latent_attention(
        KERNEL_DEVICE, qd, kp, host.table, tok_dev, causal_dev, int(host.rule.window),
        int(host.rule.chunk), scale, soft_cap, lens, v_dim, **kw, **force)
    return out, lse


@pytest.mark.skipif(KERNEL_DEVICE != "sim", reason="simulator shapes")
@pytest.mark.parametrize("dtype,k_dtype", [("float32", None), ("bfloat16", None),
                                           ("float16", None), ("float32", "q8_0")])
def test_latent_kernel_equals_the_cpu_attend(dtype, k_dtype, small_blocks):
    rank, d = (128, 192) if k_dtype else (RANK, D)   # q8_0: rotated in blocks of 64
    cfg = nkv.CacheConfig(2, 1, d, v_head_dim=0, dtype=dtype, capacity=32, max_seqs=2,
                          max_batch=8, device=KERNEL_DEVICE,
                          **({} if k_dtype is None else dict(k_dtype=k_dtype)))
    cache = nkv.CausalCache(cfg, shift=nkv.RopeShift(dim=d - rank, offset=rank))
    rng = np.random.default_rng(3)
    _fill(cache, rng, dtype, d)
    q = torch.from_numpy(rng.standard_normal((3, H, d)).astype(np.float32))
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    q = q.to(tdt[dtype])
    backend = "dense" if k_dtype else "torch"
    tol = TOL[dtype]
    for scale, soft_cap, v_dim in ((0.3, None, rank), (0.5, 2.0, rank // 2)):
        if k_dtype and v_dim % 64:     # a rotated q8_0 latent's value: whole rotation blocks
            continue
        want = attention.attend(q, cache, scale=scale, soft_cap=soft_cap, backend=backend,
                                v_dim=v_dim).float().numpy()
        # one part and one head tile; tiles of 4 heads (one partial) over tiles of 2 staged
        # rows (the online softmax's rescale); 5-head tiles over 3 rows with a split-K of
        # 4-cell parts (the merge, and parts empty for the prefill's early token); 2-head
        # tiles whose scores are split over 2 lanes each
        for force in (dict(), dict(heads=4, rows=2), dict(heads=5, rows=3, part_len=4),
                      dict(heads=2, rows=2)):      # 2 lanes a score (8 threads, 4 pairs)
            out, lse = _kernel(cache, q, scale, soft_cap, v_dim, **force)
            np.testing.assert_allclose(out, want, atol=tol, rtol=tol)
            assert lse.shape == (3, H) and np.isfinite(lse).all()
        # attend's CUDA route (backend "auto"), its launcher run in the simulator
        src = cache._attention_cache
        host = cache._host_pages()
        assert attention._latent_kernel_takes(src, H, 3, v_dim, host)
        rows, kw = attention._latent_pool(src)
        got = attention._gpu_latent(torch, q, host, src, rows, kw, scale, soft_cap, v_dim,
                                    KERNEL_DEVICE)
        np.testing.assert_allclose(got.numpy(), want, atol=tol, rtol=tol)
    if k_dtype:     # a value of part of a rotation block: attend's other paths refuse it
        assert not attention._latent_kernel_takes(cache._attention_cache, H, 3, 32,
                                                  cache._host_pages())
    # the LSE against scores in float64 (float32 cache: exact rows)
    if dtype == "float32" and k_dtype is None:
        key, _, mask = cache.get()
        lat = np.asarray(key)[:, 0].astype(np.float64)
        qq = q.numpy().astype(np.float64)
        sc = np.einsum("thd,nd->thn", qq, lat) * 0.3
        vis = np.asarray(mask)[:3] == 0
        ref = np.log(np.where(vis[:, None, :], np.exp(sc), 0).sum(-1))
        _, lse = _kernel(cache, q, 0.3, None, RANK, heads=4, rows=3, part_len=4)
        np.testing.assert_allclose(lse, ref, atol=1e-5, rtol=1e-5)


def test_latent_tiling_and_fits():
    """DeepSeek's latent (576 values, 512 the value): 8 heads a block, 4 staged rows; the
    shared tiles bound the row and the value; one latent head only."""
    assert decode.latent_tiling(128, 576, 512) == (8, 4)
    assert decode.latent_tiling(3, 576, 512) == (3, 4)
    assert decode.latent_tiling(16, 24, 16) == (8, 32)
    assert decode.latent_fits(128, 1, 576, 512, 64)
    assert not decode.latent_fits(128, 2, 576, 512, 64)
    assert not decode.latent_fits(16, 1, 4700, 512, 1)         # not even one head's queries
    assert not decode.latent_fits(16, 1, 576, 577, 1)          # the value is within the row


@pytest.mark.skipif(KERNEL_DEVICE != "sim", reason="simulator shapes")
def test_latent_kernel_reads_fp8_ds_mla_rows(small_blocks):
    """FlashMLA's 656-byte rows (512 float8_e4m3 values in four tiles with float32 scales, 64
    bfloat16 rope values) dequantized as the kernel stages them: equal to the CPU attend, which
    decodes them through get(); tiles of values spanning several orders of magnitude (each tile
    its own power-of-two scale), a forced head tiling over 2 staged rows with a split-K, and
    attend's CUDA route."""
    cfg = nkv.CacheConfig(2, 1, 576, v_head_dim=0, dtype="bfloat16", k_dtype="fp8_ds_mla",
                          capacity=16, max_seqs=2, max_batch=8, device=KERNEL_DEVICE)
    cache = nkv.CausalCache(cfg, shift=nkv.RopeShift(dim=64, offset=512))
    rng = np.random.default_rng(5)
    tile_mag = np.repeat([0.01, 1.0, 30.0, 0.2, 2.0], [128, 128, 128, 128, 64])

    def rows(n):
        return torch.from_numpy((rng.standard_normal((n, 1, 576)) * tile_mag)
                                .astype(np.float32)).bfloat16()
    for seq, n in ((0, 5), (1, 2)):
        cache.start_forward(np.arange(n, dtype=np.int32), np.full(n, seq, np.int32))
        for layer in range(2):
            cache.set_layer(layer)
            cache.put(rows(n), None)
    cache.start_forward(np.array([5, 2], np.int32), np.array([0, 1], np.int32))
    cache.set_layer(1)
    cache.put(rows(2), None)
    src = cache._attention_cache
    kp, kw = attention._latent_pool(src)
    assert kw["kfmt"] == decode.FMT_DS_MLA and kp.shape[-1] == 656
    q = torch.from_numpy(rng.standard_normal((2, 3, 576)).astype(np.float32) * 0.05)
    want = attention.attend(q, cache, scale=0.5, soft_cap=4.0, backend="dense").numpy()
    tol = 2e-5 * np.abs(want).max()
    for force in (dict(), dict(heads=2, rows=2, part_len=3)):
        out, lse = _kernel(cache, q, 0.5, 4.0, 512, **force)
        np.testing.assert_allclose(out, want, atol=tol, rtol=1e-5)
        assert np.isfinite(lse).all()
    host = cache._host_pages()
    assert attention._latent_kernel_takes(src, 3, 2, 512, host)
    got = attention._gpu_latent(torch, q, host, src, kp, kw, 0.5, 4.0, 512, KERNEL_DEVICE)
    np.testing.assert_allclose(got.numpy(), want, atol=tol, rtol=1e-5)
