"""numbakv on PyTorch's stream: the stream contract, and the side-stream race it prevents.

An engine runs its model on its own CUDA stream (a torch side stream, or a stream a CUDA graph
is captured on). The cache must queue its work on that stream too, so that

- ``put`` reads the keys and values before torch's caching allocator can reuse their memory
  (numbakv also keeps them referenced until an event on the stream has passed);
- attention reads a mask / page table before the cache recycles it;
- nothing synchronises implicitly, so the steps can be captured in a CUDA graph.

The rules (see ``CausalCache.use_stream``):

1. ``cache.use_stream(torch.cuda.current_stream())`` inside ``with torch.cuda.stream(s):``
   (any CuPy stream or raw ``cudaStream_t`` int works as well).
2. Consume ``get()``'s views on that stream, or make your stream wait for it.
3. Host inputs (positions, slots, masks' inputs) travel through pinned buffers, asynchronously.

The script is the race repro: the NULL stream is kept busy, K/V are produced on a side stream,
``put``, freed and their memory immediately reused by new tensors full of garbage; reading back
must still give the original K/V. Without a GPU it runs the same steps on the CPU.

    python examples/torch_stream.py [--device auto|cpu|cuda] [--steps N]
"""

from __future__ import annotations

import argparse
import sys

try:
    import torch
except ImportError as exc:  # an optional dependency: say which one and how to get it
    _NEED = (f"examples/torch_stream.py needs PyTorch, which did not import "
             f"({exc}): pip install 'numbakv[torch]'")
    if __name__ == "__main__":
        sys.exit(_NEED)
    raise ImportError(_NEED) from exc

import numbakv as nkv

N_LAYERS, N_KV_HEADS, HEAD_DIM = 2, 2, 64


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    cfg = nkv.CacheConfig(N_LAYERS, N_KV_HEADS, HEAD_DIM, dtype="float16", capacity=256,
                          max_batch=64, device=args.device)
    cache = nkv.CausalCache(cfg)
    on_gpu = cache.device == "cuda"
    tdev = "cuda" if on_gpu else "cpu"
    side = torch.cuda.Stream() if on_gpu else None
    ctx = torch.cuda.stream(side) if on_gpu else _null()
    expected = {}
    next_pos = 0
    gen = torch.Generator(device=tdev).manual_seed(0)
    with ctx:
        if on_gpu:
            cache.use_stream(torch.cuda.current_stream())   # rule 1: the engine's stream
            busy = torch.randn(4096, 4096, device="cuda")
        for step in range(args.steps):
            if on_gpu:  # keep the NULL stream busy so an unordered read would come late
                with torch.cuda.stream(torch.cuda.default_stream()):
                    busy = busy @ busy / 4096
            batch = 1 if step else 16
            positions = list(range(next_pos, next_pos + batch))
            next_pos += batch
            cache.start_forward(positions, [0] * batch)
            for layer in range(N_LAYERS):
                cache.set_layer(layer)
                k = torch.randn(batch, N_KV_HEADS, HEAD_DIM, device=tdev, generator=gen,
                                dtype=torch.float16)
                v = torch.randn_like(k)
                expected.setdefault(layer, []).append((k.cpu(), v.cpu()))
                cache.put(k, v)
                del k, v                      # the allocator may hand this memory out now...
                junk = torch.full((batch, N_KV_HEADS, HEAD_DIM), float("nan"), device=tdev,
                                  dtype=torch.float16)   # ...and here it does
                del junk
            for layer in range(N_LAYERS):     # rule 2: consumed on the same stream
                cache.set_layer(layer)
                key, value, mask = cache.get()
                kt, vt = torch.from_dlpack(key), torch.from_dlpack(value)
                want_k = torch.cat([k for k, _ in expected[layer]])
                want_v = torch.cat([v for _, v in expected[layer]])
                n = want_k.shape[0]
                if not (torch.equal(kt[:n].cpu(), want_k) and torch.equal(vt[:n].cpu(), want_v)):
                    print(f"step {step} layer {layer}: stored K/V differ from what was put")
                    return 1
    print(f"ok: {args.steps} steps on {cache.device}"
          + (" (side stream, NULL stream busy, freed inputs reused)" if on_gpu else
             " (no GPU: the stream contract is not exercised)"))
    return 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
