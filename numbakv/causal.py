"""``CausalCache``: Ollama's ``Cache`` interface with ``Causal`` semantics (sliding window, window
memory, chunked attention), plus llama.cpp's sequence operations, on numbakv's cell table
(``cells.py``) and K/V storage (``storage.py``).

Semantics follow Ollama's ``kvcache/causal.go`` (see ``shared/NOTES.md``) with two deliberate
differences: a call that raises leaves the cache exactly as it was, and no operation ever pairs a
cell's metadata with another cell's K/V (defrag included).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike

from .cells import SHARED_SHIFT_MESSAGE, CellTable
from .config import CacheConfig, RopeShift, round_up
from .device import array_module, as_array, export_view, resolve_device
from .errors import KVCacheError, KVCacheFullError, NotSupportedError
from .storage import KVStorage

#: Stands for "no limit" in window, memory and range arithmetic (Ollama's math.MaxInt32).
UNLIMITED = 2**31 - 1

ShiftFn = Callable[[int, Any, Any], Any]
PathLike = Union[str, os.PathLike]   # a file path


def _check_index(name: str, value, low: int, high: Optional[int] = None) -> int:
    """``value`` as an int in ``[low, high)`` (``high=None``: no upper bound)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def host_int_array(values, name: str) -> np.ndarray:
    """A 1-D int64 host copy of integer values given as a list, numpy/CuPy array or tensor."""
    if hasattr(values, "__cuda_array_interface__") or type(values).__module__.startswith("cupy"):
        import cupy
        values = cupy.asnumpy(cupy.asarray(values))
    elif hasattr(values, "__dlpack_device__") and not isinstance(values, np.ndarray):
        if int(values.__dlpack_device__()[0]) not in (1, 3):  # not host memory
            import cupy
            values = cupy.asnumpy(cupy.from_dlpack(values))
        else:
            values = np.from_dlpack(values)
    arr = np.asarray(values)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


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


@dataclass
class _Undo:
    """What ``_place`` changed, so it can be taken back without having copied the table."""

    forward: Optional[_Forward]
    defrag_count: int
    pruned: Optional[np.ndarray] = None     # prune_window's undo records
    slots: Optional[np.ndarray] = None      # the cells apply_batch filled
    head: int = 0                           # the scatter head before apply_batch
    before_defrag: Optional[CellTable] = None   # the (pruned) table a defrag started from


class CausalCache:
    """A KV cache for causal attention over many sequences sharing one pool of cells.

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
    """

    def __init__(self, config: CacheConfig, *, shift: Union[None, RopeShift, ShiftFn] = None,
                 swa_window: Optional[int] = None, swa_memory: Optional[int] = None,
                 chunk_size: Optional[int] = None) -> None:
        if not isinstance(config, CacheConfig):
            raise ValueError(f"config must be a numbakv.CacheConfig, got {type(config).__name__}")
        if shift is not None and not isinstance(shift, RopeShift) and not callable(shift):
            raise ValueError("shift must be None, a numbakv.RopeShift or a callable "
                             f"(layer, key, deltas) -> key, got {shift!r}")
        if isinstance(shift, RopeShift):
            shift.rotary_dim(config.head_dim)  # raises when it does not fit the keys
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

        self.config = config
        self.device = resolve_device(config.device)
        self.swa_window = None if window == UNLIMITED else window
        self.swa_memory = None if memory == UNLIMITED else memory
        self.chunk_size = chunk or None
        self.shift = shift
        self.n_cells = config.n_cells(self.swa_memory)
        _check_memory(config, self.n_cells, self.device)

        self._window = window
        self._memory = memory
        self._chunk = chunk
        self.cells = CellTable(self.n_cells, config.max_seqs)
        self.storage = KVStorage(config, self.n_cells, self.device)
        self._xp = array_module(self.device)
        self._layer = 0
        self._forward: Optional[_Forward] = None
        self._closed = False
        #: how many defrags ran (on a full cache or by request): the demo and benches read it
        self.defrag_count = 0

    # ------------------------------------------------------------------ forward pass
    def start_forward(self, positions: ArrayLike, seqs: ArrayLike, reserve: bool = False) -> None:
        """Place a batch: ``positions`` and ``seqs`` (one entry per token, ``[batch]``).

        Evicts what fell out of every sequence's window memory, finds the first contiguous run
        of free cells (defragmenting once if only fragmentation is in the way), records the
        tokens there, applies pending key rotations and builds the mask. ``reserve=True``
        changes no metadata and sizes everything for the worst case. Raises
        ``KVCacheFullError`` when the batch cannot fit; then nothing has changed.
        """
        self._place(positions, seqs, reserve)
        self._finish_forward()

    def _place(self, positions, seqs, reserve: bool, undoable: bool = False) -> "_Undo":
        """The metadata half of start_forward; returns what ``_undo`` needs to take it back (a
        WrapperCache does when a sibling cache fails).

        Atomic without copying the table on the hot path: window pruning returns undo records,
        and a defrag runs only when it is sure to make room, so the one check that can fail
        comes before it. A pass that defrags copies the table first. Block moves copy, so after
        a defrag the source rows still hold their data and restoring the earlier table is a
        complete undo. ``undoable`` is kept for callers that will call ``_undo``; every pass
        can be undone."""
        self._check_open()
        pos, sq = self._check_batch(positions, seqs)
        batch = len(pos)
        undo = _Undo(self._forward, self.defrag_count)
        if reserve:
            self._forward = _Forward(pos, sq, True, 0, 0, self.n_cells, np.ones(batch, np.uint8))
            return undo
        try:
            if self._memory != UNLIMITED:
                undo.pruned = self.cells.prune_window(pos, sq, self._memory)
            range_window = -1 if self._memory == UNLIMITED else self._window
            lo, hi = self.cells.batch_range(pos, sq, range_window)
            start = self.cells.find_contiguous(batch)
            if start < 0:
                if self.cells.n_used + batch > self.n_cells:
                    raise KVCacheFullError(
                        f"no room for a batch of {batch} tokens: {self.cells.n_used} of "
                        f"{self.n_cells} cells hold tokens (cache full)")
                # a defrag renumbers cells, so the prune records no longer apply: keep the
                # table it starts from (defrags are rare and O(n_cells) anyway)
                undo.before_defrag = self.cells.copy()
                self._defrag_plan_and_move()
                lo, hi = self.cells.batch_range(pos, sq, range_window)
                start = self.cells.find_contiguous(batch)
                if start < 0:  # cannot happen: a defrag leaves every free cell in one run
                    raise KVCacheFullError(f"no contiguous run of {batch} free cells")
            undo.head = self.cells.head
            slots = np.arange(start, start + batch, dtype=np.int32)
            self.cells.apply_batch(slots, pos, sq)
            undo.slots = slots
        except BaseException:
            self._undo(undo)
            raise
        if lo >= hi:
            lo, hi = start, start + batch
        lo, hi = min(lo, start), max(hi, start + batch)
        pad = self.config.cache_padding
        lo, hi = (lo // pad) * pad, min(round_up(hi, pad), self.n_cells)
        self._forward = _Forward(pos, sq, False, start, lo, hi, np.ones(batch, np.uint8))
        return undo

    def _finish_forward(self) -> None:
        """The data half of start_forward: pending key rotations, then the mask."""
        fwd = self._forward
        if fwd.reserve:
            mask = self.storage.new_mask(round_up(len(fwd.positions),
                                                  self.config.mask_batch_padding), self.n_cells)
            mask[...] = 0  # a sizing pass: all visible, so a model run on it stays finite
            fwd.mask = mask
            return
        self._apply_pending_shifts()
        self._build_mask()

    def _undo(self, undo: "_Undo") -> None:
        """Take back a ``_place``: its own failure part-way, or a sibling's in a WrapperCache."""
        if undo.before_defrag is not None:
            self.cells = undo.before_defrag
        elif undo.slots is not None:
            self.cells.unapply_batch(undo.slots, undo.head)
        if undo.pruned is not None and len(undo.pruned):
            self.cells.undo_prune(undo.pruned)
        self._forward = undo.forward
        self.defrag_count = undo.defrag_count

    def _check_batch(self, positions, seqs) -> Tuple[np.ndarray, np.ndarray]:
        pos = host_int_array(positions, "positions")
        sq = host_int_array(seqs, "seqs")
        if len(pos) != len(sq):
            raise ValueError(f"positions and seqs must have the same length, got {len(pos)} "
                             f"and {len(sq)}")
        if len(pos) == 0:
            raise ValueError("positions must hold at least one token")
        if len(pos) > self.config.max_batch:
            raise ValueError(f"batch of {len(pos)} tokens is larger than max_batch="
                             f"{self.config.max_batch}")
        if pos.min() < 0 or pos.max() >= UNLIMITED:
            raise ValueError(f"positions must be in [0, {UNLIMITED}), got min {pos.min()} "
                             f"max {pos.max()}")
        if sq.min() < 0 or sq.max() >= self.config.max_seqs:
            raise ValueError(f"seqs must be in [0, max_seqs={self.config.max_seqs}), got min "
                             f"{sq.min()} max {sq.max()}")
        return pos.astype(np.int32), sq.astype(np.int32)

    def _build_mask(self) -> None:
        fwd = self._forward
        rows = round_up(len(fwd.positions), self.config.mask_batch_padding)
        mask = self.storage.new_mask(rows, fwd.hi - fwd.lo)
        cell_pos, cell_seqs = self.cells.mask_inputs(fwd.lo, fwd.hi, copy=False)
        self.storage.fill_mask(mask, cell_pos, cell_seqs, fwd.positions, fwd.seqs, fwd.causal,
                               window=-1 if self._window == UNLIMITED else self._window,
                               chunk=self._chunk)
        fwd.mask = mask

    def set_layer(self, layer: int) -> None:
        """Choose the layer that ``put`` and ``get`` work on."""
        self._layer = _check_index("layer", layer, 0, self.config.n_layers)

    def set_causal(self, except_: Optional[Sequence[int]] = None) -> None:
        """Drop the future-position test for these batch indices (sequence, window and chunk
        tests still apply) until the next ``start_forward``; ``None`` restores it for all."""
        fwd = self._require_forward("set_causal")
        causal = np.ones(len(fwd.positions), np.uint8)
        if except_ is not None:
            idx = host_int_array(except_, "except_")
            if idx.size and (idx.min() < 0 or idx.max() >= len(causal)):
                raise ValueError(f"except_ must hold batch indices in [0, {len(causal)}), got "
                                 f"{idx.tolist()}")
            causal[idx] = 0
        if np.array_equal(causal, fwd.causal):
            return
        fwd.causal = causal
        if not fwd.reserve:
            self._build_mask()

    def put(self, key: Any, value: Any) -> None:
        """Store this batch's keys ``[batch, n_kv_heads, head_dim]`` and values
        ``[batch, n_kv_heads, v_head_dim]`` for the current layer (nothing is written during a
        reserve pass; the inputs are still checked)."""
        fwd = self._require_forward("put")
        cfg = self.config
        k = as_array(key, self.device, cfg.dtype, name="key")
        v = as_array(value, self.device, cfg.dtype, name="value")
        batch = len(fwd.positions)
        if tuple(k.shape) != (batch, cfg.n_kv_heads, cfg.head_dim):
            raise ValueError(f"key must have shape [batch={batch}, n_kv_heads={cfg.n_kv_heads}, "
                             f"head_dim={cfg.head_dim}], got {list(k.shape)}")
        if tuple(v.shape) != (batch, cfg.n_kv_heads, cfg.v_head_dim):
            raise ValueError(f"value must have shape [batch={batch}, n_kv_heads="
                             f"{cfg.n_kv_heads}, v_head_dim={cfg.v_head_dim}], got "
                             f"{list(v.shape)}")
        if fwd.reserve:
            return
        self.storage.put_range(self._layer, fwd.start, k, v)

    def get(self) -> Tuple[Any, Any, Any]:
        """``(key, value, mask)`` for the current layer: zero-copy views of the cells the batch
        may attend to, key ``[n, n_kv_heads, head_dim]``, value ``[n, n_kv_heads, v_head_dim]``
        (``[n_kv_heads, v_head_dim, n]`` when permuted), mask ``[batch_padded, n]`` holding 0
        where a token may attend and -inf elsewhere. bfloat16 views export through DLPack as
        bfloat16."""
        fwd = self._require_forward("get")
        dtype = self.config.dtype
        key = self.storage.key_view(self._layer, fwd.lo, fwd.hi)
        value = self.storage.value_view(self._layer, fwd.lo, fwd.hi)
        return export_view(key, dtype), export_view(value, dtype), fwd.mask

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
        that negative delta through ``shift``."""
        seq, begin, end = self._check_remove(seq, begin, end)
        self._atomically(lambda: self.cells.remove(seq, begin, end))

    def _check_remove(self, seq, begin, end) -> Tuple[int, int, Optional[int]]:
        """Every check ``remove`` makes before it changes anything (so a WrapperCache can ask
        all its caches first); returns the normalised arguments."""
        self._check_open()
        seq = self._check_seq(seq)
        begin = _check_index("begin", begin, 0)
        if end is not None:
            end = _check_index("end", end, begin)
            if end >= UNLIMITED:
                end = None
        if end is not None and self.shift is None:
            pos = self._seq_positions(seq)
            if ((pos < begin) | (pos >= end)).any():
                raise NotSupportedError(
                    f"removing positions [{begin}, {end}) of sequence {seq} moves later "
                    "positions and needs a shift function (CausalCache(shift=...))")
        if end is not None and self.cells.shared_cells_moving(seq, begin, end):
            raise NotSupportedError(SHARED_SHIFT_MESSAGE)
        return seq, begin, end

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        """Make ``dst_seq`` hold exactly the first ``length`` positions of ``src_seq`` (shared
        cells, no data copied)."""
        self._check_open()
        src = self._check_seq(src_seq, "src_seq")
        dst = self._check_seq(dst_seq, "dst_seq")
        length = _check_index("length", length, 0)
        self.cells.copy_prefix(src, dst, length)

    def can_resume(self, seq: int, pos: int) -> bool:
        """Whether ``seq`` can continue at ``pos`` with what is stored: always without a window
        memory limit; else only when ``pos``'s window lies inside what ``seq`` still holds."""
        self._check_open()
        seq = self._check_seq(seq)
        pos = _check_index("pos", pos, 0)
        if self._memory == UNLIMITED:
            return True
        first, last = self.cells.seq_pos_min(seq), self.cells.seq_pos_max(seq)
        if last < 0:
            return False
        return max(0, pos - self._window) >= first and pos <= last + 1

    def defrag(self) -> None:
        """Move every used cell to the front, keeping each (sequence, position) with its own K/V.
        Ends the forward pass in progress (its cells may have moved)."""
        self._check_open()
        self._defrag_plan_and_move()
        self._forward = None

    def _defrag_plan_and_move(self) -> np.ndarray:
        moves = self.cells.plan_defrag()
        if len(moves):
            self.storage.move_blocks(moves)
        self.defrag_count += 1
        return moves

    # ------------------------------------------------------------------ sequences (llama.cpp)
    def seq_rm(self, seq: int, p0: int = 0, p1: Optional[int] = None) -> bool:
        """Remove positions ``[p0, p1)`` of ``seq`` (``-1``: every sequence; ``p1=None``: to the
        end). Positions do not move. Returns True."""
        self._check_open()
        seq = self._check_seq(seq, allow_all=True)
        p0, p1 = self._check_span(p0, p1)
        return bool(self.cells.seq_rm(seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: Optional[int] = None) -> None:
        """Let ``dst`` share ``src``'s cells with positions in ``[p0, p1)``."""
        self._check_open()
        src = self._check_seq(src, "src")
        dst = self._check_seq(dst, "dst")
        p0, p1 = self._check_span(p0, p1)
        self.cells.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq: int) -> None:
        """Drop every sequence but ``seq``."""
        self._check_open()
        self.cells.seq_keep(self._check_seq(seq))

    def seq_add(self, seq: int, p0: int, p1: Optional[int], delta: int) -> None:
        """Add ``delta`` to the positions in ``[p0, p1)`` of ``seq``; keys are re-rotated at the
        next ``start_forward`` (or ``apply_pending_shifts``); positions that become negative
        are dropped."""
        self._check_open()
        seq = self._check_seq(seq)
        p0, p1 = self._check_span(p0, p1)
        delta = _check_index("delta", delta, -UNLIMITED)
        if delta == 0:
            return
        self._require_shift_for(seq, p0, p1, "seq_add")
        self._atomically(lambda: self.cells.seq_add(seq, p0, p1, delta), apply_shifts=False)

    def seq_div(self, seq: int, p0: int, p1: Optional[int], d: int) -> None:
        """Divide the positions in ``[p0, p1)`` of ``seq`` by ``d`` (integer division); keys are
        re-rotated at the next ``start_forward``."""
        self._check_open()
        seq = self._check_seq(seq)
        p0, p1 = self._check_span(p0, p1)
        d = _check_index("d", d, 1)
        if d == 1:
            return
        self._require_shift_for(seq, p0, p1, "seq_div")
        self._atomically(lambda: self.cells.seq_div(seq, p0, p1, d), apply_shifts=False)

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
        self._apply_pending_shifts()

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

    def _seq_positions(self, seq: int) -> np.ndarray:
        cells = self.cells.seq_cells(seq)
        return self.cells.cells["pos"][cells]

    def _require_shift_for(self, seq: int, p0: int, p1: Optional[int], what: str) -> None:
        if self.shift is not None:
            return
        pos = self._seq_positions(seq)
        hit = (pos >= p0) & (pos < (UNLIMITED if p1 is None else p1))
        if hit.any():
            raise NotSupportedError(f"{what} moves positions of sequence {seq} and needs a shift "
                                    "function (CausalCache(shift=...))")

    def _atomically(self, edit: Callable[[], Any], apply_shifts: bool = True) -> Any:
        """Run a metadata edit (and, if asked, the key rotation it calls for) all or nothing."""
        snapshot = self.cells.copy()
        try:
            result = edit()
            if apply_shifts:
                self._apply_pending_shifts()
        except BaseException:
            self.cells = snapshot
            raise
        return result

    # ------------------------------------------------------------------ key rotation
    def _apply_pending_shifts(self) -> None:
        if not self.cells.has_pending_shifts():
            return
        if self.shift is None:
            raise NotSupportedError("positions moved but the cache has no shift function")
        cells = self.cells.copy()
        moved, deltas = cells.take_shifts()
        if isinstance(self.shift, RopeShift):
            self.storage.rotate(moved, deltas, self.shift)
        else:
            self._shift_with_callable(moved, deltas)
        self.cells = cells

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
        for layer in range(cfg.n_layers):
            for lo, hi, window_deltas in windows:
                view = self.storage.key_view(layer, lo, hi)
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
    def save_state(self, path: PathLike, seq: Optional[int] = None, *,
                   tokens: Optional[ArrayLike] = None, metadata: Optional[dict] = None,
                   progress: Optional[bool] = None) -> None:
        """Save the whole cache (``seq=None``) or one sequence to a safetensors file,
        atomically."""
        from . import state
        state.save_cache(self, path, seq, tokens=tokens, metadata=metadata, progress=progress)

    def load_state(self, path: PathLike, seq: Optional[int] = None, *,
                   progress: Optional[bool] = None) -> dict:
        """Restore what ``save_state`` wrote: the whole cache, or a saved sequence as ``seq``
        (replacing what ``seq`` held). Returns the saved tokens and metadata."""
        from . import state
        return state.load_cache(self, path, seq, progress=progress)

    def state_bytes(self, seq: Optional[int] = None, *, tokens: Optional[ArrayLike] = None,
                    metadata: Optional[dict] = None,
                    progress: Optional[bool] = None) -> bytes:
        """What ``save_state`` writes, as bytes."""
        from . import state
        return state.cache_to_bytes(self, seq, tokens=tokens, metadata=metadata,
                                    progress=progress)

    def load_state_bytes(self, data: bytes, seq: Optional[int] = None, *,
                         progress: Optional[bool] = None) -> dict:
        """Load ``state_bytes`` output: the whole cache, or the saved sequence as ``seq``."""
        from . import state
        return state.cache_from_bytes(self, data, seq, progress=progress)

    # ------------------------------------------------------------------ misc
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

    def __repr__(self) -> str:
        cfg = self.config
        extra = "".join(f", {k}={v}" for k, v in (("swa_window", self.swa_window),
                                                  ("swa_memory", self.swa_memory),
                                                  ("chunk_size", self.chunk_size)) if v)
        return (f"CausalCache(n_cells={self.n_cells}, used={self.cells.n_used}, layers="
                f"{cfg.n_layers}, kv_heads={cfg.n_kv_heads}, head_dim={cfg.head_dim}, dtype="
                f"{cfg.dtype}, device={self.device}{extra})")


def _check_memory(config: CacheConfig, n_cells: int, device: str) -> None:
    """Refuse, before allocating, a cache larger than the memory the device has free."""
    need = config.nbytes(n_cells)
    have = None
    if device == "cuda":
        try:
            import cupy
            have = cupy.cuda.runtime.memGetInfo()[0]
        except Exception:  # noqa: BLE001
            have = None
    else:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        have = int(line.split()[1]) * 1024
                        break
        except OSError:
            have = None
    if have is not None and need > have:
        raise ValueError(f"the cache needs {need / 2**30:.2f} GiB of K/V storage "
                         f"({n_cells} cells) but {device} has {have / 2**30:.2f} GiB free: "
                         "lower capacity, max_seqs or n_layers (CacheConfig.nbytes() sizes it)")


__all__ = ["CausalCache", "UNLIMITED"]
