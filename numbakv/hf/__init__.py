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
function of this package needs them.

The package has one module per concern: :mod:`~numbakv.hf.families` (what a config says: shapes,
windows, RoPE shift, ``cache_for``), :mod:`~numbakv.hf.attach` (``attach``/``detach``, the
attention function), :mod:`~numbakv.hf.generation` (``generation_cache``) and
:mod:`~numbakv.hf.server` (``Server``), :mod:`~numbakv.hf.identity` (``model_id``: the
identity a prefix store of this model carries).
"""

from __future__ import annotations

from .attach import ATTENTION_NAME, _cache_stream, attach, attached_cache, detach
from .families import (INTERLEAVED_MODEL_TYPES, LayerAttention, ModelShapes, cache_for,
                       kv_reuse_for, layer_attention, model_shapes, rope_shift_for)
from .generation import generation_cache
from .identity import model_id, weights_digest
from .server import Server

__all__ = ["ATTENTION_NAME", "INTERLEAVED_MODEL_TYPES", "ModelShapes", "LayerAttention",
           "model_shapes", "layer_attention", "rope_shift_for", "cache_for", "attach", "detach",
           "attached_cache", "generation_cache", "Server", "model_id", "weights_digest"]
