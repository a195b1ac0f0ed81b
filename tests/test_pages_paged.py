"""Paged placement and page tables in pages (issue 34 item 2): ``CacheConfig(page_size=64)``
places every sequence's tokens so that, in position order, they fill pages of 64 cells (page
``p`` = cells ``[64p, 64p + 64)``, pages anywhere in the pool, only the last one partial), and
``page_table(page_size=64)`` hands out FlashMLA's ``block_table`` / FlashInfer's paged arrays for
any such layout. Random sequence operations check the rule after each one against a numpy
reference built from the cell table, the K/V of every (sequence, position) against a model, the
MLA attention over the pages against the dense ``attend``, and that an operation that breaks
the rule makes ``page_table`` refuse, naming the sequence, instead of describing it wrongly."""

import numpy as np
import pytest

import numbakv as nkv
from numbakv.errors import KVCacheFullError, NotSupportedError

from helpers import host, same, shares_memory
from test_mla import RANK, ROPE, D, absorbed_reference, rope_reference

P = 64


def paged_cache(device="cpu", page_size=P, capacity=256, max_seqs=4, **kw):
    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=1, head_dim=D, v_head_dim=0, dtype="float32",
                          capacity=capacity, max_seqs=max_seqs, max_batch=512, device=device,
                          page_size=page_size, **kw)
    return nkv.CausalCache(cfg, shift=nkv.RopeShift(base=10000.0, dim=ROPE, offset=RANK))


def ordered_cells(cache, seq):
    """``seq``'s cells in position order (int64), and their positions."""
    cells = np.asarray(cache.cells.seq_cells(seq), np.int64)
    pos = cache.cells.cells["pos"][cells]
    order = np.argsort(pos, kind="stable")
    return cells[order], pos[order]


def rule_holds(cache, seq, page=P) -> bool:
    """The page rule, written plainly: token i (position order) sits in slot i % page of the
    page that token i - i % page opened."""
    cells, _ = ordered_cells(cache, seq)
    for i, c in enumerate(cells.tolist()):
        if c % page != i % page or c // page != int(cells[i - i % page]) // page:
            return False
    return True


def reference_table(cache, seqs, page=P):
    """The paged arrays of ``seqs`` (batch order of first appearance), every cell visible."""
    pages, lens = [], []
    for s in seqs:
        cells, _ = ordered_cells(cache, s)
        lens.append(len(cells))
        pages.append([int(cells[k]) // page for k in range(0, len(cells), page)])
    width = max(1, max(len(p) for p in pages))
    block = np.full((len(seqs), width), -1, np.int32)
    for b, p in enumerate(pages):
        block[b, :len(p)] = p
    last = [n - (len(p) - 1) * page if n else 0 for n, p in zip(lens, pages)]
    indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])])
    return {"cache_seqlens": lens, "block_table": block, "kv_indptr": indptr.tolist(),
            "kv_indices": [x for p in pages for x in p], "kv_last_page_len": last}


def check_table(cache, pt, seqs, page=P):
    want = reference_table(cache, seqs, page)
    assert pt.page_size == page
    assert host(pt.seq_ids).tolist() == list(seqs)
    assert host(pt.cache_seqlens).tolist() == want["cache_seqlens"]
    assert same(host(pt.block_table), want["block_table"])
    assert host(pt.kv_indptr).tolist() == want["kv_indptr"]
    assert host(pt.kv_indices).tolist() == want["kv_indices"]
    assert host(pt.kv_last_page_len).tolist() == want["kv_last_page_len"]


class Model:
    """The rows each (sequence, position) must hold, and the driver of random operations."""

    def __init__(self, cache, rng):
        self.cache, self.rng = cache, rng
        self.rows = {}          # (seq, pos) -> float32 [2 layers, D]
        self.max_seqs = cache.config.max_seqs

    def next_pos(self, s):
        return self.cache.seq_pos_max(s) + 1

    def forward(self, seqs_counts):
        pos, sq = [], []
        for s, k in seqs_counts:
            p0 = self.next_pos(s)
            pos += range(p0, p0 + k)
            sq += [s] * k
        pos, sq = np.array(pos, np.int32), np.array(sq, np.int32)
        self.cache.start_forward(pos, sq)
        rows = self.rng.standard_normal((2, len(pos), D)).astype(np.float32)
        for layer in range(2):
            self.cache.set_layer(layer)
            self.cache.put(rows[layer][:, None, :], None)
        for i, (p, s) in enumerate(zip(pos.tolist(), sq.tolist())):
            self.rows[(s, p)] = rows[:, i]
        return pos, sq

    def seq_rm(self, s, p0=0, p1=None):
        self.cache.seq_rm(s, p0, p1)
        stop = np.inf if p1 is None else p1
        for key in [k for k in self.rows if k[0] == s and p0 <= k[1] < stop]:
            del self.rows[key]

    def seq_cp(self, src, dst):
        self.seq_rm(dst)
        self.cache.seq_cp(src, dst)
        for (s, p), r in list(self.rows.items()):
            if s == src:
                self.rows[(dst, p)] = r

    def seq_add(self, s, delta):
        try:
            self.cache.seq_add(s, 0, None, delta)
        except NotSupportedError:       # shares cells with another sequence: nothing changed
            return
        mine = sorted(k for k in self.rows if k[0] == s)
        rows = {k: self.rows.pop(k) for k in mine}
        shift = self.cache.shift
        for (_, p), r in rows.items():
            turned = rope_reference(r[:, None, :], np.full(2, delta), shift)[:, 0]
            self.rows[(s, p + delta)] = turned

    def check_rows(self):
        """Every (sequence, position) holds its own row in both layers."""
        self.cache.apply_pending_shifts()
        keys = np.array(host(self.cache.storage.keys))[:, :, 0]
        for s in range(self.max_seqs):
            cells, pos = ordered_cells(self.cache, s)
            assert sorted(pos.tolist()) == sorted(p for (t, p) in self.rows if t == s)
            for c, p in zip(cells.tolist(), pos.tolist()):
                np.testing.assert_allclose(keys[:, c], self.rows[(s, p)], rtol=1e-4, atol=1e-4)


def paged_attend_reference(cache, pt, q, layer):
    """FlashMLA's dense decode semantics over the block table, in numpy: sequence ``b``'s
    tokens are gathered page by page from ``mla_views(page_size)``; its ``q_len`` queries are
    its last ``q_len`` positions (query j sees the first ``seqlen - q_len + j + 1`` tokens)."""
    ckv, kpe = cache.mla_views(layer, page_size=pt.page_size)
    ckv, kpe = np.asarray(host(ckv)), np.asarray(host(kpe))
    block, lens = host(pt.block_table), host(pt.cache_seqlens)
    qo, order = host(pt.qo_indptr), host(pt.token_order)
    out = np.zeros((q.shape[0], q.shape[1], RANK))
    for b in range(len(lens)):
        n = int(lens[b])
        idx = np.arange(n)
        lat = np.concatenate([ckv[block[b, idx // P], idx % P], kpe[block[b, idx // P], idx % P]],
                             axis=-1)
        rows = order[qo[b]:qo[b + 1]]
        q_len = len(rows)
        visible = idx[None, :] < (n - q_len + np.arange(1, q_len + 1))[:, None]
        out[rows] = absorbed_reference(q[rows], lat, visible, 1 / np.sqrt(D), RANK)
    return out


def random_step(model, rng, breaking: bool):
    """One random sequence operation; ``breaking`` adds those that break the page rule."""
    cache, n = model.cache, model.max_seqs
    ops = ["forward"] * 6 + ["rm_all", "rm_suffix", "cp", "defrag", "add", "import", "keep"]
    if breaking:
        ops += ["rm_middle"] * 4
    op = ops[int(rng.integers(len(ops)))]
    s = int(rng.integers(n))
    if op == "forward":
        chosen = [t for t in range(n) if rng.random() < 0.5] or [s]
        counts = [(t, int(rng.choice([1, 1, 2, 5, P - 1, P + 3]))) for t in chosen]
        try:
            model.forward(counts)
        except KVCacheFullError:
            model.seq_rm(int(rng.integers(n)))
        return op
    if op == "rm_all":
        model.seq_rm(s)
    elif op == "rm_suffix":
        top = cache.seq_pos_max(s)
        if top > 0:
            model.seq_rm(s, int(rng.integers(top + 1)), None)
    elif op == "rm_middle":
        top = cache.seq_pos_max(s)
        if top > 4:
            a = int(rng.integers(1, top - 2))
            model.seq_rm(s, a, a + int(rng.integers(1, 3)))
    elif op == "cp":
        dst = int(rng.integers(n))
        if dst != s:
            model.seq_cp(s, dst)
    elif op == "defrag":
        cache.defrag()
    elif op == "add":
        model.seq_add(s, int(rng.integers(1, 9)))
    elif op == "import":
        dst = int(rng.integers(n))
        if dst != s and cache.seq_pos_max(s) >= 0:
            snap = cache.export_seq(s)
            model.seq_rm(dst)
            at = int(rng.integers(0, 4)) if rng.random() < 0.5 else None
            delta = 0 if at is None else at - cache.seq_pos_min(s)
            try:
                cache.import_seq(dst, snap, at=at)
            except KVCacheFullError:
                return op
            for (t, p), r in list(model.rows.items()):
                if t == s:
                    model.rows[(dst, p + delta)] = r if delta == 0 else rope_reference(
                        r[:, None, :], np.full(2, delta), cache.shift)[:, 0]
    elif op == "keep":
        if rng.random() < 0.3:
            cache.seq_keep(s)
            for key in [k for k in model.rows if k[0] != s]:
                del model.rows[key]
    return op


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_the_page_rule(seed):
    """Only operations that can keep the rule (appends, whole and suffix removals, seq_cp with
    both sides going on, defrag, uniform shifts, imports, seq_keep): after every one, every
    sequence's cells fill pages, page_table(64) equals the reference, every row is its own,
    and on decode steps the paged MLA attention equals the dense attend."""
    torch = pytest.importorskip("torch")
    from numbakv.attention import attend
    rng = np.random.default_rng(seed)
    cache = paged_cache()
    model = Model(cache, rng)
    ops = []
    for step in range(70):
        ops.append(random_step(model, rng, breaking=False))
        for s in range(model.max_seqs):
            assert rule_holds(cache, s), (s, ops[-6:])
        cache.cells.check_consistency()
        if ops[-1] != "forward" or cache._forward is None:
            continue
        fwd = cache._forward
        seqs = list(dict.fromkeys(fwd.seqs.tolist()))
        pt = cache.page_table(page_size=P)
        check_table(cache, pt, seqs)
        if step % 3 == 0:
            model.check_rows()
            # a decode step over the pages: the paged MLA attention equals the dense attend
            cache.start_forward(*model_forward_args(model, rng))
            fwd = cache._forward
            q = rng.standard_normal((len(fwd.positions), 4, D)).astype(np.float32)
            for layer in range(2):
                cache.set_layer(layer)
                rows = rng.standard_normal((len(fwd.positions), 1, D)).astype(np.float32)
                cache.put(rows, None)
                for i, (p, s) in enumerate(zip(fwd.positions.tolist(), fwd.seqs.tolist())):
                    model.rows.setdefault((s, p), np.zeros((2, D), np.float32))[layer] = rows[i, 0]
            pt = cache.page_table(page_size=P)
            check_table(cache, pt, list(dict.fromkeys(fwd.seqs.tolist())))
            dense = attend(torch.from_numpy(q), cache, backend="dense").numpy()
            np.testing.assert_allclose(dense, paged_attend_reference(cache, pt, q, 1),
                                       rtol=2e-4, atol=2e-4)
    model.check_rows()
    assert {"cp", "defrag", "import"} <= set(ops)


def model_forward_args(model, rng):
    """A decode step (one token each) of up to three sequences, positions after their last."""
    n = model.max_seqs
    chosen = [t for t in range(n) if rng.random() < 0.6][:3] or [0]
    pos = np.array([model.next_pos(t) for t in chosen], np.int32)
    return pos, np.array(chosen, np.int32)


@pytest.mark.parametrize("seed", [3, 4])
def test_random_operations_that_break_the_rule_are_refused_by_page_table(seed):
    """With middle removals too: whenever every batch sequence's cells fill pages the table
    equals the reference; otherwise page_table raises NotSupportedError naming the first batch
    sequence that does not (never a wrong table)."""
    rng = np.random.default_rng(seed)
    cache = paged_cache()
    model = Model(cache, rng)
    refused = described = 0
    for _ in range(120):
        op = random_step(model, rng, breaking=True)
        cache.cells.check_consistency()
        if op != "forward" or cache._forward is None:
            continue
        seqs = list(dict.fromkeys(cache._forward.seqs.tolist()))
        broken = [s for s in seqs if not rule_holds(cache, s)]
        if broken:
            with pytest.raises(NotSupportedError, match=f"sequence {broken[0]}'s"):
                cache.page_table(page_size=P)
            refused += 1
        else:
            check_table(cache, cache.page_table(page_size=P), seqs)
            described += 1
    model.check_rows()
    assert refused and described


def test_paged_placement_by_example():
    """Two sequences decoding in turn each go on in their own page (the contiguous policy
    interleaves them); a sequence's next page is the first wholly free one, wherever it is; a
    removed sequence frees its pages; a defrag moves whole pages."""
    rng = np.random.default_rng(5)
    cache = paged_cache(max_seqs=3, capacity=128)          # 384 cells: 6 pages
    model = Model(cache, rng)
    model.forward([(0, 3), (1, 2)])
    assert ordered_cells(cache, 0)[0].tolist() == [0, 1, 2]
    assert ordered_cells(cache, 1)[0].tolist() == [64, 65]
    for _ in range(3):
        model.forward([(1, 1), (0, 1)])
    assert ordered_cells(cache, 0)[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert ordered_cells(cache, 1)[0].tolist() == [64, 65, 66, 67, 68]
    model.forward([(2, 70)])                               # pages 2 and 3
    assert ordered_cells(cache, 2)[0].tolist() == list(range(128, 198))
    model.seq_rm(1)                                        # page 1 wholly free again
    assert cache.cells.n_free_pages == 3
    model.forward([(0, 60)])                               # fills page 0, opens page 1
    cells0 = ordered_cells(cache, 0)[0]
    assert cells0[:64].tolist() == list(range(64)) and cells0[64:].tolist() == [64, 65]
    pt = cache.page_table(page_size=P)
    assert host(pt.block_table).tolist() == [[0, 1]]
    model.seq_rm(0)
    model.forward([(1, 1)])                                # first free page: 0
    assert ordered_cells(cache, 1)[0].tolist() == [0]
    cache.defrag()                                         # pages 0, 2, 3 in use: 3 -> 1
    assert ordered_cells(cache, 2)[0].tolist() == list(range(128, 192)) + list(range(64, 70))
    assert rule_holds(cache, 2)
    model.check_rows()
    model.forward([(2, 1), (1, 1)])
    check_table(cache, cache.page_table(page_size=P), [2, 1])


def test_shared_prefix_pages_copy_on_write():
    """seq_cp shares a partly filled page; the sequence that writes its next slot first keeps
    it, the other gets its own copy of that page's cells (K/V in every layer) and goes on there,
    so both keep the rule; whole shared pages stay shared."""
    rng = np.random.default_rng(6)
    cache = paged_cache(max_seqs=3, capacity=128)
    model = Model(cache, rng)
    model.forward([(0, 100)])                              # page 0 full, page 1: 36 tokens
    model.seq_cp(0, 1)
    model.forward([(1, 1)])                                # 1 takes cell 100
    assert ordered_cells(cache, 1)[0][-1] == 100
    model.forward([(0, 2)])                                # 0 copies its 36 to page 2
    cells0 = ordered_cells(cache, 0)[0]
    assert cells0[:64].tolist() == list(range(64))         # the full page stays shared
    assert cells0[64:].tolist() == list(range(128, 166))
    assert rule_holds(cache, 0) and rule_holds(cache, 1)
    check_table(cache, cache.page_table(page_size=P), [0])
    model.check_rows()
    # both sharers going on in one pass: the lower sequence id keeps the page, the other copies
    model.seq_rm(1)
    model.seq_cp(0, 1)
    model.forward([(1, 1), (0, 1)])
    assert rule_holds(cache, 0) and rule_holds(cache, 1)
    assert ordered_cells(cache, 0)[0][-1] == 166
    assert ordered_cells(cache, 1)[0][64:].tolist() == list(range(64, 64 + 39))
    check_table(cache, cache.page_table(page_size=P), [1, 0])
    model.check_rows()
    model.seq_rm(1)
    # a start_forward that copies a shared page and then finds no room for its batch takes
    # the copy back: pages 0 and 2 in use, the copy takes page 1, 250 tokens need 4 more of 3
    model.seq_cp(0, 2)
    model.forward([(0, 1)])                                # 0 takes the slot 2 would want
    before, keys = cache.cells.cells, np.array(host(cache.storage.keys))
    p0 = model.next_pos(2)
    with pytest.raises(KVCacheFullError):
        cache.start_forward(np.arange(p0, p0 + 250, dtype=np.int32), np.full(250, 2, np.int32))
    assert same(cache.cells.cells, before)
    assert same(np.array(host(cache.storage.keys)), keys)
    model.forward([(2, 1)])                                # now the copy happens and stays
    assert ordered_cells(cache, 2)[0][64:].tolist() == list(range(64, 104))
    assert rule_holds(cache, 2)
    model.check_rows()


def test_paired_cache_places_both_halves_in_the_same_pages():
    """PairedCache: page_size is a sizing field both halves share; placement (and its
    copy-on-write) lands on the same pages in both, so one paged table serves both pools."""
    rng = np.random.default_rng(7)
    main = nkv.CacheConfig(2, 1, D, v_head_dim=0, capacity=128, max_seqs=2, page_size=P,
                           device="cpu", dtype="float32")
    p = nkv.PairedCache(main, main.replace(head_dim=32))
    for step in range(6):
        pos = np.array([p.main.seq_pos_max(0) + 1, p.main.seq_pos_max(1) + 1], np.int32)
        sq = np.array([0, 1], np.int32)
        k = 20 if step == 0 else 1
        pos = np.concatenate([np.arange(pos[0], pos[0] + k), [pos[1]]]).astype(np.int32)
        sq = np.concatenate([np.zeros(k), [1]]).astype(np.int32)
        p.start_forward(pos, sq)
        for layer in range(2):
            p.set_layer(layer)
            p.put(rng.standard_normal((len(pos), 1, D)).astype(np.float32), None)
            p.put_indexer(rng.standard_normal((len(pos), 1, 32)).astype(np.float32))
        p.check_paired()
    pt = p.page_table(page_size=P)
    assert host(pt.block_table).tolist() == [[0], [1]]
    # a middle removal breaks sequence 0's pages; the pair's defrag repacks both halves alike
    p.seq_rm(0, 2, 4)
    p.defrag()
    p.check_paired()
    p.start_forward(np.array([p.main.seq_pos_max(0) + 1], np.int32), np.zeros(1, np.int32))
    assert host(p.page_table(page_size=P).cache_seqlens).tolist() == [24]
    with pytest.raises(ValueError, match="page_size"):
        nkv.PairedCache(p.main.config, p.indexer.config.replace(page_size=1))


def test_mla_views_in_pages_of_64(device):
    cache = paged_cache(device, capacity=128, max_seqs=2)
    ckv, kpe = cache.mla_views(0, page_size=P)
    key, _ = cache.layer_pool(0)
    n_pages = cache.n_cells // P
    assert tuple(ckv.shape) == (n_pages, P, RANK) and tuple(kpe.shape) == (n_pages, P, ROPE)
    item = np.dtype(np.float32).itemsize
    assert tuple(ckv.strides) == (P * D * item, D * item, item)
    assert tuple(kpe.strides) == (P * D * item, D * item, item)
    assert shares_memory(ckv, key) and shares_memory(kpe, key)
    rng = np.random.default_rng(8)
    model = Model(cache, rng)
    model.forward([(0, 3), (1, 2)])
    k = np.asarray(host(key))
    cell = ordered_cells(cache, 1)[0][1]                   # sequence 1's token 1
    assert cell == 65
    assert same(np.asarray(host(ckv))[1, 1], k[65, 0, :RANK])
    assert same(np.asarray(host(kpe))[1, 1], k[65, 0, RANK:])


def test_bad_page_sizes_are_refused_before_anything_changes():
    base = dict(n_layers=1, n_kv_heads=1, head_dim=D, v_head_dim=0, device="cpu")
    for bad in (0, -64, True, 64.0, "64"):
        with pytest.raises(ValueError, match="page_size"):
            nkv.CacheConfig(**base, page_size=bad)
    with pytest.raises(ValueError, match="unified"):
        nkv.CacheConfig(**base, page_size=64, unified=False, max_seqs=2)
    # 3 * 100 cells is no multiple of 64: refused when the cache is built, naming the fix
    cfg = nkv.CacheConfig(**base, capacity=100, max_seqs=3, page_size=64)
    with pytest.raises(ValueError, match="page_size=64 must divide.*300.*cache_padding"):
        nkv.CausalCache(cfg)
    assert nkv.CausalCache(cfg.replace(cache_padding=64)).n_cells == 320
    from numbakv.cells import CellTable
    with pytest.raises(ValueError, match="page_size"):
        CellTable(300, 2, page_size=64)
    cache = paged_cache(capacity=64, max_seqs=2)           # 2 pages
    model = Model(cache, np.random.default_rng(9))
    model.forward([(0, 1), (1, 1)])
    model.forward([(0, 63)])        # page 0 full; page 1 holds one token: no page is free
    before, keys = cache.cells.cells, np.array(host(cache.storage.keys))
    with pytest.raises(KVCacheFullError, match="pages"):
        cache.start_forward(np.array([64], np.int32), np.array([0], np.int32))
    assert same(cache.cells.cells, before)
    assert same(np.array(host(cache.storage.keys)), keys)
    for bad in (0, 48, 1.5):
        with pytest.raises(ValueError, match="page_size"):
            cache.page_table(page_size=bad)
    assert same(cache.cells.cells, before)


def test_defrag_repacks_a_sequence_a_context_shift_broke():
    """A context shift (Ollama's remove with the move-down) and a seq_rm of a middle range
    leave holes in the pages: page_table refuses, naming the sequence; defrag() repacks each
    such sequence that shares no cell into fresh pages in position order (its rows with it),
    after which the table describes it again. A shared sequence is left as it is."""
    rng = np.random.default_rng(10)
    cache = paged_cache(max_seqs=3, capacity=128)
    model = Model(cache, rng)
    model.forward([(0, 100), (1, 70)])
    cache.remove(0, 10, 20)                      # positions 20.. move down by 10, re-rotated
    shifted = {}
    for (s, p), r in list(model.rows.items()):
        if s == 0 and 10 <= p:
            del model.rows[(s, p)]
            if p >= 20:
                shifted[(s, p - 10)] = rope_reference(r[:, None, :], np.full(2, -10),
                                                      cache.shift)[:, 0]
    model.rows.update(shifted)
    model.seq_rm(1, 5, 6)
    model.forward([(0, 1), (1, 1)])
    with pytest.raises(NotSupportedError, match="sequence 0's visible token 10 "):
        cache.page_table(page_size=P)
    model.check_rows()
    cache.defrag()
    assert rule_holds(cache, 0) and rule_holds(cache, 1)
    model.check_rows()
    model.forward([(1, 1), (0, 1)])
    check_table(cache, cache.page_table(page_size=P), [1, 0])
    # a sequence sharing its cells is not repacked (its copies would leave the sharer's)
    model.seq_rm(2)
    model.seq_cp(1, 2)
    model.seq_rm(1, 3, 4)
    cache.defrag()
    assert rule_holds(cache, 2) and not rule_holds(cache, 1)
    model.check_rows()


def test_prefix_store_loads_keep_the_page_rule():
    """A PrefixStore over a paged cache: a tier-0 hit shares the retained sequence's pages
    (copy_prefix), a second request on the same prefix copies the partly filled last page when
    it goes on: every sequence's paged table is the reference's and every row its own
    (import_seq, what the lower tiers' hits go through, is in the random operations)."""
    rng = np.random.default_rng(11)
    cache = paged_cache(max_seqs=4, capacity=256)
    store = nkv.PrefixStore(cache, retain_seqs=[3], host_bytes=64 << 20)
    model = Model(cache, rng)
    prompt = list(range(1000, 1100))
    model.forward([(0, 100)])
    store.save(0, prompt)
    for p in range(100):                         # the store keeps the prompt in sequence 3
        model.rows[(3, p)] = model.rows[(0, p)]
    model.seq_rm(0)
    for seq in (1, 2):
        n = store.load(seq, prompt + [seq])
        assert n == 100
        for (t, p), r in list(model.rows.items()):
            if t == 3 and p < n:
                model.rows[(seq, p)] = r
        model.forward([(seq, 1)])
    assert rule_holds(cache, 1) and rule_holds(cache, 2)
    model.forward([(2, 1), (1, 1)])
    check_table(cache, cache.page_table(page_size=P), [2, 1])
    for s in (1, 2, 3):
        assert rule_holds(cache, s)
    model.check_rows()
    store.close()


def test_captured_decode_step_writes_the_paged_cells(device):
    """capture_step under paged placement: the step descriptor carries the batch's scattered
    cells (one per sequence's page), so replays store exactly what start_forward + put do."""
    from test_step import _cfg, _drive

    def make():
        return nkv.CausalCache(_cfg(device, capacity=16, page_size=4))
    direct = _drive(make(), 7, False)
    replayed = _drive(make(), 7, True)
    for a, b in zip(replayed, direct):
        np.testing.assert_array_equal(a, b)
    cells = direct[2]
    bit = cells["seqs"][:, 0]
    pages = {s: set((np.nonzero(bit & (1 << s))[0] // 4).tolist()) for s in range(3)}
    assert not (pages[0] & pages[1]) and not (pages[1] & pages[2])   # each its own pages


def test_hybrid_cache_attention_half_in_pages():
    """HybridCache over a paged attention half: page_table(page_size) passes through, and
    sequences decoding in turn keep their own pages."""
    from test_hybrid import KINDS, SPECS, H, D as HD, run
    cfg = nkv.CacheConfig(n_layers=KINDS.count("attention"), n_kv_heads=H, head_dim=HD,
                          dtype="float32", capacity=64, max_seqs=3, device="cpu", page_size=16)
    rc = nkv.RecurrentCache(nkv.RecurrentConfig(KINDS.count("recurrent"), SPECS, max_seqs=3,
                                                restore_every=4, max_restore_points=4,
                                                device="cpu"))
    hc = nkv.HybridCache(nkv.CausalCache(cfg, shift=nkv.RopeShift()), rc, KINDS)
    run(hc, 0, [5, 6, 7], 0)
    run(hc, 1, [8, 9], 0)
    for t in range(20):
        run(hc, t % 2, [10 + t], 3 + t // 2 if t % 2 == 0 else 2 + t // 2)
    pt = hc.page_table(page_size=16)
    want = reference_table(hc.attn, [1], 16)
    assert host(pt.block_table).tolist() == want["block_table"].tolist() == [[1]]
    assert host(pt.cache_seqlens).tolist() == [12]
    assert [rule_holds(hc.attn, s, 16) for s in (0, 1)] == [True, True]
    assert ordered_cells(hc.attn, 0)[0].tolist() == list(range(13))


@pytest.mark.parametrize("k_dtype", [None, "q8_0"])
def test_scattered_puts_store_what_the_contiguous_policy_stores(device, k_dtype):
    """The paged pass's put writes each token's row into its (scattered) cell: sequence by
    sequence in position order the rows equal a contiguous cache's, float and q8_0."""
    from helpers import seq_rows
    rng = np.random.default_rng(12)
    caches = [nkv.CausalCache(nkv.CacheConfig(
        n_layers=2, n_kv_heads=2, head_dim=32, dtype="float16", k_dtype=k_dtype, capacity=64,
        max_seqs=3, max_batch=64, device=device, page_size=page)) for page in (1, 16)]
    steps = [[(0, 5), (1, 3)], [(1, 1), (0, 1), (2, 2)], [(2, 1), (0, 1)], [(1, 20), (2, 1)]]
    for step in steps:
        pos = np.concatenate([np.arange(caches[0].seq_pos_max(s) + 1,
                                        caches[0].seq_pos_max(s) + 1 + k) for s, k in step])
        sq = np.concatenate([np.full(k, s) for s, k in step])
        kv = rng.standard_normal((2, 2, len(pos), 2, 32)).astype(np.float16)
        for cache in caches:
            cache.start_forward(pos.astype(np.int32), sq.astype(np.int32))
            for layer in range(2):
                cache.set_layer(layer)
                cache.put(kv[0, layer], kv[1, layer])
    assert caches[1]._forward.slots is not None          # the last pass was scattered
    for s in range(3):
        a, b = seq_rows(caches[0], s), seq_rows(caches[1], s)
        for x, y in zip(a, b):
            assert same(np.asarray(x), np.asarray(y))
        assert rule_holds(caches[1], s, 16)
