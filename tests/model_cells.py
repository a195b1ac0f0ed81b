"""A deliberately simple pure-Python model of ``numbakv.cells.CellTable``.

Cells are plain lists (``pos``, ``shift``, a ``set`` of sequences); every operation is written
the obvious way, scanning the whole table, straight from Ollama's ``causal.go`` and llama.cpp's
``llama_kv_cache`` / ``llama_kv_cells``, with numbakv's two departures: a failing call changes
nothing (checks come first) and a freed cell is reset to ``pos = -1, shift = 0``.

Defrag is not re-implemented as block moves here: :func:`reference_defrag_plan` gives the plan
llama.cpp's ``defrag_prepare`` makes (each hole filled, in ascending order, by the last cells of
the table), and the tests check the table's moves by applying them to a data array of unique
ids (every (sequence, position) must keep its own id).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from numbakv.errors import NotSupportedError

INF = 2**62
POS_MAX = 2**31 - 2


class ModelCells:
    def __init__(self, n_cells: int, max_seqs: int) -> None:
        self.n = n_cells
        self.max_seqs = max_seqs
        self.pos: List[int] = [-1] * n_cells
        self.shift: List[int] = [0] * n_cells
        self.seqs: List[set] = [set() for _ in range(n_cells)]
        self.head = 0

    # ---- basics ---------------------------------------------------------------------------

    def copy(self) -> "ModelCells":
        m = ModelCells(self.n, self.max_seqs)
        m.pos = list(self.pos)
        m.shift = list(self.shift)
        m.seqs = [set(s) for s in self.seqs]
        m.head = self.head
        return m

    def state(self):
        return (tuple(self.pos), tuple(self.shift), tuple(frozenset(s) for s in self.seqs),
                self.head)

    def _free(self, c: int) -> None:
        self.seqs[c] = set()
        self.pos[c] = -1
        self.shift[c] = 0

    def _drop(self, c: int, seq: int) -> bool:
        """Cell c loses seq; True if it became free."""
        self.seqs[c].discard(seq)
        if not self.seqs[c]:
            self._free(c)
            return True
        return False

    @property
    def n_used(self) -> int:
        return sum(1 for s in self.seqs if s)

    def cell_range(self, seq: int) -> Tuple[int, int]:
        cells = [c for c in range(self.n) if seq in self.seqs[c]]
        return (cells[0], cells[-1]) if cells else (-1, -1)

    def pos_range(self, seq: int) -> Tuple[int, int]:
        ps = [self.pos[c] for c in range(self.n) if seq in self.seqs[c]]
        return (min(ps), max(ps)) if ps else (-1, -1)

    def seq_cells(self, seq: int) -> List[int]:
        return [c for c in range(self.n) if seq in self.seqs[c]]

    # ---- placement ------------------------------------------------------------------------

    def find_contiguous(self, n: int) -> int:
        """Ollama's findStartLoc."""
        start = count = 0
        for i in range(self.n):
            if not self.seqs[i]:
                count += 1
                if count >= n:
                    return start
            else:
                start = i + 1
                count = 0
        return -1

    def find_scatter(self, n: int) -> Optional[List[int]]:
        """llama.cpp's find_slot with cont = false."""
        if self.n - self.n_used < n:
            return None
        head = self.head
        if head > self.n_used + 2 * n:
            head = 0
        out = []
        c = head
        while len(out) < n:
            if not self.seqs[c]:
                out.append(c)
            c = (c + 1) % self.n
        return out

    def apply_batch(self, slots, positions, seqs) -> None:
        slots = [int(x) for x in slots]
        assert len(set(slots)) == len(slots) and all(not self.seqs[c] for c in slots)
        for c, p, s in zip(slots, positions, seqs):
            self.pos[c] = int(p)
            self.shift[c] = 0
            self.seqs[c] = {int(s)}
        if slots:
            self.head = (slots[-1] + 1) % self.n

    # ---- sliding window -------------------------------------------------------------------

    def prune_window(self, positions, seqs, memory: int) -> None:
        """Ollama's updateSlidingWindow (the eviction part)."""
        if memory < 0:
            return
        lowest = {}
        for p, s in zip(positions, seqs):
            lowest[int(s)] = min(lowest.get(int(s), INF), int(p))
        for s in range(self.max_seqs):
            if s not in lowest and self.pos_range(s)[1] >= 0:
                lowest[s] = self.pos_range(s)[1] + 1
        for s, low in lowest.items():
            for c in range(self.n):
                if s in self.seqs[c] and self.pos[c] < low - memory:
                    self._drop(c, s)

    def batch_range(self, positions, seqs, window: int) -> Tuple[int, int]:
        lowest = {}
        for p, s in zip(positions, seqs):
            lowest[int(s)] = min(lowest.get(int(s), INF), int(p))
        cells = []
        for s, low in lowest.items():
            for c in range(self.n):
                if s in self.seqs[c] and (window < 0 or self.pos[c] >= low - window):
                    cells.append(c)
        return (min(cells), max(cells) + 1) if cells else (0, 0)

    # ---- sequence operations --------------------------------------------------------------

    def remove(self, seq: int, begin: int, end: Optional[int]) -> List[int]:
        """Ollama's Remove, refusing before any change when a shared cell must move."""
        d = 0 if end is None else end - begin
        e = INF if end is None else end
        if d > 0:
            for c in range(self.n):
                if seq in self.seqs[c] and self.pos[c] >= e and len(self.seqs[c]) > 1:
                    raise NotSupportedError("shifting cells shared by multiple sequences "
                                            "not supported")
        moved = []
        for c in range(self.n):
            if seq not in self.seqs[c]:
                continue
            if begin <= self.pos[c] < e:
                self._drop(c, seq)
            elif d > 0 and self.pos[c] >= e:
                self.pos[c] -= d
                self.shift[c] -= d
                moved.append(c)
        return moved

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        if src == dst:
            return
        for c in range(self.n):
            if dst in self.seqs[c]:
                self._drop(c, dst)
        for c in range(self.n):
            if src in self.seqs[c] and self.pos[c] < length:
                self.seqs[c].add(dst)

    @staticmethod
    def _norm(p0, p1):
        p0 = max(p0, 0)
        p1 = INF if p1 is None or p1 < 0 else p1
        return p0, p1

    def seq_rm(self, seq: int, p0: int = 0, p1: Optional[int] = None) -> bool:
        p0, p1 = self._norm(p0, p1)
        new_head = None
        for c in range(self.n):
            if not self.seqs[c] or not (p0 <= self.pos[c] < p1):
                continue
            if seq < 0:
                self._free(c)
                freed = True
            elif seq in self.seqs[c]:
                freed = self._drop(c, seq)
            else:
                freed = False
            if freed and new_head is None:
                new_head = c
        if new_head is not None and new_head < self.head:
            self.head = new_head
        return True

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: Optional[int] = None) -> None:
        p0, p1 = self._norm(p0, p1)
        if src == dst:
            return
        for c in range(self.n):
            if src in self.seqs[c] and p0 <= self.pos[c] < p1:
                self.seqs[c].add(dst)

    def seq_keep(self, seq: int) -> None:
        new_head = None
        for c in range(self.n):
            if not self.seqs[c]:
                continue
            if seq in self.seqs[c]:
                self.seqs[c] = {seq}
            else:
                self._free(c)
                if new_head is None:
                    new_head = c
        if new_head is not None and new_head < self.head:
            self.head = new_head

    def _targets(self, seq, p0, p1):
        return [c for c in range(self.n) if seq in self.seqs[c] and p0 <= self.pos[c] < p1]

    def seq_add(self, seq: int, p0: int, p1: Optional[int], delta: int) -> None:
        p0, p1 = self._norm(p0, p1)
        if delta == 0 or p0 >= p1:
            return
        cells = self._targets(seq, p0, p1)
        if any(len(self.seqs[c]) > 1 for c in cells):
            raise NotSupportedError("shifting cells shared by multiple sequences not supported")
        if any(self.pos[c] + delta > POS_MAX for c in cells):
            raise ValueError("delta overflows a position")
        new_head = None
        for c in cells:
            if self.pos[c] + delta < 0:
                self._free(c)
                if new_head is None:
                    new_head = c
            else:
                self.pos[c] += delta
                self.shift[c] += delta
        self.head = new_head if new_head is not None else 0

    def seq_div(self, seq: int, p0: int, p1: Optional[int], d: int) -> None:
        p0, p1 = self._norm(p0, p1)
        if d == 1 or p0 >= p1:
            return
        cells = self._targets(seq, p0, p1)
        # a shared cell whose position does not change (0 // d) is no shift of the others'
        if any(len(self.seqs[c]) > 1 and self.pos[c] // d != self.pos[c] for c in cells):
            raise NotSupportedError("shifting cells shared by multiple sequences not supported")
        for c in cells:
            new = self.pos[c] // d
            self.shift[c] += new - self.pos[c]
            self.pos[c] = new

    def take_shifts(self) -> Tuple[List[int], List[int]]:
        cells = [c for c in range(self.n) if self.shift[c] != 0]
        deltas = [self.shift[c] for c in cells]
        for c in cells:
            self.shift[c] = 0
        return cells, deltas

    # ---- defrag ---------------------------------------------------------------------------

    def adopt_defrag(self, data_ids: List[int], n_used: int) -> None:
        """After a checked defrag: cell i now holds what cell data_ids[i] held."""
        old = self.copy()
        for c in range(self.n):
            self._free(c)
        for i in range(n_used):
            j = data_ids[i]
            self.pos[i] = old.pos[j]
            self.shift[i] = old.shift[j]
            self.seqs[i] = set(old.seqs[j])
        self.head = n_used if n_used < self.n else 0


def reference_defrag_plan(used: List[bool]) -> List[Tuple[int, int, int]]:
    """llama.cpp's defrag_prepare, written plainly: for each hole run in [0, n_used), ascending,
    take the last n not-yet-moved used cells, put them in the hole lowest first, and merge
    moves whose sources and destinations are both contiguous."""
    n = len(used)
    n_used = sum(used)
    taken = [False] * n
    pairs = []                       # (src, dst) per cell
    i0 = 0
    while i0 < n_used:
        if used[i0]:
            i0 += 1
            continue
        nh = 0
        while i0 + nh < n_used and not used[i0 + nh]:
            nh += 1
        srcs = []
        for c in range(n - 1, -1, -1):
            if len(srcs) == nh:
                break
            if used[c] and not taken[c] and c >= n_used:
                srcs.append(c)
        for c in srcs:
            taken[c] = True
        for k, src in enumerate(sorted(srcs)):
            pairs.append((src, i0 + k))
        i0 += nh
    moves = []
    for src, dst in pairs:
        if moves and moves[-1][0] + moves[-1][2] == src and moves[-1][1] + moves[-1][2] == dst:
            moves[-1] = (moves[-1][0], moves[-1][1], moves[-1][2] + 1)
        else:
            moves.append((src, dst, 1))
    return moves
