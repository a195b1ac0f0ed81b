"""Benchmark of ``numbakv.dist``: one sequence moved between two processes (gloo over loopback,
CPU) against ``torch.distributed`` send/recv of one tensor of the same bytes, in the same run.

    python -m numbakv.tools.bench_dist [--tokens 4096] [--layers 32] [--heads 8] [--dim 128]
                                       [--dtype float16] [--repeat 3] [--json]
                                       [--transport torch|nixl]

Rank 0 holds the sequence; rank 1 receives it into an empty cache (``recv_seq``: header,
verdict, rows, ``import_seq``, acknowledgement: everything a real transfer does) and drops it
again between repeats. Times are the receiver's, from a barrier to the call's return; the best
of ``--repeat`` runs counts. Target (issue 28): ratio = tensor time / sequence time >= 0.5.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, args, out) -> None:
    import numpy as np
    import torch
    import torch.distributed as tdist

    import numbakv as nkv
    from numbakv import dist

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=2, timeout=datetime.timedelta(seconds=600))
    cfg = nkv.CacheConfig(n_layers=args.layers, n_kv_heads=args.heads, head_dim=args.dim,
                          dtype=args.dtype, k_dtype=args.k_dtype, v_dtype=args.v_dtype,
                          capacity=args.tokens, max_seqs=1, max_batch=args.tokens,
                          device="cpu")
    cache = nkv.CausalCache(cfg, shift=nkv.RopeShift())
    n = args.tokens
    if rank == 0:
        cache.start_forward(np.arange(n), [0] * n)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((n, args.heads, args.dim), dtype=np.float32)
        x = torch.from_numpy(x).to(getattr(torch, args.dtype))
        for layer in range(args.layers):
            cache.set_layer(layer)
            cache.put(x, x)
        nbytes = cache.export_seq(0).nbytes
    else:
        nbytes = 0
    size = torch.tensor([nbytes], dtype=torch.int64)
    tdist.broadcast(size, 0)
    nbytes = int(size)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    t_tensor, t_seq, t_send, t_import = [], [], [], []
    if rank == 1:   # the copy into the cache's cells, part of every receive: reported apart
        real_import = cache.import_seq

        def timed_import(*a, **k):
            t = time.perf_counter()
            try:
                return real_import(*a, **k)
            finally:
                t_import.append(time.perf_counter() - t)

        cache.import_seq = timed_import
    for _ in range(args.repeat):
        tdist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            tdist.send(buf, 1)
        else:
            tdist.recv(buf, 0)
        t_tensor.append(time.perf_counter() - t0)
        tdist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send_seq(cache, 0, 1, transport=args.transport)
            t_send.append(time.perf_counter() - t0)
        else:
            got = dist.recv_seq(cache, 0, 0, transport=args.transport)
            t_seq.append(time.perf_counter() - t0)
            assert got == n, got
            cache.seq_rm(0)
    if rank == 1:
        out.put({"transport": args.transport, "tokens": n, "layers": args.layers,
                 "heads": args.heads, "dim": args.dim,
                 "k_dtype": cfg.k_dtype, "v_dtype": cfg.v_dtype, "bytes": nbytes,
                 "tensor_s": min(t_tensor), "seq_s": min(t_seq),
                 "import_s": t_import[t_seq.index(min(t_seq))],
                 "ratio": min(t_tensor) / min(t_seq)})
    else:
        out.put({"send_s": min(t_send)})
    tdist.barrier()


def run(args) -> dict:
    """Spawn the two ranks, return the receiver's figures (and the sender's time)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    port = _free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=args.timeout) for _ in range(2)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    merged: dict = {}
    for r in results:
        merged.update(r)
    return merged


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m numbakv.tools.bench_dist",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--k-dtype", default=None)
    ap.add_argument("--v-dtype", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--transport", default="torch", choices=("torch", "nixl"),
                    help="how the rows move (the baseline is always torch.distributed)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    r = run(args)
    if args.json:
        print(json.dumps(r))
    else:
        mib = r["bytes"] / 2**20
        print(f"sequence: {r['tokens']} tokens x {r['layers']} layers x {r['heads']}x{r['dim']} "
              f"{r['k_dtype']}/{r['v_dtype']}: {mib:.1f} MiB")
        print(f"torch.distributed send/recv of one tensor: {r['tensor_s'] * 1e3:8.1f} ms "
              f"({mib / r['tensor_s']:.0f} MiB/s)")
        print(f"numbakv.dist send_seq/recv_seq ({r['transport']}): {r['seq_s'] * 1e3:8.1f} ms "
              f"({mib / r['seq_s']:.0f} MiB/s; sender {r['send_s'] * 1e3:.1f} ms; of it "
              f"import_seq {r['import_s'] * 1e3:.1f} ms)")
        print(f"ratio (tensor time / sequence time): {r['ratio']:.2f} (target >= 0.50)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
