"""Decode attention over per-sequence streams (``CacheConfig(unified=False)``) against its floor.

8 sequences x ``CONTEXT`` tokens, 32 query heads over 8 KV heads of 128 (GQA), one layer (the
attention of every layer costs the same). Three ways to attend one decode token per sequence:

* ``floor``: SDPA over each sequence's own contiguous K/V, batched ``[8, 8, CONTEXT, 128]``,
  no mask: what attention costs when nobody pays for other sequences' tokens;
* ``streams``: ``start_forward`` + ``put`` + ``get()`` of a stream cache (zero-copy
  ``[8, n_kv, 8, 128]`` views, consecutive sequences) and batched SDPA with its
  ``[8, 1, n_kv]`` mask;
* ``unified``: the same step on a unified cache: ``get()`` covers every sequence's cells
  (``8 * CONTEXT`` rows) and SDPA runs over all of them with the dense ``[8, n]`` mask.

Issue target: streams <= 1.2x floor.
"""

import numpy as np

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover
    torch = None

from numbakv import CacheConfig
from numbakv.causal import CausalCache

SEQS, Q_HEADS, KV_HEADS, HEAD_DIM = 8, 32, 8, 128
CONTEXT = 4096


def _filled(unified: bool, dtype: str):
    cfg = CacheConfig(1, KV_HEADS, HEAD_DIM, dtype=dtype, capacity=CONTEXT + 16,
                      max_seqs=SEQS, max_batch=CONTEXT, device="cpu", unified=unified)
    cache = CausalCache(cfg)
    rng = np.random.default_rng(0)
    chunk = rng.standard_normal((CONTEXT, KV_HEADS, HEAD_DIM)).astype(dtype)
    for seq in range(SEQS):
        cache.start_forward(np.arange(CONTEXT, dtype=np.int32), np.full(CONTEXT, seq, np.int32))
        cache.set_layer(0)
        cache.put(chunk, chunk)
    return cache


def decode_attention(cache, q, k_new, positions, seqs, tdtype):
    """One decode step of one layer through ``cache``: place, put, get, SDPA; returns
    ``[SEQS, Q_HEADS, 1, HEAD_DIM]``."""
    cache.start_forward(positions, seqs)
    cache.set_layer(0)
    cache.put(k_new, k_new)
    key, value, mask = cache.get()
    k = torch.from_dlpack(key)
    v = torch.from_dlpack(value)
    m = torch.from_numpy(np.asarray(mask)).to(tdtype)
    if k.dim() == 4:     # streams: [n_b, n_kv, H, D], mask [n_b, rows, n_kv]
        return F.scaled_dot_product_attention(q, k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3),
                                              attn_mask=m[:, None],
                                              enable_gqa=True)
    # unified: [n, H, D] shared by the batch, mask [batch, n]: one query row per sequence
    qq = q.permute(2, 1, 0, 3)                                  # [1, Q_HEADS, SEQS, D]
    out = F.scaled_dot_product_attention(qq, k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None],
                                         attn_mask=m[None, None, :SEQS], enable_gqa=True)
    return out.permute(2, 1, 0, 3)


class StreamDecodeAttention:
    params = (["floor", "streams", "unified"], ["float32", "float16"])
    param_names = ["contender", "dtype"]
    timeout = 600

    def setup(self, contender, dtype):
        if torch is None:
            raise NotImplementedError("needs torch")
        self.tdtype = getattr(torch, dtype)
        rng = np.random.default_rng(1)
        self.q = torch.from_numpy(rng.standard_normal((SEQS, Q_HEADS, 1, HEAD_DIM))
                                  .astype(dtype))
        self.k_new = rng.standard_normal((SEQS, KV_HEADS, HEAD_DIM)).astype(dtype)
        self.positions = np.full(SEQS, CONTEXT, np.int32)
        self.seqs = np.arange(SEQS, dtype=np.int32)
        if contender == "floor":
            kv = torch.from_numpy(rng.standard_normal((SEQS, KV_HEADS, CONTEXT + 1, HEAD_DIM))
                                  .astype(dtype))
            self.kv = kv
        else:
            self.cache = _filled(contender == "unified", dtype)

    def teardown(self, contender, dtype):
        if contender != "floor":
            self.cache.seq_rm(-1, CONTEXT, None)

    def time_decode_attention(self, contender, dtype):
        if contender == "floor":
            F.scaled_dot_product_attention(self.q, self.kv, self.kv, enable_gqa=True)
        else:
            decode_attention(self.cache, self.q, self.k_new, self.positions, self.seqs,
                             self.tdtype)
            self.cache.seq_rm(-1, CONTEXT, None)


class StreamDecodePlacement:
    """``start_forward`` of a decode step, 8 sequences one token each, on a stream cache against
    a unified cache (the baseline): the bookkeeping every step pays on the host, and what a
    captured step's replay starts with (issue 35: a replayed 32-layer step <= 100 us of host
    time). A stream cache places the batch in every stream's cell table in one compiled call
    (``CellTableStack``); before, a Python call per stream cost ~110 us here. Bookkeeping only
    (one layer of 1 x 8 K/V: the placement does not touch K/V)."""
    params = (["unified", "streams"],)
    param_names = ["cache"]
    CAPACITY = 1 << 14

    def setup(self, cache):
        cfg = CacheConfig(1, 1, 8, dtype="float16", capacity=self.CAPACITY, max_seqs=SEQS,
                          max_batch=512, device="cpu", unified=cache == "unified")
        self.cache = CausalCache(cfg)
        self.seqs = np.arange(SEQS, dtype=np.int32)
        for seq in range(SEQS):   # 200 tokens each
            self.cache.start_forward(np.arange(200, dtype=np.int32), np.full(200, seq, np.int32))
        self.pos = 200

    def time_start_forward(self, cache):
        if self.pos >= self.CAPACITY:    # full: start over (once per 16k steps)
            self.cache.seq_rm(-1, 0, None)
            self.pos = 0
        self.cache.start_forward(np.full(SEQS, self.pos, np.int32), self.seqs)
        self.pos += 1
