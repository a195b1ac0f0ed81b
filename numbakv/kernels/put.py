"""put: scatter a batch's keys and values into one layer of the storage, a slot per token.

``key [batch, n_kv_heads, head_dim]`` goes to ``K[layer, slot, :, :]`` and ``value [batch,
n_kv_heads, v_head_dim]`` to ``V[layer, slot, :, :]`` (or ``V[layer, :, :, slot]`` in the permuted
layout), K and V in one launch. A negative slot skips its token (padding), like vLLM's
``reshape_and_cache``. Slots come either as an int32 array or as a start (``slot = start + t``,
the contiguous placement Ollama uses; no slot array is sent to the GPU then).

Data moves as raw words: on the GPU (and the simulator) 16 bytes at a time when the row length,
strides and addresses allow (one 128-bit load and store per thread, see
``_common.copy_raw``), else 8, 4 or 2; rows of all heads as one run when the input's heads are
contiguous. The word size is chosen once per launch on the host. Inputs may be strided.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from numba import prange, types

from .._jit import njit

from . import _common, launch as _launch_mod
from ._common import WORD_PAIRS as _PAIRS, sig_array as _arr
from ._common import (DEVICE_WORD, UINT, WORD, Desc, block_size, cdiv, copy_raw, copy_raw4, desc_of,
                      head_word, word_size)
from .launch import launch as _launch
from ._registry import cuda, cuda_device, cuda_kernel, element, on_cuda_import


@element
def slot_of(slots, start, t):
    """The cell that token ``t`` goes to: ``start + t`` in contiguous mode (``start >= 0``),
    else ``slots[t]`` (negative: skip the token)."""
    if start >= 0:
        return start + t
    return np.int64(slots[t])


@element
def put_word(dst, src, slot, t, h, w):
    """Copy word ``w`` of head ``h`` of batch token ``t`` into cell ``slot`` (callers skip
    negative slots). ``dst`` is indexed ``[cell, head, word]`` whatever the storage layout."""
    copy_raw(dst, (slot, h, w), src, (t, h, w))


_slot_of_cuda = slot_of.cuda
_put_word_cuda = put_word.cuda
_slot_of_cpu = slot_of.cpu
_put_word_cpu = put_word.cpu
_head_word_cuda = head_word.cuda


#: permuted V goes through shared-memory tiles of TILE tokens x TILE row elements: read along a
#: token's row (coalesced), written along cells (coalesced); below TILE tokens or row elements a
#: tile would be mostly idle, and the direct token-fastest path is used
TILE = 32
TILE_PITCH = TILE + 1  # a padded row of the shared tile: no bank conflicts on the transposed read
V_ROWS, V_CELLS_DIRECT, V_CELLS_TILED = 0, 1, 2


#: lanes of a warp: put's row spaces give each token row one warp
WARP = 32


@cuda_device
def put_rows(dst, src, slots, start, i, step):
    """Token rows of ``src [batch, heads', words]``, one warp per row (warp ``i >> 5`` of the
    space, then every ``step >> 5``-th): the row's slot is read once, lane ``l`` copies words
    ``l, l + 32, ...`` (adjacent lanes, adjacent words), four independent words in flight
    (:func:`copy_raw4`) while four remain. A one-row space (a single token, or a contiguous
    put viewed as one flat row) grid-strides over its words instead, so every thread has work.
    ``i`` and ``step`` come from blocks of a multiple of 32 threads."""
    nh = src.shape[1]
    nw = src.shape[2]
    batch = src.shape[0]
    if batch == 1:
        slot = _slot_of_cuda(slots, start, 0)
        if slot < 0:
            return
        if nh == 1:
            while i < nw:
                _put_word_cuda(dst, src, slot, 0, 0, i)
                i += step
            return
        row = nh * nw
        while i < row:
            h, w = _head_word_cuda(i, nh, nw)
            _put_word_cuda(dst, src, slot, 0, h, w)
            i += step
        return
    lane = i & (WARP - 1)
    t = i >> 5
    warps = step >> 5
    while t < batch:
        slot = _slot_of_cuda(slots, start, t)
        if slot >= 0:
            if nh == 1:
                w = lane
                while w + 3 * WARP < nw:
                    copy_raw4(dst, (slot, 0, w), (slot, 0, w + WARP), (slot, 0, w + 2 * WARP),
                              (slot, 0, w + 3 * WARP), src, (t, 0, w), (t, 0, w + WARP),
                              (t, 0, w + 2 * WARP), (t, 0, w + 3 * WARP))
                    w += 4 * WARP
                while w < nw:
                    _put_word_cuda(dst, src, slot, t, 0, w)
                    w += WARP
            else:
                for h in range(nh):
                    w = lane
                    while w < nw:
                        _put_word_cuda(dst, src, slot, t, h, w)
                        w += WARP
        t += warps


def row_threads(batch: int, heads: int, words: int) -> int:
    """Threads :func:`put_rows` uses for a ``[batch, heads, words]`` space: a warp per row, or
    one per word of a single row; none for a zero-width side (a V-less cache's V, or the
    quantized side of a captured step's float-side put), which then gets no blocks."""
    if heads * words == 0:
        return 0
    return heads * words if batch == 1 else batch * WARP


@cuda_device
def put_flat_cells(dst, src, slots, start, i, step):
    """Every ``(row element, token)`` item of ``src``, token fastest: a warp writes adjacent
    cells of permuted V (few tokens: a decode step)."""
    batch = src.shape[0]
    nh = src.shape[1]
    nw = src.shape[2]
    total = batch * nh * nw
    while i < total:
        r = i // batch
        t = i - r * batch
        slot = _slot_of_cuda(slots, start, t)
        if slot >= 0:
            h, w = _head_word_cuda(r, nh, nw)
            _put_word_cuda(dst, src, slot, t, h, w)
        i += step


@cuda_device
def put_tiles(dst, src, slots, start, tile, tile_step, tid, nb):
    """Permuted V through shared memory: tile ``tile`` (then ``tile + tile_step``, ...) of TILE
    tokens x TILE row elements is read row-wise (adjacent threads, adjacent elements of a
    token's row) and written cell-wise (adjacent threads, adjacent tokens' cells). Every thread
    of the block calls this (it synchronises the block)."""
    batch = src.shape[0]
    nh = src.shape[1]
    nw = src.shape[2]
    row = nh * nw
    n_r = (row + TILE - 1) // TILE
    n_tiles = ((batch + TILE - 1) // TILE) * n_r
    buf = cuda.shared.array((TILE, TILE_PITCH), types.uint32)
    while tile < n_tiles:
        tt = tile // n_r
        t0 = tt * TILE
        r0 = (tile - tt * n_r) * TILE
        k = tid
        while k < TILE * TILE:
            tl = k // TILE
            rl = k - tl * TILE
            if t0 + tl < batch and r0 + rl < row:
                h, w = _head_word_cuda(r0 + rl, nh, nw)
                buf[tl, rl] = src[t0 + tl, h, w]
            k += nb
        cuda.syncthreads()
        k = tid
        while k < TILE * TILE:
            rl = k // TILE
            tl = k - rl * TILE
            if t0 + tl < batch and r0 + rl < row:
                slot = _slot_of_cuda(slots, start, t0 + tl)
                if slot >= 0:
                    h, w = _head_word_cuda(r0 + rl, nh, nw)
                    dst[slot, h, w] = buf[tl, rl]
            k += nb
        cuda.syncthreads()
        tile += tile_step


def tiles_of_elements(dst, src, slots, start, tile, tile_step, tid, nb):
    """:func:`put_tiles`, which only permuted V takes, and permuted V is always copied element
    by element (2 or 4 bytes, what the uint32 tile holds). The kernel is also compiled for
    signatures whose V words are 8 or 16 bytes (rows, never tiled): for those the CUDA form
    below is empty, so they neither fail to type (a 16-byte word into the uint32 tile) nor
    reserve shared memory for a tile they never use. The simulator runs this Python."""
    put_tiles(dst, src, slots, start, tile, tile_step, tid, nb)


def _register_cuda_tiles() -> None:
    from numba.cuda.extending import overload as cuda_overload

    @cuda_overload(tiles_of_elements, target="cuda", inline="always")
    def _tiles_cuda(dst, src, slots, start, tile, tile_step, tid, nb):
        if src.dtype.bitwidth <= 32:
            def impl(dst, src, slots, start, tile, tile_step, tid, nb):
                put_tiles(dst, src, slots, start, tile, tile_step, tid, nb)
            return impl

        def never_tiled(dst, src, slots, start, tile, tile_step, tid, nb):
            pass
        return never_tiled


@on_cuda_import
def _register_cuda_tiles_unless_simulated() -> None:
    if not _common._simulator_on():
        _register_cuda_tiles()


_SIGS = [(_arr(kw, 3), _arr(vw, 3), _arr(types.int32, 1), _arr(kw, 3), _arr(vw, 3), types.int64,
          types.int64, types.int64) for kw, vw in _PAIRS]


@cuda_kernel("put_kv", _SIGS)
def put_kv_kernel(k_dst, v_dst, slots, k_src, v_src, start, v_mode, nbk):
    """K and V in one launch, each over its own flattened index space (no block idles because
    the other is larger): the first ``nbk`` blocks grid-stride over K's ``(token, row word)``
    items, the rest over V's, as rows (``v_mode`` 0), token-fastest cells of permuted V (1) or
    shared-memory tiles of permuted V (2)."""
    bx = cuda.blockIdx.x
    nb = cuda.blockDim.x
    tid = cuda.threadIdx.x
    if bx < nbk:
        put_rows(k_dst, k_src, slots, start, bx * nb + tid, nbk * nb)
        return
    vb = bx - nbk
    nbv = cuda.gridDim.x - nbk
    if v_mode == 0:
        put_rows(v_dst, v_src, slots, start, vb * nb + tid, nbv * nb)
    elif v_mode == 1:
        put_flat_cells(v_dst, v_src, slots, start, vb * nb + tid, nbv * nb)
    else:
        tiles_of_elements(v_dst, v_src, slots, start, vb, nbv, tid, nb)


# The token loop is written out in both twins: factored into a helper function, Numba's
# generated code ran about 25% slower (measured), which matters for a copy.

@njit(cache=True)
def put_kv_cpu(k_dst, v_dst, slots, k_src, v_src, start):
    """CPU twin of :func:`put_kv_kernel`, one thread."""
    for t in range(k_src.shape[0]):
        slot = _slot_of_cpu(slots, start, t)
        if slot < 0:
            continue
        for h in range(k_src.shape[1]):
            for w in range(k_src.shape[2]):
                _put_word_cpu(k_dst, k_src, slot, t, h, w)
        for h in range(v_src.shape[1]):
            for w in range(v_src.shape[2]):
                _put_word_cpu(v_dst, v_src, slot, t, h, w)


@njit(cache=True, parallel=True)
def put_kv_cpu_parallel(k_dst, v_dst, slots, k_src, v_src, start):
    """CPU twin of :func:`put_kv_kernel`, tokens spread over threads."""
    for t in prange(k_src.shape[0]):
        slot = _slot_of_cpu(slots, start, t)
        if slot >= 0:
            for h in range(k_src.shape[1]):
                for w in range(k_src.shape[2]):
                    _put_word_cpu(k_dst, k_src, slot, t, h, w)
            for h in range(v_src.shape[1]):
                for w in range(v_src.shape[2]):
                    _put_word_cpu(v_dst, v_src, slot, t, h, w)


#: below this many bytes a CPU put runs on one thread. A copy is bound by memory bandwidth, which
#: one core nearly saturates; measured on a 2-core box, the parallel form was up to 1.7x faster
#: when the cores were idle but 2-7x slower when other work kept them busy (OpenMP threads
#: waiting on each other), so only very large puts go parallel.
PARALLEL_MIN_BYTES = 64 * 1024 * 1024

_NO_SLOTS = np.zeros(1, dtype=np.int32)
_NO_SLOTS_DEV = {}


def _plan(shape, strides, isz: int, ptr: Optional[int], dst_ptr: int = 0):
    """(heads flattened into one row?, word size) for an input ``[batch, heads, dim]`` at
    address ``ptr`` going into storage at ``dst_ptr`` (both decide the 16-byte words: a word
    must be aligned on both sides)."""
    _, h, d = shape
    last = strides[2] if d > 1 else isz
    flat = last == isz and (h == 1 or strides[1] == d * isz)
    ptrs = None if ptr is None else ptr | dst_ptr
    if flat:
        return True, word_size(h * d * isz, isz, (strides[0],), ptrs, last, DEVICE_WORD)
    return False, word_size(d * isz, isz, (strides[0], strides[1]), ptrs, last, DEVICE_WORD)


def _np_pair(dst: np.ndarray, src: np.ndarray, flat: bool, w: int):
    """numpy views ``dst [n_cells, heads', words]`` and ``src [batch, heads', words]``."""
    n, h, d = dst.shape
    b = src.shape[0]
    wd = WORD[w]
    dv = dst.view(UINT[dst.itemsize])
    sv = src.view(UINT[src.itemsize])
    if flat:
        # heads joined into one row first: ``w`` was sized from the whole row, which a single
        # head's row (e.g. 3 halves) need not be a multiple of
        # (_plan's ``flat`` guarantees these reshapes are views, never copies)
        dv, sv = dv.reshape(n, 1, -1), sv.reshape(b, 1, -1)
    if w != dst.itemsize:
        dv = dv.view(wd)
        sv = sv.view(wd)
    return dv, sv


def _desc_pair(dst, src, flat: bool, w: int):
    """:class:`Desc` twins of :func:`_np_pair` for CuPy arrays (no CuPy views built)."""
    n, h, d = dst.shape
    b, _, _ = src.shape
    isz = src.itemsize
    wd = WORD[w]
    row = h * d * isz
    if flat:
        dd = Desc(int(dst.data.ptr), (n, 1, row // w), (row, row, w), wd)
        sd = Desc(int(src.data.ptr), (b, 1, row // w), (int(src.strides[0]), row, w), wd)
    else:
        s = src.strides
        last = w if w != isz else int(s[2])  # element-wise when the last axis is strided
        dd = Desc(int(dst.data.ptr), (n, h, d * isz // w), (row, d * isz, w), wd)
        sd = Desc(int(src.data.ptr), (b, h, d * isz // w), (int(s[0]), int(s[1]), last), wd)
    return dd, sd


def launch(device: str, k_dst, v_dst, slots: Optional[np.ndarray], key, value,
           permuted: bool, start: int = -1) -> None:
    """Write ``key [batch, n_kv_heads, head_dim]`` and ``value [batch, n_kv_heads, v_head_dim]``
    into one layer: ``k_dst [n_cells, n_kv_heads, head_dim]`` and ``v_dst`` (``[n_cells,
    n_kv_heads, v_head_dim]``, or ``[n_kv_heads, v_head_dim, n_cells]`` when ``permuted``), at
    ``slots[t]`` (int32, host; negative = skip) or, when ``start >= 0``, at ``start + t``.
    Inputs are in the storage dtype, on the storage's device, possibly strided; checked by the
    caller (``KVStorage``)."""
    batch = key.shape[0]
    if batch == 0:
        return
    isz = k_dst.dtype.itemsize
    if device == "cpu":
        _launch_cpu(k_dst, v_dst, slots, key, value, permuted, int(start))
        return
    if device == "cuda":
        _launch_cuda(k_dst, v_dst, slots, key, value, bool(permuted), int(start))
        return
    # sim: the same plan as on the GPU (addresses included), materialised as numpy views
    kflat, kw = _plan(key.shape, key.strides, isz, key.ctypes.data, k_dst.ctypes.data)
    vflat, vw = (False, isz) if permuted else _plan(value.shape, value.strides, isz,
                                                    value.ctypes.data, v_dst.ctypes.data)
    kd, ks = _np_pair(k_dst, key, kflat, kw)
    if permuted:
        vd = v_dst.view(UINT[isz]).transpose(2, 0, 1)
        vs = value.view(UINT[isz])
    else:
        vd, vs = _np_pair(v_dst, value, vflat, vw)
    start = int(start)
    sl = _NO_SLOTS if start >= 0 else slots
    grid, nb, nbk, v_mode = geometry(device, ks.shape, vs.shape, permuted,
                                     _common.max_blocks(device))
    _launch(device, put_kv_kernel, grid, nb, (kd, vd, sl, ks, vs, start, v_mode, nbk))


def geometry(device: str, ks_shape, vs_shape, permuted: bool, cap: int):
    """``(grid, block, nbk, v_mode)`` of a put whose K source is viewed ``ks_shape [batch,
    heads', words]`` and V source ``vs_shape``: ``nbk`` blocks over K's items, then V's blocks
    (rows, token-fastest cells, or one block per TILE x TILE tile of permuted V); each space gets
    the blocks its items fill, at most ``cap`` (grid-striding beyond)."""
    batch = ks_shape[0]
    nb = block_size(device)
    nbk = _common.flat_blocks(row_threads(*ks_shape), nb, cap)
    v_row = vs_shape[1] * vs_shape[2]
    if not permuted:
        v_mode, nbv = V_ROWS, _common.flat_blocks(row_threads(*vs_shape), nb, cap)
    elif batch >= TILE and v_row >= TILE:
        v_mode, nbv = V_CELLS_TILED, min(cdiv(batch, TILE) * cdiv(v_row, TILE), cap)
    else:
        v_mode, nbv = V_CELLS_DIRECT, _common.flat_blocks(batch * v_row, nb, cap)
    return (nbk + nbv,), nb, nbk, v_mode


class _CudaPut:
    """What a GPU put launch needs beyond five pointers and the start, worked out once per
    (shapes, strides, alignment) and reused: every layer of every forward pass with the same
    batch shape launches from here, patching pointers into a ready parameter list."""

    __slots__ = ("descs", "grid", "block", "nbk", "v_mode", "fast", "template", "ptr_idx",
                 "start_idx")

    def __init__(self, k_dst, v_dst, key, value, sl: Desc, permuted: bool, device_id: int):
        isz = k_dst.dtype.itemsize
        kflat, kw = _plan(key.shape, key.strides, isz, int(key.data.ptr), int(k_dst.data.ptr))
        kd, ks = _desc_pair(k_dst, key, kflat, kw)
        if permuted:
            # [cell, head, dim] over V's own strides: a per-sequence stream's cell slice of the
            # pool keeps the pool's head and dim strides (its own cell count would be wrong)
            hh, dv, n = v_dst.shape
            vs_ = v_dst.strides
            vd = Desc(int(v_dst.data.ptr), (n, hh, dv), (int(vs_[2]), int(vs_[0]), int(vs_[1])),
                      UINT[isz])
            vs = Desc(int(value.data.ptr), tuple(value.shape), tuple(value.strides), UINT[isz])
        else:
            vflat, vw = _plan(value.shape, value.strides, isz, int(value.data.ptr),
                              int(v_dst.data.ptr))
            vd, vs = _desc_pair(v_dst, value, vflat, vw)
        self.descs = (kd, vd, sl, ks, vs)
        self.grid, self.block, self.nbk, self.v_mode = geometry(
            "cuda", ks.shape, vs.shape, permuted, _common.max_blocks("cuda"))
        args = self.descs + (0, self.v_mode, self.nbk)
        self.fast = _launch_mod._fast_kernel(put_kv_kernel, args, device_id) \
            if _launch_mod.fast_launch_enabled() else None
        flat = _launch_mod._flatten(args)
        offsets = _launch_mod._flat_offsets(args)
        self.template = flat
        self.ptr_idx = tuple(offsets[i] + 4 for i in range(5))  # data pointer of each array
        self.start_idx = offsets[5]

    def launch(self, ptrs, start: int, stream: int) -> None:
        if self.fast is not None:
            vals = self.template.copy()
            i = self.ptr_idx
            vals[i[0]], vals[i[1]], vals[i[2]], vals[i[3]], vals[i[4]] = ptrs
            vals[self.start_idx] = start
            self.fast.launch_flat(self.grid, self.block, stream, vals)
            return
        args = tuple(d._replace(ptr=p) for d, p in zip(self.descs, ptrs))
        _launch("cuda", put_kv_kernel, self.grid, self.block,
                args + (start, self.v_mode, self.nbk))


_CUDA_PLANS: dict = {}


def _launch_cuda(k_dst, v_dst, slots, key, value, permuted: bool, start: int) -> None:
    import cupy
    device_id = cupy.cuda.runtime.getDevice()
    kp = key.data.ptr
    vp = value.data.ptr
    kdp = k_dst.data.ptr
    vdp = v_dst.data.ptr
    sl = _dummy_slots_dev(device_id) if start >= 0 else _slots_to_device(slots, device_id)
    # the low address bits decide the word size (16-byte words need 16-byte alignment)
    pkey = (device_id, k_dst.shape, v_dst.shape, v_dst.strides, k_dst.dtype, key.shape,
            key.strides,
            value.shape, value.strides, (kp | kdp) & 15, (vp | vdp) & 15, permuted, start >= 0)
    plan = _CUDA_PLANS.get(pkey)
    if plan is None:
        if len(_CUDA_PLANS) > 4096:  # shapes churning: forget old plans
            _CUDA_PLANS.clear()
        plan = _CUDA_PLANS[pkey] = _CudaPut(k_dst, v_dst, key, value, sl, permuted, device_id)
    plan.launch((kdp, vdp, sl.ptr, kp, vp), start,
                cupy.cuda.get_current_stream().ptr)


def _launch_cpu(k_dst, v_dst, slots, key, value, permuted: bool, start: int) -> None:
    """The CPU twin on element-sized unsigned views of the natural storage layer arrays."""
    if k_dst.dtype.kind != "u":
        k_dst = k_dst.view(UINT[k_dst.dtype.itemsize])
    if v_dst.dtype.kind != "u":
        v_dst = v_dst.view(UINT[v_dst.dtype.itemsize])
    launch_cpu(k_dst, v_dst.transpose(2, 0, 1) if permuted else v_dst, slots, key, value, start)


def launch_cpu(k_cells, v_cells, slots, key, value, start: int = -1) -> None:
    """The CPU put with the destination already as the twin indexes it: ``k_cells [n_cells,
    n_kv_heads, head_dim]`` and ``v_cells [n_cells, n_kv_heads, v_head_dim]`` (for permuted
    storage, the transposed view), as float32 or as unsigned views of the same width; inputs
    of another dtype of that width are viewed to match. The storage keeps these per layer, so a put
    costs one Numba call plus (float16) two views. No word views: LLVM vectorises the contiguous
    inner loops anyway, and every numpy view costs host time on small batches."""
    if key.dtype != k_cells.dtype:  # e.g. float16 data, uint16 views (no float16 in Numba's CPU)
        key = key.view(k_cells.dtype)
        value = value.view(v_cells.dtype)
    if (key.size + value.size) * key.itemsize >= PARALLEL_MIN_BYTES:
        put_kv_cpu_parallel(k_cells, v_cells, _NO_SLOTS if start >= 0 else slots, key, value,
                            start)
    else:
        put_kv_cpu(k_cells, v_cells, _NO_SLOTS if start >= 0 else slots, key, value, start)

_SLOT_CACHE = {}


def _dummy_slots_dev(device_id: Optional[int] = None) -> Desc:
    """A one-entry device int32 array standing in for the slot array in contiguous mode."""
    if device_id is None:
        import cupy
        device_id = cupy.cuda.runtime.getDevice()
    d = _NO_SLOTS_DEV.get(device_id)
    if d is None:
        import cupy
        buf = cupy.zeros(1, dtype=np.int32)
        d = (buf, desc_of(buf))
        _NO_SLOTS_DEV[device_id] = d
    return d[1]


def _slots_to_device(slots: np.ndarray, device_id: Optional[int] = None) -> Desc:
    """The slot array on the GPU. The last one sent is remembered (a forward pass puts the same
    slots into every layer), so only the first layer of a batch pays the copy. Reusing the buffer
    is ordered by the stream: later puts on the same stream see the new contents after the
    earlier kernels ran."""
    import cupy
    if device_id is None:
        device_id = cupy.cuda.runtime.getDevice()
    raw = np.ascontiguousarray(slots, dtype=np.int32).tobytes()
    # per stream: a buffer written on one stream must not be read by a kernel on another
    key = (device_id, cupy.cuda.get_current_stream().ptr)
    hit = _SLOT_CACHE.get(key)
    if hit is not None and hit[0] == raw:
        return hit[2]
    (desc,), buf = _launch_mod.to_device("cuda", np.frombuffer(raw, dtype=np.int32))
    _SLOT_CACHE[key] = (raw, buf, desc)
    return desc


__all__ = ["launch", "launch_cpu", "put_kv_kernel", "put_kv_cpu", "put_kv_cpu_parallel", "put_word", "slot_of"]
