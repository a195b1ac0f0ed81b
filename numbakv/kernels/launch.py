"""The CUDA launch path of the kernels, and the cubin linking it relies on.

Launching: ``cpu`` runs the ``@njit`` twins on numpy arrays; ``sim`` runs the ``@cuda.jit``
kernels through Numba's dispatcher (the simulator); ``cuda`` launches the same kernels on CuPy
arrays. Numba's dispatcher spends tens of microseconds per launch typing and wrapping each
argument, so on ``cuda`` each kernel is compiled once per exact signature (every array typed
``'A'``), linked to a cubin for the device (:func:`link_cubin`), loaded through CuPy's driver API
and launched with a flat, preallocated parameter buffer (:class:`FastKernel`): a few
microseconds of host time per launch. The dispatcher stays as the fallback
(``NUMBAKV_FAST_LAUNCH=0`` forces it). Host staging for small per-launch arrays
(:class:`HostStaging`, :func:`to_device`, :func:`device_arg`) lives here too.

No compiled code lives here: the element math the kernels share is ``_common.py``'s.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import struct
import threading
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from numba import types

from ..device import HOST_WAITS, capturing, device_to_host, host_wait  # noqa: F401 - re-exported
from ._common import Desc, _DeviceView, desc_of

def link_cubin(ptx: str, cc: Tuple[int, int]) -> Tuple[bytes, str]:
    """``(cubin, info log)``: ``ptx`` linked by nvJitLink (through ``cuda.core``) for ``sm_XY``.
    Runs without a GPU or driver; a cubin loads on any driver that supports the architecture,
    whatever PTX ISA version the toolkit emitted."""
    from cuda.core import Linker, LinkerOptions, ObjectCode
    linker = Linker(ObjectCode.from_ptx(ptx.encode()),
                    options=LinkerOptions(arch=f"sm_{cc[0]}{cc[1]}", verbose=True))
    cubin = linker.link("cubin")
    return bytes(cubin.code), linker.get_info_log() or ""


def numba_type(x) -> types.Type:
    """The Numba type a kernel argument is compiled for on the fast path: arrays as ``'A'``
    layout (strided) so contiguous and strided inputs share one compiled kernel; scalars int64."""
    if isinstance(x, Desc):
        from numba.np.numpy_support import from_dtype
        return types.Array(from_dtype(x.dtype), len(x.shape), "A")
    return types.int64


def _flatten(args: Sequence[Any]) -> List[int]:
    """Kernel parameters as Numba lays them out: per array meminfo, parent, nitems, itemsize,
    data, shape..., strides... (all 64-bit); per int64 scalar the value."""
    out: List[int] = []
    add = out.extend
    for a in args:
        if type(a) is Desc:
            add((0, 0, math.prod(a.shape), a.dtype.itemsize, a.ptr))
            add(a.shape)
            add(a.strides)
        else:
            out.append(int(a))
    return out


def _flat_offsets(args: Sequence[Any]) -> List[int]:
    """Where each argument starts in :func:`_flatten`'s list."""
    out, pos = [], 0
    for a in args:
        out.append(pos)
        pos += 5 + 2 * len(a.shape) if type(a) is Desc else 1
    return out


def _sig_key(args: Sequence[Any]) -> tuple:
    """A cheap hashable stand-in for the Numba signature of ``args`` (building Numba types costs
    tens of microseconds per launch)."""
    return tuple((a.dtype, len(a.shape)) if type(a) is Desc else None for a in args)


def _n_flat(sig: Sequence[types.Type]) -> int:
    n = 0
    for t in sig:
        n += 5 + 2 * t.ndim if isinstance(t, types.Array) else 1
    return n


_ENTRY = re.compile(r"\.entry\s+(\S+)\s*\((.*?)\)", re.S)


def ptx_entry(py_func, sig: Tuple[types.Type, ...], cc: Tuple[int, int]):
    """``(ptx, entry name, number of parameters)`` of ``py_func`` compiled for ``sig``; raises
    unless the entry takes exactly the 64-bit parameters :func:`_flatten` produces (so the fast
    path can never pass a kernel a misaligned argument list)."""
    from numba import cuda
    from ._registry import ensure_cuda
    ensure_cuda()                 # the kernel modules' globals: real CUDA objects, not stand-ins
    ptx, _ = cuda.compile_ptx(py_func, sig, cc=cc)
    m = _ENTRY.search(ptx)
    if m is None:
        raise RuntimeError("no kernel entry in the PTX")
    params = re.findall(r"\.param\s+\.(\w+)", m.group(2))
    expected = _n_flat(sig)
    if len(params) != expected or any(p not in ("u64", "s64", "b64") for p in params):
        raise RuntimeError(f"unexpected kernel parameters ({len(params)} {set(params)}, "
                           f"expected {expected} x u64)")
    return ptx, m.group(1), expected


def device_cc(device_id: int) -> Tuple[int, int]:
    """Compute capability ``(major, minor)`` of CUDA device ``device_id`` (through CuPy)."""
    import cupy
    text = str(cupy.cuda.Device(device_id).compute_capability)
    return int(text[:-1]), int(text[-1])


def load_image(ptx: str, cc: Tuple[int, int]) -> Tuple[bytes, str]:
    """``(image, kind)`` to hand ``cuModuleLoadData``: a cubin linked by nvJitLink for exactly
    ``sm_XY`` when nvJitLink is available (``kind`` ``"cubin"``), else the NUL-terminated PTX
    (``"ptx"``). A cubin loads on any driver that knows the architecture; PTX from NVVM 12.9
    (``.version 8.8``) needs a 12.9+ driver (R575+), and older drivers (R535-R570) would refuse
    every kernel and push each launch onto Numba's dispatcher."""
    try:
        return link_cubin(ptx, cc)[0], "cubin"
    except Exception:  # noqa: BLE001 - no nvJitLink / cuda.core: the driver JITs the PTX
        return ptx.encode() + b"\0", "ptx"


_SOURCE_HASH: List[str] = []


def _kernels_source_hash() -> str:
    """A digest of every kernel module's source and of the compiler versions: a cached cubin is
    used only by the exact code and toolchain that built it."""
    if not _SOURCE_HASH:
        import hashlib
        import pathlib
        import numba
        h = hashlib.sha256()
        for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
        try:
            from importlib.metadata import version
            h.update(version("numba-cuda").encode())
        except Exception:  # noqa: BLE001
            pass
        h.update(numba.__version__.encode())
        _SOURCE_HASH.append(h.hexdigest()[:24])
    return _SOURCE_HASH[0]


def image_cache_dir() -> Optional[str]:
    """Where linked kernels are kept between processes (``NUMBAKV_CACHE_DIR``, default
    ``~/.cache/numbakv/kernels``; ``NUMBAKV_CACHE_DIR=""`` turns the cache off)."""
    d = os.environ.get("NUMBAKV_CACHE_DIR")
    if d is None:
        d = os.path.join(os.path.expanduser("~"), ".cache", "numbakv", "kernels")
    return d or None


def _image_path(py_func, sig, cc) -> Optional[str]:
    d = image_cache_dir()
    if d is None:
        return None
    import hashlib
    text = f"{py_func.__module__}.{py_func.__qualname__}|{sig}|{cc}|{_kernels_source_hash()}"
    return os.path.join(d, hashlib.sha256(text.encode()).hexdigest()[:32] + ".bin")


def cached_image(py_func, sig: Tuple[types.Type, ...], cc: Tuple[int, int]):
    """``(image, kind, entry name, number of parameters)`` of ``py_func`` for ``sig`` on a device
    of compute capability ``cc``: from the disk cache when this code and toolchain linked it
    before (the warm-up of a later process then costs a file read instead of NVVM + nvJitLink),
    else compiled, linked and stored (best effort: an unwritable cache only costs time)."""
    import pickle
    path = _image_path(py_func, sig, cc)
    if path is not None and os.path.exists(path):
        try:
            with open(path, "rb") as f:
                image, kind, name, expected = pickle.load(f)
            if isinstance(image, bytes) and kind in ("cubin", "ptx"):
                return image, kind, name, int(expected)
        except Exception:  # noqa: BLE001 - a damaged entry: rebuild it
            pass
    try:
        ptx, name, expected = ptx_entry(py_func, sig, cc)
    except Exception:  # noqa: BLE001 - NVVM may not know the newest arch: PTX runs forward
        ptx, name, expected = ptx_entry(py_func, sig, (9, 0) if cc >= (9, 0) else (8, 0))
    image, kind = load_image(ptx, cc)
    if path is not None and kind == "cubin":
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                pickle.dump((image, kind, name, expected), f)
            os.replace(tmp, path)
        except OSError:
            pass
    return image, kind, name, expected


class FastKernel:
    """One kernel compiled for one exact signature, linked to a cubin for the device's compute
    capability (:func:`load_image`) and loaded with CuPy's driver API; launched through
    ``cuLaunchKernel`` with a reusable int64 parameter buffer. Checks at load time that the PTX
    entry takes exactly the 64-bit parameters Numba's data model says it should."""

    def __init__(self, py_func, sig: Tuple[types.Type, ...], device_id: int) -> None:
        import cupy
        dev = cupy.cuda.Device(device_id)
        cc = device_cc(device_id)
        image, self.image_kind, name, expected = cached_image(py_func, tuple(sig), cc)
        with dev:
            self._module = cupy.cuda.driver.moduleLoadData(image)
            self._func = cupy.cuda.driver.moduleGetFunction(self._module, name)
        self._values = np.zeros(expected, dtype=np.int64)
        self._pack = struct.Struct(f"<{expected}q").pack_into
        base = self._values.ctypes.data
        self._pointers = np.arange(expected, dtype=np.uint64) * np.uint64(8) + np.uint64(base)
        self._pointers_addr = self._pointers.ctypes.data
        self._launch = cupy.cuda.driver.launchKernel
        self._lock = threading.Lock()
        self.n_params = expected

    def __call__(self, grid: Tuple[int, ...], block: int, stream: int, args) -> None:
        self.launch_flat(grid, block, stream, _flatten(args))

    def launch_flat(self, grid: Tuple[int, ...], block: int, stream: int, flat) -> None:
        """Launch with the parameters already flattened (callers that cache a template)."""
        g = tuple(grid) + (1, 1)
        with self._lock:
            self._pack(self._values, 0, *flat)
            self._launch(self._func, g[0], g[1], g[2], block, 1, 1, 0, stream,
                         self._pointers_addr, 0)


_FAST: Dict[tuple, Optional[FastKernel]] = {}
_FAST_LOCK = threading.Lock()


_FAST_ENABLED = os.environ.get("NUMBAKV_FAST_LAUNCH", "1").lower() not in ("0", "", "false", "no")


def fast_launch_enabled() -> bool:
    """Whether ``cuda`` launches go through :class:`FastKernel` (``NUMBAKV_FAST_LAUNCH=0`` at
    import, or :func:`set_fast_launch`, turns it off)."""
    return _FAST_ENABLED


def set_fast_launch(enabled: bool) -> None:
    """Switch the fast launch path on or off (tests compare both on a GPU)."""
    global _FAST_ENABLED
    _FAST_ENABLED = bool(enabled)


def _sig_key_of(sig: Sequence[types.Type]) -> tuple:
    """:func:`_sig_key` of the arguments a Numba signature describes."""
    from numba.np.numpy_support import as_dtype
    return tuple((np.dtype(as_dtype(t.dtype)), t.ndim) if isinstance(t, types.Array) else None
                 for t in sig)


def _load(kernel, key: tuple, sig, device_id: int) -> Optional[FastKernel]:
    fk = _FAST.get(key, False)
    if fk is False:
        with _FAST_LOCK:
            fk = _FAST.get(key, False)
            if fk is False:
                try:
                    fk = FastKernel(kernel.py_func, tuple(sig), device_id)
                except Exception as exc:  # noqa: BLE001 - fall back to Numba's dispatcher
                    warnings.warn(f"numbakv: fast launch of {kernel.py_func.__name__} unavailable "
                                  f"({type(exc).__name__}: {exc}); using Numba's dispatcher",
                                  RuntimeWarning, stacklevel=4)
                    fk = None
                _FAST[key] = fk
    return fk


def _fast_kernel(kernel, args, device_id: int) -> Optional[FastKernel]:
    key = (id(kernel), _sig_key(args), device_id)
    fk = _FAST.get(key, False)
    if fk is False:
        fk = _load(kernel, key, [numba_type(a) for a in args], device_id)
    return fk


def preload(kernel, sig: Sequence[types.Type], device_id: int) -> Optional[FastKernel]:
    """Compile, link and load ``kernel`` for ``sig`` on ``device_id`` now (a cache's warm-up), so
    the first launch with arguments of that signature finds it ready."""
    if not _FAST_ENABLED:
        return None
    return _load(kernel, (id(kernel), _sig_key_of(sig), device_id), sig, device_id)


def launch(device: str, kernel, grid: Tuple[int, ...], block: int, args: Sequence[Any]) -> None:
    """Run ``kernel`` over ``grid`` x ``block`` threads. ``args`` are numpy arrays (``sim``) or
    :class:`Desc` views and ints (``cuda``); ints are always passed as int64."""
    grid3 = (tuple(grid) + (1, 1))[:3]
    if min(grid3) <= 0:
        return
    if device == "cuda":
        import cupy
        stream = cupy.cuda.get_current_stream()
        if _FAST_ENABLED:
            fk = _fast_kernel(kernel, args, cupy.cuda.runtime.getDevice())
            if fk is not None:
                fk(grid3, block, stream.ptr, args)
                return
        from numba import cuda
        nargs = [_DeviceView(a) if isinstance(a, Desc) else np.int64(a) for a in args]
        nstream = cuda.external_stream(stream.ptr) if stream.ptr else cuda.default_stream()
        kernel[grid3, block, nstream](*nargs)
        return
    # the simulator copies numpy arguments in and back out (and refuses strided ones): hand it
    # its own array wrapper instead, which indexes the numpy view in place
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    nargs = [np.int64(a) if isinstance(a, (int, np.integer))
             else FakeCUDAArray(a) if isinstance(a, np.ndarray) else a for a in args]
    kernel[grid3, block](*nargs)


class Prepared(NamedTuple):
    """A kernel launch with its inputs already on the device: ``launch(device, kernel, grid,
    block, args)``; ``keep`` holds the device buffers ``args`` point into."""
    kernel: Any
    grid: Tuple[int, ...]
    block: int
    args: tuple
    keep: Any


class HostStaging:
    """Pinned host buffers through which one stream's host-to-device inputs travel, reused.

    A pageable copy makes the driver stage the bytes itself and returns only when it is done
    (and is refused during CUDA-graph capture); a copy from pinned memory is truly asynchronous,
    so a buffer may be refilled only after the copy that last read it has run. Each buffer
    carries an event recorded after its copy; :meth:`take` reuses the first whose event has
    passed, else adds a buffer (up to :data:`MAX_BUFFERS`, then waits for the oldest). While the
    stream is capturing a graph no event is queried (that would be an illegal implicit
    synchronisation): a new buffer is taken and kept for the cache's lifetime, since every replay
    of the graph reads it again."""

    MAX_BUFFERS = 8

    def __init__(self) -> None:
        self._free: List[list] = []    # [nbytes, pinned memory, host view, event, host address]
        self._busy: List[list] = []
        self.captured: List[Any] = []  # buffers a captured graph reads: never reused

    @staticmethod
    def _new(nbytes: int) -> list:
        import cupy
        cap = max(4096, 1 << (int(nbytes) - 1).bit_length())
        mem = cupy.cuda.alloc_pinned_memory(cap)
        host = np.frombuffer(mem, np.uint8, cap)
        return [cap, mem, host, None, int(host.ctypes.data)]

    def take(self, nbytes: int, stream) -> list:
        """A pinned buffer of at least ``nbytes`` whose previous copy has completed."""
        if capturing(stream):
            slot = self._new(nbytes)
            self.captured.append(slot)
            return slot
        still = []
        for slot in self._busy:  # retire every buffer whose copy has run
            (self._free if slot[3] is None or slot[3].done else still).append(slot)
        self._busy = still
        for i, slot in enumerate(self._free):
            if slot[0] >= nbytes:
                return self._free.pop(i)
        if len(self._free) + len(self._busy) >= self.MAX_BUFFERS:
            if self._free:
                self._free.pop(0)  # too small: make room for a bigger one
            else:
                oldest = self._busy.pop(0)
                host_wait(oldest[3])  # the GPU is MAX_BUFFERS launches behind: wait
        return self._new(nbytes)

    def give_back(self, slot: list, stream) -> None:
        """``slot``'s copy has been queued on ``stream``: mark it busy until that has run."""
        if capturing(stream):
            return  # kept in ``captured``
        import cupy
        if slot[3] is None:
            slot[3] = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
        slot[3].record(stream)
        self._busy.append(slot)


_STAGING: Dict[tuple, HostStaging] = {}


def staging_for(stream, device_id: int) -> HostStaging:
    """The :class:`HostStaging` of a stream (by its handle) on a device."""
    key = (device_id, int(stream.ptr))
    st = _STAGING.get(key)
    if st is None:
        st = _STAGING[key] = HostStaging()
    return st


#: cudaMemcpyHostToDevice
_H2D = 1


#: host -> device copies made through :func:`to_device` (and the page tables' copies), counted on
#: every device but the CPU (the simulator counts what CUDA would copy): what a decode step
#: uploads must not grow with the cache (tests, benchmarks). ``calls``: copies; ``bytes``.
UPLOADS = {"calls": 0, "bytes": 0}


def count_upload(nbytes: int) -> None:
    """Count one host -> device copy of ``nbytes`` in :data:`UPLOADS`."""
    UPLOADS["calls"] += 1
    UPLOADS["bytes"] += int(nbytes)


def to_device(device: str, *arrays: np.ndarray):
    """Host arrays for a kernel: as they are on ``cpu``/``sim``; on ``cuda`` packed into one
    pinned, reused host buffer (:class:`HostStaging`) and copied asynchronously, with a single
    transfer, on the current stream into one device buffer; returned as :class:`Desc` views. The
    device buffer is returned too: keep it alive until the kernel that reads it is queued (CuPy's
    pool orders its reuse on the stream)."""
    if device != "cuda":
        if device != "cpu":
            count_upload(sum(np.asarray(a).nbytes for a in arrays))
        return arrays, None
    import cupy
    parts = [np.ascontiguousarray(a) for a in arrays]
    count_upload(sum(p.nbytes for p in parts))
    offsets = []
    total = 0
    for p in parts:
        offsets.append(total)
        total += -(-p.nbytes // 16) * 16 or 16
    stream = cupy.cuda.get_current_stream()
    staging = staging_for(stream, cupy.cuda.runtime.getDevice())
    slot = staging.take(total, stream)
    host = slot[2]
    for p, off in zip(parts, offsets):
        host[off:off + p.nbytes] = p.reshape(-1).view(np.uint8)
    # a fresh device buffer per call (CuPy's pool: no cudaMalloc): callers may keep it past the
    # next call (put's slot cache does)
    dev = cupy.empty(total, dtype=np.uint8)
    if staging.captured and staging.captured[-1] is slot:
        # the stream is capturing a graph (take() kept the pinned buffer): every replay reads
        # this device buffer too, so it must outlive the caller's reference (issue 35: a
        # captured launch's buffer was freed at once, and a replay read memory another array
        # had been given)
        staging.captured.append(dev)
    # cudaMemcpyAsync itself, not MemoryPointer.copy_from_host_async: CuPy refuses host-to-device
    # transfers on a capturing stream (seen on an H100: "the current stream is capturing, so H2D
    # transfers are disallowed"), while a copy from pinned memory is a legal graph node; the
    # staging keeps captured buffers for the graph's lifetime
    cupy.cuda.runtime.memcpyAsync(int(dev.data.ptr), slot[4], total, _H2D, stream.ptr)
    staging.give_back(slot, stream)
    base = int(dev.data.ptr)
    descs = []
    for p, off in zip(parts, offsets):
        strides = []
        acc = p.itemsize
        for s in reversed(p.shape):
            strides.append(acc)
            acc *= s
        descs.append(Desc(base + off, tuple(p.shape), tuple(reversed(strides)), p.dtype))
    return tuple(descs), dev


def device_arg(device: str, arr, dtype=None):
    """A storage/output array as a kernel argument: itself (numpy, optionally viewed as another
    dtype of the same size) or its :class:`Desc` on ``cuda``."""
    if device == "cuda":
        return desc_of(arr, dtype)
    return arr if dtype is None else arr.view(dtype)


__all__ = ["HOST_WAITS", "UPLOADS",
           "count_upload", "link_cubin", "FastKernel", "HostStaging", "Prepared", "device_cc", "load_image",
           "preload", "staging_for", "ptx_entry", "device_arg", "fast_launch_enabled", "launch",
           "set_fast_launch", "numba_type", "to_device", "device_to_host", "capturing",
           "cached_image", "image_cache_dir"]
