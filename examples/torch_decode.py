"""Decode two sequences with PyTorch doing the math and numbakv holding the KV cache.

PyTorch computes queries, keys and values (with rotary embeddings); the keys and values go into
the cache with ``cache.put(tensor, tensor)`` (DLPack in) and ``numbakv.attention.attend(q,
cache)`` computes the attention, each sequence over its own cells only (``cache.page_table()``),
reading ``cache.layer_pool()``'s DLPack views: the tensors PyTorch attends over are the cache's
own storage, not copies. Each step's attention output is checked against plain PyTorch attention
over each sequence's own keys and values, kept without any cache.

    python examples/torch_decode.py [--device auto|cpu|cuda] [--steps N]
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

try:
    import torch
except ImportError as exc:  # an optional dependency: say which one and how to get it
    _NEED = (f"examples/torch_decode.py needs PyTorch, which did not import "
             f"({exc}): pip install 'numbakv[torch]'")
    if __name__ == "__main__":
        sys.exit(_NEED)
    raise ImportError(_NEED) from exc

import numbakv as nkv
from numbakv.attention import attend

N_HEADS, N_KV_HEADS, HEAD_DIM, D_MODEL, VOCAB = 4, 2, 16, 64, 100


def address(array) -> int:
    """Where a numpy or CuPy array's data starts."""
    if hasattr(array, "__cuda_array_interface__"):
        return array.__cuda_array_interface__["data"][0]
    return array.__array_interface__["data"][0]


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """NeoX rotary embedding of ``x`` ``[tokens, heads, head_dim]`` at ``positions``."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) * 2 / x.shape[-1])
    angle = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: q ``[t, H, d]``, k/v ``[n, KVH, d]``, additive mask ``[t, n]``."""
    group = N_HEADS // N_KV_HEADS
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)       # [H, n, d]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v,
                                                           attn_mask=mask)
    return out.transpose(0, 1)                                   # [t, H, d]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=8, help="decode steps (default 8)")
    args = parser.parse_args(argv)

    cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, dtype="float32",
                          capacity=64, max_seqs=2, max_batch=16, device=args.device)
    cache = nkv.CausalCache(cfg, shift=nkv.RopeShift(neox=True))
    dev = "cuda" if cache.device == "cuda" else "cpu"
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(VOCAB, D_MODEL, generator=gen).to(dev)
    wq, wk, wv = (torch.randn(D_MODEL, h * HEAD_DIM, generator=gen).to(dev) / D_MODEL ** 0.5
                  for h in (N_HEADS, N_KV_HEADS, N_KV_HEADS))

    prompts = {0: [5, 17, 42, 8, 99], 1: [3, 3, 71]}
    history = {s: ([], []) for s in prompts}          # cache-free keys and values per sequence
    lengths = {s: 0 for s in prompts}
    batch_tokens = [(s, t) for s, p in prompts.items() for t in p]   # the prefill batch
    max_err, zero_copy = 0.0, True
    for step in range(args.steps + 1):
        seqs = [s for s, _ in batch_tokens]
        positions = []
        for s in seqs:
            positions.append(lengths[s])
            lengths[s] += 1
        tokens = torch.tensor([t for _, t in batch_tokens], device=dev)
        pos = torch.tensor(positions, device=dev)

        x = embed[tokens]
        q = rope((x @ wq).view(-1, N_HEADS, HEAD_DIM), pos)
        k = rope((x @ wk).view(-1, N_KV_HEADS, HEAD_DIM), pos)
        v = (x @ wv).view(-1, N_KV_HEADS, HEAD_DIM)

        cache.start_forward(positions, seqs)
        cache.set_layer(0)
        cache.put(k, v)                                   # torch tensors in, through DLPack
        key, value = cache.layer_pool()                   # every cell of the layer
        keys, values = torch.from_dlpack(key), torch.from_dlpack(value)
        # no copy: the tensors PyTorch attends over start where the cache's storage starts
        zero_copy &= keys.data_ptr() == address(key) and values.data_ptr() == address(value)
        out = attend(q, cache)                            # [batch, H, d], batch order

        # the same attention without the cache: each sequence over its own history
        for i, s in enumerate(seqs):
            history[s][0].append(k[i])
            history[s][1].append(v[i])
        for i, s in enumerate(seqs):
            n_visible = positions[i] + 1
            hk = torch.stack(history[s][0][:n_visible])
            hv = torch.stack(history[s][1][:n_visible])
            no_mask = torch.zeros(1, n_visible, device=dev)
            expect = sdpa_gqa(q[i:i + 1], hk, hv, no_mask)
            max_err = max(max_err, (out[i:i + 1] - expect).abs().max().item())

        # greedy next token per sequence from a toy readout of its last row
        logits = out.reshape(len(seqs), -1)[:, :D_MODEL] @ embed.T
        last = {s: i for i, s in enumerate(seqs)}
        batch_tokens = [(s, int(logits[i].argmax())) for s, i in sorted(last.items())]

    cache.close()
    ok = max_err < 1e-4 and zero_copy
    print(f"torch {torch.__version__} on {dev}, numbakv cache on {cache.device}: decoded "
          f"{args.steps} steps for 2 sequences (lengths {lengths[0]} and {lengths[1]})")
    print(f"numbakv.attention.attend vs. cache-free attention: max |diff| {max_err:.2e}")
    print(f"zero-copy (torch data_ptr == the cache's view address): {zero_copy}")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
