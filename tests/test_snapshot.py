"""One sequence's K/V as a unit (``numbakv.state.snapshot``): ``export_seq`` / ``import_seq`` /
``SeqSnapshot``.

Round trips are checked against an independent reading of the storage (the sequence's cells
found in the cell table, their rows read from the K/V arrays, V un-permuted by hand), byte for
byte. Every refusal must leave the destination exactly as it was (cell table, every K/V byte,
the forward pass).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numbakv as nkv
from numbakv import KVCacheFullError, NotSupportedError, SeqSnapshot, SnapshotPart, StateError
from numbakv.state import snapshot as snapmod
from numbakv import state
from numbakv.causal import CausalCache
from numbakv.wrappers import WrapperCache

from causal_reference import rope_ref
from helpers import dev, host, host_kv, random_storage, same, seq_rows

L, H, D, DV = 2, 2, 32, 32


# ============================================================================ helpers
def make(device="cpu", *, dtype="float16", capacity=16, max_seqs=3, shift=None,
         swa_window=None, n_layers=L, **kw) -> CausalCache:
    cfg = nkv.CacheConfig(n_layers=n_layers, n_kv_heads=H, head_dim=D, v_head_dim=DV,
                          dtype=dtype, capacity=capacity, max_seqs=max_seqs, max_batch=16,
                          device=device, **kw)
    return CausalCache(cfg, shift=shift, swa_window=swa_window)


def put_all(cache, n, rng, keys=None) -> None:
    cfg = cache.config
    for layer in range(cfg.n_layers):
        cache.set_layer(layer)
        k = random_storage(rng, (n, cfg.n_kv_heads, cfg.head_dim), cfg.dtype) if keys is None \
            else keys[layer].astype(cfg.storage_dtype)
        cache.put(dev(k, cache.device),
                  dev(random_storage(rng, (n, cfg.n_kv_heads, cfg.v_head_dim), cfg.dtype),
                      cache.device))


def fill(cache, seq, positions, rng, keys=None) -> None:
    positions = np.asarray(positions)
    cache.start_forward(positions, np.full(len(positions), seq))
    put_all(cache, len(positions), rng, keys)


def part_rows(part: SnapshotPart):
    return (np.asarray(part.positions), np.stack([host(k) for k in part.keys]),
            np.stack([host(v) for v in part.values]))


def assert_rows(a, b) -> None:
    for x, y in zip(a, b):
        assert same(x, y)


def frozen(cache):
    k = np.array(host(cache.storage.keys))
    v = np.array(host(cache.storage.values))
    return cache.cells.cells.copy(), k, v, cache._forward, cache.n_used


def assert_unchanged(cache, before, *, data_of_free_cells=True) -> None:
    cells, k, v, forward, used = before
    assert cache.cells.cells.tobytes() == cells.tobytes(), "cell table changed"
    if data_of_free_cells:
        assert same(host(cache.storage.keys), k), "K changed"
        assert same(host(cache.storage.values), v), "V changed"
    else:    # the rows of every cell in use
        now_k, now_v = host_kv(cache)
        was_v = v.transpose(0, 3, 1, 2) if cache.config.permuted_v else v
        busy = np.flatnonzero(cells["pos"] >= 0)
        assert same(now_k[:, busy], k[:, busy]) and same(now_v[:, busy], was_v[:, busy])
    assert cache._forward is forward, "the forward pass changed"
    assert cache.n_used == used
    cache.cells.check_consistency()


def scattered_source(rng, **kw) -> CausalCache:
    """Sequence 1 interleaved with sequence 0 (its cells are not one run) and sequence 2 in one
    run."""
    c = make(**kw)
    fill(c, 1, range(0, 4), rng)
    fill(c, 0, range(0, 3), rng)
    fill(c, 1, range(4, 9), rng)
    fill(c, 2, range(0, 6), rng)
    return c


FORMATS = [dict(dtype="float16"), dict(dtype="bfloat16"), dict(dtype="float32"),
           dict(dtype="float16", k_dtype="q8_0", v_dtype="q4_0"),
           dict(dtype="bfloat16", k_dtype="q4_0", v_dtype="q8_0"),
           dict(dtype="float16", k_dtype="float8_e4m3", v_dtype="float8_e4m3", k_scale=0.5,
                v_scale=2.0),
           dict(dtype="float16", k_dtype="q8_0")]


# ============================================================================ round trips
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: "-".join(str(v) for v in f.values()))
@pytest.mark.parametrize("src_perm,dst_perm", [(False, False), (False, True), (True, False)])
def test_round_trip_bit_exact(fmt, src_perm, dst_perm):
    if (src_perm or dst_perm) and fmt.get("v_dtype", fmt["dtype"]) != fmt["dtype"]:
        pytest.skip("a quantized V is never stored permuted")
    rng = np.random.default_rng(1)
    src = scattered_source(rng, permuted_v=src_perm, **fmt)
    for seq in (1, 2):                       # a gather (interleaved cells) and a view (a run)
        snap = src.export_seq(seq)
        part = snap.parts[0]
        assert (part.k_format, part.v_format) == (src.config.k_dtype, src.config.v_dtype)
        assert snap.head_range == (0, H) and snap.fingerprint == state.fingerprint(src)
        assert_rows(part_rows(part), seq_rows(src, seq))
        assert snap.nbytes == sum(a.nbytes for a in part.keys + part.values)
        # another capacity, max_seqs, V layout and occupancy: other cells
        dst = make(capacity=32, max_seqs=2, permuted_v=dst_perm, **fmt)
        fill(dst, 0, range(5), rng)
        dst.start_forward([5], [0])
        assert dst.import_seq(1, snap) == len(snap)
        assert dst._forward is None                     # ends the forward pass
        assert_rows(seq_rows(dst, 1), seq_rows(src, seq))
        assert_rows(part_rows(dst.export_seq(1).parts[0]), seq_rows(src, seq))
        dst.cells.check_consistency()
        # free cells in two runs, neither long enough: the rows scatter (the compiled row
        # copy; a permuted V through numpy)
        frag = make(capacity=10, max_seqs=2, permuted_v=dst_perm, **fmt)
        for s, lo in ((0, 0), (1, 0), (0, 5), (1, 5)):
            fill(frag, s, range(lo, lo + 5), rng)
        frag.seq_rm(0)
        assert frag.import_seq(0, snap) == len(snap)
        assert _run(np.sort(np.asarray(frag.cells.seq_cells(0)))) is False
        assert_rows(seq_rows(frag, 0), seq_rows(src, seq))
        frag.cells.check_consistency()
        # and through bytes
        back = SeqSnapshot.from_bytes(snap.to_bytes())
        assert back.fingerprint == snap.fingerprint and back.head_range == snap.head_range
        assert_rows(part_rows(back.parts[0]), seq_rows(src, seq))


def test_views_copies_ranges_and_placement():
    rng = np.random.default_rng(2)
    src = scattered_source(rng)
    run = src.export_seq(2).parts[0]
    k0 = run.keys[0]
    assert np.shares_memory(k0, src.storage.keys) and not k0.flags.writeable   # a view
    gathered = src.export_seq(1).parts[0]
    assert not np.shares_memory(gathered.keys[0], src.storage.keys)            # a gather
    owned = src.export_seq(2).copy()
    assert not np.shares_memory(owned.parts[0].keys[0], src.storage.keys)
    # ranges [p0, p1)
    part = src.export_seq(1, 2, 6).parts[0]
    assert part.positions.tolist() == [2, 3, 4, 5]
    assert src.export_seq(1, 7).positions.tolist() == [7, 8]
    empty = src.export_seq(1, 50)
    assert len(empty) == 0 and empty.nbytes == 0
    dst = make()
    before = frozen(dst)
    assert dst.import_seq(0, empty) == 0
    assert dst.cells.cells.tobytes() == before[0].tobytes()
    # no contiguous run left: scattered cells
    dst = make(capacity=6, max_seqs=2)                 # 12 cells
    fill(dst, 0, range(3), rng)
    fill(dst, 1, range(3), rng)
    fill(dst, 0, range(3, 6), rng)
    fill(dst, 1, range(3, 6), rng)
    dst.seq_rm(0)                                      # free: cells 0..2 and 6..8
    snap = src.export_seq(1, 0, 5)
    dst.import_seq(0, snap)
    cells = np.sort(np.asarray(dst.cells.seq_cells(0)))
    assert len(cells) == 5 and _run(cells) is False
    pos, k, v = seq_rows(dst, 0)
    spos, sk, sv = seq_rows(src, 1)
    sel = np.isin(pos, spos[:5])
    assert same(k[:, sel], sk[:, :5]) and same(v[:, sel], sv[:, :5])
    # the sequence may hold other positions
    dst2 = make()
    fill(dst2, 0, [9, 50], rng)
    dst2.import_seq(0, src.export_seq(1))
    assert dst2.cells.cells["pos"][np.asarray(dst2.cells.seq_cells(0))].size == 11


def test_a_position_held_twice_round_trips():
    """seq_add / seq_div may merge positions (llama.cpp's do: its cells keep a count per
    position), so a sequence can hold one position in several cells. export_seq, the bytes and
    state_bytes(seq) must carry every one of those rows, each with its own K/V, and load them
    back as they were (found by the long WrapperCache stateful run: ``seq_add(s, 2, None, -2)``
    over positions 0..9 left 0 and 1 twice and ``state_bytes(s)`` refused the sequence)."""
    rng = np.random.default_rng(21)
    src = make(dtype="float32", shift=nkv.RopeShift())
    fill(src, 0, range(6), rng)
    fill(src, 1, range(4), rng)
    src.seq_add(0, 2, None, -2)                        # 0 1 2 3 4 5 -> 0 1 0 1 2 3
    src.seq_div(1, 0, None, 2)                         # 0 1 2 3 -> 0 0 1 1
    src.apply_pending_shifts()                         # what an export does first
    held = {0: [0, 0, 1, 1, 2, 3], 1: [0, 0, 1, 1]}
    for seq, positions in held.items():
        want = seq_rows(src, seq)                      # position order, cells in table order
        assert want[0].tolist() == positions
        snap = src.export_seq(seq)
        assert snap.positions.tolist() == positions
        assert_rows(part_rows(snap.parts[0]), want)
        assert_rows(part_rows(SeqSnapshot.from_bytes(snap.to_bytes()).parts[0]), want)
        # into another cache, as saved and moved by `at` (every key re-rotated alike)
        dst = make(dtype="float32", shift=nkv.RopeShift())
        assert dst.import_seq(2, snap) == len(positions)
        assert_rows(seq_rows(dst, 2), want)
        dst.import_seq(0, snap, at=10)
        assert seq_rows(dst, 0)[0].tolist() == [p + 10 for p in positions]
        dst.cells.check_consistency()
        # a state of the sequence: into a fresh cache, and back over itself
        data = src.state_bytes(seq)
        fresh = make(dtype="float32", shift=nkv.RopeShift())
        fresh.load_state_bytes(data, 2)
        assert_rows(seq_rows(fresh, 2), want)
        src.load_state_bytes(data, seq)
        assert_rows(seq_rows(src, seq), want)
        src.cells.check_consistency()
    # a WrapperCache's sequence state holds every group's repeated rows
    w = wrapper()
    wfill(w, 0, range(4), rng)
    w.seq_div(0, 0, None, 2)
    for g in w.caches:
        g.apply_pending_shifts()
    want = [seq_rows(g, 0) for g in w.caches]
    w2 = wrapper()
    w2.load_state_bytes(w.state_bytes(0), 1)
    for g, rows in zip(w2.caches, want):
        assert seq_rows(g, 1)[0].tolist() == [0, 0, 1, 1]
        assert_rows(seq_rows(g, 1), rows)


def _run(cells) -> bool:
    return bool(len(cells) and cells[-1] - cells[0] == len(cells) - 1)


def test_pending_shifts_are_applied_before_export():
    rng = np.random.default_rng(3)
    rope = nkv.RopeShift()
    c = make(dtype="float32", shift=rope)
    fill(c, 0, range(6), rng)
    c.seq_add(0, 3, None, 10)
    snap = c.export_seq(0)
    assert not c.cells.has_pending_shifts()
    assert snap.positions.tolist() == [0, 1, 2, 13, 14, 15]
    assert_rows(part_rows(snap.parts[0]), seq_rows(c, 0))


# ============================================================================ at=
def _roped(rng, n, start, raw=None):
    raw = rng.standard_normal((L, n, H, D)).astype(np.float32) if raw is None else raw
    return raw, np.stack([rope_ref(raw[l], np.arange(start, start + n)) for l in range(L)])


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-5), ("float16", 4e-3)])
def test_import_at_equals_a_fresh_prefill_there(dtype, tol):
    rng = np.random.default_rng(4)
    rope = nkv.RopeShift()
    raw, keys = _roped(rng, 7, 0)
    src = make(dtype=dtype, shift=rope)
    fill(src, 0, range(7), rng, keys=keys)
    snap = src.export_seq(0)
    dst = make(dtype=dtype, shift=rope)
    fill(dst, 0, range(3), rng)
    assert dst.import_seq(1, snap, at=40) == 7
    pos, k, v = seq_rows(dst, 1)
    assert pos.tolist() == list(range(40, 47))
    _, fresh = _roped(rng, 7, 40, raw)
    assert np.allclose(k.astype(np.float32), fresh.astype(dtype).astype(np.float32), atol=tol,
                       rtol=0)
    assert same(v, seq_rows(src, 0)[2])                  # values do not turn
    # at below the saved start moves positions down, the same way
    dst.import_seq(2, src.export_seq(0, 3), at=0)
    pos, k, _ = seq_rows(dst, 2)
    assert pos.tolist() == [0, 1, 2, 3]
    _, fresh = _roped(rng, 4, 0, raw[:, 3:])
    assert np.allclose(k.astype(np.float32), fresh.astype(dtype).astype(np.float32), atol=tol,
                       rtol=0)
    # at equal to where it starts: bit-exact, no rotation
    dst.seq_rm(2)
    dst.import_seq(2, snap, at=0)
    assert_rows(seq_rows(dst, 2), seq_rows(src, 0))


def test_import_at_on_quantized_keys_is_the_cache_rotation():
    """q8_0 keys turn by the cache's own quantized rotary kernel: the same bytes a seq_add on
    the source produces."""
    rng = np.random.default_rng(5)
    rope = nkv.RopeShift()
    src = make(k_dtype="q8_0", shift=rope)
    fill(src, 0, range(6), rng)
    snap = src.export_seq(0).copy()
    dst = make(k_dtype="q8_0", shift=rope)
    dst.import_seq(0, snap, at=21)
    src.seq_add(0, 0, None, 21)
    src.apply_pending_shifts()
    assert_rows(seq_rows(dst, 0), seq_rows(src, 0))


def test_import_at_with_a_shift_callable():
    rng = np.random.default_rng(6)
    calls = []

    def shift(layer, key, deltas):
        calls.append(layer)
        k = np.asarray(key, dtype=np.float32)
        return rope_ref(k, np.asarray(deltas)).astype(np.float32)

    raw, keys = _roped(rng, 5, 0)
    src = make(dtype="float32", shift=shift)
    fill(src, 0, range(5), rng, keys=keys)
    dst = make(dtype="float32", shift=shift)
    dst.import_seq(0, src.export_seq(0), at=9)
    _, fresh = _roped(rng, 5, 9, raw)
    assert calls and np.allclose(seq_rows(dst, 0)[1], fresh, atol=2e-5, rtol=0)


# ============================================================================ other caches
def test_stream_caches_round_trip_with_unified_ones():
    rng = np.random.default_rng(7)
    streams = make(unified=False, capacity=12)
    fill(streams, 1, range(5), rng)
    fill(streams, 2, range(3), rng)
    snap = streams.export_seq(1)
    assert_rows(part_rows(snap.parts[0]), seq_rows(streams.streams[1], 0))
    unified = make(capacity=12)
    fill(unified, 0, range(4), rng)
    unified.import_seq(2, snap)
    assert_rows(seq_rows(unified, 2), seq_rows(streams.streams[1], 0))
    # back into another sequence's stream: the rows go to that stream only
    other = make(unified=False, capacity=12)
    other.start_forward([0], [0])
    assert other.import_seq(2, unified.export_seq(2)) == 5
    assert [s.n_used for s in other.streams] == [1, 0, 5] and other._forward is None
    assert_rows(seq_rows(other.streams[2], 0), seq_rows(streams.streams[1], 0))
    with pytest.raises(ValueError, match="seq 2 already holds"):
        other.import_seq(2, snap)
    with pytest.raises(KVCacheFullError):
        other.import_seq(1, SeqSnapshot.concat_heads([_wide(other, 13)]))


def _wide(cache, n):
    """A hand-built snapshot of ``n`` tokens fitting ``cache``'s formats."""
    rng = np.random.default_rng(n)
    cfg = cache.config
    return SeqSnapshot(parts=(SnapshotPart(
        positions=np.arange(100, 100 + n), keys=[random_storage(rng, (n, H, D), cfg.dtype)] * L,
        values=[random_storage(rng, (n, H, DV), cfg.dtype)] * L, k_format=cfg.k_dtype,
        v_format=cfg.v_dtype),), fingerprint=state.fingerprint(cache), head_range=(0, H))


def wrapper(rng=None, *, swa_memory=None):
    """Gemma-style: layers 0 and 2 sliding (window 3), layer 1 full."""
    swa = CausalCache(nkv.CacheConfig(n_layers=2, n_kv_heads=H, head_dim=D, v_head_dim=DV,
                                      capacity=16, max_seqs=2, max_batch=4, device="cpu"),
                      shift=nkv.RopeShift(), swa_window=3)
    full = CausalCache(nkv.CacheConfig(n_layers=1, n_kv_heads=H, head_dim=D, v_head_dim=DV,
                                       capacity=16, max_seqs=2, max_batch=4, device="cpu",
                                       permuted_v=True), shift=nkv.RopeShift())
    return WrapperCache([swa, full], layer_groups=[0, 1, 0])


def wfill(w, seq, positions, rng):
    positions = np.asarray(positions)
    w.start_forward(positions, np.full(len(positions), seq))
    for layer in range(3):
        w.set_layer(layer)
        w.put(random_storage(rng, (len(positions), H, D), "float16"),
              random_storage(rng, (len(positions), H, DV), "float16"))


def test_wrapper_cache_sliding_and_full_groups():
    rng = np.random.default_rng(8)
    w = wrapper()
    for start in range(0, 12, 4):
        wfill(w, 0, range(start, start + 4), rng)
    wfill(w, 1, range(2), rng)
    snap = w.export_seq(0)
    swa_part, full_part = snap.parts
    assert full_part.positions.tolist() == list(range(12))
    # the sliding group keeps only what its window memory kept
    assert swa_part.positions.tolist() == seq_rows(w.caches[0], 0)[0].tolist()
    assert len(swa_part.positions) < 12
    assert snap.fingerprint == {"groups": [state.fingerprint(c) for c in w.caches]}
    w2 = wrapper()
    wfill(w2, 0, range(3), rng)
    assert w2.import_seq(1, snap) == 12
    for a, b in zip(w.caches, w2.caches):
        assert_rows(seq_rows(b, 1), seq_rows(a, 0))
    back = SeqSnapshot.from_bytes(snap.to_bytes())
    for p, q in zip(back.parts, snap.parts):
        assert_rows(part_rows(p), part_rows(q))
    # sliding-window pruning goes on as usual at the next forward pass
    wfill(w2, 1, [12], rng)
    assert w2.caches[0].seq_pos_min(1) >= 12 - w2.caches[0].swa_memory
    w2.caches[0].cells.check_consistency()
    # the full group has no room: refused in both groups
    w3 = wrapper()
    for start in range(0, 24, 4):
        wfill(w3, 1, range(start, start + 4), rng)
    before = [frozen(c) for c in w3.caches]
    with pytest.raises(KVCacheFullError, match="group 1"):
        w3.import_seq(0, snap)
    for c, b in zip(w3.caches, before):
        assert_unchanged(c, b)
    # a plain cache's snapshot does not fit a wrapper
    with pytest.raises(ValueError, match="part"):
        w3.import_seq(0, SeqSnapshot(parts=snap.parts[:1], fingerprint=snap.fingerprint,
                                     head_range=snap.head_range))


def test_wrapper_rolls_back_a_committed_group(monkeypatch):
    rng = np.random.default_rng(9)
    w = wrapper()
    wfill(w, 0, range(3), rng)
    wfill(w, 0, range(3, 6), rng)
    snap = w.export_seq(0).copy()
    w2 = wrapper()
    wfill(w2, 0, range(2), rng)
    before = [frozen(c) for c in w2.caches]
    real = snapmod._write_rows

    def failing(cache, layer, idx, k, v):
        if cache is w2.caches[1]:
            raise RuntimeError("device error")
        return real(cache, layer, idx, k, v)

    monkeypatch.setattr(snapmod, "_write_rows", failing)
    with pytest.raises(RuntimeError, match="device error"):
        w2.import_seq(1, snap)
    for c, b in zip(w2.caches, before):
        assert_unchanged(c, b, data_of_free_cells=False)


@pytest.mark.parametrize("replace", [False, True])
def test_failed_write_rolls_back(monkeypatch, replace):
    rng = np.random.default_rng(10)
    src = scattered_source(rng, shift=nkv.RopeShift())
    snap = src.export_seq(1).copy()
    dst = make(capacity=8, max_seqs=2, shift=nkv.RopeShift())     # 16 cells
    fill(dst, 0, range(3), rng)
    if replace:                       # full: the replacement must reuse seq 1's own cells
        fill(dst, 1, range(9), rng)
        fill(dst, 0, range(3, 6), rng)
    dst.start_forward([6], [0])
    before = frozen(dst)
    calls = []
    real = snapmod._write_rows

    def failing(cache, layer, idx, k, v):
        calls.append(layer)
        if len(calls) == 2:
            raise RuntimeError("device error")
        return real(cache, layer, idx, k, v)

    monkeypatch.setattr(snapmod, "_write_rows", failing)
    with pytest.raises(RuntimeError, match="device error"):
        if replace:
            snapmod.replace_seq(dst, 1, snap)
        else:
            dst.import_seq(1, snap, at=2)
    # every cell in use keeps its rows (a replaced sequence's reused cells come back too)
    assert_unchanged(dst, before, data_of_free_cells=False)


# ============================================================================ refusals
def _refuse(cache, fn, exc, match):
    before = frozen(cache)
    with pytest.raises(exc, match=match):
        fn()
    assert_unchanged(cache, before)


def test_every_refusal_changes_nothing():
    rng = np.random.default_rng(11)
    src = scattered_source(rng, shift=nkv.RopeShift())
    snap = src.export_seq(1)
    target = make(capacity=8, max_seqs=2, shift=nkv.RopeShift())
    fill(target, 0, range(4), rng)
    fill(target, 1, [3, 20], rng)
    target.start_forward([4], [0])
    fp = snap.fingerprint
    part = snap.parts[0]

    def built(**kw):
        args = dict(positions=part.positions, keys=part.keys, values=part.values,
                    k_format=part.k_format, v_format=part.v_format)
        args.update(kw)
        return SeqSnapshot(parts=(SnapshotPart(**args),), fingerprint=kw.pop("fp", fp),
                           head_range=(0, H))

    cases = [
        # the model fingerprint: a strict state load's check, naming the field
        (lambda: target.import_seq(0, make(capacity=8, max_seqs=2).export_seq(0)),
         StateError, "shift.type"),
        (lambda: target.import_seq(0, SeqSnapshot(parts=snap.parts, head_range=(0, H),
                                                  fingerprint=dict(fp, swa_window=4))),
         StateError, "swa_window"),
        (lambda: target.import_seq(0, built(keys=part.keys[:1], values=part.values[:1])),
         ValueError, "1 layers"),
        (lambda: target.import_seq(0, built(keys=[k[..., :16] for k in part.keys])),
         ValueError, "wide"),
        (lambda: target.import_seq(0, built(
            keys=[np.zeros((len(part.positions), H, 34), np.uint8)] * L, k_format="q8_0")),
         ValueError, "q8_0"),
        (lambda: target.import_seq(0, SeqSnapshot(
            parts=(part._heads(0, 1),), fingerprint=fp, head_range=(1, 2))),
         ValueError, "head_range"),
        (lambda: target.import_seq(0, snap), ValueError, "already holds position"),
        (lambda: target.import_seq(1, snap), ValueError, r"position\(s\) 3\b"),
        (lambda: target.import_seq(1, snap, at=18), ValueError, "20"),
        (lambda: target.import_seq(1, snap, at=2**31 - 5), ValueError, "past"),
        (lambda: target.import_seq(1, snap, at=-1), ValueError, "at must"),
        (lambda: target.import_seq(1, snap, at=1.5), ValueError, "at must"),
        (lambda: target.import_seq(1, _wide(target, 11)), KVCacheFullError, "no room"),
        (lambda: target.import_seq(2, snap), ValueError, "seq must"),
        (lambda: target.import_seq(1, "snap"), ValueError, "SeqSnapshot"),
        (lambda: target.export_seq(0, "a"), ValueError, "p0"),
        (lambda: target.export_seq(0, device=1), ValueError, "device"),
    ]
    for fn, exc, match in cases:
        _refuse(target, fn, exc, match)
    # no shift: a move is refused, positions as saved are fine
    plain = make(capacity=8, max_seqs=2)
    psnap = scattered_source(rng).export_seq(1)
    _refuse(plain, lambda: plain.import_seq(0, psnap, at=5), NotSupportedError, "shift")
    plain.import_seq(0, psnap, at=0)
    # a closed cache
    plain.close()
    with pytest.raises(nkv.KVCacheError, match="closed"):
        plain.import_seq(1, psnap)


def test_constructor_checks():
    part = dict(positions=np.arange(3), keys=[np.zeros((3, H, D), np.float16)],
                values=[np.zeros((3, H, DV), np.float16)], k_format="float16",
                v_format="float16")
    SnapshotPart(**part)
    SnapshotPart(**dict(part, positions=np.array([0, 1, 1])))   # a position held twice
    for change, match in [(dict(positions=np.array([0, 2, 1])), "ascending"),
                          (dict(positions=np.array([1, 1, 0])), "ascending"),
                          (dict(positions=np.array([-1, 0, 1])), "outside"),
                          (dict(positions=np.zeros((3, 1), int)), "1-D"),
                          (dict(k_format="float64"), "k_format"),
                          (dict(keys=[np.zeros((3, H, D), np.float32)]), "dtype"),
                          (dict(keys=[np.zeros((4, H, D), np.float16)]), "one row"),
                          (dict(values=[np.zeros((3, 1, DV), np.float16)]), "same heads"),
                          (dict(keys=np.zeros((3, H, D), np.float16)), "list"),
                          (dict(keys=[]), "at least one")]:
        with pytest.raises(ValueError, match=match):
            SnapshotPart(**dict(part, **change))
    p = SnapshotPart(**part)
    with pytest.raises(ValueError, match="heads"):
        SeqSnapshot(parts=(p,), fingerprint={}, head_range=(0, 3))
    with pytest.raises(ValueError, match="head_range"):
        SeqSnapshot(parts=(p,), fingerprint={}, head_range=(2, 2))
    with pytest.raises(ValueError, match="parts"):
        SeqSnapshot(parts=(), fingerprint={}, head_range=(0, H))


def test_select_and_concat_heads():
    rng = np.random.default_rng(12)
    src = scattered_source(rng, k_dtype="q8_0")
    snap = src.export_seq(1)
    lo, hi = snap.select_heads(0, 1), snap.select_heads(1, 2)
    assert lo.head_range == (0, 1) and hi.head_range == (1, 2)
    assert same(host(lo.parts[0].keys[1]), host(snap.parts[0].keys[1])[:, :1])
    joined = SeqSnapshot.concat_heads([hi, lo])
    assert joined.head_range == (0, 2)
    assert_rows(part_rows(joined.parts[0]), part_rows(snap.parts[0]))
    dst = make(k_dtype="q8_0")
    dst.import_seq(0, joined)
    assert_rows(seq_rows(dst, 0), seq_rows(src, 1))
    with pytest.raises(ValueError, match="adjacent"):
        SeqSnapshot.concat_heads([lo, lo])
    with pytest.raises(ValueError, match="positions"):
        SeqSnapshot.concat_heads([lo, src.export_seq(1, 0, 3).select_heads(1, 2)])
    with pytest.raises(ValueError, match="head_range"):
        snap.select_heads(1, 3)


# ============================================================================ bytes
@pytest.fixture(scope="module")
def blob():
    rng = np.random.default_rng(13)
    return scattered_source(rng, k_dtype="q4_0").export_seq(1).to_bytes()


def test_bytes_are_a_state_and_read_causal_seq(blob):
    info = state.read_info(blob)
    assert info["kind"] == "seq-snapshot" and info["config"]["head_range"] == [0, H]
    rng = np.random.default_rng(14)
    src = scattered_source(rng)
    from_state = SeqSnapshot.from_bytes(src.state_bytes(1))
    assert_rows(part_rows(from_state.parts[0]), seq_rows(src, 1))
    assert from_state.fingerprint == state.fingerprint(src)
    with pytest.raises(StateError, match="one sequence"):
        SeqSnapshot.from_bytes(src.state_bytes())
    with pytest.raises(ValueError, match="bytes-like"):
        SeqSnapshot.from_bytes("text")
    # a seq-snapshot is not a state load_state takes
    with pytest.raises(StateError, match="kind"):
        src.load_state_bytes(blob, 0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_bytes_are_state_errors(blob, data):
    """Truncations and bit flips anywhere: StateError, never another exception or a crash."""
    raw = bytearray(blob)
    kind = data.draw(st.sampled_from(["truncate", "flip", "both"]))
    if kind in ("flip", "both"):
        for i in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=3,
                                    unique=True)):
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
    if kind in ("truncate", "both"):
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    try:
        SeqSnapshot.from_bytes(bytes(raw))
    except StateError:
        return
    # a flip the codec cannot see (none: the checksum covers header and data) would land here
    pytest.fail("corrupted bytes were accepted")


# ============================================================================ devices
def test_kernel_device_round_trip_and_at(kernel_device):
    """The simulator (or a GPU): export (device and host rows), import scattered, at=."""
    rng = np.random.default_rng(15)
    rope = nkv.RopeShift()
    src = scattered_source(rng, device=kernel_device, shift=rope, capacity=8, dtype="float32")
    snap = src.export_seq(1, device=True)
    host_snap = src.export_seq(1)
    assert all(isinstance(k, np.ndarray) for k in host_snap.parts[0].keys)
    assert_rows(part_rows(host_snap.parts[0]), seq_rows(src, 1))
    dst = make(kernel_device, capacity=8, shift=rope, dtype="float32", permuted_v=True)
    fill(dst, 0, range(3), rng)
    dst.import_seq(1, snap)
    assert_rows(seq_rows(dst, 1), seq_rows(src, 1))
    dst.import_seq(2, host_snap, at=30)
    pos, k, _ = seq_rows(dst, 2)
    assert pos.tolist() == list(range(30, 39))
    want = rope_ref(seq_rows(src, 1)[1], np.full(9, 30))
    assert np.allclose(k, want, atol=2e-5, rtol=0)


def test_cuda_transfers_go_through_pinned_buffers_on_the_cache_stream(monkeypatch):
    """The cuda half of export/import (no GPU here: ``fake_cupy`` records what a GPU would be
    asked): device rows come to the host through one pinned buffer, copied on the storage's
    stream, which alone is synchronised; host rows go up the same way."""
    import sys
    from types import SimpleNamespace
    from fake_cupy import FakeStream, fake_cupy
    cp = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    stream = FakeStream(cp, 0x77)
    storage = SimpleNamespace(stream=stream)
    rng = np.random.default_rng(16)
    rows = [rng.standard_normal((5, H, D)).astype(np.float16),
            rng.integers(0, 255, (5, H, 34), dtype=np.uint8)]
    spaced = np.zeros((10, H, D), np.float16)
    spaced[::2] = rows[0]
    strided = spaced[::2]                                # a non-contiguous view
    assert not strided.flags.c_contiguous
    keys, values = snapmod._to_host_pinned(storage, [cp.asarray(rows[0])],
                                           [cp.asarray(rows[1])])
    assert same(keys[0], rows[0]) and same(values[0], rows[1])
    assert [e[0] for e in cp.log].count("pinned_alloc") == 1
    assert [e for e in cp.log if e[0] == "d2h"] == [
        ("d2h", 0x77, rows[0].nbytes, keys[0].ctypes.data),
        ("d2h", 0x77, rows[1].nbytes, values[0].ctypes.data)]
    assert stream.synchronized == 1
    cp.log.clear()
    devs, pinned = snapmod._to_device_pinned(storage, [strided, rows[1]])
    assert same(devs[0].get(), rows[0]) and same(devs[1].get(), rows[1])
    assert [e[0] for e in cp.log].count("pinned_alloc") == 1
    assert [(e[0], e[1], e[2]) for e in cp.log if e[0] == "h2d"] == [
        ("h2d", 0x77, rows[0].nbytes), ("h2d", 0x77, rows[1].nbytes)]


def test_bench_section_runs_and_judges_the_target():
    from numbakv.tools import bench_snapshot
    rows = bench_snapshot.run("cpu", "float16", layers=2, heads=2, dim=32, tokens=48,
                              budget=0.01, min_reps=2)
    assert [r["case"] for r in rows] == ["views", "gather", "export_gather",
                                         "export_gather_pooled", "bytes"]
    assert all(r["bytes"] == 2 * 2 * 48 * 2 * 32 * 2 and r["fraction"] > 0 for r in rows)
    assert all(r["clock"] == "thread CPU" for r in rows)
    views, interleaved = bench_snapshot.targets(rows)
    assert views["status"] in ("met", "missed") and "50%" in views["target"]
    assert interleaved["status"] in ("met", "missed") and "interleaved" in interleaved["target"]
    assert "views" in "\n".join(bench_snapshot.format_lines(rows))


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6), st.booleans()),
                    min_size=1, max_size=8),
       seq=st.integers(0, 2), span=st.tuples(st.integers(0, 20), st.integers(0, 40)),
       busy=st.integers(0, 10), permuted=st.booleans())
def test_random_layouts_round_trip(ops, seq, span, busy, permuted):
    """Whatever cells the source scattered the sequence over and whatever the destination
    holds, the imported rows are the exported ones, position by position."""
    rng = np.random.default_rng(len(ops) * 31 + busy)
    src = make(capacity=40, max_seqs=3)
    nxt = [0, 0, 0]
    for s, n, drop in ops:
        fill(src, s, range(nxt[s], nxt[s] + n), rng)
        nxt[s] += n
        if drop and nxt[s] > 2:
            src.seq_rm(s, nxt[s] - 2, nxt[s] - 1)          # a hole
    p0, p1 = min(span), max(span)
    snap = src.export_seq(seq, p0, p1)
    pos, k, v = seq_rows(src, seq)
    sel = (pos >= p0) & (pos < p1)
    assert_rows(part_rows(snap.parts[0]), (pos[sel], k[:, sel], v[:, sel]))
    dst = make(capacity=30, max_seqs=2, permuted_v=permuted)
    if busy:
        fill(dst, 0, range(busy), rng)
        dst.seq_rm(0, 0, busy // 2)
    before = frozen(dst)
    if len(snap) > dst.cells.n_free:
        with pytest.raises(KVCacheFullError):
            dst.import_seq(1, snap)
        assert_unchanged(dst, before)
        return
    assert dst.import_seq(1, snap) == len(snap)
    assert_rows(seq_rows(dst, 1), (pos[sel], k[:, sel], v[:, sel]))
    dst.cells.check_consistency()


def test_bench_command_has_the_section():
    from numbakv.tools import bench
    s = bench.BenchSettings(device="cpu", layers=2, kv_heads=2, head_dim=16, budget=0.005,
                            sections=["snapshot"], quick=True)
    res = bench.run_bench(s)
    assert [r["case"] for r in res["snapshot"]] == ["views", "gather", "export_gather",
                                                    "export_gather_pooled", "bytes"]
    assert any("snapshot export+import" in t["target"] for t in res["targets"])
    assert "Snapshots:" in bench.format_report(res)
