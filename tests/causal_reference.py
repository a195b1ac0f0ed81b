"""Independent references for the CausalCache tests (no numbakv code inside).

* ``rope_ref``: a plain numpy rotary re-rotation (float64 math) of keys by position deltas.
* ``ref_sizing``: the cell count and the effective window / memory of Ollama's ``Causal.Init``.
* ``RefCausal``: a pure-Python model of Ollama's ``kvcache/causal.go`` (contiguous form, the seed
  004) plus llama.cpp's sequence operations. Cells are tracked by a token id ("uid") so that K/V
  data can be checked without knowing where the implementation put a cell; the layout (which
  cell index holds which uid) is tracked too, and is exact until the first defrag (numbakv is
  free to pick a different, valid, defrag order).
* ``attention_ref``: softmax attention with an additive mask.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Set

import numpy as np

INF = math.inf
NEG_INF = -np.inf


class RefFull(Exception):
    """The reference found no room for the batch (KVCacheFullError expected)."""


class RefNotSupported(Exception):
    """The reference refuses the operation (NotSupportedError expected)."""


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def round_down(x: int, m: int) -> int:
    return (x // m) * m


# --------------------------------------------------------------------------------------------
# rotary shift
# --------------------------------------------------------------------------------------------

def rope_inv_freq(head_dim: int, base: float = 10000.0, dim: Optional[int] = None,
                  freq_scale: float = 1.0) -> np.ndarray:
    n = head_dim if dim is None else dim
    i = np.arange(n // 2, dtype=np.float64)
    return (freq_scale * base ** (-2.0 * i / n)).astype(np.float32).astype(np.float64)


def rope_ref(key, deltas, *, base: float = 10000.0, dim: Optional[int] = None,
             neox: bool = True, freq_scale: float = 1.0) -> np.ndarray:
    """Rotate ``key`` ``[..., k, n_heads, head_dim]`` by ``deltas`` ``[k]`` positions.

    Pair ``i`` of the ``dim`` rotary dims turns by ``delta * freq_scale * base**(-2i/dim)``;
    NeoX pairs ``(x[i], x[i + dim/2])``, normal pairs ``(x[2i], x[2i+1])``; dims past ``dim`` are
    untouched. float64 math; returns float64.
    """
    x = np.array(key, dtype=np.float64, copy=True)
    hd = x.shape[-1]
    n = hd if dim is None else dim
    inv = rope_inv_freq(hd, base, n, freq_scale)                      # [n/2]
    d = np.asarray(deltas, dtype=np.float64).reshape(-1)              # [k]
    theta = d[:, None] * inv[None, :]                                 # [k, n/2]
    cos = np.cos(theta)[:, None, :]
    sin = np.sin(theta)[:, None, :]
    if neox:
        a_idx = np.arange(n // 2)
        b_idx = a_idx + n // 2
    else:
        a_idx = np.arange(0, n, 2)
        b_idx = a_idx + 1
    a = x[..., a_idx].copy()
    b = x[..., b_idx].copy()
    x[..., a_idx] = a * cos - b * sin
    x[..., b_idx] = a * sin + b * cos
    return x


# --------------------------------------------------------------------------------------------
# sizing (Causal.Init)
# --------------------------------------------------------------------------------------------

def ref_sizing(*, max_seqs: int, capacity: int, max_batch: int, cache_padding: int = 1,
               swa_window: Optional[int] = None, swa_memory: Optional[int] = None):
    """``(n_cells, window, memory)``; window / memory are ``math.inf`` when unlimited.

    Raises ValueError when the memory ends up smaller than the window (Init panics there).
    """
    window = INF if swa_window is None else swa_window
    memory = window if swa_memory is None else swa_memory
    if memory != INF and max_seqs > 1:
        memory = max(memory, window + 1)
    if memory >= capacity:
        memory = INF
    if memory < window:
        raise ValueError("swa_memory smaller than swa_window")
    if memory == INF:
        cells = max_seqs * capacity
    else:
        cells = max_seqs * memory + max_batch
    return round_up(cells, cache_padding), window, memory


# --------------------------------------------------------------------------------------------
# the cache model
# --------------------------------------------------------------------------------------------

class RefCausal:
    """Metadata model of causal.go. Each live cell is a uid with a position, a set of sequences
    and the total rotary delta its key has received since it was put (``shift``)."""

    def __init__(self, *, max_seqs: int, capacity: int, max_batch: int, cache_padding: int = 1,
                 mask_batch_padding: int = 1, swa_window: Optional[int] = None,
                 swa_memory: Optional[int] = None, chunk_size: Optional[int] = None,
                 has_shift: bool = True):
        self.n_cells, self.window, self.memory = ref_sizing(
            max_seqs=max_seqs, capacity=capacity, max_batch=max_batch,
            cache_padding=cache_padding, swa_window=swa_window, swa_memory=swa_memory)
        self.max_seqs = max_seqs
        self.max_batch = max_batch
        self.cache_padding = cache_padding
        self.mask_batch_padding = mask_batch_padding
        self.chunk = chunk_size or 0
        self.has_shift = has_shift
        self.layout: List[Optional[int]] = [None] * self.n_cells
        self.pos: Dict[int, int] = {}
        self.seqs: Dict[int, Set[int]] = {}
        self.shift: Dict[int, int] = {}
        self.exact = True          # layout known exactly (false after any defrag)
        self.defrags = 0
        self.batch_pos: List[int] = []
        self.batch_seq: List[int] = []
        self.batch_uid: List[int] = []
        self.loc = 0
        self.lo = 0
        self.hi = 0
        self.except_: Set[int] = set()

    # ---- helpers -------------------------------------------------------------------------
    def snapshot(self):
        return (list(self.layout), dict(self.pos), {u: set(s) for u, s in self.seqs.items()},
                dict(self.shift), self.exact, self.defrags)

    def restore(self, snap) -> None:
        layout, pos, seqs, shift, exact, defrags = snap
        self.layout, self.pos, self.seqs, self.shift = list(layout), dict(pos), \
            {u: set(s) for u, s in seqs.items()}, dict(shift)
        self.exact, self.defrags = exact, defrags

    def _free(self, uid: int) -> None:
        self.layout[self.layout.index(uid)] = None
        del self.pos[uid], self.seqs[uid], self.shift[uid]

    def _drop(self, uid: int, seq: int) -> None:
        self.seqs[uid].discard(seq)
        if not self.seqs[uid]:
            self._free(uid)

    def uids_of(self, seq: int) -> List[int]:
        return sorted(u for u, s in self.seqs.items() if seq in s)

    def positions(self, seq: int) -> List[int]:
        return sorted(self.pos[u] for u in self.uids_of(seq))

    def pos_min(self, seq: int) -> int:
        p = self.positions(seq)
        return p[0] if p else -1

    def pos_max(self, seq: int) -> int:
        p = self.positions(seq)
        return p[-1] if p else -1

    def live_seqs(self) -> Set[int]:
        out: Set[int] = set()
        for s in self.seqs.values():
            out |= s
        return out

    def n_used(self) -> int:
        return len(self.pos)

    def cell_of(self, uid: int) -> int:
        return self.layout.index(uid)

    # ---- forward pass --------------------------------------------------------------------
    def _slide(self, positions: Sequence[int], seqs: Sequence[int]) -> None:
        """updateSlidingWindow's eviction: batch sequences by their lowest batch position,
        every other stored sequence by its highest stored position + 1."""
        if self.memory == INF:
            return
        lowest: Dict[int, int] = {}
        for p, s in zip(positions, seqs):
            lowest[s] = min(lowest.get(s, p), p)
        for s in self.live_seqs():
            if s not in lowest:
                lowest[s] = self.pos_max(s) + 1
        for s, low in lowest.items():
            for u in self.uids_of(s):
                if self.pos[u] < low - self.memory:
                    self._drop(u, s)

    def _first_fit(self, n: int) -> Optional[int]:
        start, count = 0, 0
        for i, u in enumerate(self.layout):
            if u is None:
                count += 1
                if count >= n:
                    return start
            else:
                start, count = i + 1, 0
        return None

    def defrag(self) -> None:
        """Pack the used cells at the front (llama.cpp's old order: each hole takes the last
        used cells in ascending order). Any valid order is allowed to numbakv, so the layout
        is no longer exact afterwards."""
        used = [u for u in self.layout if u is not None]
        layout = list(self.layout)
        n_used = len(used)
        i0 = 0
        while i0 < n_used:
            if layout[i0] is not None:
                i0 += 1
                continue
            nh = 1
            while i0 + nh < n_used and layout[i0 + nh] is None:
                nh += 1
            tail = [i for i in range(len(layout) - 1, i0, -1)
                    if layout[i] is not None and i >= n_used][:nh]
            tail.sort()
            for k, src in enumerate(tail):
                layout[i0 + k] = layout[src]
                layout[src] = None
            i0 += nh
        self.layout = layout
        self.exact = False
        self.defrags += 1

    def start_forward(self, positions: Sequence[int], seqs: Sequence[int],
                      uids: Sequence[int]) -> None:
        """Place a batch (raises RefFull and changes nothing when it does not fit)."""
        snap = self.snapshot()
        positions, seqs = [int(p) for p in positions], [int(s) for s in seqs]
        self._slide(positions, seqs)
        loc = self._first_fit(len(positions))
        if loc is None:
            self.defrag()
            loc = self._first_fit(len(positions))
        if loc is None:
            self.restore(snap)
            raise RefFull()
        # the get() range: cells of the batch's sequences it may attend to, then the new cells
        idx: List[int] = []
        batch_set = set(seqs)
        lowest = {}
        for p, s in zip(positions, seqs):
            lowest[s] = min(lowest.get(s, p), p)
        for i, u in enumerate(self.layout):
            if u is None:
                continue
            for s in self.seqs[u] & batch_set:
                if self.memory == INF or self.pos[u] >= lowest[s] - self.window:
                    idx.append(i)
        for k, (p, s, u) in enumerate(zip(positions, seqs, uids)):
            self.layout[loc + k] = u
            self.pos[u] = p
            self.seqs[u] = {s}
            self.shift[u] = 0
            idx.append(loc + k)
        self.loc = loc
        self.lo = round_down(min(idx), self.cache_padding)
        self.hi = round_up(max(idx) + 1, self.cache_padding)
        self.batch_pos, self.batch_seq, self.batch_uid = positions, seqs, list(uids)
        self.except_ = set()

    def visible(self, uid: int, i: int) -> bool:
        """Whether batch token ``i`` attends to live cell ``uid`` (buildMask's rules)."""
        s, p = self.batch_seq[i], self.batch_pos[i]
        if s not in self.seqs[uid]:
            return False
        q = self.pos[uid]
        if i not in self.except_ and q > p:
            return False
        if self.chunk and q < p - p % self.chunk:
            return False
        if q < p - self.window:
            return False
        return True

    def visible_uids(self, i: int) -> List[int]:
        return sorted(u for u in self.pos if self.visible(u, i))

    def mask(self) -> np.ndarray:
        """``[round_up(batch, mask_batch_padding), hi - lo]`` float32 mask (exact layout)."""
        rows = round_up(len(self.batch_pos), self.mask_batch_padding)
        m = np.full((rows, self.hi - self.lo), NEG_INF, dtype=np.float32)
        for i in range(len(self.batch_pos)):
            for j in range(self.lo, self.hi):
                u = self.layout[j]
                if u is not None and self.visible(u, i):
                    m[i, j - self.lo] = 0.0
        return m

    def set_causal(self, except_) -> None:
        self.except_ = set() if except_ is None else {int(i) for i in except_}

    # ---- Ollama's management calls --------------------------------------------------------
    def remove(self, seq: int, begin: int, end: Optional[int] = None) -> None:
        stop = INF if end is None else end
        mine = self.uids_of(seq)
        keeps = [u for u in mine if not (begin <= self.pos[u] < stop)]
        moving = [u for u in keeps if self.pos[u] >= stop]
        if any(len(self.seqs[u]) > 1 for u in moving):
            raise RefNotSupported("shifting shared cells")
        if end is not None and keeps and not self.has_shift:
            raise RefNotSupported("no shift function")
        for u in mine:
            if begin <= self.pos[u] < stop:
                self._drop(u, seq)
        if end is not None:
            for u in moving:
                self.pos[u] += begin - end
                self.shift[u] += begin - end

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        for u in list(self.pos):
            if dst in self.seqs[u]:
                self.seqs[u].discard(dst)
            if src in self.seqs[u] and self.pos[u] < length:
                self.seqs[u].add(dst)
            if not self.seqs[u]:
                self._free(u)

    def can_resume(self, seq: int, pos: int) -> bool:
        if self.memory == INF:
            return True
        p = self.positions(seq)
        if not p:
            return False
        return max(0, pos - self.window) >= p[0] and pos <= p[-1] + 1

    # ---- llama.cpp's sequence operations --------------------------------------------------
    def seq_rm(self, seq: int, p0: int = 0, p1: Optional[int] = None) -> bool:
        stop = INF if p1 is None else p1
        for u in list(self.pos):
            if p0 <= self.pos[u] < stop:
                if seq == -1:
                    self._free(u)
                elif seq in self.seqs[u]:
                    self._drop(u, seq)
        return True

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: Optional[int] = None) -> None:
        stop = INF if p1 is None else p1
        if src == dst:
            return
        for u in self.pos:
            if src in self.seqs[u] and p0 <= self.pos[u] < stop:
                self.seqs[u].add(dst)

    def seq_keep(self, seq: int) -> None:
        for u in list(self.pos):
            if seq in self.seqs[u]:
                self.seqs[u] = {seq}
            else:
                self._free(u)

    def _moving(self, seq: int, p0: int, p1: Optional[int], d: int = 0) -> List[int]:
        stop = INF if p1 is None else p1
        moving = [u for u in self.uids_of(seq) if p0 <= self.pos[u] < stop]
        # seq_div (d > 1) leaves position 0 in place: a shared cell there does not move
        if any(len(self.seqs[u]) > 1 and not (d and self.pos[u] // d == self.pos[u])
               for u in moving):
            raise RefNotSupported("moving shared cells")
        return moving

    def seq_add(self, seq: int, p0: int, p1: Optional[int], delta: int) -> None:
        moving = self._moving(seq, p0, p1)
        for u in moving:
            self.pos[u] += delta
            self.shift[u] += delta
            if self.pos[u] < 0:
                self._free(u)

    def seq_div(self, seq: int, p0: int, p1: Optional[int], d: int) -> None:
        moving = self._moving(seq, p0, p1, d)
        for u in moving:
            new = self.pos[u] // d
            self.shift[u] += new - self.pos[u]
            self.pos[u] = new


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------

def attention_ref(q, k, v, mask) -> np.ndarray:
    """``q [b, H, D]``, ``k [n, H, D]``, ``v [n, H, Dv]``, additive ``mask [b, n]`` ->
    ``[b, H, Dv]`` (float64)."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    scores = np.einsum("bhd,nhd->bhn", q, k) / math.sqrt(q.shape[-1])
    scores = scores + np.asarray(mask, np.float64)[:, None, :]
    scores -= scores.max(axis=-1, keepdims=True)
    w = np.exp(scores)
    w /= w.sum(axis=-1, keepdims=True)
    return np.einsum("bhn,nhd->bhd", w, v)


# --------------------------------------------------------------------------------------------
# driving a cache through its public API only (no numbakv import here)
# --------------------------------------------------------------------------------------------

def to_host(x) -> np.ndarray:
    """A host copy of what ``get()`` returned: numpy / CuPy arrays, or bfloat16 views (their
    ``.bits``, uint16)."""
    if hasattr(x, "bits"):
        x = x.bits
    if not isinstance(x, np.ndarray) and hasattr(x, "get"):
        x = x.get()
    return np.array(x, copy=True)


def to_device(x: np.ndarray, device: str):
    if device == "cuda":
        import cupy
        return cupy.asarray(x)
    return x


def bf16_bits(x) -> np.ndarray:
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16)


def bf16_to_f32(bits) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 data in a storage dtype (uint16 bit patterns for bfloat16)."""
    if dtype == "bfloat16":
        return bf16_bits(x)
    return np.asarray(x, dtype=np.float32).astype(dtype)


def from_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_to_f32(x)
    return np.asarray(x, dtype=np.float32)


def enc_key(seqs, positions, layer: int, n_heads: int, head_dim: int) -> np.ndarray:
    """Keys that say whose they are: ``[b, h, :] = (seq, pos, layer, h*16 + 3, h*16 + 4, ...)``.
    Small integers, so exact in float16 and bfloat16."""
    b = len(seqs)
    k = np.empty((b, n_heads, head_dim), np.float32)
    for h in range(n_heads):
        k[:, h, :] = h * 16 + np.arange(head_dim, dtype=np.float32)
    k[:, :, 0] = np.asarray(seqs, np.float32)[:, None]
    if head_dim > 1:
        k[:, :, 1] = np.asarray(positions, np.float32)[:, None]
    if head_dim > 2:
        k[:, :, 2] = layer
    return k


def enc_value(seqs, positions, layer: int, n_heads: int, v_head_dim: int) -> np.ndarray:
    return -(enc_key(seqs, positions, layer, n_heads, v_head_dim) + 0.5)


def decode_row(key_row) -> tuple:
    """``(seq, pos)`` of a key row written with ``enc_key`` ``[n_heads, head_dim]``."""
    return int(key_row[0, 0]), int(key_row[0, 1])


def mask_from_text(text: str) -> np.ndarray:
    """``"0x0/00x"`` -> rows of 0 (visible) and -inf (masked)."""
    rows = [r for r in text.replace(" ", "").split("/")]
    return np.array([[0.0 if c == "0" else NEG_INF for c in r] for r in rows], np.float32)


class AddShift:
    """An exactly invertible shift callable: adds the delta to every element of the key (what
    Ollama's own tests use). Records ``(layer, n_rows, deltas)`` for each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, layer, key_view, deltas):
        d_host = to_host(deltas).astype(np.int64).reshape(-1)
        self.calls.append((int(layer), int(key_view.shape[0]), d_host))
        d = deltas
        if not isinstance(key_view, np.ndarray):       # CuPy storage
            import cupy
            d = cupy.asarray(to_host(deltas))
        else:
            d = to_host(deltas)
        return key_view + d.reshape(-1, 1, 1).astype(key_view.dtype)


class Batch:
    """What one forward pass saw: per layer host copies of K ``[n, H, D]``, V ``[n, H, Dv]``
    (un-permuted) and the mask (float32), plus ``cell_range()``."""

    def __init__(self, keys, values, masks, cell_range, dtype):
        self.keys, self.values, self.masks = keys, values, masks
        self.lo, self.hi = cell_range
        self.dtype = dtype

    @property
    def range(self):
        return (self.lo, self.hi)

    @property
    def mask(self):
        return self.masks[0]

    def k(self, layer=0):
        return from_storage(self.keys[layer], self.dtype)

    def v(self, layer=0):
        return from_storage(self.values[layer], self.dtype)

    def rows(self, layer=0):
        """Decoded ``(seq, pos)`` of every returned row (meaningless for free cells)."""
        k = self.k(layer)
        return [decode_row(k[r]) for r in range(k.shape[0])]


def read_get(cache, n_layers: int, dtype: str, permuted_v: bool):
    keys, values, masks = [], [], []
    for layer in range(n_layers):
        cache.set_layer(layer)
        k, v, m = cache.get()
        k, v, m = to_host(k), to_host(v), to_host(m)
        if permuted_v:
            v = np.ascontiguousarray(v.transpose(2, 0, 1))
        keys.append(k)
        values.append(v)
        masks.append(m)
    return keys, values, masks


def forward(cache, positions, seqs, *, keys=None, values=None, except_=None,
            reserve: bool = False) -> Batch:
    """start_forward, then per layer put (+ get). ``keys``/``values``: ``[L, b, H, D]`` float32
    data (default: ``enc_key``/``enc_value``)."""
    cfg = cache.config
    dev = cache.device
    cache.start_forward(list(positions), list(seqs), reserve=reserve)
    if except_ is not None:
        cache.set_causal(except_)
    for layer in range(cfg.n_layers):
        cache.set_layer(layer)
        k = enc_key(seqs, positions, layer, cfg.n_kv_heads, cfg.head_dim) if keys is None \
            else keys[layer]
        v = enc_value(seqs, positions, layer, cfg.n_kv_heads, cfg.v_head_dim) if values is None \
            else values[layer]
        cache.put(to_device(to_storage(k, cfg.dtype), dev),
                  to_device(to_storage(v, cfg.dtype), dev))
    got = read_get(cache, cfg.n_layers, cfg.dtype, cfg.permuted_v)
    return Batch(*got, cache.cell_range(), cfg.dtype)


def state_snapshot(cache, max_seqs: Optional[int] = None):
    """Everything observable without changing the cache: each sequence's (min, max) position
    and the K/V data of every cell (read through a reserve pass, which changes no metadata)."""
    cfg = cache.config
    n = cfg.max_seqs if max_seqs is None else max_seqs
    spans = [(cache.seq_pos_min(s), cache.seq_pos_max(s)) for s in range(n)]
    cache.start_forward([0], [0], reserve=True)
    keys, values, _ = read_get(cache, cfg.n_layers, cfg.dtype, cfg.permuted_v)
    return spans, keys, values


def assert_same_state(a, b) -> None:
    spans_a, keys_a, values_a = a
    spans_b, keys_b, values_b = b
    assert spans_a == spans_b, f"sequence spans changed: {spans_a} -> {spans_b}"
    for layer, (x, y) in enumerate(zip(keys_a, keys_b)):
        assert x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8)), \
            f"keys of layer {layer} changed"
    for layer, (x, y) in enumerate(zip(values_a, values_b)):
        assert x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8)), \
            f"values of layer {layer} changed"
