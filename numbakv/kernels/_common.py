"""Pieces every kernel family shares: launch geometry, raw-word views for wide copies, float
conversions for 16-bit storage, and array descriptors (the fast CUDA launch path that consumes
them is :mod:`numbakv.kernels.launch`).

Arrays reach the kernels as *raw bits* wherever the math does not look at the values (put, move,
mask): 16-bit data as ``uint16``, 32-bit as ``uint32`` and, where the row length, strides and
(on a GPU) the address allow, whole 4-, 8- or (GPU kernels) 16-byte words, so one kernel serves
every dtype and a plain copy moves 16 bytes per thread access (:func:`copy_raw`). Only the
rotary kernel converts to float32.

Launching (``cpu`` twins, ``sim`` dispatcher, ``cuda`` fast launch) is ``launch.py``'s.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from numba import types

from ._registry import element, on_cuda_import

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


def copy_raw4(dst, d0, d1, d2, d3, src, s0, s1, s2, s3):
    """Four raw words ``dst[dk] = src[sk]``, all four loaded before the first store: the loads
    are independent, so a GPU thread has four memory requests in flight instead of one (a store
    may alias a later load, so the compiler would not reorder :func:`copy_raw` calls itself).
    The callers guarantee that no destination word is also a source word."""
    a = src[s0]
    b = src[s1]
    c = src[s2]
    e = src[s3]
    dst[d0] = a
    dst[d1] = b
    dst[d2] = c
    dst[d3] = e


from numba.extending import overload as _overload  # noqa: E402


# The plain forms above are also the compiled ones on the CPU and for GPU words up to 8 bytes
# (written once: the overloads hand Numba the same Python functions).

@_overload(copy_raw4, inline="always")
def _copy_raw4_cpu(dst, d0, d1, d2, d3, src, s0, s1, s2, s3):
    return copy_raw4


@_overload(copy_raw, inline="always")
def _copy_raw_cpu(dst, di, src, si):
    return copy_raw


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

    @cuda_intrinsic
    def copy16x4(typingctx, dst, d0, d1, d2, d3, src, s0, s1, s2, s3):
        """Four 16-byte words: four ``ld.global.v2.u64`` issued, then four stores."""
        def codegen(context, builder, sig, args):
            vec = ir.VectorType(ir.IntType(64), 2)
            glob = ir.PointerType(vec, 1)

            def pointer(aryty, ary, idxty, idx):
                p = item_pointer(context, builder, aryty, ary, idxty, idx)
                return builder.addrspacecast(builder.bitcast(p, vec.as_pointer()), glob)
            dty, sty = sig.args[0], sig.args[5]
            words = [builder.load(pointer(sty, args[5], sig.args[6 + k], args[6 + k]), align=16)
                     for k in range(4)]
            for k in range(4):
                builder.store(words[k], pointer(dty, args[0], sig.args[1 + k], args[1 + k]),
                              align=16)
            return context.get_dummy_value()
        return types.void(dst, d0, d1, d2, d3, src, s0, s1, s2, s3), codegen

    @cuda_overload(copy_raw4, target="cuda", inline="always")
    def _copy_raw4_cuda(dst, d0, d1, d2, d3, src, s0, s1, s2, s3):
        if dst.dtype == src.dtype == types.complex128:
            def impl16(dst, d0, d1, d2, d3, src, s0, s1, s2, s3):
                copy16x4(dst, d0, d1, d2, d3, src, s0, s1, s2, s3)
            return impl16
        return copy_raw4

    @cuda_overload(copy_raw, target="cuda", inline="always")
    def _copy_raw_cuda(dst, di, src, si):
        if dst.dtype == src.dtype == types.complex128:
            def impl16(dst, di, src, si):
                copy16(dst, di, src, si)
            return impl16
        return copy_raw


def mul_rn(a, b):
    """``a * b`` (float32) rounded on its own, never fused with a following add: NVVM contracts
    ``a * b + c`` into one FMA by default (one rounding instead of two), which changes results
    against ggml's CPU reference (q4_0's ``x * (1/d) + 8.5``). Plain Python here (the simulator
    runs it); the CPU form is a multiply (LLVM does not contract without fast-math), the CUDA
    form libdevice's ``__fmul_rn``, which is never merged into an FMA."""
    return a * b


@_overload(mul_rn, inline="always")
def _mul_rn_cpu(a, b):
    def impl(a, b):
        return a * b
    return impl


def _register_cuda_mul_rn() -> None:
    """The CUDA target's :func:`mul_rn` (not while the simulator is on)."""
    from numba.cuda import libdevice
    from numba.cuda.extending import overload as cuda_overload

    @cuda_overload(mul_rn, target="cuda", inline="always")
    def _mul_rn_cuda(a, b):
        def impl(a, b):
            return libdevice.fmul_rn(a, b)
        return impl


def _simulator_on() -> bool:
    from numba.core import config as nb_config
    return bool(nb_config.ENABLE_CUDASIM)


@on_cuda_import
def _register_cuda_overloads() -> None:
    """The CUDA forms of :func:`copy_raw` / :func:`copy_raw4` / :func:`mul_rn` (the simulator
    runs their Python)."""
    if not _simulator_on():
        _register_cuda_copy_raw()
        _register_cuda_mul_rn()


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


def sig_array(dt, nd: int) -> types.Array:
    """The Numba type of a kernel's array argument in an eager signature: ``nd``-D of ``dt``,
    layout ``'A'`` (strided), as the fast launch path types every array (launch.numba_type)."""
    return types.Array(dt, nd, "A")


#: the element types a kernel sees float storage as (rope.storage_kind): float16 natively on a
#: GPU, float32, and 16-bit patterns (float16 on the CPU, bfloat16 everywhere)
STORAGE_VIEW_TYPES = (types.float16, types.float32, types.uint16)


#: the (K word, V word) pairs the put and move kernels are compiled for: K and V rows alike
#: (16-byte words where aligned), or a permuted V copied element by element
WORD_PAIRS = [(types.complex128, types.complex128), (types.uint64, types.uint64),
              (types.uint32, types.uint32), (types.uint16, types.uint16),
              (types.complex128, types.uint16), (types.complex128, types.uint32),
              (types.uint64, types.uint16), (types.uint64, types.uint32)]

__all__ = ["cpu_has_f16c", "f16_bits_to_f32_hw", "f32_to_f16_bits_hw", "BLOCKS_PER_SM",
           "BLOCK_CUDA", "BLOCK_SIM", "MAX_GRID_YZ", "SIM_MAX_BLOCKS", "flat_blocks", "max_blocks", "sm_count",
           "UINT", "Desc", "bf16_bits_to_f32", "block_size", "cdiv", "desc_of", "f16_bits_to_f32",
           "f32_to_bf16_bits", "f32_to_f16_bits", "head_word", "word_size", "copy_raw",
           "DEVICE_WORD", "WORD", "WORD16", "sig_array", "WORD_PAIRS", "copy_raw4", "mul_rn"]
