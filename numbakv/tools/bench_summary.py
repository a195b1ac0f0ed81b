"""``numbakv bench``: the lines a user should read first (where numbakv wins, by how much, on
which shapes) and what a run will cost before it starts."""

from __future__ import annotations

from typing import Any, List

import numpy as np


def headline(results: dict) -> List[str]:
    """"Where numbakv stands" from the decode section: for every (batch, context) measured,
    how many times faster (or slower) numbakv's decode step is than each baseline."""
    decode = results.get("decode", [])
    s = results["settings"]
    by = {(r["batch"], r["context"], r["contender"]): r["median_us"] for r in decode}
    keys = sorted({(r["batch"], r["context"]) for r in decode})
    baselines = [n for n in ("HF StaticCache", "HF DynamicCache", "torch append",
                             "numpy append") if any(r["contender"] == n for r in decode)]
    if not keys or not baselines:
        return []
    lines = ["", f"Where numbakv stands: decode step (store one token per sequence and read the "
                 f"K/V attention needs, {s['layers']} layers x {s['kv_heads']} KV heads x "
                 f"{s['head_dim']}, {s['dtype']}, {s['device']}); Nx = numbakv is N times "
                 "faster"]
    for b, c in keys:
        ours = by.get((b, c, "numbakv"))
        if ours is None:
            continue
        parts = []
        for n in baselines:
            theirs = by.get((b, c, n))
            if theirs is None:
                continue
            r = theirs / ours
            parts.append(f"{r:,.2f}x vs {n}" if r >= 1 else f"{1 / r:.2f}x SLOWER than {n}")
        lines.append(f"  batch {b}, context {c}: numbakv {ours:,.0f} us per step; "
                     + ", ".join(parts))
    lines.append("  (numbakv also places tokens, builds the attention mask and serves sequences "
                 "of different lengths in one pool; details below)")
    return lines


def cost_note(s: Any, memory_factor: int = 2) -> str:
    """What a run of ``s`` will cost, said before it starts: peak memory of the largest decode
    configuration (K/V of every layer, times ``memory_factor`` for the copying baselines) and of
    the capacity section, and a time estimate from the measured default run."""
    itemsize = np.dtype(s.dtype).itemsize
    peak = 0
    if "decode" in s.sections:
        for b in s.batches:
            for c in s.contexts:
                peak = max(peak, memory_factor * 2 * b * (c + 16) * s.layers * s.kv_heads
                           * s.head_dim * itemsize)
    if "capacity" in s.sections:
        peak = max(peak, 2 * max(s.capacities) * s.capacity_layers * s.kv_heads * s.head_dim
                   * itemsize)
    if "attend" in s.sections and not s.quick:
        # 8 x 4k decode, float32: the pool plus the floor's contiguous copies
        peak = max(peak, 3 * 2 * 8 * 4100 * 8 * 128 * 4)
    runs = len(s.batches) * len(s.contexts) if "decode" in s.sections else 0
    # the default run (3 contexts x 2 batches, 32 layers, budget 0.5 s) took ~160 s on 2 cores
    secs = 30 + runs * 6 * (s.budget * 3 + 2 * s.layers * max(s.contexts) / 2 ** 17)
    secs += 40 * ("kernels" in s.sections) + 30 * ("capacity" in s.sections)
    secs += 60 * sum(x in s.sections for x in ("quant", "seqops", "attention", "streams",
                                                "attend", "snapshot"))
    return (f"numbakv bench: this run measures {', '.join(s.sections)}; expect about "
            f"{max(10, round(secs, -1)):.0f} s on a 2-core machine and a peak of about "
            f"{peak / 2 ** 30:.1f} GiB of memory (largest K/V held by a baseline that copies it)"
            + ("; --quick runs in well under a minute" if not s.quick else ""))


__all__ = ["headline", "cost_note"]
