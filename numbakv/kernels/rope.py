"""rotary shift: re-rotate the stored keys of some cells by per-cell position deltas, in all (or
some) layers, in one launch.

A key roped at position ``p`` and rotated by ``d`` equals the key roped at ``p + d``: pair ``i``
turns by ``d * inv_freq[i]`` (``inv_freq`` from :meth:`numbakv.RopeShift.inv_freq`, float32,
``freq_scale``, ``base`` and ``freq_factors`` folded in). NeoX pairs ``(x[i], x[i + n/2])``,
normal pairs ``(x[2i], x[2i+1])``; dims past the rotary dim ``n`` are untouched. A pure
rotation (no magnitude scaling).

Precision: the angles ``d * inv_freq[i]`` are formed and reduced in float64 on the host, once per
distinct delta (a shift moves many cells by the same few deltas), and handed to the kernel as
float32 cos/sin tables ``[n_deltas, n/2]``; the rotation itself runs in float32 whatever the
storage dtype (float16 and bfloat16 are widened, rotated and rounded to nearest even). Large
deltas therefore lose nothing to float32 angle rounding, and every device computes the same
cos/sin.
"""

from __future__ import annotations

import numpy as np
from numba import prange, types
from numba.extending import intrinsic

from .._jit import njit

from . import _common
from ._common import (bf16_bits_to_f32, block_size, cdiv, f16_bits_to_f32, f32_to_bf16_bits,
                      f32_to_f16_bits)
from ._common import Desc
from .launch import Prepared, capturing, device_arg, launch as _launch, staging_for, to_device
from ._registry import cuda, cuda_kernel, element

#: how the kernel reads the storage: native floats, float16 bit patterns, bfloat16 bit patterns;
#: on the CPU also float16 bit patterns converted by the hardware (F16C), the default there
KIND_FLOAT, KIND_F16_BITS, KIND_BF16_BITS, KIND_F16_HW = 0, 1, 2, 3

# njit forms of the conversions: element functions may call njit functions on both targets
_f16_to_f32 = f16_bits_to_f32.cpu
_f32_to_f16 = f32_to_f16_bits.cpu
_bf16_to_f32 = bf16_bits_to_f32.cpu
_f32_to_bf16 = f32_to_bf16_bits.cpu


@element
def load_f32(x, kind):
    """A stored element as float32."""
    if kind == 1:
        return _f16_to_f32(x)
    if kind == 2:
        return _bf16_to_f32(x)
    return np.float32(x)


@element
def store_f32(arr, layer, cell, h, i, y, kind):
    """Store float32 ``y`` into ``arr[layer, cell, h, i]`` in the storage's representation."""
    if kind == 1:
        arr[layer, cell, h, i] = _f32_to_f16(y)
    elif kind == 2:
        arr[layer, cell, h, i] = _f32_to_bf16(y)
    else:
        arr[layer, cell, h, i] = y


@element
def pair_index(p, half, neox):
    """The two dims rotated together as pair ``p`` of ``half`` pairs."""
    if neox != 0:
        return p, p + half
    return 2 * p, 2 * p + 1


@element
def rotate_pair(a, b, c, s):
    """``(a, b)`` turned by the angle whose cosine and sine are ``c`` and ``s`` (float32)."""
    a = np.float32(a)
    b = np.float32(b)
    return a * c - b * s, a * s + b * c


_load_cuda = load_f32.cuda
_store_cuda = store_f32.cuda
_pair_cuda = pair_index.cuda
_rotate_cuda = rotate_pair.cuda
_load_cpu = load_f32.cpu
_store_cpu = store_f32.cpu
_pair_cpu = pair_index.cpu
_rotate_cpu = rotate_pair.cpu


_arr = _common.sig_array

_SIGS = [(_arr(dt, 4), _arr(types.int32, 1), _arr(types.int32, 1), _arr(types.int32, 1),
          _arr(types.float32, 2), _arr(types.float32, 2), types.int64, types.int64, types.int64)
         for dt in (types.float32, types.float16, types.uint16)]


@cuda_kernel("rope_shift", _SIGS)
def rope_shift_kernel(keys, cells, tab, layers, cos_t, sin_t, neox, kind, col):
    """One flattened index space ``(listed cell, layer, head, pair)``, pair fastest (a warp
    turns adjacent pairs of one key row), grid-striding. ``keys [n_layers, n_cells, n_kv_heads,
    head_dim]``; cell ``cells[c]`` turns by the angles of table row ``tab[c]``; the rotary dims
    start at dim ``col`` of the row (0, or an MLA latent's trailing rope dims)."""
    half = cos_t.shape[1]
    row = keys.shape[2] * half
    per_cell = layers.shape[0] * row
    total = cells.shape[0] * per_cell
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    while i < total:
        c = i // per_cell
        rest = i - c * per_cell
        z = rest // row
        r = rest - z * row
        h = r // half
        p = r - h * half
        i0, i1 = _pair_cuda(p, half, neox)
        i0 += col
        i1 += col
        cell = cells[c]
        u = tab[c]
        layer = layers[z]
        a = _load_cuda(keys[layer, cell, h, i0], kind)
        b = _load_cuda(keys[layer, cell, h, i1], kind)
        a2, b2 = _rotate_cuda(a, b, cos_t[u, p], sin_t[u, p])
        _store_cuda(keys, layer, cell, h, i0, a2, kind)
        _store_cuda(keys, layer, cell, h, i1, b2, kind)
        i += step


# --------------------------------------------------------------------------------------------
# the CPU twins' vector form of one 16-bit key row's rotation (rotary dims 64 and 128: MLA's rope
# part, most heads): the row's ``2 * half`` values one LLVM vector, widened, split into the pairs'
# two sides by shuffles, turned with rotate_pair's float32 math (``a*c - b*s``, ``a*s + b*c``,
# no fusing), joined and rounded back with the same bits as _common's conversions (numpy's NaN
# bits for float16, a quiet NaN for bfloat16). Addressed by byte offset from the 4-D storage:
# no per-row array view (the view and five short loops cost ~27 ns a 64-value row; this ~9 ns).

def _byte_vector_ptr(context, builder, aryty, ary, byte_off, elem, n):
    """A pointer to ``<n x elem>`` ``byte_off`` bytes past the data of the array ``ary``."""
    from llvmlite import ir
    arr = context.make_array(aryty)(context, builder, value=ary)
    p = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
    return builder.bitcast(builder.gep(p, [byte_off]), ir.VectorType(elem, n).as_pointer())


def _rope_row_intrinsic(kind: int):
    """An intrinsic ``(keys, byte_off, cos_t, sin_t, table_byte_off, half, neox)`` turning the
    ``2 * half`` (64 or 128) contiguous 16-bit values (``kind`` KIND_F16_HW or KIND_BF16_BITS) at
    ``byte_off`` of ``keys`` by the cos/sin table row at ``table_byte_off``, NeoX pairs when
    ``neox`` != 0: one straight-line body per (half, neox), picked by two branches."""
    from llvmlite import ir

    def rope_row(typingctx, keys, off, cos_t, sin_t, toff, half, neox):
        def codegen(context, builder, sig, args):
            is_short = builder.icmp_signed("==", args[5], ir.Constant(args[5].type, 32))
            is_neox = builder.icmp_signed("!=", args[6], ir.Constant(args[6].type, 0))
            with builder.if_else(is_short) as (short, long_):
                for half_, branch in ((32, short), (64, long_)):
                    with branch:
                        with builder.if_else(is_neox) as (neox_pairs, interleaved):
                            with neox_pairs:
                                row(context, builder, sig, args, half_, True)
                            with interleaved:
                                row(context, builder, sig, args, half_, False)
            return context.get_dummy_value()

        def row(context, builder, sig, args, half, neox):
            n = 2 * half
            i16, i32, f32 = ir.IntType(16), ir.IntType(32), ir.FloatType()
            vi16, vi32, vf = ir.VectorType(i16, n), ir.VectorType(i32, n), ir.VectorType(f32, n)

            def c32(v):
                return ir.Constant(vi32, [v] * n)
            ptr = _byte_vector_ptr(context, builder, sig.args[0], args[0], args[1], i16, n)
            raw = builder.load(ptr, align=2)
            if kind == KIND_F16_HW:   # fpext, signalling NaNs kept signalling (numpy's bits)
                f = builder.bitcast(builder.fpext(builder.bitcast(
                    raw, ir.VectorType(ir.HalfType(), n)), vf), vi32)
                h = builder.zext(raw, vi32)
                snan = builder.and_(builder.and_(
                    builder.icmp_unsigned("==", builder.and_(h, c32(0x7C00)), c32(0x7C00)),
                    builder.icmp_unsigned("!=", builder.and_(h, c32(0x3FF)), c32(0))),
                    builder.icmp_unsigned("==", builder.and_(h, c32(0x200)), c32(0)))
                x = builder.bitcast(builder.select(snan, builder.and_(f, c32(0xFFBFFFFF)), f), vf)
            else:                     # bfloat16: the high half of a float32
                x = builder.bitcast(builder.shl(builder.zext(raw, vi32), c32(16)), vf)
            first, second = ((list(range(half)), list(range(half, n))) if neox else
                             (list(range(0, n, 2)), list(range(1, n, 2))))
            hv = ir.VectorType(i32, half)
            a = builder.shuffle_vector(x, x, ir.Constant(hv, first))
            b = builder.shuffle_vector(x, x, ir.Constant(hv, second))
            cs = builder.load(_byte_vector_ptr(context, builder, sig.args[2], args[2], args[4],
                                               f32, half), align=4)
            sn = builder.load(_byte_vector_ptr(context, builder, sig.args[3], args[3], args[4],
                                               f32, half), align=4)
            a2 = builder.fsub(builder.fmul(a, cs), builder.fmul(b, sn))
            b2 = builder.fadd(builder.fmul(a, sn), builder.fmul(b, cs))
            back = [0] * n
            for k in range(half):
                back[first[k]], back[second[k]] = k, k + half
            y = builder.shuffle_vector(a2, b2, ir.Constant(vi32, back))
            bits = builder.bitcast(y, vi32)
            nan = builder.icmp_unsigned(">", builder.and_(bits, c32(0x7FFFFFFF)),
                                        c32(0x7F800000))
            if kind == KIND_F16_HW:   # fptrunc; a NaN as numpy makes it (_f32_to_f16_hw)
                hw = builder.zext(builder.bitcast(builder.fptrunc(
                    y, ir.VectorType(ir.HalfType(), n)), vi16), vi32)
                payload = builder.and_(builder.lshr(bits, c32(13)), c32(0x3FF))
                payload = builder.select(builder.icmp_unsigned("!=", payload, c32(0)), payload,
                                         c32(1))
                nan_bits = builder.or_(builder.or_(builder.and_(builder.lshr(bits, c32(16)),
                                                                c32(0x8000)), c32(0x7C00)),
                                       payload)
                out = builder.select(nan, nan_bits, hw)
            else:                     # round to nearest even; a NaN quiet (f32_to_bf16_bits)
                rounded = builder.lshr(builder.add(bits, builder.add(builder.and_(
                    builder.lshr(bits, c32(16)), c32(1)), c32(0x7FFF))), c32(16))
                out = builder.select(nan, builder.or_(builder.lshr(bits, c32(16)), c32(0x40)),
                                     rounded)
            builder.store(builder.trunc(out, vi16), ptr, align=2)
        return types.void(keys, off, cos_t, sin_t, toff, half, neox), codegen
    rope_row.__name__ = f"rope_row_{kind}"
    return intrinsic(rope_row)


_rope_row_f16 = _rope_row_intrinsic(KIND_F16_HW)
_rope_row_bf16 = _rope_row_intrinsic(KIND_BF16_BITS)


@intrinsic
def _prefetch_for_write(typingctx, keys, byte_off):
    """``llvm.prefetch`` (for writing, kept in every cache level) of the two cache lines at
    ``byte_off`` bytes past the data of ``keys``."""
    from llvmlite import ir
    from numba.core import cgutils

    def codegen(context, builder, sig, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch.p0i8")
        arr = context.make_array(sig.args[0])(context, builder, value=args[0])
        p = builder.gep(builder.bitcast(arr.data, i8p), [args[1]])
        for line in (0, 64):
            builder.call(fn, [builder.gep(p, [ir.Constant(ir.IntType(64), line)]),
                              ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(keys, byte_off), codegen


#: listed cells ahead whose rope dims the vector form prefetches: a rope-only shift touches
#: 128 bytes of each 1,152-byte latent row, too sparse for the hardware prefetcher to run
#: ahead, so after anything else has used the cache every row was a memory round trip
#: (measured: 150 ns a row cold)
PREFETCH_CELLS = 16


@njit(inline="always")
def _vector_rows(keys, cos_t):
    """Whether the vector row form serves: 16-bit rows, rotary dim 64 or 128, the row's last
    axis contiguous (decided once per launch: a check per cell inside the loop cost 5x)."""
    half = cos_t.shape[1]
    return (half == 32 or half == 64) and keys.strides[3] == 2


@njit(inline="always")
def _rotate_cell_vector(keys, cells, tab, layers, cos_t, sin_t, neox, kind, c, col, z0, z1):
    """Listed cell ``c`` in layers ``layers[z0:z1]`` by the vector row form (where
    :func:`_vector_rows`)."""
    half = cos_t.shape[1]
    s0, s1, s2 = keys.strides[0], keys.strides[1], keys.strides[2]
    cell_at = cells[c] * s1 + col * 2
    table_at = tab[c] * cos_t.strides[0]
    ahead = c + PREFETCH_CELLS
    for z in range(z0, z1):
        layer_at = layers[z] * s0 + cell_at
        for h in range(keys.shape[2]):
            at = layer_at + h * s2
            if ahead < cells.shape[0]:
                _prefetch_for_write(keys, layers[z] * s0 + cells[ahead] * s1 + col * 2 + h * s2)
            if kind == KIND_F16_HW:
                _rope_row_f16(keys, at, cos_t, sin_t, table_at, half, neox)
            else:
                _rope_row_bf16(keys, at, cos_t, sin_t, table_at, half, neox)


@njit(cache=True, inline="always")
def _rotate_cell_cpu(keys, cells, tab, layers, cos_t, sin_t, neox, kind, c, col, z0, z1):
    """Listed cell ``c`` in layers ``layers[z0:z1]``."""
    half = cos_t.shape[1]
    cell = cells[c]
    u = tab[c]
    for z in range(z0, z1):
        layer = layers[z]
        for h in range(keys.shape[2]):
            for p in range(half):
                i0, i1 = _pair_cpu(p, half, neox)
                i0 += col
                i1 += col
                a = _load_cpu(keys[layer, cell, h, i0], kind)
                b = _load_cpu(keys[layer, cell, h, i1], kind)
                a2, b2 = _rotate_cpu(a, b, cos_t[u, p], sin_t[u, p])
                _store_cpu(keys, layer, cell, h, i0, a2, kind)
                _store_cpu(keys, layer, cell, h, i1, b2, kind)


_f16_hw_to_f32 = _common.f16_bits_to_f32_hw
_f32_to_f16_hw = _common.f32_to_f16_bits_hw


@njit(cache=True, inline="always")
def _rotate_cell_cpu_f16hw(keys, cells, tab, layers, cos_t, sin_t, neox, c, lo, hi, col, z0,
                           z1):
    """:func:`_rotate_cell_cpu` for float16 bit patterns converted by the CPU's half-precision
    instructions (bit-identical with numpy's conversions). Staged per head row through float32
    scratch ``lo``/``hi`` (``[n/2]`` each): each of the five loops is a plain contiguous pass
    that LLVM vectorises (vcvtph2ps, the float32 rotation, vcvtps2ph); measured ~10x faster
    than the per-element form."""
    half = cos_t.shape[1]
    cell = cells[c]
    u = tab[c]
    cs = cos_t[u]
    sn = sin_t[u]
    for z in range(z0, z1):
        layer = layers[z]
        for h in range(keys.shape[2]):
            row = keys[layer, cell, h][col:]   # contiguous: the loops stay vectorised
            if neox != 0:
                for p in range(half):
                    lo[p] = _f16_hw_to_f32(row[p])
                for p in range(half):
                    hi[p] = _f16_hw_to_f32(row[p + half])
            else:
                for p in range(half):
                    lo[p] = _f16_hw_to_f32(row[2 * p])
                    hi[p] = _f16_hw_to_f32(row[2 * p + 1])
            for p in range(half):
                a = lo[p]
                b = hi[p]
                lo[p] = a * cs[p] - b * sn[p]
                hi[p] = a * sn[p] + b * cs[p]
            if neox != 0:
                for p in range(half):
                    row[p] = _f32_to_f16_hw(lo[p])
                for p in range(half):
                    row[p + half] = _f32_to_f16_hw(hi[p])
            else:
                for p in range(half):
                    row[2 * p] = _f32_to_f16_hw(lo[p])
                    row[2 * p + 1] = _f32_to_f16_hw(hi[p])


# One thread walks layer by layer (cells inner): consecutive cells of a layer are neighbours in
# memory, while one cell's layers lie n_cells rows apart; measured 2-3x faster (minimum) and up
# to 20x (median, busy machine) than cell by cell for 4 layers x 4,096 MLA rows.

@njit(cache=True)
def _rope_cpu_f16hw(keys, cells, tab, layers, cos_t, sin_t, neox, col):
    if _vector_rows(keys, cos_t):
        for z in range(layers.shape[0]):
            for c in range(cells.shape[0]):
                _rotate_cell_vector(keys, cells, tab, layers, cos_t, sin_t, neox, KIND_F16_HW, c,
                                    col, z, z + 1)
        return
    lo = np.empty(cos_t.shape[1], np.float32)
    hi = np.empty(cos_t.shape[1], np.float32)
    for z in range(layers.shape[0]):
        for c in range(cells.shape[0]):
            _rotate_cell_cpu_f16hw(keys, cells, tab, layers, cos_t, sin_t, neox, c, lo, hi, col,
                                   z, z + 1)


@njit(cache=True, parallel=True)
def _rope_cpu_f16hw_par(keys, cells, tab, layers, cos_t, sin_t, neox, col):
    if _vector_rows(keys, cos_t):
        for c in prange(cells.shape[0]):
            _rotate_cell_vector(keys, cells, tab, layers, cos_t, sin_t, neox, KIND_F16_HW, c, col,
                                0, layers.shape[0])
        return
    for c in prange(cells.shape[0]):
        lo = np.empty(cos_t.shape[1], np.float32)
        hi = np.empty(cos_t.shape[1], np.float32)
        _rotate_cell_cpu_f16hw(keys, cells, tab, layers, cos_t, sin_t, neox, c, lo, hi, col, 0,
                               layers.shape[0])


#: float16 rotations on the CPU use the hardware conversions where Numba's target has them
F16_HW = _common.cpu_has_f16c()


# The CPU twins come in one compiled form per storage kind (a constant, so the conversion
# branches fold away and the pair loop vectorises: measured 2-8x faster than passing the kind).

@njit(cache=True)
def _rope_cpu_float(keys, cells, tab, layers, cos_t, sin_t, neox, col):
    for z in range(layers.shape[0]):
        for c in range(cells.shape[0]):
            _rotate_cell_cpu(keys, cells, tab, layers, cos_t, sin_t, neox, KIND_FLOAT, c, col, z,
                             z + 1)


@njit(cache=True)
def _rope_cpu_f16(keys, cells, tab, layers, cos_t, sin_t, neox, col):
    for z in range(layers.shape[0]):
        for c in range(cells.shape[0]):
            _rotate_cell_cpu(keys, cells, tab, layers, cos_t, sin_t, neox, KIND_F16_BITS, c, col, z,
                             z + 1)


@njit(cache=True)
def _rope_cpu_bf16(keys, cells, tab, layers, cos_t, sin_t, neox, col):
    if _vector_rows(keys, cos_t):
        for z in range(layers.shape[0]):
            for c in range(cells.shape[0]):
                _rotate_cell_vector(keys, cells, tab, layers, cos_t, sin_t, neox, KIND_BF16_BITS,
                                    c, col, z, z + 1)
        return
    for z in range(layers.shape[0]):
        for c in range(cells.shape[0]):
            _rotate_cell_cpu(keys, cells, tab, layers, cos_t, sin_t, neox, KIND_BF16_BITS, c,
                             col, z, z + 1)


@njit(cache=True, parallel=True)
def _rope_cpu_float_par(keys, cells, tab, layers, cos_t, sin_t, neox, col):
    for c in prange(cells.shape[0]):
        _rotate_cell_cpu(keys, cells, tab, layers, cos_t, sin_t, neox, KIND_FLOAT, c, col, 0,
                         layers.shape[0])


@njit(cache=True, parallel=True)
def _rope_cpu_f16_par(keys, cells, tab, layers, cos_t, sin_t, neox, col):
    for c in prange(cells.shape[0]):
        _rotate_cell_cpu(keys, cells, tab, layers, cos_t, sin_t, neox, KIND_F16_BITS, c, col, 0,
                         layers.shape[0])


@njit(cache=True, parallel=True)
def _rope_cpu_bf16_par(keys, cells, tab, layers, cos_t, sin_t, neox, col):
    if _vector_rows(keys, cos_t):
        for c in prange(cells.shape[0]):
            _rotate_cell_vector(keys, cells, tab, layers, cos_t, sin_t, neox, KIND_BF16_BITS, c,
                                col, 0, layers.shape[0])
        return
    for c in prange(cells.shape[0]):
        _rotate_cell_cpu(keys, cells, tab, layers, cos_t, sin_t, neox, KIND_BF16_BITS, c, col, 0,
                         layers.shape[0])


_CPU_TWINS = {KIND_FLOAT: (_rope_cpu_float, _rope_cpu_float_par),
              KIND_F16_BITS: (_rope_cpu_f16, _rope_cpu_f16_par),
              KIND_BF16_BITS: (_rope_cpu_bf16, _rope_cpu_bf16_par),
              KIND_F16_HW: (_rope_cpu_f16hw, _rope_cpu_f16hw_par)}


def rope_shift_cpu(keys, cells, tab, layers, cos_t, sin_t, neox, kind, parallel=False, col=0):
    """CPU twin of :func:`rope_shift_kernel` (cells spread over threads with ``parallel``; a cell
    must then be listed once: :func:`launch` merges repeats)."""
    _CPU_TWINS[kind][1 if parallel else 0](keys, cells, tab, layers, cos_t, sin_t, neox, col)


#: below this many rotated pairs the CPU runs on one thread
PARALLEL_MIN_PAIRS = 16 * 1024 * 1024  # parallel lost 10x to one thread on busy cores (measured)


def tables(deltas: np.ndarray, inv_freq: np.ndarray):
    """``(tab int32 [k], cos float32 [u, n/2], sin float32 [u, n/2])`` for the ``u`` distinct
    deltas: angles formed in float64 from the float32 ``inv_freq``."""
    deltas = np.asarray(deltas, dtype=np.int64).reshape(-1)
    if deltas.size and deltas.min() == deltas.max():  # a shift turns every cell alike: no sort
        uniq, tab = deltas[:1], np.zeros(deltas.size, dtype=np.int32)
    else:
        uniq, tab = np.unique(deltas, return_inverse=True)
    ang = uniq.astype(np.float64)[:, None] * np.asarray(inv_freq, dtype=np.float32).astype(
        np.float64)[None, :]
    return (np.ascontiguousarray(tab.reshape(-1), dtype=np.int32),
            np.ascontiguousarray(np.cos(ang), dtype=np.float32),
            np.ascontiguousarray(np.sin(ang), dtype=np.float32))


def storage_kind(device: str, dtype: str):
    """(numpy dtype the kernel sees the storage as, kind) for a storage dtype on a device: the
    GPU and the simulator read float16 natively; Numba's CPU target has no float16, so the CPU
    twin reads its bit patterns."""
    if dtype == "bfloat16":
        return np.dtype(np.uint16), KIND_BF16_BITS
    if dtype == "float16":
        if device == "cpu":
            return np.dtype(np.uint16), KIND_F16_HW if F16_HW else KIND_F16_BITS
        return np.dtype(np.float16), KIND_FLOAT
    return np.dtype(np.float32), KIND_FLOAT


def _merge(cells, deltas):
    """Drop zero deltas; fold a cell listed twice into one rotation by the sum (the GPU rotates
    each listed cell in its own thread)."""
    cells = np.asarray(cells, dtype=np.int32).reshape(-1)
    deltas = np.asarray(deltas, dtype=np.int64).reshape(-1)
    keep = deltas != 0
    if not keep.all():
        cells, deltas = cells[keep], deltas[keep]
    if cells.size == 0:
        return cells, deltas
    if cells.size == 1 or bool(np.all(cells[1:] > cells[:-1])):
        return np.ascontiguousarray(cells), deltas  # ascending: no cell repeats (no sort)
    uniq, inverse = np.unique(cells, return_inverse=True)
    if uniq.size != cells.size:
        summed = np.zeros(uniq.size, dtype=np.int64)
        np.add.at(summed, inverse.reshape(-1), deltas)
        keep = summed != 0
        cells, deltas = uniq[keep].astype(np.int32), summed[keep]
    return np.ascontiguousarray(cells), deltas


def shift_plan(cells, deltas, inv_freq, n_layers: int, layers=None):
    """The host side of every rotary shift (plain and quantized keys): ``(cells int32 [k],
    layers int32 [z], tab int32 [k], cos_t, sin_t float32 [u, n/2])`` with zero deltas dropped
    and repeated cells merged (:func:`_merge`), ``layers`` all ``n_layers`` when None, the
    tables of :func:`tables`; None when nothing turns."""
    cells, deltas = _merge(cells, deltas)
    layers = (np.arange(n_layers, dtype=np.int32) if layers is None
              else np.asarray(layers, dtype=np.int32).reshape(-1))
    inv_freq = np.asarray(inv_freq, dtype=np.float32).reshape(-1)
    if cells.size == 0 or layers.size == 0 or inv_freq.size == 0:
        return None
    return (cells, layers) + tables(deltas, inv_freq)


def prepare(device: str, keys, dtype: str, cells, deltas, inv_freq, neox: bool, layers=None,
            col: int = 0):
    """The host work of :func:`launch` for ``sim``/``cuda``: a :class:`Prepared` launch (or None
    when there is nothing to rotate)."""
    plan = shift_plan(cells, deltas, inv_freq, keys.shape[0], layers)
    if plan is None:
        return None
    cells, layers, tab, cos_t, sin_t = plan
    view_dtype, kind = storage_kind(device, dtype)
    dev_in, keep = to_device(device, cells, tab, layers, cos_t, sin_t)
    nb = block_size(device)
    grid = geometry(cells.size, layers.size, keys.shape[2], cos_t.shape[1], nb,
                    _common.max_blocks(device))
    args = (device_arg(device, keys, view_dtype),) + tuple(dev_in) + (int(bool(neox)), kind,
                                                                       int(col))
    return Prepared(rope_shift_kernel, grid, nb, args, keep)


@njit(cache=True)
def merge_sorted(cells, deltas, out_cells, out_deltas):
    """The fast half of :func:`_merge` in one compiled pass: cells with a non-zero delta,
    copied with their deltas into ``out_*``, when the listed cells ascend strictly (every shift
    numbakv makes lists them so). Returns how many were kept, or -1 when the cells do not
    ascend (then the caller merges repeats the general way)."""
    live = 0
    prev = -1
    for i in range(cells.shape[0]):
        c = cells[i]
        if c <= prev:
            return -1
        prev = c
        if deltas[i] != 0:
            out_cells[live] = c
            out_deltas[live] = deltas[i]
            live += 1
    return live


@njit(cache=True)
def distinct_deltas(deltas, tab, uniq):
    """``tab[i]`` = the index in ``uniq`` of ``deltas[i]``, ``uniq`` the distinct deltas (first
    seen first); returns how many. A shift moves many cells by the same few deltas: a short
    linear search per cell, falling back to a sort past 8 distinct values."""
    n = deltas.shape[0]
    u = 0
    for i in range(n):
        d = deltas[i]
        j = 0
        while j < u and uniq[j] != d:
            j += 1
        if j == u:
            if u == 8:
                return -1
            uniq[u] = d
            u += 1
        tab[i] = j
    return u


@njit(cache=True)
def pack_rotation(buf, cells, tab, layers, cos_t, sin_t, offsets):
    """Write a rotation's inputs into one byte buffer at ``offsets`` (cells, tab, layers: int32;
    cos, sin: float32), the layout one host-to-device copy sends."""
    buf[offsets[0]:offsets[0] + 4 * cells.shape[0]].view(np.int32)[:] = cells
    buf[offsets[1]:offsets[1] + 4 * tab.shape[0]].view(np.int32)[:] = tab
    buf[offsets[2]:offsets[2] + 4 * layers.shape[0]].view(np.int32)[:] = layers
    n = cos_t.size
    cv = buf[offsets[3]:offsets[3] + 4 * n].view(np.float32)
    sv = buf[offsets[4]:offsets[4] + 4 * n].view(np.float32)
    k = 0
    for a in range(cos_t.shape[0]):
        for b in range(cos_t.shape[1]):
            cv[k] = cos_t[a, b]
            sv[k] = sin_t[a, b]
            k += 1


class RopeLauncher:
    """The rotary shift of one storage's keys on ``sim``/``cuda`` with little host work per
    call: the storage view and the all-layers list built once; the cells merged, their deltas
    made distinct and everything packed by compiled passes (no numpy temporaries per call);
    cos/sin formed in float64 by numpy for the distinct deltas only (:func:`tables`' rounding,
    so every device turns alike); on ``cuda`` one pinned staging buffer and one asynchronous
    copy into a device buffer reused per stream."""

    def __init__(self, device: str, keys, dtype: str) -> None:
        self.device = device
        self.view_dtype, self.kind = storage_kind(device, dtype)
        self.keys = device_arg(device, keys, self.view_dtype)
        self.n_layers = int(keys.shape[0])
        self.n_heads = int(keys.shape[2])
        self.all_layers = np.arange(self.n_layers, dtype=np.int32)
        self.block = block_size(device)
        self.cap = _common.max_blocks(device)
        self._cells = np.zeros(64, np.int32)
        self._deltas = np.zeros(64, np.int64)
        self._tab = np.zeros(64, np.int32)
        self._uniq = np.zeros(8, np.int64)
        self._tables = (None, b"", None, None)   # (inv_freq, distinct deltas, cos, sin)
        self._dev: dict = {}
        self._kept: list = []

    def _scratch(self, k: int) -> None:
        if self._cells.shape[0] < k:
            size = max(k, 2 * self._cells.shape[0])
            self._cells = np.zeros(size, np.int32)
            self._deltas = np.zeros(size, np.int64)
            self._tab = np.zeros(size, np.int32)

    def launch(self, cells: np.ndarray, deltas: np.ndarray, inv_freq: np.ndarray, neox: bool,
               layers=None, col: int = 0) -> None:
        """As :func:`launch` (inputs validated by the caller: ``cells`` int32, ``deltas``
        int64, ``inv_freq`` float32)."""
        self._scratch(cells.shape[0])
        live = merge_sorted(cells, deltas, self._cells, self._deltas)
        if live < 0:     # unsorted or repeated cells: the general merge
            mc, md = _merge(cells, deltas)
            live = mc.shape[0]
            self._scratch(live)
            self._cells[:live] = mc
            self._deltas[:live] = md
        if live == 0 or inv_freq.size == 0:
            return
        layers = self.all_layers if layers is None else np.asarray(layers, np.int32)
        if layers.size == 0:
            return
        cells_l, deltas_l, tab = self._cells[:live], self._deltas[:live], self._tab[:live]
        u = distinct_deltas(deltas_l, tab, self._uniq)
        if u < 0:
            uniq, inv = np.unique(deltas_l, return_inverse=True)
            tab[:] = inv.reshape(-1)
        else:
            uniq = self._uniq[:u]
        key = uniq.tobytes()
        memo = self._tables
        if memo[0] is inv_freq and memo[1] == key:   # the same shift again: same tables
            cos_t, sin_t = memo[2], memo[3]
        else:
            ang = uniq.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
            cos_t = np.cos(ang).astype(np.float32)
            sin_t = np.sin(ang).astype(np.float32)
            self._tables = (inv_freq, key, cos_t, sin_t)
        half = inv_freq.size
        n_tab = 4 * cos_t.size
        sizes = (4 * live, 4 * live, 4 * layers.size, n_tab, n_tab)
        o1 = -(-sizes[0] // 16) * 16
        o2 = 2 * o1
        o3 = o2 + -(-sizes[2] // 16) * 16
        o4 = o3 + -(-n_tab // 16) * 16
        total = o4 + -(-n_tab // 16) * 16
        offsets = np.array((0, o1, o2, o3, o4), np.int64)
        grid = geometry(live, layers.size, self.n_heads, half, self.block, self.cap)
        tail = (int(bool(neox)), self.kind, int(col))
        if self.device != "cuda":
            buf = np.zeros(total, np.uint8)
            pack_rotation(buf, cells_l, tab, layers, cos_t, sin_t, offsets)
            parts = [buf[o:o + n].view(dt) for o, n, dt in zip(
                offsets, sizes, (np.int32, np.int32, np.int32, np.float32, np.float32))]
            parts[3] = parts[3].reshape(-1, half)
            parts[4] = parts[4].reshape(-1, half)
            _launch(self.device, rope_shift_kernel, grid, self.block,
                    (self.keys, *parts) + tail)
            return
        self._launch_cuda(total, offsets, sizes, half, cells_l, tab, layers, cos_t, sin_t,
                          grid, tail)

    def _launch_cuda(self, total, offsets, sizes, half, cells, tab, layers, cos_t, sin_t,
                     grid, tail) -> None:
        import cupy
        stream = cupy.cuda.get_current_stream()
        staging = staging_for(stream, cupy.cuda.runtime.getDevice())
        slot = staging.take(total, stream)
        pack_rotation(slot[2], cells, tab, layers, cos_t, sin_t, offsets)
        if capturing(stream):   # a graph reads it at every replay: kept as long as we live
            buf = cupy.empty(total, dtype=np.uint8)
            self._kept.append(buf)
        else:
            dev = self._dev.get(stream.ptr)
            if dev is None or dev.nbytes < total:
                if dev is not None:
                    self._kept.append(dev)     # a queued kernel may still read it
                dev = self._dev[stream.ptr] = cupy.empty(
                    max(total, 4096, 2 * (0 if dev is None else dev.nbytes)), dtype=np.uint8)
            buf = dev
        base = int(buf.data.ptr)
        cupy.cuda.runtime.memcpyAsync(base, slot[4], total, 1, stream.ptr)
        staging.give_back(slot, stream)
        i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
        n_c, n_l, n_u = sizes[0] // 4, sizes[2] // 4, sizes[3] // (4 * half)
        args = (self.keys,
                Desc(base + int(offsets[0]), (n_c,), (4,), i32),
                Desc(base + int(offsets[1]), (n_c,), (4,), i32),
                Desc(base + int(offsets[2]), (n_l,), (4,), i32),
                Desc(base + int(offsets[3]), (n_u, half), (4 * half, 4), f32),
                Desc(base + int(offsets[4]), (n_u, half), (4 * half, 4), f32)) + tail
        _launch("cuda", rope_shift_kernel, grid, self.block, args)


def geometry(n_cells: int, n_layers: int, n_heads: int, half: int, block: int, cap: int):
    """The grid of a rotation: one thread per (cell, layer, head, pair) item, at most ``cap``
    blocks (grid-striding beyond)."""
    return (_common.flat_blocks(n_cells * n_layers * n_heads * half, block, cap),)


def launch(device: str, keys, dtype: str, cells, deltas, inv_freq, neox: bool,
           layers=None, col: int = 0) -> None:
    """Rotate ``keys [n_layers, n_cells, n_kv_heads, head_dim]`` (storage dtype ``dtype``) of
    ``cells`` (int32 host ``[k]``) by ``deltas`` (int host ``[k]``; a cell listed twice turns by
    the sum) with ``inv_freq float32 [rot_dim/2]``, in ``layers`` (int host array, distinct; all
    when None), the rotary dims starting at dim ``col`` of each row (an MLA latent's trailing
    rope dims: ``col = kv_lora_rank``; the rest of the row is not touched). Cells whose delta is
    0 are left alone. Inputs validated by the caller."""
    if device != "cpu":   # KVStorage keeps one RopeLauncher; this builds one
        RopeLauncher(device, keys, dtype).launch(
            np.ascontiguousarray(cells, dtype=np.int32).reshape(-1),
            np.ascontiguousarray(deltas, dtype=np.int64).reshape(-1),
            np.ascontiguousarray(inv_freq, dtype=np.float32).reshape(-1), neox, layers, col)
        return
    plan = shift_plan(cells, deltas, inv_freq, keys.shape[0], layers)
    if plan is None:
        return
    cells, layers, tab, cos_t, sin_t = plan
    view_dtype, kind = storage_kind(device, dtype)
    n_pairs = cells.size * layers.size * keys.shape[2] * cos_t.shape[1]
    rope_shift_cpu(keys.view(view_dtype), cells, tab, layers, cos_t, sin_t, int(bool(neox)), kind,
                   parallel=n_pairs >= PARALLEL_MIN_PAIRS and cells.size > 1, col=int(col))


__all__ = ["RopeLauncher", "distinct_deltas", "merge_sorted", "pack_rotation", "F16_HW", "KIND_BF16_BITS", "KIND_F16_BITS", "KIND_F16_HW", "KIND_FLOAT", "launch", "load_f32", "pair_index",
           "prepare",
           "rope_shift_cpu", "rope_shift_kernel", "rotate_pair", "shift_plan",
           "storage_kind", "store_f32", "tables"]
