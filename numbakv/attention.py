"""``attend``: attention over a cache's per-sequence page table.

``get()`` gives attention the union of every batch sequence's cells and a dense mask, so each
token pays for every other sequence's history. ``attend`` reads, for each sequence of the batch,
only the cells its page list names (``cache.page_table()``), and computes exactly the attention
that ``get()``'s mask defines (causal, sliding window, chunks, ``set_causal``).

Backends:

* ``"torch"``: per sequence, scaled-dot-product attention over its cells. On the CPU, decodes,
  short lists and (with 16-bit storage) chunks of up to 32 queries go through numbakv's own
  numba kernel instead (:func:`_attend_pool`): it reads each listed cell's K/V row, every KV
  head at once, straight from the pool, converts float16/bfloat16 per tile and accumulates in
  float32 (online softmax), one work item per sequence or part of a long list (split-K) on
  numba's threads. For the other sequences: when its cells lie densely in one run of the cell
  pool (the usual case: contiguous placement), a zero-copy view of that run, masking the few
  cells of other sequences; otherwise its cells gathered, or (CPU) pool runs and a gathered
  rest merged by log-sum-exp. CPU and CUDA.
* ``"flashinfer"``: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (every sequence has one
  query) or ``BatchPrefillWithPagedKVCacheWrapper`` on the page table, with ``causal`` and
  ``window_left`` where they express the mask and a custom mask where they cannot (chunks,
  ``set_causal``, queries that are not the sequence's last positions, position gaps). CUDA only;
  planned once per forward pass and reused by every layer.
* ``"flash_attn"``: FlashAttention's ``flash_attn_with_kvcache`` with ``block_table`` over the
  pool in pages (:func:`flash_attn_unfit` says when it computes the pass exactly: float16 /
  bfloat16, ``CacheConfig(page_size)`` a multiple of 256 -- its paged block size --, a decode
  pass without window or chunks). CUDA only.
* ``"dense"``: ``get()`` and its mask, in float32 (the reference; pays for the union).
* ``"auto"``: ``"flashinfer"`` when it can run (importable - probed once per process -, cache
  and ``q`` on CUDA, V not permuted); else ``"flash_attn"`` when importable (probed once) and
  the pass fits it; else on CUDA numbakv's batched paged kernel
  (:mod:`numbakv.kernels.decode`: one launch per layer for every token of the pass, reading the
  pool through the device page table, split-K with a log-sum-exp merge, on the cache's stream
  after ``q``'s producer; a permuted V read through its strides) when the shape fits it (query
  heads per KV head <= 16, group x head_dim <= 2048) and no sequence has more than 32 queries in the pass (long
  prefills go to PyTorch's flash kernel); else ``"torch"``.

Quantized K/V (q8_0, q4_0, float8_e4m3; ``k_dtype``/``v_dtype``) are read as stored: on the CPU
by numbakv's numba kernel, on CUDA by the batched paged kernel (every pass whose shape it takes,
dequantizing in the kernel; rotated K/V (``kv_rotation``) with the query rotation and the
output's turn back in the kernel too); a shape neither takes goes through ``get()``
(``"dense"``).
"""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple, Optional, Tuple

import numpy as np
import llvmlite
from llvmlite import ir
import numba
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ._dlpack import BFloat16View
from ._jit import njit
from .config import latent_value_width
from .kernels import decode as _decode_kernel
from .kernels.quant import dequantize_block as _dequantize_block

from .pages import HostPages, columns_mask, plan_parts, token_mask, visible_lo
from .rotation import hadamard_blocks, rotate_queries, unrotate_output

BACKENDS = ("auto", "torch", "flashinfer", "flash_attn", "dense")

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
#: On the CPU, numbakv's own kernel (:func:`_attend_pool`) computes every sequence with at most
#: this many queries in the pass (decode), reading its cells straight from the pool: PyTorch's
#: CPU kernel reads the token-major float16 pool ~2x slower than the floor's head-major copy,
#: and a torch call per short sequence costs more than its arithmetic. -1 turns the kernel off.
_KERNEL_TOKENS = 4
#: ... at most this many with float16/bfloat16 storage (converted per tile, read once), where
#: PyTorch's kernel is slowest; longer float32 prefills go to PyTorch's flash kernel, whose
#: matrix products win once a K/V row serves many queries (measured: 8 queries over 4k cells)
_KERNEL_TOKENS_16BIT = 32
#: ... and every sequence that sees at most _SHORT_CELLS cells with at most _SHORT_TOKENS
#: queries (the demo's and hf.attach's many small parts)
_SHORT_CELLS = 512
_SHORT_TOKENS = 64
#: the kernel runs on numba's threads (one item per sequence or part of a long list) from this
#: much work, listed cells x queries x query heads; below it on one thread (waking the threads
#: costs more than a small batch's arithmetic, and on a loaded machine they wait to be scheduled)
_PARALLEL_WORK = 1 << 17
#: with fewer sequences than twice numba's threads, long lists are cut into parts of at least
#: this many cells (split-K, merged by their log-sum-exp), so one long decode uses every thread
_MIN_PART = 512
#: on CUDA the paged kernel (one block per token, KV head and part) serves passes whose
#: sequences have at most this many queries (decode, speculative verification, short chunks):
#: it reads a sequence's K/V once per query, so long prefills go to PyTorch's flash kernel
_GPU_KERNEL_TOKENS = 32
#: the process that imported this module: a child forked from it runs the kernel on one thread,
#: because numba's threading layer here (GNU OpenMP) aborts a forked child that starts a
#: parallel region after its parent ran one
_PID = os.getpid()
#: exp(x) for x below this is a float32 denormal (or 0): such weights are flushed to exactly 0,
#: because arithmetic on denormals runs ~100x slower on x86 and changes nothing visible
_EXP_FLUSH = -87.0
#: the CPU kernel's pool formats for plain K/V: (kfmt, vfmt, kscale, vscale, v_dim)
_PLAIN_FORMATS = (0, 0, 1.0, 1.0, 0)


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is an optional dependency
        raise ImportError("numbakv.attention.attend needs PyTorch (pip install torch)") from exc
    return torch


#: memoised answer of flashinfer_available(): a failed import is tried once per process, not on
#: every attend call (a failing import walks sys.path each time: tens of microseconds)
_FLASHINFER: Optional[bool] = None


def flashinfer_available() -> bool:
    """Whether the FlashInfer backend can be imported (probed once per process)."""
    global _FLASHINFER
    if _FLASHINFER is None:
        try:
            import flashinfer  # noqa: F401
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            _FLASHINFER = False
        else:
            _FLASHINFER = True
    return _FLASHINFER


#: memoised answer of flash_attn_available() (probed once per process, as FlashInfer's)
_FLASH_ATTN: Optional[bool] = None
#: flash_attn_with_kvcache's paged KV cache takes blocks of a multiple of this many tokens
#: (flash-attn 2.x: "Paged KV cache block size must be divisible by 256")
FLASH_ATTN_PAGE = 256


def flash_attn_available() -> bool:
    """Whether FlashAttention's ``flash_attn_with_kvcache`` can be imported (probed once per
    process)."""
    global _FLASH_ATTN
    if _FLASH_ATTN is None:
        try:
            from flash_attn import flash_attn_with_kvcache  # noqa: F401
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            _FLASH_ATTN = False
        else:
            _FLASH_ATTN = True
    return _FLASH_ATTN


def attend(q: Any, cache: Any, *, scale: Optional[float] = None,
           soft_cap: Optional[float] = None, backend: str = "auto",
           v_dim: Optional[int] = None) -> Any:
    """Attention of this forward pass's queries over the cache.

    On a V-less MLA latent cache (``v_head_dim=0``, one "head" of ``kv_lora_rank + rope``
    values) this is MLA in its absorbed form: ``q`` holds each query head's absorbed query
    (``q_nope @ W_UK`` then ``q_rope``, ``[batch, n_heads, kv_lora_rank + rope]``), scores are
    ``q . latent`` over the whole row, and the output is the softmax-weighted sum of the rows'
    first ``v_dim`` values (the latent ``c_kv``), ``[batch, n_heads, v_dim]``: the caller applies
    ``W_UV``. ``v_dim`` defaults to the cache's ``RopeShift.offset`` (``kv_lora_rank``). On CUDA
    (backend ``"auto"``, passes of at most 32 queries a sequence) numbakv's latent kernel reads
    the rows as stored (float, q8_0/q4_0/float8, rotated, FlashMLA's ``fp8_ds_mla``): each
    staged tile of rows serves a tile of up to 8 query heads.

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
        backend: ``"auto"``, ``"torch"``, ``"flashinfer"``, ``"flash_attn"`` or ``"dense"``.

        v_dim: V-less caches only: how many leading values of each latent row are the value
            (default: the cache's ``RopeShift`` offset).

    Returns:
        torch tensor ``[batch, n_heads, v_head_dim]`` (``[batch, n_heads, v_dim]`` on a V-less
        cache) on ``q``'s device, ``q``'s dtype, rows in batch order: exactly the attention
        ``get()``'s mask defines.
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
    latent_v = _latent_v_dim(src, cfg, v_dim)
    if scale is None:
        scale = 1.0 / math.sqrt(cfg.head_dim)
    scale = float(scale)
    if soft_cap is not None:
        soft_cap = float(soft_cap)
        if not soft_cap > 0:
            raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")
    if latent_v and on_cuda and backend == "auto":
        # MLA on CUDA: the latent kernel (each staged tile of rows serves a tile of heads)
        rows, kw = _latent_pool(src) if _latent_kernel_takes(src, q.shape[1], batch, latent_v,
                                                              host) else (None, None)
        if rows is not None:
            return _gpu_latent(torch, q, host, src, rows, kw, scale, soft_cap, latent_v,
                               "cuda").to(q.dtype)
    route = _attend_route(src, q.shape[1], batch, backend, latent_v, on_cuda)
    backend, formats, permuted, quantized = route.backend, route.formats, route.permuted, \
        route.quantized
    gpu_kernel = route.gpu_kernel
    if on_cuda and not gpu_kernel:
        _after_cache(torch, src, q)
    if route.rotated:
        # llama.cpp's rotated quantized K/V: the cache holds H k and H v (get() hands them out
        # as stored), so the queries are rotated like the keys ((H q) . (H k) = q . k) and the
        # output, H times the true one, is turned back (H @ H = I); float32 in between
        if formats is not None and on_cuda and backend != "dense":
            # the GPU kernel rotates the queries and turns its output back itself
            return _gpu_quantized(torch, q, host, src, scale, soft_cap, formats,
                                  "cuda").to(q.dtype)
        qr = rotate_queries(q.float(), cfg) if cfg.k_rotation else q
        out = _quantized_paged(torch, qr, host, src, scale, soft_cap, formats) \
            if formats is not None and backend != "dense" else \
            _dense(torch, qr, cache, scale, soft_cap, permuted, latent_v)
        if latent_v:   # MLA: the values are the latent's first dims, rotated as keys
            if latent_v % cfg.k_rotation:
                raise ValueError(f"v_dim={latent_v} must be a multiple of the latent's "
                                 f"Walsh-Hadamard block {cfg.k_rotation} (kv_rotation)")
            return hadamard_blocks(out.float(), cfg.k_rotation).to(q.dtype)
        return unrotate_output(out.float(), cfg).to(q.dtype) if cfg.v_rotation \
            else out.to(q.dtype)
    if backend == "dense":
        return _dense(torch, q, cache, scale, soft_cap, permuted, latent_v)
    if formats is not None:
        if on_cuda:
            return _gpu_quantized(torch, q, host, src, scale, soft_cap, formats,
                                  "cuda").to(q.dtype)
        return _quantized_paged(torch, q, host, src, scale, soft_cap, formats)
    pools = cache.layer_pool()
    if latent_v:   # the value is a view of the latent rows (llama.cpp: V is a view of K)
        kp = pools[0]
        pools = (kp, BFloat16View(kp.bits[..., :latent_v]) if isinstance(kp, BFloat16View)
                 else kp[..., :latent_v])
    if backend == "flash_attn" or (gpu_kernel and flash_attn_available()):
        why = "flash_attn is not installed" if not flash_attn_available() else \
            flash_attn_unfit(cfg, host, str(q.dtype).replace("torch.", ""), on_cuda=on_cuda,
                             permuted=permuted, quantized=quantized, latent=bool(latent_v))
        out = None
        if why is None:
            _after_cache(torch, src, q)
            key_pool, value_pool = (torch.from_dlpack(x) for x in pools)
            out = _flash_attn(torch, q, src, host, key_pool, value_pool, scale, soft_cap)
            if out is None:
                why = "the pass's cells do not fill pages in position order"
        if out is not None:
            return out
        if backend == "flash_attn":
            raise ValueError(f"backend='flash_attn' cannot compute this pass: {why}")
    if backend == "flashinfer":
        if not on_cuda or not flashinfer_available():
            raise ValueError("backend='flashinfer' needs flashinfer installed and a cache on CUDA")
        if permuted:
            raise ValueError("backend='flashinfer' needs V in [n_cells, heads, dim] layout "
                             "(the cache has permuted_v=True): use backend='torch'")
        key_pool, value_pool = (torch.from_dlpack(x) for x in pools)
        return _flashinfer(torch, q, host, key_pool, value_pool, scale, soft_cap)
    if gpu_kernel and _decode_kernel.fits(q.shape[1], cfg.local_kv_heads, cfg.head_dim,
                                          _value_dim(pools[1], permuted), batch) \
            and _max_queries(host) <= _GPU_KERNEL_TOKENS:
        return _gpu_attend(torch, q, host, pools, scale, soft_cap, "cuda",
                           src.storage, permuted=permuted).to(q.dtype)
    if gpu_kernel:      # the batched kernel does not fit: torch reads the pools on its stream
        _after_cache(torch, src, q)
    return _torch_paged(torch, q, host, pools, scale, soft_cap, permuted,
                        cfg.dtype == "bfloat16")


class _Route(NamedTuple):
    """What :func:`attend` runs for a pass's layer (:func:`_attend_route`)."""

    backend: str                  # the backend "auto" resolved to (or the one asked for)
    formats: Optional[tuple]      # a quantized pool numbakv's kernels read as stored, else None
    permuted: bool                # V stored [n_kv_heads, v_head_dim, n_cells]
    quantized: bool               # the pool holds quantized blocks
    gpu_kernel: bool              # CUDA: numbakv's batched paged kernel (no FlashInfer)
    rotated: bool                 # llama.cpp's rotated K/V: queries and output turned around

    @property
    def cpu_pool_kernel(self) -> bool:
        """Whether the pass's plain K/V pool is read by the torch backend (on the CPU: numbakv's
        kernel, where :func:`_kernel_plan` takes the sequences)."""
        return self.backend == "torch" and self.formats is None and not self.quantized \
            and not self.rotated and not self.gpu_kernel


def _attend_route(src: Any, n_heads: int, batch: int, backend: str, latent_v: int,
                  on_cuda: bool) -> _Route:
    """The dispatch decision of :func:`attend` (for ``q`` of ``n_heads`` heads and ``batch``
    tokens over attention cache ``src``): which backend, reading which pool format. The one
    place it is made: ``attend`` and the trusted per-pass route of numbakv.hf's dispatcher
    (:func:`_cpu_pass_route`) both follow it, so they cannot drift apart. Raises ``ValueError``
    for a backend that cannot read the pool."""
    cfg = src.config
    permuted = bool(getattr(cfg, "permuted_v", False)) and hasattr(src, "storage")
    # quantized K/V: the cell pool holds raw blocks. numbakv's kernels read them as they are
    # (dequantized per tile, never copied out): on the CPU the numba kernel, on CUDA the batched
    # paged kernel when the shape fits it; elsewhere get() dequantizes the range
    quantized = bool(getattr(getattr(src, "storage", None), "quantized", False))
    # (an MLA latent cache, whose V is a view of K, keeps get(): no V rows of its own)
    formats = _pool_formats(src) if quantized and not latent_v else None
    if formats is not None and on_cuda and not _decode_kernel.fits(
            n_heads, cfg.local_kv_heads, cfg.head_dim, cfg.v_head_dim, batch):
        formats = None                    # a shape the GPU kernel does not take: get()
    gpu_kernel = False
    if backend == "auto":
        backend = ("torch" if formats is not None else "dense") if quantized else \
            "flashinfer" if (on_cuda and not permuted and flashinfer_available()) else "torch"
        # on CUDA without FlashInfer: numbakv's batched paged kernel (one launch per layer;
        # permuted V read through its strides)
        gpu_kernel = backend == "torch" and on_cuda and not latent_v \
            and getattr(src, "storage", None) is not None
    elif quantized and backend != "dense" and not (backend == "torch" and formats is not None):
        raise ValueError(f"backend={backend!r} reads the cell pool, which holds quantized blocks "
                         f"(k_dtype={cfg.k_dtype!r}, v_dtype={cfg.v_dtype!r}): use "
                         "backend='dense' or 'auto'")
    rotated = bool(getattr(cfg, "k_rotation", 0) or getattr(cfg, "v_rotation", 0))
    return _Route(backend, formats, permuted, quantized, gpu_kernel, rotated)


def _cpu_pass_route(cache: Any, n_heads: int) -> Optional[tuple]:
    """Trusted (numbakv.hf's dispatcher, once per forward pass and attention cache): when
    ``attend(q, cache)`` (``q`` of ``n_heads`` heads, backend "auto") on a CPU cache would run
    the CPU kernel over every sequence of the pass (:func:`_attend_route` decides, as for
    ``attend``), ``(host, plan, permuted, bf16)`` for :func:`_attend_cpu_routed`; else None
    (the caller uses ``attend``). The page table and plan are the pass's, shared by every layer
    of the cache; only the pool and ``q`` differ."""
    src = getattr(cache, "_attention_cache", None)
    if src is None or src.device != "cpu" or _KERNEL_TOKENS < 1:
        return None
    cfg = src.config
    if not getattr(cfg, "v_head_dim", 0) or n_heads % cfg.local_kv_heads:
        return None                       # latent rows: attend reads a view of K as V
    host = cache._host_pages()
    route = _attend_route(src, n_heads, host.q_positions.shape[0], "auto", 0, False)
    if not route.cpu_pool_kernel:
        return None
    plan = _kernel_plan(host, n_heads, cfg.dtype != "float32")
    if not plan["any"] or plan["rest"]:
        return None
    return host, plan, route.permuted, cfg.dtype == "bfloat16"


def _routed_layer_pools(cache: Any, layer: int, route: tuple) -> tuple:
    """Trusted (with :func:`_cpu_pass_route`): ``(key_pool, value_pool, v_dim)`` the CPU kernel
    reads for model ``layer`` of ``cache`` (a layer of the attention cache ``route`` was made
    for), as host arrays (16-bit rows as their uint16 bits). Views of the storage's arrays,
    which never move while the storage lives: a caller may keep them across passes as long as
    the layer's cache keeps its ``storage``."""
    kp, vp = (_host_pool(x) for x in cache.layer_pool(layer))
    return kp, vp, int(vp.shape[1] if route[2] else vp.shape[2])


def _attend_cpu_routed(q: np.ndarray, pools: tuple, route: tuple, scale: float,
                       soft_cap: Optional[float]) -> np.ndarray:
    """``attend(q, cache, scale=scale, soft_cap=soft_cap)`` along a :func:`_cpu_pass_route`, in
    host arrays (trusted: ``q`` float32 ``[batch, n_heads, head_dim]`` C-contiguous, the
    pass's queries rounded to the cache's dtype as ``attend`` would; ``pools`` the layer's
    :func:`_routed_layer_pools`) -> float32 ``[batch, n_heads, v_head_dim]``, a fresh array
    (``attend`` returns it in the cache's dtype)."""
    host, plan, permuted, bf16 = route
    kp, vp, dv = pools
    return plan["run"].run(q, kp, vp, dv, scale, soft_cap, _PLAIN_FORMATS, bf16, permuted)


def _after_cache(torch, src: Any, q: Any) -> None:
    """Order torch's current stream (where the torch/FlashInfer paths read the pools and the
    page table) after the cache's stream (its puts and uploads; CuPy's current stream when it
    has none of its own): an event waited on, no host wait; nothing when they are one stream."""
    storage = getattr(src, "storage", None)
    if storage is not None:
        storage.order_before(torch.cuda.current_stream(q.device))


def _max_queries(host: HostPages) -> int:
    """The most queries any sequence of the pass has (kept in ``host.plans``)."""
    n = host.plans.get("max-queries")
    if n is None:
        n = host.plans["max-queries"] = int(np.diff(host.qo_indptr).max()) \
            if host.qo_indptr.shape[0] > 1 else 0
    return n


def _value_dim(value_pool, permuted: bool) -> int:
    return int(value_pool.shape[1] if permuted else value_pool.shape[2])


def _gpu_quantized(torch, q, host: HostPages, src, scale: float, soft_cap, formats: tuple,
                   device: str):
    """``attend`` over a quantized cache through the batched paged kernel (``device``
    ``"cuda"``, or ``"sim"`` for the tests): the storage's byte rows read as stored, each
    quantized side dequantized in the kernel, a float side as its raw bits; rotated K/V
    (``kv_rotation``) rotated and turned back in the kernel. float32 ``[batch, H, Dv]``."""
    cfg = src.config
    st = src.storage
    slot = src._storage_layers[src._layer]
    kf, vf, ks, vs, _ = formats
    pools = (st.key_view(slot, 0, src.n_cells), st.value_view(slot, 0, src.n_cells))
    permuted = bool(cfg.permuted_v)     # a float V beside a quantized K may be stored permuted
    quant = dict(bf16=cfg.dtype == "bfloat16",
                 kfmt=_decode_kernel.QUANT_FORMATS[kf] if kf else None,
                 vfmt=_decode_kernel.QUANT_FORMATS[vf] if vf else None,
                 kscale=ks, vscale=vs, k_rotation=int(cfg.k_rotation),
                 v_rotation=int(cfg.v_rotation))
    return _gpu_attend(torch, q, host, pools, scale, soft_cap, device, st, quant, permuted)


def _gpu_attend(torch, q, host: HostPages, pools, scale: float, soft_cap, device: str,
                storage: Any = None, quant: Optional[dict] = None, permuted: bool = False):
    """float32 ``[batch, H, Dv]`` torch tensor on ``q``'s device: every token of the pass in one
    launch of :func:`numbakv.kernels.decode.paged_attention` (``device`` ``"cuda"``: CuPy pools
    and page table; ``"sim"``: numpy ones through the CUDA simulator, for the tests). Per pass,
    the token -> sequence map, the causal flags and the list lengths are planned once and kept
    in ``host.plans`` (one upload per pass, read by every layer). ``quant``: the raw pools'
    formats, scales and rotations (:func:`_gpu_quantized`). ``permuted``: the value pool is
    stored ``[n_kv_heads, v_head_dim, n_cells]``; the kernel reads it through a transposed
    view's strides (no copy)."""
    tok_dev, causal_dev, lens = _gpu_pass_plan(host, device)
    kw = dict(quant) if quant is not None else {"bf16": isinstance(pools[0], BFloat16View)}
    kp, vp = (x.bits if isinstance(x, BFloat16View) else x for x in pools)
    if permuted:
        vp = vp.transpose(2, 0, 1)
    args = (host.table, tok_dev, causal_dev, int(host.rule.window), int(host.rule.chunk), scale,
            soft_cap, lens)
    return _run_on_cache_stream(
        torch, q, device, storage,
        lambda qd: _decode_kernel.paged_attention(device, qd, kp, vp, *args, **kw)[0])


def _gpu_pass_plan(host: HostPages, device: str) -> tuple:
    """``(tok_seq, causal, list_lens)`` of the pass for the batched kernels: the token ->
    sequence map and causal flags on the device (int32 / uint8 ``[batch]``), the host list
    lengths; planned once per pass and kept in ``host.plans`` (one upload, read by every
    layer)."""
    from .kernels.launch import to_device
    plan = host.plans.get("gpu-kernel")
    if plan is None:
        batch = host.q_positions.shape[0]
        tok_seq = _decode_kernel.token_sequences(host.qo_indptr, host.token_order, batch)
        causal = np.ascontiguousarray(host.rule.causal, np.uint8)
        (tok_dev, causal_dev), keep = to_device(device, tok_seq, causal)
        plan = host.plans["gpu-kernel"] = (tok_dev, causal_dev, keep,
                                           np.diff(host.kv_indptr).astype(np.int64))
    return plan[0], plan[1], plan[3]


def _latent_pool(src: Any) -> Tuple[Any, Optional[dict]]:
    """``(rows, kw)``: the current layer's latent rows of a V-less (MLA) cache as
    :func:`numbakv.kernels.decode.paged_latent_attention` reads them (raw storage
    ``[n_cells, 1, ...]``: float bits, or the byte rows of a quantized latent) and its keyword
    arguments (format, float8 scale, rotation; FlashMLA's ``fp8_ds_mla`` rows dequantized in
    the kernel too); ``(None, None)`` for a latent the kernel cannot read as stored."""
    cfg = src.config
    st = src.storage
    slot = src._storage_layers[src._layer]
    kw = dict(bf16=cfg.dtype == "bfloat16", k_rotation=int(cfg.k_rotation))
    if st.k_quantized and st._k_ds_mla:
        kw.update(kfmt=_decode_kernel.FMT_DS_MLA)
    elif st.k_quantized:
        formats = _pool_formats(src)
        if formats is None or formats[0] not in _decode_kernel.QUANT_FORMATS:
            return None, None
        kw.update(kfmt=_decode_kernel.QUANT_FORMATS[formats[0]], kscale=formats[2])
    return st.key_view(slot, 0, src.n_cells), kw


def _latent_kernel_takes(src: Any, n_heads: int, batch: int, v_dim: int,
                         host: HostPages) -> bool:
    """Whether ``attend`` (backend "auto") on a CUDA V-less cache runs the latent kernel: the
    cache's own storage, one latent head, a shape within the kernel's tiles, a decode-like pass
    (at most :data:`_GPU_KERNEL_TOKENS` queries per sequence, as the batched kernel), a value
    of whole blocks on a q8_0/q4_0 latent and of whole rotation blocks on a rotated one."""
    cfg = src.config
    if getattr(src, "storage", None) is None or getattr(cfg, "permuted_v", False) or \
            not _decode_kernel.latent_fits(n_heads, cfg.local_kv_heads, cfg.head_dim, v_dim,
                                           batch) or _max_queries(host) > _GPU_KERNEL_TOKENS:
        return False
    if cfg.k_dtype in ("q8_0", "q4_0") and v_dim % 32:
        return False
    return not (cfg.k_rotation and v_dim % cfg.k_rotation)


def _gpu_latent(torch, q, host: HostPages, src: Any, rows, kw: dict, scale: float, soft_cap,
                v_dim: int, device: str):
    """``attend`` over a V-less (MLA) latent cache through the latent kernel
    (:func:`numbakv.kernels.decode.paged_latent_attention`: each staged tile of latent rows
    serves a tile of query heads; ``device`` ``"cuda"``, or ``"sim"`` for the tests): float32
    ``[batch, H, v_dim]``; ``rows`` / ``kw`` from :func:`_latent_pool`."""
    tok_dev, causal_dev, lens = _gpu_pass_plan(host, device)
    args = (host.table, tok_dev, causal_dev, int(host.rule.window), int(host.rule.chunk), scale,
            soft_cap, lens, v_dim)
    return _run_on_cache_stream(
        torch, q, device, src.storage,
        lambda qd: _decode_kernel.paged_latent_attention(device, qd, rows, *args, **kw)[0])


def _run_on_cache_stream(torch, q, device: str, storage: Any, run):
    """``run(q as float32 device array)`` -> the kernel's float32 output as a torch tensor on
    ``q``'s device; on CUDA on the cache's stream, ordered after ``q``'s producer and before
    torch's current stream reads the output (no host wait)."""
    if device != "cuda":
        return torch.from_numpy(run(np.ascontiguousarray(q.detach().float().numpy())))
    import cupy
    qf = q.detach().float().contiguous()       # on torch's current stream (the producer's)
    producer = torch.cuda.current_stream(q.device).cuda_stream
    with storage._on_device():
        # on the cache's stream: wait for the producer's work (q) and for the cache's own work
        # (puts) is implied; importing q here hands DLPack this stream as the consumer, so torch
        # orders it after q's producer as well
        stream = cupy.cuda.get_current_stream()
        if stream.ptr != producer:
            ready = cupy.cuda.Event(disable_timing=True)
            ready.record(cupy.cuda.ExternalStream(producer))
            stream.wait_event(ready)
        out = run(cupy.from_dlpack(qf))
        if stream.ptr != producer:
            # the consumer (torch's current stream) reads out only after the kernel
            done = cupy.cuda.Event(disable_timing=True)
            done.record(stream)
            cupy.cuda.ExternalStream(producer).wait_event(done)
    return torch.from_dlpack(out)


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


# --------------------------------------------------------------------------------------------
# the CPU kernel: few queries per sequence, read straight from the cell pool
# --------------------------------------------------------------------------------------------

def _native_half(context) -> bool:
    """Whether the code being compiled may convert float16 with the CPU's own instruction: x86
    with F16C (every x86-64-v3 CPU, the level the shipped code targets) or AArch64. Read from
    the target machine numba compiles for, so a cached entry (keyed by CPU features) always
    matches; elsewhere LLVM would call a runtime helper numba does not link."""
    if _PORTABLE_HALF:
        return False
    try:
        import llvmlite.binding as llvm
        triple = llvm.get_process_triple()
        if triple.startswith(("aarch64", "arm64")):
            return True
        feats = str(getattr(context.codegen(), "_tm_features", ""))
        return triple.startswith("x86_64") and "+f16c" in feats.split(",")
    except Exception:  # noqa: BLE001 - unknown target: the portable conversion
        return False


#: tests set this to compile the portable float16 conversion on a CPU that has F16C
_PORTABLE_HALF = False


@intrinsic
def _half_bits_to_f32(typingctx, bits):
    """float32 value of float16 bit pattern ``bits`` (uint16): ``vcvtph2ps`` where the CPU has
    it (LLVM vectorises the loops around it), else exact integer arithmetic: sign, exponent and
    mantissa moved into float32's fields, scaled by 2**112 (which also renormalises float16
    subnormals), exponent 31 mapped to infinity / NaN."""
    if not isinstance(bits, types.Integer) or bits.bitwidth != 16:
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        if _native_half(context):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), f32)
        i32 = ir.IntType(32)
        w = builder.zext(args[0], i32)
        sign = builder.shl(builder.and_(w, ir.Constant(i32, 0x8000)), ir.Constant(i32, 16))
        mag = builder.shl(builder.and_(w, ir.Constant(i32, 0x7FFF)), ir.Constant(i32, 13))
        special = builder.icmp_unsigned("==", builder.and_(w, ir.Constant(i32, 0x7C00)),
                                        ir.Constant(i32, 0x7C00))
        top = builder.select(special, ir.Constant(i32, 0x7F800000), ir.Constant(i32, 0))
        f = builder.bitcast(builder.or_(builder.or_(sign, mag), top), f32)
        return builder.fmul(f, ir.Constant(f32, 2.0 ** 112))
    return sig, codegen


@intrinsic
def _bf16_bits_to_f32(typingctx, bits):
    """float32 value of bfloat16 bit pattern ``bits`` (uint16): its upper 16 bits."""
    if not isinstance(bits, types.Integer) or bits.bitwidth != 16:
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        w = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
        return builder.bitcast(w, ir.FloatType())
    return sig, codegen


def _to_f32(x, bf16):
    """float32 of one stored element: float32 / float16 as is, uint16 as bfloat16 bits when
    ``bf16``, else as float16 bits (numba overload below)."""
    raise NotImplementedError      # pragma: no cover - only called from compiled code


@overload(_to_f32)
def _to_f32_impl(x, bf16):
    if isinstance(x, types.Float):
        def from_float(x, bf16):
            return np.float32(x)
        return from_float
    if isinstance(x, types.Integer) and x.bitwidth == 16:
        def from_bits(x, bf16):
            if bf16:
                return _bf16_bits_to_f32(x)
            return _half_bits_to_f32(x)
        return from_bits
    return None


_dequantize_row_block = _dequantize_block.cpu   # the element math quant.get uses (written once)


def _load_key_row(pool, c, kh, dst, fmt, scale, bf16):
    """float32 ``dst[:]`` = key row ``(c, kh)`` of the pool (numba overload below)."""
    raise NotImplementedError      # pragma: no cover - only called from compiled code


def _load_value_row(pool, c, kh, dst, vperm, fmt, scale, bf16):
    """float32 ``dst[:]`` = value row ``(c, kh)`` (``pool[kh, :, c]`` when ``vperm``)."""
    raise NotImplementedError      # pragma: no cover - only called from compiled code


def _blocks_to_f32(row, dst, fmt, scale):
    """Dequantize one stored row (ggml q8_0 / q4_0 blocks, or float8 with ``scale``) into
    float32 ``dst``: quantized K/V stay quantized in the pool and are read per tile."""
    raise NotImplementedError      # pragma: no cover - only called from compiled code


@overload(_blocks_to_f32, inline="always")
def _blocks_to_f32_impl(row, dst, fmt, scale):
    def impl(row, dst, fmt, scale):
        n = dst.shape[0]
        if fmt == 3:
            _dequantize_row_block(row, 0, n, 3, scale, dst, 0, 0)
        else:
            nbytes = 34 if fmt == 1 else 18
            for blk in range(n // 32):
                _dequantize_row_block(row, blk * nbytes, 32, fmt, scale, dst, blk * 32, 0)
    return impl


@overload(_load_key_row, inline="always")
def _load_key_row_impl(pool, c, kh, dst, fmt, scale, bf16):
    if isinstance(pool.dtype, types.Integer) and pool.dtype.bitwidth == 8:
        def from_blocks(pool, c, kh, dst, fmt, scale, bf16):
            _blocks_to_f32(pool[c, kh], dst, fmt, scale)
        return from_blocks

    def from_elements(pool, c, kh, dst, fmt, scale, bf16):
        for d in range(dst.shape[0]):
            dst[d] = _to_f32(pool[c, kh, d], bf16)
    return from_elements


@overload(_load_value_row, inline="always")
def _load_value_row_impl(pool, c, kh, dst, vperm, fmt, scale, bf16):
    if isinstance(pool.dtype, types.Integer) and pool.dtype.bitwidth == 8:
        def from_blocks(pool, c, kh, dst, vperm, fmt, scale, bf16):
            _blocks_to_f32(pool[c, kh], dst, fmt, scale)    # never permuted (CacheConfig)
        return from_blocks

    def from_elements(pool, c, kh, dst, vperm, fmt, scale, bf16):
        if vperm:
            for d in range(dst.shape[0]):
                dst[d] = _to_f32(pool[kh, d, c], bf16)
        else:
            for d in range(dst.shape[0]):
                dst[d] = _to_f32(pool[c, kh, d], bf16)
    return from_elements


# --------------------------------------------------------------------------------------------
# the CPU kernel's decode form: one query token per work item
# --------------------------------------------------------------------------------------------

#: cells per tile of the decode form: the scores of a tile (n_heads x 64 float32) stay in L1
#: between the score, softmax and value passes
_DECODE_TILE = 64
# float32 constants of :func:`_exp_f32` (module globals of numpy float32 type stay float32 in
# compiled code; Python floats would widen the arithmetic to float64 and stop vectorisation)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_P0 = np.float32(1.9875691500e-4)
_EXP_P1 = np.float32(1.3981999507e-3)
_EXP_P2 = np.float32(8.3334519073e-3)
_EXP_P3 = np.float32(4.1665795894e-2)
_EXP_P4 = np.float32(1.6666665459e-1)
_EXP_P5 = np.float32(5.0000001201e-1)
_F32_FLUSH = np.float32(_EXP_FLUSH)
_F32_ONE = np.float32(1.0)
_F32_HALF = np.float32(0.5)


@njit(inline="always")
def _exp_f32(x):
    """``exp(x)`` for float32 ``x`` in ``(_EXP_FLUSH, 0]`` (a softmax weight against the running
    maximum), within 2 ulp of libm's: Cephes' ``expf`` (``x = n ln 2 + r``, a degree-5
    polynomial in ``r``, ``2**n`` put into the exponent bits). Plain arithmetic and a bit
    cast, so LLVM vectorises a loop of them (numba calls libm's scalar ``expf`` per value
    otherwise: ~8k calls per layer of a 2k-token decode)."""
    n = np.floor(x * _LOG2E + _F32_HALF)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _EXP_P0 * r + _EXP_P1
    p = p * r + _EXP_P2
    p = p * r + _EXP_P3
    p = p * r + _EXP_P4
    p = p * r + _EXP_P5
    y = p * (r * r) + r + _F32_ONE
    return y * np.int32((np.int32(n) + 127) << 23).view(np.float32)


#: how far ahead (cells) the decode form prefetches K and V rows. Inside generate() the pools
#: of a layer are usually out of cache by its next step (the model's weights, the other layers'
#: K/V and other processes pass through L3 in between): measured inside generate() (tiny Llama,
#: 2k context, load 5-8) the kernel took 0.75-0.8x the time with 32-128 cells ahead against
#: none; the hardware prefetcher alone did not keep up with the two interleaved row streams
_PREFETCH_CELLS = 64
#: LLVM's prefetch intrinsic, named after the pointer form llvmlite writes
_PREFETCH_FN = "llvm.prefetch.p0i8" if getattr(llvmlite, "ir_layer_typed_pointers_enabled",
                                                True) else "llvm.prefetch.p0"


@intrinsic
def _prefetch_line(typingctx, pool, c, offset):
    """Prefetch (a read, into every cache level) the cache line at byte ``offset`` of cell
    ``c``'s row of ``pool`` (an array whose first axis is the cell). A hint: it never faults,
    and changes no value."""
    if not isinstance(pool, types.Array) or not isinstance(c, types.Integer) \
            or not isinstance(offset, types.Integer):
        return None
    sig = types.void(pool, c, offset)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        stride0 = cgutils.unpack_tuple(builder, ary.strides)[0]
        intp = context.get_value_type(types.intp)
        cell = context.cast(builder, args[1], signature.args[1], types.intp)
        off = context.cast(builder, args[2], signature.args[2], types.intp)
        addr = builder.add(builder.ptrtoint(ary.data, intp),
                           builder.add(builder.mul(cell, stride0), off))
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), _PREFETCH_FN)
        # (address, read, locality 3: keep in every level, data cache)
        builder.call(fn, [builder.inttoptr(addr, i8p), ir.Constant(i32, 0),
                          ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return sig, codegen


@njit(inline="always")
def _prefetch_cell(pool, c):
    """Prefetch cell ``c``'s row of ``pool`` (``[n_cells, n_kv_heads, ...]``: every KV head),
    one 64-byte line at a time."""
    for off in range(0, pool.shape[1] * pool.strides[1], 64):
        _prefetch_line(pool, c, off)


def _key_row_scores(kpool, c, kh, qs, h0, g, s, jj, kbuf, fmt, kscale, bf16):
    """``s[h0 + gi, jj] = qs[h0 + gi] . k`` for the ``g`` query heads of KV head ``kh``, ``k``
    the key row ``(c, kh)`` read once (numba overload below: float rows converted as they are read,
    quantized rows dequantized into ``kbuf`` first)."""
    raise NotImplementedError      # pragma: no cover - only called from compiled code


def _value_row_accumulate(vpool, c, kh, acc, h0, g, s, jj, vbuf, fmt, vscale, bf16):
    """``acc[h0 + gi] += s[h0 + gi, jj] * v`` for the group's heads with a nonzero weight,
    ``v`` the value row ``(c, kh)`` (numba overload below)."""
    raise NotImplementedError      # pragma: no cover - only called from compiled code


def _key_scores4(kpool, ca, cb, cc, cd, kh, qs, h0, g, s, jj, kbuf, fmt, kscale, bf16):
    """:func:`_key_row_scores` for the four key rows ``ca .. cd`` into ``s[h0:h0 + g, jj:jj +
    4]``: four independent sums per pass over ``qs``'s row (each query value loaded once for
    four cells)."""
    raise NotImplementedError      # pragma: no cover - only called from compiled code


def _value_accumulate4(vpool, ca, cb, cc, cd, kh, acc, h0, g, s, jj, vbuf, fmt, vscale, bf16):
    """:func:`_value_row_accumulate` for the four value rows ``ca .. cd`` (weights ``s[h0:h0 + g,
    jj:jj + 4]``): each accumulator value is loaded and stored once for four cells."""
    raise NotImplementedError      # pragma: no cover - only called from compiled code


# Quantized rows go through these two functions, compiled on their own: inlined at numba's IR
# level into every kernel signature (each format pair, float or quantized on either side), the
# dequantizers made the kernel take minutes longer to compile.

@njit(fastmath={"reassoc", "contract"})
def _key_scores_blocks(kpool, c, kh, qs, h0, g, s, jj, kbuf, fmt, kscale):
    """:func:`_key_row_scores` of a quantized key row."""
    _blocks_to_f32(kpool[c, kh], kbuf, fmt, kscale)
    for gi in range(g):
        x = np.float32(0.0)
        for d in range(kbuf.shape[0]):
            x += qs[h0 + gi, d] * kbuf[d]
        s[h0 + gi, jj] = x


@njit(fastmath={"reassoc", "contract"})
def _value_accumulate_blocks(vpool, c, kh, acc, h0, g, s, jj, vbuf, fmt, vscale):
    """:func:`_value_row_accumulate` of a quantized value row (dequantized only when a weight
    of the group needs it)."""
    for gi in range(g):
        if s[h0 + gi, jj] != 0:
            _blocks_to_f32(vpool[c, kh], vbuf, fmt, vscale)
            for gj in range(gi, g):
                w = s[h0 + gj, jj]
                if w != 0:
                    for d in range(vbuf.shape[0]):
                        acc[h0 + gj, d] += w * vbuf[d]
            return


def _is_byte_pool(pool) -> bool:
    return isinstance(pool.dtype, types.Integer) and pool.dtype.bitwidth == 8


@overload(_key_row_scores, inline="always")
def _key_row_scores_impl(kpool, c, kh, qs, h0, g, s, jj, kbuf, fmt, kscale, bf16):
    if _is_byte_pool(kpool):
        def from_blocks(kpool, c, kh, qs, h0, g, s, jj, kbuf, fmt, kscale, bf16):
            _key_scores_blocks(kpool, c, kh, qs, h0, g, s, jj, kbuf, fmt, kscale)
        return from_blocks

    def from_elements(kpool, c, kh, qs, h0, g, s, jj, kbuf, fmt, kscale, bf16):
        for gi in range(g):
            x = np.float32(0.0)
            for d in range(kbuf.shape[0]):
                x += qs[h0 + gi, d] * _to_f32(kpool[c, kh, d], bf16)
            s[h0 + gi, jj] = x
    return from_elements


@overload(_value_row_accumulate, inline="always")
def _value_row_accumulate_impl(vpool, c, kh, acc, h0, g, s, jj, vbuf, fmt, vscale, bf16):
    if _is_byte_pool(vpool):
        def from_blocks(vpool, c, kh, acc, h0, g, s, jj, vbuf, fmt, vscale, bf16):
            _value_accumulate_blocks(vpool, c, kh, acc, h0, g, s, jj, vbuf, fmt, vscale)
        return from_blocks

    def from_elements(vpool, c, kh, acc, h0, g, s, jj, vbuf, fmt, vscale, bf16):
        for gi in range(g):
            w = s[h0 + gi, jj]
            if w != 0:
                for d in range(vbuf.shape[0]):
                    acc[h0 + gi, d] += w * _to_f32(vpool[c, kh, d], bf16)
    return from_elements


@overload(_key_scores4, inline="always")
def _key_scores4_impl(kpool, ca, cb, cc, cd, kh, qs, h0, g, s, jj, kbuf, fmt, kscale, bf16):
    if _is_byte_pool(kpool):
        def from_blocks(kpool, ca, cb, cc, cd, kh, qs, h0, g, s, jj, kbuf, fmt, kscale, bf16):
            _key_scores_blocks(kpool, ca, kh, qs, h0, g, s, jj, kbuf, fmt, kscale)
            _key_scores_blocks(kpool, cb, kh, qs, h0, g, s, jj + 1, kbuf, fmt, kscale)
            _key_scores_blocks(kpool, cc, kh, qs, h0, g, s, jj + 2, kbuf, fmt, kscale)
            _key_scores_blocks(kpool, cd, kh, qs, h0, g, s, jj + 3, kbuf, fmt, kscale)
        return from_blocks

    def from_elements(kpool, ca, cb, cc, cd, kh, qs, h0, g, s, jj, kbuf, fmt, kscale, bf16):
        for gi in range(g):
            xa = np.float32(0.0)
            xb = np.float32(0.0)
            xc = np.float32(0.0)
            xd = np.float32(0.0)
            for d in range(kbuf.shape[0]):
                qd = qs[h0 + gi, d]
                xa += qd * _to_f32(kpool[ca, kh, d], bf16)
                xb += qd * _to_f32(kpool[cb, kh, d], bf16)
                xc += qd * _to_f32(kpool[cc, kh, d], bf16)
                xd += qd * _to_f32(kpool[cd, kh, d], bf16)
            s[h0 + gi, jj] = xa
            s[h0 + gi, jj + 1] = xb
            s[h0 + gi, jj + 2] = xc
            s[h0 + gi, jj + 3] = xd
    return from_elements


@overload(_value_accumulate4, inline="always")
def _value_accumulate4_impl(vpool, ca, cb, cc, cd, kh, acc, h0, g, s, jj, vbuf, fmt, vscale,
                            bf16):
    if _is_byte_pool(vpool):
        def from_blocks(vpool, ca, cb, cc, cd, kh, acc, h0, g, s, jj, vbuf, fmt, vscale, bf16):
            _value_accumulate_blocks(vpool, ca, kh, acc, h0, g, s, jj, vbuf, fmt, vscale)
            _value_accumulate_blocks(vpool, cb, kh, acc, h0, g, s, jj + 1, vbuf, fmt, vscale)
            _value_accumulate_blocks(vpool, cc, kh, acc, h0, g, s, jj + 2, vbuf, fmt, vscale)
            _value_accumulate_blocks(vpool, cd, kh, acc, h0, g, s, jj + 3, vbuf, fmt, vscale)
        return from_blocks

    def from_elements(vpool, ca, cb, cc, cd, kh, acc, h0, g, s, jj, vbuf, fmt, vscale, bf16):
        for gi in range(g):
            wa = s[h0 + gi, jj]
            wb = s[h0 + gi, jj + 1]
            wc = s[h0 + gi, jj + 2]
            wd = s[h0 + gi, jj + 3]
            for d in range(vbuf.shape[0]):
                acc[h0 + gi, d] += (wa * _to_f32(vpool[ca, kh, d], bf16)
                                    + wb * _to_f32(vpool[cb, kh, d], bf16)) \
                    + (wc * _to_f32(vpool[cc, kh, d], bf16) + wd * _to_f32(vpool[cd, kh, d], bf16))
    return from_elements


# --------------------------------------------------------------------------------------------
# the decode form's vector code: rows of 64 or 128 values as explicit float32 vectors
# --------------------------------------------------------------------------------------------
# LLVM vectorises the scalar loops above over a runtime head size: per call it re-checks
# aliasing and trip counts, keeps 16 partial sums per dot product and reduces each one with
# its own shuffle ladder (~11 ns of score and ~12 ns of value work per cell at 4 query heads of
# head size 64, the kernel's cost at any context length). For the common head sizes the decode
# form's two hot loops are written here directly as LLVM vector IR: four cells' dot products
# reduced together through one transposing shuffle ladder, each K row read once for a pair of
# grouped query heads, and the value accumulators of a whole tile held in registers. Vectors
# are one register wide (16 lanes where the target has AVX-512, else 8: AVX2, the level the
# shipped code targets), and the value pass holds only as many accumulators as the target has
# registers for (at most half of them).

#: the kernels' own fastmath flags (no nnan/ninf): products may fuse, sums may reorder
_VEC_FLAGS = ("contract", "reassoc")


def _vector_lanes(context) -> int:
    """float32 lanes of one vector register of the target numba compiles for: 16 with
    AVX-512, else 8 (AVX2; elsewhere LLVM splits or joins them as the target needs)."""
    feats = str(getattr(context.codegen(), "_tm_features", ""))
    return 16 if "+avx512f" in feats.split(",") else 8


def _f32x(lanes: int) -> ir.VectorType:
    return ir.VectorType(ir.FloatType(), lanes)


def _splat(ty: ir.VectorType, x) -> ir.Constant:
    return ir.Constant(ty, [ir.Constant(ty.element, x)] * ty.count)


def _shuffle(builder, a, b, lanes):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)),
                                                    list(lanes)))


def _byte_address(context, builder, aryty, ary, idxs):
    """Integer byte address of ``ary[i0, i1, .., 0, ..]`` (``idxs``: (value, numba type) pairs
    of the leading indices; the array's own strides)."""
    arr = context.make_array(aryty)(context, builder, ary)
    strides = cgutils.unpack_tuple(builder, arr.strides)
    addr = builder.ptrtoint(arr.data, context.get_value_type(types.intp))
    for axis, (v, ty) in enumerate(idxs):
        addr = builder.add(addr, builder.mul(context.cast(builder, v, ty, types.intp),
                                             strides[axis]))
    return addr


def _load_f32x(builder, dtype, addr, mode: str, k: int, lanes: int):
    """float32 vector of the ``lanes`` stored elements ``lanes * k ..`` from byte address
    ``addr``: float32 as is, uint16 bit patterns widened as ``mode`` says (``"bf16"``,
    ``"f16"``: the CPU's conversion, ``"f16-portable"``: :func:`_half_bits_to_f32`'s integer
    form)."""
    intp = addr.type
    f32x = _f32x(lanes)
    if dtype == types.float32:
        ptr = builder.inttoptr(builder.add(addr, ir.Constant(intp, 4 * lanes * k)),
                               f32x.as_pointer())
        return builder.load(ptr, align=4)
    i32x = ir.VectorType(ir.IntType(32), lanes)
    ptr = builder.inttoptr(builder.add(addr, ir.Constant(intp, 2 * lanes * k)),
                           ir.VectorType(ir.IntType(16), lanes).as_pointer())
    bits = builder.load(ptr, align=2)
    if mode == "bf16":
        return builder.bitcast(builder.shl(builder.zext(bits, i32x), _splat(i32x, 16)), f32x)
    if mode == "f16":
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), lanes)), f32x)
    w = builder.zext(bits, i32x)
    sign = builder.shl(builder.and_(w, _splat(i32x, 0x8000)), _splat(i32x, 16))
    mag = builder.shl(builder.and_(w, _splat(i32x, 0x7FFF)), _splat(i32x, 13))
    special = builder.icmp_unsigned("==", builder.and_(w, _splat(i32x, 0x7C00)),
                                    _splat(i32x, 0x7C00))
    top = builder.select(special, _splat(i32x, 0x7F800000), _splat(i32x, 0))
    f = builder.bitcast(builder.or_(builder.or_(sign, mag), top), f32x)
    return builder.fmul(f, _splat(f32x, 2.0 ** 112))


def _emit_per_format(context, builder, dtype, bf16, emit) -> None:
    """``emit(mode)`` for the pool's element format: once for float32, else twice under a
    branch on the runtime ``bf16`` flag (bfloat16 / float16 bits)."""
    if dtype == types.float32:
        emit("f32")
        return
    half = "f16" if _native_half(context) else "f16-portable"
    with builder.if_else(bf16) as (is_bf16, is_half):
        with is_bf16:
            emit("bf16")
        with is_half:
            emit(half)


def _vector_pool(pool) -> bool:
    return isinstance(pool, types.Array) and pool.ndim == 3 and pool.dtype in (types.float32,
                                                                               types.uint16)


def _four_sums(builder, p: list, lanes: int):
    """``<4 x float>`` of the lane sums of the four vectors in ``p``: one transposing ladder
    (halves of two vectors added into one, then quarters, then within each group of
    ``lanes / 4``) instead of four separate reductions."""
    h, q = lanes // 2, lanes // 4
    lo = list(range(h)) + list(range(lanes, lanes + h))
    hi = [i + h for i in lo]
    a = builder.fadd(_shuffle(builder, p[0], p[1], lo), _shuffle(builder, p[0], p[1], hi),
                     flags=_VEC_FLAGS)
    b = builder.fadd(_shuffle(builder, p[2], p[3], lo), _shuffle(builder, p[2], p[3], hi),
                     flags=_VEC_FLAGS)
    first = [base + i for base in (0, h, lanes, lanes + h) for i in range(q)]
    second = [i + q for i in first]
    c = builder.fadd(_shuffle(builder, a, b, first), _shuffle(builder, a, b, second),
                     flags=_VEC_FLAGS)
    step = q // 2
    while step:
        c = builder.fadd(c, _shuffle(builder, c, c, [i ^ step for i in range(lanes)]),
                         flags=_VEC_FLAGS)
        step //= 2
    return _shuffle(builder, c, c, [0, q, 2 * q, 3 * q])


def _make_key_dots4(dim: int, heads: int):
    """Intrinsic ``f(qs, h, kpool, ca, cb, cc, cd, kh, s, jj, bf16)``: ``s[h + i, jj:jj + 4] =
    qs[h + i] . kpool[(ca, cb, cc, cd), kh]`` for the ``heads`` query heads ``h ..`` of KV
    head ``kh``, each key vector loaded once for them; rows of ``dim`` values, the last axis of
    ``kpool`` contiguous (the caller checks), ``qs``/``s`` C-contiguous float32."""

    @intrinsic
    def key_dots4(typingctx, qs, h, kpool, ca, cb, cc, cd, kh, s, jj, bf16):
        if not _vector_pool(kpool):
            return None
        sig = types.void(qs, h, kpool, ca, cb, cc, cd, kh, s, jj, bf16)

        def codegen(context, builder, signature, args):
            ty = signature.args
            lanes = _vector_lanes(context)
            intp = context.get_value_type(types.intp)
            h_i = context.cast(builder, args[1], ty[1], types.intp)
            rows = [_byte_address(context, builder, ty[2], args[2],
                                  [(args[3 + c], ty[3 + c]), (args[7], ty[7])]) for c in range(4)]
            jj_bytes = builder.mul(context.cast(builder, args[9], ty[9], types.intp),
                                   ir.Constant(intp, 4))
            head_q, head_s = [], []
            for i in range(heads):
                hi = (builder.add(h_i, ir.Constant(intp, i)), types.intp)
                head_q.append(_byte_address(context, builder, ty[0], args[0], [hi]))
                head_s.append(builder.add(_byte_address(context, builder, ty[8], args[8], [hi]),
                                          jj_bytes))
            bf16_flag = context.cast(builder, args[10], ty[10], types.boolean)

            def emit(mode):
                # one running sum per (head, cell), vector by vector along the rows: few
                # registers live at once (AVX2 has 16)
                sums = [[None] * 4 for _ in range(heads)]
                for k in range(dim // lanes):
                    for c in range(4):
                        kv = _load_f32x(builder, ty[2].dtype, rows[c], mode, k, lanes)
                        for i in range(heads):
                            qv = _load_f32x(builder, types.float32, head_q[i], "f32", k, lanes)
                            x = builder.fmul(qv, kv, flags=_VEC_FLAGS)
                            sums[i][c] = x if k == 0 else builder.fadd(sums[i][c], x,
                                                                       flags=_VEC_FLAGS)
                for i in range(heads):
                    ptr = builder.inttoptr(head_s[i], _f32x(4).as_pointer())
                    builder.store(_four_sums(builder, sums[i], lanes), ptr, align=4)
            _emit_per_format(context, builder, ty[2].dtype, bf16_flag, emit)
            return context.get_dummy_value()
        return sig, codegen
    return key_dots4


def _make_value_tile(dv: int, heads: int):
    """Intrinsic ``f(acc, h, vpool, kv_indices, j0, n, kh, s, bf16)``: ``acc[h + i] += sum_j
    s[h + i, j] * vpool[kv_indices[j0 + j], kh]`` over ``j < n`` for the ``heads`` query heads
    ``h ..`` of KV head ``kh``. The accumulators stay in registers for the tile: with enough
    registers (AVX-512) each value row is read once for the heads, else (AVX2) one head at a
    time and, for rows of 128, one half of the row at a time; a lone head with registers to
    spare keeps two accumulator sets (even and odd cells) so consecutive multiply-adds do not
    wait on each other. Rows of ``dv`` values, last axis of ``vpool`` contiguous,
    ``acc``/``s`` C-contiguous float32."""

    @intrinsic
    def value_tile(typingctx, acc, h, vpool, kv_indices, j0, n, kh, s, bf16):
        if not _vector_pool(vpool):
            return None
        sig = types.void(acc, h, vpool, kv_indices, j0, n, kh, s, bf16)

        def codegen(context, builder, signature, args):
            ty = signature.args
            lanes = _vector_lanes(context)
            f32x = _f32x(lanes)
            budget = 16 if lanes == 16 else 8      # accumulators: half the vector registers
            nv = dv // lanes
            block = min(nv, budget)                # vectors of a row per pass over the tile
            joint = heads if heads * block <= budget else 1
            sets = 2 if joint == 1 and 2 * block <= budget else 1
            intp = context.get_value_type(types.intp)
            one = ir.Constant(intp, 1)
            h_i = context.cast(builder, args[1], ty[1], types.intp)
            head_acc, head_s = [], []
            for i in range(heads):
                hi = (builder.add(h_i, ir.Constant(intp, i)), types.intp)
                head_acc.append(_byte_address(context, builder, ty[0], args[0], [hi]))
                head_s.append(_byte_address(context, builder, ty[7], args[7], [hi]))
            idx_ty = ty[3]
            idx_base = _byte_address(context, builder, idx_ty, args[3], [(args[4], ty[4])])
            idx_stride = cgutils.unpack_tuple(
                builder, context.make_array(idx_ty)(context, builder, args[3]).strides)[0]
            idx_ptr_ty = context.get_value_type(idx_ty.dtype).as_pointer()
            vty = ty[2]
            varr = context.make_array(vty)(context, builder, args[2])
            vstrides = cgutils.unpack_tuple(builder, varr.strides)
            vbase = builder.add(builder.ptrtoint(varr.data, intp),
                                builder.mul(context.cast(builder, args[6], ty[6], types.intp),
                                            vstrides[1]))
            n_i = context.cast(builder, args[5], ty[5], types.intp)
            bf16_flag = context.cast(builder, args[8], ty[8], types.boolean)
            # accumulators as stack slots: LLVM promotes them to registers across the loop
            slots = [[[cgutils.alloca_once(builder, f32x) for _ in range(block)]
                      for _ in range(sets)] for _ in range(joint)]

            def cell(j, mode, st, group, k0):
                c = builder.load(builder.inttoptr(builder.add(idx_base, builder.mul(j, idx_stride)),
                                                  idx_ptr_ty))
                row = builder.add(vbase, builder.mul(context.cast(builder, c, idx_ty.dtype,
                                                                  types.intp), vstrides[0]))
                weights = []
                for i in group:
                    wp = builder.inttoptr(
                        builder.add(head_s[i], builder.mul(j, ir.Constant(intp, 4))),
                        ir.FloatType().as_pointer())
                    w = builder.insert_element(ir.Constant(f32x, ir.Undefined), builder.load(wp),
                                               ir.Constant(ir.IntType(32), 0))
                    weights.append(_shuffle(builder, w, w, [0] * lanes))
                for k in range(block):
                    v = _load_f32x(builder, vty.dtype, row, mode, k0 + k, lanes)
                    for gi in range(len(group)):
                        slot = slots[gi][st][k]
                        builder.store(builder.fadd(builder.load(slot),
                                                   builder.fmul(weights[gi], v, flags=_VEC_FLAGS),
                                                   flags=_VEC_FLAGS), slot)

            def pass_over_tile(mode, group, k0):
                for gi, i in enumerate(group):
                    for k in range(block):
                        builder.store(_load_f32x(builder, types.float32, head_acc[i], "f32",
                                                 k0 + k, lanes), slots[gi][0][k])
                        for st in range(1, sets):      # -0.0: x + -0.0 is x, even -0.0
                            builder.store(_splat(f32x, -0.0), slots[gi][st][k])
                if sets == 2:
                    with cgutils.for_range(builder, builder.ashr(n_i, one)) as loop:
                        j = builder.shl(loop.index, one)
                        cell(j, mode, 0, group, k0)
                        cell(builder.add(j, one), mode, 1, group, k0)
                    with builder.if_then(builder.icmp_signed(
                            "!=", builder.and_(n_i, one), ir.Constant(intp, 0))):
                        cell(builder.sub(n_i, one), mode, 0, group, k0)
                else:
                    with cgutils.for_range(builder, n_i) as loop:
                        cell(loop.index, mode, 0, group, k0)
                for gi, i in enumerate(group):
                    for k in range(block):
                        tot = builder.load(slots[gi][0][k])
                        for st in range(1, sets):
                            tot = builder.fadd(tot, builder.load(slots[gi][st][k]),
                                               flags=_VEC_FLAGS)
                        ptr = builder.add(head_acc[i], ir.Constant(intp, 4 * lanes * (k0 + k)))
                        builder.store(tot, builder.inttoptr(ptr, f32x.as_pointer()), align=4)

            def emit(mode):
                for g0 in range(0, heads, joint):
                    for k0 in range(0, nv, block):
                        pass_over_tile(mode, list(range(g0, g0 + joint)), k0)
            _emit_per_format(context, builder, vty.dtype, bf16_flag, emit)
            return context.get_dummy_value()
        return sig, codegen
    return value_tile


_key_dots4_64x1 = _make_key_dots4(64, 1)
_key_dots4_64x2 = _make_key_dots4(64, 2)
_key_dots4_128x1 = _make_key_dots4(128, 1)
_key_dots4_128x2 = _make_key_dots4(128, 2)
_value_tile_64x1 = _make_value_tile(64, 1)
_value_tile_64x2 = _make_value_tile(64, 2)
_value_tile_128x1 = _make_value_tile(128, 1)
_value_tile_128x2 = _make_value_tile(128, 2)


def _vector_rows(pool, width):
    """``width`` (64 or 128) when the decode form's vector code reads ``pool``'s rows of
    ``width`` values (float32 or 16-bit elements, contiguous last axis), else 0 (numba
    overload below)."""
    raise NotImplementedError      # pragma: no cover - only called from compiled code


@overload(_vector_rows, inline="always")
def _vector_rows_impl(pool, width):
    if not _vector_pool(pool):
        return lambda pool, width: 0

    def impl(pool, width):
        if pool.strides[2] != pool.itemsize or (width != 64 and width != 128):
            return 0
        return width
    return impl


def _key_scores4_vector(kpool, ca, cb, cc, cd, kh, qs, h0, g, s, jj, bf16, width):
    """:func:`_key_scores4` by the vector code (rows of ``width`` = :func:`_vector_rows`):
    query heads in pairs, then the odd one."""
    raise NotImplementedError      # pragma: no cover - only called from compiled code


@overload(_key_scores4_vector)
def _key_scores4_vector_impl(kpool, ca, cb, cc, cd, kh, qs, h0, g, s, jj, bf16, width):
    if not _vector_pool(kpool):
        return lambda kpool, ca, cb, cc, cd, kh, qs, h0, g, s, jj, bf16, width: None

    def impl(kpool, ca, cb, cc, cd, kh, qs, h0, g, s, jj, bf16, width):
        for p in range(g >> 1):
            h = h0 + 2 * p
            if width == 64:
                _key_dots4_64x2(qs, h, kpool, ca, cb, cc, cd, kh, s, jj, bf16)
            else:
                _key_dots4_128x2(qs, h, kpool, ca, cb, cc, cd, kh, s, jj, bf16)
        if g & 1:
            h = h0 + g - 1
            if width == 64:
                _key_dots4_64x1(qs, h, kpool, ca, cb, cc, cd, kh, s, jj, bf16)
            else:
                _key_dots4_128x1(qs, h, kpool, ca, cb, cc, cd, kh, s, jj, bf16)
    return impl


def _value_tile_vector(vpool, kv_indices, j0, n, kh, acc, h0, g, s, bf16, width):
    """``acc[h0 + i] += sum_j s[h0 + i, j] * v_j`` over the tile's ``n`` cells
    ``kv_indices[j0 ..]`` for the ``g`` query heads of KV head ``kh``, by the vector code (rows
    of ``width`` = :func:`_vector_rows`)."""
    raise NotImplementedError      # pragma: no cover - only called from compiled code


@overload(_value_tile_vector)
def _value_tile_vector_impl(vpool, kv_indices, j0, n, kh, acc, h0, g, s, bf16, width):
    if not _vector_pool(vpool):
        return lambda vpool, kv_indices, j0, n, kh, acc, h0, g, s, bf16, width: None

    def impl(vpool, kv_indices, j0, n, kh, acc, h0, g, s, bf16, width):
        for p in range(g >> 1):
            h = h0 + 2 * p
            if width == 64:
                _value_tile_64x2(acc, h, vpool, kv_indices, j0, n, kh, s, bf16)
            else:
                _value_tile_128x2(acc, h, vpool, kv_indices, j0, n, kh, s, bf16)
        if g & 1:
            h = h0 + g - 1
            if width == 64:
                _value_tile_64x1(acc, h, vpool, kv_indices, j0, n, kh, s, bf16)
            else:
                _value_tile_128x1(acc, h, vpool, kv_indices, j0, n, kh, s, bf16)
    return impl


@njit(cache=True, fastmath={"reassoc", "contract"})   # no nnan/ninf: -inf marks an empty max
def _attend_decode_item(it, items, q, kpool, vpool, bf16, kfmt, vfmt, kscale, vscale,
                        kv_indices, kv_pos, qo_indptr, token_order, q_pos, causal, window,
                        chunk, scale, soft_cap, out, part_acc, part_m, part_l):
    """:func:`_attend_item` for an item whose sequence has one query token (a decode step), V
    not permuted: the same arguments and results. Per tile of :data:`_DECODE_TILE` cells, each
    cell's K row (every KV head: one contiguous read) is read once for every query head (the
    scores of each KV head's grouped-query group), the tile's weights come from one vectorised
    pass per head (:func:`_exp_f32`), and each V row is read once and added to the heads'
    accumulators; the K and V rows :data:`_PREFETCH_CELLS` cells ahead are prefetched as the
    scores go. Nothing is copied out of the pool (quantized rows are dequantized one row at a
    time)."""
    T, H, dim = q.shape
    hkv = kpool.shape[1]
    dv = out.shape[2]
    g = H // hkv
    b = items[it, 0]
    c0 = items[it, 1]
    c1 = items[it, 2]
    row0 = items[it, 3]
    t = token_order[qo_indptr[b]]
    p = np.int64(q_pos[t])
    lo = visible_lo(p, window, chunk)
    a = c0
    e = c1
    while a < e:                              # first j with kv_pos[j] >= lo
        m = (a + e) >> 1
        if kv_pos[m] < lo:
            a = m + 1
        else:
            e = m
    jlo = a
    e = c1
    if causal[t] != 0:
        while a < e:                          # first j with kv_pos[j] > p
            m = (a + e) >> 1
            if kv_pos[m] <= p:
                a = m + 1
            else:
                e = m
    jhi = e
    qs = np.empty((H, dim), np.float32)       # scale folded in
    for h in range(H):
        for d in range(dim):
            qs[h, d] = q[t, h, d] * scale
    acc = np.zeros((H, dv), np.float32)
    mx = np.full(H, -np.inf, np.float32)
    tot = np.zeros(H, np.float32)
    s = np.empty((H, _DECODE_TILE), np.float32)
    kbuf = np.empty(dim, np.float32)
    vbuf = np.empty(dv, np.float32)
    kvec = _vector_rows(kpool, dim)           # 0: the scalar loops (another size, quantized)
    vvec = _vector_rows(vpool, dv)
    for j0 in range(jlo, jhi, _DECODE_TILE):
        n = min(_DECODE_TILE, jhi - j0)
        n4 = n - n % 4
        # cells outer, KV heads inner: a cell's row of every KV head is one contiguous read
        for jj in range(0, n4, 4):
            j = j0 + jj
            for u in range(j + _PREFETCH_CELLS, min(j + _PREFETCH_CELLS + 4, jhi)):
                _prefetch_cell(kpool, kv_indices[u])
                _prefetch_cell(vpool, kv_indices[u])
            ca = kv_indices[j]
            cb = kv_indices[j + 1]
            cc = kv_indices[j + 2]
            cd = kv_indices[j + 3]
            for kh in range(hkv):
                if kvec != 0:
                    _key_scores4_vector(kpool, ca, cb, cc, cd, kh, qs, kh * g, g, s, jj, bf16,
                                        kvec)
                else:
                    _key_scores4(kpool, ca, cb, cc, cd, kh, qs, kh * g, g, s, jj, kbuf, kfmt,
                                 kscale, bf16)
        if kvec != 0 and n4 < n:
            # the last 1-3 cells (n < 64: columns n4 + 3 < 64 exist) as a group of four, the
            # last cell repeated (its extra scores are never read)
            last = j0 + n - 1
            ca = kv_indices[j0 + n4]
            cb = kv_indices[min(j0 + n4 + 1, last)]
            cc = kv_indices[min(j0 + n4 + 2, last)]
            cd = kv_indices[last]
            for kh in range(hkv):
                _key_scores4_vector(kpool, ca, cb, cc, cd, kh, qs, kh * g, g, s, n4, bf16, kvec)
        else:
            for jj in range(n4, n):
                for kh in range(hkv):
                    _key_row_scores(kpool, kv_indices[j0 + jj], kh, qs, kh * g, g, s, jj,
                                    kbuf, kfmt, kscale, bf16)
        for h in range(H):
            if soft_cap > 0:
                for jj in range(n):
                    s[h, jj] = soft_cap * math.tanh(s[h, jj] / soft_cap)
            m = mx[h]
            for jj in range(n):
                m = max(m, s[h, jj])
            # online softmax: rescale what was summed so far to the new maximum; weights
            # below exp(_EXP_FLUSH) are flushed to 0 (no denormal arithmetic)
            y = mx[h] - m
            corr = _exp_f32(max(y, _F32_FLUSH)) if y > _F32_FLUSH else np.float32(0.0)
            if corr != 1.0:
                for d in range(dv):
                    acc[h, d] *= corr
            sm = np.float32(0.0)
            for jj in range(n):
                y = s[h, jj] - m
                w = _exp_f32(max(y, _F32_FLUSH))
                w = w if y > _F32_FLUSH else np.float32(0.0)
                s[h, jj] = w
                sm += w
            mx[h] = m
            tot[h] = tot[h] * corr + sm
        if vvec != 0:
            for kh in range(hkv):
                _value_tile_vector(vpool, kv_indices, j0, n, kh, acc, kh * g, g, s, bf16, vvec)
            continue
        for jj in range(0, n4, 4):
            j = j0 + jj
            ca = kv_indices[j]
            cb = kv_indices[j + 1]
            cc = kv_indices[j + 2]
            cd = kv_indices[j + 3]
            for kh in range(hkv):
                _value_accumulate4(vpool, ca, cb, cc, cd, kh, acc, kh * g, g, s, jj, vbuf,
                                   vfmt, vscale, bf16)
        for jj in range(n4, n):
            for kh in range(hkv):
                _value_row_accumulate(vpool, kv_indices[j0 + jj], kh, acc, kh * g, g, s, jj,
                                      vbuf, vfmt, vscale, bf16)
    if row0 >= 0:
        for h in range(H):
            part_m[row0 + h] = mx[h]
            part_l[row0 + h] = tot[h]
            for d in range(dv):
                part_acc[row0 + h, d] = acc[h, d]
        return
    for h in range(H):
        inv = np.float32(1.0) / tot[h] if tot[h] > 0 else np.float32(0.0)
        for d in range(dv):
            out[t, h, d] = acc[h, d] * inv


#: cells per tile of the kernel: the tile's K and V rows of every KV head (8 x 128 float32 each
#: at 16 cells: 64 KiB apiece) stay in L2 while every query row uses them
_TILE = 16


@njit(cache=True, fastmath={"reassoc", "contract"})   # no nnan/ninf: -inf marks masked scores
def _attend_item(it, items, q, kpool, vpool, bf16, vperm, kfmt, vfmt, kscale, vscale,
                 kv_indices, kv_pos, qo_indptr, token_order, q_pos, causal, window, chunk, scale,
                 soft_cap, out, part_acc, part_m, part_l):
    """Work item ``it`` of :func:`_attend_pool`: ``items[it] = (b, j0, j1, row0)``, batch sequence
    ``b``'s list entries ``j0:j1`` (all of its list, or one part of it), every query and every
    head at once, so each cell's K/V row (all KV heads: one contiguous read) is read and
    converted to float32 once. ``row0 < 0``: the whole list, normalised rows written to
    ``out``; else the unnormalised accumulators, maxima and sums go to ``part_*`` rows
    ``row0 ..`` (merged by :func:`_merge_item_parts`). A uint8 pool holds quantized rows
    (``kfmt``/``vfmt``: kernels.quant format codes, ``kscale``/``vscale`` for float8),
    dequantized per tile as they are read."""
    T, H, dim = q.shape
    hkv = kpool.shape[1]
    dv = out.shape[2]
    g = H // hkv
    b = items[it, 0]
    c0 = items[it, 1]
    c1 = items[it, 2]
    row0 = items[it, 3]
    q0 = qo_indptr[b]
    L = qo_indptr[b + 1] - q0
    if L == 1 and not vperm:                  # a decode step: the one-query form
        _attend_decode_item(it, items, q, kpool, vpool, bf16, kfmt, vfmt, kscale, vscale,
                            kv_indices, kv_pos, qo_indptr, token_order, q_pos, causal, window,
                            chunk, scale, soft_cap, out, part_acc, part_m, part_l)
        return
    R = L * H
    # per token, the visible run [jlo, jhi) of the list: positions ascend along it, and a token
    # sees exactly the positions in [lo, hi] (window / chunk below, causal above)
    jlo = np.empty(L, np.int64)
    jhi = np.empty(L, np.int64)
    u0 = c1
    u1 = c0
    for tl in range(L):
        t = token_order[q0 + tl]
        p = np.int64(q_pos[t])
        lo = visible_lo(p, window, chunk)
        a = c0
        e = c1
        while a < e:                          # first j with kv_pos[j] >= lo
            m = (a + e) >> 1
            if kv_pos[m] < lo:
                a = m + 1
            else:
                e = m
        jlo[tl] = a
        e = c1
        if causal[t] != 0:
            a2 = a
            while a2 < e:                     # first j with kv_pos[j] > p
                m = (a2 + e) >> 1
                if kv_pos[m] <= p:
                    a2 = m + 1
                else:
                    e = m
        jhi[tl] = e
        if jlo[tl] < jhi[tl]:
            u0 = min(u0, jlo[tl])
            u1 = max(u1, jhi[tl])
    qs = np.empty((R, dim), np.float32)        # row tl * H + h: token tl, head h; scale folded
    for tl in range(L):
        t = token_order[q0 + tl]
        for h in range(H):
            for d in range(dim):
                qs[tl * H + h, d] = q[t, h, d] * scale
    kt = np.empty((hkv, _TILE, dim), np.float32)
    vt = np.empty((hkv, _TILE, dv), np.float32)
    s = np.empty(_TILE, np.float32)
    acc = np.zeros((R, dv), np.float32)
    mx = np.full(R, -np.inf, np.float32)
    tot = np.zeros(R, np.float32)
    for j0 in range(u0, u1, _TILE):
        j1 = min(u1, j0 + _TILE)
        for j in range(j0, j1):
            c = kv_indices[j]
            for kh in range(hkv):
                _load_key_row(kpool, c, kh, kt[kh, j - j0], kfmt, kscale, bf16)
            for kh in range(hkv):
                _load_value_row(vpool, c, kh, vt[kh, j - j0], vperm, vfmt, vscale, bf16)
        for tl in range(L):
            a = max(j0, jlo[tl]) - j0
            e = min(j1, jhi[tl]) - j0
            if a >= e:
                continue
            for h in range(H):
                kh = h // g
                r = tl * H + h
                m = mx[r]
                for jj in range(a, e):
                    x = np.float32(0.0)
                    for d in range(dim):
                        x += qs[r, d] * kt[kh, jj, d]
                    if soft_cap > 0:
                        x = soft_cap * math.tanh(x / soft_cap)
                    s[jj] = x
                    m = max(m, x)
                # online softmax: rescale what was summed so far to the new maximum; weights
                # below exp(_EXP_FLUSH) are flushed to 0 (no denormal arithmetic)
                y = mx[r] - m
                corr = np.float32(math.exp(y)) if y > _EXP_FLUSH else np.float32(0.0)
                if corr != 1.0:
                    for d in range(dv):
                        acc[r, d] *= corr
                sm = tot[r] * corr
                for jj in range(a, e):
                    y = s[jj] - m
                    if y > _EXP_FLUSH:
                        w = np.float32(math.exp(y))
                        sm += w
                        for d in range(dv):
                            acc[r, d] += w * vt[kh, jj, d]
                mx[r] = m
                tot[r] = sm
    if row0 >= 0:
        for r in range(R):
            part_m[row0 + r] = mx[r]
            part_l[row0 + r] = tot[r]
            for d in range(dv):
                part_acc[row0 + r, d] = acc[r, d]
        return
    for tl in range(L):
        t = token_order[q0 + tl]
        for h in range(H):
            r = tl * H + h
            inv = np.float32(1.0) / tot[r] if tot[r] > 0 else np.float32(0.0)
            for d in range(dv):
                out[t, h, d] = acc[r, d] * inv


@njit(cache=True)
def _merge_item_parts(i, merges, items, qo_indptr, token_order, out, part_acc, part_m, part_l):
    """Sequence ``merges[i] = (i0, i1)``: its items ``i0:i1`` each hold the softmax of one part of
    its list; combine them (split-K) into its normalised rows of ``out``."""
    i0 = merges[i, 0]
    i1 = merges[i, 1]
    b = items[i0, 0]
    q0 = qo_indptr[b]
    L = qo_indptr[b + 1] - q0
    H = out.shape[1]
    dv = out.shape[2]
    for tl in range(L):
        t = token_order[q0 + tl]
        for h in range(H):
            r = tl * H + h
            m = -np.inf
            for k in range(i0, i1):
                m = max(m, part_m[items[k, 3] + r])
            tot = np.float32(0.0)
            for d in range(dv):
                out[t, h, d] = 0.0
            if m == -np.inf:
                continue
            for k in range(i0, i1):
                y = part_m[items[k, 3] + r] - m
                if y > _EXP_FLUSH:
                    w = np.float32(math.exp(y))
                    tot += w * part_l[items[k, 3] + r]
                    for d in range(dv):
                        out[t, h, d] += w * part_acc[items[k, 3] + r, d]
            inv = np.float32(1.0) / tot if tot > 0 else np.float32(0.0)
            for d in range(dv):
                out[t, h, d] *= inv


@njit(cache=True)
def _attend_pool(items, merges, q, kpool, vpool, bf16, vperm, kfmt, vfmt, kscale, vscale,
                 kv_indices, kv_pos, qo_indptr, token_order, q_pos, causal, window, chunk, scale,
                 soft_cap, out, part_acc, part_m, part_l):
    """Attention of the batch sequences named by ``items`` (:func:`_attend_item`), read straight
    from the cell pool, one thread.

    q float32 ``[T, H, D]`` (batch rows); kpool ``[n_cells, Hkv, D]`` and vpool ``[n_cells, Hkv,
    Dv]`` (``[Hkv, Dv, n_cells]`` when ``vperm``) float32, or uint16 bit patterns of float16
    (bfloat16 when ``bf16``); the page table's arrays (int32) and mask rule; out float32 ``[T,
    H, Dv]``: the rows of these sequences' tokens are written (zeros for a token that sees no
    cell). soft_cap <= 0: none. ``merges``: the sequences split into several items."""
    for it in range(items.shape[0]):
        _attend_item(it, items, q, kpool, vpool, bf16, vperm, kfmt, vfmt, kscale, vscale,
                     kv_indices, kv_pos, qo_indptr, token_order, q_pos, causal, window, chunk,
                     scale, soft_cap, out, part_acc, part_m, part_l)
    for i in range(merges.shape[0]):
        _merge_item_parts(i, merges, items, qo_indptr, token_order, out, part_acc, part_m,
                          part_l)


@njit(cache=True, parallel=True)
def _attend_pool_parallel(items, merges, q, kpool, vpool, bf16, vperm, kfmt, vfmt, kscale,
                          vscale, kv_indices, kv_pos, qo_indptr, token_order, q_pos, causal,
                          window, chunk, scale, soft_cap, out, part_acc, part_m, part_l):
    """:func:`_attend_pool` with the items, then the merges, spread over numba's threads."""
    for it in prange(items.shape[0]):
        _attend_item(it, items, q, kpool, vpool, bf16, vperm, kfmt, vfmt, kscale, vscale,
                     kv_indices, kv_pos, qo_indptr, token_order, q_pos, causal, window, chunk,
                     scale, soft_cap, out, part_acc, part_m, part_l)
    for i in prange(merges.shape[0]):
        _merge_item_parts(i, merges, items, qo_indptr, token_order, out, part_acc, part_m,
                          part_l)


@njit(cache=True)
def _plan_items(qo_indptr, kv_indptr, limit, short_cells, short_tokens, parallel_work, min_part,
                n_heads, threads):
    """The work of :func:`_kernel_plan` in one compiled pass over the page table's ``qo_indptr``
    / ``kv_indptr`` (int32 ``[n_b + 1]``): ``(items int64 [n_items, 4] (sequence, first cell,
    end cell, part row or -1), merges int64 [n_merges, 2] (item range of a split sequence),
    part_rows, mine bool [n_b] (the sequences the kernel computes), parallel)``. A split
    sequence's parts end at ``np.linspace(c0, c1, n_parts + 1)`` truncated, as numpy computes
    it."""
    nb = qo_indptr.shape[0] - 1
    mine = np.empty(nb, np.bool_)
    work = 0
    total = 0
    n_mine = 0
    for b in range(nb):
        count = np.int64(qo_indptr[b + 1] - qo_indptr[b])
        cells = np.int64(kv_indptr[b + 1] - kv_indptr[b])
        m = count <= limit or (cells <= short_cells and count <= short_tokens)
        mine[b] = m
        if m:
            work += cells * count
            total += cells
            n_mine += 1
    parallel = work * n_heads >= parallel_work
    split = parallel and 1 < threads and n_mine < 2 * threads
    parts = np.ones(nb, np.int64)
    n_items = 0
    n_merges = 0
    for b in range(nb):
        if not mine[b]:
            continue
        if split:
            cells = np.int64(kv_indptr[b + 1] - kv_indptr[b])
            share = np.ceil(cells * (2 * threads) / max(1, total))
            n_p = min(share, np.float64(cells // min_part))
            parts[b] = max(np.int64(n_p), 1)
        n_items += parts[b]
        if parts[b] > 1:
            n_merges += 1
    items = np.empty((n_items, 4), np.int64)
    merges = np.empty((n_merges, 2), np.int64)
    k = 0
    m = 0
    row = 0
    for b in range(nb):
        if not mine[b]:
            continue
        c0 = np.int64(kv_indptr[b])
        c1 = np.int64(kv_indptr[b + 1])
        n_p = parts[b]
        if n_p == 1:
            items[k, 0] = b
            items[k, 1] = c0
            items[k, 2] = c1
            items[k, 3] = -1
            k += 1
            continue
        merges[m, 0] = k
        merges[m, 1] = k + n_p
        m += 1
        step = (c1 - c0) / n_p
        count = np.int64(qo_indptr[b + 1] - qo_indptr[b])
        for p in range(n_p):
            items[k, 0] = b
            items[k, 1] = np.int64(p * step + c0)
            items[k, 2] = c1 if p + 1 == n_p else np.int64((p + 1) * step + c0)
            items[k, 3] = row
            row += count * n_heads
            k += 1
    return items, merges, row, mine, parallel


@njit(cache=True)
def _grow_decode_lists(items, kv_indices, kv_positions, token_order, seqs, positions, new_seqs,
                       new_positions, causal, start, slots, room):
    """One decode step of lists kept apart (numbakv.hf's decode route: list ``b`` is the whole
    list of batch sequence ``b``, its one query token ``token_order[b]``, in ``kv_indices`` /
    ``kv_positions`` entries ``items[b, 1] .. items[b, 2]`` (room for ``room``), ascending by
    position): when the pass (``new_seqs``, ``new_positions``, ``causal`` ``[batch]``) is the
    same sequences in the same order as the last one (``seqs``, ``positions``), each one
    position further and causal, append each token's cell (``start + t``, or ``slots[t]``
    when ``slots`` is not empty) and position to its list, grow ``items[:, 2]``, take the
    new positions into ``positions``, and return the cells listed in all; else change
    nothing and return 0 (not such a step) or -1 (a list is full: grow the room first)."""
    n = seqs.shape[0]
    if new_seqs.shape[0] != n or new_positions.shape[0] != n or items.shape[0] != n:
        return 0
    for i in range(n):
        if new_seqs[i] != seqs[i] or new_positions[i] != positions[i] + 1 or causal[i] == 0:
            return 0
    for b in range(n):
        if items[b, 2] - items[b, 1] >= room:
            return -1
    total = 0
    for b in range(n):
        t = token_order[b]
        j = items[b, 2]
        kv_indices[j] = start + t if slots.shape[0] == 0 else slots[t]
        kv_positions[j] = new_positions[t]
        items[b, 2] = j + 1
        total += j + 1 - items[b, 1]
    for i in range(n):
        positions[i] = new_positions[i]
    return total


class _KernelRun:
    """The arguments of one pass's CPU kernel call that every layer shares (the page table's
    arrays, the mask rule, the plan's items; built once per plan): a layer adds its query,
    pools and output (:meth:`run`)."""

    __slots__ = ("parallel", "items", "merges", "lists", "part_rows")

    def __init__(self, host: HostPages, plan: dict) -> None:
        rule = host.rule
        self.parallel = plan["parallel"]
        self.items, self.merges, self.part_rows = plan["items"], plan["merges"], \
            plan["part_rows"]
        self.lists = (host.kv_indices, host.kv_positions, host.qo_indptr, host.token_order,
                      host.q_positions, rule.causal, int(rule.window), int(rule.chunk))

    def run(self, qn: np.ndarray, kp, vp, dv: int, scale: float, soft_cap,
            formats: tuple = _PLAIN_FORMATS, bf16: bool = False,
            permuted: bool = False) -> np.ndarray:
        """float32 ``[T, H, dv]`` (a fresh array: the caller may hand it out) for ``qn``
        (float32 ``[T, H, D]``, C-contiguous) over the host pools ``kp``/``vp``."""
        res = np.empty((qn.shape[0], qn.shape[1], dv), np.float32)
        n_part = self.part_rows
        part_acc = np.empty((n_part, dv), np.float32)
        part_ml = np.empty((2, n_part), np.float32)
        kf, vf, ks, vs, _ = formats
        lists = self.lists
        # a child forked from a process that ran the threaded kernel runs it on one thread
        # (asked per call: a child may inherit a pass planned before the fork)
        fn = _attend_pool_parallel if self.parallel and os.getpid() == _PID else _attend_pool
        fn(self.items, self.merges, qn, kp, vp, bf16, permuted, kf, vf, np.float32(ks),
           np.float32(vs), lists[0], lists[1], lists[2], lists[3], lists[4], lists[5], lists[6],
           lists[7], np.float32(scale), np.float32(soft_cap if soft_cap is not None else 0.0),
           res, part_acc, part_ml[0], part_ml[1])
        return res


def _kernel_plan(host: HostPages, n_heads: int, half: bool, everything: bool = False) -> dict:
    """The CPU kernel's work for this pass (planned once per forward pass, kept in
    ``host.plans``): the sequences it computes (``_KERNEL_TOKENS`` and the limits after it;
    ``half``: 16-bit storage), as items (a whole list, or - when there are fewer sequences than
    twice numba's threads and the work is parallel - parts of at least ``_MIN_PART`` cells,
    merged afterwards). ``everything``: every sequence (a quantized pool no other path reads).
    ``plan["run"]``: the kernel call's shared arguments (:class:`_KernelRun`)."""
    limit = (1 << 62) if everything else _KERNEL_TOKENS_16BIT if half else _KERNEL_TOKENS
    key = ("kernel", limit, _SHORT_CELLS, _SHORT_TOKENS, _PARALLEL_WORK, _MIN_PART, n_heads)
    plan = host.plans.get(key)
    if plan is not None:
        return plan
    args = (host.qo_indptr, host.kv_indptr, limit, _SHORT_CELLS, _SHORT_TOKENS, _PARALLEL_WORK,
            _MIN_PART, n_heads)
    # planned for one thread first: numba.get_num_threads() starts numba's thread pool, which
    # only parallel work may do (an idle pool slows torch's own threads in the same process)
    items, merges, row, mine, parallel = _plan_items(*args, 1)
    if parallel:
        threads = numba.get_num_threads()
        if threads > 1:
            items, merges, row, mine, parallel = _plan_items(*args, threads)
    rest = []
    rows = None
    if items.shape[0] < mine.shape[0] or not mine.all():
        rest = np.flatnonzero(~mine).tolist()
        seqs = np.flatnonzero(mine).tolist()
        if rest and seqs:
            rows = np.concatenate([host.token_order[host.qo_indptr[b]:host.qo_indptr[b + 1]]
                                   for b in seqs]).astype(np.int64)
    plan = {"items": items, "merges": merges, "part_rows": int(row), "rest": rest,
            "rows": rows, "parallel": bool(parallel), "any": items.shape[0] > 0}
    plan["run"] = _KernelRun(host, plan)
    host.plans[key] = plan
    return plan


def _host_pool(x):
    """A layer_pool() view as the numpy array the kernel reads: float32 as is, float16 and
    bfloat16 as their uint16 bit patterns."""
    if isinstance(x, BFloat16View):
        return x.bits
    return x.view(np.uint16) if x.dtype == np.float16 else x


def _cpu_kernel(q, host: HostPages, plan: dict, pools, scale: float, soft_cap, permuted: bool,
                bf16: bool, formats: tuple = _PLAIN_FORMATS) -> np.ndarray:
    """float32 ``[batch, H, Dv]``: the rows of the plan's sequences' tokens from
    :func:`_attend_pool` (other rows undefined)."""
    kp, vp = (_host_pool(x) for x in pools)
    qn = q.detach().float().contiguous().numpy()
    v_dim = formats[4]
    dv = v_dim if formats[1] else vp.shape[1] if permuted else vp.shape[2]  # quantized: bytes
    return plan["run"].run(qn, kp, vp, dv, scale, soft_cap, formats, bf16, permuted)


#: quantized storage types the CPU kernel reads in place (kernels.quant's block formats)
_KERNEL_QUANT_TYPES = ("q8_0", "q4_0", "float8_e4m3")


def _pool_formats(src) -> Optional[tuple]:
    """``(kfmt, vfmt, kscale, vscale)`` of the current layer of a quantized cache whose pool the
    CPU kernel can read as stored, or None (then ``get()`` dequantizes). Rotated K/V
    (``kv_rotation``) are read as stored too: ``attend`` rotates the queries and turns the
    output back around either path. Memoised per (storage, layer slot): a config and its
    storage never change their formats or scales, and attend asks every layer of every step."""
    st = src.storage
    slot = src._storage_layers[src._layer]
    cfg = src.config
    memo = getattr(src, "_kernel_formats", None)
    if memo is None or memo[0] is not st or memo[1] is not cfg:
        memo = (st, cfg, {})
        src._kernel_formats = memo
    if slot in memo[2]:
        return memo[2][slot]
    out = None
    if all(not quantized or kind in _KERNEL_QUANT_TYPES    # e.g. fp8_ds_mla: get() decodes
           for quantized, kind in ((st.k_quantized, cfg.k_dtype),
                                   (st.v_quantized, cfg.v_dtype))):
        kf = int(st._k_fmt) if st.k_quantized else 0
        vf = int(st._v_fmt) if st.v_quantized else 0
        out = (kf, vf, float(cfg.layer_scales("k")[slot]), float(cfg.layer_scales("v")[slot]),
               int(cfg.v_head_dim))
    memo[2][slot] = out
    return out


def _quantized_paged(torch, q, host: HostPages, src, scale, soft_cap, formats):
    """``attend`` over a quantized CPU cache: every sequence through :func:`_attend_pool`,
    reading the rows its page list names from the storage as stored (quantized blocks
    dequantized per tile; a float side as float32, float16 or bfloat16 bits)."""
    plan = _kernel_plan(host, q.shape[1], True, everything=True)
    st = src.storage
    slot = src._storage_layers[src._layer]
    pools = (st.key_view(slot, 0, src.n_cells), st.value_view(slot, 0, src.n_cells))
    # a float V beside a quantized K may be stored permuted ([n_kv_heads, v_head_dim, n_cells])
    res = _cpu_kernel(q, host, plan, pools, scale, soft_cap, bool(src.config.permuted_v),
                      src.config.dtype == "bfloat16", formats)
    return torch.from_numpy(res).to(q.dtype)


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


def _torch_paged(torch, q, host: HostPages, pools, scale, soft_cap, permuted, bf16: bool):
    dev = q.device
    n_b = host.seq_ids.shape[0]
    todo = range(n_b)
    out = None
    if dev.type == "cpu" and _KERNEL_TOKENS >= 1:
        plan = _kernel_plan(host, q.shape[1], not _host_pool(pools[0]).dtype == np.float32)
        if plan["any"]:
            res = torch.from_numpy(_cpu_kernel(q, host, plan, pools, scale, soft_cap, permuted,
                                               bf16))
            if not plan["rest"]:
                return res.to(q.dtype)
            out = torch.empty(res.shape, dtype=q.dtype, device=dev)
            rows = torch.from_numpy(plan["rows"])
            out[rows] = res[rows].to(q.dtype)
            todo = plan["rest"]
    key_pool, value_pool = (torch.from_dlpack(x) for x in pools)
    H = q.shape[1]
    hkv = key_pool.shape[1]
    g = H // hkv
    dv = value_pool.shape[1] if permuted else value_pool.shape[2]
    split = dev.type == "cpu" and soft_cap is None
    if out is None and not (n_b == 1 and host.qo_indptr[1] == q.shape[0]):
        out = torch.empty((q.shape[0], H, dv), dtype=q.dtype, device=dev)
    # else out stays None: one sequence holds the whole batch, results are in batch order

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

def _latent_v_dim(src, cfg, v_dim) -> int:
    """0 for caches that store V; on a V-less (MLA) cache the latent's value width: ``v_dim``,
    else the cache's RopeShift offset (the rope dims follow the latent)."""
    if not getattr(cfg, "v_less", False):
        if v_dim is not None:
            raise ValueError(f"v_dim applies to V-less (v_head_dim=0) caches; this one stores V "
                             f"of v_head_dim={cfg.v_head_dim}")
        return 0
    return latent_value_width(cfg, getattr(src, "shift", None), v_dim, "attend()")


def _dense(torch, q, cache, scale, soft_cap, permuted, latent_v: int = 0):
    key, value, mask = cache.get()
    k = torch.from_dlpack(key)
    v = k[..., :latent_v] if latent_v else torch.from_dlpack(value)
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


# --------------------------------------------------------------------------------------------
# FlashAttention (CUDA): flash_attn_with_kvcache over the pool in pages
# --------------------------------------------------------------------------------------------

def flash_attn_unfit(cfg: Any, host: HostPages, q_dtype: str, *, on_cuda: bool, permuted: bool,
                     quantized: bool, latent: bool) -> Optional[str]:
    """None when FlashAttention's paged decode (``flash_attn_with_kvcache`` with
    ``block_table``) computes exactly this pass's attention over the cache, else why not (the
    reason ``backend="flash_attn"`` names). It needs: CUDA, float16/bfloat16 K/V not quantized,
    not permuted, not a latent (MLA) cache, ``q`` in the storage dtype, one head dim for K and V
    (<= 256, a multiple of 8), pages of a multiple of :data:`FLASH_ATTN_PAGE` cells
    (``CacheConfig(page_size)``, placed so that a sequence fills its pages in position order),
    no window or chunks, and a decode pass: one query per sequence, causal, at the sequence's
    last position."""
    if not on_cuda:
        return "the cache is not on CUDA"
    if quantized or latent:
        return "quantized K/V or a V-less (MLA) cache"
    if permuted:
        return "V is permuted (permuted_v=True)"
    if cfg.dtype not in ("float16", "bfloat16"):
        return f"storage dtype {cfg.dtype} (FlashAttention takes float16 / bfloat16)"
    if q_dtype != cfg.dtype:
        return f"q is {q_dtype}, the cache stores {cfg.dtype} (FlashAttention takes one dtype)"
    if cfg.v_head_dim != cfg.head_dim or cfg.head_dim > 256 or cfg.head_dim % 8:
        return (f"head_dim={cfg.head_dim}, v_head_dim={cfg.v_head_dim} (one head dim, <= 256, "
                "a multiple of 8)")
    if cfg.page_size % FLASH_ATTN_PAGE:
        return (f"page_size={cfg.page_size} is not a multiple of {FLASH_ATTN_PAGE} (the paged "
                "KV block size flash_attn_with_kvcache takes)")
    if host.rule.window >= 0 or host.rule.chunk > 0:
        return "a sliding window or chunks"
    if _max_queries(host) != 1 or not host.trailing:
        return ("not a decode pass (one causal query per sequence, at its last position, "
                "every sequence)")
    return None


def _flash_attn(torch, q, src: Any, host: HostPages, key_pool, value_pool, scale: float,
                soft_cap: Optional[float]):
    """``flash_attn_with_kvcache`` over the pool as ``[n_pages, page_size, Hkv, D]`` pages:
    the pass's :func:`numbakv.pages.paged_table` (planned once per pass, kept in
    ``host.plans``), one query per sequence (grouped by :attr:`PageTable.token_order`), rows
    returned in batch order. None when the pass's layout does not fill pages (a ``seq_rm`` of a
    middle range, a shared page written by another sequence...): the caller falls back."""
    from .errors import NotSupportedError
    from .pages import paged_table
    cfg = src.config
    plan = host.plans.get("flash_attn")
    if plan is None:
        try:
            pt = paged_table(host, cfg.page_size, src.n_cells, np)
        except NotSupportedError:
            plan = host.plans["flash_attn"] = False
        else:
            dev = q.device
            table = torch.as_tensor(np.maximum(pt.block_table, 0), dtype=torch.int32,
                                    device=dev)   # entries past a sequence's pages: never read
            lens = torch.as_tensor(pt.cache_seqlens, dtype=torch.int32, device=dev)
            order = torch.as_tensor(pt.token_order, dtype=torch.int64, device=dev)
            plan = host.plans["flash_attn"] = (table, lens, order)
    if plan is False:
        return None
    table, lens, order = plan
    from flash_attn import flash_attn_with_kvcache
    n_cells, hkv, d = key_pool.shape
    pages = (n_cells // cfg.page_size, cfg.page_size, hkv)
    res = flash_attn_with_kvcache(
        q.index_select(0, order)[:, None], key_pool.reshape(pages + (d,)),
        value_pool.reshape(pages + (value_pool.shape[2],)), cache_seqlens=lens,
        block_table=table, softmax_scale=scale, causal=True,
        softcap=float(soft_cap or 0.0))
    out = torch.empty((q.shape[0], q.shape[1], value_pool.shape[2]), dtype=q.dtype,
                      device=q.device)
    out[order] = res[:, 0].to(q.dtype)
    return out


__all__ = ["attend", "flash_attn_available", "flash_attn_unfit", "flashinfer_available",
           "BACKENDS", "FLASH_ATTN_PAGE"]
