"""mask fill: the attention mask ``[batch_padded, range_len]`` of a batch over a range of cells.

Entry ``[i, j]`` is ``0`` when batch token ``i`` may attend to cell ``j`` and ``-inf`` otherwise,
in float32 or float16; rows past the batch (padding) are all ``-inf``. The rule lives in one
element function, :func:`visible` (Ollama's ``buildMask`` plus llama.cpp's symmetric window).

Cell inputs: ``cell_pos int32 [n]`` and ``cell_seqs uint64 [n, 4]`` (a 256-bit sequence set:
sequence ``s`` is bit ``s % 64`` of word ``s // 64``). Only the words the batch's sequences use
are sent to the kernel (usually one), which keeps the host-to-GPU copy at 12 bytes per cell.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, njit, prange, types

from ._common import MAX_GRID_YZ, block_size, cdiv, device_arg, launch as _launch, to_device
from ._registry import cuda_kernel, element

#: raw bit patterns written for a masked entry, by mask dtype
MASKED_BITS = {"float32": 0xFF800000, "float16": 0xFC00, "bfloat16": 0xFF80}
_RAW = {"float32": np.dtype(np.uint32), "float16": np.dtype(np.uint16),
        "bfloat16": np.dtype(np.uint16)}
#: bfloat16 masks are stored as their uint16 bit patterns (as bfloat16 K/V are)
_NAME_OF = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
            np.dtype(np.uint16): "bfloat16"}


@element
def visible(q, seq_word, seq, p, causal, window, symmetric, chunk):
    """May a token at position ``p`` of sequence ``seq`` attend to a cell at position ``q``
    whose sequence-set word holding ``seq``'s bit is ``seq_word``? All of:

    - the cell holds the sequence (bit ``seq % 64`` of ``seq_word``);
    - causal (unless ``causal`` is 0 for this token, ``set_causal(except_)``): ``q <= p``;
    - chunked attention (``chunk > 0``): ``q >= p - p % chunk``;
    - sliding window (``window >= 0``): Ollama's ``q >= p - window`` (``window + 1`` positions
      visible) or, with ``symmetric``, llama.cpp's ``-(window // 2) <= p - q <= window // 2``.

    Written without branches (one boolean expression) so the CPU loop vectorises and GPU warps do
    not diverge; the terms that depend on the row only are hoisted out of the loops.
    """
    has = ((seq_word >> np.uint64(seq & 63)) & np.uint64(1)) != 0
    causal_ok = (causal == 0) | (q <= p)
    chunk_ok = (chunk <= 0) | (q >= p - p % max(chunk, 1))
    half = window // 2
    d = p - q
    window_ok = (window < 0) | ((symmetric != 0) & (d >= -half) & (d <= half)) | \
        ((symmetric == 0) & (q >= p - window))
    return has & causal_ok & chunk_ok & window_ok


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
                if _visible_cuda(q, seq_words[j, row_word[i]], batch_seq[i], batch_pos[i],
                                 causal[i], window, symmetric, chunk):
                    val = 0
            out[i, j] = val
        first += cuda.gridDim.y * ROWS_PER_THREAD


@njit(cache=True, inline="always")
def _fill_row_cpu(out, cell_pos, seq_words, row_word, batch_pos, batch_seq, causal, batch,
                  window, symmetric, chunk, masked, i):
    n = out.shape[1]
    if i >= batch:
        for j in range(n):
            out[i, j] = masked
        return
    wi = row_word[i]
    s = batch_seq[i]
    p = batch_pos[i]
    c = causal[i]
    for j in range(n):
        ok = _visible_cpu(cell_pos[j], seq_words[j, wi], s, p, c, window, symmetric, chunk)
        out[i, j] = 0 if ok else masked


@njit(cache=True)
def mask_fill_cpu(out, cell_pos, seq_words, row_word, batch_pos, batch_seq, causal, batch,
                  window, symmetric, chunk, masked):
    """CPU twin of :func:`mask_fill_kernel`, one thread."""
    for i in range(out.shape[0]):
        _fill_row_cpu(out, cell_pos, seq_words, row_word, batch_pos, batch_seq, causal, batch,
                      window, symmetric, chunk, masked, i)


@njit(cache=True, parallel=True)
def mask_fill_cpu_parallel(out, cell_pos, seq_words, row_word, batch_pos, batch_seq, causal,
                           batch, window, symmetric, chunk, masked):
    """CPU twin of :func:`mask_fill_kernel`, rows spread over threads."""
    for i in prange(out.shape[0]):
        _fill_row_cpu(out, cell_pos, seq_words, row_word, batch_pos, batch_seq, causal, batch,
                      window, symmetric, chunk, masked, i)


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
    """Fill ``out [rows, n]`` (float32 or float16, on the device) for the ``b = len(batch_pos)``
    tokens of the batch (``b <= rows``; rows past ``b`` are padding, all ``-inf``) over cells with
    positions ``cell_pos int32 [n]`` and sequence sets ``cell_seqs uint64 [n, 4]``; ``batch_seq``
    int32 ``[b]``, ``causal`` bool/uint8 ``[b]`` (0: no causal test for that token). Host inputs,
    checked by the caller."""
    rows, n = out.shape
    if rows == 0 or n == 0:
        return
    dtype = _NAME_OF[out.dtype]  # a dict keyed by dtype object: formatting names is slow
    raw = _RAW[dtype]
    masked = MASKED_BITS[dtype]
    batch = int(len(batch_pos))
    inputs = prepare_inputs(cell_pos, cell_seqs, batch_pos, batch_seq, causal)
    scalars = (batch, int(window), int(bool(symmetric)), int(chunk), masked)
    if device == "cpu":
        fn = mask_fill_cpu_parallel if rows * n >= PARALLEL_MIN_ENTRIES and rows > 1 \
            else mask_fill_cpu
        fn(out.view(raw), *inputs, *scalars)
        return
    dev_inputs, _keep = to_device(device, *inputs)
    nb = block_size(device)
    grid = (cdiv(n, nb), min(cdiv(rows, ROWS_PER_THREAD), MAX_GRID_YZ))
    _launch(device, mask_fill_kernel, grid, nb,
            (device_arg(device, out, raw),) + tuple(dev_inputs) + scalars)
    del _keep


__all__ = ["MASKED_BITS", "launch", "mask_fill_cpu", "mask_fill_cpu_parallel",
           "mask_fill_kernel", "prepare_inputs", "visible"]
