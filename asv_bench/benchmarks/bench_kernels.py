"""Kernel throughput against the plain copy / memset of the same bytes, CPU and GPU.

The ``track_*`` benchmarks report ratios measured in one run (both sides timed back to back, best
of several interleaved repeats), so machine noise largely cancels:

- CPU ``put`` vs ``np.copyto`` of the same K and V bytes (target >= 0.7);
- GPU ``put`` / ``move`` / ``rotate`` vs a CuPy device-to-device copy of the same bytes (target
  >= 0.85 from 16 MiB), mask fill vs a memset (target >= 0.8), and the host time of one ``put``
  launch in microseconds (target <= 10).

GPU benchmarks raise ``NotImplementedError`` in ``setup`` (asv's way to skip) without a GPU.
"""

import timeit

import numpy as np

from numbakv.config import CacheConfig, RopeShift
from numbakv.kernels import _common, launch, move, put, rope
from numbakv.storage import KVStorage

N_KV_HEADS, HEAD_DIM = 8, 128


def _best_ratio(fast, slow, min_time=2e-3, repeats=7):
    """``time(slow) / time(fast)``: best of ``repeats`` interleaved runs of each."""
    def number_for(fn):
        n = 1
        while True:
            t = timeit.timeit(fn, number=n)
            if t >= min_time or n >= 1 << 16:
                return n
            n *= 4
    nf, ns = number_for(fast), number_for(slow)
    tf = ts = float("inf")
    for _ in range(repeats):
        tf = min(tf, timeit.timeit(fast, number=nf) / nf)
        ts = min(ts, timeit.timeit(slow, number=ns) / ns)
    return ts / tf


def _cuda_or_skip():
    from numbakv.device import cuda_usable
    if not cuda_usable():
        raise NotImplementedError("no usable CUDA GPU")
    import cupy
    return cupy


# ------------------------------------------------------------------ CPU

class KernelPutCPU:
    """One layer, 8 KV heads, head_dim 128, float16: a decode-sized batch and a prefill."""
    params = [64, 512]
    param_names = ["batch"]

    def setup(self, batch):
        cfg = CacheConfig(1, N_KV_HEADS, HEAD_DIM, dtype="float16", capacity=4096)
        self.st = KVStorage(cfg, 4096, "cpu")
        rng = np.random.default_rng(0)
        self.key = rng.standard_normal((batch, N_KV_HEADS, HEAD_DIM)).astype(np.float16)
        self.value = rng.standard_normal((batch, N_KV_HEADS, HEAD_DIM)).astype(np.float16)
        self.start = 1000
        self.slots = np.arange(self.start, self.start + batch, dtype=np.int32)
        self.k_dst = self.st.keys[0, self.start:self.start + batch]
        self.v_dst = self.st.values[0, self.start:self.start + batch]
        self.put()
        self.put_range()

    def put(self):
        self.st.put(0, self.slots, self.key, self.value)

    def put_range(self):
        self.st.put_range(0, self.start, self.key, self.value)

    def copyto(self):
        np.copyto(self.k_dst, self.key)
        np.copyto(self.v_dst, self.value)

    def time_put(self, batch):
        self.put()

    def time_put_range(self, batch):
        self.put_range()

    def time_np_copyto_same_bytes(self, batch):
        self.copyto()

    def track_put_bandwidth_vs_copyto(self, batch):
        return _best_ratio(self.put, self.copyto)
    track_put_bandwidth_vs_copyto.unit = "fraction of np.copyto"

    def track_put_range_bandwidth_vs_copyto(self, batch):
        return _best_ratio(self.put_range, self.copyto)
    track_put_range_bandwidth_vs_copyto.unit = "fraction of np.copyto"


class KernelMaskCPU:
    params = [[1, 512], [4096]]
    param_names = ["batch", "cells"]

    def setup(self, batch, n):
        cfg = CacheConfig(1, N_KV_HEADS, HEAD_DIM, capacity=n)
        self.st = KVStorage(cfg, n, "cpu")
        self.out = self.st.new_mask(batch, n)
        self.cell_pos = np.arange(n, dtype=np.int32)
        self.cell_seqs = np.zeros((n, 4), np.uint64)
        self.cell_seqs[:, 0] = 1
        self.batch_pos = np.arange(n - batch, n, dtype=np.int32)
        self.batch_seq = np.zeros(batch, np.int32)
        self.causal = np.ones(batch, np.uint8)
        self.fill()

    def fill(self):
        self.st.fill_mask(self.out, self.cell_pos, self.cell_seqs, self.batch_pos,
                          self.batch_seq, self.causal)

    def memset(self):
        self.out.fill(-np.inf)

    def time_fill_mask(self, batch, n):
        self.fill()

    def track_fill_vs_memset(self, batch, n):
        return _best_ratio(self.fill, self.memset)
    track_fill_vs_memset.unit = "fraction of ndarray.fill"


def _defrag_plan(n_cells, block=16):
    """Holes filled from the end: every other block of the upper half moves into the lower half."""
    moves = []
    dst = 0
    for src in range(n_cells // 2, n_cells, 2 * block):
        moves.append((src, dst, block))
        dst += 2 * block
    return np.array(moves, dtype=np.int64)


class KernelMoveCPU:
    """A defrag plan over 8 layers of 2048 cells (8 KV heads x 128, float16)."""

    def setup(self):
        cfg = CacheConfig(8, N_KV_HEADS, HEAD_DIM, dtype="float16", capacity=2048)
        self.st = KVStorage(cfg, 2048, "cpu")
        self.moves = _defrag_plan(2048)
        self.move()

    def move(self):
        self.st.move_blocks(self.moves)

    def numpy_copy(self):
        for s, d, ln in self.moves:
            self.st.keys[:, d:d + ln] = self.st.keys[:, s:s + ln]
            self.st.values[:, d:d + ln] = self.st.values[:, s:s + ln]

    def time_move_blocks(self):
        self.move()

    def track_move_vs_numpy_slices(self):
        return _best_ratio(self.move, self.numpy_copy)
    track_move_vs_numpy_slices.unit = "fraction of numpy slice copies"


class KernelRotateCPU:
    params = ["float16", "bfloat16", "float32"]
    param_names = ["dtype"]

    def setup(self, dtype):
        cfg = CacheConfig(4, N_KV_HEADS, HEAD_DIM, dtype=dtype, capacity=2048)
        self.st = KVStorage(cfg, 2048, "cpu")
        self.cells = np.arange(0, 1024, dtype=np.int32)
        self.deltas = np.full(1024, -37, dtype=np.int64)
        self.rope = RopeShift()
        self.rotate()

    def rotate(self):
        self.st.rotate(self.cells, self.deltas, self.rope)

    def copy_same_bytes(self):
        k = self.st.keys
        k[:, 1024:2048] = k[:, 0:1024]

    def time_rotate(self, dtype):
        self.rotate()

    def track_rotate_vs_copy(self, dtype):
        return _best_ratio(self.rotate, self.copy_same_bytes)
    track_rotate_vs_copy.unit = "fraction of a numpy copy"


# ------------------------------------------------------------------ GPU

def _gpu_time(cupy, fn, repeats=20):
    """Mean device time of ``fn`` in seconds (CUDA events around ``repeats`` calls)."""
    fn()
    cupy.cuda.get_current_stream().synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(repeats):
            fn()
        stop.record()
        stop.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, stop) / 1e3 / repeats)
    return best


class KernelPutGPU:
    """K+V bytes per put: 4 KiB per token, so 4096 tokens = 16 MiB."""
    params = [64, 4096, 16384]
    param_names = ["batch"]

    def setup(self, batch):
        cupy = _cuda_or_skip()
        self.cp = cupy
        cfg = CacheConfig(1, N_KV_HEADS, HEAD_DIM, dtype="float16", capacity=32768)
        self.st = KVStorage(cfg, 32768, "cuda")
        self.key = cupy.random.standard_normal((batch, N_KV_HEADS, HEAD_DIM)).astype(cupy.float16)
        self.value = cupy.random.standard_normal((batch, N_KV_HEADS, HEAD_DIM)).astype(cupy.float16)
        self.slots = np.arange(100, 100 + batch, dtype=np.int32)
        self.k_dst = self.st.keys[0, 100:100 + batch]
        self.v_dst = self.st.values[0, 100:100 + batch]
        self.put()
        self.put_range()
        cupy.cuda.get_current_stream().synchronize()

    def put(self):
        self.st.put(0, self.slots, self.key, self.value)

    def put_range(self):
        self.st.put_range(0, 100, self.key, self.value)

    def d2d(self):
        self.k_dst[...] = self.key
        self.v_dst[...] = self.value

    def time_put(self, batch):
        self.put()
        self.cp.cuda.get_current_stream().synchronize()

    def track_put_bandwidth_vs_d2d(self, batch):
        return _gpu_time(self.cp, self.d2d) / _gpu_time(self.cp, self.put)
    track_put_bandwidth_vs_d2d.unit = "fraction of CuPy D2D copy"

    def track_put_range_bandwidth_vs_d2d(self, batch):
        return _gpu_time(self.cp, self.d2d) / _gpu_time(self.cp, self.put_range)
    track_put_range_bandwidth_vs_d2d.unit = "fraction of CuPy D2D copy"

    def track_put_host_us(self, batch):
        """Host time of one put launch (GPU work not awaited), microseconds."""
        n = 200
        self.put()
        self.cp.cuda.get_current_stream().synchronize()
        t = timeit.timeit(self.put, number=n) / n
        self.cp.cuda.get_current_stream().synchronize()
        return t * 1e6
    track_put_host_us.unit = "us"

    def track_put_range_host_us(self, batch):
        n = 200
        self.put_range()
        self.cp.cuda.get_current_stream().synchronize()
        t = timeit.timeit(self.put_range, number=n) / n
        self.cp.cuda.get_current_stream().synchronize()
        return t * 1e6
    track_put_range_host_us.unit = "us"

    def track_put_range_host_us_numba_dispatcher(self, batch):
        """The same through Numba's dispatcher (what the fast path saves)."""
        launch.set_fast_launch(False)
        put._CUDA_PLANS.clear()
        try:
            return self.track_put_range_host_us(batch)
        finally:
            launch.set_fast_launch(True)
            put._CUDA_PLANS.clear()
    track_put_range_host_us_numba_dispatcher.unit = "us"


class KernelMaskGPU:
    params = [[512, 2048], [32768]]
    param_names = ["batch", "cells"]

    def setup(self, batch, n):
        cupy = _cuda_or_skip()
        self.cp = cupy
        cfg = CacheConfig(1, N_KV_HEADS, HEAD_DIM, capacity=n)
        self.st = KVStorage(cfg, n, "cuda")
        self.out = self.st.new_mask(batch, n)
        self.cell_pos = np.arange(n, dtype=np.int32)
        self.cell_seqs = np.zeros((n, 4), np.uint64)
        self.cell_seqs[:, 0] = 1
        self.batch_pos = np.arange(n - batch, n, dtype=np.int32)
        self.batch_seq = np.zeros(batch, np.int32)
        self.causal = np.ones(batch, np.uint8)

    def fill(self):
        self.st.fill_mask(self.out, self.cell_pos, self.cell_seqs, self.batch_pos,
                          self.batch_seq, self.causal)

    def memset(self):
        self.out.fill(0)

    def time_fill_mask(self, batch, n):
        self.fill()
        self.cp.cuda.get_current_stream().synchronize()

    def track_fill_vs_memset(self, batch, n):
        return _gpu_time(self.cp, self.memset) / _gpu_time(self.cp, self.fill)
    track_fill_vs_memset.unit = "fraction of a memset"


class KernelMoveGPU:
    """A defrag plan over 32 layers of 8192 cells (8 x 128 float16): 64 MiB moved."""

    def setup(self):
        cupy = _cuda_or_skip()
        self.cp = cupy
        cfg = CacheConfig(32, N_KV_HEADS, HEAD_DIM, dtype="float16", capacity=8192)
        self.st = KVStorage(cfg, 8192, "cuda")
        self.moves = _defrag_plan(8192)
        self.prepared = move.prepare("cuda", self.st.keys, self.st.values, self.moves, False)
        n = int(self.moves[:, 2].sum())
        self.a = cupy.empty((32, n, N_KV_HEADS, HEAD_DIM), cupy.float16)
        self.b = cupy.empty_like(self.a)
        self.c = cupy.empty_like(self.a)
        self.d = cupy.empty_like(self.a)

    def move(self):
        self.st.move_blocks(self.moves)

    def d2d(self):
        self.b[...] = self.a
        self.d[...] = self.c

    def time_move_blocks(self):
        self.move()
        self.cp.cuda.get_current_stream().synchronize()

    def kernel_only(self):
        p = self.prepared
        launch.launch("cuda", p.kernel, p.grid, p.block, p.args)

    def track_move_vs_d2d(self):
        """The whole call, host planning and transfers included."""
        return _gpu_time(self.cp, self.d2d) / _gpu_time(self.cp, self.move)
    track_move_vs_d2d.unit = "fraction of CuPy D2D copy"

    def track_move_kernel_vs_d2d(self):
        """The kernel alone (plan already on the GPU)."""
        return _gpu_time(self.cp, self.d2d) / _gpu_time(self.cp, self.kernel_only)
    track_move_kernel_vs_d2d.unit = "fraction of CuPy D2D copy"


class KernelRotateGPU:
    """Rotate 8192 cells of 32 layers (8 x 128 float16 keys): 128 MiB read and written."""

    def setup(self):
        cupy = _cuda_or_skip()
        self.cp = cupy
        cfg = CacheConfig(32, N_KV_HEADS, HEAD_DIM, dtype="float16", capacity=16384)
        self.st = KVStorage(cfg, 16384, "cuda")
        self.cells = np.arange(8192, dtype=np.int32)
        self.deltas = np.full(8192, -100, dtype=np.int64)
        self.rope = RopeShift()
        self.prepared = rope.prepare("cuda", self.st.keys, "float16", self.cells, self.deltas,
                                     self.rope.inv_freq(HEAD_DIM), self.rope.neox)
        self.a = cupy.empty((32, 8192, N_KV_HEADS, HEAD_DIM), cupy.float16)
        self.b = cupy.empty_like(self.a)

    def rotate(self):
        self.st.rotate(self.cells, self.deltas, self.rope)

    def d2d(self):
        self.b[...] = self.a

    def time_rotate(self):
        self.rotate()
        self.cp.cuda.get_current_stream().synchronize()

    def kernel_only(self):
        p = self.prepared
        launch.launch("cuda", p.kernel, p.grid, p.block, p.args)

    def track_rotate_vs_d2d(self):
        """The whole call, host tables and transfers included."""
        return _gpu_time(self.cp, self.d2d) / _gpu_time(self.cp, self.rotate)
    track_rotate_vs_d2d.unit = "fraction of CuPy D2D copy"

    def track_rotate_kernel_vs_d2d(self):
        """The kernel alone (tables already on the GPU)."""
        return _gpu_time(self.cp, self.d2d) / _gpu_time(self.cp, self.kernel_only)
    track_rotate_kernel_vs_d2d.unit = "fraction of CuPy D2D copy"


# ------------------------------------------------------------------ issue 15 / issue 12 item 5

class KernelRotateF16CPU:
    """float16 rotary shift on the CPU: the F16C twin against the software-conversion twin and
    against ``np.copyto`` of the same key bytes (4 layers x 4096 cells x 8 x 128 = 32 MiB;
    target: >= 1x copyto)."""

    def setup(self):
        from numbakv.kernels import rope as _rope
        if not _rope.F16_HW:
            raise NotImplementedError("this CPU target has no hardware half conversions")
        self.rope = _rope
        rng = np.random.default_rng(0)
        self.keys = rng.standard_normal((4, 4096, N_KV_HEADS, HEAD_DIM)).astype(np.float16)
        self.src = self.keys.copy()
        self.dst = np.empty_like(self.keys)
        self.cells = np.arange(4096, dtype=np.int32)
        self.deltas = np.full(4096, -3, dtype=np.int64)
        self.inv = RopeShift().inv_freq(HEAD_DIM)
        self.hw()
        self.sw()
        np.copyto(self.dst, self.src)

    def _run(self, hw):
        old = self.rope.F16_HW
        self.rope.F16_HW = hw
        try:
            self.rope.launch("cpu", self.keys, "float16", self.cells, self.deltas, self.inv, True)
        finally:
            self.rope.F16_HW = old

    def hw(self):
        self._run(True)

    def sw(self):
        self._run(False)

    def copyto(self):
        np.copyto(self.dst, self.src)

    def time_rotate_f16c(self):
        self.hw()

    def track_f16c_vs_copyto(self):
        return _best_ratio(self.hw, self.copyto, min_time=1e-2, repeats=3)
    track_f16c_vs_copyto.unit = "fraction of np.copyto bandwidth"

    def track_f16c_vs_software(self):
        return _best_ratio(self.hw, self.sw, min_time=1e-2, repeats=3)
    track_f16c_vs_software.unit = "x faster than software conversion"


class KernelStreamGPU:
    """Host cost of the stream contract: one decode put (1 token) on a side stream set with
    use_stream (input kept alive, event every 64 puts) and a permuted-V prefill put through the
    shared-memory tiles vs a D2D copy of the same bytes."""

    def setup(self):
        cupy = _cuda_or_skip()
        self.cp = cupy
        cfg = CacheConfig(1, N_KV_HEADS, HEAD_DIM, dtype="float16", capacity=32768,
                          permuted_v=True)
        self.st = KVStorage(cfg, 32768, "cuda")
        self.side = cupy.cuda.Stream(non_blocking=True)
        self.st.use_stream(self.side)
        self.key1 = cupy.zeros((1, N_KV_HEADS, HEAD_DIM), cupy.float16)
        self.keyp = cupy.random.standard_normal((4096, N_KV_HEADS, HEAD_DIM)).astype(cupy.float16)
        self.a = cupy.empty_like(self.keyp)
        self.b = cupy.empty_like(self.keyp)
        self.put1()
        self.putp()
        self.side.synchronize()

    def put1(self):
        self.st.put_range(0, 7, self.key1, self.key1)

    def putp(self):
        self.st.put_range(0, 100, self.keyp, self.keyp)

    def d2d(self):
        self.a[...] = self.keyp
        self.b[...] = self.keyp

    def track_side_stream_put_host_us(self):
        n = 500
        t = timeit.timeit(self.put1, number=n) / n
        self.side.synchronize()
        return t * 1e6
    track_side_stream_put_host_us.unit = "us"

    def track_permuted_prefill_put_vs_d2d(self):
        with self.side:
            return _gpu_time(self.cp, self.d2d) / _gpu_time(self.cp, self.putp)
    track_permuted_prefill_put_vs_d2d.unit = "fraction of CuPy D2D copy"
