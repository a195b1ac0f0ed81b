"""The cell table: numbakv's metadata heart, independent of K/V data.

Per cache cell: the position of the token it holds and the rotary shift still pending on its key
(an 8-byte ``POS_SHIFT_DTYPE`` record, what the hot path reads), and beside them the set of
sequences that reference it, a bitset of ``uint64 [n_cells, words]`` with ``words`` sized from
``max_seqs`` (one word up to 64 sequences, four for 256). ``CELL_DTYPE`` / ``cell_dtype(words)``
is the whole record as exported and loaded. A free cell has every sequence bit 0 (``pos = -1``
and ``shift = 0``: every operation that frees a cell resets it, as llama.cpp's
``llama_kv_cells::rm`` does).

Semantics are Ollama's ``kvcache/causal.go`` (contiguous first-fit placement, sliding-window
pruning of batch and idle sequences, ``Remove`` with the move-down of later positions,
``CopyPrefix``, defrag) plus llama.cpp's sequence operations (``seq_rm`` / ``seq_cp`` /
``seq_keep`` / ``seq_add`` / ``seq_div``, scatter placement from a rotating head). Where the
upstreams leave a table half-edited on failure, every function here decides before it writes:
a call that fails leaves the table exactly as it was.

Sequence operations cost O(log n + cells touched): they visit only the ``stree`` leaf blocks whose
position range meets what they change (only ``seq_rm(-1)``, ``seq_keep``, defrag and whole-table
loads scan). Each can record an undo log (``journal=``: the cells of those blocks as they were,
plus the small per-sequence rows and scalars; for a join into a sequence that holds no cell,
only that sequence's row) that :meth:`CellTable.rollback` replays; callers never need a copy of
the table to be all or nothing.

All work runs in module-level ``@njit`` functions over plain arrays; :class:`CellTable` is a thin
Python class that owns the arrays, validates arguments and maps error codes to exceptions.

Indexes kept in step with the cells, so that what runs every forward pass (placement, window
pruning, the attended range) never scans the whole table:

* ``occ`` -- occupancy bitmap, one bit per cell (bits past ``n_cells`` are set, so they can
  never be part of a free run), and ``ftree``, a segment tree over its 64-cell words holding
  (free prefix run, free suffix run, longest free run): first-fit search in O(log n).
* ``stree`` -- for every sequence, a segment tree over blocks of ``block_size`` cells holding the
  (min, max) position of the sequence's cells in that block: "which cells of seq s have
  pos < t" and "leftmost / rightmost cell of s with pos >= t" cost O(log n + block_size)
  however far the sequence is spread over the table. Stored ``[2, node, seq]`` so that a
  rebuild touches one contiguous row per node (a ``[seq, node]`` layout puts the rows of all
  sequences 2^k bytes apart, and their leaves thrash the same L1 sets).
* ``sidx`` -- per sequence: first and last cell holding it, lowest and highest position
  (``-1`` when the sequence has no cell); always exact.
* ``meta`` -- scalars: cells in use, the scatter head, how many cells have a pending shift and
  the cell range they lie in.
"""

from __future__ import annotations

import functools
from operator import attrgetter, is_
from typing import NamedTuple, Optional, Tuple

import numpy as np
from ._jit import njit
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros

from .errors import NotSupportedError

SEQ_WORDS = 4
#: Sequence ids are 0 .. MAX_SEQS - 1 (the widest bitset).
MAX_SEQS = 64 * SEQ_WORDS
#: What the hot path reads per cell, 8 bytes: position and pending shift side by side.
POS_SHIFT_DTYPE = np.dtype([("pos", np.int32), ("shift", np.int32)])


def cell_dtype(words: int) -> np.dtype:
    """The record a whole cell is exported as (``CellTable.cells``, state files): position,
    pending shift and ``words`` uint64 words of sequence bits."""
    return np.dtype([("pos", np.int32), ("shift", np.int32), ("seqs", np.uint64, (words,))])


def seq_words(max_seqs: int) -> int:
    """uint64 words of sequence bits per cell: one up to 64 sequences."""
    return max(1, -(-int(max_seqs) // 64))


#: the record of the widest table (256 sequences)
CELL_DTYPE = cell_dtype(SEQ_WORDS)
#: Largest storable position; one below int32 max so that ``pos + 1`` (Ollama's lowest position
#: of an idle sequence) still fits an int32.
POS_MAX = 2**31 - 2
#: Largest table: positions, cell indices and free-run lengths all fit int32.
MAX_CELLS = 2**30
SHARED_SHIFT_MESSAGE = "shifting cells shared by multiple sequences not supported"

_WORD = 64
_EMPTY_MIN = 2**31 - 1          # stree min of a block that holds no cell of the sequence
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_ONE = np.uint64(1)
_INF = 2**62                     # "no upper bound" for position ranges inside njit code

# meta slots
_M_USED = 0       # cells holding at least one sequence
_M_HEAD = 1       # where find_scatter starts (llama.cpp's head), 0 <= head < n_cells
_M_NSHIFT = 2     # cells with shift != 0
_M_SHLO = 3       # every cell with shift != 0 lies in [SHLO, SHHI] (SHLO > SHHI when none)
_M_SHHI = 4
_M_BSHIFT = 5     # log2(block_size) of stree leaves
_META_LEN = 8

# error codes returned by the njit functions (0 = ok)
_E_SLOT_RANGE = -1
_E_SLOT_USED = -2
_E_SLOT_DUP = -3
_E_POS = -4
_E_SEQ = -5
_E_LEN_POS = -6
_E_LEN_SEQ = -7
_E_SHARED = -8
_E_OVERFLOW = -9
_E_SHIFT_OVERFLOW = -10

_I32 = np.dtype(np.int32)


# --------------------------------------------------------------------------------------------
# bit helpers
# --------------------------------------------------------------------------------------------

@njit(cache=True)
def _bit(s):
    return _ONE << np.uint64(s & 63)


@njit(cache=True)
def _has(cseqs, c, s):
    return (cseqs[c, s >> 6] & _bit(s)) != 0


@njit(cache=True)
def _used(cseqs, c):
    for w in range(cseqs.shape[1]):
        if cseqs[c, w] != 0:
            return True
    return False


@njit(cache=True)
def _has_others(cseqs, c, s):
    """Whether cell c holds a sequence other than s."""
    sw = s >> 6
    for w in range(cseqs.shape[1]):
        x = cseqs[c, w]
        if w == sw:
            x &= ~_bit(s)
        if x != 0:
            return True
    return False


@njit(cache=True)
def _occ_test(occ, c):
    return (occ[c >> 6] >> np.uint64(c & 63)) & _ONE != 0


@njit(cache=True)
def _occ_set(occ, c):
    occ[c >> 6] |= _bit(c)


@njit(cache=True)
def _occ_clear(occ, c):
    occ[c >> 6] &= ~_bit(c)


@njit(cache=True)
def _next_free(occ, i, n):
    """First free cell >= i, or n."""
    if i >= n:
        return n
    w = i >> 6
    x = ~occ[w] & (_ALL << np.uint64(i & 63))
    nw = occ.shape[0]
    while x == 0:
        w += 1
        if w >= nw:
            return n
        x = ~occ[w]
    c = w * 64 + np.int64(trailing_zeros(x))
    return c if c < n else n


@njit(cache=True)
def _next_used(occ, i, n):
    """First used cell >= i, or n (padding bits past n count as used, hence the clamp)."""
    if i >= n:
        return n
    w = i >> 6
    x = occ[w] & (_ALL << np.uint64(i & 63))
    while x == 0:
        w += 1
        x = occ[w]          # the padding bits guarantee a stop at the last word
    c = w * 64 + np.int64(trailing_zeros(x))
    return c if c < n else n


@njit(cache=True)
def _prev_used(occ, j):
    """Last used cell <= j (j < n_cells), or -1."""
    if j < 0:
        return -1
    w = j >> 6
    b = j & 63
    mask = _ALL if b == 63 else ((_ONE << np.uint64(b + 1)) - _ONE)
    x = occ[w] & mask
    while x == 0:
        w -= 1
        if w < 0:
            return -1
        x = occ[w]
    return w * 64 + 63 - np.int64(leading_zeros(x))


# --------------------------------------------------------------------------------------------
# free-run tree over occupancy words: ftree[0] free prefix, ftree[1] free suffix, ftree[2] best
# --------------------------------------------------------------------------------------------

@njit(cache=True)
def _ft_leaf(ftree, occ, w):
    x = occ[w]
    k = occ.shape[0] + w
    if x == 0:
        ftree[0, k] = 64
        ftree[1, k] = 64
        ftree[2, k] = 64
        return
    f = ~x
    best = 0
    while f != 0:                      # each step shortens every run of ones by one
        f &= f >> _ONE
        best += 1
    ftree[0, k] = np.int64(trailing_zeros(x))
    ftree[1, k] = np.int64(leading_zeros(x))
    ftree[2, k] = best


@njit(cache=True)
def _ft_pull(ftree, k, half):
    """Recompute node k from its children (each covering ``half`` cells); True if it changed."""
    l = 2 * k
    r = l + 1
    lp = ftree[0, l]
    ls = ftree[1, l]
    rp = ftree[0, r]
    rs = ftree[1, r]
    p = lp if lp < half else half + rp
    s = rs if rs < half else half + ls
    b = max(max(ftree[2, l], ftree[2, r]), ls + rp)
    if p == ftree[0, k] and s == ftree[1, k] and b == ftree[2, k]:
        return False
    ftree[0, k] = p
    ftree[1, k] = s
    ftree[2, k] = b
    return True


@njit(cache=True)
def _ft_point(ftree, occ, w):
    """Word w of occ changed: refresh its leaf and the path to the root."""
    _ft_leaf(ftree, occ, w)
    k = (occ.shape[0] + w) >> 1
    half = 64
    while k >= 1:
        if not _ft_pull(ftree, k, half):
            return
        k >>= 1
        half *= 2


@njit(cache=True)
def _ft_range(ftree, occ, w0, w1):
    """Words w0..w1 (inclusive) of occ changed."""
    nw = occ.shape[0]
    for w in range(w0, w1 + 1):
        _ft_leaf(ftree, occ, w)
    lo = (nw + w0) >> 1
    hi = (nw + w1) >> 1
    half = 64
    while lo >= 1:
        for k in range(lo, hi + 1):
            _ft_pull(ftree, k, half)
        lo >>= 1
        hi >>= 1
        half *= 2


@njit(cache=True)
def _ft_first_fit(ftree, occ, n):
    """Ollama's findStartLoc: start of the first run of n free cells, or -1."""
    nw = occ.shape[0]
    if ftree[2, 1] < n:
        return -1
    k = 1
    start = 0
    length = nw * 64
    while k < nw:
        half = length >> 1
        l = 2 * k
        if ftree[2, l] >= n:
            k = l
        elif ftree[1, l] + ftree[0, l + 1] >= n:
            return start + half - ftree[1, l]
        else:
            k = l + 1
            start += half
        length = half
    x = occ[k - nw]
    run = 0
    for j in range(64):
        if (x >> np.uint64(j)) & _ONE:
            run = 0
        else:
            run += 1
            if run >= n:
                return start + j - n + 1
    return -1


# --------------------------------------------------------------------------------------------
# per-sequence position trees: stree[0, k, s] min pos, stree[1, k, s] max pos of s's cells
# --------------------------------------------------------------------------------------------

@njit(cache=True)
def _st_widen(stree, s, blk, mn, mx):
    """Cells of s in block blk now hold positions mn .. mx: widen the leaf and its ancestors,
    stopping at the first that already covers them (the same tree as one widening per cell,
    with one walk up instead of one per cell)."""
    k = (stree.shape[1] >> 1) + blk
    while k >= 1:
        changed = False
        if mn < stree[0, k, s]:
            stree[0, k, s] = mn
            changed = True
        if mx > stree[1, k, s]:
            stree[1, k, s] = mx
            changed = True
        if not changed:
            return
        k >>= 1


@njit(cache=True, inline="always")
def _st_run(stree, run_s, run_blk, mn, mx, s, blk, p):
    """One cell of sequence ``s`` at position ``p`` in leaf block ``blk``, in a loop that widens
    the position tree once per run of one sequence in one block: extends the open run
    ``(run_s, run_blk, mn, mx)`` or closes it into the tree (:func:`_st_widen`) and opens the
    next; returns the open run. The loop closes the last run itself (``run_s >= 0``)."""
    if s == run_s and blk == run_blk:
        return run_s, run_blk, min(mn, p), max(mx, p)
    if run_s >= 0:
        _st_widen(stree, run_s, run_blk, mn, mx)
    return s, blk, p, p


@njit(cache=True)
def _st_set_leaf(stree, s, blk, mn, mx):
    """Set the leaf of block blk and refresh its ancestors (stops once one is unchanged)."""
    k = (stree.shape[1] >> 1) + blk
    stree[0, k, s] = mn
    stree[1, k, s] = mx
    k >>= 1
    while k >= 1:
        a = min(stree[0, 2 * k, s], stree[0, 2 * k + 1, s])
        b = max(stree[1, 2 * k, s], stree[1, 2 * k + 1, s])
        if a == stree[0, k, s] and b == stree[1, k, s]:
            return
        stree[0, k, s] = a
        stree[1, k, s] = b
        k >>= 1


@njit(cache=True)
def _st_leaf_from_cells(stree, cpos, cseqs, s, blk, bshift):
    n = cpos.shape[0]
    lo = blk << bshift
    hi = min(lo + (1 << bshift), n)
    w = s >> 6
    bit = _bit(s)
    mn = _EMPTY_MIN
    mx = -1
    for c in range(lo, hi):
        if cseqs[c, w] & bit:
            p = cpos[c]
            if p < mn:
                mn = p
            if p > mx:
                mx = p
    k = (stree.shape[1] >> 1) + blk
    stree[0, k, s] = mn
    stree[1, k, s] = mx


@njit(cache=True)
def _st_first_leaf_min_lt(stree, s, t):
    """Leftmost block whose lowest position of s is < t, or -1."""
    if stree[0, 1, s] >= t:
        return -1
    nl = stree.shape[1] >> 1
    k = 1
    while k < nl:
        k = 2 * k if stree[0, 2 * k, s] < t else 2 * k + 1
    return k - nl


@njit(cache=True)
def _st_first_leaf_max_ge(stree, s, t):
    """Leftmost block holding a cell of s with pos >= t, or -1."""
    if stree[1, 1, s] < t:
        return -1
    nl = stree.shape[1] >> 1
    k = 1
    while k < nl:
        k = 2 * k if stree[1, 2 * k, s] >= t else 2 * k + 1
    return k - nl


@njit(cache=True)
def _st_last_leaf_max_ge(stree, s, t):
    """Rightmost block holding a cell of s with pos >= t, or -1."""
    if stree[1, 1, s] < t:
        return -1
    nl = stree.shape[1] >> 1
    k = 1
    while k < nl:
        k = 2 * k + 1 if stree[1, 2 * k + 1, s] >= t else 2 * k
    return k - nl


@njit(cache=True)
def _first_cell_ge(cpos, cseqs, stree, s, t, bshift):
    """Lowest cell index holding s with pos >= t, or -1."""
    blk = _st_first_leaf_max_ge(stree, s, t)
    if blk < 0:
        return -1
    lo = blk << bshift
    hi = min(lo + (1 << bshift), cpos.shape[0])
    w = s >> 6
    bit = _bit(s)
    for c in range(lo, hi):
        if (cseqs[c, w] & bit) != 0 and cpos[c] >= t:
            return c
    return -1


@njit(cache=True)
def _last_cell_ge(cpos, cseqs, stree, s, t, bshift):
    """Highest cell index holding s with pos >= t, or -1."""
    blk = _st_last_leaf_max_ge(stree, s, t)
    if blk < 0:
        return -1
    lo = blk << bshift
    hi = min(lo + (1 << bshift), cpos.shape[0])
    w = s >> 6
    bit = _bit(s)
    for c in range(hi - 1, lo - 1, -1):
        if (cseqs[c, w] & bit) != 0 and cpos[c] >= t:
            return c
    return -1


@njit(cache=True)
def _sidx_refresh(sidx, stree, cpos, cseqs, s, bshift):
    """Recompute s's index row from its tree (O(log n + block_size))."""
    if stree[1, 1, s] < 0:
        sidx[0, s] = -1
        sidx[1, s] = -1
        sidx[2, s] = -1
        sidx[3, s] = -1
        return
    sidx[2, s] = stree[0, 1, s]
    sidx[3, s] = stree[1, 1, s]
    sidx[0, s] = _first_cell_ge(cpos, cseqs, stree, s, 0, bshift)
    sidx[1, s] = _last_cell_ge(cpos, cseqs, stree, s, 0, bshift)


@njit(cache=True)
def _sidx_add(sidx, s, c, p):
    if sidx[3, s] < 0:
        sidx[0, s] = c
        sidx[1, s] = c
        sidx[2, s] = p
        sidx[3, s] = p
        return
    if c < sidx[0, s]:
        sidx[0, s] = c
    if c > sidx[1, s]:
        sidx[1, s] = c
    if p < sidx[2, s]:
        sidx[2, s] = p
    if p > sidx[3, s]:
        sidx[3, s] = p


# --------------------------------------------------------------------------------------------
# cell-level edits shared by the operations (indexes other than stree/sidx kept in step here)
# --------------------------------------------------------------------------------------------

@njit(cache=True)
def _set_shift(cshift, meta, c, new):
    old = cshift[c]
    if old == 0 and new != 0:
        meta[_M_NSHIFT] += 1
        if c < meta[_M_SHLO]:
            meta[_M_SHLO] = c
        if c > meta[_M_SHHI]:
            meta[_M_SHHI] = c
    elif old != 0 and new == 0:
        meta[_M_NSHIFT] -= 1
    cshift[c] = new


@njit(cache=True)
def _free_cell(cpos, cshift, cseqs, occ, meta, c):
    """Reset cell c (whose sequence bits are already all 0) to the free state; the caller
    refreshes ftree for its word."""
    _set_shift(cshift, meta, c, 0)
    cpos[c] = -1
    for w in range(cseqs.shape[1]):
        cseqs[c, w] = 0
    _occ_clear(occ, c)
    meta[_M_USED] -= 1


@njit(cache=True)
def _drop_seq(cpos, cshift, cseqs, occ, meta, c, s):
    """Cell c loses s; returns True if that freed the cell (ftree not yet refreshed)."""
    cseqs[c, s >> 6] &= ~_bit(s)
    if _used(cseqs, c):
        return False
    _free_cell(cpos, cshift, cseqs, occ, meta, c)
    return True


@njit(cache=True)
def _st_pull_all(stree, nseq):
    """Recompute every internal node of every sequence's tree from the leaves (the layout
    [node, seq] makes this a contiguous min/max over sequences per node)."""
    nl = stree.shape[1] >> 1
    for k in range(nl - 1, 0, -1):
        for s in range(nseq):
            a = stree[0, 2 * k, s]
            b = stree[0, 2 * k + 1, s]
            stree[0, k, s] = a if a < b else b
            a = stree[1, 2 * k, s]
            b = stree[1, 2 * k + 1, s]
            stree[1, k, s] = a if a > b else b


@njit(cache=True)
def _rebuild_all(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta):
    """Recompute every index from the cells (and normalise free cells to pos -1, shift 0)."""
    n = cpos.shape[0]
    nseq = sidx.shape[1]
    bshift = meta[_M_BSHIFT]
    nl = stree.shape[1] >> 1
    stree[0, nl:, :] = _EMPTY_MIN
    stree[1, nl:, :] = -1
    nw = occ.shape[0]
    for w in range(nw):
        occ[w] = 0
    used = 0
    nshift = 0
    shlo = n
    shhi = -1
    for c in range(n):
        if not _used(cseqs, c):
            if cpos[c] != -1:
                cpos[c] = -1
            if cshift[c] != 0:
                cshift[c] = 0
            continue
        used += 1
        occ[c >> 6] |= _bit(c)
        if cshift[c] != 0:
            nshift += 1
            if c < shlo:
                shlo = c
            shhi = c
        p = cpos[c]
        k = nl + (c >> bshift)
        for w in range(cseqs.shape[1]):
            x = cseqs[c, w]
            while x != 0:
                s = w * 64 + np.int64(trailing_zeros(x))
                x &= x - _ONE
                if p < stree[0, k, s]:
                    stree[0, k, s] = p
                if p > stree[1, k, s]:
                    stree[1, k, s] = p
    _st_pull_all(stree, nseq)
    for s in range(nseq):
        _sidx_refresh(sidx, stree, cpos, cseqs, s, bshift)
    # cells past n_cells are permanently "used" so no free run extends into them
    for c in range(n, nw * 64):
        occ[c >> 6] |= _bit(c)
    _ft_range(ftree, occ, 0, nw - 1)
    meta[_M_USED] = used
    meta[_M_NSHIFT] = nshift
    meta[_M_SHLO] = shlo
    meta[_M_SHHI] = shhi
    if meta[_M_HEAD] >= n or meta[_M_HEAD] < 0:
        meta[_M_HEAD] = 0


@njit(cache=True)
def _validate_cells(cpos, cseqs, nseq):
    """0 if the cells can be indexed, else -(1 + first bad cell)."""
    n = cpos.shape[0]
    for c in range(n):
        if not _used(cseqs, c):
            continue
        p = cpos[c]
        if p < 0 or p > POS_MAX:
            return -(1 + c)
        for w in range(cseqs.shape[1]):
            x = cseqs[c, w]
            if x == 0:
                continue
            top = w * 64 + 63 - np.int64(leading_zeros(x))
            if top >= nseq:
                return -(1 + c)
    return 0


# --------------------------------------------------------------------------------------------
# placement
# --------------------------------------------------------------------------------------------

@njit(cache=True)
def _find_scatter(occ, meta, n_cells, n):
    """llama.cpp's non-contiguous find_slot: (n free cells from the head onwards, wrapping;
    True), or (empty, False) when fewer than n cells are free."""
    out = np.empty(n, np.int32)
    if n > n_cells - meta[_M_USED]:
        return out[:0], False
    head = meta[_M_HEAD]
    if head > meta[_M_USED] + 2 * n:
        head = 0          # enough free cells before the head: fill the front first
    k = 0
    c = _next_free(occ, head, n_cells)
    while k < n:
        if c >= n_cells:
            c = _next_free(occ, 0, n_cells)
        out[k] = c
        k += 1
        c = _next_free(occ, c + 1, n_cells)
    return out, True


@njit(cache=True)
def _apply_batch(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, slots, positions, bseqs):
    n = cpos.shape[0]
    nseq = sidx.shape[1]
    b = slots.shape[0]
    if positions.shape[0] != b:
        return _E_LEN_POS
    if bseqs.shape[0] != b:
        return _E_LEN_SEQ
    ascending = True
    for i in range(b):
        c = slots[i]
        if c < 0 or c >= n:
            return _E_SLOT_RANGE
        if _occ_test(occ, c):
            return _E_SLOT_USED
        if i > 0 and c <= slots[i - 1]:
            ascending = False
        p = positions[i]
        if p < 0 or p > POS_MAX:
            return _E_POS
        s = bseqs[i]
        if s < 0 or s >= nseq:
            return _E_SEQ
    if not ascending:
        srt = np.sort(slots)
        for i in range(1, b):
            if srt[i] == srt[i - 1]:
                return _E_SLOT_DUP
    if b == 0:
        return 0
    bshift = meta[_M_BSHIFT]
    # the position tree is widened once per run of cells of one sequence in one leaf block: a
    # 4096-token prefill walks up the tree 64 times instead of 4096 (4 us instead of 58)
    run_s = np.int64(-1)
    run_blk = np.int64(-1)
    mn = np.int64(0)
    mx = np.int64(0)
    for i in range(b):
        c = np.int64(slots[i])
        p = np.int64(positions[i])
        s = np.int64(bseqs[i])
        cpos[c] = p
        for w in range(cseqs.shape[1]):
            cseqs[c, w] = 0
        cseqs[c, s >> 6] = _bit(s)
        _occ_set(occ, c)
        _sidx_add(sidx, s, c, p)
        run_s, run_blk, mn, mx = _st_run(stree, run_s, run_blk, mn, mx, s, c >> bshift, p)
    if run_s >= 0:
        _st_widen(stree, run_s, run_blk, mn, mx)
    meta[_M_USED] += b
    first = np.int64(slots[0])
    last = np.int64(slots[b - 1])
    if ascending and (last >> 6) - (first >> 6) <= 2 * b:
        _ft_range(ftree, occ, first >> 6, last >> 6)
    else:
        for i in range(b):
            _ft_point(ftree, occ, np.int64(slots[i]) >> 6)
    meta[_M_HEAD] = (last + 1) % n
    return 0


@njit(cache=True)
def _unapply_batch(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, slots, head):
    """Free the cells of a batch just applied and put the head back."""
    n = cpos.shape[0]
    b = slots.shape[0]
    if head < 0 or head >= n:
        return _E_POS
    for i in range(b):
        c = slots[i]
        if c < 0 or c >= n:
            return _E_SLOT_RANGE
        if not _occ_test(occ, c):
            return _E_SLOT_USED
    srt = np.sort(slots)
    for i in range(1, b):
        if srt[i] == srt[i - 1]:
            return _E_SLOT_DUP
    bshift = meta[_M_BSHIFT]
    aff = np.zeros(cseqs.shape[1], np.uint64)
    for i in range(b):
        c = np.int64(slots[i])
        for w in range(cseqs.shape[1]):
            aff[w] |= cseqs[c, w]
            cseqs[c, w] = 0
        _free_cell(cpos, cshift, cseqs, occ, meta, c)
    for w in range(cseqs.shape[1]):
        x = aff[w]
        while x != 0:
            s = w * 64 + np.int64(trailing_zeros(x))
            x &= x - _ONE
            for i in range(b):
                blk = np.int64(slots[i]) >> bshift
                if i > 0 and blk == (np.int64(slots[i - 1]) >> bshift):
                    continue
                _st_leaf_from_cells(stree, cpos, cseqs, s, blk, bshift)
                k = (stree.shape[1] >> 1) + blk
                _st_set_leaf(stree, s, blk, stree[0, k, s], stree[1, k, s])
            _sidx_refresh(sidx, stree, cpos, cseqs, s, bshift)
    if b > 0 and srt[b - 1] - srt[0] < 128 * b:
        _ft_range(ftree, occ, np.int64(srt[0]) >> 6, np.int64(srt[b - 1]) >> 6)
    else:
        for i in range(b):
            _ft_point(ftree, occ, np.int64(slots[i]) >> 6)
    meta[_M_HEAD] = head
    return 0


# --------------------------------------------------------------------------------------------
# sliding window
# --------------------------------------------------------------------------------------------

@njit(cache=True)
def _lowest_positions(sidx, positions, bseqs):
    """Per sequence: the lowest position the batch gives it, -1 if not in the batch."""
    nseq = sidx.shape[1]
    lowest = np.full(nseq, -1, np.int64)
    for i in range(positions.shape[0]):
        s = bseqs[i]
        p = np.int64(positions[i])
        if lowest[s] < 0 or p < lowest[s]:
            lowest[s] = p
    return lowest


@njit(cache=True)
def _check_batch(nseq, positions, bseqs):
    if positions.shape[0] != bseqs.shape[0]:
        return _E_LEN_SEQ
    for i in range(positions.shape[0]):
        p = positions[i]
        if p < 0 or p > POS_MAX:
            return _E_POS
        s = bseqs[i]
        if s < 0 or s >= nseq:
            return _E_SEQ
    return 0


@njit(cache=True)
def _prune_window(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, positions, bseqs, memory):
    """Ollama's updateSlidingWindow eviction. Returns (code, undo records [k, 4] of
    (cell, seq, pos, shift) for every sequence bit dropped, in drop order)."""
    nseq = sidx.shape[1]
    undo = np.empty((16, 4), np.int64)
    code = _check_batch(nseq, positions, bseqs)
    if code != 0:
        return code, undo[:0]
    lowest = _lowest_positions(sidx, positions, bseqs)
    bshift = meta[_M_BSHIFT]
    k = 0
    dirty = np.empty(16, np.int64)     # occupancy words that changed (refreshed once each)
    nd = 0
    for s in range(nseq):
        if sidx[3, s] < 0:
            continue
        low = lowest[s] if lowest[s] >= 0 else sidx[3, s] + 1   # idle: last stored pos + 1
        t = low - memory
        if sidx[2, s] >= t:
            continue
        w = s >> 6
        bit = _bit(s)
        edge = False
        while True:
            blk = _st_first_leaf_min_lt(stree, s, t)
            if blk < 0:
                break
            lo = blk << bshift
            hi = min(lo + (1 << bshift), cpos.shape[0])
            mn = _EMPTY_MIN
            mx = -1
            for c in range(lo, hi):
                if (cseqs[c, w] & bit) == 0:
                    continue
                p = cpos[c]
                if p < t:
                    if k == undo.shape[0]:
                        grown = np.empty((2 * k, 4), np.int64)
                        grown[:k] = undo
                        undo = grown
                    undo[k, 0] = c
                    undo[k, 1] = s
                    undo[k, 2] = p
                    undo[k, 3] = cshift[c]
                    k += 1
                    if c == sidx[0, s] or c == sidx[1, s]:
                        edge = True
                    if _drop_seq(cpos, cshift, cseqs, occ, meta, c, s):
                        if nd == dirty.shape[0]:
                            grown_d = np.empty(2 * nd, np.int64)
                            grown_d[:nd] = dirty
                            dirty = grown_d
                        dirty[nd] = c >> 6
                        nd += 1
                else:
                    if p < mn:
                        mn = p
                    if p > mx:
                        mx = p
            _st_set_leaf(stree, s, blk, mn, mx)
        if stree[1, 1, s] < 0 or edge:
            _sidx_refresh(sidx, stree, cpos, cseqs, s, bshift)
        else:
            sidx[2, s] = stree[0, 1, s]
            sidx[3, s] = stree[1, 1, s]
    if nd > 0:
        dw = np.sort(dirty[:nd])
        for i in range(nd):
            if i == 0 or dw[i] != dw[i - 1]:
                _ft_point(ftree, occ, dw[i])
    return 0, undo[:k]


@njit(cache=True)
def _undo_prune(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, undo):
    n = cpos.shape[0]
    nseq = sidx.shape[1]
    for r in range(undo.shape[0]):
        c = undo[r, 0]
        s = undo[r, 1]
        if c < 0 or c >= n or s < 0 or s >= nseq or undo[r, 2] < 0 or undo[r, 2] > POS_MAX \
                or undo[r, 3] < -(2**31) or undo[r, 3] > 2**31 - 1:
            return _E_SLOT_RANGE
        if _has(cseqs, c, s):
            return _E_SLOT_USED
    bshift = meta[_M_BSHIFT]
    run_s = np.int64(-1)        # one tree walk per run of one sequence in one block (see
    run_blk = np.int64(-1)      # _apply_batch)
    mn = np.int64(0)
    mx = np.int64(0)
    for r in range(undo.shape[0] - 1, -1, -1):
        c = undo[r, 0]
        s = undo[r, 1]
        p = undo[r, 2]
        if not _used(cseqs, c):
            cpos[c] = p
            _set_shift(cshift, meta, c, undo[r, 3])
            _occ_set(occ, c)
            meta[_M_USED] += 1
            _ft_point(ftree, occ, c >> 6)
        cseqs[c, s >> 6] |= _bit(s)
        _sidx_add(sidx, s, c, cpos[c])
        run_s, run_blk, mn, mx = _st_run(stree, run_s, run_blk, mn, mx, np.int64(s),
                                         np.int64(c) >> bshift, np.int64(cpos[c]))
    if run_s >= 0:
        _st_widen(stree, run_s, run_blk, mn, mx)
    return 0


@njit(cache=True)
def _batch_range(cpos, cseqs, stree, sidx, meta, positions, bseqs, window):
    """(code, lo, hi): the cells the batch's sequences may attend to, half-open."""
    nseq = sidx.shape[1]
    code = _check_batch(nseq, positions, bseqs)
    if code != 0:
        return code, 0, 0
    lowest = _lowest_positions(sidx, positions, bseqs)
    bshift = meta[_M_BSHIFT]
    lo = cpos.shape[0]
    hi = -1
    for i in range(bseqs.shape[0]):
        s = bseqs[i]
        if lowest[s] < 0:          # sequence already handled
            continue
        low = lowest[s]
        lowest[s] = -1
        if sidx[3, s] < 0:
            continue
        cmin = sidx[0, s]
        cmax = sidx[1, s]
        if window < 0:
            lo = min(lo, cmin)
            hi = max(hi, cmax)
            continue
        t = low - window
        if sidx[3, s] < t:
            continue
        # a sequence whose cells lie inside [lo, hi] already cannot widen it
        if cmin < lo:
            first = cmin if cpos[cmin] >= t else _first_cell_ge(cpos, cseqs, stree, s, t, bshift)
            lo = min(lo, first)
        if cmax > hi:
            last = cmax if cpos[cmax] >= t else _last_cell_ge(cpos, cseqs, stree, s, t, bshift)
            hi = max(hi, last)
    if hi < 0:
        return 0, 0, 0
    return 0, lo, hi + 1


@njit(cache=True)
def _place_contiguous(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, positions, bseqs,
                      window):
    """start_forward's placement in one call: the attended range, Ollama's first fit, and
    applying the batch there. Returns (code, lo, hi, start, head before); start -1 (nothing
    applied) when no run of free cells is long enough."""
    code, lo, hi = _batch_range(cpos, cseqs, stree, sidx, meta, positions, bseqs, window)
    head = meta[_M_HEAD]
    b = positions.shape[0]
    if code != 0:
        return code, lo, hi, -1, head
    start = _ft_first_fit(ftree, occ, b) if b <= cpos.shape[0] else -1
    if start < 0:
        return 0, lo, hi, -1, head
    slots = np.arange(start, start + b).astype(np.int32)
    code = _apply_batch(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, slots, positions,
                        bseqs)
    return code, lo, hi, (start if code == 0 else -1), head


@njit(cache=True)
def _group_by_seq(seqs, max_seqs):
    """A batch's tokens grouped by sequence (``seqs`` int32 ``[batch]``, each in ``[0,
    max_seqs)``): ``(seq_ids, qo_indptr, token_order, consecutive)`` -- the distinct sequences in
    order of first appearance (int32 ``[n_b]``), CSR offsets (int32 ``[n_b + 1]``), batch
    indices grouped by sequence, each group in batch order (int32 ``[batch]``), and whether
    ``seq_ids`` are consecutive ascending. ``streams.group_batch``'s result, in one pass."""
    batch = seqs.shape[0]
    rank = np.full(max_seqs, -1, np.int32)
    ids = np.empty(batch, np.int32)
    counts = np.zeros(batch, np.int32)
    group = np.empty(batch, np.int32)
    nb = 0
    for i in range(batch):
        s = seqs[i]
        r = rank[s]
        if r < 0:
            r = nb
            rank[s] = r
            ids[nb] = s
            nb += 1
        group[i] = r
        counts[r] += 1
    indptr = np.zeros(nb + 1, np.int32)
    for r in range(nb):
        indptr[r + 1] = indptr[r] + counts[r]
    fill = indptr[:nb].copy()
    order = np.empty(batch, np.int32)
    for i in range(batch):
        r = group[i]
        order[fill[r]] = i
        fill[r] += 1
    consecutive = True
    for r in range(1, nb):
        if ids[r] != ids[r - 1] + 1:
            consecutive = False
    return ids[:nb].copy(), indptr, order, consecutive


@njit(cache=True)
def _take_back_stacked(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, seq_ids, qo_indptr,
                       local, out, records, pruned_at, placed):
    """Undo ``_place_stacked``'s first ``placed`` groups, newest first: each group's cells
    freed (head put back), then its window pruning put back (``CausalCache._undo``'s order)."""
    for c in range(placed - 1, -1, -1):
        t = seq_ids[c]
        _unapply_batch(cpos[t], cshift[t], cseqs[t], occ[t], ftree[t], stree[t], sidx[t],
                       meta[t], local[qo_indptr[c]:qo_indptr[c + 1]], out[c, 3])
        if pruned_at[c + 1] > pruned_at[c]:
            _undo_prune(cpos[t], cshift[t], cseqs[t], occ[t], ftree[t], stree[t], sidx[t],
                        meta[t], records[pruned_at[c]:pruned_at[c + 1]])


@njit(cache=True)
def _place_stacked(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, seq_ids, qo_indptr,
                   token_order, positions, memory, window, pad, grouped, local, pool, out,
                   pruned_at):
    """:meth:`CellTableStack.place`: each table ``seq_ids[b]`` of the stack (arrays ``[table,
    ...]``) takes its group of the batch as sequence 0, as ``CausalCache._place`` does on that
    table alone: ``_batch_conflict`` for every group first, then per group the window pruning
    (``memory >= 0``) and ``_place_contiguous`` (range ``window``). A repeated or stored
    position, or a group without a free run long enough (a defrag or a full table), returns
    ``(1, b, records)`` with every table as it was (groups already placed taken back). Else
    ``(0, largest hi, records)``, and per group ``b``: ``out[b] = (start, lo, hi, head
    before, pending shifts)`` (``lo``/``hi`` padded to ``pad`` as ``CausalCache._place`` pads
    them), its pruning's undo records ``records[pruned_at[b]:pruned_at[b + 1]]`` (int64
    ``[k, 4]``), ``grouped`` the positions in group order, ``local`` each token's cell in its
    table (group order) and ``pool`` ``table * n_cells + cell`` (batch order)."""
    nb = seq_ids.shape[0]
    n_cells = cpos.shape[1]
    zeros = np.zeros(positions.shape[0], np.int32)
    records = np.empty((0, 4), np.int64)
    pruned_at[0] = 0
    for i in range(positions.shape[0]):
        grouped[i] = positions[token_order[i]]
    for b in range(nb):
        s = seq_ids[b]
        a0 = qo_indptr[b]
        a1 = qo_indptr[b + 1]
        if a1 - a0 > n_cells:
            return 1, b, records
        # without pruning the room is known now (with it, after the group's pruning)
        if memory < 0 and _ft_first_fit(ftree[s], occ[s], a1 - a0) < 0:
            return 1, b, records
        if _batch_conflict(cpos[s], cseqs[s], stree[s], sidx[s], meta[s], grouped[a0:a1],
                           zeros[a0:a1]) >= 0:
            return 1, b, records
    top = 0
    for b in range(nb):
        s = seq_ids[b]
        a0 = qo_indptr[b]
        a1 = qo_indptr[b + 1]
        n = a1 - a0
        pruned_at[b + 1] = pruned_at[b]
        if memory >= 0:
            code, rec = _prune_window(cpos[s], cshift[s], cseqs[s], occ[s], ftree[s], stree[s],
                                      sidx[s], meta[s], grouped[a0:a1], zeros[a0:a1], memory)
            if code != 0:          # checked input: not expected
                _take_back_stacked(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta,
                                   seq_ids, qo_indptr, local, out, records, pruned_at, b)
                return 1, b, records
            k = rec.shape[0]
            if k:
                grown = np.empty((pruned_at[b] + k, 4), np.int64)
                grown[:pruned_at[b]] = records[:pruned_at[b]]
                grown[pruned_at[b]:] = rec
                records = grown
                pruned_at[b + 1] = pruned_at[b] + k
        code, lo, hi, start, head = _place_contiguous(
            cpos[s], cshift[s], cseqs[s], occ[s], ftree[s], stree[s], sidx[s], meta[s],
            grouped[a0:a1], zeros[a0:a1], window)
        if code != 0 or start < 0:
            # no room after all (a defrag's case) or, not expected, bad input: this group's
            # pruning, then the earlier groups, taken back
            if pruned_at[b + 1] > pruned_at[b]:
                _undo_prune(cpos[s], cshift[s], cseqs[s], occ[s], ftree[s], stree[s], sidx[s],
                            meta[s], records[pruned_at[b]:pruned_at[b + 1]])
            _take_back_stacked(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, seq_ids,
                               qo_indptr, local, out, records, pruned_at, b)
            return 1, b, records
        if lo >= hi:
            lo, hi = start, start + n
        lo = min(lo, start)
        hi = max(hi, start + n)
        lo = (lo // pad) * pad
        hi = min(-(-hi // pad) * pad, n_cells)
        out[b, 0] = start
        out[b, 1] = lo
        out[b, 2] = hi
        out[b, 3] = head
        out[b, 4] = meta[s, _M_NSHIFT]
        top = max(top, hi)
        for j in range(n):
            local[a0 + j] = start + j
            pool[token_order[a0 + j]] = s * n_cells + start + j
    return 0, top, records


# --------------------------------------------------------------------------------------------
# paged placement (CacheConfig(page_size=P)): each sequence's tokens, in position order, fill
# pages of P cells (page k = cells [k*P, (k+1)*P)); FlashMLA / FlashInfer / vLLM block tables
# --------------------------------------------------------------------------------------------

@njit(cache=True)
def _range_free(occ, lo, hi):
    """Whether cells ``lo .. hi - 1`` (``lo < hi``) are all free: the bitmap words they span
    only (``_next_used`` would run on through a free region to its end)."""
    w0 = lo >> 6
    w1 = (hi - 1) >> 6
    for w in range(w0, w1 + 1):
        x = occ[w]
        if w == w0:
            x &= _ALL << np.uint64(lo & 63)
        if w == w1 and (hi & 63) != 0:
            x &= (_ONE << np.uint64(hi & 63)) - _ONE
        if x != 0:
            return False
    return True


@njit(cache=True)
def _free_page(occ, n, page, from_page):
    """The first page >= ``from_page`` whose ``page`` cells are all free, or -1. O(pages
    skipped * words per page): a page with a used cell costs about one bitmap word read."""
    n_pages = n // page
    for p in range(from_page, n_pages):
        if _range_free(occ, p * page, p * page + page):
            return p
    return -1


@njit(cache=True)
def _count_free_pages(occ, n, page):
    k = 0
    p = _free_page(occ, n, page, 0)
    while p >= 0:
        k += 1
        p = _free_page(occ, n, page, p + 1)
    return k


@njit(cache=True)
def _append_after(cpos, cseqs, stree, sidx, meta, positions, bseqs):
    """Per sequence (int64 ``[max_seqs]``): the cell of its highest position when the batch
    gives it tokens that all come after the positions it holds (its tokens go on from there),
    else -1 (not in the batch, holds nothing, or goes below what it holds). O(batch) plus one
    O(log n + block) search per appending sequence whose last cell is not its highest-numbered
    cell (usually it is: pages open in increasing order)."""
    nseq = sidx.shape[1]
    lowest = np.full(nseq, -1, np.int64)
    for i in range(positions.shape[0]):
        s = bseqs[i]
        p = np.int64(positions[i])
        if lowest[s] < 0 or p < lowest[s]:
            lowest[s] = p
    bshift = meta[_M_BSHIFT]
    for s in range(nseq):
        low = lowest[s]
        if low < 0:
            continue
        top = sidx[3, s]
        lowest[s] = -1
        if top < 0 or low <= top:
            continue
        c = sidx[1, s]
        if cpos[c] != top:
            c = _last_cell_ge(cpos, cseqs, stree, s, top, bshift)
        lowest[s] = c
    return lowest


@njit(cache=True)
def _find_paged(occ, ftree, n_cells, positions, bseqs, page, after):
    """Cells (int32 ``[batch]``) for a batch under paged placement, or (empty, False) when the
    pages it needs are not free; nothing is changed (the bitmap bits claimed while planning
    are cleared again). Per sequence of the batch (ascending id), its tokens in position
    order: when it appends (``after[s]``, see :func:`_append_after`) the first goes to the slot
    after that cell if the slot is free and on the same page, then on up that page; each time
    a page is full (or the sequence holds nothing, or the slot is taken), the first wholly free
    page is opened. Tokens that go below positions the sequence holds start a fresh page (its
    page rule is then broken; page tables say so). O(batch log batch + pages skipped)."""
    b = positions.shape[0]
    slots = np.empty(b, np.int32)
    if b == 0:
        return slots, True
    key = np.empty(b, np.int64)
    sorted_ = True
    for i in range(b):
        key[i] = (np.int64(bseqs[i]) << 32) | np.int64(positions[i])
        if i > 0 and key[i] < key[i - 1]:
            sorted_ = False
    order = np.arange(b) if sorted_ else np.argsort(key, kind="mergesort")
    # a free page needs a free run of `page`: none anywhere, no page (the tree is current)
    no_page = ftree[2, 1] < page
    next_page = 0          # pages below it were found not free during this plan
    ok = True
    done = 0
    i = 0
    while i < b and ok:
        s = bseqs[order[i]]
        j = i
        while j < b and bseqs[order[j]] == s:
            j += 1
        cursor = np.int64(-1)
        last = after[s]
        if last >= 0:
            nxt = last + 1
            if nxt % page != 0 and not _occ_test(occ, nxt):
                cursor = nxt
        for t in range(i, j):
            if cursor < 0 or cursor % page == 0 or _occ_test(occ, cursor):
                pg = -1 if no_page else _free_page(occ, n_cells, page, next_page)
                if pg < 0:
                    ok = False
                    break
                next_page = pg + 1
                cursor = np.int64(pg) * page
            slots[order[t]] = cursor
            _occ_set(occ, cursor)
            done += 1
            cursor += 1
        i = j
    # give the claimed bits back (tokens are planned in sorted order): planning changes nothing
    for t in range(done):
        _occ_clear(occ, slots[order[t]])
    if not ok:
        return slots[:0], False
    return slots, True


@njit(cache=True)
def _shared_tails(cpos, cseqs, occ, page, after):
    """Copy-on-write under paged placement: the batch's appending sequences (``after``, see
    :func:`_append_after`) whose partly filled last page has its next slot taken -- by another
    sequence already, or by one earlier in this batch (ascending id, :func:`_find_paged`'s
    order) that appends after the same cell: two sequences sharing a page through ``seq_cp``
    that both go on. Returns int64 ``[k, 3]`` rows (seq, first cell, cells): the sequence's
    cells on that page, slots ``0 .. cells - 1`` of it, every one shared, which it needs its
    own copies of before its tokens can follow them. O(max_seqs) plus O(page) per sharer;
    changes nothing."""
    out = np.empty((0, 3), np.int64)
    claimed = np.empty(0, np.int64)     # next slots the sequences before took (bits set)
    n = cpos.shape[0]
    for s in range(after.shape[0]):
        last = after[s]
        if last < 0:
            continue
        off = last % page
        nxt = last + 1
        if off == page - 1 or nxt >= n or _has(cseqs, nxt, s):
            continue
        if not _occ_test(occ, nxt):
            if not _has_others(cseqs, last, s):
                continue                # its own last cell: nobody else appends after it
            _occ_set(occ, nxt)          # this sequence writes it; a later sharer copies
            grown_c = np.empty(claimed.shape[0] + 1, np.int64)
            grown_c[:claimed.shape[0]] = claimed
            grown_c[claimed.shape[0]] = nxt
            claimed = grown_c
            continue
        first = last - off
        # the tail page holds the sequence in slots 0 .. off, every cell shared (leaving them
        # frees none); any other layout has broken the page rule already: nothing to save
        mine = _has_others(cseqs, last, s)
        for c in range(first, last):
            if not mine:
                break
            if not _has(cseqs, c, s) or cpos[c] >= cpos[c + 1] or not _has_others(cseqs, c, s):
                mine = False
        if not mine:
            continue
        grown = np.empty((out.shape[0] + 1, 3), np.int64)
        grown[:out.shape[0]] = out
        grown[out.shape[0], 0] = s
        grown[out.shape[0], 1] = first
        grown[out.shape[0], 2] = off + 1
        out = grown
    for k in range(claimed.shape[0]):
        _occ_clear(occ, claimed[k])
    return out


@njit(cache=True)
def _place_paged(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, positions, bseqs, window,
                 page, cow):
    """start_forward's paged placement in one call: the attended range, then (``cow``) the
    sequences that need copy-on-write first (:func:`_shared_tails`; when there are any,
    nothing is placed and they are returned), :func:`_find_paged` and applying the batch.
    Returns (code, lo, hi, slots, head before, tails, contiguous); slots empty (nothing
    applied) when the pages are not free or copies are needed; ``contiguous``: the slots are
    one ascending run."""
    code, lo, hi = _batch_range(cpos, cseqs, stree, sidx, meta, positions, bseqs, window)
    head = meta[_M_HEAD]
    none = np.empty(0, np.int32)
    tails = np.empty((0, 3), np.int64)
    if code != 0:
        return code, lo, hi, none, head, tails, False
    after = _append_after(cpos, cseqs, stree, sidx, meta, positions, bseqs)
    if cow:
        tails = _shared_tails(cpos, cseqs, occ, page, after)
        if tails.shape[0] > 0:
            return 0, lo, hi, none, head, tails, False
    slots, ok = _find_paged(occ, ftree, cpos.shape[0], positions, bseqs, page, after)
    if not ok:
        return 0, lo, hi, none, head, tails, False
    code = _apply_batch(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, slots, positions,
                        bseqs)
    if code != 0:
        return code, lo, hi, none, head, tails, False
    run = True
    for i in range(1, slots.shape[0]):
        if slots[i] != slots[i - 1] + 1:
            run = False
            break
    return 0, lo, hi, slots, head, tails, run


@njit(cache=True)
def _fill_hole_runs(moves, m, srcbuf, nh, hole, unit):
    """Append to the plan ``moves [>= m, 3]`` (src, dst, length; grown when full) the moves that
    fill the hole run starting at ``hole`` with the sources ``srcbuf[:nh]`` (descending: the
    lowest source, ``srcbuf[nh - 1]``, goes to ``hole``), adjacent sources merged into one
    move. Units are ``unit`` cells (1 for cells, the page size for pages). Returns
    ``(moves, m)``."""
    k = nh - 1
    dst = hole
    while k >= 0:
        src = srcbuf[k]
        length = 1
        while k - length >= 0 and srcbuf[k - length] == src + length:
            length += 1
        if m == moves.shape[0]:
            grown = np.empty((2 * m, 3), np.int64)
            grown[:m] = moves
            moves = grown
        moves[m, 0] = src * unit
        moves[m, 1] = dst * unit
        moves[m, 2] = length * unit
        m += 1
        dst += length
        k -= length
    return moves, m


@njit(cache=True)
def _move_cell_meta(cpos, cshift, cseqs, a, b):
    """Cell ``a``'s position, shift and sequence bits to cell ``b``; ``a`` left free. The indexes
    (occupancy, trees) are the caller's to rebuild."""
    cpos[b] = cpos[a]
    cshift[b] = cshift[a]
    for w in range(cseqs.shape[1]):
        cseqs[b, w] = cseqs[a, w]
        cseqs[a, w] = 0
    cpos[a] = -1
    cshift[a] = 0


@njit(cache=True)
def _plan_defrag_pages(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, page):
    """Paged defrag: moves (src, dst, length) of whole pages that make the pages holding a used
    cell the first ones, applied to the metadata. Each hole page below the used-page count is
    filled with the last not-yet-moved used page (lowest first, as :func:`_plan_defrag`), so
    sources all lie at or past the used-page count and destinations below it (any copy order
    works) and every cell keeps its slot in its page: a sequence's page rule survives, its
    pages renumbered. Adjacent page moves are merged."""
    n = cpos.shape[0]
    n_pages = n // page
    used_pages = 0
    for p in range(n_pages):
        if not _range_free(occ, p * page, p * page + page):
            used_pages += 1
    moves = np.empty((16, 3), np.int64)
    m = 0
    top = n_pages - 1
    srcbuf = np.empty(16, np.int64)
    p = 0
    while p < used_pages:
        if not _range_free(occ, p * page, p * page + page):
            p += 1
            continue
        h1 = p          # a run of hole pages [p, h1) below used_pages
        while h1 < used_pages and _range_free(occ, h1 * page, h1 * page + page):
            h1 += 1
        nh = h1 - p
        if srcbuf.shape[0] < nh:
            srcbuf = np.empty(2 * nh, np.int64)
        for k in range(nh):     # the last nh used pages not yet moved, descending
            while _range_free(occ, top * page, top * page + page):
                top -= 1
            srcbuf[k] = top
            top -= 1
        moves, m = _fill_hole_runs(moves, m, srcbuf, nh, p, page)
        p = h1
    # apply to the metadata (sources are free pages afterwards), then rebuild the indexes
    for r in range(m):
        for j in range(moves[r, 2]):
            _move_cell_meta(cpos, cshift, cseqs, moves[r, 0] + j, moves[r, 1] + j)
    if m > 0:
        _rebuild_all(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta)
    upto = used_pages * page
    meta[_M_HEAD] = upto if upto < n else 0
    return moves[:m]


# --------------------------------------------------------------------------------------------
# sequence operations: each walks only the stree leaf blocks whose position range meets the
# operation's range, so its cost is O(log n + cells touched) however long the cache is
# --------------------------------------------------------------------------------------------

@njit(cache=True)
def _st_blocks(stree, s, p0, p1):
    """The leaf blocks (ascending, int64) that may hold a cell of s with p0 <= pos < p1 (their
    min < p1 and max >= p0): O(log n) per block returned, no scan of the table."""
    nl = stree.shape[1] >> 1
    out = np.empty(16, np.int64)
    m = 0
    if stree[1, 1, s] < p0 or stree[0, 1, s] >= p1:
        return out[:0]
    stack = np.empty(128, np.int64)
    stack[0] = 1
    sp = 1
    while sp > 0:
        sp -= 1
        k = stack[sp]
        if k >= nl:
            if m == out.shape[0]:
                grown = np.empty(2 * m, np.int64)
                grown[:m] = out
                out = grown
            out[m] = k - nl
            m += 1
            continue
        r = 2 * k + 1
        if stree[1, r, s] >= p0 and stree[0, r, s] < p1:     # right first: left pops first
            stack[sp] = r
            sp += 1
        if stree[1, r - 1, s] >= p0 and stree[0, r - 1, s] < p1:
            stack[sp] = r - 1
            sp += 1
    return out[:m]


@njit(cache=True)
def _st_refresh_blocks(stree, cpos, cseqs, s, blocks, bshift):
    """Recompute s's leaves for ``blocks`` from the cells, and their paths to the root."""
    nl = stree.shape[1] >> 1
    for i in range(blocks.shape[0]):
        blk = blocks[i]
        _st_leaf_from_cells(stree, cpos, cseqs, s, blk, bshift)
        k = nl + blk
        _st_set_leaf(stree, s, blk, stree[0, k, s], stree[1, k, s])


@njit(cache=True)
def _ft_blocks(ftree, occ, blocks, bshift):
    """Occupancy of the cells of ``blocks`` changed: refresh the free-run tree over their words."""
    last = -1
    n_words = occ.shape[0]
    for i in range(blocks.shape[0]):
        w0 = (blocks[i] << bshift) >> 6
        w1 = (((blocks[i] + 1) << bshift) - 1) >> 6
        for w in range(max(w0, last + 1), min(w1, n_words - 1) + 1):
            _ft_point(ftree, occ, w)
            last = w


@njit(cache=True)
def _block_cells(blk, bshift, n):
    lo = blk << bshift
    return lo, min(lo + (1 << bshift), n)


@njit(cache=True)
def _any_in_range(cpos, cseqs, stree, meta, s, p0, p1, others):
    """Whether s holds a cell with p0 <= pos < p1 (``others``: one shared with another
    sequence)."""
    bshift = meta[_M_BSHIFT]
    blocks = _st_blocks(stree, s, p0, p1)
    n = cpos.shape[0]
    for i in range(blocks.shape[0]):
        lo, hi = _block_cells(blocks[i], bshift, n)
        for c in range(lo, hi):
            if _has(cseqs, c, s):
                p = cpos[c]
                if p >= p0 and p < p1 and (not others or _has_others(cseqs, c, s)):
                    return True
    return False


@njit(cache=True)
def _shared_in_range(cpos, cseqs, stree, sidx, meta, s, p0, p1):
    """Whether a cell of s with p0 <= pos < p1 is shared with another sequence."""
    if sidx[3, s] < 0 or sidx[3, s] < p0 or sidx[2, s] >= p1:
        return False
    return _any_in_range(cpos, cseqs, stree, meta, s, p0, p1, True)


@njit(cache=True)
def _batch_conflict(cpos, cseqs, stree, sidx, meta, positions, bseqs):
    """Index of the first batch token whose (sequence, position) repeats an earlier token of the
    batch or one its sequence still holds; -1 when none (llama.cpp's batch validation)."""
    b = positions.shape[0]
    if b > 1:
        keys = np.empty(b, np.int64)
        for i in range(b):
            keys[i] = (np.int64(bseqs[i]) << 32) | np.int64(positions[i])
        order = np.argsort(keys, kind="mergesort")
        for j in range(1, b):
            if keys[order[j]] == keys[order[j - 1]]:
                return max(order[j], order[j - 1])
    for i in range(b):
        s = bseqs[i]
        p = np.int64(positions[i])
        if sidx[3, s] < p or sidx[2, s] > p:     # the decode case: past the sequence's end
            continue
        if _any_in_range(cpos, cseqs, stree, meta, s, p, p + 1, False):
            return i
    return -1


@njit(cache=True)
def _remove(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, s, begin, end):
    """Ollama's Remove; end < 0 means no end. Returns (code, cells whose pos moved)."""
    moved = np.empty(0, np.int32)
    if sidx[3, s] < 0 or sidx[3, s] < begin:
        return 0, moved
    has_end = end >= 0
    d = end - begin if has_end else 0
    if has_end and d == 0:
        return 0, moved
    if d > 0 and _shared_in_range(cpos, cseqs, stree, sidx, meta, s, end, _INF):
        return _E_SHARED, moved
    bshift = meta[_M_BSHIFT]
    n = cpos.shape[0]
    blocks = _st_blocks(stree, s, begin, _INF)
    moved = np.empty(blocks.shape[0] << bshift, np.int32)
    k = 0
    freed = False
    for i in range(blocks.shape[0]):
        lo, hi = _block_cells(blocks[i], bshift, n)
        for c in range(lo, hi):
            if not _has(cseqs, c, s):
                continue
            p = cpos[c]
            if p >= begin and (not has_end or p < end):
                freed |= _drop_seq(cpos, cshift, cseqs, occ, meta, c, s)
            elif d > 0 and p >= end:
                cpos[c] = p - d
                _set_shift(cshift, meta, c, cshift[c] - d)
                moved[k] = c
                k += 1
    if freed:
        _ft_blocks(ftree, occ, blocks, bshift)
    _st_refresh_blocks(stree, cpos, cseqs, s, blocks, bshift)
    _sidx_refresh(sidx, stree, cpos, cseqs, s, bshift)
    return 0, moved[:k].copy()


@njit(cache=True)
def _check_shift_range(cpos, cshift, cseqs, stree, meta, s, p0, p1, delta, d):
    """Before seq_add (d = 1) / seq_div (delta = 0): refuse shared cells and positions or
    pending shifts that would overflow int32."""
    bshift = meta[_M_BSHIFT]
    blocks = _st_blocks(stree, s, p0, p1)
    n = cpos.shape[0]
    for i in range(blocks.shape[0]):
        lo, hi = _block_cells(blocks[i], bshift, n)
        for c in range(lo, hi):
            if not _has(cseqs, c, s):
                continue
            p = cpos[c]
            if p < p0 or p >= p1:
                continue
            q = p // d + delta
            if _has_others(cseqs, c, s) and q != p:
                return _E_SHARED    # a shared cell whose position stays (seq_div of 0) may stay
            if q > POS_MAX:
                return _E_OVERFLOW
            if q >= 0:
                sh = np.int64(cshift[c]) + (q - p)
                if sh > 2**31 - 1 or sh < -(2**31):
                    return _E_SHIFT_OVERFLOW
    return 0


@njit(cache=True)
def _seq_add(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, s, p0, p1, delta):
    code = _check_shift_range(cpos, cshift, cseqs, stree, meta, s, p0, p1, delta, 1)
    if code != 0:
        return code
    if sidx[3, s] < 0:
        meta[_M_HEAD] = 0
        return 0
    n = cpos.shape[0]
    bshift = meta[_M_BSHIFT]
    blocks = _st_blocks(stree, s, p0, p1)
    new_head = n
    for i in range(blocks.shape[0]):
        lo, hi = _block_cells(blocks[i], bshift, n)
        for c in range(lo, hi):
            if not _has(cseqs, c, s):
                continue
            p = cpos[c]
            if p < p0 or p >= p1:
                continue
            if p + delta < 0:
                # llama.cpp: a cell shifted before position 0 is dropped
                cseqs[c, s >> 6] &= ~_bit(s)
                _free_cell(cpos, cshift, cseqs, occ, meta, c)
                if new_head == n:
                    new_head = c
            else:
                cpos[c] = p + delta
                _set_shift(cshift, meta, c, cshift[c] + delta)
    if new_head != n:
        _ft_blocks(ftree, occ, blocks, bshift)
    meta[_M_HEAD] = new_head if new_head != n else 0
    _st_refresh_blocks(stree, cpos, cseqs, s, blocks, bshift)
    _sidx_refresh(sidx, stree, cpos, cseqs, s, bshift)
    return 0


@njit(cache=True)
def _seq_div(cpos, cshift, cseqs, stree, sidx, meta, s, p0, p1, d):
    code = _check_shift_range(cpos, cshift, cseqs, stree, meta, s, p0, p1, 0, d)
    if code != 0 or sidx[3, s] < 0:
        return code
    n = cpos.shape[0]
    bshift = meta[_M_BSHIFT]
    blocks = _st_blocks(stree, s, p0, p1)
    for i in range(blocks.shape[0]):
        lo, hi = _block_cells(blocks[i], bshift, n)
        for c in range(lo, hi):
            if not _has(cseqs, c, s):
                continue
            p = cpos[c]
            if p < p0 or p >= p1:
                continue
            q = p // d
            cpos[c] = q
            _set_shift(cshift, meta, c, cshift[c] + (q - p))
    _st_refresh_blocks(stree, cpos, cseqs, s, blocks, bshift)
    _sidx_refresh(sidx, stree, cpos, cseqs, s, bshift)
    return 0


@njit(cache=True)
def _seq_rm(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, s, p0, p1):
    """llama.cpp seq_rm; s = -1 frees every cell with p0 <= pos < p1 (the one form that scans)."""
    n = cpos.shape[0]
    new_head = n
    if s >= 0:
        bshift = meta[_M_BSHIFT]
        blocks = _st_blocks(stree, s, p0, p1)
        if blocks.shape[0] == 0:
            return
        w = s >> 6
        bit = _bit(s)
        for i in range(blocks.shape[0]):
            lo, hi = _block_cells(blocks[i], bshift, n)
            for c in range(lo, hi):
                if cseqs[c, w] & bit:
                    p = cpos[c]
                    if p >= p0 and p < p1:
                        # _drop_seq written out: a call per cell (its array arguments'
                        # reference counts) cost ~50 ns, 20x the work, when the cell stays
                        # shared (a retained prefix's sequence leaving its cells)
                        cseqs[c, w] &= ~bit
                        if not _used(cseqs, c):
                            _free_cell(cpos, cshift, cseqs, occ, meta, c)
                            if new_head == n:
                                new_head = c
        if new_head != n:
            _ft_blocks(ftree, occ, blocks, bshift)
        _st_refresh_blocks(stree, cpos, cseqs, s, blocks, bshift)
        _sidx_refresh(sidx, stree, cpos, cseqs, s, bshift)
    else:
        # free cells have pos -1 < p0: one pass over the positions finds the used ones
        for c in range(n):
            p = cpos[c]
            if p >= p0 and p < p1:
                for w in range(cseqs.shape[1]):
                    cseqs[c, w] = 0
                _free_cell(cpos, cshift, cseqs, occ, meta, c)
                if new_head == n:
                    new_head = c
        if new_head != n:
            _rebuild_all(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta)
    if new_head != n and new_head < meta[_M_HEAD]:
        meta[_M_HEAD] = new_head


@njit(cache=True)
def _join_seq(cpos, cseqs, stree, sidx, meta, src, dst, p0, p1, blocks):
    """dst joins src's cells with p0 <= pos < p1 in ``blocks`` (src's blocks for that range).

    The indexes of dst are widened once per block, not once per cell: the cells of a block
    that join are scanned for their (min, max) position and (first, last) cell, then the leaf
    is merged with that and its path refreshed (stopping at the first unchanged ancestor).
    Per cell, a tree update walked the whole path whenever the position was a new maximum --
    every cell of an ascending prefix, so a 4k-token copy_prefix cost O(4k log n)."""
    bshift = meta[_M_BSHIFT]
    n = cpos.shape[0]
    nl = stree.shape[1] >> 1
    w = dst >> 6
    bit = _bit(dst)
    sw = src >> 6
    sbit = _bit(src)
    for i in range(blocks.shape[0]):
        lo, hi = _block_cells(blocks[i], bshift, n)
        mn = _EMPTY_MIN
        mx = -1
        first = -1
        last = -1
        for c in range(lo, hi):
            x = cseqs[c, w]
            if (cseqs[c, sw] & sbit) != 0 and (x & bit) == 0:
                p = cpos[c]
                if p >= p0 and p < p1:
                    cseqs[c, w] = x | bit
                    if p < mn:
                        mn = p
                    if p > mx:
                        mx = p
                    if first < 0:
                        first = c
                    last = c
        if first < 0:
            continue
        k = nl + blocks[i]
        if stree[0, k, dst] < mn:
            mn = stree[0, k, dst]
        if stree[1, k, dst] > mx:
            mx = stree[1, k, dst]
        _st_set_leaf(stree, dst, blocks[i], mn, mx)
        # sidx's four fields are independent min / max: widening by (first, mn) and then by
        # (last, mx) gives the same row as one _sidx_add per joined cell
        _sidx_add(sidx, dst, first, mn)
        _sidx_add(sidx, dst, last, mx)


@njit(cache=True)
def _seq_cp(cpos, cseqs, stree, sidx, meta, src, dst, p0, p1):
    blocks = _st_blocks(stree, src, p0, p1)
    _join_seq(cpos, cseqs, stree, sidx, meta, src, dst, p0, p1, blocks)


@njit(cache=True)
def _copy_prefix(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, src, dst, length):
    """Ollama's CopyPrefix: dst loses every cell, then joins src's cells with pos < length."""
    bshift = meta[_M_BSHIFT]
    n = cpos.shape[0]
    dblocks = _st_blocks(stree, dst, 0, _INF)
    freed = False
    for i in range(dblocks.shape[0]):
        lo, hi = _block_cells(dblocks[i], bshift, n)
        for c in range(lo, hi):
            if _has(cseqs, c, dst):
                freed |= _drop_seq(cpos, cshift, cseqs, occ, meta, c, dst)
    if freed:
        _ft_blocks(ftree, occ, dblocks, bshift)
    _st_refresh_blocks(stree, cpos, cseqs, dst, dblocks, bshift)
    _sidx_refresh(sidx, stree, cpos, cseqs, dst, bshift)
    sblocks = _st_blocks(stree, src, 0, length)
    _join_seq(cpos, cseqs, stree, sidx, meta, src, dst, 0, length, sblocks)


@njit(cache=True)
def _seq_keep(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, s):
    n = cpos.shape[0]
    new_head = n
    sw = s >> 6
    bit = _bit(s)
    for c in range(n):
        if (cseqs[c, sw] & bit) != 0:
            for w in range(cseqs.shape[1]):
                cseqs[c, w] = 0
            cseqs[c, sw] = bit
        elif cpos[c] >= 0:
            for w in range(cseqs.shape[1]):
                cseqs[c, w] = 0
            _free_cell(cpos, cshift, cseqs, occ, meta, c)
            if new_head == n:
                new_head = c
    _rebuild_all(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta)
    if new_head != n and new_head < meta[_M_HEAD]:
        meta[_M_HEAD] = new_head


@njit(cache=True)
def _take_shifts(cshift, meta):
    k = meta[_M_NSHIFT]
    cells = np.empty(k, np.int32)
    deltas = np.empty(k, np.int32)
    if k == 0:
        return cells, deltas
    j = 0
    for c in range(meta[_M_SHLO], meta[_M_SHHI] + 1):
        if cshift[c] != 0:
            cells[j] = c
            deltas[j] = cshift[c]
            cshift[c] = 0
            j += 1
    meta[_M_NSHIFT] = 0
    meta[_M_SHLO] = cshift.shape[0]
    meta[_M_SHHI] = -1
    return cells[:j], deltas[:j]


@njit(cache=True)
def _restore_shifts(cshift, meta, cells, deltas):
    """Undo :func:`_take_shifts` (the rotation it fed failed)."""
    for i in range(cells.shape[0]):
        _set_shift(cshift, meta, cells[i], cshift[cells[i]] + deltas[i])


@njit(cache=True)
def _cells_of(cpos, cseqs, stree, meta, s):
    bshift = meta[_M_BSHIFT]
    n = cpos.shape[0]
    blocks = _st_blocks(stree, s, 0, _INF)
    out = np.empty(blocks.shape[0] << bshift, np.int32)
    k = 0
    for i in range(blocks.shape[0]):
        lo, hi = _block_cells(blocks[i], bshift, n)
        for c in range(lo, hi):
            if _has(cseqs, c, s):
                out[k] = c
                k += 1
    return out[:k].copy()


# --------------------------------------------------------------------------------------------
# undo log: an operation's journal holds the cells of the blocks it may touch as they were, and
# the (small) per-sequence index rows and scalars; putting them back costs O(cells journaled)
# --------------------------------------------------------------------------------------------

@njit(cache=True)
def _op_blocks(stree, s, p0, p1, s2, q0, q1):
    """The blocks an operation on (s, [p0, p1)) and (s2, [q0, q1)) may touch (s2 < 0: none)."""
    a = _st_blocks(stree, s, p0, p1)
    if s2 < 0:
        return a
    b = _st_blocks(stree, s2, q0, q1)
    # each side is already ascending and unique: merge only when both hold blocks (an edit
    # into an empty sequence, e.g. a prefix store's copy_prefix, skips the sort)
    if a.shape[0] == 0:
        return b
    if b.shape[0] == 0:
        return a
    return np.unique(np.concatenate((a, b)))


@njit(cache=True)
def _save_blocks(cpos, cshift, cseqs, meta, blocks):
    """Copies of (pos, shift, seqs) of every cell of ``blocks``, in block order."""
    bshift = meta[_M_BSHIFT]
    n = cpos.shape[0]
    k = 0
    for i in range(blocks.shape[0]):
        lo, hi = _block_cells(blocks[i], bshift, n)
        k += hi - lo
    pos = np.empty(k, np.int32)
    shift = np.empty(k, np.int32)
    seqs = np.empty((k, cseqs.shape[1]), np.uint64)
    j = 0
    for i in range(blocks.shape[0]):
        # whole-block slice copies: ~3x faster than a loop per cell and word, and the undo
        # record of every edit is made here (a prefix store's tier-0 hit is mostly this)
        lo, hi = _block_cells(blocks[i], bshift, n)
        m = hi - lo
        pos[j:j + m] = cpos[lo:hi]
        shift[j:j + m] = cshift[lo:hi]
        seqs[j:j + m] = cseqs[lo:hi]
        j += m
    return pos, shift, seqs


@njit(cache=True)
def _restore_blocks(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, blocks, pos, shift, seqs,
                    old_sidx, old_meta):
    """Put back what :func:`_save_blocks` saved, then the index rows and scalars."""
    bshift = old_meta[_M_BSHIFT]
    n = cpos.shape[0]
    words = cseqs.shape[1]
    aff = np.zeros(words, np.uint64)
    j = 0
    for i in range(blocks.shape[0]):
        lo, hi = _block_cells(blocks[i], bshift, n)
        for c in range(lo, hi):
            used = False
            for w in range(words):
                aff[w] |= cseqs[c, w] | seqs[j, w]
                cseqs[c, w] = seqs[j, w]
                used |= seqs[j, w] != 0
            cpos[c] = pos[j]
            cshift[c] = shift[j]
            if used:
                _occ_set(occ, c)
            else:
                _occ_clear(occ, c)
            j += 1
    _ft_blocks(ftree, occ, blocks, bshift)
    for w in range(words):
        x = aff[w]
        while x != 0:
            s = w * 64 + np.int64(trailing_zeros(x))
            x &= x - _ONE
            _st_refresh_blocks(stree, cpos, cseqs, s, blocks, bshift)
    sidx[...] = old_sidx
    meta[...] = old_meta


@njit(cache=True)
def _unjoin(cseqs, stree, meta, s):
    """Undo of a join (``copy_prefix`` / ``seq_cp``) into a sequence that held no cell: s leaves
    every cell it holds and its tree is emptied. No cell is freed (each joined cell is still
    held by the source) and no position, shift, occupancy or scalar changed with the join, so
    this and s's saved index row restore the table. O(log n) per block of s."""
    bshift = meta[_M_BSHIFT]
    n = cseqs.shape[0]
    w = s >> 6
    keep = ~_bit(s)
    blocks = _st_blocks(stree, s, 0, _INF)
    for i in range(blocks.shape[0]):
        lo, hi = _block_cells(blocks[i], bshift, n)
        for c in range(lo, hi):
            cseqs[c, w] &= keep
        _st_set_leaf(stree, s, blocks[i], _EMPTY_MIN, -1)


@njit(cache=True)
def _undo_defrag(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta, moves, head):
    """Move the metadata of a defrag plan back (the sources are free again after it ran, and K/V
    moves copy, so the source rows still hold their data) and rebuild the indexes (a defrag is
    O(n_cells) anyway)."""
    for r in range(moves.shape[0] - 1, -1, -1):
        for j in range(moves[r, 2]):
            _move_cell_meta(cpos, cshift, cseqs, moves[r, 1] + j, moves[r, 0] + j)
    _rebuild_all(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta)
    meta[_M_HEAD] = head


# --------------------------------------------------------------------------------------------
# defrag
# --------------------------------------------------------------------------------------------

@njit(cache=True)
def _plan_defrag(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta):
    """Moves (src, dst, length) that make the used cells 0..n_used-1, applied to the metadata.

    Each hole run in [0, n_used) is filled with the last not-yet-moved used cells of the table,
    placed in ascending order (the lowest of them first), as llama.cpp's defrag_prepare did; a
    move is a maximal run whose sources and destinations are both contiguous, so copying any
    move in any order carries every cell's K/V with its metadata (sources are all >= n_used,
    destinations all < n_used: no move reads what another writes)."""
    n = cpos.shape[0]
    used = meta[_M_USED]
    moves = np.empty((16, 3), np.int64)
    m = 0
    first_hole = _next_free(occ, 0, n)
    if first_hole >= used:
        return moves[:0]
    srcbuf = np.empty(64, np.int64)
    top = n - 1
    i0 = first_hole
    while i0 < used:
        i1 = min(_next_used(occ, i0, n), used)
        nh = i1 - i0
        if srcbuf.shape[0] < nh:
            srcbuf = np.empty(2 * nh, np.int64)
        for j in range(nh):
            top = _prev_used(occ, top)
            srcbuf[j] = top
            top -= 1
        moves, m = _fill_hole_runs(moves, m, srcbuf, nh, i0, 1)
        i0 = _next_free(occ, i1, n)
    # apply to the metadata; destination leaves only widen (their ancestors are recomputed
    # below, once, for every sequence)
    bshift = meta[_M_BSHIFT]
    nl = stree.shape[1] >> 1
    aff = np.zeros(cseqs.shape[1], np.uint64)
    for r in range(m):
        src = moves[r, 0]
        dst = moves[r, 1]
        for j in range(moves[r, 2]):
            a = src + j
            b = dst + j
            p = cpos[a]
            cpos[b] = p
            cshift[b] = cshift[a]
            for w in range(cseqs.shape[1]):
                x = cseqs[a, w]
                cseqs[b, w] = x
                cseqs[a, w] = 0
                aff[w] |= x
                k = nl + (b >> bshift)
                while x != 0:
                    s = w * 64 + np.int64(trailing_zeros(x))
                    x &= x - _ONE
                    if p < stree[0, k, s]:
                        stree[0, k, s] = p
                    if p > stree[1, k, s]:
                        stree[1, k, s] = p
            cpos[a] = -1
            cshift[a] = 0
    # used cells are now exactly [0, used)
    nw = occ.shape[0]
    for w in range(nw):
        lo = w * 64
        if lo + 64 <= used:
            occ[w] = _ALL
        elif lo >= used:
            occ[w] = 0
        else:
            occ[w] = (_ONE << np.uint64(used - lo)) - _ONE
    for c in range(n, nw * 64):
        occ[c >> 6] |= _bit(c)
    _ft_range(ftree, occ, 0, nw - 1)
    # no cell is left past `used`: blocks beyond its block are empty for every sequence, its
    # own block is recomputed for the sequences that moved out of it
    bu = used >> bshift
    nb = ((n - 1) >> bshift) + 1
    if bu + 1 < nb:
        stree[0, nl + bu + 1:nl + nb, :] = _EMPTY_MIN
        stree[1, nl + bu + 1:nl + nb, :] = -1
    if bu < nb:
        for w in range(cseqs.shape[1]):
            x = aff[w]
            while x != 0:
                s = w * 64 + np.int64(trailing_zeros(x))
                x &= x - _ONE
                _st_leaf_from_cells(stree, cpos, cseqs, s, bu, bshift)
    _st_pull_all(stree, sidx.shape[1])
    for w in range(cseqs.shape[1]):
        x = aff[w]
        while x != 0:
            s = w * 64 + np.int64(trailing_zeros(x))
            x &= x - _ONE
            _sidx_refresh(sidx, stree, cpos, cseqs, s, bshift)
    if meta[_M_NSHIFT] > 0:
        meta[_M_SHLO] = 0
        meta[_M_SHHI] = used - 1
    meta[_M_HEAD] = used if used < n else 0
    return moves[:m]


# --------------------------------------------------------------------------------------------
# consistency check (tests, debugging)
# --------------------------------------------------------------------------------------------

@njit(cache=True)
def _check_consistency(cpos, cshift, cseqs, occ, ftree, stree, sidx, meta):
    """0 when every index matches the cells, else a code naming the first mismatch."""
    n = cpos.shape[0]
    nseq = sidx.shape[1]
    bshift = meta[_M_BSHIFT]
    nl = stree.shape[1] >> 1
    used = 0
    nshift = 0
    for c in range(n):
        u = _used(cseqs, c)
        if u != _occ_test(occ, c):
            return 1
        if u:
            used += 1
            if cpos[c] < 0:
                return 2
            if cshift[c] != 0:
                nshift += 1
                if c < meta[_M_SHLO] or c > meta[_M_SHHI]:
                    return 3
        elif cpos[c] != -1 or cshift[c] != 0:
            return 4
    for c in range(n, occ.shape[0] * 64):
        if not _occ_test(occ, c):
            return 5
    if used != meta[_M_USED] or nshift != meta[_M_NSHIFT]:
        return 6
    # free tree: rebuild a copy and compare
    ft = np.zeros_like(ftree)
    nw = occ.shape[0]
    for w in range(nw):
        _ft_leaf(ft, occ, w)
    half = 64
    lo = nw >> 1
    while lo >= 1:
        for k in range(lo, 2 * lo):
            _ft_pull(ft, k, half)
        lo >>= 1
        half *= 2
    for k in range(1, 2 * nw):
        for j in range(3):
            if ft[j, k] != ftree[j, k]:
                return 7
    for s in range(nseq):
        mn = np.full(2 * nl, _EMPTY_MIN, np.int64)
        mx = np.full(2 * nl, -1, np.int64)
        cmin = -1
        cmax = -1
        for c in range(n):
            if _has(cseqs, c, s):
                k = nl + (c >> bshift)
                mn[k] = min(mn[k], cpos[c])
                mx[k] = max(mx[k], cpos[c])
                if cmin < 0:
                    cmin = c
                cmax = c
        for k in range(nl - 1, 0, -1):
            mn[k] = min(mn[2 * k], mn[2 * k + 1])
            mx[k] = max(mx[2 * k], mx[2 * k + 1])
        for k in range(1, 2 * nl):
            if mn[k] != stree[0, k, s] or mx[k] != stree[1, k, s]:
                return 8
        if sidx[0, s] != cmin or sidx[1, s] != cmax:
            return 9
        if cmin < 0:
            if sidx[2, s] != -1 or sidx[3, s] != -1:
                return 10
        elif sidx[2, s] != mn[1] or sidx[3, s] != mx[1]:
            return 10
    if meta[_M_HEAD] < 0 or meta[_M_HEAD] >= n:
        return 11
    return 0


# --------------------------------------------------------------------------------------------
# the Python face
# --------------------------------------------------------------------------------------------

def _int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _index_array(x, name: str) -> np.ndarray:
    """A 1-D int32 array, without copying when x already is one (one compiled specialisation
    per function: other integer inputs are range-checked and converted)."""
    if type(x) is np.ndarray and x.ndim == 1 and x.dtype is _I32:
        return x
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size == 0:
        return np.zeros(0, np.int32)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.dtype != np.int32:
        lo, hi = int(a.min()), int(a.max())
        if lo < -2**31 or hi > 2**31 - 1:
            raise ValueError(f"{name} holds a value outside int32: {lo if lo < -2**31 else hi}")
        a = a.astype(np.int32)
    return a


class SeqIndex(np.ndarray):
    """A per-sequence index row (int64 ``[max_seqs]``, -1 for a sequence with no cell) that is
    also callable: ``table.seq_pos_max[s]`` and ``table.seq_pos_max(s)`` (llama.cpp's
    ``seq_pos_max``, the argument validated) read the same value."""

    def __call__(self, seq: int) -> int:
        seq = _int(seq, "seq")
        if not 0 <= seq < self.shape[0]:
            raise ValueError(f"seq must be in [0, {self.shape[0]}), got {seq}")
        return int(np.ndarray.__getitem__(self, seq))


class _Journal(NamedTuple):
    """One undo record: the cells of ``blocks`` (int64 leaf blocks) as they were, and the
    index rows and scalars (O(max_seqs))."""

    blocks: np.ndarray
    pos: np.ndarray
    shift: np.ndarray
    seqs: np.ndarray
    sidx: np.ndarray
    meta: np.ndarray


class _JoinJournal(NamedTuple):
    """The undo record of a join into an empty sequence (``copy_prefix`` / ``seq_cp`` into a
    ``seq`` holding no cell): only sequence bits of ``seq`` were set, so taking it back needs
    only ``seq`` and its index row (int64 ``[4]``) -- O(1) to record, where a ``_Journal``
    would copy every cell of the blocks joined (most of a tier-0 prefix-store hit)."""

    seq: int
    sidx: np.ndarray


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _mutates(method):
    """Count a call of a method that may change the table in :attr:`CellTable.version` (before
    it runs: a call that fails having changed nothing only costs a page-table rebuild)."""
    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        self.version += 1
        return method(self, *args, **kwargs)
    return counted


class CellTable:
    """The cells of a cache and the indexes kept in step with them.

    Fields and their invariants:

    * the cells, split by access pattern: ``_ps`` ``[n_cells]`` of ``POS_SHIFT_DTYPE`` (8 bytes:
      position and pending shift; ``_pos`` / ``_shift`` are its field views) and ``_seqs``
      uint64 ``[n_cells, words]``, the sequence bits (sequence ``s`` is bit ``s % 64`` of word
      ``s // 64``; ``words = seq_words(max_seqs)``, one up to 64 sequences). The mask kernel
      reads a position with an 8-byte stride and one bit word per cell. A cell is used iff some
      sequence bit is set; a free cell has ``pos = -1`` and ``shift = 0``. Used cells have
      ``0 <= pos <= POS_MAX``. ``cells`` exports them as one record array (a copy),
      ``load_cells`` replaces them.
    * ``seq_cell_min`` / ``seq_cell_max`` -- int64 ``[max_seqs]``: first / last cell holding the
      sequence, -1 when it holds none.
    * ``seq_pos_min`` / ``seq_pos_max`` -- int64 ``[max_seqs]``: lowest / highest position the
      sequence holds, -1 when none. All four rows are :class:`SeqIndex` views, so
      ``table.seq_pos_max(s)`` works as llama.cpp's call too.
    * ``n_used`` -- cells holding at least one sequence.
    * the scatter head (``head``), the pending-shift count and range, the occupancy bitmap with
      its free-run tree and the per-sequence position trees (see the module docstring).

    Every method validates its arguments before it writes; on any exception the table is
    unchanged. ``version`` counts the calls of the methods that may change it: equal counts
    mean an unchanged table (the page tables are extended on the device from it).
    """

    #: calls of changing methods so far (a copy or an unpickled table starts again at 0; it is
    #: another object, which is what the page-table cache compares first)
    version = 0
    #: the allocation policy (``CacheConfig.page_size``): 1 contiguous, > 1 paged placement
    page_size = 1

    def __init__(self, n_cells: int, max_seqs: int, *, block_size: Optional[int] = None,
                 page_size: int = 1) -> None:
        n_cells = _int(n_cells, "n_cells")
        max_seqs = _int(max_seqs, "max_seqs")
        page_size = _int(page_size, "page_size")
        if not 1 <= n_cells <= MAX_CELLS:
            raise ValueError(f"n_cells must be in [1, {MAX_CELLS}], got {n_cells}")
        if not 1 <= max_seqs <= MAX_SEQS:
            raise ValueError(f"max_seqs must be in [1, {MAX_SEQS}], got {max_seqs}")
        if page_size < 1 or n_cells % page_size:
            raise ValueError(f"page_size must be >= 1 and divide n_cells={n_cells} (whole pages), "
                             f"got {page_size}")
        n_words = -(-n_cells // _WORD)
        if block_size is None:
            # 64-cell leaves, coarser when needed to keep the position trees within 8 MiB
            block_size = 64
            while max_seqs * 2 * _next_pow2(-(-n_cells // block_size)) > 2**21:
                block_size *= 2
        block_size = _int(block_size, "block_size")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {block_size}")
        self.n_cells = n_cells
        self.max_seqs = max_seqs
        self.block_size = block_size
        self.page_size = page_size
        n_leaves = _next_pow2(-(-n_cells // block_size))
        self.words = seq_words(max_seqs)
        self._ps = np.zeros(n_cells, POS_SHIFT_DTYPE)
        self._ps["pos"] = -1
        self._seqs = np.zeros((n_cells, self.words), np.uint64)
        self._occ = np.zeros(_next_pow2(n_words), np.uint64)
        self._ftree = np.zeros((3, 2 * self._occ.shape[0]), np.int32)
        self._stree = np.empty((2, 2 * n_leaves, max_seqs), np.int32)
        self._sidx = np.full((4, max_seqs), -1, np.int64)
        self._meta = np.zeros(_META_LEN, np.int64)
        self._meta[_M_BSHIFT] = block_size.bit_length() - 1
        self._bind()
        _rebuild_all(self._pos, self._shift, self._seqs, self._occ, self._ftree, self._stree,
                     self._sidx, self._meta)

    def _bind(self) -> None:
        """Field views of the cell records and the index rows (they alias the arrays)."""
        self._pos = self._ps["pos"]
        self._shift = self._ps["shift"]
        self.seq_cell_min = self._sidx[0].view(SeqIndex)
        self.seq_cell_max = self._sidx[1].view(SeqIndex)
        self.seq_pos_min = self._sidx[2].view(SeqIndex)
        self.seq_pos_max = self._sidx[3].view(SeqIndex)

    @property
    def cells(self) -> np.ndarray:
        """A copy of every cell as one record array ``[n_cells]`` of ``cell_dtype(words)``
        (fields ``pos``, ``shift``, ``seqs``); change cells through :meth:`load_cells`."""
        out = np.empty(self.n_cells, cell_dtype(self.words))
        out["pos"] = self._pos
        out["shift"] = self._shift
        out["seqs"] = self._seqs
        return out

    @property
    def n_used(self) -> int:
        return int(self._meta[_M_USED])

    @property
    def n_free(self) -> int:
        return self.n_cells - int(self._meta[_M_USED])

    @property
    def max_free_run(self) -> int:
        """Longest run of free cells (a batch of this many tokens fits contiguously). Public
        although the caches do not call it: a scheduler asks it whether a batch fits without a
        defrag, and the tests check the free-run tree against the cells with it."""
        return int(self._ftree[2, 1])

    @property
    def head(self) -> int:
        """Where find_scatter starts looking (llama.cpp's head)."""
        return int(self._meta[_M_HEAD])

    def copy(self) -> "CellTable":
        """A deep copy (every array duplicated)."""
        new = object.__new__(CellTable)
        new.n_cells = self.n_cells
        new.max_seqs = self.max_seqs
        new.block_size = self.block_size
        new.page_size = self.page_size
        new.words = self.words
        new._ps = self._ps.copy()
        new._seqs = self._seqs.copy()
        new._occ = self._occ.copy()
        new._ftree = self._ftree.copy()
        new._stree = self._stree.copy()
        new._sidx = self._sidx.copy()
        new._meta = self._meta.copy()
        new._bind()
        return new

    def __deepcopy__(self, memo) -> "CellTable":
        return self.copy()

    def __getstate__(self):
        # the index-row views are rebuilt on unpickling so they alias the new arrays
        return {k: v for k, v in self.__dict__.items()
                if k not in ("_pos", "_shift", "seq_cell_min", "seq_cell_max",
                             "seq_pos_min", "seq_pos_max")}

    @_mutates
    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._bind()

    @_mutates
    def load_cells(self, cells: np.ndarray) -> None:
        """Replace every cell record (e.g. from saved state) and rebuild the indexes; validated
        first, the table is unchanged on error. ``cells``: ``[n_cells]`` records with fields
        ``pos``, ``shift`` and ``seqs`` (uint64 words; words past this table's must be 0)."""
        arr = np.asarray(cells)
        names = arr.dtype.names or ()
        if arr.shape != (self.n_cells,) or not {"pos", "shift", "seqs"} <= set(names):
            raise ValueError(f"cells must be [{self.n_cells}] records with fields pos, shift and "
                             f"seqs, got {arr.shape} of {arr.dtype}")
        seqs = np.asarray(arr["seqs"], np.uint64).reshape(self.n_cells, -1)
        if seqs.shape[1] > self.words:
            extra = seqs[:, self.words:]
            if extra.any():
                c = int(np.argwhere(extra)[0, 0])
                raise ValueError(f"cells[{c}] is invalid: a sequence bit >= max_seqs="
                                 f"{self.max_seqs}")
            seqs = seqs[:, :self.words]
        elif seqs.shape[1] < self.words:
            seqs = np.concatenate([seqs, np.zeros((self.n_cells, self.words - seqs.shape[1]),
                                                  np.uint64)], axis=1)
        seqs = np.ascontiguousarray(seqs)
        pos = np.ascontiguousarray(arr["pos"], np.int32)
        self._validate(pos, seqs)
        self._pos[...] = pos
        self._shift[...] = arr["shift"]
        self._seqs[...] = seqs
        self.rebuild_indexes()

    def _validate(self, pos, seqs) -> None:
        bad = _validate_cells(pos, seqs, self.max_seqs)
        if bad < 0:
            c = -bad - 1
            raise ValueError(f"cells[{c}] is invalid: a used cell needs 0 <= pos <= {POS_MAX} "
                             f"and sequence bits < max_seqs={self.max_seqs} "
                             f"(pos={int(pos[c])})")

    @_mutates
    def rebuild_indexes(self) -> None:
        """Recompute every index from ``cells`` (free cells are normalised to pos -1, shift 0).
        Raises ValueError, indexes untouched, if a used cell has a negative position or a
        sequence bit >= max_seqs."""
        self._validate(self._pos, self._seqs)
        _rebuild_all(self._pos, self._shift, self._seqs, self._occ, self._ftree, self._stree,
                     self._sidx, self._meta)

    def check_consistency(self) -> None:
        """Recompute every index from scratch and compare (O(n_cells * max_seqs); for tests)."""
        code = _check_consistency(self._pos, self._shift, self._seqs, self._occ, self._ftree,
                                  self._stree, self._sidx, self._meta)
        if code:
            raise AssertionError(f"cell table indexes out of step with the cells (code {code})")

    # ---- argument checks ------------------------------------------------------------------

    def _seq(self, seq, name: str = "seq", allow_all: bool = False) -> int:
        if type(seq) is not int:
            seq = _int(seq, name)
        lo = -1 if allow_all else 0
        if not lo <= seq < self.max_seqs:
            raise ValueError(f"{name} must be in [{lo}, {self.max_seqs}), got {seq}")
        return seq

    def _cell(self, cell, name: str = "cell") -> int:
        cell = _int(cell, name)
        if not 0 <= cell < self.n_cells:
            raise ValueError(f"{name} must be in [0, {self.n_cells}), got {cell}")
        return cell

    def _raise(self, code: int, names=("slots", "positions", "seqs")) -> None:
        slots, positions, seqs = names
        msgs = {
            _E_SLOT_RANGE: f"{slots} must be cell indices in [0, {self.n_cells})",
            _E_SLOT_USED: f"{slots} must be free cells (one is in use)",
            _E_SLOT_DUP: f"{slots} must not repeat a cell",
            _E_POS: f"{positions} must be in [0, {POS_MAX}]",
            _E_SEQ: f"{seqs} must be sequence ids in [0, {self.max_seqs})",
            _E_LEN_POS: f"{positions} must have one entry per slot",
            _E_LEN_SEQ: f"{seqs} must have one entry per position",
        }
        raise ValueError(msgs.get(code, f"invalid argument (code {code})"))

    @staticmethod
    def _range(p0, p1) -> Tuple[int, int]:
        """llama.cpp's convention: p0 < 0 -> 0, p1 None or < 0 -> infinity."""
        p0 = _int(p0, "p0")
        p1 = _INF if p1 is None else _int(p1, "p1")
        return min(max(p0, 0), _INF), (_INF if p1 < 0 else min(p1, _INF))

    # ---- queries --------------------------------------------------------------------------

    def has_seq(self, cell: int, seq: int) -> bool:
        """Whether ``cell`` holds sequence ``seq``. Public although the caches read the bitsets
        in bulk: the one-cell question for callers inspecting the table, and for the tests."""
        cell = self._cell(cell)
        seq = self._seq(seq)
        return bool((int(self._seqs[cell, seq >> 6]) >> (seq & 63)) & 1)

    def seq_cells(self, seq: int) -> np.ndarray:
        """int32 indices of the cells holding seq, ascending."""
        return _cells_of(self._pos, self._seqs, self._stree, self._meta, self._seq(seq))

    def mask_inputs(self, lo: int, hi: int, copy: bool = True) -> Tuple[np.ndarray, np.ndarray]:
        """The cells [lo, hi) as (pos int32 [hi-lo], seqs uint64 [hi-lo, words]). Free cells
        have pos -1 and no sequence bit. ``copy=False`` returns views of the table (the
        positions with an 8-byte stride, the bit words contiguous; nothing copied; valid until
        the table next changes), which the CPU mask kernel reads as they are."""
        lo = _int(lo, "lo")
        hi = _int(hi, "hi")
        if not 0 <= lo <= hi <= self.n_cells:
            raise ValueError(f"lo, hi must satisfy 0 <= lo <= hi <= {self.n_cells}, "
                             f"got {lo}, {hi}")
        if not copy:
            return self._pos[lo:hi], self._seqs[lo:hi]
        return np.ascontiguousarray(self._pos[lo:hi]), np.ascontiguousarray(self._seqs[lo:hi])

    # ---- placement ------------------------------------------------------------------------

    def find_contiguous(self, n: int) -> int:
        """Ollama's findStartLoc: start of the first run of n free cells, -1 if none (O(log))."""
        if type(n) is not int:
            n = _int(n, "n")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if n > self.n_cells:
            return -1
        return int(_ft_first_fit(self._ftree, self._occ, n))

    def find_scatter(self, n: int) -> Optional[np.ndarray]:
        """n free cells (int32) taken from the head onwards, wrapping (llama.cpp's find_slot
        without contiguity); None if fewer than n are free. Changes nothing; apply_batch moves
        the head past the last slot."""
        n = _int(n, "n")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        out, ok = _find_scatter(self._occ, self._meta, self.n_cells, n)
        return out if ok else None

    def find_paged(self, positions: np.ndarray, seqs: np.ndarray) -> Optional[np.ndarray]:
        """Cells (int32 ``[batch]``) for a batch under paged placement (``page_size > 1``; see
        the module's paged placement): each sequence's tokens go on from the slot after its
        highest position, opening the first wholly free page whenever a page is full; None
        when not enough whole pages are free. Changes nothing (:meth:`apply_batch` places)."""
        positions = _index_array(positions, "positions")
        seqs = _index_array(seqs, "seqs")
        code = _check_batch(self.max_seqs, positions, seqs)
        if code:
            self._raise(code)
        after = _append_after(self._pos, self._seqs, self._stree, self._sidx, self._meta,
                              positions, seqs)
        out, ok = _find_paged(self._occ, self._ftree, self.n_cells, positions, seqs,
                              self.page_size, after)
        return out if ok else None

    def find_cells(self, positions: np.ndarray, seqs: np.ndarray) -> Optional[np.ndarray]:
        """Free cells (int32 ``[batch]``) for tokens placed outside a forward pass (an imported
        snapshot, copies, a stream's copy): paged placement (:meth:`find_paged`) when
        ``page_size > 1``, else a contiguous run where one exists and scattered cells from the
        head otherwise. None when there is no room. Changes nothing."""
        if self.page_size > 1:
            return self.find_paged(positions, seqs)
        n = len(positions)
        if n == 0:
            return np.zeros(0, np.int32)
        start = self.find_contiguous(n)
        if start >= 0:
            return np.arange(start, start + n, dtype=np.int32)
        return self.find_scatter(n)

    @property
    def n_free_pages(self) -> int:
        """Pages of ``page_size`` cells with no used cell (``n_free`` when ``page_size`` is
        1). O(pages)."""
        if self.page_size == 1:
            return self.n_free
        return int(_count_free_pages(self._occ, self.n_cells, self.page_size))

    @_mutates
    def apply_batch(self, slots: np.ndarray, positions: np.ndarray, seqs: np.ndarray) -> None:
        """Token i of the batch goes to cell ``slots[i]`` (which must be free) with
        ``positions[i]``, no pending shift and only sequence ``seqs[i]``. All ``[batch]``."""
        code = _apply_batch(self._pos, self._shift, self._seqs, self._occ, self._ftree,
                            self._stree, self._sidx, self._meta, _index_array(slots, "slots"),
                            _index_array(positions, "positions"), _index_array(seqs, "seqs"))
        if code:
            self._raise(code)

    @_mutates
    def unapply_batch(self, slots: np.ndarray, head: int) -> None:
        """Undo :meth:`apply_batch` right after it: free ``slots`` (int ``[batch]``, each in use)
        and set the scatter head back to ``head`` (read :attr:`head` before applying). With
        :meth:`undo_prune` this takes back a whole start_forward without copying the table."""
        slots = _index_array(slots, "slots")
        head = _int(head, "head")
        code = _unapply_batch(self._pos, self._shift, self._seqs, self._occ, self._ftree,
                              self._stree, self._sidx, self._meta, slots, head)
        if code == _E_POS:
            raise ValueError(f"head must be in [0, {self.n_cells}), got {head}")
        if code == _E_SLOT_USED:
            raise ValueError("slots must be cells in use (one is free)")
        if code:
            self._raise(code)

    @_mutates
    def place_contiguous(self, positions: np.ndarray, seqs: np.ndarray,
                         window: int) -> Tuple[int, int, int, int]:
        """:meth:`batch_range` (``window``), :meth:`find_contiguous` and, when a run is free,
        :meth:`apply_batch` on it, in one compiled call (start_forward's hot path). Returns
        ``(lo, hi, start, head)``: the range, the first cell of the batch (-1: no run long
        enough, nothing applied) and the scatter head before (for :meth:`unapply_batch`)."""
        code, lo, hi, start, head = _place_contiguous(
            self._pos, self._shift, self._seqs, self._occ, self._ftree, self._stree, self._sidx,
            self._meta, _index_array(positions, "positions"), _index_array(seqs, "seqs"),
            min(_int(window, "window"), _INF))
        if code:
            self._raise(code)
        return int(lo), int(hi), int(start), int(head)

    def shared_tails(self, positions: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        """Under paged placement: int64 ``[k, 3]`` rows (seq, first cell, cells) for the
        batch's sequences whose partly filled last page they share with a sequence that has
        taken (or in this batch takes) its next slot; each needs its own copy of those cells
        (copy-on-write) for its tokens to follow them on one page. Empty when ``page_size`` is
        1. Changes nothing."""
        if self.page_size == 1:
            return np.zeros((0, 3), np.int64)
        positions = _index_array(positions, "positions")
        seqs = _index_array(seqs, "seqs")
        code = _check_batch(self.max_seqs, positions, seqs)
        if code:
            self._raise(code)
        after = _append_after(self._pos, self._seqs, self._stree, self._sidx, self._meta,
                              positions, seqs)
        return _shared_tails(self._pos, self._seqs, self._occ, self.page_size, after)

    @_mutates
    def place_paged(self, positions: np.ndarray, seqs: np.ndarray, window: int,
                    cow: bool = False) -> Tuple[int, int, Optional[np.ndarray], int, np.ndarray,
                                                bool]:
        """:meth:`place_contiguous` under paged placement (``page_size > 1``): returns ``(lo,
        hi, slots, head, tails, contiguous)`` with ``slots`` the batch's cells (int32
        ``[batch]``, batch order; ``contiguous``: one ascending run), or None (nothing applied)
        when the pages it needs are not free or, with ``cow``, when sequences need copies of
        a shared last page first: then ``tails`` lists them as :meth:`shared_tails` does."""
        code, lo, hi, slots, head, tails, run = _place_paged(
            self._pos, self._shift, self._seqs, self._occ, self._ftree, self._stree, self._sidx,
            self._meta, _index_array(positions, "positions"), _index_array(seqs, "seqs"),
            min(_int(window, "window"), _INF), self.page_size, bool(cow))
        if code:
            self._raise(code)
        return (int(lo), int(hi), (slots if len(slots) == len(positions) else None), int(head),
                tails, bool(run))

    # ---- sliding window -------------------------------------------------------------------

    @_mutates
    def prune_window(self, positions: np.ndarray, seqs: np.ndarray, memory: int) -> np.ndarray:
        """Ollama's updateSlidingWindow eviction, before a batch is placed.

        Every sequence of the batch has lowest = its lowest position in the batch; every other
        sequence holding cells has lowest = its highest stored position + 1 (idle sequences
        must shrink too: Ollama #10127). Cells of a sequence with ``pos < lowest - memory`` drop
        it. ``memory < 0`` means unlimited (nothing is evicted).

        Returns the undo records int64 ``[k, 4]`` (cell, seq, pos, shift) that
        :meth:`undo_prune` takes to put everything back (e.g. when placement then fails).
        """
        positions = _index_array(positions, "positions")
        seqs = _index_array(seqs, "seqs")
        if type(memory) is not int:
            memory = _int(memory, "memory")
        memory = min(memory, _INF)
        if memory < 0:
            code = _check_batch(self.max_seqs, positions, seqs)
            if code:
                self._raise(code)
            return np.zeros((0, 4), np.int64)
        code, undo = _prune_window(self._pos, self._shift, self._seqs, self._occ, self._ftree,
                                   self._stree, self._sidx, self._meta, positions, seqs, memory)
        if code:
            self._raise(code)
        return undo

    @_mutates
    def undo_prune(self, records: np.ndarray) -> None:
        """Put back what :meth:`prune_window` dropped (records exactly as it returned them,
        before any other change)."""
        rec = np.asarray(records)
        if rec.ndim != 2 or rec.shape[1] != 4 or (rec.size and rec.dtype.kind not in "iu"):
            raise ValueError(f"records must be [k, 4] integers, got {rec.shape} of {rec.dtype}")
        code = _undo_prune(self._pos, self._shift, self._seqs, self._occ, self._ftree,
                           self._stree, self._sidx, self._meta, rec.astype(np.int64, copy=False))
        if code:
            raise ValueError("records must name cells and sequences dropped by prune_window "
                             "(a cell out of range or already holding its sequence)")

    def batch_range(self, positions: np.ndarray, seqs: np.ndarray, window: int) -> Tuple[int, int]:
        """The cells [lo, hi) the batch's sequences may attend to among those stored now;
        (0, 0) when none. ``window < 0``: the union of the batch sequences' cell ranges;
        ``window >= 0``: the cells of a batch sequence whose pos >= (lowest batch position of
        that sequence) - window."""
        positions = _index_array(positions, "positions")
        seqs = _index_array(seqs, "seqs")
        if type(window) is not int:
            window = _int(window, "window")
        window = min(window, _INF)
        code, lo, hi = _batch_range(self._pos, self._seqs, self._stree, self._sidx, self._meta,
                                    positions, seqs, window)
        if code:
            self._raise(code)
        return lo, hi

    # ---- sequence operations --------------------------------------------------------------

    def shared_cells_moving(self, seq: int, begin: int, end: Optional[int]) -> bool:
        """Whether remove(seq, begin, end) would refuse (a cell to move is shared)."""
        seq = self._seq(seq)
        begin = _int(begin, "begin")
        if end is None:
            return False
        end = _int(end, "end")
        if end <= begin:
            return False
        return bool(_shared_in_range(self._pos, self._seqs, self._stree, self._sidx, self._meta,
                                     seq, end, _INF))

    def shared_cells_in(self, seq: int, p0: int = 0, p1: Optional[int] = None) -> bool:
        """Whether a cell of seq with p0 <= pos < p1 is shared (seq_add / seq_div would refuse).
        Public although the caches find out by trying: a caller asks it before a shift."""
        seq = self._seq(seq)
        p0, p1 = self._range(p0, p1)
        return bool(_shared_in_range(self._pos, self._seqs, self._stree, self._sidx, self._meta,
                                     seq, p0, p1))

    def holds_in(self, seq: int, p0: int = 0, p1: Optional[int] = None) -> bool:
        """Whether seq holds a position p0 <= pos < p1 (O(log n + cells of seq in range))."""
        seq = self._seq(seq)
        p0, p1 = self._range(p0, p1)
        return p0 < p1 and bool(_any_in_range(self._pos, self._seqs, self._stree, self._meta, seq,
                                              p0, p1, False))

    def batch_conflict(self, positions: np.ndarray, seqs: np.ndarray) -> int:
        """Index of the first token (int32 ``[batch]`` positions and seqs, already checked) whose
        (sequence, position) repeats one earlier in the batch or one the sequence still holds;
        -1 when none."""
        return int(_batch_conflict(self._pos, self._seqs, self._stree, self._sidx, self._meta,
                                   positions, seqs))

    @_mutates
    def remove(self, seq: int, begin: int, end: Optional[int],
               journal: Optional[list] = None) -> np.ndarray:
        """Ollama's Remove: cells of seq with begin <= pos < end drop it; with a finite end,
        its cells with pos >= end move down by end - begin (pos and pending shift both).
        Raises NotSupportedError, before any change, if a cell that must move is shared.
        Returns the int32 indices of the cells whose position moved, ascending."""
        seq = self._seq(seq)
        begin = _int(begin, "begin")
        if not 0 <= begin <= POS_MAX + 1:
            raise ValueError(f"begin must be in [0, {POS_MAX + 1}], got {begin}")
        if end is None:
            e = -1
        else:
            e = _int(end, "end")
            if e < begin:
                raise ValueError(f"end must be None or >= begin ({begin}), got {e}")
            e = min(e, POS_MAX + 1)      # no position reaches past this: same meaning
        self._record(journal, seq, begin, _INF)
        code, moved = _remove(self._pos, self._shift, self._seqs, self._occ, self._ftree,
                              self._stree, self._sidx, self._meta, seq, begin, e)
        if code == _E_SHARED:
            raise NotSupportedError(SHARED_SHIFT_MESSAGE)
        return moved

    @_mutates
    def copy_prefix(self, src: int, dst: int, length: int, journal: Optional[list] = None) -> None:
        """Ollama's CopyPrefix: dst drops every cell, then joins src's cells with pos < length.
        src == dst does nothing."""
        src = self._seq(src, "src")
        dst = self._seq(dst, "dst")
        length = _int(length, "length")
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        length = min(length, POS_MAX + 1)
        if src == dst:
            return
        self._record_join(journal, src, dst, 0, length, clear_dst=True)
        _copy_prefix(self._pos, self._shift, self._seqs, self._occ, self._ftree, self._stree,
                     self._sidx, self._meta, src, dst, length)

    @_mutates
    def seq_rm(self, seq: int, p0: int = 0, p1: Optional[int] = None,
               journal: Optional[list] = None) -> bool:
        """llama.cpp's seq_rm: cells of seq with p0 <= pos < p1 drop it (seq = -1: every cell in
        the range is freed). p0 < 0 means 0, p1 None or < 0 means infinity. Returns True."""
        seq = self._seq(seq, allow_all=True)
        p0, p1 = self._range(p0, p1)
        if p0 < p1:
            self._record(journal, seq, p0, p1)
            _seq_rm(self._pos, self._shift, self._seqs, self._occ, self._ftree, self._stree,
                    self._sidx, self._meta, seq, p0, p1)
        return True

    @_mutates
    def leave_cells(self, seq: int, cells: np.ndarray, journal: Optional[list] = None) -> None:
        """``seq`` leaves exactly ``cells`` (int ``[k]``), each of which it holds and another
        sequence holds too (so none is freed): unlike ``seq_rm`` over a position range, a
        sequence holding one position twice (once here, once in a private cell) keeps the
        other cell."""
        seq = self._seq(seq)
        cells = np.asarray(cells, np.int64)
        if not len(cells):
            return
        pos = self._pos[cells]
        self._record(journal, seq, int(pos.min()), int(pos.max()) + 1)
        self._seqs[cells, seq >> 6] &= ~np.uint64(1 << (seq & 63))
        bshift = int(self._meta[_M_BSHIFT])
        blocks = np.unique(cells >> bshift).astype(np.int64)
        _st_refresh_blocks(self._stree, self._pos, self._seqs, seq, blocks, bshift)
        _sidx_refresh(self._sidx, self._stree, self._pos, self._seqs, seq, bshift)

    @_mutates
    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: Optional[int] = None,
               journal: Optional[list] = None) -> None:
        """llama.cpp's seq_cp: dst joins every cell of src with p0 <= pos < p1."""
        src = self._seq(src, "src")
        dst = self._seq(dst, "dst")
        p0, p1 = self._range(p0, p1)
        if src == dst or p0 >= p1:
            return
        self._record_join(journal, src, dst, p0, p1)
        _seq_cp(self._pos, self._seqs, self._stree, self._sidx, self._meta, src, dst, p0, p1)

    @_mutates
    def seq_keep(self, seq: int, journal: Optional[list] = None) -> None:
        """llama.cpp's seq_keep: cells holding seq keep only seq; every other cell is freed."""
        seq = self._seq(seq)
        self._record(journal, -1, 0, _INF)
        _seq_keep(self._pos, self._shift, self._seqs, self._occ, self._ftree, self._stree,
                  self._sidx, self._meta, seq)

    @_mutates
    def seq_add(self, seq: int, p0: int, p1: Optional[int], delta: int,
                journal: Optional[list] = None) -> None:
        """llama.cpp's seq_add: cells of seq with p0 <= pos < p1 get pos += delta and
        shift += delta; a cell whose pos would go below 0 is freed. Shared cells in the range
        -> NotSupportedError before any change."""
        seq = self._seq(seq)
        p0, p1 = self._range(p0, p1)
        delta = _int(delta, "delta")
        if abs(delta) > POS_MAX + 1:
            raise ValueError(f"delta must be in [-{POS_MAX + 1}, {POS_MAX + 1}], got {delta}")
        if delta == 0 or p0 >= p1:
            return
        self._record(journal, seq, p0, p1)
        code = _seq_add(self._pos, self._shift, self._seqs, self._occ, self._ftree, self._stree,
                        self._sidx, self._meta, seq, p0, p1, delta)
        if code == _E_SHARED:
            raise NotSupportedError(SHARED_SHIFT_MESSAGE)
        if code == _E_OVERFLOW:
            raise ValueError(f"delta {delta} would move a position past {POS_MAX}")
        if code == _E_SHIFT_OVERFLOW:
            raise ValueError(f"delta {delta} would overflow a cell's pending int32 shift")

    @_mutates
    def seq_div(self, seq: int, p0: int, p1: Optional[int], d: int,
                journal: Optional[list] = None) -> None:
        """llama.cpp's seq_div: cells of seq with p0 <= pos < p1 get pos //= d and
        shift += new - old. Shared cells in the range -> NotSupportedError before any change."""
        seq = self._seq(seq)
        p0, p1 = self._range(p0, p1)
        d = _int(d, "d")
        if not 1 <= d <= POS_MAX + 1:
            raise ValueError(f"d must be in [1, {POS_MAX + 1}], got {d}")
        if d == 1 or p0 >= p1:
            return
        self._record(journal, seq, p0, p1)
        code = _seq_div(self._pos, self._shift, self._seqs, self._stree, self._sidx, self._meta,
                        seq, p0, p1, d)
        if code == _E_SHARED:
            raise NotSupportedError(SHARED_SHIFT_MESSAGE)
        if code == _E_SHIFT_OVERFLOW:
            raise ValueError(f"d {d} would overflow a cell's pending int32 shift")

    # ---- shifts ---------------------------------------------------------------------------

    @_mutates
    def restore_shifts(self, cells: np.ndarray, deltas: np.ndarray) -> None:
        """Undo :meth:`take_shifts` (exactly what it returned, before any other change)."""
        _restore_shifts(self._shift, self._meta, cells, deltas)

    def has_pending_shifts(self) -> bool:
        return self._meta[_M_NSHIFT] > 0

    @_mutates
    def take_shifts(self) -> Tuple[np.ndarray, np.ndarray]:
        """(cells int32 [k], deltas int32 [k]) of every cell with a pending shift, ascending;
        their shift is reset to 0 (the caller rotates those keys by the deltas)."""
        return _take_shifts(self._shift, self._meta)

    # ---- defrag ---------------------------------------------------------------------------

    @_mutates
    def plan_defrag(self) -> np.ndarray:
        """int64 ``[m, 3]`` block moves (src, dst, length), already applied to the metadata;
        the caller copies K/V ``[src, src+length) -> [dst, dst+length)`` for each (in any order:
        sources are all >= n_used, destinations all < n_used). Holes are filled from the end of
        the table in ascending order and contiguous runs merged, so every (sequence, position)
        keeps its own K/V. Afterwards the used cells are exactly 0 .. n_used-1.

        With ``page_size > 1`` whole pages move instead (every cell keeps its slot in its page,
        so page tables stay valid, renumbered): afterwards the pages holding a used cell are
        the first ones (free cells inside partly used pages stay where they are)."""
        if self.page_size > 1:
            return _plan_defrag_pages(self._pos, self._shift, self._seqs, self._occ, self._ftree,
                                      self._stree, self._sidx, self._meta, self.page_size)
        return _plan_defrag(self._pos, self._shift, self._seqs, self._occ, self._ftree,
                            self._stree, self._sidx, self._meta)

    @_mutates
    def undo_defrag(self, moves: np.ndarray, head: int) -> None:
        """Undo :meth:`plan_defrag` (its moves, the :attr:`head` read before it) right after
        it, or after changes that were themselves undone: the cells go back where they were."""
        _undo_defrag(self._pos, self._shift, self._seqs, self._occ, self._ftree, self._stree,
                     self._sidx, self._meta, np.asarray(moves, np.int64).reshape(-1, 3), int(head))

    # ---- undo log -------------------------------------------------------------------------

    def _record(self, journal: Optional[list], seq: int, p0: int, p1: int, seq2: int = -1,
                q0: int = 0, q1: int = 0) -> None:
        """Append to ``journal`` (when given) what an edit of seq's positions [p0, p1) (and
        seq2's [q0, q1)) may change: the cells of the blocks holding them, as they are now.
        ``seq = -1``: every block (only the operations that scan the table anyway)."""
        if journal is None:
            return
        if seq < 0:
            blocks = np.arange(-(-self.n_cells // self.block_size), dtype=np.int64)
        else:
            blocks = _op_blocks(self._stree, seq, p0, p1, seq2, q0, q1)
        pos, shift, seqs = _save_blocks(self._pos, self._shift, self._seqs, self._meta, blocks)
        journal.append(_Journal(blocks, pos, shift, seqs, self._sidx.copy(), self._meta.copy()))

    def _record_join(self, journal: Optional[list], src: int, dst: int, p0: int, p1: int,
                     clear_dst: bool = False) -> None:
        """Record an edit that makes ``dst`` join ``src``'s cells with ``p0 <= pos < p1``
        (``clear_dst``: after dropping every cell of dst, as copy_prefix does)."""
        if journal is None:
            return
        if self._sidx[3, dst] < 0:
            journal.append(_JoinJournal(dst, self._sidx[:, dst].copy()))
        elif clear_dst:
            self._record(journal, dst, 0, _INF, src, p0, p1)
        else:
            self._record(journal, src, p0, p1)

    @_mutates
    def rollback(self, journal: list) -> None:
        """Undo, newest first, the edits recorded in ``journal`` (by the ``journal=`` argument
        of the sequence operations) and empty it. Nothing else may have changed the table
        since, except edits that were themselves undone."""
        while journal:
            j = journal.pop()
            if isinstance(j, _JoinJournal):
                _unjoin(self._seqs, self._stree, self._meta, j.seq)
                self._sidx[:, j.seq] = j.sidx
                continue
            _restore_blocks(self._pos, self._shift, self._seqs, self._occ, self._ftree,
                            self._stree, self._sidx, self._meta, j.blocks, j.pos, j.shift,
                            j.seqs, j.sidx, j.meta)

    def __repr__(self) -> str:
        return (f"CellTable(n_cells={self.n_cells}, max_seqs={self.max_seqs}, "
                f"n_used={self.n_used})")


_TABLE_ARRAYS = ("_ps", "_seqs", "_occ", "_ftree", "_stree", "_sidx", "_meta")


_meta_of = attrgetter("_meta")       # a cell table's counters row (its place in a stack)


class CellTableStack:
    """Cell tables of one shape whose arrays are rows of shared ``[n_tables, ...]`` arrays, so
    that one compiled call places a batch in all of them (per-sequence streams: one table per
    stream, a decode step placing a token in each).

    ``CellTableStack(tables)`` adopts ``tables`` (equal ``n_cells``, ``max_seqs``, block and
    page size): their contents are copied into new stacked arrays and each table's arrays
    become its row (its contents, and every method, unchanged; its ``version`` counts the
    adoption). :meth:`holds` says whether given tables are still these tables on these rows
    (a table replaced, e.g. by a state load, or a copied stack, is not).
    """

    def __init__(self, tables) -> None:
        tables = tuple(tables)
        if not tables or not all(isinstance(t, CellTable) for t in tables):
            raise ValueError("CellTableStack needs one or more CellTables")
        first = tables[0]
        shape = (first.n_cells, first.max_seqs, first.block_size, first.page_size)
        if any((t.n_cells, t.max_seqs, t.block_size, t.page_size) != shape for t in tables):
            raise ValueError("CellTableStack needs tables of one shape (n_cells, max_seqs, "
                             "block_size, page_size)")
        stacked = {name: np.stack([getattr(t, name) for t in tables]) for name in _TABLE_ARRAYS}
        for i, t in enumerate(tables):
            for name in _TABLE_ARRAYS:
                setattr(t, name, stacked[name][i])
            t._bind()
            t.version += 1
        self.tables = tables
        self.n_cells = first.n_cells
        self._table_list = list(tables)                # holds() compares a list with it
        self._rows = tuple(t._meta for t in tables)
        ps = stacked["_ps"]
        self._arrays = (ps["pos"], ps["shift"]) + tuple(stacked[name]
                                                          for name in _TABLE_ARRAYS[1:])

    def holds(self, tables) -> bool:
        """Whether ``tables`` (a sequence) are this stack's tables, each still on its row."""
        if type(tables) is not list:
            tables = list(tables)
        # every decode step of a stream cache asks: a list comparison (identity first, a C
        # loop) and a C-level map over the rows; at 64 tables 1.7-2.2 us where a generator
        # over the three was 2.1-3.1 and map/all over the three 3.1-3.4 (Python 3.11-3.13)
        return tables == self._table_list and all(map(is_, map(_meta_of, tables), self._rows))

    def place(self, seq_ids: np.ndarray, qo_indptr: np.ndarray, token_order: np.ndarray,
              positions: np.ndarray, memory: int, window: int, pad: int):
        """Place a batch grouped by table (``_group_by_seq``'s ``seq_ids`` / ``qo_indptr`` /
        ``token_order``; ``positions`` int32 ``[batch]`` in batch order, checked): group ``b``
        into table ``seq_ids[b]`` as its sequence 0, each as ``CausalCache._place`` does it:
        :meth:`CellTable.prune_window` with ``memory`` (-1: no window memory, not called),
        then :meth:`CellTable.place_contiguous` with ``window`` (its range's window, -1 none).
        Trusted inputs. Returns None, every table as it was, when a group finds no free run
        long enough (a defrag or a full table) or a position is stored or repeated (the
        caller's one-table path raises or defragments); else ``(out, grouped, local, pool,
        top, records, pruned_at, steps)``: ``out`` int64 ``[n_b, 5]`` (start, range lo and hi padded
        to ``pad``, head before, pending shifts), the positions in group order, each token's
        cell in its table (group order), ``table * n_cells + cell`` in batch order (int32
        ``[batch]`` each), the largest ``hi``, and group ``b``'s pruning undo records
        ``records[pruned_at[b]:pruned_at[b + 1]]``. Each placed table's ``version`` counts
        the calls as those two methods count them: ``steps`` more (1, or 2 with ``memory``)."""
        batch = positions.shape[0]
        nb = seq_ids.shape[0]
        out = np.empty((nb, 5), np.int64)
        grouped = np.empty(batch, np.int32)
        local = np.empty(batch, np.int32)
        pool = np.empty(batch, np.int32)
        pruned_at = np.empty(nb + 1, np.int64)
        code, top, records = _place_stacked(
            *self._arrays, seq_ids, qo_indptr, token_order, positions,
            -1 if memory < 0 else min(memory, _INF), min(window, _INF), pad, grouped, local,
            pool, out, pruned_at)
        if code:
            return None
        tables = self.tables
        steps = 1 if memory < 0 else 2
        for s in seq_ids.tolist():
            tables[s].version += steps
        return out, grouped, local, pool, int(top), records, pruned_at, steps


__all__ = ["SEQ_WORDS", "MAX_SEQS", "CELL_DTYPE", "POS_SHIFT_DTYPE", "cell_dtype", "seq_words",
           "POS_MAX", "SHARED_SHIFT_MESSAGE", "CellTable", "CellTableStack",
           "SeqIndex"]
