"""Where the cache lives: ``cuda`` (CuPy storage, Numba CUDA kernels), ``cpu`` (numpy storage,
numba ``@njit`` twins of the kernels) or ``sim`` (numpy storage, the real ``@cuda.jit`` kernels
run by Numba's CUDA simulator, for testing without a GPU).

Also turns whatever array a caller hands in (numpy, CuPy, torch, JAX: anything speaking DLPack,
``__cuda_array_interface__`` or ``__array_interface__``) into the device's array type without a
copy when the memory already lives there, and wraps views for export (bfloat16 included).
"""

from __future__ import annotations

import ctypes
import os
import sys as _sys
import threading
import time
import warnings
from typing import Any, List, Tuple

import numpy as np

from . import _dlpack
from .config import STORAGE_DTYPES, normalize_dtype
from ._gpu_probe import driver_gpu_count

DEVICE_NAMES = ("cpu", "cuda", "sim")


def simulator_enabled() -> bool:
    """True when Numba's CUDA simulator is on (``NUMBA_ENABLE_CUDASIM=1`` before numba.cuda was
    imported): then every ``@cuda.jit`` kernel runs in Python on numpy arrays."""
    try:
        from numba.cuda.core import config as cuda_config
        return bool(cuda_config.ENABLE_CUDASIM)
    except ImportError:  # older numba-cuda layouts
        return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


#: what to install for the GPU path (named in warnings and errors)
GPU_EXTRA = "numbakv[cuda]"
#: a failed probe is trusted this long before it is tried again (a transient failure, e.g. a GPU
#: still being brought up or CuPy installed by a running notebook, must not stick for the
#: process's lifetime); a success is kept
PROBE_RETRY_S = 2.0

_probe_lock = threading.Lock()
_probe_ok = False
_probe_failed_at = -1e300
_probe_reason = ""
_warned_missing_cupy = False


def _probe() -> Tuple[bool, str]:
    """One real attempt: ``(usable, why not)``."""
    if simulator_enabled():
        return False, "the CUDA simulator is on"
    n = driver_gpu_count()
    if n == 0:
        return False, "the CUDA driver sees no GPU"
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install raising anything
        return False, (f"the CUDA driver sees {n} GPU(s) but CuPy is not importable "
                       f"({type(exc).__name__}: {exc}); install {GPU_EXTRA}")
    try:
        cupy.zeros(1, dtype=cupy.float32).sum().item()
    except Exception as exc:  # noqa: BLE001
        return False, (f"the CUDA driver sees {n} GPU(s) but CuPy cannot allocate on one "
                       f"({type(exc).__name__}: {exc}); check that the CuPy build matches the "
                       f"driver ({GPU_EXTRA})")
    try:
        from numba import cuda
        if not cuda.is_available():
            return False, "Numba's CUDA target reports no usable GPU"
    except Exception as exc:  # noqa: BLE001
        return False, f"Numba's CUDA target failed ({type(exc).__name__}: {exc})"
    why = numba_cuda_numpy_problem()
    if why:
        return False, f"the CUDA driver sees {n} GPU(s) but {why}"
    return True, ""


def numba_cuda_numpy_problem() -> str:
    """Why numba-cuda cannot compile kernels with the installed numpy, or ``""``.

    numba-cuda (0.30.4 and older) registers an overload of ``np.row_stack``, which numpy 2.5
    removed: ``numba.cuda`` still imports, but the first kernel compile loads that module and
    fails with ``AttributeError: module 'numpy' has no attribute 'row_stack'``, so every GPU
    operation would fail. Checked only when numpy lacks ``row_stack`` (nothing to pay otherwise),
    by importing the module the compiler loads; any other outcome lets the compiler speak."""
    if hasattr(np, "row_stack"):
        return ""
    try:
        import numba.cuda.np.arrayobj  # noqa: F401 - what the first kernel compile imports
    except AttributeError as exc:
        if "row_stack" not in str(exc):
            return ""
        try:
            from importlib.metadata import version
            ncu = f"numba-cuda {version('numba-cuda')}"
        except Exception:  # noqa: BLE001 - metadata missing: the message still holds
            ncu = "numba-cuda"
        return (f"{ncu} cannot compile kernels with numpy {np.__version__} (numpy 2.5 removed "
                f"np.row_stack, which this numba-cuda still registers: {exc}); install "
                f"'numpy<2.5' (numbakv's cuda extras pin it) or a numba-cuda release that "
                f"supports numpy 2.5")
    except Exception:  # noqa: BLE001 - another layout or failure: not this known problem
        return ""
    return ""


def cuda_status() -> Tuple[bool, str]:
    """``(usable, why not)`` for the GPU path: the driver sees a device, CuPy can allocate on it
    and Numba's CUDA target is live (not the simulator). CuPy imports fine on machines without a
    driver and fails at the first allocation, so this tries one. A success is remembered; a
    failure only for :data:`PROBE_RETRY_S` seconds."""
    global _probe_ok, _probe_failed_at, _probe_reason
    if _probe_ok:
        return True, ""
    with _probe_lock:
        if _probe_ok:
            return True, ""
        now = time.monotonic()
        if now - _probe_failed_at < PROBE_RETRY_S:
            return False, _probe_reason
        ok, reason = _probe()
        if ok:
            _probe_ok = True
        else:
            _probe_failed_at, _probe_reason = time.monotonic(), reason
        return ok, reason


def cuda_usable() -> bool:
    """True only when a CUDA GPU really works (see :func:`cuda_status`)."""
    return cuda_status()[0]


def _reset_probe() -> None:
    """Forget what the probe found (tests; also after installing CuPy in a running process)."""
    global _probe_ok, _probe_failed_at, _probe_reason, _warned_missing_cupy
    with _probe_lock:
        _probe_ok, _probe_failed_at, _probe_reason = False, -1e300, ""
        _warned_missing_cupy = False


def _auto_cpu_warning(reason: str) -> None:
    """``auto`` fell back to the CPU although the driver sees a GPU: say so once per process,
    naming the extra to install (silently running a GPU machine's cache on the CPU costs 10-100x)."""
    global _warned_missing_cupy
    if _warned_missing_cupy or "driver sees" not in reason or "no GPU" in reason:
        return
    _warned_missing_cupy = True
    warnings.warn(f"numbakv: device='auto' chose the CPU: {reason}", RuntimeWarning,
                  stacklevel=4)


def resolve_device(device: str = "auto") -> str:
    """``auto`` becomes ``sim`` when the simulator is on, ``cuda`` when a GPU works, else ``cpu``.
    An explicit ``cuda`` or ``sim`` that cannot run raises ``ValueError`` saying why."""
    if device == "auto":
        if simulator_enabled():
            return "sim"
        ok, reason = cuda_status()
        if not ok:
            _auto_cpu_warning(reason)
        return "cuda" if ok else "cpu"
    if device not in DEVICE_NAMES:
        raise ValueError(f"device must be one of ('auto',) + {DEVICE_NAMES}, got {device!r}")
    if device == "sim" and not simulator_enabled():
        raise ValueError("device='sim' needs Numba's CUDA simulator: set NUMBA_ENABLE_CUDASIM=1 "
                         "before numba.cuda is first imported")
    if device == "cuda":
        ok, why = cuda_status()
        if not ok:
            raise ValueError(f"device='cuda' is not available: {why}")
    return device


def array_module(device: str):
    """The array module storing data on ``device``: CuPy for ``cuda``, numpy otherwise."""
    if resolve_device(device) == "cuda":
        import cupy
        return cupy
    return np


#: host waits for the GPU made by numbakv: a stream, event or the device synchronised, or a
#: device -> host copy (which waits for its stream). ``calls``: all of them; ``device_to_host``:
#: the copies among them. Every such wait in the library goes through :func:`host_wait` /
#: :func:`count_host_wait`, so a test or benchmark can check that a path makes none (a decode
#: step replayed as a graph: tests/test_step.py; ``.ci/gpu_step_bench.py`` on a GPU).
HOST_WAITS = {"calls": 0, "device_to_host": 0}


def count_host_wait(copy: bool = False) -> None:
    """Count one host wait for the GPU in :data:`HOST_WAITS` (``copy``: a device -> host
    copy)."""
    HOST_WAITS["calls"] += 1
    if copy:
        HOST_WAITS["device_to_host"] += 1


def host_wait(waitable: Any) -> None:
    """``waitable.synchronize()`` (a CuPy stream or event), counted in :data:`HOST_WAITS`."""
    count_host_wait()
    waitable.synchronize()


def synchronize(device: str) -> None:
    """Wait for queued GPU work (a no-op on cpu and sim)."""
    if device == "cuda":
        import cupy
        host_wait(cupy.cuda.get_current_stream())


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "cupy"


#: dtype object -> canonical name (``str()`` of a numpy dtype costs microseconds: every put on a
#: GPU paid it several times per layer)
_DTYPE_NAMES: dict = {}


def dtype_name(x: Any) -> str:
    """The canonical dtype name of an array-like (``bfloat16`` for framework bfloat16 tensors)."""
    if isinstance(x, _dlpack.BFloat16View):
        return "bfloat16"
    dt = getattr(x, "dtype", None)
    if dt is None:
        return type(x).__name__
    try:
        return _DTYPE_NAMES[dt]
    except (KeyError, TypeError):  # TypeError: an unhashable dtype object
        pass
    text = str(dt).lower().replace("torch.", "")
    text = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}.get(text, text)
    try:
        if len(_DTYPE_NAMES) < 256:
            _DTYPE_NAMES[dt] = text
    except TypeError:
        pass
    return text


def input_device(x: Any) -> str:
    """``cuda`` when ``x``'s memory is on a GPU, ``cpu`` when on the host (pinned host memory
    included); for a DLPack device of another kind, ``"dlpack device <type>"``."""
    if isinstance(x, np.ndarray):
        return "cpu"
    if isinstance(x, _dlpack.BFloat16View):
        return x.device
    if _is_cupy(x):
        return "cuda"
    # DLPack first: torch's __cuda_array_interface__ raises (not AttributeError) for bfloat16
    # and for tensors that require grad, so hasattr() on it is not a safe probe.
    dl = _dlpack.dlpack_device(x)
    if dl is not None:
        if dl[0] in (_dlpack.KDL_CPU, _dlpack.KDL_CUDA_HOST):
            return "cpu"
        if dl[0] in (_dlpack.KDL_CUDA, _dlpack.KDL_CUDA_MANAGED):
            return "cuda"
        return f"dlpack device {dl[0]}"
    try:
        getattr(x, "__cuda_array_interface__")
        return "cuda"
    except AttributeError:
        return "cpu"
    except Exception:  # noqa: BLE001 - the attribute exists but refused this array: a GPU array
        return "cuda"


def torch_host_view(torch, t) -> np.ndarray:
    """A contiguous CPU torch tensor (float16, float32 or bfloat16) as the numpy array a CPU
    cache stores, sharing its memory: bfloat16 as its uint16 bit patterns (numpy has no
    bfloat16). ``torch``: the torch module (passed in: this module never imports it)."""
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def as_array(x: Any, device: str, dtype: str, *, name: str = "array"):
    """``x`` as the array type of ``device`` holding ``dtype`` (its storage dtype: uint16 bit
    patterns for ``bfloat16``), without copying when the memory is already there.

    Accepts numpy and CuPy arrays, torch / JAX / any DLPack tensor (contiguous or strided), raw
    DLPack capsules, ``BFloat16View``, and for ``bfloat16`` also uint16 arrays taken as bit
    patterns. Raises ``ValueError`` naming ``name`` when ``x`` lives on the other device, has
    another dtype or cannot be imported: the cache never converts dtypes or moves data between
    devices behind a caller's back.
    """
    # Fast paths, paid on every put: a host array (or, on cuda, a CuPy array) already in the
    # storage dtype needs no import and no check beyond its type and dtype.
    tx = type(x)
    if tx is np.ndarray:
        if device != "cuda" and x.dtype == STORAGE_DTYPES.get(dtype):
            return x
    elif tx is _CUPY_NDARRAY[0] and device == "cuda" and x.dtype == STORAGE_DTYPES.get(dtype):
        return x
    elif device != "cuda":
        # a host torch tensor (what hf.attach puts, every layer): .numpy() shares its memory in
        # ~1 us where the DLPack import took ~12 us. GPU tensors keep DLPack (it orders the
        # producer's stream before the consumer's).
        torch = _sys.modules.get("torch")
        if torch is not None and tx is torch.Tensor and not x.requires_grad \
                and x.device.type == "cpu":
            tdt = x.dtype
            if (tdt is torch.float16 and dtype == "float16") or \
                    (tdt is torch.float32 and dtype == "float32") or \
                    (tdt is torch.bfloat16 and dtype == "bfloat16"):
                return torch_host_view(torch, x)
    try:
        return _as_array(x, device, dtype, name)
    except ValueError as exc:
        if str(exc).startswith(name):
            raise
        # e.g. numpy on a ragged list, DLPack on a tensor of an unknown ("meta") device
        raise ValueError(f"{name} could not be read as an array: {exc}") from exc
    except (TypeError, RuntimeError, BufferError, AttributeError, NotImplementedError,
            OverflowError) as exc:
        raise ValueError(f"{name} could not be read as an array ({type(x).__name__}): "
                         f"{exc}") from exc


#: ``cupy.ndarray`` once a GPU input has been imported (None before: as_array's fast path never
#: imports CuPy itself)
_CUPY_NDARRAY: list = [None]


def _as_array(x: Any, device: str, dtype: str, name: str):
    dtype = normalize_dtype(dtype, "dtype")
    storage_device = "cuda" if device == "cuda" else "cpu"
    try:
        where = input_device(x)
    except BufferError as exc:  # a raw capsule already consumed
        raise ValueError(f"{name} could not be imported through DLPack: {exc}") from exc
    if where != storage_device:
        if storage_device == "cuda" and not _array_like(x):
            # a str or list is no array at all: say that, not "lives on cpu"
            raise ValueError(f"{name} must be a GPU array (CuPy, or anything speaking DLPack or "
                             f"the CUDA array interface), got {type(x).__name__}")
        if where == "cuda" and storage_device == "cpu":
            # the usual cause: device='auto' on a GPU machine without CuPy
            ok, why = cuda_status() if device == "cpu" else (False, "")
            hint = (f" (device='auto' could not use the GPU: {why})" if why and "driver sees" in why
                    and "no GPU" not in why else "")
            raise ValueError(f"{name} lives on cuda but the cache stores on cpu: {name} is a "
                             f"CUDA GPU tensor and this cache is on the CPU{hint}; create the "
                             f"cache with device='cuda' (needs {GPU_EXTRA}) or move {name} to "
                             f"the host first")
        raise ValueError(f"{name} lives on {where} but the cache stores on {device}: move it to "
                         f"{'the GPU' if storage_device == 'cuda' else 'the host'} first")
    arr, was_bf16 = _to_native(x, storage_device, name)
    got = "bfloat16" if was_bf16 or dtype_name(x) == "bfloat16" else str(arr.dtype)
    if got != dtype and not (dtype == "bfloat16" and got == "uint16"):
        raise ValueError(f"{name} must have dtype {dtype}, got {got}")
    if dtype == "bfloat16" and arr.dtype != STORAGE_DTYPES["bfloat16"]:
        arr = arr.view(STORAGE_DTYPES["bfloat16"])
    return arr


def _array_like(x: Any) -> bool:
    """Whether ``x`` speaks any array protocol (numpy, DLPack, the array interfaces)."""
    return (isinstance(x, np.ndarray) or _dlpack.is_capsule(x)
            or any(hasattr(x, a) for a in ("__dlpack__", "__array__", "__array_interface__",
                                           "__cuda_array_interface__")))


def _to_native(x: Any, storage_device: str, name: str):
    """``(array, was_bfloat16)``: a numpy (host) or CuPy (GPU) array over ``x``'s memory;
    framework bfloat16 tensors come back as uint16 arrays over the same bytes."""
    if storage_device == "cpu":
        if isinstance(x, np.ndarray):
            # ml_dtypes' bfloat16 (what JAX's np.asarray gives) is a numpy dtype of its own
            if str(x.dtype) == "bfloat16":
                return x.view(np.uint16), True
            return x, False
        if isinstance(x, _dlpack.BFloat16View):
            return x.bits, True
        if hasattr(x, "__dlpack__") or _dlpack.is_capsule(x):
            return _import(x, "cpu", name)
        if hasattr(x, "__array_interface__") or hasattr(x, "__array__"):
            return np.asarray(x), False
        raise ValueError(f"{name} must be an array (numpy, or anything speaking DLPack or the "
                         f"array interface), got {type(x).__name__}")
    import cupy
    _CUPY_NDARRAY[0] = cupy.ndarray  # as_array's fast path, from now on
    if _is_cupy(x):
        if str(x.dtype) == "bfloat16":  # a CuPy build with a bfloat16 dtype
            return x.view(cupy.uint16), True
        return x, False
    if isinstance(x, _dlpack.BFloat16View):
        return x.bits, True
    if hasattr(x, "__dlpack__") or _dlpack.is_capsule(x):
        return _import(x, "cuda", name)
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x), False
    raise ValueError(f"{name} must be a GPU array (CuPy, or anything speaking DLPack or the "
                     f"CUDA array interface), got {type(x).__name__}")


def _import(x: Any, target: str, name: str):
    try:
        return _dlpack.import_dlpack(x, target)
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        # e.g. torch refuses tensors that require grad; a capsule consumed twice
        raise ValueError(f"{name} could not be imported through DLPack: {exc}") from exc


def export_view(arr, dtype: str):
    """What the cache hands out for a storage view: the array itself for float16/float32, or a
    ``BFloat16View`` whose ``__dlpack__`` exports the uint16 storage as bfloat16 (so
    ``torch.from_dlpack`` gives ``torch.bfloat16`` without a copy)."""
    if dtype == "bfloat16":
        return _dlpack.BFloat16View(arr)
    return arr


# ---------------------------------------------------------------------------- CUDA stream helpers
# (platform level: the cache's input checks (_inputs.py) and the kernels' launch path both use them)
def capturing(stream) -> bool:
    """Whether ``stream`` is capturing a CUDA graph. Asking about the legacy NULL stream while
    another stream captures in global mode is itself an error: counted as capturing (then
    nothing queries or synchronises)."""
    try:
        return bool(stream.is_capturing())
    except Exception:  # noqa: BLE001
        return True


_READBACK: List[Any] = []       # [capacity, pinned memory, host view]: one, reused
_READBACK_LOCK = threading.Lock()


def device_to_host(arr, stream) -> np.ndarray:
    """A host copy of the CuPy array ``arr``, made on ``stream`` through one pinned, reused
    buffer: a contiguous copy (if ``arr`` is strided) and an asynchronous device-to-host copy are
    queued on ``stream``, then only that stream is synchronised (``cupy.asnumpy`` would copy on
    the current stream into pageable memory). The caller refuses this during graph capture."""
    import cupy
    with stream:
        dev = cupy.ascontiguousarray(arr)
    nbytes = int(dev.nbytes)
    if nbytes == 0:
        return np.empty(dev.shape, dtype=dev.dtype)
    with _READBACK_LOCK:
        if not _READBACK or _READBACK[0] < nbytes:
            cap = max(4096, 1 << (nbytes - 1).bit_length())
            mem = cupy.cuda.alloc_pinned_memory(cap)
            _READBACK[:] = [cap, mem, np.frombuffer(mem, np.uint8, cap)]
        host = _READBACK[2]
        dev.data.copy_to_host_async(ctypes.c_void_p(host.ctypes.data), nbytes, stream)
        count_host_wait(copy=True)
        stream.synchronize()
        return host[:nbytes].view(dev.dtype).reshape(dev.shape).copy()


__all__ = ["simulator_enabled", "cuda_usable", "cuda_status", "GPU_EXTRA", "resolve_device", "array_module", "synchronize",
           "as_array", "export_view", "dtype_name", "input_device", "DEVICE_NAMES",
           "capturing", "device_to_host", "HOST_WAITS", "count_host_wait", "host_wait"]
