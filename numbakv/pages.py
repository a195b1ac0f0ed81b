"""Per-sequence page tables: the cells each sequence of a forward pass may attend to, in the CSR
form of FlashInfer / vLLM with page size 1 (a page is a cell).

``get()`` hands attention the union of every batch sequence's cells and a dense ``[batch, n]``
mask, so attention pays for every other sequence's tokens. A page table lists, per sequence of
the batch, only the cells that sequence may see, so attention costs O(its own cells).

The builder reads the cell table only through its arrays, passed in as arguments (position
``pos int32 [n_cells]``, sequence bitset ``seqs uint64 [n_cells, words]``, the per-sequence
position trees ``stree int32 [2, 2 * n_leaves, max_seqs]`` with leaves over blocks of
``2**bshift`` cells), so that this module depends on the table's layout in one place only. It
runs in O(batch + sum over the batch's sequences of the cells in the blocks that hold their
visible cells), never O(n_cells): the tree prunes every block without a cell of the sequence in
the visible position range. When a sequence's cells are interleaved with others' (decode steps
of many sequences), a block holds cells of several sequences and is read once per sequence.

Visibility is the mask rule of :func:`numbakv.kernels.mask.visible` (Ollama's): a token at
position ``p`` of sequence ``s`` sees a cell of ``s`` at position ``q`` when ``q <= p`` (unless
``set_causal`` dropped the test for it), ``q >= p - window`` (sliding window) and
``q >= p - p % chunk`` (chunked attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from ._jit import njit
from .cells import _M_BSHIFT

#: "no upper bound" for position ranges (positions are int32)
_NO_LIMIT = 2**31 - 1
_ONE = np.uint64(1)

#: field order of the page table (also the order of the single host -> device copy)
FIELDS = ("seq_ids", "qo_indptr", "token_order", "kv_indptr", "kv_indices", "kv_positions",
          "kv_last_page_len", "q_positions")


@dataclass
class PageTable:
    """A forward pass's per-sequence page table (page size 1), int32 arrays on the cache's device.

    ``n_b`` sequences in the batch, ``batch`` tokens, ``nnz`` visible (sequence, cell) pairs.

    Attributes:
        seq_ids: ``[n_b]`` the batch's sequences, in order of first appearance in the batch.
        qo_indptr: ``[n_b + 1]``: ``token_order[qo_indptr[b]:qo_indptr[b+1]]`` are the batch
            indices of sequence ``b``'s tokens.
        token_order: ``[batch]`` a permutation of ``range(batch)``: batch indices grouped by
            sequence, each group in batch order.
        kv_indptr: ``[n_b + 1]``.
        kv_indices: ``[nnz]`` the cells sequence ``b`` may attend to (with any of its batch
            tokens), ascending by position: ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
        kv_positions: ``[nnz]`` their positions.
        kv_last_page_len: ``[n_b]`` all 1 (a page is one cell).
        q_positions: ``[batch]`` the batch's positions, in batch order.
    """

    seq_ids: Any
    qo_indptr: Any
    token_order: Any
    kv_indptr: Any
    kv_indices: Any
    kv_positions: Any
    kv_last_page_len: Any
    q_positions: Any

    @property
    def n_seqs(self) -> int:
        """Sequences in the batch (``n_b``)."""
        return int(self.seq_ids.shape[0])

    @property
    def nnz(self) -> int:
        """Visible (sequence, cell) pairs."""
        return int(self.kv_indices.shape[0])


@dataclass(frozen=True)
class MaskRule:
    """What a batch token may see among the cells its sequence's page list holds (host side):
    ``causal uint8 [batch]`` (0 where ``set_causal`` dropped the future-position test),
    ``window`` (-1: none) and ``chunk`` (0: none). ``attend`` builds per-token masks from it."""

    causal: np.ndarray
    window: int
    chunk: int


#: the host fields of size ``nnz`` (or built with them): a page table extended on the device
#: (:func:`extend_pages`) fills them on the host only when a host-side reader asks
LAZY_FIELDS = ("kv_indices", "kv_positions", "cell_lo", "cell_hi")


class HostPages:
    """Host (numpy) copies of a page table plus its mask rule, for backends that loop over the
    sequences on the host. ``table`` is the device-side :class:`PageTable`.

    The fields of :data:`LAZY_FIELDS` may be filled on first read (a table extended on the
    device: its host lists are built only if a host-side backend reads them)."""

    __slots__ = tuple(f for f in FIELDS if f not in LAZY_FIELDS) + (
        "rule", "table", "trailing", "plans", "_fill") + tuple("_" + f for f in LAZY_FIELDS)

    def __init__(self, arrays: dict, rule: MaskRule, cell_lo, cell_hi, trailing) -> None:
        self._fill = None
        for name in FIELDS:
            setattr(self, name, arrays[name])
        self.rule = rule
        self.cell_lo = cell_lo          # int [n_b] lowest cell of each page list (-1: empty)
        self.cell_hi = cell_hi          # int [n_b] highest cell + 1
        self.trailing = trailing        # bool: FlashInfer's causal convention holds everywhere
        self.table: Optional[PageTable] = None
        self.plans: dict = {}           # per-backend state planned once per forward pass

    def _filled(self, name: str):
        if self._fill is not None:
            fill, self._fill = self._fill, None
            full = fill()               # the same pass's table built on the host
            for f in LAZY_FIELDS:
                setattr(self, "_" + f, getattr(full, f))
        return getattr(self, "_" + name)

    @property
    def host_lists_built(self) -> bool:
        """Whether the ``nnz``-sized host fields exist (False: extended on the device, not read
        on the host yet)."""
        return self._fill is None

    kv_indices = property(lambda self: self._filled("kv_indices"),
                          lambda self, v: setattr(self, "_kv_indices", v))
    kv_positions = property(lambda self: self._filled("kv_positions"),
                            lambda self, v: setattr(self, "_kv_positions", v))
    cell_lo = property(lambda self: self._filled("cell_lo"),
                       lambda self, v: setattr(self, "_cell_lo", v))
    cell_hi = property(lambda self: self._filled("cell_hi"),
                       lambda self, v: setattr(self, "_cell_hi", v))


@dataclass(frozen=True)
class PagedTable:
    """A forward pass's page table in pages of ``page_size`` cells (FlashMLA's dense decode:
    ``block_table`` + ``cache_seqlens``; FlashInfer's paged MLA: ``kv_indptr`` / ``kv_indices``
    / ``kv_last_page_len``), int32 arrays on the cache's device. Page ``p`` is cells
    ``p * page_size .. (p + 1) * page_size - 1`` of the pool (:meth:`CausalCache.mla_views`
    shapes the latent pool ``[n_pages, page_size, ...]`` to match); token ``i`` of sequence
    ``b`` (in position order) is slot ``i % page_size`` of page ``block_table[b, i //
    page_size]``. A sequence's pages may lie anywhere in the pool, in any order, and be shared
    with other sequences; only its last page may be partial (``kv_last_page_len``). A cache
    built with ``CacheConfig(page_size=...)`` places tokens so that this holds by
    construction (see :func:`paged_arrays` for the rule and what breaks it).

    Attributes: ``page_size``; ``seq_ids``, ``qo_indptr``, ``token_order``, ``q_positions`` as
    in :class:`PageTable`; ``cache_seqlens [n_b]`` (tokens each sequence attends to);
    ``block_table [n_b, max_pages]`` (-1 past a sequence's pages); ``kv_indptr [n_b + 1]``,
    ``kv_indices [n_pages_used]``, ``kv_last_page_len [n_b]``.
    """

    page_size: int
    seq_ids: Any
    qo_indptr: Any
    token_order: Any
    q_positions: Any
    cache_seqlens: Any
    block_table: Any
    kv_indptr: Any
    kv_indices: Any
    kv_last_page_len: Any


def page_rule_break(cells: np.ndarray, page_size: int) -> int:
    """The first index ``i`` of a sequence's cells in position order (``cells`` int ``[n]``)
    that breaks the page rule of :func:`paged_arrays` (``cells[i]`` is not slot ``i %
    page_size`` of the page ``cells[i - i % page_size]`` opened), or -1 when none does."""
    cells = np.asarray(cells, np.int64)
    i = np.arange(cells.shape[0])
    slot = i % page_size
    bad = (cells % page_size != slot) | (cells // page_size != cells[i - slot] // page_size)
    return int(np.argmax(bad)) if bad.any() else -1


def paged_arrays(host: "HostPages", page_size: int) -> dict:
    """Host arrays of a :class:`PagedTable` from a pass's page-size-1 table, or a ``str``
    saying why the layout has no page form.

    The rule (FlashMLA's ``block_table``, FlashInfer's paged KV): a sequence's visible cells,
    in position order ``c_0, c_1, ...``, fill pages of ``page_size`` cells, so that ``c_i``
    is slot ``i % page_size`` of its page (``c_i % page_size == i % page_size``) and the
    cells ``c_{k*page_size} .. c_{k*page_size + page_size - 1}`` are one page. Pages need not
    be contiguous nor ordered in the pool (a sequence's page list can run 7, 2, 9), sequences
    may share pages (a ``seq_cp`` prefix), and only the last page may be partial. The
    message names the first sequence and cell that breaks it. O(nnz), vectorised."""
    n_b = host.seq_ids.shape[0]
    indptr = np.asarray(host.kv_indptr, np.int64)
    cells = np.asarray(host.kv_indices, np.int64)
    seqlens = np.diff(indptr).astype(np.int32)
    counts = -(-seqlens.astype(np.int64) // page_size)
    # rank of each visible cell inside its sequence's list (position order)
    owner = np.repeat(np.arange(n_b, dtype=np.int64), np.diff(indptr))
    rank = np.arange(cells.shape[0], dtype=np.int64) - indptr[owner]
    slot = rank % page_size
    page = cells // page_size
    # the page each cell must share with the first cell of its group of page_size
    head = np.arange(cells.shape[0], dtype=np.int64) - slot
    bad = (cells % page_size != slot) | (page != page[head])
    if bad.any():
        i = int(np.argmax(bad))
        b = int(owner[i])
        r = int(rank[i])
        c = int(cells[i])
        want = (f"slot {r % page_size} of a page" if r % page_size == 0
                else f"cell {int(cells[i - 1]) + 1} (slot {r % page_size} of page "
                     f"{int(page[head[i]])})")
        return (f"sequence {int(host.seq_ids[b])}'s visible token {r} (position "
                f"{int(host.kv_positions[i])}) is in cell {c}, not {want}: its cells do not "
                f"fill pages of {page_size} in position order (use CacheConfig(page_size="
                f"{page_size}) and avoid seq_rm of a middle range, windows and context shifts, "
                f"or defrag() after them)")
    max_pages = int(counts.max()) if n_b else 0
    block = np.full((n_b, max(max_pages, 1)), -1, np.int32)
    firsts = head[slot == 0] if cells.shape[0] else head[:0]
    pages = page[firsts].astype(np.int32)          # every sequence's pages, in order
    page_owner = owner[firsts]
    page_rank = rank[firsts] // page_size
    block[page_owner, page_rank] = pages
    last = np.where(seqlens > 0, seqlens - (counts - 1) * page_size, 0).astype(np.int32)
    return {"cache_seqlens": seqlens, "block_table": block,
            "kv_indptr": np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            "kv_indices": pages, "kv_last_page_len": last}


def paged_table(host: "HostPages", page_size: int, n_cells: int, xp: Any) -> PagedTable:
    """The :class:`PagedTable` of a pass (``host``: its page-size-1 tables) over a pool of
    ``n_cells`` cells, arrays made by ``xp`` (numpy or CuPy). ``ValueError`` when
    ``page_size`` does not divide the pool, ``NotSupportedError`` (naming the sequence and
    cell) when the layout breaks the page rule of :func:`paged_arrays`."""
    from .errors import NotSupportedError
    if n_cells % page_size:
        raise ValueError(f"page_size={page_size} must divide the cache's {n_cells} cells (set "
                         "cache_padding to a multiple of it)")
    arrays = paged_arrays(host, page_size)
    if isinstance(arrays, str):
        raise NotSupportedError(f"page_table(page_size={page_size}): {arrays}")
    dev = {k: xp.asarray(v) for k, v in arrays.items()}
    table = host.table
    return PagedTable(page_size, table.seq_ids, table.qo_indptr, table.token_order,
                      table.q_positions, **dev)


# --------------------------------------------------------------------------------------------
# numba builder
# --------------------------------------------------------------------------------------------

@njit(cache=True)
def _group_tokens(bseqs, max_seqs):
    """(seq_ids, qo_indptr, token_order) in O(batch + max_seqs)."""
    batch = bseqs.shape[0]
    slot = np.full(max_seqs, -1, np.int64)
    seq_ids = np.empty(batch, np.int32)
    counts = np.zeros(batch + 1, np.int64)
    nb = 0
    for i in range(batch):
        s = bseqs[i]
        if slot[s] < 0:
            slot[s] = nb
            seq_ids[nb] = s
            nb += 1
        counts[slot[s] + 1] += 1
    qo_indptr = np.empty(nb + 1, np.int32)
    qo_indptr[0] = 0
    for b in range(nb):
        qo_indptr[b + 1] = qo_indptr[b] + counts[b + 1]
    fill = np.empty(nb, np.int64)
    for b in range(nb):
        fill[b] = qo_indptr[b]
    token_order = np.empty(batch, np.int32)
    for i in range(batch):
        b = slot[bseqs[i]]
        token_order[fill[b]] = i
        fill[b] += 1
    return seq_ids[:nb].copy(), qo_indptr, token_order


@njit(cache=True, inline="always")
def visible_lo(p, window, chunk):
    """The lowest position a token at position ``p`` may see (int64): 0, raised by a sliding
    ``window`` (>= 0: ``p - window``) and by attention chunks (``chunk > 0``: the chunk's
    start). The upper end is ``p`` for a causal token."""
    lo = np.int64(0)
    if window >= 0:
        lo = max(lo, p - window)
    if chunk > 0:
        lo = max(lo, p - p % chunk)
    return lo


@njit(cache=True)
def _token_intervals(bpos, causal, window, chunk, tokens):
    """The merged, disjoint position intervals ``[lo, hi]`` (int64 ``[k, 2]``, ascending) that
    the given batch tokens see between them."""
    n = tokens.shape[0]
    los = np.empty(n, np.int64)
    his = np.empty(n, np.int64)
    for t in range(n):
        i = tokens[t]
        p = np.int64(bpos[i])
        los[t] = visible_lo(p, window, chunk)
        his[t] = p if causal[i] != 0 else _NO_LIMIT
    order = np.argsort(los, kind="mergesort")
    out = np.empty((n, 2), np.int64)
    k = 0
    for t in range(n):
        lo = los[order[t]]
        hi = his[order[t]]
        if k > 0 and lo <= out[k - 1, 1] + 1:
            if hi > out[k - 1, 1]:
                out[k - 1, 1] = hi
        else:
            out[k, 0] = lo
            out[k, 1] = hi
            k += 1
    return out[:k]


@njit(cache=True)
def _inside(intervals, q):
    """Whether position q lies in one of the merged intervals (binary search)."""
    a = 0
    b = intervals.shape[0]
    while a < b:
        m = (a + b) >> 1
        if intervals[m, 1] < q:
            a = m + 1
        else:
            b = m
    return a < intervals.shape[0] and intervals[a, 0] <= q


@njit(cache=True)
def _grow(buf, need):
    if need <= buf.shape[0]:
        return buf
    size = max(need, 2 * buf.shape[0])
    out = np.empty(size, buf.dtype)
    out[:buf.shape[0]] = buf
    return out


# A leaf's scan comes in three kinds, chosen per leaf by the caller: ``mode`` 0: every cell of
# the sequence in the leaf is visible (the tree says its positions lie inside the one interval);
# 1: test each position against [lo, hi]; 2: also search the intervals. The mode is a compile-time
# literal at each call site, so each kind is its own loop.
_ALL_IN, _RANGE, _SEARCH = 0, 1, 2


@njit(cache=True, inline="always")
def _count_leaf(cpos, cseqs, w, sh, c0, c1, lo, hi, intervals, mode):
    """How many of the cells ``c0 .. c1 - 1`` :func:`_take_leaf` lists (same arguments)."""
    n = np.uint64(0)
    if mode == _ALL_IN:     # the sequence's bits only: 8x faster than with the positions
        for c in range(c0, c1):
            n += (cseqs[c, w] >> sh) & _ONE
    elif mode == _RANGE:    # branch-free: cells of several sequences interleave in a leaf
        for c in range(c0, c1):
            q = cpos[c]
            n += ((cseqs[c, w] >> sh) & _ONE) & np.uint64((q >= lo) & (q <= hi))
    else:
        for c in range(c0, c1):
            if ((cseqs[c, w] >> sh) & _ONE) != 0:
                q = cpos[c]
                if q >= lo and q <= hi and _inside(intervals, q):
                    n += _ONE
    return np.int64(n)


@njit(cache=True, inline="always")
def _take_leaf(cpos, cseqs, w, sh, c0, c1, lo, hi, intervals, mode, cells, poss, nnz, prev):
    """Write the cells ``c0 .. c1 - 1`` that hold the sequence (word ``w``, bit ``sh``) at a
    visible position (``mode``: see above) to ``cells``/``poss`` from ``nnz`` (they have room).
    Returns the new ``nnz``, the last position written (``prev`` if none) and how many times a
    position fell below the one before (``prev`` before the first)."""
    desc = 0
    for c in range(c0, c1):
        if ((cseqs[c, w] >> sh) & _ONE) != 0:
            q = cpos[c]
            if mode == _ALL_IN or (q >= lo and q <= hi and (mode == _RANGE
                                                          or _inside(intervals, q))):
                cells[nnz] = c
                poss[nnz] = q
                nnz += 1
                desc += q < prev
                prev = q
    return nnz, prev, desc


@njit(cache=True, inline="always")
def _leaf_mode(stree, k, s, lo, hi, n_iv):
    """The scan a leaf ``k`` of sequence ``s`` needs (see :func:`_count_leaf`)."""
    if n_iv > 1:
        return _SEARCH
    if stree[0, k, s] >= lo and stree[1, k, s] <= hi:
        return _ALL_IN
    return _RANGE


@njit(cache=True, inline="always")
def _skip(arr, a, e, x, ties):
    """Index of the first entry of ascending ``arr[a:e]`` not below ``x`` (``ties``: not at or
    below it), or ``e``: an exponential search from ``a``, O(log of the distance)."""
    lo = a
    step = 1
    while True:
        hi = lo + step - 1
        if hi >= e:
            hi = e
            break
        v = arr[hi]
        if not (v < x or (ties and v == x)):
            break
        lo = hi + 1
        step *= 2
    while lo < hi:      # arr[lo - 1] is below x (or lo == a); arr[hi] is not (or hi == e)
        m = (lo + hi) >> 1
        v = arr[m]
        if v < x or (ties and v == x):
            lo = m + 1
        else:
            hi = m
    return lo


@njit(cache=True)
def _merge_runs(cells, poss, a, m, e, tc, tp):
    """Stable merge, by position, of the ascending runs ``[a, m)`` and ``[m, e)`` of
    ``cells``/``poss`` into ``[a, e)``; ``tc``/``tp`` hold at least ``m - a`` entries. Whole
    stretches move at a time (a decode cell merged in front of 32k older ones is one block)."""
    a = _skip(poss, a, m, poss[m], True)    # the left run's head stays where it is
    nl = m - a
    tc[:nl] = cells[a:m]
    tp[:nl] = poss[a:m]
    i = 0
    j = m
    o = a
    while i < nl:
        # the right run's entries below the left run's next one, down as a block; o < j
        # throughout, so the forward copy never overwrites what it has still to read
        j1 = _skip(poss, j, e, tp[i], False)
        for t in range(j, j1):
            cells[o] = cells[t]
            poss[o] = poss[t]
            o += 1
        j = j1
        if j == e:
            break
        # then the left run's entries up to the right run's next one (on a tie, left first)
        i1 = _skip(tp, i, nl, poss[j], True)
        for t in range(i, i1):
            cells[o] = tc[t]
            poss[o] = tp[t]
            o += 1
        i = i1
    for t in range(i, nl):          # what the right run leaves behind is already in place
        cells[o] = tc[t]
        poss[o] = tp[t]
        o += 1


@njit(cache=True)
def _sort_runs(cells, poss, start, stop):
    """Sort ``cells``/``poss[start:stop]`` by position, stably (the order ``argsort(kind=
    "mergesort")`` gives), merging the ascending runs they come in pairwise: O(n log runs).

    The cells come in cell order and their positions usually ascend with them (contiguous
    placement): one run, one pass to see it. A batch placed into a hole in front of the
    sequence's older cells (a decode after ``seq_rm`` freed cells lower in the pool) makes a
    second run; a full sort of such a 32k-cell list cost 1.1 ms."""
    nr = 1
    for j in range(start + 1, stop):
        if poss[j] < poss[j - 1]:
            nr += 1
    if nr == 1:
        return
    bounds = np.empty(nr + 1, np.int64)
    bounds[0] = start
    k = 1
    for j in range(start + 1, stop):
        if poss[j] < poss[j - 1]:
            bounds[k] = j
            k += 1
    bounds[nr] = stop
    tc = np.empty(stop - start, cells.dtype)
    tp = np.empty(stop - start, poss.dtype)
    while nr > 1:               # one pass merges runs (0, 1), (2, 3), ...; an odd last one waits
        k = 0
        for r in range(0, nr - 1, 2):
            _merge_runs(cells, poss, bounds[r], bounds[r + 1], bounds[r + 2], tc, tp)
            bounds[k] = bounds[r]
            k += 1
        if nr % 2 == 1:
            bounds[k] = bounds[nr - 1]
            k += 1
        bounds[k] = stop
        nr = k


@njit(cache=True)
def _order_leaves(stree, s, leaves, modes, a, e):
    """Put the leaves ``a .. e - 1`` of sequence ``s`` (and their ``modes``) in position order
    when the trees' position ranges of them are disjoint: their cells then come out in position
    order and none has to move. A decode placed into a hole in front of the sequence's older cells is the usual case;
    sorting its 32k cells instead cost 1.1 ms, merging them 0.1 ms. Leaves whose ranges overlap
    stay in cell order (the cells are sorted afterwards)."""
    ordered = True
    for t in range(a + 1, e):
        if stree[1, leaves[t - 1], s] >= stree[0, leaves[t], s]:
            ordered = False
            break
    if ordered:
        return
    mins = np.empty(e - a, np.int64)
    for t in range(a, e):
        mins[t - a] = stree[0, leaves[t], s]
    order = np.argsort(mins, kind="mergesort")
    for t in range(1, e - a):
        if stree[1, leaves[a + order[t - 1]], s] >= mins[order[t]]:
            return
    moved = leaves[a:e][order]
    leaves[a:e] = moved
    moved = modes[a:e][order]
    modes[a:e] = moved


@njit(cache=True)
def _fill_seq(cpos, cseqs, w, sh, leaves, lcnt, lmode, a, e, nl, bshift, lo_all, hi_all, iv,
              counted, cells, poss, o):
    """Write the listed cells of one sequence's leaves ``a .. e - 1`` (in that order) to
    ``cells``/``poss`` from ``o``. ``counted``: ``lcnt`` holds each leaf's count (empty leaves
    are skipped and full ones copied plainly). Returns (end, how many times a position fell
    below the one before (0: sorted), lowest cell, highest cell)."""
    n_cells = cpos.shape[0]
    lo_c = n_cells
    hi_c = -1
    prev = np.int32(-1)     # below every position: the first one starts a run
    desc = 0
    for t in range(a, e):
        k = leaves[t]
        c0 = (k - nl) << bshift
        c1 = min(c0 + (1 << bshift), n_cells)
        o0 = o
        m = lcnt[t] if counted else -1
        if m == 0:
            continue
        if m == c1 - c0:            # every cell listed (a prefill's blocks): a plain copy
            for c in range(c0, c1):
                q = cpos[c]
                cells[o + c - c0] = c
                poss[o + c - c0] = q
                desc += q < prev
                prev = q
            o += m
        else:
            mode = lmode[t]
            if mode == _ALL_IN:
                o, prev, d = _take_leaf(cpos, cseqs, w, sh, c0, c1, lo_all, hi_all, iv, _ALL_IN,
                                        cells, poss, o, prev)
            elif mode == _RANGE:
                o, prev, d = _take_leaf(cpos, cseqs, w, sh, c0, c1, lo_all, hi_all, iv, _RANGE,
                                        cells, poss, o, prev)
            else:
                o, prev, d = _take_leaf(cpos, cseqs, w, sh, c0, c1, lo_all, hi_all, iv, _SEARCH,
                                        cells, poss, o, prev)
            desc += d
        if o > o0:          # the leaf's cells ascend; the leaves may not (_order_leaves)
            lo_c = min(lo_c, cells[o0])
            hi_c = max(hi_c, cells[o - 1])
    return o, desc, lo_c, hi_c


@njit(cache=True)
def _build_packed(cpos, cseqs, stree, bshift, bpos, bseqs, causal, window, chunk):
    """Page table of a batch over the cell table (see the module docstring for the cost), with
    ``kv_last_page_len``, ``q_positions`` and each list's cell range in one int32 buffer (one
    array to box instead of nine: the page table is built every forward pass, and at the demo's
    sizes boxing nine arrays took about a third of the call, 7.0 vs 5.1 us). Returns ``(buf,
    n_b, nnz, trailing)``; :func:`_unpack` cuts it.

    First, per sequence: its visible position intervals, the leaves of its tree that may hold
    them, put in position order where they can be (:func:`_order_leaves`). Then the lists, one
    of two ways:

    * the leaves hold few cells of other sequences (the blocks the sequences read add up to at
      most twice the table): count each sequence's cells, then write the lists straight into
      the buffer. Counting (the sequence bits only) costs a fraction of growing the lists and
      copying them out (fresh memory: page faults, most of the call at 262k listed cells).
    * the sequences interleave in the pool (decode in lock step: each block holds a few cells
      of each): write each list once into a scratch buffer, then copy; the lists are short
      against the blocks read, and counting first would read every block twice (14 vs 10 ms
      for 64 sequences in lock step over 131k cells)."""
    n_cells = cpos.shape[0]
    max_seqs = stree.shape[2]
    nl = stree.shape[1] >> 1
    batch = bpos.shape[0]
    seq_ids, qo_indptr, token_order = _group_tokens(bseqs, max_seqs)
    nb = seq_ids.shape[0]
    # intervals (ivs[ivptr[b]:ivptr[b+1]]), leaves (leaves[lfptr[b]:lfptr[b+1]]) and their scans
    ivs = np.empty((batch, 2), np.int64)
    ivptr = np.zeros(nb + 1, np.int64)
    leaves = np.empty(64, np.int64)
    lmode = np.empty(64, np.int64)          # each leaf's scan (kept: the tree is cold later)
    lfptr = np.zeros(nb + 1, np.int64)
    bound = np.zeros(nb, np.int64)          # cells in each sequence's leaves
    stack = np.empty(128, np.int64)
    n_iv = 0
    n_lf = 0
    for b in range(nb):
        s = seq_ids[b]
        q0 = qo_indptr[b]
        if qo_indptr[b + 1] - q0 == 1:      # a decode: its one interval, no sort, no allocation
            i = token_order[q0]
            p = np.int64(bpos[i])
            ivs[n_iv, 0] = visible_lo(p, window, chunk)
            ivs[n_iv, 1] = p if causal[i] != 0 else np.int64(_NO_LIMIT)
            n_iv += 1
        else:
            iv = _token_intervals(bpos, causal, window, chunk, token_order[q0:qo_indptr[b + 1]])
            ivs[n_iv:n_iv + iv.shape[0]] = iv
            n_iv += iv.shape[0]
        ivptr[b + 1] = n_iv
        iv = ivs[ivptr[b]:n_iv]
        lo_all = iv[0, 0]
        hi_all = iv[iv.shape[0] - 1, 1]
        # depth-first over s's tree, left to right, pruning blocks outside [lo_all, hi_all]
        stack[0] = 1
        top = 1
        while top > 0:
            top -= 1
            k = stack[top]
            if stree[1, k, s] < lo_all or stree[0, k, s] > hi_all or stree[1, k, s] < 0:
                continue
            if k < nl and (iv.shape[0] > 1 or stree[0, k, s] < lo_all
                           or stree[1, k, s] > hi_all):
                stack[top] = 2 * k + 1
                stack[top + 1] = 2 * k
                top += 2
                continue
            # a leaf, or a subtree wholly inside the one interval: its leaves need no more of
            # the tree than "empty or not" (the tree walk's cache misses are most of the cost
            # when the sequences interleave: each node of a sequence is its own cache line)
            l0 = k
            l1 = k + 1
            while l0 < nl:
                l0 <<= 1
                l1 <<= 1
            if n_lf + (l1 - l0) > leaves.shape[0]:
                leaves = _grow(leaves, n_lf + (l1 - l0))
                lmode = _grow(lmode, n_lf + (l1 - l0))
            if l1 - l0 == 1:
                leaves[n_lf] = k
                lmode[n_lf] = _leaf_mode(stree, k, s, lo_all, hi_all, iv.shape[0])
                bound[b] += min((k - nl + 1) << bshift, n_cells) - ((k - nl) << bshift)
                n_lf += 1
                continue
            for leaf in range(l0, l1):
                if stree[1, leaf, s] >= 0:
                    leaves[n_lf] = leaf
                    lmode[n_lf] = _ALL_IN
                    bound[b] += min((leaf - nl + 1) << bshift, n_cells) - ((leaf - nl) << bshift)
                    n_lf += 1
        lfptr[b + 1] = n_lf
        _order_leaves(stree, s, leaves, lmode, lfptr[b], n_lf)
    counts = np.zeros(nb + 1, np.int64)     # kv_indptr
    desc = np.zeros(nb, np.int64)
    cell_lo = np.full(nb, -1, np.int64)
    cell_hi = np.full(nb, -1, np.int64)
    counted = bound.sum() <= 2 * n_cells
    if counted:
        lcnt = np.empty(n_lf, np.int64)     # how many cells each leaf lists
        for b in range(nb):
            s = seq_ids[b]
            w = s >> 6
            sh = np.uint64(s & 63)
            iv = ivs[ivptr[b]:ivptr[b + 1]]
            lo_all = iv[0, 0]
            hi_all = iv[iv.shape[0] - 1, 1]
            n = np.int64(0)
            for t in range(lfptr[b], lfptr[b + 1]):
                c0 = (leaves[t] - nl) << bshift
                c1 = min(c0 + (1 << bshift), n_cells)
                mode = lmode[t]
                if mode == _ALL_IN:     # one inlined loop per kind (see _count_leaf)
                    m = _count_leaf(cpos, cseqs, w, sh, c0, c1, lo_all, hi_all, iv, _ALL_IN)
                elif mode == _RANGE:
                    m = _count_leaf(cpos, cseqs, w, sh, c0, c1, lo_all, hi_all, iv, _RANGE)
                else:
                    m = _count_leaf(cpos, cseqs, w, sh, c0, c1, lo_all, hi_all, iv, _SEARCH)
                lcnt[t] = m
                n += m
            counts[b + 1] = counts[b] + n
        nnz = counts[nb]
        sc_cells = np.empty(0, np.int32)
        sc_poss = np.empty(0, np.int32)
    else:
        lcnt = np.empty(0, np.int64)
        sc_cells = np.empty(max(16, 2 * batch), np.int32)
        sc_poss = np.empty(sc_cells.shape[0], np.int32)
        for b in range(nb):
            s = seq_ids[b]
            iv = ivs[ivptr[b]:ivptr[b + 1]]
            o = counts[b]
            if o + bound[b] > sc_cells.shape[0]:
                sc_cells = _grow(sc_cells, o + bound[b])
                sc_poss = _grow(sc_poss, o + bound[b])
            a, e = lfptr[b], lfptr[b + 1]
            if e == a:
                counts[b + 1] = o
                continue
            k0 = leaves[a:e].min() - nl
            k1 = leaves[a:e].max() - nl + 1
            c0 = k0 << bshift
            c1 = min(k1 << bshift, n_cells)
            if 2 * bound[b] >= c1 - c0:
                # the leaves cover most of the cells between the first and the last: one scan of
                # them all, in cell order, lists the same cells without the per-leaf work (64
                # sequences in lock step over 262k cells: 5.5 ms instead of 26)
                if iv.shape[0] == 1:
                    end, _, desc[b] = _take_leaf(cpos, cseqs, s >> 6, np.uint64(s & 63), c0, c1,
                                                 iv[0, 0], iv[0, 1], iv, _RANGE, sc_cells,
                                                 sc_poss, o, np.int32(-1))
                else:
                    end, _, desc[b] = _take_leaf(cpos, cseqs, s >> 6, np.uint64(s & 63), c0, c1,
                                                 iv[0, 0], iv[iv.shape[0] - 1, 1], iv, _SEARCH,
                                                 sc_cells, sc_poss, o, np.int32(-1))
                if end > o:
                    cell_lo[b] = sc_cells[o]
                    cell_hi[b] = sc_cells[end - 1]
            else:
                end, desc[b], cell_lo[b], cell_hi[b] = _fill_seq(
                    cpos, cseqs, s >> 6, np.uint64(s & 63), leaves, lcnt, lmode, a, e, nl,
                    bshift, iv[0, 0], iv[iv.shape[0] - 1, 1], iv, False, sc_cells, sc_poss, o)
            counts[b + 1] = end
        nnz = counts[nb]
    buf = np.empty(6 * nb + 2 + 2 * batch + 2 * nnz, np.int32)
    o = 0
    for part in (seq_ids, qo_indptr, token_order):
        buf[o:o + part.shape[0]] = part
        o += part.shape[0]
    buf[o:o + nb + 1] = counts                        # kv_indptr
    o += nb + 1
    cells = buf[o:o + nnz]
    poss = buf[o + nnz:o + 2 * nnz]
    o += 2 * nnz
    buf[o:o + nb] = 1                                 # kv_last_page_len
    o += nb
    buf[o:o + batch] = bpos                           # q_positions
    o += batch
    if counted:     # the lists, straight into the buffer
        for b in range(nb):
            s = seq_ids[b]
            iv = ivs[ivptr[b]:ivptr[b + 1]]
            _, desc[b], cell_lo[b], cell_hi[b] = _fill_seq(
                cpos, cseqs, s >> 6, np.uint64(s & 63), leaves, lcnt, lmode, lfptr[b],
                lfptr[b + 1], nl, bshift, iv[0, 0], iv[iv.shape[0] - 1, 1], iv, True, cells,
                poss, counts[b])
    else:
        cells[:] = sc_cells[:nnz]
        poss[:] = sc_poss[:nnz]
    trailing = True
    for b in range(nb):
        start = counts[b]
        stop = counts[b + 1]
        if stop > start:
            buf[o + b] = cell_lo[b]
            buf[o + nb + b] = cell_hi[b] + 1
        else:
            buf[o + b] = -1
            buf[o + nb + b] = -1
        if desc[b] != 0:
            _sort_runs(cells, poss, start, stop)
        # FlashInfer's causal convention: query i of b sees kv j <= kv_len - qo_len + i. It holds
        # when b's tokens are causal, in ascending position, and are its last qo_len pages
        # (then every earlier page has a lower position, so "kv j <= own index" is "q <= p").
        nq = qo_indptr[b + 1] - qo_indptr[b]
        kv_len = stop - start
        if nq > kv_len:
            trailing = False
        else:
            for t in range(nq):
                i = token_order[qo_indptr[b] + t]
                if causal[i] == 0 or poss[start + kv_len - nq + t] != bpos[i]:
                    trailing = False
                    break
    return buf, nb, nnz, trailing


@njit(cache=True)
def _build(cpos, cseqs, stree, bshift, bpos, bseqs, causal, window, chunk):
    """:func:`_build_packed`'s results as separate arrays: (seq_ids, qo_indptr, token_order,
    kv_indptr, kv_indices, kv_positions, cell_lo, cell_hi (int64 ``[n_b]``), trailing)."""
    buf, nb, nnz, trailing = _build_packed(cpos, cseqs, stree, bshift, bpos, bseqs, causal,
                                           window, chunk)
    batch = bpos.shape[0]
    seq_ids = buf[:nb].copy()
    o = nb
    qo_indptr = buf[o:o + nb + 1].copy()
    o += nb + 1
    token_order = buf[o:o + batch].copy()
    o += batch
    kv_indptr = buf[o:o + nb + 1].copy()
    o += nb + 1
    cells = buf[o:o + nnz].copy()
    poss = buf[o + nnz:o + 2 * nnz].copy()
    o += 2 * nnz + nb + batch                         # past kv_last_page_len, q_positions
    cell_lo = buf[o:o + nb].astype(np.int64)
    cell_hi = buf[o + nb:o + 2 * nb].astype(np.int64)
    return (seq_ids, qo_indptr, token_order, kv_indptr, cells, poss, cell_lo, cell_hi,
            trailing)


def _unpack(buf: np.ndarray, nb: int, batch: int, nnz: int, rule: "MaskRule",
            trailing: bool) -> "HostPages":
    """The :class:`HostPages` of a :func:`_build_packed` buffer (views of it, in its order),
    written out field by field: it runs every forward pass."""
    host = HostPages.__new__(HostPages)
    host._fill = None
    a = nb
    host.seq_ids = buf[:a]
    host.qo_indptr = buf[a:a + nb + 1]
    a += nb + 1
    host.token_order = buf[a:a + batch]
    a += batch
    host.kv_indptr = buf[a:a + nb + 1]
    a += nb + 1
    host.kv_indices = buf[a:a + nnz]
    a += nnz
    host.kv_positions = buf[a:a + nnz]
    a += nnz
    host.kv_last_page_len = buf[a:a + nb]
    a += nb
    host.q_positions = buf[a:a + batch]
    a += batch
    host.cell_lo = buf[a:a + nb]
    host.cell_hi = buf[a + nb:a + 2 * nb]
    host.rule = rule
    host.trailing = trailing
    host.table = None
    host.plans = {}
    return host


@njit(cache=True)
def _all_cells(cpos, bseqs, n_cells, max_seqs):
    """Page table of a reserve pass or an encoder cache: every sequence sees cells 0..n-1."""
    seq_ids, qo_indptr, token_order = _group_tokens(bseqs, max_seqs)
    nb = seq_ids.shape[0]
    kv_indptr = np.empty(nb + 1, np.int32)
    cells = np.empty(nb * n_cells, np.int32)
    poss = np.empty(nb * n_cells, np.int32)
    for b in range(nb + 1):
        kv_indptr[b] = b * n_cells
    for b in range(nb):
        for c in range(n_cells):
            cells[b * n_cells + c] = c
            poss[b * n_cells + c] = cpos[c]
    cell_lo = np.zeros(nb, np.int64)
    cell_hi = np.full(nb, n_cells, np.int64)
    return seq_ids, qo_indptr, token_order, kv_indptr, cells, poss, cell_lo, cell_hi


# --------------------------------------------------------------------------------------------
# Python entry points
# --------------------------------------------------------------------------------------------

def _host_pages(result, bpos, rule: MaskRule, trailing: bool) -> HostPages:
    seq_ids, qo_indptr, token_order, kv_indptr, kv_indices, kv_positions, lo, hi = result[:8]
    arrays = dict(seq_ids=seq_ids, qo_indptr=qo_indptr, token_order=token_order,
                  kv_indptr=kv_indptr, kv_indices=kv_indices, kv_positions=kv_positions,
                  kv_last_page_len=np.ones(len(seq_ids), np.int32),
                  q_positions=np.ascontiguousarray(bpos, dtype=np.int32))
    return HostPages(arrays, rule, lo, hi, trailing)


def build_pages(cell_pos: np.ndarray, cell_seqs: np.ndarray, stree: np.ndarray, bshift: int,
                positions: np.ndarray, seqs: np.ndarray, causal: np.ndarray, *, window: int = -1,
                chunk: int = 0) -> HostPages:
    """The page table of a batch over a cell table, on the host.

    Args:
        cell_pos: int32 ``[n_cells]`` cell positions (the table's ``_pos``).
        cell_seqs: uint64 ``[n_cells, words]`` sequence bitsets (``_seqs``).
        stree: int32 ``[2, 2 * n_leaves, max_seqs]`` per-sequence (min, max) position trees
            over blocks of ``2**bshift`` cells (``_stree``).
        positions, seqs: int32 ``[batch]`` the batch.
        causal: uint8 ``[batch]``, 0 where ``set_causal`` dropped the future-position test.
        window: sliding window ``W`` (a token at ``p`` sees ``p - W .. p``), -1 for none.
        chunk: chunk size ``C`` (a token at ``p`` sees ``p - p % C .. p``), 0 for none.
    """
    bpos = np.ascontiguousarray(positions, dtype=np.int32)
    bseq = np.ascontiguousarray(seqs, dtype=np.int32)
    caus = np.ascontiguousarray(causal, dtype=np.uint8)
    buf, nb, nnz, trailing = _build_packed(cell_pos, cell_seqs, stree, int(bshift), bpos, bseq,
                                           caus, int(window), int(chunk))
    return _unpack(buf, nb, len(bpos), nnz, MaskRule(caus, int(window), int(chunk)), trailing)


def build_all_visible(cell_pos: np.ndarray, n_cells: int, max_seqs: int, positions: np.ndarray,
                      seqs: np.ndarray) -> HostPages:
    """A page table in which every batch sequence sees cells ``0 .. n_cells-1`` and every token
    sees all of them (a reserve pass; an encoder cache). ``cell_pos`` int32 ``[n_cells]`` gives
    ``kv_positions``."""
    bpos = np.ascontiguousarray(positions, dtype=np.int32)
    bseq = np.ascontiguousarray(seqs, dtype=np.int32)
    result = _all_cells(np.ascontiguousarray(cell_pos, dtype=np.int32), bseq, int(n_cells),
                        int(max_seqs))
    no_test = np.zeros(len(bpos), np.uint8)
    # read-only as a causal cache's flags are: the attention's compiled code is typed by the
    # array's flags, and a writable one compiled (and would ship) another signature of each
    no_test.flags.writeable = False
    rule = MaskRule(no_test, -1, 0)
    return _host_pages(result, bpos, rule, False)


#: devices whose decode steps extend the previous pass's page table (:func:`extend_pages`)
#: instead of building it from the cell table: on the device (CUDA: no upload of the lists),
#: or on the host (CPU: each list copied and its new cells appended, no walk of the cell table)
INCREMENTAL_DEVICES = ("cuda", "cpu")
#: ... except a CPU batch of one token while the cache holds fewer cells than this: a batch-1
#: decode over 2k cells builds its list in ~11 us and extends it in ~14 us (hot; ~43 vs ~75 us
#: inside generate()), over 16k cells 34 vs 16 us; 8 sequences gain at every size (2k: 73 vs
#: 23 us)
CPU_EXTEND_MIN_CELLS = 4096


@njit(cache=True)
def _extension(prev_seq_ids, prev_indptr, prev_last, prev_first, prev_contiguous, bpos, bseqs,
               causal, start, slots, max_seqs, window, chunk):
    """The small fields of :func:`extend_pages`'s table, in one compiled pass: ``(ok, seq_ids,
    qo_indptr, token_order, kv_indptr, add_cells, add_pos, drop, new_last, new_first,
    contiguous, trailing)``; ``ok`` False (the rest meaningless) when the lists do not just grow
    at their ends. ``start >= 0``: the batch's cells are ``start + i``, else ``slots[i]``."""
    seq_ids, qo_indptr, token_order = _group_tokens(bseqs, max_seqs)
    nb = seq_ids.shape[0]
    batch = bpos.shape[0]
    add_tok = token_order.copy()
    add_pos = np.empty(batch, np.int32)
    add_cells = np.empty(batch, np.int32)
    drop = np.zeros(nb, np.int64)
    kv_indptr = np.zeros(nb + 1, np.int32)
    new_last = np.empty(nb, np.int64)
    new_first = np.empty(nb, np.int64)
    ok = nb == prev_seq_ids.shape[0]
    trailing = True
    contiguous = True
    # each phase runs while the lists still just grow: one return, whatever stops them
    if ok:
        for b in range(nb):
            if seq_ids[b] != prev_seq_ids[b]:
                ok = False
        for i in range(batch):
            if causal[i] == 0:
                trailing = False
        for b in range(nb):
            q0 = qo_indptr[b]
            q1 = qo_indptr[b + 1]
            # each sequence's tokens by position (its new cells, in list order): insertion
            # sort, a group is a decode token or a few verified ones
            for j in range(q0 + 1, q1):
                t = add_tok[j]
                k = j - 1
                while k >= q0 and bpos[add_tok[k]] > bpos[t]:
                    add_tok[k + 1] = add_tok[k]
                    k -= 1
                add_tok[k + 1] = t
            for j in range(q0, q1):
                if add_tok[j] != token_order[j]:
                    trailing = False   # the batch does not give this sequence's tokens in order
            for j in range(q0, q1):
                t = add_tok[j]
                add_pos[j] = bpos[t]
                add_cells[j] = start + t if start >= 0 else slots[t]
            if q1 > q0 and np.int64(add_pos[q0]) <= prev_last[b]:
                ok = False
    # each list keeps the positions its tokens can still see: from the lowest visible
    # position of its new tokens, which only grows as positions do; where the front ends
    # needs the list's positions to be one run
    windowed = window >= 0 or chunk > 0
    if ok and windowed and not prev_contiguous:
        ok = False
    if ok and windowed:
        for b in range(nb):
            lo_b = np.int64(1) << 62
            for j in range(qo_indptr[b], qo_indptr[b + 1]):
                lo_b = min(lo_b, visible_lo(np.int64(add_pos[j]), window, chunk))
            prev_len = np.int64(prev_indptr[b + 1] - prev_indptr[b])
            drop[b] = min(max(lo_b - prev_first[b], 0), prev_len)
    if ok:
        for b in range(nb):
            prev_len = np.int64(prev_indptr[b + 1] - prev_indptr[b])
            n_new = np.int64(qo_indptr[b + 1] - qo_indptr[b])
            new_len = prev_len - drop[b] + n_new
            kv_indptr[b + 1] = kv_indptr[b] + new_len
            new_last[b] = add_pos[qo_indptr[b + 1] - 1]
            new_first[b] = prev_first[b] + drop[b] if drop[b] < prev_len \
                else add_pos[qo_indptr[b]]
            if new_last[b] - new_first[b] + 1 != new_len:
                contiguous = False
    return (ok, seq_ids, qo_indptr, token_order, kv_indptr, add_cells, add_pos, drop, new_last,
            new_first, contiguous, trailing)


_NO_SLOTS = np.zeros(1, np.int32)


def extend_pages(prev: HostPages, positions: np.ndarray, seqs: np.ndarray, causal: np.ndarray,
                 start: Any, max_seqs: int, device: str, fill, window: int = -1,
                 chunk: int = 0) -> Optional[HostPages]:
    """This pass's page table as ``prev``'s lists, each followed by its sequence's new cells:
    O(batch) host work whatever the lists' lengths, the lists themselves merged on the device
    from ``prev.table`` (CUDA: an O(batch) upload and one kernel) or, on the CPU, copied on
    the host (no walk of the cell table). None (build it the usual way) unless every list just
    grows at its end: the same batch sequences in the same order, each one's new positions
    above every position its list holds.

    The caller vouches for the rest (:meth:`numbakv.causal.CausalCache._host_pages`): the cell
    table changed since ``prev`` only by this pass's placement at cells ``start .. start +
    batch - 1`` (``start`` an int) or ``start[i]`` (int32 ``[batch]``: paged placement),
    ``prev``'s lists held every cell of their sequences from their first listed position on,
    ``prev`` was built under the same ``window`` / ``chunk``. With a window or chunks each list
    also loses its front up to the new tokens' lowest visible position: counted on the host
    when the list's positions are one run (``prev.plans["contiguous"]``), else None.
    ``fill()`` builds the same table on the host: on the device, the host lists
    (:data:`LAZY_FIELDS`) come from it on first read.

    Args:
        positions, seqs: int32 ``[batch]`` the batch; causal: uint8 ``[batch]``.
    """
    prev_last = prev.plans.get("last-positions")
    prev_first = prev.plans.get("first-positions")
    if prev_last is None or prev_first is None:
        return None
    bpos = np.ascontiguousarray(positions, dtype=np.int32)
    bseq = np.ascontiguousarray(seqs, dtype=np.int32)
    caus = np.ascontiguousarray(causal, np.uint8)
    scalar = np.ndim(start) == 0
    (ok, seq_ids, qo_indptr, token_order, kv_indptr, add_cells, add_pos, drop, new_last,
     new_first, contiguous, trailing) = _extension(
        prev.seq_ids, prev.kv_indptr, prev_last, prev_first,
        bool(prev.plans.get("contiguous", False)), bpos, bseq, caus,
        int(start) if scalar else -1,
        _NO_SLOTS if scalar else np.ascontiguousarray(start, np.int32), int(max_seqs),
        int(window), int(chunk))
    if not ok:
        return None
    nb = seq_ids.shape[0]
    host = HostPages.__new__(HostPages)
    host.seq_ids = seq_ids
    host.qo_indptr = qo_indptr
    host.token_order = token_order
    host.kv_indptr = kv_indptr
    host.kv_last_page_len = np.ones(nb, np.int32)
    host.q_positions = bpos
    host.rule = MaskRule(caus, int(window), int(chunk))
    host.trailing = bool(trailing)
    host.plans = {"last-positions": new_last, "first-positions": new_first,
                  "contiguous": bool(contiguous)}
    if device == "cpu":
        _extend_on_host(prev, host, add_cells, add_pos, drop)
        return host
    host._fill = fill
    host.table = _extend_on_device(prev.table, host, add_cells, add_pos, drop, device)
    return host


def _extend_on_host(prev: HostPages, host: HostPages, add_cells: np.ndarray,
                    add_pos: np.ndarray, drop: np.ndarray) -> None:
    """The host lists of :func:`extend_pages` on the CPU (where the table is the host arrays):
    each of ``prev``'s lists less its ``drop[b]`` front entries, then its sequence's new cells
    (``add_cells`` / ``add_pos`` grouped by ``host.qo_indptr``); every list is non-empty."""
    nb = host.seq_ids.shape[0]
    prev_indptr = prev.kv_indptr
    qo = host.qo_indptr
    idx, pos = prev.kv_indices, prev.kv_positions
    cells, poss = add_cells, add_pos
    if nb == 1:                               # one sequence (batch-1 decode): two copies
        a, e = int(prev_indptr[0] + drop[0]), int(prev_indptr[1])
        kv_indices = np.concatenate((idx[a:e], cells))
        kv_positions = np.concatenate((pos[a:e], poss))
    else:
        parts_i, parts_p = [], []
        for b in range(nb):
            a, e = int(prev_indptr[b] + drop[b]), int(prev_indptr[b + 1])
            q0, q1 = int(qo[b]), int(qo[b + 1])
            parts_i += (idx[a:e], cells[q0:q1])
            parts_p += (pos[a:e], poss[q0:q1])
        kv_indices = np.concatenate(parts_i)
        kv_positions = np.concatenate(parts_p)
    starts = np.asarray(host.kv_indptr[:-1], np.int64)
    host._fill = None
    host._kv_indices = kv_indices
    host._kv_positions = kv_positions
    host._cell_lo = np.minimum.reduceat(kv_indices, starts).astype(np.int64)
    host._cell_hi = np.maximum.reduceat(kv_indices, starts).astype(np.int64) + 1
    host.table = PageTable(host.seq_ids, qo, host.token_order, host.kv_indptr, kv_indices,
                           kv_positions, host.kv_last_page_len, host.q_positions)


def _extend_on_device(prev: PageTable, host: HostPages, add_cells: np.ndarray,
                      add_pos: np.ndarray, drop: np.ndarray, device: str) -> PageTable:
    """The device :class:`PageTable` of :func:`extend_pages`: the small fields and the new
    cells in one staged copy (pinned, asynchronous, on the current stream), the lists merged
    by one kernel on the device."""
    from .kernels.launch import to_device as staged_copy
    from .kernels.decode import extend_lists
    small = [host.seq_ids, host.qo_indptr, host.token_order, host.kv_indptr,
             host.kv_last_page_len, host.q_positions, add_cells, add_pos, drop]
    small = [np.ascontiguousarray(a, np.int32) for a in small]
    nnz = int(host.kv_indptr[-1])
    if device == "cuda":
        import cupy
        descs, dev = staged_copy("cuda", *small)
        base = int(dev.data.ptr)
        small = [dev[d.ptr - base:d.ptr - base + 4 * d.shape[0]].view(np.int32) for d in descs]
        kv_indices = cupy.empty(nnz, np.int32)
        kv_positions = cupy.empty(nnz, np.int32)
    else:
        small, _ = staged_copy(device, *small)     # counted as the CUDA copy would be
        small = list(small)
        kv_indices = np.empty(nnz, np.int32)
        kv_positions = np.empty(nnz, np.int32)
    seq_ids, qo_indptr, token_order, kv_indptr, last_len, q_positions, cells, poss, drop = small
    extend_lists(device, prev.kv_indices, prev.kv_positions, prev.kv_indptr, drop, kv_indptr,
                 qo_indptr, cells, poss, kv_indices, kv_positions)
    return PageTable(seq_ids, qo_indptr, token_order, kv_indptr, kv_indices, kv_positions,
                     last_len, q_positions)


def last_positions(host: HostPages) -> np.ndarray:
    """int64 ``[n_b]``: the last position of each list (-1 for an empty one), from the host
    lists."""
    return _end_positions(host, last=True)


def _end_positions(host: HostPages, last: bool) -> np.ndarray:
    ends = np.asarray(host.kv_indptr[1:], np.int64)
    starts = np.asarray(host.kv_indptr[:-1], np.int64)
    pos = np.asarray(host.kv_positions)
    out = np.full(ends.shape[0], -1, np.int64)
    full = ends > starts
    out[full] = pos[ends[full] - 1] if last else pos[starts[full]]
    return out


def mark_extendable(host: HostPages, seq_pos_max: np.ndarray, windowed: bool) -> None:
    """Record in ``host.plans`` what :func:`extend_pages` needs of a host-built table (each
    list's first and last position, whether every list's positions are one run) when every
    list holds every cell of its sequence from its first listed position on; else nothing.
    Without a window or chunks that is: every list ends at its sequence's highest position
    (``seq_pos_max``: int ``[max_seqs]``; a causal list is then all the sequence's cells).
    With them (``windowed``) the tokens' visible intervals may leave holes, so each list's
    positions must be one run as well."""
    last = _end_positions(host, True)
    if not np.array_equal(last, np.asarray(seq_pos_max)[host.seq_ids]) or (last < 0).any():
        return
    first = _end_positions(host, False)
    lens = np.diff(np.asarray(host.kv_indptr, np.int64))
    contiguous = bool((last - first + 1 == lens).all())
    if windowed and not contiguous:
        return
    host.plans["first-positions"] = first
    host.plans["contiguous"] = contiguous
    host.plans["last-positions"] = last


def to_device(host: HostPages, device: str) -> PageTable:
    """The :class:`PageTable` of ``host`` on ``device``: the host arrays themselves on ``cpu`` and
    ``sim``; on ``cuda`` one asynchronous copy of all of them on the current stream, packed in
    a pinned staging buffer reused between passes (:func:`numbakv.kernels.launch.to_device`: no
    pinned allocation, no pageable upload and no host synchronisation per pass; legal while a
    CUDA graph is captured)."""
    arrays = [getattr(host, name) for name in FIELDS]
    if device != "cuda":
        if device != "cpu":          # counted as the CUDA copy would be
            from .kernels.launch import count_upload
            count_upload(sum(np.asarray(a).nbytes for a in arrays))
        table = PageTable(*arrays)
    else:
        from .kernels.launch import to_device as staged_copy
        descs, dev = staged_copy("cuda", *[np.ascontiguousarray(a, np.int32) for a in arrays])
        base = int(dev.data.ptr)
        table = PageTable(*[dev[d.ptr - base:d.ptr - base + 4 * d.shape[0]].view(np.int32)
                            for d in descs])
    host.table = table
    return table


def check_pages(pages: PageTable, n_cells: int) -> None:
    """Raise AssertionError unless ``pages`` (host arrays) is well formed: shapes, dtypes, CSR
    pointers, a permutation in ``token_order`` grouped by sequence, cells in range, no cell twice
    in a sequence's list, positions non-decreasing. Used by the tests and debug checks."""
    n_b = pages.seq_ids.shape[0]
    for name in FIELDS:
        a = np.asarray(getattr(pages, name))
        assert a.dtype == np.int32 and a.ndim == 1, (name, a.dtype, a.shape)
    assert pages.qo_indptr.shape[0] == n_b + 1 and pages.kv_indptr.shape[0] == n_b + 1
    assert pages.qo_indptr[0] == 0 and pages.kv_indptr[0] == 0
    assert (np.diff(pages.qo_indptr) >= 1).all() and (np.diff(pages.kv_indptr) >= 0).all()
    batch = pages.q_positions.shape[0]
    assert pages.qo_indptr[-1] == batch
    assert sorted(pages.token_order.tolist()) == list(range(batch))
    assert pages.kv_indptr[-1] == pages.kv_indices.shape[0] == pages.kv_positions.shape[0]
    assert (pages.kv_last_page_len == 1).all() and pages.kv_last_page_len.shape[0] == n_b
    assert len(set(pages.seq_ids.tolist())) == n_b
    for b in range(n_b):
        group = pages.token_order[pages.qo_indptr[b]:pages.qo_indptr[b + 1]]
        assert (np.diff(group) > 0).all(), "each group in batch order"
        cells = pages.kv_indices[pages.kv_indptr[b]:pages.kv_indptr[b + 1]]
        pos = pages.kv_positions[pages.kv_indptr[b]:pages.kv_indptr[b + 1]]
        assert ((cells >= 0) & (cells < n_cells)).all()
        assert len(np.unique(cells)) == len(cells)
        # non-decreasing: seq_add/seq_div may leave a sequence two cells at one position
        assert (np.diff(pos) >= 0).all() or len(pos) < 2, "ascending by position"




@njit(cache=True)
def _fill_visible(out, cols, kv_pos, tok_pos, tok_causal, window, chunk):
    """out[i, cols[j]] = whether token i (position tok_pos[i]) sees listed cell j (position
    kv_pos[j]); out starts all False. O(L * nnz)."""
    for i in range(tok_pos.shape[0]):
        p = np.int64(tok_pos[i])
        lo = visible_lo(p, window, chunk)
        hi = p if tok_causal[i] != 0 else np.int64(_NO_LIMIT)
        for j in range(cols.shape[0]):
            q = kv_pos[j]
            out[i, cols[j]] = (q >= lo) & (q <= hi)


@njit(cache=True)
def _plan_parts(cells, min_run, max_gap):
    """Split a sequence's page list (cells in list order) into parts read by one attention call
    each: runs of the pool (cells ``[start, end)``, read as views, unlisted cells masked) for the
    stretches where the listed cells lie densely (gaps <= max_gap) over at least ``min_run``
    cells, and one gathered part for the rest.

    Returns (runs int64 [k, 2], col int64 [nnz]: each listed cell's column in the concatenated
    parts (the runs in order, then the gathered part), gathered int64 [m]: list indices of the
    gathered part's cells)."""
    nnz = cells.shape[0]
    order = np.argsort(cells, kind="mergesort")
    runs = np.empty((nnz, 2), np.int64)
    in_run = np.zeros(nnz, np.bool_)
    k = 0
    i = 0
    while i < nnz:
        j = i
        while j + 1 < nnz and cells[order[j + 1]] - cells[order[j]] <= max_gap + 1:
            j += 1
        if cells[order[j]] - cells[order[i]] + 1 >= min_run:
            runs[k, 0] = cells[order[i]]
            runs[k, 1] = cells[order[j]] + 1
            for t in range(i, j + 1):
                in_run[order[t]] = True
            k += 1
        i = j + 1
    col = np.empty(nnz, np.int64)
    base = 0
    r = 0
    for t in range(nnz):
        c = cells[order[t]]
        if not in_run[order[t]]:
            continue
        while c >= runs[r, 1]:
            base += runs[r, 1] - runs[r, 0]
            r += 1
        col[order[t]] = base + c - runs[r, 0]
    width = 0
    for r in range(k):
        width += runs[r, 1] - runs[r, 0]
    m = 0
    for t in range(nnz):
        if not in_run[t]:
            m += 1
    gathered = np.empty(m, np.int64)
    m = 0
    for t in range(nnz):
        if not in_run[t]:
            gathered[m] = t
            col[t] = width + m
            m += 1
    return runs[:k].copy(), col, gathered


def plan_parts(host: HostPages, b: int, *, min_run: int = 256, max_gap: int = 32):
    """:func:`_plan_parts` for sequence ``b`` of a page table (see there)."""
    k0, k1 = int(host.kv_indptr[b]), int(host.kv_indptr[b + 1])
    return _plan_parts(host.kv_indices[k0:k1], int(min_run), int(max_gap))


def columns_mask(host: HostPages, b: int, cols: np.ndarray, width: int) -> np.ndarray:
    """Boolean mask ``[qo_len, width]`` of sequence ``b``'s tokens (``token_order`` order):
    listed cell ``j`` of its page list is column ``cols[j]``; columns no listed cell maps to are
    masked."""
    k0, k1 = int(host.kv_indptr[b]), int(host.kv_indptr[b + 1])
    toks = host.token_order[host.qo_indptr[b]:host.qo_indptr[b + 1]]
    out = np.zeros((len(toks), int(width)), np.bool_)
    rule = host.rule
    _fill_visible(out, cols, host.kv_positions[k0:k1], host.q_positions[toks], rule.causal[toks],
                  rule.window, rule.chunk)
    return out


def token_mask(host: HostPages, b: int, base: Optional[int] = None,
               width: Optional[int] = None) -> np.ndarray:
    """Boolean mask ``[qo_len, width]`` of sequence ``b``'s tokens (``token_order`` order) over
    its page list: column ``kv_indices[j] - base`` when ``base`` is given (a window of the cell
    pool starting at cell ``base``, cells not in the list masked), else column ``j``."""
    k0, k1 = int(host.kv_indptr[b]), int(host.kv_indptr[b + 1])
    toks = host.token_order[host.qo_indptr[b]:host.qo_indptr[b + 1]]
    if base is None:
        cols = np.arange(k1 - k0, dtype=np.int64)
        width = k1 - k0
    else:
        cols = host.kv_indices[k0:k1].astype(np.int64) - base
    out = np.zeros((len(toks), int(width)), np.bool_)
    rule = host.rule
    _fill_visible(out, cols, host.kv_positions[k0:k1], host.q_positions[toks], rule.causal[toks],
                  rule.window, rule.chunk)
    return out


def pages_of_table(table, positions: np.ndarray, seqs: np.ndarray, causal: np.ndarray, *,
                   window: int = -1, chunk: int = 0) -> HostPages:
    """:func:`build_pages` over a :class:`numbakv.cells.CellTable` (the one place that reads
    the table's arrays: ``_pos``, ``_seqs``, ``_stree`` and the tree's block size)."""
    if not (positions.dtype == seqs.dtype == np.int32 and causal.dtype == np.uint8):
        return build_pages(table._pos, table._seqs, table._stree, int(table._meta[_M_BSHIFT]),
                           positions, seqs, causal, window=window, chunk=chunk)
    # a forward pass's own arrays (int32 / uint8, contiguous): straight to the builder
    buf, nb, nnz, trailing = _build_packed(table._pos, table._seqs, table._stree,
                                           int(table._meta[_M_BSHIFT]), positions, seqs, causal,
                                           window, chunk)
    return _unpack(buf, nb, positions.shape[0], nnz, MaskRule(causal, window, chunk), trailing)


def reserve_pages_of_table(table, positions: np.ndarray, seqs: np.ndarray) -> HostPages:
    """The page table of a reserve pass (every token sees every cell, as its mask says)."""
    return build_all_visible(table._pos, table._pos.shape[0], table._stree.shape[2], positions,
                             seqs)


__all__ = ["PageTable", "MaskRule", "HostPages", "build_pages", "build_all_visible", "to_device",
           "extend_pages", "last_positions", "mark_extendable", "INCREMENTAL_DEVICES", "LAZY_FIELDS",
           "CPU_EXTEND_MIN_CELLS",
           "visible_lo",
           "check_pages", "token_mask", "plan_parts", "columns_mask", "pages_of_table",
           "reserve_pages_of_table", "FIELDS"]
