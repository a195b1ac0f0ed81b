"""Per-sequence streams (``CacheConfig(unified=False)``): sizing, the stream layout of ``get()``,
placement and refusals per stream, copies between streams, state, and a random workload run in
lockstep with a unified cache whose attention it must reproduce token for token."""

import numpy as np
import pytest

import numbakv as nkv
from numbakv import KVCacheFullError, NotSupportedError
from numbakv.streams import StreamCache, group_batch

from helpers import dev, host, shares_memory

try:
    import torch
    from numbakv.attention import attend
except ImportError:  # pragma: no cover - torch is optional
    torch = None

H, D = 2, 8


def stream_cfg(device="cpu", **kw):
    base = dict(dtype="float32", capacity=16, max_seqs=3, max_batch=8, device=device,
                unified=False)
    base.update(kw)
    return nkv.CacheConfig(2, H, D, **base)


def kv(rng, n, dim=D):
    return rng.standard_normal((n, H, dim)).astype(np.float32)


# ------------------------------------------------------------------------------------- sizing
def test_sizing_and_memory_accounting():
    cfg = stream_cfg(capacity=10, cache_padding=4)
    assert cfg.n_streams == 3 and cfg.cells_per_stream() == 12 and cfg.n_cells() == 36
    assert cfg.nbytes() == 36 * 2 * H * (D + D) * 4
    c = nkv.CausalCache(cfg)
    assert isinstance(c, StreamCache) and isinstance(c, nkv.CausalCache)
    assert c.cells_per_stream == 12 and c.n_cells == 36
    assert c.storage.keys.shape == (2, 36, H, D)
    # sliding window: each stream holds its own window memory plus one batch (llama.cpp), the
    # memory following the unified cache's rule for several sequences (>= window + 1)
    w = nkv.CausalCache(stream_cfg(capacity=64), swa_window=4)
    assert w.cells_per_stream == 5 + 8 and w.n_cells == 3 * 13
    assert w.swa_memory == 5
    one = nkv.CausalCache(stream_cfg(capacity=64, max_seqs=1), swa_window=4)
    assert one.swa_memory == 4 and one.cells_per_stream == 4 + 8
    assert nkv.CacheConfig(1, 1, 8, unified=True).n_streams == 1
    with pytest.raises(ValueError, match="unified must be a bool"):
        nkv.CacheConfig(1, 1, 8, unified="no")


def test_group_batch_matches_page_table_grouping():
    ids, qo, order = group_batch(np.array([4, 1, 4, 2, 1, 4]))
    assert ids.tolist() == [4, 1, 2]
    assert qo.tolist() == [0, 3, 5, 6]
    assert order.tolist() == [0, 2, 5, 1, 4, 3]
    assert ids.dtype == qo.dtype == order.dtype == np.int32


# ------------------------------------------------------------------------------------- layout
@pytest.mark.parametrize("permuted", [False, True])
def test_get_layout_views_and_gathers(device, permuted):
    rng = np.random.default_rng(0)
    c = nkv.CausalCache(stream_cfg(device, permuted_v=permuted, max_seqs=4))
    pos = [0, 1, 2, 0, 1, 0]
    seqs = [1, 1, 1, 2, 2, 3]
    c.start_forward(pos, seqs)
    k, v = kv(rng, 6), kv(rng, 6)
    c.set_layer(1)
    c.put(dev(k, device), dev(v, device))
    key, value, mask = c.get()
    assert key.shape == (3, 3, H, D)
    assert value.shape == ((3, H, D, 3) if permuted else (3, 3, H, D))
    assert mask.shape == (3, 3, 3)
    # consecutive ascending sequences: zero-copy views of the pool
    assert shares_memory(key, c.storage.keys)
    vals = host(value).transpose(0, 3, 1, 2) if permuted else host(value)
    for b, (lo, n) in enumerate([(0, 3), (3, 2), (5, 1)]):
        np.testing.assert_array_equal(host(key)[b, :n], k[lo:lo + n])
        np.testing.assert_array_equal(vals[b, :n], v[lo:lo + n])
    m = host(mask)
    assert np.array_equal(m[0] == 0, np.tril(np.ones((3, 3), bool)))
    assert np.isneginf(m[1, 2]).all() and np.isneginf(m[2, 1:]).all()
    assert m[2, 0, 0] == 0 and np.isneginf(m[2, 0, 1:]).all()
    # sequences out of order: gathered rows, same content, stream order = first appearance
    c.start_forward([3, 2], [1, 3])
    c.set_layer(1)
    k2 = kv(rng, 2)
    c.put(dev(k2, device), dev(k2, device))
    key, value, mask = c.get()
    assert not shares_memory(key, c.storage.keys)
    np.testing.assert_array_equal(host(key)[0, 3], k2[0])
    np.testing.assert_array_equal(host(key)[1, :1], k[5:6])
    np.testing.assert_array_equal(host(key)[1, 1], k2[1])
    assert mask.shape == (2, 1, 4)


def test_bfloat16_streams_export_as_bfloat16():
    torch = pytest.importorskip("torch")
    c = nkv.CausalCache(stream_cfg(dtype="bfloat16"))
    c.start_forward([0, 0], [0, 1])
    c.set_layer(0)
    x = torch.randn(2, H, D, dtype=torch.bfloat16)
    c.put(x, x)
    key, _, _ = c.get()
    t = torch.from_dlpack(key)
    assert t.dtype == torch.bfloat16 and t.shape == (2, 1, H, D)
    assert torch.equal(t[:, 0], x)


# ------------------------------------------------------------------------------------- placement
def test_full_stream_names_the_stream_and_changes_nothing():
    c = nkv.CausalCache(stream_cfg(capacity=4, max_batch=4))
    c.start_forward([0, 1, 2, 0], [0, 0, 0, 1])
    before = [s.cells.cells for s in c.streams]
    with pytest.raises(KVCacheFullError, match="stream 0"):
        c.start_forward([0, 1, 3, 4], [2, 2, 0, 0])   # stream 2 fits, stream 0 does not
    for s, b in zip(c.streams, before):
        np.testing.assert_array_equal(s.cells.cells, b)
    assert c.seq_pos_max(2) == -1
    c.start_forward([3], [0])                           # exactly fills stream 0
    assert c.seq_pos_max(0) == 3


def test_sequence_ids_are_checked():
    c = nkv.CausalCache(stream_cfg())
    with pytest.raises(ValueError, match="seqs"):
        c.start_forward([0], [3])
    for call in (lambda: c.seq_pos_max(3), lambda: c.remove(-1, 0),
                 lambda: c.copy_prefix(0, 5, 1), lambda: c.can_resume(7, 0)):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(ValueError, match="reserve"):
        c.start_forward([0], [0], reserve="False")


def test_reserve_pass_sizes_the_worst_case():
    c = nkv.CausalCache(stream_cfg())
    c.start_forward([0, 1, 2], [0, 1, 1], reserve=True)
    c.set_layer(0)
    z = np.zeros((3, H, D), np.float32)
    c.put(z, z)
    key, _, mask = c.get()
    assert key.shape == (2, 16, H, D) and mask.shape == (2, 2, 16)
    assert (np.asarray(mask) == 0).all()
    assert c.n_used == 0


# ------------------------------------------------------------------------------------- copies
def test_copy_prefix_copies_only_the_prefix_and_forks_are_independent(device):
    rng = np.random.default_rng(1)
    c = nkv.CausalCache(stream_cfg(device), shift=nkv.RopeShift())
    c.start_forward(list(range(5)), [0] * 5)
    ks = []
    for layer in range(2):
        c.set_layer(layer)
        k = kv(rng, 5)
        ks.append(k)
        c.put(dev(k, device), dev(k, device))
    c.copy_prefix(0, 2, 3)
    assert (c.seq_pos_min(2), c.seq_pos_max(2)) == (0, 2)
    assert c.streams[2].n_used == 3                      # only what was copied
    c.start_forward([3], [2])
    for layer in range(2):
        c.set_layer(layer)
        c.put(dev(kv(rng, 1), device), dev(kv(rng, 1), device))
        key, value, mask = c.get()
        np.testing.assert_array_equal(host(key)[0, :3], ks[layer][:3])
    # a fork owns its cells: shifting the source does not touch it (unlike shared cells)
    c.remove(0, 0, 1)
    assert c.seq_pos_max(0) == 3 and c.seq_pos_max(2) == 3
    c.start_forward([4], [2])
    c.set_layer(0)
    c.put(dev(kv(rng, 1), device), dev(kv(rng, 1), device))
    np.testing.assert_array_equal(host(c.get()[0])[0, :3], ks[0][:3])


def test_seq_cp_adds_ranges_and_refuses_overlaps():
    rng = np.random.default_rng(2)
    c = nkv.CausalCache(stream_cfg())
    c.start_forward([0, 1, 2, 3], [0] * 4)
    c.set_layer(0)
    k = kv(rng, 4)
    c.put(k, k)
    c.seq_cp(0, 1, 2, 4)
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (2, 3)
    with pytest.raises(ValueError, match="already holds"):
        c.seq_cp(0, 1, 0, 3)
    assert (c.seq_pos_min(1), c.seq_pos_max(1), c.streams[1].n_used) == (2, 3, 2)
    c.seq_cp(0, 1, 0, 2)
    assert c.streams[1].n_used == 4
    c.start_forward([4], [1])
    c.set_layer(0)
    c.put(k[:1], k[:1])
    key = np.asarray(c.get()[0])[0]
    pos = c.streams[1].cells.cells["pos"]
    for p in range(4):
        np.testing.assert_array_equal(key[int(np.nonzero(pos == p)[0][0])], k[p])
    c.seq_cp(1, 1)  # the same stream: nothing to copy


def test_sequence_operations_per_stream():
    c = nkv.CausalCache(stream_cfg(), shift=nkv.RopeShift())
    c.start_forward([0, 1, 2, 0, 1, 0], [0, 0, 0, 1, 1, 2])
    c.seq_add(0, 1, None, 3)
    assert c.seq_pos_max(0) == 5 and c.seq_pos_max(1) == 1
    c.seq_div(0, 4, None, 2)
    assert c.seq_pos_max(0) == 2
    c.seq_keep(1)
    assert [c.seq_pos_max(s) for s in range(3)] == [-1, 1, -1]
    c.seq_rm(-1)
    assert c.n_used == 0
    c.start_forward([0, 1], [2, 2])
    assert c.can_resume(2, 2) and c.seq_pos_min(2) == 0
    with pytest.raises(ValueError, match="put\\(\\) needs a forward pass"):
        c.remove(2, 1)
        c.put(np.zeros((2, H, D), np.float32), np.zeros((2, H, D), np.float32))


def test_remove_without_shift_names_the_sequence():
    c = nkv.CausalCache(stream_cfg())
    c.start_forward([0, 1, 2], [2, 2, 2])
    with pytest.raises(NotSupportedError, match="stream 2: .*sequence 2"):
        c.remove(2, 0, 1)


# ------------------------------------------------------------------------------------- state
def test_state_round_trips(tmp_path):
    rng = np.random.default_rng(3)
    c = nkv.CausalCache(stream_cfg())
    c.start_forward([0, 1, 2, 0, 1], [0, 0, 0, 2, 2])
    c.set_layer(1)
    k = kv(rng, 5)
    c.put(k, k)
    # one sequence: the same file a unified cache writes, so it loads into either kind
    one = c.state_bytes(2, tokens=[7, 8])
    unified = nkv.CausalCache(nkv.CacheConfig(2, H, D, dtype="float32", capacity=16, max_seqs=4,
                                              device="cpu"))
    assert unified.load_state_bytes(one, 3)["tokens"] == [7, 8]
    assert unified.seq_pos_max(3) == 1
    back = unified.state_bytes(3)
    c.load_state_bytes(back, 1)
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (0, 1)
    c.start_forward([2], [1])
    c.set_layer(1)
    c.put(k[:1], k[:1])
    np.testing.assert_array_equal(np.asarray(c.get()[0])[0, :2], k[3:5])
    # the whole cache
    path = tmp_path / "streams.safetensors"
    c.save_state(path)
    d = nkv.CausalCache(stream_cfg())
    d.load_state(path)
    assert [d.seq_pos_max(s) for s in range(3)] == [2, 2, 1]
    for a, b in zip(c.streams, d.streams):
        np.testing.assert_array_equal(a.cells.cells, b.cells.cells)
    np.testing.assert_array_equal(c.storage.keys, d.storage.keys)
    with pytest.raises(nkv.StateError):
        unified.load_state(path)             # a stream file is not a unified cache


# ------------------------------------------------------------------------------------- lockstep
def attention(key, value, mask_rows, q):
    """softmax(q.k + mask) v per head, float64: ``key [n, H, D]``, ``mask_rows [t, n]``."""
    scores = np.einsum("thd,nhd->thn", q, key) + mask_rows[:, None, :]
    scores -= scores.max(axis=-1, keepdims=True)
    w = np.exp(scores)
    w /= w.sum(axis=-1, keepdims=True)
    return np.einsum("thn,nhd->thd", w, value)


def unified_outputs(cache, q, batch):
    key, value, mask = (host(x).astype(np.float64) for x in cache.get())
    if cache.config.permuted_v:                      # [H, Dv, n] -> [n, H, Dv]
        value = value.transpose(2, 0, 1)
    return attention(key, value, mask[:batch], q)


def stream_outputs(cache, q, batch):
    key, value, mask = (host(x).astype(np.float64) for x in cache.get())
    if cache.config.permuted_v:                      # [n_b, H, Dv, n_kv] -> [n_b, n_kv, H, Dv]
        value = value.transpose(0, 3, 1, 2)
    fwd = cache._forward
    out = np.empty((batch, H, D))
    for b in range(len(fwd.seq_ids)):
        rows = fwd.token_order[fwd.qo_indptr[b]:fwd.qo_indptr[b + 1]]
        out[rows] = attention(key[b], value[b], mask[b, :len(rows)], q[rows])
    return out


@pytest.mark.parametrize("variant", ["plain", "window", "chunk-permuted"])
def test_random_workload_matches_unified_cache(device, variant):
    """Random batches, removals with re-rotation, forks, seq ops and defrags on a stream cache
    and a unified cache side by side: every token's attention output is the same."""
    rng = np.random.default_rng({"plain": 10, "window": 11, "chunk-permuted": 12}[variant])
    S, cap, batch_max = 3, 24, 6
    kw = dict(dtype="float32", capacity=cap, max_seqs=S, max_batch=batch_max, device=device,
              permuted_v=variant == "chunk-permuted", cache_padding=2)
    cache_kw = dict(shift=nkv.RopeShift(),
                    swa_window=3 if variant == "window" else None,
                    chunk_size=4 if variant == "chunk-permuted" else None)
    uni = nkv.CausalCache(nkv.CacheConfig(2, H, D, **kw), **cache_kw)
    st = nkv.CausalCache(nkv.CacheConfig(2, H, D, unified=False, **kw), **cache_kw)
    steps = 25 if device == "cpu" else 10
    checked = 0
    for _ in range(steps):
        op = rng.choice(["batch", "batch", "batch", "remove", "fork", "seqop", "defrag"])
        if op == "batch":
            seqs, pos = [], []
            for s in rng.choice(S, size=rng.integers(1, S + 1), replace=False):
                nxt = max(uni.seq_pos_max(int(s)), st.seq_pos_max(int(s))) + 1
                n = int(rng.integers(1, 3))
                if nxt + n > cap - batch_max or len(pos) + n > batch_max:
                    continue
                if nxt and not (uni.can_resume(int(s), nxt) and st.can_resume(int(s), nxt)):
                    continue  # rewound past what a window memory kept (the two sizes differ)
                seqs += [int(s)] * n
                pos += list(range(nxt, nxt + n))
            if not pos:
                continue
            uni.start_forward(pos, seqs)
            st.start_forward(pos, seqs)
            for layer in range(2):
                k, v, q = kv(rng, len(pos)), kv(rng, len(pos)), kv(rng, len(pos))
                for c in (uni, st):
                    c.set_layer(layer)
                    c.put(dev(k, device), dev(v, device))
                want = unified_outputs(uni, q, len(pos))
                np.testing.assert_allclose(stream_outputs(st, q, len(pos)), want,
                                           rtol=1e-5, atol=1e-5)
                if torch is not None:   # attend() over the stream page table, both backends
                    for backend in ("torch", "dense"):
                        tq = torch.from_numpy(q).to("cuda" if device == "cuda" else "cpu")
                        got = attend(tq, st, scale=1.0, backend=backend)
                        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-4,
                                                   atol=1e-5)
                checked += 1
        elif op == "remove":
            s = int(rng.integers(S))
            top = uni.seq_pos_max(s)
            if top < 2 or variant == "window" or uni.cells.shared_cells_in(s):
                continue  # the unified cache refuses to shift shared cells; streams own theirs
            b = int(rng.integers(0, top))
            for c in (uni, st):
                c.remove(s, b, b + 1)
        elif op == "fork":
            src, dst = (int(x) for x in rng.choice(S, 2, replace=False))
            n = int(rng.integers(0, uni.seq_pos_max(src) + 2))
            if variant == "window":
                continue
            for c in (uni, st):
                c.copy_prefix(src, dst, n)
        elif op == "seqop":
            s = int(rng.integers(S))
            p0 = int(rng.integers(0, 4))
            for c in (uni, st):
                c.seq_rm(s, p0, None)
        else:
            for c in (uni, st):
                c.defrag()
        for s in range(S):
            if variant != "window":
                assert uni.seq_pos_max(s) == st.seq_pos_max(s)
                assert uni.seq_pos_min(s) == st.seq_pos_min(s)
    assert checked > 0


def test_page_table_indexes_the_flattened_pool():
    from numbakv.pages import check_pages
    c = nkv.CausalCache(stream_cfg(max_seqs=4))
    c.start_forward([0, 1, 0, 2], [3, 3, 1, 3])
    pt = c.page_table()
    assert pt.seq_ids.tolist() == [3, 1]
    assert pt.token_order.tolist() == [0, 1, 3, 2]
    assert pt.qo_indptr.tolist() == [0, 3, 4]
    check_pages(pt, c.n_cells)
    cps = c.cells_per_stream
    assert (pt.kv_indices[:3] // cps == 3).all() and (pt.kv_indices[3:] // cps == 1).all()
    assert pt.kv_positions.tolist() == [0, 1, 2, 0]
    key, value = c.layer_pool(0)
    assert key.shape == (c.n_cells, H, D)
    assert np.shares_memory(np.asarray(key), c.storage.keys)


def test_wrapper_cache_over_stream_caches():
    """A WrapperCache of two stream caches (sliding-window layers beside full ones): batches,
    removals with re-rotation and a fork fan out to both, and a refusal in the second leaves
    the first as it was (its streams' undo logs)."""
    rng = np.random.default_rng(5)
    swa = nkv.CausalCache(stream_cfg(capacity=32, max_batch=4), shift=nkv.RopeShift(),
                          swa_window=3)
    full = nkv.CausalCache(stream_cfg(capacity=8, max_batch=4), shift=nkv.RopeShift())
    w = nkv.WrapperCache([swa, full], layer_groups=[0, 1, 0, 1])
    w.start_forward([0, 1, 2, 0], [0, 0, 0, 1])
    for layer in range(4):
        w.set_layer(layer)
        k = kv(rng, 4)
        w.put(k, k)
        key, _, mask = w.get()
        assert key.shape[0] == 2 and mask.shape[0] == 2
    w.copy_prefix(0, 2, 2)
    assert [w.seq_pos_max(s) for s in range(3)] == [2, 0, 1]
    w.remove(0, 0, 1)
    assert w.seq_pos_max(0) == 1
    w.start_forward([1, 2, 3, 4], [1] * 4)
    before = [s.cells.cells for c in (swa, full) for s in c.streams]
    with pytest.raises(KVCacheFullError, match="stream 1"):
        w.start_forward([5, 6, 7, 8], [1] * 4)   # fits the window group, not the full one
    after = [s.cells.cells for c in (swa, full) for s in c.streams]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert w.seq_pos_max(1) == 4


@pytest.mark.parametrize("permuted", [False, True])
def test_refused_fan_out_restores_the_copied_over_stream(monkeypatch, permuted):
    """copy_prefix / seq_cp across streams inside a WrapperCache whose second cache refuses:
    the first cache's cell tables and every K/V row are as they were, the rows the copy wrote
    over (the destination's old cells) included, and a fork that has to scatter (no free run
    long enough) never defrags."""
    rng = np.random.default_rng(8)
    first = nkv.CausalCache(stream_cfg(capacity=12, max_batch=9, permuted_v=permuted),
                            shift=nkv.RopeShift())
    second = nkv.CausalCache(stream_cfg(capacity=12, max_batch=9), shift=nkv.RopeShift())
    w = nkv.WrapperCache([first, second], layer_groups=[0, 1, 0, 1])
    w.start_forward(list(range(6)) + [0, 1, 2], [0] * 6 + [1] * 3)
    for layer in range(4):
        w.set_layer(layer)
        k = kv(rng, 9)
        w.put(k, -k)
    w.seq_rm(1, 1, 2)   # a hole in sequence 1's stream: the fork below cannot be contiguous

    def snapshot():
        return ([s.cells.cells.copy() for s in first.streams],
                [np.array(a, copy=True) for a in (first.storage.keys, first.storage.values)])

    def refuse(*args):
        raise RuntimeError("the second cache refuses")

    before = snapshot()
    monkeypatch.setattr(second, "copy_prefix", refuse)
    monkeypatch.setattr(second, "seq_cp", refuse)
    with pytest.raises(RuntimeError, match="refuses"):
        w.copy_prefix(0, 1, 5)          # replaces sequence 1: its old cells are written over
    with pytest.raises(RuntimeError, match="refuses"):
        w.seq_cp(0, 1, 3, 6)            # 3 cells into a stream with 2 cells used, one hole
    after = snapshot()
    for a, b in zip(before[0] + before[1], after[0] + after[1]):
        np.testing.assert_array_equal(a, b)
    assert [first.seq_pos_max(s) for s in range(3)] == [5, 2, -1]
    assert first.defrag_count == 0
    monkeypatch.undo()
    w.seq_cp(0, 1, 3, 6)                # accepted: positions 3..5 land around the hole
    assert w.seq_pos_max(1) == 5 and first.defrag_count == 0


def test_prompt_cache_forks_across_streams():
    """PromptCache's multi-user fork over a stream cache: copy_prefix copies the shared prefix's
    K/V into the new slot's stream, and only the rest of the prompt is evaluated."""
    rng = np.random.default_rng(6)
    c = nkv.CausalCache(stream_cfg(), shift=nkv.RopeShift())
    pc = nkv.PromptCache(c, multi_user=True, clock=iter(range(100)).__next__)
    slot, todo = pc.load([1, 2, 3, 4])
    assert list(todo) == [1, 2, 3, 4]
    c.start_forward(list(range(4)), [slot] * 4)
    c.set_layer(0)
    k = kv(rng, 4)
    c.put(k, k)
    pc.extend(slot, [1, 2, 3, 4])
    pc.release(slot)
    fork, todo = pc.load([1, 2, 3, 9])
    assert fork != slot and list(todo) == [9]
    assert (c.seq_pos_min(fork), c.seq_pos_max(fork)) == (0, 2)
    c.start_forward([3], [fork])
    c.set_layer(0)
    c.put(k[:1], k[:1])
    np.testing.assert_array_equal(np.asarray(c.get()[0])[0, :3], k[:3])


@pytest.mark.parametrize("window", [None, 3])
def test_batched_placement_equals_the_per_stream_path(window):
    """A batch whose streams all have a free run is placed by one compiled call over every
    stream's cell table (``CellTableStack``): the same cells, indexes, table versions, get()
    ranges, pool slots, page tables, K/V and errors as the per-stream path (forced on a twin),
    through decode steps, multi-token batches, removals with pending rotations, copies between
    streams, defrags, full streams, repeated positions, a state load (tables replaced, then
    stacked again), window pruning (``swa_window``) and a WrapperCache sibling's refusal (the
    batched placement undone)."""
    from numbakv.cells import CellTable, CellTableStack, _group_by_seq
    rng = np.random.default_rng(7)
    for _ in range(40):      # the compiled grouping is group_batch's
        seqs = rng.integers(0, 6, size=int(rng.integers(1, 12))).astype(np.int32)
        ids, qo, order, consecutive = _group_by_seq(seqs, 6)
        for got, want in zip((ids, qo, order), group_batch(seqs)):
            assert got.dtype == np.int32 and got.tolist() == want.tolist()
        assert consecutive == (len(ids) == 1 or bool((np.diff(ids) == 1).all()))
    S = 4
    kw = dict(capacity=10, max_seqs=S, max_batch=6, cache_padding=2)
    fast = nkv.CausalCache(stream_cfg(**kw), shift=nkv.RopeShift(), swa_window=window)
    slow = nkv.CausalCache(stream_cfg(**kw), shift=nkv.RopeShift(), swa_window=window)
    slow._place_stacked = lambda *args: None          # always the per-stream path
    batched, pruned_passes, refused = 0, 0, set()

    def same():
        for a, b in zip(fast.streams, slow.streams):
            assert np.array_equal(a.cells.cells, b.cells.cells)
            assert a.cells.version == b.cells.version
            assert a.cells.head == b.cells.head
            a.cells.check_consistency()
        np.testing.assert_array_equal(fast.storage.keys, slow.storage.keys)
        assert fast._stack.holds([s.cells for s in fast.streams])

    def run(op, *args):
        errors = []
        for c in (fast, slow):
            try:
                getattr(c, op)(*args)
                errors.append(None)
            except (ValueError, KVCacheFullError, NotSupportedError) as e:
                errors.append(f"{type(e).__name__}: {e}")
        assert errors[0] == errors[1]
        if errors[0]:
            refused.add(errors[0].split(":")[0])
        return errors[0]

    for step in range(80):
        op = rng.choice(["decode"] * 5 + ["batch", "repeat", "remove", "fork", "trim", "defrag",
                                          "load"])
        if op in ("decode", "batch", "repeat"):
            streams = rng.choice(S, size=int(rng.integers(1, S + 1)), replace=False)
            pos, seqs = [], []
            for s in streams.tolist():
                n = 1 if op != "batch" else int(rng.integers(1, 3))
                top = fast.seq_pos_max(s) + (0 if op == "repeat" else 1)
                if window and top and op != "repeat" and not fast.can_resume(s, top):
                    top = 0     # rewound past what the window memory kept: start over
                pos += list(range(top, top + n))
                seqs += [s] * n
            if run("start_forward", np.array(pos, np.int32), np.array(seqs, np.int32)):
                same()
                continue
            f, w = fast._forward, slow._forward
            batched += f.pool_slots is not None
            pruned_passes += f.pool_slots is not None and any(
                fast.streams[s]._forward.cells_v0 < 0 for s in f.seq_ids.tolist())
            assert f.n_kv == w.n_kv and f.consecutive == w.consecutive
            assert f.token_order.tolist() == w.token_order.tolist()
            np.testing.assert_array_equal(fast._step_placement()[3], slow._step_placement()[3])
            for s in f.seq_ids.tolist():
                a, b = fast.streams[s]._forward, slow.streams[s]._forward
                assert (a.start, a.lo, a.hi, a.cells_v0, a.cells_v1) == \
                    (b.start, b.lo, b.hi, b.cells_v0, b.cells_v1)
                assert a.positions.tolist() == b.positions.tolist()
            pf, ps = fast.page_table(), slow.page_table()
            for name in ("kv_indptr", "kv_indices", "kv_positions", "q_positions"):
                np.testing.assert_array_equal(getattr(pf, name), getattr(ps, name))
            for layer in range(2):
                k = kv(rng, len(pos))
                for c in (fast, slow):
                    c.set_layer(layer)
                    c.put(k, k)
                np.testing.assert_array_equal(fast.get()[0], slow.get()[0])
        elif op == "remove":
            s = int(rng.integers(S))
            if fast.seq_pos_max(s) >= 1:
                b = int(rng.integers(0, fast.seq_pos_max(s)))
                run("remove", s, b, b + 1)          # later keys re-rotated at the next pass
        elif op == "fork":
            src, dst = (int(x) for x in rng.choice(S, 2, replace=False))
            run("copy_prefix", src, dst, int(rng.integers(0, fast.seq_pos_max(src) + 2)))
        elif op == "trim":
            s = int(rng.integers(S))
            run("seq_rm", s, int(rng.integers(0, fast.seq_pos_max(s) + 2)), None)
        elif op == "defrag":
            run("defrag")
        else:
            data = fast.state_bytes()
            for c in (fast, slow):
                c.load_state_bytes(data)
            # new tables (versions restart), stacked again by the load
        same()
    assert batched >= 15 and "ValueError" in refused
    assert fast.defrag_count == slow.defrag_count
    if window is None:
        assert "KVCacheFullError" in refused and fast.defrag_count > 0
    else:    # the window memory dropped cells in batched passes (their lists are rebuilt)
        assert pruned_passes >= 5

    # a WrapperCache whose second cache refuses takes the first's batched placement back
    big = nkv.CausalCache(stream_cfg(capacity=16, max_batch=6))
    small = nkv.CausalCache(stream_cfg(capacity=4, max_batch=6))
    w = nkv.WrapperCache([big, small], layer_groups=[0, 1, 0, 1])
    w.start_forward([0, 1, 2, 3, 0], [0, 0, 0, 0, 1])
    before = [s.cells.cells for s in big.streams]
    forwards = [s._forward for s in big.streams]
    with pytest.raises(KVCacheFullError, match="stream 0"):
        w.start_forward([4, 1], [0, 1])
    assert all(np.array_equal(a, s.cells.cells) for a, s in zip(before, big.streams))
    assert all(f is s._forward for f, s in zip(forwards, big.streams))
    for s in big.streams:
        s.cells.check_consistency()
    w.start_forward([4, 1], [1, 1])          # and places again afterwards, batched
    assert big._forward.pool_slots is not None and big._forward.pool_slots.tolist() == \
        [big.cells_per_stream + 1, big.cells_per_stream + 2]
    with pytest.raises(ValueError, match="one shape"):
        CellTableStack([big.streams[0].cells, CellTable(4, 1)])
    with pytest.raises(ValueError, match="one or more"):
        CellTableStack([])


def test_trusted_pass_start_of_a_stream_cache_takes_the_checked_path():
    # CausalCache._start_forward_checked (numbakv.hf's decode steps) skips the batch checks; a
    # stream cache places per stream and must take its own checked start instead
    c = nkv.CausalCache(stream_cfg())
    c._start_forward_checked(np.array([0, 0], np.int32), np.array([0, 2], np.int32))
    assert c.seq_pos_max(0) == 0 and c.seq_pos_max(2) == 0 and c.seq_pos_max(1) == -1
    assert c.n_used == 2
    with pytest.raises(ValueError, match="already stored"):
        c._start_forward_checked(np.array([0], np.int32), np.array([2], np.int32))
    assert c.seq_pos_max(2) == 0 and c.n_used == 2
