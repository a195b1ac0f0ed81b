"""Tier 1 of the prefix store: host RAM under a hard byte budget.

Entries demoted from tier 0 (the cache's cells) are kept here as ``SeqSnapshot`` objects
(``cache.export_seq``: numpy rows in the stored format, quantized blocks stay quantized; on a GPU
the snapshot engineer's export copies through pinned host memory on the cache's stream). A hit
promotes one back with ``cache.import_seq`` (one batched copy per layer). This class only keeps
the accounts; the index (``index.py``) keeps the entries, the store decides what moves.
"""

from __future__ import annotations

import platform
import sys
import threading
from typing import Any, Dict, Optional

import numpy as np

#: whether ``sys.getrefcount`` tells that nobody but the pool holds a buffer (CPython)
_REFCOUNTS = platform.python_implementation() == "CPython"


class BufferPool:
    """Flat host buffers (uint8) recycled between the prefix store's owned copies of rows (host
    tier entries, write-through jobs): a copy into memory already faulted in runs at
    ``np.copyto`` speed, a copy into fresh memory pays a page fault per 4 KiB page (about as
    much again on Linux without transparent huge pages).

    A buffer given back (:meth:`give`) is reused only once nothing else references it: every
    row view of a snapshot keeps its buffer alive, so a writer still encoding a job, or a host
    entry still serving hits, keeps its buffer out of reach (CPython's reference count says so;
    elsewhere nothing is recycled). At most ``max_idle_bytes`` of buffers wait for reuse (the
    store passes its host budget plus its write queue bound: memory it may hold anyway);
    beyond that, buffers are dropped to the allocator. Thread-safe."""

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = int(max_idle_bytes)
        self._idle: Dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self.reused = self.allocated = 0

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._idle.values())

    def take(self, nbytes: int) -> np.ndarray:
        """A flat uint8 buffer of ``nbytes`` (a view of a recycled buffer of at most twice that
        size nobody holds, else a fresh one)."""
        nbytes = int(nbytes)
        best: Optional[np.ndarray] = None
        if _REFCOUNTS and nbytes >= 1 << 16:
            with self._lock:
                for key in list(self._idle):
                    buf = self._idle[key]
                    # refs: the dict, `buf`, getrefcount's argument: nobody else holds it
                    if nbytes <= buf.nbytes <= 2 * nbytes and sys.getrefcount(buf) <= 3 \
                            and (best is None or buf.nbytes < best.nbytes):
                        best = buf
                if best is not None:
                    del self._idle[id(best)]
                    self.reused += 1
        if best is None:
            self.allocated += 1
            return np.empty(nbytes, np.uint8)
        return best[:nbytes]

    def give(self, snap) -> None:
        """Offer the buffer under ``snap``'s rows (a snapshot this pool's :meth:`take` backed:
        others are ignored) for reuse once nobody holds it."""
        parts = getattr(snap, "parts", None)
        if not parts or not parts[0].keys:
            return
        base = getattr(parts[0].keys[0], "base", None)
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        if not isinstance(base, np.ndarray) or base.dtype != np.uint8 or base.ndim != 1 \
                or not base.flags.owndata or base.nbytes < 1 << 16:
            return
        with self._lock:
            self._idle[id(base)] = base
            self._trim(self.max_idle_bytes)

    def trim(self, max_idle_bytes: int) -> None:
        """Drop idle buffers (largest first) until at most ``max_idle_bytes`` wait."""
        with self._lock:
            self._trim(max_idle_bytes)

    def _trim(self, limit: int) -> None:
        total = sum(b.nbytes for b in self._idle.values())
        for key, buf in sorted(self._idle.items(), key=lambda kv: -kv[1].nbytes):
            if total <= limit:
                break
            del self._idle[key]
            total -= buf.nbytes

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()


def owned_copy(snap, pool: Optional[BufferPool] = None):
    """``snap`` with rows of its own, all of them in one flat buffer (from ``pool`` when
    given: recycled memory): an export may hand out views of the cache's storage (a run of
    cells), which later writes to those cells would change. Rows that already own their data
    (gathered) are kept as they are. One ``np.copyto`` per layer and side, no other copy."""
    arrays = [a for p in snap.parts for a in (*p.keys, *p.values)]
    # an export's views of the cache's storage are read-only; gathered rows (``alloc``'s
    # buffer, or arrays of their own) are writable and belong to the snapshot already
    if all(isinstance(a, np.ndarray) and (a.flags.owndata or a.flags.writeable)
           for a in arrays):
        return snap
    if not all(isinstance(a, np.ndarray) for a in arrays):
        return snap.copy()
    total = sum(-(-a.nbytes // 64) * 64 for a in arrays)
    flat = pool.take(total) if pool is not None else np.empty(total, np.uint8)
    at = 0

    def own(a: np.ndarray) -> np.ndarray:
        nonlocal at
        out = flat[at:at + a.nbytes].view(a.dtype).reshape(a.shape)
        np.copyto(out, a)
        at += -(-a.nbytes // 64) * 64
        return out
    return with_rows(snap, own)


def with_rows(snap, own):
    """``snap`` with every K/V row array ``a`` of its parts replaced by ``own(a)`` and its
    positions copied (the recurrent part, when there is one, is kept: an export owns it)."""
    parts = tuple(type(p)(positions=np.array(p.positions, copy=True),
                          keys=tuple(own(a) for a in p.keys),
                          values=tuple(own(a) for a in p.values), k_format=p.k_format,
                          v_format=p.v_format) for p in snap.parts)
    if getattr(snap, "recurrent", None) is not None:
        return snap._with(parts=parts)      # the recurrent part owns its arrays (an export)
    return type(snap)(parts=parts, fingerprint=snap.fingerprint, head_range=snap.head_range)


class HostTier:
    """Byte accounting of the host tier: ``budget_bytes`` is a hard limit (``used <= budget``
    always; the store evicts before it adds)."""

    name = "host"

    def __init__(self, budget_bytes: int) -> None:
        self.budget = int(budget_bytes)
        self.used = 0
        self.pinned = 0
        self.entries = 0

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit the budget now."""
        return self.used + nbytes <= self.budget

    def add(self, nbytes: int) -> None:
        if self.used + nbytes > self.budget:   # the store evicts first: a bug if reached
            raise AssertionError(f"host tier over budget: {self.used} + {nbytes} > "
                                 f"{self.budget}")
        self.used += nbytes
        self.entries += 1

    def remove(self, nbytes: int) -> None:
        self.used -= nbytes
        self.entries -= 1

    def stats(self) -> Dict[str, Any]:
        used = self.used
        pinned = min(self.pinned, used)
        return {"bytes_used": used, "bytes_evictable": used - pinned, "bytes_pinned": pinned,
                "bytes_free": self.budget - used, "entries": self.entries}


__all__ = ["HostTier", "BufferPool", "owned_copy", "with_rows"]
