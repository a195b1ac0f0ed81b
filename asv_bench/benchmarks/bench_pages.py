"""Building the page table (``cache.page_table()``, once per forward pass) at 262k cells, against
a plain numba scan of every cell for every sequence of the batch (what the table would cost with
no position tree: the baseline, timed in the same process, calls interleaved).

Cases: ``decode 8x32k``: 8 sequences of 32k tokens each, decoding, every decode cell placed into
the hole a ``seq_rm`` left after sequence 0's cells (in front of the other sequences' older
cells, so cell order and position order disagree); ``lockstep 64``: 64 sequences decoding in
lock step from the start (each 64-cell block holds one cell of each), 96 of 128 cells per 128
used. Target (issue: page_table at 262,144 cells): decode 8x32k in ~1-2 ms, i.e. at most ~2x the
scan; it took 12-15 ms (about 11x) before.
"""

import numpy as np
from numba import njit

import numbakv as nkv
from numbakv.cells import CellTable
from numbakv.pages import pages_of_table
from numbakv.tools.bench import _time_alternating

CASES = ("decode 8x32k", "lockstep 64")


@njit(cache=True)
def _scan(cpos, cseqs, seqs, positions, out):
    """Every cell, for every batch sequence: list the cells the decode token sees."""
    n = 0
    for b in range(seqs.shape[0]):
        s = seqs[b]
        bit = np.uint64(1) << np.uint64(s & 63)
        for c in range(cpos.shape[0]):
            if (cseqs[c, s >> 6] & bit) != 0 and cpos[c] <= positions[b]:
                out[n] = c
                n += 1
    return n


def _case(case):
    if case == "decode 8x32k":
        seqs, cap = 8, 32768
        cfg = nkv.CacheConfig(1, 1, 8, dtype="float32", capacity=cap, max_seqs=seqs,
                              max_batch=4096, device="cpu")
        c = nkv.CausalCache(cfg)
        for s in range(seqs):
            for p0 in range(0, cap, 4096):
                c.start_forward(np.arange(p0, p0 + 4096, dtype=np.int32),
                                np.full(4096, s, np.int32))
        for s in range(seqs):
            c.seq_rm(s, cap - 64, None)
        c.start_forward(np.full(seqs, cap - 64, np.int32), np.arange(seqs, dtype=np.int32))
        f = c._forward
        return c, c.cells, f.positions, f.seqs, f.causal
    n_cells, n_seq = 262144, 64
    t = CellTable(n_cells, n_seq)
    used = n_cells * 3 // 4
    cells = np.arange(used, dtype=np.int32)
    t.apply_batch(cells, (cells // n_seq).astype(np.int32), (cells % n_seq).astype(np.int32))
    return None, t, np.full(n_seq, used // n_seq, np.int32), np.arange(n_seq, dtype=np.int32), \
        np.ones(n_seq, np.uint8)


class PageTable:
    params = [list(CASES)]
    param_names = ["case"]
    number = 1
    repeat = (5, 30, 20.0)

    def setup(self, case):
        self.cache, self.t, self.pos, self.seqs, self.causal = _case(case)
        self.out = np.empty(self.t.n_cells * len(self.seqs), np.int32)
        self.fns = {
            "table": lambda: pages_of_table(self.t, self.pos, self.seqs, self.causal),
            "scan": lambda: _scan(self.t._pos, self.t._seqs, self.seqs, self.pos, self.out)}
        for fn in self.fns.values():
            fn()

    def time_page_table(self, case):
        """pages_of_table: what page_table() builds once per forward pass (host side)."""
        self.fns["table"]()

    def time_scan(self, case):
        """The baseline: every cell, for every batch sequence."""
        self.fns["scan"]()

    def track_page_table_over_scan(self, case):
        t = _time_alternating(self.fns, 2.0, 5)
        return t["table"] / t["scan"]

    track_page_table_over_scan.unit = "x scan"
