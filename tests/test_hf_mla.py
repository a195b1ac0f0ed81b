"""MLA models through transformers (issue 34): DeepSeek-V3 and DeepSeek-V2 (tiny random-weight
configs, CPU) cache one V-less latent row per token (``kv_lora_rank + rope`` values, the bytes
transformers' own cache keeps, fewer when quantized): generate() equals DynamicCache token for
token; the packed path (hf.attach) equals the model's own forward; a context shift re-rotates
only the rope dims and equals a fresh prefill at the new positions; hf.Server serves them."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import numbakv as nkv  # noqa: E402
from numbakv import hf  # noqa: E402
from helpers import random_weight_model  # noqa: E402
from hf_helpers import assert_logits, full_logits, run_batch  # noqa: E402

pytestmark = pytest.mark.torch

VOCAB, NEW = 64, 8
RANK, ROPE = 64, 32


def mla_config(name: str, n_layers: int = 2):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                  num_hidden_layers=n_layers,
                  num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=RANK,
                  q_lora_rank=None, qk_rope_head_dim=ROPE, qk_nope_head_dim=16, v_head_dim=12,
                  max_position_embeddings=256, moe_intermediate_size=32, n_routed_experts=4,
                  num_experts_per_tok=2, first_k_dense_replace=n_layers, pad_token_id=0,
                  eos_token_id=None)
    if name == "deepseek_v3":
        return transformers.DeepseekV3Config(**common, n_group=1, topk_group=1)
    if name == "deepseek_v3-plain":          # rope_interleave=False: rotate-half weights
        return transformers.DeepseekV3Config(**common, n_group=1, topk_group=1,
                                             rope_interleave=False)
    if name == "deepseek_v2":
        return transformers.DeepseekV2Config(**common)
    raise KeyError(name)


_MODELS: dict = {}


def mla_model(name: str, n_layers: int = 2):
    if (name, n_layers) not in _MODELS:
        _MODELS[name, n_layers] = random_weight_model(mla_config(name, n_layers), std=0.15)
    return _MODELS[name, n_layers]


NAMES = ["deepseek_v3", "deepseek_v3-plain", "deepseek_v2"]


def _generate(model, ids, mask, cache):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              pad_token_id=0, past_key_values=cache)


def test_cache_for_builds_a_v_less_latent_cache():
    model = mla_model("deepseek_v3")
    cache = hf.cache_for(model, capacity=32, device="cpu")
    cfg = cache.config
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim) == (1, RANK + ROPE, 0)
    assert cache.storage.values.nbytes == 0
    assert (cache.shift.dim, cache.shift.offset, cache.shift.neox) == (ROPE, RANK, True)
    assert hf.rope_shift_for(mla_config("deepseek_v2")).neox is False
    # the bytes per token transformers' own cache keeps: kv_nope + k_rot per layer
    per_token = cfg.nbytes(1)
    assert per_token == 2 * (RANK + ROPE) * 4            # 2 layers, float32
    quant = hf.cache_for(model, capacity=32, device="cpu", k_dtype="q8_0")
    assert quant.config.nbytes(1) < per_token


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("padded", [False, True], ids=["batch1", "padded"])
def test_generate_equals_dynamic_cache(name, padded):
    model = mla_model(name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2 if padded else 1, 9), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :3] = 0
        mask[1, :3] = 0
    ref = _generate(model, ids, mask, transformers.DynamicCache(config=model.config))
    cache = hf.generation_cache(model, max_new_tokens=NEW)
    out = _generate(model, ids, mask, cache)
    assert torch.equal(out, ref)
    held = cache.numbakv_cache
    assert held.config.v_less and held.config.head_dim == RANK + ROPE


@pytest.mark.parametrize("name", NAMES)
def test_packed_batches_equal_the_models_own_forward(name):
    model = mla_model(name)
    g = torch.Generator().manual_seed(2)
    a = torch.randint(3, VOCAB, (11,), generator=g).tolist()
    b = torch.randint(3, VOCAB, (7,), generator=g).tolist()
    cache = hf.cache_for(model, capacity=32, max_seqs=2, device="cpu")
    hf.attach(model, cache)
    try:
        la, lb = run_batch(model, cache, [(0, a[:6], 0), (1, b[:4], 0)])
        lb2, la2 = run_batch(model, cache, [(1, b[4:], 4), (0, a[6:], 6)])
    finally:
        hf.detach(model)
    assert_logits(torch.cat([la, la2]), full_logits(model, a), "sequence 0")
    assert_logits(torch.cat([lb, lb2]), full_logits(model, b), "sequence 1")


@pytest.mark.parametrize("name", NAMES)
def test_context_shift_equals_a_fresh_prefill_at_the_new_positions(name):
    """One layer: what a layer stores depends only on its token and position, so after the shift
    the cache is exactly what a prefill of the kept tokens would hold (deeper layers' latents
    keep the context they were computed in, as in llama.cpp's context shift)."""
    model = mla_model(name, n_layers=1)
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(3, VOCAB, (14,), generator=g).tolist()
    cache = hf.cache_for(model, capacity=32, device="cpu")
    before = cache.storage.keys.copy()
    hf.attach(model, cache)
    try:
        run_batch(model, cache, [(0, toks[:12], 0)])
        stored = cache.storage.keys.copy()
        cache.remove(0, 2, 6)          # positions 6..11 move to 2..7: rope dims re-rotated
        shifted = cache.storage.keys.copy()
        (got,) = run_batch(model, cache, [(0, toks[12:], 8)])
    finally:
        hf.detach(model)
    assert not np.array_equal(stored, before)
    # the latent part of every row is untouched; only rope dims moved
    assert np.array_equal(shifted[..., :RANK], stored[..., :RANK])
    kept = toks[:2] + toks[6:12] + toks[12:]
    want = full_logits(model, kept)[8:]
    assert_logits(got, want, "after the shift", tol=2e-4)


def test_server_equals_greedy_generate():
    model = mla_model("deepseek_v3")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 12, 3)]
    refs = []
    for p in prompts:
        out = _generate(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long),
                        transformers.DynamicCache(config=model.config))
        refs.append(out[0, len(p):].tolist())
    srv = hf.Server(model, hf.cache_for(model, capacity=64, max_seqs=2, max_batch=8,
                                        device="cpu"), prefill_chunk=5)
    rids = [srv.submit(p, max_new_tokens=NEW) for p in prompts]
    while srv.pending:
        srv.step()
    assert [srv.finished[r] for r in rids] == refs
    hf.detach(model)


def test_attach_refuses_a_per_head_cache_for_an_mla_model():
    model = mla_model("deepseek_v3")
    wrong = nkv.CausalCache(nkv.CacheConfig(2, 4, 24, v_head_dim=12, capacity=16, device="cpu"))
    with pytest.raises(ValueError, match="V-less latent"):
        hf.attach(model, wrong)
    assert hf.attached_cache(model) is None
