"""Caches made of caches: ``WrapperCache`` (a different ``CausalCache`` per group of layers, e.g.
Gemma 3's sliding-window layers beside its full-attention layers) and ``EncoderCache`` (the
encoder's K/V for cross-attention, stored once and visible to every token, like Ollama's
``encoder.go``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

import numpy as np

from ._guard import one_thread_at_a_time
from ._memory import check_memory
from ._inputs import UNLIMITED, check_batch, host_int_array
from ._inputs import check_index as _check_index
from .causal import CausalCache, _NeedRoom, check_shared_shift
from .config import MASK_DTYPES, CacheConfig, round_up
from .device import array_module, as_array, export_view, resolve_device
from .errors import KVCacheError, NotSupportedError
from .state.methods import StateMethods

if TYPE_CHECKING:  # pragma: no cover
    from .state.snapshot import SeqSnapshot
    from .pages import PageTable


@one_thread_at_a_time
class WrapperCache(StateMethods):
    """One ``CausalCache`` per layer group; every operation fans out to all of them, all or
    nothing (cell tables and K/V: keys a failed ``remove`` already re-rotated in one group come
    back bit-exact), and ``set_layer`` picks the group (and the layer inside it). One thread at
    a time, like every cache.

    Args:
        caches: the group caches, e.g. ``[swa_cache, full_cache]``.
        layer_groups: for each model layer, the index of its cache in ``caches``. Cache ``g``
            must have as many layers as ``layer_groups`` names ``g``. Default: every cache sees
            every layer (``n_layers`` equal across caches, ``set_layer_type`` picks the cache).
        shared_shift: ``None`` keeps each cache's own setting; ``"error"`` or ``"copy"`` sets
            it on every cache (see ``CausalCache``: moving cells other sequences share is
            refused, or first gives the moving sequence its own copies, in every group).
    """

    def __init__(self, caches: Sequence[CausalCache],
                 layer_groups: Optional[Sequence[int]] = None, *,
                 shared_shift: Optional[str] = None) -> None:
        if isinstance(caches, (CausalCache, str, bytes)) or not hasattr(caches, "__iter__"):
            raise ValueError(f"caches must be a non-empty sequence of CausalCache, got "
                             f"{type(caches).__name__}")
        caches = list(caches)
        if not caches or not all(isinstance(c, CausalCache) for c in caches):
            raise ValueError("caches must be a non-empty sequence of CausalCache")
        _check_groupable(caches, layer_groups is None)
        if shared_shift is not None:
            shared_shift = check_shared_shift(shared_shift)
            for cache in caches:
                for leaf in [cache] + list(getattr(cache, "streams", [])):
                    leaf.shared_shift = shared_shift
        self.caches = caches
        if layer_groups is None:
            self.layer_groups = None
            self._local = None
        else:
            groups = [_check_index(f"layer_groups[{i}]", g, 0, len(caches))
                      for i, g in enumerate(layer_groups)]
            local, counts = [], [0] * len(caches)
            for g in groups:
                local.append(counts[g])
                counts[g] += 1
            for g, cache in enumerate(caches):
                if counts[g] != cache.config.n_layers:
                    raise ValueError(f"layer_groups assigns {counts[g]} layers to cache {g}, "
                                     f"which has n_layers={cache.config.n_layers}")
            self.layer_groups = groups
            self._local = local
        self._current = 0

    @property
    def n_layers(self) -> int:
        """Model layers this wrapper serves: ``len(layer_groups)``, or the caches' common
        ``n_layers`` when every cache sees every layer."""
        if self.layer_groups is None:
            return self.caches[0].config.n_layers
        return len(self.layer_groups)

    def start_forward(self, positions, seqs, reserve: bool = False) -> None:
        """Place the batch (``positions``, ``seqs``: ``[batch]`` integers) in every cache, all
        or nothing: every cache places it, then applies its pending shifts and builds its mask;
        if any of them fails (e.g. ``KVCacheFullError``), each one's undo log takes back what it
        did (evictions, defrags and key rotations included), so every (sequence, position) keeps
        its own K/V."""
        provider = self._room_provider
        try:
            self._start_forward(positions, seqs, reserve, provider is not None)
        except _NeedRoom as need:
            # a prefix store holds cells: it evicts first (see CausalCache._room_provider)
            provider(need.cells)
            self._start_forward(positions, seqs, reserve, False)

    #: as ``CausalCache._room_provider``, for the wrapper as a whole (its caches' stay None)
    _room_provider = None

    def _start_forward(self, positions, seqs, reserve: bool, ask_room: bool) -> None:
        undos: List[Tuple[CausalCache, object]] = []
        extra = {"ask_room": True} if ask_room else {}   # stream caches take no ask_room
        try:
            for cache in self.caches:
                undos.append((cache, cache._place(positions, seqs, reserve, undoable=True,
                                                  **extra)))
            for cache, undo in undos:
                cache._finish_forward(undo)
        except BaseException:
            for cache, undo in reversed(undos):
                cache._undo(undo)
            raise

    def set_layer_type(self, index: int) -> None:
        """Pick the cache for the following ``set_layer``/``put``/``get`` (Ollama's
        SetLayerType), when no ``layer_groups`` map was given."""
        self._current = _check_index("index", index, 0, len(self.caches))

    def set_layer(self, layer: int) -> None:
        """Select model ``layer``: with ``layer_groups``, its group's cache and the layer's
        index inside it; else ``layer`` of the cache picked by :meth:`set_layer_type`."""
        layer = _check_index("layer", layer, 0, self.n_layers)
        if self.layer_groups is not None:
            self._current = self.layer_groups[layer]
            layer = self._local[layer]
        self.caches[self._current].set_layer(layer)

    def put(self, key, value) -> None:
        """Store the batch's ``key`` ``[batch, n_kv_heads, head_dim]`` and ``value`` ``[batch,
        n_kv_heads, v_head_dim]`` in the current layer's cache (see ``CausalCache.put``)."""
        self.caches[self._current].put(key, value)

    def get(self):
        """``(key, value, mask)`` of the current layer's cache (see ``CausalCache.get``)."""
        return self.caches[self._current].get()

    def set_causal(self, except_=None) -> None:
        """Turn off the future-position test for batch indices ``except_`` in every cache,
        until the next ``start_forward``."""
        for cache in self.caches:  # every cache must have a forward pass before any changes
            cache._require_forward("set_causal")
        for cache in self.caches:
            cache.set_causal(except_)

    def _fan_out(self, name: str, *args):
        """Run a sequence operation on every cache; if one raises, the others' undo logs take
        back what they did (no copy of any table)."""
        results = []
        for cache in self.caches:
            cache._journal_begin()
        failed = True
        try:
            for cache in self.caches:
                results.append(getattr(cache, name)(*args))
            failed = False
        finally:
            for cache in self.caches:
                cache._journal_end(rollback=failed)
        return results

    def remove(self, seq: int, begin: int, end: Optional[int] = None) -> None:
        """Drop positions ``[begin, end)`` of ``seq`` from every cache (``end=None``: to the
        end), moving later positions down with re-rotation; every cache is checked first, and
        if one fails all are restored."""
        for cache in self.caches:  # check all first: nothing runs unless every cache accepts
            cache._check_remove(seq, begin, end)
        self._fan_out("remove", seq, begin, end)

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        """Share the first ``length`` positions of ``src_seq`` with ``dst_seq`` in every cache."""
        self._fan_out("copy_prefix", src_seq, dst_seq, length)

    def can_resume(self, seq: int, pos: int) -> bool:
        """Whether every cache can continue ``seq`` at ``pos`` (``CausalCache.can_resume``)."""
        return all([cache.can_resume(seq, pos) for cache in self.caches])  # all checked

    def defrag(self) -> None:
        """Defragment every cache."""
        for cache in self.caches:
            cache._check_open()
        self._fan_out("defrag")

    def seq_rm(self, seq: int, p0: int = 0, p1: Optional[int] = None) -> bool:
        """llama.cpp's ``seq_rm`` on every cache (``seq=-1``: all sequences); True when all
        succeed."""
        return all(self._fan_out("seq_rm", seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: Optional[int] = None) -> None:
        """llama.cpp's ``seq_cp`` on every cache: ``dst`` shares ``src``'s positions
        ``[p0, p1)``."""
        self._fan_out("seq_cp", src, dst, p0, p1)

    def seq_keep(self, seq: int) -> None:
        """llama.cpp's ``seq_keep`` on every cache: drop every sequence but ``seq``."""
        self._fan_out("seq_keep", seq)

    def seq_add(self, seq: int, p0: int, p1: Optional[int], delta: int) -> None:
        """llama.cpp's ``seq_add`` on every cache: move positions ``[p0, p1)`` of ``seq`` by
        ``delta`` (keys re-rotated)."""
        self._fan_out("seq_add", seq, p0, p1, delta)

    def seq_div(self, seq: int, p0: int, p1: Optional[int], d: int) -> None:
        """llama.cpp's ``seq_div`` on every cache: divide positions ``[p0, p1)`` of ``seq`` by
        ``d`` (keys re-rotated)."""
        self._fan_out("seq_div", seq, p0, p1, d)

    def seq_pos_min(self, seq: int) -> int:
        """The lowest position of ``seq`` over all caches (-1 when empty)."""
        return min(cache.seq_pos_min(seq) for cache in self.caches)

    def seq_pos_max(self, seq: int) -> int:
        """The highest position of ``seq`` over all caches (-1 when empty)."""
        return max(cache.seq_pos_max(seq) for cache in self.caches)

    def use_stream(self, stream: Any) -> None:
        """Queue every group's GPU work on ``stream`` (see :meth:`CausalCache.use_stream`)."""
        for cache in self.caches:
            cache.use_stream(stream)

    def capture_step(self, batch: int, *, attend: bool = False, n_heads: Optional[int] = None,
                     scale: Optional[float] = None, soft_cap: Optional[float] = None,
                     v_dim: Optional[int] = None) -> Any:
        """A captured decode step over every group (:class:`numbakv.step.WrapperStep`): one
        :meth:`CausalCache.capture_step` per group cache with these arguments (each group its
        own descriptor, inputs and graph: its own cell table places its own cells), replayed
        together after the wrapper's all-or-nothing ``start_forward``. Every group is checked
        before any step is built; raises as ``CausalCache.capture_step`` (naming the group),
        nothing changed."""
        from .step import DecodeStep, WrapperStep, check_capturable
        for cache in self.caches:
            cache._check_open()
        checked = []
        for g, cache in enumerate(self.caches):
            try:
                checked.append(check_capturable(cache, batch, attend, n_heads, scale,
                                                soft_cap, v_dim))
            except (ValueError, NotSupportedError) as exc:
                raise type(exc)(f"caches[{g}]: {exc}") from exc
        return WrapperStep(self, [DecodeStep(cache, b, att)
                                  for cache, (b, att) in zip(self.caches, checked)])

    def close(self) -> None:
        """Close every cache (frees their storage)."""
        for cache in self.caches:
            cache.close()

    @property
    def closed(self) -> bool:
        """Whether any group cache is closed (then every call raises ``KVCacheError``)."""
        return any(cache.closed for cache in self.caches)

    # -- attention-ready outputs (the current layer's cache)
    def page_table(self, page_size: int = 1) -> Any:
        """The page table of the current layer's cache (see ``CausalCache.page_table``;
        ``page_size > 1``: in pages)."""
        return self.caches[self._current].page_table(page_size)

    def layer_pool(self, layer: Optional[int] = None) -> Tuple[Any, Any]:
        """Zero-copy views of every cell of a model layer (the current one when None), from the
        cache of that layer's group (see ``CausalCache.layer_pool``)."""
        if layer is None:
            return self.caches[self._current].layer_pool()
        layer = _check_index("layer", layer, 0, self.n_layers)
        if self.layer_groups is None:
            return self.caches[self._current].layer_pool(layer)
        return self.caches[self.layer_groups[layer]].layer_pool(self._local[layer])

    def _host_pages(self):
        return self.caches[self._current]._host_pages()

    @property
    def _attention_cache(self) -> CausalCache:
        """The cache ``attend`` reads for the current layer."""
        return self.caches[self._current]


    # ------------------------------------------------------------------ one sequence's K/V
    def export_seq(self, seq: int, p0: int = 0, p1: Optional[int] = None, *,
                   device: bool = False) -> "SeqSnapshot":
        """One ``numbakv.SeqSnapshot`` of positions ``[p0, p1)`` of ``seq`` with one part per
        group (a sliding-window group holds only the cells it keeps); see
        ``CausalCache.export_seq``."""
        from .state import snapshot
        return snapshot.export_seq(self, seq, p0, p1, device=device)

    def import_seq(self, seq: int, snap: "SeqSnapshot", *, at: Optional[int] = None) -> int:
        """Import every group's part of ``snap`` for ``seq``, all or nothing (see
        ``CausalCache.import_seq``); returns the tokens placed in the group that placed the
        most (a sliding-window group holds only what its window memory kept)."""
        from .state import snapshot
        return snapshot.import_seq(self, seq, snap, at=at)

    # ------------------------------------------------------------------ state
    # save_state / load_state / state_bytes / load_state_bytes: StateMethods (state/methods.py)
    _STATE_IO = "wrapper"

    def _after_state_load(self) -> None:
        """A state load ends every group's forward pass (a stream cache keeps its own beside its
        streams')."""
        for cache in self.caches:
            cache._forward = None


def _check_groupable(caches: List[CausalCache], same_layers: bool) -> None:
    """Caches a WrapperCache can fan out over: distinct, open, sharing max_seqs and device, and
    (without a layer_groups map) the same number of layers."""
    seen = {}
    for i, cache in enumerate(caches):
        if id(cache) in seen:
            raise ValueError(f"caches[{i}] is the same cache as caches[{seen[id(cache)]}]: each "
                             "group needs its own CausalCache (a token would be placed twice)")
        seen[id(cache)] = i
        if cache.closed:
            raise ValueError(f"caches[{i}] is closed")
    for attr, values in (("max_seqs", [c.config.max_seqs for c in caches]),
                         ("device", [c.device for c in caches])):
        if len(set(values)) != 1:
            raise ValueError(f"caches must share {attr} to be grouped, got {values}")
    if same_layers:
        layers = [c.config.n_layers for c in caches]
        if len(set(layers)) != 1:
            raise ValueError(f"caches must have the same n_layers when layer_groups is not "
                             f"given (every cache sees every layer), got {layers}: pass "
                             "layer_groups to map model layers to caches")


@one_thread_at_a_time
class EncoderCache:
    """Cross-attention K/V from an encoder (e.g. an image encoder): stored when a forward pass
    carries encoder output, kept for the following passes, visible to every token.

    Storage: K ``[n_layers, n_enc, n_kv_heads, head_dim]`` and V ``[n_layers, n_enc, n_kv_heads,
    v_head_dim]``, allocated for ``capacity`` encoder tokens (``config.capacity``), after checking
    that they (and a mask at ``max_batch``) fit the memory left. One thread at a time, like
    every cache.
    """

    def __init__(self, config: CacheConfig) -> None:
        if not isinstance(config, CacheConfig):
            raise ValueError(f"config must be a numbakv.CacheConfig, got {type(config).__name__}")
        self.config = config
        self.device = resolve_device(config.device)
        self._xp = array_module(self.device)
        sd = config.storage_dtype
        mask_rows = round_up(config.max_batch, config.mask_batch_padding)
        check_memory(f"the EncoderCache ({config.capacity} encoder tokens)", self.device,
                     {"K/V storage": config.nbytes(config.capacity),
                      "mask at max_batch": mask_rows * config.capacity
                      * MASK_DTYPES[config.mask_dtype].itemsize},
                     hint="lower capacity (encoder tokens) or n_layers")
        self.keys = self._xp.zeros((config.n_layers, config.capacity, config.local_kv_heads,
                                    config.head_dim), dtype=sd)
        self.values = self._xp.zeros((config.n_layers, config.capacity, config.local_kv_heads,
                                      config.v_head_dim), dtype=sd)
        self.encoder_len = 0            # encoder tokens stored (0: nothing cached)
        self.encoder_pos: Optional[int] = None   # position of the input the encoder output is for
        self._layers_written = np.zeros(config.n_layers, bool)
        self._batch = 0
        self._storing = False
        self._reserve = False
        self._started = False       # a forward pass has begun (put/get need one)
        self._layer = 0
        self._closed = False

    @property
    def encoder_cached(self) -> bool:
        """True when encoder output is stored for every layer (Ollama's ``EncoderCached()``: a
        runner asks it to skip the encoder; public although the cache itself never needs it)."""
        return self.encoder_len > 0 and bool(self._layers_written.all())

    def start_forward(self, positions, seqs, reserve: bool = False, *,
                      encoder_pos: Optional[int] = None) -> None:
        """Begin a forward pass; ``encoder_pos`` is the position of the input whose encoder
        output this pass stores (``None``: the pass reuses what is cached)."""
        self._check_open()
        if not isinstance(reserve, (bool, np.bool_)):
            raise ValueError(f"reserve must be a bool, got {reserve!r}")
        pos, sq = check_batch(positions, seqs, self.config)
        if encoder_pos is not None:
            encoder_pos = _check_index("encoder_pos", encoder_pos, 0)
        self._started = True
        self._batch = len(pos)
        self._batch_positions, self._batch_seqs = pos.astype(np.int32), sq.astype(np.int32)
        self._reserve = bool(reserve)
        self._storing = encoder_pos is not None and not reserve
        if self._storing:
            self.encoder_pos = encoder_pos
            self._layers_written[:] = False

    def set_layer(self, layer: int) -> None:
        """Select ``layer`` for the following ``put``/``get``."""
        self._check_open()
        self._layer = _check_index("layer", layer, 0, self.config.n_layers)

    def put(self, key, value) -> None:
        """Store the encoder's keys ``[n_enc, n_kv_heads, head_dim]`` and values ``[n_enc,
        n_kv_heads, v_head_dim]`` for the current layer (only in a pass that carries encoder
        output)."""
        self._check_open()
        if not self._started:
            raise ValueError("put() needs a forward pass: call start_forward first")
        cfg = self.config
        k = as_array(key, self.device, cfg.dtype, name="key")
        v = as_array(value, self.device, cfg.dtype, name="value")
        n = k.shape[0] if k.ndim == 3 else -1
        if k.ndim != 3 or tuple(k.shape[1:]) != (cfg.local_kv_heads, cfg.head_dim) \
                or not 1 <= n <= cfg.capacity:
            raise ValueError(f"key must have shape [n_enc <= {cfg.capacity}, {cfg.local_kv_heads}, "
                             f"{cfg.head_dim}], got {list(k.shape)}")
        if tuple(v.shape) != (n, cfg.local_kv_heads, cfg.v_head_dim):
            raise ValueError(f"value must have shape [{n}, {cfg.local_kv_heads}, {cfg.v_head_dim}],"
                             f" got {list(v.shape)}")
        if not self._storing:
            if self._reserve:
                return
            raise ValueError("put() needs a forward pass started with encoder_pos (this pass "
                             "reuses the cached encoder output)")
        if self._layers_written.any() and n != self.encoder_len:
            raise ValueError(f"key has {n} encoder tokens but earlier layers of this pass "
                             f"stored {self.encoder_len}")
        self.keys[self._layer, :n] = k
        self.values[self._layer, :n] = v
        self.encoder_len = n
        self._layers_written[self._layer] = True

    def get(self):
        """``(key, value, mask)``: the stored encoder K/V of the current layer and an all-visible
        mask ``[round_up(batch, mask_batch_padding), n_enc]`` (padding rows -inf)."""
        self._check_open()
        if not self._started:
            raise ValueError("get() needs a forward pass: call start_forward first")
        if self.encoder_len == 0:
            raise KVCacheError("no encoder output is cached")
        n = self.encoder_len
        cfg = self.config
        rows = round_up(max(self._batch, 1), cfg.mask_batch_padding)
        if cfg.mask_dtype == "bfloat16":     # stored as bit patterns, exported as bfloat16
            mask = self._xp.zeros((rows, n), dtype=np.uint16)
            mask[self._batch:] = 0xFF80
            mask = export_view(mask, "bfloat16")
        else:
            mask = self._xp.zeros((rows, n), dtype=np.dtype(cfg.mask_dtype))
            mask[self._batch:] = -np.inf
        return (export_view(self.keys[self._layer, :n], cfg.dtype),
                export_view(self.values[self._layer, :n], cfg.dtype), mask)

    def remove(self, seq: int, begin: int, end: Optional[int] = None) -> None:
        """Removing the position the encoder output belongs to drops it."""
        self._check_open()
        _check_index("seq", seq, 0, self.config.max_seqs)
        begin = _check_index("begin", begin, 0, UNLIMITED)
        end_ = None if end is None else _check_index("end", end, begin)
        if self.encoder_pos is not None and self.encoder_pos >= begin and \
                (end_ is None or self.encoder_pos < end_):
            self.encoder_len = 0
            self.encoder_pos = None
            self._layers_written[:] = False

    def can_resume(self, seq: int, pos: int) -> bool:
        """Always True: the encoder output does not depend on where a sequence resumes (the
        arguments are still checked, and the cache must be open)."""
        self._check_open()
        _check_index("seq", seq, 0, self.config.max_seqs)
        _check_index("pos", pos, 0, UNLIMITED)
        return True

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        """Not supported: raises ``NotSupportedError`` (encoder output is not per sequence)."""
        raise NotSupportedError("EncoderCache does not support copy_prefix")

    def set_causal(self, except_=None) -> None:
        """Cross-attention has no causal mask: accepted (checked) and ignored."""
        self._check_open()
        if not self._started:
            raise ValueError("set_causal() needs a forward pass: call start_forward first")
        if except_ is not None:
            idx = host_int_array(except_, "except_")
            if idx.size and (idx.min() < 0 or idx.max() >= self._batch):
                raise ValueError(f"except_ must hold batch indices in [0, {self._batch}), got "
                                 f"{idx.tolist()}")

    def defrag(self) -> None:
        """Nothing to defragment."""
        self._check_open()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Release the storage; later calls raise ``KVCacheError``."""
        self._closed = True
        self.keys = self.values = None

    def _check_open(self) -> None:
        if self._closed:
            raise KVCacheError("the cache is closed")

    # -- attention-ready outputs
    def page_table(self) -> "PageTable":
        """Every batch sequence sees every stored encoder token (cells ``0 .. n_enc-1``, their
        ``kv_positions`` the encoder token indices); see ``CausalCache.page_table``."""
        return self._host_pages().table

    def layer_pool(self, layer: Optional[int] = None) -> Tuple[Any, Any]:
        """Zero-copy views of the stored encoder K/V of a layer (current when None): key
        ``[n_enc, n_kv_heads, head_dim]``, value ``[n_enc, n_kv_heads, v_head_dim]``."""
        self._check_open()
        layer = self._layer if layer is None else _check_index("layer", layer, 0,
                                                               self.config.n_layers)
        n = self.encoder_len
        return (export_view(self.keys[layer, :n], self.config.dtype),
                export_view(self.values[layer, :n], self.config.dtype))

    def _host_pages(self):
        from . import pages
        self._check_open()
        if getattr(self, "_batch_positions", None) is None:
            raise ValueError("page_table() needs a forward pass: call start_forward first")
        if self.encoder_len == 0:
            raise KVCacheError("no encoder output is cached")
        key = (self._batch_positions, self.encoder_len)
        cached = getattr(self, "_pages_cache", None)
        if cached is not None and cached[0] is key[0] and cached[1] == key[1]:
            return cached[2]
        n = self.encoder_len
        host = pages.build_all_visible(np.arange(n, dtype=np.int32), n, self.config.max_seqs,
                                       self._batch_positions, self._batch_seqs)
        pages.to_device(host, self.device)
        self._pages_cache = (key[0], n, host)
        return host

    @property
    def _attention_cache(self) -> "EncoderCache":
        return self


__all__ = ["WrapperCache", "EncoderCache"]
