"""GPU figures of issue 35 that must measure memory, not L2 (run by ``.ci/gpu decode``).

Every working set is >= 8x a 50 MB L2 (>= 512 MiB) and both sides of a ratio are timed the same
way (CUDA events on one stream, warm-up first, median of the reps):

* ``copy``: a 1 GiB device-to-device copy (the HBM baseline; read + write bytes / time);
* ``put``: 131,072 tokens x 8 heads x 128 bfloat16 K and V (512 MiB in, 512 MiB written) into a
  262,144-cell layer, against a copy of the same bytes (target >= 90%);
* ``attend``: batched paged decode attention, 8 sequences x 4,096 cells, 32 query / 8 KV heads,
  head_dim 128, bfloat16, cycling over 8 layers (1 GiB of K/V) so no layer is in L2 when read
  again; bytes = the K/V rows read (target >= 70% of the copy's bandwidth);
* ``attend`` again over rotated q8_0 and q4_0 K/V (dequantized in the kernel), bandwidth over
  the stored bytes (working sets 571 / 302 MiB: q4_0's is ~6x a 50 MB L2);
* ``step``: the warm decode + attend step of the 262,144-cell e2e shape (8 x 32,768 cells, 2
  layers, bfloat16, then rotated q8_0): start_forward + per layer put and attend, inputs
  preallocated (target <= 2x the 0.64 ms floor; q8_0's floor scales with its bytes), with the
  host time of a step and what one step uploads.

Prints one line per figure and writes them as JSON to ``$OUT/decode_bench.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def _events_ms(fn, reps: int, stream) -> float:
    import cupy
    times = []
    for _ in range(reps):
        a = cupy.cuda.Event()
        b = cupy.cuda.Event()
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def bench_copy(out: dict) -> float:
    import cupy
    n = 1 << 30
    src = cupy.ones(n, dtype=np.uint8)
    dst = cupy.empty_like(src)
    stream = cupy.cuda.get_current_stream()
    dst[...] = src
    ms = _events_ms(lambda: dst.__setitem__(Ellipsis, src), 10, stream)
    bw = 2 * n / (ms * 1e-3)
    out["copy_1GiB_ms"] = ms
    out["copy_TBps"] = bw / 1e12
    print(f"copy 1 GiB d2d: {ms:.3f} ms, {bw / 1e12:.2f} TB/s", flush=True)
    del src, dst
    return bw


def bench_put(out: dict, copy_bw: float) -> None:
    import cupy
    import numbakv as nkv
    tokens, heads, dim = 131_072, 8, 128
    cfg = nkv.CacheConfig(1, heads, dim, dtype="bfloat16", capacity=262_144, max_seqs=1,
                          max_batch=tokens, device="cuda")
    cache = nkv.CausalCache(cfg)
    st = cache.storage
    k = cupy.ones((tokens, heads, dim), dtype=np.uint16)
    v = cupy.ones((tokens, heads, dim), dtype=np.uint16)
    stream = cupy.cuda.get_current_stream()
    starts = [0, tokens]        # alternate halves of the layer: 1 GiB of destination

    def put():
        put.i = (put.i + 1) % 2
        st.put_range(0, starts[put.i], k, v)
    put.i = 0
    put()
    ms = _events_ms(put, 10, stream)
    nbytes = 2 * 2 * k.nbytes          # K and V, read and written
    bw = nbytes / (ms * 1e-3)
    out["put_512MiB_ms"] = ms
    out["put_vs_copy"] = bw / copy_bw
    print(f"put 131072 tokens (512 MiB K+V): {ms:.3f} ms, {bw / 1e12:.2f} TB/s = "
          f"{100 * bw / copy_bw:.1f}% of the copy (target >= 90%)", flush=True)
    cache.close()


#: stored bytes per (cell, head) row of 128 values: bfloat16, and the quantized K/V types
#: the paged kernel dequantizes itself (q8_0: 4 blocks of 34 bytes; q4_0: 4 of 18)
ROW_BYTES = {None: 256, "q8_0": 136, "q4_0": 72}


def _kv_kw(kind):
    """CacheConfig arguments of a K/V storage kind: bf16, rotated q8_0 (kv_rotation "auto",
    llama.cpp's default) or unrotated q4_0."""
    if kind is None:
        return {}
    return dict(k_dtype=kind, v_dtype=kind, kv_rotation="auto" if kind == "q8_0" else "off")


def bench_attend(out: dict, copy_bw: float, kind=None) -> None:
    import cupy
    import torch
    import numbakv as nkv
    from numbakv.attention import attend
    layers, heads, dim, seqs, ctx = 8, 8, 128, 8, 4096
    cfg = nkv.CacheConfig(layers, heads, dim, dtype="bfloat16", capacity=ctx + 64,
                          max_seqs=seqs, max_batch=ctx, device="cuda", **_kv_kw(kind))
    cache = nkv.CausalCache(cfg)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for s in range(seqs):
        cache.start_forward(np.arange(ctx, dtype=np.int32), np.full(ctx, s, np.int32))
        for layer in range(layers):
            cache.set_layer(layer)
            k = torch.randn(ctx, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            cache.put(k, k)
    cache.start_forward(np.full(seqs, ctx, np.int32), np.arange(seqs, dtype=np.int32))
    kd = torch.randn(seqs, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(seqs, 4 * heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    for layer in range(layers):
        cache.set_layer(layer)
        cache.put(kd, kd)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def all_layers():
        for layer in range(layers):
            cache.set_layer(layer)
            attend(q, cache)
    all_layers()
    ms = _events_ms(all_layers, 10, stream)
    # the bytes attention must read: every stored K and V row once (working set: 8 layers,
    # >= 8x the L2 for bf16; each layer's K/V is evicted by the next seven)
    nbytes = layers * seqs * (ctx + 1) * heads * ROW_BYTES[kind] * 2
    bw = nbytes / (ms * 1e-3)
    tag = "" if kind is None else f"_{kind}"
    out[f"attend_8x4k{tag}_ms_per_layer"] = ms / layers
    out[f"attend{tag}_vs_copy"] = bw / copy_bw
    print(f"attend 8 x 4k {kind or 'bf16'} (32q/8kv, 128; working set {nbytes / 2**20:.0f} "
          f"MiB): {ms / layers:.3f} ms/layer, {bw / 1e12:.2f} TB/s = {100 * bw / copy_bw:.1f}% "
          f"of the copy (target >= 70% of HBM)", flush=True)
    cache.close()


def bench_step(out: dict, kind=None) -> None:
    import torch
    import numbakv as nkv
    from numbakv import pages
    from numbakv.attention import attend
    from numbakv.kernels import launch
    layers, heads, dim, seqs, cap, chunk = 2, 8, 128, 8, 32768, 4096
    cfg = nkv.CacheConfig(layers, heads, dim, dtype="bfloat16", capacity=cap, max_seqs=seqs,
                          max_batch=chunk, device="cuda", **_kv_kw(kind))
    cache = nkv.CausalCache(cfg)
    k = torch.randn(chunk, heads, dim, device="cuda", dtype=torch.bfloat16)
    for s in range(seqs):
        for p0 in range(0, cap - 64, chunk):
            n = min(chunk, cap - 64 - p0)
            cache.start_forward(np.arange(p0, p0 + n, dtype=np.int32), np.full(n, s, np.int32))
            for layer in range(layers):
                cache.set_layer(layer)
                cache.put(k[:n], k[:n])
    kd = torch.randn(seqs, heads, dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(seqs, 4 * heads, dim, device="cuda", dtype=torch.bfloat16)
    seq_ids = np.arange(seqs, dtype=np.int32)

    def step(t):
        cache.start_forward(np.full(seqs, cap - 64 + t, np.int32), seq_ids)
        for layer in range(layers):
            cache.set_layer(layer)
            cache.put(kd, kd)
            attend(q, cache)
    for t in range(4):
        step(t)
    torch.cuda.synchronize()
    # host work per step independent of the cache: extended page tables, one small upload
    uploads = dict(launch.UPLOADS)
    step(4)
    host_lists = cache._host_pages().host_lists_built
    up_calls = launch.UPLOADS["calls"] - uploads["calls"]
    up_bytes = launch.UPLOADS["bytes"] - uploads["bytes"]
    torch.cuda.synchronize()
    steps = 40
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    host = 0.0
    a.record()
    for t in range(5, 5 + steps):
        h0 = time.perf_counter()
        step(t)
        host += time.perf_counter() - h0
    b.record()
    torch.cuda.synchronize()
    ms = a.elapsed_time(b) / steps
    tag = "" if kind is None else f"_{kind}"
    out[f"step_262144{tag}_ms"] = ms
    out[f"step{tag}_host_us"] = 1e6 * host / steps
    out[f"step{tag}_uploads"] = [up_calls, up_bytes]
    floor = 0.64 * ROW_BYTES[kind] / 256
    print(f"warm decode + attend step, 262,144 cells {kind or 'bf16'} (2 layers): {ms:.3f} "
          f"ms/step (floor {floor:.2f} ms, target <= {2 * floor:.2f}), host "
          f"{1e6 * host / steps:.0f} us/step; one step uploaded {up_bytes} B in {up_calls} "
          f"copies, page lists {'built on the host' if host_lists else 'extended on the device'}"
          f" (pages.INCREMENTAL_DEVICES={pages.INCREMENTAL_DEVICES})", flush=True)
    cache.close()


def main() -> int:
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        print(f"no GPU ({exc}): nothing to do")
        return 0
    out: dict = {}
    copy_bw = bench_copy(out)
    rc = 0
    runs = [(bench_put, (out, copy_bw))]
    for kind in (None, "q8_0", "q4_0"):       # bf16, rotated q8_0, q4_0 (dequantized in-kernel)
        runs.append((bench_attend, (out, copy_bw, kind)))
    for kind in (None, "q8_0"):
        runs.append((bench_step, (out, kind)))
    for fn, args in runs:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - report every figure that can be measured
            print(f"{fn.__name__}{args[2:]} failed: {type(exc).__name__}: {exc}", flush=True)
            rc = 1
    path = os.path.join(os.environ.get("OUT", "gpu-out"), "decode_bench.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
