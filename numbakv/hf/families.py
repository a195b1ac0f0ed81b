"""The model-family table: what a transformers config says about its KV cache.

Shapes (layers, KV heads, head sizes), the attention of each layer (full, sliding window,
chunked), the RoPE re-rotation for context shift (:func:`rope_shift_for`), layers that share K/V,
and the numbakv cache that holds it all (:func:`cache_for`). Families that need more than the
common reading (MLA, hybrid recurrent models) plug in here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ..causal import CausalCache
from ..config import CacheConfig, RopeShift, normalize_dtype
from ..errors import NotSupportedError
from ..wrappers import WrapperCache
from ._deps import _import_torch

#: ``rotate_every_two``, Cohere's ``rotate_half``); every other model uses NeoX pairs.
INTERLEAVED_MODEL_TYPES = frozenset({"gptj", "codegen", "cohere", "cohere2", "llama4",
                                     "llama4_text"})
#: Model types whose RoPE base is hard-coded to 10000 rather than read from the config.
_FIXED_BASE_MODEL_TYPES = frozenset({"gptj", "codegen"})
#: RoPE types whose frequencies transformers derives from a table: read them from its own
#: ``ROPE_INIT_FUNCTIONS`` and express the difference to plain RoPE as per-pair factors.
_TABLE_ROPE_TYPES = frozenset({"llama3", "yarn", "longrope"})


# ---------------------------------------------------------------------------- config reading

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
    #: MLA models (DeepSeek-V2/V3, ...): ``(kv_lora_rank, rope_dims)`` of the latent row
    #: transformers caches per token (``cache.update(kv_nope, k_rot)``, one "head"); None else
    latent: Optional[Tuple[int, int]] = None

    @property
    def latent_dim(self) -> int:
        """Values of one cached latent row (``kv_lora_rank + rope_dims``); 0 without MLA."""
        return 0 if self.latent is None else sum(self.latent)


def model_shapes(model_or_config: Any) -> ModelShapes:
    """Layers, query heads, KV heads and head sizes of ``model_or_config``'s decoder
    (``head_dim``/``v_head_dim`` are the per-head sizes of the model's attention; an MLA model's
    cache holds ``latent`` rows instead)."""
    config = _text_config(model_or_config)
    n_layers = int(config.num_hidden_layers)
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    if getattr(config, "qk_rope_head_dim", None):        # MLA: keys are [nope | rope] parts
        head_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
    else:
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // n_heads)
    v_head_dim = int(getattr(config, "v_head_dim", None) or head_dim)
    latent = None
    if getattr(config, "kv_lora_rank", None) and getattr(config, "qk_rope_head_dim", None):
        latent = (int(config.kv_lora_rank), int(config.qk_rope_head_dim))
    return ModelShapes(n_layers, n_heads, n_kv, head_dim, v_head_dim, latent)


#: MLA model types whose stored rope part keeps interleaved pairs ``(x[2i], x[2i+1])``
#: (DeepSeek-V2 ropes through complex multiplication); DeepSeek-V3's interleaved weights are
#: de-interleaved by its RoPE (``apply_rotary_pos_emb_interleave`` returns rotate-half order)
_MLA_INTERLEAVED_MODEL_TYPES = frozenset({"deepseek_v2"})


def mla_cache_config_kw(shapes: ModelShapes) -> dict:
    """The CacheConfig shape fields of an MLA model's latent cache: one V-less "head" of
    ``kv_lora_rank + rope_dims`` (llama.cpp's MLA cache; what transformers 5.24 caches)."""
    return {"n_kv_heads": 1, "head_dim": shapes.latent_dim, "v_head_dim": 0}


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
    return [_layer_attention(config, i, kind, window) for i, kind in enumerate(types)]


def _layer_attention(config, i: int, kind: str, window) -> LayerAttention:
    if kind == "full_attention":
        return LayerAttention(kind, None, None)
    if kind == "sliding_attention":
        if not window:
            raise ValueError(f"layer {i} is a sliding_attention layer but config.sliding_window"
                             f" is {window!r}")
        if int(window) < 2:
            raise NotSupportedError(f"sliding_window={window} (a token sees only itself) is "
                                    "not a window numbakv can express")
        return LayerAttention(kind, int(window) - 1, None)
    if kind == "chunked_attention":
        chunk = getattr(config, "attention_chunk_size", None)
        if not chunk:
            raise ValueError(f"layer {i} is a chunked_attention layer but "
                             f"config.attention_chunk_size is {chunk!r}")
        return LayerAttention(kind, None, int(chunk))
    raise NotSupportedError(f"layer {i} has layer type {kind!r}, which keeps no KV cache "
                            "numbakv can hold")


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
            with the length, M-RoPE (``mrope_section``), or an unknown type.

    MLA models (``kv_lora_rank`` + ``qk_rope_head_dim``: DeepSeek-V2/V3, ...): the shift of the
    cached latent row, ``RopeShift(dim=qk_rope_head_dim, offset=kv_lora_rank)`` (only the
    trailing rope dims turn; DeepSeek-V2's pairs interleaved, V3's rotate-half).
    """
    config = _text_config(config)
    model_type = getattr(config, "model_type", "")
    shapes = model_shapes(config)
    if shapes.latent is None and getattr(config, "qk_rope_head_dim", None):
        raise NotSupportedError(
            f"{model_type}: MLA keys carry a decoupled RoPE part after the un-roped part and the "
            "config names no kv_lora_rank latent; context shift is not supported")
    no_rope = getattr(config, "no_rope_layers", None)
    if no_rope is not None and not all(no_rope):
        raise NotSupportedError(f"{model_type}: some layers use no RoPE (no_rope_layers), so one "
                                "RopeShift cannot re-rotate every layer; context shift is not "
                                "supported")
    neox = model_type not in INTERLEAVED_MODEL_TYPES
    if shapes.latent is not None:   # MLA: the shift turns the latent row's trailing rope dims
        shift = _rope_shift(config, layer_type, model_type, shapes.latent[1],
                            model_type not in _MLA_INTERLEAVED_MODEL_TYPES)
        return dataclasses.replace(shift, offset=shapes.latent[0])
    if model_type in _FIXED_BASE_MODEL_TYPES:
        dim = int(getattr(config, "rotary_dim", None) or shapes.head_dim)
        return RopeShift(base=10000.0, dim=dim, neox=neox)
    partial = _rope_parameters(config, layer_type)[0].get(
        "partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    partial = 1.0 if partial is None else float(partial)
    return _rope_shift(config, layer_type, model_type, int(shapes.head_dim * partial), neox)


def _rope_shift(config, layer_type: Optional[str], model_type: str, dim: int,
                neox: bool) -> RopeShift:
    """The RopeShift of ``dim`` rotary dims from the config's RoPE parameters (see
    :func:`rope_shift_for`)."""
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
              swa_memory: Optional[int] = None, **kw) -> Any:
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
            ``k_dtype="q8_0", v_dtype="q8_0"``. Hybrid models also take ``restore_every``
            (restore-point spacing in tokens, default 256) and ``max_restore_points`` (per
            sequence, default 8) for their ``RecurrentCache``.

    Returns:
        a ``CausalCache``, or a ``WrapperCache`` for models mixing layer kinds; for hybrid
        models (:data:`HYBRID_FAMILIES`: recurrent layers beside attention layers) a
        ``HybridCache`` of that attention cache and a ``RecurrentCache`` shaped by
        :func:`hybrid_layout` (conv state in the model's dtype, SSM / delta state float32).
    """
    config = _text_config(model_or_config)
    model = model_or_config if _is_module(model_or_config) else None
    layout = hybrid_layout(config)
    if layout is not None and "both" in layout.layer_kinds:
        raise NotSupportedError(f"{layout.family}: layers holding attention and a recurrent "
                                "mixer side by side (Falcon-H1) are not supported by "
                                "HybridCache yet")
    recurrent_kw = {k: kw.pop(k) for k in ("restore_every", "max_restore_points") if k in kw}
    if recurrent_kw and layout is None:
        raise ValueError(f"cache_for got {sorted(recurrent_kw)}: options of hybrid models' "
                         f"recurrent state, and {config.model_type} has no recurrent layers")
    known = {f.name for f in fields(CacheConfig)}
    reserved = {"n_layers", "n_kv_heads", "head_dim", "v_head_dim", "layer_reuse"}
    unknown = sorted(set(kw) - known)
    if unknown or reserved & set(kw):
        bad = unknown or sorted(reserved & set(kw))
        raise ValueError(f"cache_for got unexpected option(s) {bad}: shapes come from the model; "
                         f"extra options must be CacheConfig fields "
                         f"{sorted(known - reserved - {'capacity', 'max_seqs', 'max_batch'})}")
    shapes = model_shapes(config)
    layers = list(hybrid_attention(config).values())   # every layer unless hybrid
    if dtype is None:
        dtype = (_model_dtype(model) if model is not None else None) \
            or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    dtype = normalize_dtype(dtype, "dtype")
    if device == "auto" and model is not None:
        device = _model_device(model) or "auto"
    if not (shift in ("auto", None) or isinstance(shift, RopeShift) or callable(shift)):
        raise ValueError(f"shift must be 'auto', None, a RopeShift or a callable, got {shift!r}")
    if layout is not None and not layout.rope and shift == "auto":
        shift = None      # attention without RoPE (Jamba): positions move no key

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
        heads = dict(n_kv_heads=shapes.n_kv_heads, head_dim=shapes.head_dim,
                     v_head_dim=shapes.v_head_dim) if shapes.latent is None \
            else mla_cache_config_kw(shapes)
        cfg = CacheConfig(n_layers=len(members), dtype=dtype, capacity=capacity,
                          max_seqs=max_seqs, max_batch=max_batch, device=device,
                          layer_reuse=group_reuse, **heads, **kw)
        caches.append(CausalCache(cfg, shift=_group_shift(shift, config, layer_type),
                                  swa_window=window,
                                  swa_memory=swa_memory if window is not None else None,
                                  chunk_size=chunk))
        for i in members:
            group_of[i] = g
    attention = caches[0] if len(caches) == 1 else WrapperCache(caches, layer_groups=group_of)
    if layout is None:
        return attention
    model_dtype = _model_dtype(model) if model is not None else None
    state_dtype = normalize_dtype(model_dtype, "dtype") if model_dtype else dtype
    return _hybrid_cache(layout, attention, state_dtype, max_seqs, device, **recurrent_kw)


def _hybrid_cache(layout: HybridLayout, attention, dtype: str, max_seqs: int, device: str,
                  restore_every: int = 256, max_restore_points: int = 8):
    """A ``HybridCache``: ``attention`` (the attending layers) beside a ``RecurrentCache`` of
    the model's recurrent layers (conv state in ``dtype``, the model's, unless the family keeps
    it otherwise; SSM / delta state float32)."""
    from ..hybrid import HybridCache
    from ..recurrent import RecurrentCache, RecurrentConfig, StateSpec
    specs = [StateSpec(s.name, s.shape, s.dtype or dtype) for s in layout.states]
    groups = getattr(attention, "caches", (attention,))
    rc = RecurrentCache(RecurrentConfig(
        n_layers=len(layout.recurrent_layers), states=specs, max_seqs=max_seqs,
        restore_every=restore_every, max_restore_points=max_restore_points,
        device=groups[0].config.device if device == "auto" else device))
    return HybridCache(attention, rc, layer_kinds=list(layout.layer_kinds))


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


# ---------------------------------------------------------------------------- hybrid families
# transformers' hybrid models keep, for every recurrent layer, a conv state (the last inputs of
# the layer's causal convolution) and most also a recurrent state (Mamba's SSM state, the gated
# delta net's delta state). Their layer types: "linear_attention" (gated delta net, Mamba),
# "conv" (LFM2's short convolution), "hybrid" (Falcon-H1: a Mamba mixer beside the attention of
# the same layer), the attention types as above.
_RECURRENT_TYPES = frozenset({"linear_attention", "conv", "mamba"})
_BOTH_TYPES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}


@dataclass(frozen=True)
class RecurrentState:
    """One state tensor of a recurrent layer, per sequence: ``shape`` as transformers keeps it
    (the conv state ``[conv_dim, kernel]``, channels first), ``dtype`` ``None`` for the model's
    dtype."""

    name: str
    shape: Tuple[int, ...]
    dtype: Optional[str]


@dataclass(frozen=True)
class HybridLayout:
    """How a hybrid model (recurrent layers beside attention layers) keeps its sequence.

    ``layer_kinds[i]`` is ``"attention"``, ``"recurrent"`` or ``"both"`` (Falcon-H1: a Mamba
    mixer and an attention beside each other in every layer); ``mixer`` is the attribute of a
    decoder layer holding its recurrent mixer (whose ``forward(hidden_states, cache,
    attention_mask)`` asks the cache for ``get_conv_state``/``update_recurrent_state``...);
    ``states`` the state tensors every recurrent layer keeps per sequence; ``rope``: whether the
    attention layers rotate their keys (Jamba's and NoPE Granite's do not);
    ``resumes_chunks``: whether the mixer's multi-token scan starts from the state it is handed
    (transformers' Jamba starts it from zeros: numbakv then continues a state token by token)."""

    family: str
    layer_kinds: Tuple[str, ...]
    mixer: str
    states: Tuple[RecurrentState, ...]
    rope: bool
    resumes_chunks: bool = True

    @property
    def recurrent_layers(self) -> List[int]:
        """Model layers with a recurrent mixer, in order (recurrent layer ``j`` of the cache is
        model layer ``recurrent_layers[j]``)."""
        return [i for i, k in enumerate(self.layer_kinds) if k != "attention"]

    @property
    def attention_layers(self) -> List[int]:
        """Model layers with attention, in order (attention layer ``j`` of the cache is model
        layer ``attention_layers[j]``)."""
        return [i for i, k in enumerate(self.layer_kinds) if k != "recurrent"]


def _gated_delta_net_states(c) -> Tuple[RecurrentState, ...]:
    # Qwen3-Next / Qwen3.5: conv over [q | k | v] channels; delta state [v_heads, d_k, d_v]
    key_dim = int(c.linear_num_key_heads) * int(c.linear_key_head_dim)
    value_dim = int(c.linear_num_value_heads) * int(c.linear_value_head_dim)
    return (RecurrentState("conv", (2 * key_dim + value_dim, int(c.linear_conv_kernel_dim)), None),
            RecurrentState("ssm", (int(c.linear_num_value_heads), int(c.linear_key_head_dim),
                                   int(c.linear_value_head_dim)), "float32"))


def _mamba2_states(c) -> Tuple[RecurrentState, ...]:
    # Granite-4 / Bamba / Falcon-H1: conv over [x | B | C]; SSM state [heads, d_head, d_state]
    inner = getattr(c, "mamba_d_ssm", None) or int(c.mamba_expand) * int(c.hidden_size)
    conv_dim = int(inner) + 2 * int(c.mamba_n_groups) * int(c.mamba_d_state)
    return (RecurrentState("conv", (conv_dim, int(c.mamba_d_conv)), None),
            RecurrentState("ssm", (int(c.mamba_n_heads), int(c.mamba_d_head),
                                   int(c.mamba_d_state)), "float32"))


def _mamba1_states(c) -> Tuple[RecurrentState, ...]:
    # Jamba: conv over the inner channels; SSM state [d_inner, d_state]
    inner = int(c.mamba_expand) * int(c.hidden_size)
    return (RecurrentState("conv", (inner, int(c.mamba_d_conv)), None),
            RecurrentState("ssm", (inner, int(c.mamba_d_state)), "float32"))


def _short_conv_states(c) -> Tuple[RecurrentState, ...]:
    # LFM2: a gated short convolution, no recurrent state
    return (RecurrentState("conv", (int(c.hidden_size), int(c.conv_L_cache)), None),)


def _rope_unless(attr: str, want: str):
    return lambda c: getattr(c, attr, want) == want


#: model_type -> (mixer attribute, state tensors, whether attention rotates keys). The recurrent
#: state is float32 (what transformers' scans return: the torch fallbacks, the mamba_ssm and
#: flash-linear-attention kernels); the conv state is in the model's dtype.
HYBRID_FAMILIES: Dict[str, Tuple[str, Any, Any]] = {
    "qwen3_next": ("linear_attn", _gated_delta_net_states, lambda c: True),
    "qwen3_5_text": ("linear_attn", _gated_delta_net_states, lambda c: True),
    "qwen3_5_moe_text": ("linear_attn", _gated_delta_net_states, lambda c: True),
    "granitemoehybrid": ("mamba", _mamba2_states, _rope_unless("position_embedding_type",
                                                               "rope")),
    "bamba": ("mamba", _mamba2_states, lambda c: True),
    "falcon_h1": ("mamba", _mamba2_states, lambda c: True),
    "lfm2": ("conv", _short_conv_states, lambda c: True),
    "jamba": ("mamba", _mamba1_states, lambda c: False),
}


#: families whose transformers mixer starts every multi-token scan from a zero SSM state
#: (JambaMambaMixer passes no initial state to ``mamba_selective_scan``)
_SCAN_FROM_ZERO = frozenset({"jamba"})


def hybrid_layout(model_or_config: Any) -> Optional[HybridLayout]:
    """The :class:`HybridLayout` of a hybrid model (``None`` for a model whose layers all
    attend). Raises ``NotSupportedError`` for a model with recurrent layers whose family is not
    in :data:`HYBRID_FAMILIES`."""
    config = _text_config(model_or_config)
    types = list(getattr(config, "layer_types", None) or [])
    if not any(t in _RECURRENT_TYPES or t in _BOTH_TYPES for t in types):
        return None
    family = HYBRID_FAMILIES.get(config.model_type)
    if family is None:
        raise NotSupportedError(f"{config.model_type}: recurrent layers of this family are not "
                                f"in numbakv's table (hybrid families: "
                                f"{sorted(HYBRID_FAMILIES)})")
    mixer, states, rope = family
    kinds = tuple("recurrent" if t in _RECURRENT_TYPES else "both" if t in _BOTH_TYPES
                  else "attention" for t in types)
    return HybridLayout(config.model_type, kinds, mixer, states(config), bool(rope(config)),
                        config.model_type not in _SCAN_FROM_ZERO)


def hybrid_attention(model_or_config: Any) -> Dict[int, LayerAttention]:
    """``{model layer: LayerAttention}`` for the layers of a hybrid model that attend (a
    Falcon-H1 ``"hybrid"`` layer attends fully, a ``"hybrid_sliding"`` one with its window)."""
    config = _text_config(model_or_config)
    layout = hybrid_layout(config)
    if layout is None:
        return dict(enumerate(layer_attention(config)))
    window = getattr(config, "sliding_window", None)
    types = list(config.layer_types)
    return {i: _layer_attention(config, i, _BOTH_TYPES.get(types[i], types[i]), window)
            for i in layout.attention_layers}
