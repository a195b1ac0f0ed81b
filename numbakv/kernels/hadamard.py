"""The Walsh-Hadamard rotation llama.cpp applies to Q, K and V before a quantized cache (#21038),
as element math the quantized put and rotary-shift kernels fuse in.

A row of ``dim`` values is rotated in independent blocks of ``n`` values (``n`` a power of two
dividing ``dim``): ``y = H_n x`` with ``H_n`` the orthonormal Sylvester-Hadamard matrix
(``H_n[i, j] = (-1)^popcount(i & j) / sqrt(n)``, symmetric, ``H_n @ H_n = I``: the same matrix
rotates forward and back). The float32 arithmetic follows ggml's CPU fast Walsh-Hadamard op
(``ggml_compute_forward_fwht_f32``, a817a22bc) exactly, so results are bit-identical with it:

1. every value times ``scale = 1.0f / sqrtf((float) n)`` (float32, rounded once);
2. stages ``step = 1, 2, 4, ..., n/2``: for each ``i`` with ``i & step == 0``,
   ``(x[i], x[i + step]) = (x[i] + x[i + step], x[i] - x[i + step])``.

Each stage's pairs are independent and a stage reads only the previous stage's values, so any
order within a stage (SIMD lanes, GPU threads) gives the same bits; the multiply is never fused
with the following add (stored between, on every target).
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import intrinsic

from .._jit import njit
from ._registry import element


def rotation_scale(n: int) -> np.float32:
    """``1.0f / sqrtf((float) n)`` in float32, as ggml forms it."""
    return np.float32(1.0) / np.sqrt(np.float32(n))


@element
def wht_pair_index(p, step):
    """The first dim of pair ``p`` of a stage with stride ``step`` (pairs ``(i, i + step)``,
    ``i & step == 0``, numbered in ascending ``i``)."""
    blk = p // step
    return blk * 2 * step + (p - blk * step)


@element
def wht_sum_diff(u, v):
    """One butterfly of two float32 values: ``(u + v, u - v)``."""
    return u + v, u - v


_sum_diff_cpu = wht_sum_diff.cpu


def _vector_ptr(context, builder, aryty, ary, off, elem, n):
    """A pointer to ``<n x elem>`` at element ``off`` of the array ``ary``, whose last axis
    must be contiguous (the CPU twins' own work rows and storage rows are)."""
    from llvmlite import ir
    arr = context.make_array(aryty)(context, builder, value=ary)
    return builder.bitcast(builder.gep(arr.data, [off]), ir.VectorType(elem, n).as_pointer())


def cpu_fma_lanes(context) -> int:
    """The float32 lanes of one vector register of the CPU target ``context`` compiles for, when
    that target has fused multiply-add (x86 with FMA: 16 with AVX-512F, else 8; AArch64: 4),
    else 0. Read from the target machine's feature string (the host's, or the shipped code's
    ``x86-64-v3`` features), at code-generation time: numba keys its caches by that string."""
    import platform
    try:
        feats = str(context.codegen()._tm_features)
    except Exception:  # noqa: BLE001 - no feature string: the plain form
        return 0
    have = {f[1:] for f in feats.split(",") if f.startswith("+")}
    if platform.machine().lower() in ("aarch64", "arm64"):
        return 4
    if "fma" not in have:
        return 0
    return 16 if "avx512f" in have else 8


def _wht_block_intrinsic(n: int):
    """An intrinsic rotating the ``n`` float32 values ``work[off : off + n]`` in place (one
    Walsh-Hadamard block, already scaled): the row is one LLVM ``<n x float>`` value run through
    :func:`wht_stages`. The same IEEE adds and subtracts in the same stage order as ggml, so
    bit-identical to it. Measured 30x faster than the scalar stage loops (0.1 against 3.1 ns a
    value, AVX-512 host)."""
    from llvmlite import ir

    def wht(typingctx, work, off):
        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            ptr = _vector_ptr(context, builder, sig.args[0], args[0], args[1], f32, n)
            builder.store(wht_stages(builder, builder.load(ptr, align=4), n,
                                     cpu_fma_lanes(context)), ptr, align=4)
            return context.get_dummy_value()
        return types.void(work, off), codegen
    wht.__name__ = f"wht{n}_block"
    return intrinsic(wht)


def wht_stages(builder, x, n: int, fma_lanes: int = 0, first_step: int = 1):
    """The Walsh-Hadamard stages of ``x`` (an LLVM ``<m x float>`` value, already scaled) in
    blocks of ``n`` lanes (``n`` a power of two dividing ``m``), as a new value -- ggml's IEEE
    operations in ggml's stage order (used inside the fused CPU put and shift of
    kernels/quant.py, which keep the row in registers).

    A stage of stride ``step`` pairs lanes ``i`` and ``i + step`` (``i & step == 0``). Where the
    pair lies in different registers (``step >= fma_lanes``), the stage is two shuffles picking
    the ``i`` lanes and their partners (register selections, free), one vector add, one vector
    subtract and a shuffle back (LLVM folds consecutive shuffles). Where the pair lies inside one
    register (``step < fma_lanes``: the target has FMA and registers of ``fma_lanes`` floats),
    the stage is one single-source permute per register (``t = x`` with each pair's lanes
    swapped: ``vshufps``/``vpermpd``/``vshuff64x2`` with an immediate) and one FMA with a
    +-1 vector: ``fma(x, s, t)`` is ``x[i] + x[i + step]`` in lane ``i`` (``s = 1``) and
    ``x[i] - x[i + step]`` in lane ``i + step`` (``s = -1``: ``t - x``), each rounded once --
    the same bits as the add and the subtract (``x * +-1`` is exact, signed zeros included),
    in 2 operations a register instead of LLVM's 2 two-source permutes and an add/subtract a
    pair, and on the FMA pipes rather than the adders. ``fma_lanes = 0``: every stage in the
    first form (no FMA, or a caller that does not know the target). ``first_step``: the
    stages from that stride on (the earlier ones already done)."""
    from llvmlite import ir
    from numba.core import cgutils
    i32 = ir.IntType(32)
    m = x.type.count
    half = ir.VectorType(i32, m // 2)
    fma = None
    step = first_step
    while step < n:
        if step < fma_lanes:
            if fma is None:
                fma = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(x.type, [x.type] * 3), f"llvm.fma.v{m}f32")
            swapped = builder.shuffle_vector(
                x, x, ir.Constant(ir.VectorType(i32, m), [i ^ step for i in range(m)]))
            sign = ir.Constant(x.type, [-1.0 if i & step else 1.0 for i in range(m)])
            x = builder.call(fma, [x, sign, swapped])
            step *= 2
            continue
        lo = [i for i in range(m) if not i & step]
        u = builder.shuffle_vector(x, x, ir.Constant(half, lo))
        v = builder.shuffle_vector(x, x, ir.Constant(half, [i + step for i in lo]))
        s, d = builder.fadd(u, v), builder.fsub(u, v)
        back = [0] * m   # lane i <- s[k] (i = lo[k]), lane i + step <- d[k]
        for k, i in enumerate(lo):
            back[i], back[i + step] = k, k + m // 2
        x = builder.shuffle_vector(s, d, ir.Constant(ir.VectorType(i32, m), back))
        step *= 2
    return x


def wht_staged(builder, load_input, load_scratch, store_reg, barrier, regs: int, n: int,
               lanes: int) -> None:
    """The Walsh-Hadamard stages (blocks of ``n`` values, ``n`` a power of two >= ``lanes``)
    of ``regs`` registers of ``lanes`` float32 each, for a target whose register file cannot
    hold a whole call (AVX2: 16 registers of 8 floats), in passes over a scratch row in L1:
    ``load_input(i)`` gives register ``i``'s input values (already scaled), ``store_reg(i, v)``
    stores them to the scratch row, ``load_scratch(i)`` loads them back, ``barrier()`` makes
    LLVM keep that row in memory (see :func:`.quant._llvm_barrier`); the last pass's values
    are left there.

    Pass 1 takes groups of up to 8 consecutive registers: the in-register stages
    (:func:`wht_stages`' permute + FMA form, a stage at a time over the group's registers),
    then the cross-register stages among the group; a block of two groups (128 values with
    AVX2) takes its last stage as the second group ends, pairing its registers with the first
    group's from the row; pass 2 (larger blocks: 256 values with AVX2) the remaining stages
    over registers ``r, r + 8, ...`` of each block. Every butterfly is ggml's, and
    each stage reads only values of the stage before (a pass finishes its stages over whole
    pairs), so the same bits as :func:`wht_stages`; but no more than 8 registers of data are
    live at once -- the one-value form kept all 64 registers of a 512-value call live and
    spilled ~11 moves a register."""
    from llvmlite import ir
    per_block = n // lanes             # registers a rotation block spans
    group = min(per_block, 8)

    def cross(vals, first_bit, last_bit):
        """stages over register-index bits [first_bit, last_bit) of the list ``vals``"""
        b = 1 << first_bit
        while b < 1 << last_bit:
            unit = b >> first_bit
            for i in range(len(vals)):
                if not i & unit:
                    u, v = vals[i], vals[i + unit]
                    vals[i], vals[i + unit] = builder.fadd(u, v), builder.fsub(u, v)
            b *= 2
        return vals

    bits_group = group.bit_length() - 1
    bits_block = per_block.bit_length() - 1
    # a block of two groups (128 values with AVX2, 256 with AVX-512): its last stage pairs
    # register i of the second group, still in registers, with register i of the first,
    # loaded back from the row -- not a second pass over both (a store and a load a
    # register fewer)
    pair_last = bits_block == bits_group + 1
    for g0 in range(0, regs, group):
        # breadth first: each in-register stage written for the group's registers before the
        # next stage. Written register by register (a chain of ~8 dependent operations each:
        # permute, FMA, ... ~17 cycles of latency), the core's scheduler filled with waiting
        # operations and ran ~2.6 vector operations a cycle; breadth first, the operations
        # it holds are independent (rotated q8_0 key calls ~10% fewer cycles, AVX2)
        vals = [load_input(i) for i in range(g0, g0 + group)]
        step = 1
        while step < lanes:
            vals = [wht_stages(builder, v, 2 * step, lanes, step) for v in vals]
            step *= 2
        vals = cross(vals, 0, bits_group)
        if pair_last and g0 // group % 2:
            # the group's stages complete before the last stage begins: an empty asm taking
            # its registers (interleaved, LLVM spilled ~4 registers a group)
            builder.asm(ir.FunctionType(ir.VoidType(), [v.type for v in vals]), "",
                        ",".join(["x"] * len(vals)), vals, True)
            for i, v in zip(range(g0, g0 + group), vals):
                u = load_scratch(i - group)
                store_reg(i - group, builder.fadd(u, v))
                store_reg(i, builder.fsub(u, v))
            barrier()
            continue
        for i, v in zip(range(g0, g0 + group), vals):
            store_reg(i, v)
        if pair_last:   # the first group's values go to the row, and the second's stages
            barrier()   # follow (without the barriers LLVM stored both and paired them later)
    if bits_block == bits_group or pair_last:
        return
    barrier()
    for b0 in range(0, regs, per_block):
        for r in range(group):
            idx = list(range(b0 + r, b0 + per_block, group))
            vals = cross([load_scratch(i) for i in idx], bits_group, bits_block)
            for i, v in zip(idx, vals):
                store_reg(i, v)


_wht64 = _wht_block_intrinsic(64)
_wht128 = _wht_block_intrinsic(128)
_wht256 = _wht_block_intrinsic(256)


@njit(inline="always")
def wht_row_cpu(work, dim, n):
    """The stages of the rotation of ``work[:dim]`` (contiguous float32, already scaled) in
    blocks of ``n >= 8`` in place, the CPU twins' form: blocks of 64, 128 or 256 (head dims 64
    to 256 and MLA latents of 576) as one vector each (:func:`_wht_block_intrinsic`); other
    ``n`` by stage loops (the first three stages on eight values held in registers, then one
    loop per stage, contiguous inner loops). The CUDA kernels run the same butterflies a thread
    per pair."""
    if n == 128:
        for o in range(0, dim, 128):
            _wht128(work, o)
        return
    if n == 64:
        for o in range(0, dim, 64):
            _wht64(work, o)
        return
    if n == 256:
        for o in range(0, dim, 256):
            _wht256(work, o)
        return
    for i0 in range(0, dim, 8):
        b0, b1 = _sum_diff_cpu(work[i0], work[i0 + 1])
        b2, b3 = _sum_diff_cpu(work[i0 + 2], work[i0 + 3])
        b4, b5 = _sum_diff_cpu(work[i0 + 4], work[i0 + 5])
        b6, b7 = _sum_diff_cpu(work[i0 + 6], work[i0 + 7])
        c0, c2 = _sum_diff_cpu(b0, b2)
        c1, c3 = _sum_diff_cpu(b1, b3)
        c4, c6 = _sum_diff_cpu(b4, b6)
        c5, c7 = _sum_diff_cpu(b5, b7)
        work[i0], work[i0 + 4] = _sum_diff_cpu(c0, c4)
        work[i0 + 1], work[i0 + 5] = _sum_diff_cpu(c1, c5)
        work[i0 + 2], work[i0 + 6] = _sum_diff_cpu(c2, c6)
        work[i0 + 3], work[i0 + 7] = _sum_diff_cpu(c3, c7)
    step = 8
    while step < n:
        for i0 in range(0, dim, 2 * step):
            for j in range(i0, i0 + step):
                work[j], work[j + step] = _sum_diff_cpu(work[j], work[j + step])
        step *= 2


def wht_reference(x: np.ndarray, n: int) -> np.ndarray:
    """numpy reference (float32): ``x [..., dim]`` rotated in blocks of ``n`` along the last
    axis, ggml's order and scale. Used by the tests and host-side code paths."""
    y = np.asarray(x, dtype=np.float32) * rotation_scale(n)
    shape = y.shape
    dim = shape[-1]
    step = 1
    while step < n:
        z = y.reshape(shape[:-1] + (dim // (2 * step), 2, step))
        u, v = z[..., 0, :], z[..., 1, :]
        y = np.stack([u + v, u - v], axis=-2).reshape(shape)
        step *= 2
    return y


__all__ = ["rotation_scale", "wht_sum_diff", "wht_pair_index", "wht_reference", "wht_row_cpu"]
