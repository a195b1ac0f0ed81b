"""Where the host time of numbakv's GPU calls goes (cProfile over many calls; run by .ci/gpu
profile). Prints, per operation, the wall time per call and the top functions by own time."""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import cupy
import numpy as np

import numbakv as nkv
from numbakv.cells import CellTable
from numbakv.config import CacheConfig, RopeShift
from numbakv.storage import KVStorage


def profile(label, fn, n=300):
    for _ in range(10):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    cupy.cuda.get_current_stream().synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    cupy.cuda.get_current_stream().synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    body = "\n".join(l for l in s.getvalue().splitlines()[6:] if l.strip())
    print(f"\n=== {label}: {host:.1f} us host per call (no profiler)\n{body}", flush=True)


def main():
    rng = np.random.default_rng(0)
    cfg = CacheConfig(4, 8, 128, dtype="float16", capacity=8192, max_seqs=1, max_batch=8192,
                      device="cuda")
    st = KVStorage(cfg, 8192, "cuda")
    k1 = cupy.asarray(rng.standard_normal((1, 8, 128)).astype(np.float16))
    profile("put_range 1 token", lambda: st.put_range(0, 0, k1, k1))
    slots = np.array([5], np.int32)
    profile("put 1 token", lambda: st.put(0, slots, k1, k1))
    n = 4096
    table = CellTable(n, 1)
    table.apply_batch(np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32),
                      np.zeros(n, np.int32))
    cp, cs = table.mask_inputs(0, n)
    out = st.new_mask(8, n)
    bp, bs, c = np.arange(n - 8, n, dtype=np.int32), np.zeros(8, np.int32), np.ones(8, np.uint8)
    profile("fill_mask 8x4096", lambda: st.fill_mask(out, cp, cs, bp, bs, c))
    moves = np.array([[0, 64, 64]], np.int64)
    profile("move_blocks 64 cells", lambda: st.move_blocks(moves))
    cells, deltas = np.arange(64, dtype=np.int32), np.full(64, -3, np.int32)
    rope = RopeShift()
    profile("rotate 64 cells", lambda: st.rotate(cells, deltas, rope))
    # a decode step: batch 1, context 4096, 32 layers
    ccfg = CacheConfig(32, 8, 128, dtype="float16", capacity=4200, max_seqs=1, max_batch=512,
                       device="cuda")
    cache = nkv.CausalCache(ccfg)
    kk = cupy.asarray(rng.standard_normal((512, 8, 128)).astype(np.float16))
    for p0 in range(0, 4096, 512):
        cache.start_forward(np.arange(p0, p0 + 512, dtype=np.int32), np.zeros(512, np.int32))
        for layer in range(32):
            cache.set_layer(layer)
            cache.put(kk, kk)
    pos, seq = np.array([4096], np.int32), np.zeros(1, np.int32)

    def step():
        cache.start_forward(pos, seq)
        for layer in range(32):
            cache.set_layer(layer)
            cache.put(k1, k1)
            cache.get()
        cache.seq_rm(-1, 4096)
    profile("decode step b1 4k 32 layers (+seq_rm)", step, n=50)
    profile("start_forward b1 4k (+seq_rm)",
            lambda: (cache.start_forward(pos, seq), cache.seq_rm(-1, 4096)), n=200)


def attend_at_262k():
    """A decode step with ``attend`` over 8 sequences x 32,768 cells, bfloat16, 2 layers (the
    end-to-end run took 232 ms a step here on an H100: where does it go?)."""
    import torch

    from numbakv.attention import attend
    seqs, cap, chunk = 8, 32768, 4096
    cfg = CacheConfig(2, 8, 128, dtype="bfloat16", capacity=cap, max_seqs=seqs,
                      max_batch=chunk, device="cuda")
    cache = nkv.CausalCache(cfg)
    k = torch.randn(chunk, 8, 128, device="cuda", dtype=torch.bfloat16)
    for s in range(seqs):
        for p0 in range(0, cap, chunk):
            cache.start_forward(np.arange(p0, p0 + chunk, dtype=np.int32),
                                np.full(chunk, s, dtype=np.int32))
            for layer in range(2):
                cache.set_layer(layer)
                cache.put(k, k)
    for s in range(seqs):
        cache.seq_rm(s, cap - 64, None)
    q = torch.randn(seqs, 32, 128, device="cuda", dtype=torch.bfloat16)
    kd = torch.randn(seqs, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = np.full(seqs, cap - 64, dtype=np.int32)
    ids = np.arange(seqs, dtype=np.int32)

    def step():
        cache.start_forward(pos, ids)
        for layer in range(2):
            cache.set_layer(layer)
            cache.put(kd, kd)
            attend(q, cache)
        torch.cuda.synchronize()
        cache.seq_rm(-1, cap - 64, cap - 63)

    def parts():
        t0 = time.perf_counter()
        cache.start_forward(pos, ids)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        cache.page_table()
        t2 = time.perf_counter()
        cache.set_layer(0)
        cache.put(kd, kd)
        attend(q, cache)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        cache.seq_rm(-1, cap - 64, cap - 63)
        print(f"  start_forward {1e3 * (t1 - t0):.2f} ms, page_table {1e3 * (t2 - t1):.2f} ms, "
              f"put + attend {1e3 * (t3 - t2):.2f} ms", flush=True)
    for _ in range(3):
        parts()
    profile("decode step + attend, 8 x 32k cells, bf16, 2 layers", step, n=5)


if __name__ == "__main__":
    main()
    attend_at_262k()
