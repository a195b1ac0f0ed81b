"""``PrefixStore``: reuse any earlier request's prefix, token by token, from a bounded, tiered
store - tier 0 the cache's own cells, tier 1 host RAM, then (when configured) a disk directory
and a Redis/Valkey server (``tiers/disk.py``, ``tiers/redis.py``, imported only when used).

How it works (``docs/prefix.md`` has the user's view):

* **Keys.** Prompts are cut into blocks of ``block_tokens``; each block's key is a chained
  blake2b over its token ids, its parent's key, the salt, the model fingerprint and the storage
  layout (``keys.py``). The in-memory index (``index.py``) walks blocks by their token bytes and
  matches a partial last block token by token.
* **Tier 0.** ``save(seq, tokens)`` makes one of the store's ``retain_seqs`` share ``seq``'s cells
  (``copy_prefix``: metadata only); a later ``load`` does the same the other way. The K/V of a
  prefix is never copied while it is in cells, however many sequences share it.
* **Room.** The store registers itself as the cache's room provider: when ``start_forward`` finds
  no contiguous run of free cells, the store evicts its least recently (or frequently) used,
  unpinned tier-0 entries first - demoting them to host RAM when ``host_bytes`` allows - then the
  cache goes on as Ollama does (defrag, else ``KVCacheFullError``). If that pass still fails, the
  evicted entries stay evicted (demoted where they fit): they were the store's cached prefixes,
  never a request's tokens; every request sequence is exactly as before.
* **Tier 1.** Demoted entries are ``SeqSnapshot`` objects (``cache.export_seq``) under the
  ``host_bytes`` hard budget, least recently used first out (to disk/Redis when configured). A
  hit imports them (``cache.import_seq``) and promotes the prefix back to cells.
* **Tiers 2 and 3** (disk, Redis/Valkey; ``tiers/``): every ``save`` is written through to them
  by a bounded background writer (``writer.py``): the request copies the prompt's rows out of
  the cells and goes on; ``flush()`` waits for the writer, ``close()`` (also at interpreter exit)
  writes the rest. Entries that leave host RAM are written there too (if not already).
* **Sliding windows.** On caches with a window memory (``CausalCache(swa_window=...)`` or a
  ``WrapperCache`` with such a group) a sequence only keeps the last ``swa_memory`` positions of
  its sliding layers, so an entry can resume only where its window is still whole: ``match``
  answers the deepest *checkpoint* at or below the token match - an entry's end, a checkpoint
  ``checkpoint_tail`` tokens before each saved prompt's end (kept when the window memory still
  covers it: ``swa_memory >= swa_window + checkpoint_tail``), or a position the caller marked with
  ``checkpoint(seq)`` (e.g. mid-prefill, before the last tokens of a prompt).

Tier 0's budget, as ``stats()`` reports it: the bytes of the cells the retained sequences hold
(so ``bytes_free`` is 0 there; cells are shared with requests and the cache's free cells are not
the store's). ``bytes_used = bytes_evictable + bytes_pinned`` and ``bytes_used + bytes_free =
budget`` for every tier.
"""

from __future__ import annotations

import array
import atexit
import bisect
import math
import os
import sys
import time
import weakref
from collections import OrderedDict, defaultdict
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import KVCacheError, KVCacheFullError, NotSupportedError, StateError
from . import events as ev
from . import edit as _edit
from .edit import EditMatch
from .index import BlockIndex, Entry, Match
from .keys import KEYED_BIT, block_keys, fold_extra_keys, namespace, root_digest
from .policy import DEFAULT_PRIORITY, PRIORITY_RANGE, Retention, make_policy
from .tiers.base import BIND_FIRST, BIND_RUN, is_bound
from .tiers.host import BufferPool, HostTier, owned_copy, with_rows
from .writer import Job, TierWriter

CELLS, HOST = "cells", "host"
#: token ids as the store takes them: a list/tuple of ints or a 1-D integer numpy array ``[n]``
TokenIds = Union[Sequence[int], np.ndarray]
#: ``[(start, end, key_bytes)]``: keys folded into the chained keys of the tokens from ``start`` on
ExtraKeys = Optional[Sequence[Tuple[int, int, bytes]]]
_MAX_PENDING = 4   # checkpoints per sequence waiting for its save()
#: the floor of an entry that can serve no length at all (its window pruned the whole prefix)
_NEVER = 1 << 62
_MAX_DISTRUST = 4096

#: int64 in the machine's order is int64 little-endian (the keys' byte order): lists of token
#: ids are packed by the array module
_NATIVE_LE = sys.byteorder == "little" and array.array("q").itemsize == 8

#: stores still open, closed at interpreter exit (weak: the registry keeps none alive)
_LIVE: "weakref.WeakSet[PrefixStore]" = weakref.WeakSet()


def _close_live_stores() -> None:
    """At interpreter exit: close every open store, so what they hold and what their writers
    have queued reaches the disk / Redis tiers (a process that forgot ``close()`` keeps it)."""
    for store in list(_LIVE):
        try:
            store.close()
        except Exception:   # noqa: BLE001 - exiting: one store's failure must not stop others
            pass


atexit.register(_close_live_stores)


def _int_arg(name: str, value, low: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if int(value) < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")
    return int(value)


def token_buffer(tokens, name: str = "tokens") -> bytes:
    """``tokens`` (a 1-D sequence of non-negative integer token ids: list, tuple, numpy array)
    as int64 little-endian bytes. Anything else (floats, bools, strings, nested lists, negative
    ids) is a ``ValueError`` naming ``name``."""
    if isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, (list, tuple, range)):
        if tokens and isinstance(tokens[0], (bool, np.bool_)):
            raise ValueError(f"{name} must hold integer token ids, got a bool")
        if _NATIVE_LE:
            # Python ints straight into int64 (a 4k-token list: ~2/3 of np.asarray's time,
            # which infers a dtype first; most of a tier-0 hit from a list). Anything that
            # is not an integer in int64's range takes the checked path below
            try:
                packed = array.array("q", tokens)
            except (TypeError, OverflowError):
                packed = None
            if packed is not None:
                low = int(np.frombuffer(packed, np.int64).min()) if packed else 0
                if low < 0:
                    raise ValueError(f"{name} must hold non-negative token ids, got {low}")
                return packed.tobytes()
        try:
            arr = np.asarray(tokens)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{name} must be a 1-D sequence of integer token ids: {exc}") \
                from None
        if len(tokens) == 0:
            arr = np.zeros(0, np.int64)
    else:
        raise ValueError(f"{name} must be a list, tuple or 1-D numpy array of integer token ids, "
                         f"got {type(tokens).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    if arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise ValueError(f"{name} must hold non-negative token ids, got {int(arr.min())}")
    if arr.size and arr.dtype.kind == "u" and arr.dtype.itemsize == 8 \
            and int(arr.max()) >= 2**63:
        raise ValueError(f"{name} holds a token id >= 2**63")
    if arr.dtype != np.dtype("<i8"):
        arr = arr.astype("<i8")
    return arr.tobytes()


def _priority_arg(priority, name: str = "priority") -> int:
    """``priority`` as an int in 0..100 (TensorRT-LLM's retention range); else ValueError."""
    low, high = PRIORITY_RANGE
    if isinstance(priority, (bool, np.bool_)) or not isinstance(priority, (int, np.integer)) \
            or not low <= int(priority) <= high:
        raise ValueError(f"{name} must be an integer in {low}..{high}, got {priority!r}")
    return int(priority)


def _ttl_arg(ttl) -> Optional[float]:
    """``ttl`` (seconds) as a float >= 0, or None (no expiry); else ValueError."""
    if ttl is None:
        return None
    if isinstance(ttl, (bool, np.bool_)) or not isinstance(ttl, (int, float, np.integer,
                                                               np.floating)):
        raise ValueError(f"ttl must be a number of seconds >= 0 or None, got {ttl!r}")
    if not math.isfinite(float(ttl)) or float(ttl) < 0:
        raise ValueError(f"ttl must be a finite number of seconds >= 0 or None, got {ttl!r}")
    return float(ttl)


def _extra_keys_arg(extra_keys, buf: bytes) -> Optional[List[Tuple[int, int, bytes]]]:
    """Check ``extra_keys`` against the prompt ``buf`` (int64-LE): a list of ``(start, end,
    key_bytes)`` with ``0 <= start < end <= len(tokens)``, sorted by ``start`` and not
    overlapping, ``key_bytes`` non-empty bytes; the tokens they cover must be < 2**62 (keyed
    ids live above). None or empty: no extra keys."""
    if extra_keys is None:
        return None
    if isinstance(extra_keys, (str, bytes, bytearray, dict)) or not hasattr(extra_keys,
                                                                           "__iter__"):
        raise ValueError(f"extra_keys must be a list of (start, end, key_bytes) ranges, got "
                         f"{type(extra_keys).__name__}")
    n = len(buf) // 8
    out: List[Tuple[int, int, bytes]] = []
    prev_end = 0
    for i, item in enumerate(extra_keys):
        if not isinstance(item, (tuple, list)) or len(item) != 3:
            raise ValueError(f"extra_keys[{i}] must be a (start, end, key_bytes) triple, got "
                             f"{item!r:.80}")
        start, end, key = item
        for what, v in (("start", start), ("end", end)):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"extra_keys[{i}] {what} must be an integer token index, got "
                                 f"{v!r}")
        start, end = int(start), int(end)
        if not 0 <= start < end <= n:
            raise ValueError(f"extra_keys[{i}] must cover a token range 0 <= start < end <= "
                             f"len(tokens)={n}, got ({start}, {end})")
        if start < prev_end:
            raise ValueError(f"extra_keys must be sorted by start and not overlap: "
                             f"extra_keys[{i}] starts at {start}, before the previous range's "
                             f"end {prev_end}")
        if not isinstance(key, (bytes, bytearray)) or not key:
            raise ValueError(f"extra_keys[{i}] key must be non-empty bytes (e.g. an image's "
                             f"content hash, a LoRA id), got {key!r:.80}")
        out.append((start, end, bytes(key)))
        prev_end = end
    if out:
        toks = np.frombuffer(buf, "<i8")
        for i, (start, end, _) in enumerate(out):
            if int(toks[start:end].max()) >= KEYED_BIT:
                raise ValueError(f"tokens under extra_keys[{i}] must be < 2**62 (ids above are "
                                 "the store's keyed ids)")
    return out or None


def _recurrent(cache) -> Any:
    """The ``RecurrentCache`` of a ``HybridCache`` (None for an attention-only cache)."""
    return getattr(cache, "rc", None) if hasattr(cache, "layer_kinds") else None


def _attention(cache) -> Any:
    """The cache holding the K/V: a HybridCache's attention half, else ``cache``."""
    return cache.attn if _recurrent(cache) is not None else cache


def _groups(cache) -> List[Any]:
    """The ``CausalCache`` objects under ``cache`` (itself, or a WrapperCache's caches; a
    HybridCache's attention half)."""
    cache = _attention(cache)
    inner = getattr(cache, "caches", None)
    return list(inner) if inner else [cache]


def _slice_snapshot(snap, n: int):
    """The rows of ``snap`` at positions ``< n`` (every part), as a new snapshot of views; a
    hybrid snapshot keeps its recurrent entries at positions ``<= n``."""
    if getattr(snap, "recurrent", None) is not None:
        return snap.below(n)
    if all(len(p.positions) == 0 or int(p.positions[-1]) < n for p in snap.parts):
        return snap
    parts = []
    for p in snap.parts:
        k = int(np.searchsorted(p.positions, n))
        parts.append(type(p)(positions=p.positions[:k], keys=tuple(a[:k] for a in p.keys),
                             values=tuple(a[:k] for a in p.values), k_format=p.k_format,
                             v_format=p.v_format))
    return type(snap)(parts=tuple(parts), fingerprint=snap.fingerprint,
                      head_range=snap.head_range)


def _common_prefix(a: bytes, b: bytes) -> int:
    """Tokens two int64-LE prompts share from the start."""
    n = min(len(a), len(b)) // 8
    x = np.frombuffer(a, "<i8", n) != np.frombuffer(b, "<i8", n)
    return int(np.argmax(x)) if x.any() else n


def _range_snapshot(snap, a: int, b: int):
    """The rows of ``snap`` at positions ``[a, b)`` (every part), as a new snapshot of views."""
    parts = []
    for p in snap.parts:
        i, j = (int(x) for x in np.searchsorted(p.positions, [a, b]))
        parts.append(type(p)(positions=p.positions[i:j], keys=tuple(x[i:j] for x in p.keys),
                             values=tuple(x[i:j] for x in p.values), k_format=p.k_format,
                             v_format=p.v_format))
    return type(snap)(parts=tuple(parts), fingerprint=snap.fingerprint,
                      head_range=snap.head_range)


def _owned(snap):
    """``snap`` with rows of its own: an export may hand out views of the cache's storage
    (contiguous runs), which later writes to those cells would change. Rows that own their data
    (gathered) are kept as they are."""
    def own(a):
        if isinstance(a, np.ndarray) and a.flags.owndata:
            return a
        return a.copy()
    if all(isinstance(a, np.ndarray) and a.flags.owndata
           for p in snap.parts for a in (*p.keys, *p.values)):
        return snap
    return with_rows(snap, own)


class PrefixStore:
    """A content-addressed prefix store over ``cache`` (see the module docstring).

    Args:
        cache: a ``CausalCache`` or ``WrapperCache`` (e.g. ``hf.cache_for``'s).
        retain_seqs: sequence ids of ``cache`` the store may use to keep prefixes in cells
            (tier 0). They must be empty, and are never to be handed to requests
            (``PromptCache(store=...)`` skips them). Empty: no tier 0 (``save`` then copies
            the prefix straight to host RAM or the lower tiers).
        block_tokens: tokens per block (key granularity; matching is token granular anyway).
        host_bytes: hard budget of the host-RAM tier (0: no host tier).
        disk_dir, disk_bytes: a directory tier and its budget (``tiers/disk.py``).
        remote: ``"redis://host:port/db?socket_timeout=0.5"`` (Redis or Valkey).
        salt: default salt (bytes): prompts under different salts never share an entry.
        policy: ``"lru"`` or ``"lfu"``: eviction order in every tier the store runs.
        checkpoint_tail: on sliding-window caches, keep a checkpoint this many tokens before
            the end of each saved prompt (0: none).
        event_bytes: bound (estimated bytes) of the KV events waiting for ``take_events``;
            past it the oldest are dropped (``stats()["events_dropped"]``); 0 keeps none (a
            publisher still gets every event).
        model_id: the identity of the model whose K/V the cache holds (e.g.
            ``"org/model@revision:sha256-of-weights"``; ``hf`` builds one from the model's name,
            revision and a digest of its weights). Part of every block key and of the lower
            tiers' namespace: two models of the same shapes (base and instruct, a fine-tune, a
            new revision) never see each other's entries. Required with ``disk_dir`` or
            ``remote`` (shared beyond this process, where shapes alone cannot tell models
            apart); optional otherwise (the cache then serves one model anyway).
        write_through: with disk/Redis tiers, each ``save`` also reaches them as it happens:
            the prompt's rows are copied out of the cells (the request waits for that copy
            only) and a background writer encodes and writes them (``flush()`` waits for it).
            False: the lower tiers get entries only when they leave host RAM, at ``flush`` and
            at ``close``.
        write_queue_bytes: bound of the writer's queue (K/V bytes waiting to be written; a
            save that does not fit is written later, at eviction / ``flush`` / ``close``).
        clock: seconds (monotonic) for retention TTLs (``retain``/``save(ttl=...)``);
            injectable for tests.

    Retention (agents): every local entry has a priority (0..100, default 35) and an optional
    expiry; tiers 0 and 1 evict expired entries first, then the lowest priority, then the
    policy's order (LRU/LFU), a chain's tail before its parent. ``retain`` sets them for a
    token range; the lower tiers keep their own LRU.

    Use it as a context manager (``with PrefixStore(...) as store:``) or call ``close()``; an
    open store is also closed at interpreter exit (its writes reach the lower tiers).
    """

    def __init__(self, cache, *, retain_seqs: Sequence[int] = (), block_tokens: int = 16,
                 host_bytes: int = 0, disk_dir: Optional[str] = None, disk_bytes: int = 0,
                 remote: Optional[str] = None, salt: bytes = b"", policy: str = "lru",
                 checkpoint_tail: int = 16, model_id: Optional[str] = None,
                 write_through: bool = True, write_queue_bytes: int = 256 << 20,
                 event_bytes: int = ev.DEFAULT_MAX_BYTES, clock=time.monotonic) -> None:
        for name in ("copy_prefix", "seq_rm", "seq_pos_max", "seq_pos_min", "can_resume",
                     "start_forward"):
            if not callable(getattr(cache, name, None)):
                raise ValueError(f"cache must be a numbakv CausalCache or WrapperCache, got "
                                 f"{type(cache).__name__} (no {name})")
        groups = _groups(cache)
        if not all(hasattr(g, "cells") and hasattr(g, "config") for g in groups):
            raise ValueError(f"cache must be a numbakv CausalCache or WrapperCache, got "
                             f"{type(cache).__name__}")
        if any(not g.config.unified for g in groups):
            raise ValueError("cache must keep one cell pool (CacheConfig(unified=True)): with "
                             "per-sequence streams a retained sequence cannot share cells")
        if getattr(cache, "closed", False):
            raise KVCacheError("cache is closed")
        max_seqs = groups[0].config.max_seqs
        if isinstance(retain_seqs, (str, bytes)) or not hasattr(retain_seqs, "__iter__"):
            raise ValueError(f"retain_seqs must be a sequence of sequence ids, got "
                             f"{type(retain_seqs).__name__}")
        retain = [_int_arg(f"retain_seqs[{i}]", s, 0) for i, s in enumerate(retain_seqs)]
        if any(s >= max_seqs for s in retain):
            raise ValueError(f"retain_seqs must be sequence ids in [0, max_seqs={max_seqs}), got "
                             f"{retain}")
        if len(set(retain)) != len(retain):
            raise ValueError(f"retain_seqs must not repeat an id, got {retain}")
        if len(retain) >= max_seqs:
            raise ValueError(f"retain_seqs must leave at least one sequence for requests "
                             f"(max_seqs={max_seqs}), got {len(retain)} ids")
        busy = [s for s in retain if cache.seq_pos_max(s) >= 0]
        if busy:
            raise ValueError(f"retain_seqs must be empty sequences the store can own; "
                             f"{busy} hold tokens")
        block_tokens = _int_arg("block_tokens", block_tokens, 1)
        host_bytes = _int_arg("host_bytes", host_bytes, 0)
        disk_bytes = _int_arg("disk_bytes", disk_bytes, 0)
        checkpoint_tail = _int_arg("checkpoint_tail", checkpoint_tail, 0)
        event_bytes = _int_arg("event_bytes", event_bytes, 0)
        if not isinstance(salt, (bytes, bytearray)):
            raise ValueError(f"salt must be bytes, got {type(salt).__name__}")
        self._policy_name = make_policy(policy).name   # validates
        if disk_dir is not None and not isinstance(disk_dir, (str, os.PathLike)):
            raise ValueError(f"disk_dir must be a directory path or None, got {disk_dir!r}")
        if disk_dir is not None and disk_bytes <= 0:
            raise ValueError("disk_bytes must be > 0 when disk_dir is given")
        if remote is not None and (not isinstance(remote, str) or not remote.startswith(
                ("redis://", "rediss://", "valkey://", "valkeys://", "unix://"))):
            raise ValueError(f"remote must be a URL such as 'redis://127.0.0.1:6379/0', got "
                             f"{remote!r}")
        if model_id is not None and (not isinstance(model_id, str) or not model_id.strip()):
            raise ValueError(f"model_id must be a non-empty string naming the model (e.g. "
                             f"'org/model@revision'), got {model_id!r}")
        if model_id is None and (disk_dir is not None or remote is not None):
            raise ValueError("model_id is required with disk_dir or remote: the disk and Redis "
                             "tiers are shared beyond this process, and two models of the same "
                             "shapes would read each other's K/V; pass model_id='org/model@"
                             "revision' (hf.Server / hf.generation_cache fill it from the model)")
        if not isinstance(write_through, (bool, np.bool_)):
            raise ValueError(f"write_through must be a bool, got {write_through!r}")
        write_queue_bytes = _int_arg("write_queue_bytes", write_queue_bytes, 0)
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")
        if getattr(_attention(cache), "_room_provider", None) is not None:
            raise ValueError("cache already has a prefix store (one store per cache)")

        self.cache = cache
        self.retain_seqs = tuple(retain)
        self.block_tokens = block_tokens
        self.host_bytes = host_bytes
        self.checkpoint_tail = checkpoint_tail
        self.salt = bytes(salt)
        self._groups = groups
        from .. import state as _state
        #: the model identity (None: tiers 0 and 1 only), in every key and the namespace
        self.model_id = model_id
        self.fingerprint = {"groups": [_state.fingerprint(g) for g in groups],
                            "model_id": model_id}
        #: hybrid caches: the recurrent half, whose state an entry holds at its restore points
        self._rc = _recurrent(cache)
        if self._rc is not None:
            self.fingerprint["recurrent"] = {"layout": self._rc.config.layout(),
                                             "layer_kinds": list(cache.layer_kinds)}
        first = groups[0].config
        heads = getattr(first, "head_range", None) or (0, first.n_kv_heads)
        self.layout = {"kind": type(cache).__name__, "block_tokens": block_tokens,
                       "layer_groups": getattr(cache, "layer_groups", None),
                       "head_range": list(heads)}
        #: lower-tier runs are chained (a run holds only the blocks the tier lacked, its
        #: parents the rest: a growing conversation writes each block once), except where
        #: windows prune old positions or a recurrent state must go with each run. In the
        #: namespace: a reader that does not know chained runs never sees one.
        self._chained = not any(g.swa_memory is not None for g in groups) \
            and _recurrent(cache) is None
        if self._chained:
            self.layout["runs"] = "chained"
        self.namespace = namespace(self.fingerprint, self.layout)
        self._roots: Dict[bytes, bytes] = {}
        #: sliding groups: (cache, window, memory) of those that drop old positions
        self._sliding = [(g, g.swa_window, g.swa_memory) for g in groups
                         if g.swa_memory is not None]
        self.index = BlockIndex(block_tokens, {CELLS: 0, HOST: 1})
        self._clock = clock
        self._policy = {CELLS: Retention(make_policy(policy), clock),
                        HOST: Retention(make_policy(policy), clock)}
        self._free: List[int] = list(retain)
        self._pending: Dict[int, List[Tuple[int, int]]] = defaultdict(list)
        self._pins: Dict[Tuple[bytes, bytes], List[Entry]] = defaultdict(list)
        self.host = HostTier(host_bytes)
        #: recycled buffers of owned rows (host entries, write-through jobs): see BufferPool
        self._pool = BufferPool(host_bytes + (write_queue_bytes if self._has_lower(
            disk_dir, remote) else 0))
        self._counts = {t: {"hits": 0, "misses": 0} for t in (CELLS, HOST)}
        self.tokens_reused = 0
        #: after ``load_edit``: what it placed (an ``EditMatch``) and the position ranges the
        #: caller must compute before prefilling on from ``last_edit.end``
        self.last_edit: EditMatch = EditMatch(0, recompute=[])
        self.last_recompute: List[Tuple[int, int]] = []
        self.tokens_matched = 0
        self.bytes_moved = 0
        self.events = ev.EventLog(max_bytes=event_bytes)
        self._lower: List[Any] = []
        #: (tier name, block key) -> run key: lower-tier pointers found to name a run that does
        #: not hold their block (skipped while they still name that run; bounded)
        self._distrust: "OrderedDict[Tuple[str, str], str]" = OrderedDict()
        self._lower_specs = [(kind, spec, budget) for kind, spec, budget in
                             (("disk", disk_dir, disk_bytes), ("redis", remote, 0))
                             if spec is not None]
        self.write_through = bool(write_through)
        self._writer: Optional[TierWriter] = None
        if self._lower_specs:
            self._open_lower()
            self._writer = TierWriter(self._lower, max_bytes=write_queue_bytes,
                                      metadata={"model_id": model_id} if model_id else None,
                                      pool=self._pool,
                                      chain_tokens=block_tokens if self._chained else 0)
            # a store collected without close(): its writer still drains and stops (not at
            # exit: _close_live_stores closes the store, writer included, then)
            weakref.finalize(self, self._writer.close).atexit = False
        self._closed = False
        _attention(cache)._room_provider = self._make_room   # its start_forward asks for room
        _LIVE.add(self)

    # ------------------------------------------------------------------ lower tiers
    def _open_lower(self) -> None:
        """Open the disk / Redis tiers (``numbakv.prefix.tiers.open_tier``, imported only
        here: the redis client only when ``remote`` is given)."""
        from .tiers import open_tier   # the tiers package (disk.py / redis.py)
        for kind, spec, budget in self._lower_specs:
            timeout = None
            self._lower.append(open_tier(os.fspath(spec) if kind == "disk" else spec,
                                         self.namespace, budget, timeout))
        for tier in self._lower:
            self._counts.setdefault(tier.name, {"hits": 0, "misses": 0})

    @staticmethod
    def _has_lower(disk_dir, remote) -> bool:
        return disk_dir is not None or remote is not None

    def _own_export(self, seq: int, p0: int, p1: int):
        """Positions ``[p0, p1)`` of ``seq`` as a snapshot with rows of its own, in one recycled
        buffer of the store's pool: gathered there when the cells are scattered (one
        ``take`` per layer and side), else copied there from the export's views of a run of
        cells (``tiers.host.owned_copy``: one copy per layer and side)."""
        if self._rc is None and callable(getattr(self.cache, "export_seq", None)):
            from ..state.snapshot import export_seq   # the snapshot module (state layer)
            snap = export_seq(self.cache, seq, p0, p1, alloc=self._pool.take)
        else:
            snap = self.cache.export_seq(seq, p0, p1)
        return owned_copy(snap, self._pool)

    # ------------------------------------------------------------------ checks
    def _check_open(self) -> None:
        if self._closed:
            raise KVCacheError("the prefix store is closed")

    def _check_seq(self, seq, name: str = "seq") -> int:
        max_seqs = self._groups[0].config.max_seqs
        if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)) \
                or not 0 <= int(seq) < max_seqs:
            raise ValueError(f"{name} must be a sequence id in [0, {max_seqs}), got {seq!r}")
        seq = int(seq)
        if seq in self.retain_seqs:
            raise ValueError(f"{name} {seq} is reserved by the prefix store (retain_seqs="
                             f"{list(self.retain_seqs)}); use another sequence")
        return seq

    def _prompt(self, tokens, extra_keys) -> bytes:
        """The prompt as the index keys it: ``tokens`` as int64-LE bytes, the ranges of
        ``extra_keys`` folded in (``keys.fold_extra_keys``); both checked."""
        buf = token_buffer(tokens)
        return fold_extra_keys(buf, _extra_keys_arg(extra_keys, buf))

    def _retention(self, priority, ttl, default: bool) -> Optional[Tuple[int, Optional[float]]]:
        """``(priority, expiry time)`` from the arguments (checked); None when both are None
        and ``default`` is False (keep what an entry has)."""
        if priority is None and ttl is None and not default:
            return None
        priority = DEFAULT_PRIORITY if priority is None else _priority_arg(priority)
        ttl = _ttl_arg(ttl)
        return priority, (None if ttl is None else self._clock() + ttl)

    def _root(self, salt) -> bytes:
        salt = self.salt if salt is None else salt
        if not isinstance(salt, (bytes, bytearray)):
            raise ValueError(f"salt must be bytes or None, got {type(salt).__name__}")
        salt = bytes(salt)
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = root_digest(salt, self.fingerprint, self.layout)
        return root

    # ------------------------------------------------------------------ windows
    def _floor_of_seq(self, seq: int, length: int) -> int:
        """The smallest length an entry of ``length`` tokens held by ``seq`` can serve: 0
        without sliding groups; else where every sliding group still holds the window (after
        the pruning its idle sequence will get: positions below ``length - memory`` go)."""
        floor = 0
        for g, window, memory in self._sliding:
            first = g.seq_pos_min(seq)
            if not 0 <= first < length:
                # the window already pruned every position of the prefix (an empty sequence's
                # seq_pos_min is -1): it can serve nothing, not "everything from 0"
                return _NEVER
            held = max(first, length - memory)
            if held > 0:
                floor = max(floor, held + window)
        return floor

    def _floor_of_snapshot(self, snap) -> int:
        """As :meth:`_floor_of_seq`, for an exported snapshot (a sliding group's part holding
        no position: nothing servable)."""
        floor = 0
        for (g, window, memory), part in zip(self._groups_windows(), snap.parts):
            if window is None or memory is None:
                continue
            if not len(part.positions):
                return _NEVER
            first = int(part.positions[0])
            if first > 0:
                floor = max(floor, first + window)
        return floor

    def _groups_windows(self):
        return [(g, g.swa_window, g.swa_memory) for g in self._groups]

    # ------------------------------------------------------------------ restore points
    def _refuse_edits_on_hybrids(self) -> None:
        if self._rc is not None:
            raise NotSupportedError("match_edit/load_edit: a hybrid model's recurrent state "
                                    "after an edit depends on every token before it: nothing "
                                    "after the edit can be re-used (use match/load)")

    def _restore_end(self, seq: int, length: int) -> int:
        """Hybrid caches: the longest prefix ``<= length`` of ``seq`` whose recurrent state is
        held: ``length`` itself at ``seq``'s end (kept as an explicit restore point) or at a
        kept restore point, else the deepest restore point below it (0: none)."""
        rc = self._rc
        if rc.seq_pos_max(seq) + 1 == length:
            self.cache.keep_restore_point(seq, length, explicit=True)
            return length
        points = [p for p in rc.restore_points(seq) if p <= length]
        return points[-1] if points else 0

    def _restore_of_seq(self, r: int, n: int) -> Optional[Tuple[int, ...]]:
        """The lengths ``<= n`` at which retained sequence ``r`` holds the recurrent state (its
        restore points and its end); None on attention-only caches."""
        if self._rc is None:
            return None
        points = {p for p in self._rc.restore_points(r) if p <= n}
        if self._rc.seq_pos_max(r) + 1 == n:
            points.add(n)
        return tuple(sorted(points))

    def _restore_of_snapshot(self, snap) -> Optional[Tuple[int, ...]]:
        """The lengths a hybrid snapshot can serve: every recurrent entry (a restore point or
        its end), each importable as the live state; None on attention-only caches."""
        rec = getattr(snap, "recurrent", None)
        if self._rc is None or rec is None:
            return None
        return tuple(int(p) for p in rec.positions)

    # ------------------------------------------------------------------ public API
    def match(self, tokens: TokenIds, *, salt: Optional[bytes] = None,
              extra_keys: ExtraKeys = None) -> int:
        """The longest prefix of ``tokens`` the store can load now (token granular; on
        sliding-window caches the deepest checkpoint at or below the token match), over every
        tier. No side effects (the lower tiers may count a miss). ``extra_keys``: ``[(start,
        end, key_bytes)]`` as given to ``save`` (a prompt matches a stored one only up to the
        first token where the tokens or the extra keys over them differ)."""
        self._check_open()
        buf = self._prompt(tokens, extra_keys)
        root = self._root(salt)
        n = self.index.match(root, buf).n
        if self._lower:
            lower, hit = self._lower_probe(root, buf, n)
            if lower > n and self._rc is not None:
                lower = self._lower_restore_point(hit, lower)
            n = max(n, lower)
        return n

    def _lower_restore_point(self, hit, n: int) -> int:
        """Hybrid caches: the deepest restore point ``<= n`` the lower tier's run holds (its
        bytes read and parsed: the run's recurrent part says where its state is); 0 when the
        run cannot be read or holds none."""
        from ..state.snapshot import SeqSnapshot   # the snapshot codec
        tier, run_key = hit[0], hit[1]
        try:
            data = tier.read_runs([run_key])[0]
            if data is None:
                return 0
            served = self._restore_of_snapshot(_slice_snapshot(SeqSnapshot.from_bytes(data), n))
        except (StateError, ValueError):
            return 0
        return served[-1] if served else 0

    def load(self, seq: int, tokens: TokenIds, *, salt: Optional[bytes] = None,
             extra_keys: ExtraKeys = None) -> int:
        """Make the empty sequence ``seq`` hold ``tokens[:n]`` at positions ``0..n-1`` from the
        store, ``n`` the longest prefix it can serve (``match``); returns ``n`` (0: a miss,
        nothing changed). Tier 0 hits share cells (no K/V copy); other tiers import the rows
        (one batched copy per layer) and promote the prefix to cells. Raises ``ValueError``
        (bad tokens, a reserved or non-empty ``seq``) or ``KVCacheFullError`` (no room for a
        promotion even after evicting cells: the entry stays where it was, ``seq`` empty).
        ``extra_keys``: as for ``match``."""
        self._check_open()
        seq = self._check_seq(seq)
        buf = self._prompt(tokens, extra_keys)
        root = self._root(salt)
        if self.cache.seq_pos_max(seq) >= 0:
            raise ValueError(f"seq {seq} must be empty to load a prefix into it (it holds "
                             f"positions up to {self.cache.seq_pos_max(seq)}); seq_rm it first")
        self._drop_pending(seq)
        m = self.index.match(root, buf)
        self.tokens_matched += m.tokens_matched
        lower = (0, None)
        if self._lower:
            lower = self._lower_probe(root, buf, m.n)
        if lower[0] > m.n:
            return self._load_lower(seq, root, buf, lower)
        if m.n == 0:
            for t in self._counts.values():
                t["misses"] += 1
            return 0
        e = m.entry
        n = m.n
        if e.tier == CELLS:
            self.cache.copy_prefix(e.seq, seq, n)
        else:
            snap = _slice_snapshot(e.payload, n)
            self._import(seq, snap)
            self.bytes_moved += snap.nbytes
            self._promote(seq, root, buf[:8 * n], source=e)
        e.hits += 1
        self._policy[e.tier].touch(e.id)   # no-op when a promotion moved it up
        self._counts[e.tier]["hits"] += 1
        self.tokens_reused += n
        return n

    def match_edit(self, tokens: TokenIds, *, salt: Optional[bytes] = None,
                   recompute_after: int = 16) -> EditMatch:
        """What the store can re-use of ``tokens`` when they differ from a stored prompt only
        inside one range (an agent stripped earlier reasoning, changed its tool list): the exact
        prefix (``match``, cells and host RAM) plus a stored suffix found again after the edit,
        at shifted positions (:class:`numbakv.prefix.edit.EditMatch`). ``recompute`` lists what
        a caller must compute: the edited tokens and the first ``recompute_after`` tokens of
        the moved suffix (the CacheBlend/LegoLink approximation: the rest of the suffix keeps
        K/V computed against the pre-edit tokens, ``approximated``). No side effects.

        A plain prefix match (``suffix_src=None``, nothing approximated) where moving K/V is
        not possible: a cache without a shift (keys cannot be re-rotated), sliding-window
        groups, hybrid caches (a recurrent state cannot skip the edit), or no suffix longer
        than ``recompute_after`` found. ``extra_keys`` prompts are not edit-matched."""
        self._check_open()
        self._refuse_edits_on_hybrids()
        buf = token_buffer(tokens)
        root = self._root(salt)
        recompute_after = _int_arg("recompute_after", recompute_after, 0)
        return self._match_edit(root, buf, recompute_after)[0]

    def _match_edit(self, root: bytes, buf: bytes, recompute_after: int):
        """``(EditMatch, the entry holding the suffix or None)``."""
        m = self.index.match(root, buf)
        plain = _edit.plan(m.n, None, 0)
        movable = not self._sliding and all(getattr(g, "shift", None) is not None
                                            for g in self._groups)
        if m.n == 0 or not movable:
            return plain, None
        # candidates: the entries through the deepest two nodes of the match (the longest
        # prompt may leave the match a block early, where a shorter entry's tail matched a
        # token or two more); each is searched after its own common prefix; the longest
        # re-usable suffix wins
        pool = {e.id: e for node in m.path[-2:] for e in node.entries.values()
                if e.restore is None and not e.floor and e.length > m.n}
        best, best_e = plain, None
        for e in sorted(pool.values(), key=lambda e: -e.length)[:8]:
            common = _common_prefix(e.buf, buf)
            found = _edit.find_suffix(e.buf, buf, common, self.block_tokens)
            got = _edit.plan(m.n, found, recompute_after)
            if got.approximated is not None and (
                    best.approximated is None
                    or got.approximated[1] - got.approximated[0]
                    > best.approximated[1] - best.approximated[0]):
                best, best_e = got, e
        return best, best_e

    def load_edit(self, seq: int, tokens: TokenIds, *, recompute_after: int = 16,
                  salt: Optional[bytes] = None) -> int:
        """``load`` for an edited prompt (see :meth:`match_edit`): the empty ``seq`` gets the
        exact prefix at ``0..prefix-1`` and the re-usable stored suffix moved to its new
        positions ``suffix_dst`` (keys re-rotated through the cache's shift), minus its first
        ``recompute_after`` tokens. Returns the tokens placed. ``store.last_recompute`` then
        lists the position ranges the caller must compute (the edited tokens and those first
        tokens after the edit; they attend only to lower positions, so computing them after
        the load is causal) before it prefills on from ``store.last_edit.end``; the suffix's
        other tokens keep their pre-edit K/V (an approximation, ``last_edit.approximated``).

        Where no suffix can be moved (no shift, sliding windows, hybrid caches, no suffix
        found, no room for it) this is a plain :meth:`load`: ``last_recompute == []`` and
        ``last_edit.suffix_src is None``. Raises as ``load``; a refusal leaves ``seq`` empty."""
        self._check_open()
        self._refuse_edits_on_hybrids()
        seq = self._check_seq(seq)
        buf = token_buffer(tokens)
        root = self._root(salt)
        recompute_after = _int_arg("recompute_after", recompute_after, 0)
        if self.cache.seq_pos_max(seq) >= 0:
            raise ValueError(f"seq {seq} must be empty to load a prefix into it (it holds "
                             f"positions up to {self.cache.seq_pos_max(seq)}); seq_rm it first")
        em, e = self._match_edit(root, buf, recompute_after)
        suffix = None
        if e is not None:
            # the suffix rows are copied out first: loading the prefix or making room for the
            # suffix may evict the entry that holds them
            (a, b), (a2, b2) = em.suffix_src, em.suffix_dst
            skip = em.approximated[0] - a2
            if e.tier == CELLS:
                suffix = _owned(self.cache.export_seq(e.seq, a + skip, b))
            else:
                suffix = _range_snapshot(e.payload, a + skip, b)
        n = self.load(seq, tokens, salt=salt)
        self.last_recompute, self.last_edit = [], _edit.plan(n, None, 0)
        if suffix is None or n > em.approximated[0]:
            return n
        try:
            placed = self._import_at(seq, suffix, em.approximated[0])
        except KVCacheFullError:
            return n                           # no room for the suffix: a plain prefix load
        self.last_recompute = [(n, em.approximated[0])]
        self.last_edit = em._replace(prefix=n, recompute=list(self.last_recompute))
        self.tokens_reused += placed
        return n + placed

    def _import_at(self, seq: int, snap, at: int) -> int:
        """``cache.import_seq(seq, snap, at=at)`` with one retry after the store made room."""
        try:
            return self.cache.import_seq(seq, snap, at=at)
        except KVCacheFullError:
            self._make_room(max(len(p.positions) for p in snap.parts))
            return self.cache.import_seq(seq, snap, at=at)

    def save(self, seq: int, tokens: TokenIds, *, salt: Optional[bytes] = None,
             cache: bool = True, priority: Optional[int] = None, ttl: Optional[float] = None,
             extra_keys: ExtraKeys = None) -> int:
        """Record that ``seq`` holds ``tokens`` (``tokens[i]`` at position ``i``) so later
        prompts sharing a prefix with it can ``load`` it. ``cache=False``: skip this one (the
        engine's admission control); checkpoints ``checkpoint(seq)`` marked are dropped too.
        Returns how many tokens the store now keeps for it (0: nothing kept - no retained
        sequence free of pins, or ``cache=False``). Metadata only in tier 0.

        ``priority`` (0..100) and ``ttl`` (seconds): the entry's retention (see ``retain``;
        both None: a new entry gets priority 35 and no expiry, an existing one keeps its own).
        ``extra_keys``: ``[(start, end, key_bytes)]`` sorted, non-overlapping token ranges whose
        key (an image's content hash over its placeholder tokens, a LoRA id) is folded into
        the keys from the block holding ``start`` on; a later prompt matches past ``start``
        only with the same key over the same range. A cancelled request's prefilled part:
        ``save(seq, tokens[:k])`` with ``k`` the tokens whose forward pass completed."""
        self._check_open()
        seq = self._check_seq(seq)
        buf = self._prompt(tokens, extra_keys)
        root = self._root(salt)
        retention = self._retention(priority, ttl, default=False)
        if not isinstance(cache, (bool, np.bool_)):
            raise ValueError(f"cache must be a bool, got {cache!r}")
        length = len(buf) // 8
        held = self.cache.seq_pos_max(seq) + 1
        if length > held:
            raise ValueError(f"tokens has {length} ids but seq {seq} holds positions up to "
                             f"{held - 1}: tokens[i] must be what seq holds at position i")
        if not self._sliding and length and self.cache.seq_pos_min(seq) != 0:
            raise ValueError(f"seq {seq} does not hold position 0: it holds no prefix to save")
        if self._rc is not None and length and cache:
            # hybrid: the prompt's end gets a restore point (the live state, kept lazily) when
            # it is seq's end; else the deepest restore point below it ends what is kept (K/V
            # past it would be dead: no state to resume there)
            length = self._restore_end(seq, length)
            buf = buf[:8 * length]
        pending = self._pending.pop(seq, [])
        # on sliding-window caches the window may have pruned the whole prefix already (a
        # prompt saved after a long generation): nothing of it can be served, keep nothing
        servable = not self._sliding or self._floor_of_seq(seq, length) <= length
        if not cache or length == 0 or not self.retain_seqs:
            for r, _ in pending:
                self._release_seq(r)
            if cache and length and servable and not self.retain_seqs \
                    and (self.host_bytes or self._lower):
                if self._serves(root, buf) >= length:   # host RAM keeps it already
                    if retention is not None:
                        for e in self._exact(root, buf):
                            self._policy[e.tier].set(e.id, *retention)
                    return length
                if not self.host_bytes and self._write_through(root, buf, seq=seq, count=True):
                    return length   # lower tiers only: the writer has it (new blocks only)
                # no tier 0: straight to host RAM (or the next tier down)
                snap = self._own_export(seq, 0, length)
                self.bytes_moved += snap.nbytes
                if self._admit_host(root, buf, snap, retention):
                    self._write_through(root, buf, snap)
                    return length
                return 0
            return 0
        self._pending[seq] = pending   # main may take one of them when nothing else is free
        main = self._keep(seq, root, buf, retention=retention) if servable else None
        pending = self._pending.pop(seq, [])
        protect = {main.id} if main is not None else set()
        for r, n in pending:   # marked checkpoints: their tokens are known now (no new cells)
            if n <= length and self._serves(root, buf[:8 * n]) < n:
                protect.add(self._add_cells_entry(root, buf[:8 * n], r).id)
            else:
                self._release_seq(r)
        tail = self.checkpoint_tail
        if main is not None and self._sliding and tail and length - tail > 0:
            c = length - tail
            if self._resumable(seq, c) and self._serves(root, buf[:8 * c]) < c:
                self._keep(seq, root, buf[:8 * c], protect=protect)
        held_locally = main is not None
        if main is None and servable:
            # no retained sequence for it (each holds a higher-ranked or pinned entry)
            if self._exact(root, buf) or self._serves(root, buf) >= length:
                held_locally = True   # host RAM (or a longer entry) holds it already
            elif self.host_bytes and callable(getattr(self.cache, "export_seq", None)):
                snap = self._own_export(seq, 0, length)
                self.bytes_moved += snap.nbytes
                held_locally = self._admit_host(root, buf, snap, retention, write_lower=False)
        queued = self._write_through(root, buf, seq=seq)
        return length if held_locally or (queued and servable) else 0

    def retain(self, tokens: TokenIds, *, priority: int = DEFAULT_PRIORITY,
               ttl: Optional[float] = None, salt: Optional[bytes] = None,
               extra_keys: ExtraKeys = None) -> int:
        """Set the retention of the token range ``[0, n)`` of ``tokens`` the store serves now
        (``n = match(tokens)``): ``priority`` 0..100 (35 by default, as TensorRT-LLM) and
        ``ttl`` seconds (None: no expiry; afterwards the range is first out). Tiers 0 and 1
        evict expired entries first, then the lowest priority, then by the policy (LRU/LFU);
        a chain loses its tail before its parent. Every entry inside the range gets it; when
        only a longer entry holds the range, the range becomes an entry of its own (cells:
        metadata only, in a free or lower-ranked retained sequence; host RAM: a copy of its
        rows within the budget) so the longer entry's tail can go first; when there is no room
        for that, the longer entry takes the higher priority. Changeable later (a lower
        priority too). Returns ``n`` (0: nothing stored, nothing changed). The lower tiers keep
        their own LRU."""
        self._check_open()
        buf = self._prompt(tokens, extra_keys)
        root = self._root(salt)
        retention = self._retention(priority, ttl, default=True)
        m = self.index.match(root, buf)
        n = m.n
        if n == 0:
            return 0
        head = buf[:8 * n]
        inside = [e for e in self.index.entries.values()
                  if e.root == root and e.length <= n and head.startswith(e.buf)]
        for e in inside:
            self._policy[e.tier].set(e.id, *retention)
        if not any(e.length == n for e in inside):
            self._split(root, head, m.entry, retention)
        return n

    def _split(self, root: bytes, head: bytes, longer: Entry, retention) -> None:
        """An entry of its own for ``head`` (a prefix of ``longer``'s tokens) with
        ``retention``; else ``longer`` takes the higher of the two priorities."""
        n = len(head) // 8
        rank = (1, retention[0])
        made = None
        if longer.tier == CELLS and not self._sliding and self.retain_seqs:
            r = self._take_seq(protect={longer.id}, rank=rank)
            if r is not None:
                self.cache.copy_prefix(longer.seq, r, n)
                made = self._add_cells_entry(root, head, r, retention)
        elif longer.tier == HOST and not self._sliding:
            snap = _owned(_slice_snapshot(longer.payload, n))
            if self._admit_host(root, head, snap, retention, write_lower=False,
                                protect={longer.id}):
                made = True
        if made is None:
            old = self._policy[longer.tier].get(longer.id)
            if retention[0] > old[0]:
                self._policy[longer.tier].set(longer.id, *retention)

    def checkpoint(self, seq: int) -> int:
        """Keep a sliding-window checkpoint at ``seq``'s current end (call it where a later
        prompt may diverge, e.g. before a turn's last tokens or at a turn boundary); the
        tokens are attached at the next ``save(seq, ...)`` (``load`` of ``seq`` drops it).
        Returns the checkpoint's length (0: no retained sequence free). On caches without a
        sliding window every prefix of a saved prompt already serves: nothing to keep, returns
        ``seq``'s length."""
        self._check_open()
        seq = self._check_seq(seq)
        n = self.cache.seq_pos_max(seq) + 1
        if n <= 0:
            raise ValueError(f"seq {seq} holds nothing to checkpoint")
        if self._rc is not None:
            # hybrid: a restore point at seq's end (the live state, kept until overwritten,
            # then copied: explicit), which the next save's entry can serve
            self.cache.keep_restore_point(seq, n, explicit=True)
            return n
        if not self._sliding:
            return n
        r = self._take_seq(protect=())
        if r is None:
            return 0
        self.cache.copy_prefix(seq, r, n)
        lst = self._pending[seq]
        lst.append((r, n))
        if len(lst) > _MAX_PENDING:
            self._release_seq(lst.pop(0)[0])
        return n

    def pin(self, tokens: TokenIds, *, salt: Optional[bytes] = None, extra_keys: ExtraKeys = None) -> int:
        """Keep the prefix of ``tokens`` the store serves now from eviction until ``unpin``
        (the entry serving it stays in its tier). Returns the pinned length (0: not stored)."""
        self._check_open()
        buf = self._prompt(tokens, extra_keys)
        root = self._root(salt)
        m = self.index.match(root, buf)
        if m.n == 0:
            return 0
        m.entry.pins += 1
        if m.entry.tier == HOST:
            self.host.pinned += m.entry.nbytes if m.entry.pins == 1 else 0
        self._pins[(root, buf)].append(m.entry)
        return m.n

    def unpin(self, tokens: TokenIds, *, salt: Optional[bytes] = None,
              extra_keys: ExtraKeys = None) -> bool:
        """Undo one ``pin(tokens)`` (same tokens, salt and extra keys). Returns False when none
        was held."""
        self._check_open()
        buf = self._prompt(tokens, extra_keys)
        key = (self._root(salt), buf)
        held = self._pins.get(key)
        if not held:
            return False
        e = held.pop()
        if not held:
            del self._pins[key]
        e.pins -= 1
        if e.tier == HOST and e.pins == 0 and e.id in self.index.entries:
            self.host.pinned -= e.nbytes
        return True

    def stats(self) -> Dict[str, Any]:
        """``{"tiers": {name: {"bytes_used", "bytes_evictable", "bytes_pinned", "bytes_free",
        "entries", "hits", "misses"}}, "tokens_reused", "tokens_matched", "bytes_moved",
        "writer"}``; tiers 0 and 1 add their retention: ``"priorities"`` (priority -> entries),
        ``"expiring"`` (entries with a TTL), ``"expired"``; ``"writer"``: the background
        writer's counters (None without lower tiers).
        ``bytes_used = bytes_evictable + bytes_pinned``; ``bytes_used + bytes_free`` is the
        tier's budget (tier 0: the bytes of the cells retained sequences hold, see the module
        docstring)."""
        tiers: Dict[str, Dict[str, Any]] = {}
        used, pinned = self._cells_bytes()
        cells = self.index.in_tier(CELLS)
        tiers[CELLS] = {"bytes_used": used, "bytes_evictable": used - pinned,
                        "bytes_pinned": pinned, "bytes_free": 0, "entries": len(cells),
                        **self._counts[CELLS], "budget": used, **self._retention_stats(CELLS)}
        if self.host_bytes:
            tiers[HOST] = {**self.host.stats(), **self._counts[HOST], "budget": self.host_bytes,
                           **self._retention_stats(HOST)}
        for tier in self._lower:
            s = dict(tier.stats())
            tiers[tier.name] = s
        self._drain_writer()
        return {"tiers": tiers, "writer": self._writer.stats() if self._writer else None,
                "tokens_reused": self.tokens_reused,
                "tokens_matched": self.tokens_matched, "bytes_moved": self.bytes_moved,
                "events_dropped": self.events.dropped}

    def _retention_stats(self, tier: str) -> Dict[str, Any]:
        """``{"priorities": {priority: entries}, "expiring": entries with a TTL, "expired":
        entries past it}`` of a local tier."""
        policy, now = self._policy[tier], self._clock()
        by: Dict[int, int] = {}
        expiring = expired = 0
        for e in self.index.in_tier(tier):
            priority, expires = policy.get(e.id)
            by[priority] = by.get(priority, 0) + 1
            if expires is not None:
                expiring += 1
                expired += now >= expires
        return {"priorities": dict(sorted(by.items())), "expiring": expiring,
                "expired": expired}

    def take_events(self) -> List[Dict[str, Any]]:
        """The events since the last call (see ``events.py``: vLLM's KV event fields)."""
        self._drain_writer()
        return self.events.take()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Make every entry this store holds reach the disk / Redis tiers: wait for the
        background writer, then write (through it) the local entries no lower tier was given
        yet (saves the writer's bounded queue refused). Returns False when ``timeout`` seconds
        passed first (the rest is still written in the background). Without lower tiers:
        nothing to do, True."""
        self._check_open()
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(
                timeout, (int, float)) or not timeout >= 0):
            raise ValueError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
        if self._writer is None:
            return True
        self._flush_down(skip_known=True)
        done = self._writer.flush(timeout)
        self._drain_writer()
        return done

    def __enter__(self) -> "PrefixStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def publish_events(self, endpoint: str, topic: str = "kv-events") -> str:
        """Also publish every event on a ZeroMQ PUB socket bound to ``endpoint`` (needs
        ``pyzmq``); returns the bound endpoint (``tcp://127.0.0.1:*`` picks a port)."""
        if self.events.publisher is not None:
            self.events.publisher.close()
        self.events.publisher = ev.ZmqPublisher(endpoint, topic)
        return self.events.publisher.endpoint

    def clear(self) -> None:
        """Drop every entry of every tier (the retained sequences' cells are freed; the lower
        tiers clear this model's namespace) and every pin."""
        self._check_open()
        for e in self.index.clear():
            if e.tier == CELLS:
                self._release_seq(e.seq)
            elif e.tier == HOST:
                self._pool.give(e.payload)
                e.payload = None
        for seq in list(self._pending):
            self._drop_pending(seq)
        for p in self._policy.values():
            for k in list(p.victims()):
                p.remove(k)
        self._pins.clear()
        self.host = HostTier(self.host_bytes)
        if self._writer is not None:
            self._writer.flush()      # nothing queued before the clear lands after it
            self._drain_writer()
            self._writer.forget()
        for tier in self._lower:
            tier.clear()
        self.events.emit(ev.all_cleared())

    def close(self) -> None:
        """Write the local entries down to the lower tiers (when configured), clear the store's
        cells and host entries, stop acting as the cache's room provider and close the lower
        tiers (their stored runs stay for other processes)."""
        if self._closed:
            return
        _LIVE.discard(self)
        if self._lower and not getattr(self.cache, "closed", False):
            self._flush_down(skip_known=True)
        if self._writer is not None:
            self._writer.close()
            self._drain_writer()
        lower, self._lower = self._lower, []
        try:
            if not getattr(self.cache, "closed", False):
                self.clear()
        finally:
            if getattr(_attention(self.cache), "_room_provider", None) == self._make_room:
                _attention(self.cache)._room_provider = None
            for tier in lower:
                tier.close()
            if self.events.publisher is not None:
                self.events.publisher.close()
            self._closed = True

    # ------------------------------------------------------------------ tier 0
    def _resumable(self, seq: int, n: int) -> bool:
        return all(g.can_resume(seq, n) for g, _, _ in self._sliding) if n > 0 else True

    def _serves(self, root: bytes, buf: bytes) -> int:
        """How many tokens of ``buf`` the local tiers serve now (exactly, windows included)."""
        return self.index.match(root, buf).n

    def _keep(self, seq: int, root: bytes, buf: bytes, protect=(),
              retention=None) -> Optional[Entry]:
        """Keep ``seq``'s first ``len(buf)/8`` tokens in a retained sequence (tier 0); returns
        the cells entry (None: every retained sequence is pinned, protected or holds an entry
        ranked above ``retention``). ``retention``: ``(priority, expires)`` for the entry (None:
        an existing entry keeps its own, a new one gets the default)."""
        n = len(buf) // 8
        m = self.index.match(root, buf)
        if retention is None and m.n == n and m.entry is not None and m.entry.length == n \
                and m.entry.tier == CELLS:
            exact = [m.entry]            # the common case, without walking the trie again
        else:
            exact = self._exact(root, buf)
        for e in exact:                                    # already kept exactly
            self._policy[e.tier].touch(e.id)
            if retention is not None:
                self._policy[e.tier].set(e.id, *retention)
        for e in exact:
            if e.tier == CELLS:
                return e
        if exact and retention is None:   # promoted below: the host entry's retention goes along
            retention = self._policy[exact[0].tier].get(exact[0].id)
        want = retention or (DEFAULT_PRIORITY, None)
        # an unpinned cells entry this prompt extends: its sequence takes the longer prefix
        # (one entry per conversation, not one per turn)
        reuse = None
        if not self._sliding:
            for node in reversed(m.path):
                for e in node.entries.values():
                    # (a retained shorter entry stays: the longer prompt's tail must be able
                    # to go before it)
                    if e.tier == CELLS and e.pins == 0 and e.length <= n \
                            and e.path[-1] is node and node.end <= m.tokens_matched \
                            and self._policy[CELLS].get(e.id) == want:
                        reuse = e
                        break
                if reuse is not None:
                    break
        if reuse is not None:
            # the longer prefix first, then the shorter entry goes: its blocks stay covered
            # (no removed/stored event pair for them)
            self.cache.copy_prefix(seq, reuse.seq, n)
            entry = self._add_cells_entry(root, buf, reuse.seq, want)
            self._drop_entry(reuse)
            return entry
        r = self._take_seq(protect=protect, rank=(1, want[0]))
        if r is None:
            return None
        try:
            self.cache.copy_prefix(seq, r, n)
        except BaseException:
            self._release_seq(r)
            raise
        return self._add_cells_entry(root, buf, r, want)

    def _exact(self, root: bytes, buf: bytes) -> List[Entry]:
        """The entries holding exactly the prompt ``buf`` (any tier, cells first): one dict
        look-up per block down the trie."""
        node = self.index.roots.get(root)
        width = self.index.width
        for pos in range(0, len(buf), width):
            if node is None:
                return []
            node = node.children.get(buf[pos:pos + width])
        if node is None or node.parent is None:
            return []
        n = len(buf) // 8
        return sorted((e for e in node.entries.values() if e.length == n and e.floor <= n),
                      key=lambda e: e.tier != CELLS)

    def _add_cells_entry(self, root: bytes, buf: bytes, r: int, retention=None) -> Entry:
        n = len(buf) // 8
        path = self.index.insert_path(root, buf)
        e = Entry(CELLS, root, path, floor=self._floor_of_seq(r, n), seq=r,
                  restore=self._restore_of_seq(r, n), buf=buf)
        self._register(e, retention)
        return e

    def _register(self, e: Entry, retention=None) -> None:
        fresh = self.index.add(e)
        priority, expires = retention or (DEFAULT_PRIORITY, None)
        self._policy[e.tier].add(e.id, priority, expires)
        if fresh:
            self.events.emit_later(ev.block_stored_later(
                fresh, self.block_tokens, e.tier, priority=priority,
                ttl=self._ttl_left(expires)))

    def _ttl_left(self, expires: Optional[float]) -> Optional[float]:
        return None if expires is None else max(0.0, expires - self._clock())

    def _is_ancestor(self, eid: int) -> bool:
        """Whether another live entry extends entry ``eid``'s tokens (its chain's tail): the
        tail goes first, so this one waits behind entries of its rank that are not."""
        e = self.index.entries.get(eid)
        if e is None or not e.path:
            return False
        last = e.path[-1]
        if len(last.tok) == self.index.width:
            return any(o.length > e.length for o in last.entries.values())
        # a partial last block: a longer prompt passes through a full sibling instead
        pool = e.path[-2].entries.values() if len(e.path) > 1 else \
            self.index.entries.values()
        return any(o.length > e.length and o.root == e.root and o.buf.startswith(e.buf)
                   for o in pool)

    def _victims(self, tier: str, rank=None) -> Iterator[Entry]:
        """Unpinned entries of ``tier``, first to evict first: expired, then the lowest
        priority, then the policy's order, a chain's tail before its parent. ``rank``
        (``(0 expired / 1 not, priority)``): only those ranked at or below it. Lazy (the
        caller may evict while iterating; an entry gone meanwhile is skipped): evicting one
        entry costs the first few, not every entry."""
        policy = self._policy[tier]
        now = self._clock()
        for eid in policy.victims(self._is_ancestor):
            e = self.index.entries.get(eid)
            if e is None or e.pins:
                continue
            if rank is not None and policy.rank(eid, now) > rank:
                return   # ranked above: so is every later one
            yield e

    def _drop_entry(self, e: Entry) -> None:
        """Take ``e`` out of the index (its sequence / bytes are the caller's to free)."""
        gone = self.index.remove(e)
        self._policy[e.tier].remove(e.id)
        if gone:
            self.events.emit_later(ev.block_removed_later(gone, e.tier))

    def _release_seq(self, r: int) -> None:
        self.cache.seq_rm(r)
        if r not in self._free:
            self._free.append(r)

    def _drop_pending(self, seq: int) -> None:
        for r, _ in self._pending.pop(seq, []):
            self._release_seq(r)

    def _take_seq(self, protect=(), rank=None) -> Optional[int]:
        """A free retained sequence: a free one, else the one of the first unpinned cells
        entry to evict (``_victims``; ranked at or below ``rank`` when given), evicted
        (demoted), else a pending checkpoint's. None when every one is pinned or ranked
        above."""
        if self._free:
            return self._free.pop()
        for e in self._victims(CELLS, rank):
            if e.id in protect:
                continue
            self._evict_cells(e)
            return self._free.pop()
        for seq, lst in self._pending.items():
            if lst:
                r, _ = lst.pop(0)
                self.cache.seq_rm(r)
                return r
        return None

    def _evict_cells(self, e: Entry) -> None:
        """Evict a tier-0 entry: demote it to host RAM (or the next tier down) unless another
        entry already serves its whole prefix, then free its retained sequence."""
        others = [o for o in e.path[-1].entries.values()
                  if o is not e and o.floor <= e.length]
        snap = None
        if not others and (self.host_bytes or self._lower) \
                and callable(getattr(self.cache, "export_seq", None)):
            try:
                snap = self._own_export(e.seq, 0, e.length)
            except (KVCacheError, ValueError):
                snap = None   # cannot export (e.g. an unsupported cache): dropped instead
        retention = self._policy[CELLS].get(e.id)
        self._drop_entry(e)
        self._release_seq(e.seq)
        if snap is not None:
            self.bytes_moved += snap.nbytes
            self._admit_host(e.root, e.tokens_bytes(), snap, retention)

    def _trim_cells(self, e: Entry, n_cells: int) -> bool:
        """Make room by dropping the end of the tier-0 entry ``e`` rather than all of it (the
        tail before its parent, at token granularity as the peers' block-level eviction): its
        sequence leaves the positions past the last whole block that keeps the free cells
        short of ``n_cells`` by what its own tail holds; the entry keeps the rest, its id and
        its place in the eviction order. Only where the tail would be lost anyway (no host RAM
        or lower tier to demote it to) and where any prefix of an entry can serve (no sliding
        windows, no recurrent state). Returns whether it trimmed (its tail's cells that another
        sequence shares are not freed: the caller goes on evicting if short)."""
        if self._sliding or self._rc is not None or self.host_bytes or self._lower or e.pins \
                or len(e.path) < 2:
            return False
        deficit = max(n_cells - g.cells.n_free for g in self._groups)
        keep = e.length - deficit          # the tail's cells are its own in the common case
        k = bisect.bisect_right([node.end for node in e.path], keep)
        if k < 1 or k >= len(e.path):
            return False                   # not one whole node would stay / need all of it
        self.cache.seq_rm(e.seq, e.path[k - 1].end, None)
        gone = self.index.truncate(e, k)
        if gone:
            self.events.emit_later(ev.block_removed_later(gone, CELLS))
        return True

    def _cells_bytes(self) -> Tuple[int, int]:
        """(bytes of the cells retained sequences hold, of those pinned entries hold)."""
        used = pinned = 0
        pinned_seqs = [e.seq for e in self.index.in_tier(CELLS) if e.pins]
        for g in self._groups:
            per_cell = g.config.nbytes(1)
            held = [g.cells.seq_cells(r) for r in self.retain_seqs]
            used += per_cell * len(np.unique(np.concatenate(held))) if held else 0
            if pinned_seqs:
                pin = np.unique(np.concatenate([g.cells.seq_cells(r) for r in pinned_seqs]))
                pinned += per_cell * len(pin)
        return used, pinned

    def _make_room(self, n_cells: int) -> bool:
        """The cache's room provider: evict unpinned cells entries, least recently (or
        frequently) used first, until every cell group has ``n_cells`` free cells (or nothing is
        left to evict). The cache then places the batch, defragmenting if the free cells are
        not contiguous: moving cached K/V is cheaper than computing it again. Returns whether
        anything was evicted."""
        def roomy() -> bool:
            return all(g.cells.n_free >= n_cells for g in self._groups)
        evicted = False
        if roomy():
            return False
        for e in self._victims(CELLS):
            if e.id not in self.index.entries:
                continue
            evicted = True
            if self._trim_cells(e, n_cells) and roomy():
                break
            if e.id in self.index.entries:
                self._evict_cells(e)
            if roomy():
                break
        if not roomy():
            for seq in list(self._pending):
                self._drop_pending(seq)
                evicted = True
        return evicted

    # ------------------------------------------------------------------ tier 1
    def _admit_host(self, root: bytes, buf: bytes, snap, retention=None,
                    write_lower: bool = True, protect=()) -> bool:
        """Keep ``snap`` (the K/V of prompt ``buf``'s first tokens) in host RAM with
        ``retention`` (default priority when None), evicting unpinned host entries ranked at or
        below it (``_victims``: to the lower tiers) to fit; too large or no room: straight to
        the lower tiers (unless ``write_lower`` is False). Returns whether some tier now keeps
        it."""
        nbytes = int(snap.nbytes)
        retention = retention or (DEFAULT_PRIORITY, None)
        if self._sliding and self._floor_of_snapshot(snap) > len(buf) // 8:
            return False    # its window holds none of the prefix: it could never be served
        if self.host_bytes and nbytes <= self.host_bytes:
            if not self.host.fits(nbytes):
                expired = retention[1] is not None and self._clock() >= retention[1]
                for e in self._victims(HOST, rank=(0 if expired else 1, retention[0])):
                    if e.id in protect or e.id not in self.index.entries:
                        continue
                    self._evict_host(e)
                    if self.host.fits(nbytes):
                        break
            if self.host.fits(nbytes):
                # idle buffers and entries together stay within the host budget + write queue
                self._pool.trim(self._pool.max_idle_bytes - self.host.used - nbytes)
                path = self.index.insert_path(root, buf)
                e = Entry(HOST, root, path, floor=self._floor_of_snapshot(snap), payload=snap,
                          restore=self._restore_of_snapshot(snap),
                          nbytes=nbytes, buf=buf)
                self.host.add(nbytes)
                self._register(e, retention)
                return True
        if not write_lower:
            return False
        path = self.index.insert_path(root, buf)     # the block keys (no entry covers them)
        try:
            return self._write_lower(path, snap)
        finally:
            self.index.prune(path)                   # nodes no entry covers leave the index

    def _evict_host(self, e: Entry) -> None:
        self._drop_entry(e)
        self.host.remove(e.nbytes)
        self._write_lower(e.path, e.payload)
        self._pool.give(e.payload)   # reused once the writer is done with it
        e.payload = None             # (entries and index nodes form cycles: free the rows now)

    def _import(self, seq: int, snap) -> int:
        """``cache.import_seq`` with one retry after the store made room; raises
        ``KVCacheFullError`` (nothing changed) when there is none."""
        try:
            return self.cache.import_seq(seq, snap)
        except KVCacheFullError:
            self._make_room(max(len(p.positions) for p in snap.parts))
            return self.cache.import_seq(seq, snap)

    def _promote(self, seq: int, root: bytes, buf: bytes, source: Optional[Entry]) -> None:
        """``seq`` now holds a prefix it imported: keep it in cells too (a free or evictable
        retained sequence; never displacing a pinned entry). A host entry moved whole is
        dropped from host RAM (its bytes freed) unless pinned."""
        if not self.retain_seqs:
            return
        n = len(buf) // 8
        retention = self._policy[source.tier].get(source.id) \
            if source is not None and source.id in self.index.entries else None
        if self._keep(seq, root, buf, retention=retention) is not None and source is not None \
                and source.tier == HOST \
                and source.length == n and not source.pins \
                and source.id in self.index.entries:
            self._drop_entry(source)
            self.host.remove(source.nbytes)
            self._pool.give(source.payload)
            source.payload = None

    # ------------------------------------------------------------------ disk / redis
    def _flush_down(self, skip_known: bool = False) -> None:
        """Write every local entry the lower tiers may not hold yet (cells, then host) down to
        them, so a later process finds what this one kept (``close``, ``flush``). Best effort:
        a tier that refuses (full, down) is skipped, as at any demotion. ``skip_known``: skip
        runs this process already wrote or queued."""
        for e in sorted(self.index.entries.values(), key=lambda e: -e.length):
            if not e.path or (skip_known and self._writer is not None
                              and self._writer.known(e.path[-1].key)):
                continue
            if e.tier == CELLS:
                try:   # owned rows: the writer encodes them later
                    snap = self._own_export(e.seq, 0, e.length)
                except (KVCacheError, ValueError):
                    continue
            else:
                snap = e.payload
            self._write_lower(e.path, snap)

    def _write_lower(self, path, snap) -> bool:
        """Give the run ``snap`` (owned rows of the prompt whose nodes are ``path``) to every
        lower tier (the disk for this host, Redis for all) through the background writer; when
        its queue is full, write it here (the entry is leaving the local tiers: it must not be
        lost). Returns whether it was written or queued (False: no lower tier, or nothing of
        it can be served: see :meth:`_job`)."""
        if self._writer is None or not path:
            return False
        if self._writer.known(path[-1].key):
            return True   # written (or queued) already: by write-through at its save
        job = self._job(path, snap)
        if job is None:
            return False
        if not self._writer.submit(job):
            self._writer.write_now(job)
        return True

    def _job(self, path, snap) -> Optional[Job]:
        """The writer's job for the run ``snap`` of the prompt ``path`` spells. Its bytes will
        carry their run key and block keys (``tiers.base.binding``, under the snapshot's
        checksum) so a read can check that what it got is what its key names (:meth:`_bound`).
        On sliding-window caches only the blocks the run can serve (ending at or past its
        floor) get a pointer, so a lookup never promises a length the run's window cannot
        resume at; None when it can serve none."""
        first = 0
        if self._sliding:
            floor = self._floor_of_snapshot(snap)
            if floor > path[-1].end:
                return None
            first = next(i for i, node in enumerate(path) if node.end >= floor)
        return Job([node.key for node in path], snap, int(snap.nbytes), tag=path,
                   first=first)

    def _write_through(self, root: bytes, buf: bytes, snap=None, seq: Optional[int] = None,
                       count: bool = False) -> bool:
        """A save reaches the lower tiers as it happens: queue the prompt's rows (``snap``, or
        a copy of ``seq``'s first ``len(buf)/8`` positions) for the background writer, unless
        it already wrote or queued that run; returns whether it is written or queued. A full
        queue drops the write (counted in ``stats()["writer"]["refused"]``): the entry stays
        local and is written at its eviction, ``flush`` or ``close``."""
        if self._writer is None or not self.write_through or not buf:
            return False
        path = self.index.insert_path(root, buf)
        try:
            if self._writer.known(path[-1].key):
                return True
            if snap is None:
                # chained runs: only the blocks past those this process's writer already wrote
                # or queued (the previous turn of a conversation) are copied here; the writer
                # writes them as a run chained to the earlier ones
                start = 0
                if self._chained:
                    start = self._writer.known_prefix([node.key for node in path[:-1]]) \
                        * self.block_tokens
                try:
                    snap = self._own_export(seq, start, len(buf) // 8)
                except (KVCacheError, ValueError):
                    return False   # a cache that cannot export: written only if demoted
                if count:
                    self.bytes_moved += snap.nbytes
            job = self._job(path, snap)
            return job is not None and self._writer.submit(job)
        finally:
            self.index.prune(path)   # nodes no entry covers leave the index

    def _drain_writer(self) -> None:
        """``BlockStored`` events (medium: the lower tier) for runs the writer finished."""
        if self._writer is None:
            return
        for path, tier_name in self._writer.results():
            self.events.emit(ev.block_stored(path, self.block_tokens, tier_name))

    @staticmethod
    def _bound(snap, run_key: str, block: int, block_key: str) -> bool:
        """Whether ``snap`` (read from a lower tier under ``run_key``, found by the pointer of
        block ``block`` whose key is ``block_key``) is that run and holds that block: a file
        copied or linked under another run's name, or a pointer rewritten to another run,
        serves nothing."""
        return is_bound(snap.metadata, run_key, block, block_key)

    def _lower_probe(self, root: bytes, buf: bytes, local: int) -> Tuple[int, Any]:
        """``(n, (tier, run key, block index, block key))``: the deepest block of ``buf`` a
        lower tier holds beyond ``local`` tokens, one ``find_blocks`` round trip per tier
        (pointers this process found naming the wrong run are skipped)."""
        keys = block_keys(np.frombuffer(buf, "<i8"), self.block_tokens, root)
        first = local // self.block_tokens
        if first >= len(keys):
            return 0, None
        want = keys[first:]
        for tier in self._lower:
            found = tier.find_blocks(want)
            for i in range(len(found) - 1, -1, -1):
                if found[i] is not None and (not self._distrust or self._distrust.get(
                        (tier.name, want[i])) != found[i][0]):
                    b = first + i
                    n = min(len(buf) // 8, (b + 1) * self.block_tokens)
                    if n > local:
                        return n, (tier, found[i][0], b, want[i])
                    break
        return 0, None

    def _forget_written(self, run_key: Optional[str]) -> None:
        """The writer no longer takes ``run_key`` (None: any run) as written: a lower tier lost
        or refused it, and a fresh save must store it again."""
        if self._writer is not None:
            self._writer.forget(run_key)

    def _reads_into_cells(self) -> bool:
        """Whether a lower-tier hit can be read straight into the cells (``import_run``): one
        group of K/V in host memory (cpu/sim), no recurrent half, a little-endian host (the
        codec's byte order is the storage's)."""
        return self._rc is None and len(self._groups) == 1 and sys.byteorder == "little" \
            and isinstance(self._groups[0].storage.keys, np.ndarray)

    def _chain_start(self, snap, n: int) -> Optional[int]:
        """Where the rows of the lower-tier run ``snap`` start: 0 for a whole prompt's run, the
        first block's position for a chained run (``tiers.base.BIND_FIRST``: written when the
        tier held the prompt's first blocks already); None when the run cannot be right (its
        rows do not start there, or start at or past the match ``n``)."""
        first = snap.metadata.get(BIND_FIRST)
        if first is None or first == "0":
            return 0
        try:
            p0 = int(first) * self.block_tokens
        except ValueError:
            return None
        pos = snap.parts[0].positions
        if p0 <= 0 or p0 >= n or not len(pos) or int(pos[0]) != p0:
            return None
        return p0

    def _load_parent(self, seq: int, root: bytes, buf: bytes, p0: int) -> int:
        """Load the first ``p0`` tokens of ``buf`` (the blocks a chained run's parents hold)
        into the empty ``seq`` from the lower tiers; returns the tokens loaded (``p0``, or
        fewer when a parent is gone: a valid shorter prefix)."""
        hit = self._lower_probe(root, buf[:8 * p0], 0)
        if hit[0] != p0:
            return 0
        return self._load_lower(seq, root, buf[:8 * p0], hit, promote=False)

    def _broken_chain(self, seq: int, tier, run_key: str) -> int:
        """A chained run whose parents cannot be loaded (evicted, damaged): a miss with
        nothing changed (what the parents placed goes), the run dropped (``match`` stops
        promising it) and every run forgotten as written, so the next save of the prompt
        hands the writer every block again."""
        self.cache.seq_rm(seq)
        try:
            tier.remove_run(run_key)
        except Exception:  # noqa: BLE001 - tiers never raise on I/O
            pass
        self._forget_written(None)
        self._counts[tier.name]["misses"] += 1
        return 0

    def _lower_done(self, seq: int, root: bytes, buf: bytes, tier, n: int,
                    promote: bool) -> int:
        """Book a lower-tier load of ``n`` tokens (0: a miss) and promote it (outermost
        load of a chain only)."""
        if n <= 0:
            self._counts[tier.name]["misses"] += 1
            return 0
        self._counts[tier.name]["hits"] += 1
        if promote:
            self.tokens_reused += n
            self._promote(seq, root, buf[:8 * n], source=None)
        return n

    def _load_lower_direct(self, seq: int, root: bytes, buf: bytes, hit,
                           promote: bool = True) -> int:
        """``_load_lower`` with the run's rows read from the tier straight into the cells they
        land in (``RunReader`` + ``state.snapshot.import_run``): header, positions and binding
        checked first, the rows' crc32 while they arrive; a bad run is a miss, rolled back."""
        from ..state.snapshot import import_run, open_run
        n, (tier, run_key, block, block_key) = hit
        try:
            reader = tier.open_run(run_key)
        except Exception:  # noqa: BLE001 - tiers never raise on I/O; any failure is a miss
            reader = None
        if reader is None:
            self._forget_written(run_key)
            self._counts[tier.name]["misses"] += 1
            return 0
        try:
            run = open_run(reader, f"the {tier.name} tier's run {run_key}")
            if run.snap.metadata.get(BIND_RUN) != run_key:
                raise StateError(f"the {tier.name} tier's run {run_key} holds another run's "
                                 "bytes")
            if not self._bound(run.snap, run_key, block, block_key):
                self._distrust[(tier.name, block_key)] = run_key
                while len(self._distrust) > _MAX_DISTRUST:
                    self._distrust.popitem(last=False)
                tier._count("invalid")
                self._forget_written(None)
                self._counts[tier.name]["misses"] += 1
                return 0
            snap = _slice_snapshot(run.snap, n)
            if self._sliding and self._floor_of_snapshot(snap) > n:
                self._counts[tier.name]["misses"] += 1
                return 0
            p0 = self._chain_start(run.snap, n)
            if p0 is None:
                raise StateError(f"the {tier.name} tier's chained run {run_key} does not start "
                                 "at its first block")
            if p0:   # a chained run: its parents' blocks first
                if self._load_parent(seq, root, buf, p0) < p0:
                    return self._broken_chain(seq, tier, run_key)
            try:
                try:
                    import_run(self.cache, seq, run, upto=n)
                except KVCacheFullError:
                    self._make_room(max(len(p.positions) for p in snap.parts))
                    import_run(self.cache, seq, run, upto=n)
            except KVCacheFullError:
                if p0:
                    self.cache.seq_rm(seq)   # nothing changed: the parents go too
                raise
        except (StateError, ValueError, NotSupportedError) as exc:
            if isinstance(exc, KVCacheFullError):
                raise
            tier.report_invalid(run_key)   # corrupt or another model's bytes: a miss
            self._forget_written(run_key)
            self.cache.seq_rm(seq)         # a chained run's parents go too: nothing changed
            return self._lower_done(seq, root, buf, tier, 0, promote)
        finally:
            reader.close()
        self.bytes_moved += snap.nbytes
        return self._lower_done(seq, root, buf, tier, n, promote)

    def _load_lower(self, seq: int, root: bytes, buf: bytes, hit, promote: bool = True) -> int:
        from ..state.snapshot import SeqSnapshot   # the snapshot codec
        n, (tier, run_key, block, block_key) = hit
        if self._reads_into_cells() and callable(getattr(tier, "open_run", None)):
            return self._load_lower_direct(seq, root, buf, hit, promote)
        try:
            data = tier.read_runs([run_key])[0]
        except Exception:  # noqa: BLE001 - tiers never raise on I/O; any failure is a miss
            data = None
        if data is None:
            # gone (evicted elsewhere, or the tier dropped a damaged file): the next save of
            # this prompt must write it again, not trust that it was written once
            self._forget_written(run_key)
            self._counts[tier.name]["misses"] += 1
            return 0
        try:
            snap = SeqSnapshot.from_bytes(data)
            if snap.metadata.get(BIND_RUN) != run_key:
                raise StateError(f"the {tier.name} tier's run {run_key} holds another run's "
                                 "bytes")
            if not self._bound(snap, run_key, block, block_key):
                # the run is whole but the pointer that led here names the wrong run: distrust
                # the pointer (not the run) until it changes (a fresh save rewrites it)
                self._distrust[(tier.name, block_key)] = run_key
                while len(self._distrust) > _MAX_DISTRUST:
                    self._distrust.popitem(last=False)
                tier._count("invalid")
                self._forget_written(None)   # a re-save of the prompt re-points its blocks
                self._counts[tier.name]["misses"] += 1
                return 0
            p0 = self._chain_start(snap, n)      # (the metadata: before slicing drops it)
            snap = _slice_snapshot(snap, n)
            if self._rc is not None:
                # hybrid: the run serves up to its deepest restore point at or below the match
                served = self._restore_of_snapshot(snap)
                n = served[-1] if served else 0
                if n == 0:
                    self._counts[tier.name]["misses"] += 1
                    return 0
                snap = _slice_snapshot(snap, n)
            if self._sliding and self._floor_of_snapshot(snap) > n:
                self._counts[tier.name]["misses"] += 1
                return 0
            if p0 is None or (p0 and self._rc is not None):
                raise StateError(f"the {tier.name} tier's chained run {run_key} does not start "
                                 "at its first block")
            if p0:   # a chained run: its parents' blocks first
                if self._load_parent(seq, root, buf, p0) < p0:
                    return self._broken_chain(seq, tier, run_key)
            try:
                self._import(seq, snap)    # checks the fingerprint, shapes and formats first
            except KVCacheFullError:
                if p0:
                    self.cache.seq_rm(seq)   # nothing changed: the parents go too
                raise
        except (StateError, ValueError) as exc:
            if isinstance(exc, KVCacheFullError):
                raise
            tier.report_invalid(run_key)   # corrupt or another model's bytes: a miss
            self._forget_written(run_key)
            self.cache.seq_rm(seq)         # a chained run's parents go too: nothing changed
            return self._lower_done(seq, root, buf, tier, 0, promote)
        self.bytes_moved += snap.nbytes
        return self._lower_done(seq, root, buf, tier, n, promote)

    # ------------------------------------------------------------------ misc
    def entries(self) -> List[Dict[str, Any]]:
        """The local entries, for inspection and tests: ``{"tier", "length", "floor", "seq",
        "pins", "hits", "nbytes", "priority", "ttl" (seconds left or None), "expired",
        "tokens"}`` each (``tokens`` under ``extra_keys`` ranges are keyed ids)."""
        out = []
        now = self._clock()
        for e in self.index.entries.values():
            priority, expires = self._policy[e.tier].get(e.id)
            out.append({"tier": e.tier, "length": e.length, "floor": e.floor, "seq": e.seq,
                        "pins": e.pins, "hits": e.hits, "nbytes": e.nbytes,
                        "priority": priority,
                        "ttl": None if expires is None else max(0.0, expires - now),
                        "expired": expires is not None and now >= expires,
                        "salt_root": e.root,
                        "tokens": np.frombuffer(e.tokens_bytes(), "<i8").tolist()})
        return out

    def __repr__(self) -> str:
        return (f"PrefixStore(entries={len(self.index.entries)}, retain_seqs="
                f"{list(self.retain_seqs)}, host_bytes={self.host_bytes}, "
                f"policy={self._policy_name!r})")


__all__ = ["PrefixStore", "token_buffer"]
