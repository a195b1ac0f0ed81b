"""Batched paged attention on the GPU: one launch per layer for every query token of the pass,
reading K/V straight from the cell pool through the pass's device page table (the CSR
``kv_indptr`` / ``kv_indices`` / ``kv_positions`` of ``cache.page_table()``), split-K over long
lists with a log-sum-exp merge (flash-decoding).

Block ``(part, token, kv_head)``: the query heads of one KV head (grouped-query attention: the
group's K/V rows are read once for all of them), list entries ``part * part_len ..`` of the
token's sequence intersected with the run the token sees. Positions ascend along a list, so a
token's visible cells (causal ``p``, sliding window, chunks: :func:`numbakv.pages.visible_lo`)
are one run ``[jlo, jhi)`` found by two binary searches; no mask is read or built.

Per tile of :data:`TILE` cells the block computes the group's scores (one thread per (head,
cell)), then each head's running maximum and sum (online softmax), then the accumulators (one
thread per (head, value dim): consecutive threads read consecutive values of a V row). Pools are
read as raw bits (float16/bfloat16 as ``uint16``, float32 as ``uint32``) and converted with the
shared float conversions of :mod:`._common`, so one body serves every storage dtype. Quantized
sides (``uint8`` rows of ggml q8_0 / q4_0 blocks, or float8_e4m3 with a per-layer scale; see
:mod:`.quant`) are dequantized value by value as they are read, with :mod:`.quant`'s element math
(``block_scale``, ``q8_0_int``, ``q4_0_int``, ``e4m3_to_f32``): K and V may differ in format.

llama.cpp's rotated quantized K/V (``kv_rotation``): the block rotates its queries in shared
memory (Walsh-Hadamard blocks of ``krot``, :func:`.quant.wht_shared`, ggml's order and scale)
before the scores, and turns its accumulators back (blocks of ``vrot``) before they are written;
the rotation is linear, so split-K parts are turned back each on its own and merged as usual.

With one part per token the kernel writes normalised rows and their LSE itself; with several it
writes each part's unnormalised accumulator, maximum and sum, and :data:`paged_merge_kernel`
combines them. The LSE is the natural log of the sum of ``exp(scale * q.k)`` over the visible
cells (``-inf`` for a token that sees none, whose row is zeros), as the CPU kernel defines it.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np
from numba import float32, types

from . import _common
from ._common import block_size, cdiv, sig_array as _arr
from .hadamard import rotation_scale
from .launch import launch as _launch
from . import mla as _mla
from . import quant as _quant
from ._registry import cuda, cuda_device, cuda_kernel, on_cuda_import

#: cells per tile: the group's scores of a tile sit in shared memory between the passes
TILE = 32
#: the largest grouped-query group (query heads per KV head) the kernel takes
MAX_GROUP = 16
#: the largest group x head_dim (and group x value dim): the scaled queries and the accumulators
#: of a block live in shared memory, 2 x 8 KiB
MAX_GROUP_DIM = 2048
#: the scores of a tile for the largest group (a literal: shared array shapes must be constants)
_SCORE_SLOTS = 512
assert _SCORE_SLOTS == TILE * MAX_GROUP
#: blocks per launch the split-K plan aims for (per SM on a GPU): with fewer (token, KV head)
#: pairs than this, long lists are cut into parts so every SM has work
BLOCKS_PER_SM = 4
#: threads per block on a GPU (four warps: a group's scores of a tile, one thread per cell)
BLOCK_CUDA = 128
#: the shortest part a list is cut into (cells): shorter parts cost more in the merge than they
#: gain in parallelism
MIN_PART = 256
#: exp(x) below this is a float32 denormal: flushed to 0, as the CPU kernel does
_EXP_FLUSH = -87.0
#: storage formats of the pools (``kfmt`` / ``vfmt``): float16 bits, bfloat16 bits, float32
#: bits (elements), then the quantized byte rows of :mod:`.quant` (ggml q8_0 blocks, q4_0
#: blocks, float8_e4m3 values times a per-layer scale)
FMT_F16, FMT_BF16, FMT_F32, FMT_Q8_0, FMT_Q4_0, FMT_F8 = 0, 1, 2, 3, 4, 5
#: FlashMLA's ``fp8_ds_mla`` latent row (:mod:`.mla`: 512 float8_e4m3 values in four tiles of
#: 128, each tile's float32 scale, then 64 bfloat16 rope values; 656 bytes for 576 values):
#: read by the latent kernel only (:func:`latent_value`)
FMT_DS_MLA = 6
#: the decode format of each :mod:`.quant` format code
QUANT_FORMATS = {_quant.FMT_Q8_0: FMT_Q8_0, _quant.FMT_Q4_0: FMT_Q4_0, _quant.FMT_F8: FMT_F8}

_f16 = _common.f16_bits_to_f32.cuda
_bf16 = _common.bf16_bits_to_f32.cuda
_block_scale = _quant.block_scale.cuda
_q8_int = _quant.q8_0_int.cuda
_q4_int = _quant.q4_0_int.cuda
_e4m3 = _quant.e4m3_to_f32.cuda
_ds_mla_value = _mla.dequantize_value.cuda
_wht_shared = _quant.wht_shared


@cuda_device
def kv_to_f32(x, fmt):
    """One stored K/V element (raw bits) as float32, by float storage format ``fmt``."""
    if fmt == FMT_F16:
        return _f16(x)
    if fmt == FMT_BF16:
        return _bf16(x)
    return np.uint32(x).view(np.float32)


@cuda_device
def quant_value(pool, c, kh, d, fmt, fscale):
    """Value ``d`` of the quantized byte row ``(c, kh)`` (format ``fmt``) as float32: ``d * q``
    of its ggml block, or a float8 byte times ``fscale``."""
    if fmt == FMT_F8:
        return _e4m3(pool[c, kh, d]) * fscale
    i = d & 31
    if fmt == FMT_Q8_0:
        b0 = (d >> 5) * 34
        return _block_scale(pool[c, kh, b0], pool[c, kh, b0 + 1]) * \
            float32(_q8_int(pool[c, kh, b0 + 2 + i]))
    b0 = (d >> 5) * 18
    return _block_scale(pool[c, kh, b0], pool[c, kh, b0 + 1]) * \
        float32(_q4_int(pool[c, kh, b0 + 2 + (i & 15)], i >> 4))


@cuda_device
def quant_key_dot(qs, q0, kpool, c, kh, dim, kfmt, kscale):
    """``sum_d qs[q0 + d] * k[d]`` over the quantized key row ``(c, kh)``: a ggml block's scale
    is read once per 32 values (each value still ``d * q`` in float32, as the dequantizer
    forms it)."""
    x = float32(0.0)
    if kfmt == FMT_F8:
        for d in range(dim):
            x += qs[q0 + d] * (_e4m3(kpool[c, kh, d]) * kscale)
        return x
    # one loop over the row (a loop of 32 per block is unrolled whole by LLVM: ~20 registers
    # more, measured with ptxas); the block's scale is read at its first value
    nbytes = 34 if kfmt == FMT_Q8_0 else 18
    dd = float32(0.0)
    b0 = 0
    for d in range(dim):
        i = d & 31
        if i == 0:
            b0 = (d >> 5) * nbytes
            dd = _block_scale(kpool[c, kh, b0], kpool[c, kh, b0 + 1])
        if kfmt == FMT_Q8_0:
            qv = _q8_int(kpool[c, kh, b0 + 2 + i])
        else:
            qv = _q4_int(kpool[c, kh, b0 + 2 + (i & 15)], i >> 4)
        x += qs[q0 + d] * (dd * float32(qv))
    return x


@cuda_device
def float_key_dot(qs, q0, kpool, c, kh, dim, kfmt):
    """``sum_d qs[q0 + d] * k[d]`` over the float key row ``(c, kh)`` (raw bits, ``kfmt``)."""
    x = float32(0.0)
    for d in range(dim):
        x += qs[q0 + d] * kv_to_f32(kpool[c, kh, d], kfmt)
    return x


@cuda_device
def ds_mla_value(pool, c, kh, d):
    """Value ``d`` of FlashMLA's ``fp8_ds_mla`` row ``(c, kh)`` as float32:
    :func:`.mla.dequantize_value` (the per-value dequantization the cache's get uses)."""
    return _ds_mla_value(pool[c, kh], d)


# The kernel calls these two; which form runs depends on the pool's word type, fixed per
# compiled signature (uint8: quantized rows; uint16/uint32: float elements). On CUDA an overload
# picks the form at compile time, so a float signature carries no dequantizing code (its
# register use stays that of the float kernel); the simulator runs the Python below.

def kv_value(pool, c, kh, d, fmt, fscale):
    """Value ``d`` of row ``(c, kh)`` of a pool in format ``fmt`` as float32."""
    if fmt >= FMT_Q8_0:
        return quant_value(pool, c, kh, d, fmt, fscale)
    return kv_to_f32(pool[c, kh, d], fmt)


def latent_value(pool, c, d, fmt, fscale):
    """Value ``d`` of latent row ``c`` (the pool's one KV head) as the latent kernel stages it:
    :func:`kv_value`, or an ``fp8_ds_mla`` row's (:func:`ds_mla_value`); on CUDA only the
    uint8 signature carries the byte-row forms."""
    if fmt == FMT_DS_MLA:
        return ds_mla_value(pool, c, 0, d)
    return kv_value(pool, c, 0, d, fmt, fscale)


def key_dot(qs, q0, kpool, c, kh, dim, kfmt, kscale):
    """``sum_d qs[q0 + d] * k[d]`` over key row ``(c, kh)`` of a pool in format ``kfmt``."""
    if kfmt >= FMT_Q8_0:
        return quant_key_dot(qs, q0, kpool, c, kh, dim, kfmt, kscale)
    return float_key_dot(qs, q0, kpool, c, kh, dim, kfmt)


def _register_cuda_forms() -> None:
    """The CUDA target's :func:`kv_value` and :func:`key_dot` (not while the simulator is on)."""
    from numba.cuda.extending import overload as cuda_overload

    @cuda_overload(kv_value, target="cuda", inline="always")
    def _kv_value_cuda(pool, c, kh, d, fmt, fscale):
        if pool.dtype.bitwidth == 8:
            def quant(pool, c, kh, d, fmt, fscale):
                return quant_value(pool, c, kh, d, fmt, fscale)
            return quant

        def elements(pool, c, kh, d, fmt, fscale):
            return kv_to_f32(pool[c, kh, d], fmt)
        return elements

    @cuda_overload(latent_value, target="cuda", inline="always")
    def _latent_value_cuda(pool, c, d, fmt, fscale):
        if pool.dtype.bitwidth == 8:
            def quant(pool, c, d, fmt, fscale):
                if fmt == FMT_DS_MLA:
                    return ds_mla_value(pool, c, 0, d)
                return quant_value(pool, c, 0, d, fmt, fscale)
            return quant

        def elements(pool, c, d, fmt, fscale):
            return kv_to_f32(pool[c, 0, d], fmt)
        return elements

    @cuda_overload(key_dot, target="cuda", inline="always")
    def _key_dot_cuda(qs, q0, kpool, c, kh, dim, kfmt, kscale):
        if kpool.dtype.bitwidth == 8:
            def quant(qs, q0, kpool, c, kh, dim, kfmt, kscale):
                return quant_key_dot(qs, q0, kpool, c, kh, dim, kfmt, kscale)
            return quant

        def elements(qs, q0, kpool, c, kh, dim, kfmt, kscale):
            return float_key_dot(qs, q0, kpool, c, kh, dim, kfmt)
        return elements


@on_cuda_import
def _register_cuda_forms_unless_simulated() -> None:
    if not _common._simulator_on():
        _register_cuda_forms()


def f32_bits(x: float) -> int:
    """The float32 bits of ``x`` as an int (the fast launch path passes 64-bit words only)."""
    return int(np.float32(x).view(np.uint32))


@cuda_device
def lower_bound(pos, a, e, value):
    """First ``j`` in ``[a, e)`` with ``pos[j] >= value`` (``pos`` ascending)."""
    while a < e:
        m = (a + e) >> 1
        if pos[m] < value:
            a = m + 1
        else:
            e = m
    return a


@cuda_device
def visible_run(kv_pos, c0, c1, p, causal, window, chunk):
    """``(jlo, jhi)``: the entries of list ``[c0, c1)`` a token at position ``p`` sees (the
    device form of :func:`numbakv.pages.visible_lo` plus the causal upper bound)."""
    lo = 0
    if window >= 0:
        lo = max(lo, p - window)
    if chunk > 0:
        lo = max(lo, p - p % chunk)
    jlo = lower_bound(kv_pos, c0, c1, lo)
    jhi = c1
    if causal != 0:
        jhi = lower_bound(kv_pos, jlo, c1, p + 1)
    return jlo, jhi


@cuda_device
def part_run(kv_pos, kv_indptr, tok_seq, q_pos, causal, window, chunk, part_len, part_len_dev,
             t, part):
    """``(a, e)``: the list entries token ``t`` sees within split-K part ``part`` (``part_len``,
    or 0: the length a captured step keeps in ``part_len_dev[0]``); empty when ``a >= e``."""
    b = tok_seq[t]
    c0 = np.int64(kv_indptr[b])
    c1 = np.int64(kv_indptr[b + 1])
    jlo, jhi = visible_run(kv_pos, c0, c1, np.int64(q_pos[t]), causal[t], window, chunk)
    plen = part_len if part_len > 0 else np.int64(part_len_dev[0])
    return max(jlo, c0 + part * plen), min(jhi, c0 + (part + 1) * plen)


@cuda_device
def online_softmax_tile(sc, mx, tot, corr, g, n, tid, nt):
    """One tile of the online softmax, one thread per head ``gi < g``: the tile's ``n`` scores
    (``sc[gi * TILE + jj]``) become weights against the new running maximum ``mx[gi]``,
    ``tot[gi]`` the rescaled sum plus theirs, ``corr[gi]`` the factor the head's accumulators
    must be rescaled by (exp of old - new maximum; 0 below float32's range)."""
    for gi in range(tid, g, nt):
        m_old = mx[gi]
        m = m_old
        for jj in range(n):
            m = max(m, sc[gi * TILE + jj])
        y = m_old - m
        cr = float32(math.exp(y)) if y > _EXP_FLUSH else float32(0.0)
        s = tot[gi] * cr
        for jj in range(n):
            y = sc[gi * TILE + jj] - m
            w = float32(math.exp(y)) if y > _EXP_FLUSH else float32(0.0)
            sc[gi * TILE + jj] = w
            s += w
        mx[gi] = m
        tot[gi] = s
        corr[gi] = cr


@cuda_device
def write_part(acc, mx, tot, g, dv, tid, nt, single, t, h0, part, out, lse, part_acc,
               part_ml):
    """A block's result for heads ``h0 .. h0 + g`` of token ``t``: normalised into ``out`` and
    ``lse`` when the pass has one part (``single``), else the part's sums into ``part_acc`` and
    its maximum and total into ``part_ml`` for the merge."""
    if single:
        for i in range(tid, g * dv, nt):
            gi = i // dv
            s = tot[gi]
            out[t, h0 + gi, i - gi * dv] = acc[i] / s if s > 0 else float32(0.0)
        for gi in range(tid, g, nt):
            s = tot[gi]
            lse[t, h0 + gi] = mx[gi] + math.log(s) if s > 0 else float32(-math.inf)
    else:
        for i in range(tid, g * dv, nt):
            gi = i // dv
            part_acc[part, t, h0 + gi, i - gi * dv] = acc[i]
        for gi in range(tid, g, nt):
            part_ml[0, part, t, h0 + gi] = mx[gi]
            part_ml[1, part, t, h0 + gi] = tot[gi]


#: (K word, V word) pairs the kernel is compiled for: float16/bfloat16 (uint16) and float32
#: (uint32) elements alike on both sides, quantized byte rows (uint8) on either or both
WORD_PAIRS = ((types.uint16, types.uint16), (types.uint32, types.uint32),
              (types.uint8, types.uint8), (types.uint8, types.uint16),
              (types.uint16, types.uint8), (types.uint8, types.uint32),
              (types.uint32, types.uint8))


def _sigs():
    i32 = _arr(types.int32, 1)
    i64 = types.int64
    out = []
    for kw, vw in WORD_PAIRS:
        out.append((_arr(types.float32, 3), _arr(kw, 3), _arr(vw, 3), i64, i64, i32, i32,
                    i32, i32, i32, _arr(types.uint8, 1), i64, i64, i64, i64, i64, i64, i64,
                    i64, i64, i64, i64, i32, _arr(types.float32, 3), _arr(types.float32, 2),
                    _arr(types.float32, 4), _arr(types.float32, 4)))
    return out


@cuda_kernel("paged_attention", _sigs())
def paged_attention_kernel(q, kpool, vpool, kfmt, vfmt, kv_indices, kv_pos, kv_indptr, tok_seq,
                           q_pos, causal, window, chunk, scale_bits, cap_bits, kscale_bits,
                           vscale_bits, krot, krscale_bits, vrot, vrscale_bits, part_len,
                           part_len_dev, out, lse, part_acc, part_ml):
    """q float32 ``[T, H, D]`` (rotated and scaled here); kpool ``[n_cells, Hkv, D]`` raw bits
    or ``[n_cells, Hkv, row_bytes]`` quantized rows (``kfmt``), vpool likewise (``vfmt``); page
    table int32; tok_seq ``[T]`` each token's sequence; causal uint8 ``[T]``; ``*_bits``: the
    float32 bits of the scale, the soft cap (<= 0: none), float8's K and V scales and the
    Walsh-Hadamard scales of the K / V rotation blocks ``krot`` / ``vrot`` (0: not rotated);
    ``part_len`` the split-K part length, or 0: read it from ``part_len_dev[0]`` (int32 ``[1]``,
    device memory a captured step refreshes; otherwise any int32 array, never read), where
    parts past a token's run exit at once (a graph's grid is sized for the longest list the
    step can meet, not this pass's); out float32 ``[T, H, Dv]`` and lse ``[T, H]`` (one
    part), else part_acc ``[P, T, H, Dv]``
    and part_ml ``[2, P, T, H]`` (maximum, sum)."""
    qs = cuda.shared.array(MAX_GROUP_DIM, float32)
    acc = cuda.shared.array(MAX_GROUP_DIM, float32)
    sc = cuda.shared.array(_SCORE_SLOTS, float32)
    mx = cuda.shared.array(MAX_GROUP, float32)
    tot = cuda.shared.array(MAX_GROUP, float32)
    corr = cuda.shared.array(MAX_GROUP, float32)
    part = cuda.blockIdx.x
    t = cuda.blockIdx.y
    kh = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    n_heads = q.shape[1]
    dim = q.shape[2]
    dv = out.shape[2]
    g = n_heads // kpool.shape[1]
    h0 = kh * g
    scale = np.uint32(scale_bits).view(np.float32)
    soft_cap = np.uint32(cap_bits).view(np.float32)
    kscale = np.uint32(kscale_bits).view(np.float32)
    vscale = np.uint32(vscale_bits).view(np.float32)
    a, e = part_run(kv_pos, kv_indptr, tok_seq, q_pos, causal, window, chunk, part_len,
                    part_len_dev, t, part)
    if a >= e and part > 0:
        # an empty part of a split (the whole block alike: no barrier is skipped by some
        # threads only): nothing to sum, the merge skips it by its maximum
        for gi in range(tid, g, nt):
            part_ml[0, part, t, h0 + gi] = -math.inf
            part_ml[1, part, t, h0 + gi] = 0.0
        return
    for i in range(tid, g * dim, nt):
        gi = i // dim
        qs[i] = q[t, h0 + gi, i - gi * dim]
    for i in range(tid, g * dv, nt):
        acc[i] = 0.0
    for i in range(tid, g, nt):
        mx[i] = -math.inf
        tot[i] = 0.0
    cuda.syncthreads()
    if krot > 0:     # keys stored as H k: the scores read (H q) . (H k) = q . k
        _wht_shared(qs, g * dim, krot, np.uint32(krscale_bits).view(np.float32), tid, nt)
    for i in range(tid, g * dim, nt):
        qs[i] = qs[i] * scale       # the same thread wrote qs[i] (or a barrier came between)
    cuda.syncthreads()
    for j0 in range(a, e, TILE):
        n = min(TILE, e - j0)
        # scores: one thread per (head of the group, cell of the tile)
        for i in range(tid, g * TILE, nt):
            gi = i // TILE
            jj = i - gi * TILE
            x = float32(-math.inf)
            if jj < n:
                x = key_dot(qs, gi * dim, kpool, kv_indices[j0 + jj], kh, dim, kfmt, kscale)
                if soft_cap > 0:
                    x = soft_cap * math.tanh(x / soft_cap)
            sc[i] = x
        cuda.syncthreads()
        # online softmax per head: new maximum, the rescale of what was summed, the weights
        online_softmax_tile(sc, mx, tot, corr, g, n, tid, nt)
        cuda.syncthreads()
        # accumulators: one thread per (head, value dim), consecutive threads along a V row
        for i in range(tid, g * dv, nt):
            gi = i // dv
            d = i - gi * dv
            v = acc[i] * corr[gi]
            for jj in range(n):
                w = sc[gi * TILE + jj]
                if w != 0:
                    v += w * kv_value(vpool, kv_indices[j0 + jj], kh, d, vfmt, vscale)
            acc[i] = v
        cuda.syncthreads()
    if vrot > 0:     # values stored as H v: the weighted sum is H out, and H H = I
        _wht_shared(acc, g * dv, vrot, np.uint32(vrscale_bits).view(np.float32), tid, nt)
    write_part(acc, mx, tot, g, dv, tid, nt, cuda.gridDim.x == 1, t, h0, part, out, lse,
               part_acc, part_ml)


_MERGE_SIGS = [(_arr(types.float32, 4), _arr(types.float32, 4), _arr(types.float32, 3),
                _arr(types.float32, 2))]


@cuda_kernel("paged_attention_merge", _MERGE_SIGS)
def paged_merge_kernel(part_acc, part_ml, out, lse):
    """Block ``(token, head)``: the parts' accumulators combined by their maxima and sums into
    the normalised row of ``out`` and its LSE (split-K's second pass)."""
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    n_parts = part_acc.shape[0]
    m = float32(-math.inf)
    for p in range(n_parts):
        m = max(m, part_ml[0, p, t, h])
    s = float32(0.0)
    if m > -math.inf:
        for p in range(n_parts):
            y = part_ml[0, p, t, h] - m
            if y > _EXP_FLUSH:
                s += float32(math.exp(y)) * part_ml[1, p, t, h]
    for d in range(cuda.threadIdx.x, out.shape[2], cuda.blockDim.x):
        v = float32(0.0)
        if s > 0:
            for p in range(n_parts):
                y = part_ml[0, p, t, h] - m
                if y > _EXP_FLUSH:
                    v += float32(math.exp(y)) * part_acc[p, t, h, d]
            v = v / s
        out[t, h, d] = v
    if cuda.threadIdx.x == 0:
        lse[t, h] = m + math.log(s) if s > 0 else float32(-math.inf)


_I32 = _arr(types.int32, 1)


@cuda_kernel("extend_page_lists", [(_I32,) * 10])
def extend_lists_kernel(prev_idx, prev_pos, prev_indptr, drop, new_indptr, qo_indptr,
                        add_cells, add_pos, out_idx, out_pos):
    """A page table's lists grown at their ends (a decode step), each first losing its
    ``drop[b]`` front entries (a sliding window or chunk moved on): entry ``j`` of the new CSR
    lists (one thread each, grid-striding) is entry ``k`` of its list ``b``: ``prev``'s entry
    ``drop[b] + k`` while that is in the old list, else new cell ``k - kept`` of ``b``
    (``add_cells`` / ``add_pos`` grouped by ``qo_indptr``, in position order). Every new list
    is non-empty, so ``new_indptr`` ascends strictly and ``b`` is found by binary search.
    The entry count is read on the device (``new_indptr[-1]``), so ``out_*`` may be longer than
    the lists and ``new_indptr`` may end in empty lists: a captured decode step
    (:class:`numbakv.step.DecodeStep`) launches it with a fixed grid over fixed buffers."""
    nb = new_indptr.shape[0] - 1
    nnz = new_indptr[nb]
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < nnz:
        lo = 0
        hi = nb
        while hi - lo > 1:                  # the last b with new_indptr[b] <= j
            m = (lo + hi) >> 1
            if new_indptr[m] <= j:
                lo = m
            else:
                hi = m
        k = j - new_indptr[lo]
        p0 = prev_indptr[lo] + drop[lo]
        n_prev = prev_indptr[lo + 1] - p0
        if k < n_prev:
            out_idx[j] = prev_idx[p0 + k]
            out_pos[j] = prev_pos[p0 + k]
        else:
            a = qo_indptr[lo] + k - n_prev
            out_idx[j] = add_cells[a]
            out_pos[j] = add_pos[a]
        j += stride


def extend_lists(device: str, prev_idx, prev_pos, prev_indptr, drop, new_indptr, qo_indptr,
                 add_cells, add_pos, out_idx, out_pos) -> None:
    """Launch :data:`extend_lists_kernel` (``device`` ``"cuda"``: CuPy arrays; ``"sim"``: numpy
    arrays through the simulator). All int32, 1-d; ``out_*`` ``[new_indptr[-1]]``."""
    nnz = int(out_idx.shape[0])
    if nnz == 0:
        return
    nb = block_size(device)
    grid = _common.flat_blocks(nnz, nb, _common.max_blocks(device))
    if device == "cuda":
        def arg(a):
            return a if isinstance(a, _common.Desc) else _common.desc_of(a)
    else:
        def arg(a):
            return a
    _launch(device, extend_lists_kernel, (grid,), nb,
            tuple(arg(a) for a in (prev_idx, prev_pos, prev_indptr, drop, new_indptr,
                                   qo_indptr, add_cells, add_pos, out_idx, out_pos)))


def fits(n_heads: int, n_kv_heads: int, head_dim: int, v_dim: int, batch: int) -> bool:
    """Whether the kernel takes this shape (group and group x dims within the shared-memory
    tiles, tokens within the grid's y extent)."""
    g = n_heads // max(1, n_kv_heads)
    return (n_heads % max(1, n_kv_heads) == 0 and 1 <= g <= MAX_GROUP
            and g * max(head_dim, v_dim) <= MAX_GROUP_DIM and 0 < batch <= _common.MAX_GRID_YZ
            and n_kv_heads <= _common.MAX_GRID_YZ)


def plan_part_len(list_lens: np.ndarray, blocks_per_part: int, device: str,
                  part_len: Optional[int] = None) -> Tuple[int, int]:
    """``(part_len, n_parts)`` of the split-K: lists cut so that the launch has about
    :data:`BLOCKS_PER_SM` blocks per SM (``blocks_per_part`` = tokens x KV heads), parts of at
    least :data:`MIN_PART` cells (a multiple of :data:`TILE`); ``part_len`` forces it."""
    longest = int(list_lens.max()) if list_lens.size else 0
    if longest <= 0:
        return 1, 1
    if part_len is None:
        want = BLOCKS_PER_SM * (_common.sm_count(_device_id()) if device == "cuda" else 4)
        n = max(1, want // max(1, blocks_per_part))
        part_len = max(MIN_PART, cdiv(cdiv(longest, n), TILE) * TILE)
    part_len = max(1, int(part_len))
    return part_len, cdiv(longest, part_len)


def max_parts(device: str, blocks_per_part: int) -> int:
    """The split-K parts a captured step's grid is sized for (:class:`numbakv.step.DecodeStep`):
    as many as :func:`plan_part_len` would cut the longest list into, whatever its length, so
    every replay fills the GPU; a replay's part length (read on the device) then covers its
    longest list with at most this many parts, and the rest exit at once."""
    want = BLOCKS_PER_SM * (_common.sm_count(_device_id()) if device == "cuda" else 4)
    return max(1, want // max(1, blocks_per_part))


def _device_id() -> int:
    import cupy
    return cupy.cuda.runtime.getDevice()


def raw_pool(pool, device: str, fmt: Optional[int] = None):
    """A pool as the kernel reads it: raw bits and the storage format. ``fmt`` given (a
    quantized format): the pool is its uint8 byte rows."""
    dt = np.dtype(pool.dtype)
    if fmt is not None and fmt >= FMT_Q8_0:
        if dt != np.uint8:
            raise ValueError(f"a quantized pool holds uint8 byte rows, got {dt}")
        word = np.uint8
    elif dt == np.float32:
        word, fmt = np.uint32, FMT_F32
    elif dt == np.float16:
        word, fmt = np.uint16, FMT_F16
    elif dt == np.uint16:     # bfloat16 bit patterns
        word, fmt = np.uint16, FMT_BF16
    else:
        raise ValueError(f"paged attention reads float16, bfloat16 (uint16 bits) or float32 "
                         f"pools, or quantized uint8 rows, got {dt}")
    if device == "cuda":
        return _common.desc_of(pool, word), fmt
    return pool.view(word), fmt


def row_values(pool, fmt: int) -> int:
    """Values per stored row of a pool in format ``fmt`` (a quantized row's bytes: 32 values
    per 34-byte q8_0 / 18-byte q4_0 block, one per float8 byte)."""
    n = int(pool.shape[2])
    if fmt == FMT_DS_MLA:
        return _mla.HEAD_DIM if n == _mla.ROW_BYTES else 0
    if fmt == FMT_Q8_0:
        return n // 34 * 32
    if fmt == FMT_Q4_0:
        return n // 18 * 32
    return n


def token_sequences(qo_indptr: np.ndarray, token_order: np.ndarray, batch: int) -> np.ndarray:
    """int32 ``[batch]``: the batch-sequence index of each batch token (host side)."""
    out = np.empty(batch, np.int32)
    counts = np.diff(np.asarray(qo_indptr, np.int64))
    out[np.asarray(token_order, np.int64)] = np.repeat(np.arange(counts.size, dtype=np.int32),
                                                       counts)
    return out


def paged_attention(device: str, q, kpool, vpool, table, tok_seq, causal, window: int,
                    chunk: int, scale: float, soft_cap: Optional[float], list_lens: np.ndarray,
                    *, bf16: bool = False, part_len: Optional[int] = None,
                    kfmt: Optional[int] = None, vfmt: Optional[int] = None,
                    kscale: float = 1.0, vscale: float = 1.0, k_rotation: int = 0,
                    v_rotation: int = 0):
    """Attention of every query token over its sequence's listed cells, one launch (two when
    lists are split).

    Args:
        device: ``"cuda"`` (CuPy arrays) or ``"sim"`` (numpy arrays).
        q: float32 ``[T, H, D]`` contiguous on the device.
        kpool: ``[n_cells, Hkv, D]`` float16/float32, or uint16 bfloat16 bits (``bf16``), or
            uint8 ``[n_cells, Hkv, row_bytes]`` quantized rows (``kfmt``); vpool ``[n_cells,
            Hkv, Dv]`` likewise (``vfmt``).
        table: the pass's :class:`numbakv.pages.PageTable` (device arrays).
        tok_seq: int32 ``[T]`` device array (:func:`token_sequences`); causal uint8 ``[T]``.
        window, chunk: the mask rule (-1 / 0: none); scale; soft_cap (None: none).
        list_lens: host int ``[n_b]`` list lengths (plans the split).
        part_len: force the split-K part length (tests).
        kfmt, vfmt: a quantized side's format (:data:`FMT_Q8_0`, :data:`FMT_Q4_0`,
            :data:`FMT_F8`; None: a float pool, its format from its dtype and ``bf16``);
            kscale / vscale: float8's per-layer scales.
        k_rotation, v_rotation: Walsh-Hadamard blocks of rotated keys / values (0: none):
            the queries are rotated and the output turned back inside the kernel.

    Returns:
        ``(out, lse)``: float32 ``[T, H, Dv]`` and ``[T, H]`` on the device (``out`` in the
        model's basis, turned back from rotated values).
    """
    T, H, D = q.shape
    hkv = kpool.shape[1]
    if bf16 and np.dtype(kpool.dtype) == np.float16:
        raise ValueError("bf16=True needs the pools as uint16 bit patterns")
    kr, kf = raw_pool(kpool.view(np.uint16) if bf16 and kfmt is None else kpool, device, kfmt)
    vr, vf = raw_pool(vpool.view(np.uint16) if bf16 and vfmt is None else vpool, device, vfmt)
    if bf16:
        kf = FMT_BF16 if kf < FMT_Q8_0 else kf
        vf = FMT_BF16 if vf < FMT_Q8_0 else vf
    dk = row_values(kpool, kf)
    dv = row_values(vpool, vf)
    if dk != D:
        raise ValueError(f"q's head_dim ({D}) must match the key rows' ({dk})")
    if kfmt is None and vfmt is None and kf != vf:
        raise ValueError("K and V pools must share their storage dtype")
    if not fits(H, hkv, D, dv, T):
        raise ValueError(f"paged attention kernel does not take n_heads={H}, n_kv_heads={hkv}, "
                         f"head_dim={D}, v_dim={dv}, batch={T}")
    for name, rot, n in (("k_rotation", k_rotation, D), ("v_rotation", v_rotation, dv)):
        if rot and (rot & (rot - 1) or n % rot):
            raise ValueError(f"{name}={rot} must be a power of two dividing the row ({n})")
    xp = _xp(device)
    pl, n_parts = plan_part_len(np.asarray(list_lens), T * hkv, device, part_len)
    out = xp.empty((T, H, dv), np.float32)
    lse = xp.empty((T, H), np.float32)
    if n_parts > 1:
        part_acc = xp.empty((n_parts, T, H, dv), np.float32)
        part_ml = xp.empty((2, n_parts, T, H), np.float32)
    else:   # unused by the one-part kernel: a minimal placeholder of the right rank
        part_acc = xp.empty((1, 1, 1, 1), np.float32)
        part_ml = xp.empty((2, 1, 1, 1), np.float32)
    launch_paged(device, q, kr, vr, kf, vf, table.kv_indices, table.kv_positions,
                 table.kv_indptr, tok_seq, table.q_positions, causal, window, chunk, scale,
                 soft_cap, n_parts, pl, tok_seq, out, lse, part_acc, part_ml, kscale=kscale,
                 vscale=vscale, k_rotation=k_rotation, v_rotation=v_rotation)
    return out, lse


def launch_paged(device: str, q, kpool, vpool, kfmt: int, vfmt: int, kv_indices, kv_positions,
                 kv_indptr, tok_seq, q_pos, causal, window: int, chunk: int, scale: float,
                 soft_cap: Optional[float], n_parts: int, part_len: int, part_len_dev, out, lse,
                 part_acc, part_ml, *, kscale: float = 1.0, vscale: float = 1.0,
                 k_rotation: int = 0, v_rotation: int = 0) -> None:
    """The launches of :func:`paged_attention` on arrays the caller owns: the kernel over grid
    ``(n_parts, T, n_kv_heads)``, then the merge when ``n_parts > 1``. ``kpool`` / ``vpool``
    are raw (:func:`raw_pool`: words and formats ``kfmt`` / ``vfmt``); every array is a CuPy array
    or a :class:`._common.Desc` (``cuda``) or a numpy array (``sim``). ``part_len`` 0 makes
    the kernel read the part length from ``part_len_dev`` (int32 ``[1]``) when it runs: a
    captured step's grid is fixed at ``n_parts`` for every replay, and the parts past a
    token's run exit at once (:class:`numbakv.step.DecodeStep`)."""
    if device == "cuda":
        def arg(a):
            return a if isinstance(a, _common.Desc) else _common.desc_of(a)
    else:
        def arg(a):
            return a
    T = q.shape[0]
    hkv = kpool.shape[1]
    dv = out.shape[2]
    nb = block_size(device) if device == "sim" else BLOCK_CUDA
    krs = f32_bits(rotation_scale(k_rotation)) if k_rotation else 0
    vrs = f32_bits(rotation_scale(v_rotation)) if v_rotation else 0
    _launch(device, paged_attention_kernel, (n_parts, T, hkv), nb,
            (arg(q), kpool, vpool, kfmt, vfmt, arg(kv_indices), arg(kv_positions),
             arg(kv_indptr), arg(tok_seq), arg(q_pos), arg(causal),
             int(window), int(chunk), f32_bits(scale), f32_bits(soft_cap or 0.0),
             f32_bits(kscale), f32_bits(vscale), int(k_rotation), krs, int(v_rotation), vrs,
             int(part_len), arg(part_len_dev), arg(out), arg(lse), arg(part_acc),
             arg(part_ml)))
    if n_parts > 1:
        _launch(device, paged_merge_kernel, (T, out.shape[1]), min(nb, max(32, dv)),
                (arg(part_acc), arg(part_ml), arg(out), arg(lse)))


# ------------------------------------------------------------------ MLA latent decode
# MLA's absorbed form (one V-less latent "head" of kv_lora_rank + rope values shared by every
# query head; V is the row's first v_dim values) in a kernel of its own. The kernel above holds
# a group's queries and accumulators in 2 x 8 KiB of shared memory, so a 576-value latent fits
# only 3 heads per block, and each block reads the rows itself: with DeepSeek's 16-128 heads
# that is 6-43 reads of every latent row per step. Here a block takes a tile of up to
# LATENT_HEADS heads and stages each tile of rows, converted to float32, in shared memory
# once: the scores and the value sums of all the tile's heads read that copy.

#: query heads per block of the latent kernel (the tile's queries and accumulators in shared)
LATENT_HEADS = 8
#: shared floats of the tile's queries (8 heads x 576 values, each head's row padded by one
#: value so that heads sit on different banks), accumulators (8 x 512) and staged rows (4 rows
#: of 576, padded likewise): 45.6 KiB with the scores and their partial sums, under the 48 KiB
#: of static shared memory
_LQ_SLOTS = 4616
_LACC_SLOTS = 4096
_LROW_SLOTS = 2312
_LSCORE_SLOTS = 256
assert _LSCORE_SLOTS == LATENT_HEADS * TILE


def latent_tiling(n_heads: int, head_dim: int, v_dim: int) -> Tuple[int, int]:
    """``(heads per block, rows per staged tile)`` of :data:`paged_latent_kernel` for a latent
    of ``head_dim`` values read as ``v_dim`` values; ``(0, 0)`` when not even one head fits."""
    if not 1 <= v_dim <= head_dim:
        return 0, 0
    ht = min(LATENT_HEADS, n_heads, _LQ_SLOTS // (head_dim + 1), _LACC_SLOTS // v_dim)
    rows = min(TILE, _LROW_SLOTS // (head_dim + 1))
    return (ht, rows) if ht >= 1 and rows >= 1 else (0, 0)


def latent_fits(n_heads: int, n_kv_heads: int, head_dim: int, v_dim: int, batch: int) -> bool:
    """Whether :data:`paged_latent_kernel` takes this shape: one latent head, its row and the
    value's width within the shared tiles, tokens within the grid's y extent (the split-K
    parts, its z, are at most :func:`max_parts`)."""
    ht, _ = latent_tiling(n_heads, head_dim, v_dim)
    return n_kv_heads == 1 and ht >= 1 and 0 < batch <= _common.MAX_GRID_YZ


def _latent_sigs():
    i32 = _arr(types.int32, 1)
    i64 = types.int64
    return [(_arr(types.float32, 3), _arr(kw, 3), i64, i32, i32, i32, i32, i32,
             _arr(types.uint8, 1), i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, i32,
             _arr(types.float32, 3), _arr(types.float32, 2), _arr(types.float32, 4),
             _arr(types.float32, 4))
            for kw in (types.uint16, types.uint32, types.uint8)]


@cuda_kernel("paged_latent_attention", _latent_sigs())
def paged_latent_kernel(q, kpool, kfmt, kv_indices, kv_pos, kv_indptr, tok_seq, q_pos,
                        causal, window, chunk, scale_bits, cap_bits, kscale_bits, krot,
                        krscale_bits, heads, rows, part_len, part_len_dev, out, lse, part_acc,
                        part_ml):
    """MLA's absorbed attention: block ``(head tile, token, part)`` over the one latent head
    (the tiles of a (token, part) are consecutive blocks: they read the same rows at about the
    same time, so the rows come from DRAM about once and L2 serves the other tiles).
    q float32 ``[T, H, D]`` (rotated and scaled here); kpool ``[n_cells, 1, D]`` raw bits or
    ``[n_cells, 1, row_bytes]`` quantized rows (``kfmt``; FlashMLA's ``fp8_ds_mla`` rows too,
    :data:`FMT_DS_MLA`, dequantized as they are staged); the value of a cell is its row's
    first ``out.shape[2]`` values, in the same format; ``heads`` query heads per
    block, ``rows`` rows per staged tile (:func:`latent_tiling`); the rest as
    :data:`paged_attention_kernel` (the value rotation is the key's: ``krot``)."""
    qs = cuda.shared.array(_LQ_SLOTS, float32)
    acc = cuda.shared.array(_LACC_SLOTS, float32)
    rw = cuda.shared.array(_LROW_SLOTS, float32)
    sc = cuda.shared.array(_LSCORE_SLOTS, float32)
    dots = cuda.shared.array(_LSCORE_SLOTS, float32)
    mx = cuda.shared.array(LATENT_HEADS, float32)
    tot = cuda.shared.array(LATENT_HEADS, float32)
    corr = cuda.shared.array(LATENT_HEADS, float32)
    part = cuda.blockIdx.z
    t = cuda.blockIdx.y
    h0 = cuda.blockIdx.x * heads
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    dim = q.shape[2]
    dv = out.shape[2]
    g = min(heads, q.shape[1] - h0)
    # a head's queries (and a staged row) padded by one value: the heads (rows) a warp reads at
    # once fall on different banks; the Walsh-Hadamard rotation needs them contiguous
    qst = dim if krot > 0 else dim + 1
    rst = dim + 1
    # lanes per score: a (head, staged row) dot is split over the threads the pairs leave
    # (8 heads x 4 rows on 128 threads: 4 lanes, each a quarter of the 576 values)
    n_pairs = g * rows
    lanes = max(1, min(nt, _LSCORE_SLOTS) // n_pairs)
    scale = np.uint32(scale_bits).view(np.float32)
    soft_cap = np.uint32(cap_bits).view(np.float32)
    kscale = np.uint32(kscale_bits).view(np.float32)
    a, e = part_run(kv_pos, kv_indptr, tok_seq, q_pos, causal, window, chunk, part_len,
                    part_len_dev, t, part)
    if a >= e and part > 0:
        # an empty part of a split (as the paged kernel's)
        for gi in range(tid, g, nt):
            part_ml[0, part, t, h0 + gi] = -math.inf
            part_ml[1, part, t, h0 + gi] = 0.0
        return
    for i in range(tid, g * dim, nt):
        gi = i // dim
        qs[gi * qst + i - gi * dim] = q[t, h0 + gi, i - gi * dim]
    for i in range(tid, g * dv, nt):
        acc[i] = 0.0
    for i in range(tid, g, nt):
        mx[i] = -math.inf
        tot[i] = 0.0
    cuda.syncthreads()
    if krot > 0:     # keys stored as H k: the scores read (H q) . (H k) = q . k
        _wht_shared(qs, g * dim, krot, np.uint32(krscale_bits).view(np.float32), tid, nt)
    for i in range(tid, g * qst, nt):
        qs[i] = qs[i] * scale
    cuda.syncthreads()
    for j0 in range(a, e, rows):
        n = min(rows, e - j0)
        # the tile's rows, read from the pool once (consecutive threads: consecutive values)
        for i in range(tid, n * dim, nt):
            jj = i // dim
            d = i - jj * dim
            rw[jj * rst + d] = latent_value(kpool, kv_indices[j0 + jj], d, kfmt, kscale)
        cuda.syncthreads()
        # scores: each (head, staged row) dot in ``lanes`` strided partial sums, then one
        # thread per pair adds them
        for i in range(tid, n_pairs * lanes, nt):
            pr = i // lanes
            ln = i - pr * lanes
            gi = pr // rows
            jj = pr - gi * rows
            x = float32(0.0)
            if jj < n:
                for d in range(ln, dim, lanes):
                    x += qs[gi * qst + d] * rw[jj * rst + d]
            dots[i] = x
        cuda.syncthreads()
        for pr in range(tid, n_pairs, nt):
            gi = pr // rows
            jj = pr - gi * rows
            x = float32(-math.inf)
            if jj < n:
                x = float32(0.0)
                for ln in range(lanes):
                    x += dots[pr * lanes + ln]
                if soft_cap > 0:
                    x = soft_cap * math.tanh(x / soft_cap)
            sc[gi * TILE + jj] = x
        cuda.syncthreads()
        # online softmax per head (as the kernel above)
        online_softmax_tile(sc, mx, tot, corr, g, n, tid, nt)
        cuda.syncthreads()
        # the value sums from the same staged rows: one thread per (head, value dim)
        for i in range(tid, g * dv, nt):
            gi = i // dv
            d = i - gi * dv
            v = acc[i] * corr[gi]
            for jj in range(n):
                v += sc[gi * TILE + jj] * rw[jj * rst + d]
            acc[i] = v
        cuda.syncthreads()
    if krot > 0:     # the value is the latent's first dims, rotated as the keys: turned back
        _wht_shared(acc, g * dv, krot, np.uint32(krscale_bits).view(np.float32), tid, nt)
    write_part(acc, mx, tot, g, dv, tid, nt, cuda.gridDim.z == 1, t, h0, part, out, lse,
               part_acc, part_ml)


def launch_latent(device: str, q, kpool, kfmt: int, kv_indices, kv_positions, kv_indptr,
                  tok_seq, q_pos, causal, window: int, chunk: int, scale: float,
                  soft_cap: Optional[float], n_parts: int, part_len: int, part_len_dev, out,
                  lse, part_acc, part_ml, *, kscale: float = 1.0, k_rotation: int = 0,
                  heads: Optional[int] = None, rows: Optional[int] = None) -> None:
    """The launches of MLA's absorbed attention on arrays the caller owns, as
    :func:`launch_paged` (same arguments, but one raw latent pool ``kpool`` ``[n_cells, 1,
    ...]`` in format ``kfmt`` whose rows' first ``out.shape[2]`` values are the value, rotated
    as the keys when ``k_rotation``): :data:`paged_latent_kernel` over grid ``(head tiles, T,
    n_parts)``, then the merge when ``n_parts > 1``. ``heads`` / ``rows`` force the tiling
    (tests; default :func:`latent_tiling`)."""
    if device == "cuda":
        def arg(a):
            return a if isinstance(a, _common.Desc) else _common.desc_of(a)
    else:
        def arg(a):
            return a
    T, H, D = q.shape
    dv = out.shape[2]
    ht, nr = latent_tiling(H, D, dv)
    ht, nr = heads or ht, rows or nr
    nb = block_size(device) if device == "sim" else BLOCK_CUDA
    krs = f32_bits(rotation_scale(k_rotation)) if k_rotation else 0
    _launch(device, paged_latent_kernel, (cdiv(H, ht), T, n_parts), nb,
            (arg(q), kpool, kfmt, arg(kv_indices), arg(kv_positions), arg(kv_indptr),
             arg(tok_seq), arg(q_pos), arg(causal), int(window), int(chunk), f32_bits(scale),
             f32_bits(soft_cap or 0.0), f32_bits(kscale), int(k_rotation), krs, int(ht),
             int(nr), int(part_len), arg(part_len_dev), arg(out), arg(lse), arg(part_acc),
             arg(part_ml)))
    if n_parts > 1:
        _launch(device, paged_merge_kernel, (T, H), min(nb, max(32, dv)),
                (arg(part_acc), arg(part_ml), arg(out), arg(lse)))


def paged_latent_attention(device: str, q, kpool, table, tok_seq, causal, window: int,
                           chunk: int, scale: float, soft_cap: Optional[float],
                           list_lens: np.ndarray, v_dim: int, *, bf16: bool = False,
                           part_len: Optional[int] = None, kfmt: Optional[int] = None,
                           kscale: float = 1.0, k_rotation: int = 0,
                           heads: Optional[int] = None, rows: Optional[int] = None):
    """MLA's absorbed attention of every query token over its sequence's listed latent rows
    (:func:`paged_attention`'s contract with V the rows' first ``v_dim`` values).

    Args:
        device: ``"cuda"`` (CuPy arrays) or ``"sim"`` (numpy arrays).
        q: float32 ``[T, H, D]`` contiguous on the device (``D`` the latent row's values).
        kpool: the latent rows ``[n_cells, 1, D]`` float16/float32, or uint16 bfloat16 bits
            (``bf16``), or uint8 ``[n_cells, 1, row_bytes]`` quantized rows (``kfmt``).
        table, tok_seq, causal, window, chunk, scale, soft_cap, list_lens, part_len, kscale:
            as :func:`paged_attention`; ``k_rotation`` the latent's Walsh-Hadamard blocks
            (queries rotated, output turned back in the same blocks).
        v_dim: values of each row that are the value (``kv_lora_rank``).
        heads, rows: force the tiling (tests).

    Returns:
        ``(out, lse)``: float32 ``[T, H, v_dim]`` and ``[T, H]`` on the device.
    """
    T, H, D = q.shape
    if bf16 and np.dtype(kpool.dtype) == np.float16:
        raise ValueError("bf16=True needs the pool as uint16 bit patterns")
    kr, kf = raw_pool(kpool.view(np.uint16) if bf16 and kfmt is None else kpool, device, kfmt)
    if bf16 and kf < FMT_Q8_0:
        kf = FMT_BF16
    if row_values(kpool, kf) != D:
        raise ValueError(f"q's head_dim ({D}) must match the latent rows' "
                         f"({row_values(kpool, kf)})")
    if not latent_fits(H, int(kpool.shape[1]), D, int(v_dim), T):
        raise ValueError(f"the latent kernel does not take n_heads={H}, n_kv_heads="
                         f"{kpool.shape[1]}, head_dim={D}, v_dim={v_dim}, batch={T}")
    if k_rotation and (k_rotation & (k_rotation - 1) or D % k_rotation or v_dim % k_rotation):
        raise ValueError(f"k_rotation={k_rotation} must be a power of two dividing the row "
                         f"({D}) and the value ({v_dim})")
    xp = _xp(device)
    ht, _ = latent_tiling(H, D, int(v_dim))
    pl, n_parts = plan_part_len(np.asarray(list_lens), T * cdiv(H, heads or ht), device,
                                part_len)
    out = xp.empty((T, H, v_dim), np.float32)
    lse = xp.empty((T, H), np.float32)
    if n_parts > 1:
        part_acc = xp.empty((n_parts, T, H, v_dim), np.float32)
        part_ml = xp.empty((2, n_parts, T, H), np.float32)
    else:
        part_acc = xp.empty((1, 1, 1, 1), np.float32)
        part_ml = xp.empty((2, 1, 1, 1), np.float32)
    launch_latent(device, q, kr, kf, table.kv_indices, table.kv_positions, table.kv_indptr,
                  tok_seq, table.q_positions, causal, window, chunk, scale, soft_cap, n_parts,
                  pl, tok_seq, out, lse, part_acc, part_ml, kscale=kscale,
                  k_rotation=k_rotation, heads=heads, rows=rows)
    return out, lse


def _xp(device: str):
    if device == "cuda":
        import cupy
        return cupy
    return np


__all__ = ["extend_lists", "extend_lists_kernel", "FMT_BF16", "FMT_DS_MLA", "FMT_F16",
           "FMT_F32", "FMT_F8", "FMT_Q4_0", "FMT_Q8_0", "LATENT_HEADS", "MAX_GROUP",
           "MAX_GROUP_DIM", "QUANT_FORMATS", "TILE", "WORD_PAIRS", "ds_mla_value", "f32_bits",
           "fits", "key_dot", "float_key_dot", "kv_to_f32", "kv_value", "latent_fits",
           "latent_tiling", "latent_value", "launch_latent", "launch_paged", "max_parts",
           "raw_pool", "quant_key_dot", "quant_value", "row_values", "lower_bound",
           "paged_attention", "paged_attention_kernel", "paged_latent_attention",
           "paged_latent_kernel", "paged_merge_kernel", "plan_part_len", "token_sequences",
           "visible_run"]
