"""``PairedCache``: two caches of different row layouts driven as one (llama.cpp's
``llama_kv_cache_dsa`` / ``_msa``: the MLA latent keys of DeepSeek-V3.2-class models beside the
lightning indexer's keys).

Both halves are :class:`~numbakv.causal.CausalCache` s of the same sizing (cells, sequences, batch,
padding, device, windows), so the first-fit placement, every eviction, defrag plan and sequence
operation lands on the same cells in both: one cell layout, two storages. Every operation goes
through :class:`~numbakv.wrappers.WrapperCache`'s fan-out, all or nothing (a refusal in either
half undoes the other), and snapshots, state files, prefix-store entries and ``numbakv.dist``
transfers carry both halves' rows together. :meth:`PairedCache.check_paired` says whether the two
cell tables are identical (the tests drive random operations through it).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import numpy as np

from .causal import CausalCache, ShiftFn
from .config import CacheConfig, RopeShift
from .errors import KVCacheError
from .wrappers import WrapperCache

#: config fields that size and place cells: equal in both halves so placement is identical
_SIZING = ("n_layers", "capacity", "max_seqs", "max_batch", "cache_padding",
           "mask_batch_padding", "unified", "device", "head_shard", "layer_reuse", "page_size")

_Shift = Union[None, RopeShift, ShiftFn]


class PairedCache(WrapperCache):
    """A main cache and an indexer cache on one cell layout.

    Args:
        main_cfg: the main rows, e.g. an MLA latent ``CacheConfig(n_layers, 1, 576,
            v_head_dim=0, k_dtype="fp8_ds_mla")``.
        indexer_cfg: the indexer's rows, e.g. ``CacheConfig(n_layers, 1, 128, v_head_dim=0)``;
            the fields that size and place cells (``n_layers``, ``capacity``, ``max_seqs``,
            ``max_batch``, ``cache_padding``, ``mask_batch_padding``, ``unified``, ``device``,
            ``head_shard``, ``layer_reuse``, ``page_size``) must equal ``main_cfg``'s (paged
            placement is deterministic too: both halves get the same pages).
        shift: the main rows' RoPE re-rotation (``RopeShift(dim=64, offset=512)`` for a
            latent); ``indexer_shift``: the indexer keys' (both or neither: a context shift must
            move both halves).
        swa_window, swa_memory, chunk_size, shared_shift: as ``CausalCache``, for both halves.

    Use: ``set_layer(layer)``, then ``put(key, value)`` (main rows) and ``put_indexer(key)``
    (indexer keys ``[batch, n_kv_heads, head_dim]`` of ``indexer_cfg``); ``get()`` the main rows
    and mask, ``get_indexer()`` the indexer keys and the same mask. ``main`` and ``indexer`` are
    the two halves (read them; drive the pair through this object).
    """

    def __init__(self, main_cfg: CacheConfig, indexer_cfg: CacheConfig, *, shift: _Shift = None,
                 indexer_shift: _Shift = None, swa_window: Optional[int] = None,
                 swa_memory: Optional[int] = None, chunk_size: Optional[int] = None,
                 shared_shift: str = "error") -> None:
        for name, cfg in (("main_cfg", main_cfg), ("indexer_cfg", indexer_cfg)):
            if not isinstance(cfg, CacheConfig):
                raise ValueError(f"{name} must be a numbakv.CacheConfig, got "
                                 f"{type(cfg).__name__}")
        for field in _SIZING:
            a, b = getattr(main_cfg, field), getattr(indexer_cfg, field)
            if a != b:
                raise ValueError(f"indexer_cfg.{field} must equal main_cfg.{field} (the pair "
                                 f"shares one cell layout), got {b!r} and {a!r}")
        if not indexer_cfg.v_less:
            raise ValueError(f"indexer_cfg must be V-less (v_head_dim=0: the indexer caches keys "
                             f"only), got v_head_dim={indexer_cfg.v_head_dim}")
        if (shift is None) != (indexer_shift is None):
            raise ValueError("shift and indexer_shift must be given both or neither: a context "
                             "shift moves the main rows and the indexer keys together")
        kw = dict(swa_window=swa_window, swa_memory=swa_memory, chunk_size=chunk_size,
                  shared_shift=shared_shift)
        main = CausalCache(main_cfg, shift=shift, **kw)
        try:
            indexer = CausalCache(indexer_cfg, shift=indexer_shift, **kw)
        except BaseException:
            main.close()
            raise
        super().__init__([main, indexer])

    # ---------------------------------------------------------------- the halves
    @property
    def main(self) -> CausalCache:
        """The main rows' cache (read it; drive the pair through this object)."""
        return self.caches[0]

    @property
    def indexer(self) -> CausalCache:
        """The indexer keys' cache (read it; drive the pair through this object)."""
        return self.caches[1]

    @property
    def config(self) -> CacheConfig:
        """The main rows' config."""
        return self.main.config

    def set_layer(self, layer: int) -> None:
        """Select ``layer`` in both halves; ``put``/``get`` then address the main rows."""
        layer = int(layer) if isinstance(layer, (int, np.integer)) and \
            not isinstance(layer, bool) else layer
        self.main.set_layer(layer)
        self.indexer.set_layer(layer)
        self._current = 0

    def capture_step(self, batch: int, *, attend: bool = False, **attention: Any) -> Any:
        """A captured decode step of both halves' puts (:class:`numbakv.step.WrapperStep`:
        ``steps[0]`` the main rows, ``steps[1]`` the indexer keys; ``replay(positions, seqs,
        None, [main_k, indexer_k], [main_v, None])``). ``attend=True`` is refused
        (``NotSupportedError``): DeepSeek sparse attention reads the top-k cells the indexer
        picks per token, and the captured attention is dense over every visible cell;
        capture the puts and run the sparse attention over the step's pass."""
        from .errors import NotSupportedError
        if attend is True or attention:
            self._check_open_all()
            raise NotSupportedError(
                "PairedCache.capture_step(attend=True): DeepSeek sparse attention reads the "
                "top-k cells the lightning indexer picks per token, and the captured attention "
                "is dense over every visible cell; capture the puts (attend=False) and run the "
                "sparse attention over the step's pass")
        return super().capture_step(batch, attend=attend)

    def _check_open_all(self) -> None:
        for cache in self.caches:
            cache._check_open()

    def set_layer_type(self, index: int) -> None:
        """Not used by a pair: ``put``/``get`` address the main rows, ``put_indexer``/
        ``get_indexer`` the indexer keys."""
        raise KVCacheError("PairedCache: use put/get for the main rows and put_indexer/"
                           "get_indexer for the indexer keys")

    def put(self, key: Any, value: Any = None) -> None:
        """Store the batch's main rows ``key [batch, n_kv_heads, head_dim]`` (``value`` as
        ``CausalCache.put``; ``None`` for a V-less latent) in the current layer."""
        self.main.put(key, value)

    def put_indexer(self, key: Any) -> None:
        """Store the batch's indexer keys ``[batch, n_kv_heads, head_dim]`` (indexer_cfg's
        shape) in the current layer."""
        self.indexer.put(key, None)

    def get(self) -> Tuple[Any, Any, Any]:
        """``(key, value, mask)`` of the main rows, as ``CausalCache.get``."""
        return self.main.get()

    def get_indexer(self) -> Tuple[Any, Any]:
        """``(key, mask)``: the indexer keys of the same cells as :meth:`get` and the same
        mask."""
        key, _, mask = self.indexer.get()
        return key, mask

    def page_table(self, page_size: int = 1) -> Any:
        """The pass's page table (both halves place alike: one table serves both pools); see
        ``CausalCache.page_table``."""
        return self.main.page_table(page_size)

    def check_paired(self) -> None:
        """Raise ``KVCacheError`` unless the two halves' cell tables are identical (positions,
        pending shifts, sequence sets, free cells): every row pair is one token's."""
        a, b = self.main.cells, self.indexer.cells
        if not (np.array_equal(a._ps, b._ps) and np.array_equal(a._seqs, b._seqs)):
            raise KVCacheError("PairedCache halves differ in their cell tables")
        for seq in range(self.main.config.max_seqs):
            if self.main.seq_pos_min(seq) != self.indexer.seq_pos_min(seq) or \
                    self.main.seq_pos_max(seq) != self.indexer.seq_pos_max(seq):
                raise KVCacheError(f"PairedCache halves differ for sequence {seq}")


__all__ = ["PairedCache"]
