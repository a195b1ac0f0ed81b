"""Cache configuration: validated on construction, sized before anything is allocated."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from .errors import NotSupportedError

#: Storage dtypes by name. bfloat16 is kept as its 16-bit pattern (numpy has no bfloat16).
STORAGE_DTYPES = {"float16": np.dtype(np.float16), "float32": np.dtype(np.float32),
                  "bfloat16": np.dtype(np.uint16)}
MASK_DTYPES = {"float16": np.dtype(np.float16), "float32": np.dtype(np.float32),
               "bfloat16": np.dtype(np.uint16)}   # bfloat16 masks: bit patterns, like K/V
#: Quantized K/V storage types (``k_dtype``/``v_dtype``): name -> (values per block, bytes per
#: block). q8_0 and q4_0 are ggml's block formats (an f16 scale then 32 int8s, or 16 bytes of
#: nibbles); float8_e4m3 is one float8_e4m3fn byte per value (a "block" of one) with a per-layer
#: scale, vLLM's fp8 KV cache.
QUANT_TYPES = {"q8_0": (32, 34), "q4_0": (32, 18), "float8_e4m3": (1, 1),
               "fp8_ds_mla": (576, 656)}
#: FlashMLA's fp8 MLA row (``k_dtype="fp8_ds_mla"``, see kernels/mla.py): one "block" per
#: 576-value latent row (512 latent + 64 rope), 656 bytes; V-less caches only
DS_MLA = "fp8_ds_mla"
DEVICES = ("auto", "cpu", "cuda", "sim")
#: ``kv_rotation`` settings: llama.cpp's rule (``"auto"``), the rule required (``"on"``), none
KV_ROTATIONS = ("auto", "on", "off")
#: the storage types llama.cpp rotates before quantizing (its ggml block types; float8 is vLLM's
#: per-layer-scale format, which llama.cpp has no rotation for)
ROTATED_TYPES = ("q8_0", "q4_0")
#: the smallest Walsh-Hadamard block (and the V block): llama.cpp rotates a side only when its
#: head dim is a multiple of it
ROTATION_MIN_BLOCK = 64
#: llama.cpp's rule, as the errors quote it
ROTATION_RULE = ("llama.cpp rotates a side whose type is q8_0/q4_0 and whose head dim is a "
                 "multiple of 64 (K in blocks of the largest power of two dividing head_dim, "
                 "V in blocks of 64)")
#: The sequence bitset of a cell has this many bits (see cells.py).
MAX_SEQS_LIMIT = 256


def normalize_dtype(dtype, name: str = "dtype", allowed=STORAGE_DTYPES) -> str:
    """Turn a dtype given as a string, numpy dtype or framework dtype into its canonical name."""
    if isinstance(dtype, type):
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            pass
    text = str(getattr(dtype, "name", dtype)).lower()
    for prefix in ("torch.", "jnp.", "numpy.", "np.", "cupy."):
        if text.startswith(prefix):
            text = text[len(prefix):]
    aliases = {"half": "float16", "f16": "float16", "fp16": "float16", "float": "float32",
               "f32": "float32", "fp32": "float32", "bf16": "bfloat16"}
    text = aliases.get(text, text)
    if allowed is QUANT_TYPES or allowed is KV_TYPES:
        text = {"fp8": "float8_e4m3", "fp8_e4m3": "float8_e4m3", "float8_e4m3fn": "float8_e4m3",
                "q8": "q8_0", "q4": "q4_0"}.get(text, text)
    if text not in allowed:
        raise ValueError(f"{name} must be one of {sorted(allowed)}, got {dtype!r}")
    return text


#: every name ``k_dtype``/``v_dtype`` takes
KV_TYPES = dict(STORAGE_DTYPES, **QUANT_TYPES)


def row_bytes(kv_dtype: str, dim: int) -> int:
    """Bytes one ``(cell, head)`` row of ``dim`` values takes in storage type ``kv_dtype``."""
    if kv_dtype in QUANT_TYPES:
        per_block, block_bytes = QUANT_TYPES[kv_dtype]
        return dim // per_block * block_bytes
    return dim * STORAGE_DTYPES[kv_dtype].itemsize


def _check_scale(name: str, value, n_layers: int) -> "float | tuple":
    """A positive finite float, or a sequence of ``n_layers`` of them (a tuple, so the frozen
    config stays hashable)."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        if not (math.isfinite(float(value)) and float(value) > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        return float(value)
    try:
        arr = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a float or a sequence of n_layers={n_layers} floats, "
                         f"got {value!r}") from None
    if np.asarray(value).ndim != 1 or arr.size != n_layers:
        raise ValueError(f"{name} must be a float or a sequence of n_layers={n_layers} floats, "
                         f"got {arr.size} values")
    if not (np.isfinite(arr).all() and (arr > 0).all()):
        raise ValueError(f"{name} values must be finite numbers > 0, got {arr.tolist()}")
    return tuple(float(x) for x in arr)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_head_shard(value, n_kv_heads: int) -> "Optional[Tuple[int, int]]":
    """``None`` or ``(rank, world)`` with ``world >= 1``, ``0 <= rank < world`` and ``world``
    dividing ``n_kv_heads`` or a multiple of it (replicated heads)."""
    if value is None:
        return None
    try:
        rank, world = value
    except (TypeError, ValueError):
        raise ValueError(f"head_shard must be None or (rank, world), got {value!r}") from None
    for x in (rank, world):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            raise ValueError(f"head_shard must be a pair of integers (rank, world), got {value!r}")
    rank, world = int(rank), int(world)
    if world < 1:
        raise ValueError(f"head_shard world must be >= 1, got {value!r}")
    if not 0 <= rank < world:
        raise ValueError(f"head_shard rank must be in [0, world={world}), got {value!r}")
    if n_kv_heads % world and world % n_kv_heads:
        raise ValueError(f"head_shard world must divide n_kv_heads={n_kv_heads} or be a multiple "
                         f"of it, got {value!r}")
    return (rank, world)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class CacheConfig:
    """Shapes, dtypes and limits of a cache.

    ``v_head_dim=0`` makes a V-less latent layer (MLA: ``n_kv_heads=1``, ``head_dim =
    kv_lora_rank + rope_dims``; see :attr:`v_less`).

    K storage is ``[n_layers, n_cells, local_kv_heads, head_dim]``; V storage is
    ``[n_layers, n_cells, local_kv_heads, v_head_dim]`` or, with ``permuted_v``,
    ``[n_layers, local_kv_heads, v_head_dim, n_cells]`` (``local_kv_heads == n_kv_heads`` unless
    ``head_shard`` is set). ``capacity`` is the number of tokens each
    sequence may keep; ``max_seqs`` how many sequences share the cache; ``max_batch`` the most
    tokens one forward pass may add. ``cache_padding`` rounds the cell count and every ``get()``
    range; ``mask_batch_padding`` rounds the mask's rows.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: Optional[int] = None
    dtype: str = "float16"
    capacity: int = 2048
    max_seqs: int = 1
    max_batch: int = 512
    cache_padding: int = 1
    mask_batch_padding: int = 1
    mask_dtype: str = "float32"
    permuted_v: bool = False
    device: str = "auto"
    #: ``False``: llama.cpp's per-sequence streams (``kv_unified = false``): every sequence its
    #: own ``capacity`` cells (or window memory + batch), K/V ``[n_layers, n_streams, cells, ...]``
    unified: bool = True
    k_dtype: Optional[str] = None
    v_dtype: Optional[str] = None
    k_scale: "float | Sequence[float]" = 1.0
    v_scale: "float | Sequence[float]" = 1.0
    #: llama.cpp's layer filter / reuse: ``None`` (every layer owns its K/V) or ``n_layers``
    #: ints: ``layer_reuse[i] == i`` layer ``i`` owns K/V; ``j`` (another layer, which must own
    #: its K/V) layer ``i`` reads layer ``j``'s K/V and stores none (KV-sharing layers such as
    #: Gemma 3n's last ones); ``-1`` no K/V in this cache (a recurrent or linear-attention
    #: layer, or one another cache holds). Storage is allocated for owning layers only.
    layer_reuse: Optional[Sequence[int]] = None
    #: ``(rank, world)``: this cache is one shard of a tensor-parallel group and keeps only the KV
    #: heads :attr:`head_range` of every layer (``None``: all ``n_kv_heads``). ``n_kv_heads``
    #: stays the model's total; storage, ``put``, ``get``, page tables, ``layer_pool`` and
    #: ``attend`` use :attr:`local_kv_heads`.
    head_shard: Optional[Tuple[int, int]] = None
    #: llama.cpp's rotated quantized K/V (since 2026-04, #21038): ``"auto"`` rotates each side
    #: whose type is q8_0/q4_0 and whose head dim is a multiple of 64 by an orthonormal
    #: Walsh-Hadamard matrix before quantizing (K in blocks of the largest power of two dividing
    #: ``head_dim``, V in blocks of 64; see :attr:`k_rotation`); ``"on"``: the same, but a
    #: quantized side the rule cannot serve (or no q8_0/q4_0 side at all) is a ValueError;
    #: ``"off"``: never (llama.cpp's ``LLAMA_ATTN_ROT_DISABLE=1``). Stored rows, ``get()``,
    #: ``get_quantized()``, ``layer_pool()`` and page tables are then in the rotated basis:
    #: a caller's own attention rotates Q with :func:`numbakv.rotate_queries` and turns the
    #: output back with :func:`numbakv.unrotate_output`; ``attend`` does both.
    kv_rotation: str = "auto"
    #: the allocation policy. ``1`` (default): Ollama's contiguous first fit of a whole batch.
    #: ``> 1``: paged placement (vLLM / FlashMLA / FlashInfer block tables): the pool is pages of
    #: ``page_size`` cells; a sequence's next token goes to the next slot of its last page, and
    #: a full page (or a sequence's first token) takes the first wholly free page, so each
    #: sequence's tokens in position order fill whole pages and ``page_table(page_size)`` /
    #: ``mla_views(page_size=...)`` describe it (FlashMLA's dense decode uses 64). A page
    #: is free again when every cell in it is; a sequence that shares a partly filled last page
    #: (``seq_cp``) gets its own copy of it when it goes on; ``defrag`` moves whole pages and
    #: repacks a sequence that broke the rule (a context shift) when it shares no cell. The
    #: contract is in docs/paged.md. The cache's cell
    #: count must be a multiple of it (``cache_padding`` a multiple of it guarantees that).
    #: Needs ``unified=True``.
    page_size: int = 1

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("n_layers", _check_int("n_layers", self.n_layers, 1))
        set_("n_kv_heads", _check_int("n_kv_heads", self.n_kv_heads, 1))
        set_("head_dim", _check_int("head_dim", self.head_dim, 1))
        v_dim = self.head_dim if self.v_head_dim is None else self.v_head_dim
        set_("v_head_dim", _check_int("v_head_dim", v_dim, 0))   # 0: no V (MLA latent)
        set_("dtype", normalize_dtype(self.dtype, "dtype"))
        set_("capacity", _check_int("capacity", self.capacity, 1))
        set_("max_seqs", _check_int("max_seqs", self.max_seqs, 1))
        if self.max_seqs > MAX_SEQS_LIMIT:
            raise ValueError(f"max_seqs must be <= {MAX_SEQS_LIMIT}, got {self.max_seqs}")
        set_("max_batch", _check_int("max_batch", self.max_batch, 1))
        set_("cache_padding", _check_int("cache_padding", self.cache_padding, 1))
        set_("mask_batch_padding", _check_int("mask_batch_padding", self.mask_batch_padding, 1))
        set_("mask_dtype", normalize_dtype(self.mask_dtype, "mask_dtype", MASK_DTYPES))
        if not isinstance(self.permuted_v, (bool, np.bool_)):
            raise ValueError(f"permuted_v must be a bool, got {self.permuted_v!r}")
        set_("permuted_v", bool(self.permuted_v))
        if not isinstance(self.unified, (bool, np.bool_)):
            raise ValueError(f"unified must be a bool, got {self.unified!r}")
        set_("unified", bool(self.unified))
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        self._check_kv_types(set_)
        self._check_rotation()
        set_("layer_reuse", _check_layer_reuse(self.layer_reuse, self.n_layers))
        set_("head_shard", _check_head_shard(self.head_shard, self.n_kv_heads))
        set_("page_size", _check_int("page_size", self.page_size, 1))
        if self.page_size > 1 and not self.unified:
            raise ValueError(f"page_size={self.page_size} needs unified=True (one shared cell "
                             "pool); per-sequence streams (unified=False) place contiguously")

    @property
    def head_range(self) -> Tuple[int, int]:
        """``(first, stop)``: the KV heads this cache keeps, ``(0, n_kv_heads)`` unless
        ``head_shard`` is set. With ``head_shard=(rank, world)`` and ``H = n_kv_heads``: heads
        ``[rank*H/world, (rank+1)*H/world)`` when ``world <= H``; when ``world > H`` each rank keeps
        the single head ``rank * H // world`` (replicated ``world / H`` times, as vLLM does)."""
        if self.head_shard is None:
            return (0, self.n_kv_heads)
        rank, world = self.head_shard
        H = self.n_kv_heads
        if world <= H:
            per = H // world
            return (rank * per, (rank + 1) * per)
        head = rank * H // world
        return (head, head + 1)

    @property
    def head_replicas(self) -> int:
        """How many ranks of a ``head_shard`` group hold each KV head this cache holds: 1 when
        the heads are split (or unsharded), ``world / n_kv_heads`` when they are replicated. An
        MLA latent (``v_head_dim=0``, one "head") cannot be split by heads: every rank keeps the
        whole latent (``head_replicas == world``), as vLLM does under tensor parallelism."""
        if self.head_shard is None:
            return 1
        world = self.head_shard[1]
        return world // self.n_kv_heads if world > self.n_kv_heads else 1

    @property
    def local_kv_heads(self) -> int:
        """KV heads held per layer: ``stop - first`` of :attr:`head_range` (``n_kv_heads``
        unless head-sharded). Every storage shape uses it."""
        first, stop = self.head_range
        return stop - first

    def _check_kv_types(self, set_) -> None:
        """``k_dtype``/``v_dtype``: ``dtype`` (the default) or a quantized type; ggml blocks need
        the row length to be a multiple of 32; a quantized V cannot be stored permuted (its
        blocks run along ``v_head_dim``; llama.cpp likewise needs flash attention, i.e. no
        transposed V, for a quantized V)."""
        for name, dim_name in (("k_dtype", "head_dim"), ("v_dtype", "v_head_dim")):
            value = getattr(self, name)
            kind = self.dtype if value is None else normalize_dtype(value, name, KV_TYPES)
            if kind in STORAGE_DTYPES and kind != self.dtype:
                raise ValueError(f"{name} must be dtype ({self.dtype!r}) or one of "
                                 f"{sorted(QUANT_TYPES)}, got {value!r} (a float storage type "
                                 "other than dtype is not supported)")
            per_block = QUANT_TYPES.get(kind, (1, 0))[0]
            dim = getattr(self, dim_name)
            if dim % per_block:
                raise ValueError(f"{dim_name} must be a multiple of {per_block} for {name}="
                                 f"{kind!r} (ggml blocks run along it), got {dim}")
            set_(name, kind)
        if self.v_dtype == DS_MLA:
            raise ValueError("v_dtype='fp8_ds_mla' is a key (latent row) format: MLA caches "
                             "store no V (v_head_dim=0)")
        if self.k_dtype == DS_MLA and (self.head_dim != 576 or self.v_head_dim != 0):
            raise ValueError(f"k_dtype='fp8_ds_mla' is FlashMLA's 656-byte row of one MLA latent "
                             f"(512 latent + 64 rope values): it needs head_dim=576 and "
                             f"v_head_dim=0, got head_dim={self.head_dim}, "
                             f"v_head_dim={self.v_head_dim}")
        if self.v_head_dim == 0 and (self.v_quantized or self.permuted_v):
            raise ValueError(f"v_head_dim=0 (a V-less latent layer: no V is stored) takes no "
                             f"v_dtype other than dtype and no permuted_v, got v_dtype="
                             f"{self.v_dtype!r}, permuted_v={self.permuted_v}")
        if self.permuted_v and self.v_dtype in QUANT_TYPES:
            raise ValueError(f"permuted_v=True needs a float v_dtype, got v_dtype="
                             f"{self.v_dtype!r} (quantized blocks run along v_head_dim)")
        set_("k_scale", _check_scale("k_scale", self.k_scale, self.n_layers))
        set_("v_scale", _check_scale("v_scale", self.v_scale, self.n_layers))

    def _check_rotation(self) -> None:
        """``kv_rotation`` is one of :data:`KV_ROTATIONS`; ``"on"`` needs every q8_0/q4_0 side
        to satisfy llama.cpp's rule, and at least one such side."""
        if not isinstance(self.kv_rotation, str) or self.kv_rotation not in KV_ROTATIONS:
            raise ValueError(f"kv_rotation must be one of {KV_ROTATIONS}, got "
                             f"{self.kv_rotation!r}")
        if self.kv_rotation != "on":
            return
        sides = [(name, kind, dim) for name, kind, dim in
                 (("k_dtype", self.k_dtype, self.head_dim),
                  ("v_dtype", self.v_dtype, self.v_head_dim))
                 if kind in ROTATED_TYPES and dim > 0]   # dim 0: a V-less (MLA) layer
        if not sides:
            raise ValueError(f"kv_rotation='on' needs k_dtype or v_dtype in {ROTATED_TYPES}, "
                             f"got {self.k_dtype!r}/{self.v_dtype!r}: {ROTATION_RULE}")
        for name, kind, dim in sides:
            if dim % ROTATION_MIN_BLOCK:
                dim_name = "head_dim" if name == "k_dtype" else "v_head_dim"
                raise ValueError(f"kv_rotation='on' cannot rotate {name}={kind!r} with "
                                 f"{dim_name}={dim} (not a multiple of {ROTATION_MIN_BLOCK}): "
                                 f"{ROTATION_RULE}; use kv_rotation='auto' or 'off'")

    def _rotation_block(self, kind: str, dim: int, largest: bool) -> int:
        if self.kv_rotation == "off" or kind not in ROTATED_TYPES or dim <= 0 \
                or dim % ROTATION_MIN_BLOCK:
            return 0
        if not largest:
            return ROTATION_MIN_BLOCK
        return dim & -dim   # the largest power of two dividing dim

    @property
    def k_rotation(self) -> int:
        """Walsh-Hadamard block of the stored keys (and of the queries that read them): the
        largest power of two dividing ``head_dim`` when keys are rotated, else 0."""
        return self._rotation_block(self.k_dtype, self.head_dim, True)

    @property
    def v_rotation(self) -> int:
        """Walsh-Hadamard block of the stored values (and of the attention output): 64 when
        values are rotated, else 0."""
        return self._rotation_block(self.v_dtype, self.v_head_dim, False)

    @property
    def v_less(self) -> bool:
        """Whether the layers store no V (``v_head_dim == 0``): an MLA latent cache, whose one
        "head" per token is ``kv_lora_rank + rope_dims`` values and whose V is read from the
        latent itself (llama.cpp's V-less cache, #19067). ``get()`` and ``layer_pool()`` then hand
        out a zero-width value ``[n, n_kv_heads, 0]`` and nothing is allocated for it."""
        return self.v_head_dim == 0

    @property
    def k_quantized(self) -> bool:
        """Whether keys are stored in a quantized type (``k_dtype`` in ``QUANT_TYPES``)."""
        return self.k_dtype in QUANT_TYPES

    @property
    def v_quantized(self) -> bool:
        """Whether values are stored in a quantized type (``v_dtype`` in ``QUANT_TYPES``)."""
        return self.v_dtype in QUANT_TYPES

    @property
    def k_row_bytes(self) -> int:
        """Bytes of one ``(cell, head)`` key row in storage."""
        return row_bytes(self.k_dtype, self.head_dim)

    @property
    def v_row_bytes(self) -> int:
        """Bytes of one ``(cell, head)`` value row in storage."""
        return row_bytes(self.v_dtype, self.v_head_dim)

    def layer_scales(self, which: str) -> np.ndarray:
        """float32 ``[n_layers]``: ``k_scale`` (``which="k"``) or ``v_scale`` per layer."""
        value = self.k_scale if which == "k" else self.v_scale
        return np.broadcast_to(np.asarray(value, dtype=np.float32), (self.n_layers,)).copy()

    @property
    def storage_dtype(self) -> np.dtype:
        """The numpy dtype the storage arrays hold (uint16 bit patterns for bfloat16)."""
        return STORAGE_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        """Bytes per stored K/V element (2 for float16/bfloat16, 4 for float32)."""
        return self.storage_dtype.itemsize

    @property
    def n_streams(self) -> int:
        """Cell pools: one per sequence with ``unified=False``, else one shared by all."""
        return 1 if self.unified else self.max_seqs

    def cells_per_stream(self, swa_memory: Optional[int] = None) -> int:
        """Cells of one stream: what ``n_cells`` gives a one-sequence cache (``capacity``, or
        ``swa_memory + max_batch`` with a window memory, as llama.cpp sizes each SWA stream),
        rounded up to ``cache_padding``. Equals ``n_cells`` for a unified cache."""
        if self.unified:
            return self.n_cells(swa_memory)
        return self.replace(max_seqs=1, unified=True).n_cells(swa_memory)

    def n_cells(self, swa_memory: Optional[int] = None) -> int:
        """Cells the cache allocates (Ollama's Init): ``max_seqs * capacity`` without a memory
        limit; ``max_seqs * swa_memory + max_batch`` with one; rounded up to ``cache_padding``.
        With ``unified=False``: ``max_seqs`` streams of ``cells_per_stream`` cells each (pass
        the window memory of one stream)."""
        if not self.unified:
            return self.max_seqs * self.cells_per_stream(swa_memory)
        if swa_memory is None:
            cells = self.max_seqs * self.capacity
        else:
            cells = self.max_seqs * int(swa_memory) + self.max_batch
        return round_up(cells, self.cache_padding)

    def nbytes(self, n_cells: Optional[int] = None, *, swa_memory: Optional[int] = None) -> int:
        """Bytes of K and V storage for ``n_cells`` cells (default: what the cache allocates):
        owning layers only (``layer_reuse``)."""
        if n_cells is None:
            n_cells = self.n_cells(swa_memory)
        per_cell = self.n_stored_layers * self.local_kv_heads * (self.k_row_bytes +
                                                                 self.v_row_bytes)
        return int(n_cells) * per_cell

    # -- layer filter / reuse (llama.cpp's ``filter`` and ``reuse``)
    @property
    def owner_layers(self) -> Tuple[int, ...]:
        """The model layers that store K/V, ascending (every layer without ``layer_reuse``)."""
        if self.layer_reuse is None:
            return tuple(range(self.n_layers))
        return tuple(i for i, r in enumerate(self.layer_reuse) if r == i)

    @property
    def n_stored_layers(self) -> int:
        """Layers of K/V the storage holds: the owning layers."""
        return len(self.owner_layers)

    def owner_layer(self, layer: int) -> int:
        """The model layer whose K/V ``layer`` reads (itself when it owns K/V), -1 when the
        layer has none in this cache. The hook sequence snapshots and state files use to find
        a layer's rows: see :meth:`storage_layer`."""
        if self.layer_reuse is None:
            return layer
        return self.layer_reuse[layer]

    def storage_layer(self, layer: int) -> int:
        """Index along the storage's layer axis of the K/V ``layer`` reads (-1: none)."""
        return self.storage_layers[layer]

    @property
    def storage_layers(self) -> Tuple[int, ...]:
        """For every model layer, the storage layer its K/V lives in (-1: none)."""
        if self.layer_reuse is None:
            return tuple(range(self.n_layers))
        slot = {layer: i for i, layer in enumerate(self.owner_layers)}
        return tuple(slot.get(r, -1) for r in self.layer_reuse)

    def storage_config(self) -> "CacheConfig":
        """The config a ``KVStorage`` is allocated with: the owning layers only (their float8
        scales with them), no ``layer_reuse``. Itself when every layer owns K/V."""
        if self.layer_reuse is None:
            return self
        owners = list(self.owner_layers)
        scales = {}
        for side in ("k_scale", "v_scale"):
            value = getattr(self, side)
            scales[side] = tuple(value[i] for i in owners) if isinstance(value, tuple) \
                else value
        return self.replace(n_layers=len(owners), layer_reuse=None, **scales)

    def replace(self, **changes: Any) -> "CacheConfig":
        """A new, validated config with ``changes`` (field name -> value) applied."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for side in ("k_dtype", "v_dtype"):  # a side that follows dtype keeps following it
            if "dtype" in changes and side not in changes and values[side] == self.dtype:
                values[side] = None
        values.update(changes)
        return CacheConfig(**values)

    def to_dict(self) -> dict:
        """Every field by name (plain values: what ``CacheConfig(**d)`` takes back)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_layer_reuse(value, n_layers: int) -> Optional[Tuple[int, ...]]:
    """``layer_reuse`` as a tuple of ``n_layers`` ints (None stays None), each -1, the layer
    itself, or another layer that owns its K/V; at least one layer must own K/V."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        raise ValueError(f"layer_reuse must be None or a sequence of n_layers={n_layers} ints, "
                         f"got {type(value).__name__}")
    items = list(value)
    if len(items) != n_layers:
        raise ValueError(f"layer_reuse must have n_layers={n_layers} entries, got {len(items)}")
    out = []
    for i, r in enumerate(items):
        if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, np.integer)) \
                or not -1 <= int(r) < n_layers:
            raise ValueError(f"layer_reuse[{i}] must be -1 or a layer in [0, {n_layers}), got "
                             f"{r!r}")
        out.append(int(r))
    for i, r in enumerate(out):
        if r >= 0 and r != i and out[r] != r:
            raise ValueError(f"layer_reuse[{i}] = {r}: layer {r} must own its K/V "
                             f"(layer_reuse[{r}] == {r}), got layer_reuse[{r}] = {out[r]}")
    if not any(r == i for i, r in enumerate(out)):
        raise ValueError("layer_reuse must leave at least one layer owning its K/V "
                         "(layer_reuse[i] == i)")
    return tuple(out)


def _freq_factors(value) -> tuple:
    """``freq_factors`` as a tuple of finite floats > 0, from a 1-D sequence or array; anything
    else (a mapping, a string, nested or 2-D data, non-numbers) is a ValueError naming it."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__") \
            and not hasattr(value, "__array__") and not hasattr(value, "__dlpack__"):
        raise ValueError(f"freq_factors must be a 1-D sequence of numbers, got "
                         f"{type(value).__name__}")
    try:
        arr = np.asarray(value)
    except Exception as exc:  # noqa: BLE001 - ragged lists, foreign tensors, ...
        raise ValueError(f"freq_factors must be a 1-D sequence of numbers: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"freq_factors must be 1-D (one factor per rotary pair), got shape "
                         f"{arr.shape}")
    if arr.size and arr.dtype.kind not in "iuf":
        raise ValueError(f"freq_factors must hold real numbers, got dtype {arr.dtype}")
    factors = tuple(float(f) for f in arr.astype(np.float64))
    if not all(math.isfinite(f) and f > 0 for f in factors):
        raise ValueError("freq_factors must be finite numbers > 0")
    return factors


@dataclass(frozen=True)
class RopeShift:
    """Parameters of the rotary re-rotation applied to keys whose position moves.

    A stored key roped at position ``p`` rotated by ``delta`` equals the key roped at
    ``p + delta``: pair ``i`` of the ``dim`` rotary dims turns by
    ``delta * freq_scale * base**(-2i/dim) / freq_factors[i]``. ``neox=True`` pairs
    ``(x[i], x[i + dim/2])`` (rotate-half, HF Llama); ``neox=False`` pairs ``(x[2i], x[2i+1])``
    (GGUF llama). ``dim=None`` means the whole ``head_dim`` (past ``offset``). Always computed
    in float32; a pure rotation (no YaRN magnitude scaling).

    ``offset``: the rotary dims are ``offset .. offset + dim - 1`` of each key row (0: the leading
    dims, as every per-head key). An MLA latent row ``[kv_lora_rank + rope_dims]`` keeps its rope
    dims last: ``RopeShift(dim=64, offset=512)`` turns only those, and the shift touches only
    their bytes (llama.cpp's K-shift on a DeepSeek cache: offset ``n_embd_head_k - n_rot``).
    """

    base: float = 10000.0
    dim: Optional[int] = None
    neox: bool = True
    freq_scale: float = 1.0
    freq_factors: Optional[Sequence[float]] = field(default=None)
    offset: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.base, (int, float, np.integer, np.floating))
                and not isinstance(self.base, (bool, np.bool_)) and math.isfinite(self.base)
                and self.base > 0):
            raise ValueError(f"base must be a finite number > 0, got {self.base!r}")
        if self.dim is not None:
            dim = _check_int("dim", self.dim, 2)
            if dim % 2:
                raise ValueError(f"dim must be even, got {dim}")
            object.__setattr__(self, "dim", dim)
        if not (isinstance(self.freq_scale, (int, float, np.integer, np.floating))
                and not isinstance(self.freq_scale, (bool, np.bool_))
                and math.isfinite(self.freq_scale) and self.freq_scale > 0):
            raise ValueError(f"freq_scale must be a finite number > 0, got {self.freq_scale!r}")
        object.__setattr__(self, "base", float(self.base))
        object.__setattr__(self, "freq_scale", float(self.freq_scale))
        if not isinstance(self.neox, (bool, np.bool_)):
            raise ValueError(f"neox must be a bool (True: rotate-half pairs, False: interleaved), "
                             f"got {self.neox!r}")
        object.__setattr__(self, "neox", bool(self.neox))
        if self.freq_factors is not None:
            factors = _freq_factors(self.freq_factors)
            if self.dim is not None and len(factors) != self.dim // 2:
                raise ValueError(f"freq_factors must have dim/2 = {self.dim // 2} entries, "
                                 f"got {len(factors)}")
            object.__setattr__(self, "freq_factors", factors)
        object.__setattr__(self, "offset", _check_int("offset", self.offset, 0))

    def rotary_dim(self, head_dim: int) -> int:
        """The number of rotated dims for keys of ``head_dim``; checks that they fit
        (``offset + dim <= head_dim``)."""
        dim = head_dim - self.offset if self.dim is None else self.dim
        if dim < 2 or dim % 2 or self.offset + dim > head_dim:
            raise ValueError(f"RopeShift offset + dim must fit head_dim={head_dim} with dim even "
                             f">= 2, got offset={self.offset}, dim={dim}")
        if self.freq_factors is not None and len(self.freq_factors) != dim // 2:
            raise ValueError(f"freq_factors must have {dim // 2} entries for rotary dim {dim}, "
                             f"got {len(self.freq_factors)}")
        return dim

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """``[rotary_dim // 2]`` float32 angle per unit of position for each pair."""
        dim = self.rotary_dim(head_dim)
        i = np.arange(dim // 2, dtype=np.float64)
        freq = self.freq_scale * self.base ** (-2.0 * i / dim)
        if self.freq_factors is not None:
            freq = freq / np.asarray(self.freq_factors, dtype=np.float64)
        return freq.astype(np.float32)


def check_rope_layout(config: CacheConfig, rope: RopeShift) -> int:
    """The rotary dim of ``rope`` on ``config``'s keys, after checking the pair can shift: the dims
    fit the row (``ValueError``); on a V-less latent row (MLA) the rope dims are the trailing
    ones (``offset + dim == head_dim``), anything else rotates latent dims that never saw RoPE
    (``NotSupportedError``); on quantized keys with an offset the rope dims fill whole blocks
    (``ValueError``)."""
    dim = rope.rotary_dim(config.head_dim)
    if config.k_dtype == DS_MLA and (rope.offset, dim) != (512, 64):
        raise NotSupportedError(f"k_dtype='fp8_ds_mla' keeps the rope dims as the row's 64 "
                                f"trailing bfloat16 values: the shift must be RopeShift(dim=64, "
                                f"offset=512), got offset={rope.offset}, dim={dim}")
    if config.v_less and rope.offset + dim != config.head_dim:
        raise NotSupportedError(
            f"an MLA (v_head_dim=0) latent row keeps its rope dims last: the shift must rotate "
            f"dims [head_dim - n_rot, head_dim) = RopeShift(dim=n_rot, offset=head_dim - n_rot),"
            f" got offset={rope.offset}, dim={dim} on head_dim={config.head_dim}")
    if config.k_dtype in QUANT_TYPES and config.k_dtype != DS_MLA and rope.offset:
        per_block = QUANT_TYPES[config.k_dtype][0]
        if rope.offset % per_block or dim % per_block:
            raise ValueError(f"a RopeShift with offset={rope.offset}, dim={dim} on "
                             f"k_dtype={config.k_dtype!r} keys needs offset and dim multiples of "
                             f"{per_block} (the rope dims must fill whole blocks)")
    rot = config.k_rotation
    if rot and (rope.offset % rot or (rope.offset and dim % rot)):
        raise ValueError(f"a RopeShift with offset={rope.offset}, dim={dim} on keys rotated in "
                         f"Walsh-Hadamard blocks of {rot} (kv_rotation) needs offset and dim "
                         f"multiples of {rot}: the shift turns whole blocks back and forth")
    return dim


__all__ = ["CacheConfig", "check_rope_layout", "KV_ROTATIONS", "KV_TYPES", "ROTATED_TYPES",
           "ROTATION_RULE", "QUANT_TYPES", "RopeShift", "STORAGE_DTYPES", "MASK_DTYPES",
           "normalize_dtype", "round_up", "row_bytes"]


def latent_value_width(config: CacheConfig, shift: Any, v_dim: Any, caller: str) -> int:
    """The value width of a V-less (MLA) cache's absorbed attention: ``v_dim``, or by default
    the cache's ``RopeShift.offset`` (``kv_lora_rank``: the rope dims follow the latent),
    checked to lie in ``[1, head_dim]``; ``caller`` names the call in the errors."""
    if v_dim is None:
        v_dim = getattr(shift, "offset", 0)
        if not v_dim:
            raise ValueError(f"{caller} on a V-less (MLA) cache needs v_dim (the latent width "
                             f"kv_lora_rank) when the cache's shift is not a RopeShift with an "
                             f"offset")
    if isinstance(v_dim, bool) or not isinstance(v_dim, (int, np.integer)) or \
            not 1 <= v_dim <= config.head_dim:
        raise ValueError(f"v_dim must be an integer in [1, head_dim={config.head_dim}], got "
                         f"{v_dim!r}")
    return int(v_dim)
