"""Decode two sequences with JAX doing the math and numbakv holding the KV cache.

JAX computes queries, keys and values (with rotary embeddings) and the attention; the keys and
values go into the cache with ``cache.put(array, array)`` (DLPack in) and attention reads
``jnp.from_dlpack`` of ``cache.get()``'s views (DLPack out). On a GPU those are the cache's own
buffers; on the CPU XLA takes a buffer without a copy only when it is 64-byte aligned, so the
script reports, per step, whether the keys and values JAX attended over were the cache's memory.
Each step's output is checked against plain JAX attention over each sequence's own keys and
values, kept without any cache.

    pip install 'numbakv[jax]'      # needs JAX (the extra installs it)
    python examples/jax_decode.py [--device auto|cpu|cuda] [--steps N]
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # an optional dependency: say which one and how to get it
    _NEED = (f"examples/jax_decode.py needs JAX, which did not import "
             f"({exc}): pip install 'numbakv[jax]'")
    if __name__ == "__main__":
        sys.exit(_NEED)
    raise ImportError(_NEED) from exc

import numpy as np

import numbakv as nkv

N_HEADS, N_KV_HEADS, HEAD_DIM, D_MODEL, VOCAB = 4, 2, 16, 64, 100


def address(array) -> int:
    """Where a numpy or CuPy array's data starts."""
    if hasattr(array, "__cuda_array_interface__"):
        return array.__cuda_array_interface__["data"][0]
    return array.__array_interface__["data"][0]


@jax.jit
def rope(x, positions, base: float = 10000.0):
    """NeoX rotary embedding of ``x`` ``[tokens, heads, head_dim]`` at ``positions``."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    angle = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


@jax.jit
def project(embed, wq, wk, wv, tokens, positions):
    """Roped queries ``[t, H, d]``, roped keys and values ``[t, KVH, d]`` of ``tokens``."""
    x = embed[tokens]
    q = rope((x @ wq).reshape(-1, N_HEADS, HEAD_DIM), positions)
    k = rope((x @ wk).reshape(-1, N_KV_HEADS, HEAD_DIM), positions)
    return q, k, (x @ wv).reshape(-1, N_KV_HEADS, HEAD_DIM)


@jax.jit
def attend(q, k, v, mask):
    """Grouped-query attention: q ``[t, H, d]``, k/v ``[n, KVH, d]``, additive mask ``[t, n]``."""
    group = N_HEADS // N_KV_HEADS
    k = jnp.repeat(k, group, axis=1)
    v = jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("thd,nhd->htn", q, k) / jnp.sqrt(jnp.float32(HEAD_DIM)) + mask[None]
    return jnp.einsum("htn,nhd->thd", jax.nn.softmax(scores, axis=-1), v)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=8, help="decode steps (default 8)")
    args = parser.parse_args(argv)

    cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, dtype="float32",
                          capacity=64, max_seqs=2, max_batch=16, device=args.device)
    cache = nkv.CausalCache(cfg, shift=nkv.RopeShift(neox=True))
    on_gpu = cache.device == "cuda"
    if on_gpu and jax.default_backend() != "gpu":
        print("the cache is on the GPU but JAX has no GPU backend: use --device cpu")
        return 1
    dev = jax.devices()[0] if on_gpu else jax.devices("cpu")[0]

    def on_dev(x):
        # committed to the cache's device: jit then computes there (an array made under
        # jax.default_device alone is uncommitted, and jit may run on the GPU anyway)
        return jax.device_put(x, dev)

    rng = np.random.default_rng(0)
    embed = on_dev(rng.standard_normal((VOCAB, D_MODEL), np.float32))
    wq, wk, wv = (on_dev(rng.standard_normal((D_MODEL, h * HEAD_DIM), np.float32)
                         / D_MODEL ** 0.5) for h in (N_HEADS, N_KV_HEADS, N_KV_HEADS))

    prompts = {0: [5, 17, 42, 8, 99], 1: [3, 3, 71]}
    # cache-free keys and values per sequence (host copies, padded to the capacity so that XLA
    # compiles the reference attention once)
    history = {s: (np.zeros((cfg.capacity, N_KV_HEADS, HEAD_DIM), np.float32),
                   np.zeros((cfg.capacity, N_KV_HEADS, HEAD_DIM), np.float32)) for s in prompts}
    lengths = {s: 0 for s in prompts}
    batch_tokens = [(s, t) for s, p in prompts.items() for t in p]
    max_err, shared_steps = 0.0, 0
    for step in range(args.steps + 1):
        seqs = [s for s, _ in batch_tokens]
        positions = []
        for s in seqs:
            positions.append(lengths[s])
            lengths[s] += 1
        tokens = on_dev(np.asarray([t for _, t in batch_tokens], np.int32))
        pos = on_dev(np.asarray(positions, np.int32))
        q, k, v = project(embed, wq, wk, wv, tokens, pos)

        cache.start_forward(positions, seqs)
        cache.set_layer(0)
        cache.put(k, v)                                    # JAX arrays in, through DLPack
        key, value, mask = cache.get()
        keys, values = jnp.from_dlpack(key), jnp.from_dlpack(value)
        masks = jnp.from_dlpack(mask)[:len(positions)]
        shared_steps += int(keys.unsafe_buffer_pointer() == address(key)
                            and values.unsafe_buffer_pointer() == address(value))
        out = attend(q, keys, values, masks)

        host_k, host_v = np.asarray(k), np.asarray(v)
        for i, s in enumerate(seqs):
            history[s][0][positions[i]] = host_k[i]
            history[s][1][positions[i]] = host_v[i]
        for i, s in enumerate(seqs):
            visible = np.where(np.arange(cfg.capacity) <= positions[i], 0.0, -np.inf)
            expect = attend(q[i:i + 1], on_dev(history[s][0]), on_dev(history[s][1]),
                            on_dev(visible[None].astype(np.float32)))
            max_err = max(max_err, float(jnp.abs(out[i:i + 1] - expect).max()))

        # greedy next token per sequence from a toy readout of its last row
        best = jnp.argmax(out.reshape(len(seqs), -1)[:, :D_MODEL] @ embed.T, axis=-1).tolist()
        last = {s: i for i, s in enumerate(seqs)}
        batch_tokens = [(s, best[i]) for s, i in sorted(last.items())]

    cache.close()
    ok = max_err < 1e-4
    print(f"jax {jax.__version__} on {dev.platform}, numbakv cache on {cache.device}: decoded "
          f"{args.steps} steps for 2 sequences (lengths {lengths[0]} and {lengths[1]})")
    print(f"attention on get()'s views vs. cache-free attention: max |diff| {max_err:.2e}")
    print(f"steps where JAX attended over the cache's own K/V memory (zero-copy): "
          f"{shared_steps} of {args.steps + 1}")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
