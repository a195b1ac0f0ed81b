"""Model test of ``shared_shift="copy"`` (issue 37, items 13 and 14): random sequence operations
on sequences that share cells, hold one position twice (after their own ``seq_add`` /
``seq_div`` / ``seq_cp``) and move, against a model where every sequence owns its entries.

The shift is a callable that adds the position delta to the key, so ``K - position`` of every
entry stays the constant it was written with wherever it moves, and ``V`` is that constant: a
lost, duplicated or mixed-up entry shows as a wrong multiset of ``(position, K - position, V)``
per sequence."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import numbakv as nkv

H, D, LAYERS, SEQS = 1, 2, 2, 3


def add_delta(layer, key, deltas):
    return key + np.asarray(deltas, np.float32)[:, None, None]


def new_cache(capacity=12):
    cfg = nkv.CacheConfig(n_layers=LAYERS, n_kv_heads=H, head_dim=D, dtype="float32",
                          capacity=capacity, max_seqs=SEQS, device="cpu")
    return nkv.CausalCache(cfg, shift=add_delta, shared_shift="copy")


def held(cache, seq):
    """Sorted ``(position, K - position, V)`` of every entry of ``seq``."""
    cache.apply_pending_shifts()
    cells = cache.cells.seq_cells(seq)
    pos = cache.cells._pos[cells].astype(np.int64)
    out = []
    for i, c in enumerate(cells):
        k = np.asarray(cache.storage.keys[:, c, 0, 0])
        v = np.asarray(cache.storage.values[:, c, 0, 0])
        out.append((int(pos[i]), tuple((k - pos[i]).tolist()), tuple(v.tolist())))
    return sorted(out)


class Model:
    """Per sequence, a list of entries ``[position, constant, cell id]``. The id stands for the
    cell holding the entry: ``seq_cp`` adds a cell to a sequence once (a sequence that already
    holds that cell gains nothing), and an entry that moves gets a new id (in copy mode a shared
    cell that moves is copied for the moving sequence; an unshared one has no other holder)."""

    def __init__(self):
        self.seqs = {s: [] for s in range(SEQS)}
        self.next = 1
        self.ids = 0

    def new_id(self):
        self.ids += 1
        return self.ids

    def rows(self, s):
        return sorted((p, tuple(float(c + 0.25 * l) for l in range(LAYERS)),
                       tuple(float(c + 0.25 * l + 0.5) for l in range(LAYERS)))
                      for p, c, _ in self.seqs[s])


def copies_needed(cache, kind, s, a, stop, k) -> int:
    """Cells of ``s`` that other sequences share and whose position the operation changes."""
    n = 0
    for c in cache.cells.seq_cells(s):
        p = int(cache.cells._pos[c])
        if len(shared_by(cache, c)) < 2:
            continue
        if kind == "add" and k and a <= p < stop:
            n += 1
        elif kind == "div" and a <= p < stop and p // (abs(k) + 1) != p:
            n += 1
        elif kind == "remove" and k and p >= a + abs(k):
            n += 1
    return n


def shared_by(cache, cell):
    return [q for q in range(SEQS) if cache.cells.has_seq(int(cell), q)]


kinds = st.sampled_from(["fill", "fill", "cp", "cp", "add", "add", "div", "rm", "remove"])
ops = st.lists(st.tuples(kinds,
                         st.integers(0, SEQS - 1), st.integers(0, SEQS - 1),
                         st.integers(0, 6), st.integers(-1, 8), st.integers(-3, 3)),
               min_size=1, max_size=14)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=ops, capacity=st.sampled_from([3, 4, 12]))
# item 13: seq 0 holds position 0 twice (once shared with seq 1), then moves
@example(ops=[("fill", 0, 0, 1, 0, 0), ("cp", 0, 1, 0, 1, 0), ("add", 0, 0, 1, -1, -1),
              ("add", 0, 0, 0, -1, 3)], capacity=12)
# item 14: seq_div keeps position 0 in place; with room for exactly the moving copies
@example(ops=[("fill", 0, 0, 2, 0, 0), ("fill", 2, 0, 0, 0, 0), ("cp", 0, 1, 0, -1, 0),
              ("div", 0, 0, 0, -1, 1)], capacity=2)
# a cell already held by the destination is not copied to it twice; an empty remove is a no-op
@example(ops=[("fill", 0, 0, 0, 0, 0)] + [("fill", 1, 0, 0, 0, 0)] * 7
         + [("cp", 1, 0, 1, -1, 0), ("fill", 0, 0, 0, 0, 0), ("cp", 0, 1, 1, -1, 0)], capacity=3)
@example(ops=[("fill", 0, 0, 0, 0, 0)] + [("fill", 1, 0, 0, 0, 0)] * 7
         + [("cp", 1, 0, 1, -1, 0), ("remove", 0, 0, 0, 0, 0)], capacity=3)
def test_copy_mode_moves_every_entry_of_the_moving_sequence_only(ops, capacity):
    cache, model = new_cache(capacity), Model()
    for kind, s, t, a, b, k in ops:
        p1 = None if b < 0 else b
        stop = 1 << 40 if p1 is None else p1
        before = {q: held(cache, q) for q in range(SEQS)}
        try:
            if kind == "fill":
                n = a % 3 + 1
                start = max((e[0] for e in model.seqs[s]), default=-1) + 1
                pos = list(range(start, start + n))
                cache.start_forward(pos, [s] * n)
                consts = list(range(model.next, model.next + n))
                for layer in range(LAYERS):
                    cache.set_layer(layer)
                    kk = np.array(consts, np.float32)[:, None, None] + 0.25 * layer + \
                        np.array(pos, np.float32)[:, None, None]
                    kk = np.broadcast_to(kk, (n, H, D)).copy()
                    vv = kk - np.array(pos, np.float32)[:, None, None] + 0.5
                    cache.put(kk, vv)
                model.seqs[s] += [[p, c, model.new_id()] for p, c in zip(pos, consts)]
                model.next += n
            elif kind == "cp":
                cache.seq_cp(s, t, a, p1)
                if s != t:
                    have = {e[2] for e in model.seqs[t]}
                    model.seqs[t] += [list(e) for e in model.seqs[s]
                                      if a <= e[0] < stop and e[2] not in have]
            elif kind == "add":
                cache.seq_add(s, a, p1, k)
                if k:
                    moved = []
                    for e in model.seqs[s]:
                        if a <= e[0] < stop:
                            if e[0] + k >= 0:
                                moved.append([e[0] + k, e[1], model.new_id()])
                        else:
                            moved.append(e)
                    model.seqs[s] = moved
            elif kind == "div":
                d = abs(k) + 1
                cache.seq_div(s, a, p1, d)
                for e in model.seqs[s]:
                    if a <= e[0] < stop and e[0] // d != e[0]:
                        e[0] //= d
                        e[2] = model.new_id()
            elif kind == "rm":
                cache.seq_rm(s, a, p1)
                model.seqs[s] = [e for e in model.seqs[s] if not a <= e[0] < stop]
            else:
                end = a + abs(k)
                cache.remove(s, a, end)
                gap = end - a
                model.seqs[s] = [[e[0] - gap, e[1], model.new_id()] if e[0] >= end and gap
                                 else e for e in model.seqs[s] if not a <= e[0] < end]
        except nkv.KVCacheFullError:
            # refused for want of room: a batch that does not fit, or a move whose shared
            # cells that MOVE do not fit
            assert kind == "fill" or copies_needed(cache, kind, s, a, stop, k) > \
                cache.cells.n_free
            assert {q: held(cache, q) for q in range(SEQS)} == before
            continue
        except ValueError:
            # refused (a repeated position): nothing changed
            assert {q: held(cache, q) for q in range(SEQS)} == before
            continue
        for q in range(SEQS):
            assert held(cache, q) == model.rows(q), (kind, s, t, a, b, k, q)
        cache.cells.check_consistency()
