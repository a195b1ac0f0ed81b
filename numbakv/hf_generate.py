"""``model.generate()`` and continuous batching over numbakv (``hf.generation_cache``,
``hf.Server``).

* :func:`generation_cache` returns a transformers ``Cache`` whose layers store every new key
  and value in a numbakv cache built by :func:`numbakv.hf.cache_for` (windows, RoPE shift,
  quantized K/V options) and hand the model back, per layer, the K/V its own attention and mask
  expect - the same tensors ``DynamicCache`` would hand it (``[batch, kv_heads, kv_len,
  head_dim]``; a sliding layer's last ``window - 1`` columns plus the new ones). Row ``b`` of the
  padded batch is numbakv sequence ``b``; a column is a position (left padding is stored like
  ``DynamicCache`` stores it and masked by the model's ``attention_mask``).
* :class:`Server` serves many prompts over one numbakv cache with continuous batching: each
  :meth:`Server.step` is one forward pass of the attached model over a packed batch mixing
  prompt chunks and decode tokens; finished requests free their sequence.

Inputs that require grad are detached here: no ``torch.no_grad()`` is needed.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional

import numpy as np

from .errors import KVCacheError


def _transformers():
    try:
        import torch
        from transformers import cache_utils
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("numbakv.hf needs transformers and torch: pip install numbakv[hf]") \
            from exc
    return torch, cache_utils


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
        from .hf import cache_for
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
    ``cache=``) whose keys and values live in a numbakv cache.

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
    from . import hf
    torch, cache_utils = _transformers()
    if capacity is None and max_new_tokens is None:
        raise ValueError("generation_cache needs max_new_tokens (or capacity) to size the cache")
    for name, value in (("max_new_tokens", max_new_tokens), ("capacity", capacity)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a transformers model, got {type(model).__name__}")
    if hf.attached_cache(model) is not None:
        raise ValueError("model is attached to a numbakv cache (hf.attach): generate() runs the "
                         "model's own attention; call hf.detach(model) first")
    from dataclasses import fields
    from .config import CacheConfig
    known = {f.name for f in fields(CacheConfig)} - {"n_layers", "n_kv_heads", "head_dim",
                                                      "v_head_dim", "capacity", "max_seqs",
                                                      "max_batch", "dtype", "device"}
    unknown = sorted(set(kw) - known - {"shift", "swa_memory"})
    if unknown:
        raise ValueError(f"generation_cache got unexpected option(s) {unknown}: extra options "
                         f"are hf.cache_for's (CacheConfig fields {sorted(known)}, shift, "
                         "swa_memory)")
    layers = hf.layer_attention(model)
    if any(la.chunk_size is not None for la in layers):
        raise NotImplementedError("chunked-attention models are not supported by "
                                  "generation_cache")
    state = _GenState(model, max_new_tokens, capacity, dtype, device, kw)
    layer_cls = _layer_class()

    class NumbakvGenerationCache(cache_utils.Cache):
        """A transformers Cache backed by numbakv (see :func:`numbakv.hf.generation_cache`)."""

        @property
        def numbakv_cache(self):
            return state.cache

    return NumbakvGenerationCache(layers=[layer_cls(state, i, la.swa_window)
                                          for i, la in enumerate(layers)])


class Server:
    """Continuous batching over one numbakv cache (``hf.cache_for``'s) and an attached model.

    ``submit`` queues a prompt; every ``step`` runs ONE forward pass of the model over a packed
    batch holding one decode token of every running request and, in the room left (the cache's
    ``max_batch``), chunks of waiting prompts; it returns the token each request produced.
    A request that reached ``max_new_tokens`` (or its ``eos_token_id``) is moved to
    ``finished`` and its sequence freed. Greedy by default; ``do_sample=True`` with
    ``temperature``/``top_k`` samples from a per-request ``torch.Generator(seed)``.

        srv = hf.Server(model, hf.cache_for(model, capacity=1024, max_seqs=4))
        rids = [srv.submit(p, max_new_tokens=16) for p in prompts]
        while srv.pending:
            srv.step()
        outputs = [srv.finished[r] for r in rids]
    """

    def __init__(self, model: Any, cache: Any, *, prefill_chunk: int = 256) -> None:
        from . import hf
        torch, _ = _transformers()
        self._torch = torch
        if hf.attached_cache(model) is None:
            hf.attach(model, cache)
        elif hf.attached_cache(model) is not cache:
            raise ValueError("model is attached to another cache: hf.detach(model) first")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) \
                or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        self.model, self.cache, self.prefill_chunk = model, cache, prefill_chunk
        cfg = getattr(cache, "config", None) or cache.caches[0].config
        self._max_batch = cfg.max_batch
        self._free = list(range(cfg.max_seqs))
        self._ids = itertools.count()
        self._device = next(model.parameters()).device
        self._waiting: List[int] = []
        self._reqs: Dict[int, dict] = {}
        self.finished: Dict[int, List[int]] = {}
        self._last_batch = 0

    @property
    def pending(self) -> int:
        """Requests submitted and not finished."""
        return len(self._reqs)

    def submit(self, prompt_ids: Any, max_new_tokens: int = 32, *, do_sample: bool = False,
               temperature: float = 1.0, top_k: Optional[int] = None, seed: int = 0,
               eos_token_id: Optional[int] = None) -> int:
        """Queue ``prompt_ids`` (a sequence of token ids, ``[n]``); returns the request id."""
        ids = np.asarray(prompt_ids.detach().cpu() if hasattr(prompt_ids, "detach")
                         else prompt_ids).reshape(-1)
        if ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt_ids must be a non-empty sequence of token ids, got "
                             f"{ids.dtype} [{ids.size}]")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        rid = next(self._ids)
        gen = None
        if do_sample:
            gen = self._torch.Generator(device=self._device).manual_seed(int(seed))
        self._reqs[rid] = {"prompt": ids.astype(np.int64).tolist(), "done": 0, "seq": None,
                           "out": [], "max": max_new_tokens, "sample": do_sample,
                           "temp": float(temperature), "top_k": top_k, "gen": gen,
                           "eos": eos_token_id}
        self._waiting.append(rid)
        return rid

    def step(self) -> Dict[int, int]:
        """One forward pass: ``{request id: new token id}`` for the requests that produced a
        token (decodes, and prompts whose last chunk ran). The batch is planned first and the
        server's state changes only after the pass ran: a pass that raises (the cache full, the
        model failing) leaves the requests as they were and the cache without its tokens."""
        torch = self._torch
        tokens: List[int] = []
        positions: List[int] = []
        seqs: List[int] = []
        last_row: Dict[int, int] = {}
        placed: Dict[int, int] = {}                # sequence -> first position this pass puts
        chunks: List[tuple] = []                   # (rid, seq, tokens taken)
        free = list(self._free)
        room = self._max_batch
        for rid, r in self._reqs.items():          # one decode token per running request
            if r["seq"] is not None and r["done"] == len(r["prompt"]) and room > 0:
                p = len(r["prompt"]) + len(r["out"]) - 1
                tokens.append(r["out"][-1])
                positions.append(p)
                seqs.append(r["seq"])
                placed[r["seq"]] = p
                last_row[rid] = len(tokens) - 1
                room -= 1
        for rid in self._waiting:                  # then prompt chunks in the room left
            r = self._reqs[rid]
            if room <= 0:
                break
            seq = r["seq"]
            if seq is None:
                if not free:
                    break
                seq = free.pop(0)
            n = min(self.prefill_chunk, room, len(r["prompt"]) - r["done"])
            tokens += r["prompt"][r["done"]:r["done"] + n]
            positions += range(r["done"], r["done"] + n)
            seqs += [seq] * n
            placed[seq] = r["done"]
            chunks.append((rid, seq, n))
            room -= n
            if r["done"] + n == len(r["prompt"]):
                last_row[rid] = len(tokens) - 1
        self._last_batch = len(tokens)
        if not tokens:
            return {}
        self.cache.start_forward(positions, seqs)
        try:
            ids = torch.tensor([tokens], device=self._device)
            pos = torch.tensor([positions], device=self._device)
            with torch.no_grad():
                logits = self.model(input_ids=ids, position_ids=pos).logits[0]
            picks = {rid: self._pick(logits[row].float(), self._reqs[rid])
                     for rid, row in last_row.items()}
        except BaseException:
            for seq, p0 in placed.items():         # the tokens of the failed pass go again
                self.cache.remove(seq, p0)
            raise
        self._free = free
        for rid, seq, n in chunks:
            r = self._reqs[rid]
            r["seq"] = seq
            r["done"] += n
            if r["done"] == len(r["prompt"]):
                self._waiting.remove(rid)
        new: Dict[int, int] = {}
        for rid, tok in picks.items():
            r = self._reqs[rid]
            r["out"].append(tok)
            new[rid] = tok
            if len(r["out"]) >= r["max"] or (r["eos"] is not None and tok == r["eos"]):
                self.cache.remove(r["seq"], 0)
                self._free.append(r["seq"])
                self.finished[rid] = r["out"]
                del self._reqs[rid]
        return new

    def _pick(self, logits, r: dict) -> int:
        torch = self._torch
        if not r["sample"]:
            return int(torch.argmax(logits))
        logits = logits / r["temp"]
        if r["top_k"]:
            kth = torch.topk(logits, int(r["top_k"])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=r["gen"]))

    def run(self) -> Dict[int, List[int]]:
        """Step until every submitted request finished; returns ``finished``."""
        while self._reqs:
            self.step()
            if not self._last_batch:
                raise KVCacheError("no request can make progress: no free sequence and no "
                                   "room in max_batch")
        return self.finished


__all__ = ["generation_cache", "Server"]
