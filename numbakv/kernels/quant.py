"""quantized K/V: quantize on put, dequantize a cell range, the rotary shift on quantized keys,
and raw moves of quantized (or any) storage rows.

Storage of a quantized side is ``uint8 [n_layers, n_cells, n_kv_heads, row_bytes]``, one row per
(cell, head), its blocks running along the head dim:

- ``q8_0`` (ggml): per 32 values an f16 scale ``d = amax / 127`` (little-endian) then 32 int8s
  ``round(x * (1/d))`` (half away from zero), 34 bytes.
- ``q4_0`` (ggml): per 32 values an f16 ``d = m / -8`` (``m`` the signed value of largest
  magnitude, the first one on ties) then 16 bytes: ``min(15, int(x * (1/d) + 8.5))``, element
  ``j`` in the low nibble of byte ``j`` and element ``j + 16`` in the high nibble, 18 bytes.
- ``float8_e4m3``: one float8_e4m3fn byte per value, ``stored = x / scale`` with a per-layer
  scale (vLLM's fp8 KV cache), rounded to nearest even, saturating at +-448 (CUDA's
  ``__NV_SATFINITE``, which vLLM uses): infinities become +-448, NaN stays NaN (0x7F/0xFF).

All math is float32, exactly as ggml's reference (``ggml_quantize_row_q8_0_ref``; numpy's
``gguf.quants``) does it, so blocks are bit-identical to ggml's for finite inputs. **Non-finite
inputs** (ggml leaves them undefined): a q8_0/q4_0 block holding a NaN or an infinity is stored
with a NaN scale (f16 0x7E00) and zero quants, so every value of that block dequantizes to NaN
(what the gguf reference gives for a NaN block) instead of becoming finite garbage.

Dequantized values are ``d * q`` (float32) then rounded to the cache's ``dtype``. The rotary
shift dequantizes a key row into float32, rotates it with :mod:`.rope`'s pair math and
requantizes it, in one pass per (layer, cell, head): ``quantize(rotate(dequantize(k)))``.
"""

from __future__ import annotations

import types as pytypes

import numpy as np
import numba
from numba import prange, types
from numba.extending import intrinsic

from .._jit import njit
from ._common import (MAX_GRID_YZ, STORAGE_VIEW_TYPES, UINT, _hw_float_to_half, block_size,
                      cdiv, f16_bits_to_f32, f16_bits_to_f32_hw, f32_to_bf16_bits,
                      f32_to_f16_bits, mul_rn, sig_array as _arr)
from .hadamard import (_vector_ptr, cpu_fma_lanes, rotation_scale, wht_pair_index, wht_row_cpu,
                       wht_staged, wht_stages, wht_sum_diff)
from .launch import device_arg, launch as _launch, to_device
from ._registry import cuda, cuda_device, cuda_jit_from, cuda_kernel, element, resolved
from .move import move_step, normalize
from .rope import (F16_HW, KIND_F16_BITS, KIND_F16_HW, KIND_FLOAT, load_f32, pair_index,
                   rotate_pair, shift_plan, storage_kind)

#: storage formats (kernel argument ``fmt``)
FMT_Q8_0, FMT_Q4_0, FMT_F8 = 1, 2, 3
FORMATS = {"q8_0": FMT_Q8_0, "q4_0": FMT_Q4_0, "float8_e4m3": FMT_F8}
#: values per block and bytes per block of each format (a float8 "block" is one value)
BLOCK_VALUES = {FMT_Q8_0: 32, FMT_Q4_0: 32, FMT_F8: 1}
BLOCK_BYTES = {FMT_Q8_0: 34, FMT_Q4_0: 18, FMT_F8: 1}
#: the longest key row the rotary shift takes (a float32 row per GPU thread in local memory)
MAX_ROTATE_DIM = 1024
#: grid x cap of the row-per-block kernel (blocks grid-stride beyond it)
_MAX_GRID_X = 1 << 20


def _bound_element(names: dict):
    """:func:`element`, with the helper names ``fn`` calls bound per target: an element function
    that takes arrays must call the same target's form of the next one (the simulator hands
    kernels array wrappers that CPU ``@njit`` code cannot take). ``names`` maps a helper's name
    to its :class:`Element`; the CPU form sees each ``.cpu``, the CUDA form each ``.cuda``."""
    def wrap(fn):
        def bound(form):
            # the module's globals as they are now: for the CUDA form (made once numba.cuda is
            # imported, see _registry.Deferred) every stand-in already replaced by its object
            g = dict(fn.__globals__)
            g.update({k: getattr(v, form) for k, v in names.items()})
            if form == "cuda":     # the globals fn reads, real (not its module's own alias)
                g.update({k: resolved(g[k]) for k in fn.__code__.co_names if k in g})
            return pytypes.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__,
                                        fn.__closure__)
        e = element(bound("cpu"))
        # the CUDA form is made (and compiled) only when a CUDA kernel first needs it
        e.cuda = cuda_jit_from(lambda: bound("cuda"), device=True)
        e.py_func = fn
        return e
    return wrap


_FLT_MAX = np.float32(3.4028234663852886e38)


# --------------------------------------------------------------------------------------------
# float8_e4m3fn conversions (bias 7, 3 mantissa bits, no infinities, max 448, NaN 0x7F)

@element
def f32_to_e4m3(x):
    """float32 to float8_e4m3fn bits: round to nearest even, saturate to +-448, NaN kept.
    Written with conditional expressions, not branches (LLVM makes them selects: the element
    put of 4096 x 8 x 128 float16 K+V took 27 -> 17 ms; the CPU's vector put is
    :func:`_fused_f8_put_chunk`). Every arm is computed; the subnormal arm's input is clamped
    so its integer conversion stays defined for values the other arms take."""
    b = np.int64(np.float32(x).view(np.uint32))
    sign = (b >> 24) & 0x80
    a = abs(np.float32(x))
    # normal (2**-6 and up): drop 20 mantissa bits, round to nearest even; a mantissa carry
    # moves into the exponent (below 448 it never reaches the NaN code 0x7F)
    keep = (b & 0x7FFFFF) >> 20
    rem = b & 0xFFFFF
    up = 1 if (rem > 0x80000) | ((rem == 0x80000) & ((keep & 1) != 0)) else 0
    normal = ((((b >> 23) & 0xFF) - 120) << 3) + keep + up
    # subnormal: k * 2**-9, k in 0..8 (8 is the smallest normal, 0x08)
    y = (a if a < np.float32(0.015625) else np.float32(0.015625)) * np.float32(512.0)
    k = np.int64(y)
    r = y - np.float32(k)
    sub = k + (1 if (r > np.float32(0.5)) | ((r == np.float32(0.5)) & ((k & 1) != 0)) else 0)
    out = normal if a >= np.float32(0.015625) else sub
    out = 0x7E if a >= np.float32(448.0) else out
    out = out if a == a else 0x7F
    return np.uint8(sign | out)


@element
def e4m3_to_f32(v):
    """float8_e4m3fn bits to float32 (exact); conditional expressions, as
    :func:`f32_to_e4m3`."""
    v = np.int64(v)
    e = (v >> 3) & 0xF
    m = v & 0x7
    normal = np.uint32((((e + 120) << 23) | (m << 20)) & 0xFFFFFFFF).view(np.float32)
    small = np.float32(m) * np.float32(0.001953125)  # 2**-9: a subnormal, exact
    y = small if e == 0 else normal
    y = np.float32(np.nan) if (v & 0x7F) == 0x7F else y
    return -y if (v & 0x80) != 0 else y


# --------------------------------------------------------------------------------------------
# one stored ggml value (scalars only: the dequantizer below and the GPU decode kernel, which
# reads single values of a row straight from the pool, share them)

@element
def q8_0_int(byte):
    """The signed quant of one q8_0 byte: the value is ``d * q`` (``d`` the block's scale)."""
    return np.int32(np.int8(byte))


@element
def q4_0_int(byte, high):
    """The signed quant of one q4_0 nibble (``high`` 0: the low nibble, element ``j``; 1: the
    high nibble, element ``j + 16``): the value is ``d * q``."""
    return np.int32((np.int64(byte) >> (4 * np.int64(high))) & 0xF) - 8


@_bound_element({"_f16_to_f32": f16_bits_to_f32})
def block_scale(lo, hi):
    """A ggml block's float16 scale ``d`` from its two little-endian bytes, as float32."""
    return _f16_to_f32(np.int64(lo) | (np.int64(hi) << 8))


#: the helpers of the block math (bound per target by _bound_element)
_BLOCK_HELPERS = {"_f16_to_f32": f16_bits_to_f32, "_f32_to_f16": f32_to_f16_bits,
                  "_f32_to_bf16": f32_to_bf16_bits, "_to_e4m3": f32_to_e4m3,
                  "_from_e4m3": e4m3_to_f32, "_load": load_f32, "_q8_int": q8_0_int,
                  "_q4_int": q4_0_int, "_block_scale": block_scale}


# --------------------------------------------------------------------------------------------
# block math (element functions: one block of one (cell, head) row; rows are 1-d views, which
# the CPU twins index about 25x faster than 4-d arrays - measured)

@_bound_element(_BLOCK_HELPERS)
def quantize_block(x, j0, n, kind, q, b0, fmt, scale):
    """Quantize values ``x[j0 : j0 + block]`` (a row stored as ``kind``, see rope.load_f32)
    into the block at byte ``b0`` of the byte row ``q`` (uint8) in format ``fmt``. A ggml
    block is 32 values; float8 has no blocks, so ``n`` values (bytes) are done in one call."""
    if fmt == 3:
        for i in range(n):
            q[b0 + i] = _to_e4m3(_load(x[j0 + i], kind) / scale)
        return
    # the largest magnitude as a max over the magnitudes' bit patterns (ordered as the values
    # for non-negative floats; >= 0x7F800000 is an infinity or NaN), with the index folded into
    # the low bits so the first of equal magnitudes wins, as in ggml: an integer max reduction,
    # which LLVM vectorises (a float compare-and-select chain it does not)
    key = np.int64(0)
    for i in range(32):
        bits = np.int64(np.float32(_load(x[j0 + i], kind)).view(np.uint32)) & 0x7FFFFFFF
        key = max(key, (bits << 5) | (31 - i))
    amax_bits = key >> 5
    n_q = 32 if fmt == 1 else 16
    if amax_bits >= 0x7F800000:   # a NaN or an infinity in the block
        q[b0] = np.uint8(0x00)  # f16 NaN 0x7E00, little-endian
        q[b0 + 1] = np.uint8(0x7E)
        for i in range(n_q):
            q[b0 + 2 + i] = np.uint8(0)
        return
    if fmt == 1:
        d = np.uint32(amax_bits).view(np.float32) / np.float32(127.0)
    else:
        d = np.float32(_load(x[j0 + 31 - (key & 31)], kind)) / np.float32(-8.0)
    inv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
    bits = np.int64(_f32_to_f16(d))
    q[b0] = np.uint8(bits & 0xFF)
    q[b0 + 1] = np.uint8(bits >> 8)
    if fmt == 1:
        for i in range(32):
            y = _load(x[j0 + i], kind) * inv
            a = abs(y)
            fl = np.int32(a)  # floor (0 <= a <= 127.5); then half away from zero as roundf
            r = fl + np.int32(np.float32(2.0) * (a - np.float32(fl)))
            r = -r if y < np.float32(0.0) else r
            q[b0 + 2 + i] = np.uint8(r & 0xFF)
    else:
        for i in range(16):
            # the product rounded before the add, as ggml's CPU reference (no GPU FMA)
            lo = np.int32(mul_rn(_load(x[j0 + i], kind), inv) + np.float32(8.5))
            hi = np.int32(mul_rn(_load(x[j0 + 16 + i], kind), inv) + np.float32(8.5))
            q[b0 + 2 + i] = np.uint8(min(15, lo) | (min(15, hi) << 4))


@_bound_element(_BLOCK_HELPERS)
def dequantize_block(q, b0, n, fmt, scale, out, j0, kind):
    """The block at byte ``b0`` of the byte row ``q`` as values ``out[j0 : j0 + block]``
    (float32 math, stored as ``kind``); float8: ``n`` values in one call. The stores are written
    out here, not called: a helper taking the array per value cost the CPU twin 20x
    (measured)."""
    if fmt == 3:
        for i in range(n):
            y = _from_e4m3(q[b0 + i]) * scale
            if kind == 1:
                out[j0 + i] = _f32_to_f16(y)
            elif kind == 2:
                out[j0 + i] = _f32_to_bf16(y)
            else:
                out[j0 + i] = y
        return
    d = _block_scale(q[b0], q[b0 + 1])
    for half in range(1 if fmt == 1 else 2):
        for i in range(32 if fmt == 1 else 16):
            if fmt == 1:
                y = d * np.float32(_q8_int(q[b0 + 2 + i]))
            else:
                y = d * np.float32(_q4_int(q[b0 + 2 + i], half))
            j = j0 + 16 * half + i
            if kind == 1:
                out[j] = _f32_to_f16(y)
            elif kind == 2:
                out[j] = _f32_to_bf16(y)
            else:
                out[j] = y


_quantize_cpu = quantize_block.cpu
_to_e4m3_cpu = f32_to_e4m3.cpu
_f32_to_f16_cpu = f32_to_f16_bits.cpu
#: whether the CPU converts float16 in hardware (frozen into the compiled twins as a constant)
_F16C = bool(F16_HW)
_dequantize_cpu = dequantize_block.cpu
_quantize_cuda = quantize_block.cuda
_dequantize_cuda = dequantize_block.cuda
_pair_cpu = pair_index.cpu
_rotate_pair_cpu = rotate_pair.cpu
_load_cpu = load_f32.cpu
_load_cuda = load_f32.cuda
_sum_diff_cuda = wht_sum_diff.cuda
_wht_pair_cuda = wht_pair_index.cuda
_f16_hw = f16_bits_to_f32_hw


# --------------------------------------------------------------------------------------------
# the CPU twins' vector form of quantize_block's q8_0/q4_0 math on a contiguous float32 row:
# LLVM vector IR (Numba's loops over 32 values did not vectorise: the block max stayed a scalar
# compare chain, 0.7-2.3 ns a value; this form 0.16-0.26). Same float32 operations in the same
# order as quantize_block (no fast-math, the multiply never fused with the add), so the bytes
# are identical to it and to ggml's reference (tests/test_rotation.py, tests/test_quant.py).

def _llvm_splat(builder, x, n):
    from llvmlite import ir
    vt = ir.VectorType(x.type, n)
    one = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n))


def _llvm_abs_bits32(context, builder, aryty, ary, off):
    """The 32 values at ``off`` as ``<32 x i32>`` magnitude bit patterns."""
    from llvmlite import ir
    v32 = ir.VectorType(ir.IntType(32), 32)
    v = builder.load(_vector_ptr(context, builder, aryty, ary, off, ir.IntType(32), 32), align=4)
    return builder.and_(v, ir.Constant(v32, [0x7FFFFFFF] * 32))


@intrinsic
def _amax_bits32(typingctx, work, off):
    """The largest magnitude of ``work[off : off + 32]`` (float32) as its bit pattern (int64;
    ``>= 0x7F800000``: an infinity or NaN is in the block): an unsigned max over the magnitudes'
    bits, ordered as the values."""
    from llvmlite import ir
    from numba.core import cgutils

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i32, [ir.VectorType(i32, 32)]),
            "llvm.vector.reduce.umax.v32i32")
        m = builder.call(fn, [_llvm_abs_bits32(context, builder, sig.args[0], *args)])
        return builder.zext(m, ir.IntType(64))
    return types.int64(work, off), codegen


@intrinsic
def _first_of_bits32(typingctx, work, off, bits):
    """The index (0-31) of the first value of ``work[off : off + 32]`` whose magnitude has the
    bit pattern ``bits`` (q4_0 keeps the first of equal magnitudes, as ggml)."""
    from llvmlite import ir
    from numba.core import cgutils

    def codegen(context, builder, sig, args):
        i32, i1 = ir.IntType(32), ir.IntType(1)
        mags = _llvm_abs_bits32(context, builder, sig.args[0], args[0], args[1])
        want = _llvm_splat(builder, builder.trunc(args[2], i32), 32)
        eq = builder.icmp_unsigned("==", mags, want)
        cttz = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i32, i1]),
                                              "llvm.cttz.i32")
        first = builder.call(cttz, [builder.bitcast(eq, i32), ir.Constant(i1, 0)])
        return builder.zext(first, ir.IntType(64))
    return types.int64(work, off, bits), codegen


#: the float32 just below 0.5 (0x3EFFFFFF)
_PRED_HALF_BITS = 0x3EFFFFFF


def _llvm_roundf32(builder, y, blendv_lanes: int = 0):
    """``roundf`` (half away from zero) of the ``<n x float>`` ``y`` (``|y| <= 128``) as
    ``<n x i32>``: ``trunc(y + copysign(0.49999997f, y))``. The one float add rounds to the
    right side in every case (checked against ``floor(|y|) + int(2 (|y| - floor|y|))``, the
    scalar form, for every float32 in [0, 128]: 0 differences; with 0.5 itself 0.49999997
    would round to 1), in 3 vector operations instead of that form's 9 (the copysign is an
    and + or; one ``vpternlogd`` with AVX-512). ``blendv_lanes`` 8 (the fused put's staged
    AVX2 form): the copysign as AVX's ``vblendvps`` on ``y``'s sign bits, one operation a
    register instead of two (LLVM turns a generic select on the sign back into the and + or);
    in :func:`_llvm_quantize_blocks` it also picks q4_0's byte-first narrowing
    (:func:`_llvm_q4_0_bytes`)."""
    from llvmlite import ir
    from numba.core import cgutils
    vf, vi = y.type, ir.VectorType(ir.IntType(32), y.type.count)
    n = y.type.count
    pos = ir.Constant(vi, [_PRED_HALF_BITS] * n)
    if blendv_lanes == 8 and n % 8 == 0:
        i32, v8 = ir.IntType(32), ir.VectorType(ir.FloatType(), 8)
        blendv = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v8, [v8, v8, v8]), "llvm.x86.avx.blendv.ps.256")
        pos8 = ir.Constant(v8, [float(np.uint32(_PRED_HALF_BITS).view(np.float32))] * 8)
        neg8 = ir.Constant(v8, [-float(np.uint32(_PRED_HALF_BITS).view(np.float32))] * 8)
        parts = [builder.call(blendv, [pos8, neg8, builder.shuffle_vector(
            y, y, ir.Constant(ir.VectorType(i32, 8), list(range(j, j + 8))))])
                 for j in range(0, n, 8)]
        while len(parts) > 1:
            parts = [builder.shuffle_vector(a, b, ir.Constant(
                ir.VectorType(i32, 2 * a.type.count), list(range(2 * a.type.count))))
                for a, b in zip(parts[0::2], parts[1::2])]
        h = parts[0]
    else:
        sign = builder.and_(builder.bitcast(y, vi), ir.Constant(vi, [0x80000000] * n))
        h = builder.bitcast(builder.or_(sign, pos), vf)
    return builder.fptosi(builder.fadd(y, h), vi)


def _llvm_clamp_i32(builder, r, lo, hi):
    """``min(max(r, lo), hi)`` of the ``<n x i32>`` ``r`` (signed)."""
    from llvmlite import ir
    lo_v, hi_v = (ir.Constant(r.type, [c] * r.type.count) for c in (lo, hi))
    r = builder.select(builder.icmp_signed(">", r, lo_v), r, lo_v)
    return builder.select(builder.icmp_signed("<", r, hi_v), r, hi_v)


def _llvm_q8_0_bytes(builder, r):
    """The ``<n x i8>`` of q8_0 quants ``r`` (``<n x i32>``, all in [-127, 127]), narrowed as a
    clamp to [-128, 127] and a truncation: a no-op clamp that x86 code generation folds into
    signed saturating packs (``vpackssdw`` + ``vpacksswb`` with AVX2, ``vpmovsdb`` with
    AVX-512) instead of a mask per register before unsigned packs, which a plain truncation
    costs on AVX2. The one case outside that range: a block whose scale is subnormal below
    ~2^-128, where ``1 / d`` overflows and ggml's ``roundf(x * inf)`` is +-inf or NaN; its int8
    conversion (x86: the integer indefinite 0x80000000, then the low byte) stores 0, as gguf's
    reference does, where a saturating pack would store -128. The callers take that
    reciprocal as 0 instead: the same zero bytes, and the pack sees only [-127, 127]."""
    from llvmlite import ir
    return builder.trunc(_llvm_clamp_i32(builder, r, -128, 127),
                         ir.VectorType(ir.IntType(8), r.type.count))


def _llvm_q4_0_bytes(builder, r):
    """The 16 bytes of a q4_0 block from its 32 quants ``r`` (``<32 x i32>`` of
    ``int(x * inv + 8.5)``, all in [0, 16]): ``min(15, q)``, value ``i`` in the low nibble of
    byte ``i`` and value ``i + 16`` in the high one. Narrowed to bytes first (a clamp to
    [0, 255] that x86 folds into unsigned saturating packs), then the ``min`` and the nibble
    merge on bytes: one ``vpminub``, and a 16-bit shift (each byte is <= 15, so no bit crosses
    into its neighbour) and an or for the 16 bytes, instead of those on 4 registers of
    32-bit lanes."""
    from llvmlite import ir
    i8, i16 = ir.IntType(8), ir.IntType(16)
    b = builder.trunc(_llvm_clamp_i32(builder, r, 0, 255), ir.VectorType(i8, 32))
    b15 = ir.Constant(ir.VectorType(i8, 32), [15] * 32)
    b = builder.select(builder.icmp_unsigned("<", b, b15), b, b15)
    v16 = ir.VectorType(i8, 16)
    lo = builder.shuffle_vector(b, b, ir.Constant(ir.VectorType(ir.IntType(32), 16),
                                                  list(range(16))))
    hi = builder.shuffle_vector(b, b, ir.Constant(ir.VectorType(ir.IntType(32), 16),
                                                  list(range(16, 32))))
    hi = builder.bitcast(builder.shl(builder.bitcast(hi, ir.VectorType(i16, 8)),
                                     ir.Constant(ir.VectorType(i16, 8), [4] * 8)), v16)
    return builder.or_(lo, hi)


@intrinsic
def _q8_0_quants32(typingctx, work, off, inv, q, qoff):
    """``q[qoff : qoff + 32]`` = the int8 of ``roundf(work[off + i] * inv)`` (half away from
    zero, as :func:`quantize_block`; :func:`_llvm_roundf32`)."""
    from llvmlite import ir

    def codegen(context, builder, sig, args):
        n = 32
        x = builder.load(_vector_ptr(context, builder, sig.args[0], args[0], args[1],
                                     ir.FloatType(), n), align=4)
        r = _llvm_roundf32(builder, builder.fmul(x, _llvm_splat(builder, args[2], n)))
        builder.store(_llvm_q8_0_bytes(builder, r),
                      _vector_ptr(context, builder, sig.args[3], args[3], args[4],
                                  ir.IntType(8), n), align=1)
        return context.get_dummy_value()
    return types.void(work, off, inv, q, qoff), codegen


@intrinsic
def _q4_0_quants32(typingctx, work, off, inv, q, qoff):
    """``q[qoff : qoff + 16]``: ``min(15, int(work[off + i] * inv + 8.5))`` in the low nibble
    of byte ``i`` and that of value ``i + 16`` in the high one (the product rounded before the
    add: a separate multiply and add, never fused)."""
    from llvmlite import ir

    def codegen(context, builder, sig, args):
        n = 32
        vf, vi = ir.VectorType(ir.FloatType(), n), ir.VectorType(ir.IntType(32), n)
        x = builder.load(_vector_ptr(context, builder, sig.args[0], args[0], args[1],
                                     ir.FloatType(), n), align=4)
        y = builder.fadd(builder.fmul(x, _llvm_splat(builder, args[2], n)),
                         ir.Constant(vf, [8.5] * n))
        r = builder.fptosi(y, vi)
        c15 = ir.Constant(vi, [15] * n)
        r = builder.select(builder.icmp_signed("<", r, c15), r, c15)
        h = ir.VectorType(ir.IntType(32), 16)
        lo = builder.shuffle_vector(r, r, ir.Constant(h, list(range(16))))
        hi = builder.shuffle_vector(r, r, ir.Constant(h, list(range(16, 32))))
        b = builder.or_(lo, builder.shl(hi, ir.Constant(h, [4] * 16)))
        builder.store(builder.trunc(b, ir.VectorType(ir.IntType(8), 16)),
                      _vector_ptr(context, builder, sig.args[3], args[3], args[4],
                                  ir.IntType(8), 16), align=1)
        return context.get_dummy_value()
    return types.void(work, off, inv, q, qoff), codegen


@njit(inline="always")
def quantize_row_cpu(work, dim, q_row, fmt):
    """``work[:dim]`` (contiguous float32) quantized into the q8_0 (``fmt`` 1) or q4_0 (2) byte
    row ``q_row`` (contiguous): :func:`quantize_block`'s math, block by block, in vector form.
    The scale's float16 by F16C where the CPU has it (the same bits as the software conversion
    for the finite scales that reach it; a compile-time constant)."""
    nbytes = 34 if fmt == 1 else 18
    for blk in range(dim // 32):
        j0 = blk * 32
        b0 = blk * nbytes
        amax_bits = _amax_bits32(work, j0)
        if amax_bits >= 0x7F800000:   # a NaN or an infinity in the block: NaN scale, zero quants
            q_row[b0] = np.uint8(0x00)
            q_row[b0 + 1] = np.uint8(0x7E)
            for i in range(nbytes - 2):
                q_row[b0 + 2 + i] = np.uint8(0)
            continue
        if fmt == 1:
            d = np.uint32(amax_bits).view(np.float32) / np.float32(127.0)
        else:
            d = work[j0 + _first_of_bits32(work, j0, amax_bits)] / np.float32(-8.0)
        inv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
        if fmt == 1 and inv == np.float32(np.inf):
            inv = np.float32(0.0)   # the same zero quants: see _llvm_q8_0_bytes
        if _F16C:
            bits = np.int64(_hw_float_to_half(d))
        else:
            bits = np.int64(_f32_to_f16_cpu(d))
        q_row[b0] = np.uint8(bits & 0xFF)
        q_row[b0 + 1] = np.uint8(bits >> 8)
        if fmt == 1:
            _q8_0_quants32(work, j0, inv, q_row, b0 + 2)
        else:
            _q4_0_quants32(work, j0, inv, q_row, b0 + 2)




# --------------------------------------------------------------------------------------------
# the CPU put's fused form: a chunk of a row from the input straight to its quantized bytes,
# all in registers (no float32 work row, no per-row array views). Same IEEE operations in the
# same order as the work-row form above (widen exactly, scale, ggml's stages, quantize_block's
# block math), so the same bytes.

def _elem_ptr(context, builder, aryty, ary, off, elem):
    """A pointer to one ``elem`` at element ``off`` of ``ary``'s data."""
    arr = context.make_array(aryty)(context, builder, value=ary)
    return builder.bitcast(builder.gep(arr.data, [off]), elem.as_pointer())


def _int_const(value, c):
    from llvmlite import ir
    return ir.Constant(value.type, c)


def _llvm_quantize_blocks(context, builder, q_ty, qa, qoff, blocks, mags, amax, fmt_v,
                          m_given=None, blendv_lanes=0, block_regs=None, barrier=None,
                          prescale=None):
    """Store the ggml blocks (``fmt_v`` 1: q8_0, 2: q4_0) of the finite ``<32 x float>``
    values ``blocks`` (their magnitudes' bits ``mags``, largest ``amax``) at byte ``qoff`` of
    ``q``'s data: :func:`quantize_block`'s math (scales and reciprocals of all blocks as one
    vector divide, the scales' float16 by ``fptrunc``, the quants as :func:`_q8_0_quants32` /
    :func:`_q4_0_quants32`). ``m_given``: q4_0's signed largest values (``<nb x i32>`` bits)
    already known (:func:`_llvm_q4_0_maxima`); else found here from ``mags`` and ``amax``.
    ``block_regs`` (the staged AVX2 form): ``block_regs(k)`` loads block ``k`` from the
    scratch row as 4 ``<8 x float>`` registers just before its quants, and ``barrier()``
    follows each block's stores (:func:`_llvm_store_block_avx2`). ``prescale`` (a float32
    power of two, see :func:`_fused_put_chunk`): ``blocks`` are the values divided by it,
    exactly (:data:`_UNSCALED_BLOCKS`; an LLVM float value, 1.0 for none); the scales are
    taken of the largest values times it and the quants of ``blocks`` times the reciprocals
    times it -- the same float32 results."""
    from llvmlite import ir
    from numba.core import cgutils
    f32, i32, i16, i8, i1 = (ir.FloatType(), ir.IntType(32), ir.IntType(16), ir.IntType(8),
                             ir.IntType(1))
    nb = len(amax)
    v32f, v32i = ir.VectorType(f32, 32), ir.VectorType(i32, 32)
    vb_i, vb_f = ir.VectorType(i32, nb), ir.VectorType(f32, nb)
    m_v = ir.Constant(vb_i, ir.Undefined) if m_given is None else m_given
    for k in range(nb if m_given is None else 0):
        mk = amax[k]
        if fmt_v == 2:   # m: the first value of the largest magnitude, with its sign
            cttz = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(i32, [i32, i1]), "llvm.cttz.i32")
            eq = builder.icmp_unsigned("==", mags[k], _llvm_splat(builder, amax[k], 32))
            first = builder.call(cttz, [builder.bitcast(eq, i32), ir.Constant(i1, 0)])
            neg = builder.icmp_signed("<", builder.bitcast(blocks[k], v32i),
                                      ir.Constant(v32i, [0] * 32))
            sign = builder.and_(builder.lshr(builder.bitcast(neg, i32), first),
                                ir.Constant(i32, 1))
            mk = builder.or_(mk, builder.shl(sign, ir.Constant(i32, 31)))
        m_v = builder.insert_element(m_v, mk, ir.Constant(i32, k))
    # q8_0: d = amax / 127; q4_0: d = m / -8
    m_f = builder.bitcast(m_v, vb_f)
    if prescale is not None:
        m_f = builder.fmul(m_f, _llvm_splat(builder, prescale, nb))
    d = builder.fdiv(m_f, ir.Constant(vb_f, [127.0 if fmt_v == 1 else -8.0] * nb))
    recip = builder.fdiv(ir.Constant(vb_f, [1.0] * nb), d)
    if fmt_v == 1:   # d >= 0: a zero or infinite reciprocal (d 0 or below ~2^-128) -> 0
        keep = builder.fcmp_ordered("<", recip, ir.Constant(vb_f, [float("inf")] * nb))
    else:
        keep = builder.fcmp_ordered("!=", d, ir.Constant(vb_f, [0.0] * nb))
    inv = builder.select(keep, recip, ir.Constant(vb_f, [0.0] * nb))
    if prescale is not None:
        inv = builder.fmul(inv, _llvm_splat(builder, prescale, nb))
    d_half = builder.bitcast(builder.fptrunc(d, ir.VectorType(ir.HalfType(), nb)),
                             ir.VectorType(i16, nb))
    nbytes = 34 if fmt_v == 1 else 18
    for k in range(nb):
        kk = ir.Constant(i32, k)
        b0 = builder.add(qoff, _int_const(qoff, k * nbytes))
        builder.store(builder.extract_element(d_half, kk),
                      _elem_ptr(context, builder, q_ty, qa, b0, i16), align=1)
        qat = builder.add(qoff, _int_const(qoff, k * nbytes + 2))
        if block_regs is not None:
            _llvm_store_block_avx2(context, builder, q_ty, qa, qat, block_regs(k),
                                   builder.extract_element(inv, kk), fmt_v)
            barrier()
            continue
        inv_k = _llvm_splat(builder, builder.extract_element(inv, kk), 32)
        blk = blocks[k]
        if fmt_v == 1:   # roundf(x * inv)
            r = _llvm_roundf32(builder, builder.fmul(blk, inv_k), blendv_lanes)
            builder.store(_llvm_q8_0_bytes(builder, r),
                          _vector_ptr(context, builder, q_ty, qa, qat, i8, 32), align=1)
        else:            # min(15, int(x * inv + 8.5)), the product rounded before the add
            y = builder.fadd(builder.fmul(blk, inv_k), ir.Constant(v32f, [8.5] * 32))
            r = builder.fptosi(y, v32i)
            if blendv_lanes == 8:   # AVX2: narrowed to bytes first (_llvm_q4_0_bytes)
                packed = _llvm_q4_0_bytes(builder, r)
            else:   # AVX-512: min and nibbles on 32-bit lanes, then one vpmovdb (measured
                # faster there than the byte-first form's packs, extract and merge)
                c15 = ir.Constant(v32i, [15] * 32)
                r = builder.select(builder.icmp_signed("<", r, c15), r, c15)
                h16 = ir.VectorType(i32, 16)
                lo = builder.shuffle_vector(r, r, ir.Constant(h16, list(range(16))))
                hi = builder.shuffle_vector(r, r, ir.Constant(h16, list(range(16, 32))))
                packed = builder.trunc(
                    builder.or_(lo, builder.shl(hi, ir.Constant(h16, [4] * 16))),
                    ir.VectorType(i8, 16))
            builder.store(packed, _vector_ptr(context, builder, q_ty, qa, qat, i8, 16), align=1)


def _llvm_block_values(context, builder, q_ty, qa, qoff, fmt_v):
    """The 32 values (``<32 x float>``) of the q8_0 (``fmt_v`` 1) or q4_0 (2) block at byte
    ``qoff`` of ``q``'s data: :func:`dequantize_block`'s ``d * q``, the scale widened by
    ``fpext`` (F16C: exact), the quants sign-extended (q8_0) or split into nibbles less 8
    (q4_0: value ``i`` the low nibble of byte ``i``, value ``i + 16`` its high nibble) and
    converted exactly. Shared by the vector get and the in-register shift."""
    from llvmlite import ir
    i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
    v32i = ir.VectorType(i32, 32)
    d = builder.fpext(builder.bitcast(builder.load(
        _elem_ptr(context, builder, q_ty, qa, qoff, ir.IntType(16)), align=1), ir.HalfType()),
        f32)
    at = builder.add(qoff, _int_const(qoff, 2))
    if fmt_v == 1:
        ints = builder.sext(builder.load(_vector_ptr(context, builder, q_ty, qa, at, i8, 32),
                                         align=1), v32i)
    else:
        v16 = ir.VectorType(i8, 16)
        raw = builder.load(_vector_ptr(context, builder, q_ty, qa, at, i8, 16), align=1)
        both = builder.shuffle_vector(builder.and_(raw, ir.Constant(v16, [15] * 16)),
                                      builder.lshr(raw, ir.Constant(v16, [4] * 16)),
                                      ir.Constant(v32i, list(range(32))))
        ints = builder.sub(builder.zext(both, v32i), ir.Constant(v32i, [8] * 32))
    return builder.fmul(_llvm_splat(builder, d, 32),
                        builder.sitofp(ints, ir.VectorType(f32, 32)))


def _llvm_f8_values(context, builder, q_ty, qa, qoff, scale, n):
    """The ``n`` values (``<n x float>``) of the float8_e4m3fn bytes at byte ``qoff`` of
    ``q``'s data: :func:`e4m3_to_f32` times ``scale`` (:func:`_llvm_from_e4m3`). Shared by
    the vector get and the in-register shift."""
    from llvmlite import ir
    raw = builder.load(_vector_ptr(context, builder, q_ty, qa, qoff, ir.IntType(8), n), align=1)
    return builder.fmul(_llvm_from_e4m3(builder, raw), _llvm_splat(builder, scale, n))


def _llvm_x86(builder, name, ret, args):
    """A call of the x86 intrinsic ``name`` (LLVM's ``llvm.x86.*``) returning ``ret``."""
    from llvmlite import ir
    from numba.core import cgutils
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _llvm_store_block_avx2(context, builder, q_ty, qa, qat, regs, inv, fmt_v):
    """Store the quants of one q8_0 (``fmt_v`` 1) or q4_0 block at byte ``qat`` of ``q``'s
    data from its 32 values as 4 ``<8 x float>`` registers ``regs`` and the float32
    reciprocal ``inv`` of its scale, in AVX2 instructions (the fused put's staged form):
    q8_0 ``roundf(x * inv)`` (the copysign by ``vblendvps``, :func:`_llvm_roundf32`), q4_0
    ``min(15, int(x * inv + 8.5))``; the narrowing written as AVX2's in-lane saturating
    packs with one cross-lane ``vpermd`` to put the bytes in order. LLVM's own lowering of a
    ``<32 x i32>`` truncation took 3 ``vpermq`` fixes a block (one after each pack); q4_0's
    nibbles merge by one 64-bit shift and an ``or`` on the packed bytes (the packs pair value
    ``i``'s dword with value ``i + 16``'s) instead of an extract, a 16-bit shift and an
    ``or``. The same bytes as :func:`_llvm_q8_0_bytes` / :func:`_llvm_q4_0_bytes`: every
    quant is within the packs' range ([-127, 127] for q8_0, see there; [0, 16] for q4_0)."""
    from llvmlite import ir
    f32, i32, i16, i8, i64 = (ir.FloatType(), ir.IntType(32), ir.IntType(16), ir.IntType(8),
                              ir.IntType(64))
    v8f, v8i = ir.VectorType(f32, 8), ir.VectorType(i32, 8)
    v16s, v32b = ir.VectorType(i16, 16), ir.VectorType(i8, 32)
    inv8 = _llvm_splat(builder, inv, 8)

    def pack(name, ret, a, b):
        return _llvm_x86(builder, f"llvm.x86.avx2.{name}", ret, [a, b])
    if fmt_v == 1:
        half = float(np.uint32(_PRED_HALF_BITS).view(np.float32))
        pos8, neg8 = ir.Constant(v8f, [half] * 8), ir.Constant(v8f, [-half] * 8)
        ints = []
        for r in regs:
            y = builder.fmul(r, inv8)
            h = _llvm_x86(builder, "llvm.x86.avx.blendv.ps.256", v8f, [pos8, neg8, y])
            ints.append(builder.fptosi(builder.fadd(y, h), v8i))
        # dwords after the packs: v0-3, v8-11, v16-19, v24-27 | v4-7, v12-15, v20-23, v28-31
        b = pack("packsswb", v32b, pack("packssdw", v16s, ints[0], ints[1]),
                 pack("packssdw", v16s, ints[2], ints[3]))
        b = builder.shuffle_vector(builder.bitcast(b, v8i), builder.bitcast(b, v8i),
                                   ir.Constant(v8i, [0, 4, 1, 5, 2, 6, 3, 7]))
        builder.store(builder.bitcast(b, v32b),
                      _vector_ptr(context, builder, q_ty, qa, qat, i8, 32), align=1)
        return
    c85 = ir.Constant(v8f, [8.5] * 8)
    ints = [builder.fptosi(builder.fadd(builder.fmul(r, inv8), c85), v8i) for r in regs]
    # dwords after the packs: v0-3, v16-19, v8-11, v24-27 | v4-7, v20-23, v12-15, v28-31
    b = pack("packuswb", v32b, pack("packssdw", v16s, ints[0], ints[2]),
             pack("packssdw", v16s, ints[1], ints[3]))
    b15 = ir.Constant(v32b, [15] * 32)
    b = builder.select(builder.icmp_unsigned("<", b, b15), b, b15)
    # each qword's low dword | its high dword << 4 (bytes <= 15: no bit crosses a byte)
    qw = builder.bitcast(b, ir.VectorType(i64, 4))
    qw = builder.or_(qw, builder.lshr(qw, ir.Constant(qw.type, [28] * 4)))
    d = builder.bitcast(qw, v8i)
    out = builder.shuffle_vector(d, d, ir.Constant(ir.VectorType(i32, 4), [0, 4, 2, 6]))
    builder.store(builder.bitcast(out, ir.VectorType(i8, 16)),
                  _vector_ptr(context, builder, q_ty, qa, qat, i8, 16), align=1)


def _umax(builder, a, b):
    return builder.select(builder.icmp_unsigned(">", a, b), a, b)


def _smax(builder, a, b):
    return builder.select(builder.icmp_signed(">", a, b), a, b)


def _llvm_block_maxima(builder, mags, vmax=_umax):
    """The maximum (``vmax``: unsigned, or :func:`_smax` signed) of each ``<32 x i32>`` in
    ``mags`` (1, 2, 4, 8 or 16 of them) as one ``<len x i32>``: each folded to 16 lanes, then pairs merged (half the lanes of each into one
    vector, a max of the two halves) until one vector holds every block's lanes, then each
    block's lanes reduced in place -- a shared shuffle tree (~4 operations a block) rather than
    a horizontal reduction per block (~10 each, a long dependency chain)."""
    from llvmlite import ir
    i32 = ir.IntType(32)

    def shuffle(a, b, idx):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, len(idx)), idx))
    vs = [vmax(builder, shuffle(m, m, list(range(16))), shuffle(m, m, list(range(16, 32))))
          for m in mags]
    group = 16   # lanes per block in each vector
    while len(vs) > 1:
        half = group // 2
        lo = [g * group + j for g in range(16 // group) for j in range(half)]
        hi = [i + half for i in lo]
        merged = []
        for a, b in zip(vs[0::2], vs[1::2]):
            # lanes of a's blocks first, then b's: block order kept
            first = shuffle(a, b, lo + [16 + i for i in lo])
            second = shuffle(a, b, hi + [16 + i for i in hi])
            merged.append(vmax(builder, first, second))
        vs, group = merged, half
    v = vs[0]
    while group > 1:   # within each block's lanes: fold the top half onto the bottom
        half = group // 2
        idx = [(i + half) if (i % group) < half else i for i in range(16)]
        v = vmax(builder, v, shuffle(v, v, idx))
        group = half
    return shuffle(v, v, [k * (16 // len(mags)) for k in range(len(mags))])


def _llvm_block_maxima_df(builder, block_fn, nb: int, vmaxes):
    """:func:`_llvm_block_maxima` for each max in ``vmaxes`` (:func:`_umax`, :func:`_smax`),
    of the ``<32 x i32>`` values ``block_fn(k)`` of blocks ``k = 0 .. nb - 1`` (``nb`` a power
    of two), as a list of ``<nb x i32>``: each block folded to 8 lanes as soon as it is
    loaded, then merged with its neighbours like a binary counter (two blocks of the same
    size merge into one vector: half the lanes of each, a max of the halves), so no more
    than one block and log2(nb) partial results are live at once. Integer maxima: any order
    gives the same result."""
    from llvmlite import ir
    i32 = ir.IntType(32)

    def shuffle(a, b, idx):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, len(idx)), idx))

    def merge(a, b, vmax, group):
        half = group // 2
        lo = [g * group + j for g in range(8 // group) for j in range(half)]
        hi = [i + half for i in lo]
        return vmax(builder, shuffle(a, b, lo + [8 + i for i in lo]),
                    shuffle(a, b, hi + [8 + i for i in hi]))

    stacks = [[] for _ in vmaxes]   # (8 lanes, lanes per block) in block order
    for k in range(nb):
        m = block_fn(k)
        for stack, vmax in zip(stacks, vmaxes):
            a = vmax(builder, shuffle(m, m, list(range(16))), shuffle(m, m, list(range(16, 32))))
            stack.append((vmax(builder, shuffle(a, a, list(range(8))),
                               shuffle(a, a, list(range(8, 16)))), 8))
            while len(stack) > 1 and stack[-1][1] == stack[-2][1] > 1:
                (a, group), (b, _) = stack[-2], stack[-1]
                stack[-2:] = [(merge(a, b, vmax, group), group // 2)]
    out = []
    for stack, vmax in zip(stacks, vmaxes):
        picks = []
        for v, group in stack:
            g = group
            while g > 1:   # within each block's lanes: fold the top half onto the bottom
                half = g // 2
                v = vmax(builder, v, shuffle(v, v, [(i + half) if (i % g) < half else i
                                                    for i in range(8)]))
                g = half
            picks.append(v if group == 1 else
                         shuffle(v, v, [c * group for c in range(8 // group)]))
        while len(picks) > 1:   # equal halves, in block order
            picks = [shuffle(a, b, list(range(2 * a.type.count)))
                     for a, b in zip(picks[0::2], picks[1::2])]
        out.append(picks[0])
    return out


def _llvm_barrier(builder, ptr):
    """An empty ``asm volatile`` that may read and write the memory at ``ptr`` (an escaped
    scratch row): LLVM must complete the stores to it before and load it again after,
    instead of keeping its values in registers -- which, for a row larger than the register
    file, it did by spilling ~11 moves a register (AVX2)."""
    from llvmlite import ir
    builder.asm(ir.FunctionType(ir.VoidType(), [ptr.type]), "", "r,~{memory}", [ptr], True)


def _llvm_store_quantized(context, builder, v, nb, q_ty, qa, qoff_v, is_q8, name,
                          load_block=None, barrier=None, blendv_lanes=0, block_regs=None,
                          prescale=None):
    """IR: quantize the float32 vector ``v`` (``nb`` blocks of 32 values) into q8_0 (``is_q8``)
    or q4_0 blocks at byte ``qoff_v`` of ``qa`` (:func:`_llvm_quantize_blocks`, ggml's block
    maxima and rounding; q4_0's signed largest value from an unsigned and a signed max over the
    raw bits, the lanes' order consulted only for a tie of opposite signs). A block holding an
    infinity or NaN stores nothing: the returned i64 is 1 then (the caller redoes the chunk by
    the work-row path, whose non-finite handling is ggml's), else 0. Shared by the fused put
    and the fused shift. Staged form (``v`` None, ``load_block(k)`` loading block ``k`` as
    ``<32 x float>`` from a scratch row, ``barrier()`` as :func:`_llvm_barrier`): the block
    maxima folded block by block as the blocks are loaded (:func:`_llvm_block_maxima_df`),
    and the blocks loaded again for the quants after a barrier, so no more than a block's
    registers are live at once (AVX2)."""
    from llvmlite import ir
    i32, i64 = ir.IntType(32), ir.IntType(64)
    v32i = ir.VectorType(i32, 32)
    vb = ir.VectorType(i32, nb)
    staged = load_block is not None
    blocks, raws = [], []
    for k in range(0 if staged else nb):
        blk = v if nb == 1 else builder.shuffle_vector(
            v, v, ir.Constant(v32i, list(range(32 * k, 32 * k + 32))))
        blocks.append(blk)
        raws.append(builder.bitcast(blk, v32i))

    def magnitude(r):
        return builder.and_(r, ir.Constant(v32i, [0x7FFFFFFF] * 32))

    def magnitudes():
        return [magnitude(r) for r in raws]

    def reloaded():
        """the blocks for the quants: staged, loaded again after a barrier"""
        if not staged:
            return blocks
        barrier()
        return [load_block(k) for k in range(nb)]

    def quantize(fmt_v, m_v):
        """the quants (q8_0: ``m_v`` None): staged with ``block_regs``, each block loaded
        just before its quants and a barrier after its stores -- without it LLVM hoisted
        every block's multiply above the first block's stores and spilled the products
        (2 extra stack moves a register)"""
        if block_regs is not None:
            barrier()
            _llvm_quantize_blocks(context, builder, q_ty, qa, qoff_v, None, None, amax, fmt_v,
                                  m_v, block_regs=block_regs, barrier=barrier,
                                  prescale=prescale)
        else:
            _llvm_quantize_blocks(context, builder, q_ty, qa, qoff_v, reloaded(), None, amax,
                                  fmt_v, m_v, blendv_lanes=blendv_lanes, prescale=prescale)

    def raw_block(k):
        return builder.bitcast(load_block(k), v32i)

    def any_lane(cond):
        return builder.icmp_unsigned("!=", builder.bitcast(cond, ir.IntType(nb)),
                                     ir.Constant(ir.IntType(nb), 0))

    def not_finite(amax_v):
        return any_lane(builder.icmp_signed(">=", amax_v, ir.Constant(vb, [0x7F800000] * nb)))

    q8 = builder.append_basic_block(f"{name}_q8_0")
    q8_store = builder.append_basic_block(f"{name}_q8_0_store")
    q4 = builder.append_basic_block(f"{name}_q4_0")
    q4_pick = builder.append_basic_block(f"{name}_q4_0_pick")
    q4_store = builder.append_basic_block(f"{name}_q4_0_store")
    q4_tie = builder.append_basic_block(f"{name}_q4_0_tie")
    done = builder.append_basic_block(f"{name}_done")
    builder.cbranch(is_q8, q8, q4)
    # q8_0: the largest magnitude, an unsigned max over the magnitudes' bits
    builder.position_at_end(q8)
    if staged:
        amax_v, = _llvm_block_maxima_df(builder, lambda k: magnitude(raw_block(k)), nb, [_umax])
    else:
        amax_v = _llvm_block_maxima(builder, magnitudes())
    builder.cbranch(not_finite(amax_v), done, q8_store)
    builder.position_at_end(q8_store)
    amax = [builder.extract_element(amax_v, ir.Constant(i32, k)) for k in range(nb)]
    quantize(1, None)
    builder.branch(done)
    # q4_0: the signed value of the first largest magnitude. An unsigned max over the raw bits
    # is the largest negative magnitude (sign bit set) if any value is negative; a signed max,
    # the largest non-negative one if any is not. The larger decides the sign, unless they are
    # equal (a tie of opposite signs, rare): then the first of them, by the lanes' order.
    builder.position_at_end(q4)
    if staged:
        neg_top, pos_top = _llvm_block_maxima_df(builder, raw_block, nb, [_umax, _smax])
    else:
        neg_top = _llvm_block_maxima(builder, raws)
        pos_top = _llvm_block_maxima(builder, raws, _smax)
    none = ir.Constant(vb, [-1] * nb)
    neg_mag = builder.select(builder.icmp_signed("<", neg_top, ir.Constant(vb, [0] * nb)),
                             builder.and_(neg_top, ir.Constant(vb, [0x7FFFFFFF] * nb)), none)
    pos_mag = builder.select(builder.icmp_signed(">=", pos_top, ir.Constant(vb, [0] * nb)),
                             pos_top, none)
    amax_v = _smax(builder, neg_mag, pos_mag)
    builder.cbranch(not_finite(amax_v), done, q4_pick)
    builder.position_at_end(q4_pick)
    amax = [builder.extract_element(amax_v, ir.Constant(i32, k)) for k in range(nb)]
    builder.cbranch(any_lane(builder.icmp_signed("==", neg_mag, pos_mag)), q4_tie, q4_store)
    builder.position_at_end(q4_store)
    m_v = builder.select(builder.icmp_signed("==", neg_mag, amax_v),
                         builder.or_(amax_v, ir.Constant(vb, [-0x80000000] * nb)), amax_v)
    quantize(2, m_v)
    builder.branch(done)
    builder.position_at_end(q4_tie)
    tie_blocks = reloaded()
    _llvm_quantize_blocks(context, builder, q_ty, qa, qoff_v, tie_blocks,
                          [magnitude(builder.bitcast(b, v32i)) for b in tie_blocks], amax, 2,
                          blendv_lanes=blendv_lanes, block_regs=block_regs, barrier=barrier,
                          prescale=prescale)
    builder.branch(done)
    builder.position_at_end(done)
    flag = builder.phi(i64)
    flag.add_incoming(ir.Constant(i64, 1), q8)
    flag.add_incoming(ir.Constant(i64, 0), q8_store)
    flag.add_incoming(ir.Constant(i64, 1), q4)
    flag.add_incoming(ir.Constant(i64, 0), q4_store)
    flag.add_incoming(ir.Constant(i64, 0), q4_tie)
    return flag


@intrinsic(prefer_literal=True)
def _fused_put_chunk(typingctx, x, xoff, q, qoff, rscale, fmt, kind, n, rotate):
    """Quantize the ``n`` (32 to 512, a multiple of 32: a literal) input values at element
    ``xoff`` of ``x``'s data into ``n / 32`` ggml blocks at byte ``qoff`` of ``q``'s data
    (``fmt`` 1: q8_0, 2: q4_0), rotated first in Walsh-Hadamard blocks of ``rotate`` values (a
    literal: 0 for none, else 64, 128 or 256 dividing ``n``; scaled by ``rscale``): the values
    widened as one ``<n x float>`` (``kind`` 3: float16 bits by F16C's ``fpext``; 2: bfloat16
    bits by a shift; a float32 ``x``: as they are), the stages of
    :func:`.hadamard.wht_stages` (in-register strides by permute + FMA where the target has
    FMA), the blocks' largest magnitudes by one shuffle tree (:func:`_llvm_block_maxima`), then
    :func:`_llvm_quantize_blocks`. ``fmt`` and ``kind`` are run-time values (a branch each per
    call, always predicted; a specialisation per value made the put take minutes to compile).
    Returns 0, or 1 (and stores nothing) when a block holds an infinity or NaN: the caller then
    takes the work-row path, which stores ggml's NaN block. The CPU must have F16C
    (``_F16C``).

    Compiled for AVX2 without AVX-512 (the shipped ``x86-64-v3`` code; ``_STAGED_LANES``),
    the call is staged through a scratch row of ``n`` floats on the stack instead of being
    one LLVM value: :func:`.hadamard.wht_staged`'s passes of at most 8 registers, the block
    maxima as the blocks are loaded back, the quants from a second load. One value of 512
    floats needs 64 of AVX2's 16 registers, and LLVM spilled ~11 moves a register (2,428
    instructions a rotated q8_0 call, 926 of them stack accesses; staged: 1,830, whose stack
    accesses are the row's planned stores and loads). Its quants are AVX2 instructions a
    block at a time (:func:`_llvm_store_block_avx2`): 1,692. With AVX-512 the rotated calls
    take the staged form too (registers of 16 floats: the stages of a 128-value block in one
    pass; a 4,096 x 8 x 128 K+V put measured the same in cache, 8-13% faster memory-bound),
    the unrotated ones the one-value form (faster there). Same operations on the same values:
    the same bits."""
    if not (isinstance(n, types.IntegerLiteral) and isinstance(rotate, types.IntegerLiteral)):
        return None
    n_v, rot_v = n.literal_value, rotate.literal_value
    from llvmlite import ir

    def codegen(context, builder, sig, args):
        f32, i32, i16 = ir.FloatType(), ir.IntType(32), ir.IntType(16)
        x_ty, q_ty = sig.args[0], sig.args[2]
        xa, xoff_v, qa, qoff_v, rs, fmt_a, kind_a = args[:7]
        nb = n_v // 32
        vf, vi = ir.VectorType(f32, n_v), ir.VectorType(i32, n_v)
        if x_ty.dtype == types.float32:
            v = builder.load(_vector_ptr(context, builder, x_ty, xa, xoff_v, f32, n_v), align=4)
        else:
            raw = builder.load(_vector_ptr(context, builder, x_ty, xa, xoff_v, i16, n_v),
                               align=2)
            as_f16 = builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), n_v)), vf)
            as_bf16 = builder.bitcast(builder.shl(builder.zext(raw, vi),
                                                  ir.Constant(vi, [16] * n_v)), vf)
            is_f16 = builder.icmp_signed("==", kind_a, _int_const(kind_a, 3))
            v = builder.select(is_f16, as_f16, as_bf16)
        if rot_v:
            v = wht_stages(builder, builder.fmul(v, _llvm_splat(builder, rs, n_v)), rot_v,
                           cpu_fma_lanes(context))
        is_q8 = builder.icmp_signed("==", fmt_a, _int_const(fmt_a, 1))
        return _llvm_store_quantized(context, builder, v, nb, q_ty, qa, qoff_v, is_q8, "fused")

    def codegen_staged(context, builder, sig, args):
        from numba.core import cgutils
        f32, i32, i16 = ir.FloatType(), ir.IntType(32), ir.IntType(16)
        x_ty, q_ty = sig.args[0], sig.args[2]
        xa, xoff_v, qa, qoff_v, rs, fmt_a, kind_a = args[:7]
        lanes = cpu_fma_lanes(context)
        regs = n_v // lanes
        vf, vi = ir.VectorType(f32, lanes), ir.VectorType(i32, lanes)
        scratch = cgutils.alloca_once(builder, ir.ArrayType(f32, n_v), name="fused_row")
        scratch.align = 64
        row = builder.bitcast(scratch, f32.as_pointer())

        def reg_ptr(i, count=lanes):
            return builder.bitcast(builder.gep(row, [ir.Constant(i32, i * lanes)]),
                                   ir.VectorType(f32, count).as_pointer())

        def load_input(i, widen):
            at = builder.add(xoff_v, _int_const(xoff_v, i * lanes))
            if x_ty.dtype == types.float32:
                v = builder.load(_vector_ptr(context, builder, x_ty, xa, at, f32, lanes),
                                 align=4)
            else:
                raw = builder.load(_vector_ptr(context, builder, x_ty, xa, at, i16, lanes),
                                   align=2)
                if widen == 3:
                    v = builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), lanes)),
                                      vf)
                else:
                    v = builder.bitcast(builder.shl(builder.zext(raw, vi),
                                                    ir.Constant(vi, [16] * lanes)), vf)
            if rot_v and not (widen == 3 and rot_v in _UNSCALED_BLOCKS):
                v = builder.fmul(v, _llvm_splat(builder, rs, lanes))
            return v

        def load_scratch(i):
            return builder.load(reg_ptr(i), align=32)

        def store_reg(i, v):
            builder.store(v, reg_ptr(i), align=32)

        def barrier():
            _llvm_barrier(builder, row)

        def first_passes(widen):
            if rot_v:
                wht_staged(builder, lambda i: load_input(i, widen), load_scratch, store_reg,
                           barrier, regs, rot_v, lanes)
            else:
                for i in range(regs):
                    store_reg(i, load_input(i, widen))

        prescale = None
        if x_ty.dtype == types.float32:
            first_passes(0)
        else:   # the row's passes twice, for float16 (kind 3) and bfloat16 bits: one
            # branch a call (a select of the two widenings became a branch a register)
            is_f16 = builder.icmp_signed("==", kind_a, _int_const(kind_a, 3))
            with builder.if_else(is_f16) as (f16_arm, bf16_arm):
                with f16_arm:
                    first_passes(3)
                with bf16_arm:
                    first_passes(2)
            if rot_v in _UNSCALED_BLOCKS:
                prescale = builder.select(is_f16, rs, ir.Constant(f32, 1.0))
        barrier()
        is_q8 = builder.icmp_signed("==", fmt_a, _int_const(fmt_a, 1))
        return _llvm_store_quantized(
            context, builder, None, n_v // 32, q_ty, qa, qoff_v, is_q8, "fused",
            load_block=lambda k: builder.load(reg_ptr(k * 32 // lanes, 32), align=32),
            barrier=barrier, blendv_lanes=lanes,
            block_regs=(lambda k: [load_scratch(k * 32 // lanes + j) for j in range(32 // lanes)])
            if lanes == 8 else None,
            prescale=prescale)

    def pick(context, builder, sig, args):
        if cpu_fma_lanes(context) == _STAGED_LANES or (
                rot_v and cpu_fma_lanes(context) == 16):
            return codegen_staged(context, builder, sig, args)
        return codegen(context, builder, sig, args)
    return types.int64(x, xoff, q, qoff, rscale, fmt, kind, n, rotate), pick


#: Walsh-Hadamard block sizes whose scale (1/8, 1/16) is a power of two: a float16 row
#: rotated in such blocks skips the scale multiply in the fused put's staged form. The
#: stages then run on the unscaled values and the scale goes into the block scales and
#: reciprocals (``prescale`` of :func:`_llvm_quantize_blocks`): every sum and difference
#: of float16 values in a block is a multiple of 2^-24 below 2^25 in magnitude, so neither
#: form meets a subnormal or an overflow, and scaling by a power of two commutes with each
#: rounding -- the same bits, one multiply a register fewer (the put's ``rscale`` is
#: :func:`.hadamard.rotation_scale` of the block). bfloat16 and float32 values can be
#: subnormal once scaled: they keep the multiply.
_UNSCALED_BLOCKS = (64, 256)

#: the register width (float32 lanes) for which the fused put takes the staged form
#: (:func:`.hadamard.wht_staged`): AVX2 with FMA, 16 registers of 8 floats -- the shipped
#: ``x86-64-v3`` code. AVX-512 (32 registers of 16 floats) holds a 512-value call whole,
#: and takes the staged form only for rotated calls (:func:`_fused_put_chunk`).
_STAGED_LANES = 8


@intrinsic(prefer_literal=True)
def _fused_rope_row(typingctx, q, qoff, cos_t, sin_t, toff, rscale, fmt, n, rot, neox, scale):
    """The rotary shift of one q8_0/q4_0/float8_e4m3 (``fmt`` 1/2/3) key row of ``n`` values
    (64 or 128, a literal) at byte ``qoff`` of ``q``'s data, in registers: the blocks
    dequantized (:func:`dequantize_block`'s ``d * q``, the scale widened by ``fpext``; float8:
    :func:`e4m3_to_f32` times ``scale``, stored back divided by it as :func:`f32_to_e4m3`
    -- :func:`_llvm_from_e4m3`, :func:`_llvm_e4m3_bits`), turned back from
    the Walsh-Hadamard basis when ``rot`` (a literal: 0 or ``n``; scaled by ``rscale``), the
    RoPE pairs (``neox`` a literal; :func:`.rope.rotate_pair`'s float32 math with the cos/sin
    table row at element ``toff``), forward again, requantized by
    :func:`_llvm_quantize_blocks` -- :func:`rotate_row_cpu`'s operations in its order. Returns
    0, or 1 (the row left as it was) when a value is not finite: the caller then runs
    :func:`rotate_row_cpu`."""
    lits = (n, rot, neox)
    if not all(isinstance(a, types.IntegerLiteral) for a in lits):
        return None
    n_v, rot_v, neox_v = (a.literal_value for a in lits)
    from llvmlite import ir

    def codegen(context, builder, sig, args):
        f32, i32, i8 = ir.FloatType(), ir.IntType(32), ir.IntType(8)
        q_ty = sig.args[0]
        qa, qoff_v, cos_a, sin_a, toff_v, rs, fmt_a = args[:7]
        scale_v = args[10]
        nb = n_v // 32

        def shuffle(a, b, idx):
            return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, len(idx)), idx))

        def dequantized(fmt_v):
            nbytes = 34 if fmt_v == 1 else 18
            parts = [_llvm_block_values(context, builder, q_ty, qa, builder.add(
                qoff_v, _int_const(qoff_v, k * nbytes)), fmt_v) for k in range(nb)]
            while len(parts) > 1:   # joined pairwise (shuffles take equal types)
                w = parts[0].type.count
                parts = [shuffle(a, b, list(range(2 * w)))
                         for a, b in zip(parts[0::2], parts[1::2])]
            return parts[0]

        is_q8 = builder.icmp_signed("==", fmt_a, _int_const(fmt_a, 1))
        is_f8 = builder.icmp_signed("==", fmt_a, _int_const(fmt_a, 3))
        deq8 = builder.append_basic_block("rope_deq_q8_0")
        deq4 = builder.append_basic_block("rope_deq_q4_0")
        deqf8 = builder.append_basic_block("rope_deq_f8")
        ggml = builder.append_basic_block("rope_deq_ggml")
        merged = builder.append_basic_block("rope_dequantized")
        builder.cbranch(is_f8, deqf8, ggml)   # (each reads only its own format's bytes)
        builder.position_at_end(ggml)
        builder.cbranch(is_q8, deq8, deq4)
        ends = []
        for block, fmt_v in ((deq8, 1), (deq4, 2)):
            builder.position_at_end(block)
            ends.append((dequantized(fmt_v), builder.block))
            builder.branch(merged)
        builder.position_at_end(deqf8)
        ends.append((_llvm_f8_values(context, builder, q_ty, qa, qoff_v, scale_v, n_v),
                     builder.block))
        builder.branch(merged)
        builder.position_at_end(merged)
        v = builder.phi(ir.VectorType(f32, n_v))
        for value, block in ends:
            v.add_incoming(value, block)
        if rot_v:
            v = wht_stages(builder, builder.fmul(v, _llvm_splat(builder, rs, n_v)), n_v,
                           cpu_fma_lanes(context))
        half = n_v // 2
        first, second = ((list(range(half)), list(range(half, n_v))) if neox_v else
                         (list(range(0, n_v, 2)), list(range(1, n_v, 2))))
        a = shuffle(v, v, first)
        b = shuffle(v, v, second)
        cs = builder.load(_vector_ptr(context, builder, sig.args[2], cos_a, toff_v, f32, half),
                          align=4)
        sn = builder.load(_vector_ptr(context, builder, sig.args[3], sin_a, toff_v, f32, half),
                          align=4)
        a2 = builder.fsub(builder.fmul(a, cs), builder.fmul(b, sn))
        b2 = builder.fadd(builder.fmul(a, sn), builder.fmul(b, cs))
        back = [0] * n_v
        for k in range(half):
            back[first[k]], back[second[k]] = k, k + half
        v = shuffle(a2, b2, back)
        if rot_v:
            v = wht_stages(builder, builder.fmul(v, _llvm_splat(builder, rs, n_v)), n_v,
                           cpu_fma_lanes(context))
        store_f8 = builder.append_basic_block("rope_store_f8")
        store_ggml = builder.append_basic_block("rope_store_ggml")
        done = builder.append_basic_block("rope_stored")
        builder.cbranch(is_f8, store_f8, store_ggml)
        builder.position_at_end(store_f8)   # float8: every value has a code (NaN 0x7F)
        bits = _llvm_e4m3_bits(builder, builder.fdiv(v, _llvm_splat(builder, scale_v, n_v)))
        builder.store(builder.trunc(bits, ir.VectorType(i8, n_v)),
                      _vector_ptr(context, builder, q_ty, qa, qoff_v, i8, n_v), align=1)
        f8_end = builder.block
        builder.branch(done)
        builder.position_at_end(store_ggml)
        flag_ggml = _llvm_store_quantized(context, builder, v, nb, q_ty, qa, qoff_v, is_q8,
                                          "rope")
        ggml_end = builder.block
        builder.branch(done)
        builder.position_at_end(done)
        flag = builder.phi(flag_ggml.type)
        flag.add_incoming(ir.Constant(flag_ggml.type, 0), f8_end)
        flag.add_incoming(flag_ggml, ggml_end)
        return flag
    return types.int64(q, qoff, cos_t, sin_t, toff, rscale, fmt, n, rot, neox, scale), codegen

@njit(inline="always")
def rotate_row_cpu(q, work, dim, fmt, scale, cos_t, sin_t, u, neox, rot, rscale):
    """The quantized key row ``q`` (bytes of ``dim`` values) turned by table row ``u`` of the
    cos/sin tables: dequantized into ``work`` (float32, ``>= dim``), rotated pair by pair with
    rope.py's math, requantized in place. A Walsh-Hadamard-rotated row (``rot`` > 0) is turned
    back before the RoPE pairs and forward again after them (llama.cpp's ``build_rope_shift``:
    dequantize, rotate back, RoPE, rotate forward, requantize)."""
    per = dim if fmt == 3 else 32  # float8: the whole row as one "block"
    nbytes = dim if fmt == 3 else (34 if fmt == 1 else 18)
    for blk in range(dim // per):
        _dequantize_cpu(q, blk * nbytes, per, fmt, scale, work, blk * per, 0)
    if rot > 0:
        for j in range(dim):
            work[j] = work[j] * rscale
        wht_row_cpu(work, dim, rot)
    half = cos_t.shape[1]
    for p in range(half):
        i0, i1 = _pair_cpu(p, half, neox)
        a2, b2 = _rotate_pair_cpu(work[i0], work[i1], cos_t[u, p], sin_t[u, p])
        work[i0] = a2
        work[i1] = b2
    if rot > 0:
        for j in range(dim):
            work[j] = work[j] * rscale
        wht_row_cpu(work, dim, rot)
    if fmt == 3:
        _quantize_cpu(work, 0, dim, 0, q, 0, fmt, scale)
    else:
        quantize_row_cpu(work, dim, q, fmt)


_pair_cuda = pair_index.cuda
_rotate_pair_cuda = rotate_pair.cuda
_move_step_cuda = move_step.cuda
_move_step_cpu = move_step.cpu


_IN_TYPES = STORAGE_VIEW_TYPES
_PUT_SIGS = [(_arr(types.uint8, 4), _arr(dt, 3), _arr(types.int32, 1), types.int64, types.int64,
              types.int64, _arr(types.float32, 1), types.int64) for dt in _IN_TYPES]
_PUT_ROT_SIGS = [(_arr(types.uint8, 4), _arr(dt, 3), _arr(types.int32, 1), types.int64,
                  types.int64, types.int64, types.int64, types.int64, types.int64)
                 for dt in _IN_TYPES]
_GET_SIGS = [(_arr(types.uint8, 4), types.int64, types.int64, types.int64,
              _arr(types.float32, 1), _arr(dt, 3), types.int64) for dt in _IN_TYPES]
_ROPE_SIGS = [(_arr(types.uint8, 4), _arr(types.int32, 1), _arr(types.int32, 1),
               _arr(types.int32, 1), _arr(types.float32, 2), _arr(types.float32, 2), types.int64,
               types.int64, _arr(types.float32, 1), types.int64, types.int64, types.int64)]
_MOVE_SIGS = [(_arr(w, 4), _arr(types.int64, 2)) for w in (types.uint8, types.uint16,
                                                           types.uint32, types.uint64)]


# --------------------------------------------------------------------------------------------
# put: quantize a batch into one layer

@cuda_kernel("quant_put", _PUT_SIGS)
def quant_put_kernel(q, x, slots, start, layer, fmt, scales, kind):
    """Grid x: (head, block) of a row; y: tokens (grid-striding). Token ``t`` goes to cell
    ``start + t`` (``start >= 0``) or ``slots[t]`` (negative: skipped)."""
    per = 1 if fmt == 3 else 32
    nbytes = 1 if fmt == 3 else (34 if fmt == 1 else 18)
    nblk = x.shape[2] // per
    r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if r >= x.shape[1] * nblk:
        return
    h = r // nblk
    blk = r - h * nblk
    scale = scales[layer]
    t = cuda.blockIdx.y
    while t < x.shape[0]:
        cell = start + t if start >= 0 else np.int64(slots[t])
        if cell >= 0:
            _quantize_cuda(x[t, h], blk * per, per, kind, q[layer, cell, h], blk * nbytes, fmt,
                           scale)
        t += cuda.gridDim.y


# The CPU twins run their loops once per format with the format a literal (an inlined body per
# branch), so the per-value format tests fold away: measured 10x faster than a runtime format.

@njit(inline="always")
def _put_token_cpu(q, x, slots, start, layer, fmt, scale, kind, t):
    per = x.shape[2] if fmt == 3 else 32  # float8: a whole row per call
    nbytes = x.shape[2] if fmt == 3 else (34 if fmt == 1 else 18)
    nblk = x.shape[2] // per
    cell = start + t if start >= 0 else np.int64(slots[t])
    if cell < 0:
        return
    for h in range(x.shape[1]):
        x_row = x[t, h]
        q_row = q[layer, cell, h]
        for blk in range(nblk):
            _quantize_cpu(x_row, blk * per, per, kind, q_row, blk * nbytes, fmt, scale)


@njit(inline="always")
def _put_rows_cpu(q, x, slots, start, layer, fmt, scale, kind):
    # prange: threads in quant_put_cpu_par, a plain loop in quant_put_cpu; tokens go to
    # distinct cells (checked by the caller)
    for t in prange(x.shape[0]):
        _put_token_cpu(q, x, slots, start, layer, fmt, scale, kind, t)


@njit(inline="always")
def _put_by_format(q, x, slots, start, layer, fmt, scales, kind):
    scale = scales[layer]
    if fmt == 1:
        _put_rows_cpu(q, x, slots, start, layer, 1, scale, kind)
    elif fmt == 2:
        _put_rows_cpu(q, x, slots, start, layer, 2, scale, kind)
    else:
        _put_rows_cpu(q, x, slots, start, layer, 3, scale, kind)


@njit(cache=True)
def quant_put_cpu(q, x, slots, start, layer, fmt, scales, kind):
    """CPU twin of :func:`quant_put_kernel`."""
    _put_by_format(q, x, slots, start, layer, fmt, scales, kind)


@njit(cache=True, parallel=True)
def quant_put_cpu_par(q, x, slots, start, layer, fmt, scales, kind):
    """:func:`quant_put_cpu` with its tokens spread over numba's threads (large batches)."""
    _put_by_format(q, x, slots, start, layer, fmt, scales, kind)


#: values from which the CPU quantized put, get and rotary shift spread their tokens / cells over
#: numba's threads: (de)quantizing is compute-bound (~1-4 ns a value on one core), so threads pay
#: off far sooner than for plain copies
PARALLEL_MIN_VALUES = 1 << 18
#: tokens a thread takes at a time in the threaded quantized put (dynamic scheduling)
PARALLEL_CHUNK_TOKENS = 32


def _cpu_twin(single, threaded, values: int, items: int):
    """The CPU twin to launch: ``threaded`` for at least :data:`PARALLEL_MIN_VALUES` values
    spread over more than one token or cell, else ``single``."""
    return threaded if values >= PARALLEL_MIN_VALUES and items > 1 else single


# --------------------------------------------------------------------------------------------
# put with llama.cpp's Walsh-Hadamard rotation (kernels/hadamard.py): rotate, then quantize

@cuda_device
def wht_shared(work, dim, rot, rscale, t, nt):
    """The block's threads rotate the row ``work[:dim]`` (shared memory, all of it written
    and synchronised) in Walsh-Hadamard blocks of ``rot``: scale (a thread per value), then
    each stage a thread per butterfly, a barrier after each. Every thread must call it."""
    j = t
    while j < dim:
        work[j] = work[j] * rscale
        j += nt
    cuda.syncthreads()
    step = 1
    while step < rot:
        p = t
        while p < dim // 2:
            i = _wht_pair_cuda(p, step)
            work[i], work[i + step] = _sum_diff_cuda(work[i], work[i + step])
            p += nt
        cuda.syncthreads()
        step *= 2


#: threads that rotate and quantize one (token, head) row together (the row in shared memory)
PUT_ROW_THREADS = 64


@cuda_kernel("quant_put_rot", _PUT_ROT_SIGS)
def quant_put_rot_kernel(q, x, slots, start, layer, fmt, kind, rot, rscale_bits):
    """One block per (token, head) row (grid x, grid-striding over tokens x heads). The block
    loads the row into shared memory as float32 (a thread per value), scales it by ``rscale``,
    runs the Walsh-Hadamard stages (a thread per butterfly, a barrier between stages: each stage reads
    the previous one's values) in blocks of ``rot`` values, then quantizes it (a thread per
    ggml block). ``fmt``: q8_0 or q4_0 (float8 is never rotated). ``rscale_bits``: the float32
    bits of the scale (the fast launch path passes 64-bit words only)."""
    work = cuda.shared.array(MAX_ROTATE_DIM, np.float32)
    rscale = np.uint32(rscale_bits).view(np.float32)
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    dim = x.shape[2]
    n_heads = x.shape[1]
    nbytes = 34 if fmt == 1 else 18
    rows = x.shape[0] * n_heads
    r = cuda.blockIdx.x
    while r < rows:        # block-uniform loops: every thread reaches each syncthreads
        tok = r // n_heads
        h = r - tok * n_heads
        cell = start + tok if start >= 0 else np.int64(slots[tok])
        if cell >= 0:
            j = t
            while j < dim:
                work[j] = _load_cuda(x[tok, h, j], kind)
                j += nt
            cuda.syncthreads()
            wht_shared(work, dim, rot, rscale, t, nt)
            b = t
            while b < dim // 32:
                _quantize_cuda(work, b * 32, 32, 0, q[layer, cell, h], b * nbytes, fmt,
                               np.float32(1.0))
                b += nt
            cuda.syncthreads()   # the next row reuses work
        r += cuda.gridDim.x


@njit(inline="always")
def _put_token_rows_cpu(q, x, slots, start, layer, fmt, kind, rot, rscale, t):
    """Token ``t`` of a q8_0/q4_0 put: each head's row widened into a float32 work row (F16C
    for float16 bits), rotated when ``rot`` > 0, then quantized from the work row (contiguous
    float32: the block math vectorises)."""
    cell = start + t if start >= 0 else np.int64(slots[t])
    if cell < 0:
        return
    dim = x.shape[2]
    work = np.empty(dim, np.float32)
    for h in range(x.shape[1]):
        x_row = x[t, h]
        # widened and scaled in one pass (each value rounded once by the multiply, as ggml)
        if kind == 3:   # float16 bits (the cast only types the branch for other inputs)
            for j in range(dim):
                work[j] = _f16_hw(np.uint16(x_row[j])) * rscale
        else:
            for j in range(dim):
                work[j] = _load_cpu(x_row[j], kind) * rscale
        if rot > 0:
            wht_row_cpu(work, dim, rot)
        quantize_row_cpu(work, dim, q[layer, cell, h], fmt)


@njit(inline="always")
def _put_rows_rot_cpu(q, x, slots, start, layer, fmt, kind, rot, rscale):
    for t in prange(x.shape[0]):   # threads in the _par twin only; distinct cells
        _put_token_rows_cpu(q, x, slots, start, layer, fmt, kind, rot, rscale, t)


@njit(cache=True)
def _put_chunk_work_row(q, x, t, h, j0, cell, layer, b0, fmt, kind, n, rotate, rscale):
    """The work-row form of one fused chunk (``n`` values of row (t, h) from ``j0``, to bytes
    ``b0``): for a chunk holding an infinity or NaN, which the fused form leaves to it. A call,
    not inlined: it is rare, and a copy per chunk shape made compiling the put take minutes."""
    work = np.empty(n, np.float32)
    x_row = x[t, h]
    for j in range(n):
        if kind == 3:
            y = _f16_hw(np.uint16(x_row[j0 + j]))
        else:
            y = _load_cpu(x_row[j0 + j], kind)
        work[j] = y * rscale if rotate else y
    if rotate:
        wht_row_cpu(work, n, n)
    nbytes = 34 if fmt == 1 else 18
    quantize_row_cpu(work, n, q[layer, cell, h, b0:b0 + n // 32 * nbytes], fmt)


#: values per call of the fused put's wide form (16 ggml blocks: on AVX-512, 32 registers)
FUSED_WIDE = 512


@njit(inline="always")
def _fused_call_fmt(x, at, q, qat, rscale, fmt, kind, n, rotate, wide):
    if rotate:
        if n == 128:
            if wide:
                return _fused_put_chunk(x, at, q, qat, rscale, fmt, kind, 512, 128)
            return _fused_put_chunk(x, at, q, qat, rscale, fmt, kind, 128, 128)
        if n == 64:
            if wide:
                return _fused_put_chunk(x, at, q, qat, rscale, fmt, kind, 512, 64)
            return _fused_put_chunk(x, at, q, qat, rscale, fmt, kind, 64, 64)
        if wide:
            return _fused_put_chunk(x, at, q, qat, rscale, fmt, kind, 512, 256)
        return _fused_put_chunk(x, at, q, qat, rscale, fmt, kind, 256, 256)
    if wide:
        return _fused_put_chunk(x, at, q, qat, rscale, fmt, kind, 512, 0)
    if n == 128:
        return _fused_put_chunk(x, at, q, qat, rscale, fmt, kind, 128, 0)
    if n == 64:
        return _fused_put_chunk(x, at, q, qat, rscale, fmt, kind, 64, 0)
    return _fused_put_chunk(x, at, q, qat, rscale, fmt, kind, 32, 0)


@njit(inline="always")
def _fused_call(x, at, q, qat, rscale, fmt, kind, n, rotate, wide):
    """One :func:`_fused_put_chunk` call: ``FUSED_WIDE`` values (``wide``) or ``n`` (one
    Walsh-Hadamard block of ``n`` when ``rotate``; else 128, 64 or 32), the literal shape and
    format picked by branches that go the same way for the whole put (a compiled copy per
    shape and format: the two formats' code in one copy left the q8_0 path slower)."""
    if fmt == 1:
        return _fused_call_fmt(x, at, q, qat, rscale, 1, kind, n, rotate, wide)
    return _fused_call_fmt(x, at, q, qat, rscale, 2, kind, n, rotate, wide)


@njit(inline="always")
def _put_rows_fused_cpu(q, x, slots, start, layer, fmt, kind, rscale, n, rotate):
    """Rows of a q8_0/q4_0 put in the fused form, addressed by element offsets from the arrays'
    strides (no row views, no work row). A token's values are taken as contiguous runs: the
    whole token when its heads lie back to back in both ``x`` and ``q`` (the usual
    ``[batch, heads, dim]`` input and the cache's own rows), else each head's row. A run goes
    in calls of :data:`FUSED_WIDE` values while that many remain, then of ``n`` (one
    Walsh-Hadamard block each when ``rotate``): a call's chains of dependent vector operations
    (widen, 7 stages, the block maxima, the scales' divides, the rounding) are long, and 16
    blocks in one call give the core independent work to overlap them with (a 128-value call
    left it waiting: 0.22 against 0.16 ns a value for a rotated q8_0 key, AVX-512)."""
    dim = x.shape[2]
    heads = x.shape[1]
    xs0 = x.strides[0] // x.itemsize
    xs1 = x.strides[1] // x.itemsize
    bpb = 34 if fmt == 1 else 18        # bytes a ggml block of 32 values
    flat = xs1 == dim and q.strides[2] == dim // 32 * bpb and q.strides[3] == 1
    runs = 1 if flat else heads
    run_len = heads * dim if flat else dim
    for t in prange(x.shape[0]):   # threads in the _par twin only; distinct cells
        cell = start + t if start >= 0 else np.int64(slots[t])
        if cell < 0:
            continue
        q_base = layer * q.strides[0] + cell * q.strides[1]
        for r in range(runs):
            xo = t * xs0 + r * xs1
            qo = q_base + r * q.strides[2]
            v = 0
            while v < run_len:
                wide = run_len - v >= FUSED_WIDE
                size = FUSED_WIDE if wide else n
                bad = _fused_call(x, xo + v, q, qo + v // 32 * bpb, rscale, fmt, kind, n,
                                  rotate, wide)
                if bad != 0:   # an infinity or NaN: the call stored nothing
                    for s in range(v, v + size, n):
                        j0 = s % dim
                        _put_chunk_work_row(q, x, t, r + s // dim, j0, cell, layer,
                                            j0 // 32 * bpb, fmt, kind, n, rotate, rscale)
                v += size


@njit(cache=True)
def quant_put_fused_cpu(q, x, slots, start, layer, rscale, n, fmt, kind, rotate):
    """The CPU's q8_0/q4_0 put (``fmt`` 1/2) in the fused form (see :func:`_fused_put_chunk`):
    ``x [batch, heads, dim]`` (last axis contiguous; ``kind`` 3: float16 bits, 2: bfloat16
    bits, or float32) in chunks of ``n`` (``rotate``: 64, 128 or 256, one Walsh-Hadamard block
    each, scaled by ``rscale``; else 32, 64 or 128), dividing dim, into layer ``layer`` of
    ``q`` at ``slots`` / from ``start`` (as :func:`quant_put_rot_cpu`)."""
    _put_rows_fused_cpu(q, x, slots, start, layer, fmt, kind, rscale, n, rotate)


@njit(cache=True, parallel=True)
def quant_put_fused_cpu_par(q, x, slots, start, layer, rscale, n, fmt, kind, rotate):
    """:func:`quant_put_fused_cpu` with its tokens spread over numba's threads."""
    _put_rows_fused_cpu(q, x, slots, start, layer, fmt, kind, rscale, n, rotate)


def _fused_chunk(dim: int, rot: int, kind: int, last_stride: int, itemsize: int):
    """``(n, rotate)`` of the fused CPU put for rows of ``dim`` values rotated in blocks of
    ``rot`` (0: none), or None where it does not serve (no F16C, another rotation block, an
    input kind it does not read, a strided last axis)."""
    if not _F16C or kind not in (0, 2, 3) or last_stride != itemsize:
        return None
    if rot:
        return (rot, 1) if rot in (64, 128, 256) and dim % rot == 0 else None
    for n in (128, 64, 32):
        if dim % n == 0:
            return n, 0
    return None


@njit(inline="always")
def _put_rot_by_format(q, x, slots, start, layer, fmt, kind, rot, rscale):
    # the format and the two common input kinds as literals: their per-value branches fold away
    if fmt == 1:
        if kind == 3:
            _put_rows_rot_cpu(q, x, slots, start, layer, 1, 3, rot, rscale)
        elif kind == 0:
            _put_rows_rot_cpu(q, x, slots, start, layer, 1, 0, rot, rscale)
        else:
            _put_rows_rot_cpu(q, x, slots, start, layer, 1, kind, rot, rscale)
    else:
        if kind == 3:
            _put_rows_rot_cpu(q, x, slots, start, layer, 2, 3, rot, rscale)
        elif kind == 0:
            _put_rows_rot_cpu(q, x, slots, start, layer, 2, 0, rot, rscale)
        else:
            _put_rows_rot_cpu(q, x, slots, start, layer, 2, kind, rot, rscale)


@njit(cache=True)
def quant_put_rot_cpu(q, x, slots, start, layer, fmt, kind, rot, rscale):
    """CPU twin of :func:`quant_put_rot_kernel` (``rot`` 0: no rotation; any ggml block put on
    the CPU runs here)."""
    _put_rot_by_format(q, x, slots, start, layer, fmt, kind, rot, rscale)


@njit(cache=True, parallel=True)
def quant_put_rot_cpu_par(q, x, slots, start, layer, fmt, kind, rot, rscale):
    """:func:`quant_put_rot_cpu` with its tokens spread over numba's threads (large batches)."""
    _put_rot_by_format(q, x, slots, start, layer, fmt, kind, rot, rscale)


# --------------------------------------------------------------------------------------------
# float8_e4m3fn on the CPU in vector form (the put and the get; the same math as
# f32_to_e4m3 / e4m3_to_f32, lane by lane)

def _llvm_e4m3_bits(builder, y):
    """The float8_e4m3fn bits (``<n x i32>``, one byte's worth each) of the ``<n x float>``
    ``y``, :func:`f32_to_e4m3`'s results by cheaper vector forms of its arms: the normal
    arm's round to nearest even as one integer add on the magnitude's bits (``+ 0x7FFFF`` and
    the kept mantissa's low bit: a carry out of the 20 dropped bits exactly when they exceed
    half, or equal it with the kept bit odd; a mantissa carry moves into the exponent), the
    subnormal arm's (``k * 2**-9``) as the float add of ``2**23`` to ``|y| * 512`` (< 8 there:
    the sum's last bit is the integer, rounded to nearest even). Both arms are computed for
    every lane and picked by selects, with the saturation to 0x7E and NaN's 0x7F."""
    from llvmlite import ir
    n = y.type.count
    vi = ir.VectorType(ir.IntType(32), n)

    def ci(v):
        return ir.Constant(vi, [v] * n)

    def cf(v):
        return ir.Constant(y.type, [v] * n)
    b = builder.bitcast(y, vi)
    sign = builder.and_(builder.lshr(b, ci(24)), ci(0x80))
    mag = builder.and_(b, ci(0x7FFFFFFF))
    a = builder.bitcast(mag, y.type)
    odd = builder.and_(builder.lshr(mag, ci(20)), ci(1))
    normal = builder.sub(builder.lshr(builder.add(mag, builder.add(odd, ci(0x7FFFF))), ci(20)),
                         ci(120 << 3))
    magic = builder.fadd(builder.fmul(a, cf(512.0)), cf(8388608.0))
    sub = builder.sub(builder.bitcast(magic, vi), ci(0x4B000000))
    out = builder.select(builder.fcmp_ordered(">=", a, cf(0.015625)), normal, sub)
    out = builder.select(builder.fcmp_ordered(">=", a, cf(448.0)), ci(0x7E), out)
    out = builder.select(builder.fcmp_unordered("uno", a, a), ci(0x7F), out)
    return builder.or_(sign, out)


def _llvm_from_e4m3(builder, raw):
    """The float32 values (``<n x float>``) of the float8_e4m3fn bytes ``raw`` (``<n x i8>``):
    :func:`e4m3_to_f32`'s arms as vector selects (a NaN's sign flipped on its bits, as
    numba's negation does)."""
    from llvmlite import ir
    n = raw.type.count
    vi, vf = ir.VectorType(ir.IntType(32), n), ir.VectorType(ir.FloatType(), n)

    def ci(v):
        return ir.Constant(vi, [v] * n)
    v = builder.zext(raw, vi)
    e = builder.and_(builder.lshr(v, ci(3)), ci(0xF))
    m = builder.and_(v, ci(7))
    normal = builder.or_(builder.shl(builder.add(e, ci(120)), ci(23)), builder.shl(m, ci(20)))
    small = builder.bitcast(builder.fmul(builder.sitofp(m, vf),
                                         ir.Constant(vf, [0.001953125] * n)), vi)
    y = builder.select(builder.icmp_unsigned("==", e, ci(0)), small, normal)
    y = builder.select(builder.icmp_unsigned("==", builder.and_(v, ci(0x7F)), ci(0x7F)),
                       ci(0x7FC00000), y)
    y = builder.xor(y, builder.shl(builder.and_(v, ci(0x80)), ci(24)))
    return builder.bitcast(y, vf)


@intrinsic(prefer_literal=True)
def _fused_f8_put_chunk(typingctx, x, xoff, q, qoff, scale, inv, kind):
    """The 32 input values at element ``xoff`` of ``x``'s data (float32, or 16-bit values:
    ``kind`` a literal, 3: float16 bits widened by F16C, 2: bfloat16 bits) divided by
    ``scale`` and stored as float8_e4m3fn bytes at byte ``qoff`` of ``q``'s data:
    :func:`quantize_block`'s float8 arm as vector code (:func:`_llvm_e4m3_bits`). ``inv``
    nonzero: ``1 / scale`` for a power-of-two ``scale`` (1.0, vLLM's default), where the
    product is the quotient exactly (subnormal results rounded alike): a multiply instead of
    a divide (``vdivps`` takes ~5 cycles a register)."""
    if not isinstance(kind, types.IntegerLiteral):
        return None
    kind_v = kind.literal_value
    from llvmlite import ir

    def codegen(context, builder, sig, args):
        f32, i16, i32, i8 = ir.FloatType(), ir.IntType(16), ir.IntType(32), ir.IntType(8)
        x_ty, q_ty = sig.args[0], sig.args[2]
        xa, xoff_v, qa, qoff_v, sc, inv_v = args[:6]
        vf = ir.VectorType(f32, 32)
        if x_ty.dtype == types.float32:
            v = builder.load(_vector_ptr(context, builder, x_ty, xa, xoff_v, f32, 32), align=4)
        else:
            raw = builder.load(_vector_ptr(context, builder, x_ty, xa, xoff_v, i16, 32),
                               align=2)
            if kind_v == 3:
                v = builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), 32)), vf)
            else:
                vi = ir.VectorType(i32, 32)
                v = builder.bitcast(builder.shl(builder.zext(raw, vi),
                                                ir.Constant(vi, [16] * 32)), vf)
        by_mul = builder.fcmp_ordered("!=", inv_v, ir.Constant(f32, 0.0))
        with builder.if_else(by_mul, likely=True) as (mul_arm, div_arm):
            with mul_arm:
                y_mul = builder.fmul(v, _llvm_splat(builder, inv_v, 32))
                mul_end = builder.block
            with div_arm:
                y_div = builder.fdiv(v, _llvm_splat(builder, sc, 32))
                div_end = builder.block
        y = builder.phi(vf)
        y.add_incoming(y_mul, mul_end)
        y.add_incoming(y_div, div_end)
        bits = _llvm_e4m3_bits(builder, y)
        builder.store(builder.trunc(bits, ir.VectorType(i8, 32)),
                      _vector_ptr(context, builder, q_ty, qa, qoff_v, i8, 32), align=1)
        return context.get_dummy_value()
    return types.void(x, xoff, q, qoff, scale, inv, kind), codegen


@njit(inline="always")
def _f8_put_call(x, xoff, q, qoff, scale, inv, kind):
    if kind == 3:
        _fused_f8_put_chunk(x, xoff, q, qoff, scale, inv, 3)
    else:
        _fused_f8_put_chunk(x, xoff, q, qoff, scale, inv, 2)


@njit(inline="always")
def _put_rows_f8_cpu(q, x, slots, start, layer, scale, kind):
    """A float8 put (``x [batch, heads, dim]``, last axis contiguous; ``q``'s last axis
    contiguous), 32 values a :func:`_fused_f8_put_chunk` call, a row's tail of fewer by
    :func:`quantize_block`'s element form."""
    dim = x.shape[2]
    xs0 = x.strides[0] // x.itemsize
    xs1 = x.strides[1] // x.itemsize
    sb = np.int64(np.float32(scale).view(np.uint32))
    e = (sb >> 23) & 0xFF
    pow2 = ((sb & 0x7FFFFF) == 0) & (e >= 1) & (e <= 253)   # 1 / scale exact and normal
    inv = np.float32(1.0) / np.float32(scale) if pow2 else np.float32(0.0)
    for t in prange(x.shape[0]):   # threads in the _par twin only; distinct cells
        cell = start + t if start >= 0 else np.int64(slots[t])
        if cell < 0:
            continue
        for h in range(x.shape[1]):
            xo = t * xs0 + h * xs1
            qo = layer * q.strides[0] + cell * q.strides[1] + h * q.strides[2]
            j = 0
            while j + 32 <= dim:
                _f8_put_call(x, xo + j, q, qo + j, scale, inv, kind)
                j += 32
            if j < dim:
                _f8_tail(x, t, h, j, q, layer, cell, scale, kind)


@njit
def _f8_tail(x, t, h, j, q, layer, cell, scale, kind):
    """A float8 row's last ``dim % 32`` values, one at a time (a call: rare)."""
    x_row = x[t, h]
    q_row = q[layer, cell, h]
    for i in range(j, x.shape[2]):
        y = _f16_hw(np.uint16(x_row[i])) if kind == 3 else _load_cpu(x_row[i], kind)
        q_row[i] = _to_e4m3_cpu(y / scale)


@njit(cache=True)
def quant_put_f8_cpu(q, x, slots, start, layer, scales, kind):
    """The CPU's float8_e4m3fn put in vector form (:func:`_put_rows_f8_cpu`): ``x [batch,
    heads, dim]`` (float32, or float16 / bfloat16 bits by ``kind`` 3 / 2) divided by
    ``scales[layer]`` into layer ``layer`` of ``q`` at ``slots`` / from ``start``; the same
    bytes as :func:`quant_put_cpu`."""
    _put_rows_f8_cpu(q, x, slots, start, layer, scales[layer], kind)


@njit(cache=True, parallel=True)
def quant_put_f8_cpu_par(q, x, slots, start, layer, scales, kind):
    """:func:`quant_put_f8_cpu` with its tokens spread over numba's threads."""
    _put_rows_f8_cpu(q, x, slots, start, layer, scales[layer], kind)


# --------------------------------------------------------------------------------------------
# get: dequantize cells lo .. lo + n - 1 of one layer into out [n, heads, dim]; first the
# CPU's vector form (q8_0, q4_0, float8), then the CUDA kernel and its element twin

@intrinsic(prefer_literal=True)
def _fused_get_chunk(typingctx, q, qoff, out, ooff, scale, fmt, kind, nb):
    """Dequantize the ``nb`` (a literal: 1 or 4) ggml blocks at byte ``qoff`` of ``q``'s data
    (``fmt`` a literal, 1: q8_0, 2: q4_0; 3: ``32 * nb`` float8_e4m3fn bytes, each value
    :func:`e4m3_to_f32` times ``scale``, a NaN given the element form's NaN bits) into the
    ``32 * nb`` values at element ``ooff`` of ``out``'s data: float32 when ``out`` is, else
    float16 bits (``kind`` 1) or bfloat16 bits (2; :func:`_llvm_store_values`).
    :func:`dequantize_block`'s math as LLVM vectors (:func:`_llvm_block_values`,
    :func:`_llvm_f8_values`), then rounded to nearest even -- by ``fptrunc``
    (``vcvtps2ph``) for float16, by :func:`.f32_to_bf16_bits`' integer rounding for
    bfloat16. A finite scale makes every product finite (``|d * q| <= 65504 * 128``),
    where the hardware conversion gives the software one's bits (subnormal and overflowing
    halves included); a block whose scale is an infinity or NaN makes the call store
    nothing and return 1, and the caller dequantizes those blocks by
    :func:`dequantize_block` (its NaN bits). The element loop took ~0.6 ns a value with its
    software float16 rounding (4-7% of ``np.copyto`` of the same float16 bytes on one
    thread); this form is a few vector operations a register. The CPU must have F16C
    (``_F16C``)."""
    if not all(isinstance(a, types.IntegerLiteral) for a in (fmt, nb)):
        return None
    fmt_v, nb_v = fmt.literal_value, nb.literal_value
    from llvmlite import ir

    def codegen(context, builder, sig, args):
        i16 = ir.IntType(16)
        q_ty, out_ty = sig.args[0], sig.args[2]
        qa, qoff_v, oa, ooff_v, scale_v, _, kind_a = args[:7]
        nbytes = {1: 34, 2: 18, 3: 32}[fmt_v]
        scale_bits = [builder.load(_elem_ptr(context, builder, q_ty, qa, builder.add(
            qoff_v, _int_const(qoff_v, k * nbytes)), i16), align=1)
            for k in range(nb_v if fmt_v != 3 else 0)]
        bad = ir.Constant(ir.IntType(1), 0)
        for sb in scale_bits:   # an infinity or NaN scale: exponent bits all set
            bad = builder.or_(bad, builder.icmp_unsigned(
                "==", builder.and_(sb, ir.Constant(i16, 0x7C00)), ir.Constant(i16, 0x7C00)))
        with builder.if_then(builder.not_(bad), likely=True):
            for k in range(nb_v):
                at = builder.add(qoff_v, _int_const(qoff_v, k * nbytes))
                if fmt_v == 3:
                    y = _llvm_f8_values(context, builder, q_ty, qa, at, scale_v, 32)
                else:
                    y = _llvm_block_values(context, builder, q_ty, qa, at, fmt_v)
                _llvm_store_values(context, builder, out_ty, oa,
                                   builder.add(ooff_v, _int_const(ooff_v, 32 * k)), y, kind_a,
                                   fmt_v == 3)
        return builder.zext(bad, ir.IntType(64))
    return types.int64(q, qoff, out, ooff, scale, fmt, kind, nb), codegen


def _llvm_store_values(context, builder, out_ty, oa, o, y, kind_a, may_be_nan):
    """Store the ``<32 x float>`` ``y`` at element ``o`` of ``out``: as they are (a float32
    ``out``), or rounded to nearest even to float16 bits (``kind_a``, a run-time value, 1:
    ``vcvtps2ph``) or bfloat16 bits (2: :func:`.f32_to_bf16_bits`' integer rounding), a
    branch a call that goes the same way for the whole get. ``may_be_nan``: a NaN lane gets
    the element form's bits (:func:`.f32_to_f16_bits`: its sign and 0x7E00; bfloat16: its
    top half with the quiet bit) instead of the hardware's."""
    from llvmlite import ir
    f32, i16, i32 = ir.FloatType(), ir.IntType(16), ir.IntType(32)
    v32i = ir.VectorType(i32, 32)

    def c32(v):
        return ir.Constant(v32i, [v] * 32)
    if out_ty.dtype == types.float32:
        builder.store(y, _vector_ptr(context, builder, out_ty, oa, o, f32, 32), align=4)
        return
    bits = builder.bitcast(y, v32i)
    is_bf16 = builder.icmp_signed("==", kind_a, _int_const(kind_a, 2))
    with builder.if_else(is_bf16) as (bf16_arm, f16_arm):
        for arm, bf16 in ((bf16_arm, True), (f16_arm, False)):
            with arm:
                if bf16:
                    h = builder.lshr(builder.add(bits, builder.add(builder.and_(
                        builder.lshr(bits, c32(16)), c32(1)), c32(0x7FFF))), c32(16))
                    nan_bits = builder.or_(builder.lshr(bits, c32(16)), c32(0x40))
                else:
                    h = builder.zext(builder.bitcast(builder.fptrunc(
                        y, ir.VectorType(ir.HalfType(), 32)), ir.VectorType(i16, 32)), v32i)
                    nan_bits = builder.or_(builder.and_(builder.lshr(bits, c32(16)),
                                                        c32(0x8000)), c32(0x7E00))
                if may_be_nan:
                    nan = builder.icmp_unsigned(">", builder.and_(bits, c32(0x7FFFFFFF)),
                                                c32(0x7F800000))
                    h = builder.select(nan, nan_bits, h)
                builder.store(builder.trunc(h, ir.VectorType(i16, 32)),
                              _vector_ptr(context, builder, out_ty, oa, o, i16, 32), align=2)


@njit(inline="always")
def _get_call_nb(q, qoff, out, ooff, scale, fmt, kind, nb):
    if nb == 4:
        return _fused_get_chunk(q, qoff, out, ooff, scale, fmt, kind, 4)
    return _fused_get_chunk(q, qoff, out, ooff, scale, fmt, kind, 1)


@njit(inline="always")
def _get_call(q, qoff, out, ooff, scale, fmt, kind, nb):
    """One :func:`_fused_get_chunk` call, its literal format and block count picked by
    branches that go the same way for the whole get."""
    if fmt == 1:
        return _get_call_nb(q, qoff, out, ooff, scale, 1, kind, nb)
    if fmt == 2:
        return _get_call_nb(q, qoff, out, ooff, scale, 2, kind, nb)
    return _fused_get_chunk(q, qoff, out, ooff, scale, 3, kind, 1)


@njit(inline="always")
def _get_rows_fused_cpu(q, layer, lo, fmt, scale, out, kind):
    """Cells ``lo ..`` of layer ``layer`` of ``q`` (last axis contiguous) dequantized into
    ``out [n, heads, dim]`` (last axis contiguous) by :func:`_fused_get_chunk`: q8_0/q4_0
    four blocks a call while four remain (a call that met a non-finite scale is redone block
    by block by :func:`dequantize_block`), float8 32 values a call and a row's last ``dim %
    32`` by :func:`dequantize_block`."""
    nbytes = 34 if fmt == 1 else (18 if fmt == 2 else 32)
    nblk = out.shape[2] // 32
    os0 = out.strides[0] // out.itemsize
    os1 = out.strides[1] // out.itemsize
    for c in prange(out.shape[0]):   # threads in the _par twin only; distinct cells
        for h in range(out.shape[1]):
            qo = layer * q.strides[0] + (lo + c) * q.strides[1] + h * q.strides[2]
            oo = c * os0 + h * os1
            b = 0
            while b < nblk:
                nb = 4 if nblk - b >= 4 and fmt != 3 else 1
                if _get_call(q, qo + b * nbytes, out, oo + 32 * b, scale, fmt, kind,
                             nb) != 0:
                    for k in range(b, b + nb):
                        _dequantize_cpu(q[layer, lo + c, h], k * nbytes, 32, fmt, scale,
                                        out[c, h], 32 * k, kind)
                b += nb
            if fmt == 3 and nblk * 32 < out.shape[2]:   # float8: the row's last values
                j = nblk * 32
                _dequantize_cpu(q[layer, lo + c, h], j, out.shape[2] - j, 3, scale,
                                out[c, h], j, kind)


@njit(cache=True)
def quant_get_fused_cpu(q, layer, lo, fmt, scales, out, kind):
    """The CPU's q8_0/q4_0/float8 get (``fmt`` 1/2/3) in vector form
    (:func:`_get_rows_fused_cpu`):
    cells ``lo .. lo + len(out) - 1`` of layer ``layer`` of ``q [n_layers, n_cells, heads,
    row_bytes]`` into ``out [n, heads, dim]`` (float32, or float16 / bfloat16 bits by
    ``kind`` 1 / 2), the same bits as :func:`quant_get_cpu`."""
    _get_rows_fused_cpu(q, layer, lo, fmt, scales[layer], out, kind)


@njit(cache=True, parallel=True)
def quant_get_fused_cpu_par(q, layer, lo, fmt, scales, out, kind):
    """:func:`quant_get_fused_cpu` with its cells spread over numba's threads."""
    _get_rows_fused_cpu(q, layer, lo, fmt, scales[layer], out, kind)


@cuda_kernel("quant_get", _GET_SIGS)
def quant_get_kernel(q, layer, lo, fmt, scales, out, kind):
    """Grid x: (head, block); y: cells (grid-striding)."""
    per = 1 if fmt == 3 else 32
    nbytes = 1 if fmt == 3 else (34 if fmt == 1 else 18)
    nblk = out.shape[2] // per
    r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if r >= out.shape[1] * nblk:
        return
    h = r // nblk
    blk = r - h * nblk
    scale = scales[layer]
    c = cuda.blockIdx.y
    while c < out.shape[0]:
        _dequantize_cuda(q[layer, lo + c, h], blk * nbytes, per, fmt, scale, out[c, h],
                         blk * per, kind)
        c += cuda.gridDim.y


@njit(inline="always")
def _get_cell_cpu(q, layer, lo, fmt, scale, out, kind, c):
    per = out.shape[2] if fmt == 3 else 32  # float8: a whole row per call
    nbytes = out.shape[2] if fmt == 3 else (34 if fmt == 1 else 18)
    nblk = out.shape[2] // per
    for h in range(out.shape[1]):
        q_row = q[layer, lo + c, h]
        out_row = out[c, h]
        for blk in range(nblk):
            _dequantize_cpu(q_row, blk * nbytes, per, fmt, scale, out_row, blk * per, kind)


@njit(inline="always")
def _get_rows_cpu(q, layer, lo, fmt, scale, out, kind):
    for c in prange(out.shape[0]):   # threads in quant_get_cpu_par only
        _get_cell_cpu(q, layer, lo, fmt, scale, out, kind, c)


@njit(inline="always")
def _get_by_format(q, layer, lo, fmt, scales, out, kind):
    scale = scales[layer]
    if fmt == 1:
        _get_rows_cpu(q, layer, lo, 1, scale, out, kind)
    elif fmt == 2:
        _get_rows_cpu(q, layer, lo, 2, scale, out, kind)
    else:
        _get_rows_cpu(q, layer, lo, 3, scale, out, kind)


@njit(cache=True)
def quant_get_cpu(q, layer, lo, fmt, scales, out, kind):
    """CPU twin of :func:`quant_get_kernel` (one inlined body per format, see put)."""
    _get_by_format(q, layer, lo, fmt, scales, out, kind)


@njit(cache=True, parallel=True)
def quant_get_cpu_par(q, layer, lo, fmt, scales, out, kind):
    """:func:`quant_get_cpu` with its cells spread over numba's threads (large ranges)."""
    _get_by_format(q, layer, lo, fmt, scales, out, kind)


# --------------------------------------------------------------------------------------------
# rotary shift on quantized keys

#: threads that rotate one quantized key row together (the row is held in shared memory)
ROPE_ROW_THREADS = 32


@cuda_kernel("quant_rope_shift", _ROPE_SIGS)
def quant_rope_kernel(q, cells, tab, layers, cos_t, sin_t, neox, dim, scales, fmt, rot,
                      rscale_bits):
    """One block per (cell, head) key row (grid x, grid-striding over cells x heads), grid y over
    layers (grid-striding). The block dequantizes the row into shared memory (a thread per
    ggml block, or per value for float8), rotates its pairs (a thread per pair, rope.py's math)
    and requantizes it (a thread per block). Shared memory rather than a per-thread local
    array: NeoX pairs span ggml blocks, so the whole row must be held at once, and a local
    array of MAX_ROTATE_DIM floats went to a 4 KiB stack frame (ptxas). A Walsh-Hadamard-rotated
    row (``rot`` > 0) is turned back before the pairs and forward after them (a thread per
    butterfly, a barrier between stages), as :func:`rotate_row_cpu` (``rscale_bits``: the
    float32 bits of its scale)."""
    work = cuda.shared.array(MAX_ROTATE_DIM, np.float32)
    rscale = np.uint32(rscale_bits).view(np.float32)
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    n_heads = q.shape[2]
    per = 1 if fmt == 3 else 32
    nbytes = 1 if fmt == 3 else (34 if fmt == 1 else 18)
    nblk = dim // per
    half = cos_t.shape[1]
    rows = cells.shape[0] * n_heads
    r = cuda.blockIdx.x
    while r < rows:        # block-uniform loops: every thread reaches each syncthreads
        c = r // n_heads
        h = r - c * n_heads
        u = tab[c]
        z = cuda.blockIdx.y
        while z < layers.shape[0]:
            layer = layers[z]
            row = q[layer, cells[c], h]
            scale = scales[layer]
            b = t
            while b < nblk:
                _dequantize_cuda(row, b * nbytes, per, fmt, scale, work, b * per, 0)
                b += nt
            cuda.syncthreads()
            if rot > 0:
                wht_shared(work, dim, rot, rscale, t, nt)
            p = t
            while p < half:
                i0, i1 = _pair_cuda(p, half, neox)
                a2, b2 = _rotate_pair_cuda(work[i0], work[i1], cos_t[u, p], sin_t[u, p])
                work[i0] = a2
                work[i1] = b2
                p += nt
            cuda.syncthreads()
            if rot > 0:
                wht_shared(work, dim, rot, rscale, t, nt)
            b = t
            while b < nblk:
                _quantize_cuda(work, b * per, per, 0, row, b * nbytes, fmt, scale)
                b += nt
            cuda.syncthreads()   # the next row reuses work
            z += cuda.gridDim.y
        r += cuda.gridDim.x


@njit(inline="always")
def _rope_rows_cpu(q, cells, tab, layers, cos_t, sin_t, neox, dim, scales, fmt, rot, rscale):
    for c in prange(cells.shape[0]):   # threads in quant_rope_cpu_par; distinct cells (merged)
        work = np.empty(dim, np.float32)
        for z in range(layers.shape[0]):
            layer = layers[z]
            for h in range(q.shape[2]):
                rotate_row_cpu(q[layer, cells[c], h], work, dim, fmt, scales[layer], cos_t,
                               sin_t, tab[c], neox, rot, rscale)


@njit(inline="always")
def _rope_by_format(q, cells, tab, layers, cos_t, sin_t, neox, dim, scales, fmt, rot, rscale):
    if fmt == 1:
        _rope_rows_cpu(q, cells, tab, layers, cos_t, sin_t, neox, dim, scales, 1, rot, rscale)
    elif fmt == 2:
        _rope_rows_cpu(q, cells, tab, layers, cos_t, sin_t, neox, dim, scales, 2, rot, rscale)
    else:
        _rope_rows_cpu(q, cells, tab, layers, cos_t, sin_t, neox, dim, scales, 3, rot, rscale)


@njit(cache=True)
def _rope_row_work(q, layer, cell, h, col, dim, fmt, scale, cos_t, sin_t, u, neox, rot,
                   rscale):
    """:func:`rotate_row_cpu` on the row at byte ``col`` of ``q[layer, cell, h]``: the fused
    form's fallback for a row holding a value that is not finite (a call: rare)."""
    nbytes = dim // 32 * (34 if fmt == 1 else 18)
    work = np.empty(dim, np.float32)
    rotate_row_cpu(q[layer, cell, h, col:col + nbytes], work, dim, fmt, scale, cos_t, sin_t, u,
                   neox, rot, rscale)


@njit(inline="always")
def _rope_rows_fused(q, col, cells, tab, layers, cos_t, sin_t, neox, dim, scales, fmt, rot,
                     rscale):
    """Layers outside, listed cells inside (consecutive cells of a layer lie together), each
    row by :func:`_fused_rope_row`, addressed by byte offsets from ``q``'s strides (``col``:
    the byte where the rotated dims' blocks start: an MLA latent's rope blocks)."""
    t_row = cos_t.strides[0] // 4
    for z in range(layers.shape[0]):
        layer = layers[z]
        scale = scales[layer]
        for c in prange(cells.shape[0]):   # threads in the _par twin only; distinct cells
            cell = cells[c]
            base = layer * q.strides[0] + cell * q.strides[1] + col
            toff = tab[c] * t_row
            for h in range(q.shape[2]):
                qo = base + h * q.strides[2]
                # one call per compiled shape; the branches go one way for the whole launch
                if dim == 64:
                    if rot:
                        if neox:
                            bad = _fused_rope_row(q, qo, cos_t, sin_t, toff, rscale, fmt, 64, 64, 1,
                                                  scale)
                        else:
                            bad = _fused_rope_row(q, qo, cos_t, sin_t, toff, rscale, fmt, 64, 64, 0,
                                                  scale)
                    elif neox:
                        bad = _fused_rope_row(q, qo, cos_t, sin_t, toff, rscale, fmt, 64, 0, 1,
                                              scale)
                    else:
                        bad = _fused_rope_row(q, qo, cos_t, sin_t, toff, rscale, fmt, 64, 0, 0,
                                              scale)
                elif rot:
                    if neox:
                        bad = _fused_rope_row(q, qo, cos_t, sin_t, toff, rscale, fmt, 128, 128, 1,
                                              scale)
                    else:
                        bad = _fused_rope_row(q, qo, cos_t, sin_t, toff, rscale, fmt, 128, 128, 0,
                                              scale)
                elif neox:
                    bad = _fused_rope_row(q, qo, cos_t, sin_t, toff, rscale, fmt, 128, 0, 1,
                                          scale)
                else:
                    bad = _fused_rope_row(q, qo, cos_t, sin_t, toff, rscale, fmt, 128, 0, 0,
                                          scale)
                if bad != 0:
                    _rope_row_work(q, layer, cell, h, col, dim, fmt, scale, cos_t,
                                   sin_t, tab[c], neox, rot, rscale)


@njit(cache=True)
def quant_rope_fused_cpu(q, col, cells, tab, layers, cos_t, sin_t, neox, dim, scales, fmt,
                         rot, rscale):
    """The CPU's rotary shift of q8_0/q4_0 key rows of 64 or 128 values (a whole head, or an
    MLA latent's rope blocks at byte ``col`` of each row of ``q [layers, cells, heads,
    row_bytes]``), rotation block ``rot`` 0 or ``dim``, each row in registers
    (:func:`_fused_rope_row`); the same bytes as :func:`quant_rope_cpu`."""
    _rope_rows_fused(q, col, cells, tab, layers, cos_t, sin_t, neox, dim, scales, fmt, rot,
                     rscale)


@njit(cache=True, parallel=True)
def quant_rope_fused_cpu_par(q, col, cells, tab, layers, cos_t, sin_t, neox, dim, scales, fmt,
                             rot, rscale):
    """:func:`quant_rope_fused_cpu` with each layer's cells spread over numba's threads."""
    _rope_rows_fused(q, col, cells, tab, layers, cos_t, sin_t, neox, dim, scales, fmt, rot,
                     rscale)


@njit(cache=True)
def quant_rope_cpu(q, cells, tab, layers, cos_t, sin_t, neox, dim, scales, fmt, rot=0,
                   rscale=np.float32(1.0)):
    """CPU twin of :func:`quant_rope_kernel` (one inlined body per format, see put)."""
    _rope_by_format(q, cells, tab, layers, cos_t, sin_t, neox, dim, scales, fmt, rot, rscale)


@njit(cache=True, parallel=True)
def quant_rope_cpu_par(q, cells, tab, layers, cos_t, sin_t, neox, dim, scales, fmt, rot=0,
                       rscale=np.float32(1.0)):
    """:func:`quant_rope_cpu` with its cells spread over numba's threads (many cells)."""
    _rope_by_format(q, cells, tab, layers, cos_t, sin_t, neox, dim, scales, fmt, rot, rscale)


# --------------------------------------------------------------------------------------------
# raw moves: a plan of (src, dst, length) moves over one array's raw words, in order

@cuda_kernel("quant_move", _MOVE_SIGS)
def raw_move_kernel(arr, moves):
    """``arr [layers, cells, heads', words]`` (any strides); grid x: lanes (head', word);
    z: layers (grid-striding). Each lane runs the whole plan in order (each move a memmove), so
    the plan's sequential meaning holds without synchronisation."""
    nh = arr.shape[2]
    nw = arr.shape[3]
    r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if r >= nh * nw:
        return
    h = r // nw
    w = r - h * nw
    layer = cuda.blockIdx.z
    while layer < arr.shape[0]:
        for m in range(moves.shape[0]):
            for step in range(moves[m, 2]):
                s, d = _move_step_cuda(moves[m, 0], moves[m, 1], moves[m, 2], step)
                arr[layer, d, h, w] = arr[layer, s, h, w]
        layer += cuda.gridDim.z


@njit(cache=True)
def raw_move_cpu(arr, moves):
    """CPU twin of :func:`raw_move_kernel` (whole rows per step)."""
    for layer in range(arr.shape[0]):
        for m in range(moves.shape[0]):
            for step in range(moves[m, 2]):
                s, d = _move_step_cpu(moves[m, 0], moves[m, 1], moves[m, 2], step)
                for h in range(arr.shape[2]):
                    for w in range(arr.shape[3]):
                        arr[layer, d, h, w] = arr[layer, s, h, w]


# --------------------------------------------------------------------------------------------
# launchers (inputs validated by the caller: KVStorage)

def _kind(device: str, dtype: str):
    """The element kind load_f32/store_f32 take. rope's CPU float16 fast path (KIND_F16_HW, whole
    rows converted by F16C) has no element form: the block kernels convert one value at a time
    through the bit-exact software conversion, which gives the same values."""
    view_dtype, kind = storage_kind(device, dtype)
    return view_dtype, (KIND_F16_BITS if kind == KIND_F16_HW else kind)


def put_launch(device: str, q, layer: int, x, slots, start: int, fmt: int, scales,
               dtype: str, rot: int = 0, slots_on_device: bool = False) -> None:
    """Quantize ``x [batch, n_kv_heads, dim]`` (the cache's ``dtype``) into layer ``layer`` of
    ``q [n_layers, n_cells, n_kv_heads, row_bytes]`` (uint8) at ``slots`` (int32 host; negative
    skips) or, when ``start >= 0``, at ``start + t``; ``scales`` float32 ``[n_layers]``.
    ``rot`` > 0 (q8_0/q4_0 only): rotate each row in Walsh-Hadamard blocks of ``rot`` values
    first (llama.cpp's rotated cache). ``slots_on_device``: ``slots`` is already where the
    kernel reads it (a :class:`._common.Desc` on ``cuda``, the array itself on ``sim``: a
    captured step's descriptor, read when the kernel runs), not uploaded."""
    batch = x.shape[0]
    if batch == 0:
        return
    if slots is None:
        slots = np.zeros(1, np.int32)
    if fmt != FMT_F8 and (rot > 0 or device == "cpu"):
        _put_rows_launch(device, q, layer, x, slots, start, fmt, dtype, rot, slots_on_device)
        return
    if device == "cpu" and _F16C and x.strides[2] == x.itemsize and q.strides[3] == 1:
        view_dtype, kind = storage_kind(device, dtype)   # float16 read through F16C
        launch = _cpu_twin(quant_put_f8_cpu, quant_put_f8_cpu_par, x.size, batch)
        launch(q, x.view(view_dtype), slots, int(start), int(layer), scales, kind)
        return
    view_dtype, kind = _kind(device, dtype)
    if device == "cpu":
        x = x.view(view_dtype)
        if kind == KIND_F16_BITS:
            # widened by numpy (vectorised, F16C where present; exact, as the software form):
            # the quantizer then runs its float32 form, ~3x faster than converting per value
            x, kind = x.view(np.float16).astype(np.float32), KIND_FLOAT
        launch = _cpu_twin(quant_put_cpu, quant_put_cpu_par, x.size, batch)
        launch(q, x, slots, int(start), int(layer), fmt, scales, kind)
        return
    if slots_on_device:
        slots_d, keep = slots, None
    else:
        (slots_d,), keep = to_device(device, np.asarray(slots, np.int32))
    nb = block_size(device)
    nblk = x.shape[2] // BLOCK_VALUES[fmt]
    grid = (cdiv(x.shape[1] * nblk, nb), min(batch, MAX_GRID_YZ))
    _launch(device, quant_put_kernel, grid, nb,
            (device_arg(device, q), device_arg(device, x, view_dtype), slots_d, int(start),
             int(layer), fmt, device_arg(device, scales), kind))
    del keep


def _put_rows_launch(device: str, q, layer: int, x, slots, start: int, fmt: int, dtype: str,
                     rot: int, slots_on_device: bool = False) -> None:
    """A q8_0/q4_0 put a row at a time (rotated when ``rot`` > 0): the CPU's form for every
    ggml block put, the GPU's for rotated ones."""
    view_dtype, kind = storage_kind(device, dtype)   # the CPU reads float16 through F16C
    rscale = rotation_scale(rot) if rot > 0 else np.float32(1.0)
    if device == "cpu":
        x = x.view(view_dtype)
        chunk = _fused_chunk(x.shape[2], int(rot), kind, x.strides[2], x.itemsize)
        if chunk is not None:   # the row from the input to its bytes in registers
            single, threaded = quant_put_fused_cpu, quant_put_fused_cpu_par
            args = (q, x, slots, int(start), int(layer), rscale, chunk[0], fmt, kind, chunk[1])
        else:                   # through a float32 work row
            single, threaded = quant_put_rot_cpu, quant_put_rot_cpu_par
            args = (q, x, slots, int(start), int(layer), fmt, kind, int(rot), rscale)
        launch = _cpu_twin(single, threaded, x.size, x.shape[0])
        if launch is single:
            launch(*args)
            return
        # tokens handed out in chunks as threads come free (not one static half each): on a
        # shared machine a thread the OS parks would otherwise hold the whole put back
        with numba.parallel_chunksize(PARALLEL_CHUNK_TOKENS):
            launch(*args)
        return
    if x.shape[2] > MAX_ROTATE_DIM:
        raise ValueError(f"the rotated put takes head dims <= {MAX_ROTATE_DIM}, got {x.shape[2]}")
    if slots_on_device:
        slots_d, keep = slots, None
    else:
        (slots_d,), keep = to_device(device, np.asarray(slots, np.int32))
    nb = min(block_size(device), PUT_ROW_THREADS)
    grid = (min(x.shape[0] * x.shape[1], _MAX_GRID_X),)
    _launch(device, quant_put_rot_kernel, grid, nb,
            (device_arg(device, q), device_arg(device, x, view_dtype), slots_d, int(start),
             int(layer), fmt, kind, int(rot), int(rscale.view(np.uint32))))
    del keep


def get_launch(device: str, q, layer: int, lo: int, out, fmt: int, scales, dtype: str) -> None:
    """Dequantize cells ``lo .. lo + len(out) - 1`` of layer ``layer`` into ``out [n,
    n_kv_heads, dim]`` (the cache's ``dtype``)."""
    n = out.shape[0]
    if n == 0:
        return
    view_dtype, kind = _kind(device, dtype)
    if device == "cpu":
        out_v = out.view(view_dtype)
        if _F16C and out_v.strides[2] == out_v.itemsize and q.strides[3] == 1:
            launch = _cpu_twin(quant_get_fused_cpu, quant_get_fused_cpu_par, out.size, n)
        else:
            launch = _cpu_twin(quant_get_cpu, quant_get_cpu_par, out.size, n)
        launch(q, int(layer), int(lo), fmt, scales, out_v, kind)
        return
    nb = block_size(device)
    nblk = out.shape[2] // BLOCK_VALUES[fmt]
    grid = (cdiv(out.shape[1] * nblk, nb), min(n, MAX_GRID_YZ))
    _launch(device, quant_get_kernel, grid, nb,
            (device_arg(device, q), int(layer), int(lo), fmt, device_arg(device, scales),
             device_arg(device, out, view_dtype), kind))


def rope_launch(device: str, q, dim: int, cells, deltas, inv_freq, neox: bool, fmt: int,
                scales, layers=None, rot: int = 0, col: int = 0) -> None:
    """Rotate quantized keys ``q [n_layers, n_cells, n_kv_heads, row_bytes]`` (``dim`` values a
    row from byte ``col``: the rows' first bytes unless an MLA latent's rope blocks) of
    ``cells`` by ``deltas`` (a cell listed twice turns by the sum; zero deltas are skipped), in
    ``layers`` (all when None): dequantize, rotate in float32, requantize; rows stored
    Walsh-Hadamard-rotated in blocks of ``rot`` (> 0) are turned back around the RoPE."""
    rscale = rotation_scale(rot) if rot > 0 else np.float32(1.0)
    plan = shift_plan(cells, deltas, inv_freq, q.shape[0], layers)
    if plan is None:
        return
    cells, layers, tab, cos_t, sin_t = plan
    if (device == "cpu" and _F16C and dim in (64, 128) and rot in (0, dim)
            and cos_t.shape[1] * 2 == dim and q.strides[3] == 1):
        # each row in registers, addressed in the whole storage (no strided views)
        launch = _cpu_twin(quant_rope_fused_cpu, quant_rope_fused_cpu_par,
                           cells.size * layers.size * q.shape[2] * int(dim), cells.size)
        launch(q, int(col), cells, tab, layers, cos_t, sin_t, int(bool(neox)), int(dim),
               scales, fmt, int(rot), rscale)
        return
    per, nbytes = (1, 1) if fmt == FMT_F8 else (32, BLOCK_BYTES[fmt])
    q = q[..., col:col + dim // per * nbytes]   # the row's rotated dims as a (strided) view
    if device == "cpu":
        launch = _cpu_twin(quant_rope_cpu, quant_rope_cpu_par,
                           cells.size * layers.size * q.shape[2] * int(dim), cells.size)
        launch(q, cells, tab, layers, cos_t, sin_t, int(bool(neox)), int(dim), scales, fmt,
               int(rot), rscale)
        return
    dev_in, keep = to_device(device, cells, tab, layers, cos_t, sin_t)
    nb = min(block_size(device), ROPE_ROW_THREADS)
    grid = (min(cells.size * q.shape[2], _MAX_GRID_X), min(layers.size, MAX_GRID_YZ))
    _launch(device, quant_rope_kernel, grid, nb,
            (device_arg(device, q),) + tuple(dev_in) + (int(bool(neox)), int(dim),
                                                       device_arg(device, scales), fmt,
                                                       int(rot), int(rscale.view(np.uint32))))
    del keep


def raw_words(arr, cell_axis: int = 1):
    """``arr`` (a storage array ``[layers, cells, heads, dim]``, or permuted V ``[layers, heads,
    dim, cells]`` with ``cell_axis=3``) as ``[layers, cells, heads', words]`` of unsigned words:
    whole rows in 8/4/2-byte words where they tile, else per element."""
    isz = arr.dtype.itemsize
    u = arr.view(UINT[isz])
    if cell_axis == 3:
        return u.transpose(0, 3, 1, 2)
    lay, n = arr.shape[:2]
    row = int(np.prod(arr.shape[2:])) * isz
    for w in (8, 4, 2, 1):
        if row % w == 0 and (arr.data.ptr if hasattr(arr.data, "ptr") else 0) % w == 0:
            return u.reshape(lay, n, -1).view(UINT[w]).reshape(lay, n, 1, row // w)
    return u


def move_launch(device: str, arr, moves, cell_axis: int = 1) -> None:
    """Apply the plan ``moves`` (int ``[m, 3]``: src, dst, length; in order, each a memmove) to
    every layer of one storage array, on its raw bytes."""
    moves = normalize(moves)
    if moves.shape[0] == 0:
        return
    words = raw_words(arr, cell_axis)
    if device == "cpu":
        raw_move_cpu(words, moves)
        return
    (moves_d,), keep = to_device(device, moves)
    nb = block_size(device)
    grid = (cdiv(words.shape[2] * words.shape[3], nb), 1, min(words.shape[0], MAX_GRID_YZ))
    _launch(device, raw_move_kernel, grid, nb, (device_arg(device, words), moves_d))
    del keep


__all__ = ["BLOCK_BYTES", "BLOCK_VALUES", "FMT_F8", "FMT_Q4_0", "FMT_Q8_0", "FORMATS",
           "block_scale", "q4_0_int", "q8_0_int", "wht_shared",
           "MAX_ROTATE_DIM", "PUT_ROW_THREADS", "dequantize_block", "e4m3_to_f32", "f32_to_e4m3", "get_launch",
           "move_launch", "put_launch", "quant_get_kernel", "quant_put_kernel", "quant_put_rot_kernel",
           "quant_rope_kernel", "quantize_block", "raw_move_kernel", "raw_words", "rope_launch",
           "rotate_row_cpu"]
