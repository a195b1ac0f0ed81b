"""``attach``/``detach``: route a transformers model's attention layers through a numbakv cache.

The model keeps its own projections, norms, RoPE, soft-capping and query scaling: numbakv only
replaces the step between "keys and values are roped" and "attention output", through
transformers' ``AttentionInterface`` (GPT-J, whose attention does not use that interface, through
its ``_attn`` method). Each attention layer stores the batch's keys and values in the cache and
attends with :func:`numbakv.attention.attend`, which reads exactly the attention the cache's mask
defines (sequence, causal, sliding window, chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .._inputs import host_int_array
from ..causal import CausalCache
from ..errors import KVCacheError, NotSupportedError
from ..wrappers import WrapperCache
from ._deps import _import_torch
from .families import (LayerAttention, ModelShapes, _text_config, hybrid_attention,
                       hybrid_layout, mla_cache_config_kw, model_shapes)

#: The name numbakv's attention function is registered under in transformers' AttentionInterface.
ATTENTION_NAME = "numbakv"

_BINDING_ATTR = "_numbakv_binding"        # on an attached model, its attention modules, the cache


# ---------------------------------------------------------------------------- attach / detach
def _layer_caches(cache) -> List[Optional[CausalCache]]:
    """For each model layer, the ``CausalCache`` that holds it (``None`` for the recurrent
    layers of a ``HybridCache``, whose ``set_layer`` takes model layer numbers)."""
    if _is_hybrid(cache):
        per_layer = _layer_caches(cache.attn)
        return [per_layer[cache._attn_of[i]] if kind == "attention" else None
                for i, kind in enumerate(cache.layer_kinds)]
    if isinstance(cache, CausalCache):
        return [cache] * cache.config.n_layers
    if isinstance(cache, WrapperCache):
        if cache.layer_groups is None:
            raise ValueError("cache is a WrapperCache without layer_groups; hf.attach needs the "
                             "layer -> cache map (hf.cache_for builds it)")
        return [cache.caches[g] for g in cache.layer_groups]
    raise ValueError(f"cache must be a numbakv CausalCache or WrapperCache, got "
                     f"{type(cache).__name__}")


def _is_hybrid(cache) -> bool:
    return getattr(cache, "rc", None) is not None and hasattr(cache, "layer_kinds")


def _attention_modules(model) -> Dict[int, Any]:
    """``{layer_idx: attention module}`` of the decoder."""
    found: Dict[int, Any] = {}
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if not type(module).__name__.endswith("Attention") or isinstance(idx, bool) \
                or not isinstance(idx, int):
            continue
        if idx in found:
            raise NotSupportedError(f"two attention modules claim layer {idx} ({name}); "
                                    "cross-attention models are not supported by hf.attach")
        found[idx] = module
    return found


def _uses_attention_interface(module) -> bool:
    import sys
    mod = sys.modules.get(type(module).__module__)
    return mod is not None and hasattr(mod, "ALL_ATTENTION_FUNCTIONS")


def _module_head_dim(module) -> Optional[int]:
    for attr in ("head_dim", "head_size"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return value
    return None



@dataclass
class _Binding:
    """What ``attach`` set up, and what ``detach`` undoes."""

    model: Any
    cache: Any
    layer_caches: List[CausalCache]
    storage_dtypes: List[Any]                       # torch dtype each layer's K/V is stored in
    modules: Dict[int, Any]
    configs: List[Tuple[Any, Any, Any]]             # (config, old attn impl, old use_cache)
    hook: Any = None
    generation: int = 0                             # start_forward calls since attach
    layer_generation: List[int] = field(default_factory=list)
    positions: Optional[np.ndarray] = None          # the last start_forward's positions
    recurrent: Any = None                           # hybrid models: the mixers' binding
    #: MLA layers: the get() mask of the layer whose latents update() just handed the model
    latent_masks: Dict[int, Any] = field(default_factory=dict)
    latent_hooks: List[Any] = field(default_factory=list)

    def store_latent(self, layer: int, kv_nope, k_rot):
        """An MLA layer's ``cache.update``: store the batch's latent rows ``[kv_nope | k_rot]``
        (``[1, 1, q, kv_lora_rank]``, ``[1, 1, q, rope]``) and hand back every latent the batch
        may attend to (``get()``'s range, ``[1, 1, n, ...]`` each, the model's dtype); the mask
        is kept for the attention call that follows."""
        torch = _import_torch()
        if kv_nope.shape[0] != 1:
            raise ValueError(f"numbakv runs one packed batch: input_ids must be [1, tokens], got "
                             f"a batch of {kv_nope.shape[0]} rows")
        self.begin_layer(layer, kv_nope.shape[2])
        rank = kv_nope.shape[-1]
        row = torch.cat([kv_nope.detach(), k_rot.detach().to(kv_nope.dtype)], dim=-1)[0]
        row = row.transpose(0, 1)                    # [q, 1, kv_lora_rank + rope]
        want = self.storage_dtypes[layer]
        self.cache.set_layer(layer)
        if self.layer_caches[layer]._put_layer >= 0:
            self.cache.put(row.to(want).contiguous(), None)
        key, _, mask = self.cache.get()
        latents = torch.from_dlpack(key).to(kv_nope.dtype).transpose(0, 1)[None]   # [1,1,n,D]
        self.latent_masks[layer] = torch.from_dlpack(mask)
        return latents[..., :rank], latents[..., rank:]

    def attend_latent(self, layer: int, query, key, value, scaling, softcap):
        """The attention of an MLA layer over the latents :meth:`store_latent` handed out, now
        expanded by the model (``key [1, H, n, Dqk]``, ``value [1, H, n, Dv]``): eager attention
        under the cache's mask -> ``[q, H, Dv]``."""
        torch = _import_torch()
        mask = self.latent_masks.pop(layer, None)
        if mask is None:
            raise KVCacheError(f"layer {layer}: the MLA attention ran without its cache update")
        q = query.detach()
        scores = torch.matmul(q, key.detach().transpose(2, 3)) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores + mask[:q.shape[2]].to(scores.dtype)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        self.layer_generation[layer] = self.generation
        return torch.matmul(probs, value.detach())[0].transpose(0, 1)

    def begin_layer(self, layer: int, n_tokens: int) -> None:
        if self.generation == 0:
            raise KVCacheError("no forward pass: call cache.start_forward(positions, seqs) before "
                               "running the attached model")
        if self.layer_generation[layer] == self.generation:
            raise KVCacheError(f"layer {layer} already ran in this forward pass: call "
                               "cache.start_forward(positions, seqs) before every model call")
        if self.positions is not None and n_tokens != len(self.positions):
            raise ValueError(f"the model got {n_tokens} tokens but cache.start_forward was given "
                             f"{len(self.positions)} positions: input_ids must be the packed batch "
                             "[1, batch]")

    def store_and_attend(self, layer: int, query, key, value, scaling, softcap):
        """query ``[1, H, q, D]``, key/value ``[1, KVH, q, D]`` (roped) -> ``[q, H, Dv]``."""
        from ..attention import attend
        if query.shape[0] != 1:
            raise ValueError(f"numbakv runs one packed batch: input_ids must be [1, tokens], got "
                             f"a batch of {query.shape[0]} rows")
        self.begin_layer(layer, query.shape[2])
        # inference only: inputs that require grad (a model called without torch.no_grad())
        # are detached, since the cache stores plain values
        query, key, value = query.detach(), key.detach(), value.detach()
        k = key[0].transpose(0, 1)                  # [q, KVH, D]
        v = value[0].transpose(0, 1)
        want = self.storage_dtypes[layer]
        if k.dtype != want:
            k = k.to(want)
        if v.dtype != want:
            v = v.to(want)
        self.cache.set_layer(layer)
        if self.layer_caches[layer]._put_layer >= 0:
            self.cache.put(k, v)
        # else a KV-sharing layer (layer_reuse): the model hands it the K/V its source layer
        # stored earlier in this pass; attend() reads them from that layer
        self.layer_generation[layer] = self.generation
        q = query[0].transpose(0, 1)                # [q, H, D]
        if q.dtype != want:                         # attention in the cache's dtype (a float16
            q = q.to(want)                          # cache under a float32 model, like llama.cpp)
        out = attend(q, self.cache, scale=scaling, soft_cap=softcap)
        return out if out.dtype == query.dtype else out.to(query.dtype)


def _attention_forward(module, query, key, value, attention_mask=None, dropout: float = 0.0,
                       scaling: Optional[float] = None, sliding_window=None, softcap=None,
                       **kwargs):
    """transformers' attention-function signature: query ``[1, H, q, D]``, key/value
    ``[1, KVH, q, D]`` -> ``(out [1, q, H, Dv], None)``. The cache's mask replaces
    ``attention_mask`` and ``sliding_window`` (checked against the cache at attach time)."""
    binding = getattr(module, _BINDING_ATTR, None)
    if binding is None:
        raise KVCacheError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) "
                           "uses numbakv attention but is not attached: call hf.attach(model, "
                           "cache)")
    if module.layer_idx in binding.latent_masks:     # MLA: the latents were stored in update
        out = binding.attend_latent(module.layer_idx, query, key, value, scaling, softcap)
    else:
        out = binding.store_and_attend(module.layer_idx, query, key, value, scaling, softcap)
    return out.unsqueeze(0), None


class _LatentUpdate:
    """What an attached MLA attention layer sees as its ``cache``: transformers 5.24's MLA
    layers call ``cache.update(kv_nope, k_rot, layer_idx)`` with the compressed latents before
    expanding them per head; numbakv stores them there (one V-less row per token)."""

    def __init__(self, binding: "_Binding") -> None:
        self.binding = binding

    def update(self, kv_nope, k_rot, layer_idx, *args, **kwargs):
        return self.binding.store_latent(int(layer_idx), kv_nope, k_rot)


def _latent_hook(binding: "_Binding"):
    """A forward pre-hook on an MLA attention module: its ``cache`` argument becomes numbakv."""
    adapter = _LatentUpdate(binding)

    def hook(module, args, kwargs):
        kwargs.pop("past_key_values", None)
        kwargs["cache"] = adapter
        return args, kwargs
    return hook


def _gptj_attn(module, binding: _Binding):
    """A replacement for GPT-J's ``_attn(query, key, value, attention_mask)`` (query/key/value
    ``[1, H, q, D]`` -> ``([1, H, q, D], None)``, scores scaled by ``1 / scale_attn``)."""
    scale = 1.0 / float(module.scale_attn)

    def _attn(query, key, value, attention_mask=None, *args, **kwargs):
        out = binding.store_and_attend(module.layer_idx, query, key, value, scale, None)
        return out.transpose(0, 1).unsqueeze(0), None
    return _attn


def attach(model: Any, cache: Any) -> None:
    """Route every attention layer of ``model`` through ``cache``.

    After ``attach``, one call of the model is one forward pass of the cache::

        cache.start_forward(positions, seqs)
        logits = model(input_ids=tokens[None], position_ids=positions[None]).logits[0]

    ``tokens``, ``positions`` and ``seqs`` are ``[batch]``: any mix of prefills and decodes of
    many sequences packed in one row. Each layer stores its roped keys and values (converted to
    the cache's dtype) and attends through :func:`numbakv.attention.attend`; the model's
    projections, norms, RoPE, soft-capping and query scaling are its own. The model's own
    ``use_cache`` is switched off while attached (numbakv is the cache).

    Raises:
        ValueError: ``model`` is already attached, ``cache`` is attached to another model, or the
            cache's layers, KV heads, head sizes or windows do not match the model's.
        NotSupportedError: an attention implementation numbakv cannot take over.
    """
    torch = _import_torch()
    from transformers import AttentionInterface
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a transformers model (torch.nn.Module), got "
                         f"{type(model).__name__}")
    if getattr(model, _BINDING_ATTR, None) is not None:
        raise ValueError("model is already attached to a numbakv cache: call hf.detach(model) "
                         "first")
    layer_caches = _layer_caches(cache)
    if getattr(cache, _BINDING_ATTR, None) is not None:
        raise ValueError("cache is already attached to a model: call hf.detach(that model) first")
    config = _text_config(model)
    shapes = model_shapes(config)
    layers = hybrid_attention(config)        # {model layer: its attention}: every layer but a
    layout = hybrid_layout(config)           # hybrid's recurrent ones
    if (layout is None) == _is_hybrid(cache):
        raise ValueError(f"{config.model_type} {'has' if layout else 'has no'} recurrent layers "
                         f"but the cache is a {type(cache).__name__}: build it with "
                         "hf.cache_for(model)")
    if layout is not None and list(cache.layer_kinds) != list(layout.layer_kinds):
        raise ValueError(f"the cache's layer_kinds {list(cache.layer_kinds)} differ from the "
                         f"model's {list(layout.layer_kinds)}: build it with hf.cache_for(model)")
    if getattr(config, "attn_temperature_tuning", False) and \
            not all(getattr(config, "no_rope_layers", None) or [1]):
        raise NotSupportedError(f"{config.model_type}: attention temperature tuning scales queries "
                                "by positions counted from 0 in each call, not by position_ids, "
                                "so a packed batch would be scaled wrongly")
    if len(layer_caches) != shapes.n_layers:
        raise ValueError(f"cache has {len(layer_caches)} layers but the model has "
                         f"{shapes.n_layers} (num_hidden_layers)")
    modules = _attention_modules(model)
    if sorted(modules) != sorted(layers):
        raise NotSupportedError(f"found attention modules for layers {sorted(modules)}, expected "
                                f"{sorted(layers)}")
    for layer, module in modules.items():
        _check_layer(layer, module, layer_caches[layer], shapes, layers[layer])
    mixers = {}
    if layout is not None:
        from .recurrent import mixer_modules
        mixers = mixer_modules(model, layout)
        if sorted(mixers) != layout.recurrent_layers:
            raise NotSupportedError(f"found recurrent mixers ({layout.mixer}) for layers "
                                    f"{sorted(mixers)}, expected {layout.recurrent_layers}")

    binding = _Binding(model, cache, layer_caches,
                       [None if c is None else getattr(torch, c.config.dtype)
                        for c in layer_caches],
                       modules, [], layer_generation=[-1] * shapes.n_layers)
    if mixers:
        from .recurrent import RecurrentBinding
        binding.recurrent = RecurrentBinding(cache.rc, mixers, layout.resumes_chunks)
        binding.recurrent.install()
    AttentionInterface.register(ATTENTION_NAME, _attention_forward)
    seen = {}
    for cfg in [model.config] + [m.config for m in modules.values() if hasattr(m, "config")]:
        if id(cfg) not in seen:
            seen[id(cfg)] = cfg
            binding.configs.append((cfg, getattr(cfg, "_attn_implementation_internal", None),
                                    getattr(cfg, "use_cache", None)))
    for cfg, _, _ in binding.configs:
        # set the internal field directly: the property setter would recurse into sub-configs
        # (a vision tower keeps its own attention)
        cfg._attn_implementation_internal = ATTENTION_NAME
        if hasattr(cfg, "use_cache"):
            cfg.use_cache = False
    for module in modules.values():
        setattr(module, _BINDING_ATTR, binding)
        if not _uses_attention_interface(module):
            module._attn = _gptj_attn(module, binding)
        elif shapes.latent is not None:
            binding.latent_hooks.append(module.register_forward_pre_hook(
                _latent_hook(binding), with_kwargs=True))

    original_start = cache.start_forward

    def start_forward(positions, seqs, reserve: bool = False) -> None:
        # read GPU positions back once, on the cache's stream (see CausalCache.start_forward)
        host = positions if isinstance(positions, np.ndarray) else \
            host_int_array(positions, "positions", _cache_stream(cache))
        original_start(host, seqs, reserve)
        binding.positions = host_int_array(host, "positions")
        binding.generation += 1
        if binding.recurrent is not None and not reserve:
            binding.recurrent.begin(binding.positions, host_int_array(seqs, "seqs"))

    start_forward.__doc__ = original_start.__doc__
    cache.start_forward = start_forward
    binding.hook = model.register_forward_pre_hook(_position_check(binding), with_kwargs=True)
    setattr(cache, _BINDING_ATTR, binding)
    setattr(model, _BINDING_ATTR, binding)


def _cache_stream(cache):
    """The stream ``cache`` queues its work on (a WrapperCache's caches share it; None: CuPy's
    current stream), where GPU positions are read back."""
    for c in getattr(cache, "caches", (cache,)):
        storage = getattr(c, "storage", None)
        if storage is not None:
            return storage.stream
    return None


def _check_layer(layer: int, module, layer_cache: CausalCache, shapes: ModelShapes,
                 la: LayerAttention) -> None:
    cfg = layer_cache.config
    if shapes.latent is not None:
        want = mla_cache_config_kw(shapes)
        got = {k: getattr(cfg, k) for k in want}
        if got != want:
            raise ValueError(f"layer {layer}: an MLA model caches one V-less latent row per token "
                             f"({want}) but the cache has {got}: build it with hf.cache_for(model)")
    else:
        _check_heads(layer, module, cfg, shapes)
    if layer_cache.swa_window != la.swa_window:
        want = "no sliding window" if la.swa_window is None else \
            f"a sliding window of {la.swa_window + 1} tokens (swa_window={la.swa_window})"
        raise ValueError(f"layer {layer} ({la.layer_type}) attends with {want} but its cache has "
                         f"swa_window={layer_cache.swa_window}: build it with hf.cache_for(model)")
    if layer_cache.chunk_size != la.chunk_size:
        raise ValueError(f"layer {layer} ({la.layer_type}) has attention chunk {la.chunk_size} but "
                         f"its cache has chunk_size={layer_cache.chunk_size}")
    if not _uses_attention_interface(module) and not (hasattr(module, "_attn")
                                                      and hasattr(module, "scale_attn")):
        raise NotSupportedError(f"{type(module).__name__} does not route through transformers' "
                                "AttentionInterface")
    if type(module).__name__.endswith("FlashAttention2"):
        raise NotSupportedError(f"{type(module).__name__}: load the model with "
                                "attn_implementation='eager' before hf.attach")


def _check_heads(layer: int, module, cfg, shapes: ModelShapes) -> None:
    """The cache's KV heads and head sizes are the model's (per-head K/V models)."""
    head_dim = _module_head_dim(module) or shapes.head_dim
    if cfg.n_kv_heads != shapes.n_kv_heads:
        raise ValueError(f"layer {layer}: the model has {shapes.n_kv_heads} KV heads but the "
                         f"cache has n_kv_heads={cfg.n_kv_heads}")
    if cfg.head_dim != head_dim:
        raise ValueError(f"layer {layer}: the model's head size is {head_dim} but the cache has "
                         f"head_dim={cfg.head_dim}")
    if cfg.v_head_dim != shapes.v_head_dim:
        raise ValueError(f"layer {layer}: the model's value head size is {shapes.v_head_dim} but "
                         f"the cache has v_head_dim={cfg.v_head_dim}")


def _position_check(binding: _Binding):
    """A forward pre-hook: the model's ``position_ids`` must be the positions the cache placed
    (else RoPE and the mask would disagree, silently)."""

    def hook(module, args, kwargs):
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            raise KVCacheError("this model is attached to a numbakv cache (hf.attach), which "
                               "runs packed batches under cache.start_forward; for "
                               "model.generate(), hf.detach(model) and pass "
                               "past_key_values=hf.generation_cache(model, max_new_tokens=...)")
        if binding.generation == 0:
            raise KVCacheError("no forward pass: call cache.start_forward(positions, seqs) "
                               "before running the attached model (for model.generate(), "
                               "hf.detach(model) and pass past_key_values="
                               "hf.generation_cache(model, max_new_tokens=...))")
        expected = binding.positions
        given = kwargs.get("position_ids")
        if given is None:
            if not np.array_equal(expected, np.arange(len(expected))):
                raise ValueError("position_ids is missing: pass position_ids=positions[None] "
                                 "(the positions given to cache.start_forward)")
            return None
        got = given.detach().reshape(-1).to("cpu").numpy()
        if got.shape != expected.shape or not np.array_equal(got, expected):
            raise ValueError(f"position_ids {got.tolist()[:8]}... differ from the positions given "
                             f"to cache.start_forward {expected.tolist()[:8]}...: pass "
                             "position_ids=positions[None]")
        return None
    return hook


def detach(model: Any) -> None:
    """Undo :func:`attach`: the model's attention implementation, ``use_cache`` and the cache's
    ``start_forward`` are as they were. Raises ``ValueError`` when ``model`` is not attached."""
    binding = getattr(model, _BINDING_ATTR, None)
    if binding is None:
        raise ValueError("model is not attached to a numbakv cache")
    for cfg, impl, use_cache in binding.configs:
        cfg._attn_implementation_internal = impl
        if use_cache is not None:
            cfg.use_cache = use_cache
    for module in binding.modules.values():
        if _BINDING_ATTR in vars(module):
            delattr(module, _BINDING_ATTR)
        if "_attn" in vars(module):
            del module._attn
    if binding.recurrent is not None:
        binding.recurrent.uninstall()
    if binding.hook is not None:
        binding.hook.remove()
    for handle in binding.latent_hooks:
        handle.remove()
    if "start_forward" in vars(binding.cache):
        del binding.cache.start_forward
    if _BINDING_ATTR in vars(binding.cache):
        delattr(binding.cache, _BINDING_ATTR)
    delattr(model, _BINDING_ATTR)


def attached_cache(model: Any) -> Optional[Any]:
    """The cache ``model`` is attached to, or ``None``."""
    binding = getattr(model, _BINDING_ATTR, None)
    return None if binding is None else binding.cache
