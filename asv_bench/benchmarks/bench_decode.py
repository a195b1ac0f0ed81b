"""A full decode step of ``CausalCache``: ``start_forward`` for one new token per sequence, then
per layer ``set_layer`` + ``put`` + ``get`` (what a model's forward pass asks of the cache), for
1, 8 and 64 sequences each holding ``CONTEXT`` tokens.

Every timed call runs at exactly ``CONTEXT`` tokens per sequence: asv re-runs ``setup`` before
each timed call, and ``setup`` rolls the cache back (``seq_rm``) to the pre-filled state. The
pre-filled cache itself is built once per process and parameter set (it is the slow part).
"""

import numpy as np

from numbakv import CacheConfig
from numbakv.causal import CausalCache
from numbakv.device import cuda_usable, synchronize

LAYERS, KV_HEADS, HEAD_DIM = 8, 8, 128
CONTEXT = 512

#: the one pre-filled cache kept alive between setups: (params, cache, keys, values)
_MEMO = {}


def _prefilled(device, dtype, n_seqs):
    key = (device, dtype, n_seqs)
    if _MEMO.get("key") != key:
        _MEMO.clear()  # free the previous parameter set's cache before allocating this one
        xp = np
        if device == "cuda":
            import cupy as xp
        cfg = CacheConfig(LAYERS, KV_HEADS, HEAD_DIM, dtype=dtype, capacity=CONTEXT + 8,
                          max_seqs=n_seqs, max_batch=CONTEXT, device=device)
        cache = CausalCache(cfg)
        rng = np.random.default_rng(0)
        chunk = xp.asarray(rng.standard_normal((CONTEXT, KV_HEADS, HEAD_DIM), np.float32)
                           .astype(dtype))
        for seq in range(n_seqs):
            cache.start_forward(np.arange(CONTEXT, dtype=np.int32),
                                np.full(CONTEXT, seq, np.int32))
            for layer in range(LAYERS):
                cache.set_layer(layer)
                cache.put(chunk, chunk)
        keys = [xp.asarray(rng.standard_normal((n_seqs, KV_HEADS, HEAD_DIM), np.float32)
                           .astype(dtype)) for _ in range(LAYERS)]
        values = [k.copy() for k in keys]
        # one untimed step, rolled back: loads (or compiles) every function the step calls, so
        # that even `asv run --quick`, which times a single call, times a warm step
        cache.start_forward(np.full(n_seqs, CONTEXT, np.int32), np.arange(n_seqs, dtype=np.int32))
        for layer in range(LAYERS):
            cache.set_layer(layer)
            cache.put(keys[layer], values[layer])
            cache.get()
        cache.seq_rm(-1, CONTEXT)
        _MEMO.update(key=key, cache=cache, keys=keys, values=values)
    return _MEMO["cache"], _MEMO["keys"], _MEMO["values"]


class DecodeStep:
    params = [["cpu", "cuda"], ["float16", "float32"], [1, 8, 64]]
    param_names = ["device", "dtype", "n_seqs"]
    timeout = 300

    def setup(self, device, dtype, n_seqs):
        if device == "cuda" and not cuda_usable():
            raise NotImplementedError("no usable CUDA GPU")
        self.cache, self.keys, self.values = _prefilled(device, dtype, n_seqs)
        self.cache.seq_rm(-1, CONTEXT)  # back to CONTEXT tokens per sequence
        self.positions = np.full(n_seqs, CONTEXT, np.int32)
        self.seqs = np.arange(n_seqs, dtype=np.int32)
        self.device = device

    def _layers(self):
        cache, keys, values = self.cache, self.keys, self.values
        for layer in range(LAYERS):
            cache.set_layer(layer)
            cache.put(keys[layer], values[layer])
            cache.get()

    def time_decode_step(self, device, dtype, n_seqs):
        """start_forward + LAYERS x (set_layer, put, get)."""
        self.cache.start_forward(self.positions, self.seqs)
        self._layers()
        synchronize(self.device)

    def time_start_forward(self, device, dtype, n_seqs):
        """The step's bookkeeping alone: placement, range and the mask."""
        self.cache.start_forward(self.positions, self.seqs)
        synchronize(self.device)


class DecodeLayers:
    """The per-layer half of the step alone (the batch is already placed)."""

    params = DecodeStep.params
    param_names = DecodeStep.param_names
    timeout = 300

    def setup(self, device, dtype, n_seqs):
        DecodeStep.setup(self, device, dtype, n_seqs)
        self.cache.start_forward(self.positions, self.seqs)

    def time_layers_put_get(self, device, dtype, n_seqs):
        """LAYERS x (set_layer, put, get)."""
        DecodeStep._layers(self)
        synchronize(self.device)
