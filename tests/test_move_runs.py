"""Block moves as runs (kernels/move.py: plan_runs, RunMover, move_runs_kernel): the host checks
and normalises a plan in one compiled pass over its moves and the device expands runs into
cells, so host time does not grow with the cells moved. Checked against the sequential
reference (each move a memmove, in order) and the numpy plan helpers, on random plans."""

import numpy as np
import pytest

from numbakv.config import CacheConfig
from numbakv.kernels import move
from numbakv.storage import KVStorage
from helpers import host, random_storage, reference_moves


def bits(x):
    x = host(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.itemsize])


def _random_plan(rng, n, m, disjoint):
    if disjoint:   # a defrag-like plan: destinations and sources never overlap
        m = max(1, min(m, (n - 1) // 2))
        cut = np.sort(rng.choice(np.arange(1, n), size=2 * m, replace=False))
        moves = []
        for i in range(0, 2 * m - 1, 2):
            ln = int(rng.integers(0, cut[i + 1] - cut[i] + 1))
            moves.append((int(cut[i + 1]) - ln, int(cut[i]), ln))
        return np.array(moves, np.int64).reshape(-1, 3)
    ln = rng.integers(0, min(6, n + 1), m)
    src = np.array([rng.integers(0, n - x + 1) for x in ln])
    dst = np.array([rng.integers(0, n - x + 1) for x in ln])
    return np.stack([src, dst, ln], axis=1).astype(np.int64)


def test_plan_runs_agrees_with_the_numpy_helpers():
    rng = np.random.default_rng(0)
    out = np.zeros((64, 4), np.int64)
    for trial in range(400):
        n = int(rng.integers(4, 40))
        m = int(rng.integers(1, 6))
        moves = _random_plan(rng, n, m, disjoint=bool(trial % 2))
        problem, live, total, indep = move.plan_runs(moves, n, out)
        norm = move.normalize(moves)
        assert problem == 0 and live == norm.shape[0]
        np.testing.assert_array_equal(out[:live, :3], norm)
        assert total == int(norm[:, 2].sum())
        np.testing.assert_array_equal(out[:live, 3], np.cumsum(norm[:, 2]) - norm[:, 2])
        assert indep == move.independent(norm, n), moves


def test_plan_runs_refuses_before_writing():
    out = np.zeros((4, 4), np.int64)
    assert move.plan_runs(np.array([[0, 2, -1]], np.int64), 8, out)[0] == 1
    assert move.plan_runs(np.array([[0, 2, 1], [6, 0, 3]], np.int64), 8, out)[0] == 2
    assert move.plan_runs(np.array([[-1, 2, 1]], np.int64), 8, out)[0] == 2
    assert move.plan_runs(np.array([[3, 3, 2], [1, 5, 0]], np.int64), 8, out)[1] == 0


@pytest.mark.parametrize("permuted", [False, True])
def test_storage_moves_equal_the_sequential_reference(device, permuted):
    """Random plans (independent ones through the runs kernel, others through the lanes
    kernel) on a storage, one RunMover reused across calls."""
    rng = np.random.default_rng(1 + permuted)
    cfg = CacheConfig(2, 2, 8, v_head_dim=4, dtype="bfloat16", permuted_v=permuted,
                      device=device)
    n = 24
    st = KVStorage(cfg, n, device)
    st.keys[...] = random_storage(rng, st.keys.shape, "bfloat16")
    st.values[...] = random_storage(rng, st.values.shape, "bfloat16")
    seen = set()
    for trial in range(12):
        moves = _random_plan(rng, n, int(rng.integers(1, 5)), disjoint=bool(trial % 2))
        seen.add(move.independent(move.normalize(moves), n))
        want = reference_moves(host(st.keys), host(st.values), moves, permuted)
        st.move_blocks(moves)
        assert np.array_equal(bits(st.keys), bits(want[0]))
        assert np.array_equal(bits(st.values), bits(want[1]))
    assert seen == {True, False}


def test_storage_move_errors_change_nothing(device):
    cfg = CacheConfig(1, 1, 4, device=device)
    st = KVStorage(cfg, 8, device)
    st.keys[...] = np.arange(32, dtype=np.float16).reshape(st.keys.shape)
    before = host(st.keys).copy()
    with pytest.raises(ValueError, match="lengths"):
        st.move_blocks(np.array([[0, 4, 2], [1, 2, -1]]))
    with pytest.raises(ValueError, match="inside"):
        st.move_blocks(np.array([[0, 4, 2], [5, 0, 4]]))
    assert np.array_equal(host(st.keys), before)


# ------------------------------------------------------------------ rotations (kernels/rope.py)

def test_rotation_host_passes():
    from numbakv.kernels import rope
    out_c, out_d = np.zeros(8, np.int32), np.zeros(8, np.int64)
    live = rope.merge_sorted(np.array([1, 4, 6, 9], np.int32), np.array([3, 0, -2, 3]),
                             out_c, out_d)
    assert live == 3 and out_c[:3].tolist() == [1, 6, 9] and out_d[:3].tolist() == [3, -2, 3]
    assert rope.merge_sorted(np.array([4, 1], np.int32), np.array([1, 1]), out_c, out_d) == -1
    assert rope.merge_sorted(np.array([4, 4], np.int32), np.array([1, 1]), out_c, out_d) == -1
    tab, uniq = np.zeros(5, np.int32), np.zeros(8, np.int64)
    assert rope.distinct_deltas(np.array([5, -1, 5, 7, -1]), tab, uniq) == 3
    assert uniq[tab].tolist() == [5, -1, 5, 7, -1]
    assert rope.distinct_deltas(np.arange(9, dtype=np.int64), np.zeros(9, np.int32), uniq) == -1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_storage_rotations_equal_the_cpu(device, dtype):
    """Sorted and unsorted cell lists, repeats (deltas summed), zero deltas, one delta, many
    distinct deltas (past the linear search), a layer subset, an offset rope: bit-identical to
    the CPU storage."""
    from numbakv.config import RopeShift
    rng = np.random.default_rng(11)
    cfg = CacheConfig(3, 2, 16, dtype=dtype, device=device)
    stores = [KVStorage(cfg, 20, d) for d in (device, "cpu")]
    start = random_storage(rng, stores[0].keys.shape, dtype)
    for st in stores:
        st.keys[...] = start
    cases = [
        (np.arange(3, 15, dtype=np.int32), np.full(12, -4), None, RopeShift()),
        (np.array([7, 2, 9, 2], np.int32), np.array([3, 5, 0, -1]), None, RopeShift(neox=False)),
        (np.arange(0, 20, 2, dtype=np.int32), np.arange(-5, 5), [2, 0], RopeShift(dim=8)),
        (np.array([1, 5], np.int32), np.array([100000, -7]), None,
         RopeShift(dim=8, offset=8, base=500.0)),
    ]
    for cells, deltas, layers, rs in cases:
        for st in stores:
            st.rotate(cells, deltas, rs, layers=layers)
        assert np.array_equal(bits(stores[0].keys), bits(stores[1].keys)), (cells, deltas)
