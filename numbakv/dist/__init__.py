"""Beyond one process: move a sequence's K/V between ranks over ``torch.distributed`` (gloo on
CPUs, NCCL on GPUs), shard KV heads across tensor-parallel ranks, and check that the ranks'
bookkeeping stays replicated.

This package is the only importer of ``torch.distributed`` (lazily, at the first call) and
``import numbakv`` never imports it; install the extra: ``pip install numbakv[dist]``.

```python
from numbakv import dist
dist.send_seq(cache, seq, dst)                 # rank A: export seq, send it to rank dst
n = dist.recv_seq(cache, seq, src)             # rank B: receive it into seq (tokens placed)
n = dist.recv_seq(cache, seq, [0, 1])          # resharding: gather heads from several senders
h = dist.irecv_seq(cache, seq, src); ...; n = h.wait()
dist.check_replicated(cache)                   # every rank's cell table identical?
```

Ranks are global ranks (as ``torch.distributed.send`` takes them). Transfers between one pair
of ranks are matched in call order: do not run two transfers between the same pair at once.
See ``docs/distributed.md`` and :mod:`numbakv.dist._wire` for the messages.
"""

from __future__ import annotations

import datetime
import hashlib
import threading
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import KVCacheError
from . import _wire
from ._errors import ReplicationError, TransferError, TransferRefused, TransferTimeout

__all__ = ["send_seq", "recv_seq", "isend_seq", "irecv_seq", "check_replicated",
           "TransferHandle", "release_buffers", "table_digest", "TransferError",
           "TransferRefused", "TransferTimeout", "ReplicationError"]


#: how the rows move: "torch" (torch.distributed point-to-point messages) or "nixl" (NIXL's
#: UCX backend writes them into the receiver's registered buffer; control over torch)
TRANSPORTS = ("torch", "nixl")


# ------------------------------------------------------------------------------------- torch
def _torch():
    try:
        import torch
        import torch.distributed as tdist
    except ImportError as exc:  # pragma: no cover - the tests skip without torch
        raise ImportError("numbakv.dist needs PyTorch (pip install numbakv[dist])") from exc
    if not tdist.is_available() or not tdist.is_initialized():
        raise RuntimeError("numbakv.dist needs an initialized torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    return torch, tdist


class _Link:
    """Point-to-point messages of one call, each bounded by ``timeout``; a failure names the
    peer."""

    def __init__(self, group, timeout: Optional[float], transport: str = "torch") -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "nixl":
            from . import _nixl
            _nixl._api()      # ImportError with the install hint before anything is sent
        self.transport = transport
        self.torch, self.tdist = _torch()
        self.group = group
        backend = self.tdist.get_backend(group)
        self.device = self.torch.device("cpu")
        if backend == "nccl":
            self.device = self.torch.device("cuda", self.torch.cuda.current_device())
        if timeout is None:
            timeout = _group_timeout(self.tdist, group, self.device)
        elif not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                  and timeout > 0):
            raise ValueError(f"timeout must be None or seconds > 0, got {timeout!r}")
        self.timeout = None if timeout is None else datetime.timedelta(seconds=float(timeout))
        self.seconds = None if timeout is None else float(timeout)
        self.rank = self.tdist.get_rank()

    def _wait(self, works: Sequence[Tuple[Any, int, str]]) -> None:
        for work, peer, what in works:
            try:
                ok = work.wait(self.timeout) if self.timeout is not None else work.wait()
            except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
                raise TransferTimeout(f"peer rank {peer}: {what} did not complete within "
                                      f"{self._secs()} (the peer died, stalled or closed the "
                                      f"connection); {RECREATE}: {exc}") from exc
            if ok is False:
                raise TransferTimeout(f"peer rank {peer}: {what} timed out after "
                                      f"{self._secs()}; {RECREATE}")

    def _post(self, op, tensor, peer: int, what: str) -> Tuple[Any, int, str]:
        """Post one isend/irecv; a failure to post (the pair's connection is gone, e.g. after
        an earlier timeout) is a :class:`TransferTimeout` too, never a raw ``RuntimeError``."""
        try:
            if op == "send":
                work = self.tdist.isend(tensor, dst=peer, group=self.group)
            else:
                work = self.tdist.irecv(tensor, src=peer, group=self.group)
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
            raise TransferTimeout(f"peer rank {peer}: {what} could not be posted (the "
                                  f"connection to that rank is broken); {RECREATE}: {exc}") \
                from exc
        return (work, peer, what)

    def _secs(self) -> str:
        return "the process group's timeout" if self.timeout is None else \
            f"{self.timeout.total_seconds():g} s"

    def tensor(self, arr: np.ndarray, readonly_ok: bool = False):
        """``arr`` as a tensor on the link's device. ``readonly_ok``: a read-only array (a view
        of the cache's storage) is wrapped without a copy; it is only ever read (sent)."""
        arr = np.ascontiguousarray(arr)
        if not arr.flags.writeable and not readonly_ok:
            arr = arr.copy()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = self.torch.from_numpy(arr)
        return t if self.device.type == "cpu" else t.to(self.device)

    def empty(self, nbytes: int):
        return self.torch.empty(int(nbytes), dtype=self.torch.uint8, device=self.device)

    def post_send(self, tensor, peer: int, what: str) -> Tuple[Any, int, str]:
        """Start sending ``tensor`` (keep it alive until :meth:`wait`)."""
        return self._post("send", tensor, peer, what)

    def wait(self, works: Sequence[Tuple[Any, int, str]]) -> None:
        self._wait(works)

    def send(self, items: Sequence[Tuple[Any, int, str]]) -> None:
        """Send every ``(tensor, peer, what)`` at once, then wait for all."""
        works = [self._post("send", t, peer, what) for t, peer, what in items]
        self._wait(works)

    def recv(self, items: Sequence[Tuple[Any, int, str]]) -> None:
        works = [self._post("recv", t, peer, what) for t, peer, what in items]
        self._wait(works)


#: what every TransferTimeout says: gloo and NCCL leave a timed-out pair unusable
RECREATE = ("after a timeout the process group cannot be used between these ranks again: "
            "destroy it and re-create it (torch.distributed.destroy_process_group() + "
            "init_process_group(), or a new_group()) before the next transfer")


def _send_blob(link: _Link, peer: int, data: bytes, what: str) -> None:
    link.send([(link.tensor(np.array([len(data)], np.int64)), peer, f"{what} (length)"),
               (link.tensor(np.frombuffer(data, np.uint8)), peer, what)])


def _recv_blob(link: _Link, peer: int, what: str) -> bytes:
    n = link.empty(8)
    link.recv([(n, peer, f"{what} (length)")])
    size = int(_host(n).view(np.int64)[0])
    if not 0 < size <= _wire.MAX_HEADER_BYTES:
        raise TransferError(f"rank {peer} sent {what} of {size} bytes")
    data = link.empty(size)
    link.recv([(data, peer, what)])
    return _host(data).tobytes()


def _group_timeout(tdist, group, device) -> Optional[float]:
    """The process group's own timeout (``init_process_group(timeout=...)``), else None."""
    try:
        pg = group if group is not None else tdist.distributed_c10d._get_default_group()
        return pg._get_backend(device).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - private API: fall back to work.wait()'s default
        return None


class _BufferPool:
    """Receive buffers kept for the next transfer: a fresh buffer of hundreds of MiB costs its
    page faults on every transfer (more than the copy into the cache on a loaded host). Holds
    at most one free buffer per device (the largest seen); :func:`release_buffers` drops it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: dict = {}

    def take(self, link: "_Link", nbytes: int):
        with self.lock:
            t = self.free.get(link.device)
            if t is not None and t.numel() >= nbytes:
                del self.free[link.device]
                return t[:nbytes]
        return link.empty(nbytes)

    def give(self, tensors) -> None:
        with self.lock:
            for t in tensors:
                base = t._base if t._base is not None else t
                have = self.free.get(base.device)
                if have is None or have.numel() < base.numel():
                    self.free[base.device] = base


_POOL = _BufferPool()


def release_buffers() -> None:
    """Free the receive buffer kept for the next transfer."""
    with _POOL.lock:
        _POOL.free.clear()


def _host(t) -> np.ndarray:
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def _check_rank(name: str, value, tdist, group) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be a rank (int), got {value!r}")
    world = tdist.get_world_size() if group is None else None
    if world is not None and not 0 <= int(value) < world:
        raise ValueError(f"{name} must be a rank in [0, {world}), got {value}")
    if int(value) == tdist.get_rank():
        raise ValueError(f"{name} must be another rank than this one ({value})")
    return int(value)


def _kv_half(cache):
    """The cache holding the K/V rows: a HybridCache's attention half, else the cache."""
    return cache.attn if getattr(cache, "rc", None) is not None and hasattr(cache, "attn") \
        else cache


def _n_kv_heads(cache) -> int:
    cache = _kv_half(cache)
    cfg = getattr(cache, "config", None) or cache.caches[0].config
    return int(cfg.n_kv_heads)


# -------------------------------------------------------------------------------------- send
class TransferHandle:
    """An asynchronous transfer: ``wait()`` blocks until it is done and returns the number of
    tokens moved (or raises what the synchronous call would have raised)."""

    def __init__(self, background: Callable[[], Any],
                 finish: Optional[Callable[[Any], int]] = None) -> None:
        self._finish = finish
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._done = False
        self._value: Optional[int] = None
        self._thread = threading.Thread(target=self._run, args=(background,), daemon=True,
                                        name="numbakv-dist-transfer")
        self._thread.start()

    def _run(self, background) -> None:
        try:
            self._result = background()
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc

    def is_completed(self) -> bool:
        """Whether the network part is over (``wait()`` then returns without blocking on it)."""
        return not self._thread.is_alive()

    def wait(self) -> int:
        """Finish the transfer (a receive imports into the cache here, on the calling thread)
        and return the tokens moved."""
        if self._done:
            if self._error is not None:
                raise self._error
            return self._value
        self._thread.join()
        self._done = True
        if self._error is not None:
            raise self._error
        try:
            self._value = self._finish(self._result) if self._finish else self._result
        except BaseException as exc:
            self._error = exc
            raise
        return self._value


def _export(cache, seq, p0, p1):
    export = getattr(cache, "export_seq", None)
    if export is None:
        raise ValueError(f"cache must be a numbakv cache with export_seq, got "
                         f"{type(cache).__name__}")
    return export(seq, p0, p1)


def _send_prepared(link: _Link, snap, dst: int, n_kv_heads: int) -> int:
    record = _wire.make_header(snap, n_kv_heads)
    record["transport"] = link.transport
    blob = None
    if getattr(snap, "recurrent", None) is not None:
        # a hybrid's recurrent state (restore points + its live end) goes after the K/V rows
        blob = _snapshot_api().recurrent_blob(snap.recurrent, snap.layer_kinds)
        record["recurrent"] = len(blob)
    header = _wire.encode_header(record)
    link.send([(link.tensor(np.array([len(header)], np.int64)), dst, "the header length"),
               (link.tensor(np.frombuffer(header, np.uint8)), dst, "the header")])
    verdict = link.empty(_wire.VERDICT_BYTES)
    link.recv([(verdict, dst, "the receiver's verdict on the header")])
    code, reason = _wire.decode_verdict(_host(verdict))
    if code == _wire.SKIP:
        return 0
    if code != _wire.OK:
        raise TransferRefused(f"rank {dst} refused the sequence: {reason}")
    # the receiver names the heads it keeps: only those travel (1 -> 2 resharding sends each
    # shard its half, as vLLM's heterogeneous-TP transfer reads only the slice it needs)
    lo, hi = _wire.parse_heads(reason, snap.head_range)
    if (lo, hi) != tuple(snap.head_range):
        snap = snap.select_heads(lo, hi)
    if link.transport == "nixl":
        from . import _nixl
        blob = _recv_blob(link, dst, "the NIXL offer")
        arrays = [a for part in snap.parts for layer in range(len(part.keys))
                  for a in (part.keys[layer], part.values[layer])]
        _nixl.sender_write(_nixl.agent(link.rank), blob, arrays, link.seconds, dst)
    else:
        # the rows go out straight from the exported arrays (views of the cache's storage where
        # the sequence's cells form a run: no copy), K then V of each layer, all posted at once
        works = []
        for g, part in enumerate(snap.parts):
            for layer in range(len(part.keys)):
                for side, arr in (("K", part.keys[layer]), ("V", part.values[layer])):
                    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
                    if not flat.size:   # nothing to send (the receiver posts nothing either)
                        continue
                    works.append(link.post_send(link.tensor(flat, readonly_ok=True), dst,
                                                f"the {side} rows of group {g} layer {layer}"))
        link.wait(works)
    if blob is not None:
        link.send([(link.tensor(np.frombuffer(blob, np.uint8), readonly_ok=True), dst,
                    "the recurrent state")])
    ack = link.empty(_wire.VERDICT_BYTES)
    link.recv([(ack, dst, "the receiver's acknowledgement")])
    code, reason = _wire.decode_verdict(_host(ack))
    if code != _wire.OK:
        raise TransferRefused(f"rank {dst} could not import the sequence: {reason}")
    return int(len(snap.parts[0].positions)) if snap.parts else 0


def _prepare_send(cache, seq, dst, p0, p1, group, timeout, transport):
    link = _Link(group, timeout, transport)
    dst = _check_rank("dst", dst, link.tdist, group)
    snap = _export(cache, seq, p0, p1)
    return link, snap, dst


def send_seq(cache, seq: int, dst: int, *, p0: int = 0, p1: Optional[int] = None,
             group=None, timeout: Optional[float] = None, transport: str = "torch") -> int:
    """Send positions ``[p0, p1)`` of sequence ``seq`` of ``cache`` to rank ``dst``, which calls
    :func:`recv_seq`. Returns the tokens sent (0 when the receiver needed none of this rank's
    heads); raises :class:`TransferRefused` with the receiver's reason when it refused, and
    :class:`TransferTimeout` naming ``dst`` when it did not answer within ``timeout`` seconds
    (default: the process group's timeout). The sending cache is never changed.
    ``transport="nixl"`` moves the rows through NIXL (UCX) instead of torch.distributed
    messages (the receiver must pass the same; see :mod:`numbakv.dist._nixl`).

    The rows move in their stored format (quantized blocks stay quantized), one message per
    layer (its K then its V rows), after a small header the receiver checks before it
    allocates anything."""
    link, snap, dst = _prepare_send(cache, seq, dst, p0, p1, group, timeout,
                                   transport)
    return _send_prepared(link, snap, dst, _n_kv_heads(cache))


def isend_seq(cache, seq: int, dst: int, *, p0: int = 0, p1: Optional[int] = None,
              group=None, timeout: Optional[float] = None,
              transport: str = "torch") -> TransferHandle:
    """:func:`send_seq` in the background: the sequence is exported now (the cache may change
    afterwards); ``handle.wait()`` returns the tokens sent or raises what ``send_seq`` would."""
    link, snap, dst = _prepare_send(cache, seq, dst, p0, p1, group, timeout,
                                   transport)
    n_kv = _n_kv_heads(cache)
    return TransferHandle(lambda: _send_prepared(link, snap, dst, n_kv))


# ----------------------------------------------------------------------------------- receive
def _check_srcs(src, tdist, group) -> List[int]:
    if isinstance(src, (list, tuple)):
        if not src:
            raise ValueError("src must be a rank or a non-empty list of ranks, got []")
        srcs = [_check_rank(f"src[{i}]", s, tdist, group) for i, s in enumerate(src)]
        if len(set(srcs)) != len(srcs):
            raise ValueError(f"src must not repeat a rank, got {list(src)}")
        return srcs
    return [_check_rank("src", src, tdist, group)]


def _receive_rows(link: _Link, cache, seq, srcs: List[int], at):
    """The network half of a receive: headers, verdicts, rows. Returns what :func:`_import`
    needs; on a refusal every sender has been told and :class:`TransferRefused` is raised."""
    n_kv = _n_kv_heads(cache)
    kv = _kv_half(cache)
    rc = getattr(cache, "rc", None) if kv is not cache else None
    need = _wire.head_range_of(kv)
    lengths = [link.empty(8) for _ in srcs]
    link.recv([(t, s, "the header length") for t, s in zip(lengths, srcs)])
    reason, probe, headers, takes = None, None, [], []
    sizes = [int(_host(t).view(np.int64)[0]) for t in lengths]
    bad = [(s, n) for s, n in zip(srcs, sizes) if not 0 < n <= _wire.MAX_HEADER_BYTES]
    if bad:
        # the peer is not speaking this protocol: no header length to trust, so no verdict can
        # be matched to it either
        raise TransferError(f"rank {bad[0][0]} sent a header length of {bad[0][1]} bytes "
                            f"(allowed 1..{_wire.MAX_HEADER_BYTES}): not a numbakv transfer")
    raw = [link.empty(n) for n in sizes]
    link.recv([(t, s, "the header") for t, s in zip(raw, srcs)])
    try:
        _check_seq(cache, seq)
        probe = _wire.Probe(kv, _snapshot_api().cache_fingerprint(kv))
        if at is not None and (isinstance(at, (bool, np.bool_))
                               or not isinstance(at, (int, np.integer)) or at < 0):
            raise ValueError(f"at must be None or an integer >= 0, got {at!r}")
        for s, t in zip(srcs, raw):
            try:
                h = _wire.decode_header(_host(t).tobytes())
                _check_recurrent_header(h, s, rc)   # first: the clearest reason
                takes.append(_wire.check_header(h, probe, need, n_kv))
            except _wire.Refusal as exc:
                raise _wire.Refusal(f"from rank {s}: {exc}") from None
            headers.append(h)
        for h, s in zip(headers, srcs):
            if h.get("transport", "torch") != link.transport:
                raise _wire.Refusal(f"rank {s} sends the rows over {h.get('transport')!r}, this "
                                    f"rank receives over {link.transport!r}: pass the same "
                                    "transport= on both sides")
        for h, s in zip(headers[1:], srcs[1:]):
            for g, (a, b) in enumerate(zip(headers[0]["parts"], h["parts"])):
                if not np.array_equal(a["positions"], b["positions"]):
                    raise _wire.Refusal(f"ranks {srcs[0]} and {s} sent different positions "
                                        f"for group {g}: they hold different sequences")
        plan = _wire.plan_cover(takes, need)
    except (_wire.Refusal, ValueError, KVCacheError) as exc:
        reason = str(exc)
    if reason is not None:
        link.send([(link.tensor(_wire.encode_verdict(_wire.REFUSED, reason)), s, "the verdict")
                   for s in srcs])
        raise TransferRefused(f"refused the sequence from rank(s) {srcs}: {reason}")
    link.send([(link.tensor(_wire.encode_verdict(_wire.OK, f"{p[0]} {p[1]}") if p
                            else _wire.encode_verdict(_wire.SKIP)), s, "the verdict")
               for s, p in zip(srcs, plan)])
    # the header fits: now allocate and receive the rows
    items, bufs = [], []
    for s, h, p in zip(srcs, headers, plan):
        if p is None:
            continue
        for g, part in enumerate(h["parts"]):
            nbytes, layout = _wire.part_layout(part, p[1] - p[0])
            t = _POOL.take(link, nbytes)
            bufs.append((s, h, p, g, t))
            for i, (offset, shape, dt) in enumerate(layout):
                n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
                if not n:
                    continue
                items.append((t[offset:offset + n], s, f"the {'KV'[i % 2]} rows of group {g} "
                                                       f"layer {i // 2}"))
    # (on a failure the buffers are not pooled again: a receive still posted may write them)
    if link.transport == "nixl":
        from . import _nixl
        ag = _nixl.agent(link.rank)
        for s in [s for s, p in zip(srcs, plan) if p is not None]:
            mine = [(t, [(o, o + int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize)
                         for o, shape, dt in _wire.part_layout(h["parts"][g], p[1] - p[0])[1]])
                    for s2, h, p, g, t in bufs if s2 == s]
            blob, regs, tag = _nixl.receiver_offer(ag, link.rank, mine)
            _send_blob(link, s, blob, "the NIXL offer")
            try:
                _nixl.receiver_wait(ag, f"numbakv-rank{s}", tag, link.seconds, s)
            finally:
                _nixl.receiver_done(ag, regs)
    else:
        link.recv(items)
    blobs = []
    if rc is not None:   # each sender of rows sends the (replicated) recurrent state after them
        blobs = [link.empty(int(h["recurrent"])) for h, p in zip(headers, plan) if p is not None]
        link.recv([(t, s, "the recurrent state") for t, s in
                   zip(blobs, [s for s, p in zip(srcs, plan) if p is not None])])
    return probe, need, bufs, [s for s, p in zip(srcs, plan) if p is not None], blobs


def _check_recurrent_header(h: dict, src: int, rc) -> None:
    """A hybrid sequence goes only into a HybridCache and a HybridCache takes only hybrid
    sequences; the recurrent state's size is bounded by what the receiver could hold."""
    size = h.get("recurrent")
    if rc is None:
        if size is not None:
            raise _wire.Refusal(f"rank {src} sends a hybrid model's sequence (K/V and recurrent "
                                "state): this cache is attention-only and would lose the state")
        return
    if size is None:
        raise _wire.Refusal(f"rank {src} sends K/V without recurrent state: this HybridCache "
                            "cannot serve the sequence without the state of its recurrent layers")
    limit = (rc.config.max_restore_points + 2) * rc.config.state_bytes + (1 << 20)
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= limit:
        raise _wire.Refusal(f"rank {src}: a recurrent state of {size!r} bytes (this cache holds "
                            f"at most {limit})")


def _snapshot_api():
    """The module of ``SeqSnapshot`` (SnapshotPart, cache_fingerprint live beside it)."""
    from ..state import snapshot
    return snapshot


def _check_seq(cache, seq) -> int:
    cache = _kv_half(cache)
    cfg = getattr(cache, "config", None) or cache.caches[0].config
    if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)) \
            or not 0 <= int(seq) < cfg.max_seqs:
        raise ValueError(f"seq must be an integer in [0, max_seqs={cfg.max_seqs}), got {seq!r}")
    return int(seq)


def _assemble(probe, need, bufs):
    """The received rows as one SeqSnapshot of this cache's heads ``need``."""
    api = _snapshot_api()
    SeqSnapshot, SnapshotPart = api.SeqSnapshot, api.SnapshotPart
    by_group: dict = {}
    for s, h, take, g, t in bufs:
        flat = _host(t)
        part = h["parts"][g]
        _, layout = _wire.part_layout(part, take[1] - take[0])   # only the heads taken came
        arrays = []
        for offset, shape, dt in layout:
            n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
            arrays.append(flat[offset:offset + n].view(dt).reshape(shape))
        by_group.setdefault(g, []).append((take[0], part, arrays))
    parts = []
    for g in range(len(probe.parts)):
        pieces = sorted(by_group[g], key=lambda x: x[0])
        part = pieces[0][1]
        joined = [a[0] if len(a) == 1 else np.concatenate(a, axis=1)
                  for a in zip(*(p[2] for p in pieces))]
        joined = [np.ascontiguousarray(a) for a in joined]
        parts.append(SnapshotPart(positions=part["positions"], keys=joined[0::2],
                                  values=joined[1::2], k_format=part["k_format"],
                                  v_format=part["v_format"]))
    # the fingerprints matched up to head ranges (checked on the header): the rows now are
    # those of this cache's heads, so they carry this cache's fingerprint
    return SeqSnapshot(parts=tuple(parts), fingerprint=probe.fingerprint, head_range=tuple(need))


def _import(link: _Link, cache, seq, at, received) -> int:
    probe, need, bufs, senders, blobs = received
    try:
        snap = _assemble(probe, need, bufs)
        if blobs:
            part, kinds = _snapshot_api().recurrent_from_blob(_host(blobs[0]).tobytes())
            snap = snap._with(recurrent=part, layer_kinds=kinds)
        n = cache.import_seq(seq, snap, at=at)
    except (ValueError, KVCacheError) as exc:
        _POOL.give([b[4] for b in bufs])
        link.send([(link.tensor(_wire.encode_verdict(_wire.REFUSED, str(exc))), s, "the ack")
                   for s in senders])
        if isinstance(exc, KVCacheError):
            raise
        raise TransferRefused(f"import_seq refused the sequence from rank(s) {senders}: "
                              f"{exc}") from exc
    del snap   # its rows view the receive buffers: import_seq copied them into the cache
    _POOL.give([b[4] for b in bufs])
    link.send([(link.tensor(_wire.encode_verdict(_wire.OK)), s, "the ack") for s in senders])
    return int(n)


def recv_seq(cache, seq: int, src: Union[int, Sequence[int]], *, at: Optional[int] = None,
             group=None, timeout: Optional[float] = None, transport: str = "torch") -> int:
    """Receive a sequence sent by :func:`send_seq` into sequence ``seq`` of ``cache`` (which
    must hold none of its positions); returns the tokens placed (``import_seq``'s count).

    ``src`` is a rank, or a list of ranks whose head ranges together cover this cache's heads
    (resharding ``world=2 -> world=1``); a receiver keeps the heads of its own head range of
    whatever it receives (``1 -> 2``: one sender sends the whole sequence to each rank). ``at``
    moves the positions to start there (keys re-rotated, as ``import_seq``).

    The rows arrive in one message per layer. Each header is checked before anything is
    allocated; a mismatch (fingerprint, formats,
    shapes, heads not covered) raises :class:`TransferRefused` here and in every sender. A
    sender that dies or stalls raises :class:`TransferTimeout` naming it. On any error the
    cache is unchanged."""
    link = _Link(group, timeout, transport)
    srcs = _check_srcs(src, link.tdist, group)
    received = _receive_rows(link, cache, seq, srcs, at)
    return _import(link, cache, seq, at, received)


def irecv_seq(cache, seq: int, src: Union[int, Sequence[int]], *, at: Optional[int] = None,
              group=None, timeout: Optional[float] = None,
              transport: str = "torch") -> TransferHandle:
    """:func:`recv_seq` in the background: headers and rows arrive on a helper thread while the
    caller keeps using the cache; ``handle.wait()`` (call it from the thread that uses the
    cache) imports the rows, acknowledges the senders and returns the tokens placed."""
    link = _Link(group, timeout, transport)
    srcs = _check_srcs(src, link.tdist, group)
    return TransferHandle(lambda: _receive_rows(link, cache, seq, srcs, at),
                          lambda received: _import(link, cache, seq, at, received))


# -------------------------------------------------------------------------------- replication
def _tables(cache) -> List[Any]:
    cache = _kv_half(cache)
    caches = getattr(cache, "caches", None) or [cache]
    units = []
    for c in caches:   # a stream cache's cell tables are its streams'
        streams = getattr(c, "streams", None)
        units += streams if isinstance(streams, list) else [c]
    out = []
    for c in units:
        table = getattr(c, "cells", None)
        if table is None or not hasattr(table, "_ps"):
            raise ValueError(f"cache must be a numbakv CausalCache, StreamCache or WrapperCache, "
                             f"got {type(c).__name__}")
        out.append(table)
    return out


def table_digest(cache) -> bytes:
    """SHA-256 of the cache's bookkeeping: every cell's position, pending shift and sequence
    bits, the per-sequence cell and position ranges and the table's counters (used cells, scan
    head, pending-shift range), for each layer group. Identical on every rank of a
    head-sharded group as long as they saw the same batches and operations."""
    h = hashlib.sha256()
    for table in _tables(cache):
        for arr in (table._ps, table._seqs, table._sidx, table._meta):
            h.update(np.ascontiguousarray(arr).tobytes())
    if _kv_half(cache) is not cache:   # a HybridCache: its recurrent half's positions and points
        rc = cache.rc
        h.update(repr((rc._lo, rc._hi, [sorted(p) for p in rc._points])).encode())
    return h.digest()


def check_replicated(cache, group=None) -> None:
    """Compare :func:`table_digest` across the ranks of ``group`` (all-gather of 32 bytes);
    raises :class:`ReplicationError` naming the first rank whose cell table differs from rank
    0's. A collective: every rank of the group must call it."""
    torch, tdist = _torch()
    digest = np.frombuffer(table_digest(cache), np.uint8)
    device = torch.device("cpu")
    if tdist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.from_numpy(digest.copy()).to(device)
    world = tdist.get_world_size(group)
    out = [torch.empty_like(mine) for _ in range(world)]
    tdist.all_gather(out, mine, group=group)
    got = [_host(t).tobytes() for t in out]
    for i, d in enumerate(got):
        if d != got[0]:
            ranks = tdist.get_process_group_ranks(group) if group is not None else range(world)
            raise ReplicationError(f"the cell table of rank {list(ranks)[i]} differs from rank "
                                   f"{list(ranks)[0]}'s (digest {d.hex()[:16]} vs "
                                   f"{got[0].hex()[:16]}): the ranks' bookkeeping diverged")
