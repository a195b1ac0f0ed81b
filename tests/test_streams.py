"""The stream contract of a ``cuda`` storage, checked without a GPU: a stand-in CuPy
(tests/fake_cupy.py) records streams, events, pinned buffers and copies, and the kernels run in
Numba's simulator on the memory the descriptors point to."""

import gc
import weakref

import numpy as np
import pytest

from numbakv.config import CacheConfig, RopeShift
from numbakv.kernels import launch, mask, move, put, rope
from numbakv.storage import KVStorage
from fake_cupy import FakeDeviceArray
from helpers import random_storage


def _storage(dtype="float16", permuted=False):
    cfg = CacheConfig(2, 2, 8, v_head_dim=4, dtype=dtype, permuted_v=permuted)
    return KVStorage(cfg, 12, "cuda")


def _every_operation(st, cp, rng):
    key = FakeDeviceArray(random_storage(rng, (3, 2, 8), "float16"), cp)
    value = FakeDeviceArray(random_storage(rng, (3, 2, 4), "float16"), cp)
    st.put(1, np.array([9, -1, 4], np.int32), key, value)
    st.put_range(0, 5, key, value)
    out = st.new_mask(4, 6)
    st.fill_mask(out, np.arange(6, dtype=np.int32), np.ones((6, 4), np.uint64),
                 np.array([5], np.int32), np.array([0], np.int32), np.array([1], np.uint8))
    st.move_blocks(np.array([[5, 0, 3]]))
    st.rotate(np.array([0, 1], np.int32), np.array([3, -2]), RopeShift(dim=8))
    return key, value


class _TorchStream:
    """What torch.cuda.current_stream() looks like to numbakv: an int ``cuda_stream``."""

    def __init__(self, handle):
        self.cuda_stream = handle


@pytest.mark.parametrize("make", [lambda cp: 0x1234, lambda cp: _TorchStream(0x777),
                                  lambda cp: cp.cuda.ExternalStream(0x999)],
                         ids=["raw-handle", "torch-stream", "cupy-stream"])
def test_every_launch_and_copy_goes_on_the_chosen_stream(fake_gpu, make):
    cp, launches = fake_gpu
    st = _storage()
    stream = make(cp)
    handle = getattr(stream, "cuda_stream", getattr(stream, "ptr", stream))
    st.use_stream(stream)
    assert st.stream.ptr == handle
    launches.clear()
    cp.log.clear()
    key, _ = _every_operation(st, cp, np.random.default_rng(0))
    names = {name for name, _ in launches}
    assert {"put_kv_kernel", "mask_fill_kernel", "move_runs_kernel",
            "rope_shift_kernel"} <= names
    assert {ptr for _, ptr in launches} == {handle}
    copies = [e for e in cp.log if e[0] == "h2d"]
    assert copies and {e[1] for e in copies} == {handle}
    # the data landed (put at slots 9 and 4 of layer 1, then the range at 5.. of layer 0)
    assert np.array_equal(st.keys._a[1, 9], key._a[0])


def test_put_inputs_stay_alive_until_an_event_on_the_stream_passed(fake_gpu):
    cp, _ = fake_gpu
    st = _storage()
    stream = cp.cuda.ExternalStream(0x42)
    stream.hold_events = True   # the GPU is behind: events stay pending until complete()
    st.use_stream(stream)
    rng = np.random.default_rng(1)
    key = FakeDeviceArray(random_storage(rng, (2, 2, 8), "float16"), cp)
    value = FakeDeviceArray(random_storage(rng, (2, 2, 4), "float16"), cp)
    refs = [weakref.ref(key), weakref.ref(value)]
    st.put(0, np.array([1, 2], np.int32), key, value)
    del key, value
    gc.collect()
    assert all(r() is not None for r in refs)          # queued, not yet consumed
    st.new_mask(1, 1)                                   # next forward: an event covers them
    gc.collect()
    assert all(r() is not None for r in refs)          # the event has not passed
    for ev in stream.events:
        ev.complete()
    st.new_mask(1, 1)
    gc.collect()
    assert all(r() is None for r in refs)              # released once the stream ran past


def test_a_mask_is_not_recycled_before_the_stream_consumed_it(fake_gpu):
    cp, _ = fake_gpu
    st = _storage()
    stream = cp.cuda.ExternalStream(0x43)
    stream.hold_events = True
    st.use_stream(stream)
    first = st.new_mask(2, 3)
    ref = weakref.ref(first)
    table = FakeDeviceArray(np.zeros(4, np.int32), cp)   # e.g. a page table
    table_ref = weakref.ref(table)
    st.retire(table)
    del first, table
    st.new_mask(2, 3)   # the next forward pass
    gc.collect()
    assert ref() is not None and table_ref() is not None
    for ev in stream.events:
        ev.complete()
    st.new_mask(2, 3)
    gc.collect()
    assert ref() is None and table_ref() is None


def test_host_inputs_travel_through_pinned_reused_buffers(fake_gpu):
    cp, _ = fake_gpu
    st = _storage()
    stream = cp.cuda.ExternalStream(0x44)
    st.use_stream(stream)
    stream.hold_events = True
    cp.log.clear()
    out = st.new_mask(2, 6)
    args = (np.arange(6, dtype=np.int32), np.ones((6, 4), np.uint64), np.array([5], np.int32),
            np.array([0], np.int32), np.array([1], np.uint8))
    st.fill_mask(out, *args)
    st.fill_mask(out, *args)
    srcs = [e[3] for e in cp.log if e[0] == "h2d"]
    assert len(srcs) == 2 and srcs[0] != srcs[1]   # the first buffer's copy may not have run
    for ev in stream.events:
        ev.complete()
    st.fill_mask(out, *args)
    srcs = [e[3] for e in cp.log if e[0] == "h2d"]
    assert srcs[2] in srcs[:2]                      # reused once its copy has passed
    assert sum(e[0] == "pinned_alloc" for e in cp.log) == 2
    pinned = launch._STAGING[(0, 0x44)]
    assert all(slot[0] >= 16 for slot in pinned._free + pinned._busy)


def test_no_implicit_synchronisation_while_capturing_a_graph(fake_gpu):
    cp, launches = fake_gpu
    st = _storage()
    stream = cp.cuda.ExternalStream(0x45)
    st.use_stream(stream)
    stream.capturing = True
    cp.log.clear()
    launches.clear()
    _every_operation(st, cp, np.random.default_rng(2))
    st.new_mask(1, 1)
    kinds = {e[0] for e in cp.log}
    assert "h2d" in kinds and launches                      # the work was queued (captured)
    assert not kinds & {"record", "event_sync", "stream_sync"}, kinds
    staged = launch._STAGING[(0, 0x45)]
    assert staged.captured and not staged._free and not staged._busy   # kept for replays
    # the device buffers the captured kernels read are kept too, beside their pinned sources
    assert any(isinstance(x, FakeDeviceArray) for x in staged.captured)
    stream.capturing = False
    st.new_mask(1, 1)                                        # after capture: covered by an event
    assert ("record", 0x45) in cp.log


def test_use_stream_checks_its_argument(fake_gpu):
    st = _storage()
    for bad in ("stream", -1, 1.5, True):
        with pytest.raises(ValueError, match="stream"):
            st.use_stream(bad)
    assert st.stream is None
    cpu = KVStorage(CacheConfig(1, 1, 4), 4, "cpu")
    cpu.use_stream(None)
    with pytest.raises(ValueError, match="stream applies to a cuda cache"):
        cpu.use_stream(0x1234)


def test_warm_up_loads_every_kernel_the_first_forward_needs(fake_gpu, monkeypatch):
    """Constructing a cuda storage compiles and loads the kernels (signatures) that puts, masks,
    block moves (both kernels) and rotations of that storage then launch: none is loaded later."""
    cp, _ = fake_gpu
    loads = []

    def record(kernel, key, sig, device_id):
        loads.append(key)
        return None   # no GPU: the dispatcher (the simulator here) runs the launch
    monkeypatch.setattr(launch, "_load", record)
    monkeypatch.setattr(launch, "_FAST_ENABLED", True)
    real = put._launch

    def launch_via_fast_path(device, kernel, grid, block, args):
        launch._fast_kernel(kernel, args, 0)   # what the real launcher asks first
        real(device, kernel, grid, block, args)
    for mod in (put, mask, move, rope):
        monkeypatch.setattr(mod, "_launch", launch_via_fast_path)
    for dtype, permuted in (("float16", False), ("bfloat16", True), ("float32", True)):
        loads.clear()
        cfg = CacheConfig(2, 2, 8, v_head_dim=4, dtype=dtype, permuted_v=permuted)
        st = KVStorage(cfg, 12, "cuda")
        warmed = set(loads)
        assert {k[0] for k in warmed} >= {id(put.put_kv_kernel), id(mask.mask_fill_kernel),
                                          id(move.move_cells_kernel), id(move.move_lanes_kernel),
                                          id(rope.rope_shift_kernel)}
        loads.clear()
        rng = np.random.default_rng(3)
        key = FakeDeviceArray(random_storage(rng, (3, 2, 8), dtype), cp)
        value = FakeDeviceArray(random_storage(rng, (3, 2, 4), dtype), cp)
        st.put(1, np.array([9, -1, 4], np.int32), key, value)
        st.put_range(0, 5, key, value)
        st.fill_mask(st.new_mask(2, 6), np.arange(6, dtype=np.int32), np.ones((6, 4), np.uint64),
                     np.array([5], np.int32), np.array([0], np.int32), np.array([1], np.uint8))
        st.move_blocks(np.array([[5, 0, 3]]))            # independent: the cells kernel
        st.move_blocks(np.array([[0, 1, 3], [1, 0, 1]]))  # overlapping: the lanes kernel
        st.rotate(np.array([0, 1], np.int32), np.array([3, -2]), RopeShift(dim=8))
        assert set(loads) <= warmed, (dtype, permuted, set(loads) - warmed)
        assert len({k[0] for k in loads}) == 5


def test_causal_cache_use_stream_on_the_cpu():
    import numbakv as nkv
    cache = nkv.CausalCache(CacheConfig(1, 1, 4, capacity=4, device="cpu"))
    cache.use_stream(None)
    with pytest.raises(ValueError, match="stream"):
        cache.use_stream(0x1234)


@pytest.mark.torch
def test_torch_stream_example_runs(capsys):
    pytest.importorskip("torch")
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "torch_stream.py"
    spec = importlib.util.spec_from_file_location("torch_stream", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--device", "cpu", "--steps", "3"]) == 0
    assert capsys.readouterr().out.startswith("ok: 3 steps on cpu")


@pytest.mark.gpu
@pytest.mark.torch
def test_side_stream_race_on_a_gpu():
    """Issue 15's repro on real hardware: K/V produced on a torch side stream while the NULL
    stream is busy, put, freed and their memory reused at once; the cache must hold what was
    put."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "torch_stream.py"
    spec = importlib.util.spec_from_file_location("torch_stream", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--device", "cuda", "--steps", "32"]) == 0


# ------------------------------------------------------------------ device-resident positions
# start_forward's positions/seqs given as GPU arrays: read back on the cache's own stream into a
# pinned, reused buffer, synchronising that stream only; refused during graph capture.

class _DLPackOnGPU:
    """What a torch CUDA tensor looks like to numbakv: a CUDA ``__dlpack_device__`` (and no
    CUDA array interface, so the DLPack route is the one taken)."""

    def __init__(self, values):
        self._values = np.asarray(values)

    def __dlpack_device__(self):
        return (2, 0)   # kDLCUDA, device 0

    def __dlpack__(self, stream=None):  # pragma: no cover - the stand-in CuPy reads it directly
        raise AssertionError("not called by the stand-in")

    def to_host_array(self):
        return self._values


def _cache_on(cp, stream):
    """A CausalCache whose storage reports ``stream`` as its own (what use_stream sets on a cuda
    cache; the cache itself runs on the CPU here, its bookkeeping is the same)."""
    import numbakv as nkv
    cache = nkv.CausalCache(CacheConfig(1, 1, 4, capacity=16, max_seqs=2, max_batch=4,
                                        device="cpu"))
    cache.storage._stream = stream
    return cache


def _table(cache):
    t = cache.cells
    return (t.cells.tobytes(), t._occ.tobytes(), t._ftree.tobytes(), t._stree.tobytes(),
            t._sidx.tobytes(), t._meta.tobytes(), cache._forward)


@pytest.mark.parametrize("kind", ["cuda-array-interface", "dlpack"])
def test_device_positions_are_read_back_on_the_cache_stream(fake_gpu, kind):
    cp, _ = fake_gpu
    stream = cp.cuda.ExternalStream(0x77)
    cache = _cache_on(cp, stream)
    cp.log.clear()

    def on_gpu(values, dtype):
        if kind == "dlpack":
            return _DLPackOnGPU(np.asarray(values, dtype))
        wide = FakeDeviceArray(np.repeat(np.asarray(values, dtype), 2), cp)
        return wide[::2]   # a strided device view: made contiguous on the stream first
    for step, (pos, seqs) in enumerate((([0, 1, 2], [0, 0, 1]), ([3], [0]), ([3, 4], [1, 1]))):
        cache.start_forward(on_gpu(pos, np.int64), on_gpu(seqs, np.int32))
        assert cache._forward.positions.tolist() == pos
        assert cache._forward.seqs.tolist() == seqs
    kinds = [e[0] for e in cp.log]
    copies = [e for e in cp.log if e[0] == "d2h"]
    assert len(copies) == 6 and {e[1] for e in copies} == {0x77}
    assert {e[1] for e in cp.log if e[0] in ("contiguous", "from_dlpack")} == {0x77}
    assert ("stream_sync", 0x77) in cp.log and stream.synchronized == 6
    assert not {"device_sync", "asnumpy"} & set(kinds), kinds
    assert {e[1] for e in cp.log if e[0] == "stream_sync"} == {0x77}
    # one pinned buffer, reused by every read-back
    assert kinds.count("pinned_alloc") <= 1 and len({e[3] for e in copies}) == 1


def test_device_positions_without_a_set_stream_use_cupys_current_stream(fake_gpu):
    cp, _ = fake_gpu
    cache = _cache_on(cp, None)
    cp.log.clear()
    current = cp.cuda.ExternalStream(0x88)
    with current:
        cache.start_forward(FakeDeviceArray(np.array([0, 1], np.int32), cp),
                            FakeDeviceArray(np.array([1, 1], np.int32), cp))
    assert {e[1] for e in cp.log if e[0] in ("d2h", "stream_sync")} == {0x88}
    assert not any(e[0] in ("device_sync", "asnumpy") for e in cp.log)
    assert cache._forward.seqs.tolist() == [1, 1]


@pytest.mark.parametrize("which", ["positions", "seqs", "both"])
def test_device_positions_are_refused_during_graph_capture_and_nothing_changes(fake_gpu, which):
    cp, _ = fake_gpu
    stream = cp.cuda.ExternalStream(0x79)
    cache = _cache_on(cp, stream)
    cache.start_forward([0, 1], [0, 0])
    before = _table(cache)
    stream.capturing = True
    cp.log.clear()
    pos = np.array([2, 3], np.int32)
    seqs = np.array([0, 0], np.int32)
    if which in ("positions", "both"):
        pos = FakeDeviceArray(pos, cp)
    if which in ("seqs", "both"):
        seqs = _DLPackOnGPU(seqs)
    with pytest.raises(ValueError, match=r"must be a host array .*capturing a CUDA graph.*"
                                         r"positions/seqs as host arrays inside graph capture"):
        cache.start_forward(pos, seqs)
    assert _table(cache) == before
    assert not any(e[0] in ("d2h", "stream_sync", "device_sync", "contiguous", "from_dlpack",
                            "asnumpy") for e in cp.log), cp.log
    # host arrays are fine while capturing: the cache's bookkeeping is on the host
    cache.start_forward(np.array([2, 3], np.int32), np.array([0, 0], np.int32))
    assert cache._forward.positions.tolist() == [2, 3]


def test_hf_reads_gpu_positions_back_on_the_cache_stream(fake_gpu):
    """hf.attach's start_forward reads GPU positions back once, on the stream of the cache (or,
    for a WrapperCache, of its caches), not on CuPy's current one."""
    import numbakv as nkv
    from numbakv import hf
    cp, _ = fake_gpu
    stream = cp.cuda.ExternalStream(0x7A)
    cache = _cache_on(cp, stream)
    assert hf._cache_stream(cache) is stream
    cfg = CacheConfig(1, 1, 4, capacity=16, max_seqs=2, max_batch=4, device="cpu")
    wrapper = nkv.WrapperCache([nkv.CausalCache(cfg), nkv.CausalCache(cfg)])
    assert hf._cache_stream(wrapper) is None
    for c in wrapper.caches:
        c.storage._stream = stream
    assert hf._cache_stream(wrapper) is stream


def test_page_table_is_one_staged_async_copy_on_the_given_stream(fake_gpu):
    """pages.to_device on cuda: every array of the table in one host-to-device copy from the
    reused pinned staging, on the current (the cache's) stream; the device arrays read back
    equal the host ones (no pinned allocation or pageable upload per pass)."""
    from numbakv import pages as pages_mod
    cp, _ = fake_gpu
    rng = np.random.default_rng(4)
    arrays = {name: rng.integers(0, 50, 3 + i).astype(np.int32)
              for i, name in enumerate(pages_mod.FIELDS)}
    arrays["kv_last_page_len"] = np.zeros(0, np.int32)          # an empty field too
    host = pages_mod.HostPages(arrays, pages_mod.MaskRule(np.ones(3, np.uint8), -1, 0),
                               None, None, True)
    stream = cp.cuda.ExternalStream(0x4242)
    cp.log.clear()
    with stream:
        table = pages_mod.to_device(host, "cuda")
    copies = [e for e in cp.log if e[0] == "h2d"]
    assert len(copies) == 1 and copies[0][1] == 0x4242
    for name in pages_mod.FIELDS:
        got = getattr(table, name).get()
        assert got.dtype == np.int32 and np.array_equal(got, arrays[name]), name
