"""Fidelity round 3 (issue 29): where numbakv met its references' interfaces only in part, and
four reliability defects. Each test below failed on the code before its fix."""

from __future__ import annotations

import numpy as np
import pytest

import numbakv as nkv
from numbakv import KVCacheFullError

from helpers import dev, host, random_weight_model

H, D = 2, 4


def _cfg(**kw):
    base = dict(n_layers=2, n_kv_heads=H, head_dim=D, dtype="float32", capacity=8, max_seqs=3,
                max_batch=8, device="cpu")
    base.update(kw)
    return nkv.CacheConfig(**base)


def _fill(cache, positions, seqs, value=1.0):
    """One forward pass that puts ``value`` + batch index in every layer."""
    cache.start_forward(positions, seqs)
    n_layers = getattr(cache, "n_layers", None) or cache.config.n_layers
    rows = (value + np.arange(len(positions), dtype=np.float32))[:, None, None]
    kv = np.broadcast_to(rows, (len(positions), H, D)).astype(np.float32)
    for layer in range(n_layers):
        cache.set_layer(layer)
        cache.put(kv, kv)


def _everything(cache):
    """Every array of every cell table (and the K/V pool) of a cache, as bytes: what must not
    change when a call is refused."""
    caches = getattr(cache, "caches", None) or [cache]
    out = []
    for c in caches:
        tables = [s.cells for s in c.streams] if hasattr(c, "streams") else [c.cells]
        for t in tables:
            for name in sorted(vars(t)):
                v = getattr(t, name)
                if isinstance(v, np.ndarray):
                    out.append((name, v.tobytes()))
        out.append(("keys", np.asarray(c.storage.keys).tobytes()))
        out.append(("values", np.asarray(c.storage.values).tobytes()))
    return out


def _observable(cache):
    """Every cell record and the K/V of every used cell, per cell table (what a state saves;
    not the scatter head)."""
    caches = getattr(cache, "caches", None) or [cache]
    out = []
    for c in caches:
        for leaf in getattr(c, "streams", None) or [c]:
            cells = leaf.cells.cells
            used = np.flatnonzero(cells["pos"] >= 0).astype(np.int32)
            k, v = leaf.storage.read_cells(used)
            out.append((cells.tobytes(), np.asarray(k).tobytes(), np.asarray(v).tobytes()))
    return out


def _unified(**kw):
    return nkv.CausalCache(_cfg(**kw), shift=nkv.RopeShift(base=100.0))


def _streams(**kw):
    return nkv.CausalCache(_cfg(unified=False, **kw), shift=nkv.RopeShift(base=100.0))


def _wrapper(kind="unified"):
    make = _unified if kind == "unified" else _streams
    return nkv.WrapperCache([make(n_layers=1), make(n_layers=1)], layer_groups=[0, 1])


KINDS = ["unified", "streams", "wrapper", "wrapper-streams"]


def _make(kind):
    return {"unified": _unified, "streams": _streams, "wrapper": lambda: _wrapper("unified"),
            "wrapper-streams": lambda: _wrapper("streams")}[kind]()


# ------------------------------------------------------------------------------------------
# 4. seq_cp into positions the destination already holds
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_seq_cp_into_held_positions_is_refused(kind):
    c = _make(kind)
    _fill(c, [0, 1, 2, 3], [0, 0, 0, 0])
    _fill(c, [0, 1], [1, 1], value=10.0)
    before = _everything(c)
    with pytest.raises(ValueError, match=r"seq_cp.*\[0, 1\]"):
        c.seq_cp(0, 1)
    assert _everything(c) == before
    # positions the destination does not hold are still copied
    c.seq_cp(0, 1, 2, None)
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (0, 3)


def test_seq_cp_unified_holds_each_position_once():
    c = _unified()
    _fill(c, [0, 1, 2, 3], [0, 0, 0, 0])
    c.seq_cp(0, 1)
    c.seq_cp(0, 1)          # dst already shares those very cells: nothing to add, accepted
    c.start_forward([4], [1])
    assert c.page_table().kv_positions.tolist() == [0, 1, 2, 3, 4]


# ------------------------------------------------------------------------------------------
# 8. a second put for the same layer in one forward pass
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_second_put_for_a_layer_is_refused(kind):
    c = _make(kind)
    c.start_forward([0, 1], [0, 0])
    kv = np.ones((2, H, D), np.float32)
    c.set_layer(0)
    c.put(kv, kv)
    before = _everything(c)
    with pytest.raises(ValueError, match="set_layer"):
        c.put(2 * kv, 2 * kv)          # a loop that forgot set_layer
    assert _everything(c) == before
    c.set_layer(1)
    c.put(kv, kv)                      # the next layer is fine
    c.set_layer(0)
    c.put(3 * kv, 3 * kv)              # set_layer again: an overwrite on purpose
    c.start_forward([2], [0])          # a new pass writes every layer again
    c.set_layer(0)
    c.put(kv[:1], kv[:1])


def test_second_put_refused_in_a_reserve_pass_too():
    c = _unified()
    c.start_forward([0, 1], [0, 0], reserve=True)
    kv = np.ones((2, H, D), np.float32)
    c.put(kv, kv)
    with pytest.raises(ValueError, match="set_layer"):
        c.put(kv, kv)


# ------------------------------------------------------------------------------------------
# 6. stream caches: the whole batch is validated before any stream reports it is full
# ------------------------------------------------------------------------------------------

def test_streams_validate_the_whole_batch_before_room():
    c = _streams(capacity=4)
    _fill(c, [0, 1, 2, 3], [0, 0, 0, 0])     # stream 0 is full
    _fill(c, [0, 1], [1, 1])
    before = _everything(c)
    # sequence 0 has no room, and sequence 1 re-puts position 1: the ValueError wins
    with pytest.raises(ValueError, match=r"sequence 1, position 1"):
        c.start_forward([4, 1], [0, 1])
    assert _everything(c) == before
    with pytest.raises(KVCacheFullError):
        c.start_forward([4, 2], [0, 1])
    assert _everything(c) == before


# ------------------------------------------------------------------------------------------
# 1. StepCache / RotatingCache: the seed's and mlx-lm's state protocol
# ------------------------------------------------------------------------------------------

def _chunk(rng, n):
    k = rng.standard_normal((1, H, n, D)).astype(np.float32)
    return k, -k


@pytest.mark.parametrize("make", [lambda: nkv.StepCache(4, device="cpu"),
                                  lambda: nkv.RotatingCache(5, 2, device="cpu")],
                         ids=["step", "rotating"])
def test_simple_state_is_keys_values(make, tmp_path):
    import json
    c = make()
    assert c.state() == (None, None)
    rng = np.random.default_rng(0)
    for n in (3, 1, 1, 1, 1, 2, 1):          # the ring wraps and is rotated
        c.update(*_chunk(rng, n))
    keys, values = c.state()                  # code ported from the seed / mlx-lm
    assert keys.shape[:2] == (1, H) and keys.shape[3] == D and values.shape == keys.shape
    meta = c.meta_state()
    assert json.loads(json.dumps(meta)) == meta     # plain ints and strings
    assert meta["offset"] == c.offset
    back = type(c).from_state((keys, values), meta, device="cpu")
    k2, v2 = back.state()
    assert np.array_equal(k2, keys) and np.array_equal(v2, values)
    assert back.meta_state() == meta and len(back) == len(c)
    # both go on identically
    k, v = _chunk(rng, 1)
    assert np.array_equal(c.update(k, v)[0], back.update(k, v)[0])
    # state files keep working
    c.save_state(tmp_path / "s.st")
    again = type(c).load_state(tmp_path / "s.st", device="cpu")
    assert again.meta_state() == c.meta_state()
    assert np.array_equal(again.state()[0], c.state()[0])
    with pytest.raises(ValueError, match="meta_state"):
        type(c).from_state((keys, values), device="cpu")
    with pytest.raises(ValueError, match="kind"):
        type(c).from_state((keys, values), {**meta, "kind": "nope"}, device="cpu")


# ------------------------------------------------------------------------------------------
# 5. a WrapperCache over stream caches saves and loads state
# ------------------------------------------------------------------------------------------

def _kv_of(cache, seq):
    """Every layer's K rows of ``seq``'s positions, by position, through the wrapper's groups."""
    out = []
    for c in cache.caches:
        if hasattr(c, "streams"):
            t, st = c.streams[seq].cells, c.streams[seq].storage
            cells = t.seq_cells(0)
        else:
            t, st = c.cells, c.storage
            cells = t.seq_cells(seq)
        order = np.argsort(t._pos[cells])
        out.append((t._pos[cells][order].tolist(),
                    np.asarray(st.read_cells(cells[order].astype(np.int32))[0]).tobytes()))
    return out


@pytest.mark.parametrize("other", ["wrapper-streams", "wrapper"])
def test_wrapper_over_streams_state_round_trips(other, tmp_path):
    w = _wrapper("streams")
    _fill(w, [0, 1, 2], [0, 0, 0])
    _fill(w, [0, 1], [2, 2], value=5.0)
    data = w.state_bytes(tokens=[7, 8, 9])
    fresh = _wrapper("streams")
    assert fresh.load_state_bytes(data)["tokens"] == [7, 8, 9]
    assert _observable(fresh) == _observable(w)
    w.save_state(tmp_path / "w.st")
    fresh2 = _wrapper("streams")
    fresh2.load_state(tmp_path / "w.st")
    assert _observable(fresh2) == _observable(w)
    # one sequence, into a wrapper over streams or over unified caches, as another sequence
    one = w.state_bytes(2)
    target = _make(other)
    target.load_state_bytes(one, 1)
    assert _kv_of(target, 1) == _kv_of(w, 2)
    assert target.seq_pos_max(1) == 1 and target.seq_pos_max(2) == -1
    # and the prompt cache's slot files
    pc = nkv.PromptCache(_wrapper("streams"), multi_user=True)
    slot, remaining = pc.load([11, 12, 13])
    _fill(pc.cache, list(range(len(remaining))), [slot] * len(remaining))
    pc.extend(slot, remaining)
    pc.release(slot)
    saved = pc.slot_bytes(slot)
    pc2 = nkv.PromptCache(_wrapper("streams"), multi_user=True)
    assert pc2.load_slot(saved, 1) == 1 and pc2.inputs(1) == [11, 12, 13]


def test_wrapper_state_refuses_another_layout():
    w = _wrapper("streams")
    _fill(w, [0, 1], [0, 0])
    data = w.state_bytes()
    plain = _wrapper("unified")
    before = _everything(plain)
    with pytest.raises(nkv.StateError):
        plain.load_state_bytes(data)
    assert _everything(plain) == before


def test_wrapper_state_error_does_not_call_streams_not_causal():
    w = _wrapper("streams")
    w.caches[0].close()
    with pytest.raises(nkv.KVCacheError) as e:
        w.state_bytes()
    assert "not a CausalCache" not in str(e.value)


# ------------------------------------------------------------------------------------------
# 3. shifting cells shared by several sequences: shared_shift="copy"
# ------------------------------------------------------------------------------------------

def _rows(cache, seq):
    """``{position: (K bytes, V bytes) over every layer}`` of what ``seq`` holds."""
    cache.apply_pending_shifts()
    cells = cache.cells.seq_cells(seq)
    k, v = (host(x) for x in cache.storage.read_cells(cells))
    pos = cache.cells._pos[cells]
    return {int(p): (k[:, i].tobytes(), v[:, i].tobytes()) for i, p in enumerate(pos)}


def _random_fill(cache, seq, n, rng, start=0):
    cache.start_forward(list(range(start, start + n)), [seq] * n)
    for layer in range(cache.config.n_layers):
        cache.set_layer(layer)
        k = rng.standard_normal((n, H, D)).astype(np.float32)
        cache.put(dev(k, cache.device), dev(-k, cache.device))


OPS = [("remove", lambda c, s: c.remove(s, 2, 4)),
       ("remove-shared-gap", lambda c, s: c.remove(s, 6, 7)),
       ("seq_add", lambda c, s: c.seq_add(s, 3, None, 5)),
       ("seq_add-drop", lambda c, s: c.seq_add(s, 0, 4, -2)),
       ("seq_div", lambda c, s: c.seq_div(s, 2, 9, 2))]


@pytest.mark.parametrize("name, op", OPS, ids=[n for n, _ in OPS])
def test_shared_shift_copy_equals_an_unshared_twin(name, op):
    """Forked seq 1 shares seq 0's first 8 cells; shifting seq 1 with shared_shift="copy" gives
    exactly what the same shift gives a twin cache where seq 1 holds its own copies, and seq 0
    keeps its positions and K/V."""
    _check_twin(op, "cpu")


def test_shared_shift_copy_on_the_kernel_device(kernel_device):
    """The same through the @cuda.jit move and rotary kernels (the simulator, or a GPU)."""
    _check_twin(OPS[0][1], kernel_device)


def _check_twin(op, device):
    shift = nkv.RopeShift(base=100.0)
    rng = np.random.default_rng(1)
    c = nkv.CausalCache(_cfg(capacity=16, max_seqs=2, device=device), shift=shift,
                        shared_shift="copy")
    _random_fill(c, 0, 8, rng)
    c.copy_prefix(0, 1, 8)
    _random_fill(c, 1, 2, rng, start=8)      # seq 1's own tail
    c.seq_add(0, 6, None, 1)                 # a pending shift the copies must carry
    c.seq_add(0, 6, None, -1)
    twin = nkv.CausalCache(_cfg(capacity=16, max_seqs=2, device=device), shift=shift)
    twin.load_state_bytes(c.state_bytes())
    rows1 = _rows(c, 1)
    twin.seq_rm(1)
    twin.load_state_bytes(c.state_bytes(1), 1)     # seq 1's own copies
    assert _rows(twin, 1) == rows1
    seq0 = _rows(c, 0)
    op(c, 1)
    op(twin, 1)
    assert _rows(c, 1) != rows1                  # seq 1 did move
    assert _rows(c, 1) == _rows(twin, 1)
    assert _rows(c, 0) == seq0
    c.cells.check_consistency()


def test_shared_shift_default_refuses_and_copy_refuses_without_room():
    rng = np.random.default_rng(2)
    c = nkv.CausalCache(_cfg(capacity=4, max_seqs=2), shift=nkv.RopeShift(base=100.0))
    _random_fill(c, 0, 6, rng)
    c.copy_prefix(0, 1, 6)
    with pytest.raises(nkv.NotSupportedError, match="shared"):
        c.remove(1, 0, 2)
    full = nkv.CausalCache(_cfg(capacity=4, max_seqs=2), shift=nkv.RopeShift(base=100.0),
                           shared_shift="copy")
    _random_fill(full, 0, 6, rng)
    full.copy_prefix(0, 1, 6)
    before = _everything(full)
    for call in (lambda: full.remove(1, 0, 2), lambda: full.seq_add(1, 0, None, 3),
                 lambda: full.seq_div(1, 0, None, 2)):
        with pytest.raises(KVCacheFullError, match="copies"):
            call()
        assert _everything(full) == before
    with pytest.raises(ValueError, match="shared_shift"):
        nkv.CausalCache(_cfg(), shared_shift="move")


def test_shared_shift_copy_is_all_or_nothing_when_the_rotation_fails():
    class Failing:
        def __call__(self, layer, key, deltas):
            raise RuntimeError("device failure")
    rng = np.random.default_rng(3)
    c = nkv.CausalCache(_cfg(capacity=16, max_seqs=2), shift=Failing(), shared_shift="copy")
    _random_fill(c, 0, 6, rng)
    c.copy_prefix(0, 1, 6)
    before = _everything(c)
    with pytest.raises(RuntimeError, match="device"):
        c.remove(1, 1, 3)
    assert _everything(c) == before


def test_shared_shift_copy_in_a_wrapper_is_all_or_nothing():
    rng = np.random.default_rng(4)
    shift = nkv.RopeShift(base=100.0)
    roomy = nkv.CausalCache(_cfg(n_layers=1, capacity=8, max_seqs=2), shift=shift)
    tight = nkv.CausalCache(_cfg(n_layers=1, capacity=4, max_seqs=2), shift=shift)
    w = nkv.WrapperCache([roomy, tight], layer_groups=[0, 1], shared_shift="copy")
    assert roomy.shared_shift == tight.shared_shift == "copy"
    w.start_forward(list(range(6)), [0] * 6)
    for layer in range(2):
        w.set_layer(layer)
        k = rng.standard_normal((6, H, D)).astype(np.float32)
        w.put(k, k)
    w.copy_prefix(0, 1, 6)
    before = _everything(w)
    with pytest.raises(KVCacheFullError):        # the tight group has 2 free cells, needs 4
        w.seq_add(1, 2, None, 1)
    assert _everything(w) == before
    w.seq_add(1, 4, None, 1)                     # two copies fit in both groups
    assert w.seq_pos_max(1) == 6 and w.seq_pos_max(0) == 5
    with pytest.raises(KVCacheFullError):
        w.remove(1, 0, 1)
    assert w.seq_pos_min(1) == 0


def test_streams_accept_shared_shift():
    c = nkv.CausalCache(_cfg(unified=False), shift=nkv.RopeShift(base=100.0), shared_shift="copy")
    assert c.shared_shift == "copy" and all(s.shared_shift == "copy" for s in c.streams)
    _fill(c, [0, 1, 2, 3], [0, 0, 0, 0])
    c.copy_prefix(0, 1, 4)
    c.remove(1, 0, 2)
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (0, 1)
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (0, 3)


def test_prompt_cache_shift_works_on_forked_slots():
    shift = nkv.RopeShift(base=100.0)
    c = nkv.CausalCache(_cfg(capacity=8, max_seqs=2, max_batch=8), shift=shift,
                        shared_shift="copy")
    pc = nkv.PromptCache(c, multi_user=True)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    slot, remaining = pc.load(prompt)
    _fill(c, list(range(len(remaining))), [slot] * len(remaining))
    pc.extend(slot, remaining)
    pc.release(slot)
    other, rest = pc.load(prompt[:6] + [9])      # forks the shared prefix into the other slot
    assert other != slot and len(rest) <= 2
    start = len(prompt[:6] + [9]) - len(rest)
    _fill(c, list(range(start, start + len(rest))), [other] * len(rest))
    pc.extend(other, rest)
    assert c.cells.shared_cells_in(other)
    discard = pc.shift(other, 1)                 # the shared prefix reaches past num_keep
    assert discard > 0 and len(pc.inputs(other)) == 7 - discard
    assert c.seq_pos_max(slot) == 6              # the other slot kept everything


def test_bench_fidelity_runs():
    """The benchmark section runs and reports its figures (timings are not asserted here)."""
    from numbakv.tools import bench_fidelity
    res = bench_fidelity.run(shared=16, own=4, n_layers=2, heads=2, dim=8, repeats=2)
    assert res["shared_cells_copied"] == 14
    assert min(res["copy_mode_ms"], res["unshared_twin_ms"], res["copy_alone_ms"]) > 0
    assert "extra / copy" in bench_fidelity.format_section(res)


# ------------------------------------------------------------------------------------------
# 2. llama.cpp's layer filter / reuse: CacheConfig(layer_reuse=...)
# ------------------------------------------------------------------------------------------

REUSE = (0, 1, 1, -1, 0)      # layer 2 reads layer 1, layer 4 reads layer 0, layer 3 has none


def _reuse_cache(**kw):
    cfg = _cfg(n_layers=5, layer_reuse=REUSE, **kw)
    return nkv.CausalCache(cfg, shift=nkv.RopeShift(base=100.0))


def _put_owners(cache, positions, seqs, rng):
    """A forward pass putting random K/V on the owning layers (0 and 1); returns them."""
    cache.start_forward(positions, seqs)
    out = {}
    for layer in (0, 1):
        cache.set_layer(layer)
        k = rng.standard_normal((len(positions), H, D)).astype(np.float32)
        cache.put(k, -k)
        out[layer] = k
    return out


def test_layer_reuse_config_checks_and_nbytes():
    plain = _cfg(n_layers=5)
    cfg = _cfg(n_layers=5, layer_reuse=REUSE)
    assert cfg.owner_layers == (0, 1) and cfg.n_stored_layers == 2
    assert cfg.storage_layers == (0, 1, 1, -1, 0)
    assert cfg.owner_layer(4) == 0 and cfg.owner_layer(3) == -1
    assert cfg.nbytes() * 5 == plain.nbytes() * 2
    c = nkv.CausalCache(cfg)
    assert c.storage.keys.shape[0] == 2            # storage for the owning layers only
    for bad, match in [((0, 1), "n_layers"), ((0, 2, 1, -1, 0), "own"), ((0, 1, 1, 5, 0), "-1"),
                       ((-1,) * 5, "at least one"), ((0, 1, 2, 2, 1.0), "layer_reuse\\[4\\]")]:
        with pytest.raises(ValueError, match=match):
            _cfg(n_layers=5, layer_reuse=bad)


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "streams"])
def test_layer_reuse_put_get_and_refusals(unified):
    rng = np.random.default_rng(5)
    c = _reuse_cache(unified=unified)
    kv = _put_owners(c, [0, 1, 2], [0, 0, 0], rng)
    for layer, src in ((2, 1), (4, 0)):
        c.set_layer(layer)
        with pytest.raises(ValueError, match=f"reuses layer {src}"):
            c.put(kv[0], kv[0])
        k, v, _ = c.get()
        c.set_layer(src)
        k2, v2, _ = c.get()
        assert np.array_equal(np.asarray(k), np.asarray(k2))
        assert np.array_equal(np.asarray(c.layer_pool(layer)[0]), np.asarray(c.layer_pool()[0]))
    c.set_layer(3)
    for call in (lambda: c.put(kv[0], kv[0]), c.get, c.layer_pool):
        with pytest.raises(ValueError, match="no K/V"):
            call()


def test_layer_reuse_shift_rotates_each_key_once_and_state_round_trips(tmp_path):
    rng = np.random.default_rng(6)
    c = _reuse_cache()
    ref = nkv.CausalCache(_cfg(n_layers=2), shift=nkv.RopeShift(base=100.0))
    kv = _put_owners(c, [0, 1, 2, 3], [0] * 4, rng)
    ref.start_forward([0, 1, 2, 3], [0] * 4)
    for layer in (0, 1):
        ref.set_layer(layer)
        ref.put(kv[layer], -kv[layer])
    for cache in (c, ref):
        cache.remove(0, 1, 2)         # positions 2, 3 move down, keys rotated once
        cache.defrag()
    assert np.array_equal(np.asarray(c.storage.keys), np.asarray(ref.storage.keys))
    data = c.state_bytes()
    fresh = _reuse_cache()
    fresh.load_state_bytes(data)
    assert np.array_equal(np.asarray(fresh.storage.keys), np.asarray(c.storage.keys))
    fresh.load_state_bytes(c.state_bytes(0), 0)
    with pytest.raises(nkv.StateError, match="layer_reuse"):
        nkv.CausalCache(_cfg(n_layers=5), shift=nkv.RopeShift(base=100.0)).load_state_bytes(data)


def test_layer_reuse_attend_reads_the_source_layer():
    torch = pytest.importorskip("torch")
    from numbakv.attention import attend
    rng = np.random.default_rng(7)
    c = _reuse_cache()
    _put_owners(c, [0, 1, 2], [0, 0, 0], rng)
    q = torch.from_numpy(rng.standard_normal((3, H, D)).astype(np.float32))
    c.set_layer(2)
    a = attend(q, c)
    c.set_layer(1)
    b = attend(q, c)
    assert torch.equal(a, b)


def test_layer_reuse_quantized_keys():
    rng = np.random.default_rng(8)
    cfg = nkv.CacheConfig(n_layers=3, n_kv_heads=1, head_dim=32, dtype="float32", capacity=8,
                          device="cpu", k_dtype="q8_0", v_dtype="q8_0", layer_reuse=(0, 0, -1))
    c = nkv.CausalCache(cfg, shift=nkv.RopeShift())
    c.start_forward([0, 1], [0, 0])
    c.set_layer(0)
    k = rng.standard_normal((2, 1, 32)).astype(np.float32)
    c.put(k, k)
    c.set_layer(1)
    k1 = np.asarray(c.get()[0]).copy()
    c.set_layer(0)
    assert np.array_equal(np.asarray(c.get()[0]), k1)
    assert c.config.nbytes() == 8 * 1 * 2 * 34


def _tiny_gemma3n():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma3nTextConfig"):
        pytest.skip("this transformers has no Gemma 3n")
    cfg = transformers.Gemma3nTextConfig(
        vocab_size=64, vocab_size_per_layer_input=64, hidden_size=64, intermediate_size=64,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        hidden_size_per_layer_input=8, sliding_window=4, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 3, laurel_rank=4,
        altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 6, max_position_embeddings=128)
    return random_weight_model(cfg)


def test_gemma3n_kv_sharing_logits_equal_its_own_forward():
    import torch
    from numbakv import hf
    model = _tiny_gemma3n()
    # layers 4 (sliding) and 5 (full) reuse the last earlier layer of their type: 2 and 3
    assert hf.kv_reuse_for(model.config) == [0, 1, 2, 3, 2, 3]
    cache = hf.cache_for(model, capacity=32, max_seqs=2, max_batch=16, device="cpu")
    groups = cache.caches
    assert [g.config.layer_reuse for g in groups] == [(0, 1, 1), (0, 1, 1)]
    assert sum(g.config.n_stored_layers for g in groups) == 4     # of 6 layers
    rng = np.random.default_rng(0)
    toks = [rng.integers(0, 64, 9).tolist(), rng.integers(0, 64, 7).tolist()]
    want = []
    for t in toks:
        with torch.no_grad():
            want.append(model(input_ids=torch.tensor(t)[None],
                              position_ids=torch.arange(len(t))[None]).logits[0])
    hf.attach(model, cache)
    try:
        got = [[], []]
        steps = [[(0, 0, 5), (1, 0, 4)], [(0, 5, 9), (1, 4, 5)], [(1, 5, 7)]]
        for step in steps:
            tokens, positions, seqs = [], [], []
            for s, a, b in step:
                tokens += toks[s][a:b]
                positions += range(a, b)
                seqs += [s] * (b - a)
            cache.start_forward(positions, seqs)
            with torch.no_grad():
                out = model(input_ids=torch.tensor(tokens)[None],
                            position_ids=torch.tensor(positions)[None]).logits[0]
            i = 0
            for s, a, b in step:
                got[s].append(out[i:i + b - a])
                i += b - a
    finally:
        hf.detach(model)
    for s in (0, 1):
        g = torch.cat(got[s])
        scale = max(1.0, float(want[s].abs().max()))
        assert float((g - want[s]).abs().max()) <= 2e-5 * scale


def test_layer_reuse_snapshots_hold_the_owning_layers():
    rng = np.random.default_rng(9)
    c = _reuse_cache()
    _put_owners(c, [0, 1, 2], [0, 0, 0], rng)
    snap = c.export_seq(0)
    assert snap.fingerprint["layer_reuse"] == list(REUSE)
    fresh = _reuse_cache()
    assert fresh.import_seq(1, nkv.SeqSnapshot.from_bytes(snap.to_bytes())) == 3
    assert _rows(fresh, 1) == _rows(c, 0)
    with pytest.raises((ValueError, nkv.StateError)):
        nkv.CausalCache(_cfg(n_layers=5), shift=nkv.RopeShift(base=100.0)).import_seq(0, snap)
