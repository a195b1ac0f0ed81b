"""The protocol between the prefix store and the byte tiers below host RAM (disk, Redis/Valkey).

A byte tier stores **runs**: the snapshot bytes (``SeqSnapshot.to_bytes()``, the state codec) of
a run of consecutive token blocks of one prompt, under a run key, plus a pointer from every block
key the run covers to ``(run key, index of the block in the run)``. Keys are lower-case hex
strings made by the store (a chained blake2b over token bytes, parent key, salt, fingerprint and
layout); the tier adds its own namespace (``"nkv1-<16 hex>"``: one model fingerprint + storage
layout + head range) and a format version, so two models, two layouts or two format versions
never read each other's bytes.

Rules every tier follows:

- **Nothing raises on I/O.** A missing entry, an I/O error, a full disk, a server that is down or
  slower than the caller's timeout: ``find_blocks``/``read_runs`` answer ``None`` for it and
  ``write_run`` answers ``False``, counted in ``stats()`` (``misses``, ``errors``). Bad *arguments*
  (a key that is not hex, bytes that are not bytes) are the caller's bug: ``ValueError`` before
  anything changes, as everywhere in numbakv.
- **Atomic entries.** A reader sees a run's bytes whole or not at all, whatever happens to the
  writer (``kill -9``, disk full, a second writer of the same key).
- **One request per batch.** ``find_blocks`` answers every block key with one round trip (one
  Redis ``MGET``; the disk tier's in-memory index, refreshed from its log with one read), and
  ``read_runs`` reads every run with one request (Redis ``MGET``) or one read per file.
- **Hard budget.** ``write_run`` evicts least-recently-used runs of its namespace until the new
  run fits ``budget_bytes``, across every process sharing the directory or server; a run larger
  than the budget is refused (``False``).
- The tier does not parse the bytes: the store does (``SeqSnapshot.from_bytes`` checks the
  header, the crc32 checksum and the fingerprint) and calls :meth:`ByteTier.report_invalid`
  for bytes it rejects, which drops the run and counts it.
"""

from __future__ import annotations

import abc
import re
import threading
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["ByteTier", "FORMAT_VERSION", "check_key", "check_keys", "check_namespace",
           "check_budget", "BIND_FIRST", "check_data", "check_chunks", "BIND_RUN",
           "BIND_BLOCKS", "binding",
           "is_bound", "RunReader"]

#: Version of the tiers' on-disk / in-server layout; part of every path and key, so a future
#: layout never reads this one's entries (it misses instead).
FORMAT_VERSION = 1

_KEY = re.compile(r"[0-9a-f]{8,128}\Z")
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


def check_key(key, what: str = "key") -> str:
    """``key`` if it is a lower-case hex string of 8 to 128 digits (what the store's blake2b keys
    are); else ``ValueError`` naming ``what``. Keys become file names and Redis keys, so nothing
    else (no ``/``, no ``..``, no glob or hash-tag characters) may get through."""
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError(f"{what} must be a lower-case hex string of 8 to 128 digits, "
                         f"got {key!r:.80}")
    return key


_KEYS = re.compile(r"[0-9a-f]{8,128}(?:,[0-9a-f]{8,128})*\Z")


def check_keys(keys, what: str = "block_keys") -> List[str]:
    """A list of hex keys (see :func:`check_key`); ``keys`` must be a sequence, not a string.
    Checked with one pattern match over the joined keys (a prompt has hundreds); the message of
    a failure names the first bad one."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise ValueError(f"{what} must be a sequence of hex strings, got {type(keys).__name__}")
    keys = list(keys)
    try:
        joined = ",".join(keys)
        # the comma count rules out a key that itself holds a comma
        if not keys or (_KEYS.match(joined) and joined.count(",") == len(keys) - 1):
            return keys
    except TypeError:   # not all str
        pass
    return [check_key(k, f"{what}[{i}]") for i, k in enumerate(keys)]


def check_namespace(namespace) -> str:
    """``namespace`` if it is 1-128 characters of ``[A-Za-z0-9._-]`` starting with a letter or
    digit (the store passes ``"nkv1-<16 hex>"``); else ``ValueError``."""
    if not isinstance(namespace, str) or not _NAMESPACE.match(namespace):
        raise ValueError("namespace must be 1-128 characters of [A-Za-z0-9._-] starting with a "
                         f"letter or digit (e.g. 'nkv1-0123456789abcdef'), got {namespace!r:.80}")
    return namespace


def check_budget(budget_bytes) -> int:
    """``budget_bytes`` as an int >= 0 (0: the tier stores nothing); else ``ValueError``."""
    if isinstance(budget_bytes, bool) or not hasattr(budget_bytes, "__index__"):
        raise ValueError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
    budget = int(budget_bytes.__index__())
    if budget < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget}")
    return budget


#: snapshot metadata that binds a run's bytes to their key: the run key and the block keys
#: (csv, first to last) of the prompt they hold. The store writes them into the snapshot
#: (``SeqSnapshot.to_bytes(binding(keys))``, covered by its checksum) and checks them on every
#: read (:func:`is_bound`), whichever tier the bytes came from.
BIND_RUN, BIND_BLOCKS = "prefix.run", "prefix.blocks"
#: snapshot metadata of a *chained* run (written when the tier held the prompt's first blocks
#: already): the index of the first block whose rows it holds (absent: 0, the whole prompt)
BIND_FIRST = "prefix.first"


def binding(block_keys: Sequence[str]) -> Dict[str, str]:
    """The metadata binding a run's bytes to ``block_keys`` (its last key is the run key)."""
    return {BIND_RUN: block_keys[-1], BIND_BLOCKS: ",".join(block_keys)}


def is_bound(metadata: Dict[str, str], run_key: str, block: int, block_key: str) -> bool:
    """Whether bytes whose snapshot metadata is ``metadata``, read under ``run_key`` through the
    pointer of block number ``block`` (key ``block_key``), are that run and hold that block: a
    file copied or linked under another run's name, a value of another run, or a pointer
    rewritten to another run fail."""
    blocks = metadata.get(BIND_BLOCKS, "")
    if metadata.get(BIND_RUN) != run_key or not blocks.endswith(run_key) or block < 0:
        return False
    # the store's keys have one length: the block's key sits at a known offset (no split of
    # a 2k-block prompt's list on every hit); anything else is checked the long way
    width = len(block_key)
    at = block * (width + 1)
    if blocks[at:at + width] == block_key and (at + width == len(blocks)
                                               or blocks[at + width] == ","):
        return at == 0 or blocks[at - 1] == ","
    keys = blocks.split(",")
    return block < len(keys) and keys[block] == block_key


def check_data(data) -> memoryview:
    """``data`` (bytes-like, C-contiguous) as a flat byte memoryview; else ``ValueError``."""
    try:
        view = memoryview(data)
    except TypeError:
        raise ValueError(f"data must be bytes-like, got {type(data).__name__}") from None
    if not view.c_contiguous:
        raise ValueError("data must be a contiguous bytes-like object")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def check_chunks(data) -> List[memoryview]:
    """``data`` (one bytes-like object, or a list/tuple of them: a run's bytes in pieces, e.g.
    ``SeqSnapshot.to_chunks()``, written as if joined) as a list of flat byte memoryviews;
    else ``ValueError``."""
    if isinstance(data, (list, tuple)):
        out = []
        for i, chunk in enumerate(data):
            try:
                out.append(check_data(chunk))
            except ValueError as exc:
                raise ValueError(f"data[{i}]: {exc}") from None
        return out
    return [check_data(data)]


class RunReader:
    """A run's bytes opened for reading in pieces (``ByteTier.open_run``): ``size`` bytes;
    :meth:`read_into` fills caller buffers (a cache's rows) from an offset, so a hit lands in
    the cells without a whole-run buffer. This one serves bytes already in memory (a Redis
    reply, one ``MGET``): the rows are copied once, from the reply into the cells."""

    def __init__(self, data) -> None:
        self._data = check_data(data)
        self.size = len(self._data)

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> bool:
        """Fill ``buffers`` (flat writable byte views) in order with the bytes from
        ``offset`` on; False when the run ends first (nothing else is promised then)."""
        data = self._data
        for buf in buffers:
            n = len(buf)
            if offset + n > self.size:
                return False
            buf[:] = data[offset:offset + n]
            offset += n
        return True

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes from ``offset`` (fewer at the end of the run)."""
        return bytes(self._data[offset:offset + n])

    def close(self) -> None:
        self._data = memoryview(b"")

    def __enter__(self) -> "RunReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ByteTier(abc.ABC):
    """A store of runs below host RAM: see the module docstring for the rules.

    Subclasses: :class:`numbakv.prefix.tiers.disk.DiskTier` (``name = "disk"``) and
    :class:`numbakv.prefix.tiers.redis.RedisTier` (``name = "redis"``); build one from a
    directory or a URL with :func:`numbakv.prefix.tiers.open_tier`.

    Counters (per process, in :meth:`stats`): ``hits`` / ``misses`` count runs ``read_runs``
    returned / could not return; ``block_hits`` / ``block_misses`` count block keys
    ``find_blocks`` resolved / did not; ``invalid`` counts :meth:`report_invalid`; ``errors``
    counts I/O failures and timeouts (each also a miss or a refused write); ``writes`` and
    ``evictions`` count runs written and runs this process evicted. The instance is thread-safe.
    """

    #: "disk" or "redis"
    name: str = ""
    #: whether :meth:`write_run` takes ``data`` as a list of pieces (``SeqSnapshot.to_chunks``);
    #: the store's writer joins them for a tier that does not say so
    accepts_chunks: bool = True

    def __init__(self, namespace: str, budget_bytes: int) -> None:
        self.namespace = check_namespace(namespace)
        self.budget_bytes = check_budget(budget_bytes)
        self._lock = threading.RLock()
        self._closed = False
        self._counts: Dict[str, int] = {k: 0 for k in (
            "hits", "misses", "block_hits", "block_misses", "invalid", "errors", "writes",
            "evictions")}

    # -- the protocol --------------------------------------------------------------------------
    @abc.abstractmethod
    def find_blocks(self, block_keys: Sequence[str]) -> List[Optional[Tuple[str, int]]]:
        """For each of ``block_keys``: ``(run key, index of the block in that run)`` or ``None``,
        with ONE round trip (Redis ``MGET``; disk: the index, refreshed from the shared log with
        one read and rebuilt by scanning when missing). An I/O failure is a miss (counted), never
        an exception. A pointer may outlive its run (another process evicted it): the store then
        misses in :meth:`read_runs`."""

    @abc.abstractmethod
    def read_runs(self, run_keys: Sequence[str]) -> List[Optional[bytes]]:
        """The bytes of each run (as written) or ``None`` (missing, I/O error, timeout: counted),
        with one request (Redis ``MGET``) / one read per file. Marks each run read as recently
        used (LRU)."""

    def open_run(self, run_key: str) -> Optional[RunReader]:
        """``run_key``'s bytes as a :class:`RunReader` (counted as :meth:`read_runs` counts a
        read), or ``None`` (missing, I/O error, timeout). The disk tier's reads straight from
        the file (``preadv`` into the caller's buffers); the default reads the run whole."""
        data = self.read_runs([run_key])[0]
        return None if data is None else RunReader(data)

    @abc.abstractmethod
    def write_run(self, run_key: str, block_keys: Sequence[str], data) -> bool:
        """Store ``data`` (a run's snapshot bytes: one bytes-like object or a list of them, the
        pieces of one run in order, e.g. ``SeqSnapshot.to_chunks()``) under ``run_key`` with a
        pointer from ``block_keys[i]`` to ``(run_key, i)``, atomically (readers see all or
        nothing), evicting least-recently-used runs of this namespace so the total stays within
        ``budget_bytes``.
        ``True`` when stored (or already there); ``False`` when it cannot (larger than the
        budget, disk full, read-only, server down or slow). Never raises on I/O."""

    @abc.abstractmethod
    def remove_run(self, run_key: str) -> None:
        """Drop a run and the pointers to it (nothing when absent; I/O failures are counted)."""

    def report_invalid(self, run_key: str) -> None:
        """The store found ``run_key``'s bytes corrupt or foreign: count it in
        ``stats()["invalid"]`` and drop the run, so nobody reads it again."""
        check_key(run_key, "run_key")
        self._count("invalid")
        self.remove_run(run_key)

    @abc.abstractmethod
    def clear(self) -> int:
        """Remove every run of this namespace (other namespaces untouched); returns how many."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """``bytes_used``, ``bytes_evictable`` (= used: no byte tier pins), ``bytes_pinned``
        (0), ``bytes_free`` (they sum to ``budget_bytes``), ``entries`` (runs held by every
        process of this namespace), and this process's counters (see the class docstring)."""

    def close(self) -> None:
        """Release files / connections; later calls miss (reads) or refuse (writes)."""
        self._closed = True

    # -- helpers -------------------------------------------------------------------------------
    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def _budget_stats(self, used: int, entries: int) -> dict:
        used = max(0, int(used))  # above the budget only if another process set a larger one
        out = {"bytes_used": used, "bytes_evictable": used, "bytes_pinned": 0,
               "bytes_free": max(0, self.budget_bytes - used), "entries": int(entries),
               "budget_bytes": self.budget_bytes}
        with self._lock:
            out.update(self._counts)
        return out

    def __enter__(self) -> "ByteTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(namespace={self.namespace!r}, "
                f"budget_bytes={self.budget_bytes})")
