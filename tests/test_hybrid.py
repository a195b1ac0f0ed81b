"""HybridCache: attention K/V + recurrent state behind one cache, every operation all or nothing
across both halves (compared array by array), one state file, snapshots carrying both halves."""

import numpy as np
import pytest

import numbakv as nkv
from numbakv.dist import table_digest
from numbakv.errors import KVCacheFullError, NotSupportedError, StateError

KINDS = ["recurrent", "attention", "recurrent", "attention"]
SPECS = [nkv.StateSpec("conv", (2, 4), "bfloat16"), nkv.StateSpec("ssm", (2, 2, 2), "float32")]
H, D = 2, 8


def make(device="cpu", capacity=64, max_seqs=3, shift=True, every=4, points=4, kinds=KINDS,
         specs=SPECS, wrapper=False):
    n_att = kinds.count("attention")
    cfg = nkv.CacheConfig(n_layers=n_att, n_kv_heads=H, head_dim=D, dtype="float32",
                          capacity=capacity, max_seqs=max_seqs, device=device)
    shift_fn = nkv.RopeShift() if shift else None
    if wrapper:
        attn = nkv.WrapperCache([nkv.CausalCache(cfg, shift=shift_fn),
                                 nkv.CausalCache(cfg, shift=shift_fn, swa_window=8)],
                                layer_groups=None)
    else:
        attn = nkv.CausalCache(cfg, shift=shift_fn)
    rc = nkv.RecurrentCache(nkv.RecurrentConfig(kinds.count("recurrent"), specs,
                                                max_seqs=max_seqs, restore_every=every,
                                                max_restore_points=points, device=device))
    return nkv.HybridCache(attn, rc, kinds)


def everything(hc):
    caches = hc.attn.caches if isinstance(hc.attn, nkv.WrapperCache) else [hc.attn]
    kv = [(np.array(c.storage.keys, copy=True), np.array(c.storage.values, copy=True))
          for c in caches]
    rc = hc.rc
    return (table_digest(hc.attn), kv, {n: np.array(a, copy=True) for n, a in rc.pool.items()},
            list(rc._lo), list(rc._hi),
            [{q: (p.row, p.explicit, p.missing) for q, p in pts.items()} for pts in rc._points],
            [set(m) for m in rc._marks], rc._refs.copy(), list(rc._free))


def same(a, b):
    assert a[0] == b[0]
    for (k1, v1), (k2, v2) in zip(a[1], b[1]):
        np.testing.assert_array_equal(k1, k2)
        np.testing.assert_array_equal(v1, v2)
    for n in a[2]:
        np.testing.assert_array_equal(a[2][n], b[2][n])
    for x, y in zip(a[3:], b[3:]):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


def run(hc, seq, tokens, start, keep=True):
    """A toy hybrid model's forward over tokens of one sequence: K/V from the token ids,
    recurrence state = 0.5 * state + token; restore points where the cache asks."""
    n = len(tokens)
    pos = np.arange(start, start + n)
    hc.start_forward(pos, [seq] * n)
    plan = hc.restore_plan(seq, n)
    for layer, kind in enumerate(hc.layer_kinds):
        hc.set_layer(layer)
        if kind == "attention":
            cfg = (hc.attn.caches[0] if isinstance(hc.attn, nkv.WrapperCache) else hc.attn).config
            k = np.array(tokens, np.float32)[:, None, None] + \
                np.zeros((n, H, cfg.head_dim), np.float32) + layer
            hc.put(k, -k)
            continue
        done, cuts = 0, {}
        for cut in plan:
            for t in tokens[done:cut]:
                v = hc.state_views(layer, [seq])
                v["ssm"][0] = v["ssm"][0] * np.float32(0.5) + np.float32(t + layer)
                v["conv"].bits[0, 0, :] = t
            done = cut
            if keep and cut < n:
                hc.keep_restore_point(seq, start + cut, {nm: a[0] for nm, a in
                                                         hc.read_states(layer, [seq]).items()},
                                      layer=layer)
    if keep:
        hc.keep_restore_point(seq, start + n)


def expect_state(hc, seq, tokens):
    for layer, kind in enumerate(hc.layer_kinds):
        if kind != "recurrent":
            continue
        ssm = np.float32(0)
        for t in tokens:
            ssm = ssm * np.float32(0.5) + np.float32(t + layer)
        got = hc.read_states(layer, [seq])
        np.testing.assert_array_equal(got["ssm"][0], np.full((2, 2, 2), ssm, np.float32))
        assert (got["conv"][0, 0] == (tokens[-1] if tokens else 0)).all()


def test_construction_checks():
    hc = make()
    assert hc.n_layers == 4 and hc._attn_of == [-1, 0, -1, 1] and hc._rec_of == [0, -1, 1, -1]
    with pytest.raises(ValueError, match="layer_kinds"):
        nkv.HybridCache(hc.attn, hc.rc, ["recurrent", "mamba"])
    with pytest.raises(ValueError, match="n_layers"):
        nkv.HybridCache(hc.attn, hc.rc, KINDS + ["attention"])
    other = make(max_seqs=2)
    with pytest.raises(ValueError, match="max_seqs"):
        nkv.HybridCache(hc.attn, other.rc, KINDS)
    with pytest.raises(ValueError, match="RecurrentCache"):
        nkv.HybridCache(hc.attn, hc.attn, KINDS)
    hc.start_forward([0], [0])
    hc.set_layer(0)
    with pytest.raises(ValueError, match="recurrent layer"):
        hc.put(np.zeros((1, H, D), np.float32), np.zeros((1, H, D), np.float32))
    with pytest.raises(ValueError, match="attention layer"):
        hc.state_views(1, [0])


def test_forward_and_positions(device):
    hc = make(device)
    run(hc, 0, [1, 2, 3, 4, 5], 0)
    run(hc, 1, [7, 7], 0)
    expect_state(hc, 0, [1, 2, 3, 4, 5])
    assert hc.seq_pos_min(0) == 0 and hc.seq_pos_max(0) == 4
    assert hc.restore_points(0) == [4, 5]
    hc.set_layer(1)
    k, v, mask = hc.get()
    assert k.shape[1:] == (H, D)
    run(hc, 0, [6], 5)
    expect_state(hc, 0, [1, 2, 3, 4, 5, 6])


def test_refusals_change_neither_half():
    hc = make(capacity=8, max_seqs=2)
    run(hc, 0, [1, 2, 3, 4, 5, 6], 0)
    before = everything(hc)
    assert hc.seq_rm(0, 2, 4) is False                 # the middle: recurrent refuses
    assert hc.seq_rm(0, 5, None) is False              # no restore point at 5
    assert hc.rollback(0, 3) is False
    with pytest.raises(ValueError, match="continues at position 6"):
        hc.start_forward([9], [0])                     # recurrent refuses a gap
    with pytest.raises(KVCacheFullError):
        hc.start_forward(np.arange(0, 11), [1] * 11)   # attention refuses: no room
    with pytest.raises(ValueError, match="restore point 3 of sequence 0 is not held"):
        hc.seq_cp(0, 1, 0, 3)
    with pytest.raises(ValueError, match="restore point 5 is not held"):
        hc.remove(0, 5)
    with pytest.raises(NotSupportedError, match="recurrent"):
        hc.remove(0, 1, 3)
    with pytest.raises(ValueError, match="would put its last positions before"):
        hc.seq_add(0, 3, None, -10)
    same(before, everything(hc))
    noshift = make(capacity=8, max_seqs=2, shift=False)
    run(noshift, 0, [1, 2], 0)
    before = everything(noshift)
    with pytest.raises(NotSupportedError):
        noshift.seq_add(0, 0, None, 5)                # attention refuses: rc unchanged
    same(before, everything(noshift))


def test_rollback_seq_rm_and_copies_move_both_halves():
    hc = make(max_seqs=3)
    run(hc, 0, [1, 2, 3, 4, 5, 6], 0)
    assert hc.rollback(0, 4)
    assert hc.attn.seq_pos_max(0) == 3 and hc.rc.seq_pos_max(0) == 3
    expect_state(hc, 0, [1, 2, 3, 4])
    run(hc, 0, [9, 9], 4)
    expect_state(hc, 0, [1, 2, 3, 4, 9, 9])
    hc.copy_prefix(0, 1, 4)                           # restore point at 4: state there copied
    assert hc.seq_pos_max(1) == 3
    expect_state(hc, 1, [1, 2, 3, 4])
    hc.seq_cp(0, 2)
    expect_state(hc, 2, [1, 2, 3, 4, 9, 9])
    assert hc.seq_pos_max(2) == 5
    assert hc.seq_rm(2, 4, None)                      # back to the shared point at 4
    expect_state(hc, 2, [1, 2, 3, 4])
    hc.remove(2, 0)
    assert hc.seq_pos_max(2) == -1
    hc.seq_keep(0)
    assert hc.seq_pos_max(1) == -1 and hc.seq_pos_max(0) == 5
    hc.seq_add(0, 0, None, 3)
    assert (hc.seq_pos_min(0), hc.seq_pos_max(0)) == (3, 8)
    assert hc.can_resume(0, 9) and not hc.can_resume(0, 6)


def test_snapshot_carries_both_halves(device):
    hc = make(device)
    run(hc, 0, [1, 2, 3, 4, 5, 6], 0)
    snap = hc.export_seq(0)
    assert snap.restore_points == [4, 6] and snap.layer_kinds == tuple(KINDS)
    back = nkv.SeqSnapshot.from_bytes(snap.to_bytes())
    assert back.restore_points == [4, 6] and back.state_nbytes == snap.state_nbytes
    other = make(device)
    assert other.import_seq(1, back) == 6
    expect_state(other, 1, [1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(other.export_seq(1).parts[0].keys[0],
                                  snap.parts[0].keys[0])
    assert other.restore_points(1) == [4, 6]
    # a prefix that ends between restore points serves only up to the deepest one
    part = hc.export_seq(0, 0, 5)
    assert part.restore_points == [4]
    assert other.import_seq(2, part, at=0) == 4
    assert other.seq_pos_max(2) == 3
    expect_state(other, 2, [1, 2, 3, 4])
    # the rest, chained on
    rest = hc.export_seq(0, 4, None)
    assert other.import_seq(2, rest) == 2
    expect_state(other, 2, [1, 2, 3, 4, 5, 6])


def test_snapshot_refusals_change_nothing():
    hc = make()
    run(hc, 0, [1, 2, 3, 4, 5], 0)
    snap = hc.export_seq(0)
    # a hybrid snapshot into an attention-only cache
    attn_only = make().attn
    digest = table_digest(attn_only)
    with pytest.raises(ValueError, match="HybridCache"):
        attn_only.import_seq(0, snap)
    assert table_digest(attn_only) == digest
    # an attention-only snapshot into a hybrid
    target = make()
    before = everything(target)
    with pytest.raises(ValueError, match="no recurrent state"):
        target.import_seq(0, snap.attention_only())
    # another layer layout, another state layout
    with pytest.raises(StateError, match="layer layout"):
        make(kinds=["attention", "recurrent", "recurrent", "attention"]).import_seq(0, snap)
    bad = make(specs=[nkv.StateSpec("conv", (2, 4), "float16"), SPECS[1]])
    with pytest.raises(StateError, match="dtype"):
        bad.import_seq(0, snap)
    # positions the sequence holds: the attention half refuses after the recurrent checks
    run(target, 1, [9], 0)
    before = everything(target)
    with pytest.raises(ValueError):
        target.import_seq(1, snap)
    same(before, everything(target))
    # hostile bytes
    data = bytearray(snap.to_bytes())
    i = data.find(b'"layer_kinds":["recurrent"')
    data[i + 16:i + 27] = b'["mamba"   '
    with pytest.raises(StateError):
        nkv.SeqSnapshot.from_bytes(bytes(data))
    with pytest.raises(StateError):
        nkv.SeqSnapshot.from_bytes(snap.to_bytes()[:-7])


def test_state_file_holds_both_halves(tmp_path, device):
    hc = make(device)
    run(hc, 0, [1, 2, 3, 4, 5], 0)
    run(hc, 2, [8, 8], 3)
    path = tmp_path / "h.safetensors"
    hc.save_state(path, tokens=[1, 2, 3], metadata={"a": "b"})
    other = make(device)
    info = other.load_state(path)
    assert info["tokens"] == [1, 2, 3] and info["metadata"] == {"a": "b"}
    expect_state(other, 0, [1, 2, 3, 4, 5])
    expect_state(other, 2, [8, 8])
    assert other.restore_points(0) == hc.restore_points(0)
    for s in (0, 2):
        a, b = other.export_seq(s), hc.export_seq(s)
        np.testing.assert_array_equal(a.positions, b.positions)
        np.testing.assert_array_equal(a.parts[0].keys[1], b.parts[0].keys[1])
    one = make(device)
    one.load_state_bytes(hc.state_bytes(0), 1)
    expect_state(one, 1, [1, 2, 3, 4, 5])
    assert one.attn.seq_pos_max(1) == 4
    # refusals: nothing changes in either half
    before = everything(one)
    with pytest.raises(StateError, match="layout"):
        one.load_state_bytes(make(device, specs=[SPECS[0]]).state_bytes(0), 1)
    with pytest.raises(StateError, match="layer layout"):
        one.load_state_bytes(make(device, kinds=["attention", "recurrent", "attention",
                                                 "recurrent"]).state_bytes(0), 1)
    with pytest.raises(StateError):
        one.load_state_bytes(hc.attn.state_bytes(0), 1)        # attention-only state
    with pytest.raises(StateError):
        one.rc.load_state_bytes(hc.state_bytes(0), 1)          # hybrid state into the rc alone
    wider = make(device, capacity=64)
    wider_cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=H, head_dim=2 * D, dtype="float32",
                                capacity=64, max_seqs=3, device=device)
    other_attn = nkv.HybridCache(nkv.CausalCache(wider_cfg, shift=nkv.RopeShift()), wider.rc,
                                 KINDS)
    run(other_attn, 0, [1, 2], 0)
    with pytest.raises(StateError):                            # attention half refuses last
        one.load_state_bytes(other_attn.state_bytes(0), 1)
    same(before, everything(one))


def test_wrapper_attention_half():
    hc = make(wrapper=True)
    run(hc, 0, list(range(1, 12)), 0)
    snap = hc.export_seq(0)
    assert len(snap.parts) == 2
    other = make(wrapper=True)
    assert other.import_seq(0, nkv.SeqSnapshot.from_bytes(snap.to_bytes())) == 11
    expect_state(other, 0, list(range(1, 12)))
    other.load_state_bytes(hc.state_bytes())
    expect_state(other, 0, list(range(1, 12)))


def test_attend_reads_the_attention_half():
    torch = pytest.importorskip("torch")
    from numbakv.attention import attend
    hc = make()
    run(hc, 0, [1, 2, 3], 0)
    run(hc, 0, [4, 5], 3)
    q = torch.randn(2, 4, D)
    hc.set_layer(3)
    got = attend(q, hc)
    want = attend(q, hc.attn)          # the attention half, layer 1 (model layer 3) selected
    assert torch.equal(got, want)
    hc.set_layer(2)
    with pytest.raises(ValueError, match="recurrent layer"):
        attend(q, hc)


@pytest.mark.parametrize("seed", [1, 2])
def test_random_operations_keep_both_halves_in_step(seed):
    """Random sequence operations on a hybrid: each either succeeds with both halves agreeing
    on every sequence's positions, or refuses (False / an exception) with every array and every
    piece of bookkeeping of both halves unchanged."""
    rng = np.random.default_rng(seed)
    hc = make(capacity=24, max_seqs=3, every=3, points=3)
    toks = {}
    ops = []
    for step in range(80):
        s, d = (int(x) for x in rng.integers(0, 3, 2))
        end = hc.rc.seq_pos_max(s) + 1
        r = lambda: int(rng.integers(0, end + 3))   # noqa: E731
        choice = str(rng.choice(["run", "run", "rollback", "seq_rm", "seq_cp", "copy_prefix",
                                 "remove", "seq_add", "seq_keep"]))
        calls = {"rollback": lambda: hc.rollback(s, r()),
                 "seq_rm": lambda: hc.seq_rm(s, r(), int(rng.choice([r(), -1]))),
                 "seq_cp": lambda: hc.seq_cp(s, d, 0, int(rng.choice([r(), -1]))),
                 "copy_prefix": lambda: hc.copy_prefix(s, d, r()),
                 "remove": lambda: hc.remove(s, r(), rng.choice([None, r()])),
                 "seq_add": lambda: hc.seq_add(s, r(), None, int(rng.integers(-3, 4))),
                 "seq_keep": lambda: hc.seq_keep(s)}
        before = everything(hc)
        try:
            if choice == "run":
                n = int(rng.integers(1, 5))
                run(hc, s, [int(t) for t in rng.integers(0, 9, n)], max(end, 0))
                ok = True
            else:
                ok = calls[choice]()
        except (ValueError, NotSupportedError, KVCacheFullError):
            ok = False
        ops.append((choice, s, ok))
        if ok is False:
            same(before, everything(hc))
        for q in range(3):
            assert hc.attn.seq_pos_max(q) == hc.rc.seq_pos_max(q), (ops[-3:], q)
            if hc.rc.seq_pos_max(q) >= 0:
                assert hc.attn.seq_pos_min(q) == hc.rc.seq_pos_min(q), (ops[-3:], q)
    assert any(ok for _, _, ok in ops) and not all(ok is not False for _, _, ok in ops)
