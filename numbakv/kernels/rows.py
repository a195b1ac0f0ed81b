"""state rows: copy whole rows of recurrent state between row pools, in every layer given, in
one launch (``numbakv.recurrent``: gathering sequences' states for the model, scattering them
back, copy-on-write of shared states, keeping and restoring restore points).

A row pool is an array ``[layers, rows, row_words]`` (one state tensor of every sequence slot,
each row one slot's ``[*shape]`` as raw words). A copy is a list of pairs ``(src_rows[i],
dst_rows[i])``: ``dst[l, dst_rows[i], :] = src[l, src_rows[i], :]`` for every layer ``l``.
Gather is ``src`` = the pool, ``dst`` = a dense buffer with ``dst_rows = 0..n-1``; scatter is
the reverse; an in-pool copy passes the pool as both (the caller guarantees that no destination
row is also read, so the pairs commute and every word is its own thread).

The copy is raw bits (any dtype: float32 delta state, bfloat16 conv state), in the widest word
the row length, strides and (on a GPU) the addresses allow (:func:`row_words`): 16-byte words
on the GPU, up to 8 on the CPU, whose twin is a plain loop LLVM vectorises.
"""

from __future__ import annotations

import numpy as np
from numba import types

from .._jit import njit
from . import _common
from ._common import DEVICE_WORD, UINT, WORD, Desc, block_size, copy_raw, sig_array, word_size
from .launch import launch as _launch, to_device
from ._registry import cuda, cuda_kernel, element


@element
def row_word(dst, di, src, si):
    """One raw word of a row: ``dst[di] = src[si]`` (the CUDA kernel indexes ``(layer, row,
    word)`` of the pools, the CPU twin ``(word,)`` of one row's view)."""
    copy_raw(dst, di, src, si)


_row_word_cuda = row_word.cuda
_row_word_cpu = row_word.cpu

#: the word types a row is copied in (16-byte words: complex128, see _common.WORD16)
_WORD_TYPES = (types.complex128, types.uint64, types.uint32, types.uint16, types.uint8)
_SIGS = [(sig_array(t, 3), sig_array(types.int32, 1), sig_array(t, 3), sig_array(types.int32, 1))
         for t in _WORD_TYPES]


@cuda_kernel("state_rows", _SIGS)
def state_rows_kernel(dst, dst_rows, src, src_rows):
    """Every word of every pair in every layer, flattened ``(layer, pair, word)`` with the word
    fastest (a warp reads and writes adjacent words of one row), grid-striding."""
    nw = dst.shape[2]
    npairs = dst_rows.shape[0]
    per_layer = npairs * nw
    total = dst.shape[0] * per_layer
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    while i < total:
        layer = i // per_layer
        rest = i - layer * per_layer
        c = rest // nw
        w = rest - c * nw
        _row_word_cuda(dst, (layer, dst_rows[c], w), src, (layer, src_rows[c], w))
        i += step


@njit(cache=True)
def state_rows_cpu(dst, dst_rows, src, src_rows):
    """CPU twin: pair by pair, each row as its own 1-D view so the word loop is a plain
    contiguous copy (LLVM vectorises it, with a run-time overlap check)."""
    nw = dst.shape[2]
    for layer in range(dst.shape[0]):
        for c in range(dst_rows.shape[0]):
            d = dst[layer, dst_rows[c]]
            s = src[layer, src_rows[c]]
            for w in range(nw):
                _row_word_cpu(d, (w,), s, (w,))


def row_words(arr, row_bytes: int, device: str) -> int:
    """The word size to copy rows of ``row_bytes`` bytes of ``arr`` (``[layers, rows, ...]``,
    each row contiguous) in: up to 16 bytes on ``cuda``/``sim``, 8 on ``cpu``, limited by the
    layer and row strides and (GPU, simulator) the base address."""
    isz = arr.dtype.itemsize
    if device == "cuda":
        ptr = int(arr.data.ptr)
    elif device == "sim":
        ptr = arr.ctypes.data
    else:
        ptr = None
    widest = 8 if device == "cpu" else DEVICE_WORD
    return word_size(row_bytes, isz, (int(arr.strides[0]), int(arr.strides[1])), ptr, isz, widest)


def as_words(arr, row_bytes: int, w: int, device: str):
    """``arr`` (``[layers, rows, *shape]``, each row's ``row_bytes`` contiguous) as the kernels
    index it: ``[layers, rows, row_bytes // w]`` raw words (numpy view, or a :class:`Desc` on
    ``cuda``)."""
    lay, n = arr.shape[0], arr.shape[1]
    if device == "cuda":
        return Desc(int(arr.data.ptr), (lay, n, row_bytes // w),
                    (int(arr.strides[0]), int(arr.strides[1]), w), WORD[w])
    return arr.view(UINT[arr.itemsize]).reshape(lay, n, -1).view(WORD[w])


def geometry(layers: int, npairs: int, nwords: int, device: str):
    """``(grid, block)`` of :data:`state_rows_kernel`: one thread per word, at most
    ``_common.max_blocks`` blocks (grid-striding beyond)."""
    nb = block_size(device)
    return (_common.flat_blocks(layers * npairs * nwords, nb, _common.max_blocks(device)),), nb


def launch(device: str, dst, dst_rows, src, src_rows, row_bytes: int) -> None:
    """Copy row ``src_rows[i]`` of ``src`` to row ``dst_rows[i]`` of ``dst`` in every layer
    (``dst``, ``src``: numpy or CuPy arrays ``[layers, rows, *shape]`` of equal layers and row
    bytes, each row contiguous; rows int32 host arrays, validated by the caller; no destination
    row also read)."""
    dst_rows = np.ascontiguousarray(dst_rows, dtype=np.int32)
    src_rows = np.ascontiguousarray(src_rows, dtype=np.int32)
    if dst_rows.shape[0] == 0 or row_bytes == 0 or dst.shape[0] == 0:
        return
    w = min(row_words(dst, row_bytes, device), row_words(src, row_bytes, device))
    d = as_words(dst, row_bytes, w, device)
    s = as_words(src, row_bytes, w, device)
    if device == "cpu":
        state_rows_cpu(d, dst_rows, s, src_rows)
        return
    (dr, sr), keep = to_device(device, dst_rows, src_rows)
    grid, nb = geometry(dst.shape[0], dst_rows.shape[0], row_bytes // w, device)
    _launch(device, state_rows_kernel, grid, nb, (d, dr, s, sr))
    del keep  # CuPy's pool orders the buffer's reuse after the launch on this stream


__all__ = ["as_words", "geometry", "launch", "row_word", "row_words", "state_rows_cpu",
           "state_rows_kernel"]
