"""A decode step that replays as a CUDA graph: :meth:`numbakv.CausalCache.capture_step`.

A CUDA graph freezes its kernels' launch arguments, so a graph of an ordinary ``put`` would
write every replay's tokens into the cells of the first one. A :class:`DecodeStep` instead gives
the captured kernels inputs that sit in device buffers at fixed addresses, owned by the step
and kept for its lifetime:

* ``descriptor``: int32 ``[HEADER + 3 * batch]`` (:data:`HEADER` = 4), the *step descriptor*:
  ``[n_tokens, start, batch, 0, slots[batch], positions[batch], seqs[batch]]``. The put kernel
  reads its slots from ``slots`` (slot list mode: a token whose slot is -1 writes nothing, so a
  step captured for ``batch`` tokens replays with any ``n_tokens <= batch``); positions and
  sequence ids travel beside them for kernels that need them. No kernel of the graph has a start
  slot or a length among its launch arguments.
* ``key``/``value``: the step's inputs, ``[n_stored_layers, batch, n_kv_heads, head_dim]`` and
  ``[n_stored_layers, batch, n_kv_heads, v_head_dim]`` in the storage dtype (a model may write
  its K/V straight into them and pass ``k=None, v=None`` to :meth:`DecodeStep.replay`).

:meth:`DecodeStep.replay` does the host half of a decode step -- ``start_forward`` (the cell
table's bookkeeping, and any pending key rotation or defrag, launched eagerly on the cache's
stream), the descriptor written into a pinned host buffer and sent by one ``cudaMemcpyAsync``,
the caller's K/V copied into the fixed inputs -- then launches the graph: one put per stored
layer, all reading the descriptor. Everything is queued on the cache's stream in that order.

An engine that captures its own graph (the whole model) instead calls :meth:`DecodeStep.put`
per layer inside its capture, on the cache's stream, and :meth:`DecodeStep.prepare` before each
replay of its graph: the same descriptor-reading put, launched where the engine wants it.

**Attention in the step** (``capture_step(attend=True, n_heads=..., scale=..., soft_cap=...)``):
each stored layer's put is followed by numbakv's batched paged decode attention
(:mod:`numbakv.kernels.decode`) of the fixed queries ``query`` (float32 ``[n_stored_layers,
batch, n_heads, head_dim]``) over that layer, written into ``output`` (float32 ``[...,
v_head_dim]``) and ``lse``. Every per-pass input of the kernel sits at a fixed address: the
descriptor grows by the split-K part length, each token's batch sequence, the CSR list pointers
(``kv_indptr``, two spare entries so that tokens past ``n`` read an empty list and write zeros)
and the causal flags; the page lists live in ``kv_indices`` / ``kv_positions``, room for
``n_cells x min(batch, max_seqs)`` entries (the most a pass can list). A decode replay whose
lists just grow (the same batch sequences in the same order, new positions above each list's
last one, the cell table changed only by the replays' placements and by window pruning that
dropped only cells the window already cut from the lists' fronts since the lists were built)
sends the new cells, the front drops of a window or chunks and the new list pointers in its
descriptor, and two launches at the head of the graph grow the lists on the device (into
scratch lists, then back): no page table of the pass is built on the host, so a sliding-window
decode replay stays O(batch) on the host once its window prunes. Otherwise (first replay, a
sequence operation, a defrag, a shift, other batch sequences) the
pass's page table is built (or extended on the device) by ``page_table()``'s machinery on the
cache's stream and copied into the fixed lists by two device-to-device copies. The grid cannot follow the lengths, so it
is sized once for a fixed number of split-K parts (what the kernel's planner gives the batch on
this GPU); the part length is read on the device (the longest list cut in that many parts), the
parts past a token's run exit at once, and the merge kernel is part of the graph. Window,
chunks, GQA, float16 / bfloat16 / float32 are those of the kernel; ``scale`` and ``soft_cap``
are fixed at capture. An engine capturing its own graph calls :meth:`DecodeStep.attend` per
layer after :meth:`DecodeStep.put`.

No host waits: a replay (or ``prepare``) makes no stream, event or device synchronisation and no
device-to-host copy; numbakv counts every host wait it makes in
:data:`numbakv.device.HOST_WAITS` (the one a step may make: the pinned descriptor ring waiting
for a GPU :data:`PINNED_RING` replays behind), and the tests check that replays add none.

On ``cpu`` and ``sim`` there is no graph to capture; the step records the same launches (the
CPU twin, or the real kernel in the simulator) reading the same descriptor array, and
:meth:`DecodeStep.replay` runs them: the results, the validation and the error behaviour are
those of the GPU path, so code written against a step runs unchanged on every device (the
attention on ``cpu`` is :func:`numbakv.attention.attend`'s CPU kernel).

Quantized K/V (each quantized side among :data:`CAPTURED_QUANT_TYPES`, formats may differ;
rotated ``kv_rotation`` included): a quantized side's put is its quantize kernel
(``quant_put``, or the row-per-thread rotating form) reading the descriptor's slots, and the
attention dequantizes as it reads (per-layer float8 scales and the rotations fixed at capture).
A cache with one quantized side and one float side (llama.cpp's ``-ctk q8_0 -ctv f16``) stores
its float side by the put kernel with the quantized side's arguments zero-width (no blocks for
them): one launch per side, both reading the slots.

V stored permuted (``permuted_v``, ``[n_layers, n_kv_heads, v_head_dim, n_cells]``): the put
kernel writes it as the eager put does, and the paged attention kernel reads it through the
transposed view ``[n_cells, n_kv_heads, v_head_dim]``'s strides (its array arguments are
strided; no copy, no other code). Consecutive threads then read one value of consecutive
dims of a cell, ``n_cells`` elements apart (not one coalesced row); each thread's next cells
sit in the same cache lines, so the bytes read stay those of the rows (a GPU figure is still
to measure).

A V-less MLA latent cache (``v_head_dim=0``): the put stores the latent rows (the value input
is zero-width and gets no blocks), and the attention is MLA's absorbed form as
:func:`numbakv.attention.attend` computes it: scores over the whole latent row, the value read
as the first ``v_dim`` values of the same row (a strided view of the K pool in K's format:
float, or whole q8_0 / q4_0 blocks, or float8 bytes; a rotated latent turned back in K's
blocks), output ``[.., n_heads, v_dim]``. It runs as one launch of the latent kernel
(:func:`numbakv.kernels.decode.launch_latent`): a block stages each tile of latent rows in shared
memory once for a tile of up to 8 query heads (DeepSeek's 16-128 heads: 2-16 tiles, consecutive
blocks reading the same rows), not a launch per range of heads. FlashMLA's ``fp8_ds_mla`` rows
(656 bytes: 512 float8_e4m3 values in four tiles of 128 with a float32 scale each, 64 bfloat16
rope values): the put is FlashMLA's quantizer (:mod:`numbakv.kernels.mla`) reading the
descriptor's slots, byte-exact with the eager put, and the latent kernel dequantizes each value
as it stages the rows (a tile's byte times its scale, the rope values widened): one latent head
a cell (several KV heads: the put only).

llama.cpp's per-sequence streams (``unified=False``, a :class:`numbakv.streams.StreamCache`):
the descriptor's slots are pool cells (each token's stream offset plus the cell its stream
placed it in), and the attention's page lists are the pass's page table over the pool (each
stream's cells offset into it), grown on the device as above while every batch stream's own
cell table changed only by the replays' placements.

A :class:`numbakv.WrapperCache` (a cache per layer group, e.g. Gemma 3's sliding-window and
full-attention layers) is captured as a :class:`WrapperStep`: one step per group cache (each
group has its own cell table, so its own descriptor, lists and graph), replayed together after
the wrapper's all-or-nothing ``start_forward``, ``put`` / ``attend`` routed by model layer.

Not captured (``NotSupportedError`` at :meth:`~numbakv.CausalCache.capture_step`): with
attention, shapes the kernels do not take (more than 16 query heads per KV head, or group x
head_dim > 2048, with several KV heads; ``fp8_ds_mla`` rows of several KV heads).
With one KV head (MQA, or a latent too wide for the latent kernel's tiles) a larger group runs
as several launches of at most that many heads, each reading the layer's listed rows again:
correct, but that many times the bytes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from ._jit import njit
from .device import as_array, host_wait
from ._inputs import UNLIMITED, check_index
from .config import DS_MLA, latent_value_width, row_bytes
from .errors import KVCacheError, NotSupportedError
from . import pages as _pages
from .kernels import decode as _decode
from .kernels import mla as _mla
from .kernels import put as _put
from .kernels import quant as _quant
from .kernels._common import Desc

#: int32 entries before the slots: n_tokens, start, batch, 0 (16 bytes: the slots start aligned)
HEADER = 4
#: pinned host descriptors in flight: a replay refills the one whose copy ran longest ago, and
#: waits for that copy only when the GPU is this many replays behind
PINNED_RING = 4
#: quantized K/V formats a step captures: their quantize kernels take a slot list with -1
#: skipped, and the paged attention kernel reads them as stored (FlashMLA's ``fp8_ds_mla``
#: latent rows: the latent kernel, V-less caches only)
CAPTURED_QUANT_TYPES = ("q8_0", "q4_0", "float8_e4m3", "fp8_ds_mla")
#: cudaMemcpyHostToDevice, cudaMemcpyDeviceToDevice
_H2D, _D2D = 1, 3
_NO_SCOPE = contextlib.nullcontext()


@njit(cache=True)
def fill_descriptor(host, pos, seqs, start, batch):
    """The step descriptor (see the module docstring) of ``n = len(pos)`` tokens placed at
    cells ``start ..`` into ``host`` (int32 ``[HEADER + 3 * batch]``), -1 past ``n``; one
    compiled pass instead of a dozen numpy slice assignments per replay."""
    n = pos.shape[0]
    host[0] = n
    host[1] = start
    host[2] = batch
    host[3] = 0
    for t in range(batch):
        if t < n:
            host[HEADER + t] = start + t
            host[HEADER + batch + t] = pos[t]
            host[HEADER + 2 * batch + t] = seqs[t]
        else:
            host[HEADER + t] = -1
            host[HEADER + batch + t] = -1
            host[HEADER + 2 * batch + t] = -1


#: The attention a captured step runs on ``cpu``, where there is no CUDA kernel to launch:
#: :func:`numbakv.attention.attend`, registered by the package facade (``numbakv/__init__``),
#: which imports it on first use: the attention layer sits above the caches and this module
#: (DESIGN.md's layer table), so this module never imports it.
_CPU_ATTEND: Optional[Callable[..., Any]] = None


def register_cpu_attend(fn: Callable[..., Any]) -> None:
    """Set the function a ``cpu`` step's attention runs (``attend(q, cache, scale=, soft_cap=)``
    returning ``[n, n_heads, v_head_dim]``); ``import numbakv`` registers
    :func:`numbakv.attention.attend`."""
    global _CPU_ATTEND
    _CPU_ATTEND = fn


def cpu_attend() -> Callable[..., Any]:
    """The registered CPU attention (importing :mod:`numbakv` registers it)."""
    if _CPU_ATTEND is None:
        raise KVCacheError("a cpu decode step with attention needs numbakv.attention imported "
                           "(`import numbakv` does it)")
    return _CPU_ATTEND


@njit(cache=True)
def fill_attention(host, kv_indptr, qo_indptr, token_order, causal_in, causal_out, n, batch,
                   tok_at, indptr_at, plen_at, parts, min_part, unit):
    """The attention fields of the step descriptor (see :meth:`DecodeStep._fill_attention`):
    ``kv_indptr`` int32 ``[n_b + 1]`` then ``n_b`` again up to ``batch + 2`` entries (empty
    lists), token ``t``'s batch sequence (``n_b`` -- an empty list -- past ``n``), the causal
    flags (1 past ``n``) and the part length: the longest list cut in ``parts``, rounded up to
    ``unit`` cells, at least ``min_part``."""
    nb = kv_indptr.shape[0] - 1
    nnz = kv_indptr[nb]
    longest = 0
    for b in range(nb + 1):
        host[indptr_at + b] = kv_indptr[b]
        if b < nb:
            longest = max(longest, kv_indptr[b + 1] - kv_indptr[b])
    for b in range(nb + 1, batch + 2):
        host[indptr_at + b] = nnz
    for t in range(batch):
        host[tok_at + t] = nb
        causal_out[t] = 1
    for b in range(nb):
        for k in range(qo_indptr[b], qo_indptr[b + 1]):
            host[tok_at + token_order[k]] = b
    for t in range(n):
        causal_out[t] = causal_in[t]
    plen = (longest + parts - 1) // parts
    plen = (plen + unit - 1) // unit * unit
    host[plen_at] = max(min_part, plen)


@njit(cache=True)
def append_lists(host, n, causal_in, causal_out, batch, max_seqs, window, chunk, state_seq,
                 state_indptr, state_first, state_last, meta, at, parts, min_part, unit,
                 pruned):
    """A decode step's page lists as the previous replay's, each grown by its sequence's new
    cells (and, with a window or chunks, cut at the front): the attention fields of the
    descriptor ``host`` for the captured list extension (see :meth:`DecodeStep._send`), in one
    compiled O(batch) pass. The tokens' cells are the descriptor's slots (already written);
    ``at`` int64 ``[8]``: where the token -> sequence, ``kv_indptr``, part length, previous
    ``kv_indptr``, front drops, token groups, new cells and new positions go.

    The state (``state_*`` ``[batch + 2]``: the previous lists' sequence ids, CSR pointers,
    first and last positions; ``meta`` ``[n_lists, contiguous]``) is updated only on success.
    Returns False, with the state untouched, where the lists do not just grow: other batch
    sequences or another order, a new position not above its list's last one, a window /
    chunk over a list whose positions are not one run (where its front ends is unknown), or a
    cell the pass's window pruning dropped that its list still holds: ``pruned`` int64 ``[k,
    2]`` (sequence, position) of each cell sequence dropped; one of a listed sequence must lie
    before that list's new front (the window's memory is at least the window, so pruning only
    drops cells the window already cut from the list's front; the list then stays valid, the
    freed cells reused by the placement appearing as new cells)."""
    tok_at, ip_at, plen_at, prev_at, drop_at, qo_at, addc_at, addp_at = \
        at[0], at[1], at[2], at[3], at[4], at[5], at[6], at[7]
    pos_at = HEADER + batch
    seq_at = HEADER + 2 * batch
    nbp = meta[0]
    # group the tokens by sequence, in order of first appearance (as the page table does)
    slot = np.full(max_seqs, -1, np.int64)
    group = np.empty(n, np.int64)
    counts = np.zeros(n + 1, np.int64)
    nb = 0
    for t in range(n):
        s = host[seq_at + t]
        if slot[s] < 0:
            if nb >= nbp or state_seq[nb] != s:
                return False
            slot[s] = nb
            nb += 1
        group[t] = slot[s]
        counts[slot[s] + 1] += 1
    if nb != nbp:
        return False
    qo = np.zeros(nb + 1, np.int64)
    for b in range(nb):
        qo[b + 1] = qo[b] + counts[b + 1]
    order = np.empty(n, np.int64)       # tokens grouped, each group by position
    fill = qo[:nb].copy()
    for t in range(n):
        b = group[t]
        k = fill[b]
        fill[b] += 1
        p = host[pos_at + t]
        while k > qo[b] and host[pos_at + order[k - 1]] > p:     # insertion: groups are tiny
            order[k] = order[k - 1]
            k -= 1
        order[k] = t
    windowed = window >= 0 or chunk > 0
    if windowed and meta[1] == 0:
        return False
    drop = np.zeros(nb, np.int64)
    for b in range(nb):
        if host[pos_at + order[qo[b]]] <= state_last[b]:
            return False
        if windowed:
            lo = np.int64(1) << 62
            for k in range(qo[b], qo[b + 1]):
                p = np.int64(host[pos_at + order[k]])
                v = np.int64(0)
                if window >= 0:
                    v = max(v, p - window)
                if chunk > 0:
                    v = max(v, p - p % chunk)
                lo = min(lo, v)
            prev_len = state_indptr[b + 1] - state_indptr[b]
            drop[b] = min(max(lo - state_first[b], 0), prev_len)
    for r in range(pruned.shape[0]):
        s = pruned[r, 0]
        if s < 0 or s >= max_seqs:
            return False
        b = slot[s]
        if b < 0:
            continue        # not listed (the batch's sequences are the lists')
        prev_len = state_indptr[b + 1] - state_indptr[b]
        if meta[1] == 0 or pruned[r, 1] >= state_first[b] + drop[b] and drop[b] < prev_len:
            return False    # a listed cell dropped (or the list's front unknown)
    # the descriptor: previous pointers, drops, groups, new cells / positions, new pointers
    nnz_prev = state_indptr[nb]
    for b in range(batch + 2):
        host[prev_at + b] = state_indptr[b] if b <= nb else nnz_prev
        host[drop_at + b] = drop[b] if b < nb else 0
        host[qo_at + b] = qo[b] if b <= nb else n
    for k in range(batch):
        if k < n:
            host[addc_at + k] = host[HEADER + order[k]]
            host[addp_at + k] = host[pos_at + order[k]]
        else:
            host[addc_at + k] = -1
            host[addp_at + k] = -1
    contiguous = 1
    longest = 0
    total = 0
    for b in range(nb):
        prev_len = state_indptr[b + 1] - state_indptr[b]
        new_len = prev_len - drop[b] + (qo[b + 1] - qo[b])
        first = state_first[b] + drop[b] if drop[b] < prev_len \
            else np.int64(host[pos_at + order[qo[b]]])
        last = np.int64(host[pos_at + order[qo[b + 1] - 1]])
        if last - first + 1 != new_len:
            contiguous = 0
        state_first[b] = first
        state_last[b] = last
        state_indptr[b] = total
        total += new_len
        longest = max(longest, new_len)
        host[ip_at + b] = state_indptr[b]
    state_indptr[nb] = total
    for b in range(nb, batch + 2):
        host[ip_at + b] = total
    meta[1] = contiguous
    for t in range(batch):
        host[tok_at + t] = group[t] if t < n else nb
        causal_out[t] = causal_in[t] if t < n else 1
    plen = (longest + parts - 1) // parts
    plen = (plen + unit - 1) // unit * unit
    host[plen_at] = max(min_part, plen)
    return True


_NONE_PRUNED = np.zeros((0, 2), np.int64)    # a pass whose window pruning dropped nothing


class Attention:
    """What a step captured with attention computes (fixed at capture): ``n_heads`` query
    heads, ``scale`` on ``q . k``, ``soft_cap`` (None: none), ``v_dim`` values per output
    head (the cache's ``v_head_dim``; on a V-less MLA latent cache the latent width: the
    output is the absorbed form's weighted sum of each row's first ``v_dim`` values, as
    :func:`numbakv.attention.attend` defines it) and ``latent`` (whether V is read from K)."""

    __slots__ = ("n_heads", "scale", "soft_cap", "v_dim", "latent", "per_launch",
                 "latent_heads")

    def __init__(self, n_heads: int, scale: float, soft_cap: Optional[float], v_dim: int,
                 latent: bool = False, per_launch: Optional[int] = None,
                 latent_heads: int = 0) -> None:
        self.n_heads = n_heads
        self.scale = scale
        self.soft_cap = soft_cap
        self.v_dim = v_dim
        self.latent = latent
        #: query heads per attention launch: all of them, or with one KV head (MQA, an MLA
        #: latent) whose group is too large for the kernel's tiles, ranges of that many heads
        #: (each launch reads the layer's listed rows again)
        self.per_launch = n_heads if per_launch is None else per_launch
        #: an MLA latent read by the latent kernel (:func:`numbakv.kernels.decode.
        #: launch_latent`, one launch: each staged tile of rows serves this many query heads);
        #: 0: the paged kernel
        self.latent_heads = latent_heads

    def __repr__(self) -> str:
        return (f"Attention(n_heads={self.n_heads}, scale={self.scale}, soft_cap="
                f"{self.soft_cap}, v_dim={self.v_dim}, latent={self.latent}, per_launch="
                f"{self.per_launch}, latent_heads={self.latent_heads})")


class DecodeStep:
    """A captured decode step of a :class:`~numbakv.CausalCache` (see the module docstring).

    Attributes: ``cache``, ``batch`` (most tokens a replay takes), ``layers`` (the model layers
    whose K/V the step stores, in the order of ``key``'s first axis), ``key`` ``[len(layers),
    batch, n_kv_heads, head_dim]`` and ``value`` ``[len(layers), batch, n_kv_heads, v_head_dim]``
    (the fixed input buffers, storage dtype), ``descriptor`` (int32 ``[4 + 3 * batch]``, device
    memory on ``cuda``), ``graph`` (the CuPy graph on ``cuda``, None elsewhere), ``replays``.
    """

    def __init__(self, cache: Any, batch: int, attention: Optional["Attention"] = None,
                 split: Optional[Tuple[int, int]] = None) -> None:
        storage = cache.storage
        cfg = cache.config
        self.cache = cache
        self.batch = int(batch)
        self.device = storage.device
        self.layers: Tuple[int, ...] = tuple(cfg.owner_layers)
        self.replays = 0
        self.graph = None
        self.attention = attention
        # llama.cpp's per-sequence streams (unified=False): the slots are the pool's cells of
        # each token's stream, each page list follows its own stream's cell table
        self._per_stream = not cfg.unified
        self._user_plans: dict = {}   # put(): one launch plan per (layer, input addresses)
        xp = storage.xp
        n_layers = len(self.layers)
        sdt = cfg.storage_dtype
        H = cfg.local_kv_heads
        self._storage = storage
        self._scope = storage._on_device
        self._slots_at = HEADER
        self._pos_at = HEADER + self.batch
        self._seq_at = HEADER + 2 * self.batch
        size = HEADER + 3 * self.batch
        if attention is not None:
            # the attention's per-pass fields travel in the same descriptor (one copy a replay)
            self._plen_at = size
            self._tok_at = size + 1
            self._indptr_at = self._tok_at + self.batch
            self._causal_at = self._indptr_at + self.batch + 2
            # the list extension's inputs (:func:`append_lists`): previous pointers, front
            # drops, token groups (batch + 2 each), new cells and positions, zero drops
            self._prev_at = self._causal_at + (self.batch + 3) // 4
            self._drop_at = self._prev_at + self.batch + 2
            self._qo_at = self._drop_at + self.batch + 2
            self._addc_at = self._qo_at + self.batch + 2
            self._addp_at = self._addc_at + self.batch
            self._zero_at = self._addp_at + self.batch
            size = self._zero_at + self.batch + 2
            self._append_at = np.array([self._tok_at, self._indptr_at, self._plen_at,
                                        self._prev_at, self._drop_at, self._qo_at,
                                        self._addc_at, self._addp_at], np.int64)
        self._nbytes = size * 4
        with self._scope():
            self.key = xp.zeros((n_layers, self.batch, H, cfg.head_dim), dtype=sdt)
            self.value = xp.zeros((n_layers, self.batch, H, cfg.v_head_dim), dtype=sdt)
            self.descriptor = xp.full(size, -1, dtype=np.int32) \
                if self.device != "cuda" else xp.zeros(size, dtype=np.int32)
            if attention is not None:
                self._alloc_attention(xp, attention, split)
                self.descriptor[self._zero_at:] = 0
        if self.device == "cuda":
            self._ring: List[list] = []
            self._ring_next = 0
            self._capture()
        else:
            self._host = self.descriptor   # the kernels' descriptor is host memory here
            self._launches = self._record()

    def _alloc_attention(self, xp, att: "Attention", split: Optional[Tuple[int, int]]) -> None:
        """The attention's fixed buffers: queries, outputs and LSE per stored layer, the page
        lists (room for every cell in every batch sequence's list: ``n_cells x
        min(batch, max_seqs)`` entries, the most a pass can list) and the split-K scratch."""
        cfg = self.cache.config
        n_layers, T, H = len(self.layers), self.batch, att.n_heads
        self.query = xp.zeros((n_layers, T, H, cfg.head_dim), np.float32)
        self._lse_scratch = xp.zeros((T, H), np.float32)     # attend(): LSE not returned
        self.output = xp.zeros((n_layers, T, H, att.v_dim), np.float32)
        self.lse = xp.zeros((n_layers, T, H), np.float32)
        # per-sequence streams: each list holds only its own stream's cells, so all the
        # lists together hold at most every cell once
        room = self.cache.n_cells if self._per_stream else \
            self.cache.n_cells * max(1, min(T, self.cache.cells.max_seqs))
        self.kv_indices = xp.zeros(room, np.int32)
        self.kv_positions = xp.zeros(room, np.int32)
        # the extension's output, copied back into the fixed lists by the same kernel
        self._next_indices = xp.zeros(room, np.int32)
        self._next_positions = xp.zeros(room, np.int32)
        # the lists the fixed buffers hold (see _remember_lists): None until a replay built
        # them, or after one that may have stopped half-way
        self._lists_of = None
        T2 = self.batch + 2
        self._st_seq = np.zeros(T2, np.int64)
        self._st_indptr = np.zeros(T2, np.int64)
        self._st_first = np.zeros(T2, np.int64)
        self._st_last = np.zeros(T2, np.int64)
        self._st_meta = np.zeros(2, np.int64)
        if split is None:
            # blocks per split-K part: (token, KV head), or the latent kernel's (token, tile)
            parts = _decode.max_parts(self.device, T * (
                -(-H // att.latent_heads) if att.latent_heads else cfg.local_kv_heads))
            min_part, unit = _decode.MIN_PART, _decode.TILE
        else:      # tests: a forced split-K of small lists
            parts, min_part = (int(x) for x in split)
            unit = min(_decode.TILE, min_part)
        parts = max(1, min(parts, -(-self.cache.n_cells // min_part)))
        self._parts, self._min_part, self._part_unit = parts, min_part, unit
        shape = (parts, T, H, att.v_dim) if parts > 1 else (1, 1, 1, 1)
        self._part_acc = xp.zeros(shape, np.float32)
        self._part_ml = xp.zeros((2,) + shape[:1] + ((T, H) if parts > 1 else (1, 1)),
                                 np.float32)

    def _attention_launches(self, i: int, desc_ptr: Optional[int], q: Any = None,
                            out: Any = None, lse: Any = None
                            ) -> List[Tuple[Callable, dict, tuple]]:
        """``(launcher, kw, args)`` of each launch of stored layer ``i``'s attention (see
        :meth:`_attention_args`; run as ``launcher(*args, **kw)``): an MLA latent's one launch
        of the latent kernel (:attr:`Attention.latent_heads`), or the paged kernel's one, or
        one per range of :attr:`Attention.per_launch` query heads when the group is too large
        for its tiles (one KV head: MQA, a latent the latent kernel does not take), each over
        views of the queries, outputs, LSE and split-K buffers."""
        att = self.attention
        q = self.query[i] if q is None else q
        out = self.output[i] if out is None else out
        lse = self.lse[i] if lse is None else lse
        if att.latent_heads:
            kw, args = self._attention_args(i, desc_ptr, q, out, lse)
            # the latent kernel reads V from K itself: no V pool, nor V's format and scales
            kw = dict(kscale=kw["kscale"], k_rotation=kw["k_rotation"],
                      heads=att.latent_heads)
            return [(_decode.launch_latent, kw, args[:3] + args[4:5] + args[6:])]
        if att.per_launch >= att.n_heads:
            return [(_decode.launch_paged,) + self._attention_args(i, desc_ptr, q, out, lse)]
        launches = []
        for h0 in range(0, att.n_heads, att.per_launch):
            h = slice(h0, min(h0 + att.per_launch, att.n_heads))
            parts = (self._part_acc[:, :, h], self._part_ml[:, :, :, h]) \
                if self._parts > 1 else None
            launches.append((_decode.launch_paged,) + self._attention_args(
                i, desc_ptr, q[:, h], out[:, h], lse[:, h], parts))
        return launches

    def _attention_args(self, i: int, desc_ptr: Optional[int], q: Any = None, out: Any = None,
                        lse: Any = None, parts: Optional[tuple] = None):
        """The launch arguments of stored layer ``i``'s attention (:func:`numbakv.kernels.decode.
        launch_paged`), every per-pass input read from the descriptor and the fixed lists;
        queries, outputs and LSE from the fixed buffers unless given (:meth:`attend`), the
        split-K buffers likewise (``parts``)."""
        storage = self._storage
        att = self.attention
        cfg = self.cache.config
        bf16 = cfg.dtype == "bfloat16"
        T = self.batch

        def field(at, n, dtype=np.int32):
            if desc_ptr is None:
                view = self.descriptor[at:at + (n if dtype == np.int32 else (n + 3) // 4)]
                return view if dtype == np.int32 else view.view(np.uint8)[:n]
            return Desc(desc_ptr + 4 * at, (n,), (np.dtype(dtype).itemsize,), np.dtype(dtype))

        kp, vp = storage.keys[i], storage.values[i]
        if storage.permuted:
            # V stored [n_kv_heads, v_head_dim, n_cells]: the kernel indexes [cell, head, dim]
            # through the view's strides (its arrays are strided, layout 'A')
            vp = vp.transpose(2, 0, 1)
        # a quantized side's uint8 rows in its format; a float side's raw bits
        kq = (_decode.FMT_DS_MLA if storage._k_ds_mla else
              _decode.QUANT_FORMATS[storage._k_fmt]) if storage.k_quantized else None
        vq = _decode.QUANT_FORMATS[storage._v_fmt] if storage.v_quantized else None
        kw = dict(kscale=float(cfg.layer_scales("k")[i]), vscale=float(cfg.layer_scales("v")[i]),
                  k_rotation=int(cfg.k_rotation), v_rotation=int(cfg.v_rotation))
        if att.latent:
            # MLA's absorbed form: V is the first v_dim values of each latent row, a strided
            # view of K in K's format (whole blocks: checked at capture); rotated latents are
            # turned back in K's blocks, as attend() does
            vp, vq = kp[:, :, :_latent_bytes(cfg, att.v_dim)], kq
            kw.update(vscale=kw["kscale"], v_rotation=kw["k_rotation"])
        kr, kf = _decode.raw_pool(kp.view(np.uint16) if bf16 and kq is None else kp,
                                  self.device, kq)
        vr, vf = _decode.raw_pool(vp.view(np.uint16) if bf16 and vq is None else vp,
                                  self.device, vq)
        if bf16:
            kf = _decode.FMT_BF16 if kq is None else kf
            vf = _decode.FMT_BF16 if vq is None else vf
        return kw, (self.device, self.query[i] if q is None else q, kr, vr, kf, vf,
                self.kv_indices, self.kv_positions, field(self._indptr_at, T + 2),
                field(self._tok_at, T), field(self._pos_at, T),
                field(self._causal_at, T, np.uint8),
                -1 if self.cache.swa_window is None else int(self.cache.swa_window),
                int(self.cache.chunk_size or 0), att.scale, att.soft_cap,
                self._parts, 0, field(self._plen_at, 1),
                self.output[i] if out is None else out, self.lse[i] if lse is None else lse,
                *(parts or (self._part_acc, self._part_ml)))

    def _list_launches(self, desc_ptr: Optional[int]) -> List[Any]:
        """The two launches of :func:`numbakv.kernels.decode.extend_lists` that bring the fixed
        lists to this pass (both read every input from the descriptor, the entry count
        included): the previous lists grown by the new cells into the scratch lists, then
        copied back (the same kernel with the new pointers on both sides, no drops). A replay
        that rebuilt the table put the whole lists in place with previous pointers = new
        ones, so both launches copy them unchanged."""
        T = self.batch

        def field(at, n):
            if desc_ptr is None:
                return self.descriptor[at:at + n]
            return Desc(desc_ptr + 4 * at, (n,), (4,), np.dtype(np.int32))

        indptr, qo = field(self._indptr_at, T + 2), field(self._qo_at, T + 2)
        cells, poss = field(self._addc_at, T), field(self._addp_at, T)
        grow = (self.kv_indices, self.kv_positions, field(self._prev_at, T + 2),
                field(self._drop_at, T + 2), indptr, qo, cells, poss, self._next_indices,
                self._next_positions)
        back = (self._next_indices, self._next_positions, indptr, field(self._zero_at, T + 2),
                indptr, qo, cells, poss, self.kv_indices, self.kv_positions)
        return [lambda a=a: _decode.extend_lists(self.device, *a) for a in (grow, back)]

    def _quant_put(self, i: int, key, value, slots) -> None:
        """Stored layer ``i`` of a quantized cache: each quantized side quantized into its rows
        by the quantize kernel (:func:`numbakv.kernels.quant.put_launch`), a float side (one
        quantized side only, e.g. llama.cpp's ``-ctk q8_0 -ctv f16``) copied by the put kernel
        (:meth:`_float_side_put`), both at ``slots`` (the descriptor's: a numpy view on
        cpu/sim, a :class:`Desc` on cuda; -1 skipped), read when the kernel runs."""
        st = self._storage
        cfg = self.cache.config
        on_device = self.device != "cpu"
        for quantized, store, x, fmt, scales, rot in (
                (st.k_quantized, st.keys, key, st._k_fmt, st._k_scales, cfg.k_rotation),
                (st.v_quantized, st.values, value, st._v_fmt, st._v_scales, cfg.v_rotation)):
            if quantized and store is st.keys and st._k_ds_mla:   # FlashMLA's 656-byte rows
                _mla.put_launch(self.device, store, i, x, slots, -1, st.dtype,
                                slots_on_device=on_device)
            elif quantized:
                _quant.put_launch(self.device, store, i, x, slots, -1, fmt, scales, st.dtype,
                                  rot, slots_on_device=on_device)
        if not (st.k_quantized and st.v_quantized) and not cfg.v_less:
            self._float_side_put(i, key, value, slots)

    def _float_side_put(self, i: int, key, value, slots) -> None:
        """The float side of stored layer ``i`` of a cache with one quantized side, by the put
        kernel reading ``slots`` (as :meth:`_quant_put` passes them): the quantized side's
        place in the kernel's arguments holds zero-width views of the float side's own arrays,
        which get no blocks (:func:`numbakv.kernels.put.row_threads`), so one launch copies
        the float side's rows and nothing else. (The eager ``KVStorage`` path stores this side
        by an indexed array copy, whose cells are launch arguments: not replayable.)"""
        st = self._storage
        if not st.k_quantized:
            dst = st._k_layers[i]
            kd, vd, ks, vs, permuted = dst, dst[:, :, :0], key, key[:, :, :0], False
        else:
            dst = st._v_layers[i]
            permuted = st.permuted and self.device != "cpu"   # cpu: already [cell, head, dim]
            empty = dst[:, :0, :].transpose(2, 0, 1) if permuted else dst[:, :, :0]
            kd, vd, ks, vs = empty, dst, value[:, :, :0], value
        if self.device == "cpu":
            _put.launch_cpu(kd, vd, slots, ks, vs)
            return
        if self.device == "sim":
            _put.launch("sim", kd, vd, slots, ks, vs, permuted)
            return
        import cupy
        ptrs = (int(kd.data.ptr), int(vd.data.ptr), int(slots.ptr), int(ks.data.ptr),
                int(vs.data.ptr))
        pkey = ("float side", i, ptrs, ks.shape, ks.strides, vs.shape, vs.strides)
        plan = self._user_plans.get(pkey)
        if plan is None:
            plan = self._user_plans[pkey] = _put._CudaPut(
                kd, vd, ks, vs, slots, permuted, cupy.cuda.runtime.getDevice())
        plan.launch(ptrs, -1, cupy.cuda.get_current_stream().ptr)

    # ------------------------------------------------------------------ building
    def _record(self) -> List[Any]:
        """cpu/sim: one put per stored layer, each reading ``descriptor``'s slots when called."""
        storage = self._storage
        slots = self.descriptor[self._slots_at:self._slots_at + self.batch]
        out = []
        if self.attention is not None and self.device != "cpu":
            out.extend(self._list_launches(None))
        for i in range(len(self.layers)):
            k_in, v_in = self.key[i], self.value[i]
            if storage.quantized:
                out.append(lambda i=i, k_in=k_in, v_in=v_in:
                           self._quant_put(i, k_in, v_in, slots))
            elif self.device == "cpu":
                k_l, v_l = storage._k_layers[i], storage._v_layers[i]
                out.append(lambda k_l=k_l, v_l=v_l, k_in=k_in, v_in=v_in:
                           _put.launch_cpu(k_l, v_l, slots, k_in, v_in))
            else:
                k_l, v_l = storage._k_layers[i], storage._v_layers[i]
                out.append(lambda k_l=k_l, v_l=v_l, k_in=k_in, v_in=v_in:
                           _put.launch("sim", k_l, v_l, slots, k_in, v_in, storage.permuted))
            if self.attention is not None:
                if self.device == "cpu":
                    out.append(lambda i=i: self._attend_cpu_into(self.layers[i], self.query[i],
                                                                 self.output[i]))
                else:
                    out.extend(lambda a=a: a[0](*a[2], **a[1])
                               for a in self._attention_launches(i, None))
        return out

    def _attend_cpu_into(self, layer: int, q: np.ndarray, out: np.ndarray) -> None:
        """cpu: model ``layer``'s attention of the pass's ``n`` tokens by the registered CPU
        attention (:func:`numbakv.attention.attend`: the CPU kernels, there is no CUDA kernel to
        run) over ``q[:n]`` (float32 ``[batch, n_heads, head_dim]``), written into ``out[:n]``
        (float32 ``[batch, n_heads, v_head_dim]``) and zeros into ``out[n:]``; the cache's
        current layer is put back afterwards. Both the replayed step and :meth:`attend` run
        it."""
        import torch
        attend = cpu_attend()
        cache = self.cache
        n = int(self.descriptor[0])
        current = cache._layer
        cache.set_layer(layer)
        try:
            got = attend(torch.from_numpy(q[:n]), cache, scale=self.attention.scale,
                         soft_cap=self.attention.soft_cap, **self._latent_kw())
        finally:
            cache.set_layer(current)
        out[:n] = got.numpy()
        out[n:] = 0

    def _latent_kw(self) -> dict:
        """The CPU attend's ``v_dim`` on an MLA latent cache (none otherwise)."""
        return {"v_dim": self.attention.v_dim} if self.attention.latent else {}

    def _capture(self) -> None:
        """cuda: per stored layer a put plan whose slot array is the descriptor's, launched once
        eagerly with every slot -1 (loads the kernel, writes nothing), then captured into one
        graph on a private stream."""
        import cupy
        storage = self._storage
        desc_ptr = int(self.descriptor.data.ptr)
        slots = Desc(desc_ptr + 4 * self._slots_at, (self.batch,), (4,), np.dtype(np.int32))
        device_id = cupy.cuda.runtime.getDevice()
        self._plans = []
        for i in range(len(self.layers)):
            k_l, v_l = storage._k_layers[i], storage._v_layers[i]
            k_in, v_in = self.key[i], self.value[i]
            if storage.quantized:     # the quantize kernels, reading the descriptor's slots
                self._plans.append((None, (i, k_in, v_in, slots)))
                continue
            plan = _put._CudaPut(k_l, v_l, k_in, v_in, slots, storage.permuted, device_id)
            ptrs = (int(k_l.data.ptr), int(v_l.data.ptr), slots.ptr, int(k_in.data.ptr),
                    int(v_in.data.ptr))
            self._plans.append((plan, ptrs))
        with self._scope():
            stream = cupy.cuda.get_current_stream()
            self._write_descriptor(np.zeros(0, np.int32), np.zeros(0, np.int32), 0, stream)
            self._launch_all(stream)           # every slot -1: loads the kernels, writes nothing
            capture = cupy.cuda.Stream(non_blocking=True)
            # the capture stream must not run ahead of the buffers' initialisation: graphs
            # record no cross-stream order, so finish it first (once, at capture time)
            host_wait(stream)
            with capture:   # current too: Numba's dispatcher (the fallback) launches there
                capture.begin_capture()
                try:
                    self._launch_all(capture)
                finally:
                    graph = capture.end_capture()
        self.graph = graph
        self._capture_stream = capture

    def _launch_all(self, stream) -> None:
        if self.attention is not None:
            with stream:
                for launch in self._list_launches(int(self.descriptor.data.ptr)):
                    launch()
        for i, (plan, ptrs) in enumerate(self._plans):
            if plan is None:
                with stream:
                    self._quant_put(*ptrs)
            else:
                plan.launch(ptrs, -1, stream.ptr)
            if self.attention is not None:
                with stream:      # the launcher queues on CuPy's current stream
                    for run, kw, args in self._attention_launches(
                            i, int(self.descriptor.data.ptr)):
                        run(*args, **kw)

    # ------------------------------------------------------------------ replay
    def _pinned(self, stream) -> list:
        """A pinned host descriptor whose previous copy has run (a ring of
        :data:`PINNED_RING`)."""
        import cupy
        ring = self._ring
        if len(ring) < PINNED_RING:
            mem = cupy.cuda.alloc_pinned_memory(self._nbytes)
            host = np.frombuffer(mem, np.int32, self._nbytes // 4)
            slot = [mem, host, None, int(host.ctypes.data)]
            ring.append(slot)
            return slot
        slot = ring[self._ring_next]
        self._ring_next = (self._ring_next + 1) % PINNED_RING
        if slot[2] is not None and not slot[2].done:
            host_wait(slot[2])   # the GPU is PINNED_RING replays behind
        return slot

    def _fill_attention(self, host: np.ndarray, pages: Any, n: int) -> None:
        """The attention's fields of the descriptor for this pass's page table ``pages`` (a
        :class:`numbakv.pages.HostPages`; None: every list empty): the CSR list pointers (two
        spare entries: the tokens past ``n`` read an empty list), each token's batch sequence,
        its causal flag and the split-K part length for the longest list."""
        T = self.batch
        ip = self._indptr_at
        causal = host[self._causal_at:self._causal_at + (T + 3) // 4].view(np.uint8)
        # the captured list extension copies the lists in place unchanged (previous pointers
        # = new ones, no drops, no new cells)
        host[self._prev_at:] = 0
        if pages is None:
            host[ip:ip + T + 2] = 0
            host[self._tok_at:self._tok_at + T] = 0
            causal[:] = 1
            host[self._plen_at] = 1
            return
        fill_attention(host, pages.kv_indptr, pages.qo_indptr, pages.token_order,
                       pages.rule.causal, causal, n, T, self._tok_at, ip, self._plen_at,
                       self._parts, self._min_part, self._part_unit)
        host[self._prev_at:self._prev_at + T + 2] = host[ip:ip + T + 2]

    def _copy_lists(self, pages: Any, stream) -> None:
        """This pass's page lists into the fixed :attr:`kv_indices` / :attr:`kv_positions` (on
        the cache's stream: two device copies on ``cuda``, from where the page table was
        built or extended on the device)."""
        table = pages.table
        nnz = int(pages.kv_indptr[-1])
        if nnz > self.kv_indices.shape[0]:   # cannot happen while n_cells is fixed
            raise KVCacheError(f"the pass lists {nnz} cells, more than the step's room "
                               f"({self.kv_indices.shape[0]})")
        if self.device != "cuda":
            self.kv_indices[:nnz] = table.kv_indices
            self.kv_positions[:nnz] = table.kv_positions
            return
        if nnz:
            import cupy
            for dst, src in ((self.kv_indices, table.kv_indices),
                             (self.kv_positions, table.kv_positions)):
                cupy.cuda.runtime.memcpyAsync(int(dst.data.ptr), int(src.data.ptr), 4 * nnz,
                                              _D2D, stream.ptr)

    def _write_descriptor(self, pos: np.ndarray, seqs: np.ndarray, start: int, stream,
                          slots: Optional[np.ndarray] = None, pages: Any = None,
                          fwd: Any = None) -> Any:
        """The step descriptor of the pass into a host buffer, then (cuda) one copy to the
        device. With attention and ``fwd`` (the cache's pass) the page lists come from
        :meth:`_append_lists` when they just grow, else from the pass's page table (returned:
        the caller copies its lists into the fixed ones)."""
        n = pos.shape[0]
        if self.device == "cuda":
            slot = self._pinned(stream)
            host = slot[1]
        else:
            host = self._host
        fill_descriptor(host, pos, seqs, start, self.batch)
        if slots is not None:       # paged placement (CacheConfig(page_size)): scattered cells
            host[HEADER:HEADER + n] = slots
        if self.attention is not None:
            if fwd is None:                        # capture: no pass, every list empty
                self._fill_attention(host, pages, n)
            elif not self._append_lists(host, fwd):
                pages = self.cache._host_pages()   # built or extended on the cache's stream
                self._fill_attention(host, pages, n)
                self._remember_lists(pages, fwd)
        if self.device == "cuda":
            import cupy
            cupy.cuda.runtime.memcpyAsync(int(self.descriptor.data.ptr), slot[3], self._nbytes,
                                          _H2D, stream.ptr)
            if slot[2] is None:
                slot[2] = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
            slot[2].record(stream)
        return pages

    def _check_input(self, x, name: str, n: int, dim: int):
        """``x`` as an array of the cache's device and storage dtype ``[n_layers, n, H, dim]``
        (None or the step's own buffer: already in place)."""
        own = self.key if name == "k" else self.value
        if x is None or x is own:
            return None
        cfg = self.cache.config
        with self._scope():   # a DLPack producer is ordered before the cache's stream
            arr = as_array(x, self.device, cfg.dtype, name=name)
        want = (len(self.layers), n, cfg.local_kv_heads, dim)
        if tuple(arr.shape) != want:
            raise ValueError(f"{name} must have shape [n_stored_layers={want[0]}, tokens={n}, "
                             f"n_kv_heads={want[2]}, {'head_dim' if name == 'k' else 'v_head_dim'}"
                             f"={dim}], got {list(arr.shape)}")
        return arr

    def _copy_in(self, own, arr, n: int, stream) -> None:
        """``arr`` into the first ``n`` tokens of the fixed input ``own`` (on the cache's
        stream: one asynchronous device copy when both are contiguous and whole)."""
        if self.device == "cuda" and n == self.batch and arr.flags.c_contiguous:
            import cupy
            cupy.cuda.runtime.memcpyAsync(int(own.data.ptr), int(arr.data.ptr), own.nbytes,
                                          _D2D, stream.ptr)
            self._storage._keep_inputs(arr, arr)
            return
        own[:, :n] = arr
        if self.device == "cuda":
            self._storage._keep_inputs(arr, arr)

    def _count(self, positions: Any) -> int:
        n = int(np.size(positions)) if isinstance(positions, np.ndarray) else None
        if n is None:
            try:
                n = len(positions)
            except TypeError:
                raise ValueError(f"positions must be a 1-d integer array, got "
                                 f"{type(positions).__name__}") from None
        if not 1 <= n <= self.batch:
            raise ValueError(f"positions must hold 1 to batch={self.batch} tokens (the step's "
                             f"captured size), got {n}")
        return n

    def _stream(self):
        if self.device != "cuda":
            return None
        import cupy
        return cupy.cuda.get_current_stream()

    def _send(self, stream) -> None:
        """After ``start_forward``: the step descriptor of the pass sent to the device and, with
        attention, the pass's page lists brought into the fixed lists (all on ``stream``, the
        cache's; no host wait). A decode step whose lists just grow (the cell table changed
        only by the previous replay's and this pass's placements, and its window pruning of
        cells already cut from the lists' fronts) sends the new cells in the descriptor and
        the captured extension (:meth:`_list_launches`) appends them on the device: O(batch)
        host work. Anything else (a sequence operation, a defrag, a shift, other batch
        sequences) builds the pass's page table
        (``_host_pages``) and copies its lists into the fixed ones."""
        fwd = self.cache._forward
        positions, seqs, start, slots = self.cache._step_placement()
        pages = self._write_descriptor(positions, seqs, start, stream, slots, None, fwd)
        if pages is not None:
            self._copy_lists(pages, stream)

    def _append_lists(self, host: np.ndarray, fwd: Any) -> bool:
        """The attention fields of pass ``fwd`` by :func:`append_lists` when the fixed lists
        hold the previous replay's lists and the cell table changed since only by this pass's
        placement; False (nothing usable written) otherwise."""
        held = self._lists_of
        if held is None or self.device == "cpu" or fwd.reserve:
            return False
        pruned = self._pruned_since(held, fwd)
        if pruned is None:
            return False
        self._lists_of = None       # until the lists are known to be this pass's
        T = self.batch
        n = fwd.positions.shape[0]
        causal = host[self._causal_at:self._causal_at + (T + 3) // 4].view(np.uint8)
        window = self.cache._window
        if not append_lists(host, n, self._pass_causal(fwd), causal, T, self._max_seqs(),
                            -1 if window == UNLIMITED else int(window),
                            int(self.cache._chunk), self._st_seq, self._st_indptr,
                            self._st_first, self._st_last, self._st_meta, self._append_at,
                            self._parts, self._min_part, self._part_unit, pruned):
            return False
        host[self._zero_at:self._zero_at + T + 2] = 0
        self._lists_of = self._tables_state()
        return True

    # The cell tables the fixed lists follow: the cache's one, or with per-sequence streams
    # one per stream (each stream's list grows from its own placements, in pool cells).
    def _tables_state(self) -> tuple:
        """The cell tables and their versions now (what :meth:`_pruned_since` compares
        a later pass with)."""
        if self._per_stream:
            return tuple((st.cells, st.cells.version) for st in self.cache.streams)
        cells = self.cache.cells
        return (cells, cells.version)

    def _pruned_since(self, held: tuple, fwd: Any) -> Optional[np.ndarray]:
        """Whether the cell tables changed since ``held`` (:meth:`_tables_state`) only by pass
        ``fwd``'s window pruning and placements (no sequence operation, defrag or shift):
        then the (sequence, position) of every cell sequence the pruning dropped (int64 ``[k,
        2]``, per-sequence streams' local sequences as their stream's; ``k = 0``: none), which
        :func:`append_lists` checks lie before their lists' new fronts; None otherwise."""
        if not self._per_stream:
            cells = self.cache.cells
            if held[0] is not cells or fwd.pruned_v0 != held[1] or \
                    cells.version != fwd.cells_v1:
                return None
            return _NONE_PRUNED if fwd.pruned is None else np.ascontiguousarray(fwd.pruned[:, 1:3])
        in_batch = set(fwd.seq_ids.tolist())
        dropped = []
        for s, st in enumerate(self.cache.streams):
            cells, version = held[s]
            if cells is not st.cells:
                return None
            if s in in_batch:
                sf = st._forward
                if sf is None or sf.pruned_v0 != version or st.cells.version != sf.cells_v1:
                    return None
                if sf.pruned is not None:
                    rec = sf.pruned[:, 1:3].copy()
                    rec[:, 0] = s               # a stream's one sequence is local sequence 0
                    dropped.append(rec)
            elif st.cells.version != version:
                return None
        if not dropped:
            return _NONE_PRUNED
        return dropped[0] if len(dropped) == 1 else np.concatenate(dropped)

    def _pass_causal(self, fwd: Any) -> np.ndarray:
        """uint8 ``[n]``: the pass's causal flags in batch order (a stream cache keeps them
        per stream)."""
        if not self._per_stream or fwd.causal is not None:
            return fwd.causal       # a stream cache's when every stream's are all ones
        causal = np.ones(len(fwd.token_order), np.uint8)
        for b, s in enumerate(fwd.seq_ids.tolist()):
            causal[fwd.groups[b]] = self.cache.streams[s]._forward.causal
        # read-only as every other pass's flags are: append_lists is typed by the array's
        # flags, and a writable one compiled (and would ship) a second signature of it
        causal.flags.writeable = False
        return causal

    def _max_seqs(self) -> int:
        return self.cache.n_streams if self._per_stream else self.cache.cells.max_seqs

    def _seq_pos_max(self) -> np.ndarray:
        """int ``[max_seqs]``: each sequence's highest position (-1: none)."""
        if not self._per_stream:
            return self.cache.cells.seq_pos_max
        return np.array([st.cells.seq_pos_max[0] for st in self.cache.streams], np.int64)

    def _remember_lists(self, pages: Any, fwd: Any) -> None:
        """After the fixed lists were filled from ``pages`` (this pass's page table): what
        :meth:`_append_lists` needs to grow them next replay (each list's sequence, pointers,
        first and last positions), when every list holds all its sequence's cells from its
        first listed position on (:func:`numbakv.pages.mark_extendable`); else nothing."""
        self._lists_of = None
        if self.device == "cpu" or fwd.reserve:
            return
        plans = pages.plans
        if "last-positions" not in plans:
            window = self.cache._window
            _pages.mark_extendable(pages, self._seq_pos_max(),
                                   window != UNLIMITED or self.cache._chunk > 0)
            if "last-positions" not in plans:
                return
        nb = pages.seq_ids.shape[0]
        if nb > self.batch:
            return
        self._st_seq[:nb] = pages.seq_ids
        self._st_indptr[:nb + 1] = pages.kv_indptr
        self._st_first[:nb] = plans["first-positions"]
        self._st_last[:nb] = plans["last-positions"]
        self._st_meta[0] = nb
        self._st_meta[1] = 1 if plans["contiguous"] else 0
        self._lists_of = self._tables_state()

    def prepare(self, positions: Any, seqs: Any) -> None:
        """The host half of a step without the graph, for an engine that captures its own
        (the whole model, say) with :meth:`put` inside it: ``start_forward(positions, seqs)``
        and the step descriptor sent to the device (on the cache's stream), so kernels
        captured earlier by :meth:`put` store this batch's ``n <= batch`` tokens when the
        engine replays its graph next on that stream. Raises like ``start_forward``, nothing
        changed."""
        cache = self.cache
        if cache.closed:
            raise KVCacheError("the cache is closed")
        self._count(positions)
        cache.start_forward(positions, seqs)
        self._prepared()

    def _prepared(self) -> None:
        """:meth:`prepare` after ``start_forward`` (a :class:`WrapperStep` calls it per group
        after the wrapper's ``start_forward``)."""
        try:
            with self._scope():
                stream = self._stream()
                self._send(stream)
                if self.attention is not None and self.device != "cpu":
                    # the engine's graph holds only put/attend: the lists grow here
                    ptr = int(self.descriptor.data.ptr) if self.device == "cuda" else None
                    with (stream if stream is not None else _NO_SCOPE):
                        for launch in self._list_launches(ptr):
                            launch()
        except BaseException:
            self._lists_of = None     # the fixed lists may not be this pass's
            raise

    def put(self, layer: int, key: Any, value: Any) -> None:
        """Store ``key [batch, n_kv_heads, head_dim]`` and ``value [batch, n_kv_heads,
        v_head_dim]`` (arrays of the cache's device, storage dtype) for model ``layer`` at the
        cells the step descriptor names: token ``t < n`` of the last :meth:`prepare` (or
        :meth:`replay`) goes to its cell, rows past ``n`` are skipped. The kernel reads its
        slots from the descriptor when it runs, never from its launch arguments, so a call made
        while the engine captures a CUDA graph (on the cache's stream) stores each later
        replay's tokens where that replay's ``prepare`` placed them. On cpu/sim the put runs
        at once, reading the same descriptor."""
        cfg = self.cache.config
        layer = check_index("layer", layer, 0, cfg.n_layers)
        slot = cfg.storage_layers[layer]
        if cfg.owner_layer(layer) != layer or slot < 0:
            raise ValueError(f"layer {layer} stores no K/V of its own (layer_reuse)")
        storage = self._storage
        storage._check_kv(key, value, self.batch)
        k_l, v_l = storage._k_layers[slot], storage._v_layers[slot]
        slots = self.descriptor[self._slots_at:self._slots_at + self.batch]
        if storage.quantized:
            if self.device == "cuda":
                slots = Desc(int(self.descriptor.data.ptr) + 4 * self._slots_at,
                             (self.batch,), (4,), np.dtype(np.int32))
            with self._scope():
                self._quant_put(slot, key, value, slots)
                if self.device == "cuda":
                    storage._keep_inputs(key, value)
            return
        if self.device == "cpu":
            _put.launch_cpu(k_l, v_l, slots, key, value)
            return
        if self.device == "sim":
            _put.launch("sim", k_l, v_l, slots, key, value, storage.permuted)
            return
        import cupy
        ptrs = (int(k_l.data.ptr), int(v_l.data.ptr),
                int(self.descriptor.data.ptr) + 4 * self._slots_at, int(key.data.ptr),
                int(value.data.ptr))
        pkey = (slot, ptrs, key.shape, key.strides, value.shape, value.strides)
        plan = self._user_plans.get(pkey)
        if plan is None:
            desc = Desc(ptrs[2], (self.batch,), (4,), np.dtype(np.int32))
            plan = self._user_plans[pkey] = _put._CudaPut(
                k_l, v_l, key, value, desc, storage.permuted, cupy.cuda.runtime.getDevice())
        with self._scope():
            plan.launch(ptrs, -1, cupy.cuda.get_current_stream().ptr)
            storage._keep_inputs(key, value)

    def attend(self, layer: int, q: Any, out: Any) -> None:
        """Attention of ``q`` (float32 ``[batch, n_heads, head_dim]``, contiguous, on the
        cache's device) over model ``layer`` of the pass of the last :meth:`prepare` (or
        :meth:`replay`), written into ``out`` (float32 ``[batch, n_heads, v_dim]``, ``v_dim``
        the cache's ``v_head_dim`` or an MLA latent's value width, contiguous; rows past the pass's ``n`` tokens get zeros): for an engine that captures
        its own graph, after :meth:`put` of that layer (or of the layer it reuses). The kernel
        reads the pass's page lists, lengths and positions from the step's fixed buffers when
        it runs, so a call made while the engine captures a CUDA graph (on the cache's stream)
        attends over each later replay's pass. On cpu/sim it runs at once. Needs a step
        captured with ``attend=True``."""
        att = self.attention
        if att is None:
            raise ValueError("attend() needs a step captured with capture_step(attend=True)")
        cfg = self.cache.config
        layer = check_index("layer", layer, 0, cfg.n_layers)
        slot = cfg.storage_layers[layer]
        if slot < 0:
            raise ValueError(f"layer {layer} has no K/V in this cache (layer_reuse)")
        xp = self._storage.xp
        for name, x, dim in (("q", q, cfg.head_dim), ("out", out, att.v_dim)):
            want = (self.batch, att.n_heads, dim)
            if not isinstance(x, xp.ndarray) or np.dtype(x.dtype) != np.float32 or \
                    tuple(x.shape) != want or not x.flags.c_contiguous:
                raise ValueError(f"{name} must be a contiguous float32 array of the cache's "
                                 f"device with shape {list(want)}, got "
                                 f"{type(x).__name__} {getattr(x, 'dtype', None)} "
                                 f"{list(getattr(x, 'shape', ()))}")
        if self.device == "cpu":
            self._attend_cpu_into(layer, q, out)
            return
        ptr = int(self.descriptor.data.ptr) if self.device == "cuda" else None
        with self._scope():
            for run, kw, args in self._attention_launches(slot, ptr, q, out,
                                                          self._lse_scratch):
                run(*args, **kw)

    def replay(self, positions: Any, seqs: Any, q: Any = None, k: Any = None,
               v: Any = None) -> Any:
        """Run the captured step for a batch of ``n <= batch`` tokens: ``positions`` and
        ``seqs`` ``[n]`` (as :meth:`~numbakv.CausalCache.start_forward` takes them),
        ``k [n_stored_layers, n, n_kv_heads, head_dim]`` and ``v [n_stored_layers, n,
        n_kv_heads, v_head_dim]`` (arrays of the cache's device and dtype, or DLPack tensors;
        None when the caller wrote them into :attr:`key` / :attr:`value`, which then hold
        ``batch`` tokens of which the first ``n`` are stored). Afterwards the cache is in that
        forward pass: ``get()``, ``attend`` and ``page_table()`` see the tokens. Raises like
        ``start_forward`` (``KVCacheFullError``, ``ValueError``) with nothing changed.

        A step captured with ``attend=True`` also takes ``q [n_stored_layers, n, n_heads,
        head_dim]`` (float16, bfloat16 or float32 on the cache's device, or DLPack; None when
        written into :attr:`query`) and returns the attention of each stored layer's queries
        over the cache after that layer's put: float32 ``[n_stored_layers, n, n_heads,
        v_head_dim]``, a view of :attr:`output` (overwritten by the next replay; :attr:`lse`
        ``[n_stored_layers, batch, n_heads]`` holds the log-sum-exp). Without attention it
        returns None and ``q`` must be None."""
        cache = self.cache
        if cache.closed:
            raise KVCacheError("the cache is closed")
        n = self._count(positions)
        inputs = self._check_inputs(n, q, k, v)
        cache.start_forward(positions, seqs)      # validates; all or nothing
        return self._run(n, *inputs)

    def _check_inputs(self, n: int, q: Any, k: Any, v: Any) -> tuple:
        """``(q, k, v)`` of a replay of ``n`` tokens, checked (see :meth:`replay`)."""
        if q is not None and self.attention is None:
            raise ValueError("q must be None: this step was captured without attention "
                             "(capture_step(attend=False))")
        cfg = self.cache.config
        q_arr = self._check_query(q, n) if self.attention is not None else None
        k_arr = self._check_input(k, "k", n, cfg.head_dim)
        v_arr = self._check_input(v, "v", n, cfg.v_head_dim)
        return q_arr, k_arr, v_arr

    def _run_checked(self, n: int, inputs: tuple) -> Any:
        """:meth:`_run` of :meth:`_check_inputs`' result (the interface a :class:`HybridStep`
        drives a DecodeStep or a WrapperStep by)."""
        return self._run(n, *inputs)

    def _run(self, n: int, q_arr: Any, k_arr: Any, v_arr: Any) -> Any:
        """:meth:`replay` after ``start_forward``: the descriptor (and lists) sent, the inputs
        copied in, the graph launched (cpu/sim: the recorded launches run)."""
        try:
            with self._scope():
                stream = self._stream()
                self._send(stream)
                if k_arr is not None:
                    self._copy_in(self.key, k_arr, n, stream)
                if v_arr is not None:
                    self._copy_in(self.value, v_arr, n, stream)
                if q_arr is not None:
                    self._copy_query(q_arr, n)
                if self.device == "cuda":
                    self.graph.launch(stream)
                else:
                    for launch in self._launches:
                        launch()
        except BaseException:
            # the fixed lists may not be this pass's: the next replay rebuilds them
            self._lists_of = None
            raise
        self.replays += 1
        if self.attention is not None:
            return self.output[:, :n]
        return None

    def _check_query(self, q, n: int):
        """``q`` as an array of the cache's device ``[n_stored_layers, n, n_heads, head_dim]``
        (float16, bfloat16 -- then its uint16 bits -- or float32), with its dtype name; None
        when the caller wrote the queries into :attr:`query` (which it then passes)."""
        if q is None or q is self.query:
            return None
        name = str(getattr(q, "dtype", "")).replace("torch.", "")
        if name not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"q must be a float16, bfloat16 or float32 array or tensor, got "
                             f"{type(q).__name__} of dtype {name or None}")
        with self._scope():
            arr = as_array(q, self.device, name, name="q")
        cfg = self.cache.config
        want = (len(self.layers), n, self.attention.n_heads, cfg.head_dim)
        if tuple(arr.shape) != want:
            raise ValueError(f"q must have shape [n_stored_layers={want[0]}, tokens={n}, "
                             f"n_heads={want[2]}, head_dim={want[3]}], got {list(arr.shape)}")
        return arr, name

    def _copy_query(self, q, n: int) -> None:
        """The queries into the fixed float32 :attr:`query` (on the cache's stream: one
        elementwise kernel on ``cuda``)."""
        arr, name = q
        if name == "bfloat16":    # uint16 bit patterns: the float32 with those high bits
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        self.query[:, :n] = arr
        if self.device == "cuda":
            self._storage._keep_inputs(q[0], q[0])

    def __repr__(self) -> str:
        return (f"DecodeStep(batch={self.batch}, layers={len(self.layers)}, device="
                f"{self.device!r}, graph={'yes' if self.graph is not None else 'no'}, "
                f"replays={self.replays})")


class WrapperStep:
    """A captured decode step of a :class:`numbakv.WrapperCache` (a cache per layer group, e.g.
    Gemma 3's sliding-window layers beside its full-attention layers):
    :meth:`numbakv.WrapperCache.capture_step`.

    Each group cache has its own cell table, so its own slots and page lists: the step is one
    :class:`DecodeStep` per group (:attr:`steps`, each with its own descriptor, fixed inputs
    and, on ``cuda``, its own graph), driven together on the groups' streams.

    :meth:`replay` ``(positions, seqs, q=None, k=None, v=None)`` does the wrapper's
    ``start_forward`` (every group or none), then each group's half of
    :meth:`DecodeStep.replay`; ``q`` / ``k`` / ``v`` are sequences with one entry per group
    (what ``steps[g].replay`` takes for that group's stored layers; an entry None: written
    into ``steps[g].query`` / ``key`` / ``value``), or None for every group. Returns the
    per-group outputs (a list of ``steps[g].replay``'s, with attention; else None).

    An engine that captures its own graph calls :meth:`prepare` before each replay and
    :meth:`put` / :meth:`attend` per model layer (routed to the layer's group and its index
    there, as ``WrapperCache.set_layer`` routes; needs the wrapper's ``layer_groups``).
    """

    def __init__(self, wrapper: Any, steps: List["DecodeStep"]) -> None:
        self.cache = wrapper
        self.steps = steps
        self.batch = steps[0].batch
        self.attention = steps[0].attention
        self.device = steps[0].device
        self.replays = 0

    def _route(self, layer: Any) -> Tuple["DecodeStep", int]:
        wrapper = self.cache
        n = wrapper.n_layers
        layer = check_index("layer", layer, 0, n)
        if wrapper.layer_groups is None:
            raise ValueError("the wrapper has no layer_groups (every cache sees every layer, "
                             "set_layer_type picks one at run time): call steps[g].put / "
                             "steps[g].attend of the group cache g that layer uses")
        return self.steps[wrapper.layer_groups[layer]], int(wrapper._local[layer])

    def _check_open(self) -> None:
        for step in self.steps:
            if step.cache.closed:
                raise KVCacheError("the cache is closed")

    def _per_group(self, x: Any, name: str) -> list:
        g = len(self.steps)
        if x is None:
            return [None] * g
        if isinstance(x, (list, tuple)) and len(x) == g:
            return list(x)
        raise ValueError(f"{name} must be None or a list of {g} entries, one per group cache "
                         f"(each what steps[g].replay takes), got {type(x).__name__}")

    def prepare(self, positions: Any, seqs: Any) -> None:
        """:meth:`DecodeStep.prepare` for every group: the wrapper's ``start_forward`` (all
        or nothing), then each group's descriptor (and page lists) sent on its stream."""
        self._check_open()
        self._count(positions)
        self.cache.start_forward(positions, seqs)
        self._prepared()

    def _count(self, positions: Any) -> int:
        return self.steps[0]._count(positions)

    def _prepared(self) -> None:
        for step in self.steps:
            step._prepared()

    def _check_inputs(self, n: int, q: Any, k: Any, v: Any) -> list:
        qs, ks, vs = (self._per_group(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
        return [step._check_inputs(n, qg, kg, vg)
                for step, qg, kg, vg in zip(self.steps, qs, ks, vs)]

    def _run_checked(self, n: int, inputs: list) -> Optional[List[Any]]:
        outs = [step._run(n, *inp) for step, inp in zip(self.steps, inputs)]
        self.replays += 1
        return outs if self.attention is not None else None

    def put(self, layer: int, key: Any, value: Any) -> None:
        """:meth:`DecodeStep.put` of model ``layer`` (its group's step, its index there)."""
        step, local = self._route(layer)
        step.put(local, key, value)

    def attend(self, layer: int, q: Any, out: Any) -> None:
        """:meth:`DecodeStep.attend` of model ``layer`` (its group's step, its index there)."""
        step, local = self._route(layer)
        step.attend(local, q, out)

    def replay(self, positions: Any, seqs: Any, q: Any = None, k: Any = None,
               v: Any = None) -> Optional[List[Any]]:
        """Every group's step for a batch of ``n <= batch`` tokens (see the class
        docstring); every input is checked before ``start_forward``, which raises like the
        wrapper's with nothing changed."""
        self._check_open()
        n = self._count(positions)
        inputs = self._check_inputs(n, q, k, v)
        self.cache.start_forward(positions, seqs)      # every group or none
        return self._run_checked(n, inputs)

    def __repr__(self) -> str:
        return f"WrapperStep(groups={len(self.steps)}, batch={self.batch}, replays={self.replays})"


class HybridStep:
    """A captured decode step of a :class:`numbakv.HybridCache` (attention K/V beside
    recurrent state): :meth:`numbakv.HybridCache.capture_step`.

    The attention half's step (:attr:`inner`: a :class:`DecodeStep`, or a
    :class:`WrapperStep` for a ``WrapperCache`` half) is driven after the hybrid cache's own
    ``start_forward``, so the recurrent half keeps its bookkeeping (positions, restore points:
    the live-state copies a pass needs are queued eagerly on its stream, before the graph).
    The recurrent layers' states are the model's to update: sequence ``s``'s live state is row
    ``s`` of every state tensor (:meth:`numbakv.RecurrentCache.state_views`), and the batch's
    sequence ids sit in the attention step's descriptor at a fixed address
    (``descriptor[HEADER + 2 * batch:]``, -1 past ``n``), so a model's captured recurrent
    kernels can read their rows there.

    :meth:`replay` / :meth:`prepare` take what the inner step takes; :meth:`put` /
    :meth:`attend` take the *model* layer (an attention layer: routed to its layer in the
    attention half; a recurrent one is a ``ValueError``).
    """

    def __init__(self, hybrid: Any, inner: Any) -> None:
        self.cache = hybrid
        self.inner = inner
        self.batch = inner.batch
        self.attention = inner.attention
        self.device = inner.device

    @property
    def replays(self) -> int:
        return self.inner.replays

    def _attention_layer(self, layer: Any) -> int:
        hybrid = self.cache
        n = hybrid.n_layers
        layer = check_index("layer", layer, 0, n)
        if hybrid.layer_kinds[layer] != "attention":
            raise ValueError(f"layer {layer} is a recurrent layer (no K/V): its state is row "
                             "seq of rc.state_views, updated by the model")
        return int(hybrid._attn_of[layer])

    def prepare(self, positions: Any, seqs: Any) -> None:
        """The hybrid cache's ``start_forward`` (both halves, all or nothing), then the
        attention step's descriptor (and page lists) sent on its stream."""
        self.cache._check_open()
        self.inner._count(positions)
        self.cache.start_forward(positions, seqs)
        self.inner._prepared()

    def put(self, layer: int, key: Any, value: Any) -> None:
        """The attention step's put of model ``layer``."""
        self.inner.put(self._attention_layer(layer), key, value)

    def attend(self, layer: int, q: Any, out: Any) -> None:
        """The attention step's attend of model ``layer``."""
        self.inner.attend(self._attention_layer(layer), q, out)

    def replay(self, positions: Any, seqs: Any, q: Any = None, k: Any = None,
               v: Any = None) -> Any:
        """The inner step's replay (inputs for the attention half's stored layers) after the
        hybrid cache's ``start_forward``; every input checked first, nothing changed on a
        refusal."""
        self.cache._check_open()
        n = self.inner._count(positions)
        inputs = self.inner._check_inputs(n, q, k, v)
        self.cache.start_forward(positions, seqs)
        return self.inner._run_checked(n, inputs)

    def __repr__(self) -> str:
        return f"HybridStep({self.inner!r})"


def _heads_per_launch(n_heads: int, n_kv_heads: int, head_dim: int, v_dim: int,
                      batch: int) -> int:
    """Query heads per launch of the captured attention: ``n_heads`` when the kernel takes
    the group; with one KV head (MQA, an MLA latent: DeepSeek's 16-128 heads on a 576-value
    latent) the most heads a launch's tiles hold (at most :data:`~numbakv.kernels.decode.
    MAX_GROUP`, group x dims <= :data:`~numbakv.kernels.decode.MAX_GROUP_DIM`), each launch
    reading the listed rows again; 0 when not even that fits."""
    if _decode.fits(n_heads, n_kv_heads, head_dim, v_dim, batch):
        return n_heads
    if n_kv_heads != 1:
        return 0
    per = min(_decode.MAX_GROUP, _decode.MAX_GROUP_DIM // max(head_dim, v_dim, 1))
    return per if per >= 1 and _decode.fits(per, 1, head_dim, v_dim, batch) else 0


def _latent_bytes(cfg: Any, v_dim: int) -> int:
    """Bytes of a latent row's first ``v_dim`` values in K's storage (whole q8_0 / q4_0
    blocks; one per float8 value; elements of a float row)."""
    if cfg.k_dtype in ("q8_0", "q4_0"):
        return row_bytes(cfg.k_dtype, v_dim)
    return v_dim


def _check_latent_v_dim(cache: Any, v_dim: Any) -> int:
    """The value width of an MLA latent cache's absorbed attention (``v_dim``, default the
    cache's ``RopeShift.offset``, i.e. ``kv_lora_rank``), checked as the kernel reads it."""
    cfg = cache.config
    v_dim = latent_value_width(cfg, getattr(cache, "shift", None), v_dim,
                               "capture_step(attend=True)")
    if cfg.k_dtype in ("q8_0", "q4_0") and v_dim % 32:
        raise NotSupportedError(f"capture_step(attend=True): v_dim={v_dim} must be a multiple "
                                f"of 32 on a {cfg.k_dtype} latent (the kernel reads the value as "
                                "the row's first whole blocks)")
    if cfg.k_rotation and v_dim % cfg.k_rotation:
        raise ValueError(f"v_dim={v_dim} must be a multiple of the latent's Walsh-Hadamard "
                         f"block {cfg.k_rotation} (kv_rotation)")
    return int(v_dim)


def check_capturable(cache: Any, batch: Any, attend: bool, n_heads: Any = None,
                     scale: Any = None, soft_cap: Any = None, v_dim: Any = None,
                     ) -> Tuple[int, Optional[Attention]]:
    """The checks of :meth:`~numbakv.CausalCache.capture_step`: ``(batch, attention)``
    (``attention`` None unless ``attend``)."""
    cfg = cache.config
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or \
            not 1 <= batch <= cfg.max_batch:
        raise ValueError(f"batch must be an integer in [1, max_batch={cfg.max_batch}], "
                         f"got {batch!r}")
    if not isinstance(attend, (bool, np.bool_)):
        raise ValueError(f"attend must be a bool, got {attend!r}")
    if not attend and (n_heads is not None or scale is not None or soft_cap is not None
                       or v_dim is not None):
        raise ValueError("n_heads, scale, soft_cap and v_dim describe the captured attention: "
                         "pass them with attend=True")
    if v_dim is not None and not cfg.v_less:
        raise ValueError(f"v_dim applies to V-less (v_head_dim=0) caches; this one stores V of "
                         f"v_head_dim={cfg.v_head_dim}")
    for side, quantized, dtype in (("k_dtype", cfg.k_quantized, cfg.k_dtype),
                                   ("v_dtype", cfg.v_quantized, cfg.v_dtype)):
        if quantized and dtype not in CAPTURED_QUANT_TYPES:
            raise NotSupportedError(f"capture_step: a quantized {side} must be among "
                                    f"{CAPTURED_QUANT_TYPES} to be captured, got {dtype!r}")
    att = None
    if attend:
        hkv = cfg.local_kv_heads
        if n_heads is None:
            n_heads = hkv
        if isinstance(n_heads, bool) or not isinstance(n_heads, (int, np.integer)) or \
                n_heads < 1 or n_heads % hkv:
            raise ValueError(f"n_heads must be a positive multiple of the cache's n_kv_heads "
                             f"({hkv}), got {n_heads!r}")
        if scale is None:
            scale = 1.0 / float(np.sqrt(cfg.head_dim))
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating,
                                                             np.integer)) \
                or not np.isfinite(scale):
            raise ValueError(f"scale must be a finite number or None, got {scale!r}")
        if soft_cap is not None and (isinstance(soft_cap, bool) or not isinstance(
                soft_cap, (int, float, np.floating, np.integer)) or not soft_cap > 0
                or not np.isfinite(soft_cap)):
            raise ValueError(f"soft_cap must be a finite number > 0 or None, got {soft_cap!r}")
        out_dim = _check_latent_v_dim(cache, v_dim) if cfg.v_less else cfg.v_head_dim
        # an MLA latent: the latent kernel (each staged tile of rows serves a tile of heads),
        # else the paged kernel, in ranges of heads when the group is too large for it
        latent_heads = _decode.latent_tiling(int(n_heads), cfg.head_dim, out_dim)[0] \
            if cfg.v_less and _decode.latent_fits(int(n_heads), hkv, cfg.head_dim, out_dim,
                                                  int(batch)) else 0
        per_launch = int(n_heads) if latent_heads else \
            _heads_per_launch(int(n_heads), hkv, cfg.head_dim, out_dim, int(batch))
        if cfg.k_dtype == DS_MLA and not latent_heads:
            # only the latent kernel dequantizes FlashMLA's rows (one latent head a cell)
            raise NotSupportedError(
                f"capture_step(attend=True): k_dtype='fp8_ds_mla' rows are read by the "
                f"latent kernel only, which takes one latent head a cell (this cache holds "
                f"n_kv_heads={hkv}); capture the put alone (attend=False)")
        if not per_launch:
            raise NotSupportedError(
                f"capture_step(attend=True): the paged attention kernel does not take "
                f"n_heads={n_heads}, n_kv_heads={hkv}, head_dim={cfg.head_dim}, "
                f"{'v_dim' if cfg.v_less else 'v_head_dim'}={out_dim}, batch={batch} (at most "
                f"{_decode.MAX_GROUP} query heads per KV head and group x head_dim <= "
                f"{_decode.MAX_GROUP_DIM}; with one KV head, larger groups run as several "
                f"launches when head_dim <= {_decode.MAX_GROUP_DIM})")
        att = Attention(int(n_heads), float(scale),
                        None if soft_cap is None else float(soft_cap), out_dim, cfg.v_less,
                        per_launch, latent_heads)
    if cache.storage is None:
        raise NotSupportedError("capture_step needs a cache with its own K/V storage")
    return int(batch), att


__all__ = ["Attention", "CAPTURED_QUANT_TYPES", "DecodeStep", "HEADER", "HybridStep",
           "WrapperStep",
           "check_capturable",
           "fill_attention",
           "fill_descriptor"]
