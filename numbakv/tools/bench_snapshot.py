"""``numbakv bench --sections snapshot``: moving one sequence's K/V (``export_seq`` +
``import_seq``) against a plain copy of the same bytes.

One sequence of ``tokens`` tokens in a ``layers`` x ``heads`` x ``dim`` cache (issue 24: 4,096
tokens, 32 layers, 8 x 128, float16 = 512 MiB of K/V) is exported from one cache and imported
into another of the same shape; after each timed round the destination drops it again
(untimed). The baseline, timed in the same loop with the rounds interleaved so a busy machine's
load moves both alike: on the CPU ``np.copyto`` of the same K and V arrays between the same two
caches' storages; on a GPU, CuPy copies of the same bytes device -> pinned host -> device (what a
snapshot through host memory must do at least). Cases:

* ``views``: the sequence fills one run of cells, so the export hands out views of the storage
  and the import is one copy per layer and side (the common case: a prefilled sequence);
* ``gather``: the sequence's cells interleave with another's, so the export gathers (one copy
  per layer and side) and the import copies again;
* ``bytes``: ``to_bytes`` + ``from_bytes`` + import (the state codec's checksum and framing on
  top: what a disk or network tier pays).
* ``export_gather``: ``export_seq`` alone of the interleaved sequence (one compiled row copy
  per side over every layer into one fresh buffer: the kernel zeroing fresh pages included);
  ``export_gather_pooled``: the same into a recycled buffer (``alloc=`` a
  ``numbakv.prefix.tiers.host.BufferPool``'s ``take``, what the prefix store does), the
  snapshot dropped after each round.

Targets (CPU): ``views`` at >= 50% of the copy's bandwidth (issue 24), and
``export_gather_pooled`` too (issue 36 item 6: a snapshot of interleaved cells); on a GPU
``views`` >= 80% of the pinned device<->host copy. CPU cases are timed in thread CPU time (see
:func:`run`).
"""

from __future__ import annotations

import gc
import time
from typing import Callable, Dict, List

import numpy as np

#: the issue's shape
TOKENS, LAYERS, HEADS, DIM = 4096, 32, 8, 128


def _caches(device: str, dtype: str, layers: int, heads: int, dim: int, tokens: int,
            interleave: bool):
    from ..causal import CausalCache
    from ..config import CacheConfig, RopeShift
    cfg = CacheConfig(layers, heads, dim, dtype=dtype, capacity=tokens, max_seqs=2,
                      max_batch=512, device=device)
    src, dst = CausalCache(cfg, shift=RopeShift()), CausalCache(cfg, shift=RopeShift())
    for cache in (src, dst):      # touch every page (fresh zeroed memory reads as free pages)
        cache.storage.keys.fill(1)
        cache.storage.values.fill(2)
    n = tokens
    if interleave:                # seq 0 in every other cell, seq 1 in the others
        cells0 = np.arange(0, 2 * n, 2, dtype=np.int32)
        src.cells.apply_batch(np.arange(1, 2 * n, 2, dtype=np.int32),
                              np.arange(n, dtype=np.int32), np.ones(n, np.int32))
    else:
        cells0 = np.arange(n, dtype=np.int32)
    src.cells.apply_batch(cells0, np.arange(n, dtype=np.int32), np.zeros(n, np.int32))
    return src, dst


def _interleaved(fns: Dict[str, Callable[[], object]], reset: Callable[[], object],
                 sync: Callable[[], None], budget: float, min_reps: int,
                 clock: Callable[[], float] = time.perf_counter) -> Dict[str, float]:
    """Median seconds of each function by ``clock``, called in turn; ``reset`` after each
    round, untimed."""
    for fn in fns.values():     # warm
        fn()
        sync()
    reset()
    times: Dict[str, List[float]] = {k: [] for k in fns}
    spent = 0.0
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        while True:
            for name, fn in fns.items():
                t0 = clock()
                fn()
                sync()
                dt = clock() - t0
                times[name].append(dt)
                spent += dt
            reset()
            if len(times[name]) >= min_reps and spent >= budget:
                break
    finally:
        if gc_was_on:
            gc.enable()
    return {k: float(np.median(v)) for k, v in times.items()}


def run(device: str = "cpu", dtype: str = "float16", *, layers: int = LAYERS,
        heads: int = HEADS, dim: int = DIM, tokens: int = TOKENS, budget: float = 2.0,
        min_reps: int = 3,
        cases=("views", "gather", "export_gather", "export_gather_pooled", "bytes"),
        log: Callable[[str], None] = lambda _: None) -> List[dict]:
    """One row per case: ``{"case", "bytes", "snapshot_s", "copy_s", "gbps", "copy_gbps",
    "fraction", "clock"}`` (``fraction``: copy time / snapshot time, i.e. the share of the
    baseline's bandwidth the snapshot reaches). On the CPU both sides are timed in the calling
    thread's CPU time (``time.thread_time``: both are one thread's work, and on a shared machine
    preemption would otherwise land in whichever side it hits; page faults of fresh memory are
    the thread's own kernel time and count); on a GPU in wall time (the copies run on the
    device)."""
    from ..state.snapshot import SeqSnapshot
    rows = []
    for case in cases:
        log(f"snapshot {case} ...")
        src, dst = _caches(device, dtype, layers, heads, dim, tokens,
                           case in ("gather", "export_gather", "export_gather_pooled"))
        nbytes = src.export_seq(0).nbytes

        if case == "export_gather":
            def move():
                src.export_seq(0)
        elif case == "export_gather_pooled":
            from ..prefix.tiers.host import BufferPool
            from ..state.snapshot import export_seq
            pool = BufferPool(2 * nbytes + (1 << 20))

            def move():
                pool.give(export_seq(src, 0, alloc=pool.take))
        elif case == "bytes":
            def move():
                dst.import_seq(0, SeqSnapshot.from_bytes(src.export_seq(0).to_bytes()))
        else:
            def move():
                dst.import_seq(0, src.export_seq(0))

        copy, sync, release = _baseline(device, src, dst, tokens)
        try:
            clock = time.perf_counter if device == "cuda" else time.thread_time
            t = _interleaved({"snapshot": move, "copy": copy}, lambda: dst.seq_rm(0), sync,
                             budget, min_reps, clock)
        finally:
            release()
        src.close()
        dst.close()
        gc.collect()
        rows.append({"case": case, "bytes": int(nbytes), "snapshot_s": t["snapshot"],
                     "copy_s": t["copy"], "gbps": nbytes / t["snapshot"] / 1e9,
                     "copy_gbps": nbytes / t["copy"] / 1e9,
                     "fraction": t["copy"] / t["snapshot"], "device": device,
                     "clock": "wall" if device == "cuda" else "thread CPU",
                     "shape": f"{tokens} tokens x {layers} layers x {heads}x{dim} {dtype}"})
    return rows


def _baseline(device: str, src, dst, n: int):
    """``(copy, sync, release)``: the same bytes (``n`` cells of every layer, K and V) copied
    plainly between the two storages, and how to wait for it."""
    keys, values = src.storage.keys[:, :n], src.storage.values[:, :n]
    dkeys, dvalues = dst.storage.keys[:, :n], dst.storage.values[:, :n]
    if device != "cuda":
        def copy():
            np.copyto(dkeys, keys)
            np.copyto(dvalues, values)
        return copy, lambda: None, lambda: None
    import cupy
    keys, values = cupy.ascontiguousarray(keys), cupy.ascontiguousarray(values)
    dkeys, dvalues = cupy.empty_like(keys), cupy.empty_like(values)
    mem = cupy.cuda.alloc_pinned_memory(keys.nbytes + values.nbytes)
    host = np.frombuffer(mem, np.uint8, keys.nbytes + values.nbytes)
    stream = cupy.cuda.get_current_stream()

    def copy():  # device -> pinned host -> device, the same bytes
        off = 0
        for a, b in ((keys, dkeys), (values, dvalues)):
            n = int(a.nbytes)
            a.data.copy_to_host_async(host[off:off + n].ctypes.data, n, stream)
            b.data.copy_from_host_async(host[off:off + n].ctypes.data, n, stream)
            off += n
    return copy, stream.synchronize, lambda: None


def format_lines(rows: List[dict]) -> List[str]:
    if not rows:
        return []
    base = "np.copyto" if rows[0]["device"] != "cuda" else "pinned D2H + H2D copy"
    lines = ["", f"Snapshots: export_seq + import_seq of one sequence ({rows[0]['shape']}) vs "
             f"{base} of the same bytes ({rows[0].get('clock', 'wall')} time)",
             f"{'case':<8} {'MiB':>7} {'ms':>9} {'GB/s':>7} {'copy ms':>9} {'copy GB/s':>9} "
             f"{'fraction':>8}"]
    for r in rows:
        lines.append(f"{r['case']:<8} {r['bytes'] / 2**20:>7.0f} {r['snapshot_s'] * 1e3:>9.1f} "
                     f"{r['gbps']:>7.2f} {r['copy_s'] * 1e3:>9.1f} {r['copy_gbps']:>9.2f} "
                     f"{r['fraction']:>8.0%}")
    return lines


def targets(rows: List[dict]) -> List[dict]:
    """The issues' targets: ``views`` (issue 24) and, on the CPU, ``export_gather_pooled``
    (issue 36 item 6)."""
    out = []
    by_case = {r["case"]: r for r in rows}
    r = by_case.get("views")
    if r is not None:
        gpu = r["device"] == "cuda"
        need = 0.8 if gpu else 0.5
        name = ("GPU snapshot export+import >= 80% of a pinned D2H+H2D copy" if gpu else
                "CPU snapshot export+import >= 50% of np.copyto bandwidth")
        out.append({"target": name, "status": "met" if r["fraction"] >= need else "missed",
                    "value": r["fraction"],
                    "detail": f"{r['fraction']:.0%} ({r['gbps']:.2f} vs {r['copy_gbps']:.2f} "
                              f"GB/s, {r['shape']})"})
    r = by_case.get("export_gather_pooled")
    if r is not None and r["device"] != "cuda":
        out.append({"target": "CPU snapshot of interleaved cells (export into recycled memory) "
                              ">= 50% of np.copyto bandwidth",
                    "status": "met" if r["fraction"] >= 0.5 else "missed",
                    "value": r["fraction"],
                    "detail": f"{r['fraction']:.0%} ({r['gbps']:.2f} vs {r['copy_gbps']:.2f} "
                              f"GB/s, {r['shape']}, {r.get('clock', 'wall')} time)"})
    return out


__all__ = ["run", "format_lines", "targets"]
