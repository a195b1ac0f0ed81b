"""``generation_cache``: a transformers ``Cache`` for ``model.generate()`` backed by numbakv.

Its layers store every new key and value in a numbakv cache built by
:func:`numbakv.hf.cache_for` (windows, RoPE shift, quantized K/V options) and hand the model
back, per layer, the K/V its own attention and mask expect - the same tensors ``DynamicCache``
would hand it (``[batch, kv_heads, kv_len, head_dim]``; a sliding layer's last ``window - 1``
columns plus the new ones). Row ``b`` of the padded batch is numbakv sequence ``b``; a column is
a position (left padding is stored like ``DynamicCache`` stores it and masked by the model's
``attention_mask``). Inputs that require grad are detached here: no ``torch.no_grad()`` is
needed.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Optional

import numpy as np

from ..config import CacheConfig
from ..errors import KVCacheError, NotSupportedError
from ._deps import _transformers
from .attach import attached_cache
from .families import cache_for, hybrid_attention, hybrid_layout
from .recurrent import begin_passes_in_a_hook, generation_layer_class


class _GenState:
    """What the layers of one generation cache share: the numbakv cache (built at the first
    forward pass, when the batch size and prompt length are known) and the columns it holds."""

    def __init__(self, model: Any, max_new_tokens: Optional[int], capacity: Optional[int],
                 dtype: Any, device: str, kw: dict) -> None:
        self.model, self.max_new_tokens, self.capacity = model, max_new_tokens, capacity
        self.dtype, self.device, self.kw = dtype, device, kw
        self.cache: Any = None
        self.batch = 0
        self.columns = 0            # columns (positions) of every row the numbakv cache holds

    def begin(self, batch: int, new: int) -> None:
        """A forward pass of ``new`` columns for each of ``batch`` rows."""
        if self.cache is None:
            capacity = self.capacity
            if capacity is None:
                capacity = batch * (new + self.max_new_tokens + 1)
            self.cache = cache_for(self.model, capacity=int(capacity), max_seqs=batch,
                                   max_batch=max(512, batch * new), dtype=self.dtype,
                                   device=self.device, **self.kw)
            self.batch = batch
        elif batch != self.batch:
            raise ValueError(f"this generation cache serves a batch of {self.batch} rows, got "
                             f"{batch}: make one hf.generation_cache per generate() call")
        positions = np.tile(np.arange(self.columns, self.columns + new), batch)
        seqs = np.repeat(np.arange(batch), new)
        self.cache.start_forward(positions, seqs)
        self.columns += new


def _layer_class():
    torch, cache_utils = _transformers()

    class NumbakvLayer(cache_utils.CacheLayerMixin):
        """One model layer of a :func:`generation_cache` (see the module docstring)."""

        is_compileable = False
        is_croppable = False
        supports_early_init = False

        def __init__(self, state: _GenState, layer: int, window: Optional[int]) -> None:
            super().__init__()
            self.state, self.layer = state, layer
            # transformers' sliding window W counts the query token: numbakv's swa_window + 1
            self.sliding_window = None if window is None else window + 1
            self.is_sliding = window is not None
            self.cumulative_length = 0

        def lazy_initialization(self, key_states, value_states) -> None:
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            """Store ``[batch, kv_heads, new, head_dim]`` keys/values; return this layer's
            visible K/V ``[batch, kv_heads, kv_len, head_dim]`` in the model's dtype."""
            state = self.state
            batch, heads, new, dim = key_states.shape
            if self.cumulative_length == state.columns:     # the first layer of a new pass
                state.begin(batch, new)
            elif self.cumulative_length + new != state.columns:
                raise KVCacheError(f"layer {self.layer} got {new} new columns, the pass started "
                                   f"with {state.columns - self.cumulative_length}")
            cache = state.cache
            cache.set_layer(self.layer)
            # rows then columns: the order begin() gave start_forward
            k = key_states.detach().transpose(1, 2).reshape(batch * new, heads, dim)
            v = value_states.detach().transpose(1, 2).reshape(batch * new, heads, -1)
            want = getattr(torch, cache._attention_cache.config.dtype)
            cache.put(k.to(want).contiguous(), v.to(want).contiguous())
            src = cache._attention_cache
            host = src._host_pages()
            key, value, _ = src.get()
            lo, _ = src.cell_range()
            kp, vp = torch.from_dlpack(key), torch.from_dlpack(value)
            counts = np.diff(host.kv_indptr)
            if len(counts) != batch or (counts != counts[0]).any():
                raise KVCacheError(f"layer {self.layer}: rows hold unequal column counts "
                                   f"{counts.tolist()}")
            order = np.argsort(host.seq_ids, kind="stable")       # row b = sequence b
            idx = np.stack([host.kv_indices[host.kv_indptr[b]:host.kv_indptr[b + 1]]
                            for b in order]).astype(np.int64) - lo
            idx_t = torch.from_numpy(idx.reshape(-1)).to(kp.device)
            ks = kp.index_select(0, idx_t).reshape(batch, -1, heads, dim).transpose(1, 2)
            vs = vp.index_select(0, idx_t).reshape(batch, -1, heads, vp.shape[-1]).transpose(1, 2)
            self.keys = ks.to(key_states.dtype)
            self.values = vs.to(value_states.dtype)
            self.is_initialized = True
            self.cumulative_length += new        # counted once stored and read back
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int):
            if self.sliding_window is None:
                return self.cumulative_length + query_length, 0
            w = self.sliding_window
            offset = max(self.cumulative_length - w + 1, 0)
            if self.cumulative_length >= w:
                return w - 1 + query_length, offset
            return self.cumulative_length + query_length, offset

        def get_seq_length(self) -> int:
            return self.cumulative_length

        def get_max_length(self) -> int:
            return -1 if self.sliding_window is None else self.sliding_window

        def reset(self) -> None:
            raise KVCacheError("a numbakv generation cache is not reset: make a new one per "
                               "generate() call (hf.generation_cache)")

        def reorder_cache(self, beam_idx) -> None:
            raise KVCacheError("beam search is not supported by numbakv's generation cache "
                               "(num_beams=1)")

        def crop(self, tokens_to_remove: int) -> None:
            raise KVCacheError("cropping (assisted decoding) is not supported by numbakv's "
                               "generation cache")

        def batch_repeat_interleave(self, repeats: int) -> None:
            if repeats != 1:
                raise KVCacheError("num_return_sequences > 1 / num_beams > 1 are not supported "
                                   "by numbakv's generation cache: repeat the rows of input_ids")

        def batch_select_indices(self, indices) -> None:
            raise KVCacheError("selecting batch rows is not supported by numbakv's generation "
                               "cache")

    return NumbakvLayer


def generation_cache(model: Any, *, max_new_tokens: Optional[int] = None,
                     capacity: Optional[int] = None, dtype: Any = None, device: str = "auto",
                     **kw) -> Any:
    """A transformers ``Cache`` for ``model.generate(..., past_key_values=cache)`` (or
    ``cache=`` on transformers >= 5.24, which renamed the keyword) whose keys and values live in
    a numbakv cache.

    Args:
        model: the transformers model (not attached with ``hf.attach``: generate runs the
            model's own attention over the K/V this cache returns).
        max_new_tokens: tokens ``generate`` will add per row; sizes the cache as
            ``batch * (prompt + max_new_tokens + 1)`` cells when ``capacity`` is None.
        capacity: cells of the numbakv cache (default from ``max_new_tokens``).
        dtype, device, **kw: as :func:`numbakv.hf.cache_for` (e.g. ``k_dtype="q8_0",
            v_dtype="q8_0"`` for quantized K/V: the model then attends over the dequantized
            values).

    Returns:
        a ``transformers.Cache`` (DynamicCache-compatible: ``update``, ``get_seq_length``,
        ``get_mask_sizes``). One per ``generate()`` call: the batch (one numbakv sequence per
        row of the padded batch) is fixed by its first forward pass. ``.numbakv_cache`` is the
        numbakv cache once that pass ran. Beam search and assisted decoding are refused.
    """
    torch, cache_utils = _transformers()
    if capacity is None and max_new_tokens is None:
        raise ValueError("generation_cache needs max_new_tokens (or capacity) to size the cache")
    for name, value in (("max_new_tokens", max_new_tokens), ("capacity", capacity)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a transformers model, got {type(model).__name__}")
    if attached_cache(model) is not None:
        raise ValueError("model is attached to a numbakv cache (hf.attach): generate() runs the "
                         "model's own attention; call hf.detach(model) first")
    known = {f.name for f in fields(CacheConfig)} - {"n_layers", "n_kv_heads", "head_dim",
                                                      "v_head_dim", "capacity", "max_seqs",
                                                      "max_batch", "dtype", "device"}
    unknown = sorted(set(kw) - known - {"shift", "swa_memory"})
    if unknown:
        raise ValueError(f"generation_cache got unexpected option(s) {unknown}: extra options "
                         f"are hf.cache_for's (CacheConfig fields {sorted(known)}, shift, "
                         "swa_memory)")
    layout = hybrid_layout(model)
    attention = hybrid_attention(model)       # every layer, unless the model is a hybrid
    if any(la.chunk_size is not None for la in attention.values()):
        raise NotImplementedError("chunked-attention models are not supported by "
                                  "generation_cache")
    if layout is not None and "both" in layout.layer_kinds:
        raise NotSupportedError(f"{layout.family}: layers holding attention and a recurrent "
                                "mixer side by side are not supported by generation_cache yet "
                                "(hf.attach / hf.Server serve them)")
    state = _GenState(model, max_new_tokens, capacity, dtype, device, kw)
    layer_cls = _layer_class()
    layers = {i: layer_cls(state, i, la.swa_window) for i, la in attention.items()}
    if layout is not None:
        # recurrent layers: transformers' own layer over numbakv's state rows; every pass begins
        # before the first layer (a recurrent one asks for its state first)
        recurrent_cls = generation_layer_class()
        layers.update({i: recurrent_cls(state, i, j)
                       for j, i in enumerate(layout.recurrent_layers)})

    class NumbakvGenerationCache(cache_utils.Cache):
        """A transformers Cache backed by numbakv (see :func:`numbakv.hf.generation_cache`)."""

        @property
        def numbakv_cache(self):
            return state.cache

    cache = NumbakvGenerationCache(layers=[layers[i] for i in sorted(layers)])
    if layout is not None:
        begin_passes_in_a_hook(model, cache, state)
    return cache
