"""FlashMLA's ``fp8_ds_mla`` latent row: quantize on put, dequantize a cell range.

One row per (cell, head) of a DeepSeek MLA latent (512 latent values + 64 rope values), 656
bytes, as FlashMLA's ``quantize_k_cache`` (layout ``V32_FP8Sparse``) writes it:

- bytes ``0 .. 511``: the 512 latent values as float8_e4m3fn, ``x / scale_t`` rounded to nearest
  even, in four tiles of 128 values;
- bytes ``512 .. 527``: the four tiles' float32 scales (little-endian), each a power of two:
  ``scale_t = 2 ** ceil(log2(max(amax_t / 448, 1e-4)))`` with ``amax_t`` the tile's largest
  magnitude (FlashMLA's ``_cast_scale_inv_to_ue8m0``);
- bytes ``528 .. 655``: the 64 rope values as bfloat16 (little-endian; FlashMLA's kernels read
  bfloat16), rounded to nearest even from the cache's dtype.

The power of two is found exactly from the float32 bits of ``amax / 448`` (the smallest power of
two not below it), which is ``2 ** ceil(log2(.))`` without a rounded logarithm. Dequantized
values are ``e4m3 * scale_t`` in float32, rounded to the cache's dtype. The rotary shift never
comes here: it turns the bfloat16 rope bytes in place through :mod:`.rope` (no requantization).

Non-finite inputs: a tile holding a NaN gets a NaN scale and all-NaN values (torch's reference
propagates the NaN through ``max`` the same way); an infinity gives an infinite scale.
"""

from __future__ import annotations

import numpy as np
from numba import prange, types

from .._jit import njit
from ._common import (STORAGE_VIEW_TYPES, bf16_bits_to_f32, block_size, cdiv, f32_to_bf16_bits,
                      f32_to_f16_bits, sig_array as _arr)
from ._registry import cuda, cuda_kernel
from .launch import device_arg, launch as _launch, to_device
from .quant import _bound_element, _cpu_twin, _kind, e4m3_to_f32, f32_to_e4m3
from .rope import KIND_F16_BITS, KIND_FLOAT, load_f32

#: the row: latent values, tiles, rope values, bytes
LATENT, TILE, ROPE = 512, 128, 64
N_TILES = LATENT // TILE
SCALES_AT = LATENT                    # byte offset of the four float32 scales
ROPE_AT = LATENT + 4 * N_TILES        # byte offset of the bfloat16 rope values (528)
ROW_BYTES = ROPE_AT + 2 * ROPE        # 656
HEAD_DIM = LATENT + ROPE              # 576
#: the parts one thread (or one call) handles: the four tiles, then the rope values
N_PARTS = N_TILES + 1

_HELPERS = {"_load": load_f32, "_to_e4m3": f32_to_e4m3, "_from_e4m3": e4m3_to_f32,
            "_f32_to_bf16": f32_to_bf16_bits, "_bf16_to_f32": bf16_bits_to_f32,
            "_f32_to_f16": f32_to_f16_bits}


@_bound_element({})
def tile_scale(amax):
    """FlashMLA's tile scale for a tile whose largest magnitude is ``amax`` (float32): the
    smallest power of two ``>= max(amax / 448, 1e-4)``; NaN stays NaN, infinity infinity."""
    v = np.float32(amax) / np.float32(448.0)
    if v != v:
        return v
    if v < np.float32(1e-4):
        v = np.float32(1e-4)
    b = np.int64(np.float32(v).view(np.uint32))
    e = (b >> 23) & 0xFF
    if (b & 0x7FFFFF) == 0 or e == 0xFF:
        return v
    return np.uint32((e + 1) << 23).view(np.float32)


_HELPERS["_tile_scale"] = tile_scale


@_bound_element(_HELPERS)
def quantize_part(x, kind, q, part):
    """Part ``part`` of one row: a tile (0..3: its scale and 128 float8 values) or the rope
    values (4: 64 bfloat16). ``x`` the row's 576 values stored as ``kind``, ``q`` its 656 bytes."""
    if part < 4:
        j0 = part * 128
        amax = np.float32(0.0)
        nan = False
        for i in range(128):
            a = abs(_load(x[j0 + i], kind))
            if a != a:
                nan = True
            elif a > amax:
                amax = a
        scale = _tile_scale(np.float32(np.nan) if nan else amax)
        bits = np.int64(np.float32(scale).view(np.uint32))
        b0 = 512 + 4 * part
        q[b0] = np.uint8(bits & 0xFF)
        q[b0 + 1] = np.uint8((bits >> 8) & 0xFF)
        q[b0 + 2] = np.uint8((bits >> 16) & 0xFF)
        q[b0 + 3] = np.uint8((bits >> 24) & 0xFF)
        for i in range(128):
            q[j0 + i] = _to_e4m3(_load(x[j0 + i], kind) / scale)
    else:
        for i in range(64):
            if kind == 2:    # bfloat16 already: the bits as they are
                b = np.int64(x[512 + i])
            else:
                b = np.int64(_f32_to_bf16(_load(x[512 + i], kind)))
            q[528 + 2 * i] = np.uint8(b & 0xFF)
            q[529 + 2 * i] = np.uint8((b >> 8) & 0xFF)


@_bound_element(_HELPERS)
def stored_scale(q, tile):
    """Tile ``tile``'s (0..3) float32 scale, read from row ``q``'s little-endian scale bytes."""
    b0 = 512 + 4 * tile
    bits = np.int64(q[b0]) | (np.int64(q[b0 + 1]) << 8) | (np.int64(q[b0 + 2]) << 16) \
        | (np.int64(q[b0 + 3]) << 24)
    return np.uint32(bits).view(np.float32)


@_bound_element(_HELPERS)
def rope_bits(q, i):
    """Rope value ``i``'s (0..63) bfloat16 bits, read from row ``q``'s little-endian bytes."""
    return np.int64(q[528 + 2 * i]) | (np.int64(q[529 + 2 * i]) << 8)


_HELPERS["_stored_scale"] = stored_scale
_HELPERS["_rope_bits"] = rope_bits


@_bound_element(_HELPERS)
def latent_value(q, d, scale):
    """Latent value ``d`` (0..511) of row ``q`` as float32: its float8_e4m3 byte times
    ``scale``, its tile's :func:`stored_scale` (a loop over a tile reads that once)."""
    return _from_e4m3(q[d]) * scale


_HELPERS["_latent_value"] = latent_value


@_bound_element(_HELPERS)
def dequantize_value(q, d):
    """Value ``d`` (0..575) of row ``q`` as float32, as :func:`dequantize_part` forms it: a
    latent value by :func:`latent_value` with its tile's :func:`stored_scale`, a rope value its
    bfloat16 bits (:func:`rope_bits`) widened. For readers of single values (the paged latent
    attention, :mod:`.decode`)."""
    if d < 512:
        return _latent_value(q, d, _stored_scale(q, d // 128))
    return _bf16_to_f32(_rope_bits(q, d - 512))


@_bound_element(_HELPERS)
def dequantize_part(q, part, out, kind):
    """Part ``part`` of one row's bytes ``q`` into ``out`` (576 values stored as ``kind``): a
    tile's values by :func:`latent_value` with its scale read once, or the rope values'
    :func:`rope_bits` (the bits as they are for bfloat16, else widened)."""
    if part < 4:
        scale = _stored_scale(q, part)
        j0 = part * 128
        for i in range(128):
            y = _latent_value(q, j0 + i, scale)
            if kind == 1:
                out[j0 + i] = _f32_to_f16(y)
            elif kind == 2:
                out[j0 + i] = _f32_to_bf16(y)
            else:
                out[j0 + i] = y
    else:
        for i in range(64):
            b = _rope_bits(q, i)
            if kind == 2:    # bfloat16 already: the bits as they are
                out[512 + i] = b
            else:
                y = _bf16_to_f32(b)
                if kind == 1:
                    out[512 + i] = _f32_to_f16(y)
                else:
                    out[512 + i] = y


_quantize_cuda = quantize_part.cuda
_dequantize_cuda = dequantize_part.cuda
_quantize_cpu = quantize_part.cpu
_dequantize_cpu = dequantize_part.cpu


_IN_TYPES = STORAGE_VIEW_TYPES
_PUT_SIGS = [(_arr(types.uint8, 4), _arr(dt, 3), _arr(types.int32, 1), types.int64, types.int64,
              types.int64) for dt in _IN_TYPES]
_GET_SIGS = [(_arr(types.uint8, 4), types.int64, types.int64, _arr(dt, 3), types.int64)
             for dt in _IN_TYPES]


@cuda_kernel("ds_mla_put", _PUT_SIGS)
def ds_mla_put_kernel(q, x, slots, start, layer, kind):
    """One thread per (token, head, part), grid-striding. Token ``t`` goes to cell ``start + t``
    (``start >= 0``) or ``slots[t]`` (negative: skipped)."""
    per_token = x.shape[1] * 5
    total = x.shape[0] * per_token
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    while i < total:
        t = i // per_token
        r = i - t * per_token
        h = r // 5
        part = r - h * 5
        cell = start + t if start >= 0 else np.int64(slots[t])
        if cell >= 0:
            _quantize_cuda(x[t, h], kind, q[layer, cell, h], part)
        i += step


@cuda_kernel("ds_mla_get", _GET_SIGS)
def ds_mla_get_kernel(q, layer, lo, out, kind):
    """One thread per (cell, head, part) of cells ``lo ..``, grid-striding."""
    per_cell = out.shape[1] * 5
    total = out.shape[0] * per_cell
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    while i < total:
        c = i // per_cell
        r = i - c * per_cell
        h = r // 5
        part = r - h * 5
        _dequantize_cuda(q[layer, lo + c, h], part, out[c, h], kind)
        i += step


@njit(inline="always")
def _put_rows(q, x, slots, start, layer, kind):
    for t in prange(x.shape[0]):     # threads in the _par twin; distinct cells (caller checked)
        cell = start + t if start >= 0 else np.int64(slots[t])
        if cell < 0:
            continue
        for h in range(x.shape[1]):
            for part in range(5):
                _quantize_cpu(x[t, h], kind, q[layer, cell, h], part)


@njit(cache=True)
def ds_mla_put_cpu(q, x, slots, start, layer, kind):
    """CPU twin of :func:`ds_mla_put_kernel`."""
    _put_rows(q, x, slots, start, layer, kind)


@njit(cache=True, parallel=True)
def ds_mla_put_cpu_par(q, x, slots, start, layer, kind):
    """:func:`ds_mla_put_cpu` with its tokens spread over numba's threads."""
    _put_rows(q, x, slots, start, layer, kind)


@njit(inline="always")
def _get_rows(q, layer, lo, out, kind):
    for c in prange(out.shape[0]):
        for h in range(out.shape[1]):
            for part in range(5):
                _dequantize_cpu(q[layer, lo + c, h], part, out[c, h], kind)


@njit(cache=True)
def ds_mla_get_cpu(q, layer, lo, out, kind):
    """CPU twin of :func:`ds_mla_get_kernel`."""
    _get_rows(q, layer, lo, out, kind)


@njit(cache=True, parallel=True)
def ds_mla_get_cpu_par(q, layer, lo, out, kind):
    """:func:`ds_mla_get_cpu` with its cells spread over numba's threads."""
    _get_rows(q, layer, lo, out, kind)


def _grid(items: int, device: str) -> int:
    from ._common import max_blocks
    return max(1, min(cdiv(items, block_size(device)), max_blocks(device)))


def put_launch(device: str, q, layer: int, x, slots, start: int, dtype: str,
               slots_on_device: bool = False) -> None:
    """Quantize ``x [batch, n_kv_heads, 576]`` (the cache's ``dtype``) into layer ``layer`` of
    ``q [n_layers, n_cells, n_kv_heads, 656]`` (uint8) at ``slots`` (int32 host; negative
    skips) or, when ``start >= 0``, at ``start + t``. Inputs validated by the caller.
    ``slots_on_device``: ``slots`` is already where the kernel reads it (a
    :class:`._common.Desc` on ``cuda``, the array itself on ``sim``: a captured step's
    descriptor, read when the kernel runs), not uploaded (as :func:`.quant.put_launch`)."""
    batch = x.shape[0]
    if batch == 0:
        return
    view_dtype, kind = _kind(device, dtype)
    if slots is None:
        slots = np.zeros(1, np.int32)
    if device == "cpu":
        x = x.view(view_dtype)
        if kind == KIND_F16_BITS:   # widened by numpy (exact), as quant.put_launch does
            x, kind = x.view(np.float16).astype(np.float32), KIND_FLOAT
        launch = _cpu_twin(ds_mla_put_cpu, ds_mla_put_cpu_par, x.size, batch)
        launch(q, x, slots, int(start), int(layer), kind)
        return
    if slots_on_device:
        slots_d, keep = slots, None
    else:
        (slots_d,), keep = to_device(device, np.asarray(slots, np.int32))
    _launch(device, ds_mla_put_kernel, (_grid(batch * x.shape[1] * N_PARTS, device),),
            block_size(device), (device_arg(device, q), device_arg(device, x, view_dtype),
                                 slots_d, int(start), int(layer), kind))
    del keep


def get_launch(device: str, q, layer: int, lo: int, out, dtype: str) -> None:
    """Dequantize cells ``lo .. lo + len(out) - 1`` of layer ``layer`` into ``out [n,
    n_kv_heads, 576]`` (the cache's ``dtype``)."""
    n = out.shape[0]
    if n == 0:
        return
    view_dtype, kind = _kind(device, dtype)
    if device == "cpu":
        launch = _cpu_twin(ds_mla_get_cpu, ds_mla_get_cpu_par, out.size, n)
        launch(q, int(layer), int(lo), out.view(view_dtype), kind)
        return
    _launch(device, ds_mla_get_kernel, (_grid(n * out.shape[1] * N_PARTS, device),),
            block_size(device), (device_arg(device, q), int(layer), int(lo),
                                 device_arg(device, out, view_dtype), kind))


__all__ = ["HEAD_DIM", "LATENT", "ROPE", "ROPE_AT", "ROW_BYTES", "SCALES_AT", "TILE",
           "dequantize_part", "dequantize_value", "ds_mla_get_kernel", "ds_mla_put_kernel",
           "get_launch", "latent_value", "put_launch", "quantize_part", "rope_bits",
           "stored_scale", "tile_scale"]
