"""``numbakv bench --sections fidelity`` (or ``python -m numbakv.tools.bench_fidelity``): what
``shared_shift="copy"`` costs (issue 29, item 3).

A forked sequence shares a prefix with its parent and owns a tail; ``remove`` of one token near
the start moves everything after it, shared cells included. Three timings, in the same run on the
same cache shapes:

* **copy mode**: that ``remove`` with ``shared_shift="copy"`` (the shared cells past the removed
  token are first copied into free cells, then the positions move and the keys are re-rotated);
* **unshared twin**: the same ``remove`` on a cache where the sequence already owns every cell
  (what the move itself costs);
* **the copy alone**: ``read_cells`` of the free rows the copy writes over (kept for the undo)
  plus ``copy_cells`` of the shared cells into them (the move kernel, every layer).

Target: ``copy mode - unshared twin <= 1.25 x the copy alone`` -- the extra cost is the copy of
the shared cells, not a slower shift. Medians of ``repeats`` runs; every run starts from the same
state (loaded from bytes, outside the timing).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import numpy as np

from ..causal import CausalCache
from ..config import CacheConfig, RopeShift


def _median_ms(samples: List[float]) -> float:
    return float(np.median(samples) * 1e3)


def _build(shared: int, own: int, n_layers: int, heads: int, dim: int, dtype: str,
           device: str, mode: str, fork: bool) -> CausalCache:
    """Seq 0 holds ``shared`` tokens; seq 1 shares them (``fork``) or holds its own copies,
    then owns ``own`` more tokens."""
    total = shared + own
    cfg = CacheConfig(n_layers, heads, dim, dtype=dtype, capacity=2 * total, max_seqs=2,
                      max_batch=max(total, 1), device=device)
    cache = CausalCache(cfg, shift=RopeShift(), shared_shift=mode)
    rng = np.random.default_rng(0)

    def forward(positions, seq):
        cache.start_forward(positions, [seq] * len(positions))
        for layer in range(n_layers):
            cache.set_layer(layer)
            kv = rng.standard_normal((len(positions), heads, dim)).astype(dtype)
            cache.put(kv, kv)

    forward(list(range(shared)), 0)
    if fork:
        cache.copy_prefix(0, 1, shared)
    else:
        forward(list(range(shared)), 1)
    forward(list(range(shared, total)), 1)
    return cache


def run(shared: int = 512, own: int = 64, n_layers: int = 8, heads: int = 8, dim: int = 128,
        dtype: str = "float16", device: str = "cpu", repeats: int = 15) -> Dict[str, float]:
    """The three timings (ms, medians) and the ratio the target is about."""
    copy_cache = _build(shared, own, n_layers, heads, dim, dtype, device, "copy", fork=True)
    twin = _build(shared, own, n_layers, heads, dim, dtype, device, "error", fork=False)
    copy_state, twin_state = copy_cache.state_bytes(), twin.state_bytes()
    begin = 1                      # remove position 1: positions 2 .. shared-1 are shared
    moved_shared = shared - (begin + 1)
    t_copy_mode, t_twin, t_copy = [], [], []
    for _ in range(repeats):
        copy_cache.load_state_bytes(copy_state)
        t0 = time.perf_counter()
        copy_cache.remove(1, begin, begin + 1)
        t_copy_mode.append(time.perf_counter() - t0)

        twin.load_state_bytes(twin_state)
        t0 = time.perf_counter()
        twin.remove(1, begin, begin + 1)
        t_twin.append(time.perf_counter() - t0)

        copy_cache.load_state_bytes(copy_state)   # the copy alone, on the same cells
        src = np.asarray(copy_cache._shared_cells(1, begin + 1, None)[0])
        slots = copy_cache.cells.find_scatter(len(src))
        t0 = time.perf_counter()
        copy_cache.storage.read_cells(slots)
        copy_cache.storage.copy_cells(src, slots)
        t_copy.append(time.perf_counter() - t0)
    out = {"shared_cells_copied": moved_shared, "copy_mode_ms": _median_ms(t_copy_mode),
           "unshared_twin_ms": _median_ms(t_twin), "copy_alone_ms": _median_ms(t_copy)}
    out["extra_over_copy"] = (out["copy_mode_ms"] - out["unshared_twin_ms"]) / \
        max(out["copy_alone_ms"], 1e-9)
    out["target_met"] = bool(out["extra_over_copy"] <= 1.25)
    return out


def format_section(res: Dict[str, float]) -> str:
    """The section as text."""
    return (f"shared_shift='copy' (remove moving {res['shared_cells_copied']} shared cells): "
            f"copy mode {res['copy_mode_ms']:.2f} ms, unshared twin "
            f"{res['unshared_twin_ms']:.2f} ms, the copy alone {res['copy_alone_ms']:.2f} ms; "
            f"extra / copy = {res['extra_over_copy']:.2f} (target <= 1.25: "
            f"{'met' if res['target_met'] else 'missed'})")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shared", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    res = run(shared=a.shared, n_layers=a.layers, device=a.device, repeats=a.repeats)
    print(json.dumps(res) if a.json else format_section(res))


if __name__ == "__main__":   # pragma: no cover
    main()
