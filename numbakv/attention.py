"""``attend``: attention over a cache's per-sequence page table.

``get()`` gives attention the union of every batch sequence's cells and a dense mask, so each
token pays for every other sequence's history. ``attend`` reads, for each sequence of the batch,
only the cells its page list names (``cache.page_table()``), and computes exactly the attention
that ``get()``'s mask defines (causal, sliding window, chunks, ``set_causal``).

Backends:

* ``"torch"``: per sequence, scaled-dot-product attention over its cells. When a sequence's
  cells lie densely in one run of the cell pool (the usual case: contiguous placement), it reads
  a zero-copy view of that run, masking the few cells of other sequences; otherwise it gathers
  its cells. CPU and CUDA.
* ``"flashinfer"``: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (every sequence has one
  query) or ``BatchPrefillWithPagedKVCacheWrapper`` on the page table, with ``causal`` and
  ``window_left`` where they express the mask and a custom mask where they cannot (chunks,
  ``set_causal``, queries that are not the sequence's last positions, position gaps). CUDA only;
  planned once per forward pass and reused by every layer.
* ``"dense"``: ``get()`` and its mask, in float32 (the reference; pays for the union).
* ``"auto"``: ``"flashinfer"`` when it can run (importable, cache and ``q`` on CUDA, V not
  permuted), else ``"torch"``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
from ._jit import njit

from .pages import HostPages, columns_mask, plan_parts, token_mask

BACKENDS = ("auto", "torch", "flashinfer", "dense")

#: A sequence's run of the pool is read as a view when it holds at most this many cells that the
#: sequence does not see (relative to its visible count) - masking them is cheaper than a gather.
_SPAN_SLACK = 0.25
_SPAN_MIN_SLACK = 64
#: Otherwise (on the CPU) its list is split: pool runs of at least _MIN_RUN cells whose listed
#: cells are at most _MAX_GAP apart are read as views, the rest is gathered.
_MIN_RUN = 256
_MAX_GAP = 32
#: parts of at most this many cells are computed with matmuls instead of the flash kernel
_SMALL_PART = 256
#: On the CPU, every sequence that sees at most this many cells and has at most _PACK_TOKENS
#: queries is computed in one single-threaded numba call for the whole batch (gathered once):
#: a torch call per such sequence costs more than its arithmetic, and on a loaded CPU each
#: parallel torch op also waits for its worker threads to be scheduled.
_PACK_CELLS = 512
_PACK_TOKENS = 64
#: exp(x) for x below this is a float32 denormal (or 0): such weights are flushed to exactly 0,
#: because arithmetic on denormals runs ~100x slower on x86 and changes nothing visible
_EXP_FLUSH = -87.0


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is an optional dependency
        raise ImportError("numbakv.attention.attend needs PyTorch (pip install torch)") from exc
    return torch


def flashinfer_available() -> bool:
    """Whether the FlashInfer backend can be imported."""
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def attend(q: Any, cache: Any, *, scale: Optional[float] = None,
           soft_cap: Optional[float] = None, backend: str = "auto") -> Any:
    """Attention of this forward pass's queries over the cache.

    Args:
        q: torch tensor ``[batch, n_heads, head_dim]`` on the cache's device, rows in batch
            order; ``n_heads`` a multiple of the cache's ``local_kv_heads`` (grouped-query
            attention: query head ``h`` reads KV head ``h // (n_heads // local_kv_heads)``).
            A head-sharded cache (``CacheConfig(head_shard=...)``) holds only its rank's KV
            heads: ``q`` then holds the rank's query heads (the ones that read those KV heads).
        cache: a ``CausalCache``, ``WrapperCache`` (the current layer's cache) or
            ``EncoderCache``, after ``start_forward`` (and ``put`` for the current layer).
        scale: factor on ``q . k`` (default ``1 / sqrt(head_dim)``).
        soft_cap: if given, scores become ``soft_cap * tanh(score / soft_cap)`` (after scaling,
            before the mask).
        backend: ``"auto"``, ``"torch"``, ``"flashinfer"`` or ``"dense"``.

    Returns:
        torch tensor ``[batch, n_heads, v_head_dim]`` on ``q``'s device, ``q``'s dtype, rows in
        batch order: exactly the attention ``get()``'s mask defines.
    """
    torch = _torch()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    src = getattr(cache, "_attention_cache", None)
    if src is None:
        raise ValueError("cache must be a numbakv CausalCache, WrapperCache or EncoderCache, got "
                         f"{type(cache).__name__}")
    try:
        host = cache._host_pages()
    except ValueError as exc:
        raise ValueError("attend() needs a forward pass: call cache.start_forward first "
                         f"({exc})") from None
    cfg = src.config
    batch = host.q_positions.shape[0]
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q must be a torch.Tensor [batch, n_heads, head_dim], got "
                         f"{type(q).__name__}")
    if q.ndim != 3 or q.shape[0] != batch or q.shape[2] != cfg.head_dim:
        raise ValueError(f"q must have shape [batch={batch}, n_heads, head_dim={cfg.head_dim}], "
                         f"got {list(q.shape)}")
    if q.shape[1] % cfg.local_kv_heads:
        raise ValueError(f"q's n_heads ({q.shape[1]}) must be a multiple of n_kv_heads held by "
                         f"the cache (local_kv_heads={cfg.local_kv_heads})")
    if not q.is_floating_point():
        raise ValueError(f"q must be a floating-point tensor, got {q.dtype}")
    on_cuda = src.device == "cuda"
    if (q.device.type == "cuda") != on_cuda:
        raise ValueError(f"q must be on the cache's device ({src.device}), got {q.device}")
    if scale is None:
        scale = 1.0 / math.sqrt(cfg.head_dim)
    scale = float(scale)
    if soft_cap is not None:
        soft_cap = float(soft_cap)
        if not soft_cap > 0:
            raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")
    permuted = bool(getattr(cfg, "permuted_v", False)) and hasattr(src, "storage")
    # quantized K/V: the cell pool holds raw blocks; get() dequantizes the attended range
    quantized = bool(getattr(getattr(src, "storage", None), "quantized", False))
    if backend == "auto":
        backend = "dense" if quantized else \
            "flashinfer" if (on_cuda and not permuted and flashinfer_available()) else "torch"
    elif quantized and backend != "dense":
        raise ValueError(f"backend={backend!r} reads the cell pool, which holds quantized blocks "
                         f"(k_dtype={cfg.k_dtype!r}, v_dtype={cfg.v_dtype!r}): use "
                         "backend='dense' or 'auto'")
    if backend == "dense":
        return _dense(torch, q, cache, scale, soft_cap, permuted)
    key_pool, value_pool = (torch.from_dlpack(x) for x in cache.layer_pool())
    if backend == "flashinfer":
        if not on_cuda or not flashinfer_available():
            raise ValueError("backend='flashinfer' needs flashinfer installed and a cache on CUDA")
        if permuted:
            raise ValueError("backend='flashinfer' needs V in [n_cells, heads, dim] layout "
                             "(the cache has permuted_v=True): use backend='torch'")
        return _flashinfer(torch, q, host, key_pool, value_pool, scale, soft_cap)
    return _torch_paged(torch, q, host, key_pool, value_pool, scale, soft_cap, permuted)


# --------------------------------------------------------------------------------------------
# one sequence: [L, H, D] queries over [n, Hkv, D] keys, grouped-query attention folded
# --------------------------------------------------------------------------------------------

def _attend_one(torch, q, k, v_hnd, mask, scale: float, soft_cap: Optional[float]):
    """q ``[L, H, D]``, k ``[n, Hkv, D]``, v_hnd ``[Hkv, n, Dv]``, mask bool ``[L, n]`` or None
    (all visible) -> ``[L, H, Dv]``. The ``g = H // Hkv`` query heads of a KV head are folded
    into the query axis, so K/V are read once per KV head and never repeated."""
    L, H, D = q.shape
    hkv = k.shape[1]
    g = H // hkv
    qf = q.reshape(L, hkv, g, D).transpose(0, 1).reshape(hkv, L * g, D)
    kf = k.transpose(0, 1)
    if k.dtype != q.dtype:
        kf = kf.to(q.dtype)
        v_hnd = v_hnd.to(q.dtype)
    m = None
    if mask is not None:
        m = mask[:, None, :].expand(L, g, mask.shape[1]).reshape(L * g, mask.shape[1])
    if soft_cap is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            qf[None], kf[None], v_hnd[None], attn_mask=None if m is None else m[None, None],
            scale=scale)[0]
    else:
        s = torch.matmul(qf.float(), kf.float().transpose(-1, -2)) * scale
        s = soft_cap * torch.tanh(s / soft_cap)
        if m is not None:
            s = s.masked_fill(~m[None], float("-inf"))
        out = torch.matmul(torch.softmax(s, dim=-1), v_hnd.float()).to(q.dtype)
    dv = out.shape[-1]
    return out.reshape(hkv, L, g, dv).transpose(0, 1).reshape(L, H, dv)


def _value_hnd(value, permuted: bool):
    """``[Hkv, n, Dv]`` view of a value slice (``[n, Hkv, Dv]``, or ``[Hkv, Dv, n]`` permuted)."""
    return value.transpose(1, 2) if permuted else value.transpose(0, 1)


def _fold_mask(torch, mask, g: int, dtype):
    """bool ``[L, n]`` -> additive ``[L * g, n]`` in ``dtype`` (row ``l * g + i`` is query
    head ``i`` of the group, token ``l``), the form the CPU flash kernel takes."""
    L, n = mask.shape
    m = torch.zeros((L, n), dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return m[:, None, :].expand(L, g, n).reshape(L * g, n)


def _part_with_lse(torch, qf, k, v_hnd, mask, scale):
    """One part of a split sequence on the CPU: (out ``[Hkv, L*g, Dv]``, lse ``[Hkv, L*g]``)
    from PyTorch's CPU flash-attention kernel (the kernel ``scaled_dot_product_attention``
    runs, asked for its log-sum-exp)."""
    g = qf.shape[1] // mask.shape[0] if mask is not None else 1
    kf = k.transpose(0, 1)
    if mask is not None and bool(mask.all()):
        mask = None
    if kf.dtype != qf.dtype:
        kf, v_hnd = kf.to(qf.dtype), v_hnd.to(qf.dtype)
    if k.shape[0] <= _SMALL_PART:
        # a few cells: plain matmuls (the flash kernel's fixed cost is ~a 4k-cell call)
        sc = torch.matmul(qf.float(), kf.float().transpose(-1, -2)) * scale
        if mask is not None:
            n = mask.shape[1]
            sees = mask[:, None, :].expand(mask.shape[0], g, n).reshape(-1, n)
            sc = sc.masked_fill(~sees[None], float("-inf"))
        lse = torch.logsumexp(sc, dim=-1)
        d = sc - lse[..., None]
        p = torch.exp(d.masked_fill_(d < _EXP_FLUSH, float("-inf"))).nan_to_num_(0.0)
        return torch.matmul(p, v_hnd.float()), lse
    if v_hnd.stride(-1) != 1:       # permuted V: the kernel wants unit-stride rows
        v_hnd = v_hnd.contiguous()
    m = None if mask is None else _fold_mask(torch, mask, g, qf.dtype)[None, None]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qf[None], kf[None], v_hnd[None], attn_mask=m, scale=scale)
    lse = lse[0]
    if mask is not None and not bool(mask.all()):
        # the kernel reports lse 0 (not -inf) for a row that sees nothing in this part
        sees = mask.any(1)[:, None].expand(mask.shape[0], g).reshape(-1)
        lse = lse.masked_fill(~sees[None, :], float("-inf"))
    return out[0], lse


@njit(cache=True)
def _add_small_part(qf, k, v, mask, scale, out, lse):
    """Fold attention over a few gathered cells into a partial result, in place (one thread: on
    a loaded CPU every extra parallel torch op waits for its threads to be scheduled).

    qf float32 ``[Hkv, R, D]`` (row ``r`` is token ``r // g``), k ``[m, Hkv, D]``, v ``[Hkv, m,
    Dv]``, mask bool ``[L, m]``; out float32 ``[Hkv, R, Dv]`` and lse ``[Hkv, R]`` hold the
    attention and log-sum-exp over the other cells (lse -inf: none)."""
    hkv, rows, dim = qf.shape
    m = k.shape[0]
    g = rows // mask.shape[0]
    dv = v.shape[2]
    s = np.empty(m, np.float32)
    for h in range(hkv):
        for r in range(rows):
            t = r // g
            mx = -np.inf
            for j in range(m):
                if mask[t, j]:
                    acc = np.float32(0.0)
                    for d in range(dim):
                        acc += qf[h, r, d] * k[j, h, d]
                    s[j] = acc * scale
                    mx = max(mx, s[j])
            if mx == -np.inf:
                continue
            tot = 0.0
            for j in range(m):
                if mask[t, j]:
                    tot += math.exp(s[j] - mx)
            small = mx + math.log(tot)
            old = lse[h, r]
            new = small if old == -np.inf else max(old, small) + math.log1p(
                math.exp(-abs(old - small)))
            w_old = 0.0 if old == -np.inf else math.exp(old - new)
            for d in range(dv):
                out[h, r, d] = out[h, r, d] * w_old if w_old > 0.0 else 0.0
            for j in range(m):
                if mask[t, j] and s[j] - new > _EXP_FLUSH:     # no denormal weights
                    p = math.exp(s[j] - new)
                    for d in range(dv):
                        out[h, r, d] += p * v[h, j, d]
            lse[h, r] = new


@njit(cache=True)
def _pack_index(kv_indptr, seqs):
    """List indices (into ``kv_indices``) of the cells of batch sequences ``seqs``, concatenated,
    and ``ptr int64 [len(seqs) + 1]``: sequence ``seqs[i]``'s cells are rows ``ptr[i]:ptr[i+1]``."""
    ptr = np.zeros(seqs.shape[0] + 1, np.int64)
    for i in range(seqs.shape[0]):
        b = seqs[i]
        ptr[i + 1] = ptr[i] + kv_indptr[b + 1] - kv_indptr[b]
    idx = np.empty(ptr[-1], np.int64)
    for i in range(seqs.shape[0]):
        b = seqs[i]
        for j in range(kv_indptr[b + 1] - kv_indptr[b]):
            idx[ptr[i] + j] = kv_indptr[b] + j
    return idx, ptr


@njit(cache=True, fastmath={"reassoc", "contract"})   # no nnan/ninf: -inf marks masked cells
def _attend_packed(q, k, v, seqs, ptr, qo_indptr, token_order, kv_pos, q_pos, causal, window,
                   chunk, scale, soft_cap, out):
    """Attention of several short sequences at once (single-threaded, exact softmax with max
    subtraction; weights below exp(_EXP_FLUSH) are flushed to 0 so no denormal arises).

    q float32 ``[T, H, D]`` (batch rows), k float32 ``[m, Hkv, D]`` and v float32 ``[m, Hkv,
    Dv]`` the gathered cells (sequence ``seqs[i]``'s are rows ``ptr[i]:ptr[i+1]``, positions
    ``kv_pos``), out float32 ``[T, H, Dv]``: the rows of these sequences' tokens are written
    (a token that sees no cell gets zeros). soft_cap <= 0: none."""
    H = q.shape[1]
    dim = q.shape[2]
    hkv = k.shape[1]
    g = H // hkv
    dv = v.shape[2]
    s = np.empty(k.shape[0], np.float32)
    acc = np.empty(dv, np.float32)
    for i in range(seqs.shape[0]):
        b = seqs[i]
        c0, c1 = ptr[i], ptr[i + 1]
        for qi in range(qo_indptr[b], qo_indptr[b + 1]):
            t = token_order[qi]
            p = np.int64(q_pos[t])
            lo = np.int64(0)
            if window >= 0:
                lo = max(lo, p - window)
            if chunk > 0:
                lo = max(lo, p - p % chunk)
            hi = p if causal[t] != 0 else np.int64(2 ** 62)
            for h in range(H):
                kh = h // g
                mx = -np.inf
                for j in range(c0, c1):
                    kp = kv_pos[j]
                    if kp < lo or kp > hi:
                        s[j] = -np.inf
                        continue
                    a = np.float32(0.0)
                    for d in range(dim):
                        a += q[t, h, d] * k[j, kh, d]
                    a *= scale
                    if soft_cap > 0:
                        a = soft_cap * math.tanh(a / soft_cap)
                    s[j] = a
                    mx = max(mx, a)
                for d in range(dv):
                    acc[d] = 0.0
                if mx == -np.inf:
                    for d in range(dv):
                        out[t, h, d] = 0.0
                    continue
                tot = np.float32(0.0)
                for j in range(c0, c1):
                    x = s[j] - mx
                    if x > _EXP_FLUSH:
                        w = np.float32(math.exp(x))
                        tot += w
                        for d in range(dv):
                            acc[d] += w * v[j, kh, d]
                for d in range(dv):
                    out[t, h, d] = acc[d] / tot


def _pack_plan(torch, host: HostPages):
    """Which sequences of this pass are computed packed, and everything about them that does
    not change between layers (planned once per forward pass, kept in ``host.plans``)."""
    key = ("packed", _PACK_CELLS, _PACK_TOKENS)
    plan = host.plans.get(key)
    if plan is None:
        short = (np.diff(host.kv_indptr) <= _PACK_CELLS) & \
            (np.diff(host.qo_indptr) <= _PACK_TOKENS)
        seqs = np.flatnonzero(short).astype(np.int64)
        idx, ptr = _pack_index(host.kv_indptr.astype(np.int64), seqs)
        rows = np.concatenate([host.token_order[host.qo_indptr[b]:host.qo_indptr[b + 1]]
                               for b in seqs]).astype(np.int64) if len(seqs) else None
        plan = {"short": short, "seqs": seqs, "ptr": ptr,
                "cells": torch.from_numpy(host.kv_indices[idx].astype(np.int64)),
                "kv_pos": host.kv_positions[idx].astype(np.int64),
                "qo_indptr": host.qo_indptr.astype(np.int64),
                "token_order": host.token_order.astype(np.int64),
                "q_pos": host.q_positions.astype(np.int64),
                "rows": None if rows is None else torch.from_numpy(rows),
                "rest": np.flatnonzero(~short).tolist()}
        host.plans[key] = plan
    return plan


def _packed(torch, q, host: HostPages, plan: dict, key_pool, value_pool, scale, soft_cap,
            permuted, out):
    """The plan's sequences through :func:`_attend_packed`: their cells gathered with one
    ``index_select`` per pool, results scattered into ``out`` (or returned, rows in batch
    order, when ``out`` is None)."""
    cells = plan["cells"]
    k = key_pool.index_select(0, cells).float().numpy()
    if permuted:
        v = value_pool.index_select(2, cells).permute(2, 0, 1).float().contiguous().numpy()
    else:
        v = value_pool.index_select(0, cells).float().numpy()
    qn = q.detach().float().contiguous().numpy()
    res = np.empty((q.shape[0], q.shape[1], v.shape[2]), np.float32)
    rule = host.rule
    _attend_packed(qn, k, v, plan["seqs"], plan["ptr"], plan["qo_indptr"], plan["token_order"],
                   plan["kv_pos"], plan["q_pos"], rule.causal, int(rule.window),
                   int(rule.chunk), np.float32(scale),
                   np.float32(soft_cap if soft_cap is not None else 0.0), res)
    res_t = torch.from_numpy(res)
    if out is None:
        return res_t.to(q.dtype)
    rows = plan["rows"]
    out[rows] = res_t[rows].to(out.dtype)
    return out


def _merge_parts(torch, outs, lses):
    """Softmax-weighted merge of attention over disjoint key sets (flash-decoding's split-K)."""
    if len(outs) == 1:
        return outs[0].float(), lses[0]
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    total = None
    for o, l in zip(outs, lses):
        d = l - lse
        w = torch.exp(d.masked_fill_(d < _EXP_FLUSH, float("-inf")))[..., None]
        part = torch.where(w > 0, o.float() * w, 0.0)   # a part a row cannot see may hold NaN
        total = part if total is None else total + part
    return total, lse


def _torch_paged(torch, q, host: HostPages, key_pool, value_pool, scale, soft_cap, permuted):
    dev = q.device
    n_b = host.seq_ids.shape[0]
    H = q.shape[1]
    hkv = key_pool.shape[1]
    g = H // hkv
    dv = value_pool.shape[1] if permuted else value_pool.shape[2]
    split = dev.type == "cpu" and soft_cap is None
    if n_b == 1 and host.qo_indptr[1] == q.shape[0]:
        out = None      # one sequence holds the whole batch: results are already in batch order
    else:
        out = torch.empty((q.shape[0], H, dv), dtype=q.dtype, device=dev)
    todo = range(n_b)
    if dev.type == "cpu":
        plan = _pack_plan(torch, host)
        if len(plan["seqs"]):
            packed = _packed(torch, q, host, plan, key_pool, value_pool, scale, soft_cap,
                             permuted, out)
            if out is None:
                return packed
            todo = plan["rest"]

    def run_view(lo, hi):
        return key_pool[lo:hi], value_pool[:, :, lo:hi] if permuted else value_pool[lo:hi]

    def gather(idx):
        idx = torch.from_numpy(idx.astype(np.int64)).to(dev)
        v = value_pool.index_select(2, idx) if permuted else value_pool.index_select(0, idx)
        return key_pool.index_select(0, idx), v

    for b in todo:
        q0, q1 = int(host.qo_indptr[b]), int(host.qo_indptr[b + 1])
        L = q1 - q0
        toks = host.token_order[q0:q1]
        first, last = int(toks[0]), int(toks[-1])
        contiguous = last - first + 1 == L
        qb = q[first:last + 1] if contiguous else q[torch.from_numpy(toks.astype(np.int64)).to(dev)]
        k0, k1 = int(host.kv_indptr[b]), int(host.kv_indptr[b + 1])
        n_vis = k1 - k0
        lo, hi = int(host.cell_lo[b]), int(host.cell_hi[b])
        span = hi - lo
        if span <= n_vis + max(_SPAN_MIN_SLACK, int(n_vis * _SPAN_SLACK)):
            # one run of the pool: zero-copy view, the cells not listed are masked
            k, v = run_view(lo, hi)
            need_mask = not (L == 1 and span == n_vis)
            mask = token_mask(host, b, base=lo, width=span) if need_mask else None
        elif split:
            # dense runs of the pool read as views, the scattered rest gathered; merged by LSE
            runs, cols, gathered = plan_parts(host, b, min_run=_MIN_RUN, max_gap=_MAX_GAP)
            width = int(cols.max()) + 1
            full = columns_mask(host, b, cols, width)
            qf = qb.reshape(L, hkv, g, -1).transpose(0, 1).reshape(hkv, L * g, -1)
            outs, lses = [], []
            c = 0
            parts = [run_view(int(a), int(e)) for a, e in runs]
            small = None
            if len(gathered):
                rest = gather(host.kv_indices[k0:k1][gathered])
                if len(runs) and len(gathered) <= _SMALL_PART:
                    small = rest
                else:
                    parts.append(rest)
            for k, v in parts:
                n = k.shape[0]
                part_mask = full[:, c:c + n]
                c += n
                # a part every token sees whole (the usual decode case) needs no mask
                m = None if part_mask.all() else torch.from_numpy(part_mask).to(dev)
                o, lse = _part_with_lse(torch, qf, k, _value_hnd(v, permuted), m, scale)
                outs.append(o)
                lses.append(lse)
            merged, lse = _merge_parts(torch, outs, lses)
            if small is not None:
                m = full[:, c:]
                _add_small_part(qf.float().contiguous().numpy(), small[0].float().numpy(),
                                _value_hnd(small[1], permuted).float().numpy(), m,
                                np.float32(scale), merged.numpy(), lse.contiguous().numpy())
            merged = merged.to(q.dtype)
            res = merged.reshape(hkv, L, g, dv).transpose(0, 1).reshape(L, H, dv)
            if out is None:
                return res
            _scatter(torch, out, res, toks, first, last, contiguous, dev)
            continue
        else:
            k, v = gather(host.kv_indices[k0:k1])
            mask = token_mask(host, b) if L > 1 else None
        mask_t = None if mask is None else torch.from_numpy(mask).to(dev)
        res = _attend_one(torch, qb, k, _value_hnd(v, permuted), mask_t, scale, soft_cap)
        if out is None:
            return res
        _scatter(torch, out, res, toks, first, last, contiguous, dev)
    return out


def _scatter(torch, out, res, toks, first, last, contiguous, dev):
    if contiguous:
        out[first:last + 1] = res
    else:
        out[torch.from_numpy(toks.astype(np.int64)).to(dev)] = res


# --------------------------------------------------------------------------------------------
# dense: get() + mask (the reference)
# --------------------------------------------------------------------------------------------

def _dense(torch, q, cache, scale, soft_cap, permuted):
    key, value, mask = cache.get()
    k = torch.from_dlpack(key)
    v = torch.from_dlpack(value)
    m = torch.from_dlpack(mask) if not isinstance(mask, np.ndarray) else torch.from_numpy(mask)
    if k.ndim == 4:
        # per-sequence streams: key [n_b, n_kv, Hkv, D] and mask [n_b, rows, n_kv], stream b's
        # rows are its tokens in token_order (get()'s layout)
        host = cache._host_pages()
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1] if not permuted else v.shape[2],
                          dtype=q.dtype, device=q.device)
        for b in range(host.seq_ids.shape[0]):
            toks = torch.as_tensor(host.token_order[host.qo_indptr[b]:host.qo_indptr[b + 1]]
                                   .astype(np.int64), device=q.device)
            out[toks] = _dense_rows(torch, q[toks], k[b], v[b], m[b, :len(toks)].to(q.device)
                                    == 0, scale, soft_cap, permuted)
        return out
    m = m[:q.shape[0]].to(q.device)
    return _dense_rows(torch, q, k, v, m == 0, scale, soft_cap, permuted)


def _dense_rows(torch, q, k, v, visible, scale, soft_cap, permuted):
    """Softmax attention of ``q [L, H, D]`` over ``k [n, Hkv, D]``/``v`` where ``visible
    [L, n]``, in float32 (GQA: query head h reads KV head h // (H // Hkv))."""
    L, H, D = q.shape
    hkv = k.shape[1]
    g = H // hkv
    vh = _value_hnd(v, permuted).float()            # [Hkv, n, Dv]
    kh = k.transpose(0, 1).float()                  # [Hkv, n, D]
    qh = q.float().reshape(L, hkv, g, D).permute(1, 2, 0, 3)   # [Hkv, g, L, D]
    s = torch.matmul(qh, kh[:, None].transpose(-1, -2)) * scale    # [Hkv, g, L, n]
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    s = s.masked_fill(~visible, float("-inf"))
    out = torch.matmul(torch.softmax(s, dim=-1), vh[:, None])      # [Hkv, g, L, Dv]
    return out.permute(2, 0, 1, 3).reshape(L, H, -1).to(q.dtype)


# --------------------------------------------------------------------------------------------
# FlashInfer (CUDA)
# --------------------------------------------------------------------------------------------

_WORKSPACE_BYTES = 128 * 1024 * 1024
_workspaces: dict = {}


def _flashinfer_mode(host: HostPages) -> str:
    """How FlashInfer expresses this batch's mask: ``"decode"`` (one query per sequence: each
    sees its whole page list), ``"causal"`` (causal=True and window_left express it), or
    ``"custom"`` (a packed custom mask)."""
    if (np.diff(host.qo_indptr) == 1).all():
        return "decode"
    rule = host.rule
    if not host.trailing or rule.chunk > 0:
        return "custom"
    # window_left counts pages; it equals the position window when positions have no gaps
    if rule.window >= 0 and len(host.kv_positions):
        gaps = np.diff(host.kv_positions) != 1
        gaps[host.kv_indptr[1:-1] - 1] = False     # boundaries between sequences
        if gaps.any():
            return "custom"
    return "causal"


def _flashinfer(torch, q, host: HostPages, key_pool, value_pool, scale, soft_cap):
    import flashinfer
    dev = q.device
    n_cells, hkv, d = key_pool.shape
    H = q.shape[1]
    dv = value_pool.shape[2]
    pt = host.table
    as_t = (lambda a: torch.as_tensor(a, device=dev))
    key = (H, hkv, d, dv, str(q.dtype), str(key_pool.dtype), scale, soft_cap)
    wrapper = host.plans.get(("flashinfer",) + key)
    if wrapper is None:
        ws = _workspaces.get(dev)
        if ws is None:
            ws = _workspaces[dev] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        mode = _flashinfer_mode(host)
        if mode == "decode" and dv != d:   # the decode kernels take one head_dim for K and V
            mode = "causal" if host.trailing and host.rule.chunk <= 0 else "custom"
        common = dict(q_data_type=q.dtype, kv_data_type=key_pool.dtype, sm_scale=scale,
                      logits_soft_cap=soft_cap)
        if mode == "decode":
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            wrapper.plan(as_t(pt.kv_indptr), as_t(pt.kv_indices), as_t(pt.kv_last_page_len), H,
                         hkv, d, 1, **common)
        else:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            extra: dict[str, Any] = {}
            if mode == "causal":
                extra = dict(causal=True, window_left=host.rule.window)
            else:
                masks = [token_mask(host, b).reshape(-1) for b in range(host.seq_ids.shape[0])]
                extra = dict(custom_mask=torch.from_numpy(np.concatenate(masks)).to(dev))
            wrapper.plan(as_t(pt.qo_indptr), as_t(pt.kv_indptr), as_t(pt.kv_indices),
                         as_t(pt.kv_last_page_len), H, hkv, d, 1, head_dim_vo=dv, **extra,
                         **common)
        host.plans[("flashinfer",) + key] = wrapper
    order = torch.as_tensor(pt.token_order, device=dev).long()
    res = wrapper.run(q.index_select(0, order),
                      (key_pool.reshape(n_cells, 1, hkv, d), value_pool.reshape(n_cells, 1, hkv,
                                                                                 dv)))
    out = torch.empty((q.shape[0], H, dv), dtype=q.dtype, device=dev)
    out[order] = res.to(q.dtype)
    return out


__all__ = ["attend", "flashinfer_available", "BACKENDS"]
