"""The prefix store on hybrid caches (recurrent layers beside attention): an entry serves only
the lengths where it holds the recurrent state (its restore points), so a hit counts up to the
deepest restore point at or below the token match."""

from __future__ import annotations

from numbakv.prefix.index import BlockIndex, Entry
from numbakv.prefix.keys import token_bytes


def _entry(index, root, tokens, tier="cells", floor=0, restore=None):
    e = Entry(tier, root, index.insert_path(root, token_bytes(tokens)), floor=floor,
              restore=restore)
    index.add(e)
    return e


def test_index_serves_the_deepest_restore_point_at_or_below_the_token_match():
    idx = BlockIndex(4)
    root = b"r" * 16
    long = _entry(idx, root, list(range(20)), restore=(6, 13, 20))
    assert idx.match(root, token_bytes(list(range(20)) + [5])).n == 20
    m = idx.match(root, token_bytes(list(range(17)) + [0, 0]))
    assert (m.n, m.entry, m.tokens_matched) == (13, long, 17)     # token match 17 -> point 13
    assert idx.match(root, token_bytes(list(range(12)))).n == 6
    assert idx.match(root, token_bytes(list(range(5)))).n == 0     # below the first point
    # another entry with a deeper point below the match wins, whatever its tier
    short = _entry(idx, root, list(range(16)), tier="host", restore=(16,))
    m = idx.match(root, token_bytes(list(range(18))))
    assert (m.n, m.entry) == (16, short)
    # a point equal to the match: the fast path; lower tier rank first, then the shorter
    m = idx.match(root, token_bytes(list(range(13))))
    assert (m.n, m.entry) == (13, long)
    assert short.servable(15) == 0 and long.servable(19) == 13 and long.servable(100) == 20


def test_index_restore_points_and_window_floor_together():
    idx = BlockIndex(4)
    root = b"r" * 16
    e = _entry(idx, root, list(range(20)), floor=10, restore=(4, 8, 12, 20))
    assert e.servable(11) == 0            # point 8 is below the window floor
    assert idx.match(root, token_bytes(list(range(15)))).n == 12
    assert idx.match(root, token_bytes(list(range(11)))).n == 0


# ---------------------------------------------------------------------- the store over a HybridCache
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import numbakv as nkv  # noqa: E402
from numbakv.prefix import PrefixStore  # noqa: E402
from prefix_helpers import kv_of  # noqa: E402

KINDS = ["recurrent", "attention", "recurrent"]
SPACING = 8


def toy_state(tokens):
    """The recurrent state a toy model keeps after ``tokens``: exact in float32, different for
    every prefix (what a load must bring back)."""
    t = np.asarray(tokens, np.float64)
    base = float(t.sum()) + 0.001 * len(t)
    conv = np.full((2, 3, 4), base, np.float32) + np.arange(2, dtype=np.float32)[:, None, None]
    ssm = np.full((2, 5), base * 0.5, np.float32)
    return {"conv": conv, "ssm": ssm}      # [recurrent layers, *shape]


def hybrid_cache(capacity=64, max_seqs=4, restore_every=SPACING):
    attn = nkv.CausalCache(nkv.CacheConfig(n_layers=1, n_kv_heads=2, head_dim=4,
                                           dtype="float32", capacity=capacity,
                                           max_seqs=max_seqs, device="cpu"))
    rc = nkv.RecurrentCache(nkv.RecurrentConfig(
        n_layers=2, states=[nkv.StateSpec("conv", (3, 4)), nkv.StateSpec("ssm", (5,))],
        max_seqs=max_seqs, restore_every=restore_every, max_restore_points=8, device="cpu"))
    return nkv.HybridCache(attn, rc, KINDS)


def hybrid_prefill(hc, seq, tokens, start=0, chunk=64):
    """Evaluate ``tokens[start:]`` into ``seq`` as a model would: K/V of the attention layer,
    the state handed over at each restore-plan cut, the live state at each chunk's end."""
    for lo in range(start, len(tokens), chunk):
        hi = min(len(tokens), lo + chunk)
        pos = np.arange(lo, hi, dtype=np.int32)
        hc.start_forward(pos, np.full(hi - lo, seq, np.int32))
        hc.set_layer(1)
        k, v = kv_of(tokens[lo:hi], pos, 0, 2, 4)
        hc.put(k, v)
        for cut in hc.restore_plan(seq, hi - lo):
            if lo + cut < hi:
                hc.keep_restore_point(seq, lo + cut, toy_state(tokens[:lo + cut]))
        live = toy_state(tokens[:hi])
        for j, layer in enumerate((0, 2)):
            views = hc.state_views(layer, [seq])
            for name in ("conv", "ssm"):
                views[name][0] = live[name][j]
        hc.keep_restore_point(seq, hi)


def check_hybrid_holds(hc, seq, tokens, n):
    """``seq`` holds ``tokens[:n]``: K/V rows and, as its live state, the state after them."""
    assert hc.seq_pos_max(seq) == n - 1 and hc.rc.seq_pos_max(seq) == n - 1
    g = hc.attn
    cells = g.cells.seq_cells(seq)
    pos, _ = g.cells.mask_inputs(0, g.n_cells)
    p = np.sort(pos[cells])
    assert p.tolist() == list(range(n))
    want = toy_state(tokens[:n])
    for j, layer in enumerate((0, 2)):
        got = hc.read_states(layer, [seq])
        for name in ("conv", "ssm"):
            np.testing.assert_array_equal(np.asarray(got[name][0]), want[name][j])


def test_store_serves_restore_points_of_a_hybrid_cache():
    rng = np.random.default_rng(0)
    toks = rng.integers(1, 50, 30).tolist()
    hc = hybrid_cache()
    store = PrefixStore(hc, retain_seqs=[3], block_tokens=4)
    hybrid_prefill(hc, 0, toks[:21], chunk=11)          # cuts at 8, 11 (batch end), 16
    assert 8 in hc.restore_points(0) and 16 in hc.restore_points(0)
    assert store.save(0, toks[:21]) == 21                # the prompt's end gets a point
    assert store.match(toks[:21] + [99]) == 21
    assert store.match(toks[:19] + [99]) == 16           # the deepest point <= the match
    assert store.match(toks[:10]) == 8 and store.match(toks[:7]) == 0
    hc.seq_rm(0)
    assert store.load(1, toks[:19] + [7, 7]) == 16
    check_hybrid_holds(hc, 1, toks, 16)
    hybrid_prefill(hc, 1, toks[:30], start=16)           # goes on from the restored state
    check_hybrid_holds(hc, 1, toks, 30)


def test_save_ends_at_a_restore_point_and_a_cancelled_prefill_is_reusable():
    rng = np.random.default_rng(1)
    toks = rng.integers(1, 50, 30).tolist()
    hc = hybrid_cache()
    store = PrefixStore(hc, retain_seqs=[3], block_tokens=4)
    hybrid_prefill(hc, 0, toks[:20])
    # tokens ending between restore points: only what a state exists for is kept
    assert store.save(0, toks[:13]) == 8
    assert store.match(toks[:13]) == 8
    # a cancelled prefill: 13 of 30 prompt tokens ran; saving them keeps their end
    hybrid_prefill(hc, 1, toks[:13])
    assert store.save(1, toks[:13]) == 13
    hc.seq_rm(1)
    assert store.load(2, toks[:30]) == 13
    check_hybrid_holds(hc, 2, toks, 13)


def test_evicted_hybrid_entries_carry_their_state_to_host_and_disk(tmp_path):
    rng = np.random.default_rng(2)
    toks = rng.integers(1, 50, 40).tolist()
    hc = hybrid_cache(capacity=12, max_seqs=3)        # 36 cells: two prompts of 20 do not fit
    store = PrefixStore(hc, retain_seqs=[2], block_tokens=4, host_bytes=1 << 20)
    hybrid_prefill(hc, 0, toks[:20])
    assert store.save(0, toks[:20]) == 20
    hc.seq_rm(0)
    hybrid_prefill(hc, 1, toks[20:40])                   # needs the retained cells: evicts
    hc.seq_rm(1)
    entries = store.entries()
    assert [e["tier"] for e in entries] == ["host"] and entries[0]["length"] == 20
    assert store.match(toks[:18]) == 16
    assert store.load(0, toks[:18]) == 16
    check_hybrid_holds(hc, 0, toks, 16)
    hc.seq_rm(0)
    store.close()
    # disk: a later store of the same model finds the entry with its state
    hc2 = hybrid_cache(capacity=24, max_seqs=3)
    with PrefixStore(hc2, block_tokens=4, disk_dir=str(tmp_path), disk_bytes=1 << 20,
                     model_id="toy") as first:
        hybrid_prefill(hc2, 0, toks[:20])
        assert first.save(0, toks[:20]) == 20
        first.flush()
    hc2.seq_rm(0)
    with PrefixStore(hc2, block_tokens=4, disk_dir=str(tmp_path), disk_bytes=1 << 20,
                     model_id="toy") as second:
        assert second.load(0, toks[:19] + [5]) == 16
        check_hybrid_holds(hc2, 0, toks, 16)


def test_a_hybrid_store_refuses_attention_only_snapshots_and_other_layouts(tmp_path):
    """Entries of an attention-only cache of the same shapes never serve a hybrid (the
    recurrent layout is part of every key and of the lower tiers' namespace)."""
    toks = list(range(1, 21))
    attn = nkv.CausalCache(nkv.CacheConfig(n_layers=1, n_kv_heads=2, head_dim=4,
                                           dtype="float32", capacity=64, max_seqs=4,
                                           device="cpu"))
    with PrefixStore(attn, block_tokens=4, disk_dir=str(tmp_path), disk_bytes=1 << 20,
                     model_id="toy") as plain:
        plain.cache.start_forward(np.arange(20, dtype=np.int32), np.zeros(20, np.int32))
        plain.cache.set_layer(0)
        plain.cache.put(*kv_of(toks, np.arange(20), 0, 2, 4))
        assert plain.save(0, toks) == 20
        plain.flush()
    hc = hybrid_cache()
    with PrefixStore(hc, block_tokens=4, disk_dir=str(tmp_path), disk_bytes=1 << 20,
                     model_id="toy") as hybrid:
        assert hybrid.match(toks) == 0 and hybrid.load(0, toks) == 0
        assert hc.seq_pos_max(0) == -1


def test_redis_carries_hybrid_entries_with_their_state():
    """The Redis/Valkey tier keeps a hybrid entry's K/V and restore points in one run: another
    store (another process, in practice) of the same model loads it up to the deepest restore
    point at or below the match, state included."""
    pytest.importorskip("redis")
    from redis_server import _running_server
    gen = _running_server()
    server = next(gen)
    try:
        toks = np.random.default_rng(3).integers(1, 50, 30).tolist()
        hc = hybrid_cache()
        with PrefixStore(hc, block_tokens=4, remote=server.url, model_id="toy") as first:
            hybrid_prefill(hc, 0, toks[:21], chunk=11)
            assert first.save(0, toks[:21]) == 21
            first.flush()
        hc.seq_rm(0)
        hc2 = hybrid_cache()
        with PrefixStore(hc2, block_tokens=4, remote=server.url, model_id="toy") as second:
            assert second.match(toks[:19] + [1, 1]) == 16      # read from the run: point 16
            assert second.load(1, toks[:19] + [1, 1]) == 16
            check_hybrid_holds(hc2, 1, toks, 16)
            # the lower tiers find runs by whole blocks: the prompt's end (21) serves a prompt
            # holding exactly those tokens; a longer one resumes from a point inside its blocks
            assert second.load(2, toks[:21]) == 21
            check_hybrid_holds(hc2, 2, toks, 21)
            assert second.load(3, toks[:21] + [2]) == 16
    finally:
        gen.close()


def test_edit_reuse_is_refused_on_hybrids():
    """An edited prompt cannot re-use anything after the edit on a hybrid (the recurrent state
    there depends on every earlier token): match_edit/load_edit say so, changing nothing."""
    from numbakv.errors import NotSupportedError
    toks = list(range(1, 21))
    hc = hybrid_cache()
    store = PrefixStore(hc, retain_seqs=[3], block_tokens=4)
    hybrid_prefill(hc, 0, toks)
    assert store.save(0, toks) == 20
    edited = toks[:10] + [99] + toks[11:]
    with pytest.raises(NotSupportedError, match="hybrid"):
        store.match_edit(edited)
    with pytest.raises(NotSupportedError, match="hybrid"):
        store.load_edit(1, edited)
    assert hc.seq_pos_max(1) == -1 and store.match(edited) == 8   # restore point 8
