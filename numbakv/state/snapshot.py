"""One sequence's K/V as a unit: :class:`SeqSnapshot`, ``export_seq`` and ``import_seq``.

What prefix tiers, transfers between processes and state files move is the same thing: the K/V
rows of a range of one sequence's positions, with those positions and the model fingerprint.

- ``snap = export_seq(cache, seq, p0=0, p1=None, *, device=False)`` reads positions
  ``[p0, p1)`` of ``seq``: the raw stored rows of every layer in the cache's storage format
  (float16 / bfloat16 bit patterns / float32, or the uint8 blocks of q8_0 / q4_0 / float8_e4m3:
  nothing is converted, a round trip is bit-exact), V always in the row layout ``[n, heads,
  v_row]`` whatever the storage's (permuted V is read transposed). Pending key rotations are
  applied first so the keys match the positions saved beside them. Where a layer's rows are a
  run of consecutive cells the arrays are **zero-copy, read-only views of the cache** (valid
  until the cache next writes those cells: ``snap.copy()`` owns its rows); otherwise one
  gather per layer copies them. On a GPU the rows come to the host through pinned buffers on
  the cache's stream, or stay device arrays with ``device=True``.
- ``import_seq(cache, seq, snap, *, at=None)`` checks everything first (fingerprint, layer count,
  head shapes and range, formats, positions ``seq`` already holds, room), then places the
  tokens in free cells (a contiguous run when there is one, else scattered cells), writes
  every layer's rows with one batched copy per layer and, with ``at``, moves the positions to
  start at ``at`` and re-rotates the keys through the cache's shift. A refusal changes
  nothing; a failure after the first write takes every change back (the cells it filled were
  free, so no sequence's data is lost). It ends the forward pass in progress, as the other
  sequence operations do.

``SeqSnapshot.to_bytes`` / ``from_bytes`` use the state file codec (``numbakv.state``, kind
``seq-snapshot``: tensors ``g<i>.positions``, ``g<i>.k.<l>``, ``g<i>.v.<l>`` per part; the head
range, the formats and the fingerprint in ``config``). ``from_bytes`` also reads a
``causal-seq`` / ``wrapper-seq`` state (what ``state_bytes(seq=...)`` writes).

This module is the one friend of the caches' internals (cell tables, storage arrays); the
caches' ``export_seq`` / ``import_seq`` methods delegate here.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..device import host_wait
from ..config import KV_TYPES, QUANT_TYPES, STORAGE_DTYPES, RopeShift, row_bytes
from ..errors import KVCacheError, KVCacheFullError, NotSupportedError, StateError
from ..kernels import rows as _rows
from . import codec as _st

#: ``kind`` of a serialized snapshot in the state codec
KIND = "seq-snapshot"
#: largest valid position + 1 (Ollama's math.MaxInt32 means "no position")
_POS_LIMIT = 2**31 - 1
_SEQ_KINDS = (KIND, "causal-seq", "wrapper-seq")


# ====================================================================================== model
def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_device_array(x) -> bool:
    return type(x) is not np.ndarray and type(x).__module__.split(".")[0] == "cupy"


def _row_dtype(fmt: str) -> np.dtype:
    """The numpy dtype rows of storage format ``fmt`` are held in (uint8 blocks when
    quantized, uint16 bit patterns for bfloat16)."""
    return np.dtype(np.uint8) if fmt in QUANT_TYPES else STORAGE_DTYPES[fmt]


def _safetensors_dtype(fmt: str) -> str:
    return "U8" if fmt in QUANT_TYPES else _st._STORAGE_ST[fmt]


def _check_rows(arrays, name: str, fmt: str) -> Tuple[Any, ...]:
    if isinstance(arrays, (np.ndarray, str, bytes)) or not hasattr(arrays, "__len__"):
        raise ValueError(f"{name} must be a list with one array per layer, got "
                         f"{type(arrays).__name__}")
    arrays = tuple(arrays)
    if not arrays:
        raise ValueError(f"{name} must hold at least one layer")
    want = _row_dtype(fmt)
    shape0 = getattr(arrays[0], "shape", None)
    if all(type(a) is np.ndarray and a.dtype == want and a.ndim == 3 and a.shape == shape0
           for a in arrays):
        return arrays      # the common case, checked at once
    for i, a in enumerate(arrays):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise ValueError(f"{name}[{i}] must be a numpy or CuPy array, got {type(a).__name__}")
        if len(a.shape) != 3:
            raise ValueError(f"{name}[{i}] must be [n, n_heads, row], got shape {tuple(a.shape)}")
        if np.dtype(a.dtype) != want:
            raise ValueError(f"{name}[{i}] must have dtype {want} (format {fmt!r}), got "
                             f"{a.dtype}")
        if tuple(a.shape) != tuple(arrays[0].shape):
            raise ValueError(f"{name}[{i}] has shape {tuple(a.shape)}, {name}[0] "
                             f"{tuple(arrays[0].shape)}: every layer must agree")
    return arrays


@dataclass(frozen=True, eq=False)
class SnapshotPart:
    """The rows of one cache group (the only one of a CausalCache / StreamCache, one per group
    of a WrapperCache).

    Attributes:
        positions: int32 ``[n]``, ascending, each in ``[0, 2**31 - 1)``. A position repeats
            when the sequence holds it in more than one cell (``seq_add`` / ``seq_div`` can
            merge positions, as llama.cpp's do); those rows keep their cell order.
        keys: one array per layer of the group, ``[n, n_heads_held, k_row]`` in the stored
            format (``k_row``: ``head_dim`` for float formats, the block bytes of a quantized
            row otherwise).
        values: likewise ``[n, n_heads_held, v_row]``: never permuted here.
        k_format, v_format: the stored formats (``"float16"``, ``"bfloat16"`` (uint16 bit
            patterns), ``"float32"``, ``"q8_0"``, ``"q4_0"``, ``"float8_e4m3"``: uint8).

    The constructor validates what it is given (shapes, dtypes, positions) and raises
    ``ValueError``; arrays are kept as given (numpy or CuPy, views allowed).
    """

    positions: np.ndarray
    keys: Tuple[Any, ...]
    values: Tuple[Any, ...]
    k_format: str
    v_format: str

    def __post_init__(self) -> None:
        for name in ("k_format", "v_format"):
            fmt = getattr(self, name)
            if not isinstance(fmt, str) or fmt not in KV_TYPES:
                raise ValueError(f"{name} must be one of {sorted(KV_TYPES)}, got {fmt!r}")
        pos = self.positions
        if _is_device_array(pos):
            pos = pos.get()
        pos = np.asarray(pos)
        if pos.ndim != 1 or (pos.size and pos.dtype.kind not in "iu"):
            raise ValueError(f"positions must be a 1-D integer array, got shape {pos.shape} "
                             f"dtype {pos.dtype}")
        if pos.size:
            if int(pos.min()) < 0 or int(pos.max()) >= _POS_LIMIT:
                raise ValueError(f"positions hold {int(pos.min())}..{int(pos.max())}, outside "
                                 f"[0, {_POS_LIMIT})")
            # a position may repeat: a sequence can hold one position in several cells (seq_add /
            # seq_div merge positions, as llama.cpp's do), and each cell's rows must be kept
            if pos.size > 1 and (np.diff(pos.astype(np.int64)) < 0).any():
                raise ValueError("positions must be ascending (non-decreasing)")
        pos = np.ascontiguousarray(pos, dtype=np.int32)
        keys = _check_rows(self.keys, "keys", self.k_format)
        values = _check_rows(self.values, "values", self.v_format)
        if len(keys) != len(values):
            raise ValueError(f"keys and values must have one array per layer each, got "
                             f"{len(keys)} and {len(values)}")
        n, heads = keys[0].shape[0], keys[0].shape[1]
        if n != len(pos) or values[0].shape[0] != n:
            raise ValueError(f"keys and values must have one row per position ({len(pos)}), "
                             f"got {n} and {values[0].shape[0]}")
        if values[0].shape[1] != heads:
            raise ValueError(f"keys and values must hold the same heads, got {heads} and "
                             f"{values[0].shape[1]}")
        object.__setattr__(self, "positions", pos)
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "values", values)

    @property
    def n_layers(self) -> int:
        """Layers of the group this part holds rows for."""
        return len(self.keys)

    @property
    def n_heads(self) -> int:
        """KV heads the rows hold."""
        return int(self.keys[0].shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of K/V rows this part holds (stored format)."""
        return sum(int(a.nbytes) for a in self.keys) + sum(int(a.nbytes) for a in self.values)

    def _heads(self, a: int, b: int) -> "SnapshotPart":
        return SnapshotPart(positions=self.positions, keys=[k[:, a:b] for k in self.keys],
                            values=[v[:, a:b] for v in self.values], k_format=self.k_format,
                            v_format=self.v_format)

    def _copy(self) -> "SnapshotPart":
        def own(a):
            return a.copy() if _is_device_array(a) else np.array(a, copy=True, order="C")
        return SnapshotPart(positions=self.positions.copy(), keys=[own(k) for k in self.keys],
                            values=[own(v) for v in self.values], k_format=self.k_format,
                            v_format=self.v_format)


@dataclass(frozen=True, eq=False)
class SeqSnapshot:
    """One sequence's positions and raw K/V rows, self-describing (see the module docstring).

    Attributes:
        parts: one :class:`SnapshotPart` per cache group (one for a CausalCache / StreamCache,
            one per group of a WrapperCache, in group order; a sliding-window group holds only
            the positions its cells still keep).
        fingerprint: the model fingerprint state files record
            (:func:`numbakv.state.fingerprint`); a WrapperCache's is ``{"groups": [one per
            group]}``.
        head_range: ``(first, stop)``: the KV heads the rows hold.
        recurrent: a hybrid model's recurrent state (``numbakv.HybridCache``): a
            :class:`RecurrentPart` holding the state at the restore points inside the
            snapshot's range (and at its end when that is the sequence's end); None for an
            attention-only cache. Only a ``HybridCache`` imports a snapshot that has one.
        layer_kinds: with ``recurrent``, the hybrid's ``layer_kinds`` (``"attention"`` /
            ``"recurrent"`` per model layer), which an importing cache must share.
        metadata: str -> str pairs saved with the bytes (covered by their checksum), e.g. what
            the prefix tiers bind a run to (its run and block keys); empty by default.
    """

    parts: Tuple[SnapshotPart, ...]
    fingerprint: Dict[str, Any]
    head_range: Tuple[int, int]
    recurrent: Optional["RecurrentPart"] = None
    layer_kinds: Optional[Tuple[str, ...]] = None
    metadata: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        parts = self.parts
        if isinstance(parts, SnapshotPart):
            parts = (parts,)
        if not hasattr(parts, "__len__") or not len(parts) \
                or not all(isinstance(p, SnapshotPart) for p in parts):
            raise ValueError("parts must be a non-empty sequence of SnapshotPart")
        if not isinstance(self.fingerprint, dict):
            raise ValueError(f"fingerprint must be a dict, got {type(self.fingerprint).__name__}")
        hr = self.head_range
        if not (isinstance(hr, (tuple, list)) and len(hr) == 2 and all(_is_int(h) for h in hr)
                and 0 <= hr[0] < hr[1]):
            raise ValueError(f"head_range must be (first, stop) with 0 <= first < stop, got "
                             f"{hr!r}")
        hr = (int(hr[0]), int(hr[1]))
        for i, p in enumerate(parts):
            if p.n_heads != hr[1] - hr[0]:
                raise ValueError(f"parts[{i}] holds {p.n_heads} heads, head_range {hr} says "
                                 f"{hr[1] - hr[0]}")
        object.__setattr__(self, "parts", tuple(parts))
        object.__setattr__(self, "head_range", hr)
        object.__setattr__(self, "metadata", _st._check_metadata(self.metadata))
        if self.recurrent is not None:
            if not isinstance(self.recurrent, RecurrentPart):
                raise ValueError(f"recurrent must be None or a RecurrentPart, got "
                                 f"{type(self.recurrent).__name__}")
            kinds = self.layer_kinds
            if isinstance(kinds, (str, bytes)) or not hasattr(kinds, "__iter__") or not all(
                    k in ("attention", "recurrent") for k in kinds) or not kinds:
                raise ValueError(f"layer_kinds must list 'attention' / 'recurrent' per layer "
                                 f"with a recurrent part, got {kinds!r}")
            object.__setattr__(self, "layer_kinds", tuple(kinds))
        elif self.layer_kinds is not None:
            raise ValueError("layer_kinds goes with a recurrent part")

    @property
    def restore_points(self) -> List[int]:
        """Positions of the restore points the snapshot carries (empty without a recurrent
        part)."""
        return [] if self.recurrent is None else self.recurrent.restore_points

    @property
    def state_nbytes(self) -> int:
        """Bytes of recurrent state held (0 without a recurrent part)."""
        return 0 if self.recurrent is None else self.recurrent.nbytes

    def _with(self, **kw) -> "SeqSnapshot":
        """This snapshot with some fields replaced (the recurrent part kept unless given)."""
        args = dict(parts=self.parts, fingerprint=self.fingerprint, head_range=self.head_range,
                    recurrent=self.recurrent, layer_kinds=self.layer_kinds)
        args.update(kw)
        return SeqSnapshot(**args)

    def attention_only(self) -> "SeqSnapshot":
        """The K/V half alone (no recurrent part)."""
        return self._with(recurrent=None, layer_kinds=None)

    def below(self, end: int) -> "SeqSnapshot":
        """The rows at positions ``< end`` (every part; the recurrent part's entries ``<= end``)."""
        parts = []
        for p in self.parts:
            keep = np.flatnonzero(p.positions < end)
            if len(keep) == len(p.positions):
                parts.append(p)
                continue
            n = len(keep)   # ascending positions: a prefix of the rows
            parts.append(SnapshotPart(positions=p.positions[:n], keys=[k[:n] for k in p.keys],
                                      values=[v[:n] for v in p.values], k_format=p.k_format,
                                      v_format=p.v_format))
        rec = self.recurrent
        if rec is not None:
            rec = rec.select(rec.positions <= end)
        return self._with(parts=tuple(parts), recurrent=rec)

    @property
    def positions(self) -> np.ndarray:
        """int32 ``[n]``: the first part's positions."""
        return self.parts[0].positions

    @property
    def nbytes(self) -> int:
        """Bytes of K/V rows held (stored format)."""
        return sum(p.nbytes for p in self.parts)

    def __len__(self) -> int:
        return len(self.parts[0].positions)

    def __repr__(self) -> str:
        pos = self.positions
        span = f"{int(pos[0])}..{int(pos[-1])}" if len(pos) else "empty"
        rec = "" if self.recurrent is None else \
            f", restore points {self.restore_points}, {self.state_nbytes} state bytes"
        return (f"SeqSnapshot({len(self.parts)} part(s), positions {span} ({len(pos)}), heads "
                f"{self.head_range}, {self.nbytes} bytes{rec})")

    def copy(self) -> "SeqSnapshot":
        """A snapshot owning its rows (an exported snapshot may view the cache's storage)."""
        return self._with(parts=tuple(p._copy() for p in self.parts),
                          fingerprint=json.loads(json.dumps(self.fingerprint)),
                          recurrent=None if self.recurrent is None else self.recurrent.copy())

    def select_heads(self, first: int, stop: int) -> "SeqSnapshot":
        """Views of KV heads ``[first, stop)`` (absolute head indices inside ``head_range``)."""
        h0, h1 = self.head_range
        if not (_is_int(first) and _is_int(stop) and h0 <= first < stop <= h1):
            raise ValueError(f"first, stop must be integers with {h0} <= first < stop <= {h1} "
                             f"(the snapshot's head_range), got {first!r}, {stop!r}")
        a, b = int(first) - h0, int(stop) - h0
        return self._with(parts=tuple(p._heads(a, b) for p in self.parts),
                          head_range=(int(first), int(stop)))

    @staticmethod
    def concat_heads(snaps: Sequence["SeqSnapshot"]) -> "SeqSnapshot":
        """Join snapshots of adjacent head ranges (any order) of the same positions, formats
        and fingerprint into one (resharding: two ranks' halves into one cache)."""
        snaps = list(snaps) if hasattr(snaps, "__iter__") else snaps
        if not isinstance(snaps, list) or not snaps or \
                not all(isinstance(s, SeqSnapshot) for s in snaps):
            raise ValueError("snaps must be a non-empty sequence of SeqSnapshot")
        snaps = sorted(snaps, key=lambda s: s.head_range)
        first = snaps[0]
        for prev, s in zip(snaps, snaps[1:]):
            if s.head_range[0] != prev.head_range[1]:
                raise ValueError(f"head ranges must be adjacent, got {prev.head_range} then "
                                 f"{s.head_range}")
        for s in snaps[1:]:
            diff = _fingerprint_diff(s.fingerprint, first.fingerprint)
            if diff is not None:
                raise ValueError(f"fingerprints differ: {diff[0]} is {diff[1]!r} and "
                                 f"{diff[2]!r}")
            if len(s.parts) != len(first.parts):
                raise ValueError("snapshots must have the same number of parts")
            for g, (p, q) in enumerate(zip(first.parts, s.parts)):
                if not np.array_equal(p.positions, q.positions):
                    raise ValueError(f"part {g}: snapshots must hold the same positions")
                if (p.k_format, p.v_format, p.n_layers) != (q.k_format, q.v_format, q.n_layers):
                    raise ValueError(f"part {g}: formats or layer counts differ")
        parts = []
        for g, p in enumerate(first.parts):
            mods = [s.parts[g] for s in snaps]
            xp = _xp_of(p.keys[0])
            keys = [xp.concatenate([m.keys[l] for m in mods], axis=1) for l in range(p.n_layers)]
            values = [xp.concatenate([m.values[l] for m in mods], axis=1)
                      for l in range(p.n_layers)]
            parts.append(SnapshotPart(positions=p.positions, keys=keys, values=values,
                                      k_format=p.k_format, v_format=p.v_format))
        return first._with(parts=tuple(parts),
                           head_range=(first.head_range[0], snaps[-1].head_range[1]))

    # ---------------------------------------------------------------- bytes
    def to_bytes(self, metadata: Optional[Dict[str, str]] = None) -> bytes:
        """The snapshot in the state codec (safetensors with a checksum; kind
        ``seq-snapshot``), with ``self.metadata`` updated by ``metadata`` (str -> str; read back
        as ``from_bytes(...).metadata``)."""
        return _st._to_bytes(self._build(metadata), False)

    def to_chunks(self, metadata: Optional[Dict[str, str]] = None) -> List[memoryview]:
        """``to_bytes(metadata)`` as a list of flat byte views (header, then every tensor in
        file order) whose concatenation is exactly those bytes; the rows' views are not copied
        (a host snapshot's C-contiguous rows: what a byte tier writes with one ``writev``).
        Valid while the snapshot's rows are unchanged."""
        return _st._to_chunks(self._build(metadata))

    def _build(self, metadata: Optional[Dict[str, str]]):
        """The codec's ``build()`` (metadata, tensor specs) of ``to_bytes``; checks first."""
        meta = dict(self.metadata)
        meta.update(_st._check_metadata(metadata))
        config = {"head_range": list(self.head_range), "fingerprint": self.fingerprint,
                  "parts": [{"k_format": p.k_format, "v_format": p.v_format,
                             "n_layers": p.n_layers} for p in self.parts]}
        if self.recurrent is not None:
            config["recurrent"] = {"layout": self.recurrent.layout(),
                                   "layer_kinds": list(self.layer_kinds)}
        try:
            json.dumps(config)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"fingerprint must be JSON-able: {exc}") from None

        def build():
            specs: List[_st._Spec] = []
            for g, p in enumerate(self.parts):
                specs += _part_specs(p, f"g{g}.")
            if self.recurrent is not None:
                specs += recurrent_specs(self.recurrent, "r.")
            return _st._base_metadata(KIND, config, meta), specs
        return build

    @staticmethod
    def from_bytes(data: "Union[bytes, bytearray, memoryview]") -> "SeqSnapshot":
        """A snapshot from ``to_bytes`` output (or a ``causal-seq`` / ``wrapper-seq`` state).
        The rows are read-only views of ``data`` when it is ``bytes``. Anything that does not
        parse as one raises ``StateError``."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"data must be bytes-like, got {type(data).__name__}")
        with _st._Opened(data) as state, _st._untrusted(state.what):
            return _snapshot_of_state(state)


def _xp_of(a):
    if _is_device_array(a):
        import cupy
        return cupy
    return np


def _part_specs(part: SnapshotPart, prefix: str) -> List["_st._Spec"]:
    """State codec tensors of one part: ``positions``, ``k.<l>``, ``v.<l>``."""
    n = len(part.positions)
    specs = [_st._Spec(prefix + "positions", "I32", (n,),
                       lambda: np.ascontiguousarray(part.positions, dtype="<i4"))]
    for which, fmt, rows in (("k", part.k_format, part.keys), ("v", part.v_format, part.values)):
        sd = _safetensors_dtype(fmt)
        le = _st._ST_DTYPES[sd]
        for layer, arr in enumerate(rows):
            specs.append(_st._Spec(f"{prefix}{which}.{layer}", sd, tuple(int(d) for d in arr.shape),
                                   lambda arr=arr, le=le: _st._host_le(arr, le)))
    # k.0, v.0, k.1, ...: the order state files use
    head, rest = specs[:1], specs[1:]
    L = part.n_layers
    return head + [s for pair in zip(rest[:L], rest[L:]) for s in pair]


def _snapshot_of_state(state) -> SeqSnapshot:
    """Check a parsed state holding one sequence and build the snapshot (views of its bytes)."""
    if state.kind not in _SEQ_KINDS:
        raise state.fail(f"the state holds a {state.kind!r} cache, not one sequence (kind "
                         f"{KIND!r}, 'causal-seq' or 'wrapper-seq')")
    config = state.config
    if state.kind == KIND:
        parts_cfg = config.get("parts")
        if not isinstance(parts_cfg, list) or not parts_cfg or \
                not all(isinstance(p, dict) for p in parts_cfg):
            raise state.fail("config field 'parts' must be a non-empty list of objects")
        hr = config.get("head_range")
        if not (isinstance(hr, list) and len(hr) == 2 and all(_st._is_int(h) for h in hr)
                and 0 <= hr[0] < hr[1]):
            raise state.fail(f"config field 'head_range' must be [first, stop], got {hr!r}")
        fp = config.get("fingerprint")
        if not isinstance(fp, dict):
            raise state.fail("config field 'fingerprint' must be an object")
        formats = []
        for g, p in enumerate(parts_cfg):
            kf, vf, L = p.get("k_format"), p.get("v_format"), p.get("n_layers")
            if kf not in KV_TYPES or vf not in KV_TYPES:
                raise state.fail(f"part {g}: formats {kf!r}, {vf!r} are not storage formats")
            if not _st._is_int(L) or L < 1:
                raise state.fail(f"part {g}: n_layers must be an integer >= 1, got {L!r}")
            formats.append((kf, vf, L))
        prefixes = [f"g{g}." for g in range(len(parts_cfg))]
        head_range = (hr[0], hr[1])
        rec_cfg = config.get("recurrent")
    else:
        groups = config.get("groups") if state.kind == "wrapper-seq" else [config]
        if not isinstance(groups, list) or not groups or \
                not all(isinstance(g, dict) for g in groups):
            raise state.fail("config field 'groups' must be a non-empty list of objects")
        formats, fps, heads = [], [], None
        for g, c in enumerate(groups):
            where = f" (group {g})" if state.kind == "wrapper-seq" else ""
            L = _st._cfg_int(state, c, "n_layers", where=where)
            H = _st._cfg_int(state, c, "n_kv_heads", where=where)
            dtype = c.get("dtype")
            if dtype not in STORAGE_DTYPES:
                raise state.fail(f"config{where} dtype {dtype!r} is not a storage dtype")
            kf, vf = c.get("k_dtype", dtype), c.get("v_dtype", dtype)
            if kf not in KV_TYPES or vf not in KV_TYPES:
                raise state.fail(f"config{where}: formats {kf!r}, {vf!r} are not storage formats")
            if L < 1 or H < 1 or (heads is not None and H != heads):
                raise state.fail(f"config{where}: n_layers {L} / n_kv_heads {H} do not fit")
            heads = H
            formats.append((kf, vf, L))
            fp = c.get("fingerprint", {})
            fps.append(fp if isinstance(fp, dict) else {})
        prefixes = ["g%d." % g for g in range(len(groups))] if state.kind == "wrapper-seq" \
            else [""]
        fp = {"groups": fps} if state.kind == "wrapper-seq" else fps[0]
        head_range = (0, heads)
        rec_cfg = None
    expected: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
    rec_specs = kinds = None
    if rec_cfg is not None:
        if not isinstance(rec_cfg, dict):
            raise state.fail("config field 'recurrent' must be an object")
        kinds = rec_cfg.get("layer_kinds")
        if not isinstance(kinds, list) or not kinds or len(kinds) > 1 << 16 or \
                not all(k in ("attention", "recurrent") for k in kinds):
            raise state.fail("config field 'recurrent.layer_kinds' must list 'attention' / "
                             "'recurrent' per layer")
        rec_specs, _, rec_expected = recurrent_expect(state, "r.", rec_cfg.get("layout"))
        expected.update(rec_expected)
    for prefix, (kf, vf, L) in zip(prefixes, formats):
        t = state.tensors.get(prefix + "positions")
        if t is None or t.dtype != "I32" or len(t.shape) != 1:
            raise state.fail(f"tensor {prefix}positions must be there, I32 [n]")
        n = t.shape[0]
        expected[prefix + "positions"] = ("I32", (n,))
        for layer in range(L):
            for which, fmt in (("k", kf), ("v", vf)):
                name = f"{prefix}{which}.{layer}"
                t = state.tensors.get(name)
                if t is None:
                    raise state.fail(f"tensor {name} missing")
                shape = tuple(t.shape)
                if len(shape) != 3 or shape[0] != n or shape[1] != head_range[1] - head_range[0]:
                    raise state.fail(f"tensor {name} has shape {list(shape)}, expected "
                                     f"[{n}, {head_range[1] - head_range[0]}, row]")
                if fmt in QUANT_TYPES and shape[2] % QUANT_TYPES[fmt][1]:
                    raise state.fail(f"tensor {name}: {shape[2]} bytes is not whole {fmt} blocks")
                expected[name] = (_safetensors_dtype(fmt), shape)
    state.expect(expected, optional=("tokens",))
    state.verify_checksum()
    parts = []
    for g, (prefix, (kf, vf, L)) in enumerate(zip(prefixes, formats)):
        try:
            parts.append(SnapshotPart(
                positions=state.tensor(prefix + "positions"),
                keys=[_native(state.tensor(f"{prefix}k.{l}"), kf) for l in range(L)],
                values=[_native(state.tensor(f"{prefix}v.{l}"), vf) for l in range(L)],
                k_format=kf, v_format=vf))
        except ValueError as exc:
            raise state.fail(f"part {g}: {exc}") from None
    rec = None if rec_specs is None else recurrent_part_of(state, "r.", rec_specs)
    try:
        return SeqSnapshot(parts=tuple(parts), fingerprint=fp, head_range=head_range,
                           recurrent=rec, layer_kinds=None if rec is None else tuple(kinds),
                           metadata=state.user_metadata())
    except ValueError as exc:
        raise state.fail(str(exc)) from None


def _native(arr: np.ndarray, fmt: str) -> np.ndarray:
    """A little-endian codec array as the format's native dtype (a view on little-endian
    hosts)."""
    want = _row_dtype(fmt)
    return arr if arr.dtype == want else arr.astype(want)


# ====================================================================================== model fingerprint
# (what state files record and snapshots carry; files.py imports these)
#: CacheConfig fields that describe how K/V are stored; those the config has are fingerprinted
#: (``k_dtype``/``v_dtype``/``k_scale``/``v_scale``: quantized storage, where present)
_FINGERPRINT_CONFIG_FIELDS = ("dtype", "k_dtype", "v_dtype", "k_scale", "v_scale",
                              "n_layers", "n_kv_heads", "head_dim", "v_head_dim")


def fingerprint(cache) -> Dict[str, Any]:
    """The model fingerprint of a ``CausalCache``: named, JSON-able fields that must agree for a
    saved state to mean the same thing in another cache. ``shift``: ``{"type": "none"}``,
    ``{"type": "rope", "base", "freq_scale", "dim" (rotary dims), "neox" (pairing),
    "freq_factors"}`` or ``{"type": "callable", "name"}``; ``swa_window``, ``swa_memory``,
    ``chunk_size`` (None when off); then the storage fields of the config (dtypes, head
    shapes). A new field is one more entry here; states saved before it was added then need
    ``strict=False``."""
    cfg = cache.config
    fields: Dict[str, Any] = {"shift": _shift_fingerprint(getattr(cache, "shift", None),
                                                          cfg.head_dim),
                              "swa_window": cache.swa_window, "swa_memory": cache.swa_memory,
                              "chunk_size": cache.chunk_size}
    for name in _FINGERPRINT_CONFIG_FIELDS:
        if hasattr(cfg, name):
            fields[name] = _json_value(getattr(cfg, name))
    # a head-sharded cache holds only some KV heads: its rows load only into the same head range
    # (recorded only when sharded, so states of unsharded caches keep their fingerprint)
    if getattr(cfg, "head_shard", None) is not None:
        fields["head_range"] = [int(h) for h in cfg.head_range]
    if getattr(cfg, "layer_reuse", None) is not None:   # absent otherwise: older states match
        fields["layer_reuse"] = list(cfg.layer_reuse)
    # llama.cpp's rotated quantized K/V: the rows are H k / H v, meaningless to an unrotated
    # cache (and the reverse); recorded only when rotated, so unrotated states keep matching
    k_rot, v_rot = getattr(cfg, "k_rotation", 0), getattr(cfg, "v_rotation", 0)
    if k_rot or v_rot:
        fields["kv_rotation"] = {"k": int(k_rot), "v": int(v_rot)}
    return fields


def _json_value(x):
    """Config values as JSON keeps them (numpy scalars and dtypes to plain values)."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(getattr(x, "name", x))


def _shift_fingerprint(shift, head_dim: int) -> Dict[str, Any]:
    if shift is None:
        return {"type": "none"}
    if hasattr(shift, "inv_freq") and hasattr(shift, "rotary_dim"):  # a RopeShift
        factors = shift.freq_factors
        out = {"type": "rope", "base": float(shift.base), "freq_scale": float(shift.freq_scale),
               "dim": int(shift.rotary_dim(head_dim)), "neox": bool(shift.neox),
               "freq_factors": None if factors is None else [float(f) for f in factors]}
        if getattr(shift, "offset", 0):   # rope dims not at the row's start (MLA latent rows);
            out["offset"] = int(shift.offset)   # absent at 0, so older states keep matching
        return out
    name = getattr(shift, "__qualname__", None) or type(shift).__qualname__
    module = getattr(shift, "__module__", None) or type(shift).__module__
    return {"type": "callable", "name": f"{module}.{name}"}


def _fingerprint_diff(saved: Any, current: Any, path: str = "") -> Optional[Tuple[str, Any, Any]]:
    """The first field (dotted path) where the saved fingerprint differs from the cache's."""
    if isinstance(saved, dict) and isinstance(current, dict):
        # the cache's field order (the shift's type first), then fields only the state has
        for key in list(current) + [k for k in saved if k not in current]:
            diff = _fingerprint_diff(saved.get(key, _MISSING), current.get(key, _MISSING),
                                     f"{path}.{key}" if path else str(key))
            if diff is not None:
                return diff
        return None
    if saved is _MISSING or current is _MISSING or type(saved) is not type(current) \
            and not (_is_number(saved) and _is_number(current)) or saved != current:
        return path, saved, current
    return None


class _Missing:
    def __repr__(self) -> str:
        return "(not recorded)"


_MISSING = _Missing()


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)



# ====================================================================================== caches
def _head_range(cache) -> Tuple[int, int]:
    cfg = cache.config
    return tuple(getattr(cfg, "head_range", None) or (0, cfg.n_kv_heads))


def _check_open(cache) -> None:
    if getattr(cache, "closed", False):
        raise KVCacheError("the cache is closed")


def _units(cache, seq: int) -> List[Tuple[Any, int]]:
    """``[(CausalCache with its own cell table, sequence id there)]``: one per group; a stream
    cache's sequence lives in its own stream as sequence 0."""
    groups = cache.caches if isinstance(getattr(cache, "caches", None), list) else [cache]
    out = []
    for g in groups:
        _check_open(g)
        streams = getattr(g, "streams", None)
        if isinstance(streams, list):
            out.append((streams[seq], 0))
        else:
            out.append((g, seq))
    return out


def cache_fingerprint(cache) -> Dict[str, Any]:
    """What :attr:`SeqSnapshot.fingerprint` of ``cache`` is."""
    if isinstance(getattr(cache, "caches", None), list):
        return {"groups": [fingerprint(g) for g in cache.caches]}
    return fingerprint(cache)


def _check_seq_arg(cache, seq) -> int:
    first = cache.caches[0] if isinstance(getattr(cache, "caches", None), list) else cache
    n = first.config.max_seqs
    if not _is_int(seq) or not 0 <= int(seq) < n:
        raise ValueError(f"seq must be an integer in [0, max_seqs={n}), got {seq!r}")
    return int(seq)


def _check_span(p0, p1) -> Tuple[int, int]:
    if not _is_int(p0):
        raise ValueError(f"p0 must be an integer, got {p0!r}")
    if p1 is not None and not _is_int(p1):
        raise ValueError(f"p1 must be None or an integer, got {p1!r}")
    lo = max(int(p0), 0)
    hi = _POS_LIMIT if p1 is None or int(p1) < 0 else min(int(p1), _POS_LIMIT)
    return lo, hi


def _seq_rows(unit, s: int, p0: int, p1: int) -> Tuple[np.ndarray, np.ndarray]:
    """(cells, positions) of sequence ``s`` with ``p0 <= pos < p1``, ascending by position."""
    table = unit.cells
    cells = np.asarray(table.seq_cells(s), dtype=np.int64)
    pos = table._pos[cells]
    keep = (pos >= p0) & (pos < p1)
    cells, pos = cells[keep], pos[keep]
    order = np.argsort(pos, kind="stable")
    return cells[order], np.ascontiguousarray(pos[order], dtype=np.int32)


def _run_start(cells: np.ndarray) -> int:
    """The first cell when ``cells`` are consecutive ascending, else -1."""
    n = len(cells)
    if n and int(cells[-1]) - int(cells[0]) == n - 1 and (n == 1 or (np.diff(cells) == 1).all()):
        return int(cells[0])
    return -1


def _read_only(a):
    if isinstance(a, np.ndarray):
        a = a.view()
        a.flags.writeable = False
    return a


def _gather_rows(sides: list, idx: np.ndarray, alloc: Optional[Callable[[int], np.ndarray]]
                 ) -> list:
    """Rows ``idx`` of every layer of each of ``sides`` (host arrays ``[layers, n_cells, ...]``,
    each row contiguous), gathered into one flat buffer (``alloc(nbytes)``, default
    ``np.empty``): per side one compiled row copy over every layer (``kernels.rows``: the rows
    in 8-byte words, no per-row Python; numpy's ``take`` copies a row with a ``memmove`` call
    each and reached ~0.35 of ``np.copyto``'s speed at 1 KiB rows, this ~0.65). Returns, per
    side, the ``[layers, len(idx), ...]`` array (one contiguous block, 64-byte aligned)."""
    n = len(idx)
    sizes = [a.shape[0] * n * (a.nbytes // max(a.shape[0] * a.shape[1], 1))
             if a.shape[1] else 0 for a in sides]
    step = [-(-b // 64) * 64 for b in sizes]
    flat = alloc(sum(step)) if alloc is not None else np.empty(sum(step), np.uint8)
    src_rows = np.ascontiguousarray(idx, dtype=np.int32)
    dst_rows = np.arange(n, dtype=np.int32)
    out, at = [], 0
    for a, b, st in zip(sides, sizes, step):
        dst = flat[at:at + b].view(a.dtype).reshape((a.shape[0], n) + a.shape[2:])
        if b:
            _rows.launch("cpu", dst, dst_rows, a, src_rows, b // (a.shape[0] * n))
        out.append(dst)
        at += st
    return out


def _export_unit(unit, s: int, p0: int, p1: int, device: bool,
                 alloc: Optional[Callable[[int], np.ndarray]] = None) -> SnapshotPart:
    unit.apply_pending_shifts()  # the keys must match the positions saved beside them
    cfg = unit.config
    storage = unit.storage
    cells, positions = _seq_rows(unit, s, p0, p1)
    n = len(cells)
    start = _run_start(cells)
    permuted = cfg.permuted_v
    keys_out, values_out = [], []
    on_gpu = unit.device == "cuda"
    keys_all, values_all = storage.keys, storage.values
    if not on_gpu:     # views handed out are read-only: a snapshot never writes the cache
        keys_all, values_all = _read_only(keys_all), _read_only(values_all)
    with storage._on_device():
        idx = None
        if start < 0 and n:
            idx = cells if not on_gpu else storage.xp.asarray(cells)
        if idx is not None and not on_gpu and not permuted:
            # scattered cells on the host: every layer's K and V gathered into one buffer
            L = cfg.n_stored_layers   # (the storage itself: these arrays are not handed out)
            k_rows, v_rows = _gather_rows([storage.keys[:L], storage.values[:L]], idx, alloc)
            return SnapshotPart(positions=positions, keys=list(k_rows), values=list(v_rows),
                                k_format=cfg.k_dtype, v_format=cfg.v_dtype)
        for layer in range(cfg.n_stored_layers):    # owning layers only (layer_reuse)
            k_all, v_all = keys_all[layer], values_all[layer]
            if n == 0:
                k = k_all[:0]
                v = v_all[:, :, :0].transpose(2, 0, 1) if permuted else v_all[:0]
            elif start >= 0:         # zero-copy views of a run of cells
                k = k_all[start:start + n]
                v = (v_all[:, :, start:start + n].transpose(2, 0, 1) if permuted
                     else v_all[start:start + n])
            else:                    # one gather per layer and side
                k = k_all.take(idx, axis=0)
                v = (v_all.take(idx, axis=2).transpose(2, 0, 1) if permuted
                     else v_all.take(idx, axis=0))
            keys_out.append(k)
            values_out.append(v)
        if on_gpu and not device:
            keys_out, values_out = _to_host_pinned(storage, keys_out, values_out)
    return SnapshotPart(positions=positions, keys=keys_out, values=values_out,
                        k_format=cfg.k_dtype, v_format=cfg.v_dtype)


def _pinned_host(nbytes: int) -> np.ndarray:
    import cupy
    mem = cupy.cuda.alloc_pinned_memory(max(int(nbytes), 1))
    return np.frombuffer(mem, np.uint8, max(int(nbytes), 1))


def _to_host_pinned(storage, keys: list, values: list) -> Tuple[list, list]:
    """Device rows -> host arrays in one pinned allocation: each array made contiguous and
    copied asynchronously on the storage's stream, then that stream (only) synchronised."""
    import cupy
    stream = storage.stream if storage.stream is not None else cupy.cuda.get_current_stream()
    arrays = keys + values
    total = sum(-(-int(a.nbytes) // 64) * 64 for a in arrays)
    host = _pinned_host(total)
    out, off, keep = [], 0, []
    with stream:
        for a in arrays:
            dev = cupy.ascontiguousarray(a)
            nbytes = int(dev.nbytes)
            view = host[off:off + nbytes].view(dev.dtype).reshape(dev.shape)
            if nbytes:
                dev.data.copy_to_host_async(ctypes.c_void_p(view.ctypes.data), nbytes, stream)
            keep.append(dev)
            out.append(view)
            off += -(-nbytes // 64) * 64
    host_wait(stream)
    del keep
    return out[:len(keys)], out[len(keys):]


def _to_device_pinned(storage, arrays: list) -> Tuple[list, np.ndarray]:
    """Host rows -> device arrays through one pinned buffer, copied asynchronously on the
    storage's stream; returns the device arrays and the pinned buffer, which must stay alive
    until that stream has run past the copies (the caller synchronises it)."""
    import cupy
    stream = storage.stream if storage.stream is not None else cupy.cuda.get_current_stream()
    # rows already in pinned memory (an export's) are copied from where they are
    direct = [a.flags.c_contiguous and _is_pinned(a) for a in arrays]
    total = sum(-(-int(a.nbytes) // 64) * 64 for a, d in zip(arrays, direct) if not d)
    host = _pinned_host(total) if total else None
    out, off = [], 0
    with stream:
        for a, d in zip(arrays, direct):
            if d:
                view = a
            else:
                view = host[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
                view[...] = a
                off += -(-int(a.nbytes) // 64) * 64
            dev = cupy.empty(a.shape, dtype=a.dtype)
            if a.nbytes:
                dev.data.copy_from_host_async(ctypes.c_void_p(view.ctypes.data), a.nbytes,
                                              stream)
            out.append(dev)
    return out, host


def _is_pinned(a: np.ndarray) -> bool:
    """Whether ``a``'s memory is page-locked host memory CUDA knows (asynchronous copies from
    it need no staging)."""
    try:
        import cupy
        attrs = cupy.cuda.runtime.pointerGetAttributes(a.ctypes.data)
        return int(getattr(attrs, "type", 0)) == 1      # cudaMemoryTypeHost
    except Exception:  # noqa: BLE001 - no runtime, or memory CUDA does not know
        return False


def export_seq(cache, seq: int, p0: int = 0, p1: Optional[int] = None, *,
               device: bool = False,
               alloc: Optional[Callable[[int], np.ndarray]] = None) -> SeqSnapshot:
    """A :class:`SeqSnapshot` of positions ``[p0, p1)`` of ``seq`` (``p1=None``: to the end)
    of a CausalCache, stream cache or WrapperCache; see the module docstring. ``device=True``
    keeps the rows of a cuda cache as CuPy arrays (ignored on cpu/sim). ``alloc(nbytes)``: a
    flat uint8 host buffer the gathered rows of scattered cells go into (one per group; the
    prefix store passes its recycling pool), default ``np.empty``."""
    _check_open(cache)
    seq = _check_seq_arg(cache, seq)
    p0, p1 = _check_span(p0, p1)
    if not isinstance(device, (bool, np.bool_)):
        raise ValueError(f"device must be a bool, got {device!r}")
    units = _units(cache, seq)
    if alloc is not None and not callable(alloc):
        raise ValueError(f"alloc must be None or a callable nbytes -> uint8 array, got {alloc!r}")
    parts = tuple(_export_unit(u, s, p0, p1, bool(device), alloc) for u, s in units)
    return SeqSnapshot(parts=parts, fingerprint=cache_fingerprint(cache),
                       head_range=_head_range(units[0][0]))


# ------------------------------------------------------------------------------------ import
class _Placement:
    """A checked import of one part into one unit: ``commit()`` writes it, ``rollback()`` takes
    a committed (or half-committed) placement back."""

    def __init__(self, unit, s: int, part: SnapshotPart, positions: np.ndarray,
                 rows: slice, head_slice: slice, delta: int, replace: bool, where: str,
                 label: int) -> None:
        self.unit, self.s, self.part = unit, s, part
        self.label = label                  # the caller's sequence id (a stream's is 0 inside)
        self.positions = positions          # int32 [k]: where the rows land (after `at`)
        self.rows = rows                    # which rows of the part (the window may drop some)
        self.heads = head_slice
        self.delta = delta
        self.replace = replace
        self.where = where
        self.slots: Optional[np.ndarray] = None
        self.journal: list = []
        self.head = 0
        self.backup = None
        self.applied = False
        self.old_forward = None
        #: None: write the part's rows; else ``fill(unit, slots)`` writes them (a run's reader)
        self.fill: Optional[Callable[[Any, np.ndarray], None]] = None

    # -------------------------------------------------------------- checks (no change)
    def check(self) -> None:
        unit, s, k = self.unit, self.s, len(self.positions)
        table = unit.cells
        if not self.replace and k:
            held = _held(unit, s, self.positions)
            if len(held):
                shown = ", ".join(str(int(p)) for p in held[:8])
                more = f" and {len(held) - 8} more" if len(held) > 8 else ""
                raise ValueError(f"seq {self.label} already holds position(s) {shown}{more}"
                                 f"{self.where}: seq_rm them first")
        room = table.n_free
        if self.replace:
            room += _alone(table, s)
        if k > room:
            raise KVCacheFullError(f"no room for {k} tokens{self.where}: {room} cells are free "
                                   f"of {unit.n_cells} (cache full)")

    # -------------------------------------------------------------- commit
    def commit(self) -> None:
        unit, s = self.unit, self.s
        table = unit.cells
        k = len(self.positions)
        self.old_forward = unit._forward
        self.head = table.head
        try:
            slots = None
            paged = table.page_size > 1
            if k and not paged:
                # prefer cells free before a replaced sequence is dropped: its rows stay intact
                start = table.find_contiguous(k)
                if start >= 0:
                    slots = np.arange(start, start + k, dtype=np.int32)
            if self.replace:
                table.seq_rm(s, 0, None, journal=self.journal)
            if k:
                if slots is None:
                    # paged placement (CacheConfig(page_size)): the tokens go on in the
                    # sequence's last page, else fill wholly free pages
                    slots = table.find_cells(self.positions, np.full(k, s, np.int32))
                    if slots is None:  # paged: free cells, but not enough whole pages
                        raise KVCacheFullError(
                            f"no room for {k} tokens in pages of {table.page_size} cells"
                            f"{self.where}: {table.n_free_pages} pages are wholly free "
                            "(cache full)")
                    slots = np.asarray(slots, dtype=np.int32)
                    if self.replace:   # cells the dropped sequence held: keep their rows
                        self.backup = (slots, *unit.storage.read_cells(slots))
                table.apply_batch(slots, self.positions, np.full(k, s, np.int32))
                self.slots = slots
                self.applied = True
                if self.fill is not None:    # rows read straight from a run (import_run)
                    self.fill(unit, slots)
                else:
                    _write_part(unit, slots, self.part, self.rows, self.heads)
                if self.delta:
                    _rotate(unit, slots, self.delta)
            unit._forward = None
        except BaseException:
            self.rollback()
            raise

    def rollback(self) -> None:
        unit = self.unit
        table = unit.cells
        if self.backup is not None:
            unit.storage.write_cells(*self.backup)
            self.backup = None
        if self.applied:
            table.unapply_batch(self.slots, self.head)
            self.applied = False
        if self.journal:
            table.rollback(self.journal)
        unit._forward = self.old_forward


def _held(unit, s: int, positions: np.ndarray) -> np.ndarray:
    """Which of ``positions`` sequence ``s`` already holds."""
    table = unit.cells
    lo, hi = int(table.seq_pos_min[s]), int(table.seq_pos_max[s])
    if hi < 0 or int(positions[-1]) < lo or int(positions[0]) > hi:
        return np.zeros(0, np.int32)
    cells = np.asarray(table.seq_cells(s), dtype=np.int64)
    have = table._pos[cells]
    return positions[np.isin(positions, have)]


def _alone(table, s: int) -> int:
    """Cells that only sequence ``s`` holds (free once it is dropped)."""
    cells = np.asarray(table.seq_cells(s), dtype=np.int64)
    if not len(cells):
        return 0
    seqs = table._seqs[cells].copy()
    seqs[:, s >> 6] &= ~np.uint64(1 << (s & 63))
    return int((~seqs.any(axis=1)).sum())


def _write_part(unit, slots: np.ndarray, part: SnapshotPart, rows: slice, heads: slice) -> None:
    """Every layer's K and V rows into ``slots``: one batched copy per layer and side (a slice
    assignment for a run of cells, a scatter otherwise). On cuda, host rows go up on the cache's
    stream through one pinned buffer (rows already pinned, e.g. an export's, directly), and that
    stream is synchronised before they may be dropped."""
    storage = unit.storage
    k = len(slots)
    start = _run_start(slots)
    L = unit.config.n_stored_layers     # owning layers only (layer_reuse)
    keys = [part.keys[layer][rows, heads] for layer in range(L)]
    values = [part.values[layer][rows, heads] for layer in range(L)]
    with storage._on_device():
        staged_from_host = False
        if unit.device == "cuda":
            import cupy
            idx = slice(start, start + k) if start >= 0 else cupy.asarray(slots.astype(np.int64))
            host = [i for i, a in enumerate(keys + values) if not _is_device_array(a)]
            if host:
                staged_from_host = True
                staged, _pinned = _to_device_pinned(storage, [(keys + values)[i] for i in host])
                both = keys + values
                for i, dev in zip(host, staged):
                    both[i] = dev
                keys, values = both[:L], both[L:]
        else:
            idx = slice(start, start + k) if start >= 0 else slots.astype(np.int64)
        for layer in range(L):
            _write_rows(unit, layer, idx, keys[layer], values[layer])
        if staged_from_host:
            import cupy
            stream = storage.stream if storage.stream is not None \
                else cupy.cuda.get_current_stream()
            # the host rows (a staging buffer, or the caller's pinned rows copied in place)
            # must outlive the copies reading them
            host_wait(stream)


def _write_rows(cache, layer: int, idx, k, v) -> None:
    """Write K ``[k, H, D]`` and V ``[k, H, Dv]`` rows (device arrays) to cells ``idx`` (device
    indices) of ``layer``, or to every cell when ``idx`` is None."""
    storage = cache.storage
    if idx is None:
        storage.keys[layer][...] = k
        if cache.config.permuted_v:
            storage.values[layer][...] = v.transpose(1, 2, 0)
        else:
            storage.values[layer][...] = v
        return
    scattered = isinstance(idx, np.ndarray)    # host cells that are not one run
    if not (scattered and _scatter_rows(storage.keys[layer], idx, k)):
        storage.keys[layer][idx] = k
    if cache.config.permuted_v:
        storage.values[layer][:, :, idx] = v.transpose(1, 2, 0)
    elif not (scattered and _scatter_rows(storage.values[layer], idx, v)):
        storage.values[layer][idx] = v


def _scatter_rows(dst: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> bool:
    """``dst[slots] = rows`` for a host layer ``dst [n_cells, ...]`` and rows ``[k, ...]`` of
    its row shape and dtype, each row contiguous, through the compiled row copy (8-byte words,
    no per-row Python; numpy's fancy assignment reached ~0.5 of ``np.copyto`` at 1 KiB rows,
    this ~0.65). Returns False, writing nothing, where that does not apply (the caller's numpy
    assignment then does it)."""
    if not (isinstance(dst, np.ndarray) and isinstance(rows, np.ndarray)
            and rows.dtype == dst.dtype and rows.shape[1:] == dst.shape[1:]
            and rows.shape[0] == len(slots) and dst.flags.c_contiguous):
        return False
    inner = rows[0] if len(rows) else rows
    if len(rows) and not inner.flags.c_contiguous:
        return False
    row_nbytes = int(np.prod(dst.shape[1:], dtype=np.int64)) * dst.itemsize
    if len(rows) and row_nbytes:
        _rows.launch("cpu", dst[None], np.asarray(slots, np.int32), rows[None],
                     np.arange(len(rows), dtype=np.int32), row_nbytes)
    return True


def _rotate(unit, slots: np.ndarray, delta: int) -> None:
    """Re-rotate the keys of ``slots`` by ``delta`` positions with the cache's shift."""
    deltas = np.full(len(slots), delta, np.int32)
    if isinstance(unit.shift, RopeShift):
        unit.storage.rotate(slots, deltas, unit.shift)
    else:
        unit._shift_with_callable(slots, deltas)


def _check_part_shapes(unit, part: SnapshotPart, heads_held: int, where: str) -> None:
    cfg = unit.config
    if part.n_layers != cfg.n_stored_layers:
        raise ValueError(f"snap has {part.n_layers} layers of K/V{where}, the cache "
                         f"{cfg.n_stored_layers}")
    if (part.k_format, part.v_format) != (cfg.k_dtype, cfg.v_dtype):
        raise ValueError(f"snap stores K/V as {part.k_format}/{part.v_format}{where}, the cache "
                         f"as {cfg.k_dtype}/{cfg.v_dtype}")
    want_k = row_bytes(cfg.k_dtype, cfg.head_dim) if cfg.k_quantized else cfg.head_dim
    want_v = row_bytes(cfg.v_dtype, cfg.v_head_dim) if cfg.v_quantized else cfg.v_head_dim
    got_k, got_v = part.keys[0].shape[2], part.values[0].shape[2]
    if (got_k, got_v) != (want_k, want_v):
        raise ValueError(f"snap rows are {got_k}/{got_v} wide (K/V){where}, the cache's "
                         f"{want_k}/{want_v} (head_dim {cfg.head_dim}, v_head_dim "
                         f"{cfg.v_head_dim})")
    stored = unit.storage.keys.shape[2]
    if stored != heads_held:
        raise ValueError(f"the cache stores {stored} heads but its head range holds "
                         f"{heads_held}")
    on_gpu = unit.device == "cuda"
    for a in part.keys + part.values:
        if _is_device_array(a) and not on_gpu:
            raise ValueError(f"snap holds CuPy arrays{where} but the cache stores on "
                             f"{unit.device}: pass host arrays")


def _check_fingerprint(snap: SeqSnapshot, cache) -> None:
    diff = _fingerprint_diff(snap.fingerprint, cache_fingerprint(cache))
    if diff is not None:
        field, was, now = diff
        raise StateError(f"snap: model fingerprint differs: {field} is {was!r} in the "
                         f"snapshot but {now!r} in this cache (another model or cache setup)")


def _plan_import(cache, seq: int, snap: SeqSnapshot, at: Optional[int], replace: bool,
                 check_fingerprint: bool = True) -> List[_Placement]:
    """Every check, no change; returns the placements to commit in order."""
    units = _units(cache, seq)
    if not isinstance(snap, SeqSnapshot):
        raise ValueError(f"snap must be a numbakv.SeqSnapshot, got {type(snap).__name__}")
    if snap.recurrent is not None:
        raise ValueError("snap holds a hybrid model's recurrent state beside its K/V: it "
                         "imports into a numbakv.HybridCache, not an attention-only "
                         f"{type(cache).__name__} (which would lose the state)")
    if len(snap.parts) != len(units):
        raise ValueError(f"snap has {len(snap.parts)} part(s), the cache {len(units)} "
                         "group(s)")
    if check_fingerprint:
        _check_fingerprint(snap, cache)
    h0, h1 = _head_range(units[0][0])
    s0, s1 = snap.head_range
    if not s0 <= h0 < h1 <= s1:
        raise ValueError(f"snap holds KV heads {snap.head_range}, the cache needs heads "
                         f"{(h0, h1)}: head_range does not cover them")
    heads = slice(h0 - s0, h1 - s0)
    delta = 0
    if at is not None:
        if not _is_int(at) or not 0 <= int(at) < _POS_LIMIT:
            raise ValueError(f"at must be None or an integer in [0, {_POS_LIMIT}), got {at!r}")
        firsts = [int(p.positions[0]) for p in snap.parts if len(p.positions)]
        if firsts:
            delta = int(at) - min(firsts)
    multi = len(units) > 1
    plans = []
    for g, ((unit, s), part) in enumerate(zip(units, snap.parts)):
        where = f" (group {g})" if multi else ""
        _check_part_shapes(unit, part, h1 - h0, where)
        pos = part.positions.astype(np.int64)
        rows = slice(0, len(pos))
        if len(pos):
            if delta:
                pos = pos + delta
                if pos[-1] >= _POS_LIMIT:
                    raise ValueError(f"at={at} moves positions past {_POS_LIMIT - 1}")
                if unit.shift is None:
                    raise NotSupportedError(f"at={at} moves the positions by {delta} and needs "
                                            "a shift function to re-rotate the keys "
                                            "(CausalCache(shift=...))")
        plan = _Placement(unit, s, part, np.ascontiguousarray(pos, dtype=np.int32), rows,
                          heads, delta, replace, where, seq)
        plan.check()
        plans.append(plan)
    return plans


def _placement(unit, s: int, part: SnapshotPart, replace: bool) -> _Placement:
    """A checked placement of ``part`` for sequence ``s`` of the CausalCache ``unit``, positions
    as saved, all heads (a state file load: the file's config was checked already)."""
    _check_part_shapes(unit, part, unit.storage.keys.shape[2], "")
    plan = _Placement(unit, s, part, part.positions, slice(0, len(part.positions)),
                      slice(None), 0, replace, "", s)
    plan.check()
    return plan


def _commit(plans: List[_Placement]) -> int:
    done: List[_Placement] = []
    try:
        for plan in plans:
            plan.commit()
            done.append(plan)
    except BaseException:
        for plan in reversed(done):
            plan.rollback()
        raise
    return max(len(plan.positions) for plan in plans)


def _end_forward(cache) -> None:
    """Ending the forward pass at every level (a stream cache and a WrapperCache's groups)."""
    for c in (cache.caches if isinstance(getattr(cache, "caches", None), list) else [cache]):
        c._forward = None


def import_seq(cache, seq: int, snap: SeqSnapshot, *, at: Optional[int] = None) -> int:
    """Place ``snap``'s tokens into free cells for ``seq`` and write their K/V (see the module
    docstring); returns the tokens placed (for a WrapperCache the largest part's: a
    sliding-window group holds only what its window memory kept). Raises, with nothing changed: ``StateError`` (fingerprint),
    ``ValueError`` (layers, head shapes or range, formats, positions ``seq`` already holds),
    ``KVCacheFullError`` (room), ``NotSupportedError`` (``at`` moves positions and the cache
    has no shift)."""
    _check_open(cache)
    seq = _check_seq_arg(cache, seq)
    plans = _plan_import(cache, seq, snap, at, replace=False)
    n = _commit(plans)
    _end_forward(cache)
    return n


# ------------------------------------------------------------------ a run read into the cells
class _LazyState(_st._State):
    """A parsed state whose tensor bytes are still in a run (``RunReader``): positions are read
    (small), rows are zero-stride placeholders of the right shape (never read: ``import_run``
    reads the real rows straight into the cells), and the checksum is checked by the fill."""

    def __init__(self, state: "_st._State", positions: Dict[str, bytes]) -> None:
        self.__dict__.update(state.__dict__)
        self.positions_raw = positions

    def tensor(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        dtype = _st._ST_DTYPES[t.dtype]
        if name in self.positions_raw:
            return np.frombuffer(self.positions_raw[name], dtype)
        return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=t.shape,
                                               strides=(0,) * len(t.shape), writeable=False)

    def verify_checksum(self, bar=None) -> None:
        """Deferred: the fill computes the crc32 over the rows it reads (``_fill_from_run``)."""

    def data_bytes_total(self) -> int:
        return max((t.end for t in self.tensors.values()), default=0)


class OpenedRun:
    """A run (``SeqSnapshot.to_bytes`` bytes behind a ``RunReader``) whose header and positions
    are read and checked (``open_run``), rows not yet: ``snap`` is the snapshot with
    placeholder rows (shapes, formats, positions, fingerprint and metadata are real), for the
    caller's checks; ``import_run`` places it."""

    def __init__(self, reader, state: _LazyState, snap: SeqSnapshot) -> None:
        self.reader, self.state, self.snap = reader, state, snap


def open_run(reader, what: str = "run") -> OpenedRun:
    """Read and check the header and the positions of the run behind ``reader`` (an object
    with ``size``, ``read(offset, n)`` and ``read_into(offset, buffers)``: the prefix tiers'
    ``RunReader``). Raises ``StateError`` for anything that is not a one-group ``seq-snapshot``
    of K/V rows (a hybrid's recurrent state and multi-group runs go through ``from_bytes``)."""
    size = int(reader.size)
    with _st._untrusted(what):
        head = reader.read(0, 8)
        if len(head) < 8:
            raise StateError(f"{what}: truncated: {size} bytes")
        n = int.from_bytes(head, "little")
        if n == 0 or n > _st.MAX_HEADER_BYTES or 8 + n > size:
            raise StateError(f"{what}: header length {n} does not fit the run's {size} bytes")
        head += reader.read(8, n)
        state = _st._parse_checked(memoryview(head), what, size=size)
        if state.kind != KIND or "recurrent" in state.config or \
                len(state.config.get("parts") or ()) != 1:
            raise NotSupportedError(f"{what}: not a one-group seq-snapshot of K/V rows")
        positions = {}
        for name, t in state.tensors.items():
            if name.endswith("positions"):
                raw = reader.read(state.data_start + t.begin, t.end - t.begin)
                if len(raw) != t.end - t.begin:
                    raise StateError(f"{what}: truncated in tensor {name}")
                positions[name] = raw
        lazy = _LazyState(state, positions)
        snap = _snapshot_of_state(lazy)
    return OpenedRun(reader, lazy, snap)


#: (pid, executor): the one helper thread computing a run's crc32 while its next rows are read
_CRC_WORKER: list = [None, None]
#: runs at least this large overlap their checksum with their reads
_PIPELINE_BYTES = 8 << 20


class _Crc:
    """A crc32 over buffers handed in file order, optionally computed on a helper thread while
    the caller reads the next ones (``preadv`` releases the GIL; ``codec.crc32``: zlib's releases
    it too, ISA-L's holds it but runs ~4x faster). One
    worker thread per process serves every run in submission order, so each run's checksum
    runs in its own order; ``value()`` waits for it."""

    def __init__(self, crc: int, background: bool) -> None:
        self.crc = crc
        self._last = None
        self._pool = None
        if background:
            import concurrent.futures
            import os
            if _CRC_WORKER[0] != os.getpid():   # first use, or a forked child: a new thread
                _CRC_WORKER[:] = [os.getpid(), concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="numbakv-crc")]
            self._pool = _CRC_WORKER[1]

    def add(self, views: Sequence[memoryview]) -> None:
        """Checksum ``views`` after everything added before; with a helper thread the views
        must stay unchanged until :meth:`value` (rows in the cells, not a reused scratch)."""
        def step() -> None:
            for v in views:
                self.crc = _st.crc32(v, self.crc)
        if self._pool is None:
            step()
        else:
            self._last = self._pool.submit(step)

    def value(self) -> int:
        if self._last is not None:
            self._last.result()
            self._last = None
        return self.crc


def _fill_from_run(unit, slots: np.ndarray, plan: "_Placement", run: OpenedRun) -> None:
    """Write the rows of ``run`` into ``slots`` of ``unit``: per tensor, one ``read_into`` of the
    rows that land straight in the cells' storage (a run of cells, all heads, K or unpermuted
    V: the destination *is* the read buffer) and of the rows past the match into a scratch
    buffer (the checksum covers them); other layouts read into scratch and copy once. The
    crc32 of everything read, in file order, must match the run's, else ``StateError`` (the
    placement is then rolled back: the cells were free)."""
    state, reader = run.state, run.reader
    storage = unit.storage
    k = len(slots)
    start = _run_start(slots)
    permuted = unit.config.permuted_v
    heads = plan.heads
    crc = _Crc(_st.crc32(_st._canonical(state.header)), background=False)
    scratch = np.empty(0, np.uint8)
    tensors = sorted(state.tensors.items(), key=lambda item: item[1].begin)
    for name, t in tensors:
        if name in state.positions_raw:
            crc.add([memoryview(state.positions_raw[name])])
    if start >= 0 and state.data_bytes_total() >= _PIPELINE_BYTES:
        # large runs: the checksum of each tensor's rows runs beside the read of the next
        crc = _Crc(crc.value(), background=True)
    for name, t in tensors:
        if name in state.positions_raw:
            continue
        which, layer = name.rsplit(".", 2)[-2:]
        side = storage.keys if which == "k" else storage.values
        layer = int(layer)
        n_all, n_heads = t.shape[0], t.shape[1]
        nbytes = t.end - t.begin
        row_nbytes = nbytes // n_all if n_all else 0
        direct = start >= 0 and heads == slice(0, n_heads) and side.shape[2] == n_heads \
            and not (which == "v" and permuted)
        dst = side[layer][start:start + k] if direct else None
        direct = direct and dst.flags.c_contiguous
        if direct:
            head_view = memoryview(dst).cast("B") if dst.size else memoryview(b"")
            need = nbytes - k * row_nbytes
        else:
            need = nbytes
        if need and crc._pool is not None:   # the worker may still read the last scratch
            crc.value()
        if scratch.size < need:
            scratch = np.empty(need, np.uint8)
        buf = memoryview(scratch)[:need]
        views = [head_view, buf] if direct else [buf]
        if not reader.read_into(state.data_start + t.begin, views):
            crc.value()
            raise StateError(f"{state.what}: truncated while read (tensor {name})")
        crc.add(views)
        if not direct and k:
            rows = np.frombuffer(scratch, side.dtype, k * row_nbytes // side.itemsize)
            rows = rows.reshape(k, n_heads, t.shape[2])[:, heads]
            idx = slice(start, start + k) if start >= 0 else slots.astype(np.int64)
            if which == "v" and permuted:
                side[layer][:, :, idx] = rows.transpose(1, 2, 0)
            elif not (start < 0 and _scatter_rows(side[layer], slots, rows)):
                side[layer][idx] = rows
    value = crc.value()
    want = state.metadata.get("checksum", "")
    if want != f"crc32:{value:08x}":
        raise StateError(f"{state.what}: checksum mismatch (stored {want!r}, computed "
                         f"crc32:{value:08x}): the data is corrupted")


def import_run(cache, seq: int, run: OpenedRun, *, upto: Optional[int] = None) -> int:
    """``import_seq(cache, seq, run.snap)`` (positions below ``upto`` only, when given) with
    the rows read straight from the run into the cells they land in (see
    :func:`_fill_from_run`): no whole-run buffer, one pass over the bytes besides the crc32.
    Checks as ``import_seq`` does first; a checksum mismatch or a short read raises
    ``StateError`` with nothing changed. Host-memory caches (cpu/sim) only:
    ``NotSupportedError`` otherwise."""
    _check_open(cache)
    seq = _check_seq_arg(cache, seq)
    snap = run.snap
    if upto is not None and len(snap.parts[0].positions) and \
            int(snap.parts[0].positions[-1]) >= upto:
        p = snap.parts[0]
        k = int(np.searchsorted(p.positions, upto))
        snap = snap._with(parts=(SnapshotPart(positions=p.positions[:k],
                                              keys=tuple(a[:k] for a in p.keys),
                                              values=tuple(a[:k] for a in p.values),
                                              k_format=p.k_format, v_format=p.v_format),))
    plans = _plan_import(cache, seq, snap, None, replace=False)
    if len(plans) != 1 or not isinstance(plans[0].unit.storage.keys, np.ndarray):
        raise NotSupportedError("import_run reads into host-memory caches of one group")
    plan = plans[0]
    plan.fill = lambda unit, slots: _fill_from_run(unit, slots, plan, run)
    n = _commit(plans)
    _end_forward(cache)
    return n


def replace_seq(cache, seq: int, snap: SeqSnapshot, *, strict: bool = True) -> int:
    """``seq`` drops everything it holds and holds ``snap``'s tokens instead, all or nothing
    (what a state load of one sequence does). ``strict=False`` skips the fingerprint check."""
    _check_open(cache)
    seq = _check_seq_arg(cache, seq)
    plans = _plan_import(cache, seq, snap, None, replace=True, check_fingerprint=strict)
    n = _commit(plans)
    _end_forward(cache)
    return n


__all__ = ["SeqSnapshot", "SnapshotPart", "RecurrentPart", "export_seq", "import_seq", "KIND",
           "open_run", "import_run", "OpenedRun"]


# ====================================================================================== recurrent state
#: flags of a :class:`RecurrentPart` entry
KEPT = 1        # the entry is a restore point the sequence keeps (else only its live state)
EXPLICIT = 2    # ... asked for explicitly (``mark_restore`` / ``explicit=True``)


def _check_state_specs(specs) -> Tuple[Tuple[str, Tuple[int, ...], str], ...]:
    """``specs`` as ``((name, shape, dtype), ...)``, checked (names unique identifiers, shapes
    of positive integers, dtypes storage dtypes)."""
    if not isinstance(specs, (list, tuple)) or not specs:
        raise ValueError("specs must be a non-empty sequence of (name, shape, dtype)")
    out, seen = [], set()
    for i, spec in enumerate(specs):
        if not isinstance(spec, (list, tuple)) or len(spec) != 3:
            raise ValueError(f"specs[{i}] must be (name, shape, dtype), got {spec!r}")
        name, shape, dtype = spec
        if not isinstance(name, str) or not name.isidentifier() or name in seen:
            raise ValueError(f"specs[{i}]: name must be a unique identifier, got {name!r}")
        if not isinstance(shape, (list, tuple)) or not all(_is_int(d) and 0 < d < 2**31
                                                           for d in shape):
            raise ValueError(f"specs[{i}] ({name}): shape must hold positive integers, got "
                             f"{shape!r}")
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"specs[{i}] ({name}): dtype must be one of "
                             f"{sorted(STORAGE_DTYPES)}, got {dtype!r}")
        seen.add(name)
        out.append((name, tuple(int(d) for d in shape), dtype))
    return tuple(out)


@dataclass(frozen=True, eq=False)
class RecurrentPart:
    """One sequence's recurrent state at some of its positions (``numbakv.RecurrentCache``):
    what a hybrid :class:`SeqSnapshot` carries beside the K/V rows, and what recurrent state
    files hold per sequence.

    Attributes:
        first: the first position the states summarise (the sequence's ``seq_pos_min``).
        positions: int32 ``[m]``, strictly ascending, each ``> first``: entry ``i`` is the state
            after the tokens at positions ``first .. positions[i] - 1`` (a restore point at
            ``positions[i]``: where a model resumes to process position ``positions[i]``).
        flags: uint8 ``[m]``: :data:`KEPT` when the entry is a restore point the sequence keeps
            (an entry without it is only the sequence's live state at its end), :data:`EXPLICIT`
            when it was asked for explicitly.
        states: ``{name: array [n_layers, m, *shape]}`` in the storage dtype (bfloat16 as its
            uint16 bit pattern), one per state tensor.
        specs: ``((name, shape, dtype), ...)``: the layout of each state tensor.
    """

    first: int
    positions: np.ndarray
    flags: np.ndarray
    states: Dict[str, Any]
    specs: Tuple[Tuple[str, Tuple[int, ...], str], ...]

    def __post_init__(self) -> None:
        specs = _check_state_specs(self.specs)
        if not _is_int(self.first) or not 0 <= int(self.first) < _POS_LIMIT:
            raise ValueError(f"first must be a position in [0, {_POS_LIMIT}), got {self.first!r}")
        first = int(self.first)
        pos = np.asarray(self.positions.get() if _is_device_array(self.positions)
                         else self.positions)
        if pos.ndim != 1 or (pos.size and pos.dtype.kind not in "iu"):
            raise ValueError(f"positions must be a 1-D integer array, got shape {pos.shape}")
        if pos.size and (int(pos.min()) <= first or int(pos.max()) > _POS_LIMIT
                         or (np.diff(pos.astype(np.int64)) <= 0).any()):
            raise ValueError(f"positions must be strictly ascending in ({first}, {_POS_LIMIT}], "
                             f"got {pos.tolist()[:8]}")
        flags = np.asarray(self.flags)
        if flags.shape != pos.shape or (flags.size and (flags.dtype.kind not in "iub"
                                                        or int(flags.max()) > 3
                                                        or int(flags.min()) < 0)):
            raise ValueError(f"flags must be {len(pos)} values in 0..3, got {flags!r}")
        if not isinstance(self.states, dict) or set(self.states) != {s[0] for s in specs}:
            raise ValueError(f"states must map exactly the names {[s[0] for s in specs]} to "
                             f"arrays, got {sorted(self.states) if isinstance(self.states, dict) else type(self.states).__name__}")
        n_layers = None
        for name, shape, dtype in specs:
            a = self.states[name]
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                raise ValueError(f"states[{name!r}] must be a numpy or CuPy array")
            if np.dtype(a.dtype) != STORAGE_DTYPES[dtype]:
                raise ValueError(f"states[{name!r}] must have dtype {STORAGE_DTYPES[dtype]} "
                                 f"({dtype}), got {a.dtype}")
            if len(a.shape) != 2 + len(shape) or tuple(a.shape[2:]) != shape \
                    or a.shape[1] != len(pos) or a.shape[0] < 1:
                raise ValueError(f"states[{name!r}] must be [n_layers, {len(pos)}, "
                                 f"{', '.join(map(str, shape))}], got {tuple(a.shape)}")
            if n_layers is not None and a.shape[0] != n_layers:
                raise ValueError("every state tensor must have the same layer count")
            n_layers = int(a.shape[0])
        object.__setattr__(self, "first", first)
        object.__setattr__(self, "positions", np.ascontiguousarray(pos, dtype=np.int32))
        object.__setattr__(self, "flags", np.ascontiguousarray(flags, dtype=np.uint8))
        object.__setattr__(self, "specs", specs)

    @property
    def n_layers(self) -> int:
        """Recurrent layers the states hold."""
        return int(self.states[self.specs[0][0]].shape[0])

    @property
    def restore_points(self) -> List[int]:
        """Positions of the entries that are kept restore points."""
        return [int(p) for p, f in zip(self.positions, self.flags) if f & KEPT]

    @property
    def end(self) -> int:
        """The position after the deepest entry's last token (``first`` when empty)."""
        return int(self.positions[-1]) if len(self.positions) else self.first

    @property
    def nbytes(self) -> int:
        """Bytes of state held (every entry, layer and tensor)."""
        return sum(int(a.nbytes) for a in self.states.values())

    def layout(self) -> Dict[str, Any]:
        """The JSON-able layout the fingerprint check compares: ``{"n_layers", "states":
        [[name, shape, dtype], ...]}``."""
        return {"n_layers": self.n_layers,
                "states": [[n, list(s), d] for n, s, d in self.specs]}

    def select(self, keep: np.ndarray) -> "RecurrentPart":
        """The entries where the boolean ``keep [m]`` is set."""
        idx = np.flatnonzero(np.asarray(keep, dtype=bool))
        return RecurrentPart(first=self.first, positions=self.positions[idx],
                             flags=self.flags[idx],
                             states={n: a[:, idx] for n, a in self.states.items()},
                             specs=self.specs)

    def shifted(self, delta: int) -> "RecurrentPart":
        """The same states at positions moved by ``delta`` (``first`` stays >= 0)."""
        return RecurrentPart(first=self.first + delta, positions=self.positions + delta,
                             flags=self.flags, states=self.states, specs=self.specs)

    def copy(self) -> "RecurrentPart":
        """A part owning its arrays (one made from bytes views them)."""
        def own(a):
            return a.copy() if _is_device_array(a) else np.array(a, copy=True, order="C")
        return RecurrentPart(first=self.first, positions=self.positions.copy(),
                             flags=self.flags.copy(),
                             states={n: own(a) for n, a in self.states.items()},
                             specs=self.specs)


def recurrent_specs(part: RecurrentPart, prefix: str) -> List["_st._Spec"]:
    """State codec tensors of a :class:`RecurrentPart`: ``first`` I32 [1], ``positions`` I32
    [m], ``flags`` U8 [m] and ``state.<name>`` ``[n_layers, m, *shape]``."""
    first = np.array([part.first], dtype="<i4")
    specs = [_st._Spec(prefix + "first", "I32", (1,), lambda: first),
             _st._Spec(prefix + "positions", "I32", (len(part.positions),),
                       lambda: np.ascontiguousarray(part.positions, dtype="<i4")),
             _st._Spec(prefix + "flags", "U8", (len(part.flags),), lambda: part.flags)]
    for name, shape, dtype in part.specs:
        sd = _st._STORAGE_ST[dtype]
        arr = part.states[name]
        specs.append(_st._Spec(f"{prefix}state.{name}", sd, tuple(int(d) for d in arr.shape),
                               lambda arr=arr, sd=sd: _st._host_le(arr, _st._ST_DTYPES[sd])))
    return specs


def recurrent_expect(state, prefix: str, layout: Any, where: str = ""
                     ) -> Tuple[Tuple[Tuple[str, Tuple[int, ...], str], ...], int,
                                Dict[str, Tuple[str, Tuple[int, ...]]]]:
    """Check a saved recurrent layout (``RecurrentPart.layout()``) and the tensor headers of the
    part under ``prefix``; returns ``(specs, n_layers, expected tensors)``. Raises
    ``StateError`` naming what does not fit."""
    if not isinstance(layout, dict):
        raise state.fail(f"recurrent layout{where} must be an object")
    n_layers = layout.get("n_layers")
    if not _st._is_int(n_layers) or not 1 <= n_layers <= 1 << 20:
        raise state.fail(f"recurrent layout{where}: n_layers must be an integer >= 1, got "
                         f"{n_layers!r}")
    try:
        specs = _check_state_specs([tuple(s) if isinstance(s, list) else s
                                    for s in layout.get("states") or ()])
    except ValueError as exc:
        raise state.fail(f"recurrent layout{where}: {exc}") from None
    t = state.tensors.get(prefix + "positions")
    if t is None or t.dtype != "I32" or len(t.shape) != 1:
        raise state.fail(f"tensor {prefix}positions must be there, I32 [m]")
    m = t.shape[0]
    expected = {prefix + "first": ("I32", (1,)), prefix + "positions": ("I32", (m,)),
                prefix + "flags": ("U8", (m,))}
    for name, shape, dtype in specs:
        expected[f"{prefix}state.{name}"] = (_st._STORAGE_ST[dtype], (n_layers, m) + shape)
    return specs, n_layers, expected


def recurrent_part_of(state, prefix: str, specs) -> RecurrentPart:
    """The :class:`RecurrentPart` under ``prefix`` of a checked state (views of its bytes);
    bad values raise ``StateError``."""
    try:
        return RecurrentPart(
            first=int(state.tensor(prefix + "first")[0]),
            positions=state.tensor(prefix + "positions"),
            flags=state.tensor(prefix + "flags"),
            states={n: _native(state.tensor(f"{prefix}state.{n}"), d) for n, _, d in specs},
            specs=specs)
    except ValueError as exc:
        raise state.fail(f"recurrent state{' ' + prefix.rstrip('.') if prefix else ''}: "
                         f"{exc}") from None


def recurrent_blob(part: RecurrentPart, layer_kinds: Sequence[str]) -> bytes:
    """``part`` (and the hybrid's ``layer_kinds``) as a ``recurrent-seq`` state: what
    ``numbakv.dist`` sends after a hybrid snapshot's K/V rows (a ``RecurrentCache`` can load it
    as one sequence)."""
    config = {"layout": part.layout(), "seqs": [0], "layer_kinds": list(layer_kinds)}
    return _st._to_bytes(lambda: (_st._base_metadata("recurrent-seq", config, None),
                                  recurrent_specs(part, "s0.")), False)


def recurrent_from_blob(data: bytes) -> Tuple[RecurrentPart, Tuple[str, ...]]:
    """``(part, layer_kinds)`` from :func:`recurrent_blob` output; anything else raises
    ``StateError``. The arrays are views of ``data``."""
    with _st._Opened(data) as state, _st._untrusted(state.what):
        if state.kind != "recurrent-seq":
            raise state.fail(f"kind {state.kind!r} is not a sequence's recurrent state")
        kinds = state.config.get("layer_kinds")
        if not isinstance(kinds, list) or not kinds or \
                not all(k in ("attention", "recurrent") for k in kinds):
            raise state.fail("config field 'layer_kinds' must list 'attention' / 'recurrent'")
        specs, _, expected = recurrent_expect(state, "s0.", state.config.get("layout"))
        state.expect(expected)
        state.verify_checksum()
        return recurrent_part_of(state, "s0.", specs), tuple(kinds)
