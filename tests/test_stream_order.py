"""Stream order across producers, the cache and consumers (issue 35, item 5).

Without a GPU: the stand-in CuPy (tests/fake_cupy.py) logs every event record, stream wait,
DLPack import and launch with its stream, and the kernels run in the simulator; these tests
check the calls come in the order that makes a consumer on another stream read K/V only after
the puts that wrote them, and the cache read its inputs only after their producer. On a GPU
(marked ``gpu``, run by ``.ci/gpu``): deliberately slow producer and cache streams
(``torch.cuda._sleep``) with the results checked."""

import sys
import types

import numpy as np
import pytest

import numbakv as nkv
from fake_cupy import FakeDeviceArray
from helpers import clear_launch_caches, emulate_cuda, fake_cuda_cache, host

CACHE = 0x61


@pytest.fixture
def fake_gpu(kernel_device, monkeypatch):
    """``(cupy stand-in, timeline)``: the stand-in's log, kernel launches included as
    ``("launch", kernel name, stream)``."""
    if kernel_device != "sim":
        pytest.skip("a real GPU runs the cuda path itself")

    def record(kernel, args):
        cp = sys.modules["cupy"]
        cp.log.append(("launch", kernel.py_func.__name__, cp.cuda.get_current_stream().ptr))
    cp = emulate_cuda(monkeypatch, record)
    yield cp, cp.log
    clear_launch_caches()


def _cfg():
    return nkv.CacheConfig(n_layers=2, n_kv_heads=2, head_dim=8, v_head_dim=4, dtype="float16",
                           capacity=8, max_seqs=2, max_batch=4, device="cpu")


def _put_one_pass(cache, cp, rng):
    cache.start_forward(np.array([0, 0], np.int32), np.array([0, 1], np.int32))
    k = rng.standard_normal((2, 2, 8)).astype(np.float16)
    v = rng.standard_normal((2, 2, 4)).astype(np.float16)
    cache.set_layer(1)
    cache.put(FakeDeviceArray(k, cp), FakeDeviceArray(v, cp))
    return k, v


def _index(timeline, entry):
    return next(i for i, e in enumerate(timeline) if e[:len(entry)] == entry)


def test_get_orders_the_current_stream_after_the_puts(fake_gpu):
    cp, timeline = fake_gpu
    cache = fake_cuda_cache(cp, _cfg(), CACHE)
    k, _ = _put_one_pass(cache, cp, np.random.default_rng(0))
    key, value, mask = cache.get()
    put_at = _index(timeline, ("launch", "put_kv_kernel", CACHE))
    record_at = max(i for i, e in enumerate(timeline) if e == ("record", CACHE))
    wait_at = _index(timeline, ("wait", 0, CACHE))
    assert put_at < record_at < wait_at, timeline
    start = cache._forward.start - cache.cell_range()[0]
    np.testing.assert_array_equal(host(key)[start:start + 2], k)


def test_no_wait_when_the_consumer_is_the_cache_stream(fake_gpu):
    cp, timeline = fake_gpu
    cache = fake_cuda_cache(cp, _cfg(), CACHE)
    _put_one_pass(cache, cp, np.random.default_rng(1))
    timeline.clear()
    with cache.storage.stream:
        cache.get()
        cache.layer_pool()
    assert not [e for e in timeline if e[0] == "wait"]


def test_every_export_waits(fake_gpu):
    """layer_pool(), page_table() and get_quantized() hand out storage (or uploads) too."""
    cp, timeline = fake_gpu
    cache = fake_cuda_cache(cp, _cfg(), CACHE)
    _put_one_pass(cache, cp, np.random.default_rng(2))
    for export in (cache.layer_pool, cache.get_quantized):
        timeline.clear()
        export()
        assert [e for e in timeline if e[0] in ("record", "wait")] == \
            [("record", CACHE), ("wait", 0, CACHE)], export


def test_a_torch_consumer_stream_waits_on_the_cache(fake_gpu):
    """What attend does for torch's current stream (torch.cuda.current_stream())."""
    cp, timeline = fake_gpu
    cache = fake_cuda_cache(cp, _cfg(), CACHE)
    torch_stream = types.SimpleNamespace(cuda_stream=0x99)
    timeline.clear()
    cache.storage.order_before(torch_stream)
    assert [e for e in timeline if e[0] in ("record", "wait")] == \
        [("record", CACHE), ("wait", 0x99, CACHE)]
    timeline.clear()
    cache.storage.order_before(types.SimpleNamespace(cuda_stream=CACHE))   # the same stream
    assert not timeline


def test_without_a_stream_of_its_own_cupys_current_stream_stands_for_the_cache(fake_gpu):
    cp, timeline = fake_gpu
    cache = fake_cuda_cache(cp, _cfg())
    _put_one_pass(cache, cp, np.random.default_rng(3))
    timeline.clear()
    cache.get()                                       # the consumer is that same stream
    assert not [e for e in timeline if e[0] == "wait"]
    timeline.clear()
    cache.storage.order_before(types.SimpleNamespace(cuda_stream=0x99))
    assert [e for e in timeline if e[0] in ("record", "wait")] == \
        [("record", 0), ("wait", 0x99, 0)]


def test_order_after_a_producer_comes_before_the_put(fake_gpu):
    """An engine handing plain CuPy arrays made on its own stream calls order_after first."""
    cp, timeline = fake_gpu
    cache = fake_cuda_cache(cp, _cfg(), CACHE)
    producer = cp.cuda.ExternalStream(0x42)
    timeline.clear()
    cache.storage.order_after(producer)
    _put_one_pass(cache, cp, np.random.default_rng(4))
    record_at = _index(timeline, ("record", 0x42))
    wait_at = _index(timeline, ("wait", CACHE, 0x42))
    put_at = _index(timeline, ("launch", "put_kv_kernel", CACHE))
    assert record_at < wait_at < put_at, timeline


class _TorchLikeOnGPU:
    """A DLPack producer on the GPU (what a torch CUDA tensor is to numbakv): the stand-in
    CuPy's from_dlpack logs the stream current at the import, which is the stream CuPy hands
    the producer to order after its own work."""

    def __init__(self, values):
        self._values = np.asarray(values)

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):  # pragma: no cover - the stand-in reads it directly
        raise AssertionError("not called by the stand-in")

    def to_host_array(self):
        return self._values


def test_dlpack_inputs_are_imported_on_the_cache_stream_before_the_put(fake_gpu):
    cp, timeline = fake_gpu
    cache = fake_cuda_cache(cp, _cfg(), CACHE)
    rng = np.random.default_rng(5)
    cache.start_forward(np.array([0], np.int32), np.array([0], np.int32))
    k = rng.standard_normal((1, 2, 8)).astype(np.float16)
    v = rng.standard_normal((1, 2, 4)).astype(np.float16)
    timeline.clear()
    cache.set_layer(0)
    cache.put(_TorchLikeOnGPU(k), _TorchLikeOnGPU(v))
    imports = [i for i, e in enumerate(timeline) if e[0] == "from_dlpack"]
    assert [timeline[i] for i in imports] == [("from_dlpack", CACHE)] * 2
    assert imports[-1] < _index(timeline, ("launch", "put_kv_kernel", CACHE))
    np.testing.assert_array_equal(host(cache.storage.keys)[0, cache._forward.start], k[0])


def test_a_step_replay_imports_dlpack_inputs_on_the_cache_stream(fake_gpu):
    cp, timeline = fake_gpu
    cache = fake_cuda_cache(cp, _cfg(), CACHE)
    step = cache.capture_step(batch=2)
    rng = np.random.default_rng(6)
    k = rng.standard_normal((2, 2, 2, 8)).astype(np.float16)
    v = rng.standard_normal((2, 2, 2, 4)).astype(np.float16)
    timeline.clear()
    step.replay(np.array([0, 0], np.int32), np.array([0, 1], np.int32), None,
                _TorchLikeOnGPU(k), _TorchLikeOnGPU(v))
    assert [e for e in timeline if e[0] == "from_dlpack"] == [("from_dlpack", CACHE)] * 2
    assert _index(timeline, ("from_dlpack",)) < _index(timeline, ("graph_launch",))


def test_no_event_crosses_a_capture(fake_gpu):
    cp, timeline = fake_gpu
    cache = fake_cuda_cache(cp, _cfg(), CACHE)
    cache.storage.stream.capturing = True
    timeline.clear()
    cache.storage.order_before(types.SimpleNamespace(cuda_stream=0x99))
    cache.storage.order_after(types.SimpleNamespace(cuda_stream=0x99))
    assert not [e for e in timeline if e[0] in ("record", "wait")]


def test_cpu_caches_have_nothing_to_order():
    cache = nkv.CausalCache(nkv.CacheConfig(1, 1, 4, capacity=4, device="cpu"))
    cache.storage.order_before()
    cache.storage.order_after(None)


# ------------------------------------------------------------------ on a GPU

def _slow(torch, stream, ms=50):
    """Keep ``stream`` busy for about ``ms`` milliseconds (a spin kernel)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(ms * 2_000_000))   # ~2 GHz clocks


@pytest.mark.gpu
@pytest.mark.torch
def test_slow_producer_stream_then_put_on_a_side_cache_stream():
    """K/V written on a slow torch stream, put by a cache on its own stream: the cache's
    import (DLPack) waits for the producer."""
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=2, head_dim=64, capacity=64, device="cuda")
    cache = nkv.CausalCache(cfg)
    cache.use_stream(cupy.cuda.Stream(non_blocking=True))
    producer = torch.cuda.Stream()
    for step in range(4):
        _slow(torch, producer)
        with torch.cuda.stream(producer):
            k = torch.full((1, 2, 64), float(step + 1), device="cuda", dtype=torch.float16)
            v = torch.full((1, 2, 64), -float(step + 1), device="cuda", dtype=torch.float16)
            cache.start_forward([step], [0])
            cache.put(k, v)
    cache.storage.stream.synchronize()
    keys = cache.storage.keys.get()[0, :4, 0, 0]
    np.testing.assert_array_equal(keys, [1, 2, 3, 4])


@pytest.mark.gpu
@pytest.mark.torch
def test_consumers_on_other_streams_read_after_a_slow_cache_stream():
    """The cache's stream is kept busy before its put; get()'s views read through DLPack on a
    torch stream, and attend on torch's stream, still see the put (the consumer waited on the
    cache's event)."""
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    from numbakv.attention import attend
    cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=1, head_dim=64, capacity=64, device="cuda")
    cache = nkv.CausalCache(cfg)
    own = cupy.cuda.Stream(non_blocking=True)
    cache.use_stream(own)
    consumer = torch.cuda.Stream()
    k = torch.ones((1, 1, 64), device="cuda", dtype=torch.float16)
    v = torch.full((1, 1, 64), 3.0, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    _slow(torch, torch.cuda.ExternalStream(own.ptr), ms=100)   # the cache's stream lags
    cache.start_forward([0], [0])
    cache.put(k, v)
    with torch.cuda.stream(consumer):
        key, value, _ = cache.get()
        seen = torch.from_dlpack(value).clone()
        q = torch.ones((1, 4, 64), device="cuda", dtype=torch.float16)
        out = attend(q, cache, backend="torch")
    consumer.synchronize()
    assert torch.all(seen == 3.0)
    assert torch.allclose(out.float(), torch.full_like(out.float(), 3.0))


#: the cache kinds a step captures beside float K/V (issue 35 session 4): one quantized side
#: (q8_0 keys, float16 values) and a V-less MLA latent (the value input zero-width)
_CAPTURED_KINDS = {
    "one-quantized-side": (dict(n_layers=2, n_kv_heads=1, head_dim=32, v_head_dim=4,
                                k_dtype="q8_0", kv_rotation="off"), {}),
    "mla-latent": (dict(n_layers=2, n_kv_heads=1, head_dim=16, v_head_dim=0),
                   dict(shift=nkv.RopeShift(base=10000.0, dim=8, offset=8)))}


@pytest.mark.parametrize("kind", sorted(_CAPTURED_KINDS))
def test_new_captured_kinds_order_on_the_cache_stream(fake_gpu, kind):
    """A step of each newly captured kind: the replay imports its DLPack inputs on the cache's
    stream before the graph launch, sends and launches everything there; an engine's own
    put/attend after prepare() launch their kernels (quantize kernel, float-side put,
    attention) on the cache's stream; a consumer on another stream then waits on it."""
    cfg_kw, cache_kw = _CAPTURED_KINDS[kind]
    cfg = nkv.CacheConfig(**cfg_kw, dtype="float16", capacity=8, max_seqs=2, max_batch=2,
                          device="cpu")
    cache = fake_cuda_cache(cp := fake_gpu[0], cfg, CACHE, **cache_kw)
    timeline = fake_gpu[1]
    step = cache.capture_step(batch=2, attend=True, n_heads=2)
    rng = np.random.default_rng(7)
    D, Dv = cfg.head_dim, cfg.v_head_dim
    k = rng.standard_normal((2, 2, 1, D)).astype(np.float16)
    v = rng.standard_normal((2, 2, 1, Dv)).astype(np.float16)
    q = rng.standard_normal((2, 2, 2, D)).astype(np.float32)
    timeline.clear()
    step.replay(np.array([0, 0], np.int32), np.array([0, 1], np.int32),
                FakeDeviceArray(q, cp), _TorchLikeOnGPU(k), _TorchLikeOnGPU(v))
    imports = [e for e in timeline if e[0] == "from_dlpack"]
    assert imports and all(e == ("from_dlpack", CACHE) for e in imports)
    assert _index(timeline, ("from_dlpack",)) < _index(timeline, ("graph_launch",))
    assert all(e[1] == CACHE for e in timeline if e[0] in ("h2d", "d2d", "graph_launch"))
    assert not [e for e in timeline if e[0] == "launch"]           # only the graph's
    # an engine's own graph: prepare, then put and attend per layer on the cache's stream
    timeline.clear()
    step.prepare(np.array([1], np.int32), np.array([0], np.int32))
    out = FakeDeviceArray(np.zeros((2, 2, step.attention.v_dim), np.float32), cp)
    with cache.storage.stream:
        for layer in range(2):
            step.put(layer, step.key[layer], step.value[layer])
            step.attend(layer, step.query[layer], out)
    launched = [e for e in timeline if e[0] == "launch"]
    names = {e[1] for e in launched}
    # a latent cache's attention is the latent kernel (one staged row serves a tile of heads)
    attention_kernel = "paged_latent_kernel" if kind == "mla-latent" else "paged_attention_kernel"
    assert attention_kernel in names and all(e[2] == CACHE for e in launched), launched
    if kind == "one-quantized-side":
        assert {"quant_put_kernel", "put_kv_kernel"} <= names
    timeline.clear()
    cache.storage.order_before(types.SimpleNamespace(cuda_stream=0x99))
    assert [e for e in timeline if e[0] in ("record", "wait")] == \
        [("record", CACHE), ("wait", 0x99, CACHE)]
