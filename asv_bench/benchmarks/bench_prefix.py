"""The prefix store (numbakv.PrefixStore): ``match`` of a 32k-token prompt (target <= 1 ms), a
tier-0 hit of a 4k-token prefix at three cache sizes (target <= 100 us whatever the size: a hit
is metadata only), and a tier-1 (host RAM) hit of a 2k-token prefix of 32 MiB of K/V beside
``np.copyto`` of the same bytes (target >= 50% of its bandwidth). CPU caches."""

import numpy as np

from numbakv.prefix import PrefixStore
from numbakv.tools.bench_prefix import _fill, _tiny_cache


class PrefixMatch:
    timeout = 300

    def setup(self):
        n = 32768
        self.cache = _tiny_cache(n + 1024, max_seqs=2)
        self.store = PrefixStore(self.cache, retain_seqs=[1])
        tokens = np.random.default_rng(1).integers(0, 128_000, n).astype(np.int64)
        _fill(self.cache, 0, n)
        self.store.save(0, tokens)
        self.query = np.concatenate([tokens[:-5], tokens[-5:] + 1])

    def time_match_32k(self):
        self.store.match(self.query)


class PrefixTier0Hit:
    params = [8192, 65536, 262144]
    param_names = ["cells"]
    timeout = 300

    def setup(self, cells):
        self.cache = _tiny_cache(cells, max_seqs=4)
        self.store = PrefixStore(self.cache, retain_seqs=[3])
        self.tokens = np.arange(4096, dtype=np.int64) + 7
        _fill(self.cache, 0, 4096)
        self.store.save(0, self.tokens)
        self.cache.seq_rm(0)

    def time_load_4k(self, cells):
        self.store.load(0, self.tokens)
        self.cache.seq_rm(0)       # included: asv has no untimed per-call setup (about 7 us)


class PrefixTier1Hit:
    timeout = 300
    number = 1
    repeat = 10

    def setup(self):
        self.n = 2048
        self.cache = _tiny_cache(4 * self.n + 1024, max_seqs=4, layers=8, heads=8, dim=64)
        per = self.cache.config.nbytes(1)
        self.store = PrefixStore(self.cache, retain_seqs=[3], host_bytes=2 * per * self.n)
        self.tokens = np.arange(self.n, dtype=np.int64)
        _fill(self.cache, 0, self.n)
        self.store.save(0, self.tokens)
        self.cache.seq_rm(0)
        self._demote()
        self.src = np.ones(per * self.n, np.uint8)
        self.dst = np.zeros_like(self.src)

    def _demote(self):
        self.cache.seq_rm(0)
        for e in list(self.store.index.entries.values()):
            if e.tier == "cells":
                self.store._evict_cells(e)

    def time_host_hit_2k(self):
        self.store.load(0, self.tokens)
        self._demote()             # included (asv number=1): the export copy back to host

    def time_copyto_same_bytes(self):
        np.copyto(self.dst, self.src)
