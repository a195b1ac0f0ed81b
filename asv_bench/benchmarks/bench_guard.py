"""The one-thread-at-a-time check (numbakv/_guard.py) on the hot path: ``set_layer``, ``put`` and
``get`` of a decode step, through the public (guarded) methods and through the undecorated
functions (``__wrapped__``). The ratio guarded / unguarded is the check's cost; target: the
check adds under 0.5 us per call (a small fraction of a put or get)."""

import numpy as np

import numbakv as nkv
from numbakv.causal import CausalCache


class GuardHotPath:
    params = [["guarded", "unguarded"]]
    param_names = ["guard"]

    def setup(self, guard):
        cfg = nkv.CacheConfig(1, 8, 128, dtype="float16", capacity=4096, max_seqs=1,
                              max_batch=1, device="cpu")
        self.cache = CausalCache(cfg)
        self.cache.start_forward([0], [0])
        self.kv = np.zeros((1, 8, 128), np.float16)
        pick = (lambda f: f) if guard == "guarded" else (lambda f: f.__wrapped__)
        self.set_layer = pick(CausalCache.set_layer)
        self.put = pick(CausalCache.put)
        self.get = pick(CausalCache.get)

    def time_set_layer(self, guard):
        self.set_layer(self.cache, 0)

    def time_put(self, guard):
        self.put(self.cache, self.kv, self.kv)

    def time_get(self, guard):
        self.get(self.cache)
