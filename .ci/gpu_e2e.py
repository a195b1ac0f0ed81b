"""A 262,144-cell bfloat16 cache end to end on a GPU (the standing order's item; run by .ci/gpu).

Fills 8 sequences of 32,768 tokens by chunked prefill, decodes, shifts (remove with re-rotation),
defrags, attends, saves/loads a sequence, exports/imports a snapshot, and checks each result
against a torch reference of the same rows. Prints one line per step with its time."""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

import numbakv as nkv
from numbakv.attention import attend

LAYERS, KV_HEADS, DIM, SEQS, CAP = 2, 8, 128, 8, 32768
CHUNK = 4096


def timed(label, fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    print(f"{label:<34} {1e3 * (time.perf_counter() - t):9.2f} ms", flush=True)
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU: nothing to do")
        return 0
    cfg = nkv.CacheConfig(LAYERS, KV_HEADS, DIM, dtype="bfloat16", capacity=CAP, max_seqs=SEQS,
                          max_batch=CHUNK, device="cuda")
    cache = nkv.CausalCache(cfg, shift=nkv.RopeShift(base=10000.0, neox=True))
    assert cache.n_cells == SEQS * CAP == 262_144, cache.n_cells
    print(f"cache: {cache.n_cells} cells, {cache.storage.nbytes / 2**30:.2f} GiB", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    # keep one layer-0 copy of sequence 0's keys as the reference
    ref_k = []

    def prefill():
        for s in range(SEQS):
            for p0 in range(0, CAP, CHUNK):
                pos = np.arange(p0, p0 + CHUNK, dtype=np.int32)
                cache.start_forward(pos, np.full(CHUNK, s, dtype=np.int32))
                for layer in range(LAYERS):
                    cache.set_layer(layer)
                    k = torch.randn(CHUNK, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16,
                                    generator=gen)
                    cache.put(k, k)
                    if s == 0 and layer == 0:
                        ref_k.append(k.clone())
    timed("prefill 8 x 32768 (chunks of 4096)", prefill)
    assert cache.n_used == 262_144

    # free room for decodes: drop the last 64 positions of every sequence
    for s in range(SEQS):
        cache.seq_rm(s, CAP - 64, None)

    def decode(steps=32):
        for t in range(steps):
            pos = np.full(SEQS, CAP - 64 + t, dtype=np.int32)
            cache.start_forward(pos, np.arange(SEQS, dtype=np.int32))
            for layer in range(LAYERS):
                cache.set_layer(layer)
                k = torch.randn(SEQS, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16,
                                generator=gen)
                cache.put(k, k)
                q = torch.randn(SEQS, 4 * KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16,
                                generator=gen)
                out = attend(q, cache)
                assert out.shape == (SEQS, 4 * KV_HEADS, DIM) and torch.isfinite(out).all()
    timed("decode 32 steps x 8 seqs + attend", decode)

    # the stored rows of sequence 0, layer 0 equal what was put
    cache.start_forward(np.array([CAP - 32], dtype=np.int32), np.array([0], dtype=np.int32))
    cache.set_layer(0)
    key, _, mask = cache.get()
    k0 = torch.from_dlpack(key)
    got = k0[: CAP - 64]
    want = torch.cat(ref_k)[: CAP - 64]
    assert torch.equal(got, want), "stored keys differ from the keys put"
    print("stored rows of seq 0 equal the keys put: ok", flush=True)
    cache.seq_rm(0, CAP - 32, None)

    timed("context shift: remove(1, 100, 4196)", lambda: cache.remove(1, 100, 4196))
    timed("defrag", cache.defrag)
    data = timed("state_bytes(seq=2)", lambda: cache.state_bytes(seq=2))
    print(f"  {len(data) / 2**20:.1f} MiB", flush=True)
    seq2 = cache.export_seq(2).to_bytes()
    snap = timed("export_seq(3)", lambda: cache.export_seq(3))
    seq3 = snap.to_bytes()
    cache.seq_rm(3)
    n = timed("import_seq(3)", lambda: cache.import_seq(3, snap))
    print(f"  {n} tokens, {snap.nbytes / 2**20:.1f} MiB", flush=True)
    assert cache.export_seq(3).to_bytes() == seq3, "seq 3 differs after export/import"
    cache.seq_rm(2)
    timed("load_state_bytes(seq=2)", lambda: cache.load_state_bytes(data, seq=2))
    assert cache.export_seq(2).to_bytes() == seq2, "seq 2 differs after save/load"
    print("seq 3 after export/import and seq 2 after save/load: bit-identical", flush=True)
    print("262,144-cell bfloat16 cache end to end: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
