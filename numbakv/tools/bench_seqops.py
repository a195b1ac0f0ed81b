"""``numbakv bench --sections seqops``: what sequence operations cost as the cache grows.

Three measurements, each a ratio taken in the same run:

* **sequence operations against capacity** -- ``remove`` (nothing to remove; a middle token
  whose removal moves and re-rotates 3 cells), ``seq_add`` of the tail + applying its shift,
  ``seq_div``, ``seq_rm`` / ``seq_cp`` / ``copy_prefix`` of 3 and 512 tokens, ``can_resume``
  and ``seq_pos_max``, on a cache of 4k .. 256k cells that one sequence fills. Each touches
  the same cells at every capacity, so the target is cost(256k) <= 2x cost(4k).
* **speculative-decoding step** -- ``start_forward`` of 5 draft tokens, ``put`` + ``get`` on
  every layer, then ``seq_rm`` of the 3 rejected drafts, at 4k and 32k tokens of context,
  against transformers' ``StaticCache.update`` of the same 5 tokens on every layer (which has
  no rollback to pay: its next update overwrites). Targets: 32k <= 1.3x 4k, and faster than
  StaticCache at both.
* **server loop** -- 8 sequences decoding; every step one request ends (``seq_rm``) and a new
  one forks the shared system prompt (``copy_prefix``), then all 8 decode one token.

The caches for the first measurement are filled through the cell table (metadata only; the
operations' cost does not depend on the K/V values).
"""

from __future__ import annotations

import gc
from typing import Callable, Dict, List, Optional

import numpy as np

from ..causal import CausalCache
from ..config import CacheConfig, RopeShift

#: operation -> cells it touches (the same at every capacity)
OPS = ["remove nothing", "remove middle (3 move)", "seq_add tail + shift (3)", "seq_div (4)",
       "seq_rm 3", "seq_rm 512", "seq_cp 512", "copy_prefix 512", "can_resume", "seq_pos_max"]


def _cache(n_cells: int, layers: int, heads: int, dim: int, dtype: str, device: str,
           max_seqs: int = 2, max_batch: int = 512) -> CausalCache:
    cfg = CacheConfig(layers, heads, dim, dtype=dtype, capacity=n_cells // max_seqs,
                      max_seqs=max_seqs, max_batch=max_batch, device=device)
    return CausalCache(cfg, shift=RopeShift())


def _fill(cache: CausalCache, seq: int, n: int, first_cell: int = 0) -> None:
    """seq holds positions 0 .. n-1 in cells first_cell .. first_cell + n - 1 (metadata only)."""
    cells = np.arange(first_cell, first_cell + n, dtype=np.int32)
    cache.cells.apply_batch(cells, np.arange(n, dtype=np.int32), np.full(n, seq, np.int32))


def _op_steps(cache: CausalCache) -> Dict[str, tuple]:
    """op name -> (step, reset or None); each step touches the same few cells."""
    top = lambda: cache.seq_pos_max(0)          # noqa: E731

    def regrow(k: int):
        def reset():                             # put back k tokens at the end of seq 0
            p = top() + 1
            cells = cache.cells.find_scatter(k)
            cache.cells.apply_batch(cells, np.arange(p, p + k, dtype=np.int32),
                                    np.zeros(k, np.int32))
        return reset

    return {
        "remove nothing": (lambda: cache.remove(0, top() + 10), None),
        "remove middle (3 move)": (lambda: cache.remove(0, top() - 3, top() - 2), regrow(1)),
        "seq_add tail + shift (3)": (lambda: (cache.seq_add(0, top() - 2, None, 1),
                                              cache.apply_pending_shifts()), None),
        "seq_div (4)": (lambda: cache.seq_div(0, 0, 4, 2), None),
        "seq_rm 3": (lambda: cache.seq_rm(0, top() - 2), regrow(3)),
        "seq_rm 512": (lambda: cache.seq_rm(0, top() - 511), regrow(512)),
        "seq_cp 512": (lambda: cache.seq_cp(0, 1, top() - 511), lambda: cache.seq_rm(1)),
        "copy_prefix 512": (lambda: cache.copy_prefix(0, 1, 512), None),
        "can_resume": (lambda: cache.can_resume(0, 5), None),
        "seq_pos_max": (lambda: cache.seq_pos_max(0), None),
    }


def run_seqops(capacities: List[int], measure: Callable, sync: Callable[[], None], *,
               budget: float, device: str = "cpu", dtype: str = "float16", heads: int = 8,
               dim: int = 128, log: Callable[[str], None] = lambda _: None) -> List[dict]:
    """Rows {op, cells, us} for every operation of :data:`OPS` at every capacity (1 layer)."""
    rows = []
    for n_cells in capacities:
        cache = _cache(n_cells, 1, heads, dim, dtype, device)
        try:
            _fill(cache, 0, cache.n_cells - 1024)
            for op, (step, reset) in _op_steps(cache).items():
                m = measure(step, reset, sync=sync, budget=budget, min_reps=20)
                rows.append({"op": op, "cells": cache.n_cells, "us": m["median_us"]})
                log(f"  {op} @ {cache.n_cells} cells: {m['median_us']:.1f} us")
            cache.cells.check_consistency() if n_cells <= 32768 else None
        finally:
            cache.close()
            del cache
            gc.collect()
    return rows


class SpecStep:
    """One speculative-decoding step on numbakv: 5 drafts placed, put + get on every layer,
    3 rejected drafts removed (the sequence ends 2 tokens longer; ``reset`` takes them back)."""

    def __init__(self, context: int, layers: int, heads: int, dim: int, dtype: str, device: str,
                 drafts: int = 5, rejected: int = 3):
        self.cache = _cache(2 * (context + 64), layers, heads, dim, dtype, device)
        _fill(self.cache, 0, context)
        rng = np.random.default_rng(3)
        self.k = rng.standard_normal((drafts, heads, dim)).astype(dtype)
        self.context, self.layers = context, layers
        self.drafts, self.keep = drafts, drafts - rejected
        self.seqs = np.zeros(drafts, np.int32)

    def step(self):
        c, k = self.cache, self.k
        p = self.context
        c.start_forward(np.arange(p, p + self.drafts, dtype=np.int32), self.seqs)
        out = None
        for layer in range(self.layers):
            c.set_layer(layer)
            c.put(k, k)
            out = c.get()
        c.seq_rm(0, p + self.keep)                 # the rejected drafts
        return out

    def reset(self):
        self.cache.seq_rm(0, self.context)

    def close(self):
        self.cache.close()


class HFSpecStep:
    """transformers' StaticCache: ``update`` of the same 5 tokens on every layer (rollback is
    free: the next update overwrites)."""

    def __init__(self, context: int, layers: int, heads: int, dim: int, dtype: str):
        import inspect

        import torch
        from transformers import LlamaConfig, StaticCache
        cfg = LlamaConfig(num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=heads, head_dim=dim, hidden_size=heads * dim)
        params = inspect.signature(StaticCache.__init__).parameters
        offered = {"config": cfg, "max_cache_len": context + 64, "max_batch_size": 1,
                   "batch_size": 1, "device": "cpu",
                   "dtype": {"float16": torch.float16, "float32": torch.float32}[dtype]}
        self.cache = StaticCache(**{k: v for k, v in offered.items() if k in params})
        tdt = offered["dtype"]
        self.k = torch.randn(1, heads, 5, dim, dtype=tdt)
        self.kw = {"cache_position": torch.arange(context, context + 5)}
        self.layers, self.context = layers, context
        for layer in range(layers):      # allocate lazily-built layers before timing
            self.cache.update(self.k, self.k, layer, self.kw)
        # transformers 5.x counts the tokens itself (cache_position is not read): hold the
        # context, and take the drafts back after every step as the rollback
        self.counters = [lay.cumulative_length for lay in getattr(self.cache, "layers", [])
                         if hasattr(getattr(lay, "cumulative_length", None), "fill_")]
        self.reset()

    def reset(self):
        for counter in self.counters:
            counter.fill_(self.context)

    def step(self):
        out = None
        for layer in range(self.layers):
            out = self.cache.update(self.k, self.k, layer, self.kw)
        return out

    def close(self):
        self.cache = None


def run_spec(contexts: List[int], measure: Callable, sync: Callable[[], None], *, budget: float,
             layers: int, device: str = "cpu", dtype: str = "float16", heads: int = 8,
             dim: int = 128, notes: Optional[List[str]] = None,
             log: Callable[[str], None] = lambda _: None) -> List[dict]:
    rows = []
    for ctx in contexts:
        spec = SpecStep(ctx, layers, heads, dim, dtype, device)
        try:
            m = measure(spec.step, spec.reset, sync=sync, budget=budget, min_reps=20)
        finally:
            spec.close()
            del spec
            gc.collect()
        row = {"context": ctx, "layers": layers, "numbakv_us": m["median_us"], "hf_us": None}
        try:
            hf = HFSpecStep(ctx, layers, heads, dim, dtype)
            row["hf_us"] = measure(hf.step, hf.reset, sync=sync, budget=budget,
                                   min_reps=20)["median_us"]
            hf.close()
        except Exception as exc:  # noqa: BLE001 - torch/transformers missing or changed
            if notes is not None:
                notes.append(f"spec step: HF StaticCache not measured ({exc})")
        rows.append(row)
        log(f"  spec step ctx {ctx}: numbakv {row['numbakv_us']:.1f} us, HF {row['hf_us']}")
        gc.collect()
    return rows


class ServerLoop:
    """8 sequences decode; each step one request ends and a new one forks the system prompt."""

    def __init__(self, n_cells: int, layers: int, heads: int, dim: int, dtype: str, device: str,
                 n_seqs: int = 8, prompt: int = 1024, seed: int = 0):
        self.cache = _cache(n_cells, layers, heads, dim, dtype, device, max_seqs=n_seqs + 1,
                            max_batch=max(512, n_seqs))
        self.n_seqs, self.prompt, self.layers = n_seqs, prompt, layers
        _fill(self.cache, n_seqs, prompt)                 # the system prompt, as its own seq
        for s in range(n_seqs):
            self.cache.copy_prefix(n_seqs, s, prompt)
        self.next_end = 0
        rng = np.random.default_rng(seed)
        self.k = rng.standard_normal((n_seqs, heads, dim)).astype(dtype)
        self.seqs = np.arange(n_seqs, dtype=np.int32)

    def step(self):
        c = self.cache
        s = self.next_end                                # this request ends, a new one starts
        self.next_end = (s + 1) % self.n_seqs
        c.seq_rm(s)
        c.copy_prefix(self.n_seqs, s, self.prompt)
        pos = np.array([c.seq_pos_max(q) + 1 for q in range(self.n_seqs)], np.int32)
        c.start_forward(pos, self.seqs)
        for layer in range(self.layers):
            c.set_layer(layer)
            c.put(self.k, self.k)
            c.get()

    def close(self):
        self.cache.close()


def run_server(capacities: List[int], measure: Callable, sync: Callable[[], None], *,
               budget: float, layers: int, device: str = "cpu", dtype: str = "float16",
               heads: int = 8, dim: int = 128,
               log: Callable[[str], None] = lambda _: None) -> List[dict]:
    rows = []
    for n_cells in capacities:
        loop = ServerLoop(n_cells, layers, heads, dim, dtype, device)
        try:
            m = measure(loop.step, None, sync=sync, budget=budget, min_reps=20)
        finally:
            loop.close()
            del loop
            gc.collect()
        rows.append({"cells": n_cells, "layers": layers, "us": m["median_us"]})
        log(f"  server loop @ {n_cells} cells: {m['median_us']:.1f} us")
    return rows


def format_section(res: dict) -> str:
    """The seqops figures as text: ops against capacity with the 256k/4k ratio, the spec step
    against HF StaticCache, the server loop."""
    lines = []
    rows = res.get("seqops") or []
    caps = sorted({r["cells"] for r in rows})
    if rows:
        lines.append("sequence operations (us) vs capacity (cells); target: largest <= 2x smallest")
        lines.append("  " + f"{'op':28s}" + "".join(f"{c:>10d}" for c in caps) + "   ratio")
        for op in OPS:
            us = {r["cells"]: r["us"] for r in rows if r["op"] == op}
            if not us:
                continue
            ratio = us[caps[-1]] / us[caps[0]]
            lines.append("  " + f"{op:28s}" + "".join(f"{us[c]:10.1f}" for c in caps)
                         + f"   {ratio:5.2f}x {'met' if ratio <= 2 else 'MISSED'}")
    spec = res.get("spec") or []
    if spec:
        lines.append("speculative step (5 drafts, 3 rejected), us; target: 32k <= 1.3x 4k, "
                     "< HF StaticCache")
        for r in spec:
            hf = r["hf_us"]
            lines.append(f"  ctx {r['context']:>6d}, {r['layers']} layers: numbakv "
                         f"{r['numbakv_us']:8.1f}  HF StaticCache "
                         + (f"{hf:8.1f} ({r['numbakv_us'] / hf:.2f}x)" if hf else "n/a"))
        if len(spec) >= 2:
            lines.append(f"  growth {spec[-1]['numbakv_us'] / spec[0]['numbakv_us']:.2f}x")
    srv = res.get("server") or []
    if srv:
        lines.append("server loop (8 seqs: one ends, one forks a 1024-token prompt, all decode)")
        for r in srv:
            lines.append(f"  {r['cells']:>7d} cells, {r['layers']} layers: {r['us']:8.1f} us")
    return "\n".join(lines)


__all__ = ["OPS", "run_seqops", "run_spec", "run_server", "format_section", "SpecStep",
           "HFSpecStep", "ServerLoop"]
