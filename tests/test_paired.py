"""PairedCache (issue 34 item 3): MLA latent rows + lightning-indexer keys on one cell layout
(llama.cpp's llama_kv_cache_dsa): random sequence operations keep both halves paired (identical
cell tables, every (sequence, position) with its own row in both), refusals change nothing in
either, snapshots / state files / the prefix store carry both halves bit-exactly."""

import numpy as np
import pytest

import numbakv as nkv
from numbakv.errors import KVCacheError, KVCacheFullError, NotSupportedError

from helpers import host, same, seq_rows

RANK, ROPE, IDX = 64, 32, 32


def pair(device="cpu", capacity=24, max_seqs=3, **kw):
    main = nkv.CacheConfig(n_layers=2, n_kv_heads=1, head_dim=RANK + ROPE, v_head_dim=0,
                           capacity=capacity, max_seqs=max_seqs, max_batch=8, device=device, **kw)
    idx = main.replace(head_dim=IDX, k_dtype=None)
    return nkv.PairedCache(main, idx, shift=nkv.RopeShift(dim=ROPE, offset=RANK),
                           indexer_shift=nkv.RopeShift(dim=16, offset=IDX - 16))


def token_rows(seq, pos, layer):
    """Deterministic rows of (seq, pos, layer): the main row and the indexer row, each filled
    with a code of the token so a mismatched pair is visible. The rope dims hold zeros, so a
    re-rotation leaves them zero and the code survives any shift."""
    code = np.float16(seq * 100 + pos + layer / 4)
    m = np.zeros((1, RANK + ROPE), np.float16)
    m[0, :RANK] = code
    i = np.zeros((1, IDX), np.float16)
    i[0, :IDX - 16] = code
    return m, i


def forward(p, seqs_pos):
    pos = np.array([q for _, q in seqs_pos], np.int32)
    sq = np.array([s for s, _ in seqs_pos], np.int32)
    p.start_forward(pos, sq)
    for layer in range(2):
        p.set_layer(layer)
        rows = [token_rows(s, q, layer) for s, q in seqs_pos]
        p.put(np.stack([m for m, _ in rows]), None)
        p.put_indexer(np.stack([i for _, i in rows]))


def check(p, model):
    """Both halves hold, for every sequence, exactly the model's positions; each cell's main and
    indexer rows are the same token's (their codes agree)."""
    p.check_paired()
    for seq in range(p.main.config.max_seqs):
        pm, km, _ = seq_rows(p.main, seq)
        pi, ki, _ = seq_rows(p.indexer, seq)
        assert pm.tolist() == pi.tolist() == sorted(model[seq]), (seq, pm, model[seq])
        codes_m = km[..., :RANK].astype(np.float32)
        codes_i = ki[..., :IDX - 16].astype(np.float32)
        assert np.array_equal(codes_m[..., :1], codes_i[..., :1])
        # each row still is the token it was put as (codes name the original position)
        for k, p_now in enumerate(pm):
            orig = model[seq][p_now]
            assert np.allclose(codes_m[:, k, 0, 0], [np.float16(o) for o in
                                                     (orig + layer / 4 for layer in range(2))])


def test_random_operations_keep_the_halves_paired():
    rng = np.random.default_rng(0)
    p = pair(capacity=10)                    # 30 cells: batches that do not fit are refused
    model = {s: {} for s in range(3)}        # seq -> {current position: code of its token}
    done = {"forward": 0, "remove": 0, "refused": 0, "copy": 0}
    for step in range(120):
        op = rng.integers(0, 8)
        s = int(rng.integers(0, 3))
        before = (p.main.state_bytes(), p.indexer.state_bytes())
        try:
            if op <= 2:                      # a forward pass of 1-4 tokens at the end
                n = int(rng.integers(1, 5))
                end = max(model[s]) + 1 if model[s] else 0
                forward(p, [(s, end + k) for k in range(n)])
                for k in range(n):
                    model[s][end + k] = s * 100 + end + k
                done["forward"] += 1
            elif op == 3 and model[s]:       # remove a middle range (context shift)
                lo = int(rng.integers(0, max(model[s]) + 1))
                hi = lo + int(rng.integers(1, 4))
                p.remove(s, lo, hi)
                moved = {}
                for q, c in model[s].items():
                    if q < lo:
                        moved[q] = c
                    elif q >= hi:
                        moved[q - (hi - lo)] = c
                model[s] = moved
                done["remove"] += 1
            elif op == 4:
                d = (s + 1) % 3
                if model[s] and not model[d]:
                    p.seq_cp(s, d)
                    model[d] = dict(model[s])
                    done["copy"] += 1
                else:
                    p.seq_rm(d)
                    model[d] = {}
            elif op == 5:
                p.defrag()
            elif op == 6 and model[s]:       # re-putting a held position: refused
                forward(p, [(s, max(model[s]) + 1), (s, min(model[s]))])
                raise AssertionError("a held position was accepted")
            else:
                p.seq_rm(s)
                model[s] = {}
        except (KVCacheFullError, NotSupportedError, ValueError, KVCacheError):
            # a refusal changes nothing in either half
            assert (p.main.state_bytes(), p.indexer.state_bytes()) == before
            done["refused"] += 1
        check(p, model)
    assert min(done.values()) >= 3, done       # every kind of step happened
    # snapshots and state files carry both halves
    s = max(model, key=lambda k: len(model[k]))
    snap = nkv.SeqSnapshot.from_bytes(p.export_seq(s).to_bytes())
    q = pair(capacity=10)
    q.import_seq(0, snap)
    for half in ("main", "indexer"):
        a, b = seq_rows(getattr(p, half), s), seq_rows(getattr(q, half), 0)
        assert same(a[0], b[0]) and same(a[1], b[1])
    r = pair(capacity=10)
    r.load_state_bytes(p.state_bytes())
    r.check_paired()
    assert same(host(r.main.storage.keys), host(p.main.storage.keys))
    assert same(host(r.indexer.storage.keys), host(p.indexer.storage.keys))


def test_prefix_store_entries_hold_both_halves():
    p = pair()
    forward(p, [(0, k) for k in range(6)])
    store = nkv.PrefixStore(p, retain_seqs=(2,), block_tokens=2, host_bytes=1 << 20)
    tokens = list(range(50, 56))
    store.save(0, tokens)
    p.seq_rm(0)
    assert store.load(1, tokens) == 6
    p.check_paired()
    pm, km, _ = seq_rows(p.main, 1)
    pi, ki, _ = seq_rows(p.indexer, 1)
    assert pm.tolist() == pi.tolist() == list(range(6))
    assert np.array_equal(km[..., 0], ki[..., 0])
    store.close()


def test_pair_refusals():
    main = nkv.CacheConfig(2, 1, 96, v_head_dim=0, capacity=16, device="cpu")
    with pytest.raises(ValueError, match="capacity"):
        nkv.PairedCache(main, main.replace(head_dim=32, capacity=8))
    with pytest.raises(ValueError, match="V-less"):
        nkv.PairedCache(main, main.replace(head_dim=32, v_head_dim=32))
    with pytest.raises(ValueError, match="both or neither"):
        nkv.PairedCache(main, main.replace(head_dim=32), shift=nkv.RopeShift(dim=32, offset=64))
    p = nkv.PairedCache(main, main.replace(head_dim=32))
    with pytest.raises(KVCacheError):
        p.set_layer_type(1)
