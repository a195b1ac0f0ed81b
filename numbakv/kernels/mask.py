"""mask fill: the attention mask ``[batch_padded, range_len]`` of a batch over a range of cells.

Entry ``[i, j]`` is ``0`` when batch token ``i`` may attend to cell ``j`` and ``-inf`` otherwise,
in float32 or float16; rows past the batch (padding) are all ``-inf``. The rule lives in one
element function, :func:`visible` (Ollama's ``buildMask`` plus llama.cpp's symmetric window).

Cell inputs: ``cell_pos int32 [n]`` and ``cell_seqs uint64 [n, words]`` (a sequence set:
sequence ``s`` is bit ``s % 64`` of word ``s // 64``), as the cell table keeps them: positions
with an 8-byte stride, one bit word per cell up to 64 sequences. The CPU fill reads them in place
(nothing gathered); for the GPU only the words the batch's sequences use are sent (usually
one), which keeps the host-to-GPU copy at 12 bytes per cell.

Each row's rule reduces to an int32 interval of visible positions plus the sequence-bit test
(:func:`row_interval`, :func:`visible`), so the per-entry work is two compares and a bit test.
"""

from __future__ import annotations

import numpy as np
from numba import prange, types

from .._jit import njit
from ._common import MAX_GRID_YZ, block_size, cdiv
from .launch import device_arg, launch as _launch, to_device
from ._registry import cuda, cuda_kernel, element

#: raw bit patterns written for a masked entry, by mask dtype
MASKED_BITS = {"float32": 0xFF800000, "float16": 0xFC00, "bfloat16": 0xFF80}
_RAW = {"float32": np.dtype(np.uint32), "float16": np.dtype(np.uint16),
        "bfloat16": np.dtype(np.uint16)}
#: bfloat16 masks are stored as their uint16 bit patterns (as bfloat16 K/V are)
_NAME_OF = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
            np.dtype(np.uint16): "bfloat16"}


#: the top of the position range (no upper bound)
_POS_TOP = 2**31 - 1


@element
def row_interval(p, causal, window, symmetric, chunk):
    """``(lo, hi)``: a token at position ``p`` may attend to cell positions ``lo <= q <= hi``
    (of its own sequence; ``lo > hi``: none). The rule, all of:

    - causal (unless ``causal`` is 0 for this token, ``set_causal(except_)``): ``q <= p``;
    - chunked attention (``chunk > 0``): ``q >= p - p % chunk``;
    - sliding window (``window >= 0``): Ollama's ``q >= p - window`` (``window + 1`` positions
      visible) or, with ``symmetric``, llama.cpp's ``-(window // 2) <= p - q <= window // 2``.
    """
    lo = np.int64(-1)        # a free cell's position (it holds no sequence bit anyway)
    hi = np.int64(p) if causal != 0 else np.int64(_POS_TOP)
    if chunk > 0:
        lo = max(lo, np.int64(p) - np.int64(p) % chunk)
    if window >= 0:
        if symmetric != 0:
            half = window // 2
            lo = max(lo, np.int64(p) - half)
            hi = min(hi, np.int64(p) + half)
        else:
            lo = max(lo, np.int64(p) - window)
    return lo, hi


@element
def visible(q, seq_word, bit, lo, hi):
    """Whether a cell at position ``q`` whose sequence word is ``seq_word`` is visible to a row
    of sequence bit ``bit`` (``seq % 64``) and interval ``[lo, hi]`` (:func:`row_interval`).
    Branch-free, so the CPU loop vectorises and GPU warps do not diverge."""
    return (((seq_word >> bit) & np.uint64(1)) != 0) & (q >= lo) & (q <= hi)


_interval_cuda = row_interval.cuda
_interval_cpu = row_interval.cpu
_visible_cuda = visible.cuda
_visible_cpu = visible.cpu


def _arr(dt, nd):
    return types.Array(dt, nd, "A")


_SIGS = [(_arr(raw, 2), _arr(types.int32, 1), _arr(types.uint64, 2), _arr(types.int32, 1),
          _arr(types.int32, 1), _arr(types.int32, 1), _arr(types.uint8, 1), types.int64,
          types.int64, types.int64, types.int64, types.int64)
         for raw in (types.uint32, types.uint16)]


#: rows each GPU thread fills (its cell's position and sequence word stay in registers, so the
#: cell inputs are read once per ROWS_PER_THREAD rows rather than once per entry)
ROWS_PER_THREAD = 16


@cuda_kernel("mask_fill", _SIGS)
def mask_fill_kernel(out, cell_pos, seq_words, row_word, batch_pos, batch_seq, causal, batch,
                     window, symmetric, chunk, masked):
    """Grid x: columns (cells); grid y: groups of ``ROWS_PER_THREAD`` rows (grid-striding). A
    warp writes adjacent addresses of each row."""
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    n = out.shape[1]
    rows = out.shape[0]
    if j >= n:
        return
    q = cell_pos[j]
    first = cuda.blockIdx.y * ROWS_PER_THREAD
    while first < rows:
        last = min(first + ROWS_PER_THREAD, rows)
        for i in range(first, last):
            val = masked
            if i < batch:
                lo, hi = _interval_cuda(batch_pos[i], causal[i], window, symmetric, chunk)
                if _visible_cuda(q, seq_words[j, row_word[i]], np.uint64(batch_seq[i] & 63),
                                 lo, hi):
                    val = 0
            out[i, j] = val
        first += cuda.gridDim.y * ROWS_PER_THREAD


@njit(cache=True, inline="always")
def _fill_masked_row(out, masked, i):
    for j in range(out.shape[1]):
        out[i, j] = masked


@njit(cache=True, inline="always")
def _fill_row_cpu(out, cell_pos, seq_words, row_word, batch_pos, batch_seq, causal, window,
                  symmetric, chunk, masked, i):
    """Row i straight from the cell table's arrays (a sequence with one row in the batch)."""
    n = out.shape[1]
    wi = row_word[i]
    lo, hi = _interval_cpu(batch_pos[i], causal[i], window, symmetric, chunk)
    if lo > hi:
        _fill_masked_row(out, masked, i)
        return
    # int32 bounds (positions are int32): the compares run at int32 width
    lo32 = np.int32(lo)
    hi32 = np.int32(min(hi, _POS_TOP))
    bit = np.uint64(batch_seq[i] & 63)
    for j in range(n):
        q = np.int32(cell_pos[j])        # int32 positions, or packed (pos, shift) records
        out[i, j] = 0 if _visible_cpu(q, seq_words[j, wi], bit, lo32, hi32) else masked


@njit(cache=True)
def _seq_keys(cell_pos, seq_words, w, bit, key):
    """key[j] = the position of cell j if it holds the sequence (bit ``bit`` of word ``w``),
    else -2 (below every row's lowest visible position, -1): then a row's test is one unsigned
    compare on contiguous int32s, which vectorises."""
    for j in range(cell_pos.shape[0]):
        q = np.int32(cell_pos[j])        # int32 positions, or packed (pos, shift) records
        key[j] = q if _visible_cpu(0, seq_words[j, w], bit, 0, 0) else -2


@njit(cache=True, inline="always")
def _fill_row_keys(out, key, batch_pos, causal, window, symmetric, chunk, masked, i):
    """Row i from its sequence's keys (:func:`_seq_keys`): visible iff lo <= key <= hi."""
    lo, hi = _interval_cpu(batch_pos[i], causal[i], window, symmetric, chunk)
    if lo > hi:
        _fill_masked_row(out, masked, i)
        return
    lo32 = np.int32(lo)
    hi32 = np.int32(min(hi, _POS_TOP))
    # int32 compares and 32-bit select values (the masked bits fit 32 bits): 64-bit ones
    # narrowed to 16-bit stores do not vectorise as well
    m = np.uint32(masked)
    z = np.uint32(0)
    for j in range(out.shape[1]):
        k = key[j]
        out[i, j] = z if (k >= lo32) & (k <= hi32) else m


@njit(cache=True)
def _row_groups(batch_seq, batch):
    """Batch rows ordered by sequence (stable) and the start of each sequence's group."""
    order = np.argsort(batch_seq[:batch], kind="mergesort")
    starts = np.empty(batch + 1, np.int64)
    g = 0
    for k in range(batch):
        if k == 0 or batch_seq[order[k]] != batch_seq[order[k - 1]]:
            starts[g] = k
            g += 1
    starts[g] = batch
    return order, starts[:g + 1]


@njit(cache=True)
def mask_fill_cpu(out, cell_pos, seq_words, row_word, batch_pos, batch_seq, causal, batch,
                  window, symmetric, chunk, masked):
    """CPU twin of :func:`mask_fill_kernel`, one thread. A sequence with several rows in the
    batch turns its cells into keys once, and each of its rows is then a vectorised compare."""
    order, starts = _row_groups(batch_seq, batch)
    key = np.empty(cell_pos.shape[0], np.int32)
    for g in range(starts.shape[0] - 1):
        first = order[starts[g]]
        if starts[g + 1] - starts[g] == 1:
            _fill_row_cpu(out, cell_pos, seq_words, row_word, batch_pos, batch_seq, causal,
                          window, symmetric, chunk, masked, first)
            continue
        _seq_keys(cell_pos, seq_words, row_word[first], np.uint64(batch_seq[first] & 63), key)
        for k in range(starts[g], starts[g + 1]):
            _fill_row_keys(out, key, batch_pos, causal, window, symmetric, chunk, masked,
                           order[k])
    for i in range(batch, out.shape[0]):
        _fill_masked_row(out, masked, i)


@njit(cache=True, parallel=True)
def mask_fill_cpu_parallel(out, cell_pos, seq_words, row_word, batch_pos, batch_seq, causal,
                           batch, window, symmetric, chunk, masked):
    """CPU twin of :func:`mask_fill_kernel`, each sequence's rows spread over threads."""
    order, starts = _row_groups(batch_seq, batch)
    key = np.empty(cell_pos.shape[0], np.int32)
    for g in range(starts.shape[0] - 1):
        first = order[starts[g]]
        _seq_keys(cell_pos, seq_words, row_word[first], np.uint64(batch_seq[first] & 63), key)
        for k in prange(starts[g], starts[g + 1]):
            _fill_row_keys(out, key, batch_pos, causal, window, symmetric, chunk, masked,
                           order[k])
    for i in prange(batch, out.shape[0]):
        _fill_masked_row(out, masked, i)


#: below this many mask entries the CPU fill runs on one thread: an entry costs a few
#: nanoseconds, and Numba's thread pool (OpenMP) was measured 5-10x slower than one thread when
#: the cores are shared with other work (see put.PARALLEL_MIN_BYTES), so only huge masks go
#: parallel
PARALLEL_MIN_ENTRIES = 16 * 1024 * 1024


@njit(cache=True)
def _gather_cells(cell_pos, cell_seqs, words, out_pos, out_words):
    """Contiguous copies of the positions and of the bitset words ``words`` of each cell (numpy's
    strided gather from the cell table's 40-byte records is several times slower)."""
    for j in range(cell_pos.shape[0]):
        out_pos[j] = cell_pos[j]
        for k in range(words.shape[0]):
            out_words[j, k] = cell_seqs[j, words[k]]


def prepare_inputs(cell_pos, cell_seqs, batch_pos, batch_seq, causal):
    """Host-side packing: ``(cell_pos, seq_words, row_word, batch_pos, batch_seq, causal)``, all
    contiguous, where row ``i`` finds its sequence bit in ``seq_words[:, row_word[i]]``. Only the
    bitset words the batch's sequences use are kept (``[n, n_words]``, usually one column): that
    is what crosses to the GPU, and on the CPU the gathered columns let the fill loop vectorise
    (reading the cell table's strided records in the loop measured 2x slower than gathering
    first). ``cell_pos`` / ``cell_seqs`` may be strided views of the cell table."""
    batch_seq = np.ascontiguousarray(batch_seq, dtype=np.int32)
    if batch_seq.size == 0 or batch_seq.max() < 64:
        words_needed = np.zeros(1, dtype=np.int64)
        row_word = np.zeros(batch_seq.size, dtype=np.int32)
    else:
        words_needed, row_word = np.unique(batch_seq >> 6, return_inverse=True)
    cell_pos = np.asarray(cell_pos, dtype=np.int32)
    cell_seqs = np.asarray(cell_seqs, dtype=np.uint64)
    n = cell_pos.shape[0]
    pos_c = np.empty(n, dtype=np.int32)
    seq_words = np.empty((n, words_needed.shape[0]), dtype=np.uint64)
    _gather_cells(cell_pos, cell_seqs, words_needed.astype(np.int64), pos_c, seq_words)
    return (pos_c, seq_words, np.ascontiguousarray(row_word, dtype=np.int32).reshape(-1),
            np.ascontiguousarray(batch_pos, dtype=np.int32), batch_seq,
            np.ascontiguousarray(causal, dtype=np.uint8))


def launch(device: str, out, cell_pos, cell_seqs, batch_pos, batch_seq, causal, *,
           window: int = -1, symmetric: bool = False, chunk: int = 0) -> None:
    """Fill ``out [rows, n]`` (float32, float16, or bfloat16 bit patterns as uint16, on the
    device) for the ``b = len(batch_pos)`` tokens of the batch (``b <= rows``; rows past ``b``
    are padding, all ``-inf``) over cells with positions ``cell_pos int32 [n]`` and sequence
    sets ``cell_seqs uint64 [n, words]`` (strided views welcome; on the CPU ``cell_pos`` may
    also be the cell table's (pos, shift) records viewed as little-endian int64 ``[n]``, whose
    low half is the position: contiguous 64-bit loads vectorise where 8-byte-strided int32
    loads do not); ``batch_seq``
    int32 ``[b]``, ``causal`` bool/uint8 ``[b]`` (0: no causal test for that token). Host inputs,
    checked by the caller."""
    rows, n = out.shape
    if rows == 0 or n == 0:
        return
    dtype = _NAME_OF[out.dtype]  # a dict keyed by dtype object: formatting names is slow
    raw = _RAW[dtype]
    masked = MASKED_BITS[dtype]
    batch = int(len(batch_pos))
    scalars = (batch, int(window), int(bool(symmetric)), int(chunk), masked)
    if device == "cpu":
        # the cell table's own arrays, read in place: row i's bit lives in word seq // 64
        batch_seq = np.ascontiguousarray(batch_seq, dtype=np.int32)
        if cell_pos.dtype != np.int64:
            cell_pos = np.asarray(cell_pos, dtype=np.int32)
        inputs = (cell_pos, np.asarray(cell_seqs, dtype=np.uint64),
                  batch_seq >> 6, np.ascontiguousarray(batch_pos, dtype=np.int32), batch_seq,
                  np.ascontiguousarray(causal, dtype=np.uint8))
        fn = mask_fill_cpu_parallel if rows * n >= PARALLEL_MIN_ENTRIES and rows > 1 \
            else mask_fill_cpu
        fn(out.view(raw), *inputs, *scalars)
        return
    inputs = prepare_inputs(cell_pos, cell_seqs, batch_pos, batch_seq, causal)
    dev_inputs, _keep = to_device(device, *inputs)
    nb = block_size(device)
    grid = (cdiv(n, nb), min(cdiv(rows, ROWS_PER_THREAD), MAX_GRID_YZ))
    _launch(device, mask_fill_kernel, grid, nb,
            (device_arg(device, out, raw),) + tuple(dev_inputs) + scalars)
    del _keep


__all__ = ["MASKED_BITS", "launch", "mask_fill_cpu", "mask_fill_cpu_parallel",
           "mask_fill_kernel", "prepare_inputs", "row_interval", "visible"]
