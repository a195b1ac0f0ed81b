"""``numbakv bench``: the lines a user should read first (where numbakv wins, by how much, on
which shapes) and what a run will cost before it starts."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np


def ratio_spread(ours: dict, theirs: dict) -> Tuple[float, Optional[float], Optional[float]]:
    """``theirs / ours`` (> 1: numbakv is faster) from two decode rows: the ratio of their
    medians, and the lowest and highest of the per-round ratios (each round measured both
    sides interleaved, so a round's ratio is a fair one); ``None, None`` with a single round."""
    ratio = theirs["median_us"] / ours["median_us"]
    a, b = ours.get("round_us") or [], theirs.get("round_us") or []
    rounds = [t / o for o, t in zip(a, b) if o > 0]
    if len(rounds) < 2:
        return ratio, None, None
    return ratio, min(rounds), max(rounds)


def format_ratio(ratio: float, lo: Optional[float], hi: Optional[float], name: str) -> str:
    """``"2.41x vs NAME (2.1-2.7x over rounds)"``, ``"1.30x SLOWER than NAME (...)"``, or, when
    the rounds disagree on which side is faster, that the difference is inside the noise."""
    spread = f" ({lo:,.2f}-{hi:,.2f}x)" if lo is not None else ""
    if lo is not None and lo < 1 < hi:
        return f"{ratio:,.2f}x vs {name}{spread}: inside the noise, no measurable difference"
    if ratio >= 1:
        return f"{ratio:,.2f}x vs {name}{spread}"
    spread = f" ({1 / hi:,.2f}-{1 / lo:,.2f}x)" if lo is not None else ""
    return f"{1 / ratio:.2f}x SLOWER than {name}{spread}"


def headline(results: dict) -> List[str]:
    """"Where numbakv stands" from the decode section: for every (batch, context) measured,
    how many times faster (or slower) numbakv's decode step is than each baseline, with the
    spread of that ratio over the rounds, and which differences are inside the noise."""
    decode = results.get("decode", [])
    s = results["settings"]
    by = {(r["batch"], r["context"], r["contender"]): r for r in decode}
    keys = sorted({(r["batch"], r["context"]) for r in decode})
    baselines = [n for n in ("HF StaticCache", "HF DynamicCache", "torch append",
                             "numpy append") if any(r["contender"] == n for r in decode)]
    if not keys or not baselines:
        return []
    rounds = max((len(r.get("round_us") or []) for r in decode), default=0)
    lines = ["", f"Where numbakv stands: decode step (store one token per sequence and read the "
                 f"K/V attention needs, {s['layers']} layers x {s['kv_heads']} KV heads x "
                 f"{s['head_dim']}, {s['dtype']}, {s['device']}); Nx = numbakv is N times "
                 "faster" + (f"; in brackets the lowest and highest of {rounds} rounds, each "
                             "timing every contender's steps interleaved" if rounds > 1 else "")]
    for b, c in keys:
        ours = by.get((b, c, "numbakv"))
        if ours is None:
            continue
        parts = [format_ratio(*ratio_spread(ours, by[(b, c, n)]), n)
                 for n in baselines if (b, c, n) in by]
        lines.append(f"  batch {b}, context {c}: numbakv {ours['median_us']:,.0f} us per step; "
                     + "; ".join(parts))
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
    rounds = max(1, getattr(s, "rounds", 1))
    secs = 30 + runs * 6 * (s.budget * 3 + 2 * rounds * s.layers * max(s.contexts) / 2 ** 17)
    secs += 40 * ("kernels" in s.sections) + 30 * ("capacity" in s.sections)
    secs += 60 * sum(x in s.sections for x in ("quant", "seqops", "attention", "streams",
                                                "attend", "snapshot"))
    return (f"numbakv bench: this run measures {', '.join(s.sections)}; expect about "
            f"{max(10, round(secs, -1)):.0f} s on a 2-core machine and a peak of about "
            f"{peak / 2 ** 30:.1f} GiB of memory (largest K/V held by a baseline that copies it)"
            + ("; --quick runs in well under a minute" if not s.quick else ""))


__all__ = ["headline", "cost_note", "ratio_spread", "format_ratio"]
