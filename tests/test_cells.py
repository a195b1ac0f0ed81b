"""The cell table against a plain Python model (tests/model_cells.py): unit tests per operation
and edge case, then a hypothesis state machine that drives random operation sequences through
both and compares everything after every step."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from numbakv.cells import (CELL_DTYPE, MAX_SEQS, POS_MAX, SEQ_WORDS, CellTable, CellTableStack,
                           cell_dtype, seq_words)
from numbakv.errors import NotSupportedError
from model_cells import ModelCells, reference_defrag_plan


def i32(x):
    return np.asarray(x, dtype=np.int32)


# ---- comparison helpers ---------------------------------------------------------------------

def seq_sets(t):
    out = []
    for words in t.cells["seqs"]:
        s = set()
        for w in range(len(words)):
            x = int(words[w])
            while x:
                low = x & -x
                s.add(w * 64 + low.bit_length() - 1)
                x ^= low
        out.append(s)
    return out


def snapshot(t):
    return [a.copy() for a in (t.cells, t._occ, t._ftree, t._stree, t._sidx, t._meta)]


def assert_unchanged(t, snap):
    for a, b in zip(snapshot(t), snap):
        assert np.array_equal(a, b)


def model_indexes(m):
    idx = np.full((4, m.max_seqs), -1, np.int64)
    for c in range(m.n):
        for s in m.seqs[c]:
            if idx[0, s] < 0:
                idx[:, s] = (c, c, m.pos[c], m.pos[c])
            idx[1, s] = c
            idx[2, s] = min(idx[2, s], m.pos[c])
            idx[3, s] = max(idx[3, s], m.pos[c])
    return idx


def assert_same(t, m):
    t.check_consistency()
    assert t.cells["pos"].tolist() == m.pos
    assert t.cells["shift"].tolist() == m.shift
    assert seq_sets(t) == m.seqs
    assert t.n_used == m.n_used
    assert t.head == m.head
    idx = model_indexes(m)
    assert np.array_equal(t.seq_cell_min, idx[0])
    assert np.array_equal(t.seq_cell_max, idx[1])
    assert np.array_equal(t.seq_pos_min, idx[2])
    assert np.array_equal(t.seq_pos_max, idx[3])


def fill(t, m, cells, positions, seqs):
    t.apply_batch(i32(cells), i32(positions), i32(seqs))
    m.apply_batch(cells, positions, seqs)


def check_defrag(t, m):
    """Plan a defrag on t; check the moves against the reference plan and by carrying unique
    data ids; then make the model follow."""
    used_before = [bool(s) for s in m.seqs]
    before = m.copy()
    moves = t.plan_defrag()
    assert moves.dtype == np.int64 and moves.ndim == 2 and moves.shape[1] == 3
    assert [tuple(r) for r in moves.tolist()] == reference_defrag_plan(used_before)
    n_used = sum(used_before)
    data = np.arange(t.n_cells)
    for src, dst, length in moves.tolist():
        assert length >= 1 and src >= n_used and dst + length <= n_used
        assert all(used_before[src:src + length])
        assert not any(used_before[dst:dst + length])
        data[dst:dst + length] = data[src:src + length]
    # any order works: the reverse order gives the same data
    data_rev = np.arange(t.n_cells)
    for src, dst, length in moves.tolist()[::-1]:
        data_rev[dst:dst + length] = data_rev[src:src + length]
    assert np.array_equal(data, data_rev)
    sets = seq_sets(t)
    assert all(sets[i] for i in range(n_used)) and not any(sets[n_used:])
    for i in range(n_used):
        j = int(data[i])
        # the cell's metadata is the metadata that travelled with its data
        assert sets[i] == before.seqs[j]
        assert int(t.cells["pos"][i]) == before.pos[j]
        assert int(t.cells["shift"][i]) == before.shift[j]
    assert sorted(int(data[i]) for i in range(n_used)) == [c for c in range(t.n_cells)
                                                            if used_before[c]]
    if len(moves):
        m.adopt_defrag([int(x) for x in data], n_used)
    assert_same(t, m)
    return moves


# ---- unit tests -----------------------------------------------------------------------------

def test_empty_table():
    t = CellTable(10, 4)
    m = ModelCells(10, 4)
    assert_same(t, m)
    assert t.n_used == 0 and t.n_free == 10 and t.max_free_run == 10
    assert t.find_contiguous(10) == 0 and t.find_contiguous(11) == -1
    assert t.find_scatter(3).tolist() == [0, 1, 2]
    assert t.batch_range(i32([0]), i32([0]), -1) == (0, 0)
    assert t.batch_range(i32([5]), i32([1]), 3) == (0, 0)
    assert t.seq_pos_max(0) == -1 and t.seq_pos_min(3) == -1
    assert t.seq_cells(2).tolist() == []
    cells, deltas = t.take_shifts()
    assert cells.size == 0 and deltas.size == 0 and not t.has_pending_shifts()
    assert t.plan_defrag().shape == (0, 3)
    assert t.prune_window(i32([3]), i32([0]), 1).shape == (0, 4)
    assert t.remove(0, 0, 3).size == 0
    pos, seqs = t.mask_inputs(0, 10)
    assert (pos == -1).all() and (seqs == 0).all() and seqs.shape == (10, 1)   # 1 word: 4 seqs
    assert t.cells.dtype == cell_dtype(1) and t.words == seq_words(4) == 1
    assert CellTable(10, 65).words == 2 and CellTable(10, 256).cells.dtype == CELL_DTYPE


def test_full_table():
    t = CellTable(8, 2)
    t.apply_batch(i32(range(8)), i32(range(8)), i32([0] * 8))
    assert t.find_contiguous(1) == -1
    assert t.find_scatter(1) is None
    assert t.n_free == 0 and t.max_free_run == 0
    t.seq_rm(0, 3, 5)
    assert t.find_contiguous(2) == 3 and t.find_contiguous(3) == -1
    assert t.find_scatter(3) is None
    assert t.find_scatter(2).tolist() == [3, 4]


@pytest.mark.parametrize("n_cells", [1, 63, 64, 65, 200, 1000])
def test_find_contiguous_matches_first_fit(n_cells):
    rng = np.random.default_rng(n_cells)
    for density in (0.1, 0.5, 0.9):
        t = CellTable(n_cells, 1)
        m = ModelCells(n_cells, 1)
        used = np.flatnonzero(rng.random(n_cells) < density)
        if used.size:
            fill(t, m, used.tolist(), [0] * used.size, [0] * used.size)
        for n in [1, 2, 3, 5, 8, 13, 31, 63, 64, 65, 100, 130, n_cells]:
            assert t.find_contiguous(n) == m.find_contiguous(n), (n, density)
        assert t.max_free_run == max((len(r) for r in "".join(
            "x" if s else "." for s in m.seqs).split("x")), default=0)


def test_find_scatter_head_and_wrap():
    t = CellTable(10, 2)
    m = ModelCells(10, 2)
    fill(t, m, [0, 1, 2, 3, 4, 5, 6], list(range(7)), [0] * 7)
    assert t.head == 7
    fill(t, m, [7, 8], [7, 8], [1, 1])
    t.seq_rm(0, 1, 3)
    m.seq_rm(0, 1, 3)
    assert t.head == m.head == 1
    assert t.find_scatter(3).tolist() == m.find_scatter(3) == [1, 2, 9]
    assert_same(t, m)
    # a head far beyond the used count is reset to the front (llama.cpp)
    t2 = CellTable(100, 1)
    m2 = ModelCells(100, 1)
    fill(t2, m2, [90], [0], [0])
    assert t2.head == 91
    assert t2.find_scatter(2).tolist() == m2.find_scatter(2) == [0, 1]
    assert t2.find_scatter(60) is not None


def test_apply_batch_and_indexes():
    t = CellTable(20, 300 // 2, block_size=4)
    m = ModelCells(20, 150)
    fill(t, m, [3, 4, 5, 10], [7, 8, 9, 2], [0, 0, 149, 0])
    assert_same(t, m)
    assert t.seq_cells(0).tolist() == [3, 4, 10]
    assert (t.seq_cell_min[0], t.seq_cell_max[0], t.seq_pos_min[0], t.seq_pos_max[0]) == \
        (3, 10, 2, 8)
    assert t.seq_pos_max(149) == 9 and t.has_seq(5, 149) and not t.has_seq(5, 0)
    # lists and other integer dtypes are accepted
    t.apply_batch([0, 1], np.array([0, 1], np.uint16), (64, 64))
    m.apply_batch([0, 1], [0, 1], [64, 64])
    assert_same(t, m)


@pytest.mark.parametrize("args, name", [
    (([3], [0], [0]), "slots"),          # cell 3 is used
    (([20], [0], [0]), "slots"),
    (([-1], [0], [0]), "slots"),
    (([6, 6], [0, 1], [0, 0]), "slots"),
    (([7, 6, 7], [0, 1, 2], [0, 0, 0]), "slots"),
    (([6], [-1], [0]), "positions"),
    (([6], [POS_MAX + 1], [0]), "positions"),
    (([6], [0], [4]), "seqs"),
    (([6], [0], [-1]), "seqs"),
    (([6, 7], [0], [0, 0]), "positions"),
    (([6, 7], [0, 1], [0]), "seqs"),
    (([6], [0.5], [0]), "positions"),
    (([[6]], [0], [0]), "slots"),
])
def test_apply_batch_rejects_and_leaves_table(args, name):
    t = CellTable(20, 4)
    t.apply_batch(i32([3, 4]), i32([0, 1]), i32([0, 1]))
    snap = snapshot(t)
    with pytest.raises(ValueError, match=name):
        t.apply_batch(*args)
    assert_unchanged(t, snap)


def test_swa_idle_sequence_is_pruned_issue_10127():
    """Ollama #10127: with two sequences, one idle while the other decodes, the idle one's
    prompt (longer than the window memory) must shrink to `memory` cells too, or the cache runs
    out of room. Sizing as Ollama: 2 * memory + max_batch cells."""
    memory, max_batch = 5, 8
    t = CellTable(2 * memory + max_batch, 2)
    m = ModelCells(2 * memory + max_batch, 2)

    def step(positions, seqs):
        t.prune_window(i32(positions), i32(seqs), memory)
        m.prune_window(positions, seqs, memory)
        loc = t.find_contiguous(len(positions))
        assert loc == m.find_contiguous(len(positions))
        if loc < 0:
            assert t.n_free >= len(positions), "cache full: idle sequence not pruned"
            check_defrag(t, m)
            loc = t.find_contiguous(len(positions))
        assert loc >= 0
        slots = list(range(loc, loc + len(positions)))
        fill(t, m, slots, positions, seqs)
        assert_same(t, m)

    step(list(range(8)), [0] * 8)        # seq 0's prompt: a full batch
    step(list(range(8)), [1] * 8)        # seq 1's prompt
    # seq 1's batch pruned seq 0 (idle) down to its memory: positions 3..7 remain
    assert (t.seq_pos_min(0), t.seq_pos_max(0)) == (3, 7)
    for p in range(8, 40):               # seq 0 decodes alone; seq 1 stays idle
        step([p], [0])
        assert len(t.seq_cells(1)) <= memory
        assert len(t.seq_cells(0)) <= memory + 1
    assert (t.seq_pos_min(1), t.seq_pos_max(1)) == (3, 7)


def test_swa_batch_without_idle_pruning_would_fill():
    """The same traffic with idle sequences left alone (Ollama before the fix) runs out of
    contiguous room: the test above is not vacuous."""
    memory, max_batch = 5, 8
    m = ModelCells(2 * memory + max_batch, 2)

    def prune_batch_only(positions, seqs):
        lowest = {}
        for p, s in zip(positions, seqs):
            lowest[s] = min(lowest.get(s, 10**9), p)
        for s, low in lowest.items():
            for c in range(m.n):
                if s in m.seqs[c] and m.pos[c] < low - memory:
                    m._drop(c, s)

    full = False
    for positions, seqs in [(list(range(8)), [0] * 8), (list(range(8)), [1] * 8)] + \
            [([p], [0]) for p in range(8, 40)] + [(list(range(8, 16)), [1] * 8)]:
        prune_batch_only(positions, seqs)
        if m.n - m.n_used < len(positions):
            full = True
            break
        loc = m.find_contiguous(len(positions))
        if loc < 0:
            used = [c for c in range(m.n) if m.seqs[c]]
            m.adopt_defrag(used + [0] * (m.n - len(used)), len(used))
            loc = m.find_contiguous(len(positions))
        m.apply_batch(list(range(loc, loc + len(positions))), positions, seqs)
    assert full


def test_prune_window_semantics_and_undo():
    t = CellTable(30, 4, block_size=2)
    m = ModelCells(30, 4)
    fill(t, m, list(range(10)), list(range(10)), [0] * 10)
    fill(t, m, list(range(10, 16)), list(range(6)), [1] * 6)
    t.seq_cp(0, 2, 0, 4)
    m.seq_cp(0, 2, 0, 4)
    fill(t, m, [20], [50], [3])
    before = snapshot(t)
    # batch: seq 0 at 10; seq 1, 2, 3 idle
    undo = t.prune_window(i32([10, 11]), i32([0, 0]), 4)
    m.prune_window([10, 11], [0, 0], 4)
    assert_same(t, m)
    # seq 0 keeps pos >= 6; seq 1 (max 5) keeps >= 2; seq 2 (max 3) keeps >= 0; seq 3 keeps 50
    assert t.seq_pos_min(0) == 6 and t.seq_pos_min(1) == 2 and t.seq_pos_min(2) == 0
    assert t.seq_cells(3).tolist() == [20]
    assert {tuple(r[:2]) for r in undo.tolist()} == {(c, 0) for c in range(6)} | \
        {(10, 1), (11, 1)}
    t.undo_prune(undo)
    assert_unchanged(t, before)
    with pytest.raises(ValueError, match="records"):
        t.undo_prune(undo[:1].copy())     # cell 0 holds seq 0 again
    assert_unchanged(t, before)
    # memory < 0: unlimited, nothing evicted
    assert t.prune_window(i32([100]), i32([0]), -1).shape == (0, 4)
    assert_unchanged(t, before)


def test_batch_range_window_and_union():
    t = CellTable(40, 3, block_size=4)
    m = ModelCells(40, 3)
    fill(t, m, list(range(0, 10)), list(range(10)), [0] * 10)
    fill(t, m, list(range(10, 20)), list(range(10)), [1] * 10)
    fill(t, m, list(range(20, 25)), list(range(10, 15)), [0] * 5)
    for positions, seqs, window in [([15], [0], -1), ([15], [0], 3), ([15], [0], 0),
                                    ([15], [0], 100), ([10], [1], 2), ([15, 10], [0, 1], 4),
                                    ([3], [2], 5), ([200], [0], 5), ([16, 15], [0, 0], 6)]:
        assert t.batch_range(i32(positions), i32(seqs), window) == \
            m.batch_range(positions, seqs, window)
    assert t.batch_range(i32([15]), i32([0]), 3) == (22, 25)
    assert t.batch_range(i32([15, 10]), i32([0, 1]), -1) == (0, 25)


def test_remove_moves_down_and_accumulates_shift():
    t = CellTable(20, 2)
    m = ModelCells(20, 2)
    fill(t, m, list(range(10)), list(range(10)), [0] * 10)
    moved = t.remove(0, 2, 5)
    assert moved.dtype == np.int32 and moved.tolist() == m.remove(0, 2, 5) == list(range(5, 10))
    assert_same(t, m)
    assert t.cells["pos"][5:10].tolist() == [2, 3, 4, 5, 6]
    assert t.cells["shift"][5:10].tolist() == [-3] * 5
    t.remove(0, 0, 1)
    m.remove(0, 0, 1)
    assert t.cells["shift"][5:10].tolist() == [-4] * 5
    cells, deltas = t.take_shifts()
    assert (cells.tolist(), deltas.tolist()) == m.take_shifts() == \
        ([1] + list(range(5, 10)), [-1] + [-4] * 5)
    assert not t.has_pending_shifts()
    # end=None: drop the tail, nothing moves
    assert t.remove(0, 4, None).tolist() == m.remove(0, 4, None) == []
    assert_same(t, m)
    assert t.seq_pos_max(0) == 3


def test_remove_shared_cell_refused_before_any_change():
    t = CellTable(16, 3)
    fill(t, t_m := ModelCells(16, 3), list(range(8)), list(range(8)), [0] * 8)
    t.seq_cp(0, 1, 6, 8)            # cells 6, 7 shared
    t_m.seq_cp(0, 1, 6, 8)
    assert t.shared_cells_moving(0, 2, 4)
    assert not t.shared_cells_moving(0, 2, None) and not t.shared_cells_moving(0, 6, 8)
    snap = snapshot(t)
    with pytest.raises(NotSupportedError, match="shared by multiple sequences"):
        t.remove(0, 2, 4)
    with pytest.raises(NotSupportedError):
        t_m.remove(0, 2, 4)
    assert_unchanged(t, snap)
    assert_same(t, t_m)
    # removing the shared tail itself is fine (nothing moves)
    t.remove(0, 6, None)
    t_m.remove(0, 6, None)
    assert_same(t, t_m)
    assert t.seq_cells(1).tolist() == [6, 7]


def test_copy_prefix():
    t = CellTable(20, 3)
    m = ModelCells(20, 3)
    fill(t, m, list(range(6)), list(range(6)), [0] * 6)
    fill(t, m, [10, 11], [0, 1], [1, 1])
    t.copy_prefix(0, 1, 3)
    m.copy_prefix(0, 1, 3)
    assert_same(t, m)
    assert t.seq_cells(1).tolist() == [0, 1, 2] and t.n_used == 6   # 10, 11 freed
    t.copy_prefix(0, 0, 2)          # src == dst: no-op
    assert_same(t, m)
    t.copy_prefix(2, 1, 5)          # empty source: dst just empties
    m.copy_prefix(2, 1, 5)
    assert_same(t, m)
    assert t.seq_pos_max(1) == -1


def test_seq_rm_all_and_ranges():
    t = CellTable(20, 3)
    m = ModelCells(20, 3)
    fill(t, m, list(range(6)), list(range(6)), [0] * 6)
    fill(t, m, list(range(6, 12)), list(range(6)), [1] * 6)
    t.seq_cp(0, 2)
    m.seq_cp(0, 2)
    assert t.seq_rm(-1, 2, 4) is True
    m.seq_rm(-1, 2, 4)
    assert_same(t, m)
    assert t.n_used == 8
    t.seq_rm(2, -5, -1)             # p0 < 0 -> 0, p1 < 0 -> infinity
    m.seq_rm(2, -5, -1)
    assert_same(t, m)
    assert t.seq_pos_max(2) == -1
    t.seq_rm(-1)
    m.seq_rm(-1)
    assert_same(t, m)
    assert t.n_used == 0


def test_seq_keep_add_div():
    t = CellTable(20, 4)
    m = ModelCells(20, 4)
    fill(t, m, list(range(8)), list(range(8)), [0, 0, 1, 1, 2, 2, 3, 3])
    t.seq_cp(1, 0)
    m.seq_cp(1, 0)
    t.seq_keep(0)
    m.seq_keep(0)
    assert_same(t, m)
    assert t.n_used == 4 and seq_sets(t)[2] == {0}
    t.seq_add(0, 1, None, -2)       # pos 1 -> -1: freed
    m.seq_add(0, 1, None, -2)
    assert_same(t, m)
    assert t.cells["pos"][:4].tolist() == [0, -1, 0, 1]
    assert t.cells["shift"][:4].tolist() == [0, 0, -2, -2]
    t.seq_add(0, 0, None, 10)
    m.seq_add(0, 0, None, 10)
    t.seq_div(0, 0, None, 3)
    m.seq_div(0, 0, None, 3)
    assert_same(t, m)
    assert t.cells["pos"][[0, 2, 3]].tolist() == [3, 3, 3]
    assert t.cells["shift"][[0, 2, 3]].tolist() == [3, 1, 0]    # 11 -> 3 undoes its +8
    cells, deltas = t.take_shifts()
    assert (cells.tolist(), deltas.tolist()) == m.take_shifts() == ([0, 2], [3, 1])
    # shared cells cannot be shifted: refused before any change
    t.seq_cp(0, 1, 3, 4)
    m.seq_cp(0, 1, 3, 4)
    snap = snapshot(t)
    assert t.shared_cells_in(0) and not t.shared_cells_in(0, 0, 3)
    with pytest.raises(NotSupportedError):
        t.seq_add(0, 0, None, 1)
    with pytest.raises(NotSupportedError):
        t.seq_div(0, 0, None, 2)
    assert_unchanged(t, snap)
    t.seq_add(0, 0, 3, 1)           # the range avoids the shared cell
    m.seq_add(0, 0, 3, 1)
    assert_same(t, m)


def test_defrag_ollama_swap_scenario():
    """Ollama's defrag merges (src 3 -> dst 0) and (src 2 -> dst 1) into one block move
    src 2 -> dst 0 of length 2 while giving cell 0 the metadata of cell 3: cell 0 ends up with
    B's metadata and A's K/V. numbakv fills the hole lowest source first."""
    t = CellTable(4, 2)
    m = ModelCells(4, 2)
    fill(t, m, [2, 3], [10, 20], [0, 1])          # A = (seq 0, pos 10), B = (seq 1, pos 20)
    moves = check_defrag(t, m)
    assert moves.tolist() == [[2, 0, 2]]
    assert t.cells["pos"][:2].tolist() == [10, 20] and seq_sets(t)[:2] == [{0}, {1}]


def test_defrag_fragmented_and_merges():
    t = CellTable(200, 5, block_size=4)
    m = ModelCells(200, 5)
    rng = np.random.default_rng(7)
    used = np.flatnonzero(rng.random(200) < 0.6).tolist()
    fill(t, m, used, list(range(len(used))), rng.integers(0, 5, len(used)).tolist())
    t.seq_cp(1, 2)
    m.seq_cp(1, 2)
    t.seq_add(3, 0, None, 4)
    m.seq_add(3, 0, None, 4)
    moves = check_defrag(t, m)
    assert len(moves) > 1 and (moves[:, 2] > 1).any()
    assert t.find_contiguous(t.n_free) == t.n_used
    assert check_defrag(t, m).shape == (0, 3)      # already compact
    # pending shifts travel with their cells
    cells, deltas = t.take_shifts()
    assert cells.tolist() == m.take_shifts()[0] and (deltas == 4).all()


def test_mask_inputs():
    t = CellTable(12, 200)
    t.apply_batch(i32([2, 3, 5]), i32([7, 8, 9]), i32([0, 130, 199]))
    t.seq_cp(0, 64)
    pos, seqs = t.mask_inputs(1, 6)
    assert pos.dtype == np.int32 and pos.flags.c_contiguous and pos.tolist() == [-1, 7, 8, -1, 9]
    assert seqs.dtype == np.uint64 and seqs.shape == (5, SEQ_WORDS) and seqs.flags.c_contiguous
    assert seqs[1].tolist() == [1, 1, 0, 0]
    assert seqs[2].tolist() == [0, 0, 1 << 2, 0]
    assert seqs[4].tolist() == [0, 0, 0, 1 << 7]
    with pytest.raises(ValueError, match="lo, hi"):
        t.mask_inputs(5, 3)
    with pytest.raises(ValueError, match="lo, hi"):
        t.mask_inputs(0, 13)


@pytest.mark.parametrize("call, name", [
    (lambda t: t.remove(4, 0, 1), "seq"),
    (lambda t: t.remove(-1, 0, 1), "seq"),
    (lambda t: t.remove(0, -1, 1), "begin"),
    (lambda t: t.remove(0, 3, 1), "end"),
    (lambda t: t.remove(0, 1.5, 2), "begin"),
    (lambda t: t.copy_prefix(0, 9, 2), "dst"),
    (lambda t: t.copy_prefix(9, 0, 2), "src"),
    (lambda t: t.copy_prefix(0, 1, -2), "length"),
    (lambda t: t.seq_rm(-2), "seq"),
    (lambda t: t.seq_rm(0, "a"), "p0"),
    (lambda t: t.seq_cp(0, 4), "dst"),
    (lambda t: t.seq_keep(7), "seq"),
    (lambda t: t.seq_add(0, 0, None, 2**40), "delta"),
    (lambda t: t.seq_add(0, 0, None, POS_MAX), "delta"),
    (lambda t: t.seq_add(5, 0, None, 1), "seq"),
    (lambda t: t.seq_div(0, 0, None, 0), "d"),
    (lambda t: t.seq_div(0, 0, None, None), "d"),
    (lambda t: t.seq_pos_max(4), "seq"),
    (lambda t: t.seq_pos_min(-1), "seq"),
    (lambda t: t.find_contiguous(0), "n"),
    (lambda t: t.find_scatter(-1), "n"),
    (lambda t: t.prune_window(i32([1]), i32([9]), 3), "seqs"),
    (lambda t: t.prune_window(i32([-1]), i32([0]), 3), "positions"),
    (lambda t: t.prune_window(i32([1]), i32([0]), 2.5), "memory"),
    (lambda t: t.prune_window(i32([1, 2]), i32([0]), 1), "seqs"),
    (lambda t: t.batch_range(i32([1]), i32([4]), 3), "seqs"),
    (lambda t: t.batch_range(i32([1]), i32([0]), "w"), "window"),
    (lambda t: t.has_seq(99, 0), "cell"),
    (lambda t: t.seq_cells(4), "seq"),
    (lambda t: t.undo_prune(np.zeros((1, 3))), "records"),
])
def test_invalid_arguments_name_the_argument_and_change_nothing(call, name):
    t = CellTable(16, 4)
    t.apply_batch(i32(range(6)), i32(range(6)), i32([0, 0, 0, 1, 1, 1]))
    snap = snapshot(t)
    with pytest.raises(ValueError, match=name):
        call(t)
    assert_unchanged(t, snap)


@pytest.mark.parametrize("kwargs, name", [
    (dict(n_cells=0, max_seqs=1), "n_cells"), (dict(n_cells=4, max_seqs=0), "max_seqs"),
    (dict(n_cells=4, max_seqs=MAX_SEQS + 1), "max_seqs"),
    (dict(n_cells=4, max_seqs=1, block_size=3), "block_size"),
    (dict(n_cells=4.0, max_seqs=1), "n_cells")])
def test_constructor_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CellTable(**kwargs)


def test_copy_is_deep_and_rebuild_from_cells():
    t = CellTable(70, 3, block_size=8)
    t.apply_batch(i32(range(0, 70, 2)), i32(range(35)), i32([0, 1, 2, 1, 0] * 7))
    t.seq_add(1, 0, None, 3)
    c = t.copy()
    c.seq_rm(-1)
    assert c.n_used == 0 and t.n_used == 35
    t.check_consistency()
    # state loading: write the raw cells, then rebuild
    saved = t.cells.copy()
    fresh = CellTable(70, 3, block_size=8)
    fresh.load_cells(saved)
    fresh.check_consistency()
    assert np.array_equal(fresh.cells, t.cells)
    assert np.array_equal(fresh._sidx, t._sidx) and fresh.has_pending_shifts()
    fresh._seqs[5, 0] = 1 << 4                          # a sequence >= max_seqs
    with pytest.raises(ValueError, match=r"cells\[5\]"):
        fresh.rebuild_indexes()
    # records of a wider table load when the extra words are empty, and not otherwise
    wide = np.zeros(70, CELL_DTYPE)
    for f in ("pos", "shift"):
        wide[f] = saved[f]
    wide["seqs"][:, :1] = saved["seqs"]
    fresh.load_cells(wide)
    assert np.array_equal(fresh.cells, t.cells)
    wide["seqs"][3, 2] = 1
    with pytest.raises(ValueError, match=r"cells\[3\]"):
        fresh.load_cells(wide)
    bad = saved.copy()
    bad["pos"][0] = -3
    snap = snapshot(t)
    with pytest.raises(ValueError, match=r"cells\[0\]"):
        t.load_cells(bad)
    assert_unchanged(t, snap)
    with pytest.raises(ValueError, match="cells"):
        t.load_cells(saved[:10])


def test_decode_simulation_many_sequences():
    """A longer run at a size where the trees have several levels: 16 sequences decoding with
    a sliding window, against the model, with the contiguous placement + defrag fallback."""
    n_seq, memory, window = 16, 12, 10
    n_cells = n_seq * memory + 32
    t = CellTable(n_cells, n_seq, block_size=8)
    m = ModelCells(n_cells, n_seq)
    rng = np.random.default_rng(3)
    next_pos = [0] * n_seq
    for step in range(60):
        seqs = sorted(rng.choice(n_seq, size=int(rng.integers(1, 12)), replace=False).tolist())
        positions = [next_pos[s] for s in seqs]
        for s in seqs:
            next_pos[s] += 1
        t.prune_window(i32(positions), i32(seqs), memory)
        m.prune_window(positions, seqs, memory)
        assert t.batch_range(i32(positions), i32(seqs), window) == \
            m.batch_range(positions, seqs, window)
        loc = t.find_contiguous(len(seqs))
        assert loc == m.find_contiguous(len(seqs))
        if loc < 0:
            check_defrag(t, m)
            loc = t.find_contiguous(len(seqs))
        fill(t, m, list(range(loc, loc + len(seqs))), positions, seqs)
        if step % 10 == 0:
            assert_same(t, m)
    assert_same(t, m)


# ---- the state machine ----------------------------------------------------------------------

class CellMachine(RuleBasedStateMachine):
    """Random operation sequences through CellTable and the model, compared after every step."""

    @initialize(n_cells=st.one_of(st.integers(1, 24), st.integers(60, 140)),
                max_seqs=st.sampled_from([1, 3, 8, 70, 256]),
                block_size=st.sampled_from([1, 2, 4, 64, None]), data=st.data())
    def init(self, n_cells, max_seqs, block_size, data):
        self.t = CellTable(n_cells, max_seqs, block_size=block_size)
        self.m = ModelCells(n_cells, max_seqs)
        ids = st.integers(0, max_seqs - 1)
        if max_seqs > 64:
            ids = st.one_of(ids, st.sampled_from([63, 64, max_seqs - 1]))
        self.pool = data.draw(st.lists(ids, min_size=min(2, max_seqs), max_size=4, unique=True),
                              label="pool")
        for s in self.pool:                    # prompts, so that operations find cells
            self.prompt(s, data.draw(st.integers(0, 12), label="prompt length"))

    def prompt(self, seq, length):
        """Place `length` consecutive positions of seq contiguously (no window), if they fit."""
        loc = self.t.find_contiguous(max(length, 1))
        assert loc == self.m.find_contiguous(max(length, 1))
        if length == 0 or loc < 0:
            return
        start = self.m.pos_range(seq)[1] + 1
        fill(self.t, self.m, list(range(loc, loc + length)),
             list(range(start, start + length)), [seq] * length)

    @rule(data=st.data())
    def prompt_rule(self, data):
        self.prompt(self.seq(data), data.draw(st.integers(1, 10), label="prompt length"))

    def seq(self, data):
        return data.draw(st.sampled_from(self.pool), label="seq")

    def both(self, name, *args):
        """Run one operation on both; they must agree on success / NotSupportedError, and a
        refusal must leave the table unchanged."""
        snap = snapshot(self.t)
        try:
            r1, e1 = getattr(self.t, name)(*args), None
        except NotSupportedError as exc:
            r1, e1 = None, type(exc)
        try:
            r2, e2 = getattr(self.m, name)(*args), None
        except NotSupportedError as exc:
            r2, e2 = None, type(exc)
        assert e1 == e2, (name, args, e1, e2)
        self.error = e1
        if e1 is not None:
            assert_unchanged(self.t, snap)
        return r1, r2

    def positions_for(self, data, seqs):
        nxt = {}
        out = []
        for s in seqs:
            if data.draw(st.integers(0, 4), label="random pos?") == 0:
                out.append(data.draw(st.integers(0, 40), label="pos"))
            else:
                if s not in nxt:
                    nxt[s] = self.m.pos_range(s)[1] + 1
                out.append(nxt[s])
                nxt[s] += 1
        return out

    @rule(data=st.data())
    def forward(self, data):
        t, m = self.t, self.m
        b = data.draw(st.integers(1, min(6, t.n_cells)), label="batch")
        seqs = [self.seq(data) for _ in range(b)]
        positions = self.positions_for(data, seqs)
        memory = data.draw(st.integers(-1, 8), label="memory")
        window = data.draw(st.integers(-1, 8), label="window")
        contiguous = data.draw(st.booleans(), label="contiguous")
        before_t, before_m = snapshot(t), m.copy()
        undo = t.prune_window(i32(positions), i32(seqs), memory)
        m.prune_window(positions, seqs, memory)
        assert_same(t, m)
        defragged = False
        if contiguous:
            loc = t.find_contiguous(b)
            assert loc == m.find_contiguous(b)
            if loc < 0 and t.n_free >= b:
                check_defrag(t, m)
                defragged = True
                loc = t.find_contiguous(b)
                assert loc == m.find_contiguous(b) and loc >= 0
            slots = None if loc < 0 else list(range(loc, loc + b))
        else:
            found = t.find_scatter(b)
            expect = m.find_scatter(b)
            assert (found is None and expect is None) or found.tolist() == expect
            slots = None if found is None else found.tolist()
        abort = data.draw(st.integers(0, 5), label="abort") == 0 and not defragged
        if slots is None or abort:
            # an all-or-nothing start_forward that cannot place its batch puts back what the
            # prune dropped (no defrag ran: a full table cannot be helped by one)
            assert not defragged
            t.undo_prune(undo)
            self.m = before_m
            assert_unchanged(t, before_t)
            return
        lo, hi = t.batch_range(i32(positions), i32(seqs), window)
        assert (lo, hi) == m.batch_range(positions, seqs, window)
        if not defragged and data.draw(st.integers(0, 5), label="take back") == 0:
            # a sibling cache failed: the whole start_forward is taken back, no copy needed
            head = t.head
            t.apply_batch(i32(slots), i32(positions), i32(seqs))
            t.unapply_batch(i32(slots), head)
            t.undo_prune(undo)
            self.m = before_m
            assert_unchanged(t, before_t)
            return
        # the range holds every stored cell any token of the batch may see
        for p, s in zip(positions, seqs):
            for c in range(t.n_cells):
                if s in m.seqs[c] and m.pos[c] <= p and (window < 0 or m.pos[c] >= p - window):
                    assert lo <= c < hi
        t.apply_batch(i32(slots), i32(positions), i32(seqs))
        m.apply_batch(slots, positions, seqs)
        # the mask kernel's inputs over the attended range plus the batch
        lo2 = min([lo] + slots) if hi > lo else min(slots)
        hi2 = max([hi] + [s + 1 for s in slots])
        pos, bits = t.mask_inputs(lo2, hi2)
        for p, s in zip(positions, seqs):
            seen = [(int(bits[j, s >> 6]) >> (s & 63)) & 1 == 1 and pos[j] <= p and
                    (window < 0 or pos[j] >= p - window) for j in range(hi2 - lo2)]
            expect = [s in m.seqs[c] and m.pos[c] <= p and (window < 0 or m.pos[c] >= p - window)
                      for c in range(lo2, hi2)]
            assert seen == expect

    def near(self, data, seq, label, lo=0):
        """A position near what seq holds (so that ranges hit its cells), or anywhere."""
        pmin, pmax = self.m.pos_range(seq)
        if pmax < 0 or data.draw(st.integers(0, 3), label=label + " anywhere?") == 0:
            return data.draw(st.integers(lo, 30), label=label)
        return data.draw(st.integers(max(lo, pmin - 2), pmax + 2), label=label)

    @rule(data=st.data())
    def share(self, data):
        """seq_cp then an operation that must refuse or not to move shared cells."""
        holding = [s for s in self.pool if self.m.pos_range(s)[1] >= 0]
        src = data.draw(st.sampled_from(holding or self.pool), label="src")
        others = [s for s in self.pool if s != src]
        dst = data.draw(st.sampled_from(others), label="dst") if others else src
        self.both("seq_cp", src, dst, self.near(data, src, "p0"), None)
        begin = self.near(data, src, "begin")
        end = data.draw(st.integers(begin, begin + 4), label="end")
        op = data.draw(st.sampled_from(["remove", "seq_add", "seq_div"]), label="op")
        if op == "remove":
            would = self.t.shared_cells_moving(src, begin, end)
            r1, _ = self.both("remove", src, begin, end)
            assert (r1 is None) == would
        elif op == "seq_add":
            delta = data.draw(st.integers(-5, 5), label="delta")
            would = self.t.shared_cells_in(src, begin, end) and delta != 0 and begin < end
            self.both("seq_add", src, begin, end, delta)
            assert would == (self.error is NotSupportedError)
        else:
            self.both("seq_div", src, begin, None, data.draw(st.integers(2, 3)))

    @rule(data=st.data())
    def prune_and_undo(self, data):
        """A prune whose batch then cannot be placed: undo puts back every bit, position and
        pending shift."""
        seqs = [self.seq(data) for _ in range(data.draw(st.integers(1, 3)))]
        positions = self.positions_for(data, seqs)
        snap = snapshot(self.t)
        undo = self.t.prune_window(i32(positions), i32(seqs), data.draw(st.integers(0, 4)))
        self.t.undo_prune(undo)
        assert_unchanged(self.t, snap)

    @rule(data=st.data())
    def remove(self, data):
        seq = self.seq(data)
        begin = self.near(data, seq, "begin")
        end = data.draw(st.one_of(st.none(), st.integers(begin, begin + 10)), label="end")
        would = self.t.shared_cells_moving(seq, begin, end)
        r1, r2 = self.both("remove", seq, begin, end)
        assert (r1 is None) == would
        if r1 is not None:
            assert r1.tolist() == r2

    @rule(data=st.data())
    def copy_prefix(self, data):
        src = self.seq(data)
        self.both("copy_prefix", src, self.seq(data), self.near(data, src, "length"))

    @rule(data=st.data())
    def seq_rm(self, data):
        seq = data.draw(st.one_of(st.just(-1), st.sampled_from(self.pool)), label="seq")
        p0 = self.near(data, self.pool[0] if seq < 0 else seq, "p0", lo=-3)
        p1 = data.draw(st.one_of(st.none(), st.integers(-1, 40)), label="p1")
        r1, _ = self.both("seq_rm", seq, p0, p1)
        assert r1 is True

    @rule(data=st.data())
    def seq_cp(self, data):
        self.both("seq_cp", self.seq(data), self.seq(data), data.draw(st.integers(-2, 20)),
                  data.draw(st.one_of(st.none(), st.integers(-1, 40))))

    @rule(data=st.data())
    def seq_keep(self, data):
        if data.draw(st.integers(0, 3)) == 0:      # rare: it empties most of the table
            self.both("seq_keep", self.seq(data))

    @rule(data=st.data())
    def seq_add(self, data):
        seq = self.seq(data)
        self.both("seq_add", seq, self.near(data, seq, "p0", lo=-2),
                  data.draw(st.one_of(st.none(), st.integers(-1, 40))),
                  data.draw(st.integers(-12, 12)))

    @rule(data=st.data())
    def seq_div(self, data):
        seq = self.seq(data)
        self.both("seq_div", seq, self.near(data, seq, "p0", lo=-2),
                  data.draw(st.one_of(st.none(), st.integers(-1, 40))),
                  data.draw(st.integers(1, 4)))

    @rule()
    def defrag(self):
        check_defrag(self.t, self.m)

    @rule()
    def take_shifts(self):
        had = self.t.has_pending_shifts()
        cells, deltas = self.t.take_shifts()
        mc, md = self.m.take_shifts()
        assert cells.tolist() == mc and deltas.tolist() == md and had == bool(mc)
        assert not self.t.has_pending_shifts()

    @rule(data=st.data())
    def invalid_call(self, data):
        t = self.t
        bad_seq = data.draw(st.sampled_from([t.max_seqs, -2, t.max_seqs + 7]))
        call = data.draw(st.sampled_from([
            lambda: t.remove(bad_seq if bad_seq != -1 else -2, 0, None),
            lambda: t.seq_rm(bad_seq),
            lambda: t.copy_prefix(self.pool[0], bad_seq, 3),
            lambda: t.seq_add(bad_seq, 0, None, 1),
            lambda: t.apply_batch(i32([0]), i32([0]), i32([bad_seq])),
            lambda: t.prune_window(i32([5]), i32([bad_seq]), 2),
        ]))
        snap = snapshot(t)
        with pytest.raises(ValueError):
            call()
        assert_unchanged(t, snap)

    @invariant()
    def same(self):
        if hasattr(self, "t"):
            assert_same(self.t, self.m)
            # the pure queries, over many sizes (the free-run tree's word-crossing cases)
            for n in (1, 2, 3, 4, 5, 7, 9, 16, 33, 64, 65, 100):
                assert self.t.find_contiguous(n) == self.m.find_contiguous(n), n
            for n in (1, 3, 8):
                found = self.t.find_scatter(n)
                assert (None if found is None else found.tolist()) == self.m.find_scatter(n)
            for s in self.pool:
                for window in (-1, 0, 2, 5):
                    p = max(self.m.pos_range(s)[1], 0) + 1
                    assert self.t.batch_range(i32([p]), i32([s]), window) == \
                        self.m.batch_range([p], [s], window)


CellMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.data_too_large])
TestCellMachine = CellMachine.TestCase


def test_deepcopy_and_pickle_keep_views_aliased():
    import copy
    import pickle
    t = CellTable(20, 3)
    t.apply_batch(i32([0, 1]), i32([4, 5]), i32([2, 2]))
    for c in (copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        c.check_consistency()
        c.seq_rm(2)
        assert c.seq_pos_max(2) == -1 and c.seq_pos_max[2] == -1
        assert t.seq_pos_max(2) == 5


def test_unapply_batch_takes_back_a_forward():
    t = CellTable(140, 70, block_size=4)
    t.apply_batch(i32(range(0, 60)), i32(range(60)), i32([0, 65] * 30))
    t.seq_cp(0, 3, 10, 20)
    before = snapshot(t)
    undo = t.prune_window(i32([70, 71, 60]), i32([65, 65, 3]), 12)
    head = t.head
    slots = t.find_scatter(3)
    t.apply_batch(slots, i32([70, 71, 60]), i32([65, 65, 3]))
    snap = snapshot(t)
    with pytest.raises(ValueError, match="slots"):
        t.unapply_batch(np.append(slots, 139), head)     # cell 139 is free
    with pytest.raises(ValueError, match="head"):
        t.unapply_batch(slots, 140)
    assert_unchanged(t, snap)
    t.unapply_batch(slots, head)
    t.undo_prune(undo)
    assert_unchanged(t, before)


# ---- undo log ---------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_journal_rollback_restores_everything(seed):
    """Random tables, every journaled operation (one or several in a row), then a rollback: the
    cells and every index are exactly as before, and the undo log held only the blocks the
    operations touched (not the table)."""
    rng = np.random.default_rng(seed)
    n, seqs = 700, 3 + seed % 2 * 70          # one and two bit words
    t = CellTable(n, seqs, block_size=16)
    for _ in range(30):
        k = int(rng.integers(1, 20))
        start = t.find_contiguous(k)
        if start < 0:
            break
        s = int(rng.integers(0, min(seqs, 4)))
        p0 = int(t.seq_pos_max(s)) + 1
        t.apply_batch(i32(range(start, start + k)), i32(range(p0, p0 + k)), i32([s] * k))
        if rng.random() < 0.3:
            t.seq_rm(s, p0 + k // 2, None)
    ops = [lambda j: t.remove(0, 3, 9, journal=j), lambda j: t.remove(1, 2, None, journal=j),
           lambda j: t.seq_rm(2, 0, 5, journal=j), lambda j: t.seq_rm(-1, 4, 8, journal=j),
           lambda j: t.seq_cp(0, 3 if seqs > 3 else 2, 1, 30, journal=j),
           lambda j: t.copy_prefix(1, 0, 12, journal=j), lambda j: t.seq_keep(1, journal=j),
           lambda j: t.seq_add(0, 2, None, -3, journal=j),
           lambda j: t.seq_div(1, 0, 40, 3, journal=j)]
    for _ in range(12):
        snap = snapshot(t)
        journal = []
        for i in rng.choice(len(ops), int(rng.integers(1, 4)), replace=False):
            try:
                ops[i](journal)
            except NotSupportedError:
                pass
            t.check_consistency()
        t.rollback(journal)
        assert journal == []
        assert_unchanged(t, snap)
        t.check_consistency()



def test_join_into_an_empty_sequence():
    """copy_prefix / seq_cp into a sequence holding no cell widen its indexes once per block
    and journal only its index row: the joined table matches the model cell for cell, and a
    rollback (mixed with block-copy records of other edits) puts back every array exactly."""
    n, seqs = 900, 70                            # two bit words; 66 and 67 live in the second
    t = CellTable(n, seqs, block_size=16)
    m = ModelCells(n, seqs)
    # sources spread over many blocks, interleaved with each other and with holes, positions
    # out of cell order (seq 0's positions 200.. sit before its positions 0..199)
    for s, start, p0, k in ((0, 300, 0, 200), (1, 40, 0, 150), (0, 20, 200, 19),
                            (66, 600, 0, 90), (1, 520, 150, 60)):
        args = (i32(range(start, start + k)), i32(range(p0, p0 + k)), i32([s] * k))
        t.apply_batch(*args)
        m.apply_batch(*args)
    # (edits, O(1) join records, block-copy records) -- seq_cp(0, 0) records nothing
    cases = [([("copy_prefix", 0, 2, 170)], 1, 0),
             ([("seq_cp", 1, 67, 30, 190)], 1, 0),
             ([("copy_prefix", 66, 3, 50), ("seq_cp", 0, 3, 100, 219), ("seq_cp", 1, 3, 60, 70),
               ("seq_rm", 3, 40, 60)], 1, 3),
             ([("seq_cp", 0, 0, 0, 5), ("copy_prefix", 1, 2, 0)], 1, 0)]
    for ops, n_joins, n_blocks in cases:
        snap = snapshot(t)
        before = m.copy()
        journal = []
        for name, *args in ops:
            getattr(t, name)(*args, journal=journal)
            getattr(m, name)(*args)
            t.check_consistency()
            assert_same(t, m)
        # a join into an empty dst is an O(1) record (dst's index row); every other edit
        # (a join into a dst holding cells included) copies the cells of its blocks
        joins = [j for j in journal if not hasattr(j, "pos")]
        assert len(joins) == n_joins and all(j.sidx.shape == (4,) for j in joins)
        assert len(journal) - n_joins == n_blocks
        t.rollback(journal)
        assert journal == []
        assert_unchanged(t, snap)
        t.check_consistency()
        m = before
        assert_same(t, m)
    t.copy_prefix(0, 2, 170)            # 170 cells over blocks 18..29 of seq 0
    assert (t.seq_pos_min(2), t.seq_pos_max(2)) == (0, 169)
    assert (t.seq_cell_min(2), t.seq_cell_max(2)) == (300, 469)


def test_stack_holds_its_tables_on_their_rows_only():
    """CellTableStack.holds: its own tables in order (any sequence type); not another table,
    another order or length, nor a table whose arrays left the stack's rows (a state load)."""
    tables = [CellTable(8, 1), CellTable(8, 1)]
    stack = CellTableStack(tables)
    assert stack.holds(tables) and stack.holds(tuple(tables)) and stack.holds(iter(tables))
    assert not stack.holds(tables[::-1])
    assert not stack.holds(tables[:1])
    assert not stack.holds([tables[0], CellTable(8, 1)])
    tables[1]._meta = tables[1]._meta.copy()
    assert not stack.holds(tables)
