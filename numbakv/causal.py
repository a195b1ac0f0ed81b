"""``CausalCache``: Ollama's ``Cache`` interface with ``Causal`` semantics (sliding window, window
memory, chunked attention), plus llama.cpp's sequence operations, on numbakv's cell table
(``cells.py``) and K/V storage (``storage.py``).

Semantics follow Ollama's ``kvcache/causal.go`` (see ``shared/NOTES.md``) with two deliberate
differences: a call that raises leaves the cache exactly as it was, and no operation ever pairs a
cell's metadata with another cell's K/V (defrag included).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike

from .cells import SHARED_SHIFT_MESSAGE, CellTable
from .cells import _check_batch as _batch_ids_ok
from . import pages as _pages
from .config import MASK_DTYPES, CacheConfig, RopeShift, check_rope_layout, round_up
from .device import array_module, as_array, export_view, resolve_device
from ._guard import _guarded, one_thread_at_a_time
from .errors import KVCacheError, KVCacheFullError, NotSupportedError
from .state.methods import StateMethods
from .storage import KVStorage
from ._inputs import UNLIMITED, check_batch, host_int_array
from ._inputs import check_index as _check_index

ShiftFn = Callable[[int, Any, Any], Any]
_I32 = np.dtype(np.int32)
if TYPE_CHECKING:  # pragma: no cover
    from .state.snapshot import SeqSnapshot
    from .step import DecodeStep



class _NeedRoom(KVCacheFullError):
    """No contiguous run of free cells for a batch, raised (nothing changed) instead of a defrag
    when the cache has a room provider to ask first (see ``CausalCache._room_provider``)."""

    def __init__(self, message: str, cells: int) -> None:
        super().__init__(message)
        self.cells = cells


@dataclass
class _Forward:
    """The forward pass in progress (from ``start_forward`` to the next one)."""

    positions: np.ndarray      # int32 [batch]
    seqs: np.ndarray           # int32 [batch]
    reserve: bool
    start: int                 # first cell of the batch (its cells are start .. start+batch-1)
    lo: int                    # get() covers cells [lo, hi), padded to cache_padding
    hi: int
    causal: np.ndarray         # uint8 [batch]; 0 where set_causal dropped the future-position test
    mask: Any = None
    exported: Any = None       # the mask as get() hands it out (bfloat16: a DLPack view)
    #: the cell table's version before this pass placed its batch (-1: the placement pruned
    #: or defragmented as well) and right after: equal to the previous page table's version
    #: and to the table's now, the pass only appended its cells (page tables extend on the
    #: device, numbakv.pages.extend_pages)
    cells_v0: int = -1
    cells_v1: int = -1
    #: the version before the pass when its window pruning and its placement were all that
    #: changed the table (-1: a defrag or a copy-on-write too), and the pruning's undo records
    #: ``[k, 4]`` (cell, seq, pos, shift; None: nothing pruned): a captured step grows its page
    #: lists on the device across a pruning that dropped only cells already cut from their
    #: list's front by the window (numbakv.step.append_lists)
    pruned_v0: int = -1
    pruned: Optional[np.ndarray] = None
    slots: Optional[np.ndarray] = None   # int32 [batch]: the batch's cells when not one run
                                         # start .. start+batch-1 (paged placement)


def no_put_error(config: CacheConfig, layer: int) -> ValueError:
    """The error of a put() on a layer that stores no K/V in this cache (``layer_reuse``)."""
    src = config.owner_layer(layer)
    if src < 0:
        return ValueError(f"put(): layer {layer} has no K/V in this cache (layer_reuse"
                          f"[{layer}] = -1): skip the cache for it")
    return ValueError(f"put(): layer {layer} reuses layer {src}'s K/V (layer_reuse[{layer}] "
                      f"= {src}) and stores none: only layer {src} puts; get() on layer "
                      f"{layer} reads layer {src}'s")


def second_put_error(layer: int) -> ValueError:
    """The error of a second ``put`` for one layer in one forward pass with no ``set_layer``
    between them (a model loop that forgot ``set_layer`` would overwrite that layer and leave
    the next ones unwritten)."""
    return ValueError(f"put(): layer {layer} was already written in this forward pass and "
                      f"set_layer was not called since; call set_layer(layer) before each "
                      f"layer's put (set_layer({layer}) again to overwrite it on purpose)")


@dataclass
class _Undo:
    """What a ``start_forward`` changed, so it can be taken back without a copy of the table:
    an undo log, replayed newest first by :meth:`CausalCache._undo`."""

    forward: Optional[_Forward]
    defrag_count: int
    pruned: Optional[np.ndarray] = None     # prune_window's undo records
    slots: Optional[np.ndarray] = None      # the cells apply_batch filled
    head: int = 0                           # the scatter head before apply_batch
    defrag_moves: Optional[np.ndarray] = None   # a defrag's plan (undone by moving cells back)
    defrag_head: int = 0                    # the scatter head before that defrag
    defrag_meta: Optional[np.ndarray] = None    # the table's counters before that defrag
    evicted_kv: Optional[tuple] = None      # (cells, K, V) a defrag wrote over, as they were
    shifts: Optional[tuple] = None          # (cells, deltas, key rows before) of applied shifts
    unshared: Optional[list] = None         # paged copy-on-write: [(leave journal, _Placed)]


@dataclass
class _Shifted:
    """Pending shifts taken and applied: enough to put the keys and the shifts back."""

    cells: np.ndarray          # int32 [k]
    deltas: np.ndarray         # int32 [k]
    keys: Any                  # the keys of ``cells`` before, [n_layers, k, n_kv_heads, head_dim]


@dataclass
class _Placed:
    """Cells a copy from another stream claimed (``StreamCache``): enough to free them again
    and to put back the K/V rows the copy writes over."""

    slots: np.ndarray          # int32 [n]
    head: int                  # the scatter head before
    keys: Any                  # host K of ``slots`` before, [n_layers, n, n_kv_heads, head_dim]
    values: Any                # host V of ``slots`` before, [n_layers, n, n_kv_heads, v_head_dim]


@dataclass
class _Defragged:
    """A defrag inside an enclosing undo log (a WrapperCache's fan-out): its plan, the head
    before it, the K/V rows its destinations held before (sources and destinations are
    disjoint, so the sources still hold theirs), and the forward pass it ended."""

    moves: np.ndarray          # int64 [m, 3]: src, dst, length
    head: int
    cells: np.ndarray          # int32 [n]: every destination cell
    keys: Any                  # host K of ``cells`` before
    values: Any                # host V of ``cells`` before
    forward: Any
    meta: np.ndarray           # the cell table's counters and index hints before


@dataclass
class _Counters:
    """The cell table's counters and index hints before an edit whose undo would rebuild them
    tighter: put back last, once everything else is undone."""

    meta: np.ndarray


SHARED_SHIFT_MODES = ("error", "copy")


def check_shared_shift(value: Any) -> str:
    """``shared_shift`` checked: ``"error"`` or ``"copy"``."""
    if not isinstance(value, str) or value not in SHARED_SHIFT_MODES:
        raise ValueError(f"shared_shift must be one of {list(SHARED_SHIFT_MODES)}, got "
                         f"{value!r}")
    return value


@one_thread_at_a_time
class CausalCache(StateMethods):
    """A KV cache for causal attention over many sequences sharing one pool of cells.

    One thread at a time: a second thread calling in while another is inside raises
    ``ConcurrentUseError`` (see ``numbakv._guard``).

    Storage: K ``[n_layers, n_cells, n_kv_heads, head_dim]``; V the same with ``v_head_dim`` or,
    with ``config.permuted_v``, ``[n_layers, n_kv_heads, v_head_dim, n_cells]``.

    Args:
        config: shapes, dtypes, limits and device.
        shift: how keys are re-rotated when positions move: ``None`` (moving positions raises
            ``NotSupportedError``), an ``nkv.RopeShift`` run by numbakv's rotary kernel, or a
            callable ``(layer, key, deltas) -> rotated`` where ``key`` is ``[k, n_kv_heads,
            head_dim]`` and ``deltas`` int32 ``[k]`` on the cache's device; it may return any
            DLPack/array tensor of the same shape and dtype.
        swa_window: sliding window ``W``: a token at position ``p`` sees ``p - W .. p``.
        swa_memory: positions kept per sequence behind the window (default ``W``); memory below
            the window is an error; memory >= capacity keeps everything.
        chunk_size: chunked attention ``C``: a token at ``p`` sees ``p - p % C .. p``.
        shared_shift: what ``remove`` (with a finite ``end``), ``seq_add`` and ``seq_div`` do
            when cells they would move are shared with other sequences (``copy_prefix`` /
            ``seq_cp`` forks). ``"error"`` (default, Ollama's rule): ``NotSupportedError``.
            ``"copy"``: the moving sequence first gets its own copies of those cells (K/V
            copied into free cells in every layer, its sequence bit moved to them), then the
            positions move; all or nothing, and ``KVCacheFullError`` with nothing changed when
            there are not enough free cells. llama.cpp instead moves the position for every
            sequence in the cell, silently corrupting the others; numbakv never does.
    """

    #: called as ``provider(n_cells)`` when a batch of ``n_cells`` tokens finds no contiguous
    #: run of free cells, before the cache defragments or raises ``KVCacheFullError``: a prefix
    #: store (``numbakv.prefix.PrefixStore``) sets it to evict the prefixes it keeps in cells.
    #: None (the default): placement is exactly Ollama's.
    _room_provider: Optional[Callable[[int], Any]] = None

    #: the class that serves ``CacheConfig(unified=False)`` (``streams.StreamCache`` registers
    #: itself here: an outer module, so this one never imports it)
    _stream_class: Optional[type] = None

    def __new__(cls, config: CacheConfig = None, *args, **kwargs):
        if cls is CausalCache and isinstance(config, CacheConfig) and not config.unified:
            if CausalCache._stream_class is None:  # pragma: no cover - numbakv imports streams
                raise NotSupportedError("per-sequence streams need numbakv.streams imported")
            return super().__new__(CausalCache._stream_class)
        return super().__new__(cls)

    def __init__(self, config: CacheConfig, *, shift: Union[None, RopeShift, ShiftFn] = None,
                 swa_window: Optional[int] = None, swa_memory: Optional[int] = None,
                 chunk_size: Optional[int] = None, shared_shift: str = "error",
                 _storage_factory=None) -> None:
        if not isinstance(config, CacheConfig):
            raise ValueError(f"config must be a numbakv.CacheConfig, got {type(config).__name__}")
        if shift is not None and not isinstance(shift, RopeShift) and not callable(shift):
            raise ValueError("shift must be None, a numbakv.RopeShift or a callable "
                             f"(layer, key, deltas) -> key, got {shift!r}")
        if isinstance(shift, RopeShift):
            check_rope_layout(config, shift)  # raises when it does not fit the keys
        elif shift is not None and config.k_quantized:
            raise ValueError(f"shift must be None or a numbakv.RopeShift when keys are quantized "
                             f"(k_dtype={config.k_dtype!r}); a shift callable needs float keys")
        window = UNLIMITED if swa_window in (None, 0) else _check_index("swa_window", swa_window, 1)
        if swa_memory is None:
            memory = window
        else:
            memory = _check_index("swa_memory", swa_memory, 1)
        # The sizing rules of Ollama's Causal.Init, in its order.
        if memory != UNLIMITED and config.max_seqs > 1:
            memory = max(memory, window + 1)
        if memory >= config.capacity:
            memory = UNLIMITED
        if memory < window:
            raise ValueError(f"swa_memory ({memory}) must be at least the window swa_window "
                             f"({window})")
        chunk = 0 if chunk_size is None else _check_index("chunk_size", chunk_size, 1)
        shared_shift = check_shared_shift(shared_shift)

        self.config = config
        self.device = resolve_device(config.device)
        self.swa_window = None if window == UNLIMITED else window
        self.swa_memory = None if memory == UNLIMITED else memory
        self.chunk_size = chunk or None
        self.shift = shift
        #: "error" (Ollama: moving cells another sequence shares is refused) or "copy" (the
        #: moving sequence first gets its own copies of them)
        self.shared_shift = shared_shift
        self.n_cells = config.n_cells(self.swa_memory)
        if self.n_cells % config.page_size:
            sized = "max_seqs * window memory + max_batch" if self.swa_memory \
                else "max_seqs * capacity"
            raise ValueError(
                f"page_size={config.page_size} must divide the cache's cell count "
                f"{self.n_cells} ({sized}, rounded up to cache_padding={config.cache_padding}): "
                f"set cache_padding to a multiple of {config.page_size}")
        if _storage_factory is None:
            _check_memory(config, self.n_cells, self.device)

        self._window = window
        self._memory = memory
        self._chunk = chunk
        self.cells = CellTable(self.n_cells, config.max_seqs, page_size=config.page_size)
        # a stream of a per-sequence cache works on its slice of the streams' one allocation
        # owning layers only (layer_reuse): the storage's layer axis is config.storage_layers
        self.storage = KVStorage(config.storage_config(), self.n_cells, self.device) \
            if _storage_factory is None else _storage_factory(self.n_cells, self.device)
        self._xp = array_module(self.device)
        self._storage_layers = config.storage_layers
        self._layer = 0
        self._put_in = None      # the forward pass whose put() the current layer already had
        self._read_layer = self._storage_layers[0]     # storage layer get() reads (-1: none)
        self._put_layer = self._read_layer if config.owner_layer(0) == 0 else -1
        self._forward: Optional[_Forward] = None
        self._closed = False
        self._mask_buf = None
        self._ones = np.ones(0, np.uint8)
        self._packed_pos = self.device == "cpu" and sys.byteorder == "little"
        #: a pass's dense mask is built at its first get(), not in start_forward, on every
        #: device: callers that attend over page_table() (attend, FlashInfer, the GPU paged
        #: kernel) never pay for it (on a GPU: a [batch x n_cells] fill every step). On CUDA it
        #: is then queued on the cache's stream at that get()
        self._lazy_mask = True
        self._bf16_mask = config.mask_dtype == "bfloat16"
        self._bf16 = config.dtype == "bfloat16"
        #: when a list: every sequence operation appends its undo log here (WrapperCache fan-out)
        self._outer_journal: Optional[list] = None
        # the put/get fast path compares against these
        self._sdt = config.storage_dtype
        #: the array type put's fast path takes as is: numpy on cpu/sim, CuPy on cuda
        self._nd = self.storage.xp.ndarray if self.storage is not None else np.ndarray
        self._kv_tail = ((config.local_kv_heads, config.head_dim), (config.local_kv_heads,
                                                                config.v_head_dim))
        #: how many defrags ran (on a full cache or by request): the demo and benches read it
        self.defrag_count = 0

    # ------------------------------------------------------------------ forward pass
    def start_forward(self, positions: ArrayLike, seqs: ArrayLike, reserve: bool = False) -> None:
        """Place a batch: ``positions`` and ``seqs`` (one entry per token, ``[batch]``).

        Evicts what fell out of every sequence's window memory, finds the first contiguous run
        of free cells (defragmenting once if only fragmentation is in the way), records the
        tokens there, applies pending key rotations and builds the mask (on the CPU: at the
        pass's first ``get()``, which is the only reader). ``reserve=True``
        changes no metadata and sizes everything for the worst case. Raises
        ``KVCacheFullError`` when the batch cannot fit; then nothing has changed (pending key
        rotations stay pending, where llama.cpp has applied them by then; docs/fidelity.md).

        ``positions``/``seqs`` on the GPU (CuPy arrays, torch CUDA tensors) are copied to the
        host on the cache's stream (:meth:`use_stream`, else CuPy's current stream) through a
        pinned buffer, synchronising that stream only; while that stream captures a CUDA graph
        they must be host arrays (``ValueError``, nothing changed): the bookkeeping is on the host.
        """
        self._start_forward(positions, seqs, reserve, False)

    @_guarded
    def _start_forward_checked(self, positions: np.ndarray, seqs: np.ndarray) -> None:
        """``start_forward(positions, seqs)`` for a caller that checked the batch itself
        (numbakv.hf's generation cache, once per decode step, its rows' sequences checked when
        it bound the cache): int32 ``[batch]`` host arrays the caller does not change while
        the pass lasts (kept by the pass as they are), ``0 < batch <= max_batch``, every
        sequence in ``[0, max_seqs)`` and every position in ``[0, POS_MAX]``. The rest is
        start_forward's: the conflict check, placement, undo record and pending shifts; one
        thread at a time (the public methods' guard)."""
        self._start_forward(positions, seqs, False, True)

    def _start_forward(self, positions, seqs, reserve, checked: bool) -> None:
        """:meth:`start_forward`'s body (``checked``: the batch arrays are
        :meth:`_start_forward_checked`'s)."""
        provider = self._room_provider
        try:
            undo = self._place(positions, seqs, reserve, ask_room=provider is not None,
                               checked=checked)
        except _NeedRoom as need:
            # a prefix store holds cells: let it evict (demoting what it can) before the
            # Ollama path (defrag, then KVCacheFullError). What it evicted stays evicted if
            # this pass still fails: those were the store's cached prefixes, not the caller's.
            provider(need.cells)
            undo = self._place(positions, seqs, reserve, checked=checked)
        try:
            self._finish_forward(undo)
        except BaseException:
            self._undo(undo)      # e.g. a shift function that failed: nothing placed, no leak
            raise

    def _place(self, positions, seqs, reserve: bool, undoable: bool = False,
               ask_room: bool = False, checked: bool = False) -> "_Undo":
        """The metadata half of start_forward; returns what ``_undo`` needs to take it back (a
        WrapperCache does when a sibling cache fails).

        All or nothing by an undo log, never a copy of the table: window pruning returns undo
        records, apply_batch is undone by freeing its slots, and a defrag by moving the cells
        back (block moves copy, so the source rows still hold their data); the K/V of the cells
        a defrag writes over (evicted ones among them) are kept aside first, so undoing the
        eviction gets each (sequence, position) its own K/V back. ``undoable`` is kept for
        callers that will call ``_undo``; every pass can be undone. ``ask_room``: when no
        contiguous run of free cells holds the batch, raise ``_NeedRoom`` (nothing changed)
        instead of defragmenting, so the caller can ask its room provider (a prefix store)
        first."""
        self._check_open()
        if not isinstance(reserve, (bool, np.bool_)):
            raise ValueError(f"reserve must be a bool, got {reserve!r}")
        # checked: _start_forward_checked's arrays (the caller's checks, no copies)
        pos, sq = (positions, seqs) if checked else self._check_batch(positions, seqs)
        batch = len(pos)
        cells_v0 = self.cells.version
        undo = _Undo(self._forward, self.defrag_count)
        if not reserve:
            bad = self.cells.batch_conflict(pos, sq)
            if bad >= 0:
                raise ValueError(f"positions/seqs: token {bad} (sequence {int(sq[bad])}, position "
                                 f"{int(pos[bad])}) is already stored or repeated in the batch")
        if reserve:
            self._forward = _Forward(pos, sq, True, 0, 0, self.n_cells, np.ones(batch, np.uint8))
            return undo
        try:
            if self._memory != UNLIMITED:
                undo.pruned = self.cells.prune_window(pos, sq, self._memory)
            range_window = -1 if self._memory == UNLIMITED else self._window
            if self.config.page_size > 1:
                self._place_paged(pos, sq, range_window, undo, ask_room)
                self._stamp_versions(undo, cells_v0)
                return undo
            lo, hi, start, head = self.cells.place_contiguous(pos, sq, range_window)
            if start < 0:
                if ask_room:
                    raise _NeedRoom(f"no contiguous run of {batch} free cells", batch)
                if self.cells.n_used + batch > self.n_cells:
                    raise KVCacheFullError(
                        f"no room for a batch of {batch} tokens: {self.cells.n_used} of "
                        f"{self.n_cells} cells hold tokens (cache full)")
                # the defrag writes over free cells, some just evicted: keep the K/V of every
                # cell it writes, so the undo gives each evicted (sequence, position) its own
                # K/V back and leaves every cell's data as it was
                undo.defrag_head = self.cells.head
                # undo_defrag rebuilds the indexes, which tightens the pending-shift range
                # hint: keep the counters to put them back exactly (issue 29, item 7)
                undo.defrag_meta = self.cells._meta.copy()
                undo.defrag_moves = moves = self.cells.plan_defrag()
                if len(moves):
                    dst = np.concatenate([np.arange(d, d + n, dtype=np.int32)
                                          for d, n in zip(moves[:, 1], moves[:, 2])])
                    undo.evicted_kv = (dst,) + self.storage.read_cells(dst)
                self._move_defragged(moves)
                lo, hi, start, head = self.cells.place_contiguous(pos, sq, range_window)
                if start < 0:  # cannot happen: a defrag leaves every free cell in one run
                    raise KVCacheFullError(f"no contiguous run of {batch} free cells")
            undo.head = head
            undo.slots = np.arange(start, start + batch, dtype=np.int32)
        except BaseException:
            self._undo(undo)
            raise
        if lo >= hi:
            lo, hi = start, start + batch
        lo, hi = min(lo, start), max(hi, start + batch)
        pad = self.config.cache_padding
        lo, hi = (lo // pad) * pad, min(round_up(hi, pad), self.n_cells)
        self._forward = _Forward(pos, sq, False, start, lo, hi, self._all_causal(batch))
        self._stamp_versions(undo, cells_v0)
        return undo

    def _stamp_versions(self, undo: "_Undo", cells_v0: int) -> None:
        """Record on the pass the cell table's version before its placement (-1 when window
        pruning, a defrag or a copy-on-write of shared pages changed more than the pass's own
        cells) and after it: page tables extend on the device only after a pure placement."""
        fwd = self._forward
        pruned = undo.pruned if undo.pruned is not None and len(undo.pruned) else None
        no_moves = undo.defrag_moves is None and not getattr(undo, "unshared", None)
        fwd.cells_v0 = cells_v0 if no_moves and pruned is None else -1
        fwd.cells_v1 = self.cells.version
        if no_moves:
            fwd.pruned_v0 = cells_v0
            fwd.pruned = pruned

    def _place_paged(self, pos: np.ndarray, sq: np.ndarray, range_window: int, undo: "_Undo",
                     ask_room: bool) -> "_Undo":
        """``_place`` under paged placement (``CacheConfig(page_size > 1)``): each sequence's
        tokens go on in its last page and open wholly free pages (``CellTable.place_paged``).
        No defrag on a full cache: moving whole pages frees no page. The caller's ``try`` takes
        back the window pruning when this raises."""
        batch = len(pos)
        page = self.config.page_size
        lo, hi, slots, head, tails, run = self.cells.place_paged(pos, sq, range_window, True)
        if len(tails):      # copy-on-write of shared last pages first, then place
            self._unshare_tails(tails, undo)
            lo, hi, slots, head, _, run = self.cells.place_paged(pos, sq, range_window)
        if slots is None:
            # pages a sequence starts, at most: one per page_size tokens, plus one
            need = (batch // page + 1) * page
            if ask_room:
                raise _NeedRoom(f"no free pages for a batch of {batch} tokens", need)
            raise KVCacheFullError(
                f"no room for a batch of {batch} tokens in pages of {page} cells: "
                f"{self.cells.n_free_pages} of {self.n_cells // page} pages are wholly free "
                f"({self.cells.n_free} free cells, the rest inside partly used pages; cache full)")
        undo.head = head
        undo.slots = slots
        if run:
            first, last = int(slots[0]), int(slots[-1])
        else:
            first, last = int(slots.min()), int(slots.max())
        if lo >= hi:
            lo, hi = first, last + 1
        lo, hi = min(lo, first), max(hi, last + 1)
        pad = self.config.cache_padding
        lo, hi = (lo // pad) * pad, min(round_up(hi, pad), self.n_cells)
        self._forward = _Forward(pos, sq, False, first, lo, hi, self._all_causal(batch),
                                 slots=None if run else slots)
        return undo

    def _unshare_tails(self, tails: np.ndarray, undo: "_Undo") -> None:
        """Paged copy-on-write (vLLM's fork of a partial block): each row (seq, first cell,
        cells) of ``CellTable.shared_tails`` gives ``seq`` its own copies of its cells on a
        shared, partly filled last page (K/V copied in every layer, pending shifts carried,
        ``seq``'s bit moved to the copies, which start a fresh page), so its next tokens can
        follow them on one page. Recorded in ``undo.unshared``; a sequence whose copies find
        no free page keeps the shared page (its page rule then breaks; page tables say so)."""
        table = self.cells
        undo.unshared = []
        for seq, first, n in np.asarray(tails).tolist():
            src = np.arange(first, first + n, dtype=np.int32)
            positions = table._pos[src].astype(np.int32)
            shifts = table._shift[src].astype(np.int32)
            journal: list = []
            entry = [journal, None]
            undo.unshared.append(entry)
            table.leave_cells(seq, src, journal=journal)
            slots = table.find_paged(positions, np.full(n, seq, np.int32))
            if slots is None:
                undo.unshared.pop()
                table.rollback(journal)
                continue
            placed = _Placed(slots, table.head, *self.storage.read_cells(slots))
            table.apply_batch(slots, positions, np.full(n, seq, np.int32))
            entry[1] = placed
            moving = shifts != 0
            if moving.any():
                table.restore_shifts(slots[moving], shifts[moving])
            self.storage.copy_cells(src, slots)

    def _finish_forward(self, undo: Optional["_Undo"] = None) -> None:
        """The data half of start_forward: pending key rotations (recorded in ``undo``), then
        the mask."""
        fwd = self._forward
        if fwd.reserve:
            mask = self._mask_buffer(round_up(len(fwd.positions),
                                              self.config.mask_batch_padding), self.n_cells)
            mask[...] = 0  # a sizing pass: all visible, so a model run on it stays finite
            fwd.mask = mask
            fwd.exported = export_view(mask, "bfloat16") if self._bf16_mask else mask
            return
        shifted = self._apply_pending_shifts()
        if undo is not None:
            undo.shifts = shifted
        if not self._lazy_mask:
            self._build_mask()
        # else get() builds it on first use: attention over page_table() never reads it, and
        # the metadata it is built from cannot change before then (every sequence operation
        # ends the forward pass)

    def _undo(self, undo: "_Undo") -> None:
        """Take back a ``start_forward`` (``_place`` and, if it ran, ``_finish_forward``): its own
        failure part-way, or a sibling's in a WrapperCache. Newest change first."""
        if undo.shifts is not None:
            self._unshift(undo.shifts)
            undo.shifts = None
        if undo.slots is not None:
            self.cells.unapply_batch(undo.slots, undo.head)
        for journal, placed in reversed(undo.unshared or []):
            if placed is not None:
                self.storage.write_cells(placed.slots, placed.keys, placed.values)
                self.cells.unapply_batch(placed.slots, placed.head)
            self.cells.rollback(journal)
        undo.unshared = None
        if undo.defrag_moves is not None:
            self.cells.undo_defrag(undo.defrag_moves, undo.defrag_head)
            if undo.defrag_meta is not None:
                self.cells._meta[:] = undo.defrag_meta
        if undo.pruned is not None and len(undo.pruned):
            self.cells.undo_prune(undo.pruned)
        if undo.evicted_kv is not None:
            self.storage.write_cells(*undo.evicted_kv)
        self._forward = undo.forward
        self.defrag_count = undo.defrag_count

    def _check_batch(self, positions, seqs) -> Tuple[np.ndarray, np.ndarray]:
        # fast path: int32 host arrays, every range checked in one compiled pass (copies kept:
        # the caller may reuse its arrays while this forward pass is still described by them)
        if type(positions) is np.ndarray and type(seqs) is np.ndarray \
                and positions.dtype is _I32 and seqs.dtype is _I32 and positions.ndim == 1 \
                and seqs.ndim == 1 and 0 < positions.shape[0] == seqs.shape[0] \
                <= self.config.max_batch \
                and _batch_ids_ok(self.config.max_seqs, positions, seqs) == 0:
            return positions.copy(), seqs.copy()
        storage = self.storage
        return check_batch(positions, seqs, self.config,
                           None if storage is None else storage.stream)

    def _all_causal(self, batch: int) -> np.ndarray:
        """uint8 ones ``[batch]`` (a read-only slice of one array: set_causal replaces, never
        writes, a forward pass's array)."""
        ones = self._ones
        if ones.shape[0] < batch:
            ones = np.ones(max(batch, 2 * ones.shape[0]), np.uint8)
            ones.flags.writeable = False
            self._ones = ones
        return ones[:batch]

    def _mask_buffer(self, rows: int, n: int):
        """A ``[rows, n]`` mask array carved from one buffer kept between forward passes (a mask
        is valid until the next start_forward): no fresh allocation, and no fresh pages to
        fault in, per step. The buffer grows by doubling."""
        need = rows * n
        buf = self._mask_buf
        if buf is None or buf.size < need:
            buf = self.storage.new_mask(1, max(need, 2 * (0 if buf is None else buf.size), 1))[0]
            self._mask_buf = buf
        return buf[:need].reshape(rows, n)

    def _forward_mask(self):
        """The forward pass's mask ``[batch_padded, hi - lo]`` (built now if it was left for
        ``get()``)."""
        fwd = self._forward
        if fwd.mask is None:
            self._build_mask()
        return fwd.mask

    def _build_mask(self) -> None:
        fwd = self._forward
        rows = round_up(len(fwd.positions), self.config.mask_batch_padding)
        mask = self._mask_buffer(rows, fwd.hi - fwd.lo)
        # the table's own arrays (positions at an 8-byte stride, bit words), checked already
        cells = self.cells
        # on the CPU the (pos, shift) records go as int64 words (contiguous loads vectorise)
        pos = cells._ps[fwd.lo:fwd.hi].view(np.int64) if self._packed_pos \
            else cells._pos[fwd.lo:fwd.hi]
        self.storage.fill_mask_trusted(mask, pos,
                                       cells._seqs[fwd.lo:fwd.hi], fwd.positions, fwd.seqs,
                                       fwd.causal, -1 if self._window == UNLIMITED
                                       else self._window, self._chunk)
        fwd.mask = mask
        fwd.exported = export_view(mask, "bfloat16") if self._bf16_mask else mask

    def set_layer(self, layer: int) -> None:
        """Choose the layer that ``put`` and ``get`` work on."""
        self._check_open()
        self._layer = layer = _check_index("layer", layer, 0, self.config.n_layers)
        self._put_in = None
        self._read_layer = self._storage_layers[layer]
        self._put_layer = self._read_layer if self.config.owner_layer(layer) == layer else -1

    def _no_put(self) -> ValueError:
        """put() on a layer that stores no K/V here (``layer_reuse``)."""
        return no_put_error(self.config, self._layer)

    def _read_layer_checked(self, what: str) -> int:
        """The storage layer ``what`` reads for the current layer (its K/V source)."""
        if self._read_layer < 0:
            raise ValueError(f"{what}(): layer {self._layer} has no K/V in this cache "
                             f"(layer_reuse[{self._layer}] = -1)")
        return self._read_layer

    def set_causal(self, except_: Optional[Sequence[int]] = None) -> None:
        """Drop the future-position test for these batch indices (sequence, window and chunk
        tests still apply) until the next ``start_forward``; ``None`` restores it for all."""
        fwd = self._require_forward("set_causal")
        causal = np.ones(len(fwd.positions), np.uint8)
        if except_ is not None:
            idx = host_int_array(except_, "except_", self.storage.stream)
            if idx.size and (idx.min() < 0 or idx.max() >= len(causal)):
                raise ValueError(f"except_ must hold batch indices in [0, {len(causal)}), got "
                                 f"{idx.tolist()}")
            causal[idx] = 0
        if np.array_equal(causal, fwd.causal):
            return
        # read-only as start_forward's all-ones flags are (never written once made): the
        # compiled functions it reaches (pages, mask, attention) are typed by the array's
        # flags, so a writable one would compile another signature of each on first use
        causal.flags.writeable = False
        fwd.causal = causal
        if not fwd.reserve:
            if self._lazy_mask:
                fwd.mask = fwd.exported = None     # rebuilt by the next get()
            else:
                self._build_mask()

    def put(self, key: Any, value: Any) -> None:
        """Store this batch's keys ``[batch, n_kv_heads, head_dim]`` and values
        ``[batch, n_kv_heads, v_head_dim]`` for the current layer (nothing is written during a
        reserve pass; the inputs are still checked). A V-less cache (``v_head_dim=0``, MLA)
        takes ``value=None`` or a zero-width ``[batch, n_kv_heads, 0]``."""
        fwd = self._forward
        # trusted fast path: arrays of the storage (numpy, or CuPy on cuda) in the storage dtype
        # and the batch's exact shape
        if fwd is not None and type(key) is self._nd and type(value) is self._nd \
                and key.dtype is self._sdt and value.dtype is self._sdt \
                and key.shape[1:] == self._kv_tail[0] and value.shape[1:] == self._kv_tail[1] \
                and key.shape[0] == value.shape[0] == len(fwd.positions) and key.ndim == 3 \
                and value.ndim == 3 and self.storage is not None:
            if self._put_in is fwd:
                raise second_put_error(self._layer)
            if self._put_layer < 0:
                raise self._no_put()
            if not fwd.reserve:
                self._store_trusted(self._put_layer, fwd, key, value)
            self._put_in = fwd
            return
        fwd = self._require_forward("put")
        if self._put_in is fwd:
            raise second_put_error(self._layer)
        if self._put_layer < 0:
            raise self._no_put()
        # imported (and converted) on the cache's stream: CuPy hands a DLPack producer its
        # current stream, so the producer (e.g. torch) orders this stream after its own work
        with self.storage._on_device() if self.storage is not None else _NO_STREAM_SCOPE:
            k, v = self._batch_kv(key, value, len(fwd.positions))
        if not fwd.reserve:
            if fwd.slots is None:
                self.storage.put_range(self._put_layer, fwd.start, k, v)
            else:
                self.storage.put(self._put_layer, fwd.slots, k, v)
        self._put_in = fwd

    @_guarded
    def _put_layer_trusted(self, layer: int, key: np.ndarray, value: np.ndarray) -> None:
        """``set_layer(layer); put(key, value)`` for a caller that made every check itself
        (numbakv.hf's generation cache, once per layer of a decode pass): a forward pass
        (not a reserve one) is running, ``layer`` owns its K/V (no ``layer_reuse`` source)
        and has not been put in this pass, and ``key``/``value`` are C-contiguous host arrays
        of the storage dtype, ``[batch, n_kv_heads, head_dim]`` / ``[batch, n_kv_heads,
        v_head_dim]`` with the pass's batch. Held by one thread at a time, as ``put`` is (the
        public methods' guard)."""
        fwd = self._forward
        self._layer = layer
        self._read_layer = self._put_layer = slot = self._storage_layers[layer]
        self._store_trusted(slot, fwd, key, value)
        self._put_in = fwd

    def _store_trusted(self, slot: int, fwd: "_Forward", key: Any, value: Any) -> None:
        """Write the batch of pass ``fwd`` (not a reserve one) into storage layer ``slot``:
        checked arrays of the storage, ``[batch, n_kv_heads, head_dim]`` / ``[.., v_head_dim]``
        in the storage dtype. Contiguous placement writes cells ``start ..``; paged placement
        the batch's cells, placed (so checked) by the table."""
        if fwd.slots is None:
            self.storage.put_range_trusted(slot, fwd.start, key, value)
        else:
            self.storage.put_slots_trusted(slot, fwd.slots, key, value)

    def _batch_kv(self, key, value, batch: int):
        """``key``/``value`` as arrays of the cache's device and dtype, checked to be ``[batch,
        n_kv_heads, head_dim]`` / ``[batch, n_kv_heads, v_head_dim]`` (put's validating path)."""
        cfg = self.config
        k = as_array(key, self.device, cfg.dtype, name="key")
        if value is None and cfg.v_less:   # a V-less (MLA latent) layer: no value to give
            value = self._xp.zeros((batch, cfg.local_kv_heads, 0), dtype=cfg.storage_dtype)
        v = as_array(value, self.device, cfg.dtype, name="value")
        if tuple(k.shape) != (batch, cfg.local_kv_heads, cfg.head_dim):
            raise ValueError(f"key must have shape [batch={batch}, local_kv_heads={cfg.local_kv_heads}, "
                             f"head_dim={cfg.head_dim}], got {list(k.shape)}")
        if tuple(v.shape) != (batch, cfg.local_kv_heads, cfg.v_head_dim):
            raise ValueError(f"value must have shape [batch={batch}, local_kv_heads="
                             f"{cfg.local_kv_heads}, v_head_dim={cfg.v_head_dim}], got "
                             f"{list(v.shape)}")
        return k, v

    def get(self) -> Tuple[Any, Any, Any]:
        """``(key, value, mask)`` for the current layer: zero-copy views of the cells the batch
        may attend to, key ``[n, n_kv_heads, head_dim]``, value ``[n, n_kv_heads, v_head_dim]``
        (``[n_kv_heads, v_head_dim, n]`` when permuted), mask ``[batch_padded, n]`` holding 0
        where a token may attend and -inf elsewhere. bfloat16 views export through DLPack as
        bfloat16."""
        fwd = self._forward
        if fwd is None or self._closed:
            fwd = self._require_forward("get")
        layer = self._read_layer if self._read_layer >= 0 else self._read_layer_checked("get")
        if self.storage.quantized:  # dequantized into a scratch the next get() reuses
            key, value = self.storage.dequantized_views(layer, fwd.lo, fwd.hi)
        else:
            key, value = self.storage.views_trusted(layer, fwd.lo, fwd.hi)
        if fwd.exported is None:
            self._build_mask()      # first get() of this pass (the CPU builds it lazily)
        if self.storage._stream is not None:
            self.storage.order_before()   # CuPy's current stream reads after the puts
        if self._bf16:
            return export_view(key, "bfloat16"), export_view(value, "bfloat16"), fwd.exported
        return key, value, fwd.exported

    def get_quantized(self) -> Tuple[Any, Any]:
        """``(key, value)`` raw storage rows of ``get()``'s cell range for the current layer:
        ``uint8 [n, n_kv_heads, bytes_per_row]`` zero-copy views, ggml's block layout for q8_0
        (34 bytes per 32 values) and q4_0 (18), one float8_e4m3fn byte per value for
        float8_e4m3 (stored = x / scale), and the little-endian bytes of a float side."""
        fwd = self._require_forward("get_quantized")
        k, v = self.storage.quantized_views(self._read_layer_checked("get_quantized"), fwd.lo,
                                            fwd.hi)
        if self.storage._stream is not None:
            self.storage.order_before()
        return export_view(k, "uint8"), export_view(v, "uint8")

    def cell_range(self) -> Tuple[int, int]:
        """The cells ``get()`` covers in this forward pass, half-open: row ``r`` is cell
        ``lo + r``."""
        fwd = self._require_forward("cell_range")
        return fwd.lo, fwd.hi

    def _require_forward(self, what: str) -> _Forward:
        self._check_open()
        if self._forward is None:
            raise ValueError(f"{what}() needs a forward pass: call start_forward first")
        return self._forward

    def _check_open(self) -> None:
        if self._closed:
            raise KVCacheError("the cache is closed")

    # ------------------------------------------------------------------ sequences (Ollama)
    def remove(self, seq: int, begin: int, end: Optional[int] = None) -> None:
        """Drop positions ``[begin, end)`` of ``seq`` (``end=None``: to the end). With a finite
        ``end``, later positions move down by ``end - begin`` and their keys are re-rotated by
        that negative delta through ``shift``.

        Deliberate differences (docs/fidelity.md): ``remove(s, b, b)`` (an empty range) is a
        no-op where Ollama errors; cells other sequences share that would move are refused, or
        copied first with ``shared_shift="copy"``; a failure changes nothing (Ollama keeps the
        edits made before it)."""
        seq, begin, end = self._check_remove(seq, begin, end)
        # an empty range moves nothing: no copies to make, so no room to ask for
        if end is not None and end > begin and self.shared_shift == "copy":
            self._edit_unshared(self.cells.remove, (seq, begin, end), seq, end, None, True)
            return
        self._edit(self.cells.remove, (seq, begin, end), apply_shifts=True)

    def _check_remove(self, seq, begin, end) -> Tuple[int, int, Optional[int]]:
        """Every check ``remove`` makes before it changes anything (so a WrapperCache can ask
        all its caches first); returns the normalised arguments."""
        self._check_open()
        seq = self._check_seq(seq)
        begin = _check_index("begin", begin, 0, UNLIMITED)
        if end is not None:
            end = _check_index("end", end, begin)
            if end >= UNLIMITED:
                end = None
        if end is not None and self.shift is None:
            lo, hi = self.cells.seq_pos_min(seq), self.cells.seq_pos_max(seq)
            if hi >= 0 and (lo < begin or hi >= end):
                raise NotSupportedError(
                    f"removing positions [{begin}, {end}) of sequence {seq} moves later "
                    "positions and needs a shift function (CausalCache(shift=...))")
        if end is not None and self.cells.shared_cells_moving(seq, begin, end):
            if self.shared_shift != "copy":
                raise NotSupportedError(SHARED_SHIFT_MESSAGE + " (CausalCache(shared_shift="
                                        "'copy') gives the moving sequence its own copies)")
            self._check_room_for_copies(seq, end, None)
        return seq, begin, end

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        """Make ``dst_seq`` hold exactly the first ``length`` positions of ``src_seq`` (shared
        cells, no data copied).

        Deliberate difference (docs/fidelity.md): ``copy_prefix(s, s, n)`` is a no-op; Ollama
        first removes the destination everywhere, so it would wipe the sequence."""
        self._check_open()
        src = self._check_seq(src_seq, "src_seq")
        dst = self._check_seq(dst_seq, "dst_seq")
        length = _check_index("length", length, 0, UNLIMITED + 1)
        self._edit(self.cells.copy_prefix, (src, dst, length))

    def can_resume(self, seq: int, pos: int) -> bool:
        """Whether ``seq`` can continue at ``pos`` with what is stored: always without a window
        memory limit; else only when ``pos``'s window lies inside what ``seq`` still holds."""
        self._check_open()
        seq = self._check_seq(seq)
        pos = _check_index("pos", pos, 0, UNLIMITED)
        if self._memory == UNLIMITED:
            return True
        first, last = self.cells.seq_pos_min(seq), self.cells.seq_pos_max(seq)
        if last < 0:
            return False
        return max(0, pos - self._window) >= first and pos <= last + 1

    def defrag(self) -> None:
        """Move every used cell to the front, keeping each (sequence, position) with its own K/V.
        Ends the forward pass in progress (its cells may have moved).

        Deliberate difference (docs/fidelity.md): the used cells keep their order; Ollama fills
        holes from the end, reversing it (attention is the same, later cell indices differ),
        and its merged moves pair metadata with another cell's K/V, which numbakv never does.

        Under paged placement (``CacheConfig(page_size > 1)``): whole pages move, then each
        sequence that breaks the page rule and shares no cell is repacked into fresh pages
        (docs/paged.md)."""
        self._check_open()
        forward = self._forward
        if self.config.page_size > 1:
            self._defrag_pages(forward)
        else:
            self._defrag_plan_and_move(forward)
        self._forward = None

    def _defrag_pages(self, forward: Any) -> None:
        """``defrag`` under paged placement, all or nothing: whole pages move to the front
        (every cell keeps its slot: a sequence that keeps the page rule keeps it), then every
        sequence whose cells break the rule and are its own (none shared) is repacked into
        fresh pages in position order (its K/V rows copied through the host), so a context
        shift or a ``seq_rm`` of a middle range can be followed by ``defrag()`` before the
        next paged table. A sequence the free pages cannot hold is left as it is."""
        # an undo log of its own (handed on to an enclosing one, e.g. a WrapperCache's)
        outer, self._outer_journal = self._outer_journal, []
        try:
            self._defrag_plan_and_move(forward)
            self._repack_broken_sequences()
        except BaseException:
            self._journal_end(rollback=True)
            self._outer_journal = outer
            raise
        entries, self._outer_journal = self._outer_journal, outer
        if outer is not None:
            outer += entries

    def _repack_broken_sequences(self) -> None:
        """Repack (see :meth:`_defrag_pages`) each sequence that breaks the page rule and
        shares none of its cells; undo entries go to ``_outer_journal``."""
        from .pages import page_rule_break
        table, page = self.cells, self.config.page_size
        for seq in range(self.config.max_seqs):
            if table.seq_pos_max[seq] < 0:
                continue
            cells = np.asarray(table.seq_cells(seq), np.int64)
            order = np.argsort(table._pos[cells], kind="stable")
            cells = cells[order].astype(np.int32)
            if page_rule_break(cells, page) < 0:
                continue
            bits = table._seqs[cells].copy()
            bits[:, seq >> 6] &= ~np.uint64(1 << (seq & 63))
            if bits.any():
                continue            # shares cells: copies would break the sharer's rule
            n = len(cells)
            if -(-n // page) > table.n_free_pages + len(np.unique(cells // page)):
                continue            # cannot hold it in fresh pages even after freeing its own
            positions = table._pos[cells].astype(np.int32)
            shifts = table._shift[cells].astype(np.int32)
            rows = self.storage.read_cells(cells)
            journal: list = []
            table.seq_rm(seq, 0, None, journal=journal)
            self._outer_journal.append((journal, self._forward))
            slots = table.find_paged(positions, np.full(n, seq, np.int32))
            if slots is None:       # free cells, not whole pages: give the sequence back
                self._outer_journal.pop()
                table.rollback(journal)
                continue
            placed = _Placed(slots, table.head, *self.storage.read_cells(slots))
            table.apply_batch(slots, positions, np.full(n, seq, np.int32))
            self._outer_journal.append(placed)
            moving = shifts != 0
            if moving.any():
                table.restore_shifts(slots[moving], shifts[moving])
            self.storage.write_cells(slots, *rows)

    def _defrag_plan_and_move(self, forward: Any = None) -> np.ndarray:
        """Plan and run a defrag, all or nothing; inside an enclosing undo log (a
        WrapperCache's fan-out) it records what takes it back, so a later group's failure
        restores this one bit-exact."""
        head = self.cells.head
        meta = self.cells._meta.copy()     # counters and index hints an undo would leave
        moves = self.cells.plan_defrag()
        undo = None
        try:
            if self._outer_journal is not None:
                dst = np.concatenate([np.arange(d, d + n, dtype=np.int32)
                                      for _, d, n in np.asarray(moves).tolist()] +
                                     [np.zeros(0, np.int32)])
                kept = self.storage.read_cells(dst) if len(dst) else (None, None)
                undo = _Defragged(moves, head, dst, *kept, forward, meta)
            self._move_defragged(moves)
        except BaseException:
            self.cells.undo_defrag(moves, head)   # the K/V never moved: neither do the cells
            self.cells._meta[:] = meta
            raise
        if undo is not None:
            self._outer_journal.append(undo)
        return moves

    def _move_defragged(self, moves: np.ndarray) -> None:
        """The K/V half of a defrag whose plan the cell table already applied."""
        if len(moves):
            self.storage.move_blocks(moves)
        self.defrag_count += 1

    # ------------------------------------------------------------------ sequences (llama.cpp)
    def seq_rm(self, seq: int, p0: int = 0, p1: Optional[int] = None) -> bool:
        """Remove positions ``[p0, p1)`` of ``seq`` (``-1``: every sequence; ``p1=None``: to the
        end). Positions do not move. Returns True."""
        self._check_open()
        seq = self._check_seq(seq, allow_all=True)
        p0, p1 = self._check_span(p0, p1)
        return bool(self._edit(self.cells.seq_rm, (seq, p0, p1)))

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: Optional[int] = None) -> None:
        """Let ``dst`` share ``src``'s cells with positions in ``[p0, p1)``."""
        self._check_open()
        src = self._check_seq(src, "src")
        dst = self._check_seq(dst, "dst")
        p0, p1 = self._check_span(p0, p1)
        if src != dst:
            _refuse_held(self.cells, src, dst, p0, p1, "seq_cp")
        self._edit(self.cells.seq_cp, (src, dst, p0, p1))

    def seq_keep(self, seq: int) -> None:
        """Drop every sequence but ``seq``."""
        self._check_open()
        self._edit(self.cells.seq_keep, (self._check_seq(seq),))

    def seq_add(self, seq: int, p0: int, p1: Optional[int], delta: int) -> None:
        """Add ``delta`` to the positions in ``[p0, p1)`` of ``seq``; keys are re-rotated at the
        next ``start_forward`` (or ``apply_pending_shifts``); positions that become negative
        are dropped."""
        self._check_open()
        seq = self._check_seq(seq)
        p0, p1 = self._check_span(p0, p1)
        delta = _check_index("delta", delta, -UNLIMITED, UNLIMITED + 1)
        if delta == 0:
            self._forward = None
            return
        self._require_shift_for(seq, p0, p1, "seq_add")
        if self.shared_shift == "copy":
            self._edit_unshared(self.cells.seq_add, (seq, p0, p1, delta), seq, p0, p1)
            return
        self._edit(self.cells.seq_add, (seq, p0, p1, delta))

    def seq_div(self, seq: int, p0: int, p1: Optional[int], d: int) -> None:
        """Divide the positions in ``[p0, p1)`` of ``seq`` by ``d`` (integer division); keys are
        re-rotated at the next ``start_forward``.

        Deliberate difference (docs/fidelity.md): the pending shift recorded is ``new - old``
        (negative), the correct sign; llama.cpp recorded it with the wrong sign for a while."""
        self._check_open()
        seq = self._check_seq(seq)
        p0, p1 = self._check_span(p0, p1)
        d = _check_index("d", d, 1, UNLIMITED + 1)   # positions are < 2**31: a larger d wraps
        if d == 1:
            self._forward = None
            return
        self._require_shift_for(seq, p0, p1, "seq_div")
        if self.shared_shift == "copy":
            # only cells whose position changes need copies: p // d == p for p == 0
            self._edit_unshared(self.cells.seq_div, (seq, p0, p1, d), seq, max(p0, 1), p1)
            return
        self._edit(self.cells.seq_div, (seq, p0, p1, d))

    def seq_pos_min(self, seq: int) -> int:
        """Smallest position stored for ``seq``, -1 when it holds none."""
        self._check_open()
        return int(self.cells.seq_pos_min(self._check_seq(seq)))

    def seq_pos_max(self, seq: int) -> int:
        """Largest position stored for ``seq``, -1 when it holds none."""
        self._check_open()
        return int(self.cells.seq_pos_max(self._check_seq(seq)))

    def apply_pending_shifts(self) -> None:
        """Re-rotate now the keys whose positions ``seq_add``/``seq_div`` moved."""
        self._check_open()
        shifted = self._apply_pending_shifts()
        if shifted is not None and self._outer_journal is not None:
            self._outer_journal.append(shifted)

    def _check_seq(self, seq, name: str = "seq", allow_all: bool = False) -> int:
        low = -1 if allow_all else 0
        return _check_index(name, seq, low, self.config.max_seqs)

    @staticmethod
    def _check_span(p0, p1) -> Tuple[int, Optional[int]]:
        p0 = _check_index("p0", p0, -UNLIMITED)
        p0 = max(p0, 0)
        if p1 is not None:
            p1 = _check_index("p1", p1, -UNLIMITED)
            if p1 < 0 or p1 >= UNLIMITED:
                p1 = None
        return p0, p1

    def _require_shift_for(self, seq: int, p0: int, p1: Optional[int], what: str) -> None:
        if self.shift is not None:
            return
        if self.cells.holds_in(seq, p0, p1):
            raise NotSupportedError(f"{what} moves positions of sequence {seq} and needs a shift "
                                    "function (CausalCache(shift=...))")

    def _edit(self, op: Callable[..., Any], args: tuple, apply_shifts: bool = False) -> Any:
        """Run a cell-table edit (and, if asked, the key rotation it calls for) all or nothing,
        by its undo log (O(cells touched), never a copy of the table). A sequence operation
        ends the forward pass in progress: its cells and mask may no longer hold."""
        journal: list = []
        shifted = None
        try:
            result = op(*args, journal=journal)
            if apply_shifts:
                shifted = self._apply_pending_shifts()
        except BaseException:
            self.cells.rollback(journal)
            raise
        if self._outer_journal is not None:
            self._outer_journal.append((journal, self._forward))
            if shifted is not None:
                self._outer_journal.append(shifted)
        self._forward = None
        return result

    def _shared_cells(self, seq: int, p0: int,
                      p1: Optional[int]) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``(cells, positions, shifts)`` (int32 ``[k]``, ascending by position) of ``seq``'s
        cells with ``p0 <= pos < p1`` that other sequences share too; None when there are none.
        O(cells of seq)."""
        if not self.cells.shared_cells_in(seq, p0, p1):
            return None
        stop = UNLIMITED if p1 is None else p1
        cells = self.cells.seq_cells(seq)
        pos = self.cells._pos[cells]
        cells = cells[(pos >= p0) & (pos < stop)]
        bits = self.cells._seqs[cells].copy()
        bits[:, seq >> 6] &= ~np.uint64(1 << (seq & 63))
        cells = cells[bits.any(axis=1)]
        pos = self.cells._pos[cells]
        order = np.argsort(pos, kind="stable")
        cells = cells[order].astype(np.int32)
        return cells, pos[order].astype(np.int32), self.cells._shift[cells].astype(np.int32)

    def _check_room_for_copies(self, seq: int, p0: int, p1: Optional[int]) -> int:
        """``shared_shift="copy"``: refuse (``KVCacheFullError``, nothing changed) a move whose
        shared cells do not fit in the free cells; returns how many copies it needs."""
        shared = self._shared_cells(seq, p0, p1)
        n = 0 if shared is None else len(shared[0])
        if n > self.cells.n_free:
            raise KVCacheFullError(
                f"shared_shift='copy': sequence {seq} needs its own copies of {n} cells it "
                f"shares with other sequences before its positions move, and only "
                f"{self.cells.n_free} cells are free (cache full); nothing changed")
        return n

    def _edit_unshared(self, op: Callable[..., Any], args: tuple, seq: int, p0: int,
                       p1: Optional[int], apply_shifts: bool = False) -> Any:
        """``shared_shift="copy"``: give ``seq`` its own copies of the cells in ``[p0, p1)`` it
        shares (K/V copied in every layer by the move kernel, pending shifts carried, ``seq``'s
        bit moved to the copies), then run ``op`` as :meth:`_edit` does. All or nothing: the
        free cells' K/V written over are kept first, and every step has its undo."""
        shared = self._shared_cells(seq, p0, p1)
        if shared is None:
            return self._edit(op, args, apply_shifts)
        src, positions, shifts = shared
        n = len(src)
        self._check_room_for_copies(seq, p0, p1)
        table = self.cells
        meta = table._meta.copy()       # index hints an undo would leave tightened
        forward = self._forward
        unshare: list = []
        journal: list = []
        placed: Optional[_Placed] = None
        shifted = None
        try:
            # seq leaves exactly the shared cells (not a position range: after its own
            # seq_add/seq_div a sequence may hold one position twice, once in a private cell)
            table.leave_cells(seq, src, journal=unshare)
            head = table.head
            slots = table.find_cells(positions, np.full(n, seq, np.int32))
            if slots is None:
                raise KVCacheFullError(
                    f"shared_shift='copy': no free pages of {self.config.page_size} cells for "
                    f"sequence {seq}'s {n} copies (cache full); nothing changed")
            kept = self.storage.read_cells(slots)
            table.apply_batch(slots, positions, np.full(n, seq, np.int32))
            placed = _Placed(slots, head, *kept)
            moving = shifts != 0
            if moving.any():           # the copies carry the rotations still owed
                table.restore_shifts(slots[moving], shifts[moving])
            self.storage.copy_cells(src, slots)
            result = op(*args, journal=journal)
            if apply_shifts:
                shifted = self._apply_pending_shifts()
        except BaseException:
            table.rollback(journal)
            if placed is not None:
                self.storage.write_cells(placed.slots, placed.keys, placed.values)
                table.unapply_batch(placed.slots, placed.head)
            table.rollback(unshare)
            table._meta[:] = meta
            raise
        if self._outer_journal is not None:
            self._outer_journal += [_Counters(meta), (unshare, forward), placed,
                                    (journal, forward)]
            if shifted is not None:
                self._outer_journal.append(shifted)
        self._forward = None
        return result

    def _journal_begin(self) -> None:
        """Record every following sequence operation until :meth:`_journal_end` (a WrapperCache
        that may have to take back what its first caches did when a later one refuses)."""
        self._outer_journal = []

    def _journal_end(self, rollback: bool) -> None:
        journal, self._outer_journal = self._outer_journal, None
        if not rollback or not journal:
            return
        for entry in reversed(journal):
            if isinstance(entry, _Shifted):
                self._unshift(entry)
            elif isinstance(entry, _Defragged):
                if len(entry.cells):
                    self.storage.write_cells(entry.cells, entry.keys, entry.values)
                self.cells.undo_defrag(entry.moves, entry.head)
                self.cells._meta[:] = entry.meta
                self.defrag_count -= 1
                self._forward = entry.forward
            elif isinstance(entry, _Placed):
                self.storage.write_cells(entry.slots, entry.keys, entry.values)
                self.cells.unapply_batch(entry.slots, entry.head)
            elif isinstance(entry, _Counters):
                self.cells._meta[:] = entry.meta
            else:
                cells_journal, forward = entry
                self.cells.rollback(cells_journal)
                self._forward = forward

    def _claim_for_copy(self, positions: np.ndarray) -> np.ndarray:
        """Claim free cells for ``positions`` (int32 ``[n]``) of sequence 0, which a copy from
        another stream is about to fill (``StreamCache``; the caller checked there is room):
        a contiguous run where one exists, else scattered cells, never a defrag (it would move
        the cells an enclosing undo log refers to). Inside a journal, the cells' K/V rows are
        kept first, so that taking the copy back restores what it wrote over. Returns the cells
        (int32 ``[n]``)."""
        n = len(positions)
        slots = self.cells.find_cells(positions, np.zeros(n, np.int32))
        if slots is None:
            raise KVCacheFullError(f"no room for {n} copied cells ({self.cells.n_free} free)")
        head = self.cells.head
        kept = self.storage.read_cells(slots) if self._outer_journal is not None else None
        self.cells.apply_batch(slots, positions, np.zeros(n, np.int32))
        if kept is not None:
            self._outer_journal.append(_Placed(slots, head, *kept))
        self._forward = None
        return slots

    # ------------------------------------------------------------------ key rotation
    def _apply_pending_shifts(self) -> Optional[_Shifted]:
        """Rotate the keys of every cell with a pending shift; all or nothing (the keys it
        touches are kept aside first, and put back with the shifts if the rotation fails).
        Returns what :meth:`_unshift` needs to take it back, None when nothing was pending."""
        if not self.cells.has_pending_shifts():
            return None
        if self.shift is None:
            raise NotSupportedError("positions moved but the cache has no shift function")
        moved, deltas = self.cells.take_shifts()
        shifted = _Shifted(moved, deltas, self._key_rows(moved))
        try:
            if isinstance(self.shift, RopeShift):
                self.storage.rotate(moved, deltas, self.shift)
            else:
                self._shift_with_callable(moved, deltas)
        except BaseException:
            self._unshift(shifted)
            raise
        return shifted

    def _key_rows(self, cells: np.ndarray):
        """Copies of the keys of ``cells`` in every layer, ``[n_layers, k, n_kv_heads,
        head_dim]``."""
        return self.storage.keys[:, self._xp.asarray(cells.astype(np.int64))]

    def _unshift(self, shifted: _Shifted) -> None:
        """Undo :meth:`_apply_pending_shifts`: the keys as they were, the shifts pending again."""
        self.storage.keys[:, self._xp.asarray(shifted.cells.astype(np.int64))] = shifted.keys
        self.cells.restore_shifts(shifted.cells, shifted.deltas)

    def _shift_with_callable(self, moved: np.ndarray, deltas: np.ndarray) -> None:
        """Ollama's shift: windows of at most ``max_batch`` consecutive cells, each passed to the
        shift function per layer with the delta of every cell in the window (0 for cells that do
        not move). Every result is computed and checked before any is written back."""
        cfg = self.config
        order = np.argsort(moved, kind="stable")
        moved, deltas = moved[order], deltas[order]
        windows = []
        i = 0
        while i < len(moved):
            first = int(moved[i])
            j = i
            while j + 1 < len(moved) and moved[j + 1] < first + cfg.max_batch:
                j += 1
            last = int(moved[j])
            window_deltas = np.zeros(last - first + 1, np.int32)
            window_deltas[moved[i:j + 1] - first] = deltas[i:j + 1]
            windows.append((first, last + 1, window_deltas))
            i = j + 1
        results = []
        # each stored key once, in its own layer (layer_reuse: the owning layers)
        for slot, layer in enumerate(cfg.owner_layers):
            for lo, hi, window_deltas in windows:
                view = self.storage.key_view(slot, lo, hi)
                d = self._xp.asarray(window_deltas)
                out = self.shift(layer, export_view(view, cfg.dtype), d)
                out = as_array(out, self.device, cfg.dtype, name="shift result")
                if tuple(out.shape) != tuple(view.shape):
                    raise ValueError(f"shift result must have shape {list(view.shape)}, got "
                                     f"{list(out.shape)}")
                results.append((view, out))
        for view, out in results:
            view[...] = out

    # ------------------------------------------------------------------ state
    # save_state / load_state / state_bytes / load_state_bytes: StateMethods (state/methods.py)
    def _after_state_load(self) -> None:
        self._forward = None      # a state load ends the forward pass in progress

    # ------------------------------------------------------------------ one sequence's K/V
    def export_seq(self, seq: int, p0: int = 0, p1: Optional[int] = None, *,
                   device: bool = False) -> "SeqSnapshot":
        """A ``numbakv.SeqSnapshot`` of positions ``[p0, p1)`` of ``seq`` (``p1=None``: to the
        end): the positions, the raw stored K/V rows of every layer (``[n, n_kv_heads, row]``,
        the storage format, V never permuted), the head range and the model fingerprint.
        Rows of a run of consecutive cells are read-only views of the storage (``snap.copy()``
        owns them); ``device=True`` keeps a cuda cache's rows on the GPU. See
        :mod:`numbakv.state.snapshot`."""
        from .state import snapshot
        return snapshot.export_seq(self, seq, p0, p1, device=device)

    def import_seq(self, seq: int, snap: "SeqSnapshot", *, at: Optional[int] = None) -> int:
        """Place ``snap``'s tokens into free cells for ``seq`` (positions as saved, or moved to
        start at ``at`` with the keys re-rotated) and write their K/V; returns the tokens
        placed. Everything is checked first (fingerprint, shapes, formats, head range,
        positions ``seq`` holds, room): a refusal changes nothing. Ends the forward pass."""
        from .state import snapshot
        return snapshot.import_seq(self, seq, snap, at=at)

    # ------------------------------------------------------------------ misc
    def capture_step(self, batch: int, *, attend: bool = False, n_heads: Optional[int] = None,
                     scale: Optional[float] = None, soft_cap: Optional[float] = None,
                     v_dim: Optional[int] = None) -> "DecodeStep":
        """A decode step of up to ``batch`` tokens whose inputs sit in fixed device buffers: on
        ``cuda`` a CUDA graph of one put per stored layer reading its slots from a step
        descriptor the host refreshes with one asynchronous copy per replay; on ``cpu``/``sim``
        the same launches recorded and run by each replay (same results and errors, no graph).

        ``step.replay(positions, seqs, q=None, k, v)`` then does ``start_forward`` and stores
        ``k [n_stored_layers, n, n_kv_heads, head_dim]`` / ``v [n_stored_layers, n, n_kv_heads,
        v_head_dim]`` in every stored layer; ``step.key`` / ``step.value`` are the fixed input
        buffers a model may write into directly (pass ``k=None, v=None``). The graph runs on the
        cache's stream (:meth:`use_stream`); the step keeps its buffers and graph alive as long as
        it lives. See :mod:`numbakv.step`.

        With ``attend=True`` each stored layer's put is followed by numbakv's batched paged
        attention (:mod:`numbakv.kernels.decode`) of ``n_heads`` query heads (default
        ``n_kv_heads``; grouped-query attention) with ``scale`` (default ``1 / sqrt(head_dim)``)
        and ``soft_cap`` over that layer after the put, under the cache's mask rule (causal,
        ``swa_window``, ``chunk_size``): its page lists, sequence lengths and positions sit in
        fixed device buffers the replay refreshes, split-K over a fixed number of parts (the
        empty ones exit at once) merged in the graph. ``step.replay(positions, seqs, q, k, v)``
        then returns the attention, float32 ``[n_stored_layers, n, n_heads, v_head_dim]``
        (on ``cpu`` computed by :func:`numbakv.attention.attend`).

        A V-less MLA latent cache (``v_head_dim=0``) is captured too: the put stores the
        latent rows (``v=None``), and the attention is MLA's absorbed form as
        :func:`numbakv.attention.attend` computes it: ``q`` holds the absorbed queries ``[..,
        n_heads, head_dim]`` and the output is ``[.., n_heads, v_dim]``, the weighted sum of
        each row's first ``v_dim`` values (default the cache's ``RopeShift.offset``, i.e.
        ``kv_lora_rank``; a multiple of 32 on a q8_0 / q4_0 latent). FlashMLA's ``fp8_ds_mla``
        rows too: the put quantizes into the 656-byte rows (byte-exact with ``put``), and the
        latent kernel dequantizes them as it stages them (one latent head a cell; with several
        KV heads only the put is captured).

        V stored permuted (``permuted_v=True``) is captured with attention too: the kernel
        reads ``[n_kv_heads, v_head_dim, n_cells]`` through the transposed view's strides.

        Per-sequence streams (``unified=False``) are captured too (the slots are pool cells,
        placed in every stream's cell table by one compiled call; the page lists grow on the
        device while only the replays' placements changed the streams' tables, else are
        rebuilt over the pool), and so is a ``WrapperCache``
        (:meth:`numbakv.WrapperCache.capture_step`: one step per layer group).

        Raises ``ValueError`` (``batch`` not in ``[1, max_batch]``, a bad ``n_heads`` /
        ``scale`` / ``soft_cap`` / ``v_dim``) and ``NotSupportedError`` for what is not
        captured: a quantized format outside :data:`numbakv.step.CAPTURED_QUANT_TYPES`; with
        ``attend=True`` shapes the attention kernels do not take (and ``fp8_ds_mla`` rows of
        several KV heads). Changes nothing in the cache."""
        self._check_open()
        from .step import DecodeStep, check_capturable
        batch, attention = check_capturable(self, batch, attend, n_heads, scale, soft_cap,
                                            v_dim)
        return DecodeStep(self, batch, attention)

    def _step_placement(self) -> Tuple[np.ndarray, np.ndarray, int, Optional[np.ndarray]]:
        """Trusted (:class:`numbakv.step.DecodeStep`, after ``start_forward``): the pass's
        ``(positions, seqs, start, slots)``: int32 ``[n]`` each, the first cell of a
        contiguous placement and the cells of a paged one (None when contiguous)."""
        fwd = self._forward
        return fwd.positions, fwd.seqs, int(fwd.start), fwd.slots

    def use_stream(self, stream: Any) -> None:
        """Queue this cache's GPU work (puts, masks, moves, rotations, copies) on ``stream``: a
        CuPy stream, a torch stream (``torch.cuda.current_stream()``) or a raw ``cudaStream_t``
        int; None goes back to CuPy's current stream. The rules are those of
        :meth:`numbakv.storage.KVStorage.use_stream`. On cpu/sim only None is accepted."""
        self._check_open()
        self.storage.use_stream(stream)

    def close(self) -> None:
        """Release the storage; any later call raises ``KVCacheError``."""
        self._closed = True
        self._forward = None
        self.storage = None

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def n_used(self) -> int:
        """Cells holding at least one sequence."""
        return int(self.cells.n_used)

    def __enter__(self) -> "CausalCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ attention-ready outputs
    def page_table(self, page_size: int = 1) -> Any:
        """This forward pass's per-sequence page table (:class:`numbakv.pages.PageTable`, page
        size 1: a page is a cell): for each sequence of the batch, the cells any of its tokens
        may attend to, ascending by position, as int32 arrays on the cache's device. Valid
        until the next ``start_forward`` or sequence operation; follows ``set_causal``.

        ``page_size > 1`` (FlashMLA's dense decode takes 64): a
        :class:`numbakv.pages.PagedTable` (``block_table``, ``cache_seqlens``, FlashInfer's
        ``kv_indptr``/``kv_indices``/``kv_last_page_len``) over pages of ``page_size`` cells
        (page ``p`` = cells ``[p * page_size, (p + 1) * page_size)``), when every sequence of
        the batch's visible cells, in position order, fill pages: token ``i`` in slot ``i %
        page_size`` of its page, pages anywhere in the pool and in any order, only the last
        one partial. ``CacheConfig(page_size=...)`` places tokens so; a layout that breaks the
        rule (contiguous placement across page boundaries, ``seq_rm`` of a middle range, a
        sliding window, a context shift, a shared page another sequence wrote on) is refused
        with ``NotSupportedError`` naming the sequence, token and cell, never described
        wrongly. Pair it with :meth:`mla_views` ``(page_size=...)``."""
        page_size = _check_index("page_size", page_size, 1)
        host = self._host_pages()
        if self.storage is not None and self.storage._stream is not None:
            self.storage.order_before()   # the table's upload and the puts, before its reader
        if page_size == 1:
            return host.table
        return _pages.paged_table(host, page_size, self.n_cells, self._xp)

    def mla_views(self, layer: Optional[int] = None, *, page_size: int = 1) -> Tuple[Any, Any]:
        """An MLA latent pool split as FlashInfer's MLA kernels take it, zero-copy: ``ckv``
        ``[n_cells, kv_lora_rank]`` and ``kpe`` ``[n_cells, rope]`` (strided views of the one
        ``[n_cells, 1, kv_lora_rank + rope]`` row array of :meth:`layer_pool`), or ``[n_pages,
        page_size, ...]`` with ``page_size > 1`` (pages as :meth:`page_table` numbers them). The
        split point is the cache's ``RopeShift`` offset. V-less float caches only."""
        cfg = self.config
        if not cfg.v_less or cfg.local_kv_heads != 1:
            raise ValueError(f"mla_views() needs an MLA latent cache (n_kv_heads=1, "
                             f"v_head_dim=0), got n_kv_heads={cfg.n_kv_heads}, "
                             f"v_head_dim={cfg.v_head_dim}")
        if cfg.k_quantized:
            raise ValueError(f"mla_views() reads float rows; k_dtype={cfg.k_dtype!r} stores "
                             "quantized bytes (get_quantized() hands them out)")
        rank = getattr(self.shift, "offset", 0)
        if not rank:
            raise ValueError("mla_views() splits the row at the RopeShift offset (kv_lora_rank):"
                             " build the cache with shift=RopeShift(dim=rope, offset=kv_lora_rank)")
        page_size = _check_index("page_size", page_size, 1)
        if self.n_cells % page_size:
            raise ValueError(f"page_size={page_size} must divide the cache's {self.n_cells} cells")
        key, _ = self.layer_pool(layer)
        bits = getattr(key, "bits", None)
        raw = key if bits is None else bits
        pages = self.n_cells // page_size
        out = []
        for part in (raw[:, 0, :rank], raw[:, 0, rank:]):
            if page_size > 1:
                part = part.reshape(pages, page_size, part.shape[-1])   # a view: axis 0 splits
            out.append(part if bits is None else type(key)(part))
        return out[0], out[1]

    def layer_pool(self, layer: Optional[int] = None) -> Tuple[Any, Any]:
        """Zero-copy views of every cell of ``layer`` (the current layer when None): key
        ``[n_cells, n_kv_heads, head_dim]``, value likewise (``[n_kv_heads, v_head_dim,
        n_cells]`` when permuted); ``page_table().kv_indices`` index their cell axis. A layer
        that reuses another's K/V (``layer_reuse``) gets that layer's views."""
        self._check_open()
        layer = self._layer if layer is None else _check_index("layer", layer, 0,
                                                               self.config.n_layers)
        slot = self._storage_layers[layer]
        if slot < 0:
            raise ValueError(f"layer_pool(): layer {layer} has no K/V in this cache "
                             f"(layer_reuse[{layer}] = -1)")
        dtype = self.config.dtype
        if self.storage._stream is not None:
            self.storage.order_before()
        return (export_view(self.storage.key_view(slot, 0, self.n_cells), dtype),
                export_view(self.storage.value_view(slot, 0, self.n_cells), dtype))

    @property
    def _attention_cache(self) -> "CausalCache":
        """The cache ``attend`` reads (a WrapperCache answers its current layer's cache)."""
        return self

    def _host_pages(self):
        """The page table with its host copies and mask rule (built once per forward pass and
        ``set_causal``; ``attend`` reads it every layer)."""
        pages = _pages      # a module global: an import statement here costs ~0.7 us a pass
        fwd = self._require_forward("page_table")
        cached = getattr(self, "_pages_cache", None)
        if cached is not None and cached[0] is fwd and cached[1] is fwd.causal \
                and cached[2] is self.cells:
            return cached[3]
        cells = self.cells
        window = -1 if self._window == UNLIMITED else self._window
        # a decode step: the previous pass's lists grown by this pass's cells (on a GPU on the
        # device: O(batch) host work and upload; on the CPU copied and appended to, no walk of
        # the cell table) when the cell table changed only by this pass's placement and those
        # lists held every cell of their sequences
        appendable = self.device in pages.INCREMENTAL_DEVICES and not fwd.reserve and not (
            self.device == "cpu" and len(fwd.positions) == 1
            and cells.n_used < pages.CPU_EXTEND_MIN_CELLS)
        host = None
        with self.storage._on_device() if self.storage is not None else _NO_STREAM_SCOPE:
            inc = getattr(self, "_pages_inc", None)
            if appendable and inc is not None and inc[1] is cells \
                    and inc[2] == fwd.cells_v0 and cells.version == fwd.cells_v1:
                host = pages.extend_pages(inc[0], fwd.positions, fwd.seqs, fwd.causal,
                                          fwd.start if fwd.slots is None else fwd.slots,
                                          cells.max_seqs, self.device,
                                          self._host_lists_of(fwd, cells.version, window),
                                          window, self._chunk)
            if host is None:
                if fwd.reserve:
                    host = pages.reserve_pages_of_table(cells, fwd.positions, fwd.seqs)
                else:
                    host = pages.pages_of_table(cells, fwd.positions, fwd.seqs, fwd.causal,
                                                window=window, chunk=self._chunk)
                pages.to_device(host, self.device)     # on the cache's stream
                if appendable:
                    pages.mark_extendable(host, cells.seq_pos_max,
                                          window >= 0 or self._chunk > 0)
        self._pages_inc = (host, cells, cells.version) \
            if "last-positions" in host.plans else None
        self._pages_cache = (fwd, fwd.causal, cells, host)
        return host

    def _host_lists_of(self, fwd: _Forward, version: int, window: int):
        """The host build of pass ``fwd``'s page table, for the host lists of a table extended
        on the device (read only if a host-side backend asks, within the pass)."""
        cells = self.cells

        def fill():
            if self.cells is not cells or cells.version != version:
                raise RuntimeError("a page table's host lists were read after the cell table "
                                   "changed (page tables are valid until the next "
                                   "start_forward or sequence operation)")
            return _pages.pages_of_table(cells, fwd.positions, fwd.seqs, fwd.causal,
                                         window=window, chunk=self._chunk)
        return fill

    def __repr__(self) -> str:
        cfg = self.config
        extra = "".join(f", {k}={v}" for k, v in (("swa_window", self.swa_window),
                                                  ("swa_memory", self.swa_memory),
                                                  ("chunk_size", self.chunk_size)) if v)
        shard = "" if cfg.head_shard is None else \
            f" (heads {cfg.head_range} of {cfg.n_kv_heads})"
        return (f"CausalCache(n_cells={self.n_cells}, used={self.cells.n_used}, layers="
                f"{cfg.n_layers}, kv_heads={cfg.local_kv_heads}{shard}, head_dim={cfg.head_dim}, dtype="
                f"{cfg.dtype}, device={self.device}{extra})")


def _held_twice(cells: CellTable, src: int, dst: int, p0: int, p1: Optional[int]) -> np.ndarray:
    """Positions (int64, ascending) that ``seq_cp(src, dst, p0, p1)`` would give ``dst`` a
    second time: ``src`` holds them in ``[p0, p1)`` in a cell ``dst`` does not share, and ``dst``
    already holds them in another cell. O(cells of src + cells of dst)."""
    stop = UNLIMITED if p1 is None else p1
    src_cells = cells.seq_cells(src)
    pos = cells._pos[src_cells]
    pick = (pos >= p0) & (pos < stop)
    if not pick.any():
        return np.zeros(0, np.int64)
    word, bit = dst >> 6, np.uint64(1 << (dst & 63))
    joins = src_cells[pick][(cells._seqs[src_cells[pick], word] & bit) == 0]
    if not len(joins):
        return np.zeros(0, np.int64)
    held = cells._pos[cells.seq_cells(dst)]
    return np.intersect1d(cells._pos[joins], held).astype(np.int64)


def _refuse_held(cells: CellTable, src: int, dst: int, p0: int, p1: Optional[int],
                 what: str) -> None:
    """Refuse (``ValueError`` naming the positions) a copy that would leave ``dst`` holding a
    position twice: llama.cpp's batch rule (a (sequence, position) is stored at most once)
    applied to ``seq_cp``, as the stream cache already did; llama.cpp itself asserts."""
    twice = _held_twice(cells, src, dst, p0, p1)
    if len(twice):
        shown = twice[:16].tolist()
        more = f" and {len(twice) - 16} more" if len(twice) > 16 else ""
        raise ValueError(f"{what}: sequence {dst} already holds positions {shown}{more} that "
                         f"sequence {src} would copy into it; seq_rm them from {dst} first")


#: put's import scope on a cache without storage (no stream to enter)
_NO_STREAM_SCOPE = contextlib.nullcontext()
_TABLE_SAMPLE_CELLS = 4096


@functools.lru_cache(maxsize=None)
def _table_bytes_per_cell(max_seqs: int) -> float:
    """Host bytes per cell of a cell table with its indexes, measured on a sample table (the
    per-sequence trees shrink per cell as tables grow, so this bounds large tables from
    above)."""
    from ._memory import nbytes_of
    return nbytes_of(CellTable(_TABLE_SAMPLE_CELLS, max_seqs)) / _TABLE_SAMPLE_CELLS


def _check_memory(config: CacheConfig, n_cells: int, device: str) -> None:
    """Refuse, before allocating anything, a cache larger than the memory left: K/V storage and
    the worst-case mask (a reserve pass: ``round_up(max_batch, mask_batch_padding)`` rows over
    every cell) on the cache's device; the cell table with its indexes and one copy of it as
    scratch (the snapshot a defragmenting pass keeps for its undo) on the host."""
    from ._memory import check_memory
    mask_rows = round_up(config.max_batch, config.mask_batch_padding)
    mask_bytes = mask_rows * n_cells * MASK_DTYPES[config.mask_dtype].itemsize
    table_bytes = math.ceil(_table_bytes_per_cell(config.max_seqs) * n_cells)
    check_memory(f"the cache ({n_cells} cells)", device,
                 {"K/V storage": config.nbytes(n_cells), "mask at max_batch": mask_bytes},
                 {"cell table": table_bytes, "scratch (table snapshot)": table_bytes},
                 hint="lower capacity, max_seqs, max_batch or n_layers "
                      "(CacheConfig.nbytes() sizes the K/V)")


__all__ = ["CausalCache", "UNLIMITED"]
