"""Paged placement (``CacheConfig(page_size=64)``, issue 34 item 2) against Ollama's contiguous
first fit (the default), on the CPU.

* ``PagedFindSlot``: finding the cells of one decode step of 64 sequences (one token each) in a
  table 75% full in the steady state of lock-step decoding: ``CellTable.find_paged`` (each
  sequence's next slot, by its highest position's cell) vs ``find_contiguous(64)`` (the
  free-run tree). Both change nothing.
* ``PagedDecodeRun``: 64 sequences decoding in lock step through ``CausalCache`` from an empty
  cache until each holds ``capacity - 1`` tokens (``start_forward`` + one layer's ``put`` of
  DeepSeek-V3 latent rows, 576 float16 values, V-less, per step), then ``seq_rm`` of all:
  the time per step. The paged step writes 64 scattered cells (one per sequence's page), the
  contiguous one a run of 64.
* ``PagedPrefill``: one 512-token prefill into an empty sequence (both place one run).

``track_*`` = time(paged) / time(contiguous) of the same work, best of interleaved repeats in
one run (``bench_quant._best_ratio``): 1.0 is parity, below 1 the paged side is faster.
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


class _PagedVsContiguous:
    """The same work placed paged and contiguous: subclasses' ``setup`` fills ``self.steps``
    (page size -> a call doing the work once: ``PAGE`` paged, 1 contiguous). asv skips this
    base (its name starts with ``_``) and times each subclass with its own params."""

    def time_paged(self, *params):
        self.steps[PAGE]()

    def time_contiguous(self, *params):
        self.steps[1]()

    def track_paged_vs_contiguous(self, *params):
        return _best_ratio(self.steps[1], self.steps[PAGE])
    track_paged_vs_contiguous.unit = "time ratio (paged / contiguous)"


class PagedFindSlot(_PagedVsContiguous):
    params = [4096, 32768]
    param_names = ["n_cells"]

    def setup(self, n_cells):
        seqs = np.arange(N_SEQ, dtype=np.int32)
        self.steps = {}
        for page in (1, PAGE):
            table, p = steady_table(n_cells, page)
            pos = np.full(N_SEQ, p, np.int32)
            self.steps[page] = (lambda t=table, pos=pos: t.find_paged(pos, seqs)) if page > 1 \
                else (lambda t=table: t.find_contiguous(N_SEQ))
            self.steps[page]()


def latent_cache(page_size, n_cells):
    cfg = CacheConfig(1, 1, ROW, v_head_dim=0, dtype="float16", capacity=n_cells // N_SEQ,
                      max_seqs=N_SEQ, max_batch=512, device="cpu", page_size=page_size)
    return CausalCache(cfg)


class PagedDecodeRun(_PagedVsContiguous):
    """64 sequences decode in lock step from an empty cache until full, then are removed; a
    call is one whole run (``capacity - 1`` steps): divide by the steps for the per-step time."""
    params = [4096, 32768]
    param_names = ["n_cells"]

    def setup(self, n_cells):
        rng = np.random.default_rng(0)
        self.rows = rng.standard_normal((N_SEQ, 1, ROW)).astype(np.float16)
        self.none = np.zeros((N_SEQ, 1, 0), np.float16)
        self.seqs = np.arange(N_SEQ, dtype=np.int32)
        self.n_steps = n_cells // N_SEQ - 1
        self.steps = {}
        for page in (1, PAGE):
            self.steps[page] = self._run(latent_cache(page, n_cells))
            self.steps[page]()

    def _run(self, cache):
        positions = [np.full(N_SEQ, p, np.int32) for p in range(self.n_steps)]

        def run():
            for pos in positions:
                cache.start_forward(pos, self.seqs)
                cache.put(self.rows, self.none)
            cache.seq_rm(-1)
        return run


class PagedPrefill(_PagedVsContiguous):
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
