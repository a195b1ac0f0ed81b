"""TEMP attention stub (issue 14 branch only; the lead replaces it with issue 13's real module).

Implements only the round-2 contract of ``attend`` densely, from ``cache.get()``: the mask it
returns, scaled dot products, optional soft-capping, softmax, GQA head mapping.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np


def _current_config(cache):
    if hasattr(cache, "caches"):  # WrapperCache: the current group's cache
        return cache.caches[cache._current].config
    return cache.config


def attend(q, cache, *, scale: Optional[float] = None, soft_cap: Optional[float] = None,
           backend: str = "auto"):
    """q ``[batch, n_heads, head_dim]`` torch -> ``[batch, n_heads, v_head_dim]`` on q's device."""
    import torch

    key, value, mask = cache.get()
    k = torch.from_dlpack(key).to(device=q.device, dtype=torch.float32)
    v = torch.from_dlpack(value).to(device=q.device, dtype=torch.float32)
    m = torch.from_dlpack(np.ascontiguousarray(mask) if isinstance(mask, np.ndarray) else mask)
    m = m.to(device=q.device, dtype=torch.float32)
    if _current_config(cache).permuted_v:
        v = v.permute(2, 0, 1)                      # [n, n_kv_heads, v_head_dim]
    batch, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"q has {n_heads} heads, not a multiple of the cache's {n_kv} KV heads")
    group = n_heads // n_kv
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)   # [H, n, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)   # [H, n, Dv]
    scores = torch.matmul(q.to(torch.float32).transpose(0, 1), k.transpose(1, 2)) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores + m[:batch][None]
    out = torch.matmul(torch.softmax(scores, dim=-1), v)   # [H, batch, Dv]
    return out.transpose(0, 1).to(q.dtype)


__all__ = ["attend"]
