"""DLPack interop beyond what numpy and CuPy do themselves: bfloat16 in both directions.

numpy and CuPy have no bfloat16 dtype, so the cache stores bfloat16 as uint16 bit patterns.

* Export: :class:`BFloat16View` wraps such a uint16 array; its ``__dlpack__`` asks the array
  itself (numpy or CuPy) for a DLPack capsule and, before handing the capsule over, rewrites the
  dtype field of the ``DLTensor`` inside it from ``uint16`` to ``bfloat16`` (code ``kDLBfloat``,
  16 bits, 1 lane). Same bits, same memory: ``torch.from_dlpack(view)`` is a ``torch.bfloat16``
  tensor over the cache's storage, and JAX and CuPy read it the same way.
* Import: :func:`host_array_from_dlpack` / :func:`cupy_array_from_dlpack` pass any DLPack
  producer to ``numpy.from_dlpack`` / ``cupy.from_dlpack`` through a thin proxy that rewrites a
  ``bfloat16`` capsule as ``uint16`` before numpy or CuPy reads it, so a ``torch.bfloat16`` or JAX
  bfloat16 array comes back as a uint16 array over the same memory (never a copy).

Why retag instead of building our own ``DLManagedTensor`` with a ctypes deleter: the capsule is
only ours between the producer's ``__dlpack__`` and the consumer's import, and the only thing
changed is the 4-byte dtype, which no deleter reads. Ownership, the deleter, the "never
consumed" capsule destructor, CUDA stream ordering, ``max_version`` (versioned
``dltensor_versioned`` capsules), ``dl_device`` and ``copy`` all stay with numpy, CuPy, torch or
JAX, whose C code does them right. A Python-level deleter, by contrast, can be called from a
framework's own threads or during interpreter shutdown, where a ctypes callback is unsafe.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Tuple

import numpy as np

# DLDeviceType (dlpack.h)
KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
KDL_ROCM = 10
KDL_ROCM_HOST = 11
KDL_CUDA_MANAGED = 13
# DLDataTypeCode (dlpack.h)
KDL_INT = 0
KDL_UINT = 1
KDL_FLOAT = 2
KDL_BFLOAT = 4

#: DLPack flag bits of a versioned capsule
DLPACK_FLAG_READ_ONLY = 1
DLPACK_FLAG_IS_COPIED = 2

_LEGACY = b"dltensor"
_VERSIONED = b"dltensor_versioned"


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    # The legacy DLManagedTensor starts with its DLTensor, so the legacy capsule pointer is the
    # DLTensor's address; the versioned one puts the DLTensor last.
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", _DLTensor)]


# Private prototypes (not ctypes.pythonapi's shared function objects, whose restype/argtypes
# other libraries may set differently). PYFUNCTYPE keeps the GIL held and checks for errors.
_PyCapsule_GetName = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", ctypes.pythonapi))
_PyCapsule_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def is_capsule(x: Any) -> bool:
    """True for a raw ``PyCapsule`` (what ``torch.utils.dlpack.to_dlpack`` returns)."""
    return type(x).__name__ == "PyCapsule"


def _capsule_tensor(capsule) -> Tuple[_DLTensor, int]:
    """The ``DLTensor`` inside an unconsumed DLPack capsule (a view of the C struct, writable)
    and the capsule's flags (0 for a legacy capsule)."""
    if not is_capsule(capsule):
        raise TypeError(f"expected a DLPack capsule, got {type(capsule).__name__}")
    name = _PyCapsule_GetName(capsule)
    if name == _LEGACY:
        return _DLTensor.from_address(_PyCapsule_GetPointer(capsule, _LEGACY)), 0
    if name == _VERSIONED:
        managed = _DLManagedTensorVersioned.from_address(
            _PyCapsule_GetPointer(capsule, _VERSIONED))
        if managed.version.major != 1:
            raise BufferError(f"unsupported DLPack major version {managed.version.major}")
        return managed.dl_tensor, int(managed.flags)
    if name in (b"used_dltensor", b"used_dltensor_versioned"):
        raise BufferError("this DLPack capsule was already consumed (a capsule can be imported "
                          "only once)")
    raise BufferError(f"not a DLPack capsule (capsule name {name!r})")


def capsule_info(capsule) -> dict:
    """What an unconsumed capsule describes, without consuming it: ``device`` ``(type, id)``,
    ``dtype`` ``(code, bits, lanes)``, ``shape``, ``strides`` (elements, ``None`` = compact
    row-major), ``data`` pointer, ``byte_offset``, ``flags`` and ``versioned``."""
    t, flags = _capsule_tensor(capsule)
    ndim = int(t.ndim)
    shape = tuple(int(t.shape[i]) for i in range(ndim))
    strides = tuple(int(t.strides[i]) for i in range(ndim)) if t.strides else None
    return {"device": (int(t.device.device_type), int(t.device.device_id)),
            "dtype": (int(t.dtype.code), int(t.dtype.bits), int(t.dtype.lanes)),
            "shape": shape, "strides": strides, "data": t.data or 0,
            "byte_offset": int(t.byte_offset), "flags": flags,
            "versioned": _PyCapsule_GetName(capsule) == _VERSIONED}


def _retag(capsule, src: Tuple[int, int], dst: Tuple[int, int]) -> bool:
    """Rewrite the dtype of an unconsumed capsule from ``src`` to ``dst`` ``(code, bits)`` (one
    lane). Returns whether it did (False when the capsule holds another dtype)."""
    t, _ = _capsule_tensor(capsule)
    if (t.dtype.code, t.dtype.bits, t.dtype.lanes) != (src[0], src[1], 1):
        return False
    t.dtype.code, t.dtype.bits = dst
    return True


def dlpack_device(x: Any) -> Optional[Tuple[int, int]]:
    """``(device_type, device_id)`` of a DLPack producer or unconsumed capsule; ``None`` when
    ``x`` speaks no DLPack."""
    if is_capsule(x):
        return capsule_info(x)["device"]
    fn = getattr(x, "__dlpack_device__", None)
    if fn is None:
        return None
    dev_type, dev_id = fn()
    return int(dev_type), int(dev_id)


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "cupy"


# --------------------------------------------------------------------------------------------
# import


class _CapsuleProducer:
    """Lets ``numpy.from_dlpack`` / ``cupy.from_dlpack`` take a raw capsule (the pre-2021
    protocol), which they only accept as objects with ``__dlpack__``."""

    __slots__ = ("capsule",)

    def __init__(self, capsule) -> None:
        self.capsule = capsule

    def __dlpack_device__(self):
        return capsule_info(self.capsule)["device"]

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        if copy:
            raise BufferError("a raw DLPack capsule cannot be copied by its producer")
        return self.capsule


class _BFloat16AsBits:
    """A DLPack producer forwarding to ``source`` that hands bfloat16 capsules out as uint16
    (same memory), so numpy and CuPy, which refuse bfloat16, import them without a copy."""

    __slots__ = ("source", "was_bfloat16")

    def __init__(self, source) -> None:
        self.source = _CapsuleProducer(source) if is_capsule(source) else source
        self.was_bfloat16 = False

    def __dlpack_device__(self):
        return self.source.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        capsule = self.source.__dlpack__(**kwargs)
        if _retag(capsule, (KDL_BFLOAT, 16), (KDL_UINT, 16)):
            self.was_bfloat16 = True
        return capsule


def import_dlpack(x: Any, target: str = "cpu") -> Tuple[Any, bool]:
    """``(array, was_bfloat16)``: a numpy (``target="cpu"``) or CuPy (``target="cuda"``) array
    over the memory of the DLPack producer (or unconsumed capsule) ``x``, never a copy; a
    bfloat16 producer comes back as a uint16 array of its bit patterns with ``was_bfloat16``
    true. The array keeps the producer's memory alive and releases it when it dies (the
    consumer library calls the producer's deleter)."""
    proxy = _BFloat16AsBits(x)
    if target == "cpu":
        arr = np.from_dlpack(proxy)
    elif target == "cuda":
        import cupy
        arr = cupy.from_dlpack(proxy)
    else:
        raise ValueError(f"target must be 'cpu' or 'cuda', got {target!r}")
    return arr, proxy.was_bfloat16


def host_array_from_dlpack(x: Any) -> np.ndarray:
    """A numpy array over a host DLPack tensor's memory (no copy); bfloat16 tensors (torch,
    JAX, :class:`BFloat16View`) come back as uint16 arrays of their bit patterns."""
    if isinstance(x, BFloat16View):
        if not isinstance(x.bits, np.ndarray):
            raise BufferError("this BFloat16View lives on the GPU")
        return x.bits
    return import_dlpack(x, "cpu")[0]


def cupy_array_from_dlpack(x: Any):
    """A CuPy array over a GPU DLPack tensor's memory (no copy); bfloat16 tensors come back as
    uint16 arrays of their bit patterns."""
    if isinstance(x, BFloat16View):
        if isinstance(x.bits, np.ndarray):
            raise BufferError("this BFloat16View lives on the host")
        return x.bits
    return import_dlpack(x, "cuda")[0]


# --------------------------------------------------------------------------------------------
# export


class BFloat16View:
    """A uint16 numpy or CuPy array of bfloat16 bit patterns that exports through DLPack as
    bfloat16, sharing memory.

    ``torch.from_dlpack(view)`` gives a ``torch.bfloat16`` tensor over ``view.bits`` (writes
    through either show in the other); ``jax.dlpack.from_dlpack`` and ``cupy.from_dlpack`` work
    the same way. numpy cannot hold bfloat16, so there is no ``__array__``: use ``.bits`` for
    the raw patterns or :meth:`to_float32` for values. Indexing gives another view.

    Attributes: ``bits`` (the uint16 array), ``shape``, ``ndim``, ``strides`` (in elements),
    ``size``, ``nbytes``, ``dtype`` (the string ``"bfloat16"``), ``device`` (``"cpu"`` or
    ``"cuda"``).
    """

    __slots__ = ("bits", "__weakref__")
    dtype = "bfloat16"

    def __init__(self, bits) -> None:
        if not (isinstance(bits, np.ndarray) or _is_cupy(bits)):
            raise ValueError(f"bits must be a numpy or CuPy uint16 array, got {type(bits).__name__}")
        if bits.dtype != np.uint16:
            raise ValueError(f"bits must have dtype uint16 (bfloat16 bit patterns), got {bits.dtype}")
        self.bits = bits

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.bits.shape)

    @property
    def ndim(self) -> int:
        return self.bits.ndim

    @property
    def strides(self) -> Tuple[int, ...]:
        """Strides in elements (DLPack's unit), not bytes."""
        return tuple(s // 2 for s in self.bits.strides)

    @property
    def size(self) -> int:
        return int(self.bits.size)

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)

    @property
    def device(self) -> str:
        return "cpu" if isinstance(self.bits, np.ndarray) else "cuda"

    def __len__(self) -> int:
        return len(self.bits)

    def __getitem__(self, key) -> "BFloat16View":
        out = self.bits[key]
        if not (isinstance(out, np.ndarray) or _is_cupy(out)):
            # a full integer index gives a numpy scalar (a copy): ask for a 0-d view instead
            out = self.bits[(key if isinstance(key, tuple) else (key,)) + (Ellipsis,)]
        return BFloat16View(out)

    def __repr__(self) -> str:
        return f"BFloat16View(shape={self.shape}, device={self.device!r})"

    def __array__(self, *args, **kwargs):
        raise TypeError("numpy has no bfloat16: use view.bits (uint16 bit patterns) or "
                        "view.to_float32()")

    def copy(self) -> "BFloat16View":
        return BFloat16View(self.bits.copy())

    def to_float32(self):
        """A float32 copy of the values (numpy or CuPy, like ``bits``): bfloat16 is the high
        half of a float32, so this is exact."""
        xp = np if isinstance(self.bits, np.ndarray) else __import__("cupy")
        return (self.bits.astype(xp.uint32) << 16).view(xp.float32)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self.bits.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule of ``bits`` tagged bfloat16: versioned when the consumer passes
        ``max_version >= (1, 0)`` and the array library supports it, legacy otherwise. On the
        GPU, ``stream`` orders the export after pending work exactly as CuPy does."""
        bits = self.bits
        if any(s < 0 for s in bits.strides):
            # DLPack allows them, but torch (2.x) aborts the whole process on negative strides
            raise BufferError("BFloat16View does not export negative strides (torch cannot "
                              "import them): export a copy, view.copy()")
        host = isinstance(bits, np.ndarray)
        kwargs = {}
        # CPU memory has no streams (DLPack says the consumer passes None); numpy refuses any
        # other value, so drop what a lenient consumer may send.
        if stream is not None and not host:
            kwargs["stream"] = stream
        for key, value in (("max_version", max_version), ("dl_device", dl_device),
                           ("copy", copy)):
            if value is not None:
                kwargs[key] = value
        try:
            capsule = bits.__dlpack__(**kwargs)
        except TypeError:
            # An older array library (numpy < 2.1, CuPy 13) knows only `stream`: honour
            # dl_device and copy here and return a legacy capsule, which DLPack allows.
            if dl_device is not None and tuple(int(v) for v in dl_device) != \
                    tuple(int(v) for v in self.__dlpack_device__()):
                raise BufferError(f"cannot export to DLPack device {tuple(dl_device)}: the data "
                                  f"lives on {tuple(self.__dlpack_device__())}") from None
            if copy:
                bits = bits.copy()
            capsule = bits.__dlpack__(**({"stream": stream} if "stream" in kwargs else {}))
        if not _retag(capsule, (KDL_UINT, 16), (KDL_BFLOAT, 16)):
            raise BufferError("the storage exported an unexpected dtype (expected uint16)")
        return capsule


__all__ = ["BFloat16View", "host_array_from_dlpack", "cupy_array_from_dlpack", "import_dlpack",
           "capsule_info", "dlpack_device", "is_capsule", "KDL_CPU", "KDL_CUDA", "KDL_CUDA_HOST",
           "KDL_CUDA_MANAGED", "KDL_BFLOAT"]
