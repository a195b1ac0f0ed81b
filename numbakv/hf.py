"""Hugging Face transformers integration: serve a transformers model through a numbakv cache.

    from numbakv import hf
    cache = hf.cache_for(model, capacity=4096, max_seqs=8)      # shapes, windows, RoPE from config
    hf.attach(model, cache)                                    # attention now reads/writes `cache`
    cache.start_forward(positions, seqs)                       # a packed batch of many sequences
    logits = model(input_ids=tokens[None], position_ids=positions[None]).logits[0]

The model keeps its own projections, norms, RoPE, soft-capping and query scaling: numbakv only
replaces the step between "keys and values are roped" and "attention output", through
transformers' ``AttentionInterface`` (GPT-J, whose attention does not use that interface, through
its ``_attn`` method). Each attention layer stores the batch's keys and values in the cache and
attends with :func:`numbakv.attention.attend`, which reads exactly the attention the cache's mask
defines (sequence, causal, sliding window, chunk).

``generation_cache(model, max_new_tokens=...)`` is a transformers ``Cache`` for
``model.generate()`` (no ``attach``), and ``Server(model, cache)`` serves many prompts with
continuous batching over an attached model.

transformers and torch are optional (``pip install numbakv[hf]``) and imported only when a
function of this module needs them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ._inputs import host_int_array
from .causal import CausalCache
from .config import CacheConfig, RopeShift, normalize_dtype
from .errors import KVCacheError, NotSupportedError
from .wrappers import WrapperCache

#: The name numbakv's attention function is registered under in transformers' AttentionInterface.
ATTENTION_NAME = "numbakv"
#: Model types whose rotary pairs are interleaved ``(x[2i], x[2i+1])`` (GPT-J's
#: ``rotate_every_two``, Cohere's ``rotate_half``); every other model uses NeoX pairs.
INTERLEAVED_MODEL_TYPES = frozenset({"gptj", "codegen", "cohere", "cohere2", "llama4",
                                     "llama4_text"})
#: Model types whose RoPE base is hard-coded to 10000 rather than read from the config.
_FIXED_BASE_MODEL_TYPES = frozenset({"gptj", "codegen"})
#: RoPE types whose frequencies transformers derives from a table: read them from its own
#: ``ROPE_INIT_FUNCTIONS`` and express the difference to plain RoPE as per-pair factors.
_TABLE_ROPE_TYPES = frozenset({"llama3", "yarn", "longrope"})

_BINDING_ATTR = "_numbakv_binding"        # on an attached model, its attention modules, the cache


# ---------------------------------------------------------------------------- config reading
def _import_torch():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("numbakv.hf needs transformers and torch: pip install numbakv[hf]") \
            from exc
    return torch


def _is_module(obj) -> bool:
    return hasattr(obj, "named_modules") and hasattr(obj, "parameters")


def _text_config(model_or_config):
    """The decoder's text config of a model or config (multimodal configs hold it inside)."""
    config = model_or_config.config if _is_module(model_or_config) else model_or_config
    if not hasattr(config, "model_type") or not hasattr(config, "to_dict"):
        raise ValueError("model_or_config must be a transformers model or PretrainedConfig, got "
                         f"{type(model_or_config).__name__}")
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            config = get_text(decoder=True)
        except TypeError:  # older transformers: no keyword
            config = get_text()
    return config


@dataclass(frozen=True)
class ModelShapes:
    """The attention shapes of a model, read from its config."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int


def model_shapes(model_or_config: Any) -> ModelShapes:
    """Layers, query heads, KV heads and head sizes of ``model_or_config``'s decoder."""
    config = _text_config(model_or_config)
    n_layers = int(config.num_hidden_layers)
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    if getattr(config, "qk_rope_head_dim", None):        # MLA: keys are [nope | rope] parts
        head_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
    else:
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // n_heads)
    v_head_dim = int(getattr(config, "v_head_dim", None) or head_dim)
    return ModelShapes(n_layers, n_heads, n_kv, head_dim, v_head_dim)


@dataclass(frozen=True)
class LayerAttention:
    """What one layer attends to, in numbakv's terms."""

    layer_type: str                  # the config's layer type ("full_attention", ...)
    swa_window: Optional[int]        # numbakv window: a token at p sees p - swa_window .. p
    chunk_size: Optional[int]


def layer_attention(model_or_config: Any) -> List[LayerAttention]:
    """Per layer: its type, sliding window and attention chunk.

    transformers' sliding window ``W`` counts the query token (a token sees ``W`` tokens,
    itself included), so numbakv's ``swa_window`` is ``W - 1``. ``layer_types`` decides which
    layers slide (Gemma 2/3, Qwen2/3); without it ``sliding_window`` applies to every layer
    (Mistral, Phi-3)."""
    config = _text_config(model_or_config)
    n_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * n_layers
    if len(types) != n_layers:
        raise ValueError(f"config.layer_types names {len(types)} layers but num_hidden_layers is "
                         f"{n_layers}")
    out = []
    for i, kind in enumerate(types):
        if kind == "full_attention":
            out.append(LayerAttention(kind, None, None))
        elif kind == "sliding_attention":
            if not window:
                raise ValueError(f"layer {i} is a sliding_attention layer but config.sliding_window"
                                 f" is {window!r}")
            if int(window) < 2:
                raise NotSupportedError(f"sliding_window={window} (a token sees only itself) is "
                                        "not a window numbakv can express")
            out.append(LayerAttention(kind, int(window) - 1, None))
        elif kind == "chunked_attention":
            chunk = getattr(config, "attention_chunk_size", None)
            if not chunk:
                raise ValueError(f"layer {i} is a chunked_attention layer but "
                                 f"config.attention_chunk_size is {chunk!r}")
            out.append(LayerAttention(kind, None, int(chunk)))
        else:
            raise NotSupportedError(f"layer {i} has layer type {kind!r}, which keeps no KV cache "
                                    "numbakv can hold")
    return out


def _rope_parameters(config, layer_type: Optional[str]) -> Tuple[dict, Optional[str]]:
    """``(parameters, layer_type_key)``: the RoPE parameters of ``layer_type``'s layers and the
    key transformers' RoPE functions need (``None`` when the config has one RoPE for all)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers 4.x: rope_theta and rope_scaling beside each other
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        factor = getattr(config, "partial_rotary_factor", None) or getattr(config, "rotary_pct",
                                                                          None)
        if factor is not None:
            params.setdefault("partial_rotary_factor", factor)
    types = getattr(config, "layer_types", None)
    if layer_type is not None and types is not None and layer_type not in types:
        raise ValueError(f"layer_type must be one of the config's layer types {sorted(set(types))},"
                         f" got {layer_type!r}")
    nested = bool(params) and all(isinstance(v, dict) for v in params.values())
    if not nested:
        return dict(params), None
    if layer_type is None:
        distinct = {repr(sorted(v.items())) for v in params.values()}
        if len(distinct) > 1:
            raise ValueError("the config has a RoPE per layer type "
                             f"({', '.join(sorted(params))}): pass layer_type=")
        layer_type = next(iter(params))
    if layer_type not in params:
        raise ValueError(f"the config has no RoPE parameters for layer_type {layer_type!r} (it has "
                         f"{sorted(params)})")
    return dict(params[layer_type]), layer_type


def rope_shift_for(config: Any, layer_type: Optional[str] = None) -> RopeShift:
    """The :class:`numbakv.RopeShift` that re-rotates this model's stored keys when their
    positions move (context shift), read from the model's own RoPE definition.

    Args:
        config: a transformers config or model.
        layer_type: for models whose RoPE differs per layer type (Gemma 3: ``"sliding_attention"``
            with base 10k, ``"full_attention"`` with base 1M), which layers.

    Reads ``rope_theta``, ``rope_parameters`` / ``rope_scaling`` (``linear`` -> ``freq_scale``;
    ``llama3``, ``yarn`` and static ``longrope`` -> per-pair ``freq_factors`` taken from the
    frequencies transformers itself computes; YaRN's attention factor scales keys at roping time
    and is not applied again: the shift is a pure rotation), ``partial_rotary_factor`` (rotary
    dims), NeoX versus interleaved pairs (GPT-J, Cohere).

    Raises:
        NotSupportedError: RoPE that is not a fixed rotation per position delta - dynamic NTK
            (frequencies change with the sequence length), ``longrope`` that switches factor sets
            with the length, M-RoPE (``mrope_section``), MLA's decoupled RoPE, or an unknown type.
    """
    config = _text_config(config)
    model_type = getattr(config, "model_type", "")
    shapes = model_shapes(config)
    if getattr(config, "qk_rope_head_dim", None):
        raise NotSupportedError(
            f"{model_type}: MLA keys carry a decoupled RoPE part after the un-roped part; a "
            "RopeShift rotates leading dims only, so context shift is not supported")
    no_rope = getattr(config, "no_rope_layers", None)
    if no_rope is not None and not all(no_rope):
        raise NotSupportedError(f"{model_type}: some layers use no RoPE (no_rope_layers), so one "
                                "RopeShift cannot re-rotate every layer; context shift is not "
                                "supported")
    neox = model_type not in INTERLEAVED_MODEL_TYPES
    if model_type in _FIXED_BASE_MODEL_TYPES:
        dim = int(getattr(config, "rotary_dim", None) or shapes.head_dim)
        return RopeShift(base=10000.0, dim=dim, neox=neox)
    params, rope_key = _rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if "mrope_section" in params or getattr(config, "mrope_section", None) or "mrope" in rope_type \
            or _is_mrope_model(model_type):
        raise NotSupportedError(f"{model_type}: M-RoPE (multimodal sections of positions) is not a "
                                "rotation by one position delta; context shift is not supported")
    if "dynamic" in rope_type:
        raise NotSupportedError(
            f"{model_type}: rope_type {rope_type!r} (dynamic NTK) changes its frequencies with the "
            "sequence length, so a stored key cannot be re-rotated; context shift is not supported")
    base = params.get("rope_theta", getattr(config, "rope_theta", None))
    base = 10000.0 if base is None else float(base)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    partial = 1.0 if partial is None else float(partial)
    dim = int(shapes.head_dim * partial)
    if rope_type == "default":
        return RopeShift(base=base, dim=dim, neox=neox)
    if rope_type == "linear":
        return RopeShift(base=base, dim=dim, neox=neox, freq_scale=1.0 / float(params["factor"]))
    if rope_type not in _TABLE_ROPE_TYPES:
        raise NotSupportedError(f"{model_type}: rope_type {rope_type!r} is not supported for "
                                "context shift")
    if rope_type == "longrope":
        _check_static_longrope(config, params, model_type)
    inv_freq = _transformers_inv_freq(config, rope_type, rope_key)
    if inv_freq.shape != (dim // 2,) or not np.all(np.isfinite(inv_freq)) or (inv_freq <= 0).any():
        raise NotSupportedError(f"{model_type}: rope_type {rope_type!r} gives frequencies numbakv "
                                f"cannot express for {dim} rotary dims")
    plain = base ** (-2.0 * np.arange(dim // 2, dtype=np.float64) / dim)
    return RopeShift(base=base, dim=dim, neox=neox, freq_factors=plain / inv_freq)


def _is_mrope_model(model_type: str) -> bool:
    """Vision-language decoders with M-RoPE (Qwen2/2.5/3-VL, GLM-4V), even when the config does
    not spell out its ``mrope_section``."""
    return "vl" in model_type.split("_") or model_type.startswith("glm4v")


def _check_static_longrope(config, params: dict, model_type: str) -> None:
    """LongRoPE uses ``short_factor`` up to ``original_max_position_embeddings`` and
    ``long_factor`` beyond, chosen per forward pass: only a model that never switches has one
    rotation per delta."""
    short, long_ = params.get("short_factor"), params.get("long_factor")
    original = params.get("original_max_position_embeddings",
                          getattr(config, "original_max_position_embeddings", None))
    longest = getattr(config, "max_position_embeddings", None)
    if short is None or long_ is None:
        raise ValueError(f"{model_type}: longrope parameters need short_factor and long_factor")
    same = np.allclose(np.asarray(short, np.float64), np.asarray(long_, np.float64), rtol=0,
                       atol=0)
    if not same and (original is None or longest is None or longest > original):
        raise NotSupportedError(
            f"{model_type}: longrope switches from short_factor to long_factor past "
            f"original_max_position_embeddings={original} (max_position_embeddings={longest}); "
            "keys roped under one factor set cannot be re-rotated under the other, so context "
            "shift is not supported")


def _transformers_inv_freq(config, rope_type: str, rope_key: Optional[str]) -> np.ndarray:
    """The frequencies the model computes (transformers' own RoPE init function), float64."""
    _import_torch()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    fn = ROPE_INIT_FUNCTIONS[rope_type]
    kwargs = {} if rope_key is None else {"layer_type": rope_key}
    inv_freq, _ = fn(config, None, **kwargs)
    return inv_freq.detach().to("cpu").double().numpy()


# ---------------------------------------------------------------------------- cache_for
def _model_dtype(model) -> Optional[str]:
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype)
    return None


def _model_device(model) -> Optional[str]:
    for p in model.parameters():
        return "cuda" if p.device.type == "cuda" else "cpu"
    return None


def cache_for(model_or_config: Any, *, capacity: int, max_seqs: int = 1, max_batch: int = 512,
              dtype: Any = None, device: str = "auto", shift: Any = "auto",
              swa_memory: Optional[int] = None, **kw) -> Union[CausalCache, WrapperCache]:
    """A cache shaped for ``model_or_config``: layers, KV heads and head sizes, sliding windows
    and chunks, and the RoPE re-rotation for context shift, all from the model's config.

    Models whose layers all attend the same way get one :class:`CausalCache`. Models that mix
    them (Gemma 2/3 sliding + full layers, ``layer_types``) get a :class:`WrapperCache` with one
    ``CausalCache`` per kind of layer, ``layer_groups`` mapping model layers to them, and each
    group its own window and RoPE shift (Gemma 3's local and global bases).

    Args:
        model_or_config: a transformers model or its config.
        capacity, max_seqs, max_batch: as in :class:`numbakv.CacheConfig`.
        dtype: K/V dtype; ``None``: the model's parameter dtype (a config's ``dtype``, else
            float32). Keys and values of another dtype are converted when stored.
        device: ``"auto"`` with a model: where the model's parameters are; else as in
            ``CacheConfig``.
        shift: ``"auto"``: :func:`rope_shift_for` per layer group, or ``None`` where the model's
            RoPE cannot be re-rotated (then ``remove`` from the middle raises
            ``NotSupportedError``); ``None``; or a ``RopeShift``/callable used for every group.
        swa_memory: window memory of the sliding groups (``CausalCache(swa_memory=)``).
        **kw: any other :class:`numbakv.CacheConfig` field, passed through: ``cache_padding``,
            ``mask_batch_padding``, ``permuted_v``, and - once quantized storage lands -
            ``k_dtype="q8_0", v_dtype="q8_0"``.

    Returns:
        a ``CausalCache``, or a ``WrapperCache`` for models mixing layer kinds.
    """
    config = _text_config(model_or_config)
    model = model_or_config if _is_module(model_or_config) else None
    known = {f.name for f in fields(CacheConfig)}
    reserved = {"n_layers", "n_kv_heads", "head_dim", "v_head_dim", "layer_reuse"}
    unknown = sorted(set(kw) - known)
    if unknown or reserved & set(kw):
        bad = unknown or sorted(reserved & set(kw))
        raise ValueError(f"cache_for got unexpected option(s) {bad}: shapes come from the model; "
                         f"extra options must be CacheConfig fields "
                         f"{sorted(known - reserved - {'capacity', 'max_seqs', 'max_batch'})}")
    shapes = model_shapes(config)
    layers = layer_attention(config)
    if dtype is None:
        dtype = (_model_dtype(model) if model is not None else None) \
            or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    dtype = normalize_dtype(dtype, "dtype")
    if device == "auto" and model is not None:
        device = _model_device(model) or "auto"
    if not (shift in ("auto", None) or isinstance(shift, RopeShift) or callable(shift)):
        raise ValueError(f"shift must be 'auto', None, a RopeShift or a callable, got {shift!r}")

    groups: Dict[Tuple[str, Optional[int], Optional[int]], List[int]] = {}
    for i, la in enumerate(layers):
        groups.setdefault((la.layer_type, la.swa_window, la.chunk_size), []).append(i)
    reuse = kv_reuse_for(config)
    caches, group_of = [], [0] * len(layers)
    for g, ((layer_type, window, chunk), members) in enumerate(groups.items()):
        local = {layer: k for k, layer in enumerate(members)}
        group_reuse = None
        if reuse is not None and any(reuse[i] != i for i in members):
            if any(reuse[i] not in local for i in members):
                raise NotSupportedError(f"layers {members} ({layer_type}) reuse K/V of a layer "
                                        "of another kind, which numbakv keeps in another cache")
            group_reuse = [local[reuse[i]] for i in members]
        cfg = CacheConfig(n_layers=len(members), n_kv_heads=shapes.n_kv_heads,
                          head_dim=shapes.head_dim, v_head_dim=shapes.v_head_dim, dtype=dtype,
                          capacity=capacity, max_seqs=max_seqs, max_batch=max_batch,
                          device=device, layer_reuse=group_reuse, **kw)
        caches.append(CausalCache(cfg, shift=_group_shift(shift, config, layer_type),
                                  swa_window=window,
                                  swa_memory=swa_memory if window is not None else None,
                                  chunk_size=chunk))
        for i in members:
            group_of[i] = g
    if len(caches) == 1:
        return caches[0]
    return WrapperCache(caches, layer_groups=group_of)


def kv_reuse_for(model_or_config: Any) -> Optional[List[int]]:
    """llama.cpp's layer ``reuse`` for a model whose last layers share K/V (transformers'
    Gemma 3n ``num_kv_shared_layers``: each of the last ``n`` layers reads the K/V of the last
    earlier layer of its own type, as ``Gemma3nTextConfig.kv_sharing_modes`` does): for every
    model layer, the layer whose K/V it reads (itself when it owns them); None when no layer
    shares."""
    config = _text_config(model_or_config)
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if shared <= 0:
        return None
    n = int(config.num_hidden_layers)
    first = n - shared
    if first <= 0:
        raise NotSupportedError(f"num_kv_shared_layers={shared} leaves no layer of the "
                                f"{n} to produce K/V")
    types = [la.layer_type for la in layer_attention(config)]
    reuse = list(range(n))
    for i in range(first, n):
        producers = [j for j in range(first) if types[j] == types[i]]
        if not producers:
            raise NotSupportedError(f"layer {i} ({types[i]}) shares K/V but no earlier layer "
                                    "of its type produces them")
        reuse[i] = producers[-1]
    return reuse


def _group_shift(shift, config, layer_type: str):
    if shift != "auto":
        return shift
    try:
        return rope_shift_for(config, layer_type)
    except NotSupportedError:
        return None  # the cache then refuses context shift with NotSupportedError


# ---------------------------------------------------------------------------- attach / detach
def _layer_caches(cache) -> List[CausalCache]:
    """For each model layer, the ``CausalCache`` that holds it."""
    if isinstance(cache, CausalCache):
        return [cache] * cache.config.n_layers
    if isinstance(cache, WrapperCache):
        if cache.layer_groups is None:
            raise ValueError("cache is a WrapperCache without layer_groups; hf.attach needs the "
                             "layer -> cache map (hf.cache_for builds it)")
        return [cache.caches[g] for g in cache.layer_groups]
    raise ValueError(f"cache must be a numbakv CausalCache or WrapperCache, got "
                     f"{type(cache).__name__}")


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


_TORCH_DTYPES = {"float16": "float16", "float32": "float32", "bfloat16": "bfloat16"}


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
        from .attention import attend
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
    out = binding.store_and_attend(module.layer_idx, query, key, value, scaling, softcap)
    return out.unsqueeze(0), None


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
    layers = layer_attention(config)
    if getattr(config, "attn_temperature_tuning", False) and \
            not all(getattr(config, "no_rope_layers", None) or [1]):
        raise NotSupportedError(f"{config.model_type}: attention temperature tuning scales queries "
                                "by positions counted from 0 in each call, not by position_ids, "
                                "so a packed batch would be scaled wrongly")
    if len(layer_caches) != shapes.n_layers:
        raise ValueError(f"cache has {len(layer_caches)} layers but the model has "
                         f"{shapes.n_layers} (num_hidden_layers)")
    modules = _attention_modules(model)
    if sorted(modules) != list(range(shapes.n_layers)):
        raise NotSupportedError(f"found attention modules for layers {sorted(modules)}, expected "
                                f"0..{shapes.n_layers - 1}")
    for layer, module in modules.items():
        _check_layer(layer, module, layer_caches[layer], shapes, layers[layer])

    binding = _Binding(model, cache, layer_caches,
                       [getattr(torch, layer_cache.config.dtype) for layer_cache in layer_caches],
                       modules, [], layer_generation=[-1] * shapes.n_layers)
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

    original_start = cache.start_forward

    def start_forward(positions, seqs, reserve: bool = False) -> None:
        # read GPU positions back once, on the cache's stream (see CausalCache.start_forward)
        host = positions if isinstance(positions, np.ndarray) else \
            host_int_array(positions, "positions", _cache_stream(cache))
        original_start(host, seqs, reserve)
        binding.positions = host_int_array(host, "positions")
        binding.generation += 1

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
    if binding.hook is not None:
        binding.hook.remove()
    if "start_forward" in vars(binding.cache):
        del binding.cache.start_forward
    if _BINDING_ATTR in vars(binding.cache):
        delattr(binding.cache, _BINDING_ATTR)
    delattr(model, _BINDING_ATTR)


def attached_cache(model: Any) -> Optional[Any]:
    """The cache ``model`` is attached to, or ``None``."""
    binding = getattr(model, _BINDING_ATTR, None)
    return None if binding is None else binding.cache




# ---------------------------------------------------------------------------- generate / Server
# ``model.generate()`` and continuous batching over numbakv (``generation_cache``, ``Server``).
# ``model.generate()`` and continuous batching over numbakv (``hf.generation_cache``,
# ``hf.Server``).
#
# * :func:`generation_cache` returns a transformers ``Cache`` whose layers store every new key
#   and value in a numbakv cache built by :func:`numbakv.hf.cache_for` (windows, RoPE shift,
#   quantized K/V options) and hand the model back, per layer, the K/V its own attention and mask
#   expect - the same tensors ``DynamicCache`` would hand it (``[batch, kv_heads, kv_len,
#   head_dim]``; a sliding layer's last ``window - 1`` columns plus the new ones). Row ``b`` of the
#   padded batch is numbakv sequence ``b``; a column is a position (left padding is stored like
#   ``DynamicCache`` stores it and masked by the model's ``attention_mask``).
# * :class:`Server` serves many prompts over one numbakv cache with continuous batching: each
#   :meth:`Server.step` is one forward pass of the attached model over a packed batch mixing
#   prompt chunks and decode tokens; finished requests free their sequence.
#
# Inputs that require grad are detached here: no ``torch.no_grad()`` is needed.


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
            cfg = src.config
            if cfg.k_rotation or cfg.v_rotation:   # rotated quantized K/V: the model's own
                from .rotation import hadamard_blocks   # attention reads the unrotated basis
                ks = hadamard_blocks(ks, cfg.k_rotation) if cfg.k_rotation else ks
                vs = hadamard_blocks(vs, cfg.v_rotation) if cfg.v_rotation else vs
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
    layers = layer_attention(model)
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
        torch, _ = _transformers()
        self._torch = torch
        if attached_cache(model) is None:
            attach(model, cache)
        elif attached_cache(model) is not cache:
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


__all__ = ["ATTENTION_NAME", "INTERLEAVED_MODEL_TYPES", "ModelShapes", "LayerAttention",
           "model_shapes", "layer_attention", "rope_shift_for", "cache_for", "attach", "detach",
           "attached_cache", "generation_cache", "Server"]
