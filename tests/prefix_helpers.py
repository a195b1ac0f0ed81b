"""Shared helpers of the prefix store tests: tiny caches whose K/V encode (token, position,
layer), so every load can be checked row by row against the tokens it claims to hold."""

from __future__ import annotations

import numpy as np

import numbakv as nkv


def kv_of(tokens, positions, layer: int, heads: int, dim: int):
    """The K and V rows a test writes for ``tokens`` at ``positions``: exact in float32."""
    t = np.asarray(tokens, np.float32)[:, None, None]
    p = np.asarray(positions, np.float32)[:, None, None]
    k = np.broadcast_to(t + 4096.0 * p + 0.25 * layer, (len(t), heads, dim)).astype(np.float32)
    return k, (k + 0.5).astype(np.float32)


def group_list(cache):
    return list(getattr(cache, "caches", None) or [cache])


def n_layers(cache) -> int:
    return cache.n_layers if hasattr(cache, "caches") else cache.config.n_layers


def prefill(cache, seq: int, tokens, start: int = 0, chunk: int = 64) -> None:
    """Evaluate ``tokens[start:]`` into ``seq`` at positions ``start..`` (chunks of ``chunk``)."""
    cfg = group_list(cache)[0].config
    for lo in range(start, len(tokens), chunk):
        hi = min(len(tokens), lo + chunk)
        pos = np.arange(lo, hi, dtype=np.int32)
        cache.start_forward(pos, np.full(hi - lo, seq, np.int32))
        for layer in range(n_layers(cache)):
            cache.set_layer(layer)
            k, v = kv_of(tokens[lo:hi], pos, layer, cfg.n_kv_heads, cfg.head_dim)
            cache.put(k, v)


def check_holds(cache, seq: int, tokens, n: int) -> None:
    """``seq`` holds positions ``< n`` (those its windows keep), each with the K/V written for
    ``tokens[pos]``, and nothing at ``n`` or beyond."""
    assert cache.seq_pos_max(seq) == n - 1, (cache.seq_pos_max(seq), n)
    for g in group_list(cache):
        cells = g.cells.seq_cells(seq)
        pos, _ = g.cells.mask_inputs(0, g.n_cells)
        p = pos[cells]
        assert len(p) and p.max() == n - 1
        if g.swa_memory is None:
            assert sorted(p.tolist()) == list(range(n))
        layers = g.config.n_layers
        for layer in range(layers):
            glob = layer if not hasattr(cache, "caches") else \
                [i for i, gg in enumerate(cache.layer_groups) if gg == group_list(cache).index(g)][layer]
            k, v = kv_of([tokens[i] for i in p], p, glob, g.config.n_kv_heads, g.config.head_dim)
            got_k = np.asarray(g.storage.keys[layer, cells])
            got_v = np.asarray(g.storage.values[layer, cells])
            np.testing.assert_array_equal(got_k, k)
            np.testing.assert_array_equal(got_v, v)


def small_cache(max_seqs: int = 4, capacity: int = 256, **kw):
    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=2, head_dim=4, dtype="float32",
                          capacity=capacity, max_seqs=max_seqs, device="cpu")
    return nkv.CausalCache(cfg, **kw)


def wrapper_cache(max_seqs: int = 4, capacity: int = 256, window: int = 8, memory=None):
    """Gemma-3-like: a sliding group (layers 0, 2) and a full group (layer 1)."""
    def cfg(layers):
        return nkv.CacheConfig(n_layers=layers, n_kv_heads=2, head_dim=4, dtype="float32",
                               capacity=capacity, max_seqs=max_seqs, device="cpu")
    swa = nkv.CausalCache(cfg(2), swa_window=window, swa_memory=memory)
    full = nkv.CausalCache(cfg(1))
    return nkv.WrapperCache([swa, full], layer_groups=[0, 1, 0])
