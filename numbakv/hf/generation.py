"""``generation_cache``: a transformers ``Cache`` for ``model.generate()`` backed by numbakv.

The attention of a decode step runs on what the cache holds. The cache's layers store each
pass's new keys and values in a numbakv cache built by :func:`numbakv.hf.cache_for` (windows,
RoPE shift, quantized K/V options) and hand the model's attention layer back only those new
tensors; the model's attention implementation is numbakv's dispatcher (registered through
transformers' ``AttentionInterface`` as ``"numbakv_generate"``), which sees that these tensors
came from a generation cache and runs :func:`numbakv.attention.attend` over the cell pool
through the pass's page table (built once per step, read by every layer): no per-layer gather,
no copy of the visible K/V. A prompt's first pass (nothing cached yet) runs the model's own
attention over the prompt's K/V - the same call ``DynamicCache`` makes. Calls that are not a
generation cache's (the same model run with ``DynamicCache``, or no cache) go to the
implementation the model had.

Row ``b`` of the padded batch is numbakv sequence ``b`` (or the ``b``-th sequence a prefix store
leaves to requests); a column is a position. Left padding is never stored: the prompt's pad
columns (``attention_mask == 0``) are left out of the cache, so attention cannot see them.
Inputs that require grad are detached here: no ``torch.no_grad()`` is needed.
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import fields
from typing import Any, Dict, List, Optional

import numba
import numpy as np
from numba.np.ufunc import parallel as _numba_parallel

from ..config import CacheConfig
from ..device import torch_host_view
from ..errors import KVCacheError, KVCacheFullError, NotSupportedError
from ._deps import _transformers
from .attach import (_attention_modules, _layer_caches, _uses_attention_interface,
                     attached_cache)
from .families import _text_config, cache_for, hybrid_attention, hybrid_layout, model_shapes
from ._refused import RefusedLayerOps
from .identity import check_store_model
from .recurrent import RecurrentStateCalls, begin_passes_in_a_hook, generation_layer_class

#: The attention implementation name generation caches switch a model to (a dispatcher: it runs
#: numbakv attention for a generation cache's layers, the model's previous implementation else).
GENERATE_ATTENTION_NAME = "numbakv_generate"

#: per thread: the K tensor a generation cache's layer just returned and what it belongs to
#: (the attention call of the same layer takes it), and the padding mask of the running pass
_local = threading.local()
#: id(config) -> (weak reference to the config, the attention implementation it had)
_FALLBACK: Dict[int, tuple] = {}


def _previous_implementation(config) -> str:
    entry = _FALLBACK.get(id(config))
    if entry is not None and entry[0]() is config:
        return entry[1]
    return "sdpa"


def _dispatch(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function signature (query ``[b, H, q, D]``, key/value ``[b, KVH,
    kv, D]``) -> ``(out [b, q, H, Dv], weights or None)``: numbakv attention over the cache
    when ``key`` is what a generation cache's layer just returned, else the model's previous
    implementation."""
    handoff = getattr(_local, "handoff", None)
    state = None
    if handoff is not None and handoff[0] is key:
        _local.handoff = None
        state, layer = handoff[1], handoff[2]
        if not state.fallback_pass:
            out = state.attend(layer, query, kwargs.get("scaling"), kwargs.get("softcap"))
            if layer == state.last_attention:
                state.end_pass()
            return out, None
    elif handoff is not None and handoff[2] == getattr(module, "layer_idx", None):
        _local.handoff = None
        raise NotSupportedError(f"layer {handoff[2]}: the attention layer changed the keys a "
                                "numbakv generation cache returned before attending; "
                                "generation_cache cannot serve this model")
    name = _previous_implementation(module.config)
    if name == "eager":
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise NotSupportedError(f"{type(module).__name__}: no eager_attention_forward to "
                                    "fall back to")
    else:
        from transformers import AttentionInterface
        fn = AttentionInterface()[name]
    result = fn(module, query, key, value, attention_mask, **kwargs)
    if state is not None and layer == state.last_attention:
        state.end_pass()
    return result


def _dispatch_mask(*args, **kwargs):
    """The mask function registered beside :func:`_dispatch`: the previous implementation's own
    mask (for the prompt pass and for other caches); the padding mask of the pass is kept for
    the generation cache (its pad columns are never stored)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    config = kwargs.get("config")
    _local.padding = kwargs.get("attention_mask")
    name = _previous_implementation(config) if config is not None else "sdpa"
    fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name, sdpa_mask)
    return fn(*args, **kwargs)


def _switch_model(model) -> None:
    """Route ``model``'s attention through :func:`_dispatch` (once; calls that are not a
    generation cache's keep the implementation the model had)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(GENERATE_ATTENTION_NAME, _dispatch)
    AttentionMaskInterface.register(GENERATE_ATTENTION_NAME, _dispatch_mask)
    configs = [model.config] + [m.config for m in _attention_modules(model).values()
                                if hasattr(m, "config")]
    text = _text_config(model)
    configs.append(text)
    for cfg in configs:
        current = getattr(cfg, "_attn_implementation_internal", None)
        if current == GENERATE_ATTENTION_NAME:
            continue
        if current not in (None, "eager", "sdpa"):
            raise NotSupportedError(f"attn_implementation={current!r}: generation_cache serves "
                                    "models loaded with attn_implementation 'sdpa' or 'eager'")
        _FALLBACK[id(cfg)] = (weakref.ref(cfg), current or "sdpa")
        cfg._attn_implementation_internal = GENERATE_ATTENTION_NAME


def _share_torch_threads(torch) -> None:
    """Run numbakv's CPU kernels on at most as many threads as torch uses (transformers users
    size the CPU parallelism of a model with ``torch.set_num_threads``). numba's default is one
    thread per core: measured on a 2-core machine with torch at 1 thread, numba's idle second
    OpenMP thread made torch's own attention in the same process 40-70x slower per step (two
    OpenMP runtimes contending for the cores). Asked once per forward pass; nothing to do (and
    nothing started) while numba has no thread pool yet."""
    if not getattr(_numba_parallel, "_is_initialized", True):
        return
    want = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)


class _DecodeRoute:
    """generate()'s decode attention over one plain :class:`~numbakv.causal.CausalCache`, kept
    across passes: the CPU kernel's page lists in preallocated arrays (list ``b`` at
    ``[b * room, b * room + n_b)``: the kernel reads a list through its item's bounds, so
    lists need not be packed) and the kernel's work items, both grown in place by one cell per
    sequence per decode step instead of a page table and a plan built every pass.

    Made from a pass's validated route (:func:`numbakv.attention._cpu_pass_route`: its page
    table and plan), when every list is one sequence's with one query, the plan did not split
    a list and no window or chunk rule applies. :meth:`extend` then follows a pass only when
    the cell table changed by that pass's placement alone (the pass's version stamps), the
    batch is the same sequences in the same order, each one position further: exactly the
    page table a fresh build gives (lists ascend by position, the new cell is the newest),
    so the kernel's sums, and the tokens, are the same. Anything else (:meth:`seed` None,
    :meth:`extend` False): the caller takes the validated route again."""

    __slots__ = ("src", "cells", "version", "seqs", "positions", "room", "kv_indices",
                 "kv_positions", "items", "qo_indptr", "token_order", "parallel", "n_heads",
                 "permuted", "bf16", "legacy", "threads", "_att", "_run")

    @classmethod
    def seed(cls, src: Any, n_heads: int, route: tuple) -> Optional["_DecodeRoute"]:
        """A decode route continuing ``route`` (``_cpu_pass_route(src, n_heads)`` of the
        running pass), or None where the pass is not a plain decode step."""
        from .. import attention
        from ..causal import CausalCache
        host, plan, permuted, bf16 = route
        fwd = src._forward
        if type(src) is not CausalCache or fwd is None or fwd.reserve or plan["rest"] \
                or plan["merges"].shape[0] \
                or src.cells.version != fwd.cells_v1 or int(host.rule.window) >= 0 \
                or int(host.rule.chunk) > 0:
            return None
        n_b = host.qo_indptr.shape[0] - 1
        batch = fwd.positions.shape[0]
        if n_b != batch or host.q_positions.shape[0] != batch \
                or not np.array_equal(host.qo_indptr, np.arange(batch + 1)) \
                or plan["items"].shape[0] != batch \
                or not np.array_equal(plan["items"][:, 0], np.arange(batch)) \
                or not fwd.causal.all():
            return None
        self = cls()
        self.room = 0
        self.src, self.cells, self.version = src, src.cells, fwd.cells_v1
        self.seqs, self.positions = fwd.seqs.copy(), fwd.positions.copy()
        self.qo_indptr = host.qo_indptr.copy()
        self.token_order = host.token_order.copy()
        self.parallel, self.n_heads, self.permuted, self.bf16 = plan["parallel"], n_heads, \
            permuted, bf16
        self.legacy = route
        self.kv_indices = self.kv_positions = np.zeros(0, np.int32)
        self.items = plan["items"].copy()
        self.threads = numba.get_num_threads() if self.parallel else 1
        self._att = attention
        # the pass's kernel call (the validated route's), reading this route's lists instead
        self._run = attention._KernelRun(host, plan)
        self._grow(int(np.diff(host.kv_indptr).max()) + 64, host)
        self._bind(fwd)
        return self

    def _grow(self, room: int, host: Any = None) -> None:
        """Room for ``room`` cells per list: the lists copied into fresh arrays (from ``host``'s
        packed lists when seeding), ``items``' bounds moved with them."""
        items = self.items
        batch = items.shape[0]
        if host is not None:
            lo, hi = host.kv_indptr[:-1].astype(np.int64), host.kv_indptr[1:].astype(np.int64)
            cells, pos = host.kv_indices, host.kv_positions
        else:
            lo, hi = items[:, 1].copy(), items[:, 2].copy()
            cells, pos = self.kv_indices, self.kv_positions
        kv_indices = np.zeros(batch * room, np.int32)
        kv_positions = np.zeros(batch * room, np.int32)
        for b in range(batch):
            a, z = int(lo[b]), int(hi[b])
            kv_indices[b * room:b * room + z - a] = cells[a:z]
            kv_positions[b * room:b * room + z - a] = pos[a:z]
        self.kv_indices, self.kv_positions, self.room = kv_indices, kv_positions, room
        items[:, 1] = np.arange(batch, dtype=np.int64) * room
        items[:, 2] = items[:, 1] + (hi - lo)

    def extend(self, src: Any) -> bool:
        """Follow ``src``'s running pass (see the class docstring); False: not a plain next
        decode step, or the kernel would plan it otherwise (the caller drops this route)."""
        att = self._att
        fwd = src._forward
        if src is not self.src or fwd is None or fwd.reserve or src.cells is not self.cells \
                or fwd.cells_v0 != self.version or src.cells.version != fwd.cells_v1:
            return False
        slots = _NO_SLOTS if fwd.slots is None else fwd.slots
        for _ in range(2):
            total = att._grow_decode_lists(self.items, self.kv_indices, self.kv_positions,
                                           self.token_order, self.seqs, self.positions,
                                           fwd.seqs, fwd.positions, fwd.causal, fwd.start,
                                           slots, self.room)
            if total != -1:
                break
            self._grow(2 * self.room)          # a list is full: twice the room, then again
        if total <= 0:
            return False
        self.version = fwd.cells_v1
        self._bind(fwd)
        if self.parallel:
            # planned on this many threads (a list split across them would be another plan)
            return numba.get_num_threads() == self.threads
        # as attention._plan_items decides (one query per list): past this much work the
        # kernel runs threaded and may split a list; the full route plans it
        return total * self.n_heads < att._PARALLEL_WORK

    def _bind(self, fwd: Any) -> None:
        """Point the kernel call at this route's lists and items and at pass ``fwd``'s query
        positions and causal flags (the window and chunk rule stay the seed's: none)."""
        run = self._run
        run.items = self.items
        run.lists = (self.kv_indices, self.kv_positions, self.qo_indptr, self.token_order,
                     fwd.positions, fwd.causal) + run.lists[6:]

    def run(self, q: np.ndarray, pools: tuple, scale: float,
            soft_cap: Optional[float]) -> np.ndarray:
        """float32 ``[batch, n_heads, v_dim]`` (fresh) for ``q`` float32 ``[batch, n_heads,
        head_dim]`` C-contiguous over one layer's pools (``_routed_layer_pools``): the validated
        route's kernel call (``attention._KernelRun.run``, plain formats) over these lists."""
        kp, vp, dv = pools
        return self._run.run(q, kp, vp, dv, scale, soft_cap, bf16=self.bf16,
                             permuted=self.permuted)


#: a decode route's "no slots" (contiguous placement: the batch's cells are start .. start + n)
_NO_SLOTS = np.zeros(0, np.int32)


class _GenState:
    """What the layers of one generation cache share: the numbakv cache (built at the first
    forward pass, when the batch size and prompt length are known, unless a prefix store
    brought its own), the rows' sequences, and the columns every row holds."""

    def __init__(self, model: Any, max_new_tokens: Optional[int], capacity: Optional[int],
                 dtype: Any, device: str, kw: dict, store: Any, n_layers: int) -> None:
        self.model, self.max_new_tokens, self.capacity = model, max_new_tokens, capacity
        self.dtype, self.device, self.kw = dtype, device, kw
        self.store = store
        self.cache: Any = None if store is None else store.cache
        self.n_layers = n_layers
        self.last_attention = n_layers - 1   # the layer whose attention ends a pass
        self.pending = None         # (batch, new) of a pass the forward pre-hook saw begin
        self.batch = 0
        self.columns = 0            # columns (positions) of every row the numbakv cache holds
        self.seqs: Optional[np.ndarray] = None    # numbakv sequence of each row
        self.seqs32: Optional[np.ndarray] = None  # the same, int32 (start_forward's fast path)
        #: per model layer: (its storage, the CPU kernel's views of its pools), kept across
        #: passes (a storage's arrays never move; checked against the layer cache's storage)
        self.pools: dict = {}
        self.keep = None            # this pass: torch index of the stored (non-pad) tokens
        self.decode = False         # this pass: one column per row, no pads (a decode step)
        self.torch: Any = None      # the torch module (once the cache is bound)
        self.put_dtype = None       # a plain CPU cache: its storage dtype (trusted decode puts)
        self.owns: List[bool] = []  # ... and per layer whether it stores K/V
        self.routes: dict = {}      # this pass: the CPU-kernel route per (attention cache, heads)
        #: across passes: the decode route per (attention cache, heads) (_DecodeRoute)
        self.decode_routes: dict = {}
        self.fallback_pass = False  # this pass runs the model's own attention (nothing cached)
        self.prompt: Optional[np.ndarray] = None  # [batch, n] token ids, when known (store)
        self.fed: List[np.ndarray] = []           # token ids fed after the prompt (store)
        self.loaded = 0             # prefix tokens the store gave every row
        self.prompt_columns = 0     # columns after the prompt's pass
        self.padded = None          # per row: whether the prompt had pad columns
        self.storage_dtype = None
        self.host_puts = False      # a CPU cache: puts hand numpy views (put's trusted path)
        self.quantized = False
        self.layer_caches: List[Any] = []
        #: an MLA model: its layers cache latent rows and attend themselves (see store_latent)
        self.latent = model_shapes(model).latent is not None

    # ---------------------------------------------------------------- sequences and sizing
    def _build(self, batch: int, new: int) -> None:
        torch, _ = _transformers()
        if self.cache is None:
            capacity = self.capacity
            if capacity is None:              # per sequence: the prompt and what generate adds
                capacity = new + self.max_new_tokens
            self.cache = cache_for(self.model, capacity=int(capacity), max_seqs=batch,
                                   max_batch=max(512, batch * new), dtype=self.dtype,
                                   device=self.device, **self.kw)
        self._bind_cache(batch)

    def _bind_cache(self, batch: int) -> None:
        torch, _ = _transformers()
        self.torch = torch
        self.layer_caches = _layer_caches(self.cache)   # None: a hybrid's recurrent layers
        attending = [c for c in self.layer_caches if c is not None]
        self.storage_dtype = getattr(torch, attending[0].config.dtype)
        self.host_puts = all(c.device == "cpu" for c in attending)
        self.quantized = any(getattr(getattr(c, "storage", None), "quantized", False)
                             for c in attending)
        cfg = attending[0].config
        reserved = set(self.store.retain_seqs) if self.store is not None else set()
        free = [s for s in range(cfg.max_seqs) if s not in reserved]
        if len(free) < batch:
            raise ValueError(f"the batch has {batch} rows but the cache leaves {len(free)} "
                             f"sequences to requests (max_seqs={cfg.max_seqs}, "
                             f"{len(reserved)} retained by the store): build it with "
                             f"max_seqs >= {batch + len(reserved)}")
        self.seqs = np.asarray(free[:batch], np.int64)
        self.seqs32 = self.seqs.astype(np.int32)
        self.pools = {}
        self.decode_routes = {}
        # a plain CPU cache: decode passes put through its trusted per-layer path, into the
        # layers that own their K/V (a layer_reuse reader stores nothing)
        from ..causal import CausalCache
        plain = type(self.cache) is CausalCache and self.cache.device == "cpu"
        self.put_dtype = self.cache.config.storage_dtype if plain else None
        self.owns = [plain and self.cache.config.owner_layer(i) == i
                     for i in range(self.cache.config.n_layers)] if plain else []
        for s in self.seqs.tolist():          # a previous generate's rows
            if self.cache.seq_pos_max(s) >= 0:
                self.cache.seq_rm(s)
        self.batch = batch

    def load_prefix(self, input_ids) -> int:
        """Load the store's longest prefix shared by every row of ``input_ids`` (``[batch,
        n]``, no padding) into the rows' sequences, keeping one token per row to compute."""
        torch, _ = _transformers()
        ids = np.asarray(input_ids.detach().cpu() if hasattr(input_ids, "detach")
                         else input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"input_ids must be token ids [batch, n], got {ids.dtype} "
                             f"{list(ids.shape)}")
        self.prompt = ids.astype(np.int64)
        self._bind_cache(ids.shape[0])
        rows = [r[:-1].tolist() for r in self.prompt]
        n = min(self.store.match(r) for r in rows)
        if n == 0:
            return 0
        got = []
        for seq, r in zip(self.seqs.tolist(), rows):
            try:
                got.append(self.store.load(seq, r[:n]))
            except KVCacheFullError:
                got.append(0)
        n = min(got)
        for seq, g in zip(self.seqs.tolist(), got):
            if g > n:
                self.cache.seq_rm(seq, n)
        self.columns = self.loaded = n
        return n

    def begin(self, batch: int, new: int) -> None:
        """A forward pass of ``new`` columns for each of ``batch`` rows (the first layer's
        update): place the non-pad tokens, decide who attends."""
        self.pending = None
        if self.host_puts:                    # (self.torch is bound with host_puts)
            _share_torch_threads(self.torch)
        padding = getattr(_local, "padding", None)
        _local.padding = None
        if new == 1 and self.owns and self.columns and batch == self.batch \
                and self.padded is not None and batch <= self.cache.config.max_batch:
            # a decode step into a plain CPU cache (every pass after the prompt's): one position
            # for every row, its rows' sequences checked when the cache was bound (seqs32,
            # never changed); the padding mask no longer matters (pads are never stored)
            self._start_pass(np.full(batch, self.columns, np.int32), self.seqs32, None, new,
                             checked=True)
            return
        torch, _ = _transformers()
        if self.seqs is None or self.cache is None:
            self._build(batch, new)
        elif batch != self.batch:
            raise ValueError(f"this generation cache serves a batch of {self.batch} rows, got "
                             f"{batch}: make one hf.generation_cache per generate() call")
        keep = None
        if self.padded is None:
            self.padded = np.zeros(batch, bool)
        if padding is not None and self.columns == 0:
            pad = padding[:, -new:] if padding.shape[-1] >= new else None
            if pad is not None and not bool(pad.all()):
                flat = pad.reshape(-1)
                # left padding: each row's pads come first (what generate() expects)
                first = pad.int().argmax(dim=1)
                ok = (pad.int().cumsum(dim=1) == (torch.arange(new)[None] - first[:, None] + 1)
                      .clamp(min=0)).all()
                if not bool(ok):
                    raise ValueError("generation_cache needs left padding (tokenizer "
                                     "padding_side='left'): attention_mask has a 0 after a 1")
                keep = torch.nonzero(flat.to("cpu")).reshape(-1)
                self.padded = (~pad.all(dim=1)).cpu().numpy()
        # int32 arrays: start_forward's fast path (one compiled range check, no conversion)
        if new == 1:                          # a decode step: one position for every row
            positions = np.full(batch, self.columns, np.int32)
            seqs = self.seqs32
        else:
            positions = np.tile(np.arange(self.columns, self.columns + new, dtype=np.int32),
                                batch)
            seqs = np.repeat(self.seqs32, new)
        if keep is not None:
            k = keep.numpy()
            positions, seqs = positions[k], seqs[k]
        self._start_pass(positions, seqs, keep, new)

    def _start_pass(self, positions: np.ndarray, seqs: np.ndarray, keep: Any, new: int,
                    checked: bool = False) -> None:
        """Start the cache's forward pass of the stored tokens (int32 ``positions`` / ``seqs``
        ``[n]``; ``checked``: through its trusted start, the decode step's rows checked when
        the cache was bound) and record the pass: ``keep`` (torch index of the stored tokens,
        None: all of them) and ``new`` columns a row."""
        try:
            if checked:
                self.cache._start_forward_checked(positions, seqs)
            else:
                self.cache.start_forward(positions, seqs)
        except KVCacheFullError as exc:
            raise self._full_error(exc, new) from None
        self.keep = keep
        self.decode = new == 1 and keep is None
        self.routes = {}            # this pass: attend's CPU-kernel route per attention cache
        # the prompt's pass over an empty cache: the model's own attention over the prompt's
        # K/V (what DynamicCache runs); quantized K/V are attended as stored, in every pass
        self.fallback_pass = self.columns == 0 and not self.quantized
        self.columns += new

    def _full_error(self, exc: KVCacheFullError, new: int) -> KVCacheFullError:
        """``exc`` of a pass of ``new`` columns, saying which size to raise."""
        return KVCacheFullError(
            f"{exc}: the generation cache holds {self.layer_caches[0].config.capacity} tokens "
            f"per row and this pass needs {self.columns + new}: pass hf.generation_cache("
            "max_new_tokens=) at least generate()'s max_new_tokens (or a larger capacity=)")

    def ensure_begun(self) -> None:
        """Begin the pass the forward pre-hook saw start, if no layer began it yet (a hybrid's
        first layer is recurrent: it asks for its state before any attention layer stores)."""
        if self.pending is not None:
            self.begin(*self.pending)

    # ---------------------------------------------------------------- per layer
    def store_layer(self, layer: int, key_states, value_states) -> None:
        """Put ``[batch, kv_heads, new, D]`` keys/values of ``layer`` (rows then columns, the
        order ``begin`` placed them; pad columns left out)."""
        batch, heads, new, dim = key_states.shape
        cache = self.cache
        want = self.storage_dtype
        if self.decode and self.owns and self.owns[layer] and key_states.dtype is want \
                and value_states.dtype is want and not key_states.requires_grad \
                and not value_states.requires_grad:
            # a decode step into a plain CPU cache: [batch, kv_heads, 1, D] host views as
            # [batch, kv_heads, D] (dropping the one column is a view), put through the
            # cache's trusted per-layer path once checked here (this layer's one put of the
            # pass: update() refuses a second)
            k = torch_host_view(self.torch, key_states).reshape(batch, heads, dim)
            v = torch_host_view(self.torch, value_states)
            v = v.reshape(batch, heads, v.shape[-1])
            if k.dtype is self.put_dtype and v.dtype is self.put_dtype \
                    and k.flags.c_contiguous and v.flags.c_contiguous \
                    and k.shape[1:] == cache._kv_tail[0] and v.shape[1:] == cache._kv_tail[1] \
                    and batch == cache._forward.positions.shape[0]:
                cache._put_layer_trusted(layer, k, v)
                return
        cache.set_layer(layer)
        if self.layer_caches[layer]._put_layer < 0:
            return                            # a KV-sharing layer: its source layer stored them
        if self.host_puts and self.keep is None and key_states.dtype is want \
                and value_states.dtype is want:
            # the common pass (CPU cache, the model's dtype, no pads): numpy views of the
            # tensors, [batch, kv_heads, new, D] -> [batch * new, kv_heads, D], for put's trusted
            # path (no import, no second validation); a copy only where the layout needs one
            torch, _ = _transformers()
            k = torch_host_view(torch, key_states.detach() if key_states.requires_grad
                                else key_states).transpose(0, 2, 1, 3).reshape(batch * new,
                                                                                heads, dim)
            v = torch_host_view(torch, value_states.detach() if value_states.requires_grad
                                else value_states).transpose(0, 2, 1, 3)
            v = v.reshape(batch * new, heads, v.shape[-1])
            if not k.flags.c_contiguous:
                k = np.ascontiguousarray(k)
            if not v.flags.c_contiguous:
                v = np.ascontiguousarray(v)
            cache.put(k, v)
            return
        k = key_states.detach().transpose(1, 2).reshape(batch * new, heads, dim)
        v = value_states.detach().transpose(1, 2).reshape(batch * new, heads, -1)
        if self.keep is not None:
            k, v = k.index_select(0, self.keep), v.index_select(0, self.keep)
        k, v = k.to(want).contiguous(), v.to(want).contiguous()
        if self.host_puts:
            # numpy views of the tensors: put's trusted path (no import, no second validation)
            torch, _ = _transformers()
            k, v = torch_host_view(torch, k), torch_host_view(torch, v)
        cache.put(k, v)

    def store_latent(self, layer: int, kv_nope, k_rot):
        """An MLA layer's pass: put the latent rows ``[kv_nope | k_rot]`` (``[batch, 1, new,
        kv_lora_rank]`` and ``[batch, 1, new, rope]``; pad columns left out) and return every
        row's latents ``(kv_nope, k_rot)`` ``[batch, 1, columns, ...]`` in the model's dtype,
        column ``c`` = position ``c`` (never-stored pad columns zero: the model's own mask, built
        for these columns, hides them)."""
        torch, _ = _transformers()
        batch, _, new, rank = kv_nope.shape
        row = torch.cat([kv_nope.detach(), k_rot.detach().to(kv_nope.dtype)], dim=-1)
        dim = row.shape[-1]
        cache = self.cache
        cache.set_layer(layer)
        src = self.layer_caches[layer]
        if src._put_layer >= 0:
            k = row.transpose(1, 2).reshape(batch * new, 1, dim)
            if self.keep is not None:
                k = k.index_select(0, self.keep)
            cache.put(k.to(self.storage_dtype).contiguous(), None)
        key, _, _ = src.get()
        lo, _ = src.cell_range()
        pages = src._host_pages()
        pool = torch.from_dlpack(key)
        out = torch.zeros(batch, self.columns, dim, dtype=kv_nope.dtype, device=pool.device)
        by_seq = {int(s): b for b, s in enumerate(pages.seq_ids)}
        for r, seq in enumerate(self.seqs.tolist()):
            b = by_seq.get(int(seq))
            if b is None:
                continue
            a, z = int(pages.kv_indptr[b]), int(pages.kv_indptr[b + 1])
            cells = torch.from_numpy(pages.kv_indices[a:z].astype(np.int64) - lo)
            cols = torch.from_numpy(pages.kv_positions[a:z].astype(np.int64))
            out[r, cols.to(pool.device)] = pool.index_select(0, cells.to(pool.device))[:, 0] \
                .to(kv_nope.dtype)
        rot = src.config.k_rotation
        if rot:   # a rotated quantized latent (llama.cpp #21038): the model reads the plain basis
            from ..rotation import hadamard_blocks
            out = hadamard_blocks(out, rot).to(kv_nope.dtype)
        out = out[:, None]
        return out[..., :rank], out[..., rank:]

    def attend(self, layer: int, query, scaling, softcap):
        """query ``[batch, H, new, D]`` -> ``[batch, new, H, Dv]``: numbakv attention over the
        cell pool (the pass's page table)."""
        batch, heads, new, dim = query.shape
        if self.keep is None and self.host_puts and scaling is not None \
                and (softcap is None or softcap > 0):
            src = self.layer_caches[layer]
            route = self.routes.get((id(src), heads), False)
            if route is False:
                route = self.routes[(id(src), heads)] = self._pass_route(src, heads)
            if route is not None:
                return self._attend_routed(layer, src, route, query, float(scaling),
                                           None if softcap is None else float(softcap))
        from ..attention import attend
        q = query.detach().transpose(1, 2).reshape(batch * new, heads, dim)
        keep = self.keep
        if keep is not None:
            # a padded pass attended here (quantized K/V: the prompt pass too): only the stored
            # tokens are the cache's batch; pad rows' outputs are zeros nothing ever reads
            q = q.index_select(0, keep)
        want = self.storage_dtype
        self.cache.set_layer(layer)
        if q.dtype != want:
            q = q.to(want)
        out = attend(q, self.cache, scale=scaling, soft_cap=softcap)
        if keep is not None:
            full = out.new_zeros((batch * new, heads, out.shape[-1]))
            full[keep] = out
            out = full
        if out.dtype != query.dtype:
            out = out.to(query.dtype)
        return out.reshape(batch, new, heads, -1)

    def _pass_route(self, src: Any, heads: int):
        """The CPU-kernel route of this pass for attention cache ``src`` and ``heads`` query
        heads (every layer of ``src`` shares it), or None (``attend`` computes). A decode step
        right after the last one grows the last pass's route (:class:`_DecodeRoute`); else the
        pass's page table and kernel plan are validated and planned here, by its first layer."""
        key = (id(src), heads)
        grown = self.decode_routes.pop(key, None)
        if grown is not None and grown.extend(src):
            self.decode_routes[key] = grown
            return grown
        from ..attention import _cpu_pass_route
        route = _cpu_pass_route(src, heads)
        if route is not None:
            grown = _DecodeRoute.seed(src, heads, route)
            if grown is not None:
                self.decode_routes[key] = grown
                return grown
        return route

    def _attend_routed(self, layer: int, src, route: tuple, query, scaling: float,
                       softcap: Optional[float]):
        """:meth:`attend` along the pass's CPU-kernel route (trusted: made by
        ``attention._cpu_pass_route`` for ``src``, the layer's attention cache, and ``query``'s
        head count; no pad rows): the query's host view in, the kernel, a torch view of its
        fresh output out (never reused: transformers' consumers, or a user's hook on the output
        projection, may keep it)."""
        torch = self.torch
        batch, heads, new, dim = query.shape
        q = query.detach() if query.requires_grad else query
        want = self.storage_dtype
        if q.dtype is not want:
            q = q.to(want)                    # rounded to the cache's dtype, as attend does
        if q.dtype is not torch.float32:
            q = q.float()
        qn = q.numpy()
        # [batch, heads, new, dim] -> [batch * new, heads, dim] (one column: a view as is)
        qn = (qn if new == 1 else qn.transpose(0, 2, 1, 3)).reshape(batch * new, heads, dim)
        if not qn.flags.c_contiguous:
            qn = np.ascontiguousarray(qn)
        grown = type(route) is _DecodeRoute
        entry = self.pools.get(layer)
        if entry is None or entry[0] is not src.storage:
            from ..attention import _routed_layer_pools
            entry = self.pools[layer] = (src.storage, _routed_layer_pools(
                self.cache, layer, route.legacy if grown else route))
        if grown:
            res = route.run(qn, entry[1], scaling, softcap)
        else:
            from ..attention import _attend_cpu_routed
            res = _attend_cpu_routed(qn, entry[1], route, scaling, softcap)
        res = torch.from_numpy(res)
        if want is not torch.float32:
            res = res.to(want)                # attend returns the cache's dtype
        if res.dtype is not query.dtype:
            res = res.to(query.dtype)
        return res.view(batch, new, heads, res.shape[-1])

    def end_pass(self) -> None:
        """After the last layer attended: save the rows to the store after the prompt's pass
        and after the pass that reaches ``max_new_tokens`` (the last one generate() runs)."""
        if self.store is None:
            return
        if self.prompt_columns == 0:
            self.prompt_columns = self.columns
            self.save()
        elif self.max_new_tokens is not None and \
                self.columns >= self.prompt_columns + self.max_new_tokens - 1:
            self.save()

    def save(self) -> int:
        """Save every unpadded row's tokens (the loaded prefix and every token fed since, as
        the forward hook saw them) to the store; returns the tokens saved per row (0: none)."""
        if self.store is None or self.seqs is None or not self.fed:
            return 0
        fed = np.concatenate(self.fed, axis=1)
        lead = self.prompt[:, :self.loaded] if self.loaded else fed[:, :0]
        tokens = np.concatenate([lead, fed], axis=1)[:, :self.columns]
        if tokens.shape[1] != self.columns:
            return 0                          # the hook missed a pass: tokens unknown
        saved = 0
        for row, seq in enumerate(self.seqs.tolist()):
            if self.padded[row]:
                continue                      # pads shift its positions: not a reusable prefix
            saved = self.store.save(seq, tokens[row].tolist())
        return saved


def _layer_class():
    torch, cache_utils = _transformers()

    class NumbakvLayer(RefusedLayerOps, cache_utils.CacheLayerMixin):
        """One model layer of a :func:`generation_cache` (see the module docstring)."""

        is_compileable = False
        is_croppable = False
        supports_early_init = False

        def __init__(self, state: _GenState, layer: int, window: Optional[int]) -> None:
            super().__init__()
            self.state, self.layer = state, layer
            # transformers' sliding window W counts the query token: numbakv's swa_window + 1
            self.sliding_window = None if window is None else window + 1
            self.is_sliding = window is not None
            self.cumulative_length = state.columns

        def lazy_initialization(self, key_states, value_states) -> None:
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            """Store ``[batch, kv_heads, new, head_dim]`` keys/values; return them as they came:
            the attention call of this layer (numbakv's dispatcher) recognises them and attends
            over the cache."""
            state = self.state
            pending = getattr(_local, "handoff", None)
            if pending is not None and pending[1] is state:
                raise NotSupportedError(
                    f"layer {pending[2]}'s attention did not go through transformers' "
                    "AttentionInterface: generation_cache cannot serve this model")
            batch, heads, new, dim = key_states.shape
            if self.cumulative_length == state.columns:     # the first layer of a new pass
                state.begin(batch, new)
            elif self.cumulative_length + new != state.columns:
                raise KVCacheError(f"layer {self.layer} got {new} new columns, the pass started "
                                   f"with {state.columns - self.cumulative_length}")
            if state.latent:
                # MLA (transformers >= 5.24 caches the latent): key_states is kv_nope [batch, 1,
                # new, kv_lora_rank], value_states k_rot [batch, 1, new, rope]; numbakv keeps one
                # V-less row [kv_nope | k_rot] per token and hands the model back every row's
                # visible latents, which the model expands per head and attends itself
                kv_nope, k_rot = state.store_latent(self.layer, key_states, value_states)
                self.is_initialized = True
                self.cumulative_length += new
                if self.layer == state.n_layers - 1:
                    state.end_pass()
                return kv_nope, k_rot
            state.store_layer(self.layer, key_states, value_states)
            self.is_initialized = True
            self.cumulative_length += new        # counted once stored
            _local.handoff = (key_states, state, self.layer)
            return key_states, value_states

        def get_mask_sizes(self, query_length: int):
            if self.sliding_window is None:
                return self.cumulative_length + query_length, 0
            w = self.sliding_window
            offset = max(self.cumulative_length - w + 1, 0)
            if self.cumulative_length >= w:
                return w - 1 + query_length, offset
            return self.cumulative_length + query_length, offset

        def get_seq_length(self) -> int:
            return self.cumulative_length

        def get_max_length(self) -> int:
            return -1 if self.sliding_window is None else self.sliding_window

    return NumbakvLayer


def _record_inputs(cache_ref, state: _GenState):
    """A forward pre-hook: the token ids each pass of ``cache_ref()``'s generate() feeds (what
    the rows hold, for the store)."""

    def hook(module, args, kwargs):
        cache = cache_ref()
        if cache is None:
            return None
        given = kwargs.get("past_key_values", kwargs.get("cache"))
        if given is not cache:
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            state.fed.append(ids.detach().to("cpu").numpy().astype(np.int64).reshape(
                ids.shape[0], -1))
        return None
    return hook


def generation_cache(model: Any, *, max_new_tokens: Optional[int] = None,
                     capacity: Optional[int] = None, dtype: Any = None, device: str = "auto",
                     store: Any = None, input_ids: Any = None, **kw) -> Any:
    """A transformers ``Cache`` for ``model.generate(..., cache=past)`` (``past_key_values=``
    before transformers 5.24) whose keys and values live in a numbakv cache, and whose decode
    attention runs on the cache itself (see the module docstring).

    Args:
        model: the transformers model, loaded with ``attn_implementation`` ``"sdpa"`` (the
            default) or ``"eager"``, not attached with ``hf.attach``. Its attention is routed
            through numbakv's dispatcher from now on (calls that are not a generation cache's
            keep the model's own implementation).
        max_new_tokens: tokens ``generate`` will add per row: each row's sequence holds
            ``prompt + max_new_tokens`` tokens, and the cache is sized for the real batch
            (``batch`` sequences of that capacity). A ``generate()`` that goes further fails
            with ``KVCacheFullError`` naming the size to raise.
        capacity: tokens per row (per sequence) instead of ``prompt + max_new_tokens``.
        dtype, device, **kw: as :func:`numbakv.hf.cache_for` (e.g. ``k_dtype="q8_0",
            v_dtype="q8_0"`` for quantized K/V).
        store: a ``numbakv.PrefixStore`` whose cache (``hf.cache_for(model, ...)``, at least
            ``batch + len(store.retain_seqs)`` sequences) holds the rows: the prompt's first
            pass saves the prompt, the pass that reaches ``max_new_tokens`` saves everything
            (``past.save()`` any time), and with ``input_ids`` the prompt starts from the
            store's longest prefix shared by every row (generate() then computes the rest only).
            A store that records a ``model_id`` must record :func:`numbakv.hf.model_id`.
        input_ids: the prompt ``[batch, n]`` (no padding) generate() will get, with ``store``.

    Returns:
        a ``transformers.Cache`` (DynamicCache-compatible: ``update``, ``get_seq_length``,
        ``get_mask_sizes``). One per ``generate()`` call: the batch (one numbakv sequence per
        row of the padded batch) is fixed by its first forward pass. ``.numbakv_cache`` is the
        numbakv cache once that pass ran; ``.reused_tokens`` the prompt tokens per row the
        store served. Beam search and assisted decoding are refused.
    """
    torch, cache_utils = _transformers()
    if capacity is None and max_new_tokens is None:
        raise ValueError("generation_cache needs max_new_tokens (or capacity) to size the cache")
    for name, value in (("max_new_tokens", max_new_tokens), ("capacity", capacity)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a transformers model, got {type(model).__name__}")
    if attached_cache(model) is not None:
        raise ValueError("model is attached to a numbakv cache (hf.attach): generate() runs the "
                         "model's own attention; call hf.detach(model) first")
    known = {f.name for f in fields(CacheConfig)} - {"n_layers", "n_kv_heads", "head_dim",
                                                      "v_head_dim", "capacity", "max_seqs",
                                                      "max_batch", "dtype", "device"}
    unknown = sorted(set(kw) - known - {"shift", "swa_memory"})
    if unknown:
        raise ValueError(f"generation_cache got unexpected option(s) {unknown}: extra options "
                         f"are hf.cache_for's (CacheConfig fields {sorted(known)}, shift, "
                         "swa_memory)")
    if store is not None:
        if not all(callable(getattr(store, n, None)) for n in ("match", "load", "save")) \
                or not hasattr(store, "retain_seqs") or getattr(store, "cache", None) is None:
            raise ValueError(f"store must be a numbakv.PrefixStore or None, got "
                             f"{type(store).__name__}")
        if kw or capacity is not None or dtype is not None:
            raise ValueError("with store=, the store's cache holds the rows: size and type it "
                             "with hf.cache_for(model, ...) (no capacity=, dtype= or cache "
                             "options here)")
        check_store_model(store, model, "hf.generation_cache")
    elif input_ids is not None:
        raise ValueError("input_ids is for loading a stored prefix: pass store= too")
    layout = hybrid_layout(model)
    attention = hybrid_attention(model)       # every layer, unless the model is a hybrid
    if any(la.chunk_size is not None for la in attention.values()):
        raise NotImplementedError("chunked-attention models are not supported by "
                                  "generation_cache")
    if layout is not None and "both" in layout.layer_kinds:
        raise NotSupportedError(f"{layout.family}: layers holding attention and a recurrent "
                                "mixer side by side are not supported by generation_cache yet")
    modules = _attention_modules(model)
    if not all(_uses_attention_interface(m) for m in modules.values()):
        raise NotSupportedError(f"{type(model).__name__}: its attention does not go through "
                                "transformers' AttentionInterface")
    state = _GenState(model, max_new_tokens, capacity, dtype, device, kw, store,
                      model_shapes(model).n_layers)
    state.last_attention = max(attention)
    if layout is not None and max(layout.recurrent_layers) > state.last_attention:
        state.last_attention = -1     # the pass ends after the model (a forward hook)
    reused = state.load_prefix(input_ids) if input_ids is not None else 0
    _switch_model(model)
    layer_cls = _layer_class()

    class NumbakvGenerationCache(RecurrentStateCalls, cache_utils.Cache):
        """A transformers Cache backed by numbakv (see :func:`numbakv.hf.generation_cache`)."""

        _numbakv_state = state

        @property
        def numbakv_cache(self):
            return state.cache

        @property
        def reused_tokens(self) -> int:
            """Prompt tokens per row the prefix store served (0 without a store)."""
            return reused

        def save(self) -> int:
            """Save what every unpadded row holds to the store now (generate() stopped early,
            e.g. at an end-of-sequence token); returns the tokens saved per row."""
            return state.save()

    layers = {i: layer_cls(state, i, la.swa_window) for i, la in attention.items()}
    if layout is not None:
        # recurrent layers: transformers' own layer over numbakv's state rows
        recurrent_cls = generation_layer_class()
        layers.update({i: recurrent_cls(state, i, j)
                       for j, i in enumerate(layout.recurrent_layers)})
    past = NumbakvGenerationCache(layers=[layers[i] for i in sorted(layers)])
    if layout is not None:
        begin_passes_in_a_hook(model, past, state)
    if store is not None:
        hook = model.register_forward_pre_hook(_record_inputs(weakref.ref(past), state),
                                               with_kwargs=True)
        weakref.finalize(past, hook.remove)
    return past
