"""Paged placement (``CacheConfig(page_size=64)``, issue 34 item 2) against Ollama's contiguous
first fit (the default), on the CPU.

* ``PagedFindSlot``: the bookkeeping of one decode step of 64 sequences (one token each) in a
  table 75% full in the steady state of lock-step decoding: the attended range, finding the
  cells and applying the batch (``CellTable.place_paged`` vs ``place_contiguous``), then taking
  it back (``unapply_batch``) so every call sees the same table.
* ``PagedDecodeStep``: ``start_forward`` + one layer's ``put`` of DeepSeek-V3 latent rows (576
  float16 values, V-less) for the same 64-sequence decode step through ``CausalCache``: the
  paged step writes 64 scattered cells (one per sequence's page), the contiguous one a run.
* ``PagedPrefill``: one 512-token prefill into an empty sequence (both place one run).

``track_*`` = time(paged) / time(contiguous) of the same step, best of interleaved repeats in
one run (``bench_quant._best_ratio``): 1.0 is parity, below 1 the paged step is faster.
"""

import numpy as np

from numbakv.causal import CausalCache
from numbakv.cells import CellTable
from numbakv.config import CacheConfig

from .bench_quant import _best_ratio

N_SEQ = 64
PAGE = 64
ROW = 512 + 64


def steady_table(n_cells, page_size, n_seq=N_SEQ, fill=0.75):
    """A table after lock-step decoding of ``n_seq`` sequences up to ``fill`` of the cells,
    placed by the policy ``page_size`` selects; returns it and the next position."""
    t = CellTable(n_cells, n_seq, page_size=page_size)
    memory = min(int(n_cells * fill) // n_seq, n_cells // n_seq - 1)
    seqs = np.arange(n_seq, dtype=np.int32)
    for p in range(memory):
        pos = np.full(n_seq, p, np.int32)
        if page_size > 1:
            t.place_paged(pos, seqs, -1)
        else:
            t.place_contiguous(pos, seqs, -1)
    return t, memory


def _step(table, pos, seqs):
    if table.page_size > 1:
        def run():
            _, _, slots, head = table.place_paged(pos, seqs, -1)
            table.unapply_batch(slots, head)
    else:
        def run():
            _, _, start, head = table.place_contiguous(pos, seqs, -1)
            table.unapply_batch(np.arange(start, start + len(pos), dtype=np.int32), head)
    return run


class PagedFindSlot:
    params = [4096, 32768]
    param_names = ["n_cells"]

    def setup(self, n_cells):
        seqs = np.arange(N_SEQ, dtype=np.int32)
        self.steps = {}
        for page in (1, PAGE):
            table, p = steady_table(n_cells, page)
            self.steps[page] = _step(table, np.full(N_SEQ, p, np.int32), seqs)
            self.steps[page]()

    def time_paged(self, n_cells):
        self.steps[PAGE]()

    def time_contiguous(self, n_cells):
        self.steps[1]()

    def track_paged_vs_contiguous(self, n_cells):
        return _best_ratio(self.steps[1], self.steps[PAGE])
    track_paged_vs_contiguous.unit = "time ratio (paged / contiguous)"


def latent_cache(page_size, n_cells):
    cfg = CacheConfig(1, 1, ROW, v_head_dim=0, dtype="float16", capacity=n_cells // N_SEQ,
                      max_seqs=N_SEQ, max_batch=512, device="cpu", page_size=page_size)
    return CausalCache(cfg)


class PagedDecodeStep:
    """start_forward + put of one decode step of 64 sequences; the step's tokens are removed
    again with one ``seq_rm(-1, p, p + 1)`` outside the timed part's difference (both sides
    pay it)."""
    params = [4096, 32768]
    param_names = ["n_cells"]

    def setup(self, n_cells):
        rng = np.random.default_rng(0)
        self.rows = rng.standard_normal((N_SEQ, 1, ROW)).astype(np.float16)
        self.none = np.zeros((N_SEQ, 1, 0), np.float16)
        self.seqs = np.arange(N_SEQ, dtype=np.int32)
        self.steps = {}
        for page in (1, PAGE):
            cache = latent_cache(page, n_cells)
            memory = min(int(n_cells * 0.75) // N_SEQ, n_cells // N_SEQ - 1)
            for p in range(memory):
                cache.start_forward(np.full(N_SEQ, p, np.int32), self.seqs)
                cache.put(self.rows, self.none)
            self.steps[page] = self._step(cache, np.full(N_SEQ, memory, np.int32))
            self.steps[page]()

    def _step(self, cache, pos):
        p = int(pos[0])

        def run():
            cache.start_forward(pos, self.seqs)
            cache.put(self.rows, self.none)
            cache.seq_rm(-1, p, p + 1)
        return run

    def time_paged(self, n_cells):
        self.steps[PAGE]()

    def time_contiguous(self, n_cells):
        self.steps[1]()

    def track_paged_vs_contiguous(self, n_cells):
        return _best_ratio(self.steps[1], self.steps[PAGE])
    track_paged_vs_contiguous.unit = "time ratio (paged / contiguous)"


class PagedPrefill:
    """A 512-token prefill of one sequence into an empty cache of 32768 cells, then removed."""

    def setup(self):
        rng = np.random.default_rng(1)
        self.rows = rng.standard_normal((512, 1, ROW)).astype(np.float16)
        self.none = np.zeros((512, 1, 0), np.float16)
        pos = np.arange(512, dtype=np.int32)
        seqs = np.zeros(512, np.int32)
        self.steps = {}
        for page in (1, PAGE):
            cache = latent_cache(page, 32768)

            def run(cache=cache):
                cache.start_forward(pos, seqs)
                cache.put(self.rows, self.none)
                cache.seq_rm(0)
            run()
            self.steps[page] = run

    def time_paged(self):
        self.steps[PAGE]()

    def track_paged_vs_contiguous(self):
        return _best_ratio(self.steps[1], self.steps[PAGE])
    track_paged_vs_contiguous.unit = "time ratio (paged / contiguous)"
