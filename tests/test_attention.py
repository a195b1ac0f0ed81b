"""numbakv.attention.attend: equal to dense attention from get()'s mask in random multi-sequence
scenarios, for every backend that can run here; argument errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numbakv as nkv  # noqa: E402
from numbakv import attention  # noqa: E402
from numbakv.attention import attend  # noqa: E402
from helpers import host  # noqa: E402
from scenario_pages import make_cache, random_forwards  # noqa: E402

pytestmark = pytest.mark.torch

TOL = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}
Q_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _independent_reference(q, cache, scale, soft_cap):
    """Attention from get()'s views and mask in float64 numpy (no numbakv.attention code)."""
    key, value, mask = cache.get()
    k = torch.from_dlpack(key).double().cpu().numpy()
    v = torch.from_dlpack(value).double().cpu().numpy()
    if getattr(cache._attention_cache.config, "permuted_v", False):
        v = np.moveaxis(v, -1, 0)                          # [n, Hkv, Dv]
    m = host(mask)[:q.shape[0]]
    qq = q.double().cpu().numpy()
    g = qq.shape[1] // k.shape[1]
    s = np.einsum("bhd,nhd->bhn", qq, np.repeat(k, g, axis=1)) * scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    s = np.where(m[:, None, :] == 0, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhn,nhd->bhd", p, np.repeat(v, g, axis=1))


CONFIGS = {
    "f32": dict(),
    "f32-window-padded": dict(swa_window=3, cache_padding=8, mask_batch_padding=4),
    "f32-chunk-permuted": dict(chunk=4, permuted_v=True),
    "f16-permuted": dict(dtype="float16", permuted_v=True),
    "bf16-window": dict(dtype="bfloat16", swa_window=4),
}


@pytest.fixture(params=["as-is", "mixed", "per-seq", "split-flash", "split-matmul"])
def split_mode(request, monkeypatch):
    """"as-is": these tiny sequences go through numbakv's CPU kernel, read from the pool;
    "mixed": only one-token sequences do, the others take the torch paths in the same call;
    "per-seq": one attention call per sequence (a view of its run of the pool or a gather),
    the path longer prefills take; "split-*": every sequence's page list is cut into pool
    views and a gathered rest, merged by log-sum-exp (the path long, scattered prefills take),
    even at these tiny sizes; each part through PyTorch's CPU flash kernel or, as small parts
    are, through matmuls."""
    if request.param == "mixed":
        monkeypatch.setattr(attention, "_KERNEL_TOKENS", 1)
        monkeypatch.setattr(attention, "_KERNEL_TOKENS_16BIT", 1)
        monkeypatch.setattr(attention, "_SHORT_TOKENS", 1)
    elif request.param != "as-is":
        monkeypatch.setattr(attention, "_KERNEL_TOKENS", -1)
    if request.param == "split-flash":
        monkeypatch.setattr(attention, "_SMALL_PART", 0)
    if request.param.startswith("split"):
        monkeypatch.setattr(attention, "_SPAN_SLACK", -1.0)
        monkeypatch.setattr(attention, "_SPAN_MIN_SLACK", -1)
        monkeypatch.setattr(attention, "_MIN_RUN", 3)
        monkeypatch.setattr(attention, "_MAX_GAP", 1)
    return request.param


@pytest.mark.parametrize("name", list(CONFIGS))
def test_attend_equals_dense_attention(device, name, split_mode):
    kw = CONFIGS[name]
    dtype = kw.get("dtype", "float32")
    rng = np.random.default_rng(7)
    torch.manual_seed(7)
    cache = make_cache(device, **kw)
    steps = 16 if device == "cpu" else 5
    checked = 0
    for pos, sq in random_forwards(cache, rng, steps, torch=torch):
        layer = int(rng.integers(cache.config.n_layers))
        cache.set_layer(layer)
        # q on the cache's device (attend takes q where the cache is)
        q = torch.randn(len(pos), 4, cache.config.head_dim).to(Q_DTYPE[dtype]).to(
            "cuda" if device == "cuda" else "cpu")
        soft_cap = 2.0 if rng.random() < 0.3 else None
        scale = 0.3 if rng.random() < 0.3 else None
        ref = _independent_reference(q.float(), cache, scale or 1 / math.sqrt(8), soft_cap)
        dense = attend(q, cache, scale=scale, soft_cap=soft_cap, backend="dense")
        paged = attend(q, cache, scale=scale, soft_cap=soft_cap, backend="torch")
        auto = attend(q, cache, scale=scale, soft_cap=soft_cap)
        for out in (dense, paged, auto):
            assert out.shape == (len(pos), 4, 8) and out.dtype == q.dtype
        np.testing.assert_allclose(dense.float().cpu().numpy(), ref, atol=TOL[dtype],
                                   rtol=TOL[dtype])
        np.testing.assert_allclose(paged.float().cpu().numpy(), ref, atol=TOL[dtype],
                                   rtol=TOL[dtype])
        if device == "cuda":    # FlashInfer, else numbakv's batched paged kernel
            np.testing.assert_allclose(auto.float().cpu().numpy(), ref, atol=TOL[dtype],
                                       rtol=TOL[dtype])
        else:
            assert torch.equal(auto, paged)    # off CUDA auto is the torch backend
        checked += 1
    assert checked >= 3


def test_gather_path_for_a_spread_sequence():
    # sequence 0's cells are spread over the pool (decode steps interleaved with another
    # sequence's prefills), so the torch backend gathers them instead of reading one run
    cache = make_cache("cpu", capacity=200, max_seqs=2)
    rng = np.random.default_rng(3)
    for step in range(6):
        cache.start_forward([step] + list(range(15 * step, 15 * step + 15)), [0] + [1] * 15)
        for layer in range(2):
            cache.set_layer(layer)
            cache.put(rng.standard_normal((16, 2, 8)).astype(np.float32),
                      rng.standard_normal((16, 2, 8)).astype(np.float32))
    pages = cache._host_pages()
    span = pages.cell_hi[0] - pages.cell_lo[0]
    assert span > 2 * (pages.kv_indptr[1] - pages.kv_indptr[0]) + 64   # the gather path
    q = torch.randn(16, 4, 8)
    ref = _independent_reference(q, cache, 1 / math.sqrt(8), None)
    np.testing.assert_allclose(attend(q, cache, backend="torch").numpy(), ref, atol=2e-5)


def test_attend_on_wrapper_and_encoder_caches():
    wrap = nkv.WrapperCache([make_cache("cpu", swa_window=2), make_cache("cpu")])
    wrap.start_forward(list(range(6)), [0] * 6)
    rng = np.random.default_rng(0)
    for t in (0, 1):
        wrap.set_layer_type(t)
        for layer in range(2):
            wrap.set_layer(layer)
            wrap.put(rng.standard_normal((6, 2, 8)).astype(np.float32),
                     rng.standard_normal((6, 2, 8)).astype(np.float32))
    q = torch.randn(6, 4, 8)
    for t in (0, 1):
        wrap.set_layer_type(t)
        ref = _independent_reference(q, wrap, 1 / math.sqrt(8), None)
        np.testing.assert_allclose(attend(q, wrap).numpy(), ref, atol=2e-5)

    cfg = nkv.CacheConfig(1, 2, 8, dtype="float32", capacity=5, max_seqs=2, device="cpu")
    enc = nkv.EncoderCache(cfg)
    enc.start_forward([0, 0, 1], [0, 1, 0], encoder_pos=0)
    enc.put(rng.standard_normal((4, 2, 8)).astype(np.float32),
            rng.standard_normal((4, 2, 8)).astype(np.float32))
    q = torch.randn(3, 4, 8)
    ref = _independent_reference(q, enc, 1 / math.sqrt(8), None)
    np.testing.assert_allclose(attend(q, enc).numpy(), ref, atol=2e-5)


def test_attend_errors_name_the_argument():
    cache = make_cache("cpu")
    with pytest.raises(ValueError, match="start_forward"):
        attend(torch.randn(1, 4, 8), cache)
    cache.start_forward([0, 1], [0, 0])
    with pytest.raises(ValueError, match=r"q must have shape \[batch=2"):
        attend(torch.randn(3, 4, 8), cache)
    with pytest.raises(ValueError, match="head_dim=8"):
        attend(torch.randn(2, 4, 7), cache)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        attend(torch.randn(2, 3, 8), cache)
    with pytest.raises(ValueError, match="backend"):
        attend(torch.randn(2, 4, 8), cache, backend="triton")
    with pytest.raises(ValueError, match="flashinfer"):
        attend(torch.randn(2, 4, 8), cache, backend="flashinfer")
    with pytest.raises(ValueError, match="soft_cap"):
        attend(torch.randn(2, 4, 8), cache, soft_cap=0.0)
    with pytest.raises(ValueError, match="q must be a torch.Tensor"):
        attend(np.zeros((2, 4, 8), np.float32), cache)


@pytest.mark.parametrize("pack", [True, False])
def test_attend_with_underflowing_weights_and_grad_inputs(pack, monkeypatch):
    # large scores: most softmax weights underflow below float32's normal range (the weights
    # that used to come out as denormals); q requires grad and is used without torch.no_grad()
    if not pack:
        monkeypatch.setattr(attention, "_KERNEL_TOKENS", -1)
        monkeypatch.setattr(attention, "_SPAN_SLACK", -1.0)
        monkeypatch.setattr(attention, "_SPAN_MIN_SLACK", -1)
    cache = make_cache("cpu", capacity=64, max_seqs=3)
    rng = np.random.default_rng(5)
    for step in range(4):                    # interleaved: each sequence's cells are scattered
        pos = [4 * step + i for i in range(4)] * 3
        seqs = [0] * 4 + [1] * 4 + [2] * 4
        cache.start_forward(pos, seqs)
        for layer in range(2):
            cache.set_layer(layer)
            kv = (30 * rng.standard_normal((12, 2, 8))).astype(np.float32)
            cache.put(kv, kv.copy())
    q = (30 * torch.randn(12, 4, 8)).requires_grad_(True)
    ref = _independent_reference(q.detach(), cache, 1 / math.sqrt(8), None)
    out = attend(q, cache, backend="torch")
    assert torch.isfinite(out).all()
    np.testing.assert_allclose(out.detach().numpy(), ref, atol=1e-4, rtol=1e-4)


def test_half_and_bfloat16_conversions_are_exact():
    # every float16 bit pattern through the kernel's conversion: the CPU's own instruction
    # where numba compiles for one that has it, and the portable integer form (forced here, on a
    # fresh non-cached function); bfloat16 patterns likewise
    import numba

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want16 = bits.view(np.float16).astype(np.float32)
    want_bf = (bits.astype(np.uint32) << 16).view(np.float32)

    def check(fn, want):
        got = np.empty(bits.shape, np.float32)
        fn(bits, got)
        nan = np.isnan(want)
        assert (np.isnan(got) == nan).all()
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))

    def half_fn():
        @numba.njit
        def conv(a, out):
            for i in range(a.shape[0]):
                out[i] = attention._half_bits_to_f32(a[i])
        return conv

    check(half_fn(), want16)
    import unittest.mock
    with unittest.mock.patch.object(attention, "_PORTABLE_HALF", True):
        check(half_fn(), want16)

    @numba.njit
    def conv_bf(a, out):
        for i in range(a.shape[0]):
            out[i] = attention._bf16_bits_to_f32(a[i])
    check(conv_bf, want_bf)


LONG = {
    "f32-window": dict(dtype="float32", swa_window=70),
    "f16-permuted": dict(dtype="float16", permuted_v=True),
    "bf16-chunk": dict(dtype="bfloat16", chunk=128),
    "f16-v-head-dim": dict(dtype="float16", v_head_dim=12),
}


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("name", list(LONG))
def test_kernel_over_long_lists(name, parallel, monkeypatch):
    # lists of 100-260 cells (many tiles), three sequences whose chunks interleave in the pool,
    # decodes mixed with a 12-token chunk; parallel: numba's threads, each long list cut into
    # parts merged by log-sum-exp (split-K), as one long decode on a multi-core CPU runs
    kw = dict(LONG[name])
    dtype = kw.pop("dtype")
    if parallel:
        import numba
        monkeypatch.setattr(attention, "_PARALLEL_WORK", 0)
        monkeypatch.setattr(attention, "_MIN_PART", 40)
        monkeypatch.setattr(numba, "get_num_threads", lambda: 2)
    cfg = nkv.CacheConfig(1, 2, 8, dtype=dtype, capacity=300, max_seqs=3, max_batch=64,
                          device="cpu", permuted_v=kw.pop("permuted_v", False),
                          v_head_dim=kw.pop("v_head_dim", None))
    dv = cfg.v_head_dim
    cache = nkv.CausalCache(cfg, swa_window=kw.get("swa_window"), chunk_size=kw.get("chunk"))
    rng = np.random.default_rng(11)
    lens = [0, 0, 0]
    for rnd in range(5):
        for s in range(3):
            n = 20 + 12 * s
            cache.start_forward(np.arange(lens[s], lens[s] + n), np.full(n, s))
            cache.put(torch.randn(n, 2, 8).to(Q_DTYPE[dtype]),
                      torch.randn(n, 2, dv).to(Q_DTYPE[dtype]))
            lens[s] += n
    pos = [lens[0]] + list(range(lens[1], lens[1] + 12)) + [lens[2]]
    sq = [0] + [1] * 12 + [2]
    cache.start_forward(pos, sq)
    cache.put(torch.randn(14, 2, 8).to(Q_DTYPE[dtype]), torch.randn(14, 2, dv).to(Q_DTYPE[dtype]))
    plan_merges = None
    for soft_cap in (None, 3.0):
        q = (3 * torch.randn(14, 8, 8)).to(Q_DTYPE[dtype])
        ref = _independent_reference(q.float(), cache, 1 / math.sqrt(8), soft_cap)
        out = attend(q, cache, backend="torch", soft_cap=soft_cap)
        np.testing.assert_allclose(out.float().numpy(), ref, atol=TOL[dtype], rtol=TOL[dtype])
        plan = next(v for k, v in cache._host_pages().plans.items() if k[0] == "kernel")
        plan_merges = len(plan["merges"])
        assert plan["parallel"] == parallel and not plan["rest"]
    assert (plan_merges > 0) == parallel


# the decode form's vector code (head sizes 64 and 128): query heads in pairs and an odd one,
# tiles cut by 1-3 cells, lists whose cells interleave in the pool, a window, split parts
VECTOR = {
    "f32-64-gqa2": dict(dtype="float32", dim=64, heads=(2, 4)),
    "f16-128-gqa3-window": dict(dtype="float16", dim=128, heads=(2, 6), swa_window=90),
    "bf16-64-mha": dict(dtype="bfloat16", dim=64, heads=(2, 2)),
    "f16-64-v128-gqa5": dict(dtype="float16", dim=64, heads=(1, 5), v_head_dim=128),
}


@pytest.mark.parametrize("name,parallel", [(name, False) for name in VECTOR]
                         + [("f16-128-gqa3-window", True)])
def test_decode_vector_code_over_long_lists(name, parallel, monkeypatch):
    kw = dict(VECTOR[name])
    if parallel:
        import numba
        monkeypatch.setattr(attention, "_PARALLEL_WORK", 0)
        monkeypatch.setattr(attention, "_MIN_PART", 40)
        monkeypatch.setattr(numba, "get_num_threads", lambda: 2)
    dtype, dim, (hkv, n_heads) = kw["dtype"], kw["dim"], kw["heads"]
    cfg = nkv.CacheConfig(1, hkv, dim, dtype=dtype, capacity=400, max_seqs=3, max_batch=64,
                          device="cpu", v_head_dim=kw.get("v_head_dim"))
    dv = cfg.v_head_dim
    cache = nkv.CausalCache(cfg, swa_window=kw.get("swa_window"))
    lens = [0, 0, 0]
    # chunks that interleave in the pool; with the decode token, lists of 131, 198 and 65 cells
    # (tiles of 64 and the last one cut by 3, 2 and 1 cells)
    sizes = ([26] * 5, [39, 40, 39, 40, 39], [3, 0, 0, 0, 61])
    for rnd in range(5):
        for s in range(3):
            n = sizes[s][rnd]
            if n == 0:
                continue
            cache.start_forward(np.arange(lens[s], lens[s] + n), np.full(n, s))
            cache.put(torch.randn(n, hkv, dim).to(Q_DTYPE[dtype]),
                      torch.randn(n, hkv, dv).to(Q_DTYPE[dtype]))
            lens[s] += n
    cache.start_forward(lens, [0, 1, 2])      # a decode step of each sequence
    cache.put(torch.randn(3, hkv, dim).to(Q_DTYPE[dtype]),
              torch.randn(3, hkv, dv).to(Q_DTYPE[dtype]))
    for soft_cap in (None, 3.0):
        q = (3 * torch.randn(3, n_heads, dim)).to(Q_DTYPE[dtype])
        ref = _independent_reference(q.float(), cache, 1 / math.sqrt(dim), soft_cap)
        out = attend(q, cache, backend="torch", soft_cap=soft_cap)
        np.testing.assert_allclose(out.float().numpy(), ref, atol=TOL[dtype], rtol=TOL[dtype])
        plan = next(v for k, v in cache._host_pages().plans.items() if k[0] == "kernel")
        assert plan["parallel"] == parallel and not plan["rest"]
        assert (len(plan["merges"]) > 0) == parallel


@pytest.mark.parametrize("fmt", ["float16", "float16-portable", "bfloat16"])
def test_decode_vector_code_widens_every_16_bit_pattern_exactly(fmt, monkeypatch):
    # every bit pattern as a value row of 64 through the vector code's value pass, weight 1 one
    # cell at a time (so the sum is the widened value itself): the CPU's float16 conversion, the
    # portable integer form (a fresh non-cached function), bfloat16's shift
    import numba

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    if fmt == "bfloat16":
        want = (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        want = bits.view(np.float16).astype(np.float32)
    if fmt == "float16-portable":
        monkeypatch.setattr(attention, "_PORTABLE_HALF", True)

    @numba.njit
    def widen(pool, bf16, got):
        cells = np.arange(pool.shape[0]).astype(np.int32)
        s = np.ones((1, 1), np.float32)
        acc = np.empty((1, 64), np.float32)
        for c in range(pool.shape[0]):
            acc[:] = -0.0                     # x + -0.0 is x, even -0.0
            attention._value_tile_64x1(acc, 0, pool, cells, c, 1, 0, s, bf16)
            got[c] = acc[0]

    got = np.empty((1024, 64), np.float32)
    widen(bits.reshape(1024, 1, 64), fmt == "bfloat16", got)
    got = got.ravel()
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_kernel_in_a_forked_child_of_a_process_that_ran_it_threaded(monkeypatch):
    # numba's GNU OpenMP threading layer aborts a forked child that starts a parallel region
    # after its parent ran one: the child must fall back to the one-thread kernel
    import os

    monkeypatch.setattr(attention, "_PARALLEL_WORK", 0)
    cache = make_cache("cpu", capacity=64, max_seqs=2)
    rng = np.random.default_rng(2)
    for p0 in (0, 8):
        cache.start_forward(list(range(p0, p0 + 8)) * 2, [0] * 8 + [1] * 8)
        for layer in range(2):
            cache.set_layer(layer)
            cache.put(rng.standard_normal((16, 2, 8)).astype(np.float32),
                      rng.standard_normal((16, 2, 8)).astype(np.float32))
    cache.start_forward([16, 16], [0, 1])
    cache.put(rng.standard_normal((2, 2, 8)).astype(np.float32),
              rng.standard_normal((2, 2, 8)).astype(np.float32))
    q = torch.randn(2, 4, 8)
    want = attend(q, cache, backend="torch")
    assert next(v for k, v in cache._host_pages().plans.items() if k[0] == "kernel")["parallel"]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                     # the child: never returns into pytest
        code = 1
        try:
            cache._pages_cache = None                # plan again, run again
            got = attend(q, cache, backend="torch")
            code = 0 if torch.equal(got, want) else 2
        finally:
            os.write(write, bytes([code]))
            os._exit(code)
    os.close(write)
    status = os.read(read, 1)
    os.close(read)
    _, exit_status = os.waitpid(pid, 0)
    assert status == b"\x00" and os.waitstatus_to_exitcode(exit_status) == 0


def test_decode_kernel_exp_matches_libm():
    # the decode form's softmax weights come from a polynomial exp that LLVM vectorises: within
    # a few ulp of libm's over the whole range it is used on, (-87, 0], exactly 1 at 0
    import numba

    @numba.njit
    def exps(x, out):
        for i in range(x.shape[0]):
            out[i] = attention._exp_f32(x[i])

    x = np.concatenate([-np.geomspace(1e-7, 86.9, 200_000), [0.0, -1e-30, -0.5, -1.0]])
    x = x.astype(np.float32)
    got = np.empty_like(x)
    exps(x, got)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 4e-7
    assert got[-4] == 1.0


ROUTE_CASES = {
    # plain K/V: the trusted route runs the CPU kernel, as attend does
    "float32": (dict(), True),
    "bfloat16": (dict(dtype="bfloat16"), True),
    "permuted_v": (dict(permuted_v=True), True),
    # attend reads these another way (kernel over quantized blocks, rotation around it):
    # the trusted route must decline and leave them to attend
    "q8_0": (dict(k_dtype="q8_0", v_dtype="q8_0", head_dim=32), False),
    "rotated": (dict(k_dtype="q8_0", v_dtype="q8_0", head_dim=64, kv_rotation="on"), False),
}


@pytest.mark.parametrize("name", list(ROUTE_CASES))
def test_trusted_cpu_route_follows_attends_dispatch(name):
    """numbakv.hf's dispatcher plans a pass once (attention._cpu_pass_route) and then runs the
    CPU kernel per layer (_attend_cpu_routed): it takes that route exactly where attend's own
    dispatch decision (_attend_route, shared by both) picks the CPU kernel for every sequence,
    and its output equals attend's."""
    import torch
    kw, routed = ROUTE_CASES[name]
    kw = dict(kw)
    head_dim = kw.pop("head_dim", 8)
    cfg = nkv.CacheConfig(2, 2, head_dim, capacity=40, max_seqs=2, max_batch=16, device="cpu",
                          **{"dtype": "float32", **kw})
    cache = nkv.CausalCache(cfg)
    g = torch.Generator().manual_seed(0)
    tdt = getattr(torch, cfg.dtype)
    for positions, seqs in (([0, 1, 2, 0, 1], [0, 0, 0, 1, 1]), ([3, 2], [0, 1])):
        cache.start_forward(np.array(positions, np.int32), np.array(seqs, np.int32))
        n = len(positions)
        for layer in range(2):
            cache.set_layer(layer)
            cache.put(torch.randn(n, 2, head_dim, generator=g).to(tdt),
                      torch.randn(n, 2, head_dim, generator=g).to(tdt))
        route = attention._cpu_pass_route(cache, 4)
        decision = attention._attend_route(cache, 4, n, "auto", 0, False)
        assert (route is not None) == routed == decision.cpu_pool_kernel
        q = torch.randn(n, 4, head_dim, generator=g).to(tdt)
        for layer in range(2):
            cache.set_layer(layer)
            want = attend(q, cache, scale=0.3, soft_cap=None)
            if route is not None:
                pools = attention._routed_layer_pools(cache, layer, route)
                got = attention._attend_cpu_routed(q.float().numpy(), pools, route, 0.3, None)
                assert got.dtype == np.float32 and got.shape == tuple(want.shape)
                torch.testing.assert_close(torch.from_numpy(got).to(tdt), want, rtol=0, atol=0)
    # 3 query heads over 2 KV heads: attend refuses it, the route declines (attend then says why)
    assert attention._cpu_pass_route(cache, 3) is None


def _reference_plan(qo_indptr, kv_indptr, limit, n_heads, threads):
    """The kernel plan as numpy computed it before _plan_items (the reference)."""
    counts = np.diff(qo_indptr).astype(np.int64)
    lens = np.diff(kv_indptr).astype(np.int64)
    mine = (counts <= limit) | ((lens <= attention._SHORT_CELLS)
                                & (counts <= attention._SHORT_TOKENS))
    seqs = np.flatnonzero(mine)
    work = int((lens[mine] * counts[mine]).sum()) * n_heads
    parallel = work >= attention._PARALLEL_WORK
    parts = np.ones(len(seqs), np.int64)
    if parallel and 1 < threads and len(seqs) < 2 * threads:
        share = lens[seqs] * (2 * threads) / max(1, int(lens[seqs].sum()))
        parts = np.clip(np.minimum(np.ceil(share), lens[seqs] // attention._MIN_PART), 1,
                        None).astype(np.int64)
    items, merges, row = [], [], 0
    for b, n_p in zip(seqs.tolist(), parts.tolist()):
        c0, c1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        if n_p == 1:
            items.append((b, c0, c1, -1))
            continue
        merges.append((len(items), len(items) + n_p))
        edges = np.linspace(c0, c1, n_p + 1).astype(np.int64)
        for p in range(n_p):
            items.append((b, edges[p], edges[p + 1], row))
            row += int(counts[b]) * n_heads
    return (np.array(items, np.int64).reshape(-1, 4), np.array(merges, np.int64).reshape(-1, 2),
            row, mine, parallel)


def test_kernel_plan_items_equal_the_numpy_reference():
    """_plan_items (one compiled pass per forward pass) plans what the numpy version did:
    decode and prefill mixes, short and long lists, split parts for 2-8 threads."""
    rng = np.random.default_rng(5)
    for trial in range(60):
        nb = int(rng.integers(1, 12))
        counts = rng.choice([1, 1, 1, 2, 5, 40, 100], nb)
        lens = rng.choice([0, 3, 300, 600, 5_000, 70_000], nb)
        qo = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        kv = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        limit = int(rng.choice([4, 32, 1 << 62]))
        heads = int(rng.choice([1, 8, 32]))
        threads = int(rng.choice([1, 2, 3, 8]))
        got = attention._plan_items(qo, kv, limit, attention._SHORT_CELLS,
                                    attention._SHORT_TOKENS, attention._PARALLEL_WORK,
                                    attention._MIN_PART, heads, threads)
        want = _reference_plan(qo, kv, limit, heads, threads)
        np.testing.assert_array_equal(got[0], want[0], err_msg=str(trial))
        np.testing.assert_array_equal(got[1], want[1])
        assert got[2] == want[2] and bool(got[4]) == want[4]
        np.testing.assert_array_equal(got[3], want[3])
