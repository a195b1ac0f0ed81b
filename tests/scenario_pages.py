"""Random multi-sequence scenarios shared by test_pages.py and test_attention.py: mixed prefill and
decode batches (shuffled, so a sequence's tokens are not adjacent), copy_prefix forks, removals
with shift, seq_rm gaps, defrag, set_causal, over caches with sliding windows, chunks, padding,
permuted V and 16-bit storage."""

from __future__ import annotations

import numpy as np

import numbakv as nkv
from numbakv.errors import KVCacheFullError, NotSupportedError

from helpers import dev, host


def make_cache(device: str, *, dtype="float32", permuted_v=False, swa_window=None, chunk=None,
               cache_padding=1, mask_batch_padding=1, capacity=40, max_seqs=4, n_layers=2,
               n_kv_heads=2, head_dim=8):
    cfg = nkv.CacheConfig(n_layers, n_kv_heads, head_dim, dtype=dtype, capacity=capacity,
                          max_seqs=max_seqs, max_batch=16, cache_padding=cache_padding,
                          mask_batch_padding=mask_batch_padding, permuted_v=permuted_v,
                          device=device)
    return nkv.CausalCache(cfg, shift=nkv.RopeShift(dim=head_dim), swa_window=swa_window,
                           chunk_size=chunk)


def _next_pos(cache, s):
    return cache.seq_pos_max(s) + 1


def random_forwards(cache, rng, steps: int, *, torch=None):
    """Drive ``cache`` through ``steps`` forward passes with random sequence operations between
    them; after each pass's puts, yield ``(positions, seqs)``. K/V are random (``torch`` tensors
    for bfloat16 storage), made on the cache's device."""
    cfg = cache.config
    where = "cuda" if cache.device == "cuda" else "cpu"
    n_seqs = cfg.max_seqs
    for _ in range(steps):
        op = rng.random()
        try:
            if op < 0.12:
                src, dst = (int(x) for x in rng.choice(n_seqs, 2, replace=False))
                n = _next_pos(cache, src)
                if n > 0:
                    cache.copy_prefix(src, dst, int(rng.integers(1, n + 1)))
            elif op < 0.22:
                s = int(rng.integers(n_seqs))
                n = _next_pos(cache, s)
                if n > 2:
                    b = int(rng.integers(0, n - 1))
                    cache.remove(s, b, b + int(rng.integers(1, 3)))
            elif op < 0.28:
                s = int(rng.integers(n_seqs))
                n = _next_pos(cache, s)
                if n > 2:
                    b = int(rng.integers(0, n - 1))
                    cache.seq_rm(s, b, b + 1)        # a gap in the positions
            elif op < 0.33:
                cache.defrag()
        except NotSupportedError:
            pass                                      # shifting cells shared by forks
        k_seqs = int(rng.integers(1, min(3, n_seqs) + 1))
        chosen = rng.choice(n_seqs, k_seqs, replace=False)
        pos, sq = [], []
        for s in chosen:
            start = _next_pos(cache, int(s))
            n_tok = 1 if rng.random() < 0.5 else int(rng.integers(2, 6))
            pos += list(range(start, start + n_tok))
            sq += [int(s)] * n_tok
        order = rng.permutation(len(pos)) if rng.random() < 0.5 else np.arange(len(pos))
        pos = np.asarray(pos)[order]
        sq = np.asarray(sq)[order]
        try:
            cache.start_forward(pos, sq)
        except KVCacheFullError:
            for s in range(n_seqs):
                cache.seq_rm(s)
            continue
        for layer in range(cfg.n_layers):
            cache.set_layer(layer)
            shape_k = (len(pos), cfg.n_kv_heads, cfg.head_dim)
            shape_v = (len(pos), cfg.n_kv_heads, cfg.v_head_dim)
            if cfg.dtype == "bfloat16":
                k = torch.randn(shape_k).to(torch.bfloat16).to(where)
                v = torch.randn(shape_v).to(torch.bfloat16).to(where)
            else:
                k = dev(rng.standard_normal(shape_k).astype(cfg.dtype), where)
                v = dev(rng.standard_normal(shape_v).astype(cfg.dtype), where)
            cache.put(k, v)
        if rng.random() < 0.3:
            cache.set_causal(rng.choice(len(pos), int(rng.integers(1, len(pos) + 1)),
                                        replace=False))
        yield pos, sq


def mask_visibility(cache, batch: int):
    """From ``get()``'s mask: for each of the ``batch`` tokens, the set of cells it may see."""
    lo, _ = cache.cell_range()
    mask = host(cache.get()[2])
    return [set((lo + np.flatnonzero(mask[i] == 0)).tolist()) for i in range(batch)]
