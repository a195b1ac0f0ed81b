"""``RecurrentCache``: per-sequence state of the recurrent layers of a model (Mamba/Mamba-2 SSM
and conv state, gated delta net, short convolutions, ...), with llama.cpp's sequence
operations under its recurrent rules (``llama-memory-recurrent``) and restore points at any
token (Ollama's ``x/mlxrunner/cache/recurrent.go`` snapshots; llama.cpp's ``n_rs_seq``).

Storage: one array per state tensor (:class:`StateSpec`), ``[n_layers, rows, *shape]`` in its
own dtype (a float32 delta state beside a bfloat16 conv tail), numpy on ``cpu``/``sim`` and
CuPy on ``cuda``. Rows ``0 .. max_seqs-1`` are the sequences' live states (row ``s`` is
sequence ``s``: so a batch of consecutive sequences reads and writes its states through
zero-copy views, :meth:`RecurrentCache.state_views`); the rows after them hold restore points,
``max_restore_points`` per sequence. Rows move by one kernel launch per state tensor
(:mod:`numbakv.kernels.rows`: a ``@cuda.jit`` kernel and its CPU twin).

Positions: a state summarises the positions ``seq_pos_min(seq) .. seq_pos_max(seq)`` of its
sequence, consumed in order (a batch's tokens of one sequence must continue at
``seq_pos_max + 1``). A *restore point at p* is the state after the tokens before ``p``: where
a model resumes to process position ``p``; the live state is the restore point at
``seq_pos_max + 1``.

Restore points, the lazy way (Ollama's snapshots): the model asks :meth:`~RecurrentCache.
restore_plan` where to cut its scan, hands the state back at each cut with
:meth:`~RecurrentCache.keep_restore_point`, which copies it into a restore-point row, except at
the batch end: the point there *is* the live state and costs nothing until the next forward
pass would overwrite it (then it is copied first, if it is worth keeping: on the spacing grid
or explicit; else it is dropped). :meth:`~RecurrentCache.rollback` (speculative decoding) and
``seq_rm`` of a suffix go back to any kept point.

Sequence operations (llama.cpp's recurrent rules, all-or-nothing):

- ``seq_rm(seq, p0, p1)``: removing the whole sequence, or nothing of it, always works; a
  suffix ``[p0, end)`` works when a restore point at ``p0`` is kept; anything else (a prefix,
  the middle) returns False and changes nothing (a state cannot forget part of what it read).
- ``seq_cp(src, dst, p0, p1)``: ``dst``'s state becomes ``src``'s (copied; the restore points
  are shared, never copied, they are immutable); a range ending inside ``src`` copies the state
  at the restore point at ``p1`` (``ValueError`` when none is kept there). ``dst``'s previous
  state is replaced (llama.cpp).
- ``seq_keep``, ``seq_add`` / ``seq_div`` (position labels only: no data moves),
  ``seq_pos_min`` / ``seq_pos_max``.

Deliberate differences from llama.cpp: ``seq_pos_min`` is the first position the state
summarises (llama.cpp reports its last one, since it can restore nothing else); ``seq_rm``
of a suffix succeeds back to any kept restore point (llama.cpp only inside its experimental
``n_rs_seq`` window).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._guard import one_thread_at_a_time
from ._inputs import UNLIMITED, host_int_array
from ._inputs import check_index as _check_index
from ._memory import check_memory
from .config import MAX_SEQS_LIMIT, STORAGE_DTYPES, normalize_dtype
from .device import (array_module, as_array, count_host_wait, export_view, host_wait,
                     resolve_device, synchronize)
from .errors import KVCacheError, NotSupportedError, StateError
from .kernels import rows as _rows
from .state import codec as _st
from .state import files as _files
from .state.methods import StateMethods
from .state.snapshot import EXPLICIT, KEPT, RecurrentPart, recurrent_expect, recurrent_part_of



# ============================================================================== configuration
@dataclass(frozen=True)
class StateSpec:
    """One state tensor of every recurrent layer: ``name`` (an identifier: it names the tensor
    in ``state_views`` and in state files), ``shape`` per sequence (e.g. a conv tail
    ``(conv_tail, conv_dim)``, a delta-net state ``(heads, d_v, d_k)``) and storage ``dtype``
    (``float32``, ``float16`` or ``bfloat16``)."""

    name: str
    shape: Tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"name must be an identifier (it names tensors in state files), "
                             f"got {self.name!r}")
        shape = self.shape
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)) or not shape or not all(
                isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_))
                and 0 < int(d) < 2**31 for d in shape):
            raise ValueError(f"shape must be a non-empty tuple of positive integers, got "
                             f"{self.shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype, "dtype"))

    @property
    def row_bytes(self) -> int:
        """Bytes of one sequence's state in one layer."""
        return math.prod(self.shape) * STORAGE_DTYPES[self.dtype].itemsize


class RecurrentConfig:
    """Shapes and limits of a :class:`RecurrentCache`, validated on construction.

    Args:
        n_layers: recurrent layers held (layer indices ``0 .. n_layers-1``; a ``HybridCache``
            maps the model's layer numbers onto them).
        states: the :class:`StateSpec` of each state tensor, the same for every layer (names
            unique).
        max_seqs: sequences, ids ``[0, max_seqs)`` (at most 256, as the K/V caches).
        restore_every: spacing of the restore points :meth:`RecurrentCache.restore_plan` asks
            for, in absolute positions (a point at every multiple); 0 for none but the explicit
            ones and the batch end.
        max_restore_points: restore points kept per sequence (>= 1); beyond it the oldest
            point that is neither explicit nor the newest goes first, then the oldest explicit
            one. The pool holds ``max_seqs * (1 + max_restore_points)`` states per layer.
        device: ``auto``, ``cpu``, ``sim`` or ``cuda``.
    """

    def __init__(self, n_layers: int, states: Sequence[StateSpec], max_seqs: int = 1,
                 restore_every: int = 256, max_restore_points: int = 4,
                 device: str = "auto") -> None:
        self.n_layers = _check_index("n_layers", n_layers, 1, 1 << 16)
        if isinstance(states, StateSpec) or not isinstance(states, (list, tuple)) or not states:
            raise ValueError("states must be a non-empty list of numbakv.StateSpec")
        for i, s in enumerate(states):
            if not isinstance(s, StateSpec):
                raise ValueError(f"states[{i}] must be a numbakv.StateSpec, got "
                                 f"{type(s).__name__}")
        names = [s.name for s in states]
        if len(set(names)) != len(names):
            raise ValueError(f"states must have unique names, got {names}")
        self.states: Tuple[StateSpec, ...] = tuple(states)
        self.max_seqs = _check_index("max_seqs", max_seqs, 1, MAX_SEQS_LIMIT + 1)
        self.restore_every = _check_index("restore_every", restore_every, 0, UNLIMITED)
        self.max_restore_points = _check_index("max_restore_points", max_restore_points, 1,
                                               1 << 16)
        if not isinstance(device, str) or device not in ("auto", "cpu", "cuda", "sim"):
            raise ValueError(f"device must be one of 'auto', 'cpu', 'cuda', 'sim', got "
                             f"{device!r}")
        self.device = device

    def layout(self) -> Dict[str, Any]:
        """What a saved state must match to load (``RecurrentPart.layout()``)."""
        return {"n_layers": self.n_layers,
                "states": [[s.name, list(s.shape), s.dtype] for s in self.states]}

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's state, every layer and tensor (one restore point)."""
        return self.n_layers * sum(s.row_bytes for s in self.states)

    def __repr__(self) -> str:
        return (f"RecurrentConfig(n_layers={self.n_layers}, states={list(self.states)}, "
                f"max_seqs={self.max_seqs}, restore_every={self.restore_every}, "
                f"max_restore_points={self.max_restore_points}, device={self.device!r})")


@dataclass
class _Point:
    row: int            # a restore-point row (>= max_seqs), or a live row while lazy
    explicit: bool
    missing: frozenset  # layers not written yet (a point kept layer by layer)


def _layout_diff(saved: Any, current: Dict[str, Any]) -> Optional[str]:
    """A sentence naming the first layout field that differs, or None."""
    if not isinstance(saved, dict):
        return "the layout is missing"
    if saved.get("n_layers") != current["n_layers"]:
        return f"n_layers: the state has {saved.get('n_layers')!r}, the cache {current['n_layers']}"
    a, b = saved.get("states"), current["states"]
    if not isinstance(a, list) or len(a) != len(b):
        return (f"states: the state has {len(a) if isinstance(a, list) else a!r} tensors, the "
                f"cache {len(b)} ({[s[0] for s in b]})")
    for i, (x, y) in enumerate(zip(a, b)):
        if not isinstance(x, list) or len(x) != 3:
            return f"states[{i}] is malformed"
        for field, u, v in zip(("name", "shape", "dtype"), x, y):
            if u != v:
                return f"states[{i}].{field}: the state has {u!r}, the cache {v!r}"
    return None


# ============================================================================== the cache
@one_thread_at_a_time
class RecurrentCache(StateMethods):
    """Recurrent state of ``config.max_seqs`` sequences (see the module docstring)."""

    _STATE_IO = "recurrent"

    def __init__(self, config: RecurrentConfig) -> None:
        if not isinstance(config, RecurrentConfig):
            raise ValueError(f"config must be a numbakv.RecurrentConfig, got "
                             f"{type(config).__name__}")
        self.config = config
        self.device = resolve_device(config.device)
        S, R = config.max_seqs, config.max_restore_points
        self.n_rows = S * (1 + R)
        need = {f"state {s.name}": config.n_layers * self.n_rows * s.row_bytes
                for s in config.states}
        check_memory("RecurrentCache", self.device, need,
                     hint="lower max_seqs or max_restore_points")
        xp = array_module(self.device)
        #: name -> [n_layers, n_rows, *shape] in the storage dtype
        self.pool: Dict[str, Any] = {
            s.name: xp.zeros((config.n_layers, self.n_rows) + s.shape, STORAGE_DTYPES[s.dtype])
            for s in config.states}
        self._specs = {s.name: s for s in config.states}
        self._lo = [-1] * S           # first position each state summarises, -1 when empty
        self._hi = [-1] * S           # last position
        self._points: List[Dict[int, _Point]] = [{} for _ in range(S)]
        self._marks: List[set] = [set() for _ in range(S)]
        self._refs = np.zeros(self.n_rows, dtype=np.int64)   # points on each restore row
        self._free = list(range(self.n_rows - 1, S - 1, -1))  # free restore rows (a stack)
        self._forward: Optional[Dict[int, Tuple[int, int]]] = None   # seq -> (start, count)
        self._closed = False
        self._stream = None           # CuPy stream of every launch (None: CuPy's current one)
        self._device_id = None
        if self.device == "cuda":
            import cupy
            self._device_id = cupy.cuda.runtime.getDevice()

    # ------------------------------------------------------------------ checks
    def _check_open(self) -> None:
        if self._closed:
            raise KVCacheError("the cache is closed")

    def _check_seq(self, seq, name: str = "seq", allow_all: bool = False) -> int:
        return _check_index(name, seq, -1 if allow_all else 0, self.config.max_seqs)

    @staticmethod
    def _check_span(p0, p1) -> Tuple[int, int]:
        """``(p0, p1)`` with llama.cpp's conventions: negative p0 is 0, negative or None p1 is
        "to the end" (returned as UNLIMITED)."""
        p0 = max(_check_index("p0", p0, -UNLIMITED), 0)
        if p1 is None:
            return p0, UNLIMITED
        p1 = _check_index("p1", p1, -UNLIMITED)
        return p0, (UNLIMITED if p1 < 0 or p1 >= UNLIMITED else p1)

    def _check_layer(self, layer) -> int:
        return _check_index("layer", layer, 0, self.config.n_layers)

    def _check_seqs(self, seqs) -> np.ndarray:
        s = host_int_array(seqs, "seqs")
        if s.size == 0:
            raise ValueError("seqs must name at least one sequence")
        if s.min() < 0 or s.max() >= self.config.max_seqs:
            raise ValueError(f"seqs must be in [0, max_seqs={self.config.max_seqs}), got "
                             f"{s.tolist()[:8]}")
        if len(np.unique(s)) != len(s):
            raise ValueError(f"seqs must not repeat a sequence, got {s.tolist()[:8]}")
        return s

    # ------------------------------------------------------------------ row moves
    def _on_device(self):
        """The cache's GPU and stream around device work (nothing on cpu/sim)."""
        if self.device != "cuda":
            return contextlib.nullcontext()
        from .storage import _CudaScope
        return _CudaScope(self._device_id, self._stream)

    def use_stream(self, stream: Any) -> None:
        """Queue this cache's GPU work (state-row kernels, zeroing, copies) on ``stream``: a
        CuPy stream, a torch stream or a raw ``cudaStream_t`` int; None: CuPy's current stream
        at each call. Views handed out (:meth:`state_views`) are ready in that stream's order.
        On cpu/sim only None is accepted."""
        self._check_open()
        if self.device != "cuda":
            if stream is None:
                return
            raise ValueError(f"stream applies to a cuda cache; this one stores on {self.device}")
        from .storage import _as_cupy_stream
        self._stream = _as_cupy_stream(stream, self._device_id)

    def _copy(self, dst_rows: Sequence[int], src_rows: Sequence[int]) -> None:
        """Rows ``src_rows[i]`` -> ``dst_rows[i]`` of every state tensor, every layer."""
        if not len(dst_rows):
            return
        d = np.asarray(dst_rows, dtype=np.int32)
        s = np.asarray(src_rows, dtype=np.int32)
        with self._on_device():
            for spec in self.config.states:
                arr = self.pool[spec.name]
                _rows.launch(self.device, arr, d, arr, s, spec.row_bytes)

    def _alloc(self) -> int:
        row = self._free.pop()
        self._refs[row] = 1
        return row

    def _release(self, point: _Point) -> None:
        r = point.row
        if r >= self.config.max_seqs:
            self._refs[r] -= 1
            if self._refs[r] == 0:
                self._free.append(r)

    def _detach(self, seqs: Sequence[int]) -> None:
        """Before live rows ``seqs`` are written: every restore point still reading one of them
        (a lazy point) gets its own row, one copy per live row. A lazy point only ever reads
        its own sequence's row (``seq_cp`` and imports give the copy its own), so only the
        sequences' own points are looked at."""
        users: Dict[int, List[_Point]] = {}
        for s in seqs:
            s = int(s)
            for p in self._points[s].values():
                if p.row == s:
                    users.setdefault(s, []).append(p)
        if not users:
            return
        src, dst = [], []
        for row, pts in users.items():
            new = self._alloc()
            self._refs[new] = len(pts)
            for p in pts:
                p.row = new
            src.append(row)
            dst.append(new)
        self._copy(dst, src)

    def _zero(self, seqs: Sequence[int]) -> None:
        if not len(seqs):
            return
        with self._on_device():
            for arr in self.pool.values():
                for s in seqs:
                    arr[:, int(s)] = 0

    def _clear(self, seq: int) -> None:
        """Forget sequence ``seq`` (its row keeps its bytes until next written: lazy points of
        other sequences may still read them)."""
        for p in self._points[seq].values():
            self._release(p)
        self._points[seq] = {}
        self._marks[seq] = set()
        self._lo[seq] = self._hi[seq] = -1

    def _drop_point(self, seq: int, pos: int) -> None:
        self._release(self._points[seq].pop(pos))

    def _on_grid(self, pos: int) -> bool:
        every = self.config.restore_every
        return every > 0 and pos % every == 0

    def _make_room(self, seq: int, adding: int) -> None:
        """Drop restore points of ``seq`` until one more fits: the oldest that is neither
        explicit nor the newest first, then the oldest explicit one (the newest point is the
        last to go)."""
        pts = self._points[seq]
        while len(pts) - (adding in pts) >= self.config.max_restore_points:
            others = [q for q in pts if q != adding]   # a point replaced in place takes no room
            newest = max(others)
            order = sorted(others, key=lambda q: (pts[q].explicit, q == newest, q))
            self._drop_point(seq, order[0])

    # ------------------------------------------------------------------ forward pass
    def capture_step(self, batch: int, **kwargs: Any) -> None:
        """Not captured: ``NotSupportedError``, nothing changed. A recurrent cache stores no
        K/V, so a decode step has no put for the cache to capture: sequence ``s``'s live state
        is row ``s`` of every state tensor (:meth:`state_views`), fixed addresses a model's
        captured graph reads and writes itself; call :meth:`start_forward` before each replay
        of that graph (its bookkeeping and any restore-point copy, queued on the cache's
        stream). A hybrid model captures through ``HybridCache.capture_step``."""
        self._check_open()
        raise NotSupportedError(
            "RecurrentCache.capture_step: a recurrent cache stores no K/V, so a decode step has "
            "no put to capture; sequence s's live state is row s of every state tensor "
            "(state_views), fixed addresses your captured graph reads and writes itself: call "
            "start_forward before each replay of it (a hybrid model: HybridCache.capture_step)")

    def start_forward(self, positions: Any, seqs: Any) -> None:
        """Begin a forward pass over a batch (``positions``, ``seqs``: ``[batch]`` integers).
        Each sequence's tokens, in batch order, must continue its positions (``seq_pos_max +
        1``, +2, ...; any start for an empty sequence, whose state is zeroed). The live states
        of the batch's sequences may then be written (:meth:`state_views`,
        :meth:`write_states`); a lazy restore point on one of them is copied first (or dropped,
        when it is neither on the spacing grid nor explicit). Raises ``ValueError`` (nothing
        changed) on a bad batch."""
        self._check_open()
        plan = self._plan_forward(positions, seqs)
        self._apply_forward(plan)

    def _plan_forward(self, positions, seqs) -> Dict[int, Tuple[int, int]]:
        pos = host_int_array(positions, "positions")
        sq = host_int_array(seqs, "seqs")
        if len(pos) != len(sq):
            raise ValueError(f"positions and seqs must have the same length, got {len(pos)} "
                             f"and {len(sq)}")
        if len(pos) == 0:
            raise ValueError("positions must hold at least one token")
        if pos.min() < 0 or pos.max() >= UNLIMITED - 1:
            raise ValueError(f"positions must be in [0, {UNLIMITED - 1}), got min {pos.min()} "
                             f"max {pos.max()}")
        if sq.min() < 0 or sq.max() >= self.config.max_seqs:
            raise ValueError(f"seqs must be in [0, max_seqs={self.config.max_seqs}), got min "
                             f"{sq.min()} max {sq.max()}")
        # grouped by sequence, batch order kept inside each group (vectorised: a decode step of
        # many sequences is one pass, not a Python loop per sequence)
        order = np.argsort(sq, kind="stable")
        ss, ps = sq[order], pos[order]
        first = np.ones(len(ss), dtype=bool)
        first[1:] = ss[1:] != ss[:-1]
        heads = np.flatnonzero(first)
        counts = np.diff(np.append(heads, len(ss)))
        u, starts = ss[heads], ps[heads]
        bad = np.flatnonzero(~first & (np.diff(ps, prepend=0) != 1))
        if len(bad):
            s = int(ss[bad[0]])
            got = ps[ss == s]
            raise ValueError(f"sequence {s}: its positions in the batch must be consecutive and "
                             f"in order ({int(got[0])}, {int(got[0]) + 1}, ...), got "
                             f"{got.tolist()[:8]}")
        hi = np.asarray(self._hi, dtype=np.int64)[u]
        wrong = np.flatnonzero((hi >= 0) & (starts != hi + 1))
        if len(wrong):
            i = wrong[0]
            raise ValueError(f"sequence {int(u[i])}: a recurrent state continues at position "
                             f"{int(hi[i]) + 1} (seq_pos_max + 1), the batch starts it at "
                             f"{int(starts[i])}")
        return {int(s): (int(a), int(n)) for s, a, n in zip(u.tolist(), starts.tolist(),
                                                           counts.tolist())}

    def _apply_forward(self, plan: Dict[int, Tuple[int, int]]) -> None:
        points, marks, lo, hi = self._points, self._marks, self._lo, self._hi
        busy = [s for s in plan if points[s]]
        for s in busy:  # the batch end of the last pass: worth a copy only on the grid or asked for
            for q, p in list(points[s].items()):
                if p.row == s and not p.explicit and not self._on_grid(q):
                    self._drop_point(s, q)
        self._detach(busy)
        self._zero([s for s in plan if hi[s] < 0])
        for s, (start, n) in plan.items():
            if hi[s] < 0:
                lo[s] = start
            hi[s] = start + n - 1
            if marks[s]:
                marks[s] = {m for m in marks[s] if m > start}
        self._forward = plan

    def restore_plan(self, seq: int, n_new: int) -> List[int]:
        """Offsets ``k`` (``1 <= k <= n_new``, ascending) inside the next ``n_new`` tokens of
        ``seq`` after which the model must hand back its state (:meth:`keep_restore_point` at
        position ``start + k``): every position on the ``restore_every`` grid (counted in
        absolute positions), every position :meth:`mark_restore` asked for, and the batch end
        (``n_new``). ``start`` is the first position of ``seq`` in the forward pass in progress
        when it has one, else ``seq_pos_max + 1`` (0 for an empty sequence). Ollama's
        ``SnapshotSplits``: the model runs its scan in segments cut there."""
        self._check_open()
        seq = self._check_seq(seq)
        n_new = _check_index("n_new", n_new, 1, UNLIMITED)
        if self._forward is not None and seq in self._forward:
            start = self._forward[seq][0]
        else:
            start = self._hi[seq] + 1
        every = self.config.restore_every
        out = set()
        if every > 0:
            first = -(-(start + 1) // every) * every   # the first multiple > start
            out.update(range(first - start, n_new + 1, every))
        out.update(m - start for m in self._marks[seq] if start < m <= start + n_new)
        out.add(n_new)
        return sorted(k for k in out if 1 <= k <= n_new)

    def mark_restore(self, seq: int, pos: int) -> None:
        """Ask for an explicit restore point of ``seq`` at position ``pos`` (a user-message or
        tool-result boundary): :meth:`restore_plan` cuts there and the point is kept in
        preference to the spacing ones. ``pos`` at the sequence's end marks its live state
        (kept without a copy until overwritten); a past position must already hold a point."""
        self._check_open()
        seq = self._check_seq(seq)
        pos = _check_index("pos", pos, 1, UNLIMITED)
        end = self._hi[seq] + 1
        if self._hi[seq] >= 0 and pos <= end:
            if pos in self._points[seq]:
                self._points[seq][pos].explicit = True
                return
            if pos == end:
                self._make_room(seq, pos)
                self._points[seq][pos] = _Point(seq, True, frozenset())
                return
            raise ValueError(f"pos {pos}: sequence {seq} is already past it (its state is at "
                             f"{end}) and keeps no restore point there (held: "
                             f"{self.restore_points(seq)})")
        self._marks[seq].add(pos)

    def keep_restore_point(self, seq: int, pos: int,
                           states: Optional[Mapping[str, Any]] = None, *,
                           layer: Optional[int] = None, explicit: bool = False) -> None:
        """Keep the state of ``seq`` after its tokens before ``pos`` as a restore point.

        ``states=None``: the live state is that state (``pos == seq_pos_max + 1``): kept
        lazily, no copy until the live state would be overwritten; then (the next forward pass
        of ``seq``) it is copied when it lies on the ``restore_every`` grid or is explicit, and
        dropped otherwise (a decode step's end is not worth a state copy per token: pass
        ``explicit=True`` to keep one). Otherwise ``states`` maps
        every state tensor's name to its value: ``[n_layers, *shape]`` (``layer=None``) or
        ``[*shape]`` for one ``layer`` (a model that cuts its scan layer by layer hands each
        layer's state as it goes; the point counts once every layer is in). Arrays are numpy,
        CuPy or any DLPack tensor on the cache's device in the tensor's dtype; they are copied.
        ``explicit`` (or a :meth:`mark_restore` at ``pos``) keeps the point in preference to
        the spacing ones. Beyond ``max_restore_points`` the oldest non-explicit point goes."""
        self._check_open()
        seq = self._check_seq(seq)
        pos = _check_index("pos", pos, 1, UNLIMITED)
        lo, hi = self._lo[seq], self._hi[seq]
        if hi < 0:
            raise ValueError(f"seq {seq} is empty: it has no state to keep")
        if not lo < pos <= hi + 1:
            raise ValueError(f"pos must be in ({lo}, {hi + 1}] (after a token sequence {seq} "
                             f"has read), got {pos}")
        if not isinstance(explicit, (bool, np.bool_)):
            raise ValueError(f"explicit must be a bool, got {explicit!r}")
        explicit = bool(explicit) or pos in self._marks[seq]
        if layer is not None:
            layer = self._check_layer(layer)
        pts = self._points[seq]
        if states is None:
            if pos != hi + 1:
                raise ValueError(f"states=None keeps the live state, which is at position "
                                 f"{hi + 1} of sequence {seq}, not {pos}: pass the states")
            if layer is not None:
                raise ValueError("layer needs states")
            old = pts.get(pos)
            if old is not None and old.row == seq:
                old.explicit = old.explicit or explicit
                return
            self._make_room(seq, pos)
            if pos in pts:
                self._drop_point(seq, pos)
            pts[pos] = _Point(seq, explicit, frozenset())
            return
        arrays = self._check_states(states, layer, "states")
        old = pts.get(pos)
        if old is not None and layer is not None and old.missing and layer in old.missing \
                and old.row >= self.config.max_seqs and self._refs[old.row] == 1:
            point = old          # filling in a point kept layer by layer
        else:
            self._make_room(seq, pos)
            if pos in pts:
                self._drop_point(seq, pos)
            missing = frozenset() if layer is None else \
                frozenset(range(self.config.n_layers)) - {layer}
            point = pts[pos] = _Point(self._alloc(), explicit, missing)
        self._scatter_point(point.row, layer, arrays)
        if layer is not None:
            point.missing = point.missing - {layer}
        point.explicit = point.explicit or explicit

    def _check_states(self, states, layer: Optional[int], what: str) -> Dict[str, Any]:
        """``states`` as storage-dtype arrays on the cache's device, one per tensor, shaped
        ``[*shape]`` (``layer`` given) or ``[n_layers, *shape]``."""
        if not isinstance(states, Mapping):
            raise ValueError(f"{what} must map state tensor names to arrays, got "
                             f"{type(states).__name__}")
        names = set(self._specs)
        if set(states) != names:
            raise ValueError(f"{what} must hold exactly the state tensors {sorted(names)}, got "
                             f"{sorted(map(str, states))}")
        out = {}
        for name, spec in self._specs.items():
            arr = as_array(states[name], self.device, spec.dtype, name=f"{what}[{name!r}]")
            want = spec.shape if layer is not None else (self.config.n_layers,) + spec.shape
            if tuple(arr.shape) != want:
                raise ValueError(f"{what}[{name!r}] must have shape {list(want)}, got "
                                 f"{list(arr.shape)}")
            out[name] = arr
        return out

    def _scatter_point(self, row: int, layer: Optional[int], arrays: Dict[str, Any]) -> None:
        with self._on_device():
            self._scatter_point_here(row, layer, arrays)

    def _scatter_point_here(self, row: int, layer: Optional[int],
                            arrays: Dict[str, Any]) -> None:
        xp = array_module(self.device)
        for name, spec in self._specs.items():
            a = xp.ascontiguousarray(arrays[name])
            pool = self.pool[name]
            if layer is None:
                src = a.reshape((a.shape[0], 1) + spec.shape)
                dst = pool
            else:
                src = a.reshape((1, 1) + spec.shape)
                dst = pool[layer:layer + 1]
            _rows.launch(self.device, dst, [row], src, [0], spec.row_bytes)

    def restore_points(self, seq: int) -> List[int]:
        """Positions of the restore points ``seq`` keeps, ascending (complete ones: a point
        kept layer by layer counts once every layer is in)."""
        self._check_open()
        seq = self._check_seq(seq)
        return sorted(q for q, p in self._points[seq].items() if not p.missing)

    def _point(self, seq: int, pos: int) -> _Point:
        p = self._points[seq].get(pos)
        if p is None or p.missing:
            why = "" if p is None else f" (layers {sorted(p.missing)} were never handed over)"
            raise ValueError(f"restore point {pos} of sequence {seq} is not held{why}; held: "
                             f"{self.restore_points(seq)}")
        return p

    def restore_point(self, seq: int, pos: int) -> Dict[str, Any]:
        """A copy of the restore point of ``seq`` at ``pos``: ``{name: [n_layers, *shape]}``.
        ``ValueError`` naming it when it is not held."""
        self._check_open()
        seq = self._check_seq(seq)
        pos = _check_index("pos", pos, 0, UNLIMITED)
        row = self._point(seq, pos).row
        return {n: self._gather(n, None, [row])[:, 0] for n in self._specs}

    def drop_restore_point(self, seq: int, pos: int) -> None:
        """Forget the restore point of ``seq`` at ``pos`` (``ValueError`` when not held)."""
        self._check_open()
        seq = self._check_seq(seq)
        pos = _check_index("pos", pos, 0, UNLIMITED)
        if pos not in self._points[seq]:
            self._point(seq, pos)   # raises, naming it
        self._drop_point(seq, pos)
        self._marks[seq].discard(pos)

    def rollback(self, seq: int, pos: int) -> bool:
        """Put ``seq`` back to its state at ``pos`` (a kept restore point, the live end, or
        the sequence's start, which empties it): positions from ``pos`` on are forgotten, and
        so are the restore points after ``pos``. Returns False, changing nothing, when no
        restore point of ``seq`` is kept at ``pos`` (speculative decoding: keep a point per
        draft token with :meth:`keep_restore_point`, roll back to the last accepted one)."""
        self._check_open()
        seq = self._check_seq(seq)
        pos = _check_index("pos", pos, 0, UNLIMITED)
        apply = self._plan_rollback(seq, pos)
        if apply is None:
            return False
        apply()
        return True

    def _plan_rollback(self, seq: int, pos: int):
        """A callable that rolls ``seq`` back to ``pos``, or None when it cannot."""
        lo, hi = self._lo[seq], self._hi[seq]
        if hi < 0 or pos > hi + 1:
            return None
        if pos == hi + 1:
            return lambda: None
        if pos <= lo:
            return lambda: self._clear(seq)
        p = self._points[seq].get(pos)
        if p is None or p.missing:
            return None

        def apply():
            self._forward = None
            for q in [q for q in self._points[seq] if q > pos]:
                self._drop_point(seq, q)
            self._detach([seq])
            self._copy([seq], [self._points[seq][pos].row])
            self._hi[seq] = pos - 1
            self._marks[seq] = {m for m in self._marks[seq] if m > pos}
        return apply

    # ------------------------------------------------------------------ model access
    def state_views(self, layer: int, seqs: Any) -> Dict[str, Any]:
        """The live states of ``seqs`` in ``layer``, zero-copy and writable: ``{name: array
        [len(seqs), *shape]}`` (numpy on cpu/sim, CuPy on cuda; bfloat16 tensors as views
        whose ``__dlpack__`` exports ``bfloat16``). ``seqs`` must be consecutive ascending ids
        (``s, s+1, ...``: row ``s`` is sequence ``s``), as a batch of sequences laid out by
        slot is; for any other set use :meth:`read_states` / :meth:`write_states` (a gather
        and a scatter kernel). Lazy restore points on these states are copied first (a view
        is for writing): to only read, use :meth:`read_states`."""
        self._check_open()
        layer = self._check_layer(layer)
        s = host_int_array(seqs, "seqs")
        if len(s) > 1 and (np.diff(s) != 1).any():
            raise ValueError(f"state_views needs consecutive ascending sequence ids (row s is "
                             f"sequence s), got {s.tolist()[:8]}: use read_states/write_states "
                             f"for other sets")
        if len(s) == 0 or s[0] < 0 or s[-1] >= self.config.max_seqs:
            raise ValueError(f"seqs must be 1 to max_seqs ids in [0, max_seqs="
                             f"{self.config.max_seqs}), got {s.tolist()[:8]}")
        self._detach(s.tolist())
        a, b = int(s[0]), int(s[-1]) + 1
        return {n: export_view(self.pool[n][layer, a:b], spec.dtype)
                for n, spec in self._specs.items()}

    def _gather(self, name: str, layer: Optional[int], rows: Sequence[int]):
        spec = self._specs[name]
        pool = self.pool[name]
        src = pool if layer is None else pool[layer:layer + 1]
        xp = array_module(self.device)
        with self._on_device():
            out = xp.empty((src.shape[0], len(rows)) + spec.shape, dtype=pool.dtype)
            _rows.launch(self.device, out, np.arange(len(rows), dtype=np.int32), src,
                         np.asarray(rows, dtype=np.int32), spec.row_bytes)
        return out

    def read_states(self, layer: int, seqs: Any) -> Dict[str, Any]:
        """Copies of the live states of any ``seqs`` (distinct ids, any order) in ``layer``:
        ``{name: array [len(seqs), *shape]}`` in the storage dtype (one gather kernel per
        tensor)."""
        self._check_open()
        layer = self._check_layer(layer)
        s = self._check_seqs(seqs)
        return {n: self._gather(n, layer, s.tolist())[0] for n in self._specs}

    def write_states(self, layer: int, seqs: Any, states: Mapping[str, Any]) -> None:
        """Write the live states of ``seqs`` in ``layer`` from ``states`` (``{name: array
        [len(seqs), *shape]}``, every tensor, on the cache's device in its dtype): the scatter
        that pairs with :meth:`read_states`."""
        self._check_open()
        layer = self._check_layer(layer)
        s = self._check_seqs(seqs)
        arrays = {}
        for name, spec in self._specs.items():
            if not isinstance(states, Mapping) or set(states) != set(self._specs):
                raise ValueError(f"states must hold exactly the state tensors "
                                 f"{sorted(self._specs)}")
            arr = as_array(states[name], self.device, spec.dtype, name=f"states[{name!r}]")
            if tuple(arr.shape) != (len(s),) + spec.shape:
                raise ValueError(f"states[{name!r}] must have shape "
                                 f"{[len(s)] + list(spec.shape)}, got {list(arr.shape)}")
            arrays[name] = arr
        self._detach(s.tolist())
        xp = array_module(self.device)
        with self._on_device():
            for name, spec in self._specs.items():
                src = xp.ascontiguousarray(arrays[name]).reshape((1, len(s)) + spec.shape)
                _rows.launch(self.device, self.pool[name][layer:layer + 1], s.astype(np.int32),
                             src, np.arange(len(s), dtype=np.int32), spec.row_bytes)

    # ------------------------------------------------------------------ sequences (llama.cpp)
    def seq_pos_min(self, seq: int) -> int:
        """The first position the state of ``seq`` summarises, -1 when empty."""
        self._check_open()
        return self._lo[self._check_seq(seq)]

    def seq_pos_max(self, seq: int) -> int:
        """The last position the state of ``seq`` has read, -1 when empty."""
        self._check_open()
        return self._hi[self._check_seq(seq)]

    def seq_rm(self, seq: int, p0: int = 0, p1: Optional[int] = None) -> bool:
        """Remove positions ``[p0, p1)`` of ``seq`` (``-1``: every sequence). Works for the
        whole sequence, for nothing of it, or for a suffix ``[p0, end)`` back to a kept restore
        point at ``p0``; otherwise returns False and changes nothing (every sequence, with
        ``-1``)."""
        self._check_open()
        apply = self._plan_seq_rm(seq, p0, p1)
        if apply is None:
            return False
        apply()
        return True

    def _plan_seq_rm(self, seq, p0, p1):
        seq = self._check_seq(seq, allow_all=True)
        p0, p1 = self._check_span(p0, p1)
        seqs = range(self.config.max_seqs) if seq < 0 else [seq]
        steps = []
        for s in seqs:
            lo, hi = self._lo[s], self._hi[s]
            if hi < 0 or p1 <= lo or p0 > hi or p0 >= p1:
                continue
            if p0 <= lo and p1 > hi:
                steps.append(lambda s=s: self._clear(s))
            elif p0 > lo and p1 > hi:
                step = self._plan_rollback(s, p0)
                if step is None:
                    return None
                steps.append(step)
            else:
                return None

        def apply():
            self._forward = None
            for step in steps:
                step()
        return apply

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: Optional[int] = None) -> None:
        """``dst``'s state becomes ``src``'s (its previous one is dropped): the live state is
        copied, the restore points up to the copied state are shared. A range ending inside
        ``src`` (``seq_pos_min < p1 <= seq_pos_max``) copies the restore point at ``p1`` (and
        the points before it); ``ValueError`` when none is kept there, or when the range starts
        after ``src``'s first position (a state cannot be split). A range holding none of
        ``src`` changes nothing."""
        self._check_open()
        self._plan_seq_cp(src, dst, p0, p1)()

    def _plan_seq_cp(self, src, dst, p0, p1):
        src = self._check_seq(src, "src")
        dst = self._check_seq(dst, "dst")
        p0, p1 = self._check_span(p0, p1)
        lo, hi = self._lo[src], self._hi[src]
        if src == dst or hi < 0 or p1 <= lo or p0 > hi or p0 >= p1:
            return lambda: None
        if p0 > lo:
            raise ValueError(f"seq_cp: the range [{p0}, ...) starts after position {lo}, where "
                             f"the state of sequence {src} begins: a recurrent state cannot be "
                             "split")
        end = hi + 1 if p1 > hi else p1
        if end != hi + 1:
            self._point(src, end)   # ValueError naming it when not held

        def apply():
            self._forward = None
            self._clear(dst)
            self._detach([dst])
            row = src if end == hi + 1 else self._points[src][end].row
            self._copy([dst], [row])
            self._lo[dst], self._hi[dst] = lo, end - 1
            for q, p in self._points[src].items():
                if q <= end and not p.missing:
                    if p.row >= self.config.max_seqs:
                        self._refs[p.row] += 1
                        row = p.row
                    else:
                        row = dst   # a lazy point on src's live state: dst's copy is that state
                    self._points[dst][q] = _Point(row, p.explicit, frozenset())
            self._marks[dst] = {m for m in self._marks[src] if m > end}
        return apply

    def seq_keep(self, seq: int) -> None:
        """Drop every sequence but ``seq``."""
        self._check_open()
        self._plan_seq_keep(seq)()

    def _plan_seq_keep(self, seq):
        seq = self._check_seq(seq)

        def apply():
            self._forward = None
            for s in range(self.config.max_seqs):
                if s != seq:
                    self._clear(s)
        return apply

    def seq_add(self, seq: int, p0: int, p1: Optional[int], delta: int) -> None:
        """Add ``delta`` to the positions in ``[p0, p1)`` of ``seq``: labels only (the state,
        which has no positional encoding, does not change); its first and last position and
        its restore points move when in range. A sequence moved wholly below 0 is emptied
        (as the K/V caches drop negative positions); ``ValueError`` when only part of it would
        cross its other end."""
        self._check_open()
        self._plan_relabel(seq, p0, p1, lambda p, d=_check_index(
            "delta", delta, -UNLIMITED, UNLIMITED + 1): p + d)()

    def seq_div(self, seq: int, p0: int, p1: Optional[int], d: int) -> None:
        """Divide the positions in ``[p0, p1)`` of ``seq`` by ``d`` (labels only, as
        :meth:`seq_add`)."""
        self._check_open()
        d = _check_index("d", d, 1, UNLIMITED + 1)
        self._plan_relabel(seq, p0, p1, lambda p: p // d)()

    def _plan_relabel(self, seq, p0, p1, move):
        seq = self._check_seq(seq)
        p0, p1 = self._check_span(p0, p1)
        lo, hi = self._lo[seq], self._hi[seq]
        if hi < 0:
            return lambda: None

        def at(p):           # a position's new label
            return move(p) if p0 <= p < p1 else p
        in_lo, in_hi = p0 <= lo < p1, p0 <= hi < p1
        what = f"moving positions [{p0}, {p1}) of sequence {seq}"
        if not in_lo and not in_hi:
            if lo < p0 < p1 <= hi and any(at(p) != p for p in (p0, p1 - 1)):
                raise ValueError(f"{what} would move tokens inside its recurrent state past "
                                 "their neighbours")
            return lambda: None
        new_lo, new_hi = at(lo), at(hi)
        if new_hi < 0 and in_lo:
            return lambda: self._clear(seq)     # all of it below 0: dropped, as K/V would be
        if new_lo < 0:
            raise ValueError(f"{what} would put positions below 0, which the K/V caches drop: "
                             "a recurrent state cannot forget the tokens it read")
        # the sequence's positions run lo..hi without gaps: a moved end must not pass the rest
        if in_lo and not in_hi and not at(p1 - 1) < p1:
            raise ValueError(f"{what} would put its first positions after position {p1}")
        if in_hi and not in_lo and not at(p0) > p0 - 1:
            raise ValueError(f"{what} would put its last positions before position {p0 - 1}")
        if new_lo > new_hi:
            raise ValueError(f"{what} would put its first position {lo} after its last {hi} "
                             f"({new_lo} > {new_hi})")
        # a point at q follows the token before it (q - 1)
        moved = {q: at(q - 1) + 1 for q in self._points[seq]}
        if len(set(moved.values())) != len(moved) or any(not new_lo < m <= new_hi + 1
                                                        for m in moved.values()):
            raise ValueError(f"moving positions [{p0}, {p1}) of sequence {seq} would merge or "
                             "misplace its restore points")

        def apply():
            self._forward = None
            pts = self._points[seq]
            self._points[seq] = {moved[q]: p for q, p in pts.items()}
            self._lo[seq], self._hi[seq] = new_lo, new_hi
            self._marks[seq] = {at(m - 1) + 1 for m in self._marks[seq]}
        return apply

    # ------------------------------------------------------------------ one sequence as a unit
    def export_part(self, seq: int, p0: int = 0, p1: Optional[int] = None) -> RecurrentPart:
        """The state of ``seq`` at its restore points in ``(p0, p1]`` and, when the sequence's
        end lies there, its live state (the last entry): a :class:`RecurrentPart` owning its
        arrays (host numpy; one gather per tensor)."""
        self._check_open()
        seq = self._check_seq(seq)
        p0, p1 = self._check_span(p0, p1)
        lo, hi = self._lo[seq], self._hi[seq]
        entries = []   # (position, row, flags)
        for q, p in sorted(self._points[seq].items()):
            if p0 < q <= p1 and not p.missing and q <= hi + 1:
                entries.append((q, p.row, KEPT | (EXPLICIT if p.explicit else 0)))
        if hi >= 0 and p0 < hi + 1 <= p1 and (not entries or entries[-1][0] != hi + 1):
            entries.append((hi + 1, seq, 0))
        rows = [e[1] for e in entries]
        states = {}
        for name in self._specs:
            arr = self._gather(name, None, rows)
            if not isinstance(arr, np.ndarray):
                count_host_wait(copy=True)
                arr = arr.get(stream=self._stream)
            states[name] = arr
        return RecurrentPart(first=max(lo, 0), positions=np.array([e[0] for e in entries],
                                                                  dtype=np.int32),
                             flags=np.array([e[2] for e in entries], dtype=np.uint8),
                             states=states, specs=self._spec_tuples())

    def _spec_tuples(self):
        return tuple((s.name, s.shape, s.dtype) for s in self.config.states)

    def check_part(self, part: RecurrentPart, what: str = "part") -> None:
        """``ValueError``/``StateError`` unless ``part`` has this cache's layout."""
        if not isinstance(part, RecurrentPart):
            raise ValueError(f"{what} must be a numbakv RecurrentPart, got {type(part).__name__}")
        diff = _layout_diff(part.layout(), self.config.layout())
        if diff is not None:
            raise StateError(f"{what} holds the state of another model or layer layout: {diff}")

    def _plan_import(self, seq: int, part: RecurrentPart, delta: int = 0):
        """Replace ``seq`` with ``part`` (positions moved by ``delta``): its deepest entry
        becomes the live state, the kept entries restore points (the newest
        ``max_restore_points``, explicit ones first). A callable; checks first."""
        self.check_part(part)
        if not len(part.positions):
            raise ValueError("the recurrent part holds no state to import")
        if part.first + delta < 0:
            raise ValueError(f"moving the state by {delta} puts its first position "
                             f"{part.first} below 0")
        if int(part.positions[-1]) + delta >= UNLIMITED:
            raise ValueError("the state's positions would pass the largest position")

        def apply():
            self._forward = None
            self._clear(seq)
            self._detach([seq])
            m = len(part.positions)
            keep = [i for i in range(m) if part.flags[i] & KEPT]
            # the newest max_restore_points, explicit ones preferred (as _make_room drops)
            while len(keep) > self.config.max_restore_points:
                newest = keep[-1]
                keep.remove(min(keep, key=lambda i: (bool(part.flags[i] & EXPLICIT),
                                                     i == newest, i)))
            rows = [seq]
            src = [m - 1]
            pts = {}
            for i in keep:
                q = int(part.positions[i]) + delta
                if i == m - 1:
                    pts[q] = _Point(seq, bool(part.flags[i] & EXPLICIT), frozenset())
                    continue
                r = self._alloc()
                rows.append(r)
                src.append(i)
                pts[q] = _Point(r, bool(part.flags[i] & EXPLICIT), frozenset())
            xp = array_module(self.device)
            with self._on_device():
                for name, spec in self._specs.items():
                    a = part.states[name]
                    a = xp.asarray(a) if self.device == "cuda" else np.asarray(a)
                    a = xp.ascontiguousarray(a)
                    _rows.launch(self.device, self.pool[name], np.asarray(rows, np.int32), a,
                                 np.asarray(src, np.int32), spec.row_bytes)
            self._points[seq] = pts
            self._lo[seq] = part.first + delta
            self._hi[seq] = int(part.positions[-1]) + delta - 1
        return apply

    def import_part(self, seq: int, part: RecurrentPart, *, at: Optional[int] = None) -> None:
        """Replace the state of ``seq`` with ``part`` (:meth:`export_part`'s), its positions as
        saved or moved to start at ``at``. ``StateError`` when ``part`` has another layout;
        nothing changes on a refusal."""
        self._check_open()
        seq = self._check_seq(seq)
        self.check_part(part)
        delta = 0 if at is None else _check_index("at", at, 0, UNLIMITED) - part.first
        self._plan_import(seq, part, delta)()

    # ------------------------------------------------------------------ misc
    def close(self) -> None:
        """Release the storage; any later call raises ``KVCacheError``."""
        self._closed = True
        self._forward = None
        self.pool = {}

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def synchronize(self) -> None:
        """Wait for this cache's queued GPU work (no-op on cpu/sim)."""
        if self._stream is not None:
            host_wait(self._stream)
        else:
            synchronize(self.device)

    def __repr__(self) -> str:
        used = sum(1 for h in self._hi if h >= 0)
        return (f"RecurrentCache({self.config.n_layers} layers, {used}/{self.config.max_seqs} "
                f"sequences, device={self.device!r})")

    def __enter__(self) -> "RecurrentCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ============================================================================== state files
def _check_recurrent(cache) -> None:
    if not isinstance(cache, RecurrentCache):
        raise ValueError(f"cache must be a numbakv.RecurrentCache, got {type(cache).__name__}")
    cache._check_open()


def recurrent_config(cache: RecurrentCache) -> dict:
    """The config record of a recurrent state: layout and limits."""
    c = cache.config
    return {"layout": c.layout(), "max_seqs": c.max_seqs, "restore_every": c.restore_every,
            "max_restore_points": c.max_restore_points}


def recurrent_specs(cache: RecurrentCache, seq: Optional[int], prefix: str = ""):
    """``(config, specs)`` of every non-empty sequence (``seq=None``) or of ``seq``: each a
    :class:`RecurrentPart` of its whole history under ``<prefix>s<id>.``, plus its pending
    explicit marks (``config["marks"]``)."""
    from .state.snapshot import recurrent_specs as part_specs
    config = recurrent_config(cache)
    seqs = [s for s in range(cache.config.max_seqs) if cache._hi[s] >= 0] if seq is None \
        else [seq]
    config["seqs"] = seqs
    config["marks"] = {str(s): sorted(cache._marks[s]) for s in seqs if cache._marks[s]}
    specs = []
    for s in seqs:
        specs += part_specs(cache.export_part(s), f"{prefix}s{s}.")
    return config, specs


def _build(cache, seq, tokens, metadata):
    def build():
        _check_recurrent(cache)
        s = None if seq is None else cache._check_seq(seq)
        toks = _st._check_tokens(tokens)
        user = _st._check_metadata(metadata)
        config, specs = recurrent_specs(cache, s)
        meta = _st._base_metadata("recurrent" if s is None else "recurrent-seq", config, user)
        return meta, specs + _st._tokens_spec(toks)
    return build


def plan_recurrent(cache: RecurrentCache, state, seq: Optional[int], config: Any,
                   prefix: str = ""):
    """Check a parsed recurrent state record (``config``, tensors under ``prefix``) against
    ``cache`` and return ``(expected tensors, finish)``: after the checksum has been verified,
    ``finish()`` reads the parts and returns the callable that loads them (every sequence,
    ``seq=None``, or the one saved sequence as ``seq``). ``StateError`` on anything that does
    not fit; nothing changes before the callable runs."""
    if not isinstance(config, dict):
        raise state.fail("recurrent config must be an object")
    diff = _layout_diff(config.get("layout"), cache.config.layout())
    if diff is not None:
        raise state.fail(f"the state holds recurrent state of another model or layer layout: "
                         f"{diff}")
    seqs = config.get("seqs")
    if not isinstance(seqs, list) or not all(_st._is_int(s) for s in seqs) \
            or len(set(seqs)) != len(seqs):
        raise state.fail("config field 'seqs' must be a list of distinct integers")
    if seq is not None and len(seqs) != 1:
        raise state.fail(f"the state holds {len(seqs)} sequences, one was asked for (seq={seq})")
    if any(not 0 <= s < cache.config.max_seqs for s in seqs):
        raise state.fail(f"the state holds sequences {seqs[:8]}, the cache has max_seqs="
                         f"{cache.config.max_seqs}")
    marks = config.get("marks", {})
    if not isinstance(marks, dict) or not all(
            isinstance(k, str) and k.isdigit() and int(k) in seqs and isinstance(v, list)
            and all(_st._is_int(m) and 0 < m < UNLIMITED for m in v) for k, v in marks.items()):
        raise state.fail("config field 'marks' must map saved sequence ids to positions")
    expected = {}
    layouts = {}
    for s in seqs:
        specs, _, exp = recurrent_expect(state, f"{prefix}s{s}.", config["layout"])
        expected.update(exp)
        layouts[s] = specs

    def finish():
        parts = {}
        for s in seqs:
            part = recurrent_part_of(state, f"{prefix}s{s}.", layouts[s])
            if not len(part.positions):
                raise state.fail(f"sequence {s} holds no state")
            parts[s] = part
        targets = {seq: parts[seqs[0]]} if seq is not None else parts
        plans = [cache._plan_import(t, p) for t, p in targets.items()]
        new_marks = {t: set(marks.get(str(seqs[0] if seq is not None else t), []))
                     for t in targets}

        def apply():
            if seq is None:
                for s in range(cache.config.max_seqs):
                    cache._clear(s)
            for plan in plans:
                plan()
            for t, m in new_marks.items():
                cache._marks[t] = m   # as saved (those the last pass crossed go at the next)
            cache._forward = None
        return apply
    return expected, finish


def load_recurrent(cache: RecurrentCache, source, seq: Optional[int] = None, *,
                   strict: bool = True) -> dict:
    """Load a ``recurrent`` / ``recurrent-seq`` state into ``cache`` (see
    :meth:`RecurrentCache.load_state`)."""
    _check_recurrent(cache)
    s = None if seq is None else cache._check_seq(seq)
    _st._check_strict(strict)
    with _st._Opened(source) as state, _st._untrusted(state.what):
        want = "recurrent" if s is None else "recurrent-seq"
        if state.kind != want:
            raise state.fail(f"the state has kind {state.kind!r}, {want!r} was asked for "
                             f"(seq={s})")
        expected, finish = plan_recurrent(cache, state, s, state.config)
        state.expect(expected, optional=("tokens",))
        tokens = state.tokens()
        state.verify_checksum()
        apply = finish()
        apply()
        return {"tokens": tokens, "metadata": state.user_metadata()}


_files.register_family("recurrent", RecurrentCache, _build, load_recurrent)

__all__ = ["StateSpec", "RecurrentConfig", "RecurrentCache", "RecurrentPart",
           "load_recurrent", "plan_recurrent", "recurrent_specs"]
