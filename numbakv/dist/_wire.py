"""What travels between ranks, without torch: the transfer header (JSON), its validation against
the receiving cache, the verdict record and the flat payload layout of one snapshot part.

One transfer of a sequence (sender -> receiver unless marked):

1. header length: int64 ``[1]``; header: uint8 ``[length]``, UTF-8 JSON (:func:`make_header`):
   fingerprint, head range, and per part the positions, formats, row shapes and dtypes;
2. verdict (receiver -> sender): uint8 ``[VERDICT_BYTES]``: byte 0 is :data:`OK`, :data:`SKIP`
   (the receiver needs none of the sender's heads) or :data:`REFUSED`, the rest the reason
   (UTF-8, NUL padded); an OK verdict's text is ``"lo hi"``: the heads the sender must send
   (the receiver's share of the sender's range). The receiver decides it from the header
   alone, before it allocates anything for the rows;
3. payload: K rows then V rows of each layer of each part, one message each, only the heads
   the verdict asked for, in the stored format (quantized blocks stay quantized), received
   into one flat buffer per part (:func:`part_layout`);
4. ack (receiver -> sender): a verdict record again, after ``import_seq``: the import itself may
   still refuse (positions the sequence holds, no room), and the sender then raises too.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

PROTOCOL = "numbakv-seq/1"
VERDICT_BYTES = 1024
OK, SKIP, REFUSED = 0, 2, 1
#: header length limit the receiver accepts (a hostile or confused peer cannot make it allocate)
MAX_HEADER_BYTES = 64 << 20


class Refusal(Exception):
    """Internal: the header does not fit the receiving cache (message: the reason)."""


def head_range_of(cache) -> Tuple[int, int]:
    """``(first, stop)``: the KV heads ``cache`` holds (a WrapperCache: its first group's)."""
    cfg = getattr(cache, "config", None)
    if cfg is None:
        cfg = cache.caches[0].config
    hr = getattr(cfg, "head_range", None)
    return tuple(int(h) for h in hr) if hr is not None else (0, int(cfg.n_kv_heads))


def _strip(fingerprint: Any) -> Any:
    """The fingerprint without ``head_range`` (at any depth: a WrapperCache's records one per
    group): head ranges are matched separately, by overlap, so that resharding works."""
    if isinstance(fingerprint, dict):
        return {k: _strip(v) for k, v in fingerprint.items() if k != "head_range"}
    if isinstance(fingerprint, (list, tuple)):
        return [_strip(v) for v in fingerprint]
    return fingerprint


def _first_diff(a: Any, b: Any, path: str = "") -> Optional[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(b) + [k for k in a if k not in b]:
            if key not in a or key not in b:
                return f"{path}{key}"
            d = _first_diff(a[key], b[key], f"{path}{key}.")
            if d is not None:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return path.rstrip(".") or "(root)"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_diff(x, y, f"{path}{i}.")
            if d is not None:
                return d
        return None
    return None if a == b else (path.rstrip(".") or "(root)")


def _dtype_name(arr) -> str:
    return np.dtype(arr.dtype).str


def make_header(snap, n_kv_heads: int) -> Dict[str, Any]:
    """The header of ``snap``: everything the receiver needs to check it and size its buffers."""
    parts = []
    for part in snap.parts:
        pos = np.ascontiguousarray(np.asarray(part.positions, dtype=np.int32))
        parts.append({
            "n": int(pos.shape[0]),
            "positions": base64.b64encode(pos.astype("<i4").tobytes()).decode("ascii"),
            "k_format": part.k_format, "v_format": part.v_format,
            "n_layers": len(part.keys),
            "k_row": [list(map(int, k.shape[1:])) for k in part.keys],
            "v_row": [list(map(int, v.shape[1:])) for v in part.values],
            "k_dtype": [_dtype_name(k) for k in part.keys],
            "v_dtype": [_dtype_name(v) for v in part.values],
        })
    return {"protocol": PROTOCOL, "fingerprint": snap.fingerprint,
            "head_range": [int(h) for h in snap.head_range], "n_kv_heads": int(n_kv_heads),
            "parts": parts}


def encode_header(header: Dict[str, Any]) -> bytes:
    return json.dumps(header, separators=(",", ":"), sort_keys=True).encode("utf-8")


def decode_header(data: bytes) -> Dict[str, Any]:
    """Parse a header; anything malformed is a :class:`Refusal` naming what."""
    try:
        header = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise Refusal(f"the header is not UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("protocol") != PROTOCOL:
        got = header.get("protocol") if isinstance(header, dict) else type(header).__name__
        raise Refusal(f"unknown transfer protocol {got!r} (this side speaks {PROTOCOL!r})")
    for key in ("fingerprint", "head_range", "n_kv_heads", "parts"):
        if key not in header:
            raise Refusal(f"the header lacks {key!r}")
    hr = header["head_range"]
    if not (isinstance(hr, list) and len(hr) == 2 and all(isinstance(h, int) for h in hr)
            and 0 <= hr[0] < hr[1]):
        raise Refusal(f"bad head_range in the header: {hr!r}")
    if not isinstance(header["parts"], list):
        raise Refusal("the header's parts must be a list")
    for i, p in enumerate(header["parts"]):
        if not isinstance(p, dict):
            raise Refusal(f"part {i} of the header is not a record")
        try:
            raw = base64.b64decode(p["positions"], validate=True)
            n, L = int(p["n"]), int(p["n_layers"])
            rows = (p["k_row"], p["v_row"], p["k_dtype"], p["v_dtype"])
        except (KeyError, TypeError, ValueError) as exc:
            raise Refusal(f"part {i} of the header is malformed ({exc!r})") from None
        if len(raw) != 4 * n or n < 0 or L < 0 or any(len(r) != L for r in rows):
            raise Refusal(f"part {i} of the header is inconsistent (n={n}, layers={L})")
        p["positions"] = np.frombuffer(raw, dtype="<i4").astype(np.int32)
    return header


class Probe:
    """What the receiving cache expects: its snapshot fingerprint and, per layer group, the
    formats, layer count, row width and stored dtype (read from the configs: no cache call)."""

    def __init__(self, cache, fingerprint: Dict[str, Any]) -> None:
        from ..config import QUANT_TYPES
        self.fingerprint = fingerprint
        groups = cache.caches if isinstance(getattr(cache, "caches", None), list) else [cache]
        self.parts = []
        for c in groups:
            cfg = c.config
            spec = {"k_format": cfg.k_dtype, "v_format": cfg.v_dtype, "n_layers": cfg.n_layers}
            # room: the free cells now (import_seq places the rows in free cells only)
            cells = getattr(c, "cells", None)
            spec["n_cells"] = getattr(c, "n_cells", None)
            spec["n_free"] = getattr(cells, "n_free", None)
            for side, fmt, dim in (("k", cfg.k_dtype, cfg.head_dim),
                                   ("v", cfg.v_dtype, cfg.v_head_dim)):
                quant = fmt in QUANT_TYPES
                spec[f"{side}_row"] = (cfg.k_row_bytes if side == "k" else cfg.v_row_bytes) \
                    if quant else dim
                spec[f"{side}_dtype"] = np.dtype(np.uint8 if quant else cfg.storage_dtype).str
            self.parts.append(spec)


def check_header(header: Dict[str, Any], probe: Probe, need: Tuple[int, int],
                 n_kv_heads: int) -> Optional[Tuple[int, int]]:
    """Check a decoded ``header`` against ``probe`` (what the receiving cache expects: its
    fingerprint, formats and row shapes per group) before any buffer is allocated.

    Returns the heads ``(first, stop)`` of the sender's range the receiver keeps (the overlap
    with ``need``, the receiver's head range), or None when they do not overlap.
    Raises :class:`Refusal` with the reason on any mismatch.
    """
    if int(header["n_kv_heads"]) != n_kv_heads:
        raise Refusal(f"n_kv_heads differs: the sender's model has {header['n_kv_heads']}, this "
                      f"cache {n_kv_heads}")
    diff = _first_diff(_strip(header["fingerprint"]), _strip(probe.fingerprint))
    if diff is not None:
        sent = _lookup(header["fingerprint"], diff)
        mine = _lookup(probe.fingerprint, diff)
        raise Refusal(f"fingerprint differs at {diff!r}: the sender has {sent!r}, this cache "
                      f"{mine!r}")
    parts = header["parts"]
    if len(parts) != len(probe.parts):
        raise Refusal(f"the sender's cache has {len(parts)} layer groups, this one "
                      f"{len(probe.parts)}")
    first, stop = header["head_range"]
    if stop > n_kv_heads:
        raise Refusal(f"head_range {first, stop} exceeds n_kv_heads={n_kv_heads}")
    held = stop - first
    for g, (p, mine) in enumerate(zip(parts, probe.parts)):
        for side in ("k_format", "v_format"):
            if p[side] != mine[side]:
                raise Refusal(f"group {g}: {side} differs: the sender stores {p[side]!r}, this "
                              f"cache {mine[side]!r}")
        if p["n_layers"] != mine["n_layers"]:
            raise Refusal(f"group {g}: the sender has {p['n_layers']} layers, this cache "
                          f"{mine['n_layers']}")
        for side in ("k", "v"):
            want_row, want_dt = [held, mine[f"{side}_row"]], mine[f"{side}_dtype"]
            for layer in range(mine["n_layers"]):
                if list(p[f"{side}_row"][layer]) != want_row:
                    raise Refusal(f"group {g} layer {layer}: {side.upper()} rows are "
                                  f"{p[f'{side}_row'][layer]} (heads, row), expected {want_row}")
                if p[f"{side}_dtype"][layer] != want_dt:
                    raise Refusal(f"group {g} layer {layer}: {side.upper()} dtype "
                                  f"{p[f'{side}_dtype'][layer]} differs from {want_dt}")
        pos = p["positions"]
        if pos.size and (pos.min() < 0 or np.any(np.diff(pos.astype(np.int64)) < 0)):
            raise Refusal(f"group {g}: positions must be >= 0 and ascending")
        # room, from the header, before a byte of the rows is allocated
        if mine.get("n_cells") is not None and pos.size > mine["n_cells"]:
            raise Refusal(f"group {g}: no room: the sequence has {pos.size} positions, this "
                          f"cache holds {mine['n_cells']} cells in all")
        if mine.get("n_free") is not None and pos.size > mine["n_free"]:
            raise Refusal(f"group {g}: no room: the sequence has {pos.size} positions and "
                          f"{mine['n_free']} cells are free")
    lo, hi = max(first, need[0]), min(stop, need[1])
    return (lo, hi) if lo < hi else None


def _lookup(fp: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        if isinstance(fp, dict):
            fp = fp.get(key, "(not recorded)")
        elif isinstance(fp, (list, tuple)) and key.isdigit() and int(key) < len(fp):
            fp = fp[int(key)]
        else:
            return "(not recorded)"
    return fp


def plan_cover(ranges: Sequence[Optional[Tuple[int, int]]],
               need: Tuple[int, int]) -> List[Optional[Tuple[int, int]]]:
    """Which heads to take from each source: ``ranges[i]`` is the overlap of source ``i`` with
    ``need``. Sources are used in order of their first head; a source that adds nothing beyond
    what earlier ones cover (replicated heads) gets None. Raises :class:`Refusal` unless the
    taken ranges tile ``need`` exactly."""
    order = sorted((r[0], i) for i, r in enumerate(ranges) if r is not None)
    take: List[Optional[Tuple[int, int]]] = [None] * len(ranges)
    cursor = need[0]
    for first, i in order:
        r = ranges[i]
        if r[1] <= cursor:
            continue
        if first > cursor:
            break
        take[i] = (cursor, r[1])
        cursor = r[1]
    if cursor != need[1]:
        have = sorted(r for r in ranges if r is not None)
        raise Refusal(f"the senders' heads {have} do not cover this cache's heads "
                      f"[{need[0]}, {need[1]}) (missing from head {cursor})")
    return take


def part_layout(p: Dict[str, Any],
                heads: Optional[int] = None) -> Tuple[int, List[Tuple[int, tuple, str]]]:
    """``(nbytes, [(offset, shape, dtype), ...])`` of one part's flat payload: for each layer
    its K rows ``[n, heads, row]`` then its V rows, each C-contiguous in the stored dtype.
    ``heads``: the heads that travel (the receiver's share), default all the header's."""
    n = int(p["n"])
    entries, offset = [], 0
    for layer in range(int(p["n_layers"])):
        for side in ("k", "v"):
            row = list(map(int, p[f"{side}_row"][layer]))
            if heads is not None:
                row[0] = int(heads)
            shape = (n, *row)
            dt = np.dtype(p[f"{side}_dtype"][layer])
            entries.append((offset, shape, dt.str))
            offset += int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    return offset, entries


def parse_heads(reason: str, held: Tuple[int, int]) -> Tuple[int, int]:
    """The heads ``(lo, hi)`` an OK verdict asks for (``"lo hi"``), inside ``held``; an old or
    empty verdict means all of them."""
    try:
        lo, hi = (int(x) for x in reason.split())
    except ValueError:
        return tuple(held)
    if not held[0] <= lo < hi <= held[1]:
        from ._errors import TransferError
        raise TransferError(f"the receiver asked for heads {lo, hi} outside {tuple(held)}")
    return lo, hi


def encode_verdict(code: int, reason: str = "") -> np.ndarray:
    out = np.zeros(VERDICT_BYTES, np.uint8)
    out[0] = code
    raw = reason.encode("utf-8")[:VERDICT_BYTES - 1]
    out[1:1 + len(raw)] = np.frombuffer(raw, np.uint8)
    return out


def decode_verdict(buf: np.ndarray) -> Tuple[int, str]:
    raw = bytes(buf[1:]).rstrip(b"\0")
    return int(buf[0]), raw.decode("utf-8", errors="replace")
