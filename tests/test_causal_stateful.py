"""Random stateful test of ``numbakv.CausalCache`` against the pure-Python model of causal.go in
``causal_reference.RefCausal``.

Each run drives one cache with a seeded random workload: batches for random sequences (prefill
and decode, sequences mixed in one batch, positions continuing from ``seq_pos_max + 1``),
``remove`` (truncation and middle removal), ``copy_prefix``, ``seq_rm``/``seq_cp``/``seq_keep``/
``seq_add``/``seq_div``, ``defrag``, ``can_resume`` and ``set_causal``; batches that cannot fit
(``KVCacheFullError``) and refused moves (``NotSupportedError``) must leave the cache unchanged.

Every token gets a uid written into its value rows (``value = uid + small offsets``), so a
returned row says which token it holds. After each forward pass, for every batch token, the rows
its mask shows must be exactly the model's tokens for that sequence under causal.go's visibility
rules, each with its own value and its key (re-rotated by every shift it received). Until the
first defrag the cell layout is deterministic, and the cell range, the full mask and every live
row are compared exactly too. ``seq_pos_min``/``seq_pos_max`` are checked after every operation.
"""

import zlib

import numpy as np
import pytest

import numbakv as nkv
from numbakv import KVCacheFullError, NotSupportedError

from causal_reference import (AddShift, RefCausal, RefFull, RefNotSupported, assert_same_state,
                              read_get, rope_ref, round_up, state_snapshot, to_device)

CONFIGS = {
    "plain-add": dict(max_seqs=4, capacity=8, max_batch=8, shift="add"),
    "plain-rope-padded": dict(max_seqs=3, capacity=8, max_batch=6, cache_padding=4,
                              mask_batch_padding=4, permuted_v=True, shift="rope"),
    "swa-add": dict(max_seqs=3, capacity=32, max_batch=6, swa_window=3, shift="add",
                    v_head_dim=4),
    "swa-memory-noshift-padded": dict(max_seqs=2, capacity=64, max_batch=4, swa_window=2,
                                      swa_memory=5, cache_padding=2, shift=None),
    "chunked-add": dict(max_seqs=2, capacity=12, max_batch=5, chunk_size=3, shift="add",
                        permuted_v=True),
    "swa-unlimited-rope": dict(max_seqs=2, capacity=16, max_batch=4, swa_window=3,
                               swa_memory=100, shift="rope"),
}

ROPE = dict(base=10000.0, neox=True)
N_LAYERS, N_HEADS, HEAD_DIM = 2, 2, 8


class Harness:
    def __init__(self, device: str, seed: int, *, shift=None, v_head_dim=None,
                 public_defrag: bool = True, **kw):
        self.rng = np.random.default_rng(seed)
        # without public defrags the layout stays exact for longer (until the cache fills)
        self.public_defrag = public_defrag
        self.mode = shift
        self.v_dim = v_head_dim or HEAD_DIM
        cfg_kw = {k: kw[k] for k in ("max_seqs", "capacity", "max_batch", "cache_padding",
                                     "mask_batch_padding", "permuted_v") if k in kw}
        cache_kw = {k: kw.get(k) for k in ("swa_window", "swa_memory", "chunk_size")}
        self.config = nkv.CacheConfig(N_LAYERS, N_HEADS, HEAD_DIM, v_head_dim=v_head_dim,
                                      dtype="float32", device=device, **cfg_kw)
        if shift == "add":
            shift_obj = AddShift()
        elif shift == "rope":
            shift_obj = nkv.RopeShift(**ROPE)
        else:
            shift_obj = None
        self.cache = nkv.CausalCache(self.config, shift=shift_obj, **cache_kw)
        self.ref = RefCausal(max_seqs=self.config.max_seqs, capacity=self.config.capacity,
                             max_batch=self.config.max_batch,
                             cache_padding=self.config.cache_padding,
                             mask_batch_padding=self.config.mask_batch_padding,
                             has_shift=shift is not None, **cache_kw)
        assert self.cache.n_cells == self.ref.n_cells
        self.max_seqs = self.config.max_seqs
        self.keys = {}            # uid -> [L, H, D] float32 key as put
        self.values = {}          # uid -> [L, H, Dv] float32 value as put
        self.next_uid = 1
        self.counts = {}
        self.full_errors = 0
        self.refused = 0
        self.exact_checks = 0

    # ---- expectations ---------------------------------------------------------------------
    def expected_key(self, uid):
        k = self.keys[uid]
        d = self.ref.shift[uid]
        if d == 0 or self.mode is None:
            return k
        if self.mode == "add":
            return k + np.float32(d)
        return rope_ref(k, [d] * N_LAYERS, **ROPE)

    def key_close(self, got, want):
        if self.mode == "rope":
            return np.allclose(got, want, rtol=1e-5, atol=1e-4)
        return np.array_equal(got, want)

    def check_spans(self):
        for s in range(self.max_seqs):
            got = (self.cache.seq_pos_min(s), self.cache.seq_pos_max(s))
            want = (self.ref.pos_min(s), self.ref.pos_max(s))
            assert got == want, f"seq {s}: (seq_pos_min, seq_pos_max) = {got}, model {want}"

    # ---- operations -----------------------------------------------------------------------
    def op_forward(self):
        r = self.rng
        n_seq = int(r.integers(1, min(3, self.max_seqs) + 1))
        chosen = r.choice(self.max_seqs, n_seq, replace=False)
        budget = self.config.max_batch
        tokens = []
        for s in chosen:
            if budget == 0:
                break
            n = 1 if r.random() < 0.6 else int(r.integers(1, budget + 1))
            n = min(n, budget)
            budget -= n
            start = self.ref.pos_max(int(s)) + 1
            tokens += [(int(s), start + i) for i in range(n)]
        if r.random() < 0.5:
            tokens = [tokens[i] for i in r.permutation(len(tokens))]
        seqs = [t[0] for t in tokens]
        positions = [t[1] for t in tokens]
        b = len(tokens)
        uids = list(range(self.next_uid, self.next_uid + b))
        L, H, D, Dv = N_LAYERS, N_HEADS, HEAD_DIM, self.v_dim
        if self.mode == "rope":
            raw = r.standard_normal((b, L, H, D)).astype(np.float32)
            keys = np.stack([rope_ref(raw[:, l], positions, **ROPE) for l in range(L)],
                            axis=1).astype(np.float32)
        else:
            keys = r.integers(-8, 9, (b, L, H, D)).astype(np.float32)
        offs = (np.arange(L * H * Dv, dtype=np.float32) / 256).reshape(L, H, Dv)
        values = np.asarray(uids, np.float32)[:, None, None, None] + offs[None]

        try:
            self.ref.start_forward(positions, seqs, uids)
        except RefFull:
            before = state_snapshot(self.cache)
            with pytest.raises(KVCacheFullError):
                self.cache.start_forward(positions, seqs)
            assert_same_state(before, state_snapshot(self.cache))
            self.full_errors += 1
            # make room: cut the longest sequence in half
            longest = max(range(self.max_seqs), key=lambda s: len(self.ref.positions(s)))
            p = self.ref.positions(longest)
            cut = p[len(p) // 2] if p else 0
            assert self.cache.seq_rm(longest, cut) is True
            self.ref.seq_rm(longest, cut)
            return
        self.next_uid += b
        for i, u in enumerate(uids):
            self.keys[u] = keys[i]
            self.values[u] = values[i]

        c = self.cache
        c.start_forward(positions, seqs)
        except_ = None
        if r.random() < 0.15:
            except_ = sorted(int(i) for i in r.choice(b, int(r.integers(1, b + 1)), replace=False))
            c.set_causal(except_)
            self.ref.set_causal(except_)
        for layer in range(L):
            c.set_layer(layer)
            c.put(to_device(np.ascontiguousarray(keys[:, layer]), c.device),
                  to_device(np.ascontiguousarray(values[:, layer]), c.device))
        got_k, got_v, got_m = read_get(c, L, "float32", self.config.permuted_v)
        self.check_batch(c.cell_range(), got_k, got_v, got_m)

    def check_batch(self, cell_range, got_k, got_v, got_m):
        ref, cfg = self.ref, self.config
        lo, hi = cell_range
        b = len(ref.batch_uid)
        n = hi - lo
        assert 0 <= lo < hi <= self.cache.n_cells
        assert lo % cfg.cache_padding == 0 and hi % cfg.cache_padding == 0, (lo, hi)
        for layer in range(N_LAYERS):
            assert got_k[layer].shape == (n, N_HEADS, HEAD_DIM)
            assert got_v[layer].shape == (n, N_HEADS, self.v_dim)
            m = got_m[layer]
            assert m.shape == (round_up(b, cfg.mask_batch_padding), n)
            assert np.all((m == 0) | (m == -np.inf)), "mask entries must be 0 or -inf"
            assert np.all(m[b:] == -np.inf), "padding rows of the mask must be all -inf"
            assert np.all(np.isfinite(got_k[layer])) and np.all(np.isfinite(got_v[layer]))
            assert np.array_equal(m, got_m[0]), "every layer sees the same mask"
        row_uid = np.floor(got_v[0][:, 0, 0]).astype(np.int64)
        # the batch sits in one contiguous run of cells, in batch order
        first = np.flatnonzero(row_uid == ref.batch_uid[0])
        assert len(first) == 1, "the batch's first token must be in exactly one returned row"
        r0 = int(first[0])
        assert list(row_uid[r0:r0 + b]) == ref.batch_uid, "batch tokens not contiguous in order"
        m = got_m[0]
        for i in range(b):
            cols = np.flatnonzero(m[i] == 0)
            seen = sorted(int(row_uid[j]) for j in cols)
            want = ref.visible_uids(i)
            assert seen == want, (f"token {i} (seq {ref.batch_seq[i]}, pos {ref.batch_pos[i]}) "
                                  f"sees uids {seen}, model says {want}")
            for j in cols:
                self.check_row(got_k, got_v, j, int(row_uid[j]))
        if ref.exact:
            self.exact_checks += 1
            assert (lo, hi) == (ref.lo, ref.hi), f"cell range {(lo, hi)}, model {(ref.lo, ref.hi)}"
            assert lo + r0 == ref.loc, f"batch placed at cell {lo + r0}, model {ref.loc}"
            want_m = ref.mask()
            bad = np.argwhere(want_m != m)
            assert bad.size == 0, f"mask differs from the model at {bad[:8].tolist()}"
            for j in range(n):
                u = ref.layout[lo + j]
                if u is not None:
                    assert row_uid[j] == u, f"cell {lo + j} holds uid {row_uid[j]}, model {u}"
                    self.check_row(got_k, got_v, j, u)

    def check_row(self, got_k, got_v, j, uid):
        assert uid in self.keys, f"row {j} holds unknown uid {uid}"
        want_k = self.expected_key(uid)
        for layer in range(N_LAYERS):
            assert np.array_equal(got_v[layer][j], self.values[uid][layer]), \
                f"value of uid {uid} (layer {layer}) is wrong"
            assert self.key_close(got_k[layer][j], want_k[layer]), \
                (f"key of uid {uid} (layer {layer}) is wrong: "
                 f"{got_k[layer][j][0]} vs {want_k[layer][0]}")

    def _live_seq(self):
        live = sorted(self.ref.live_seqs())
        return int(self.rng.choice(live)) if live else None

    def _expect_refusal(self, call):
        before = state_snapshot(self.cache)
        with pytest.raises(NotSupportedError):
            call()
        assert_same_state(before, state_snapshot(self.cache))
        self.refused += 1

    def op_remove(self):
        s = self._live_seq()
        if s is None:
            return
        lo, hi = self.ref.pos_min(s), self.ref.pos_max(s)
        begin = int(self.rng.integers(lo, hi + 2))
        end = None if self.rng.random() < 0.4 else int(self.rng.integers(begin + 1, hi + 3))
        try:
            self.ref.remove(s, begin, end)
        except RefNotSupported:
            self._expect_refusal(lambda: self.cache.remove(s, begin, end))
            return
        self.cache.remove(s, begin, end)
        self._ended()

    def op_copy_prefix(self):
        src = self._live_seq()
        if src is None or self.max_seqs < 2:
            return
        dst = int(self.rng.choice([t for t in range(self.max_seqs) if t != src]))
        n = int(self.rng.integers(0, self.ref.pos_max(src) + 2))
        self.cache.copy_prefix(src, dst, n)
        self.ref.copy_prefix(src, dst, n)
        self._ended()

    def op_seq_rm(self):
        s = -1 if self.rng.random() < 0.1 else self._live_seq()
        if s is None:
            return
        hi = max(self.ref.pos_max(t) for t in range(self.max_seqs))
        p0 = int(self.rng.integers(0, hi + 2))
        p1 = None if self.rng.random() < 0.5 else int(self.rng.integers(p0 + 1, hi + 3))
        assert self.cache.seq_rm(s, p0, p1) is True
        self.ref.seq_rm(s, p0, p1)
        self._ended()

    def op_seq_cp(self):
        src = self._live_seq()
        empty = [t for t in range(self.max_seqs) if self.ref.pos_max(t) < 0]
        if src is None or not empty:
            return
        dst = int(self.rng.choice(empty))
        hi = self.ref.pos_max(src)
        p0 = int(self.rng.integers(0, hi + 1))
        p1 = None if self.rng.random() < 0.5 else int(self.rng.integers(p0 + 1, hi + 2))
        self.cache.seq_cp(src, dst, p0, p1)
        self.ref.seq_cp(src, dst, p0, p1)
        self._ended()

    def op_seq_keep(self):
        s = self._live_seq()
        if s is None:
            return
        self.cache.seq_keep(s)
        self.ref.seq_keep(s)
        self._ended()

    def _move_args(self):
        s = self._live_seq()
        if s is None:
            return None
        hi = self.ref.pos_max(s)
        p0 = int(self.rng.integers(0, hi + 1))
        p1 = int(self.rng.integers(p0 + 1, hi + 2))
        return s, p0, p1

    def op_seq_add(self):
        if self.mode is None:
            return
        args = self._move_args()
        if args is None:
            return
        s, p0, p1 = args
        delta = int(self.rng.choice([-3, -2, -1, 1, 2, 3]))
        try:
            self.ref.seq_add(s, p0, p1, delta)
        except RefNotSupported:
            self._expect_refusal(lambda: self.cache.seq_add(s, p0, p1, delta))
            return
        self.cache.seq_add(s, p0, p1, delta)
        self._ended()

    def op_seq_div(self):
        if self.mode is None:
            return
        args = self._move_args()
        if args is None:
            return
        s, p0, p1 = args
        d = int(self.rng.choice([2, 3]))
        try:
            self.ref.seq_div(s, p0, p1, d)
        except RefNotSupported:
            self._expect_refusal(lambda: self.cache.seq_div(s, p0, p1, d))
            return
        self.cache.seq_div(s, p0, p1, d)
        self._ended()

    def op_defrag(self):
        self.cache.defrag()
        self.ref.defrag()
        self._ended()

    def _ended(self):
        """A sequence operation ends the forward pass in progress (round-2 contract)."""
        with pytest.raises(ValueError, match="start_forward"):
            self.cache.get()

    def op_reput(self):
        """A batch repeating a (sequence, position), or re-putting one the sequence holds, is a
        ValueError that changes nothing."""
        s = self._live_seq()
        if s is None:
            return
        if self.rng.random() < 0.5:
            positions, seqs = [int(self.rng.choice(self.ref.positions(s)))], [s]
        else:
            nxt = self.ref.pos_max(s) + 1
            positions, seqs = [nxt, nxt + 1, nxt], [s, s, s]
            if self.config.max_batch < 3:
                return
        before = state_snapshot(self.cache)
        with pytest.raises(ValueError, match="already stored or repeated"):
            self.cache.start_forward(positions, seqs)
        assert_same_state(before, state_snapshot(self.cache))

    def op_can_resume(self):
        s = int(self.rng.integers(0, self.max_seqs))
        p = int(self.rng.integers(0, max(self.ref.pos_max(s), 0) + 4))
        assert self.cache.can_resume(s, p) == self.ref.can_resume(s, p), (s, p)

    OPS = [("forward", 50), ("remove", 10), ("copy_prefix", 5), ("seq_rm", 7), ("seq_cp", 5),
           ("seq_keep", 1), ("seq_add", 7), ("seq_div", 2), ("defrag", 4), ("can_resume", 9),
           ("reput", 3)]

    def run(self, n_ops: int):
        names = [o[0] for o in self.OPS]
        weights = np.array([0 if (o[0] == "defrag" and not self.public_defrag) else o[1]
                            for o in self.OPS], np.float64)
        weights /= weights.sum()
        for step in range(n_ops):
            name = names[int(self.rng.choice(len(names), p=weights))]
            try:
                getattr(self, "op_" + name)()
                self.check_spans()
            except AssertionError as e:
                raise AssertionError(f"step {step} ({name}): {e}") from e
            self.counts[name] = self.counts.get(name, 0) + 1


def _run(device, name, seed, n_ops, episodes):
    totals = {}
    exact = full = refused = 0
    for e in range(episodes):
        h = Harness(device, seed * 1000 + e, public_defrag=bool(e % 2), **CONFIGS[name])
        h.run(n_ops)
        for k, v in h.counts.items():
            totals[k] = totals.get(k, 0) + v
        exact += h.exact_checks
        full += h.full_errors
        refused += h.refused
    # the workload must really have exercised the cache
    assert totals.get("forward", 0) > n_ops * episodes // 3
    assert exact > 0
    return totals, full, refused


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_workload_cpu(name):
    totals, full, refused = _run("cpu", name, seed=zlib.crc32(name.encode()) % 1000,
                                 n_ops=80, episodes=8)
    if not name.startswith("swa"):      # SWA sizing leaves room for any regular batch
        assert full > 0, "the workload never filled the cache"


def test_random_workload_kernel_device(kernel_device):
    _run(kernel_device, "plain-rope-padded", seed=5, n_ops=30, episodes=1)
    _run(kernel_device, "swa-add", seed=6, n_ops=30, episodes=1)


# ------------------------------------------------------------------------------------------
# WrapperCache: a sliding-window group and a full-attention group, each against its own model
# ------------------------------------------------------------------------------------------

#: the SWA group evicts (memory 3) and fragments (defrags to place); the full group fills up
#: (KVCacheFullError after the SWA group has already pruned and placed: the rollback case)
WRAPPER_GROUPS = {
    "swa": dict(max_seqs=3, capacity=10, max_batch=4, swa_window=2, swa_memory=3, shift="add"),
    "full": dict(max_seqs=3, capacity=6, max_batch=4, shift="add", permuted_v=True,
                 cache_padding=2),
}


class WrapperHarness:
    """Drives ``WrapperCache([swa, full])`` (or ``[full, swa]``) with the single-cache workload;
    each group's cache is checked against its own model after every operation, and a refusal
    by any group must leave every group unchanged."""

    def __init__(self, device: str, seed: int, swa_first: bool):
        self.rng = np.random.default_rng(seed)
        names = ["swa", "full"] if swa_first else ["full", "swa"]
        self.groups = [Harness(device, seed * 7 + i, **WRAPPER_GROUPS[n])
                       for i, n in enumerate(names)]
        self.full = self.groups[names.index("full")]
        self.wrapper = nkv.WrapperCache([h.cache for h in self.groups],
                                        layer_groups=[g for g in range(2)
                                                      for _ in range(N_LAYERS)])
        self.max_seqs = 3
        self.next_uid = 1
        self.counts = {}
        self.full_errors = self.refused = 0

    def _snap(self):
        return [h.ref.snapshot() for h in self.groups], [state_snapshot(h.cache)
                                                         for h in self.groups]

    def _restore_refs(self, snaps):
        for h, s in zip(self.groups, snaps):
            h.ref.restore(s)

    def _same_as(self, states):
        for h, before in zip(self.groups, states):
            assert_same_state(before, state_snapshot(h.cache))

    def _pos_max(self, s):
        return max(h.ref.pos_max(s) for h in self.groups)

    def op_forward(self):
        r = self.rng
        chosen = r.choice(self.max_seqs, int(r.integers(1, 3)), replace=False)
        budget, tokens = 4, []
        for s in chosen:
            n = min(budget, 1 if r.random() < 0.5 else int(r.integers(1, budget + 1)))
            budget -= n
            tokens += [(int(s), self._pos_max(int(s)) + 1 + i) for i in range(n)]
            if budget == 0:
                break
        seqs, positions = [t[0] for t in tokens], [t[1] for t in tokens]
        b = len(tokens)
        uids = list(range(self.next_uid, self.next_uid + b))
        refs, states = self._snap()
        try:
            for h in self.groups:
                h.ref.start_forward(positions, seqs, uids)
        except RefFull:
            self._restore_refs(refs)
            with pytest.raises(KVCacheFullError):
                self.wrapper.start_forward(positions, seqs)
            self._same_as(states)
            self.full_errors += 1
            longest = max(range(self.max_seqs), key=lambda s: len(self.full.ref.positions(s)))
            p = self.full.ref.positions(longest)
            cut = p[len(p) // 2] if p else 0
            self.wrapper.seq_rm(longest, cut)
            for h in self.groups:
                h.ref.seq_rm(longest, cut)
            return
        self.next_uid += b
        self.wrapper.start_forward(positions, seqs)
        if r.random() < 0.15:
            except_ = sorted(int(i) for i in r.choice(b, int(r.integers(1, b + 1)), replace=False))
            self.wrapper.set_causal(except_)
            for h in self.groups:
                h.ref.set_causal(except_)
        offs = (np.arange(N_LAYERS * N_HEADS * HEAD_DIM, dtype=np.float32) / 256).reshape(
            N_LAYERS, N_HEADS, HEAD_DIM)
        values = np.asarray(uids, np.float32)[:, None, None, None] + offs[None]
        for g, h in enumerate(self.groups):
            keys = r.integers(-8, 9, (b, N_LAYERS, N_HEADS, HEAD_DIM)).astype(np.float32)
            for i, u in enumerate(uids):
                h.keys[u], h.values[u] = keys[i], values[i]
            for layer in range(N_LAYERS):
                self.wrapper.set_layer(g * N_LAYERS + layer)
                self.wrapper.put(to_device(np.ascontiguousarray(keys[:, layer]), h.cache.device),
                                 to_device(np.ascontiguousarray(values[:, layer]),
                                           h.cache.device))
        for h in self.groups:
            got = read_get(h.cache, N_LAYERS, "float32", h.config.permuted_v)
            h.check_batch(h.cache.cell_range(), *got)

    def _fan(self, name, *args):
        refs, states = self._snap()
        try:
            for h in self.groups:
                getattr(h.ref, name)(*args)
        except RefNotSupported:
            self._restore_refs(refs)
            with pytest.raises(NotSupportedError):
                getattr(self.wrapper, name)(*args)
            self._same_as(states)
            self.refused += 1
            return
        getattr(self.wrapper, name)(*args)

    def _live(self):
        live = sorted(self.full.ref.live_seqs())
        return int(self.rng.choice(live)) if live else None

    def op_remove(self):
        s = self._live()
        if s is not None:
            lo, hi = self.full.ref.pos_min(s), self.full.ref.pos_max(s)
            begin = int(self.rng.integers(lo, hi + 2))
            end = None if self.rng.random() < 0.4 else int(self.rng.integers(begin + 1, hi + 3))
            self._fan("remove", s, begin, end)

    def op_seq_rm(self):
        s = self._live()
        if s is not None:
            p0 = int(self.rng.integers(0, self.full.ref.pos_max(s) + 2))
            self._fan("seq_rm", s, p0, None)

    def op_copy_prefix(self):
        src = self._live()
        if src is not None:
            dst = int(self.rng.choice([t for t in range(self.max_seqs) if t != src]))
            self._fan("copy_prefix", src, dst, int(self.rng.integers(0, self._pos_max(src) + 2)))

    def op_seq_add(self):
        s = self._live()
        if s is not None:
            hi = self.full.ref.pos_max(s)
            p0 = int(self.rng.integers(0, hi + 1))
            self._fan("seq_add", s, p0, int(self.rng.integers(p0 + 1, hi + 2)),
                      int(self.rng.choice([-2, -1, 1, 2])))

    def op_defrag(self):
        self.wrapper.defrag()
        for h in self.groups:
            h.ref.defrag()

    def op_can_resume(self):
        s = int(self.rng.integers(0, self.max_seqs))
        p = int(self.rng.integers(0, max(self._pos_max(s), 0) + 4))
        assert self.wrapper.can_resume(s, p) == all(h.ref.can_resume(s, p) for h in self.groups)

    OPS = [("forward", 55), ("remove", 10), ("seq_rm", 8), ("copy_prefix", 8), ("seq_add", 8),
           ("defrag", 4), ("can_resume", 7)]

    def run(self, n_ops: int):
        names = [o[0] for o in self.OPS]
        weights = np.array([o[1] for o in self.OPS], np.float64)
        weights /= weights.sum()
        for step in range(n_ops):
            name = names[int(self.rng.choice(len(names), p=weights))]
            try:
                getattr(self, "op_" + name)()
                for h in self.groups:
                    h.check_spans()
                    h.cache.cells.check_consistency()
            except AssertionError as e:
                raise AssertionError(f"step {step} ({name}): {e}") from e
            self.counts[name] = self.counts.get(name, 0) + 1


@pytest.mark.parametrize("swa_first", [True, False], ids=["swa-first", "swa-last"])
def test_random_workload_wrapper(swa_first):
    full = refused = forwards = defrags = 0
    for e in range(6):
        h = WrapperHarness("cpu", 100 + e + 10 * swa_first, swa_first)
        h.run(70)
        full += h.full_errors
        refused += h.refused
        forwards += h.counts.get("forward", 0)
        defrags += sum(g.cache.defrag_count for g in h.groups)
    assert forwards > 6 * 70 // 3
    assert full > 0, "the full-attention group never filled up"
    assert defrags > 0
