"""Interleaved timing shared by the benchmark sections (bench.py and the section modules it
loads import it from here; no section imports bench.py, which imports them)."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List

import numpy as np


def time_alternating(fns: Dict[str, Callable[[], Any]], budget: float,
                     min_reps: int) -> Dict[str, float]:
    """Median seconds per call of each function, calls interleaved so that a busy machine's load
    moves them together (their ratios are what the section reports)."""
    for fn in fns.values():
        fn()
    times: Dict[str, List[float]] = {k: [] for k in fns}
    spent = 0.0
    while True:
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            times[name].append(dt)
            spent += dt
        if len(times[name]) >= min_reps and spent >= budget:
            break
    return {k: float(np.median(v)) for k, v in times.items()}
