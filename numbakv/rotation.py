"""What a caller's own attention does around a rotated quantized cache (llama.cpp #21038).

A cache with ``CacheConfig.k_rotation`` / ``v_rotation`` > 0 stores keys and values multiplied
by an orthonormal Walsh-Hadamard matrix ``H`` (blocks of ``k_rotation`` / ``v_rotation`` values
along the head dim, see :mod:`numbakv.kernels.hadamard`) before quantizing; ``get()``,
``get_quantized()``, ``layer_pool()`` and the page tables hand out those rows as stored -- the
rotated basis, what llama.cpp's attention reads. Since ``H`` is orthonormal and symmetric
(``H @ H = I``):

- scores are unchanged once the queries are rotated the same way: ``(H q) . (H k) = q . k``,
  so ``q`` goes through :func:`rotate_queries` first;
- the attention output over rotated values is ``H`` times the true output, so it goes through
  :func:`unrotate_output` (``H`` again) after.

``numbakv.attention.attend`` does both itself. Outside the quantization error the result is the
attention of the unrotated K/V.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .config import CacheConfig
from .kernels.hadamard import rotation_scale


def _config(cfg: Any) -> CacheConfig:
    """A CacheConfig, or the config of a cache."""
    if isinstance(cfg, CacheConfig):
        return cfg
    inner = getattr(cfg, "config", None)
    if isinstance(inner, CacheConfig):
        return inner
    raise ValueError(f"cfg must be a numbakv CacheConfig (or a cache), got {type(cfg).__name__}")


def _namespace(x: Any):
    """(module, float32 copy of ``x``) for a numpy, CuPy or torch array."""
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        import torch
        if not x.is_floating_point():
            raise ValueError(f"the tensor must be floating-point, got {x.dtype}")
        return torch, x.to(torch.float32)
    if module == "cupy":
        import cupy
        return cupy, x.astype(cupy.float32)
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        raise ValueError(f"the array must be floating-point, got {arr.dtype}")
    return np, arr.astype(np.float32)


def hadamard_blocks(x: Any, n: int) -> Any:
    """``x [..., dim]`` (numpy, CuPy or torch; ``dim`` a multiple of ``n``, a power of two)
    multiplied block-wise by the orthonormal ``n x n`` Walsh-Hadamard matrix along the last
    axis, in float32 with ggml's order and scale (bit-identical with ggml's CPU op and with the
    cache's kernels); returns float32 of the same kind and device."""
    xp, y = _namespace(x)
    shape = tuple(y.shape)
    dim = shape[-1]
    if n < 1 or n & (n - 1) or dim % n:
        raise ValueError(f"the last axis ({dim}) must be a multiple of the block {n} (a power "
                         "of two)")
    y = y * float(rotation_scale(n))   # a Python float keeps torch/CuPy in float32
    step = 1
    while step < n:
        z = y.reshape(shape[:-1] + (dim // (2 * step), 2, step))
        u, v = z[..., 0, :], z[..., 1, :]
        y = xp.stack([u + v, u - v], -2).reshape(shape)
        step *= 2
    return y


def rotate_queries(q: Any, cfg: Any) -> Any:
    """The queries a caller's own attention must use over a cache with rotated keys.

    Args:
        q: ``[..., head_dim]`` queries (numpy, CuPy or torch, any float dtype), e.g.
            ``[batch, n_heads, head_dim]``.
        cfg: the cache's ``CacheConfig`` (or the cache).

    Returns:
        ``q`` itself when keys are not rotated (``cfg.k_rotation == 0``); else ``H q`` in
        blocks of ``cfg.k_rotation`` (float32 math), in ``q``'s dtype, kind and device.
    """
    cfg = _config(cfg)
    dim = int(q.shape[-1]) if getattr(q, "ndim", 0) else -1
    if dim != cfg.head_dim:
        raise ValueError(f"q must have head_dim={cfg.head_dim} values on its last axis, got "
                         f"shape {list(getattr(q, 'shape', ()))}")
    if not cfg.k_rotation:
        return q
    return _like(hadamard_blocks(q, cfg.k_rotation), q)


def unrotate_output(out: Any, cfg: Any) -> Any:
    """The attention output over a cache with rotated values, turned back to the model's basis.

    Args:
        out: ``[..., v_head_dim]`` (numpy, CuPy or torch), attention over ``get()``'s values.
        cfg: the cache's ``CacheConfig`` (or the cache).

    Returns:
        ``out`` itself when values are not rotated (``cfg.v_rotation == 0``); else ``H out``
        in blocks of ``cfg.v_rotation`` (``H`` is its own inverse), in ``out``'s dtype.
    """
    cfg = _config(cfg)
    dim = int(out.shape[-1]) if getattr(out, "ndim", 0) else -1
    if dim != cfg.v_head_dim:
        raise ValueError(f"out must have v_head_dim={cfg.v_head_dim} values on its last axis, "
                         f"got shape {list(getattr(out, 'shape', ()))}")
    if not cfg.v_rotation:
        return out
    return _like(hadamard_blocks(out, cfg.v_rotation), out)


def _like(y: Any, x: Any) -> Any:
    """float32 ``y`` in ``x``'s dtype."""
    if type(x).__module__.split(".")[0] == "torch":
        return y.to(x.dtype)
    return y.astype(np.asarray(x).dtype if isinstance(x, np.ndarray) or
                    type(x).__module__.split(".")[0] != "cupy" else x.dtype, copy=False)


__all__ = ["hadamard_blocks", "rotate_queries", "unrotate_output"]
