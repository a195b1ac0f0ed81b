"""A stand-in ``cupy`` over host memory, so the ``cuda`` code paths (descriptors, packed
host-to-device copies through pinned staging buffers, streams, events, kernel preloading) run
without a GPU. It records what a real GPU would be asked to do: every async copy with its
stream, every event recorded, every stream context entered."""

from __future__ import annotations

import types as _t

import numpy as np


class FakeEvent:
    """An event whose completion the test controls (``done`` is False until ``complete()``; a
    real event completes when the GPU reaches it)."""

    log = None  # the owning module's call log

    def __init__(self, block=False, disable_timing=True, interprocess=False):
        self.done = True
        self.recorded_on = None

    def record(self, stream=None):
        self.recorded_on = stream
        self.done = not getattr(stream, "hold_events", False)
        if self.log is not None:
            self.log.append(("record", getattr(stream, "ptr", None)))
        if stream is not None:
            stream.events.append(self)

    def complete(self):
        self.done = True

    def synchronize(self):
        if self.log is not None:
            self.log.append(("event_sync", getattr(self.recorded_on, "ptr", None)))
        self.done = True


class FakeStream:
    """A CUDA stream: a handle (``ptr``), whether it is capturing a graph, and (like CuPy's
    streams) a context manager making it current."""

    def __init__(self, module, ptr: int, capturing: bool = False):
        self._m = module
        self.ptr = ptr
        self.capturing = capturing
        self.hold_events = False   # events recorded on it stay pending until complete()
        self.events = []
        self.synchronized = 0

    def is_capturing(self):
        return self.capturing

    def synchronize(self):
        if self.capturing:
            raise RuntimeError("cudaErrorStreamCaptureUnsupported: synchronize while capturing")
        self.synchronized += 1
        self._m.log.append(("stream_sync", self.ptr))

    def wait_event(self, event):
        """``cudaStreamWaitEvent``: logged with the stream the event was recorded on."""
        self._m.log.append(("wait", self.ptr, getattr(event.recorded_on, "ptr", None)))

    def begin_capture(self, mode=None):
        """Start capturing: launches made while this stream is current are kept (see
        tests/helpers.emulate_cuda), not run, until :meth:`end_capture` hands them out as a
        graph."""
        self.capturing = True
        self.graph_nodes = []
        self._m.log.append(("begin_capture", self.ptr))

    def end_capture(self):
        nodes, self.graph_nodes = self.graph_nodes, None
        self.capturing = False
        self._m.log.append(("end_capture", self.ptr))
        return FakeGraph(self._m, nodes)

    graph_nodes = None

    def __enter__(self):
        self._m._stack.append(self)
        return self

    def __exit__(self, *exc):
        self._m._stack.pop()


class FakeGraph:
    """A captured graph: the launches kept during capture, run again by every :meth:`launch`."""

    def __init__(self, module, nodes):
        self._m = module
        self.nodes = nodes

    def launch(self, stream=None):
        self._m.log.append(("graph_launch", getattr(stream, "ptr", None), len(self.nodes)))
        for node in self.nodes:
            node()


class FakeDeviceArray:
    def __init__(self, a, module=None):
        self._a = a
        self._m = module
        self.data = _t.SimpleNamespace(ptr=a.ctypes.data, copy_from_host_async=self._copy_in,
                                       copy_to_host_async=self._copy_out)

    @property
    def __cuda_array_interface__(self):
        """Device memory, as far as numbakv can tell (the bytes are host memory here)."""
        return {"shape": self._a.shape, "strides": self._a.strides, "typestr": self._a.dtype.str,
                "data": (self._a.ctypes.data, False), "version": 3}

    def _copy_in(self, src_ptr, nbytes, stream):
        import ctypes
        src_ptr = src_ptr if isinstance(src_ptr, int) else src_ptr.value  # as CuPy accepts
        ctypes.memmove(self._a.ctypes.data, src_ptr, nbytes)
        if self._m is not None:
            self._m.log.append(("h2d", stream.ptr, nbytes, src_ptr))

    def _copy_out(self, dst_ptr, nbytes, stream):
        """Device to host (the array must be contiguous, as CuPy's memory pointer is)."""
        import ctypes
        assert self._a.flags.c_contiguous
        dst_ptr = dst_ptr if isinstance(dst_ptr, int) else dst_ptr.value
        ctypes.memmove(dst_ptr, self._a.ctypes.data, nbytes)
        if self._m is not None:
            self._m.log.append(("d2h", stream.ptr, nbytes, dst_ptr))

    shape = property(lambda self: self._a.shape)
    strides = property(lambda self: self._a.strides)
    dtype = property(lambda self: self._a.dtype)
    itemsize = property(lambda self: self._a.itemsize)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)

    def __getitem__(self, idx):
        return FakeDeviceArray(self._a[idx], self._m)

    def __setitem__(self, idx, value):
        """An element-wise copy kernel on the current stream."""
        if self._m is not None:
            self._m.log.append(("copy_kernel", self._m.cuda.get_current_stream().ptr))
        self._a[idx] = value._a if isinstance(value, FakeDeviceArray) else value

    flags = property(lambda self: self._a.flags)

    def view(self, dtype):
        return FakeDeviceArray(self._a.view(dtype), self._m)

    def reshape(self, *shape):
        return FakeDeviceArray(self._a.reshape(*shape), self._m)

    def transpose(self, *axes):
        return FakeDeviceArray(self._a.transpose(*axes), self._m)

    def set(self, host, stream=None):
        self._a[...] = np.asarray(host).reshape(self._a.shape)

    def get(self):
        return self._a.copy()


def _pinned(nbytes, log):
    """Pinned host memory: a buffer numpy can wrap (``np.frombuffer``), as CuPy's is."""
    log.append(("pinned_alloc", nbytes))
    return bytearray(nbytes)


class _FakeDevice:
    """``cupy.cuda.Device(i)``: its compute capability and SM count, and a context manager."""

    def __init__(self, cc):
        self.compute_capability = cc
        self.attributes = {"MultiProcessorCount": 2}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        self.log.append(("device_sync", None))


def fake_cupy(device_cc: str = "80"):
    """A module object to put in ``sys.modules['cupy']``."""
    m = _t.ModuleType("cupy")
    m.log = []
    m._stack = []
    null = FakeStream(m, 0)
    m.null_stream = null

    class Event(FakeEvent):
        log = m.log

    def current():
        return m._stack[-1] if m._stack else null

    def _make_device(i):
        dev = _FakeDevice(device_cc)
        dev.log = m.log
        return dev

    def external(ptr, device_id=-1):
        return FakeStream(m, int(ptr))

    def wrap(a):
        return FakeDeviceArray(a, m)

    m.ndarray = FakeDeviceArray
    m.float32 = np.float32
    m.uint16 = np.uint16
    m.empty = lambda shape, dtype=np.float32: wrap(np.empty(shape, dtype))
    m.zeros = lambda shape, dtype=np.float32: wrap(np.zeros(shape, dtype))
    m.asarray = lambda a: a if isinstance(a, FakeDeviceArray) else wrap(np.array(a))

    def ascontiguousarray(a):
        # a kernel (for a strided view) or nothing, on the current stream
        m.log.append(("contiguous", current().ptr))
        return a if a._a.flags.c_contiguous else wrap(np.ascontiguousarray(a._a))

    def from_dlpack(obj):
        m.log.append(("from_dlpack", current().ptr))
        obj = getattr(obj, "source", obj)   # numbakv's bfloat16 re-tagging proxy
        return wrap(obj.to_host_array())

    def asnumpy(a, stream=None):
        m.log.append(("asnumpy", getattr(stream, "ptr", None)))
        return a._a.copy()

    m.ascontiguousarray = ascontiguousarray
    m.from_dlpack = from_dlpack
    m.asnumpy = asnumpy
    def memcpy_async(dst, src, nbytes, kind, stream_ptr):
        """cudaMemcpyAsync over host memory; logged as MemoryPointer's copies are."""
        import ctypes
        assert kind in (1, 3), "only host-to-device and device-to-device copies are expected"
        ctypes.memmove(int(dst), int(src), int(nbytes))
        m.log.append(("h2d" if kind == 1 else "d2d", int(stream_ptr), int(nbytes), int(src)))

    m.cuda = _t.SimpleNamespace(
        runtime=_t.SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1,
                                   memcpyAsync=memcpy_async,
                                   deviceSynchronize=lambda: m.log.append(("device_sync", None))),
        get_current_stream=current,
        Stream=lambda non_blocking=False: FakeStream(m, 0x5000 + len(m.log)),
        ExternalStream=external,
        Event=Event,
        alloc_pinned_memory=lambda n: _pinned(n, m.log),
        Device=lambda i=0: _make_device(i),
    )
    return m
