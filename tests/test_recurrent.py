"""RecurrentCache: state rows, restore points, llama.cpp's recurrent sequence rules, state files,
and the state-row kernel against its CPU twin and numpy (cpu and the CUDA simulator)."""

import numpy as np
import pytest

import numbakv as nkv
from numbakv.errors import StateError
from numbakv.kernels import rows as krows

L = 2
SPECS = [nkv.StateSpec("conv", (3, 4), "bfloat16"), nkv.StateSpec("ssm", (2, 3, 3), "float32")]


def make(device="cpu", max_seqs=4, every=4, points=3, specs=SPECS, layers=L):
    return nkv.RecurrentCache(nkv.RecurrentConfig(layers, specs, max_seqs=max_seqs,
                                                  restore_every=every,
                                                  max_restore_points=points, device=device))


def everything(rc):
    """Every array and every piece of bookkeeping, for before/after comparisons."""
    return ({n: np.array(a, copy=True) for n, a in rc.pool.items()}, list(rc._lo), list(rc._hi),
            [{q: (p.row, p.explicit, p.missing) for q, p in pts.items()} for pts in rc._points],
            [set(m) for m in rc._marks], rc._refs.copy(), list(rc._free))


def same(a, b):
    pa, *ra = a
    pb, *rb = b
    assert set(pa) == set(pb)
    for n in pa:
        np.testing.assert_array_equal(pa[n], pb[n])
    for x, y in zip(ra, rb):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


def step_state(rc, seq, token):
    """A toy recurrence, written into the live state of seq in every layer: state =
    0.5 * state + token (+ layer), conv = a shifted tail holding the token's bits."""
    for layer in range(rc.config.n_layers):
        v = rc.state_views(layer, [seq])
        v["ssm"][0] = v["ssm"][0] * np.float32(0.5) + np.float32(token + layer)
        bits = v["conv"].bits if hasattr(v["conv"], "bits") else v["conv"]
        bits[0, :-1] = bits[0, 1:]
        bits[0, -1] = token * 3 + layer


def reference(tokens, layer):
    ssm = np.zeros((2, 3, 3), np.float32)
    conv = np.zeros((3, 4), np.uint16)
    for t in tokens:
        ssm = ssm * np.float32(0.5) + np.float32(t + layer)
        conv[:-1] = conv[1:].copy()
        conv[-1] = t * 3 + layer
    return conv, ssm


def feed(rc, seq, tokens, start, keep_plan=True):
    """Run tokens through seq one forward pass, keeping the restore points the plan asks for
    (the model's job: state at each cut)."""
    n = len(tokens)
    rc.start_forward(np.arange(start, start + n), [seq] * n)
    plan = rc.restore_plan(seq, n)
    done = 0
    for k in plan:
        for t in tokens[done:k]:
            step_state(rc, seq, t)
        done = k
        if keep_plan:
            if k < n:
                rc.keep_restore_point(seq, start + k, {
                    name: np.stack([rc.read_states(l, [seq])[name][0] for l in range(L)])
                    for name in rc.pool})
            else:
                rc.keep_restore_point(seq, start + k)
    return plan


def check_state(rc, seq, tokens):
    for layer in range(L):
        got = rc.read_states(layer, [seq])
        conv, ssm = reference(tokens, layer)
        np.testing.assert_array_equal(got["conv"][0], conv)
        np.testing.assert_array_equal(got["ssm"][0], ssm)


def test_config_and_spec_validation():
    with pytest.raises(ValueError, match="name"):
        nkv.StateSpec("a.b", (2,))
    with pytest.raises(ValueError, match="shape"):
        nkv.StateSpec("a", (0, 2))
    with pytest.raises(ValueError, match="dtype"):
        nkv.StateSpec("a", (2,), "int8")
    with pytest.raises(ValueError, match="unique"):
        nkv.RecurrentConfig(1, [nkv.StateSpec("a", (2,)), nkv.StateSpec("a", (3,))])
    with pytest.raises(ValueError, match="max_restore_points"):
        nkv.RecurrentConfig(1, SPECS, max_restore_points=0)
    with pytest.raises(ValueError, match="states"):
        nkv.RecurrentConfig(1, [])
    cfg = nkv.RecurrentConfig(3, SPECS, max_seqs=2)
    assert cfg.state_bytes == 3 * (12 * 2 + 18 * 4)


def test_views_are_zero_copy_per_dtype_and_export_through_dlpack():
    rc = make()
    rc.start_forward([0, 0], [1, 2])
    v = rc.state_views(1, [1, 2])
    assert v["ssm"].shape == (2, 2, 3, 3) and v["ssm"].dtype == np.float32
    assert np.shares_memory(v["ssm"], rc.pool["ssm"])
    v["ssm"][1, 0, 0, 0] = 7.0
    assert rc.read_states(1, [2])["ssm"][0, 0, 0, 0] == 7.0
    torch = pytest.importorskip("torch")
    t = torch.from_dlpack(v["conv"])
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == (2, 3, 4)
    t[0, 0, 0] = 2.5
    assert rc.read_states(1, [1])["conv"][0, 0, 0] == np.uint16(0x4020)   # bf16 bits of 2.5
    ts = torch.from_dlpack(v["ssm"])
    assert ts.data_ptr() == v["ssm"].ctypes.data
    with pytest.raises(ValueError, match="consecutive"):
        rc.state_views(0, [2, 1])


def test_gather_scatter_any_seqs(device):
    rc = make(device)
    rng = np.random.default_rng(0)
    rc.start_forward([0, 0, 0], [3, 0, 2])
    ssm = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    conv = rng.integers(0, 2**16, (3, 3, 4)).astype(np.uint16)
    rc.write_states(1, [3, 0, 2], {"ssm": ssm, "conv": conv})
    got = rc.read_states(1, [2, 3])
    np.testing.assert_array_equal(got["ssm"], ssm[[2, 0]])
    np.testing.assert_array_equal(got["conv"], conv[[2, 0]])
    assert not rc.read_states(0, [0])["ssm"].any()          # other layer untouched
    with pytest.raises(ValueError, match="shape"):
        rc.write_states(1, [3], {"ssm": ssm, "conv": conv})
    with pytest.raises(ValueError, match="dtype"):
        rc.write_states(1, [3], {"ssm": ssm[:1].astype(np.float16), "conv": conv[:1]})


@pytest.mark.parametrize("word", [1, 2, 4, 8, 16])
def test_row_kernel_matches_numpy(kernel_device, word):
    rng = np.random.default_rng(word)
    for dev in ("cpu", kernel_device):
        pool = rng.integers(0, 255, (3, 7, 5 * word), dtype=np.uint8)
        ref = pool.copy()
        src, dst = np.array([0, 6, 2], np.int32), np.array([4, 1, 5], np.int32)
        krows.launch(dev, pool, dst, pool, src, pool.shape[2])
        ref[:, dst] = ref[:, src]
        np.testing.assert_array_equal(pool, ref)
        out = np.zeros((1, 3, 5 * word), np.uint8)
        krows.launch(dev, out, np.arange(3, dtype=np.int32), pool[1:2], src, pool.shape[2])
        np.testing.assert_array_equal(out[0], pool[1, src])


def test_restore_plan_grid_marks_and_end():
    rc = make(every=4)
    assert rc.restore_plan(0, 10) == [4, 8, 10]
    rc.mark_restore(0, 6)
    assert rc.restore_plan(0, 10) == [4, 6, 8, 10]
    rc.start_forward(np.arange(3), [0] * 3)
    assert rc.restore_plan(0, 3) == [3]          # inside the pass: its start (0)
    assert rc.restore_plan(0, 9) == [4, 6, 8, 9]
    rc2 = make(every=0)
    assert rc2.restore_plan(1, 5) == [5]
    with pytest.raises(ValueError, match="n_new"):
        rc.restore_plan(0, 0)


def test_state_follows_tokens_and_lazy_end_point(device):
    rc = make(device, every=4, points=8)
    toks = [5, 1, 4, 2, 3, 7]
    feed(rc, 0, toks, 0)
    check_state(rc, 0, toks)
    assert rc.restore_points(0) == [4, 6]
    # the end point is the live state: no restore row used for it
    assert rc._points[0][6].row == 0
    rows_used = int((rc._refs > 0).sum())
    feed(rc, 0, [9, 9, 9], 6)           # 6 is off the grid, not explicit: dropped, not copied
    assert rc.restore_points(0) == [4, 8, 9]
    assert int((rc._refs > 0).sum()) == rows_used + 1     # 8 (grid) copied mid-batch
    rc.mark_restore(0, 10)              # future explicit point: kept and copied when overwritten
    feed(rc, 0, [1], 9)
    feed(rc, 0, [2], 10)
    assert 10 in rc.restore_points(0) and rc._points[0][10].row >= rc.config.max_seqs
    assert rc.rollback(0, 10)
    check_state(rc, 0, toks + [9, 9, 9, 1])
    assert rc.seq_pos_max(0) == 9 and rc.restore_points(0) == [4, 8, 10]   # 9 was a batch end
    assert rc.rollback(0, 4)
    check_state(rc, 0, toks[:4])
    assert rc.restore_points(0) == [4]
    feed(rc, 0, [6, 6], 4)
    check_state(rc, 0, toks[:4] + [6, 6])


def test_rollback_for_speculative_decoding():
    rc = make(every=0, points=8)
    feed(rc, 1, [1, 2, 3], 0)
    draft = [4, 5, 6, 7]
    rc.start_forward(np.arange(3, 7), [1] * 4)
    for i, t in enumerate(draft):
        step_state(rc, 1, t)
        rc.keep_restore_point(1, 4 + i, {n: np.stack([rc.read_states(l, [1])[n][0]
                                                      for l in range(L)]) for n in rc.pool})
    before = everything(rc)
    assert rc.rollback(1, 2) is False           # not kept: nothing changed
    same(before, everything(rc))
    assert rc.rollback(1, 5)                    # accepted 4 and 5... state after position 4
    check_state(rc, 1, [1, 2, 3, 4, 5])
    assert rc.seq_pos_max(1) == 4 and max(rc.restore_points(1)) == 5


def test_layer_by_layer_points():
    rc = make(every=0, points=4)
    feed(rc, 0, [1, 2, 3], 0, keep_plan=False)
    st = {n: rc.read_states(0, [0])[n][0] for n in rc.pool}
    rc.keep_restore_point(0, 2, st, layer=0)
    assert rc.restore_points(0) == []
    with pytest.raises(ValueError, match=r"restore point 2 of sequence 0 is not held.*layers \[1\]"):
        rc.restore_point(0, 2)
    assert rc.rollback(0, 2) is False
    rc.keep_restore_point(0, 2, {n: rc.read_states(1, [0])[n][0] for n in rc.pool}, layer=1)
    assert rc.restore_points(0) == [2]
    got = rc.restore_point(0, 2)
    np.testing.assert_array_equal(got["ssm"][1], rc.read_states(1, [0])["ssm"][0])


def test_bound_keeps_newest_and_explicit():
    rc = make(every=1, points=3)
    rc.mark_restore(0, 2)
    feed(rc, 0, list(range(8)), 0)
    pts = rc.restore_points(0)
    assert pts == [2, 7, 8] and rc._points[0][2].explicit
    assert sorted(rc._free + [r for r in range(rc.n_rows) if rc._refs[r]]) == \
        list(range(rc.config.max_seqs, rc.n_rows))


def test_seq_rm_rules_change_nothing_when_refused():
    rc = make(every=4, points=4)
    feed(rc, 0, list(range(10)), 0)
    feed(rc, 1, [3, 3], 5)
    before = everything(rc)
    for args in [(0, 0, 5), (0, 3, 6), (0, 5, None), (-1, 5, None), (1, 5, 6)]:
        assert rc.seq_rm(*args) is False, args
        same(before, everything(rc))
    assert rc.seq_rm(0, 20, None)                # nothing of it
    assert rc.seq_rm(0, 0, 0)
    same(before, everything(rc))
    assert rc.seq_rm(0, 8, None)                 # back to the point at 8
    check_state(rc, 0, list(range(8)))
    assert rc.seq_pos_max(0) == 7 and rc.seq_pos_min(0) == 0
    assert rc.seq_rm(1, 0, None) and rc.seq_pos_max(1) == -1
    assert rc.seq_rm(-1, 0, None) and rc.seq_pos_max(0) == -1
    assert not rc._refs.any()


def test_seq_cp_copies_state_and_shares_points(device):
    rc = make(device, every=2, points=4)
    feed(rc, 0, [1, 2, 3, 4, 5], 0)
    rows_before = int((rc._refs > 0).sum())
    rc.seq_cp(0, 2)
    assert int((rc._refs > 0).sum()) == rows_before      # points shared, not copied
    assert rc.restore_points(2) == rc.restore_points(0) == [2, 4, 5]
    check_state(rc, 2, [1, 2, 3, 4, 5])
    feed(rc, 2, [7], 5)
    feed(rc, 0, [8], 5)
    check_state(rc, 2, [1, 2, 3, 4, 5, 7])
    check_state(rc, 0, [1, 2, 3, 4, 5, 8])
    assert rc.rollback(2, 4) and rc.rollback(0, 2)
    check_state(rc, 2, [1, 2, 3, 4])
    check_state(rc, 0, [1, 2])
    rc.seq_cp(2, 3, 0, 2)                                # the state at the point at 2
    check_state(rc, 3, [1, 2])
    assert rc.seq_pos_max(3) == 1
    before = everything(rc)
    with pytest.raises(ValueError, match="restore point 3 of sequence 2 is not held"):
        rc.seq_cp(2, 1, 0, 3)
    with pytest.raises(ValueError, match="cannot be split"):
        rc.seq_cp(2, 1, 1, None)
    same(before, everything(rc))
    rc.seq_keep(3)
    assert [rc.seq_pos_max(s) for s in range(4)] == [-1, -1, -1, 1]


def test_seq_add_and_div_move_labels():
    rc = make(every=2, points=4)
    feed(rc, 0, [1, 2, 3, 4], 0)
    rc.seq_add(0, 0, None, 10)
    assert (rc.seq_pos_min(0), rc.seq_pos_max(0)) == (10, 13)
    assert rc.restore_points(0) == [12, 14]
    rc.seq_div(0, 0, None, 2)
    assert (rc.seq_pos_min(0), rc.seq_pos_max(0)) == (5, 6)
    assert rc.restore_points(0) == [6, 7]
    feed(rc, 0, [9], 7)
    check_state(rc, 0, [1, 2, 3, 4, 9])
    before = everything(rc)
    for args, match in [((0, 7, None, -5), "last positions before"),
                        ((0, 0, 6, 3), "first positions after"),
                        ((0, 0, None, -6), "below 0"),
                        ((0, 6, 7, 1), "inside its recurrent state")]:
        with pytest.raises(ValueError, match=match):
            rc.seq_add(*args)
    with pytest.raises(ValueError, match="last positions before"):
        rc.seq_div(0, 6, None, 2)
    same(before, everything(rc))
    rc.seq_add(0, 0, None, -100)
    assert rc.seq_pos_max(0) == -1


def test_forward_batch_rules():
    rc = make()
    feed(rc, 0, [1, 2], 0)
    before = everything(rc)
    with pytest.raises(ValueError, match="continues at position 2"):
        rc.start_forward([3], [0])
    with pytest.raises(ValueError, match="consecutive"):
        rc.start_forward([2, 4], [0, 0])
    with pytest.raises(ValueError, match="seqs"):
        rc.start_forward([0], [9])
    same(before, everything(rc))
    rc.start_forward([2, 7, 3, 8], [0, 1, 0, 1])       # interleaved sequences are fine
    assert rc.seq_pos_min(1) == 7 and rc.seq_pos_max(1) == 8 and rc.seq_pos_max(0) == 3


def test_fresh_sequence_starts_from_zero_state():
    rc = make(every=0)
    feed(rc, 1, [4, 4], 0)
    rc.seq_rm(1)
    feed(rc, 1, [2], 0)
    check_state(rc, 1, [2])


def test_bad_restore_point_input_changes_nothing():
    rc = make(every=0)
    feed(rc, 0, [1, 2, 3], 0)
    before = everything(rc)
    good = {n: np.zeros((L,) + rc._specs[n].shape, rc.pool[n].dtype) for n in rc.pool}
    for states, kw, match in [({"ssm": good["ssm"]}, {}, "exactly"),
                              ({**good, "ssm": good["ssm"][:1]}, {}, "shape"),
                              ({**good, "ssm": good["ssm"].astype(np.float64)}, {}, "dtype"),
                              (good, {"layer": 5}, "layer")]:
        with pytest.raises(ValueError, match=match):
            rc.keep_restore_point(0, 2, states, **kw)
    for pos, match in [(5, "pos"), (0, "pos")]:
        with pytest.raises(ValueError, match=match):
            rc.keep_restore_point(0, pos, good)
    with pytest.raises(ValueError, match="live state"):
        rc.keep_restore_point(0, 2)
    with pytest.raises(ValueError, match="restore point 2 of sequence 0 is not held"):
        rc.drop_restore_point(0, 2)
    with pytest.raises(ValueError, match="already past"):
        rc.mark_restore(0, 2)
    same(before, everything(rc))


def test_state_files_round_trip_and_refusals(tmp_path, device):
    rc = make(device, every=2, points=4)
    feed(rc, 0, [1, 2, 3, 4, 5], 0)
    feed(rc, 2, [6, 7], 3)
    rc.mark_restore(2, 9)
    path = tmp_path / "r.safetensors"
    rc.save_state(path, tokens=[1, 2], metadata={"who": "me"})
    other = make(device, every=2, points=4)
    info = other.load_state(path)
    assert info["tokens"] == [1, 2] and info["metadata"] == {"who": "me"}
    for s in (0, 2):
        assert other.restore_points(s) == rc.restore_points(s)
        assert (other.seq_pos_min(s), other.seq_pos_max(s)) == (rc.seq_pos_min(s),
                                                                  rc.seq_pos_max(s))
    check_state(other, 0, [1, 2, 3, 4, 5])
    assert other._marks[2] == {9}
    assert other.rollback(0, 2)
    check_state(other, 0, [1, 2])
    # one sequence, loaded as another
    data = rc.state_bytes(0)
    other.load_state_bytes(data, 3)
    check_state(other, 3, [1, 2, 3, 4, 5])
    # generic numbakv.state entry points know the family
    from numbakv import state as st
    again = make(device, every=2, points=4)
    st.load(st.to_bytes(rc), again)
    check_state(again, 0, [1, 2, 3, 4, 5])
    # another model / layer layout: StateError naming the field, nothing changed
    before = everything(other)
    for bad in (make(device, specs=[nkv.StateSpec("conv", (3, 4), "float16"), SPECS[1]]),
                make(device, layers=3),
                make(device, specs=[SPECS[1], SPECS[0]])):
        with pytest.raises(StateError, match="layout"):
            other.load_state_bytes(bad.state_bytes())
    with pytest.raises(StateError, match="kind"):
        other.load_state_bytes(data)                    # a sequence's state, whole asked for
    raw = bytearray(data)
    raw[-3] ^= 0xFF
    with pytest.raises(StateError, match="checksum"):
        other.load_state_bytes(bytes(raw), 1)
    with pytest.raises(StateError):
        other.load_state_bytes(bytes(data[:100]), 1)
    small = make(device, max_seqs=2)
    with pytest.raises(StateError, match="max_seqs"):
        small.load_state_bytes(rc.state_bytes())
    same(before, everything(other))
    # too many points for a smaller cache: the newest and explicit ones are kept
    few = make(device, every=2, points=2)
    few.load_state_bytes(data, 0)
    assert few.restore_points(0) == [4, 5]


def test_export_import_part_moves_positions():
    rc = make(every=2, points=4)
    feed(rc, 0, [1, 2, 3, 4, 5], 0)
    part = rc.export_part(0, 0, 4)
    assert part.positions.tolist() == [2, 4] and part.restore_points == [2, 4]
    rc.import_part(1, part, at=10)
    assert (rc.seq_pos_min(1), rc.seq_pos_max(1)) == (10, 13)
    assert rc.restore_points(1) == [12, 14]
    check_state(rc, 1, [1, 2, 3, 4])
    whole = rc.export_part(0)
    assert whole.positions.tolist() == [2, 4, 5] and whole.end == 5
    other = make(specs=[SPECS[0]])
    with pytest.raises(StateError, match="layout"):
        other.import_part(0, whole)


def test_closed_cache_refuses():
    rc = make()
    rc.close()
    with pytest.raises(nkv.KVCacheError):
        rc.start_forward([0], [0])


def test_hostile_recurrent_states_raise_state_error():
    """Crafted files whose tensors parse but whose values lie: each a StateError, nothing
    changed."""
    from numbakv.state import codec as st
    rc = make(every=2, points=4)
    feed(rc, 0, [1, 2, 3, 4, 5], 0)
    good = rc.state_bytes(0)
    target = make(every=2, points=4)
    feed(target, 1, [9], 0)
    before = everything(target)

    def crafted(**override):
        with st._Opened(good) as state:
            config = dict(state.config)
            tensors = {n: np.array(state.tensor(n)) for n in state.tensors}
            dtypes = {n: t.dtype for n, t in state.tensors.items()}
        tensors.update(override)
        specs = [st._Spec(n, dtypes[n], tuple(a.shape), lambda a=a: a) for n, a in tensors.items()]
        return st._to_bytes(lambda: (st._base_metadata("recurrent-seq", config, None), specs),
                            False)
    pos = np.array([2, 2, 5], np.int32)
    for bad, match in [(dict(**{"s0.positions": pos}), "ascending"),
                       (dict(**{"s0.flags": np.array([9, 1, 0], np.uint8)}), "flags"),
                       (dict(**{"s0.first": np.array([7], np.int32)}), "ascending"),
                       (dict(**{"s0.first": np.array([-1], np.int32)}), "first")]:
        with pytest.raises(StateError, match=match):
            target.load_state_bytes(crafted(**bad), 0)
    with pytest.raises(StateError, match="shape"):
        target.load_state_bytes(crafted(**{"s0.state.ssm": np.zeros((L, 2, 2, 3, 3),
                                                                     np.float32)}), 0)
    same(before, everything(target))


def test_emulated_cuda_row_kernel(kernel_device, monkeypatch):
    """The ``cuda`` launch path (descriptors, packed row tables, 16-byte words where aligned) on
    a stand-in CuPy, run by the simulator: a pool slice (one layer of several) included."""
    if kernel_device != "sim":
        pytest.skip("a real GPU runs the cuda path itself")
    from fake_cupy import FakeDeviceArray
    from helpers import clear_launch_caches, emulate_cuda
    from numbakv.kernels import _common
    launched = []

    def record(kernel, args):
        assert all(isinstance(a, (_common.Desc, int)) for a in args)
        launched.append(kernel)
    emulate_cuda(monkeypatch, record)
    try:
        rng = np.random.default_rng(3)
        pool = rng.integers(0, 2**16, (3, 6, 2, 8)).astype(np.uint16)
        ref = pool.copy()
        src, dst = np.array([5, 0], np.int32), np.array([1, 3], np.int32)
        krows.launch("cuda", FakeDeviceArray(pool), dst, FakeDeviceArray(pool), src, 32)
        ref[:, dst] = ref[:, src]
        np.testing.assert_array_equal(pool, ref)
        out = np.zeros((1, 2, 2, 8), np.uint16)
        krows.launch("cuda", FakeDeviceArray(out), np.arange(2, dtype=np.int32),
                     FakeDeviceArray(pool[2:3]), src, 32)
        np.testing.assert_array_equal(out[0], pool[2, src])
        assert launched == [krows.state_rows_kernel] * 2
    finally:
        clear_launch_caches()


# ------------------------------------------------------------------ random operations vs a model
def _expected(tokens, layer):
    ssm, conv = reference(tokens, layer)
    return conv, ssm


class _Model:
    """What RecurrentCache must hold, in plain Python: per sequence its first position, the
    tokens it read, its restore points (prefix length, explicit, lazy) and its marks."""

    def __init__(self, S, R, every):
        self.S, self.R, self.every = S, R, every
        self.seqs = [None] * S       # None or dict(lo, hist, points, marks)

    def on_grid(self, pos):
        return self.every > 0 and pos % self.every == 0

    def make_room(self, st, adding):
        pts = st["points"]
        while len(pts) - (adding in pts) >= self.R:
            others = [q for q in pts if q != adding]
            newest = max(others)
            victim = sorted(others, key=lambda q: (pts[q][1], q == newest, q))[0]
            del pts[victim]


def _check(rc, model):
    for s in range(model.S):
        st = model.seqs[s]
        if st is None:
            assert rc.seq_pos_max(s) == -1 and rc.restore_points(s) == []
            continue
        lo, hist = st["lo"], st["hist"]
        assert (rc.seq_pos_min(s), rc.seq_pos_max(s)) == (lo, lo + len(hist) - 1), s
        assert rc.restore_points(s) == sorted(st["points"]), (s, st["points"])
        assert rc._marks[s] == st["marks"], (s, st["marks"])
        for layer in range(L):
            got = rc.read_states(layer, [s])
            conv, ssm = reference(hist, layer)
            np.testing.assert_array_equal(got["ssm"][0], ssm)
            np.testing.assert_array_equal(got["conv"][0], conv)
        for q, (n, explicit, lazy) in st["points"].items():
            got = rc.restore_point(s, q)
            for layer in range(L):
                conv, ssm = reference(hist[:n], layer)
                np.testing.assert_array_equal(got["ssm"][layer], ssm)
                np.testing.assert_array_equal(got["conv"][layer], conv)
            assert rc._points[s][q].explicit == explicit
    # every restore row is referenced exactly as often as its refcount says, or free
    refs = np.zeros(rc.n_rows, np.int64)
    for pts in rc._points:
        for p in pts.values():
            if p.row >= rc.config.max_seqs:
                refs[p.row] += 1
    np.testing.assert_array_equal(refs, rc._refs)
    assert sorted(rc._free) == [r for r in range(rc.config.max_seqs, rc.n_rows) if refs[r] == 0]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operations_match_a_plain_model(seed):
    rng = np.random.default_rng(seed)
    S, R, every = 3, 3, 3
    rc = make(max_seqs=S, every=every, points=R)
    model = _Model(S, R, every)
    done = []
    for step in range(150):
        op = rng.choice(["forward", "forward", "forward", "rollback", "seq_rm", "seq_cp",
                         "seq_keep", "seq_add", "mark", "reload", "part"])
        s = int(rng.integers(S))
        st = model.seqs[s]
        if op == "forward":
            n = int(rng.integers(1, 6))
            toks = [int(t) for t in rng.integers(0, 50, n)]
            start = st["lo"] + len(st["hist"]) if st else int(rng.integers(0, 4))
            if st is None:
                st = model.seqs[s] = {"lo": start, "hist": [], "points": {}, "marks": set()}
            for q, (k, ex, lazy) in list(st["points"].items()):
                if lazy:
                    if not ex and not model.on_grid(q):
                        del st["points"][q]
                    else:
                        st["points"][q] = (k, ex, False)
            st["marks"] = {m for m in st["marks"] if m > start}
            plan = feed(rc, s, toks, start)
            for cut in plan:
                q = start + cut
                model.make_room(st, q)
                st["points"][q] = (len(st["hist"]) + cut, q in st["marks"], cut == n)
            st["hist"] += toks
        elif op == "rollback" and st is not None:
            cands = sorted(st["points"]) + [st["lo"] + 1, st["lo"] + len(st["hist"]) + 1]
            q = int(rng.choice(cands))
            ok = rc.rollback(s, q)
            end = st["lo"] + len(st["hist"])
            expect = q in st["points"] or q == end or q <= st["lo"]
            if q > end:
                expect = False
            assert ok == expect, (q, st)
            if ok and q <= st["lo"]:
                model.seqs[s] = None
            elif ok and q != end:
                k = q - st["lo"]
                st["hist"] = st["hist"][:k]
                st["points"] = {p: (n, ex, False) if p == q else v
                                for p, v in st["points"].items() if p <= q
                                for n, ex, _ in [v]}
                st["marks"] = {m for m in st["marks"] if m > q}
        elif op == "seq_rm":
            if st is None:
                assert rc.seq_rm(s, int(rng.integers(0, 5)))
                continue
            end = st["lo"] + len(st["hist"])
            p0 = int(rng.choice([0, st["lo"] + 1, end - 1, *st["points"]]))
            ok = rc.seq_rm(s, p0, None)
            if p0 <= st["lo"]:
                assert ok
                model.seqs[s] = None
            elif p0 in st["points"] or p0 >= end:
                assert ok
                if p0 < end:
                    k = p0 - st["lo"]
                    st["hist"] = st["hist"][:k]
                    st["points"] = {p: (v[0], v[1], False) if p == p0 else v
                                    for p, v in st["points"].items() if p <= p0}
                    st["marks"] = {m for m in st["marks"] if m > p0}
            else:
                assert not ok
        elif op == "seq_cp" and st is not None:
            d = int(rng.integers(S))
            if d == s:
                continue
            end = st["lo"] + len(st["hist"])
            p1 = int(rng.choice([end + 5, *st["points"], st["lo"] + 1]))
            if st["lo"] < p1 < end and p1 not in st["points"]:
                with pytest.raises(ValueError, match="not held"):
                    rc.seq_cp(s, d, 0, p1)
                continue
            rc.seq_cp(s, d, 0, p1)
            cut = min(p1, end)
            model.seqs[d] = {"lo": st["lo"], "hist": st["hist"][:cut - st["lo"]],
                             "points": {q: (v[0], v[1], v[2] and cut == end)
                                        for q, v in st["points"].items() if q <= cut},
                             "marks": {m for m in st["marks"] if m > cut}}
        elif op == "seq_keep":
            rc.seq_keep(s)
            model.seqs = [model.seqs[i] if i == s else None for i in range(S)]
        elif op == "seq_add" and st is not None:
            delta = int(rng.integers(-2, 5))
            if st["lo"] + delta < 0:
                continue
            rc.seq_add(s, 0, None, delta)
            st["lo"] += delta
            st["points"] = {q + delta: v for q, v in st["points"].items()}
            st["marks"] = {m + delta for m in st["marks"]}
        elif op == "mark" and st is not None:
            q = st["lo"] + len(st["hist"]) + int(rng.integers(2, 6))
            rc.mark_restore(s, q)
            st["marks"].add(q)
        elif op == "reload":
            data = rc.state_bytes()
            rc = make(max_seqs=S, every=every, points=R)
            rc.load_state_bytes(data)
            for m in model.seqs:            # a loaded end point is lazy again
                if m is not None:
                    end = m["lo"] + len(m["hist"])
                    m["points"] = {q: (v[0], v[1], q == end) for q, v in m["points"].items()}
        elif op == "part" and st is not None:
            d = int(rng.integers(S))
            rc.import_part(d, rc.export_part(s))
            end = st["lo"] + len(st["hist"])
            model.seqs[d] = {"lo": st["lo"], "hist": list(st["hist"]),
                             "points": {q: (v[0], v[1], q == end)
                                        for q, v in st["points"].items()},
                             "marks": set()}     # an import replaces the sequence
        done.append(f"{op}({s})")
        try:
            _check(rc, model)
        except AssertionError as exc:
            raise AssertionError(f"after {done[-4:]}: {exc}") from None
    assert len({d.split("(")[0] for d in done}) >= 9, sorted(set(done))     # the mix covered the operations


def test_use_stream_is_for_cuda_caches():
    rc = make()
    rc.use_stream(None)
    with pytest.raises(ValueError, match="cuda"):
        rc.use_stream(7)
    rc.synchronize()
