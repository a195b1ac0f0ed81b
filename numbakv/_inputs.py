"""Input checks the caches share: integer arguments, batches of positions/sequence ids, and
host copies of integer arrays given in any form (list, numpy, CuPy, torch, DLPack).

Sits just above the platform modules: it knows nothing of the caches (``causal``, ``streams``,
``wrappers`` and ``prompt`` import it). Every check raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from .config import CacheConfig
from .device import capturing, device_to_host

#: Stands for "no limit" in window, memory and range arithmetic (Ollama's math.MaxInt32).
UNLIMITED = 2**31 - 1


def check_index(name: str, value, low: int, high: Optional[int] = None) -> int:
    """``value`` as an int in ``[low, high)`` (``high=None``: no upper bound)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def host_int_array(values, name: str, stream: Any = None) -> np.ndarray:
    """A 1-D int64 host copy of integer values given as a list, numpy/CuPy array or tensor.
    Anything that cannot be read as one (ragged lists, tensors on a ``meta`` device, objects)
    is a ``ValueError`` naming ``name``. Values in GPU memory are copied on ``stream`` (a CuPy
    stream; None: CuPy's current stream), synchronising that stream only, and refused while it
    captures a CUDA graph (:func:`_host_array`)."""
    if type(values) is np.ndarray and values.ndim == 1 and values.dtype.kind in "iu":
        return values.astype(np.int64, copy=False)  # the common case, checked cheaply
    try:
        arr = _host_array(values, name, stream)
    except _CaptureRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the foreign object raised
        raise ValueError(f"{name} must be a 1-D sequence of integers, got "
                         f"{type(values).__name__} that cannot be read as one: {exc}") from exc
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


class _CaptureRefused(ValueError):
    """Device-resident positions/seqs while the cache's stream captures a CUDA graph."""


def _on_gpu(values) -> bool:
    """Whether ``values`` lives in GPU memory: a CuPy array, a CUDA ``__dlpack_device__``
    (anything but CPU and pinned host memory), or the CUDA array interface."""
    if type(values).__module__.startswith("cupy"):
        return True
    if hasattr(values, "__dlpack_device__") and not isinstance(values, np.ndarray):
        return int(values.__dlpack_device__()[0]) not in (1, 3)
    return hasattr(values, "__cuda_array_interface__")


def _host_array(values, name: str = "values", stream: Any = None) -> np.ndarray:
    """``values`` as a numpy array. GPU-resident values (CuPy arrays, torch CUDA tensors,
    anything with a CUDA ``__dlpack_device__`` or ``__cuda_array_interface__``) are copied on
    ``stream`` (the cache's stream; None: CuPy's current stream) into a pinned, reused buffer and
    only that stream is synchronised, never the device; while ``stream`` captures a CUDA graph
    that synchronisation is illegal, so they are refused with a ValueError before anything is
    read (the cache keeps its bookkeeping on the host)."""
    if not _on_gpu(values):
        if hasattr(values, "__dlpack_device__") and not isinstance(values, np.ndarray):
            return np.asarray(np.from_dlpack(values))
        return np.asarray(values)
    import cupy
    if stream is None:
        stream = cupy.cuda.get_current_stream()
    if capturing(stream):
        raise _CaptureRefused(
            f"{name} must be a host array (numpy or a list) while the cache's stream is "
            f"capturing a CUDA graph, got {type(values).__name__} in GPU memory: the cache keeps "
            f"its bookkeeping on the host and reading device memory back would synchronise the "
            f"stream; pass positions/seqs as host arrays inside graph capture")
    if type(values).__module__.startswith("cupy"):
        dev = values
    else:
        with stream:  # DLPack orders the producer's stream before ours (no host wait)
            dev = cupy.from_dlpack(values) if hasattr(values, "__dlpack__") \
                else cupy.asarray(values)
    return device_to_host(dev, stream)


def check_batch(positions, seqs, config: CacheConfig,
                stream: Any = None) -> Tuple[np.ndarray, np.ndarray]:
    """A batch's ``positions`` and ``seqs`` (any integer array-likes, ``[batch]``) as int32 host
    arrays, checked against ``config``: equal, non-zero length up to ``max_batch``, positions in
    ``[0, UNLIMITED)``, sequence ids in ``[0, max_seqs)``. GPU-resident ones are read back on
    ``stream`` (see :func:`host_int_array`)."""
    pos = host_int_array(positions, "positions", stream)
    sq = host_int_array(seqs, "seqs", stream)
    if len(pos) != len(sq):
        raise ValueError(f"positions and seqs must have the same length, got {len(pos)} "
                         f"and {len(sq)}")
    if len(pos) == 0:
        raise ValueError("positions must hold at least one token")
    if len(pos) > config.max_batch:
        raise ValueError(f"batch of {len(pos)} tokens is larger than max_batch="
                         f"{config.max_batch}")
    if pos.min() < 0 or pos.max() >= UNLIMITED:
        raise ValueError(f"positions must be in [0, {UNLIMITED}), got min {pos.min()} "
                         f"max {pos.max()}")
    if sq.min() < 0 or sq.max() >= config.max_seqs:
        raise ValueError(f"seqs must be in [0, max_seqs={config.max_seqs}), got min "
                         f"{sq.min()} max {sq.max()}")
    return pos.astype(np.int32), sq.astype(np.int32)


__all__ = ["UNLIMITED", "check_index", "check_batch", "host_int_array"]
