"""``numbakv bench --sections states``: moving recurrent state rows (``numbakv.RecurrentCache``)
against a plain copy of the same bytes.

Shape: gated-delta-net layers as Qwen3-Next has them (issue 33): per layer and sequence a
float32 delta state ``[32, 128, 128]`` (2 MiB) and a bfloat16 conv tail ``[3, 8192]`` (48 KiB);
``seqs`` sequences of a pool of ``2 * seqs``, every other one (not consecutive: the kernel's
gather, not a view). Timed interleaved in one process with the baseline (so a busy machine's
load moves both alike):

* ``gather``: the state-row kernel copying the sequences' rows of every layer into a dense
  buffer ``[layers, seqs, *shape]`` (what ``read_states`` does, allocation aside);
* ``scatter``: the reverse (``write_states``);
* ``restore point``: one sequence's whole state (every layer, both tensors) copied to a
  restore-point row inside the pool (what keeping a lazy point costs when the live state moves
  on, and what ``rollback`` costs);
* ``read_states``: the public call, one layer, allocation included;

baseline: ``np.copyto`` between two contiguous arrays of the same byte count. Target (issue
33, CPU): the kernels at >= 50% of the copy's bandwidth.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np

from ._timing import time_alternating

#: Qwen3-Next's gated delta net (32 value heads, d_v = d_k = 128; conv_dim 8192, kernel 4)
SSM_SHAPE, CONV_SHAPE = (32, 128, 128), (3, 8192)


def run(device: str = "cpu", *, layers: int = 4, seqs: int = 8, budget: float = 0.5,
        min_reps: int = 5, quick: bool = False,
        log: Optional[Callable[[str], None]] = None) -> List[Dict[str, float]]:
    """One row per case: ``{"case", "bytes", "seconds", "gbps", "copy_gbps", "fraction"}``."""
    from ..kernels import rows as krows
    from ..recurrent import RecurrentCache, RecurrentConfig, StateSpec
    ssm, conv = ((8, 64, 64), (3, 1024)) if quick else (SSM_SHAPE, CONV_SHAPE)
    rc = RecurrentCache(RecurrentConfig(layers, [StateSpec("conv", conv, "bfloat16"),
                                                 StateSpec("ssm", ssm, "float32")],
                                        max_seqs=2 * seqs, max_restore_points=1, device=device))
    rng = np.random.default_rng(0)
    for arr in rc.pool.values():
        arr[...] = rng.integers(0, 2**15, arr.shape).astype(arr.dtype)
    picked = np.arange(0, 2 * seqs, 2, dtype=np.int32)
    dense = np.arange(seqs, dtype=np.int32)
    bufs = {n: np.empty((layers, seqs) + a.shape[2:], a.dtype) for n, a in rc.pool.items()}
    row_bytes = {s.name: s.row_bytes for s in rc.config.states}
    moved = sum(b.nbytes for b in bufs.values())

    def gather():
        for n, a in rc.pool.items():
            krows.launch(device, bufs[n], dense, a, picked, row_bytes[n])

    def scatter():
        for n, a in rc.pool.items():
            krows.launch(device, a, picked, bufs[n], dense, row_bytes[n])

    point_row = [rc.config.max_seqs]

    def restore_point():
        for n, a in rc.pool.items():
            krows.launch(device, a, point_row, a, [1], row_bytes[n])

    def read_states():
        rc.read_states(0, picked)

    cases = {"gather": (gather, moved), "scatter": (scatter, moved),
             "restore point": (restore_point, rc.config.state_bytes),
             "read_states": (read_states, moved // layers)}
    out = []
    for case, (fn, nbytes) in cases.items():
        src = np.ones(nbytes, np.uint8)
        dst = np.empty(nbytes, np.uint8)
        if log:
            log(f"  state rows: {case} ({nbytes / 2**20:.1f} MiB) ...")
        t = time_alternating({"ours": fn, "copy": lambda: np.copyto(dst, src)}, budget,
                             min_reps)
        gbps, copy_gbps = nbytes / t["ours"] / 1e9, nbytes / t["copy"] / 1e9
        out.append({"case": case, "bytes": int(nbytes), "seconds": t["ours"], "gbps": gbps,
                    "copy_gbps": copy_gbps, "fraction": gbps / copy_gbps})
    rc.close()
    return out


def format_lines(rows: List[Dict[str, float]]) -> List[str]:
    """The section's table for ``numbakv bench``'s report."""
    if not rows:
        return []
    lines = ["", "Recurrent state rows (RecurrentCache, gated-delta-net shapes) vs np.copyto of "
                 "the same bytes",
             f"{'case':<14} {'MiB':>7} {'ms':>8} {'GB/s':>7} {'copyto GB/s':>12} {'fraction':>9}"]
    for r in rows:
        lines.append(f"{r['case']:<14} {r['bytes'] / 2**20:7.1f} {r['seconds'] * 1e3:8.2f} "
                     f"{r['gbps']:7.2f} {r['copy_gbps']:12.2f} {r['fraction']:9.0%}")
    return lines


def targets(rows: List[Dict[str, float]]) -> List[dict]:
    """Issue 33's CPU target on the two kernel cases: state gather/scatter >= 50% of
    ``np.copyto``'s bandwidth."""
    out = []
    for r in rows:
        if r["case"] in ("gather", "scatter"):
            out.append({"target": f"state {r['case']} >= 50% of np.copyto bandwidth",
                        "status": "met" if r["fraction"] >= 0.5 else "missed",
                        "value": r["fraction"],
                        "detail": f"{r['fraction']:.0%} ({r['gbps']:.2f} vs "
                                  f"{r['copy_gbps']:.2f} GB/s)"})
    return out


if __name__ == "__main__":   # python -m numbakv.tools.bench_states
    print("\n".join(format_lines(run(log=print))))


__all__ = ["run", "format_lines", "targets"]
