"""Tiny random-weight hybrid models of transformers 5.24 (recurrent layers beside attention
layers) for the tests and benchmarks of numbakv's hybrid support, and their DynamicCache
reference runs.

Every family keeps its own kind of recurrent layer, at sizes small enough for the CPU (the scan
kernels fall back to transformers' torch reference code there):

=================  =========================================  ==================================
family             recurrent layer                            state per sequence and layer
=================  =========================================  ==================================
qwen3_next         gated delta net (+ MoE MLPs)               conv [conv_dim, 4], delta
                                                              [v_heads, d_k, d_v] float32
qwen3_5            gated delta net                            as qwen3_next
granitemoehybrid   Mamba-2 (+ MoE MLPs, attention w/o RoPE)   conv [conv_dim, 4], ssm
                                                              [heads, d_head, d_state] float32
bamba              Mamba-2                                    as granitemoehybrid
falcon_h1          Mamba-2 beside attention in every layer    as granitemoehybrid
lfm2               gated short convolution                    conv [hidden, L_cache]
jamba              Mamba-1 (+ MoE MLPs)                       conv [d_inner, 4], ssm
                                                              [d_inner, d_state] float32
=================  =========================================  ==================================

Sizes are picked so that no two state dimensions are equal (a transposed state is caught).
"""

from __future__ import annotations

from typing import Callable, Dict

from helpers import random_weight_model

VOCAB = 97


def _qwen3_next():
    import transformers
    return transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4,
        linear_key_head_dim=6, linear_value_head_dim=10, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts_per_tok=2, num_experts=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])


def _qwen3_5():
    import transformers
    return transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4,
        linear_key_head_dim=6, linear_value_head_dim=10, linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])


def _granitemoehybrid():
    import transformers
    return transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=16, mamba_n_heads=4, mamba_d_state=6, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=8, mamba_n_groups=1,
        layer_types=["mamba", "attention", "mamba", "attention"])


def _bamba():
    import transformers
    return transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3],
        mamba_n_heads=4, mamba_d_state=6, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)


def _falcon_h1():
    import transformers
    return transformers.FalconH1Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=32, mamba_n_heads=4,
        mamba_d_state=6, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)


def _lfm2():
    import transformers
    return transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, block_multiple_of=16,
        layer_types=["conv", "full_attention", "conv", "full_attention"])


def _jamba():
    import transformers
    return transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
        mamba_d_state=6, mamba_d_conv=4, mamba_expand=2)


#: family -> a function building its tiny config
CONFIGS: Dict[str, Callable] = {
    "qwen3_next": _qwen3_next, "qwen3_5": _qwen3_5, "granitemoehybrid": _granitemoehybrid,
    "bamba": _bamba, "falcon_h1": _falcon_h1, "lfm2": _lfm2, "jamba": _jamba,
}
FAMILIES = sorted(CONFIGS)


def tiny_config(family: str):
    """The tiny config of ``family`` (a fresh object each call)."""
    return CONFIGS[family]()


def tiny_model(family: str, dtype=None):
    """A seeded random-weight model of ``family`` in eval mode (``helpers.random_weight_model``),
    cast to ``dtype`` when given."""
    model = random_weight_model(tiny_config(family))
    return model if dtype is None else model.to(dtype)


def padded_batch(seed: int = 0, rows=(11, 7, 9)):
    """``(input_ids [b, L], attention_mask [b, L])``: rows of the given lengths, left-padded
    with token 0 to the longest (transformers' generate() convention for decoder models)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    width = max(rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, n in enumerate(rows):
        ids[b, width - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[b, width - n:] = 1
    return ids, mask


def dynamic_generate(model, input_ids, attention_mask=None, *, max_new_tokens=8,
                     do_sample=False, seed=0, **kw):
    """``model.generate`` with transformers' own ``DynamicCache``: the reference numbakv's
    generation cache must equal token for token (``seed`` seeds torch's global generator for
    sampling, as the numbakv run does)."""
    import torch
    from transformers import DynamicCache
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(input_ids, attention_mask=attention_mask,
                              **{cache_kwarg(): DynamicCache(config=model.config)},
                              max_new_tokens=max_new_tokens, do_sample=do_sample,
                              pad_token_id=0, **kw)


def cache_kwarg() -> str:
    """The keyword generate() takes a cache under (transformers 5.24 renamed
    ``past_key_values`` to ``cache``)."""
    import inspect
    import transformers
    params = inspect.signature(transformers.GenerationMixin.prepare_inputs_for_generation)
    return "cache" if "cache" in params.parameters else "past_key_values"


def dynamic_states(model, input_ids):
    """One forward pass of ``input_ids [b, L]`` with a ``DynamicCache``; returns the cache
    (its ``LinearAttentionLayer`` layers hold the conv and recurrent states transformers keeps:
    what numbakv's state specs must match)."""
    import torch
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids, **{cache_kwarg(): cache}, use_cache=True)
    return cache
