"""The prefix store's background writer: saves reach the disk and Redis tiers as they happen
(write-through) without a request waiting for the disk or the network.

A request thread hands the writer a *job*: a snapshot whose rows it owns (``SeqSnapshot``, copied
out of the cells at save time: later writes to those cells cannot change it) and the block keys of
the prompt it holds. One daemon thread encodes it (``to_bytes``) and writes it to every lower tier
(``ByteTier.write_run``: atomic, budgeted, never raising on I/O). The queue is bounded in jobs and
in bytes: a job that does not fit is refused (``submit`` returns False; the caller keeps the entry
locally and writes it later, at eviction, ``flush`` or ``close``), so a burst of saves never grows
memory without bound and never blocks a request. Errors (an encoder or a tier raising) are counted,
never raised into a request.

The writer holds no reference to the store (only to the tiers), so a store nobody references can
be collected; ``PrefixStore`` closes its writer when it is closed or collected, and at interpreter
exit.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict, deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .tiers.base import BIND_FIRST, binding

#: remembered run keys the lower tiers hold (this process wrote them): saves of a prompt already
#: written skip the copy; bounded, oldest forgotten first (forgetting only costs a rewrite)
_WRITTEN_LIMIT = 65536
#: remembered block keys handed to the writer (chained runs); bounded likewise
_BLOCKS_LIMIT = 1 << 18


class Job:
    """One run to write: ``keys`` (hex block keys of the prompt's blocks, the last one the run
    key), ``snap`` (an owned ``SeqSnapshot`` or ready bytes), ``nbytes`` (its K/V bytes, for the
    queue bound) and ``tag`` (anything the caller wants back with the result, e.g. index nodes
    for events)."""

    __slots__ = ("keys", "snap", "nbytes", "tag", "first")

    def __init__(self, keys: Sequence[str], snap: Any, nbytes: int, tag: Any = None,
                 first: int = 0) -> None:
        self.keys = list(keys)
        self.snap = snap
        self.nbytes = int(nbytes)
        self.tag = tag
        self.first = int(first)   # blocks before it get no pointer (a window pruned them)

    @property
    def run_key(self) -> str:
        return self.keys[-1]


class TierWriter:
    """A bounded queue of :class:`Job` and one daemon thread writing them to ``tiers`` in order.

    Args:
        tiers: the lower tiers (``ByteTier``), written in this order, each one (a tier that
            refuses, full or down, does not stop the others).
        max_jobs, max_bytes: the queue's bounds (a single job larger than ``max_bytes`` is taken
            only when the queue is empty, so no prefix is too large to be written).
        metadata: str -> str pairs every run's bytes record (``PrefixStore`` passes its
            ``model_id``: ``numbakv store stats`` shows which model a namespace serves).
    """

    def __init__(self, tiers: Sequence[Any], *, max_jobs: int = 64,
                 max_bytes: int = 256 << 20, metadata: Optional[Dict[str, str]] = None,
                 pool: Any = None, chain_tokens: int = 0) -> None:
        self.tiers = list(tiers)
        #: > 0 (the store's block size): a run whose leading blocks a tier already holds is
        #: written as a *chained* run (its rows from the first block the tier lacks; a load
        #: reads the parent run(s) first), so a growing conversation writes each block once
        #: instead of its whole prefix every turn. 0: every run holds its whole prompt.
        self.chain_tokens = int(chain_tokens)
        #: where a written job's rows go back for reuse (the store's ``BufferPool``), or None
        self.pool = pool
        #: str -> str recorded in every run's snapshot metadata (the store's model id)
        self.metadata = dict(metadata or {})
        self.max_jobs = int(max_jobs)
        self.max_bytes = int(max_bytes)
        self._cv = threading.Condition()
        self._queue: Deque[Job] = deque()
        self._queued_bytes = 0
        self._busy = 0                      # jobs taken by the thread, not finished
        self._results: Deque[Tuple[Any, str]] = deque()   # (tag, tier name) written
        self._written: "OrderedDict[str, None]" = OrderedDict()
        #: block keys of every job queued (chained runs: a later save of a longer prompt
        #: hands over only the blocks past them); bounded, oldest forgotten first
        self._blocks: "OrderedDict[str, None]" = OrderedDict()
        self._queued_keys: Dict[str, int] = {}
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self._pid = os.getpid()
        self.counts = {"queued": 0, "written": 0, "refused": 0, "failed": 0, "errors": 0}

    def _check_fork(self) -> None:
        """In a child forked from the process that made this writer (``multiprocessing``'s
        fork start method): the thread did not come along and the lock may have been held at
        the fork, so the child starts a writer of its own (the parent writes what it had
        queued)."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._cv = threading.Condition()
        self._queue = deque()
        self._queued_bytes = 0
        self._busy = 0
        self._queued_keys = {}
        self._results = deque()
        self._thread = None

    # ------------------------------------------------------------------ request side
    def known(self, run_key: str) -> bool:
        """Whether ``run_key`` was written (by this process) or is queued."""
        self._check_fork()
        with self._cv:
            return run_key in self._written or run_key in self._queued_keys

    def forget(self, run_key: Optional[str] = None) -> None:
        """Forget that ``run_key`` (None: every run) was written (the tiers were cleared, or
        lost it): its blocks too, so a later save hands over the whole prompt again."""
        self._check_fork()
        with self._cv:
            if run_key is None:
                self._written.clear()
            else:
                self._written.pop(run_key, None)
            # which blocks the lost run held is not known here: the next save of any prompt
            # hands over every block again (rare: a tier lost or refused a run)
            self._blocks.clear()

    def known_prefix(self, block_keys: Sequence[str]) -> int:
        """How many leading ``block_keys`` were handed to this writer (queued or written) and
        not forgotten since: their rows need not be handed over again (chained runs)."""
        self._check_fork()
        with self._cv:
            m = 0
            for key in block_keys:
                if key not in self._blocks:
                    break
                m += 1
            return m

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False (nothing queued, counted in ``refused``) when the queue is full
        or the writer is closed. Never blocks for the write."""
        self._check_fork()
        with self._cv:
            if self._stopped or not self.tiers:
                return False
            full = len(self._queue) >= self.max_jobs or (
                self._queue and self._queued_bytes + job.nbytes > self.max_bytes)
            if full:
                self.counts["refused"] += 1
                return False
            self._queue.append(job)
            self._queued_bytes += job.nbytes
            if self.chain_tokens > 0:
                for key in job.keys[job.first:]:
                    self._blocks[key] = None
                    self._blocks.move_to_end(key)
                while len(self._blocks) > _BLOCKS_LIMIT:
                    self._blocks.popitem(last=False)
            self._queued_keys[job.run_key] = self._queued_keys.get(job.run_key, 0) + 1
            self.counts["queued"] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="numbakv-tier-writer",
                                                daemon=True)
                self._thread.start()
            self._cv.notify_all()
            return True

    def write_now(self, job: Job) -> None:
        """Write ``job`` on the caller's thread (the queue was full and the entry is leaving
        the local tiers: the caller waits for this one write, as before write-through)."""
        self._write(job)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued job is written (or failed); False when ``timeout`` seconds
        passed first."""
        self._check_fork()
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def results(self) -> List[Tuple[Any, str]]:
        """``(tag, tier name)`` of each run written since the last call (the store turns them
        into ``BlockStored`` events on its own thread)."""
        out = []
        while self._results:
            out.append(self._results.popleft())
        return out

    def stats(self) -> Dict[str, int]:
        self._check_fork()
        with self._cv:
            return {**self.counts, "pending": len(self._queue) + self._busy,
                    "pending_bytes": self._queued_bytes}

    def close(self, timeout: Optional[float] = 30.0) -> bool:
        """Write what is queued (up to ``timeout`` seconds), then stop the thread. Returns
        whether the queue was drained."""
        drained = self.flush(timeout)
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0 if drained else 0.1)
        return drained

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._stopped)
                if not self._queue:
                    return           # stopped and drained
                job = self._queue.popleft()
                self._queued_bytes -= job.nbytes
                self._busy += 1
            try:
                self._write(job)
                if self.pool is not None:
                    self.pool.give(job.snap)   # reused once nobody else holds the rows
                job.snap = None
            finally:
                with self._cv:
                    self._busy -= 1
                    n = self._queued_keys.get(job.run_key, 0) - 1
                    if n > 0:
                        self._queued_keys[job.run_key] = n
                    else:
                        self._queued_keys.pop(job.run_key, None)
                    self._cv.notify_all()

    def _held_prefix(self, tier: Any, job: Job) -> int:
        """How many leading full blocks of ``job``'s prompt ``tier`` holds already in other
        runs (one ``find_blocks`` round trip; 0 on any failure or without chaining). Blocks
        held by this very run (a rewrite) do not count: the run keeps them."""
        if self.chain_tokens <= 0 or len(job.keys) < 2 or job.first:
            return 0
        try:
            found = tier.find_blocks(job.keys[:-1])
        except Exception:   # noqa: BLE001 - a miss, as everywhere in the tiers
            return 0
        m = 0
        while m < len(found) and found[m] is not None and found[m][0] != job.run_key:
            m += 1
        return m

    def _write(self, job: Job) -> None:
        if self.chain_tokens > 0 and not isinstance(job.snap, (bytes, bytearray, memoryview)):
            self._write_chained(job)
            return
        try:
            # the bytes carry their run and block keys: every read checks them (base.is_bound)
            # (to_chunks: the header and views of the job's own rows, written with one writev:
            # no joined copy of the run on the way to the tier)
            data = job.snap if isinstance(job.snap, (bytes, bytearray, memoryview)) \
                else job.snap.to_chunks({**self.metadata, **binding(job.keys)})
        except Exception:   # noqa: BLE001 - a bad snapshot must not kill the writer
            with self._cv:
                self.counts["errors"] += 1
            return
        ok_any = False
        joined = None
        for tier in self.tiers:
            try:
                if isinstance(data, list) and not getattr(tier, "accepts_chunks", False):
                    if joined is None:    # a tier of another protocol: one buffer, as before
                        joined = b"".join(data)
                    ok = tier.write_run(job.run_key, job.keys[job.first:], joined)
                else:
                    ok = tier.write_run(job.run_key, job.keys[job.first:], data)
            except Exception:   # noqa: BLE001 - tiers never raise on I/O; count anything else
                with self._cv:
                    self.counts["errors"] += 1
                continue
            if ok:
                ok_any = True
                self._results.append((job.tag, tier.name))
            else:
                with self._cv:
                    self.counts["failed"] += 1
        with self._cv:
            if ok_any:
                self.counts["written"] += 1
                self._written[job.run_key] = None
                self._written.move_to_end(job.run_key)
                while len(self._written) > _WRITTEN_LIMIT:
                    self._written.popitem(last=False)


    def _write_chained(self, job: Job) -> None:
        """Write ``job`` to each tier holding only the blocks that tier lacks: the rows from
        the first missing block on (a view of the job's rows: no copy), pointers for those
        blocks only, and the binding of the whole prompt (``prefix.blocks``: every key, so a
        read checks the block it came for) plus ``prefix.first`` (the first block whose rows
        the run holds; the reader loads blocks before it from their own runs first). A tier
        holding every block already is only asked to keep the run (``write_run`` of nothing
        new is skipped)."""
        from ..state.snapshot import SnapshotPart   # state layer (rows only: no cache access)
        snap = job.snap
        base = int(snap.parts[0].positions[0]) // self.chain_tokens \
            if len(snap.parts[0].positions) else 0
        ok_any = False
        encoded: Dict[int, Any] = {}
        for tier in self.tiers:
            held = self._held_prefix(tier, job) if len(job.keys) > 1 else 0
            if held < base:
                # the job holds no rows of blocks [held, base) and the tier lost them (evicted,
                # refused): a run chained past a gap would serve nothing. The next save hands
                # over the whole prompt (the entry itself is written whole at its eviction).
                with self._cv:
                    self.counts["failed"] += 1
                    self._blocks.clear()
                continue
            m = max(held, base)
            if m >= len(job.keys):
                m = len(job.keys) - 1       # the tail block, at least, is the run's own
            try:
                data = encoded.get(m)
                if data is None:
                    start = m * self.chain_tokens
                    parts = []
                    for p in snap.parts:
                        i = int(np.searchsorted(p.positions, start))
                        parts.append(SnapshotPart(positions=p.positions[i:],
                                                  keys=tuple(a[i:] for a in p.keys),
                                                  values=tuple(a[i:] for a in p.values),
                                                  k_format=p.k_format, v_format=p.v_format))
                    piece = type(snap)(parts=tuple(parts), fingerprint=snap.fingerprint,
                                       head_range=snap.head_range)
                    meta = {**self.metadata, **binding(job.keys)}
                    if m:
                        meta[BIND_FIRST] = str(m)
                    data = encoded[m] = piece.to_chunks(meta)
                if not getattr(tier, "accepts_chunks", False):
                    data = b"".join(data)
                ok = tier.write_run(job.run_key, job.keys[m:], data)
            except Exception:   # noqa: BLE001 - tiers never raise on I/O; count anything else
                with self._cv:
                    self.counts["errors"] += 1
                continue
            if ok:
                ok_any = True
                self._results.append((job.tag, tier.name))
            else:
                with self._cv:
                    self.counts["failed"] += 1
        with self._cv:
            if ok_any:
                self.counts["written"] += 1
                self._written[job.run_key] = None
                self._written.move_to_end(job.run_key)
                while len(self._written) > _WRITTEN_LIMIT:
                    self._written.popitem(last=False)
            else:   # no tier took it: the next save of the prompt hands over every block
                for key in job.keys:
                    self._blocks.pop(key, None)


__all__ = ["TierWriter", "Job"]
