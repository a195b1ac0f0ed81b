"""Batched decode with FlashInfer's paged attention reading numbakv's cache directly.

numbakv's ``cache.page_table()`` is FlashInfer's CSR page table with page size 1 (a page is a
cell) and ``cache.layer_pool()`` reshaped to ``[n_cells, 1, n_kv_heads, head_dim]`` is its NHD
paged K/V cache, so ``numbakv.attention.attend(q, cache, backend="flashinfer")`` runs
``BatchDecodeWithPagedKVCacheWrapper`` (or the prefill wrapper for chunks) on the cache's own
storage, no copy. Each step's output is checked against the ``"dense"`` backend (``get()`` and
its mask).

Needs a CUDA GPU and ``pip install flashinfer-python``; elsewhere it says why and exits 0.

    python examples/flashinfer_decode.py [--seqs 4] [--prompt 100] [--steps 8]
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

N_HEADS, N_KV_HEADS, HEAD_DIM = 8, 2, 128


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=100, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=8, help="decode steps")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("skipped: PyTorch is not installed")
        return 0
    from numbakv.attention import attend, flashinfer_available
    from numbakv.device import cuda_usable
    if not torch.cuda.is_available() or not cuda_usable():
        print("skipped: no CUDA GPU")
        return 0
    if not flashinfer_available():
        print("skipped: flashinfer is not installed (pip install flashinfer-python)")
        return 0
    import numpy as np

    import numbakv as nkv
    cfg = nkv.CacheConfig(1, N_KV_HEADS, HEAD_DIM, dtype="float16",
                          capacity=args.prompt + args.steps + 8, max_seqs=args.seqs,
                          max_batch=max(512, args.prompt), device="cuda")
    cache = nkv.CausalCache(cfg)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def kv(n):
        return (torch.randn(n, N_KV_HEADS, HEAD_DIM, device="cuda", generator=gen).half(),
                torch.randn(n, N_KV_HEADS, HEAD_DIM, device="cuda", generator=gen).half())

    worst = 0.0
    for s in range(args.seqs):                        # prefill, one sequence at a time
        cache.start_forward(np.arange(args.prompt), np.full(args.prompt, s))
        cache.set_layer(0)
        cache.put(*kv(args.prompt))
        q = torch.randn(args.prompt, N_HEADS, HEAD_DIM, device="cuda", generator=gen).half()
        out = attend(q, cache, backend="flashinfer")
        worst = max(worst, (out - attend(q, cache, backend="dense")).abs().max().item())
    for step in range(args.steps):                    # decode: one token per sequence
        pos = np.full(args.seqs, args.prompt + step)
        cache.start_forward(pos, np.arange(args.seqs))
        cache.set_layer(0)
        cache.put(*kv(args.seqs))
        q = torch.randn(args.seqs, N_HEADS, HEAD_DIM, device="cuda", generator=gen).half()
        out = attend(q, cache, backend="flashinfer")
        worst = max(worst, (out - attend(q, cache, backend="dense")).abs().max().item())
    pt = cache.page_table()
    print(f"{args.seqs} sequences x {args.prompt} + {args.steps} tokens; last page table: "
          f"{int(pt.kv_indptr[-1])} pages")
    print(f"flashinfer vs dense attention: max |diff| {worst:.2e}")
    ok = worst < 1e-2
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
