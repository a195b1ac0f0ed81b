"""MLA latent caches (issue 34) on the CPU: the context shift of a DeepSeek-V3 latent row (512
latent + 64 rope dims, one "head", no V) rotates only the 64 trailing rope dims
(``RopeShift(dim=64, offset=512)``) instead of the whole 576-value row. ``track_*`` is
``time(full-row shift) / time(rope-only shift)`` of the same cells, both timed back to back in
one run (best of interleaved repeats), goal >= 5; and the bytes per token of the V-less latent
against the per-head K/V a model without MLA would cache.
"""

import numpy as np

from numbakv.config import CacheConfig, RopeShift
from numbakv.storage import KVStorage

from .bench_quant import _best_ratio

RANK, ROPE = 512, 64
LAYERS, CELLS = 4, 4096


class MLAShiftCPU:
    """4 layers x 4096 cells of 576-value latent rows; every cell moves by -3."""
    params = [["float16", "bfloat16", "q8_0"]]
    param_names = ["kind"]

    def setup(self, kind):
        k_dtype = kind if kind == "q8_0" else None
        dtype = "float16" if kind == "q8_0" else kind
        cfg = CacheConfig(LAYERS, 1, RANK + ROPE, v_head_dim=0, dtype=dtype, k_dtype=k_dtype,
                          capacity=CELLS, max_batch=CELLS)
        self.st = KVStorage(cfg, CELLS, "cpu")
        rng = np.random.default_rng(0)
        for layer in range(LAYERS):
            key = rng.standard_normal((CELLS, 1, RANK + ROPE)).astype(np.float16)
            if dtype == "bfloat16":
                key = (key.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            self.st.put_range(layer, 0, key, np.zeros((CELLS, 1, 0), key.dtype))
        self.cells = np.arange(CELLS, dtype=np.int32)
        self.deltas = np.full(CELLS, -3, dtype=np.int64)
        self.rope_only = RopeShift(dim=ROPE, offset=RANK)
        self.full_row = RopeShift(dim=RANK + ROPE)
        self.shift_rope_only()
        self.shift_full_row()

    def shift_rope_only(self):
        self.st.rotate(self.cells, self.deltas, self.rope_only)

    def shift_full_row(self):
        self.st.rotate(self.cells, self.deltas, self.full_row)

    def time_shift_rope_only(self, kind):
        self.shift_rope_only()

    def track_speedup_rope_only_vs_full_row(self, kind):
        return _best_ratio(self.shift_rope_only, self.shift_full_row)
    track_speedup_rope_only_vs_full_row.unit = "x (goal >= 5)"


class MLAMemory:
    def track_latent_bytes_per_token_vs_per_head_kv(self):
        """DeepSeek-V3: 128 heads of K (192) and V (128) per token without MLA vs one 576 row."""
        latent = CacheConfig(61, 1, RANK + ROPE, v_head_dim=0, capacity=1)
        per_head = CacheConfig(61, 128, 192, v_head_dim=128, capacity=1)
        return latent.nbytes(1) / per_head.nbytes(1)
    track_latent_bytes_per_token_vs_per_head_kv.unit = "fraction"
