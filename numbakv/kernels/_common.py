"""Pieces every kernel family shares: launch geometry, raw-word views for wide copies, float
conversions for 16-bit storage, and the fast CUDA launch path.

Arrays reach the kernels as *raw bits* wherever the math does not look at the values (put, move,
mask): 16-bit data as ``uint16``, 32-bit as ``uint32`` and, where the row length, strides and
(on a GPU) the address allow, whole 4-, 8- or (GPU kernels) 16-byte words, so one kernel serves
every dtype and a plain copy moves 16 bytes per thread access (:func:`copy_raw`). Only the
rotary kernel converts to float32.

Launching: ``cpu`` runs the ``@njit`` twins on numpy arrays; ``sim`` runs the ``@cuda.jit``
kernels through Numba's dispatcher (the simulator); ``cuda`` launches the same kernels on CuPy
arrays. Numba's dispatcher spends tens of microseconds per launch typing and wrapping each
argument, so on ``cuda`` each kernel is compiled once per exact signature (every array typed
``'A'``), loaded through CuPy's driver API and launched with a flat, preallocated parameter
buffer (:class:`FastKernel`): a few microseconds of host time per launch. The dispatcher stays as
the fallback (``NUMBAKV_FAST_LAUNCH=0`` forces it).
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

from ._registry import element

#: threads per block: the simulator runs one Python thread per CUDA thread, so keep it small there
BLOCK_CUDA = 256
BLOCK_SIM = 32
#: the largest grid extent along y and z (kernels loop when they need more)
MAX_GRID_YZ = 65535

#: unsigned integer dtype holding one raw element/word of each byte size
UINT = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32),
        8: np.dtype(np.uint64)}
#: the dtype of a 16-byte raw word: complex128, numpy's only 16-byte scalar that Numba's CUDA
#: target can type. The kernels never compute on it, they only copy its bits with
#: :func:`copy_raw` (one 128-bit load and store on the GPU)
WORD16 = np.dtype(np.complex128)
#: the raw-word dtype of each width, 16 bytes included (:data:`UINT` plus :data:`WORD16`)
WORD = {**UINT, 16: WORD16}
#: the widest word the GPU kernels (and the simulator, which mirrors them) copy at once; the CPU
#: twins keep 8 (LLVM vectorises their contiguous loops itself)
DEVICE_WORD = 16


def block_size(device: str) -> int:
    return BLOCK_SIM if device == "sim" else BLOCK_CUDA


#: resident blocks per SM a grid-striding launch is sized for: 8 blocks of 256 threads fill an
#: SM's 2,048 thread slots (sm_80/sm_90); larger work loops inside each thread instead of
#: launching idle or queued blocks
BLOCKS_PER_SM = 8
#: the simulator's cap (Python threads): small, so the tests exercise the grid-stride loops
SIM_MAX_BLOCKS = 4
_SM_COUNT: Dict[int, int] = {}


def sm_count(device_id: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_id`` (cached)."""
    n = _SM_COUNT.get(device_id)
    if n is None:
        import cupy
        n = _SM_COUNT[device_id] = int(
            cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])
    return n


def max_blocks(device: str) -> int:
    """The most blocks one index space of a grid-striding launch gets on ``device``: enough to
    fill every SM (:data:`BLOCKS_PER_SM` per SM) on ``cuda``."""
    if device == "cuda":
        import cupy
        return sm_count(cupy.cuda.runtime.getDevice()) * BLOCKS_PER_SM
    return SIM_MAX_BLOCKS


def flat_blocks(items: int, block: int, cap: int) -> int:
    """Blocks for a flattened index space of ``items`` work items (one per thread, the rest
    grid-strided): every block has work; at most ``cap`` blocks."""
    return min(cdiv(items, block), int(cap)) if items > 0 else 0


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


# --------------------------------------------------------------------------------------------
# float conversions for 16-bit storage, shared by the CPU twins (numba has no float16 on the
# CPU) and the CUDA kernels (bfloat16 has no numpy dtype). Integer math in int64 throughout
# (numba widens small integers anyway); the last step casts to the storage width.

@element
def head_word(r, n_heads, n_words):
    """Lane ``r`` of a ``[n_heads, n_words]`` row as ``(head, word)``; a single head needs no
    division."""
    h = 0
    if n_heads > 1:
        h = r // n_words
    return h, r - h * n_words


# Written with conditional expressions rather than branches, so LLVM turns them into selects and
# the CPU twins' loops vectorise.

@element
def f16_bits_to_f32(h):
    """IEEE half (as its 16-bit pattern) to float32, exactly (subnormals, inf, NaN kept)."""
    h = np.int64(h)
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    bits = sign | (0x7F800000 if exp == 31 else (exp + 112) << 23) | (mant << 13)
    # zero or subnormal: mant * 2**-24 is exact in float32
    small = np.float32(mant) * np.float32(5.9604644775390625e-08)
    small = -small if sign != 0 else small
    return small if exp == 0 else np.uint32(bits).view(np.float32)


@element
def f32_to_f16_bits(x):
    """float32 to the 16-bit pattern of IEEE half, rounding to nearest even (as numpy does);
    overflow gives inf, NaN stays a (quiet) NaN."""
    b = np.int64(np.float32(x).view(np.uint32))
    sign = (b >> 16) & 0x8000
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    ee = e - 112  # the half exponent field this value would have
    # normal half: drop 13 mantissa bits, round to nearest even; a carry moves into the
    # exponent (up to inf)
    hm = m >> 13
    rem = m & 0x1FFF
    normal = (ee << 10) + hm + (1 if (rem > 0x1000) | ((rem == 0x1000) & ((hm & 1) != 0)) else 0)
    # subnormal half (-10 <= ee <= 0): the implicit bit shifted down, same rounding
    shift = min(max(14 - ee, 14), 24)
    mm = m | 0x800000
    hs = mm >> shift
    rs = mm & ((1 << shift) - 1)
    halfway = 1 << (shift - 1)
    sub = hs + (1 if (rs > halfway) | ((rs == halfway) & ((hs & 1) != 0)) else 0)
    out = sub if ee >= -10 else 0
    out = normal if ee > 0 else out
    out = 0x7C00 if ee >= 31 else out
    out = (0x7C00 | (0x200 if m != 0 else 0)) if e == 0xFF else out
    return np.uint16(sign | out)


@element
def bf16_bits_to_f32(b):
    """bfloat16 (its 16-bit pattern) to float32: the high half of the float32 bits."""
    return np.uint32(np.int64(b) << 16).view(np.float32)


@element
def f32_to_bf16_bits(x):
    """float32 to bfloat16 bits, rounding to nearest even; NaN stays a quiet NaN."""
    b = np.int64(np.float32(x).view(np.uint32))
    rounded = (b + (((b >> 16) & 1) + 0x7FFF)) >> 16
    return np.uint16(((b >> 16) | 0x40) if (b & 0x7FFFFFFF) > 0x7F800000 else rounded)


# --------------------------------------------------------------------------------------------
# float16 on the CPU through the hardware: LLVM's half-precision conversions (``fpext half to
# float``, ``fptrunc float to half``), which x86 CPUs with F16C run as vcvtph2ps / vcvtps2ph (8
# or 16 lanes at a time once LLVM vectorises the loop) and AArch64 as fcvt. The hardware quiets
# signalling NaNs where numpy's conversion keeps them signalling, so one select per value puts
# numpy's NaN bits back: the results are bit-identical with numpy's for every input.

def cpu_has_f16c() -> bool:
    """Whether Numba's CPU target converts halves in hardware: x86 with F16C in the features
    Numba compiles for (the host's unless ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` say
    otherwise), or AArch64. Without it LLVM would call compiler-rt helpers Numba may not link."""
    import platform
    from numba.core import config as nb_config
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    if machine not in ("x86_64", "amd64", "i686", "x86"):
        return False
    if nb_config.CPU_FEATURES is not None:
        return "+f16c" in str(nb_config.CPU_FEATURES)
    if nb_config.CPU_NAME not in (None, "host"):
        return False
    try:
        import llvmlite.binding as llvm
        return bool(llvm.get_host_cpu_features().get("f16c", False))
    except Exception:  # noqa: BLE001
        return False


from numba.extending import intrinsic as _intrinsic  # noqa: E402


@_intrinsic
def _hw_half_to_float(typingctx, h):
    """uint16 bits -> float32 through LLVM's ``fpext half to float``."""
    from llvmlite import ir

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@_intrinsic
def _hw_float_to_half(typingctx, x):
    """float32 -> uint16 bits through LLVM's ``fptrunc float to half`` (round to nearest even)."""
    from llvmlite import ir

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


def _f16_to_f32_hw(h):
    """IEEE half bits to float32 in hardware, exactly as numpy (signalling NaNs stay
    signalling)."""
    f = np.float32(_hw_half_to_float(h)).view(np.uint32)
    snan = ((h & 0x7C00) == 0x7C00) & ((h & 0x3FF) != 0) & ((h & 0x200) == 0)
    return np.uint32(f & np.uint32(0xFFBFFFFF) if snan else f).view(np.float32)


def _f32_to_f16_hw(x):
    """float32 to IEEE half bits in hardware (round to nearest even), NaNs as numpy makes them:
    sign, 0x7C00 and the top 10 payload bits (0x7C01 when those are all zero)."""
    h = _hw_float_to_half(x)
    b = np.float32(x).view(np.uint32)
    payload = np.uint16((b >> 13) & 0x3FF)
    nan_bits = np.uint16(((b >> 16) & 0x8000) | 0x7C00 | (payload if payload != 0 else 1))
    return nan_bits if (b & 0x7FFFFFFF) > 0x7F800000 else h


def _njit_inline(fn):
    from numba import njit
    return njit(inline="always", cache=False)(fn)


f16_bits_to_f32_hw = _njit_inline(_f16_to_f32_hw)
f32_to_f16_bits_hw = _njit_inline(_f32_to_f16_hw)


# --------------------------------------------------------------------------------------------
# raw-word views

def word_size(row_bytes: int, itemsize: int, byte_strides: Sequence[int], ptr: Optional[int],
              last_stride: int, widest: int = 8) -> int:
    """The widest word (``widest`` = 16 or 8 bytes, then 4 or 2, never narrower than an
    element) that tiles a row of ``row_bytes``: the last axis must be contiguous and every outer
    stride (and, on a GPU, the address) a multiple of it. Falls back to the element size. Decided
    once per launch on the host, so the kernel's accesses are aligned by construction."""
    if last_stride != itemsize:
        return itemsize
    for w in (16, 8, 4, 2):
        if w > widest:
            continue
        if w < itemsize:
            break
        if row_bytes % w:
            continue
        if any(s % w for s in byte_strides):
            continue
        if ptr is not None and ptr % w:
            continue
        return w
    return itemsize


def copy_raw(dst, di, src, si):
    """``dst[di] = src[si]`` for one raw word (``di``, ``si``: index tuples), as the kernels and
    CPU twins copy data. Plain Python here (the simulator runs it); Numba compiles it through the
    overloads below: an assignment on the CPU and for words up to 8 bytes on the GPU, and for
    16-byte words (:data:`WORD16`) one ``ld.global.v2.u64`` / ``st.global.v2.u64`` pair. Numba's
    own complex128 copy would be two 8-byte accesses, since it cannot know the address is
    16-byte aligned; the launchers guarantee it (:func:`word_size` checks every base pointer
    and stride), so the CUDA form states that alignment to the compiler."""
    dst[di] = src[si]


from numba.extending import overload as _overload  # noqa: E402


@_overload(copy_raw, inline="always")
def _copy_raw_cpu(dst, di, src, si):
    def impl(dst, di, src, si):
        dst[di] = src[si]
    return impl


def _register_cuda_copy_raw() -> None:
    """The CUDA target's :func:`copy_raw` (not while the simulator is on: it runs the Python)."""
    from llvmlite import ir
    from numba.cuda import cgutils as cuda_cgutils
    from numba.cuda.extending import intrinsic as cuda_intrinsic, overload as cuda_overload

    def item_pointer(context, builder, aryty, ary, idxty, idx):
        indices = [context.cast(builder, v, t, types.intp) for v, t in
                   zip(cuda_cgutils.unpack_tuple(builder, idx, idxty.count), idxty.types)]
        arr = context.make_array(aryty)(context, builder, value=ary)
        return cuda_cgutils.get_item_pointer(context, builder, aryty, arr, indices,
                                             wraparound=False)

    @cuda_intrinsic
    def copy16(typingctx, dst, di, src, si):
        """One 16-byte word from ``src[si]`` to ``dst[di]``: a ``<2 x i64>`` load and store in
        the global address space with 16-byte alignment, which the NVPTX back end emits as
        ``ld.global.v2.u64`` / ``st.global.v2.u64``."""
        def codegen(context, builder, sig, args):
            dty, dity, sty, sity = sig.args
            d, dix, s, six = args
            vec = ir.VectorType(ir.IntType(64), 2)
            glob = ir.PointerType(vec, 1)  # addrspace(1): global memory

            def pointer(aryty, ary, idxty, idx):
                p = item_pointer(context, builder, aryty, ary, idxty, idx)
                return builder.addrspacecast(builder.bitcast(p, vec.as_pointer()), glob)
            word = builder.load(pointer(sty, s, sity, six), align=16)
            builder.store(word, pointer(dty, d, dity, dix), align=16)
            return context.get_dummy_value()
        return types.void(dst, di, src, si), codegen

    @cuda_overload(copy_raw, target="cuda", inline="always")
    def _copy_raw_cuda(dst, di, src, si):
        if dst.dtype == src.dtype == types.complex128:
            def impl16(dst, di, src, si):
                copy16(dst, di, src, si)
            return impl16

        def impl(dst, di, src, si):
            dst[di] = src[si]
        return impl


def _simulator_on() -> bool:
    from numba.core import config as nb_config
    return bool(nb_config.ENABLE_CUDASIM)


if not _simulator_on():
    _register_cuda_copy_raw()


class Desc(NamedTuple):
    """A strided view of device memory described by numbers alone (what a Numba kernel receives
    for an array argument), so the CUDA launch path never builds CuPy views per call."""
    ptr: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    dtype: np.dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n



class _DeviceView:
    """A :class:`Desc` as an object speaking the CUDA array interface, for Numba's dispatcher
    (the fallback path). Not the Desc itself: Numba would type a NamedTuple as a tuple."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, d: Desc) -> None:
        self.__cuda_array_interface__ = {
            "shape": d.shape, "strides": d.strides, "typestr": d.dtype.str,
            "data": (d.ptr, False), "version": 3}


def desc_of(arr, dtype=None) -> Desc:
    """The descriptor of a CuPy array (optionally reinterpreted as another dtype of the same
    itemsize)."""
    dt = arr.dtype if dtype is None else np.dtype(dtype)
    return Desc(int(arr.data.ptr), tuple(arr.shape), tuple(arr.strides), np.dtype(dt))


# --------------------------------------------------------------------------------------------
# the CUDA launch path

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
        from .ptx import link_cubin
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


def capturing(stream) -> bool:
    """Whether ``stream`` is capturing a CUDA graph. Asking about the legacy NULL stream while
    another stream captures in global mode is itself an error: counted as capturing (then
    nothing queries or synchronises)."""
    try:
        return bool(stream.is_capturing())
    except Exception:  # noqa: BLE001
        return True


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
        self._free: List[list] = []    # [nbytes, pinned memory, host view, event]
        self._busy: List[list] = []
        self.captured: List[Any] = []  # buffers a captured graph reads: never reused

    @staticmethod
    def _new(nbytes: int) -> list:
        import cupy
        cap = max(4096, 1 << (int(nbytes) - 1).bit_length())
        mem = cupy.cuda.alloc_pinned_memory(cap)
        return [cap, mem, np.frombuffer(mem, np.uint8, cap), None]

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
                oldest[3].synchronize()  # the GPU is MAX_BUFFERS launches behind: wait
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


def to_device(device: str, *arrays: np.ndarray):
    """Host arrays for a kernel: as they are on ``cpu``/``sim``; on ``cuda`` packed into one
    pinned, reused host buffer (:class:`HostStaging`) and copied asynchronously, with a single
    transfer, on the current stream into one device buffer; returned as :class:`Desc` views. The
    device buffer is returned too: keep it alive until the kernel that reads it is queued (CuPy's
    pool orders its reuse on the stream)."""
    if device != "cuda":
        return arrays, None
    import cupy
    parts = [np.ascontiguousarray(a) for a in arrays]
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
    dev = cupy.empty(total, dtype=np.uint8)
    # a c_void_p: CuPy < 13.x reads ``mem.value``; newer versions take it too
    dev.data.copy_from_host_async(ctypes.c_void_p(host.ctypes.data), total, stream)
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
        stream.synchronize()
        return host[:nbytes].view(dev.dtype).reshape(dev.shape).copy()


def device_arg(device: str, arr, dtype=None):
    """A storage/output array as a kernel argument: itself (numpy, optionally viewed as another
    dtype of the same size) or its :class:`Desc` on ``cuda``."""
    if device == "cuda":
        return desc_of(arr, dtype)
    return arr if dtype is None else arr.view(dtype)


__all__ = ["cpu_has_f16c", "f16_bits_to_f32_hw", "f32_to_f16_bits_hw", "BLOCKS_PER_SM", "BLOCK_CUDA", "BLOCK_SIM", "MAX_GRID_YZ", "SIM_MAX_BLOCKS", "flat_blocks",
           "max_blocks", "sm_count", "UINT", "Desc", "FastKernel", "HostStaging",
           "Prepared", "device_cc", "load_image", "preload", "staging_for",
           "ptx_entry",
           "bf16_bits_to_f32", "block_size", "cdiv", "desc_of", "device_arg", "f16_bits_to_f32",
           "f32_to_bf16_bits", "f32_to_f16_bits", "fast_launch_enabled", "head_word", "launch",
           "set_fast_launch",
           "numba_type", "to_device", "word_size", "copy_raw", "DEVICE_WORD", "WORD", "WORD16",
           "device_to_host"]
