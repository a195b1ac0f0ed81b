"""cache.capture_step / DecodeStep.replay (numbakv/step.py): a decode step whose kernels read
their slots from a fixed step descriptor, replayed with new tokens every time.

On cpu/sim the recorded launches run at each replay (the put kernel in the simulator reading the
descriptor); the ``cuda`` path -- one pinned descriptor copy, the inputs copied into fixed
buffers and one graph launch per replay -- runs against the stand-in CuPy (tests/fake_cupy.py),
whose captured graph replays the real kernels in the simulator. Real capture on a GPU:
``test_captured_graph_replays_on_a_gpu`` (marked gpu, run by ``.ci/gpu``)."""


import numpy as np
import pytest

import numbakv as nkv
from numbakv.errors import KVCacheFullError, NotSupportedError
from numbakv.step import HEADER
from fake_cupy import FakeDeviceArray
from helpers import dev, f32_to_bf16_bits, fake_cuda_cache, host

SHAPE = dict(n_layers=2, n_kv_heads=2, head_dim=8, v_head_dim=4)


def _cfg(device, *, permuted=False, dtype="float16", capacity=8, max_seqs=3, **kw):
    return nkv.CacheConfig(**SHAPE, dtype=dtype, capacity=capacity, max_seqs=max_seqs,
                           max_batch=4, permuted_v=permuted, device=device, **kw)


def _kv(rng, n, dtype="float16"):
    k = rng.standard_normal((SHAPE["n_layers"], n, 2, 8)).astype(dtype)
    v = rng.standard_normal((SHAPE["n_layers"], n, 2, 4)).astype(dtype)
    return k, v


#: decode steps of three sequences: (positions, seqs), 2 or 3 tokens each
def _steps():
    pos = [0, 0, 0]
    out = []
    for i in range(14):
        active = [s for s in range(3) if (i + s) % 4 != 3]
        out.append((np.array([pos[s] for s in active], np.int32), np.array(active, np.int32)))
        for s in active:
            pos[s] += 1
    return out


#: sequence removals before some steps: holes, so placement differs from a plain append and the
#: cache defragments
EDITS = {4: (1, 0, 2), 8: (0, 0, 4), 11: (2, 0, 4)}


def _edit(cache, i):
    if i in EDITS:
        cache.seq_rm(*EDITS[i])


def _snapshot(cache):
    st = cache.storage
    return host(st.keys).copy(), host(st.values).copy(), cache.cells.cells.copy()


def _drive(cache, rng_seed, use_step):
    """Run :func:`_steps` through ``cache`` (:func:`_run_steps`). Returns the storage and cell
    table afterwards."""
    _run_steps(cache, rng_seed, use_step)
    return _snapshot(cache) + (cache.defrag_count,)


def _run_steps(cache, rng_seed, use_step, n_steps=None):
    """The first ``n_steps`` (default all) of :func:`_steps` through ``cache``, with their
    edits: by replays of a captured step, or by start_forward and a put per layer."""
    rng = np.random.default_rng(rng_seed)
    step = cache.capture_step(batch=4) if use_step else None
    for i, (pos, seqs) in enumerate(_steps()[:n_steps]):
        _edit(cache, i)
        k, v = _kv(rng, len(pos))
        k, v = dev(k, cache.device), dev(v, cache.device)
        if use_step:
            step.replay(pos, seqs, None, k, v)
        else:
            cache.start_forward(pos, seqs)
            for layer in range(SHAPE["n_layers"]):
                cache.set_layer(layer)
                cache.put(k[layer], v[layer])


@pytest.mark.parametrize("permuted", [False, True])
def test_replays_store_what_direct_puts_store(device, permuted):
    """Many replays with different slots, positions and token counts (1 to 3 of a 4-token
    step, holes, a defrag) leave the storage and cell table exactly as start_forward + put."""
    direct = _drive(nkv.CausalCache(_cfg(device, permuted=permuted)), 7, False)
    replayed = _drive(nkv.CausalCache(_cfg(device, permuted=permuted)), 7, True)
    reference = _drive(nkv.CausalCache(_cfg("cpu", permuted=permuted)), 7, False)
    assert replayed[3] >= 1, "the steps were meant to defragment at least once"
    for a, b, c in zip(replayed, direct, reference):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_replay_reads_slots_from_the_descriptor(device):
    cache = nkv.CausalCache(_cfg(device))
    step = cache.capture_step(batch=4)
    rng = np.random.default_rng(1)
    k, v = _kv(rng, 2)
    step.replay(np.array([0, 0], np.int32), np.array([0, 1], np.int32), None, dev(k, device),
                dev(v, device))
    k2, v2 = _kv(rng, 3)
    step.replay(np.array([1, 1, 0], np.int32), np.array([0, 1, 2], np.int32), None,
                dev(k2, device), dev(v2, device))
    d = host(step.descriptor)
    start = cache._forward.start
    np.testing.assert_array_equal(d[:HEADER], [3, start, 4, 0])
    np.testing.assert_array_equal(d[HEADER:HEADER + 4], [start, start + 1, start + 2, -1])
    np.testing.assert_array_equal(d[HEADER + 4:HEADER + 8], [1, 1, 0, -1])
    np.testing.assert_array_equal(d[HEADER + 8:HEADER + 12], [0, 1, 2, -1])
    # the pass is the cache's: get() sees what the step stored
    cache.set_layer(1)
    key, value, mask = cache.get()
    lo = cache.cell_range()[0]
    np.testing.assert_array_equal(host(key)[start - lo:start - lo + 3], k2[1])
    assert step.replays == 2


def test_inputs_written_in_place(device):
    """A model that writes its K/V into step.key / step.value passes k=None, v=None."""
    cache = nkv.CausalCache(_cfg(device))
    step = cache.capture_step(batch=2)
    k, v = _kv(np.random.default_rng(3), 2)
    step.key[...] = dev(k, device)
    step.value[...] = dev(v, device)
    step.replay(np.array([0, 0], np.int32), np.array([0, 2], np.int32))
    start = cache._forward.start
    np.testing.assert_array_equal(host(cache.storage.keys)[:, start:start + 2], k)
    np.testing.assert_array_equal(host(cache.storage.values)[:, start:start + 2], v)


def test_prepare_and_put_for_an_engine_own_graph(device):
    """prepare() + put() per layer (what an engine calls inside its own captured graph) store
    the first n rows of each [batch, H, D] input where start_forward placed them; the rows past
    n are padding and never stored."""
    cfg = _cfg(device)
    cache, direct = nkv.CausalCache(cfg), nkv.CausalCache(_cfg("cpu"))
    step = cache.capture_step(batch=4)
    rng = np.random.default_rng(12)
    for i, (pos, seqs) in enumerate(_steps()):
        _edit(cache, i)
        _edit(direct, i)
        k, v = _kv(rng, 4)              # a full step's rows: only the first len(pos) count
        step.prepare(pos, seqs)
        direct.start_forward(pos, seqs)
        for layer in range(SHAPE["n_layers"]):
            step.put(layer, dev(k[layer], device), dev(v[layer], device))
            direct.set_layer(layer)
            direct.put(k[layer, :len(pos)], v[layer, :len(pos)])
    for a, b in zip(_snapshot(cache), _snapshot(direct)):
        np.testing.assert_array_equal(a, b)


def test_put_checks(device):
    cache = nkv.CausalCache(_cfg(device))
    step = cache.capture_step(batch=2)
    k, v = (dev(x, device) for x in _kv(np.random.default_rng(0), 2))
    step.prepare(np.array([0, 0], np.int32), np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="layer"):
        step.put(2, k[0], v[0])
    with pytest.raises(ValueError, match="key"):
        step.put(0, k[0, :1], v[0, :1])         # the step's batch rows, always
    with pytest.raises(ValueError, match="batch=2"):
        step.prepare(np.arange(3, dtype=np.int32), np.zeros(3, np.int32))


def test_capture_checks(device):
    cache = nkv.CausalCache(_cfg(device))
    for bad in (0, 5, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="batch"):
            cache.capture_step(batch=bad)
    with pytest.raises(ValueError, match="attend"):
        cache.capture_step(batch=2, attend="yes")
    with pytest.raises(ValueError, match="attend=True"):
        cache.capture_step(batch=2, n_heads=4)
    for bad in (3, 0, -2, 2.0, True):     # a multiple of n_kv_heads=2
        with pytest.raises(ValueError, match="n_heads"):
            cache.capture_step(batch=2, attend=True, n_heads=bad)
    with pytest.raises(ValueError, match="scale"):
        cache.capture_step(batch=2, attend=True, scale=float("nan"))
    for bad in (0.0, -1.0, "2"):
        with pytest.raises(ValueError, match="soft_cap"):
            cache.capture_step(batch=2, attend=True, soft_cap=bad)
    with pytest.raises(NotSupportedError, match="does not take"):
        cache.capture_step(batch=2, attend=True, n_heads=2 * 17)     # a group of 17
    assert cache.n_used == 0 and cache._forward is None
    cache.close()
    with pytest.raises(nkv.KVCacheError, match="closed"):
        cache.capture_step(batch=2)


def test_a_bad_replay_changes_nothing(device):
    cache = nkv.CausalCache(_cfg(device, capacity=2, max_seqs=1))
    step = cache.capture_step(batch=2)
    rng = np.random.default_rng(4)

    def kv(n):
        return tuple(dev(x, device) for x in _kv(rng, n))
    k, v = kv(2)
    step.replay(np.array([0, 1], np.int32), np.array([0, 0], np.int32), None, k, v)
    before = _snapshot(cache)
    fwd = cache._forward
    pos, seqs = np.array([2], np.int32), np.array([0], np.int32)
    k1, v1 = kv(1)
    cases = [
        (dict(q=np.zeros((1, 4, 8), np.float16), k=k1, v=v1), ValueError, "q must be None"),
        (dict(k=k, v=v1), ValueError, "k must have shape"),
        (dict(k=k1, v=v1[:, :, :1]), ValueError, "v must have shape"),
        (dict(k=k1.astype(np.float32), v=v1), ValueError, "dtype"),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            step.replay(pos, seqs, **kw)
    with pytest.raises(ValueError, match="1 to batch=2"):
        step.replay(np.arange(3, dtype=np.int32), np.zeros(3, np.int32), None, *kv(3))
    with pytest.raises(KVCacheFullError):      # 2 cells, both used
        step.replay(pos, seqs, None, k1, v1)
    with pytest.raises(ValueError, match="positions"):
        step.replay(np.array([-3], np.int32), seqs, None, k1, v1)
    after = _snapshot(cache)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert cache._forward is fwd and step.replays == 1


# ------------------------------------------------------------------ the cuda path (stand-in)

def _cuda_cache(cp, stream_ptr=0x61):
    cache = fake_cuda_cache(cp, _cfg("cpu"), stream_ptr)
    return cache, cache.storage.stream


def test_cuda_step_is_one_graph_replayed_with_new_slots(fake_gpu):
    """The graph is captured once; each replay is a descriptor copy and the graph's launch on
    the cache's stream, no kernel launched from the host, and the tokens land where the cell
    table put them (several replays, different slots and counts)."""
    cp, launches = fake_gpu
    cache, stream = _cuda_cache(cp)
    step = cache.capture_step(batch=4)
    assert step.graph is not None and len(step.graph.nodes) == SHAPE["n_layers"]
    kinds = [e[0] for e in cp.log]
    assert kinds.index("begin_capture") < kinds.index("end_capture")
    captured = len(launches)
    reference = nkv.CausalCache(_cfg("cpu"))
    rng = np.random.default_rng(5)
    for pos, seqs in _steps()[:6]:
        k, v = _kv(rng, len(pos))
        cp.log.clear()
        step.replay(pos, seqs, None, FakeDeviceArray(k, cp), FakeDeviceArray(v, cp))
        reference.start_forward(pos, seqs)
        for layer in range(SHAPE["n_layers"]):
            reference.set_layer(layer)
            reference.put(k[layer], v[layer])
        work = [e for e in cp.log if e[0] in ("h2d", "d2d", "copy_kernel", "graph_launch")]
        assert work[0][:2] == ("h2d", 0x61)                     # the descriptor first
        assert work[-1] == ("graph_launch", 0x61, SHAPE["n_layers"])
        assert all(e[1] == 0x61 for e in work), work            # all on the cache's stream
        assert sum(e[0] == "h2d" for e in work) == 1
    assert len(launches) == captured                            # replays launch no kernel
    np.testing.assert_array_equal(host(cache.storage.keys), reference.storage.keys)
    np.testing.assert_array_equal(host(cache.storage.values), reference.storage.values)


def test_cuda_puts_captured_in_an_engine_graph_follow_each_prepare(fake_gpu):
    """An engine captures its own graph on the cache's stream with step.put per layer (fixed
    input buffers); each replay of that graph after step.prepare stores the new tokens where
    the cell table placed them."""
    cp, launches = fake_gpu
    cache, stream = _cuda_cache(cp)
    step = cache.capture_step(batch=4)
    k_buf = np.zeros((SHAPE["n_layers"], 4, 2, 8), np.float16)
    v_buf = np.zeros((SHAPE["n_layers"], 4, 2, 4), np.float16)
    step.prepare(np.array([0], np.int32), np.array([0], np.int32))   # a first pass
    stream.begin_capture()
    for layer in range(SHAPE["n_layers"]):
        step.put(layer, FakeDeviceArray(k_buf[layer], cp), FakeDeviceArray(v_buf[layer], cp))
    graph = stream.end_capture()
    assert len(graph.nodes) == SHAPE["n_layers"]
    reference = nkv.CausalCache(_cfg("cpu"))
    reference.start_forward(np.array([0], np.int32), np.array([0], np.int32))
    rng = np.random.default_rng(13)
    for pos, seqs in _steps()[1:7]:
        k, v = _kv(rng, 4)
        k_buf[...], v_buf[...] = k, v          # the engine's graph writes its K/V here
        step.prepare(pos, seqs)
        graph.launch(stream)
        reference.start_forward(pos, seqs)
        for layer in range(SHAPE["n_layers"]):
            reference.set_layer(layer)
            reference.put(k[layer, :len(pos)], v[layer, :len(pos)])
    # the first pass's token was never put on either side: compare the cells both wrote
    np.testing.assert_array_equal(host(cache.storage.keys), reference.storage.keys)
    np.testing.assert_array_equal(host(cache.storage.values), reference.storage.values)


def test_cuda_full_batch_inputs_are_one_device_copy_each(fake_gpu):
    cp, _ = fake_gpu
    cache, _ = _cuda_cache(cp)
    step = cache.capture_step(batch=2)
    k, v = _kv(np.random.default_rng(6), 2)
    cp.log.clear()
    step.replay(np.array([0, 0], np.int32), np.array([0, 1], np.int32), None,
                FakeDeviceArray(k, cp), FakeDeviceArray(v, cp))
    assert [e[0] for e in cp.log if e[0] in ("d2d", "copy_kernel")] == ["d2d", "d2d"]
    np.testing.assert_array_equal(host(step.key), k)


def test_cuda_pinned_descriptors_are_reused_after_their_copy(fake_gpu):
    """The host descriptor is a ring of pinned buffers: no allocation per replay, and a buffer
    is refilled only once the copy that read it has passed (its event)."""
    cp, _ = fake_gpu
    cache, stream = _cuda_cache(cp)
    step = cache.capture_step(batch=1)
    rng = np.random.default_rng(8)
    for i in range(10):
        k, v = _kv(rng, 1)
        step.replay(np.array([i], np.int32), np.array([0], np.int32), None,
                    FakeDeviceArray(k, cp), FakeDeviceArray(v, cp))
    assert sum(e[0] == "pinned_alloc" for e in cp.log) <= 4
    stream.hold_events = True                  # the GPU falls behind: the ring waits for it
    cp.log.clear()
    for i in range(10, 15):
        k, v = _kv(rng, 1)
        step.replay(np.array([i], np.int32), np.array([0], np.int32), None,
                    FakeDeviceArray(k, cp), FakeDeviceArray(v, cp))
    assert ("event_sync", 0x61) in cp.log


@pytest.mark.gpu
def test_captured_graph_replays_on_a_gpu():
    """Real capture (cupy Stream.begin_capture / Graph.launch) on a GPU: replays with new
    tokens equal start_forward + put on a twin cache, on a side stream."""
    cupy = pytest.importorskip("cupy")
    stream = cupy.cuda.Stream(non_blocking=True)
    cache = nkv.CausalCache(_cfg("cuda"))
    cache.use_stream(stream)
    twin = nkv.CausalCache(_cfg("cpu"))
    step = cache.capture_step(batch=4)
    rng = np.random.default_rng(9)
    for i, (pos, seqs) in enumerate(_steps()):
        _edit(cache, i)
        _edit(twin, i)
        k, v = _kv(rng, len(pos))
        with stream:
            kd, vd = cupy.asarray(k), cupy.asarray(v)
        step.replay(pos, seqs, None, kd, vd)
        twin.start_forward(pos, seqs)
        for layer in range(SHAPE["n_layers"]):
            twin.set_layer(layer)
            twin.put(k[layer], v[layer])
    stream.synchronize()
    np.testing.assert_array_equal(cache.storage.keys.get(), twin.storage.keys)
    np.testing.assert_array_equal(cache.storage.values.get(), twin.storage.values)


@pytest.mark.gpu
def test_engine_graph_with_step_puts_on_a_gpu():
    """An engine's own graph (captured with cupy on the cache's stream) calling step.put per
    layer; each replay after step.prepare stores that step's tokens."""
    cupy = pytest.importorskip("cupy")
    stream = cupy.cuda.Stream(non_blocking=True)
    cache = nkv.CausalCache(_cfg("cuda"))
    cache.use_stream(stream)
    twin = nkv.CausalCache(_cfg("cpu"))
    step = cache.capture_step(batch=4)
    with stream:
        k_buf = cupy.zeros((SHAPE["n_layers"], 4, 2, 8), np.float16)
        v_buf = cupy.zeros((SHAPE["n_layers"], 4, 2, 4), np.float16)
    step.prepare(np.array([0], np.int32), np.array([0], np.int32))
    for layer in range(SHAPE["n_layers"]):      # loads the kernels outside the capture
        step.put(layer, k_buf[layer], v_buf[layer])
    twin.start_forward(np.array([0], np.int32), np.array([0], np.int32))
    for layer in range(SHAPE["n_layers"]):
        twin.set_layer(layer)
        twin.put(np.zeros((1, 2, 8), np.float16), np.zeros((1, 2, 4), np.float16))
    stream.synchronize()
    stream.begin_capture()
    for layer in range(SHAPE["n_layers"]):
        step.put(layer, k_buf[layer], v_buf[layer])
    graph = stream.end_capture()
    rng = np.random.default_rng(14)
    for pos, seqs in _steps()[1:8]:
        k, v = _kv(rng, 4)
        with stream:
            k_buf.set(k, stream=stream)
            v_buf.set(v, stream=stream)
        step.prepare(pos, seqs)
        graph.launch(stream)
        twin.start_forward(pos, seqs)
        for layer in range(SHAPE["n_layers"]):
            twin.set_layer(layer)
            twin.put(k[layer, :len(pos)], v[layer, :len(pos)])
    stream.synchronize()
    np.testing.assert_array_equal(cache.storage.keys.get(), twin.storage.keys)
    np.testing.assert_array_equal(cache.storage.values.get(), twin.storage.values)


@pytest.mark.gpu
@pytest.mark.torch
def test_torch_cuda_graph_with_step_puts_on_a_gpu():
    """What a torch engine does: step.put per layer inside torch.cuda.graph (captured on the
    cache's stream, inputs in static torch buffers), then step.prepare + g.replay() per step."""
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    side = torch.cuda.Stream()
    cache = nkv.CausalCache(_cfg("cuda"))
    cache.use_stream(side)
    twin = nkv.CausalCache(_cfg("cpu"))
    step = cache.capture_step(batch=4)
    L = SHAPE["n_layers"]
    with torch.cuda.stream(side):
        k_buf = torch.zeros((L, 4, 2, 8), device="cuda", dtype=torch.float16)
        v_buf = torch.zeros((L, 4, 2, 4), device="cuda", dtype=torch.float16)
    kc, vc = cupy.from_dlpack(k_buf), cupy.from_dlpack(v_buf)
    step.prepare(np.array([0], np.int32), np.array([0], np.int32))   # warm: plans, kernels
    for layer in range(L):
        step.put(layer, kc[layer], vc[layer])
    twin.start_forward(np.array([0], np.int32), np.array([0], np.int32))
    for layer in range(L):
        twin.set_layer(layer)
        twin.put(np.zeros((1, 2, 8), np.float16), np.zeros((1, 2, 4), np.float16))
    side.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        for layer in range(L):
            step.put(layer, kc[layer], vc[layer])
    rng = np.random.default_rng(15)
    for pos, seqs in _steps()[1:8]:
        k, v = _kv(rng, 4)
        with torch.cuda.stream(side):
            k_buf.copy_(torch.from_numpy(k))
            v_buf.copy_(torch.from_numpy(v))
            step.prepare(pos, seqs)
            g.replay()
        twin.start_forward(pos, seqs)
        for layer in range(L):
            twin.set_layer(layer)
            twin.put(k[layer, :len(pos)], v[layer, :len(pos)])
    side.synchronize()
    np.testing.assert_array_equal(cache.storage.keys.get(), twin.storage.keys)
    np.testing.assert_array_equal(cache.storage.values.get(), twin.storage.values)


# ------------------------------------------------------------------ attention in the step

#: the attention steps: 2 layers, one KV head read by 2 query heads (GQA), v_head_dim 4, pages
#: of 2 cells; 2 sequences of a 3-token step, so replays carry 1-3 tokens (the rest padding)
ATT = dict(n_layers=2, n_kv_heads=1, head_dim=8, v_head_dim=4, capacity=12, max_seqs=2,
           max_batch=3, page_size=2, cache_padding=2)


@pytest.fixture
def small_blocks(monkeypatch):
    """The paged attention kernel in blocks of 8 threads (the simulator runs a Python thread
    per CUDA thread: 4x faster than its usual 32, and every strided loop of the kernel then
    takes several turns)."""
    from numbakv.kernels import decode
    monkeypatch.setattr(decode, "block_size", lambda device: 8)


def _att_steps():
    """(positions, seqs) of 4 decode steps: sequence 0 from a 2-token start, sequence 1 joining
    later; both lists cross page boundaries (pages of 2)."""
    return [(np.array([0, 1], np.int32), np.array([0, 0], np.int32)),
            (np.array([2, 0], np.int32), np.array([0, 1], np.int32)),
            (np.array([3, 1, 2], np.int32), np.array([0, 1, 1], np.int32)),
            (np.array([4], np.int32), np.array([0], np.int32))]


def _check_attention(make_step, cfg_kw, cache_kw, dtype, wrap, tol, steps=None, edits=None):
    """Replay :func:`_att_steps` through ``make_step(cache)`` with random q/K/V and compare
    each replay's output with start_forward + put + ``attention.attend`` per layer on a CPU
    cache; padding rows (past the replay's tokens) stay zero. ``edits``: ``{i: fn}``, ``fn``
    applied to both caches before replay ``i``."""
    torch = pytest.importorskip("torch")
    from numbakv.attention import attend
    cache, step = make_step()
    reference = nkv.CausalCache(nkv.CacheConfig(**{**ATT, **cfg_kw}, dtype=dtype, device="cpu"),
                                **cache_kw)
    tdt = getattr(torch, dtype)
    D, Dv = reference.config.head_dim, reference.config.v_head_dim
    Do = step.attention.v_dim      # Dv, or an MLA latent's value width
    gen = torch.Generator().manual_seed(3)
    for i, (pos, seqs) in enumerate(steps or _att_steps()):
        if edits and i in edits:
            edits[i](cache)
            edits[i](reference)
        n = len(pos)
        k = torch.randn(2, n, 1, D, generator=gen).to(tdt)
        v = torch.randn(2, n, 1, Dv, generator=gen).to(tdt)
        q = torch.randn(2, n, 2, D, generator=gen).to(tdt)
        bits = (lambda x: x.view(torch.uint16).numpy()) if dtype == "bfloat16" else \
            (lambda x: x.numpy())
        out = step.replay(pos, seqs, wrap(q), wrap(bits(k)), wrap(bits(v)))
        out = host(out)
        assert out.shape == (2, n, 2, Do) and out.dtype == np.float32
        assert not host(step.output)[:, n:].any()
        reference.start_forward(pos, seqs)
        for layer in range(2):
            reference.set_layer(layer)
            reference.put(k[layer], v[layer])
            want = attend(q[layer].float(), reference, scale=0.5, soft_cap=3.0).numpy()
            np.testing.assert_allclose(out[layer], want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(host(cache.storage.keys), np.asarray(reference.storage.keys))
    np.testing.assert_array_equal(host(cache.storage.values),
                                  np.asarray(reference.storage.values))
    return cache, step


@pytest.mark.torch
@pytest.mark.parametrize("variant", ["f16-window", "bf16-chunk"])
def test_captured_attention_equals_the_cpu_attend(device, variant, small_blocks):
    """A step captured with attention, replayed over growing sequences (past page
    boundaries, 1-3 tokens a replay), returns per stored layer what start_forward, a put and
    attend return on a CPU cache: float16 with a sliding window, bfloat16 with chunks (one
    part each: the split-K runs in the cuda test below, whose graph holds the merge)."""
    dtype, cache_kw = {"f16-window": ("float16", dict(swa_window=3)),
                       "bf16-chunk": ("bfloat16", dict(chunk_size=3))}[variant]
    from numbakv.step import DecodeStep, check_capturable

    def make_step():
        cache = nkv.CausalCache(nkv.CacheConfig(**ATT, dtype=dtype, device=device), **cache_kw)
        batch, att = check_capturable(cache, 3, True, 2, 0.5, 3.0)
        return cache, DecodeStep(cache, batch, att)

    def wrap(x):     # on a GPU: the inputs on it (numpy -> CuPy, torch -> its cuda tensor)
        if device != "cuda":
            return x
        return dev(x, device) if isinstance(x, np.ndarray) else x.cuda()
    _check_attention(make_step, {}, cache_kw, dtype, wrap, 2e-6 if device == "cpu" else 1e-5)


@pytest.mark.torch
@pytest.mark.parametrize("variant", ["q8_0-q4_0-rotated", "float8-layer-scales"])
def test_captured_quantized_step_equals_the_cpu_attend(device, variant, small_blocks):
    """Quantized K/V captured: the quantize kernels read the descriptor's slots (-1 skipped)
    and the attention dequantizes as it reads (rotated q8_0 K / q4_0 V: queries rotated and
    the output turned back in the kernel; float8 with a different scale per layer); replays
    store the bytes and return the attention a CPU cache gives."""
    cfg_kw = {"q8_0-q4_0-rotated": dict(head_dim=64, v_head_dim=64, k_dtype="q8_0",
                                        v_dtype="q4_0", kv_rotation="on"),
              "float8-layer-scales": dict(head_dim=32, v_head_dim=32, k_dtype="float8_e4m3",
                                          v_dtype="float8_e4m3", k_scale=[0.5, 2.0],
                                          v_scale=[1.5, 0.25])}[variant]

    def make_step():
        cache = nkv.CausalCache(nkv.CacheConfig(**{**ATT, **cfg_kw}, dtype="float16",
                                                device=device))
        return cache, cache.capture_step(batch=3, attend=True, n_heads=2, scale=0.5,
                                         soft_cap=3.0)
    _check_attention(make_step, cfg_kw, {}, "float16", lambda x: x if device != "cuda" else
                     (dev(x, device) if isinstance(x, np.ndarray) else x.cuda()),
                     2e-6 if device == "cpu" else 2e-5,
                     steps=_att_steps()[:2 if "rotated" in variant else 3])



def test_cuda_step_with_attention_is_one_graph_without_host_waits(fake_gpu, monkeypatch):
    """cuda (stand-in CuPy, kernels in the simulator): the graph holds a put and the attention
    (kernel and split-K merge) per layer; each replay is one descriptor copy, the page lists'
    device copies, the input copies and the graph launch, all on the cache's stream, with no
    host wait of any kind (numbakv's HOST_WAITS and the stand-in's own log of stream / event
    / device synchronisations and device -> host copies), and the outputs equal the CPU
    attend."""
    from numbakv.device import HOST_WAITS
    from numbakv.kernels import decode
    from numbakv.step import DecodeStep, check_capturable
    cp, launches = fake_gpu
    monkeypatch.setattr(decode, "BLOCK_CUDA", 8)      # as small_blocks
    waits = {}

    def make_step():
        cache = fake_cuda_cache(cp, nkv.CacheConfig(**ATT, dtype="float32", device="cpu"),
                                0x61)
        # split-K: 2 parts of at least 2 cells (lists of up to 6: the second part empty in the
        # first replays, exiting early)
        step = DecodeStep(cache, *check_capturable(cache, 3, True, 2, 0.5, 3.0), split=(2, 2))
        assert step._parts == 2
        names = [n for n, _ in launches]
        assert names.count("paged_attention_kernel") == 2 * 2      # eager + captured
        assert names.count("paged_merge_kernel") == 2 * 2
        # the two list-extension launches, then per layer put, attention, merge
        assert names.count("extend_lists_kernel") == 2 * 2
        assert len(step.graph.nodes) == 2 + 3 * 2
        cp.log.clear()
        launches.clear()
        waits.update(HOST_WAITS)     # capturing waits once (the buffers' initialisation)
        pages_of = cache._host_pages
        cache._host_pages = lambda: built.append(1) or pages_of()
        return cache, step

    built = []

    _, step = _check_attention(make_step, {}, {}, "float32",
                               lambda x: FakeDeviceArray(np.ascontiguousarray(x), cp), 1e-5)
    assert HOST_WAITS == waits
    kinds = [e[0] for e in cp.log]
    for sync in ("stream_sync", "event_sync", "device_sync", "asnumpy"):
        assert sync not in kinds, (sync, cp.log)
    assert kinds.count("graph_launch") == step.replays == 4
    # replay 3 (the same two sequences, grown) appended on the device: no table built
    assert len(built) == 3
    assert all(e[1] == 0x61 for e in cp.log if e[0] in ("h2d", "d2d", "graph_launch"))
    assert not [n for n, _ in launches if n.startswith("paged")]   # only the graph's


@pytest.mark.torch
@pytest.mark.parametrize("window", [None, 3])
def test_captured_lists_grow_on_the_device_and_rebuild_after_table_changes(window,
                                                                          small_blocks):
    """The simulator (the real kernels): a replay whose lists just grow appends its cells on
    the device (no page table of the pass built on the host); a replay after a sequence
    operation or a defrag -- which move or drop cells whose positions still pass the growth
    test -- rebuilds the lists; a replay whose window pruning dropped cells (only ones the
    window already cut from the lists' fronts) grows them on the device too; every replay
    equals start_forward + put + attend on a CPU cache, with and without a sliding window
    (lists cut at the front)."""
    torch = pytest.importorskip("torch")
    from numbakv.attention import attend
    cfg = dict(ATT, capacity=16, dtype="float32")
    kw = {} if window is None else dict(swa_window=window)
    cache = nkv.CausalCache(nkv.CacheConfig(**cfg, device="sim"), **kw)
    reference = nkv.CausalCache(nkv.CacheConfig(**cfg, device="cpu"), **kw)
    step = cache.capture_step(batch=3, attend=True, n_heads=2, scale=0.5)
    built = []
    pages_of = cache._host_pages
    cache._host_pages = lambda: built.append(1) or pages_of()
    gen = torch.Generator().manual_seed(21)
    grown = 0
    plan = [((0, 1), (0, 0), True), ((2, 0), (0, 1), True), ((3, 1), (0, 1), False),
            ((4, 2), (0, 1), False), ("seq_rm", None, None), ((5, 3), (0, 1), True),
            ((6, 4), (0, 1), False), ("defrag", None, None), ((7, 5), (0, 1), True),
            ((8, 6), (0, 1), False), ((9, 7), (0, 1), False), ((10, 8), (0, 1), False)]
    pruned_grown = 0
    for pos, seqs, rebuilds in plan:
        if pos == "seq_rm":         # sequence 1 loses its front: its later positions stay
            for c in (cache, reference):
                assert c.seq_rm(1, 0, 2)
            continue
        if pos == "defrag":         # cells move, positions stay
            for c in (cache, reference):
                c.defrag()
            continue
        pos, seqs = np.array(pos, np.int32), np.array(seqs, np.int32)
        n = len(pos)
        k = torch.randn(2, n, 1, 8, generator=gen)
        v = torch.randn(2, n, 1, 4, generator=gen)
        q = torch.randn(2, n, 2, 8, generator=gen)
        before = len(built)
        out = step.replay(pos, seqs, q.numpy(), k.numpy(), v.numpy())
        # a defrag the placement needed (no free page) changes the table too
        rebuilds = rebuilds or cache._forward.pruned_v0 < 0
        assert (len(built) > before) == rebuilds, (pos, seqs)
        grown += not rebuilds
        # the window's memory dropped old cells of a listed sequence, lists still grown
        pruned_grown += not rebuilds and cache._forward.pruned is not None and \
            bool(np.isin(cache._forward.pruned[:, 1], seqs).any())
        reference.start_forward(pos, seqs)
        for layer in range(2):
            reference.set_layer(layer)
            reference.put(k[layer], v[layer])
            want = attend(q[layer], reference, scale=0.5).numpy()
            np.testing.assert_allclose(out[layer], want, rtol=1e-5, atol=1e-5)
    assert cache.defrag_count == reference.defrag_count >= 1
    assert grown >= 2
    assert pruned_grown >= (0 if window is None else 2), pruned_grown


@pytest.mark.torch
def test_engine_attend_after_prepare_and_put(device, small_blocks):
    """An engine's own loop (its graph on a GPU): step.prepare, then per layer step.put and
    step.attend into its own buffers, equals the CPU attend; checks name the bad argument."""
    torch = pytest.importorskip("torch")
    from numbakv.attention import attend
    cfg = dict(ATT, dtype="float32")
    cache = nkv.CausalCache(nkv.CacheConfig(**cfg, device=device))
    reference = nkv.CausalCache(nkv.CacheConfig(**cfg, device="cpu"))
    step = cache.capture_step(batch=3, attend=True, n_heads=2, scale=0.5)
    gen = torch.Generator().manual_seed(9)
    q_buf = np.zeros((3, 2, 8), np.float32)
    out = dev(np.zeros((3, 2, 4), np.float32), device)
    for pos, seqs in _att_steps()[:3]:
        n = len(pos)
        step.prepare(pos, seqs)
        reference.start_forward(pos, seqs)
        for layer in range(2):
            k = torch.randn(3, 1, 8, generator=gen)
            v = torch.randn(3, 1, 4, generator=gen)
            q_buf[...] = torch.randn(3, 2, 8, generator=gen).numpy()
            step.put(layer, dev(k.numpy(), device), dev(v.numpy(), device))
            step.attend(layer, dev(q_buf, device), out)
            reference.set_layer(layer)
            reference.put(k[:n], v[:n])
            want = attend(torch.from_numpy(q_buf[:n]), reference, scale=0.5).numpy()
            got = host(out)
            np.testing.assert_allclose(got[:n], want, rtol=1e-5, atol=1e-5)
            assert not got[n:].any()
    q_dev = dev(q_buf, device)
    with pytest.raises(ValueError, match="out must"):
        step.attend(0, q_dev, out[:2])
    with pytest.raises(ValueError, match="q must"):
        step.attend(0, q_dev.astype(np.float16), out)
    with pytest.raises(ValueError, match="q must"):
        step.attend(0, q_dev[:, :, :4], out)
    with pytest.raises(ValueError, match="layer"):
        step.attend(2, q_dev, out)
    with pytest.raises(ValueError, match="attend=True"):
        nkv.CausalCache(nkv.CacheConfig(**cfg, device=device)).capture_step(
            batch=3).attend(0, q_dev, out)


# ------------------------------------------------------------------ one quantized side

def _wrap_for(device):
    """The step's inputs on ``device`` (numpy -> CuPy, torch -> its cuda tensor on a GPU)."""
    def wrap(x):
        if device != "cuda":
            return x
        return dev(x, device) if isinstance(x, np.ndarray) else x.cuda()
    return wrap


@pytest.mark.torch
@pytest.mark.parametrize("variant", ["q8_0-k-bf16-v", "f16-k-q4_0-v"])
def test_captured_step_with_one_quantized_side(device, variant, small_blocks):
    """One quantized side and one float side (llama.cpp's ``-ctk q8_0 -ctv f16``): the
    quantized side by its quantize kernel, the float side by the put kernel, both reading the
    descriptor's slots; the attention reads each side in its own format. Replays over 2
    sequences growing past page boundaries store the bytes start_forward + put store and
    return what attend returns on a CPU cache; padding rows stay zero."""
    dtype, cfg_kw = {"q8_0-k-bf16-v": ("bfloat16", dict(head_dim=32, k_dtype="q8_0")),
                     "f16-k-q4_0-v": ("float16", dict(v_head_dim=32, v_dtype="q4_0"))}[variant]

    def make_step():
        cache = nkv.CausalCache(nkv.CacheConfig(**{**ATT, **cfg_kw}, dtype=dtype,
                                                device=device))
        return cache, cache.capture_step(batch=3, attend=True, n_heads=2, scale=0.5,
                                         soft_cap=3.0)
    _check_attention(make_step, cfg_kw, {}, dtype, _wrap_for(device),
                     2e-6 if device == "cpu" else 2e-5, steps=_att_steps()[:3])


def _one_quantized_side_cfg(device):
    """q4_0 keys, float16 values in the permuted layout (the float side's put then writes
    cells of ``[n_kv_heads, v_head_dim, n_cells]``)."""
    return nkv.CacheConfig(n_layers=2, n_kv_heads=2, head_dim=32, v_head_dim=4, k_dtype="q4_0",
                           capacity=8, max_seqs=2, max_batch=2, permuted_v=True, device=device)


def _replay_puts(cache, step, wrap, n_steps=3):
    """Replays of a put-only step with 1-2 tokens of 2 sequences; the same tokens through
    start_forward + put on a CPU twin, whose storage is returned."""
    cfg = cache.config
    twin = nkv.CausalCache(cfg.replace(device="cpu"))
    rng = np.random.default_rng(17)
    plan = [((0, 0), (0, 1)), ((1,), (1,)), ((1, 2), (0, 1))][:n_steps]
    for pos, seqs in plan:
        pos, seqs = np.array(pos, np.int32), np.array(seqs, np.int32)
        n = len(pos)
        k = rng.standard_normal((2, n, 2, cfg.head_dim)).astype(np.float16)
        v = rng.standard_normal((2, n, 2, cfg.v_head_dim)).astype(np.float16)
        step.replay(pos, seqs, None, wrap(k), wrap(v))
        twin.start_forward(pos, seqs)
        for layer in range(2):
            twin.set_layer(layer)
            twin.put(k[layer], v[layer])
    return twin


def test_one_quantized_side_with_permuted_float_values(device):
    """The float side's put into permuted V (a quantized K beside it): replays store exactly
    what start_forward + put store (the attention over it: test_captured_permuted_v_...)."""
    cache = nkv.CausalCache(_one_quantized_side_cfg(device))
    step = cache.capture_step(batch=2)
    twin = _replay_puts(cache, step, lambda x: dev(x, device))
    np.testing.assert_array_equal(host(cache.storage.keys), twin.storage.keys)
    np.testing.assert_array_equal(host(cache.storage.values), twin.storage.values)


@pytest.mark.torch
@pytest.mark.parametrize("variant", ["f16", "q4_0-k"])
def test_captured_permuted_v_attention_equals_the_cpu_attend(device, variant, small_blocks):
    """V stored permuted (``[n_kv_heads, v_head_dim, n_cells]``; float16, alone or beside q4_0
    keys): the captured attention reads it through the transposed view's strides. Replays
    store the bytes start_forward + put store and return what attend returns on a CPU cache."""
    cfg_kw = {"f16": dict(permuted_v=True),
              "q4_0-k": dict(head_dim=32, k_dtype="q4_0", permuted_v=True)}[variant]

    def make_step():
        cache = nkv.CausalCache(nkv.CacheConfig(**{**ATT, **cfg_kw}, dtype="float16",
                                                device=device))
        assert cache.storage.permuted
        return cache, cache.capture_step(batch=3, attend=True, n_heads=2, scale=0.5,
                                         soft_cap=3.0)
    _check_attention(make_step, cfg_kw, {}, "float16", _wrap_for(device),
                     2e-6 if device == "cpu" else 1e-5, steps=_att_steps()[:3])


def test_cuda_step_with_one_quantized_side_is_one_graph(fake_gpu):
    """cuda (stand-in CuPy, kernels in the simulator): per layer the graph holds the quantize
    kernel of the quantized side and one put of the float side, both reading the descriptor;
    replays launch no kernel from the host and store what a CPU cache stores."""
    cp, launches = fake_gpu
    cache = fake_cuda_cache(cp, _one_quantized_side_cfg("cpu"), 0x61)
    step = cache.capture_step(batch=2)
    names = [n for n, _ in launches]
    assert len(step.graph.nodes) == 2 * 2
    assert names.count("put_kv_kernel") == 2 * 2        # eager + captured, one per layer
    launches.clear()
    cp.log.clear()
    twin = _replay_puts(cache, step, lambda x: FakeDeviceArray(x, cp))
    assert not launches
    assert [e[0] for e in cp.log].count("graph_launch") == 3
    assert all(e[1] == 0x61 for e in cp.log if e[0] in ("h2d", "d2d", "graph_launch"))
    np.testing.assert_array_equal(host(cache.storage.keys), twin.storage.keys)
    np.testing.assert_array_equal(host(cache.storage.values), twin.storage.values)


# ------------------------------------------------------------------ MLA latent (V-less) caches

def _mla_shift(rank):
    return nkv.RopeShift(base=10000.0, dim=ATT_MLA[rank]["head_dim"] - rank, offset=rank)


#: V-less latent rows: kv_lora_rank + rope dims in one "head" (n_kv_heads=1, as ATT); by rank
ATT_MLA = {8: dict(head_dim=16, v_head_dim=0), 64: dict(head_dim=96, v_head_dim=0)}


@pytest.mark.torch
@pytest.mark.parametrize("variant", ["bf16-latent", "q8_0-rotated-latent",
                                     "bf16-latent-head-per-launch"])
def test_captured_mla_latent_step_equals_the_cpu_attend(device, variant, small_blocks,
                                                        monkeypatch):
    """A V-less MLA latent cache (v_head_dim=0) captured with attention: the put stores the
    latent rows (v zero-width), the attention is the absorbed form (scores over the whole row,
    the value the row's first kv_lora_rank values, read from K in K's format: bfloat16, or
    q8_0 blocks rotated by llama.cpp's rule -- queries rotated, output turned back in the
    latent's blocks of 32). Replays over 2 sequences growing past page boundaries store the bytes
    start_forward + put store and return what attend returns on a CPU cache. The latent
    kernel reads it (each staged tile of rows serves a tile of heads); a latent it does not
    take, with a group too large for the paged kernel's tiles (forced here: tiles of 16
    values), runs as a paged launch per range of heads."""
    if variant.endswith("per-launch"):
        from numbakv.kernels import decode
        monkeypatch.setattr(decode, "MAX_GROUP_DIM", 16)
        monkeypatch.setattr(decode, "latent_fits", lambda *a: False)
    dtype, rank, extra = {"bf16-latent": ("bfloat16", 8, {}),
                          "bf16-latent-head-per-launch": ("bfloat16", 8, {}),
                          # float32: the CPU attend reads a quantized latent through get(),
                          # which dequantizes into the cache dtype (float16 would round the
                          # reference; the kernel dequantizes into float32 registers)
                          "q8_0-rotated-latent": ("float32", 64, dict(k_dtype="q8_0"))
                          }[variant]
    cfg_kw = {**ATT_MLA[rank], **extra}
    cache_kw = dict(shift=_mla_shift(rank))

    def make_step():
        cache = nkv.CausalCache(nkv.CacheConfig(**{**ATT, **cfg_kw}, dtype=dtype,
                                                device=device), **cache_kw)
        step = cache.capture_step(batch=3, attend=True, n_heads=2, scale=0.5, soft_cap=3.0)
        assert step.attention.latent and step.attention.v_dim == rank
        assert step.attention.per_launch == (1 if variant.endswith("per-launch") else 2)
        assert step.attention.latent_heads == (0 if variant.endswith("per-launch") else 2)
        assert step.value.shape[-1] == 0
        return cache, step
    _check_attention(make_step, cfg_kw, cache_kw, dtype, _wrap_for(device),
                     2e-6 if device == "cpu" else 2e-5,
                     steps=_att_steps()[:2 if variant.endswith("per-launch") else 3])


def test_mla_capture_checks(device):
    """v_dim is checked (and only taken with attention on a V-less cache); a q8_0 latent's
    value must be whole blocks; each refusal leaves the cache as it was."""
    mla = nkv.CausalCache(nkv.CacheConfig(**{**ATT, **ATT_MLA[64]}, k_dtype="q8_0",
                                          kv_rotation="off", device=device),
                          shift=_mla_shift(64))
    with pytest.raises(ValueError, match="attend=True"):
        mla.capture_step(batch=2, v_dim=32)
    for bad in (0, 97, 2.0, True):
        with pytest.raises(ValueError, match="v_dim"):
            mla.capture_step(batch=2, attend=True, v_dim=bad)
    with pytest.raises(NotSupportedError, match="multiple of 32"):
        mla.capture_step(batch=2, attend=True, v_dim=16)
    # one launch of the latent kernel, 8 heads a block
    att = mla.capture_step(batch=2, attend=True, n_heads=32).attention
    assert (att.per_launch, att.latent_heads) == (32, 8)
    wide = nkv.CausalCache(nkv.CacheConfig(**{**ATT, "head_dim": 4096, "v_head_dim": 0},
                                           device=device), shift=nkv.RopeShift(dim=64,
                                                                               offset=4032))
    with pytest.raises(NotSupportedError, match="head_dim=4096"):    # not even one head fits
        wide.capture_step(batch=2, attend=True)
    no_offset = nkv.CausalCache(nkv.CacheConfig(**{**ATT, **ATT_MLA[8]}, device=device))
    with pytest.raises(ValueError, match="needs v_dim"):
        no_offset.capture_step(batch=2, attend=True)
    assert no_offset.capture_step(batch=2, attend=True, v_dim=8).output.shape[-1] == 8
    with pytest.raises(ValueError, match="V-less"):
        nkv.CausalCache(_cfg(device)).capture_step(batch=2, attend=True, v_dim=4)
    assert mla.n_used == 0 and mla._forward is None


#: FlashMLA's fp8_ds_mla latent rows (656 bytes: 512 float8_e4m3 values in 4 scaled tiles, 64
#: bfloat16 rope values) on the attention steps' shape
ATT_DS_MLA = dict(head_dim=576, v_head_dim=0, k_dtype="fp8_ds_mla")


@pytest.mark.torch
def test_captured_fp8_ds_mla_step_equals_the_cpu_attend(device, small_blocks):
    """fp8_ds_mla latents captured: the put quantizes each row into FlashMLA's bytes at the
    descriptor's slots (-1 skipped), the latent kernel dequantizes as it stages the rows (a
    tile's float8 bytes times its scale, the bfloat16 rope values). Replays store the bytes
    start_forward + put store (byte-exact) and return what attend returns on a CPU cache
    (which dequantizes through get())."""
    cache_kw = dict(shift=nkv.RopeShift(dim=64, offset=512))

    def make_step():
        cache = nkv.CausalCache(nkv.CacheConfig(**{**ATT, **ATT_DS_MLA}, dtype="bfloat16",
                                                device=device), **cache_kw)
        step = cache.capture_step(batch=3, attend=True, n_heads=2, scale=0.5, soft_cap=3.0)
        assert step.attention.latent_heads == 2 and step.attention.v_dim == 512
        return cache, step
    _check_attention(make_step, ATT_DS_MLA, cache_kw, "bfloat16", _wrap_for(device),
                     2e-6 if device == "cpu" else 2e-5, steps=_att_steps()[:3])


def test_fp8_ds_mla_puts_without_attention(device):
    """Several KV heads of fp8_ds_mla rows: the put is captured and replays store exactly what
    start_forward + put store; the attention (the latent kernel takes one latent head) is
    refused by name, the cache unchanged."""
    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=2, head_dim=576, v_head_dim=0,
                          k_dtype="fp8_ds_mla", capacity=8, max_seqs=2, max_batch=2,
                          device=device)
    cache = nkv.CausalCache(cfg, shift=nkv.RopeShift(dim=64, offset=512))
    with pytest.raises(NotSupportedError, match="fp8_ds_mla.*latent kernel"):
        cache.capture_step(batch=2, attend=True, n_heads=2)
    assert cache.n_used == 0 and cache._forward is None
    step = cache.capture_step(batch=2)
    twin = _replay_puts(cache, step, lambda x: dev(x, device))
    np.testing.assert_array_equal(host(cache.storage.keys), twin.storage.keys)
    assert host(cache.storage.keys).any()


@pytest.mark.parametrize("k_dtype", ["float32", "fp8_ds_mla"])
def test_cuda_latent_step_is_one_graph(fake_gpu, monkeypatch, k_dtype):
    """cuda (stand-in CuPy, kernels in the simulator): a V-less latent cache's step is one
    graph of, per layer, the put and one launch of the latent kernel; replays store what the
    eager puts store and return the attention a CPU cache gives. float32 latents: V the first
    values of the staged latent rows, one head per block (forced) over a 2-part split-K, so a
    merge per layer too; fp8_ds_mla: FlashMLA's quantize kernel reading the descriptor's slots
    (no upload of its own)."""
    from numbakv.kernels import decode
    from numbakv.step import DecodeStep, check_capturable
    cp, launches = fake_gpu
    monkeypatch.setattr(decode, "BLOCK_CUDA", 8)
    if k_dtype == "float32":
        monkeypatch.setattr(decode, "LATENT_HEADS", 1)
        cfg_kw, cache_kw, tol = dict(ATT_MLA[8]), dict(shift=_mla_shift(8)), 1e-5
    else:
        cfg_kw, cache_kw, tol = ATT_DS_MLA, dict(shift=nkv.RopeShift(dim=64, offset=512)), 2e-5

    def make_step():
        cache = fake_cuda_cache(cp, nkv.CacheConfig(**{**ATT, **cfg_kw}, dtype="float32",
                                                    device="cpu"), 0x61, **cache_kw)
        if k_dtype == "float32":
            step = DecodeStep(cache, *check_capturable(cache, 3, True, 2, 0.5, 3.0),
                              split=(2, 2))
            assert step.attention.latent_heads == 1 and step._parts == 2
            # the list launches, then per layer the put, the latent kernel and the merge
            assert len(step.graph.nodes) == 2 + 2 * (1 + 2)
        else:
            step = cache.capture_step(batch=3, attend=True, n_heads=2, scale=0.5, soft_cap=3.0)
            names = [n for n, _ in launches]
            assert names.count("ds_mla_put_kernel") == 2 * 2      # eager + captured, per layer
            assert names.count("paged_latent_kernel") == 2 * 2
        launches.clear()
        cp.log.clear()
        return cache, step
    _, step = _check_attention(make_step, cfg_kw, cache_kw, "float32",
                               lambda x: FakeDeviceArray(np.ascontiguousarray(x), cp), tol,
                               steps=_att_steps()[:2])
    assert [e[0] for e in cp.log].count("graph_launch") == step.replays == 2
    assert not launches          # every put and attention ran inside the graph


def test_paired_cache_with_fp8_ds_mla_rows_captures_both_puts(device):
    """DeepSeek V3.2's pair (fp8_ds_mla main rows beside float indexer keys): the captured puts
    of both halves store exactly what put + put_indexer store, FlashMLA's bytes included."""
    main = nkv.CacheConfig(n_layers=2, n_kv_heads=1, head_dim=576, v_head_dim=0,
                           k_dtype="fp8_ds_mla", dtype="bfloat16", capacity=6, max_batch=2,
                           max_seqs=2, device=device)
    pairs = [nkv.PairedCache(main, main.replace(head_dim=16, k_dtype="bfloat16"))
             for _ in range(2)]
    step = pairs[0].capture_step(batch=2)
    rng = np.random.default_rng(23)
    for pos, seqs in (((0, 0), (0, 1)), ((1,), (1,)), ((1, 2), (0, 1))):
        pos, seqs = np.array(pos, np.int32), np.array(seqs, np.int32)
        n = len(pos)
        rows = [f32_to_bf16_bits(rng.standard_normal((2, n, 1, d)) * 4) for d in (576, 16)]
        step.replay(pos, seqs, None, [dev(x, device) for x in rows], None)
        eager = pairs[1]
        eager.start_forward(pos, seqs)
        for layer in range(2):
            eager.set_layer(layer)
            eager.put(dev(rows[0][layer], device), None)
            eager.put_indexer(dev(rows[1][layer], device))
    for half in ("main", "indexer"):
        got, want = (host(getattr(p, half).storage.keys) for p in pairs)
        np.testing.assert_array_equal(got, want)
        assert got.any()


def test_cuda_permuted_v_step_with_attention(fake_gpu):
    """cuda (stand-in CuPy, kernels in the simulator): the captured paged kernel gets V's
    transposed view as a strided descriptor of the permuted float16 storage; replays equal the
    CPU attend and store the same bytes."""
    cp, launches = fake_gpu
    cfg_kw = dict(permuted_v=True)

    def make_step():
        cache = fake_cuda_cache(cp, nkv.CacheConfig(**ATT, **cfg_kw, dtype="float16",
                                                    device="cpu"), 0x61)
        step = cache.capture_step(batch=3, attend=True, n_heads=2, scale=0.5, soft_cap=3.0)
        launches.clear()
        return cache, step
    _, step = _check_attention(make_step, cfg_kw, {}, "float16",
                               lambda x: FakeDeviceArray(np.ascontiguousarray(x), cp), 1e-5,
                               steps=_att_steps()[:2])
    assert step.replays == 2 and not launches


# ------------------------------------------------------------------ per-sequence streams

@pytest.mark.parametrize("permuted", [False, True])
def test_stream_cache_replays_store_what_direct_puts_store(device, permuted):
    """llama.cpp's per-sequence streams (``unified=False``, its default): each token's slot
    in the descriptor is its stream's pool cell; replays of 2-3 tokens with two removals
    between them leave the pool and every stream's
    cell table as start_forward + put leave them."""
    def drive(use_step):
        cache = nkv.CausalCache(_cfg(device, permuted=permuted, unified=False, capacity=7,
                                     cache_padding=1))
        _run_steps(cache, 31, use_step, n_steps=9)      # two removals
        return cache
    replayed, direct = drive(True), drive(False)
    np.testing.assert_array_equal(host(replayed.storage.keys), host(direct.storage.keys))
    np.testing.assert_array_equal(host(replayed.storage.values), host(direct.storage.values))
    for a, b in zip(replayed.streams, direct.streams):
        np.testing.assert_array_equal(a.cells.cells, b.cells.cells)


@pytest.mark.torch
def test_captured_stream_cache_attention_equals_the_cpu_attend(device, small_blocks):
    """Per-sequence streams with attention: the page lists are the pass's page table over
    the pool (each stream's cells offset into it), grown on the device while every batch
    stream's cell table changed only by the replays' placements, rebuilt otherwise (a
    removal in one stream, another batch), under chunked attention (lists cut at the front);
    replays over 2 sequences return what start_forward + put + attend return on a CPU stream
    cache."""
    cfg_kw = dict(unified=False, page_size=1, capacity=6)
    cache_kw = dict(chunk_size=4)

    built = []

    def make_step():
        cache = nkv.CausalCache(nkv.CacheConfig(**{**ATT, **cfg_kw}, dtype="float16",
                                                device=device), **cache_kw)
        assert type(cache).__name__ == "StreamCache"
        pages_of = cache._host_pages
        cache._host_pages = lambda: built.append(1) or pages_of()
        return cache, cache.capture_step(batch=3, attend=True, n_heads=2, scale=0.5,
                                         soft_cap=3.0)
    seen = []

    def removal(c):         # stream 1 forgets position 0: its list must be rebuilt
        seen.append(len(built))
        assert c.seq_rm(1, 0, 1)
    steps = _att_steps()[:3] + [(np.array([4, 3], np.int32), np.array([0, 1], np.int32)),
                                (np.array([5, 4], np.int32), np.array([0, 1], np.int32))]
    _check_attention(make_step, cfg_kw, cache_kw, "float16", _wrap_for(device),
                     2e-6 if device == "cpu" else 2e-5, steps=steps, edits={3: removal})
    if device != "cpu":
        # replay 2 (the same two streams, grown) appended on the device; replay 3 after the
        # removal rebuilt (seen[1]: removal() ran on both caches), replay 4 grew again
        assert seen[0] == 2 and len(built) == 3, (seen, built)


def test_append_lists_refuses_a_pruned_cell_its_list_still_holds():
    """The guard behind growing windowed lists across window pruning: a dropped cell of a
    listed sequence before the list's new front is fine (or of an unlisted sequence), one at
    or after it means the list holds a freed cell: refused, the lists' state untouched."""
    from numbakv.step import append_lists
    T = 2
    at = np.array([11, 13, 10, 18, 22, 26, 30, 32], np.int64)   # tok, indptr, plen, prev, ...

    def run(pruned):
        host = np.full(38, -1, np.int32)
        host[HEADER:HEADER + 3 * T] = [20, -1, 8, -1, 0, -1]    # one token: seq 0, position 8
        state = [np.array(x, np.int64) for x in ([0, 0, 0, 0], [0, 3, 3, 3], [5, 0, 0, 0],
                                                 [7, 0, 0, 0], [1, 1])]
        kept = [x.copy() for x in state]
        causal = np.ones(1, np.uint8)
        causal.flags.writeable = False      # as a step hands it: no second compiled signature
        ok = append_lists(host, 1, causal, np.zeros(T, np.uint8), T, 3, 3, 0,
                          *state, at, 1, 1, 1, np.array(pruned, np.int64).reshape(-1, 2))
        return ok, host, state, kept

    ok, host, state, _ = run([(0, 4), (2, 6)])     # before the front (5), another sequence
    assert ok
    assert list(host[13:15]) == [0, 4] and list(host[30:31]) == [20]    # 5, 6, 7 + cell 20
    assert state[2][0] == 5 and state[3][0] == 8
    ok, _, state, kept = run([(0, 4), (0, 6)])     # position 6 is still listed
    assert not ok
    for a, b in zip(state, kept):
        np.testing.assert_array_equal(a, b)


@pytest.mark.torch
def test_captured_windowed_stream_lists_grow_across_window_pruning(small_blocks):
    """Per-sequence streams under a sliding window (the simulator, the real kernels): once
    each stream's window memory drops its oldest cells every decode step, the replays still
    grow the page lists on the device (the pruned cells were already cut from the lists'
    fronts) -- no page table built after the first replay -- and return what start_forward +
    put + attend return on a CPU stream cache."""
    cfg_kw = dict(unified=False, page_size=1, capacity=6)
    cache_kw = dict(swa_window=2)
    built = []
    made = []

    def make_step():
        cache = nkv.CausalCache(nkv.CacheConfig(**{**ATT, **cfg_kw}, dtype="float16",
                                                device="sim"), **cache_kw)
        pages_of = cache._host_pages
        cache._host_pages = lambda: built.append(1) or pages_of()
        made.append(cache)
        return cache, cache.capture_step(batch=3, attend=True, n_heads=2, scale=0.5,
                                         soft_cap=3.0)
    pruned = []

    def count(c):           # before replay i: how many passes so far pruned a listed cell
        if c is made[0]:
            pruned.append(sum(st._forward is not None and st._forward.pruned is not None
                              for st in c.streams))
    steps = [(np.array([0, 0], np.int32), np.array([0, 1], np.int32))] + [
        (np.array([p, p], np.int32), np.array([0, 1], np.int32)) for p in range(1, 8)]
    _check_attention(make_step, cfg_kw, cache_kw, "float16", _wrap_for("sim"), 2e-5,
                     steps=steps, edits={i: count for i in range(2, 8)})
    assert len(built) == 1, built
    assert sum(pruned) >= 6, pruned      # both streams pruned on most replays, still grown


# ------------------------------------------------------------------ per-layer layouts

def _gemma_like(device):
    """Gemma 3's layout in miniature: a sliding-window cache for model layers 0 and 2, a full
    one for layer 1 (layer_groups [0, 1, 0])."""
    swa = nkv.CausalCache(nkv.CacheConfig(**{**ATT, "n_layers": 2}, dtype="float32",
                                          device=device), swa_window=3)
    full = nkv.CausalCache(nkv.CacheConfig(**{**ATT, "n_layers": 1}, dtype="float32",
                                           device=device))
    return nkv.WrapperCache([swa, full], layer_groups=[0, 1, 0])


@pytest.mark.torch
def test_wrapper_cache_step_equals_the_cpu_attend(device, small_blocks):
    """A WrapperCache (a cache per layer group) captured as one step per group, driven
    together: replays (per-group inputs) and an engine's prepare + put + attend per model
    layer (routed to the layer's group) store what start_forward + put store and return what
    attend returns on a CPU wrapper, the sliding-window group under its own window."""
    torch = pytest.importorskip("torch")
    from numbakv.attention import attend
    wrapper, reference = _gemma_like(device), _gemma_like("cpu")
    step = wrapper.capture_step(batch=3, attend=True, n_heads=2, scale=0.5, soft_cap=3.0)
    assert [len(s.layers) for s in step.steps] == [2, 1]
    gen = torch.Generator().manual_seed(41)
    where = [(0, 0), (1, 0), (0, 1)]            # model layer -> (group, stored layer there)
    out = dev(np.zeros((3, 2, 4), np.float32), device)
    for i, (pos, seqs) in enumerate(_att_steps()[:2]):
        n = len(pos)
        k = torch.randn(3, n, 1, 8, generator=gen)
        v = torch.randn(3, n, 1, 4, generator=gen)
        q = torch.randn(3, n, 2, 8, generator=gen)
        if i != 1:      # a replay: each group's inputs in its stored-layer order
            outs = step.replay(pos, seqs, [q[[0, 2]].numpy(), q[[1]].numpy()],
                               [k[[0, 2]].numpy(), k[[1]].numpy()],
                               [v[[0, 2]].numpy(), v[[1]].numpy()])
            got = [host(outs[g][j]) for g, j in where]
        else:           # an engine's own loop (its graph on a GPU): rows past n are padding
            step.prepare(pos, seqs)
            got = []
            for layer in range(3):
                pad = (lambda x: dev(np.concatenate(
                    [x.numpy(), np.zeros((3 - n,) + tuple(x.shape[1:]), np.float32)]), device))
                step.put(layer, pad(k[layer]), pad(v[layer]))
                step.attend(layer, pad(q[layer]), out)
                got.append(host(out)[:n].copy())
        reference.start_forward(pos, seqs)
        for layer in range(3):
            reference.set_layer(layer)
            reference.put(k[layer], v[layer])
            want = attend(q[layer], reference, scale=0.5, soft_cap=3.0).numpy()
            np.testing.assert_allclose(got[layer], want, rtol=1e-5, atol=1e-5)
    for a, b in zip(wrapper.caches, reference.caches):
        np.testing.assert_array_equal(host(a.storage.keys), b.storage.keys)
        np.testing.assert_array_equal(host(a.storage.values), b.storage.values)
        np.testing.assert_array_equal(a.cells.cells, b.cells.cells)


def test_wrapper_and_paired_capture_checks(device):
    """Refusals name the group; a per-group input list of the wrong length, or a bad layer,
    is a ValueError before anything is placed; a PairedCache captures its two halves' puts
    and refuses attention (DeepSeek's sparse attention is not the dense kernel)."""
    swa = nkv.CausalCache(nkv.CacheConfig(**{**ATT, "n_layers": 2}, device=device))
    permuted = nkv.CausalCache(nkv.CacheConfig(**{**ATT, "n_layers": 1, "n_kv_heads": 2},
                                               permuted_v=True, device=device))
    wrapper = nkv.WrapperCache([swa, permuted], layer_groups=[0, 1, 0])
    with pytest.raises(ValueError, match=r"caches\[1\].*n_heads"):    # 3 heads over 2 KV heads
        wrapper.capture_step(batch=2, attend=True, n_heads=3)
    assert wrapper.capture_step(batch=2, attend=True, n_heads=2).steps[1].attention.n_heads == 2
    step = wrapper.capture_step(batch=2)
    k = [np.zeros((2, 1, 1, 8), np.float16), np.zeros((1, 1, 2, 8), np.float16)]
    v = [np.zeros((2, 1, 1, 4), np.float16), np.zeros((1, 1, 2, 4), np.float16)]
    with pytest.raises(ValueError, match="one per group"):
        step.replay(np.array([0], np.int32), np.array([0], np.int32), None, k[:1], v)
    with pytest.raises(ValueError, match="layer must be"):
        step.put(3, k[0][0], v[0][0])
    assert swa._forward is None and swa.n_used == 0
    step.replay(np.array([0], np.int32), np.array([0], np.int32), None,
                [dev(x, device) for x in k], [dev(x, device) for x in v])
    assert swa.n_used == permuted.n_used == 1 and step.steps[1].replays == 1
    main = nkv.CacheConfig(n_layers=2, n_kv_heads=1, head_dim=16, v_head_dim=0, capacity=4,
                           max_batch=2, device=device)
    pair = nkv.PairedCache(main, main.replace(head_dim=8))
    with pytest.raises(NotSupportedError, match="sparse attention"):
        pair.capture_step(batch=2, attend=True)
    rows = [np.ones((2, 1, 1, 16), np.float16), np.full((2, 1, 1, 8), 2, np.float16)]
    pair.capture_step(batch=2).replay(np.array([0], np.int32), np.array([0], np.int32), None,
                                      [dev(x[:, :1], device) for x in rows], None)
    assert host(pair.main.storage.keys)[:, pair.main._forward.start].min() == 1
    assert host(pair.indexer.storage.keys)[:, pair.indexer._forward.start].min() == 2


def _hybrid(device):
    """A hybrid model's cache in miniature: model layers recurrent, attention, recurrent,
    attention (the attention half ATT-shaped, float32)."""
    attn = nkv.CausalCache(nkv.CacheConfig(**ATT, dtype="float32", device=device))
    rc = nkv.RecurrentCache(nkv.RecurrentConfig(2, [nkv.StateSpec("ssm", (2, 2), "float32")],
                                                max_seqs=2, device=device))
    return nkv.HybridCache(attn, rc, ["recurrent", "attention", "recurrent", "attention"])


@pytest.mark.torch
def test_hybrid_cache_step_keeps_the_recurrent_bookkeeping(device, small_blocks):
    """A HybridCache's step: the attention half's step driven after the hybrid cache's own
    start_forward (so the recurrent half's positions move with it), put / attend routed by
    model layer (a recurrent layer refused), the batch's sequence ids in the descriptor for
    the model's recurrent kernels; outputs equal attend on a CPU hybrid cache. A bare
    RecurrentCache has no put to capture and says so."""
    torch = pytest.importorskip("torch")
    from numbakv.attention import attend
    hc, reference = _hybrid(device), _hybrid("cpu")
    step = hc.capture_step(batch=3, attend=True, n_heads=2, scale=0.5)
    gen = torch.Generator().manual_seed(43)
    out = dev(np.zeros((3, 2, 4), np.float32), device)
    for i, (pos, seqs) in enumerate(_att_steps()[:2]):
        n = len(pos)
        k = torch.randn(2, n, 1, 8, generator=gen)
        v = torch.randn(2, n, 1, 4, generator=gen)
        q = torch.randn(2, n, 2, 8, generator=gen)
        if i == 0:
            got = host(step.replay(pos, seqs, q.numpy(), k.numpy(), v.numpy()))
        else:           # an engine's own loop over model layers 1 and 3
            step.prepare(pos, seqs)
            with pytest.raises(ValueError, match="recurrent layer"):
                step.put(0, dev(np.zeros((3, 1, 8), np.float32), device),
                         dev(np.zeros((3, 1, 4), np.float32), device))
            got = []
            for j, layer in enumerate((1, 3)):
                pad = (lambda x: dev(np.concatenate(
                    [x.numpy(), np.zeros((3 - n,) + tuple(x.shape[1:]), np.float32)]), device))
                step.put(layer, pad(k[j]), pad(v[j]))
                step.attend(layer, pad(q[j]), out)
                got.append(host(out)[:n].copy())
        d = host(step.inner.descriptor)
        np.testing.assert_array_equal(d[HEADER + 6:HEADER + 6 + n], seqs)
        reference.start_forward(pos, seqs)
        for j, layer in enumerate((1, 3)):
            reference.set_layer(layer)
            reference.put(k[j], v[j])
            want = attend(q[j], reference.attn, scale=0.5).numpy()
            np.testing.assert_allclose(got[j], want, rtol=1e-5, atol=1e-5)
        for s in (0, 1):
            assert hc.rc.seq_pos_max(s) == reference.rc.seq_pos_max(s)
    np.testing.assert_array_equal(host(hc.attn.storage.keys), reference.attn.storage.keys)
    with pytest.raises(NotSupportedError, match="no put to capture"):
        hc.rc.capture_step(batch=2)


def test_cuda_stream_cache_step_with_attention(fake_gpu, monkeypatch):
    """cuda (stand-in CuPy, kernels in the simulator) with per-sequence streams: one graph
    (the two list launches, then per layer a put and the attention), each replay's descriptor, page-table
    upload and list copies on the cache's stream with no host wait, outputs equal to the CPU
    attend of a CPU stream cache, pool bytes equal."""
    from numbakv import streams
    from numbakv.device import HOST_WAITS
    from numbakv.kernels import decode
    from numbakv.storage import KVStorage
    cp, launches = fake_gpu
    monkeypatch.setattr(decode, "BLOCK_CUDA", 8)
    cfg_kw = dict(unified=False, page_size=1, capacity=6)
    waits = {}

    def make_step():
        # the stand-in's pool: a cuda storage over host memory (as fake_cuda_cache builds)
        with monkeypatch.context() as m:
            m.setenv("NUMBAKV_WARM_UP", "0")
            m.setattr(streams, "KVStorage", lambda cfg, n, device: KVStorage(cfg, n, "cuda"))
            cache = nkv.CausalCache(nkv.CacheConfig(**{**ATT, **cfg_kw}, dtype="float32",
                                                    device="cpu"), swa_window=3)
        cache.device, cache._xp = "cuda", cp
        cache.use_stream(cp.cuda.ExternalStream(0x61))
        step = cache.capture_step(batch=3, attend=True, n_heads=2, scale=0.5, soft_cap=3.0)
        assert len(step.graph.nodes) == 2 * 2 + 2
        cp.log.clear()
        launches.clear()
        waits.update(HOST_WAITS)
        return cache, step
    _, step = _check_attention(make_step, cfg_kw, dict(swa_window=3), "float32",
                               lambda x: FakeDeviceArray(np.ascontiguousarray(x), cp), 1e-5,
                               steps=_att_steps()[:2])
    assert HOST_WAITS == waits
    kinds = [e[0] for e in cp.log]
    for sync in ("stream_sync", "event_sync", "device_sync", "asnumpy"):
        assert sync not in kinds
    assert all(e[1] == 0x61 for e in cp.log if e[0] in ("h2d", "d2d", "graph_launch"))
    assert kinds.count("graph_launch") == step.replays == 2
    assert not [n for n, _ in launches if n.startswith("paged")]     # only the graph's
