"""PrefixStore.match_edit / load_edit (issue 36 #4): a prompt that differs from a stored one only
inside a range re-uses the stored suffix at its new positions, keys re-rotated; the caller is
told exactly which ranges to recompute and which were approximated. Keys here are roped
functions of (token, position), so a moved key is checked against the key the new position
would have had; V (never rotated) must be moved unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import numbakv as nkv
from numbakv.prefix import PrefixStore
from numbakv.prefix.edit import EditMatch, find_suffix, plan

from causal_reference import rope_ref

HEADS, DIM = 2, 8


def _raw(tokens):
    t = np.asarray(tokens, np.float64)[:, None, None]
    d = np.arange(DIM, dtype=np.float64)[None, None, :]
    h = np.arange(HEADS, dtype=np.float64)[None, :, None]
    return np.sin(t * 0.37 + d * 1.3 + h * 0.7)


def _kv(tokens, positions, layer):
    raw = _raw(tokens) + 0.1 * layer
    k = rope_ref(raw, np.asarray(positions))
    return k.astype(np.float32), (raw + 0.5).astype(np.float32)


def _cache(shift=True, capacity=512):
    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=HEADS, head_dim=DIM, capacity=capacity,
                          max_seqs=4, max_batch=128, dtype="float32", device="cpu")
    return nkv.CausalCache(cfg, shift=nkv.RopeShift() if shift else None)


def _prefill(cache, seq, tokens, lo=0, hi=None):
    hi = len(tokens) if hi is None else hi
    for a in range(lo, hi, 128):
        b = min(hi, a + 128)
        pos = np.arange(a, b, dtype=np.int32)
        cache.start_forward(pos, np.full(b - a, seq, np.int32))
        for layer in range(2):
            cache.set_layer(layer)
            cache.put(*_kv(tokens[a:b], pos, layer))


def _rows(cache, seq):
    """{position: (k [layer, heads, dim], v)} of what ``seq`` holds."""
    snap = cache.export_seq(seq)
    p = snap.parts[0]
    k = np.stack([np.asarray(x) for x in p.keys], 1)
    v = np.stack([np.asarray(x) for x in p.values], 1)
    return {int(pos): (k[i].reshape(2, HEADS, DIM), v[i].reshape(2, HEADS, DIM))
            for i, pos in enumerate(p.positions)}


def _agent_prompts(seed=0):
    rng = np.random.default_rng(seed)
    system, reasoning, rest = (rng.integers(10, 1000, n).tolist() for n in (40, 30, 100))
    stored = system + reasoning + rest          # turn k: reasoning kept
    new = system + rest + rng.integers(10, 1000, 20).tolist()   # turn k+1: reasoning stripped
    return stored, new


def test_find_suffix_and_plan_on_a_stripped_range():
    stored, new = _agent_prompts()
    sb, nb = (np.asarray(x, "<i8").tobytes() for x in (stored, new))
    found = find_suffix(sb, nb, 40, 16)
    assert found == ((70, 170), (40, 140))
    em = plan(40, found, 16)
    assert em == EditMatch(40, (70, 170), (40, 140), [(40, 56)], (56, 140))
    assert em.end == 140
    assert plan(40, found, 100) == EditMatch(40, recompute=[])   # nothing left to re-use
    assert find_suffix(sb, sb[:8 * 40], 40, 16) is None


def test_load_edit_moves_the_suffix_and_reports_what_to_recompute():
    stored, new = _agent_prompts()
    cache = _cache()
    store = PrefixStore(cache, retain_seqs=[3])
    _prefill(cache, 0, stored)
    store.save(0, stored)
    cache.remove(0, 0)
    before = store.match(new)
    assert before == 40
    em = store.match_edit(new)
    assert em == EditMatch(40, (70, 170), (40, 140), [(40, 56)], (56, 140))
    assert store.match_edit(new, recompute_after=4).recompute == [(40, 44)]
    placed = store.load_edit(1, new)
    assert placed == 40 + (140 - 56)
    assert store.last_recompute == [(40, 56)]
    assert store.last_edit.end == 140 and store.last_edit.approximated == (56, 140)
    rows = _rows(cache, 1)
    assert sorted(rows) == list(range(40)) + list(range(56, 140))
    for pos, (k, v) in rows.items():
        ek = np.stack([_kv([new[pos]], [pos], layer)[0][0] for layer in range(2)])
        ev_ = np.stack([_kv([new[pos]], [pos], layer)[1][0] for layer in range(2)])
        np.testing.assert_allclose(k, ek, atol=2e-5)      # moved keys re-rotated to pos
        np.testing.assert_array_equal(v, ev_)
    # the caller computes the recompute range and prefills on; the result is a whole prompt
    _prefill(cache, 1, new, 40, 56)
    _prefill(cache, 1, new, 140)
    assert sorted(_rows(cache, 1)) == list(range(len(new)))
    # the store entry it came from is intact
    assert store.match(stored) == len(stored)
    # and saves like any other sequence: the next turn matches all of it
    assert store.save(1, new) == len(new)
    assert store.match(new + [5, 6]) == len(new)


def test_load_edit_from_host_ram():
    stored, new = _agent_prompts(1)
    cache = _cache()
    store = PrefixStore(cache, host_bytes=1 << 20)     # no tier 0: saves go to host RAM
    _prefill(cache, 0, stored)
    store.save(0, stored)
    cache.remove(0, 0)
    assert store.load_edit(1, new, recompute_after=8) == 40 + (140 - 48)
    assert store.last_recompute == [(40, 48)]
    rows = _rows(cache, 1)
    k, v = rows[100]
    np.testing.assert_allclose(k, np.stack([_kv([new[100]], [100], l)[0][0] for l in range(2)]),
                               atol=2e-5)


def test_no_shift_is_a_plain_prefix_load():
    stored, new = _agent_prompts()
    cache = _cache(shift=False)
    store = PrefixStore(cache, retain_seqs=[3])
    _prefill(cache, 0, stored)
    store.save(0, stored)
    cache.remove(0, 0)
    assert store.match_edit(new) == EditMatch(40, recompute=[])
    assert store.load_edit(1, new) == 40
    assert store.last_recompute == [] and store.last_edit.suffix_src is None
    assert sorted(_rows(cache, 1)) == list(range(40))


def test_bad_input_changes_nothing():
    stored, new = _agent_prompts()
    cache = _cache()
    store = PrefixStore(cache, retain_seqs=[3])
    _prefill(cache, 0, stored)
    store.save(0, stored)
    with pytest.raises(ValueError, match="recompute_after"):
        store.load_edit(1, new, recompute_after=-1)
    with pytest.raises(ValueError, match="recompute_after"):
        store.match_edit(new, recompute_after="x")
    with pytest.raises(ValueError, match="must be empty"):
        store.load_edit(0, new)
    with pytest.raises(ValueError, match="seq"):
        store.load_edit(3, new)
    with pytest.raises(ValueError, match="tokens"):
        store.load_edit(1, [[1, 2]])
    assert cache.seq_pos_max(1) == -1
    assert store.last_recompute == []
