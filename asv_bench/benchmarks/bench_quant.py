"""Quantized K/V (q8_0, q4_0, float8_e4m3) on the CPU: memory per token against float16, and
put (quantize), get (dequantize into the scratch) and rotate (dequantize, rotate, requantize)
against ``np.copyto`` of the same tokens' float16 bytes (what a float16 cache moves for the same
work; goal >= 0.5).

``track_*`` ratios are measured in one run, both sides timed back to back (best of several
interleaved repeats), so machine noise largely cancels.
"""

import timeit

import numpy as np

from numbakv.config import CacheConfig, RopeShift
from numbakv.storage import KVStorage

N_KV_HEADS, HEAD_DIM, TOKENS = 8, 128, 512
KINDS = ["q8_0", "q4_0", "float8_e4m3"]


def _best_ratio(fast, slow, min_time=2e-3, repeats=5):
    """``time(slow) / time(fast)``: best of ``repeats`` interleaved runs of each (as in
    bench_kernels)."""
    def number_for(fn):
        n = 1
        while timeit.timeit(fn, number=n) < min_time and n < 1 << 16:
            n *= 4
        return n
    nf, ns = number_for(fast), number_for(slow)
    tf = ts = float("inf")
    for _ in range(repeats):
        tf = min(tf, timeit.timeit(fast, number=nf) / nf)
        ts = min(ts, timeit.timeit(slow, number=ns) / ns)
    return ts / tf


class QuantMemory:
    params = [KINDS]
    param_names = ["kind"]

    def track_bytes_per_token_vs_float16(self, kind):
        f16 = CacheConfig(32, N_KV_HEADS, HEAD_DIM, capacity=1)
        return f16.replace(k_dtype=kind, v_dtype=kind).nbytes(1) / f16.nbytes(1)
    track_bytes_per_token_vs_float16.unit = "fraction of float16"


class QuantKernelsCPU:
    """One layer, 8 KV heads, head_dim 128, float16 in and out, 512 tokens, unrotated."""
    params = [KINDS]
    param_names = ["kind"]
    rotation = "off"

    def setup(self, kind):
        cfg = CacheConfig(1, N_KV_HEADS, HEAD_DIM, capacity=TOKENS, max_batch=TOKENS,
                          k_dtype=kind, v_dtype=kind, kv_rotation=self.rotation)
        self.st = KVStorage(cfg, TOKENS, "cpu")
        rng = np.random.default_rng(0)
        self.key = rng.standard_normal((TOKENS, N_KV_HEADS, HEAD_DIM)).astype(np.float16)
        self.value = rng.standard_normal((TOKENS, N_KV_HEADS, HEAD_DIM)).astype(np.float16)
        self.k_dst = np.empty_like(self.key)
        self.v_dst = np.empty_like(self.value)
        self.cells = np.arange(TOKENS, dtype=np.int32)
        self.deltas = np.full(TOKENS, -3, dtype=np.int64)
        self.rope = RopeShift()
        self.put()
        self.get()
        self.rotate()

    def put(self):
        self.st.put_range(0, 0, self.key, self.value)

    def get(self):
        self.st.dequantized_views(0, 0, TOKENS)

    def rotate(self):
        self.st.rotate(self.cells, self.deltas, self.rope)

    def copy_kv(self):
        np.copyto(self.k_dst, self.key)
        np.copyto(self.v_dst, self.value)

    def copy_k(self):
        np.copyto(self.k_dst, self.key)

    def time_put(self, kind):
        self.put()

    def time_get(self, kind):
        self.get()

    def time_rotate(self, kind):
        self.rotate()

    def track_put_vs_copyto(self, kind):
        return _best_ratio(self.put, self.copy_kv)
    track_put_vs_copyto.unit = "fraction of np.copyto"

    def track_get_vs_copyto(self, kind):
        return _best_ratio(self.get, self.copy_kv)
    track_get_vs_copyto.unit = "fraction of np.copyto"

    def track_rotate_vs_copyto(self, kind):
        return _best_ratio(self.rotate, self.copy_k)
    track_rotate_vs_copyto.unit = "fraction of np.copyto"


class RotatedQuantKernelsCPU(QuantKernelsCPU):
    """llama.cpp's rotated quantized cache (``kv_rotation="auto"``: K in Walsh-Hadamard blocks
    of 128, V of 64): the rotation fused into the quantizing put, and undone/redone around the
    RoPE of the shift. Goal (issue 34): put >= 0.5 of ``np.copyto`` of the float16 input."""
    params = [["q8_0", "q4_0"]]
    rotation = "auto"
