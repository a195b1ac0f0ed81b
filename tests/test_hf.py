"""numbakv.hf: tiny random-weight transformers models (built from configs, nothing downloaded)
served through a numbakv cache give the logits of the model's own full forward, sequence by
sequence, over mixed prefill/decode batches, copy_prefix forks and context shifts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import numbakv as nkv  # noqa: E402
from numbakv import hf  # noqa: E402

from helpers import random_weight_model  # noqa: E402
from hf_helpers import assert_logits, full_logits, run_batch  # noqa: E402

VOCAB = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_attention_heads=4,
             max_position_embeddings=128)


def _family_config(name: str, n_layers: int):
    """A tiny config of each family (head_dim 16, GQA where the family has it)."""
    T = transformers
    gqa = dict(SMALL, num_key_value_heads=2, num_hidden_layers=n_layers)
    if name == "llama":
        return T.LlamaConfig(**gqa)
    if name == "llama-linear":
        return T.LlamaConfig(**gqa, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                     "rope_theta": 10000.0})
    if name == "llama-llama3":   # original length 64: the 8 pairs fall in all three bands
        return T.LlamaConfig(**gqa, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0})
    if name == "llama-yarn":
        return T.LlamaConfig(**dict(gqa, max_position_embeddings=128), rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
            "rope_theta": 10000.0})
    if name == "mistral":
        return T.MistralConfig(**gqa, sliding_window=4, head_dim=16)
    if name == "qwen2":
        return T.Qwen2Config(**gqa)
    if name == "qwen2-sliding":  # use_sliding_window: layers >= max_window_layers slide
        return T.Qwen2Config(**gqa, use_sliding_window=True, sliding_window=4,
                             max_window_layers=1 if n_layers > 1 else 0)
    if name == "qwen3":
        return T.Qwen3Config(**gqa, head_dim=16)
    if name == "gemma2":
        types = ["sliding_attention", "full_attention"][:n_layers] if n_layers <= 2 else None
        return T.Gemma2Config(**gqa, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                              attn_logit_softcapping=1.0, final_logit_softcapping=5.0,
                              layer_types=types)
    if name == "gemma3":
        types = ["full_attention"] if n_layers == 1 else ["sliding_attention", "full_attention"]
        return T.Gemma3TextConfig(**gqa, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                  layer_types=types, rope_parameters={
                                      "sliding_attention": {"rope_type": "default",
                                                            "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                         "rope_theta": 1000000.0}})
    if name == "phi3":
        return T.Phi3Config(**gqa, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2)
    if name == "gpt_neox":
        return T.GPTNeoXConfig(**dict(SMALL, num_hidden_layers=n_layers), rotary_pct=0.25)
    if name == "cohere":         # interleaved pairs through the standard rotary module
        return T.CohereConfig(**gqa, logit_scale=1.0)
    if name == "gptj":
        return T.GPTJConfig(vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=n_layers,
                            n_positions=128, rotary_dim=8, n_inner=64)
    raise KeyError(name)


FAMILIES = ["llama", "llama-linear", "llama-llama3", "llama-yarn", "mistral", "qwen2",
            "qwen2-sliding", "qwen3", "gemma2", "gemma3", "phi3", "gpt_neox", "gptj", "cohere"]


def tiny_model(name: str, n_layers: int = 2):
    """A random-weight float32 model of family ``name`` in eval mode, eager attention (the
    reference). Matrices get std 0.25 so attention is far from uniform and a wrong mask, window,
    RoPE or soft-cap changes the logits well beyond the tolerance."""
    return random_weight_model(_family_config(name, n_layers),
                               model_class=transformers.GPTJForCausalLM if name == "gptj" else None)


# ------------------------------------------------------------------------------ families
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_full_forward(family):
    """Mixed prefill/decode batches of three sequences, one of them a copy_prefix fork: every
    token's logits equal the model's own full forward of its sequence."""
    check_family_matches_full_forward(family)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3", "gptj"])
def test_family_matches_full_forward_per_sequence_streams(family):
    """The same with llama.cpp's per-sequence streams (``unified=False``; Gemma 3: a WrapperCache
    of two stream caches): the fork copies its prefix into its own stream."""
    check_family_matches_full_forward(family, unified=False)


def check_family_matches_full_forward(family, **cache_kw):
    model = tiny_model(family)
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, VOCAB, (14,), generator=g).tolist()
    b = torch.randint(0, VOCAB, (10,), generator=g).tolist()
    fork = a[:6] + torch.randint(0, VOCAB, (5,), generator=g).tolist()
    want = {0: full_logits(model, a), 1: full_logits(model, b), 2: full_logits(model, fork)}
    seqs = {0: a, 1: b, 2: fork}

    cache = hf.cache_for(model, capacity=32, max_seqs=3, max_batch=16, device="cpu", **cache_kw)
    hf.attach(model, cache)
    schedule = [
        [(0, 0, 7), (1, 0, 4)],                  # two prefills
        [(0, 7, 8), (1, 4, 9)],                  # a decode beside a prefill chunk
        "fork",                                  # seq 2 = first 6 positions of seq 0
        [(2, 6, 8), (0, 8, 9), (1, 9, 10)],      # the fork's own prompt + decodes
        [(0, 9, 10), (2, 8, 9)],
        [(0, 10, 12), (2, 9, 10)],
        [(0, 12, 14), (2, 10, 11)],
    ]
    for step in schedule:
        if step == "fork":
            cache.copy_prefix(0, 2, 6)
            continue
        parts = [(s, seqs[s][lo:hi], lo) for s, lo, hi in step]
        for (s, lo, hi), got in zip(step, run_batch(model, cache, parts)):
            assert_logits(got, want[s][lo:hi], f"{family} seq {s} positions {lo}..{hi - 1}")
    hf.detach(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_context_shift_one_layer_exact(family):
    """One layer: a stored key depends only on its token and position, so after remove() with
    re-rotation the continuation equals the full forward of the shortened sequence."""
    check_context_shift_one_layer_exact(family)


@pytest.mark.parametrize("family", ["llama", "gptj"])
def test_context_shift_one_layer_exact_per_sequence_streams(family):
    check_context_shift_one_layer_exact(family, unified=False)


def check_context_shift_one_layer_exact(family, **cache_kw):
    model = tiny_model(family, n_layers=1)
    g = torch.Generator().manual_seed(2)
    seq = torch.randint(0, VOCAB, (14,), generator=g).tolist()
    extra = torch.randint(0, VOCAB, (3,), generator=g).tolist()
    kept = seq[:3] + seq[7:] + extra          # positions 3..6 removed, later ones move down 4
    want = full_logits(model, kept)
    cache = hf.cache_for(model, capacity=32, max_seqs=2, max_batch=16, device="cpu", **cache_kw)
    hf.attach(model, cache)
    run_batch(model, cache, [(0, seq[:8], 0)])
    run_batch(model, cache, [(0, seq[8:], 8)])
    cache.remove(0, 3, 7)
    assert cache.seq_pos_max(0) == 9
    got = run_batch(model, cache, [(0, extra[:1], 10)])[0]
    assert_logits(got, want[10:11], f"{family} after context shift")
    got = run_batch(model, cache, [(0, extra[1:], 11)])[0]
    assert_logits(got, want[11:13], f"{family} decoding on after context shift")
    hf.detach(model)


class _PutRecorder:
    """Wraps a cache's set_layer/put (public methods) to keep every stored key by
    (layer, seq, position)."""

    def __init__(self, cache):
        self.cache, self.keys, self.layer, self.batch = cache, {}, 0, None
        self._set_layer, self._put = cache.set_layer, cache.put
        cache.set_layer, cache.put = self.set_layer, self.put

    def set_layer(self, layer):
        self.layer = layer
        self._set_layer(layer)

    def put(self, key, value):
        self._put(key, value)
        for row, (seq, pos) in enumerate(self.batch):
            self.keys[self.layer, seq, pos] = key[row].detach().to(torch.float32).clone()


@pytest.mark.parametrize("family", FAMILIES)
def test_context_shift_moved_keys_match_fresh_rope(family):
    """Several layers: each moved key equals the model's own RoPE at the new position. Sequence 0
    runs at positions 4..17, sequence 1 (same tokens) at 0..13; RoPE attention depends on relative
    positions only, so after removing positions 7..10 of sequence 0, its keys at 11..17 (now
    7..13) must equal sequence 1's keys at 7..13, every layer."""
    model = tiny_model(family, n_layers=2)
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, VOCAB, (14,), generator=g).tolist()
    cache = hf.cache_for(model, capacity=32, max_seqs=2, max_batch=32, device="cpu")
    hf.attach(model, cache)
    rec = _PutRecorder(cache)
    rec.batch = [(0, 4 + i) for i in range(14)] + [(1, i) for i in range(14)]
    run_batch(model, cache, [(0, seq, 4), (1, seq, 0)])
    cache.remove(0, 7, 11)
    assert cache.seq_pos_max(0) == 13
    # a probe token of sequence 0 at 14: get() shows what sequence 0 holds (window permitting)
    rec.batch = [(0, 14)]
    cache.start_forward([14], [0])
    windows = [la.swa_window for la in hf.layer_attention(model)]
    checked = 0
    for layer in range(len(windows)):
        cache.set_layer(layer)
        key, _, mask = cache.get()
        key = torch.from_dlpack(key).to(torch.float32)
        visible = key[torch.from_dlpack(mask)[0] == 0]               # [n_visible, kv, d]
        lowest = 7 if windows[layer] is None else max(7, 14 - windows[layer])
        for new_pos in range(lowest, 14):
            want = rec.keys[layer, 1, new_pos]
            err = (visible - want[None]).abs().amax(dim=(1, 2)).min()
            scale = max(1.0, float(want.abs().max()))
            assert err <= 2e-5 * scale, (f"{family} layer {layer}: key moved to {new_pos} is "
                                         f"{float(err):.3g} from fresh RoPE")
            checked += 1
    assert checked >= 6
    hf.detach(model)


def test_wrong_shift_is_caught():
    """The one-layer shift test fails with a wrong rotation (NeoX pairs for GPT-J's interleaved
    ones): the tests above can fail."""
    model = tiny_model("gptj", n_layers=1)
    seq = list(range(3, 17))
    want = full_logits(model, seq[:3] + seq[7:] + [5])
    wrong = dataclasses.replace(hf.rope_shift_for(model.config), neox=True)
    cache = hf.cache_for(model, capacity=32, max_seqs=1, device="cpu", shift=wrong)
    hf.attach(model, cache)
    run_batch(model, cache, [(0, seq, 0)])
    cache.remove(0, 3, 7)
    got = run_batch(model, cache, [(0, [5], 10)])[0]
    assert float((got - want[10:11]).abs().max()) > 1e-2
    hf.detach(model)


# ------------------------------------------------------------------------------ rope_shift_for
def _model_inv_freq(model, layer_type=None):
    rotary = model.model.rotary_emb
    name = "inv_freq" if layer_type is None else f"{layer_type}_inv_freq"
    return getattr(rotary, name).double().numpy()


@pytest.mark.parametrize("family", ["llama", "llama-linear", "llama-llama3", "llama-yarn",
                                    "qwen3", "phi3"])
def test_rope_shift_frequencies_are_the_models(family):
    model = tiny_model(family, n_layers=1)
    shift = hf.rope_shift_for(model.config)
    head_dim = hf.model_shapes(model).head_dim
    np.testing.assert_allclose(shift.inv_freq(head_dim), _model_inv_freq(model), rtol=1e-6)
    assert shift.neox


def test_rope_shift_fields():
    shift = hf.rope_shift_for(_family_config("llama-linear", 1))
    assert (shift.base, shift.dim, shift.freq_scale, shift.freq_factors) == (10000.0, 16, 0.5,
                                                                              None)
    assert hf.rope_shift_for(_family_config("phi3", 1)).dim == 8
    assert hf.rope_shift_for(_family_config("gpt_neox", 1)).dim == 4
    gptj = hf.rope_shift_for(_family_config("gptj", 1))
    assert (gptj.neox, gptj.dim, gptj.base) == (False, 8, 10000.0)
    llama3 = hf.rope_shift_for(_family_config("llama-llama3", 1))
    factors = np.asarray(llama3.freq_factors)
    assert factors[0] == pytest.approx(1.0) and factors[-1] == pytest.approx(8.0)  # both bands
    assert ((factors > 1.0 + 1e-6) & (factors < 8.0 - 1e-6)).any()                  # smoothed


def test_rope_shift_per_layer_type_gemma3():
    model = tiny_model("gemma3", n_layers=2)
    config = model.config
    with pytest.raises(ValueError, match="layer_type"):
        hf.rope_shift_for(config)
    local = hf.rope_shift_for(config, "sliding_attention")
    glob = hf.rope_shift_for(config, "full_attention")
    assert (local.base, local.freq_scale) == (10000.0, 1.0)
    assert (glob.base, glob.freq_scale) == (1000000.0, 0.125)
    for layer_type, shift in (("sliding_attention", local), ("full_attention", glob)):
        np.testing.assert_allclose(shift.inv_freq(16), _model_inv_freq(model, layer_type),
                                   rtol=1e-6)
    with pytest.raises(ValueError, match="layer_type"):
        hf.rope_shift_for(config, "chunked_attention")


def test_rope_shift_longrope_static_and_switching():
    short = [1.0, 1.5, 2.0, 3.0]
    long_ = [2.0, 3.0, 4.0, 6.0]
    rope = {"rope_type": "longrope", "short_factor": short, "long_factor": long_,
            "original_max_position_embeddings": 128, "rope_theta": 10000.0}
    static = transformers.Phi3Config(**dict(SMALL, num_hidden_layers=1,
                                            max_position_embeddings=128),
                                     original_max_position_embeddings=128,
                                     partial_rotary_factor=0.5, rope_parameters=dict(rope))
    shift = hf.rope_shift_for(static)
    np.testing.assert_allclose(shift.freq_factors, short, rtol=1e-6)
    switching = transformers.Phi3Config(**dict(SMALL, num_hidden_layers=1,
                                               max_position_embeddings=1024),
                                        original_max_position_embeddings=128,
                                        partial_rotary_factor=0.5, rope_parameters=dict(rope))
    with pytest.raises(nkv.NotSupportedError, match="longrope"):
        hf.rope_shift_for(switching)


def test_rope_shift_refuses_what_it_cannot_express():
    T = transformers
    dynamic = T.LlamaConfig(**dict(SMALL, num_hidden_layers=1),
                            rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                             "rope_theta": 10000.0})
    with pytest.raises(nkv.NotSupportedError, match="dynamic"):
        hf.rope_shift_for(dynamic)
    with pytest.raises(nkv.NotSupportedError, match="M-RoPE"):
        hf.rope_shift_for(T.Qwen2VLConfig())
    mla = hf.rope_shift_for(T.DeepseekV3Config(num_hidden_layers=1))   # the latent's rope dims
    assert (mla.dim, mla.offset, mla.neox) == (64, 512, True)
    with pytest.raises(nkv.NotSupportedError, match="no_rope_layers"):
        hf.rope_shift_for(T.Llama4TextConfig(num_hidden_layers=4))
    # cache_for then builds a cache without a shift: context shift is refused, not wrong
    cache = hf.cache_for(dynamic, capacity=16, device="cpu")
    assert cache.shift is None


# ------------------------------------------------------------------------------ cache_for
def test_cache_for_shapes_windows_and_groups():
    cache = hf.cache_for(tiny_model("mistral"), capacity=32, max_seqs=2, device="cpu")
    assert isinstance(cache, nkv.CausalCache)
    assert cache.swa_window == 3             # HF window 4 counts the query token
    cfg = cache.config
    assert (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.dtype) == (2, 2, 16, "float32")

    gemma = hf.cache_for(tiny_model("gemma3", 2), capacity=32, max_seqs=2, device="cpu")
    assert isinstance(gemma, nkv.WrapperCache)
    assert gemma.layer_groups == [0, 1]
    local, glob = gemma.caches
    assert (local.swa_window, glob.swa_window) == (3, None)
    assert (local.shift.base, glob.shift.base, glob.shift.freq_scale) == (1e4, 1e6, 0.125)

    config = transformers.Gemma2Config(**dict(SMALL, num_hidden_layers=5, num_key_value_heads=2),
                                       head_dim=16, sliding_window=8)
    cache = hf.cache_for(config, capacity=64, device="cpu", dtype="float16")
    assert cache.layer_groups == [0, 1, 0, 1, 0]
    assert [c.config.n_layers for c in cache.caches] == [3, 2]
    assert cache.caches[0].config.dtype == "float16"


def test_cache_for_forwards_cache_config_options():
    cache = hf.cache_for(_family_config("llama", 2), capacity=30, device="cpu", cache_padding=8,
                         permuted_v=True, mask_batch_padding=4)
    assert (cache.config.cache_padding, cache.config.permuted_v) == (8, True)
    assert cache.n_cells % 8 == 0
    with pytest.raises(ValueError, match="no_such_option"):
        hf.cache_for(_family_config("llama", 2), capacity=8, no_such_option=1)
    with pytest.raises(ValueError, match="head_dim"):
        hf.cache_for(_family_config("llama", 2), capacity=8, head_dim=8)
    # quantized K/V: ggml blocks run along head_dim (a multiple of 32)
    wide = _family_config("llama", 2)
    wide.head_dim = 32
    cache = hf.cache_for(wide, capacity=64, device="cpu", dtype="float16", k_dtype="q8_0",
                         v_dtype="q4_0")
    assert (cache.config.k_dtype, cache.config.v_dtype) == ("q8_0", "q4_0")
    with pytest.raises(ValueError, match="multiple of 32"):
        hf.cache_for(_family_config("llama", 2), capacity=64, k_dtype="q8_0")


def test_permuted_v_and_half_storage_serve_the_same_logits():
    model = tiny_model("qwen2")
    seq = list(range(1, 12))
    want = full_logits(model, seq)
    for options, tol in (({"permuted_v": True, "cache_padding": 4}, 2e-5),
                         ({"dtype": "float16"}, 2e-2)):
        cache = hf.cache_for(model, capacity=16, device="cpu", **options)
        hf.attach(model, cache)
        got = torch.cat([run_batch(model, cache, [(0, seq[:7], 0)])[0],
                         run_batch(model, cache, [(0, seq[7:], 7)])[0]])
        hf.detach(model)
        err = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
        assert err <= tol, (options, err)


# ------------------------------------------------------------------------------ bad input
def test_attach_refuses_caches_that_do_not_fit():
    model = tiny_model("llama")
    small_heads = hf.cache_for(transformers.LlamaConfig(**dict(SMALL, num_hidden_layers=2,
                                                               num_key_value_heads=2,
                                                               hidden_size=32)),
                               capacity=8, device="cpu")
    with pytest.raises(ValueError, match="head size is 16 but the cache has head_dim=8"):
        hf.attach(model, small_heads)
    kv4 = hf.cache_for(transformers.LlamaConfig(**dict(SMALL, num_hidden_layers=2)),
                       capacity=8, device="cpu")
    with pytest.raises(ValueError, match="2 KV heads but the cache has n_kv_heads=4"):
        hf.attach(model, kv4)
    three = hf.cache_for(tiny_model("llama", 3), capacity=8, device="cpu")
    with pytest.raises(ValueError, match="3 layers but the model has 2"):
        hf.attach(model, three)
    no_window = hf.cache_for(tiny_model("llama"), capacity=8, device="cpu")
    with pytest.raises(ValueError, match="sliding window of 4 tokens"):
        hf.attach(tiny_model("mistral"), no_window)
    with pytest.raises(ValueError, match="CausalCache or WrapperCache"):
        hf.attach(model, object())
    assert hf.attached_cache(model) is None     # nothing half-attached
    assert model.config._attn_implementation == "eager"


def test_attach_twice_and_detach_errors():
    model = tiny_model("llama")
    cache = hf.cache_for(model, capacity=8, device="cpu")
    hf.attach(model, cache)
    with pytest.raises(ValueError, match="already attached"):
        hf.attach(model, hf.cache_for(model, capacity=8, device="cpu"))
    with pytest.raises(ValueError, match="cache is already attached"):
        hf.attach(tiny_model("llama"), cache)
    hf.detach(model)
    with pytest.raises(ValueError, match="not attached"):
        hf.detach(model)


def test_running_without_start_forward_or_twice():
    model = tiny_model("llama")
    cache = hf.cache_for(model, capacity=16, device="cpu")
    hf.attach(model, cache)
    ids, pos = torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]])
    with torch.no_grad():
        with pytest.raises(nkv.KVCacheError, match="start_forward"):
            model(input_ids=ids, position_ids=pos)
        with pytest.raises(nkv.KVCacheError, match="start_forward"):
            model.model(input_ids=ids, position_ids=pos)     # the base model has no pre-hook
        cache.start_forward([0, 1, 2], [0, 0, 0])
        model(input_ids=ids, position_ids=pos)
        with pytest.raises(nkv.KVCacheError, match="already ran in this forward pass"):
            model(input_ids=ids, position_ids=pos)
        cache.start_forward([3], [0])
        with pytest.raises(ValueError, match="differ from the positions given"):
            model(input_ids=torch.tensor([[4]]), position_ids=torch.tensor([[5]]))
        with pytest.raises(ValueError, match="position_ids is missing"):
            model(input_ids=torch.tensor([[4]]))
        cache.seq_rm(0, 3)      # position 3 was placed but never run: a re-put is refused
        cache.start_forward([3, 4], [0, 0])
        with pytest.raises(ValueError, match="got 1 tokens but cache.start_forward was given 2"):
            model.model(input_ids=torch.tensor([[4]]), position_ids=torch.tensor([[3]]))
        with pytest.raises(ValueError, match="packed batch"):
            model.model(input_ids=torch.tensor([[4], [5]]), position_ids=torch.tensor([[3], [4]]))
    hf.detach(model)


def test_detach_restores_the_model():
    model = tiny_model("gemma2")
    seq = list(range(2, 12))
    want = full_logits(model, seq)
    cache = hf.cache_for(model, capacity=16, device="cpu")
    start_forward = cache.start_forward
    hf.attach(model, cache)
    assert model.config._attn_implementation == hf.ATTENTION_NAME
    assert model.config.use_cache is False
    run_batch(model, cache, [(0, seq, 0)])
    hf.detach(model)
    assert model.config._attn_implementation == "eager"
    assert model.config.use_cache is True
    assert cache.start_forward == start_forward
    assert_logits(full_logits(model, seq), want, "after detach")
    hf.attach(model, cache)   # and it can be attached again
    hf.detach(model)


@pytest.mark.slow
def test_hf_serve_example(capsys):
    """examples/hf_serve.py: continuous batching with a shared system prompt, a context shift and
    a saved/restored conversation, checked against the model's own forward."""
    import importlib.util
    import pathlib
    import sys
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "hf_serve.py"
    spec = importlib.util.spec_from_file_location("numbakv_example_hf_serve", path)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example       # its dataclasses look their module up
    spec.loader.exec_module(example)
    assert example.main(["--device", "cpu", "--requests", "3", "--context", "28"]) == 0
    out = capsys.readouterr().out
    assert "context shift" in out and "restored as sequence" in out
    assert out.strip().endswith("OK")


def test_bfloat16_model():
    """A bfloat16 model gets a bfloat16 cache (stored as bit patterns, exported as
    torch.bfloat16) and the logits of its own bfloat16 forward, to bfloat16 precision."""
    model = tiny_model("llama").to(torch.bfloat16)
    seq = list(range(1, 12))
    want = full_logits(model, seq).float()
    cache = hf.cache_for(model, capacity=16, device="cpu")
    assert cache.config.dtype == "bfloat16"
    hf.attach(model, cache)
    got = torch.cat([run_batch(model, cache, [(0, seq[:7], 0)])[0],
                     run_batch(model, cache, [(0, seq[7:], 7)])[0]]).float()
    hf.detach(model)
    assert float((got - want).abs().max()) <= 4e-2 * float(want.abs().max())
