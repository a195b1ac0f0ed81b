"""block move and cell copy: move cells' keys and values to other cells, in every layer, K and V
in one launch (defrag plans, sequence copies).

A plan is a list of moves ``(src, dst, length)``: cells ``src .. src+length-1`` go to ``dst ..
dst+length-1``. Its meaning is sequential: the moves apply in order, each as a ``memmove`` (so a
move whose ranges overlap is safe). Two kernels implement it:

- **cells** (the fast one): when no destination cell is written twice and none is also read as
  a source, the order cannot matter; the plan is expanded to cell pairs and every word of every
  pair in every layer is copied by its own thread.
- **lanes** (any plan): each thread owns one word position of a cell row in one layer (a
  "lane") and runs the whole plan over it in order; lanes never share memory, so the sequential
  meaning holds without any synchronisation, still in one launch.

Defrag plans (holes filled from the end) never overlap, so they take the fast kernel.
"""

from __future__ import annotations

import numpy as np
from numba import prange, types

from .._jit import njit

from . import _common
from ._common import WORD_PAIRS as _PAIRS, sig_array as _arr
from ._common import DEVICE_WORD, UINT, WORD, Desc, block_size, copy_raw, head_word, word_size
from .launch import Prepared, capturing, launch as _launch, staging_for, to_device
from ._registry import cuda, cuda_device, cuda_kernel, element


@element
def move_step(src, dst, length, k):
    """Cells ``(from, to)`` of step ``k`` of moving ``length`` cells from ``src`` to ``dst`` in
    an order that is safe when the ranges overlap (``memmove``): backwards when moving up."""
    if dst > src:
        o = length - 1 - k
    else:
        o = k
    return src + o, dst + o


@element
def copy_word(arr, layer, s, d, h, w):
    """``arr[layer, d, h, w] = arr[layer, s, h, w]`` (``arr`` indexed ``[layer, cell, head,
    word]`` whatever the storage layout)."""
    copy_raw(arr, (layer, d, h, w), arr, (layer, s, h, w))


_move_step_cuda = move_step.cuda
_copy_word_cuda = copy_word.cuda
_move_step_cpu = move_step.cpu
_copy_word_cpu = copy_word.cpu
_head_word_cuda = head_word.cuda


@cuda_device
def pair_and_word(rest, npairs, row, cell_fast):
    """Item ``rest`` of one layer's ``(pair, row word)`` space as ``(pair, row word)``: row word
    fastest (a warp copies adjacent words of one cell row), or pair fastest when ``cell_fast``
    (permuted V, whose cells are its fastest axis: a warp reads and writes adjacent cells)."""
    if cell_fast == 0:
        c = rest // row
        return c, rest - c * row
    r = rest // npairs
    return rest - r * npairs, r


@cuda_device
def copy_flat(arr, src, dst, i, step, cell_fast):
    """Items ``i``, ``i + step``, ... of the flattened ``(layer, pair, row word)`` space (order
    within a layer: :func:`pair_and_word`): word ``r`` of cell ``src[c]`` to cell ``dst[c]`` in
    layer ``l``. One GPU thread's share of K or of V."""
    nh = arr.shape[2]
    nw = arr.shape[3]
    row = nh * nw
    npairs = src.shape[0]
    per_layer = npairs * row
    total = arr.shape[0] * per_layer
    while i < total:
        layer = i // per_layer
        c, r = pair_and_word(i - layer * per_layer, npairs, row, cell_fast)
        h, w = _head_word_cuda(r, nh, nw)
        _copy_word_cuda(arr, layer, src[c], dst[c], h, w)
        i += step


_CELL_SIGS = [(_arr(kw, 4), _arr(vw, 4), _arr(types.int32, 1), _arr(types.int32, 1),
               types.int64, types.int64) for kw, vw in _PAIRS]
_LANE_SIGS = [(_arr(kw, 4), _arr(vw, 4), _arr(types.int64, 2), types.int64) for kw, vw in _PAIRS]


@cuda_kernel("move_cells", _CELL_SIGS)
def move_cells_kernel(k, v, src, dst, v_cell_fast, nbk):
    """Copy cell ``src[c]`` to ``dst[c]`` for every pair ``c`` (no destination read or written by
    another pair), every layer. K and V each over their own flattened index space: the first
    ``nbk`` blocks grid-stride over K's, the rest over V's (cell-fastest when V's cells are its
    fastest axis)."""
    bx = cuda.blockIdx.x
    nb = cuda.blockDim.x
    if bx < nbk:
        copy_flat(k, src, dst, bx * nb + cuda.threadIdx.x, nbk * nb, 0)
    else:
        copy_flat(v, src, dst, (bx - nbk) * nb + cuda.threadIdx.x, (cuda.gridDim.x - nbk) * nb,
                  v_cell_fast)


@cuda_device
def run_plan_lane(arr, moves, i, step):
    """Lanes ``i``, ``i + step``, ... of the flattened ``(layer, row word)`` space of ``arr``:
    every move of the plan in order, each as a memmove, on that word of every cell row."""
    nh = arr.shape[2]
    nw = arr.shape[3]
    row = nh * nw
    total = arr.shape[0] * row
    while i < total:
        layer = i // row
        r = i - layer * row
        h, w = _head_word_cuda(r, nh, nw)
        for m in range(moves.shape[0]):
            for st in range(moves[m, 2]):
                s, d = _move_step_cuda(moves[m, 0], moves[m, 1], moves[m, 2], st)
                _copy_word_cuda(arr, layer, s, d, h, w)
        i += step


@cuda_kernel("move_lanes", _LANE_SIGS)
def move_lanes_kernel(k, v, moves, nbk):
    """Run the whole plan ``moves [m, 3]`` (src, dst, length) in order, one lane (word position
    of a cell row in one layer) per thread: the first ``nbk`` blocks over K's lanes, the rest over
    V's."""
    bx = cuda.blockIdx.x
    nb = cuda.blockDim.x
    if bx < nbk:
        run_plan_lane(k, moves, bx * nb + cuda.threadIdx.x, nbk * nb)
    else:
        run_plan_lane(v, moves, (bx - nbk) * nb + cuda.threadIdx.x, (cuda.gridDim.x - nbk) * nb)


@cuda_device
def run_of(runs, c):
    """The run holding pair ``c`` of a plan ``runs [m, 4]`` (src, dst, length, first pair;
    first pairs ascending from 0): the last run whose first pair is <= ``c`` (binary search)."""
    lo = 0
    hi = runs.shape[0] - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if runs[mid, 3] <= c:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cuda_device
def copy_runs(arr, runs, total, i, step, cell_fast):
    """:func:`copy_flat` over a plan of runs instead of expanded cell pairs: item ``i`` of the
    ``(layer, pair, row word)`` space (``total`` pairs) finds its run on the device, so the host
    sends the plan's runs, not one entry per cell."""
    nh = arr.shape[2]
    nw = arr.shape[3]
    row = nh * nw
    per_layer = total * row
    n = arr.shape[0] * per_layer
    while i < n:
        layer = i // per_layer
        c, r = pair_and_word(i - layer * per_layer, total, row, cell_fast)
        j = run_of(runs, c)
        o = c - runs[j, 3]
        h, w = _head_word_cuda(r, nh, nw)
        _copy_word_cuda(arr, layer, runs[j, 0] + o, runs[j, 1] + o, h, w)
        i += step


_RUN_SIGS = [(_arr(kw, 4), _arr(vw, 4), _arr(types.int64, 2), types.int64, types.int64,
              types.int64) for kw, vw in _PAIRS]


@cuda_kernel("move_runs", _RUN_SIGS)
def move_runs_kernel(k, v, runs, total, v_cell_fast, nbk):
    """The cells kernel (:func:`move_cells_kernel`) reading the plan as runs ``[m, 4]`` (src,
    dst, length, first pair) of ``total`` cell pairs: independent moves, every layer, K over the
    first ``nbk`` blocks and V over the rest."""
    bx = cuda.blockIdx.x
    nb = cuda.blockDim.x
    if bx < nbk:
        copy_runs(k, runs, total, bx * nb + cuda.threadIdx.x, nbk * nb, 0)
    else:
        copy_runs(v, runs, total, (bx - nbk) * nb + cuda.threadIdx.x,
                  (cuda.gridDim.x - nbk) * nb, v_cell_fast)


@njit(cache=True)
def plan_runs(moves, n_cells, out):
    """Check and normalise a plan ``moves [m, 3]`` (src, dst, length) into ``out [>= m, 4]``
    (src, dst, length, first pair) in one compiled pass, O(m) plus a sort of the live moves
    for the independence test, whatever the number of cells moved.

    Returns ``(problem, live, total, independent)``: ``problem`` 0 (fine), 1 (a negative
    length), 2 (a range outside ``[0, n_cells)``); ``live`` moves written (length > 0 and src
    != dst); ``total`` cell pairs; ``independent`` when no destination cell is written twice
    or also read (then the cells may be copied all at once)."""
    m = moves.shape[0]
    for i in range(m):
        if moves[i, 2] < 0:
            return 1, 0, 0, False
    for i in range(m):
        s, d, n = moves[i, 0], moves[i, 1], moves[i, 2]
        if s < 0 or d < 0 or s + n > n_cells or d + n > n_cells:
            return 2, 0, 0, False
    live = 0
    total = 0
    for i in range(m):
        s, d, n = moves[i, 0], moves[i, 1], moves[i, 2]
        if n > 0 and s != d:
            out[live, 0] = s
            out[live, 1] = d
            out[live, 2] = n
            out[live, 3] = total
            total += n
            live += 1
    if live <= 1:
        ok = live == 0 or out[0, 1] + out[0, 2] <= out[0, 0] or out[0, 0] + out[0, 2] <= out[0, 1]
        return 0, live, total, ok
    order = np.argsort(out[:live, 1])
    prev_hi = -1
    for j in range(live):   # destinations disjoint?
        r = order[j]
        if out[r, 1] < prev_hi:
            return 0, live, total, False
        prev_hi = out[r, 1] + out[r, 2]
    for i in range(live):   # no source overlaps a destination (binary search, sorted by dst)
        s, n = out[i, 0], out[i, 2]
        lo, hi = 0, live
        while lo < hi:     # first destination ending after s
            mid = (lo + hi) >> 1
            r = order[mid]
            if out[r, 1] + out[r, 2] <= s:
                lo = mid + 1
            else:
                hi = mid
        if lo < live and out[order[lo], 1] < s + n:
            return 0, live, total, False
    return 0, live, total, True


class RunMover:
    """Block moves of one storage (``sim``/``cuda``) with host work O(moves), not O(cells):
    the plan is checked and normalised by :func:`plan_runs` straight into a pinned host buffer
    (``cuda``; a reused host array on ``sim``), sent by one ``cudaMemcpyAsync`` into a device
    buffer reused per stream (copies and kernels on one stream are ordered), and applied by
    :func:`move_runs_kernel` (independent moves: the device expands runs into cells) or
    :func:`move_lanes_kernel` (any plan, in order). The storage's K/V descriptors and the
    launch geometry's constants are worked out once."""

    def __init__(self, device: str, keys, values, permuted: bool) -> None:
        self.device = device
        self.permuted = bool(permuted)
        self.n_cells = int(keys.shape[1])
        self.k, self.v = storage_args(device, keys, values, permuted)
        self.block = block_size(device)
        self.cap = _common.max_blocks(device)
        self.k_items = self.k.shape[0] * self.k.shape[2] * self.k.shape[3]
        self.v_items = self.v.shape[0] * self.v.shape[2] * self.v.shape[3]
        self._host = np.zeros((16, 4), np.int64)
        self._staging = None
        self._dev: dict = {}      # stream handle -> (device buffer, rows)
        self._kept: list = []     # outgrown buffers and those a captured graph reads

    def _geometry(self, total: int, independent: bool):
        if independent:
            nbk = _common.flat_blocks(self.k_items * total, self.block, self.cap)
            nbv = _common.flat_blocks(self.v_items * total, self.block, self.cap)
        else:
            nbk = _common.flat_blocks(self.k_items, self.block, self.cap)
            nbv = _common.flat_blocks(self.v_items, self.block, self.cap)
        return (nbk + nbv,), nbk

    def launch(self, moves: np.ndarray) -> int:
        """Apply ``moves`` (int64 ``[m, 3]``, host); returns :func:`plan_runs`'s problem code
        (0: applied; otherwise nothing was done)."""
        m = moves.shape[0]
        if self.device != "cuda":
            if self._host.shape[0] < m:
                self._host = np.zeros((max(m, 2 * self._host.shape[0]), 4), np.int64)
            problem, live, total, indep = plan_runs(moves, self.n_cells, self._host)
            if problem or not live:
                return problem
            runs = self._host[:live]
            self._run(indep, runs, live, total)
            return 0
        return self._launch_cuda(moves, m)

    def _run(self, indep: bool, runs, live: int, total: int) -> None:
        grid, nbk = self._geometry(total, indep)
        if indep:
            _launch(self.device, move_runs_kernel, grid, self.block,
                    (self.k, self.v, runs, total, int(self.permuted), nbk))
        else:
            _launch(self.device, move_lanes_kernel, grid, self.block,
                    (self.k, self.v, runs[:, :3] if isinstance(runs, np.ndarray) else
                     Desc(runs.ptr, (live, 3), runs.strides, runs.dtype), nbk))

    def _launch_cuda(self, moves: np.ndarray, m: int) -> int:
        import cupy
        stream = cupy.cuda.get_current_stream()
        staging = staging_for(stream, cupy.cuda.runtime.getDevice())
        nbytes = max(m, 1) * 32
        slot = staging.take(nbytes, stream)
        host = slot[2][:nbytes].view(np.int64).reshape(-1, 4)
        problem, live, total, indep = plan_runs(moves, self.n_cells, host)
        if problem or not live:
            staging.give_back(slot, stream)
            return problem
        dev = self._dev.get(stream.ptr)
        if capturing(stream):
            # a graph reads the buffer at every replay: a fresh one, kept as long as the mover
            buf = cupy.empty((live, 4), dtype=np.int64)
            self._kept.append(buf)
        else:
            if dev is None or dev[1] < live:
                if dev is not None:
                    self._kept.append(dev[0])   # a queued kernel may still read it
                rows = max(live, 16, 2 * (dev[1] if dev is not None else 0))
                dev = (cupy.empty((rows, 4), dtype=np.int64), rows)
                self._dev[stream.ptr] = dev
            buf = dev[0]
        cupy.cuda.runtime.memcpyAsync(int(buf.data.ptr), slot[4], live * 32, 1, stream.ptr)
        staging.give_back(slot, stream)
        runs = Desc(int(buf.data.ptr), (live, 4), (32, 8), np.dtype(np.int64))
        self._run(indep, runs, live, total)
        return 0


@njit(cache=True, inline="always")
def _move_layer_rows(arr, moves, layer):
    """Cell-major storage: for each step, the whole cell row (contiguous) at once."""
    for m in range(moves.shape[0]):
        for step in range(moves[m, 2]):
            s, d = _move_step_cpu(moves[m, 0], moves[m, 1], moves[m, 2], step)
            for h in range(arr.shape[2]):
                for w in range(arr.shape[3]):
                    _copy_word_cpu(arr, layer, s, d, h, w)


@njit(cache=True, inline="always")
def _move_layer_lanes(arr, moves, layer):
    """Cell-fastest (permuted V) storage: lane by lane, so the inner loop walks adjacent cells."""
    for h in range(arr.shape[2]):
        for w in range(arr.shape[3]):
            for m in range(moves.shape[0]):
                for step in range(moves[m, 2]):
                    s, d = _move_step_cpu(moves[m, 0], moves[m, 1], moves[m, 2], step)
                    _copy_word_cpu(arr, layer, s, d, h, w)


@njit(cache=True)
def move_cpu(k, v, moves, v_cell_fast):
    """CPU twin: the plan in order, layer by layer (layers are independent)."""
    for layer in range(k.shape[0]):
        _move_layer_rows(k, moves, layer)
        if v_cell_fast:
            _move_layer_lanes(v, moves, layer)
        else:
            _move_layer_rows(v, moves, layer)


@njit(cache=True, parallel=True)
def move_cpu_parallel(k, v, moves, v_cell_fast):
    """CPU twin, layers spread over threads."""
    for layer in prange(k.shape[0]):
        _move_layer_rows(k, moves, layer)
        if v_cell_fast:
            _move_layer_lanes(v, moves, layer)
        else:
            _move_layer_rows(v, moves, layer)


#: below this many bytes moved a plan runs on one CPU thread (copies are memory-bound: one core
#: nearly saturates the bandwidth, and the parallel form loses badly when the cores are busy;
#: see put.PARALLEL_MIN_BYTES)
PARALLEL_MIN_BYTES = 64 * 1024 * 1024


def independent(moves: np.ndarray, n_cells: int) -> bool:
    """True when no destination cell is written twice or also read: then the moves commute and
    may all run at once. ``O(m log m)`` in the number of moves, whatever ``n_cells`` (this runs
    on every defrag's host path: a per-cell coverage array cost tens of microseconds)."""
    m = moves.shape[0]
    if m == 0:
        return True
    src, dst, ln = moves[:, 0], moves[:, 1], moves[:, 2]
    if m == 1:
        s, d, n = int(src[0]), int(dst[0]), int(ln[0])
        return n == 0 or d + n <= s or s + n <= d
    live = ln > 0  # an empty move reads and writes nothing
    src, dst, ln = src[live], dst[live], ln[live]
    m = src.shape[0]
    if m == 0:
        return True
    order = np.argsort(dst, kind="stable")
    d_lo = dst[order]
    d_hi = d_lo + ln[order]
    if np.any(d_lo[1:] < d_hi[:-1]):
        return False  # two destinations overlap
    # the destinations are disjoint and sorted: the first one ending after a source's start is
    # the only candidate to overlap it
    first = np.searchsorted(d_hi, src, side="right")
    hit = first < m
    return not bool(np.any(hit & (d_lo[np.minimum(first, m - 1)] < src + ln)))


def expand(moves: np.ndarray):
    """The plan as int32 cell pairs ``(src[c], dst[c])``."""
    ln = moves[:, 2]
    total = int(ln.sum())
    first = np.repeat(np.cumsum(ln) - ln, ln)
    offs = np.arange(total, dtype=np.int64) - first
    return ((np.repeat(moves[:, 0], ln) + offs).astype(np.int32),
            (np.repeat(moves[:, 1], ln) + offs).astype(np.int32))


def normalize(moves) -> np.ndarray:
    """int64 ``[m, 3]`` without the moves that do nothing (length 0 or src == dst)."""
    moves = np.asarray(moves, dtype=np.int64).reshape(-1, 3)
    keep = (moves[:, 2] > 0) & (moves[:, 0] != moves[:, 1])
    return np.ascontiguousarray(moves[keep])


def _row_words(arr, ptr, widest: int = 8):
    """Word size for whole cell rows of ``arr [layers, cells, heads, dim]`` (each cell row
    contiguous; the layer and cell strides as they are: a cell slice of a larger storage, as
    per-sequence streams use, has a longer layer stride), up to ``widest`` bytes: 16 for the
    GPU kernels, 8 for the CPU twins."""
    isz = arr.dtype.itemsize
    row = arr.shape[2] * arr.shape[3] * isz
    return word_size(row, isz, (int(arr.strides[0]), int(arr.strides[1])), ptr, isz, widest)


def _np_rows(arr: np.ndarray, w: int) -> np.ndarray:
    """Cell rows ``[layers, cells, 1, row words]``: the heads are joined into one row *before*
    viewing as ``w``-byte words, because :func:`_row_words` sized ``w`` from the whole row (a
    head's own row, e.g. 17 float32, need not be a multiple of it)."""
    lay, n = arr.shape[:2]
    return arr.view(UINT[arr.itemsize]).reshape(lay, n, 1, -1).view(WORD[w])


def _np_cols(arr: np.ndarray) -> np.ndarray:
    """Permuted V ``[layers, heads, dim, cells]`` as ``[layers, cells, heads, dim]``."""
    return arr.view(UINT[arr.itemsize]).transpose(0, 3, 1, 2)


def _desc_rows(arr, w: int) -> Desc:
    """:func:`_np_rows` for a CuPy array, with its own layer and cell strides (a cell slice's
    layers lie further apart than its cells times a row)."""
    lay, n, h, d = arr.shape
    row = h * d * arr.itemsize
    s = arr.strides
    return Desc(int(arr.data.ptr), (lay, n, 1, row // w), (int(s[0]), int(s[1]), row, w), WORD[w])


def _desc_cols(arr) -> Desc:
    """:func:`_np_cols` for a CuPy array (its own strides, as above)."""
    lay, h, d, n = arr.shape
    s = arr.strides
    return Desc(int(arr.data.ptr), (lay, n, h, d), (int(s[0]), int(s[3]), int(s[1]), int(s[2])),
                UINT[arr.itemsize])


def storage_args(device: str, keys, values, permuted: bool):
    """The K and V storage as the kernels index them, ``[layer, cell, head', word]``: on
    ``cuda`` and ``sim`` in 16-byte words where rows and addresses allow (decided here, once per
    launch), on ``cpu`` in words of up to 8 bytes."""
    if device == "cuda":
        k = _desc_rows(keys, _row_words(keys, int(keys.data.ptr), DEVICE_WORD))
        if permuted:
            v = _desc_cols(values)
        else:
            v = _desc_rows(values, _row_words(values, int(values.data.ptr), DEVICE_WORD))
    elif device == "sim":  # the GPU's plan on numpy views, addresses included
        k = _np_rows(keys, _row_words(keys, keys.ctypes.data, DEVICE_WORD))
        v = _np_cols(values) if permuted else _np_rows(
            values, _row_words(values, values.ctypes.data, DEVICE_WORD))
    else:
        k = _np_rows(keys, _row_words(keys, None))
        v = _np_cols(values) if permuted else _np_rows(values, _row_words(values, None))
    return k, v


def prepare(device: str, keys, values, moves, permuted: bool):
    """The host work of :func:`launch` for ``sim``/``cuda``: a :class:`Prepared` launch of the
    cells kernel (independent moves) or the lanes kernel, or None when nothing moves."""
    moves = normalize(moves)
    if moves.shape[0] == 0:
        return None
    k, v = storage_args(device, keys, values, permuted)
    nb = block_size(device)
    cap = _common.max_blocks(device)
    if independent(moves, keys.shape[1]):
        src, dst = expand(moves)
        (src_d, dst_d), keep = to_device(device, src, dst)
        grid, nbk = cells_geometry(k.shape, v.shape, src.shape[0], nb, cap)
        return Prepared(move_cells_kernel, grid, nb, (k, v, src_d, dst_d, int(permuted), nbk),
                        keep)
    (moves_d,), keep = to_device(device, moves)
    grid, nbk = lanes_geometry(k.shape, v.shape, nb, cap)
    return Prepared(move_lanes_kernel, grid, nb, (k, v, moves_d, nbk), keep)


def cells_geometry(k_shape, v_shape, npairs: int, block: int, cap: int):
    """``(grid, nbk)`` of the cells kernel over storage viewed ``[layers, cells, heads',
    words]``: K's ``layers x pairs x row words`` items and V's likewise, each its own blocks (at
    most ``cap``, grid-striding beyond)."""
    nbk = _common.flat_blocks(k_shape[0] * npairs * k_shape[2] * k_shape[3], block, cap)
    nbv = _common.flat_blocks(v_shape[0] * npairs * v_shape[2] * v_shape[3], block, cap)
    return (nbk + nbv,), nbk


def lanes_geometry(k_shape, v_shape, block: int, cap: int):
    """``(grid, nbk)`` of the lanes kernel: one thread per (layer, row word) lane of K, then
    of V."""
    nbk = _common.flat_blocks(k_shape[0] * k_shape[2] * k_shape[3], block, cap)
    nbv = _common.flat_blocks(v_shape[0] * v_shape[2] * v_shape[3], block, cap)
    return (nbk + nbv,), nbk


def launch(device: str, keys, values, moves, permuted: bool) -> None:
    """Apply ``moves`` (int64 ``[m, 3]``: src, dst, length; validated by the caller) to the whole
    K storage ``[n_layers, n_cells, n_kv_heads, head_dim]`` and V storage (same layout, or
    ``[n_layers, n_kv_heads, v_head_dim, n_cells]`` when ``permuted``), in order, each as a
    memmove."""
    if device != "cpu":   # the runs path (KVStorage keeps one RunMover; this builds one)
        moves = np.ascontiguousarray(moves, dtype=np.int64).reshape(-1, 3)
        if moves.shape[0] and RunMover(device, keys, values, permuted).launch(moves):
            raise ValueError("moves must have lengths >= 0 and stay inside the cells")
        return
    moves = normalize(moves)
    if moves.shape[0] == 0:
        return
    k, v = storage_args(device, keys, values, permuted)
    n_cells = keys.shape[1]
    per_cell = (keys.size + values.size) // n_cells * keys.itemsize
    nbytes = int(moves[:, 2].sum()) * per_cell
    fn = move_cpu_parallel if nbytes >= PARALLEL_MIN_BYTES and keys.shape[0] > 1 else move_cpu
    fn(k, v, moves, bool(permuted))


def copy_launch(device: str, keys, values, src, dst, permuted: bool) -> None:
    """Copy cell ``src[i]`` to ``dst[i]`` (int32 host arrays, validated by the caller) in every
    layer, K and V; applied in order (as one-cell moves), so chains and swaps through a shared
    cell behave as if done one after another."""
    src = np.asarray(src, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst, dtype=np.int64).reshape(-1)
    moves = np.stack([src, dst, np.ones_like(src)], axis=1) if src.size else \
        np.zeros((0, 3), dtype=np.int64)
    launch(device, keys, values, moves, permuted)


__all__ = ["RunMover", "copy_launch", "copy_word", "expand", "independent", "launch",
           "move_cells_kernel", "move_runs_kernel", "plan_runs",
           "move_cpu", "move_cpu_parallel", "move_lanes_kernel", "move_step", "normalize",
           "prepare",
           "storage_args"]
