"""numbakv.kernels.decode: the batched paged attention kernel (the real @cuda.jit kernel, in the
simulator or on a GPU) against the CPU attend and an independent numpy reference, on random
multi-sequence passes (GQA, windows, chunks, set_causal, soft cap, split-K, every dtype)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from numbakv import attention  # noqa: E402
from numbakv.kernels import decode  # noqa: E402
from conftest import KERNEL_DEVICE  # noqa: E402
from scenario_pages import make_cache, random_forwards  # noqa: E402
from test_attention import _independent_reference  # noqa: E402

pytestmark = pytest.mark.torch

TOL = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}

CONFIGS = {
    "f32": dict(),
    "f32-window": dict(swa_window=3),
    # V stored [n_kv_heads, v_head_dim, n_cells], read through the transposed view's strides
    "f16-chunk-permuted-v": dict(dtype="float16", chunk=4, permuted_v=True),
    "bf16": dict(dtype="bfloat16"),
}


def _run(cache, q, scale, soft_cap, part_len=None):
    """The kernel on ``cache``'s pass through attention's wiring (float32 torch result)."""
    host = cache._host_pages()
    permuted = cache.config.permuted_v      # V [n_kv_heads, v_head_dim, n_cells]: read strided
    if part_len is None:
        return attention._gpu_attend(torch, q, host, cache.layer_pool(), scale, soft_cap,
                                     KERNEL_DEVICE, permuted=permuted).cpu()
    # a forced split: call the launcher itself with the same arguments
    attention._gpu_attend(torch, q, host, cache.layer_pool(), scale, soft_cap, KERNEL_DEVICE,
                          permuted=permuted)
    tok, causal, _, lens = host.plans["gpu-kernel"]
    pools = cache.layer_pool()
    bf16 = cache.config.dtype == "bfloat16"
    kp, vp = (p.bits if bf16 else p for p in pools)
    if permuted:
        vp = vp.transpose(2, 0, 1)
    qd = q.float().numpy() if KERNEL_DEVICE == "sim" else \
        __import__("cupy").from_dlpack(q.float().contiguous())
    out, lse = decode.paged_attention(KERNEL_DEVICE, qd, kp, vp, host.table, tok, causal,
                                      int(host.rule.window), int(host.rule.chunk), scale,
                                      soft_cap, lens, bf16=bf16, part_len=part_len)
    return torch.from_dlpack(out).cpu() if KERNEL_DEVICE == "cuda" else torch.from_numpy(out)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_kernel_equals_cpu_attend(name):
    kw = CONFIGS[name]
    dtype = kw.get("dtype", "float32")
    rng = np.random.default_rng(11)
    torch.manual_seed(11)
    cache = make_cache(KERNEL_DEVICE, capacity=40, n_kv_heads=2, head_dim=16, **kw)
    checked = 0
    for pos, _ in random_forwards(cache, rng, 6, torch=torch):
        cache.set_layer(int(rng.integers(cache.config.n_layers)))
        q = torch.randn(len(pos), 4, 16)             # 4 query heads over 2 KV heads (GQA 2)
        if KERNEL_DEVICE == "cuda":
            q = q.cuda()
        soft_cap = 2.0 if checked % 3 == 1 else None
        scale = 0.3 if checked % 2 else 1 / math.sqrt(16)
        ref = _independent_reference(q.float(), cache, scale, soft_cap)
        cpu = attention.attend(q, cache, scale=scale, soft_cap=soft_cap, backend="torch")
        for part_len in (None, 3):                   # one part, and split-K with merge
            got = _run(cache, q, scale, soft_cap, part_len).numpy()
            np.testing.assert_allclose(got, ref, atol=TOL[dtype], rtol=TOL[dtype])
            np.testing.assert_allclose(got, cpu.float().cpu().numpy(), atol=TOL[dtype],
                                       rtol=TOL[dtype])
        checked += 1
    assert checked >= 3


def test_lse_with_and_without_split():
    """The LSE is log sum exp(scale q.k) over the visible cells, with one part and with a split
    whose later parts are empty for the early tokens (their -inf maxima must drop out)."""
    cache = make_cache(KERNEL_DEVICE, capacity=40, n_kv_heads=2, head_dim=16)
    rng = np.random.default_rng(5)
    cache.start_forward(list(range(11)) + list(range(5)), [0] * 11 + [1] * 5)
    for layer in range(2):
        cache.set_layer(layer)
        k = rng.standard_normal((16, 2, 16)).astype(np.float32)
        v = rng.standard_normal((16, 2, 16)).astype(np.float32)
        cache.put(k, v)
    q = torch.randn(16, 4, 16)
    host = cache._host_pages()
    attention._gpu_attend(torch, q, host, cache.layer_pool(), 0.25, None, KERNEL_DEVICE)
    tok, causal, _, lens = host.plans["gpu-kernel"]
    kp, vp = cache.layer_pool()
    for part_len in (None, 4):
        out, lse = decode.paged_attention(KERNEL_DEVICE, q.numpy(), kp, vp, host.table, tok,
                                          causal, -1, 0, 0.25, None, lens, part_len=part_len)
        # reference LSE from the independent scores
        kk = k.astype(np.float64)
        qq = q.numpy().astype(np.float64)
        for t in range(16):
            rows = list(range(0, t + 1)) if t < 11 else list(range(11, t + 1))
            sc = np.einsum("hd,nhd->hn", qq[t], np.repeat(kk[rows], 2, axis=1)) * 0.25
            ref = np.log(np.exp(sc).sum(-1))
            np.testing.assert_allclose(lse[t], ref, atol=1e-5, rtol=1e-5)


def test_plan_splits_long_lists_and_fits_limits():
    pl, n = decode.plan_part_len(np.array([5000, 10]), 2, "sim")
    assert pl >= decode.MIN_PART and pl % decode.TILE == 0 and n == -(-5000 // pl)
    assert decode.plan_part_len(np.array([5000]), 10_000, "sim") == (5024, 1)
    assert decode.plan_part_len(np.array([7]), 1, "sim", part_len=3) == (3, 3)
    assert decode.fits(32, 8, 128, 128, 8)
    assert not decode.fits(64, 1, 128, 128, 8)          # group 64 > MAX_GROUP
    assert not decode.fits(16, 1, 576, 512, 8)          # MLA latent rows: too wide per block
    assert decode.token_sequences(np.array([0, 2, 3]), np.array([2, 0, 1]), 3).tolist() == \
        [0, 1, 0]


def test_flashinfer_probe_is_memoised(monkeypatch):
    import builtins
    calls = []
    real = builtins.__import__

    def spy(name, *a, **k):
        if name == "flashinfer":
            calls.append(name)
        return real(name, *a, **k)
    monkeypatch.setattr(attention, "_FLASHINFER", None)
    monkeypatch.setattr(builtins, "__import__", spy)
    first = attention.flashinfer_available()
    for _ in range(5):
        assert attention.flashinfer_available() is first
    assert len(calls) == 1


def test_flashinfer_probe_with_an_installed_module_runs_once(monkeypatch):
    """With flashinfer importable (a stand-in module in sys.modules), the probe answers True
    and imports it once per process: later calls (and a module that went away) get the
    remembered answer."""
    import builtins
    import sys
    import types
    calls = []
    real = builtins.__import__

    def spy(name, *a, **k):
        if name == "flashinfer":
            calls.append(name)
        return real(name, *a, **k)
    monkeypatch.setattr(attention, "_FLASHINFER", None)
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setattr(builtins, "__import__", spy)
    assert attention.flashinfer_available() is True
    monkeypatch.delitem(sys.modules, "flashinfer")
    for _ in range(5):
        assert attention.flashinfer_available() is True
    assert calls == ["flashinfer"]


def _slow_stream_setup():
    import cupy
    import numbakv as nkv
    cfg = nkv.CacheConfig(1, 2, 64, dtype="float32", capacity=1024, max_seqs=1, max_batch=512,
                          device="cuda")
    cache = nkv.CausalCache(cfg)
    cache.use_stream(cupy.cuda.Stream(non_blocking=True))
    return cache


@pytest.mark.gpu
def test_put_from_a_slow_producer_stream_is_ordered():
    """The producer's stream spins (~tens of ms) before it writes K/V; put on the cache's own
    stream must still store the written values (DLPack import on the cache's stream)."""
    import cupy
    cache = _slow_stream_setup()
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        kv = torch.zeros(512, 2, 64, device="cuda")
        torch.cuda._sleep(100_000_000)
        kv.fill_(3.0)
        cache.start_forward(np.arange(512, dtype=np.int32), np.zeros(512, np.int32))
        cache.put(kv, kv)
    cache.storage.stream.synchronize()
    key, value, _ = cache.get()
    cache.storage.stream.synchronize()
    assert bool((cupy.asarray(key)[:512] == 3.0).all())


@pytest.mark.gpu
def test_attend_waits_for_the_producer_and_the_cache_stream():
    """q is written after a spin on the producer's stream and K/V after one on the cache's
    stream; attend (the paged kernel) must see both and its result must be ready on the
    producer's stream."""
    cache = _slow_stream_setup()
    rng = np.random.default_rng(0)
    k = torch.from_numpy(rng.standard_normal((512, 2, 64)).astype(np.float32)).cuda()
    cache.start_forward(np.arange(512, dtype=np.int32), np.zeros(512, np.int32))
    cache.put(k, k)
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        q = torch.zeros(512, 4, 64, device="cuda")
        torch.cuda._sleep(100_000_000)
        q.copy_(k.repeat_interleave(2, dim=1))
        out = attention.attend(q, cache)
        got = out.clone()           # on the producer's stream, after attend's kernel
    torch.cuda.synchronize()
    want = _independent_reference(q.float(), cache, 1 / math.sqrt(64), None)
    np.testing.assert_allclose(got.cpu().numpy(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("k_dtype", [None, "q4_0"])
def test_cuda_route_takes_permuted_v_to_the_batched_kernel(monkeypatch, k_dtype):
    """attend's CUDA dispatch (FlashInfer absent): a cache with V stored permuted goes to the
    batched paged kernel (it reads V through the transposed view's strides), a float V beside
    quantized keys too (their formats read in the kernel), not to torch or get()."""
    import numbakv as nkv
    monkeypatch.setattr(attention, "flashinfer_available", lambda: False)
    cfg = nkv.CacheConfig(2, 2, 32, dtype="float16", capacity=8, permuted_v=True,
                          device="cpu", **({"k_dtype": k_dtype} if k_dtype else {}))
    cache = nkv.CausalCache(cfg)
    cache.start_forward([0], [0])
    route = attention._attend_route(cache._attention_cache, 4, 1, "auto", 0, True)
    assert route.permuted
    if k_dtype:
        assert route.formats is not None and route.formats[0]
    else:
        assert route.gpu_kernel and route.backend == "torch"


def test_kernel_serves_passes_of_few_queries_per_sequence():
    """The CUDA routing rule: the most queries of any sequence in the pass (memoised per pass)
    against attention._GPU_KERNEL_TOKENS."""
    cache = make_cache("cpu", capacity=40, n_kv_heads=2, head_dim=16)
    cache.start_forward([0, 1, 2, 3, 4, 0], [0, 0, 0, 0, 0, 1])
    host = cache._host_pages()
    assert attention._max_queries(host) == 5 and host.plans["max-queries"] == 5
    assert attention._GPU_KERNEL_TOKENS >= 1


# --------------------------------------------------------------------------------------------
# quantized K/V read in the kernel (dequantized per value with kernels.quant's element math),
# rotated ones rotated and turned back in the kernel

QUANT_CONFIGS = {
    "q8_0": dict(k_dtype="q8_0", v_dtype="q8_0", head_dim=32, kv_rotation="off"),
    "q4_0-window": dict(k_dtype="q4_0", v_dtype="q4_0", head_dim=32, kv_rotation="off",
                        swa_window=3),
    "q4_0-k-f16-permuted-v": dict(dtype="float16", k_dtype="q4_0", head_dim=32,
                                  kv_rotation="off", permuted_v=True),
    "f32-k-q8_0-v-chunk": dict(v_dtype="q8_0", head_dim=32, kv_rotation="off", chunk=4),
    "float8-bf16": dict(dtype="bfloat16", k_dtype="float8_e4m3", v_dtype="float8_e4m3",
                        head_dim=32),
    "q8_0-rotated": dict(k_dtype="q8_0", v_dtype="q8_0", head_dim=64),
    "q4_0-rotated-window": dict(dtype="float16", k_dtype="q4_0", v_dtype="q4_0", head_dim=64,
                                swa_window=4),
}


def _quant_cache(kw):
    import numbakv as nkv
    kw = dict(kw)
    window, chunk, dim = kw.pop("swa_window", None), kw.pop("chunk", None), kw.pop("head_dim")
    cfg = nkv.CacheConfig(2, 2, dim, capacity=40, max_seqs=4, max_batch=16,
                          device=KERNEL_DEVICE, **kw)
    return nkv.CausalCache(cfg, shift=nkv.RopeShift(dim=dim), swa_window=window,
                           chunk_size=chunk)


@pytest.mark.parametrize("name", list(QUANT_CONFIGS))
def test_paged_kernel_reads_quantized_pools_like_the_cpu_attend(name):
    """The kernel over q8_0 / q4_0 / float8 pools (one side float, or both quantized; rotated
    K/V with the query rotation and the output's turn back in the kernel; GQA; windows and
    chunks) equals the CPU attend over the same stored blocks, one part and split-K."""
    cache = _quant_cache(QUANT_CONFIGS[name])
    cfg = cache.config
    if "rotated" in name:
        assert cfg.k_rotation and cfg.v_rotation          # the test covers what it says
    rng = np.random.default_rng(17)
    torch.manual_seed(17)
    dtype = cfg.dtype
    checked = 0
    for pos, _ in random_forwards(cache, rng, 3, torch=torch):
        cache.set_layer(int(rng.integers(cfg.n_layers)))
        q = torch.randn(len(pos), 4, cfg.head_dim)          # GQA 2
        if KERNEL_DEVICE == "cuda":
            q = q.cuda()
        scale = 1 / math.sqrt(cfg.head_dim)
        soft_cap = 2.0 if checked % 2 else None
        cpu = attention.attend(q, cache, scale=scale, soft_cap=soft_cap).float().cpu().numpy()
        dense = attention.attend(q, cache, scale=scale, soft_cap=soft_cap,
                                 backend="dense").float().cpu().numpy()
        formats = attention._pool_formats(cache)
        assert formats is not None
        host = cache._host_pages()
        got = attention._gpu_quantized(torch, q, host, cache, scale, soft_cap, formats,
                                       KERNEL_DEVICE).cpu().numpy()
        tol = 2e-5 if dtype == "float32" else 3e-3 if dtype == "float16" else 2e-2
        np.testing.assert_allclose(got, cpu, atol=tol, rtol=tol)
        np.testing.assert_allclose(got, dense, atol=max(tol, 1e-4), rtol=max(tol, 1e-4))
        # split-K: the parts' rotated-back accumulators merged by their LSE
        st = cache.storage
        slot = cache._storage_layers[cache._layer]
        tok, causal, _, lens = host.plans["gpu-kernel"]
        kf, vf, ks, vs, _ = formats
        qd = q.float().numpy() if KERNEL_DEVICE == "sim" else \
            __import__("cupy").from_dlpack(q.float().contiguous())
        vp = st.value_view(slot, 0, cache.n_cells)
        out, _ = decode.paged_attention(
            KERNEL_DEVICE, qd, st.key_view(slot, 0, cache.n_cells),
            vp.transpose(2, 0, 1) if cfg.permuted_v else vp, host.table, tok, causal,
            int(host.rule.window), int(host.rule.chunk), scale, soft_cap, lens,
            bf16=dtype == "bfloat16", part_len=3,
            kfmt=decode.QUANT_FORMATS[kf] if kf else None,
            vfmt=decode.QUANT_FORMATS[vf] if vf else None, kscale=ks, vscale=vs,
            k_rotation=cfg.k_rotation, v_rotation=cfg.v_rotation)
        split = torch.from_dlpack(out).cpu().numpy()
        np.testing.assert_allclose(split, cpu, atol=tol, rtol=tol)
        checked += 1
    assert checked >= 2
