"""Cell-table bookkeeping: what every decode step pays, and the operations that scan the table.

The decode step is Ollama's StartForward for 64 sequences adding one token each under a sliding
window: prune the window (batch and idle sequences), the attended range, first-fit placement,
applying the batch. The table is in the steady state of lock-step decoding: 75% of the cells
used, every sequence holding ``memory`` cells spread over the whole table (each past step's 64
tokens form one run), so per-sequence cell ranges span the table: the case where scanning a
sequence's range would cost O(n_cells). Target: 128k cells within 2x of 4k cells.
"""

import numpy as np

from numbakv.cells import CellTable

N_SEQ = 64


def steady_decode_table(n_cells, n_seq=N_SEQ, fill=0.75):
    """Cell i holds sequence i % n_seq at position i // n_seq; the rest is free."""
    memory = int(n_cells * fill) // n_seq
    t = CellTable(n_cells, n_seq)
    used = memory * n_seq
    cells = np.arange(used, dtype=np.int32)
    t.apply_batch(cells, (cells // n_seq).astype(np.int32), (cells % n_seq).astype(np.int32))
    return t, memory


class CellsDecodeStep:
    """One decode step's bookkeeping for 64 sequences (each call is the next step)."""
    params = [4096, 32768, 131072]
    param_names = ["n_cells"]

    def setup(self, n_cells):
        self.t, self.memory = steady_decode_table(n_cells)
        self.window = self.memory - 1
        self.seqs = np.arange(N_SEQ, dtype=np.int32)
        self.positions = np.full(N_SEQ, self.memory, dtype=np.int32)
        self.offsets = np.arange(N_SEQ, dtype=np.int32)
        for _ in range(3):
            self.step()

    def step(self):
        t = self.t
        t.prune_window(self.positions, self.seqs, self.memory)
        t.batch_range(self.positions, self.seqs, self.window)
        loc = t.find_contiguous(N_SEQ)
        t.apply_batch(self.offsets + loc, self.positions, self.seqs)
        self.positions += 1

    def time_decode_step(self, n_cells):
        self.step()


class CellsDecodeStepParts:
    """The decode step's calls one by one (128k cells, steady state)."""

    def setup(self):
        bench = CellsDecodeStep()
        bench.setup(131072)
        self.b = bench
        self.t = bench.t
        for name in dir(self):             # load every compiled function outside the timing
            if name.startswith("time_"):
                getattr(self, name)()

    def time_find_contiguous_64(self):
        self.t.find_contiguous(N_SEQ)

    def time_find_scatter_64(self):
        self.t.find_scatter(N_SEQ)

    def time_batch_range_window(self):
        self.t.batch_range(self.b.positions, self.b.seqs, self.b.window)

    def time_batch_range_union(self):
        self.t.batch_range(self.b.positions, self.b.seqs, -1)

    def time_prune_idle_noop(self):
        # after a step nothing is left to evict: the per-sequence checks alone
        self.t.prune_window(self.b.positions - 1, self.b.seqs, self.b.memory)


class CellsFullScan:
    """Operations that must look at the whole 128k-cell table."""
    number = 1
    repeat = 20
    warmup_time = 0

    def setup(self):
        rng = np.random.default_rng(0)
        n = 131072
        t = CellTable(n, N_SEQ)
        used = np.flatnonzero(rng.random(n) < 0.5).astype(np.int32)
        t.apply_batch(used, np.arange(used.size, dtype=np.int32) // N_SEQ,
                      (used % N_SEQ).astype(np.int32))
        self.fragmented = t
        self.t = t.copy()
        warm = t.copy()                  # load every compiled function outside the timing
        warm.plan_defrag()
        warm.rebuild_indexes()
        warm.seq_rm(-1, 2**30, None)
        warm.mask_inputs(0, 8)

    def time_plan_defrag_fragmented(self):
        # half the cells used at random: ~32k cells move
        self.t.plan_defrag()

    def time_rebuild_indexes(self):
        self.fragmented.rebuild_indexes()

    def time_seq_rm_all_no_match(self):
        # seq -1 walks every used cell and removes nothing
        self.fragmented.seq_rm(-1, 2**30, None)

    def time_mask_inputs_all(self):
        self.fragmented.mask_inputs(0, 131072)


class SeqOpsVsCapacity:
    """Sequence operations on a CausalCache that one sequence fills (f16, 8 KV heads x 128, one
    layer), each touching the same few cells at every capacity. Target: 256k cells <= 2x 4k
    (issue 12). A reset after each call keeps the sequence's length steady."""
    params = ([4096, 32768, 262144],
              ["remove nothing", "remove middle (3 move)", "seq_add tail + shift (3)",
               "seq_div (4)", "seq_rm 3", "seq_rm 512", "seq_cp 512", "copy_prefix 512",
               "can_resume", "seq_pos_max"])
    param_names = ["n_cells", "op"]
    number = 1
    repeat = 30
    warmup_time = 0

    def setup(self, n_cells, op):
        from numbakv.tools import bench_seqops as sq
        self.cache = sq._cache(n_cells, 1, 8, 128, "float16", "cpu")
        sq._fill(self.cache, 0, self.cache.n_cells - 1024)
        self.step, self.reset = sq._op_steps(self.cache)[op]
        self.step()                      # compile outside the timing
        if self.reset:
            self.reset()

    def teardown(self, n_cells, op):
        self.cache.close()

    def time_op(self, n_cells, op):
        self.step()
        if self.reset:                   # asv cannot leave it untimed: cheap next to the op
            self.reset()


class SpeculativeStep:
    """5 drafts placed, put + get on 8 layers, 3 rejected drafts removed; against transformers'
    StaticCache.update of the same tokens. Targets: 32k <= 1.3x 4k; faster than StaticCache."""
    params = ([4096, 32768], ["numbakv", "HF StaticCache"])
    param_names = ["context", "cache"]
    number = 1
    repeat = 30
    warmup_time = 0

    def setup(self, context, cache):
        from numbakv.tools import bench_seqops as sq
        if cache == "numbakv":
            self.c = sq.SpecStep(context, 8, 8, 128, "float16", "cpu")
        else:
            try:
                self.c = sq.HFSpecStep(context, 8, 8, 128, "float16")
            except ImportError:
                raise NotImplementedError("torch / transformers not installed")
        self.c.step()
        self.c.reset()

    def teardown(self, context, cache):
        self.c.close()

    def time_step(self, context, cache):
        self.c.step()
        self.c.reset()


class ServerLoop:
    """8 sequences decoding (4 layers); each step one request ends and a new one forks a
    1024-token system prompt (seq_rm + copy_prefix), then all 8 decode one token."""
    params = [8192, 65536]
    param_names = ["n_cells"]
    number = 1
    repeat = 30
    warmup_time = 0

    def setup(self, n_cells):
        from numbakv.tools import bench_seqops as sq
        self.loop = sq.ServerLoop(n_cells, 4, 8, 128, "float16", "cpu")
        self.loop.step()

    def teardown(self, n_cells):
        self.loop.close()

    def time_step(self, n_cells):
        self.loop.step()
