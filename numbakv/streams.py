"""llama.cpp's per-sequence streams (``CacheConfig(unified=False)``, llama.cpp's default
``kv_unified = false`` since PR #14363): every sequence owns a stream of contiguous cells, so
attention over one sequence never reads another sequence's cells.

``nkv.CausalCache(CacheConfig(..., unified=False))`` builds a :class:`StreamCache`. Each stream is
a one-sequence ``CausalCache`` (its own cell table, first-fit placement, window pruning, defrag on
a full stream, re-rotation on ``remove``), and all streams share one K/V allocation:

* K ``[n_layers, n_streams * cells_per_stream, n_kv_heads, head_dim]``, i.e. ``[n_layers,
  n_streams, cells_per_stream, n_kv_heads, head_dim]`` (a reshape, no copy);
* V likewise, or with ``permuted_v`` ``[n_layers, n_kv_heads, v_head_dim, n_streams *
  cells_per_stream]`` (each stream's cells one contiguous run of every (head, dim) row).

``cells_per_stream`` is what a one-sequence cache needs: ``capacity``, or with a window memory
``swa_memory + max_batch`` (llama.cpp sizes each SWA stream ``n_swa + n_ubatch``), rounded up to
``cache_padding``. The window memory follows the unified cache's rule for several sequences
(at least ``swa_window + 1``), so eviction, ``can_resume`` and forks behave as there. Sequence ``s`` lives in stream ``s``.

``get()`` returns ``key [n_b, n_kv, n_kv_heads, head_dim]`` (row ``b`` = stream
``seq_ids[b]``), ``value`` likewise (permuted: ``[n_b, n_kv_heads, v_head_dim, n_kv]``) and
``mask [n_b, rows, n_kv]``, where ``seq_ids`` are the batch's sequences in order of first
appearance, row ``r`` of stream ``b`` is the batch token ``token_order[qo_indptr[b] + r]``
(``page_table()``'s grouping), ``rows`` the most tokens any sequence has in the batch (padded to
``mask_batch_padding``) and ``n_kv`` the largest attended range of the batch's streams, from
cell 0, padded to ``cache_padding``. When the batch's sequence ids are consecutive and
ascending (``[3, 4, 5]``), key and value are zero-copy views of the storage; otherwise they are
gathered (one copy of ``n_b * n_kv`` rows per ``get()``, measured in BENCHMARKS.md).

Copies between streams (``seq_cp``, ``copy_prefix`` from one sequence to another) copy only the
copied cells' K/V, in every layer, in one launch (llama.cpp copies whole stream buffers).
"""

from __future__ import annotations

import contextlib
from operator import attrgetter
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
from numpy.typing import ArrayLike

from ._guard import one_thread_at_a_time
from ._inputs import UNLIMITED, host_int_array
from ._inputs import check_index as _check_index
from .causal import (CausalCache, _check_memory, _Forward, _Undo, no_put_error,
                     second_put_error)
from .cells import CellTableStack, _group_by_seq
from .config import CacheConfig, round_up
from .device import array_module, export_view, resolve_device
from .errors import KVCacheError, KVCacheFullError, NotSupportedError
from .storage import KVStorage

_cells_of = attrgetter("cells")      # a stream's cell table
_version_of = attrgetter("version")  # a cell table's version count
_forward_of = attrgetter("_forward")            # a stream's forward pass
_defrag_count_of = attrgetter("defrag_count")   # a stream's defrags so far


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def group_batch(seqs: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(seq_ids, qo_indptr, token_order)`` of a batch's sequence ids ``seqs`` (int ``[batch]``):
    the distinct sequences in order of first appearance (int32 ``[n_b]``), CSR offsets (int32
    ``[n_b + 1]``) and batch indices grouped by sequence, each group in batch order (int32
    ``[batch]``) - the grouping ``page_table()`` uses."""
    seqs = np.asarray(seqs)
    uniq, first, inverse = np.unique(seqs, return_index=True, return_inverse=True)
    by_first = np.argsort(first, kind="stable")       # unique ids in order of first appearance
    rank = np.empty_like(by_first)
    rank[by_first] = np.arange(len(by_first))
    group = rank[inverse.reshape(-1)]
    token_order = np.argsort(group, kind="stable").astype(np.int32)
    counts = np.bincount(group, minlength=len(uniq))
    qo_indptr = np.zeros(len(uniq) + 1, np.int32)
    np.cumsum(counts, out=qo_indptr[1:])
    return uniq[by_first].astype(np.int32), qo_indptr, token_order


@dataclass
class _StreamForward:
    """The forward pass in progress over the batch's streams."""

    seq_ids: np.ndarray        # int32 [n_b]
    qo_indptr: np.ndarray      # int32 [n_b + 1]
    token_order: np.ndarray    # int32 [batch]
    #: batch indices of each stream's tokens, batch order (see ``groups``; None: not built yet)
    groups_: Optional[List[np.ndarray]]
    reserve: bool
    consecutive: bool          # seq_ids == seq_ids[0] + arange(n_b): get() hands out views
    identity: bool             # one stream holding the whole batch in batch order
    n_kv: int = 0
    mask: Any = None
    exported: Any = None       # the mask as get() hands it out (bfloat16: a DLPack view)
    positions: Any = None      # int32 [batch], the batch as checked (a captured step's input)
    seqs: Any = None           # int32 [batch]
    #: int32 [batch]: each token's pool cell (stream offset + its stream's cell), batch order,
    #: when the placement computed it (the batched decode placement); else built on demand
    pool_slots: Any = None
    top: int = -1              # the largest of the batch streams' get() ranges' ends (-1: ask)
    #: uint8 [batch]: the causal flags in batch order when known to be every stream's (the
    #: batched placement's all-ones; set_causal drops it), else None (gathered per stream)
    causal: Any = None

    @property
    def groups(self) -> List[np.ndarray]:
        """Batch indices of each stream's tokens in batch order (views of ``token_order``),
        built at the first read: a captured decode step never reads them."""
        groups = self.groups_
        if groups is None:
            bounds, order = self.qo_indptr.tolist(), self.token_order
            groups = self.groups_ = [order[bounds[b]:bounds[b + 1]]
                                     for b in range(len(bounds) - 1)]
        return groups


@dataclass
class _StreamUndo:
    """What ``_place`` did, for ``_undo`` (a failing stream, or a WrapperCache sibling)."""

    forward: Optional[_StreamForward]
    placed: list               # [(stream index, the stream's own undo)]
    #: a batched placement's record, from which ``records()`` builds ``placed`` when it is read
    #: (an undo, pending rotations): (stream ids, rows (start, lo, hi, head, shifts), each
    #: stream's cells in group order, group bounds, the streams' forward passes and defrag
    #: counts before, the window pruning's undo records and their offsets per stream, or None
    #: without a window memory)
    stacked: Any = None

    def records(self) -> list:
        """``placed``: ``[(stream index, the stream's own undo)]``."""
        if self.stacked is not None:
            ids, rows, local, bounds, before, defrags, pruned, pruned_at = self.stacked
            for b, s in enumerate(ids):
                stream_undo = _Undo(before[b], defrags[b])
                stream_undo.head = rows[b][3]
                stream_undo.slots = local[bounds[b]:bounds[b + 1]]
                if pruned is not None:
                    stream_undo.pruned = pruned[pruned_at[b]:pruned_at[b + 1]]
                self.placed.append((s, stream_undo))
            self.stacked = None
        return self.placed


@one_thread_at_a_time
class StreamCache(CausalCache):
    """A ``CausalCache`` whose sequences each own a stream of cells (``unified=False``).

    Built by ``nkv.CausalCache(config)`` when ``config.unified`` is False; the arguments are
    ``CausalCache``'s (``shift``, ``swa_window``, ``swa_memory``, ``chunk_size``), applied to
    every stream. Every public method of ``CausalCache`` works, with the stream layout of
    ``get()`` described in the module docstring. ``streams[s]`` is sequence ``s``'s one-sequence
    cache (its sequence id there is 0); use the methods here rather than those.
    """

    def __init__(self, config: CacheConfig, *, shift=None, swa_window: Optional[int] = None,
                 swa_memory: Optional[int] = None, chunk_size: Optional[int] = None,
                 shared_shift: str = "error") -> None:
        if not isinstance(config, CacheConfig) or config.unified:
            raise ValueError("StreamCache needs a numbakv.CacheConfig with unified=False")
        if config.k_quantized or config.v_quantized:
            raise NotSupportedError(
                f"quantized K/V (k_dtype={config.k_dtype!r}, v_dtype={config.v_dtype!r}) is not "
                "supported with unified=False yet: use a unified cache or a float dtype")
        self.config = config
        self.device = resolve_device(config.device)
        self._xp = array_module(self.device)
        stream_config = config.replace(max_seqs=1, unified=True)
        self.n_streams = config.max_seqs
        self._pool: Optional[KVStorage] = None
        self.streams: List[CausalCache] = []

        def slice_of_pool(n_cells: int, device: str) -> KVStorage:
            # the first stream sizes the pool for all of them, checked before allocating
            if self._pool is None:
                _check_memory(stream_config, n_cells * self.n_streams, device)
                self._pool = KVStorage(stream_config.storage_config(), n_cells * self.n_streams,
                                       device)
            s = len(self.streams)
            return self._pool.cell_slice(s * n_cells, (s + 1) * n_cells)

        if _is_int(swa_window) and swa_window > 0 and config.max_seqs > 1 and \
                (swa_memory is None or _is_int(swa_memory)):
            # Ollama's rule for a cache of several sequences (memory >= window + 1), kept per
            # stream so that eviction, can_resume and forks behave as in the unified cache
            swa_memory = max(swa_window if swa_memory is None else swa_memory, swa_window + 1)
        for _ in range(self.n_streams):
            self.streams.append(CausalCache(stream_config, shift=shift, swa_window=swa_window,
                                            swa_memory=swa_memory, chunk_size=chunk_size,
                                            shared_shift=shared_shift,
                                            _storage_factory=slice_of_pool))
        first = self.streams[0]
        # a stream holds one sequence, so no cell is ever shared there: "copy" never copies,
        # and is accepted so that one setting fits every kind of cache
        self.shared_shift = first.shared_shift
        self.shift = first.shift
        self.swa_window, self.swa_memory, self.chunk_size = \
            first.swa_window, first.swa_memory, first.chunk_size
        self._window, self._memory, self._chunk = first._window, first._memory, first._chunk
        self.cells_per_stream = first.n_cells
        self.n_cells = self.cells_per_stream * self.n_streams
        self.storage = self._pool
        L, S, C = config.n_stored_layers, self.n_streams, self.cells_per_stream
        H, D, Dv = config.local_kv_heads, config.head_dim, config.v_head_dim
        # [layer, stream, cell, head, dim] views of the pool (reshapes, no copies)
        self._k5 = self._pool.keys.reshape(L, S, C, H, D)
        self._v5 = (self._pool.values.reshape(L, H, Dv, S, C) if config.permuted_v
                    else self._pool.values.reshape(L, S, C, H, Dv))
        self._layer = 0
        self._storage_layers = config.storage_layers     # layer_pool's map (layer_reuse)
        self._put_layer = 0 if config.owner_layer(0) == 0 else -1
        self._put_in = None      # the forward pass whose put() the current layer already had
        self._forward: Optional[_StreamForward] = None
        self._closed = False
        self._ones = np.ones(0, np.uint8)        # _all_causal's flags
        # every stream's cell table on a row of shared arrays: a batch whose streams all have
        # a free run (a decode step) is placed in all of them by one compiled call
        self._stack = CellTableStack([st.cells for st in self.streams])

    # ------------------------------------------------------------------ bookkeeping
    @property
    def defrag_count(self) -> int:
        """Defrags run so far, over all streams."""
        return sum(s.defrag_count for s in self.streams)

    @property
    def n_used(self) -> int:
        """Cells holding a token, over all streams."""
        return sum(s.n_used for s in self.streams)

    def _stream(self, seq, name: str = "seq") -> Tuple[int, CausalCache]:
        self._check_open()
        s = _check_index(name, seq, 0, self.n_streams)
        return s, self.streams[s]

    @contextlib.contextmanager
    def _in_stream(self, s: int):
        """Re-raise a stream's error naming the user's sequence and its stream (inside a stream
        every sequence is sequence 0)."""
        try:
            yield
        except (ValueError, KVCacheError) as e:
            text = str(e).replace("sequence 0", f"sequence {s}")
            if type(e) in (ValueError, KVCacheError, KVCacheFullError, NotSupportedError):
                raise type(e)(f"stream {s}: {text}") from e
            raise

    def _stream_offset(self, s: int) -> int:
        return s * self.cells_per_stream

    # ------------------------------------------------------------------ forward pass
    def start_forward(self, positions: ArrayLike, seqs: ArrayLike, reserve: bool = False) -> None:
        """Place a batch: each token in its own sequence's stream (first-fit, window pruning
        and defrag per stream). Raises ``KVCacheFullError`` naming the stream that has no room;
        then nothing has changed in any stream."""
        undo = self._place(positions, seqs, reserve)
        try:
            self._finish_forward(undo)
        except BaseException:
            self._undo(undo)      # every stream's undo log: nothing placed, nothing rotated
            raise

    def _start_forward_checked(self, positions: np.ndarray, seqs: np.ndarray) -> None:
        """CausalCache's trusted pass start does not apply here (each stream places its own
        tokens through :meth:`_place`, which takes no ``checked`` arrays): the checked public
        path, one thread at a time."""
        self.start_forward(positions, seqs)

    def _place(self, positions, seqs, reserve: bool, undoable: bool = False) -> _StreamUndo:
        self._check_open()
        if not isinstance(reserve, (bool, np.bool_)):
            raise ValueError(f"reserve must be a bool, got {reserve!r}")
        pos, sq = self._check_batch(positions, seqs)
        seq_ids, qo_indptr, token_order, consecutive = _group_by_seq(sq, self.n_streams)
        if not reserve:
            undo = self._place_stacked(pos, sq, seq_ids, qo_indptr, token_order, consecutive)
            if undo is not None:
                return undo
        groups = [token_order[qo_indptr[b]:qo_indptr[b + 1]] for b in range(len(seq_ids))]
        undo = _StreamUndo(self._forward, [])
        zeros = np.zeros(len(pos), np.int32)
        if not reserve:
            # the whole batch first (llama.cpp's batch validation, as the unified cache does):
            # a re-put position is a ValueError even when an earlier stream has no room
            for b, s in enumerate(seq_ids.tolist()):
                idx = groups[b]
                bad = self.streams[s].cells.batch_conflict(pos[idx], zeros[:len(idx)])
                if bad >= 0:
                    i = int(idx[bad])
                    raise ValueError(f"positions/seqs: token {i} (sequence {s}, position "
                                     f"{int(pos[i])}) is already stored or repeated in the batch")
        s = -1
        try:
            for b, s in enumerate(seq_ids.tolist()):
                idx = groups[b]
                with self._in_stream(s):
                    undo.placed.append((s, self.streams[s]._place(
                        pos[idx], zeros[:len(idx)], bool(reserve), undoable=True)))
        except BaseException:
            self._undo(undo)
            raise
        self._forward = _StreamForward(seq_ids, qo_indptr, token_order, groups, bool(reserve),
                                       bool(consecutive), len(seq_ids) == 1, positions=pos,
                                       seqs=sq)
        return undo

    def _place_stacked(self, pos: np.ndarray, sq: np.ndarray, seq_ids: np.ndarray,
                       qo_indptr: np.ndarray, token_order: np.ndarray,
                       consecutive: bool) -> Optional[_StreamUndo]:
        """``_place`` of a batch (checked, grouped, not a reserve pass) by one compiled call
        over every stream's cell table (``CellTableStack.place``): what each stream's own
        ``_place`` would do (window pruning, placement) when its group fits a free run -- the
        same cells, ranges, forward passes, undo records and table versions -- without a
        Python call per stream. None (nothing changed) when a stream needs more (a defrag, a
        full stream, a stored position: the per-stream path raises or defragments as
        before)."""
        streams = self.streams
        tables = list(map(_cells_of, streams))
        if not self._stack.holds(tables):
            # a table replaced (a state load): stack anew
            self._stack = CellTableStack(tables)
        pruning = self._memory != UNLIMITED
        placed = self._stack.place(seq_ids, qo_indptr, token_order, pos,
                                   self._memory if pruning else -1,
                                   self._window if pruning else -1, self.config.cache_padding)
        if placed is None:
            return None
        out, grouped, local, pool, top, pruned, pruned_at, steps = placed
        ids, rows, bounds = seq_ids.tolist(), out.tolist(), qo_indptr.tolist()
        cut = pruned_at.tolist() if pruning else None
        zeros = np.zeros(len(pos), np.int32)
        ones = self._all_causal(len(pos))
        one = ones[:1]         # read-only: one view serves every one-token stream
        # per-stream reads by C-level map (a list comprehension was ~0.05 us a stream each)
        placed_streams = list(map(streams.__getitem__, ids))
        before = list(map(_forward_of, placed_streams))
        defrags = list(map(_defrag_count_of, placed_streams))
        n_b = len(ids)
        if len(pos) == n_b:
            # a decode step (one token a stream): each stream's rows are one-token views of
            # ``grouped`` and ``zeros``, taken by iterating their [n_b, 1] reshapes (an
            # element view costs a fraction of a slice's Python call), one causal view for all
            positions_of, seqs_of = list(grouped.reshape(n_b, 1)), list(zeros.reshape(n_b, 1))
            causal_of = [one] * n_b
        else:
            positions_of = [grouped[bounds[b]:bounds[b + 1]] for b in range(n_b)]
            seqs_of = [zeros[bounds[b]:bounds[b + 1]] for b in range(n_b)]
            causal_of = [one if bounds[b + 1] - bounds[b] == 1
                         else ones[:bounds[b + 1] - bounds[b]] for b in range(n_b)]
        # the version count place() left each table at (a plain attribute read per stream)
        versions = list(map(_version_of, map(tables.__getitem__, ids)))
        for b, (st, row, v1, p_b, q_b, c_b) in enumerate(zip(placed_streams, rows, versions,
                                                            positions_of, seqs_of, causal_of)):
            # the version before the pass: place()'s version steps back (_stamp_versions); a
            # pure placement unless the window pruning dropped cells. Positional arguments
            # (mask, exported None): cheaper than keywords
            v0 = v1 - steps
            dropped = pruned[cut[b]:cut[b + 1]] if pruning and cut[b] != cut[b + 1] else None
            st._forward = _Forward(p_b, q_b, False, row[0], row[1], row[2], c_b, None, None,
                                   v0 if dropped is None else -1, v1, v0, dropped)
        undo = _StreamUndo(self._forward, [], (ids, rows, local, bounds, before, defrags,
                                               pruned if pruning else None, cut))
        self._forward = _StreamForward(seq_ids, qo_indptr, token_order, None, False,
                                       bool(consecutive), len(seq_ids) == 1, positions=pos,
                                       seqs=sq, pool_slots=pool, top=top, causal=ones)
        return undo

    def _undo(self, undo: _StreamUndo) -> None:
        for s, stream_undo in reversed(undo.records()):
            self.streams[s]._undo(stream_undo)
        self._forward = undo.forward

    def _finish_forward(self, undo: Optional[_StreamUndo] = None) -> None:
        """Each stream's pending rotations (recorded in its own undo), then the get() range;
        the stream-layout mask is built at the pass's first get(), as a unified cache's is
        (attention over page_table() and a captured step never read it: on a GPU it was a
        mask fill per stream every pass)."""
        own = None
        fwd = self._forward
        if undo is not None and undo.stacked is not None:
            # the batched placement counted each stream's pending rotations
            ids, rows = undo.stacked[:2]
            todo = [s for s, row in zip(ids, rows) if row[4]]
        else:
            todo = fwd.seq_ids.tolist()
        for s in todo:
            stream = self.streams[s]
            # a placed stream without pending rotations has nothing to finish (its mask waits
            # for get()): skip the call
            if fwd.reserve or stream.cells.has_pending_shifts():
                if own is None:
                    own = dict(undo.records()) if undo is not None else {}
                with self._in_stream(s):
                    stream._finish_forward(own.get(s))
        self._mask_range()

    def _mask_range(self) -> None:
        """The pass's ``n_kv`` (the largest attended range of its streams, padded) and no
        mask yet (``get()`` builds it)."""
        fwd = self._forward
        hi = fwd.top if fwd.top >= 0 else \
            max(self.streams[s].cell_range()[1] for s in fwd.seq_ids.tolist())
        fwd.n_kv = min(round_up(hi, self.config.cache_padding), self.cells_per_stream)
        fwd.mask = fwd.exported = None

    def _journal_begin(self) -> None:
        """Record every stream's following sequence operations (a WrapperCache holding this
        cache takes them back if a sibling refuses)."""
        for stream in self.streams:
            stream._journal_begin()

    def _journal_end(self, rollback: bool) -> None:
        for stream in self.streams:
            stream._journal_end(rollback)
        if rollback:
            self._end_forward()

    def _build_mask(self) -> None:
        """``[n_b, rows, n_kv]``: each stream's own mask (built by its cache over its get()
        range) placed at its cells; everything else -inf (all 0 in a reserve pass)."""
        fwd = self._forward
        cfg = self.config
        ranges, masks = [], []
        for s in fwd.seq_ids.tolist():
            stream = self.streams[s]
            ranges.append(stream.cell_range())
            masks.append(stream._forward_mask())   # its own [rows_padded, hi - lo] mask
        n_kv = min(round_up(max(hi for _, hi in ranges), cfg.cache_padding),
                   self.cells_per_stream)
        counts = np.diff(fwd.qo_indptr)
        rows = round_up(int(counts.max()), cfg.mask_batch_padding)
        n_b = len(fwd.seq_ids)
        first = masks[0]
        bf16 = cfg.mask_dtype == "bfloat16"   # stored as bit patterns, like K/V
        mask = self._xp.empty((n_b, rows, n_kv), dtype=first.dtype)
        mask[...] = 0 if fwd.reserve else (0xFF80 if bf16 else -np.inf)
        if not fwd.reserve:
            for b, ((lo, hi), m) in enumerate(zip(ranges, masks)):
                mask[b, :counts[b], lo:hi] = m[:counts[b]]
        fwd.n_kv = n_kv
        fwd.mask = mask
        fwd.exported = export_view(mask, "bfloat16") if bf16 else mask

    def set_layer(self, layer: int) -> None:
        """Choose the layer that ``put`` and ``get`` work on."""
        self._check_open()
        self._layer = layer = _check_index("layer", layer, 0, self.config.n_layers)
        self._put_in = None
        # whether this layer stores K/V here (layer_reuse), as CausalCache keeps it
        self._put_layer = self._storage_layers[layer] \
            if self.config.owner_layer(layer) == layer else -1

    def set_causal(self, except_: Optional[Sequence[int]] = None) -> None:
        """Drop the future-position test for these batch indices until the next
        ``start_forward`` (``None`` restores it for all)."""
        fwd = self._require_forward("set_causal")
        batch = len(fwd.token_order)
        drop = np.zeros(batch, bool)
        if except_ is not None:
            idx = host_int_array(except_, "except_")
            if idx.size and (idx.min() < 0 or idx.max() >= batch):
                raise ValueError(f"except_ must hold batch indices in [0, {batch}), got "
                                 f"{idx.tolist()}")
            drop[idx] = True
        for b, s in enumerate(fwd.seq_ids.tolist()):
            local = np.nonzero(drop[fwd.groups[b]])[0]
            self.streams[s].set_causal(local if local.size else None)
        self._pages_cache = None
        fwd.causal = None                   # now each stream's own
        fwd.mask = fwd.exported = None      # rebuilt by the next get()

    def put(self, key: Any, value: Any) -> None:
        """Store this batch's keys ``[batch, n_kv_heads, head_dim]`` and values ``[batch,
        n_kv_heads, v_head_dim]`` (batch order) for the current layer, each token into its
        sequence's stream."""
        fwd = self._require_forward("put")
        if self._put_in is fwd:
            raise second_put_error(self._layer)
        if self._put_layer < 0:
            raise no_put_error(self.config, self._layer)
        k, v = self._batch_kv(key, value, len(fwd.token_order))
        self._put_in = fwd
        if fwd.reserve:
            return
        for b, s in enumerate(fwd.seq_ids.tolist()):
            stream = self.streams[s]
            stream.set_layer(self._layer)
            if fwd.identity:
                stream.put(k, v)
            else:
                idx = fwd.groups[b]
                stream.put(k[idx], v[idx])

    def get(self) -> Tuple[Any, Any, Any]:
        """``(key, value, mask)`` of the current layer in the stream layout: key ``[n_b, n_kv,
        n_kv_heads, head_dim]``, value likewise (permuted: ``[n_b, n_kv_heads, v_head_dim,
        n_kv]``), mask ``[n_b, rows, n_kv]`` (0 visible, -inf masked). Zero-copy views when the
        batch's sequence ids are consecutive and ascending, else gathered copies."""
        fwd = self._require_forward("get")
        if fwd.exported is None:        # the pass's first get(): on the cache's stream
            with self._pool._on_device():
                self._build_mask()
        n_kv, ids = fwd.n_kv, fwd.seq_ids
        layer = self.config.storage_layer(self._layer)
        if layer < 0:
            raise ValueError(f"get(): layer {self._layer} has no K/V in this cache "
                             f"(layer_reuse[{self._layer}] = -1)")
        k5, v5 = self._k5[layer], self._v5[layer]
        if self.storage._stream is not None:
            self.storage.order_before()   # views and gathers on CuPy's current stream: after puts
        if fwd.consecutive:
            s0, s1 = int(ids[0]), int(ids[0]) + len(ids)
            key = k5[s0:s1, :n_kv]
            value = (v5[:, :, s0:s1, :n_kv].transpose(2, 0, 1, 3) if self.config.permuted_v
                     else v5[s0:s1, :n_kv])
        else:
            take = ids if self._xp is np else self._xp.asarray(ids)
            key = k5[take, :n_kv]
            value = (v5[:, :, take, :n_kv].transpose(2, 0, 1, 3) if self.config.permuted_v
                     else v5[take, :n_kv])
        dtype = self.config.dtype
        return export_view(key, dtype), export_view(value, dtype), fwd.exported

    def cell_range(self) -> Tuple[int, int]:
        """``(0, n_kv)``: every stream's ``get()`` rows are its cells ``0 .. n_kv - 1``."""
        fwd = self._require_forward("cell_range")
        return 0, fwd.n_kv

    # ------------------------------------------------------------------ attention-ready outputs
    # layer_pool() is CausalCache's: every cell of the pool, so page_table().kv_indices index it
    def page_table(self, page_size: int = 1) -> Any:
        """This forward pass's page table over the flattened pool: each stream's cells as
        ``stream * cells_per_stream + cell`` (so ``layer_pool()`` rows), grouped as ``get()``
        groups (see ``CausalCache.page_table``). ``page_size > 1``: the pool in pages of that
        many cells (a stream's contiguous placement fills whole pages from its first cell when
        ``cells_per_stream`` is a multiple of it), or ``NotSupportedError`` naming the
        sequence whose cells do not fill pages."""
        from . import pages
        page_size = _check_index("page_size", page_size, 1)
        host = self._host_pages()
        if self.storage._stream is not None:
            self.storage.order_before()   # the table's upload and the puts, before its reader
        if page_size == 1:
            return host.table
        return pages.paged_table(host, page_size, self.n_cells, self._xp)

    def _host_pages(self):
        """Every batch stream's own page table, its cells offset into the pool, joined in
        ``get()``'s stream order (built once per forward pass and ``set_causal``)."""
        from . import pages
        fwd = self._require_forward("page_table")
        cached = getattr(self, "_pages_cache", None)
        if cached is not None and cached[0] is fwd:
            return cached[1]
        parts = [self.streams[s]._host_pages() for s in fwd.seq_ids.tolist()]
        batch = len(fwd.token_order)
        causal = np.ones(batch, np.uint8)
        q_positions = np.empty(batch, np.int32)
        for group, part in zip(fwd.groups, parts):
            causal[group] = part.rule.causal
            q_positions[group] = part.q_positions
        causal.flags.writeable = False     # as a causal cache's: the same compiled signatures
        offsets = [self._stream_offset(s) for s in fwd.seq_ids.tolist()]
        kv_indptr = np.zeros(len(parts) + 1, np.int32)
        np.cumsum([len(p.kv_indices) for p in parts], out=kv_indptr[1:])

        def shifted(bounds, off):
            return np.where(bounds >= 0, bounds + off, bounds)

        arrays = dict(
            seq_ids=fwd.seq_ids, qo_indptr=fwd.qo_indptr, token_order=fwd.token_order,
            kv_indptr=kv_indptr,
            kv_indices=np.concatenate([p.kv_indices + off for p, off in zip(parts, offsets)])
            .astype(np.int32),
            kv_positions=np.concatenate([p.kv_positions for p in parts]).astype(np.int32),
            kv_last_page_len=np.ones(len(parts), np.int32), q_positions=q_positions)
        rule = pages.MaskRule(causal, parts[0].rule.window, parts[0].rule.chunk)
        host = pages.HostPages(
            arrays, rule,
            np.concatenate([shifted(p.cell_lo, off) for p, off in zip(parts, offsets)]),
            np.concatenate([shifted(p.cell_hi, off) for p, off in zip(parts, offsets)]),
            all(p.trailing for p in parts))
        pages.to_device(host, self.device)
        self._pages_cache = (fwd, host)
        return host

    # ------------------------------------------------------------------ sequences
    def _end_forward(self) -> None:
        self._forward = None

    def remove(self, seq: int, begin: int, end: Optional[int] = None) -> None:
        """Ollama's ``Remove`` inside ``seq``'s stream (later positions move down and their keys
        are re-rotated)."""
        s, stream = self._stream(seq)
        with self._in_stream(s):
            stream.remove(0, begin, end)
        self._end_forward()

    def _check_remove(self, seq, begin, end) -> Tuple[int, int, Optional[int]]:
        s, stream = self._stream(seq)
        with self._in_stream(s):
            _, begin, end = stream._check_remove(0, begin, end)
        return s, begin, end

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        """Make ``dst_seq`` hold exactly ``src_seq``'s first ``length`` positions: their K/V
        cells are copied into ``dst_seq``'s stream (every layer, one launch)."""
        src, _ = self._stream(src_seq, "src_seq")
        dst, _ = self._stream(dst_seq, "dst_seq")
        length = _check_index("length", length, 0)
        if src == dst:
            with self._in_stream(src):
                self.streams[src].copy_prefix(0, 0, length)
        else:
            self._copy_between(src, dst, 0, length, replace=True)
        self._end_forward()

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: Optional[int] = None) -> None:
        """Give ``dst`` ``src``'s positions in ``[p0, p1)``: copied cells in ``dst``'s stream
        (positions ``dst`` already holds are a ``ValueError``)."""
        s_src, _ = self._stream(src, "src")
        s_dst, _ = self._stream(dst, "dst")
        p0, p1 = self._check_span(p0, p1)
        if s_src != s_dst:
            self._copy_between(s_src, s_dst, p0, UNLIMITED if p1 is None else p1, replace=False)
        self._end_forward()

    def _cells_in(self, s: int, p0: int, p1: int) -> Tuple[np.ndarray, np.ndarray]:
        """Cells of stream ``s`` (its one sequence) with ``p0 <= pos < p1``, ascending by
        position, and their positions."""
        stream = self.streams[s]
        lo, hi = stream.cells.seq_cell_min[0], stream.cells.seq_cell_max[0]
        if hi < 0:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        pos = stream.cells._pos[lo:hi + 1]   # one sequence per stream: used <=> pos >= 0
        cells = np.nonzero((pos >= p0) & (pos < p1))[0]
        order = np.argsort(pos[cells], kind="stable")
        cells = (cells[order] + lo).astype(np.int32)
        return cells, pos[cells - lo].astype(np.int32)

    def _copy_between(self, src: int, dst: int, p0: int, p1: int, replace: bool) -> None:
        """Copy stream ``src``'s cells with positions in ``[p0, p1)`` into stream ``dst`` (after
        emptying it when ``replace``): checked first, so a refusal changes nothing."""
        source, target = self.streams[src], self.streams[dst]
        cells, positions = self._cells_in(src, p0, p1)
        n = len(cells)
        if not replace and n:
            have, _ = self._cells_in(dst, int(positions.min()), int(positions.max()) + 1)
            twice = np.intersect1d(target.cells._pos[have], positions) if len(have) else have
            if len(twice):
                shown = twice[:16].tolist()
                more = f" and {len(twice) - 16} more" if len(twice) > 16 else ""
                raise ValueError(f"seq_cp: sequence {dst} already holds positions {shown}{more} "
                                 f"that sequence {src} would copy into it; seq_rm them from "
                                 f"{dst} first")
        free_after = self.cells_per_stream - (0 if replace else target.n_used)
        if n > free_after:
            raise KVCacheFullError(f"stream {dst}: copying {n} cells of sequence {src} needs "
                                   f"{n} free cells, it has {free_after}")
        if n:
            source.apply_pending_shifts()  # the copied keys must carry their rotations
        if replace:
            target.seq_rm(0, 0, None)
        if n == 0:
            return
        slots = target._claim_for_copy(positions)   # undo-logged inside a WrapperCache
        self.storage.copy_cells(cells + self._stream_offset(src),
                                slots + self._stream_offset(dst))

    def can_resume(self, seq: int, pos: int) -> bool:
        """Whether ``seq`` can continue at ``pos`` with what its stream holds."""
        s, stream = self._stream(seq)
        with self._in_stream(s):
            return stream.can_resume(0, pos)

    def defrag(self) -> None:
        """Defragment every stream (each keeps its cells' K/V with them)."""
        self._check_open()
        for stream in self.streams:
            stream.defrag()
        self._end_forward()

    def seq_rm(self, seq: int, p0: int = 0, p1: Optional[int] = None) -> bool:
        """Remove positions ``[p0, p1)`` of ``seq`` (``-1``: every stream)."""
        self._check_open()
        seq = self._check_seq(seq, allow_all=True)
        p0, p1 = self._check_span(p0, p1)
        targets = self.streams if seq == -1 else [self.streams[seq]]
        for stream in targets:
            stream.seq_rm(0, p0, p1)
        self._end_forward()
        return True

    def seq_keep(self, seq: int) -> None:
        """Empty every stream but ``seq``'s."""
        s, _ = self._stream(seq)
        for i, stream in enumerate(self.streams):
            if i != s:
                stream.seq_rm(0, 0, None)
        self._end_forward()

    def seq_add(self, seq: int, p0: int, p1: Optional[int], delta: int) -> None:
        """llama.cpp's ``seq_add`` inside ``seq``'s stream."""
        s, stream = self._stream(seq)
        with self._in_stream(s):
            stream.seq_add(0, p0, p1, delta)
        self._end_forward()

    def seq_div(self, seq: int, p0: int, p1: Optional[int], d: int) -> None:
        """llama.cpp's ``seq_div`` inside ``seq``'s stream."""
        s, stream = self._stream(seq)
        with self._in_stream(s):
            stream.seq_div(0, p0, p1, d)
        self._end_forward()

    def seq_pos_min(self, seq: int) -> int:
        """Lowest position ``seq`` holds, -1 when empty."""
        s, stream = self._stream(seq)
        return stream.seq_pos_min(0)

    def seq_pos_max(self, seq: int) -> int:
        """Highest position ``seq`` holds, -1 when empty."""
        s, stream = self._stream(seq)
        return stream.seq_pos_max(0)

    def apply_pending_shifts(self) -> None:
        """Apply every stream's pending key rotations now."""
        self._check_open()
        for stream in self.streams:
            stream.apply_pending_shifts()

    def _step_placement(self) -> Tuple[np.ndarray, np.ndarray, int, np.ndarray]:
        """Trusted (:class:`numbakv.step.DecodeStep`, after ``start_forward``): the pass's
        ``(positions, seqs, 0, slots)``, ``slots`` int32 ``[batch]`` the pool cell of each
        batch token (its stream's offset plus the cell its stream placed it in)."""
        fwd = self._forward
        if fwd.pool_slots is not None:
            return fwd.positions, fwd.seqs, 0, fwd.pool_slots
        slots = np.empty(len(fwd.token_order), np.int32)
        for b, s in enumerate(fwd.seq_ids.tolist()):
            sf = self.streams[s]._forward
            idx = fwd.groups[b]
            local = sf.slots if sf.slots is not None else \
                sf.start + np.arange(len(idx), dtype=np.int32)
            slots[idx] = self._stream_offset(s) + local
        return fwd.positions, fwd.seqs, 0, slots

    # capture_step is CausalCache's: a captured step's put reads pool cells from its
    # descriptor (_step_placement), its attention the pass's page table over the pool

    def use_stream(self, stream: Any) -> None:
        """Queue every stream's GPU work on ``stream`` (see ``CausalCache.use_stream``): the
        streams share one allocation and one CUDA stream."""
        self._check_open()
        self._pool.use_stream(stream)
        for sub in self.streams:
            sub.use_stream(stream)

    # ------------------------------------------------------------------ state
    # save_state / load_state / state_bytes / load_state_bytes: StateMethods (state/methods.py)
    _STATE_IO = "streams"

    def _after_state_load(self) -> None:
        self._end_forward()
        tables = [st.cells for st in self.streams]
        if not self._stack.holds(tables):    # the load replaced the streams' tables
            self._stack = CellTableStack(tables)

    def close(self) -> None:
        """Free the storage; every later call raises."""
        for stream in self.streams:
            stream.close()
        self._closed = True
        self._forward = None
        self._pool = self.storage = self._k5 = self._v5 = None

    def __repr__(self) -> str:
        c = self.config
        state = "closed" if self._closed else f"{self.n_used}/{self.n_cells} cells used"
        return (f"StreamCache({c.n_layers} layers x {self.n_streams} streams x "
                f"{self.cells_per_stream} cells, {c.local_kv_heads}x{c.head_dim} {c.dtype}, "
                f"device={self.device}, {state})")


CausalCache._stream_class = StreamCache

__all__ = ["StreamCache", "group_batch"]
