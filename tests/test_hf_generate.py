"""hf.generation_cache: model.generate() over a numbakv cache equals generate() over transformers'
own DynamicCache token for token (tiny random-weight Llama, Mistral with a sliding window, Qwen3,
Gemma 3 with sliding + global layers; batch 1 and a left-padded batch; greedy and sampling with one
seed); quantized K/V against numbakv's own packed path; hf.Server against per-prompt greedy
generate()."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from numbakv import hf  # noqa: E402
from numbakv.errors import KVCacheError  # noqa: E402
from helpers import random_weight_model  # noqa: E402
from test_hf import tiny_model  # noqa: E402

pytestmark = pytest.mark.torch

NEW = 10

#: the keyword generate() takes a cache under: transformers 5.24 renamed ``past_key_values`` to
#: ``cache`` (the old name deprecated); 5.23 and older know only ``past_key_values`` and reject
#: ``cache`` as an unused model kwarg
CACHE_KWARG = "cache" if "cache" in inspect.signature(
    transformers.GenerationMixin.prepare_inputs_for_generation).parameters else "past_key_values"


def _batch(padded: bool):
    g = torch.Generator().manual_seed(1)
    if not padded:
        ids = torch.randint(3, 64, (1, 9), generator=g)
        return ids, torch.ones_like(ids)
    ids = torch.randint(3, 64, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in ((1, 5), (2, 2)):           # left padding, as tokenizers pad for generate
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


def _generate(model, ids, mask, cache, sample: bool, kwarg: str = "past_key_values"):
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # 5.24: past_key_values -> cache
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=sample,
                              top_k=20, pad_token_id=0, **{kwarg: cache})


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen3", "gemma3"])
@pytest.mark.parametrize("padded", [False, True], ids=["batch1", "padded"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
def test_generate_equals_dynamic_cache(name, padded, sample):
    model = tiny_model(name)
    ids, mask = _batch(padded)
    ref = _generate(model, ids, mask, transformers.DynamicCache(config=model.config), sample)
    cache = hf.generation_cache(model, max_new_tokens=NEW)
    # both keywords where transformers has both: the new one for the padded batch
    out = _generate(model, ids, mask, cache, sample, kwarg=CACHE_KWARG if padded else
                    "past_key_values")
    assert out.shape[1] > ids.shape[1]
    assert torch.equal(out, ref)
    held = cache.numbakv_cache
    assert held is not None and cache.get_seq_length() == out.shape[1] - 1


def test_generation_cache_windows_are_numbakv_windows():
    model = tiny_model("gemma3")
    cache = hf.generation_cache(model, max_new_tokens=NEW)
    ids, mask = _batch(False)
    _generate(model, ids, mask, cache, False)
    wrap = cache.numbakv_cache
    assert [c.swa_window for c in wrap.caches] == [3, None]     # Gemma 3 W=4 counts the query
    assert cache.is_sliding == [True, False]


def _greedy_packed(model, cache, prompt, n):
    """numbakv's own path: attach, prefill the prompt in one packed pass, decode greedily."""
    hf.attach(model, cache)
    try:
        toks = list(prompt)
        with torch.no_grad():
            cache.start_forward(list(range(len(toks))), [0] * len(toks))
            logits = model(input_ids=torch.tensor([toks]),
                           position_ids=torch.arange(len(toks))[None]).logits[0]
            for _ in range(n):
                toks.append(int(logits[-1].argmax()))
                p = len(toks) - 1
                cache.start_forward([p], [0])
                logits = model(input_ids=torch.tensor([[toks[-1]]]),
                               position_ids=torch.tensor([[p]])).logits[0]
    finally:
        hf.detach(model)
    return toks[len(prompt):]


def test_quantized_generate_equals_numbakv_packed_path():
    # q8_0 K/V: both paths attend over the same dequantized values (generate through the
    # model's own attention, the packed path through attend); greedy tokens must agree
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      num_hidden_layers=2, max_position_embeddings=128)
    model = random_weight_model(config)              # head_dim 32: one q8_0 block per row
    ids, mask = _batch(False)
    cache = hf.generation_cache(model, max_new_tokens=NEW, k_dtype="q8_0", v_dtype="q8_0")
    out = _generate(model, ids, mask, cache, False)
    assert cache.numbakv_cache.config.k_dtype == "q8_0"
    packed = _greedy_packed(model, hf.cache_for(model, capacity=64, k_dtype="q8_0",
                                                v_dtype="q8_0"), ids[0].tolist(), NEW)
    assert out[0, ids.shape[1]:].tolist() == packed


def test_quantized_generate_of_a_left_padded_batch():
    # q8_0 attends every pass through attend(), the prompt's padded pass too (it raised "a
    # padded pass after the prompt"): each row's greedy tokens equal its own packed run
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      num_hidden_layers=2, max_position_embeddings=128)
    model = random_weight_model(config)
    ids, mask = _batch(True)
    cache = hf.generation_cache(model, max_new_tokens=NEW, k_dtype="q8_0", v_dtype="q8_0")
    out = _generate(model, ids, mask, cache, False, kwarg=CACHE_KWARG)
    for row in range(ids.shape[0]):
        prompt = ids[row][mask[row].bool()].tolist()
        packed = _greedy_packed(model, hf.cache_for(model, capacity=64, k_dtype="q8_0",
                                                    v_dtype="q8_0"), prompt, NEW)
        assert out[row, ids.shape[1]:].tolist() == packed, row


def test_plain_generate_after_attach_says_what_to_do():
    model = tiny_model("llama")
    hf.attach(model, hf.cache_for(model, capacity=64))
    try:
        with pytest.raises(KVCacheError, match="generation_cache"):
            model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, pad_token_id=0)
        with pytest.raises(ValueError, match="detach"):
            hf.generation_cache(model, max_new_tokens=4)
    finally:
        hf.detach(model)


def test_generation_cache_argument_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf.generation_cache(model)
    with pytest.raises(ValueError, match="capacity"):
        hf.generation_cache(model, capacity=0)
    with pytest.raises(ValueError, match="CacheConfig"):
        hf.generation_cache(model, max_new_tokens=4, bogus=1)


def test_attached_model_without_no_grad():
    # the packed path with inputs that require grad: detached inside numbakv
    model = tiny_model("llama")
    cache = hf.cache_for(model, capacity=32)
    hf.attach(model, cache)
    try:
        cache.start_forward([0, 1, 2], [0, 0, 0])
        logits = model(input_ids=torch.tensor([[5, 6, 7]]),
                       position_ids=torch.arange(3)[None]).logits
        assert torch.isfinite(logits).all()
    finally:
        hf.detach(model)


def test_server_equals_per_prompt_greedy_generate():
    model = tiny_model("qwen3")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (7, 19, 3, 11)]
    refs = []
    for p in prompts:
        out = _generate(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long),
                        transformers.DynamicCache(config=model.config), False)
        refs.append(out[0, len(p):].tolist())
    # room for two sequences and small chunks: requests wait, prefill in chunks mixed with
    # other requests' decodes, and reuse freed sequences
    srv = hf.Server(model, hf.cache_for(model, capacity=128, max_seqs=2, max_batch=8),
                    prefill_chunk=6)
    rids = [srv.submit(p, max_new_tokens=NEW) for p in prompts]
    mixed = False
    while srv.pending:
        before = {r: len(srv._reqs[r]["out"]) for r in srv._reqs if srv._reqs[r]["seq"]
                  is not None}
        new = srv.step()
        mixed |= len(new) >= 2 and any(before.get(r, 0) == 0 for r in new)
    assert [srv.finished[r] for r in rids] == refs
    assert mixed                     # some pass finished a prompt next to another's decode
    hf.detach(model)


def test_server_argument_errors():
    model = tiny_model("llama")
    srv = hf.Server(model, hf.cache_for(model, capacity=32))
    with pytest.raises(ValueError, match="prompt_ids"):
        srv.submit([])
    with pytest.raises(ValueError, match="max_new_tokens"):
        srv.submit([1, 2], max_new_tokens=0)
    assert srv.pending == 0
    hf.detach(model)


def test_server_sampling_is_reproducible_per_seed():
    model = tiny_model("llama")
    cache = hf.cache_for(model, capacity=64, max_seqs=2)
    srv = hf.Server(model, cache)
    a = srv.submit([5, 6, 7], max_new_tokens=6, do_sample=True, top_k=10, seed=11)
    b = srv.submit([5, 6, 7], max_new_tokens=6, do_sample=True, top_k=10, seed=11)
    c = srv.submit([5, 6, 7], max_new_tokens=6, eos_token_id=None)
    srv.run()
    assert srv.finished[a] == srv.finished[b] and len(srv.finished[a]) == 6
    assert len(srv.finished[c]) == 6 and srv.pending == 0
    assert cache.n_used == 0                  # finished requests freed their cells
    hf.detach(model)


def test_server_step_that_fails_changes_nothing():
    model = tiny_model("llama")
    cache = hf.cache_for(model, capacity=32, max_seqs=2)
    srv = hf.Server(model, cache)
    rid = srv.submit([5, 6, 7, 8], max_new_tokens=3)
    srv.step()                                  # the prompt ran; one token out
    used = cache.n_used
    state = {k: (list(v) if isinstance(v, list) else v) for k, v in srv._reqs[rid].items()
             if k != "gen"}
    real = model.forward
    model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("model failed"))
    try:
        with pytest.raises(RuntimeError, match="model failed"):
            srv.step()
    finally:
        model.forward = real
    assert cache.n_used == used
    assert {k: v for k, v in srv._reqs[rid].items() if k != "gen"} == state
    srv.run()                                   # and it goes on as if nothing happened
    assert len(srv.finished[rid]) == 3
    hf.detach(model)


# ---------------------------------------------------------------- prefix reuse (issue 38 item 3)
def _shared_prompts(n_prompts: int = 3, length: int = 90, shared: int = 89):
    g = torch.Generator().manual_seed(8)
    base = torch.randint(3, 64, (shared,), generator=g).tolist()
    return [base + [3 + i] + torch.randint(3, 64, (length - shared - 1,), generator=g).tolist()
            for i in range(n_prompts)]


def test_server_with_a_store_reuses_shared_prefixes_and_saves_on_finish():
    from numbakv import PrefixStore
    model = tiny_model("llama")
    prompts = _shared_prompts()                # 3 prompts sharing 89 of 90 tokens
    # without a store: every prompt computes all 90 tokens, cells 3 x (90 + NEW - 1)
    plain_cache = hf.cache_for(model, capacity=128, max_seqs=4)
    plain = hf.Server(model, plain_cache)
    first = plain.submit(prompts[0], max_new_tokens=NEW)
    plain.run()
    rids = [plain.submit(p, max_new_tokens=NEW) for p in prompts[1:]]
    plain.step()                               # both prompts prefilled side by side
    plain_cells = plain_cache.n_used
    plain.run()
    expected = [plain.finished[first]] + [plain.finished[r] for r in rids]
    assert plain.stats == {"prefill_tokens": 270, "reused_tokens": 0}
    hf.detach(model)

    # with a store: the first prompt's prefix (saved when it finished) is loaded by the next two
    cache = hf.cache_for(model, capacity=128, max_seqs=4)
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=16)
    srv = hf.Server(model, cache, store=store)
    first = srv.submit(prompts[0], max_new_tokens=NEW)
    srv.run()
    assert srv.stats == {"prefill_tokens": 90, "reused_tokens": 0}
    rids = [srv.submit(p, max_new_tokens=NEW) for p in prompts[1:]]
    srv.step()
    shared_cells = cache.n_used
    srv.run()
    got = [srv.finished[first]] + [srv.finished[r] for r in rids]
    assert got == expected                     # reuse changes no token
    # the second and third prompts computed 1 token each: 178 prefill tokens saved
    assert srv.stats == {"prefill_tokens": 92, "reused_tokens": 178}
    # their 89 shared tokens sit once in cells, shared with the store's retained copy of the
    # first request (90 + NEW - 1 cells); each adds only its own last prompt token
    assert plain_cells == 2 * 90
    assert shared_cells == (90 + NEW - 1) + 2
    assert store.stats()["tokens_reused"] == 178
    hf.detach(model)


def test_server_cancel_saves_and_frees():
    from numbakv import PrefixStore
    model = tiny_model("llama")
    cache = hf.cache_for(model, capacity=128, max_seqs=3)
    store = PrefixStore(cache, retain_seqs=[2])
    srv = hf.Server(model, cache, store=store)
    prompt = _shared_prompts(1)[0]
    rid = srv.submit(prompt, max_new_tokens=NEW)
    srv.step()
    srv.step()
    out = srv.cancel(rid)
    assert len(out) == 2 and srv.pending == 0 and rid not in srv.finished
    assert store.match(prompt + out) == len(prompt) + 1     # prompt + the computed new token
    with pytest.raises(ValueError, match="rid"):
        srv.cancel(rid)
    again = srv.submit(prompt, max_new_tokens=2)
    srv.run()
    assert srv.stats["reused_tokens"] == len(prompt) - 1
    assert srv.finished[again] == out[:2]
    hf.detach(model)


def test_server_refuses_a_store_of_another_cache_or_model():
    from numbakv import PrefixStore
    model = tiny_model("llama")
    cache = hf.cache_for(model, capacity=64, max_seqs=2)
    other = PrefixStore(hf.cache_for(model, capacity=64, max_seqs=2), retain_seqs=[1])
    with pytest.raises(ValueError, match="this cache"):
        hf.Server(model, cache, store=other)
    with pytest.raises(ValueError, match="PrefixStore"):
        hf.Server(model, cache, store=object())

    wrong = PrefixStore(cache, retain_seqs=[1], model_id="someone/else@main#00")
    with pytest.raises(ValueError, match="model_id"):
        hf.Server(model, cache, store=wrong)
    wrong.close()
    srv = hf.Server(model, cache, store=PrefixStore(cache, retain_seqs=[1],
                                                    model_id=hf.model_id(model)))
    assert srv.store.model_id == hf.model_id(model)
    assert hf.attached_cache(model) is None or hf.detach(model) is None


def test_model_id_names_revision_and_weights():
    a = tiny_model("llama")
    b = tiny_model("llama")
    assert hf.model_id(a) == hf.model_id(b)            # same seed: same weights
    with torch.no_grad():
        c = tiny_model("llama")
        next(c.parameters()).view(-1)[0] += 1e-3        # one weight differs
    ident = hf.model_id(c)
    assert ident != hf.model_id(a) and ident.startswith("LlamaForCausalLM@local#")
    a.config._name_or_path, a.config._commit_hash = "org/tiny", "abc123"
    assert hf.model_id(a) == hf.model_id(b)            # memoised per model object
    d = tiny_model("llama")
    d.config._name_or_path, d.config._commit_hash = "org/tiny", "abc123"
    assert hf.model_id(d).startswith("org/tiny@abc123#")
    with pytest.raises(ValueError, match="model"):
        hf.model_id(object())


# ---------------------------------------------------------------- generate() on the cache itself
def test_generation_cache_is_sized_from_the_real_batch_and_stores_no_pads():
    model = tiny_model("llama")
    ids, mask = _batch(True)                   # 3 rows of 12 columns, 5 and 2 pads
    cache = hf.generation_cache(model, max_new_tokens=NEW)
    out = _generate(model, ids, mask, cache, False)
    held = cache.numbakv_cache
    assert held.config.max_seqs == 3 and held.config.capacity == 12 + NEW
    real = int(mask.sum())
    assert held.n_used == real + 3 * (NEW - 1)          # pad columns never stored
    assert [held.seq_pos_min(s) for s in range(3)] == [0, 5, 2]
    assert out.shape == (3, 12 + NEW)


def test_generation_cache_full_says_which_size_to_raise():
    model = tiny_model("llama")
    ids, mask = _batch(False)
    cache = hf.generation_cache(model, max_new_tokens=3)
    with pytest.raises(KVCacheError, match="max_new_tokens"):
        _generate(model, ids, mask, cache, False)       # generates NEW > 3 tokens


def test_model_keeps_its_own_attention_for_other_caches():
    model = tiny_model("qwen3")
    ids, mask = _batch(True)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    ref = _generate(model, ids, mask, transformers.DynamicCache(config=model.config), False)
    out = _generate(model, ids, mask, hf.generation_cache(model, max_new_tokens=NEW), False)
    assert torch.equal(out, ref)
    # after: the model (now routed through numbakv's dispatcher) runs its eager attention for
    # any call that is not a generation cache's
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, after)
    again = _generate(model, ids, mask, transformers.DynamicCache(config=model.config), False)
    assert torch.equal(again, ref)


def test_generation_cache_with_a_store_reuses_shared_prefixes():
    from numbakv import PrefixStore
    model = tiny_model("llama")
    prompts = [torch.tensor([p]) for p in _shared_prompts()]   # share 89 of 90 tokens
    ones = torch.ones(1, 90, dtype=torch.long)
    refs = [_generate(model, p, ones, transformers.DynamicCache(config=model.config), False)
            for p in prompts]
    cache = hf.cache_for(model, capacity=128, max_seqs=2)
    store = PrefixStore(cache, retain_seqs=[1], model_id=hf.model_id(model))
    reused, loaded_cells = [], []
    for p, ref in zip(prompts, refs):
        past = hf.generation_cache(model, store=store, input_ids=p, max_new_tokens=NEW)
        loaded_cells.append(cache.n_used)
        out = _generate(model, p, ones, past, False)
        assert torch.equal(out, ref)                       # reuse changes no token
        reused.append(past.reused_tokens)
        # saved when generate() reached max_new_tokens: the store's retained sequence holds
        # this conversation (90 + NEW - 1 tokens), sharing its cells with the row
        assert cache.n_used == 90 + NEW - 1
    assert reused == [0, 89, 89]                # the 2nd and 3rd compute 1 prompt token each
    # a loaded prefix takes no new cells: the row shares the retained sequence's
    assert loaded_cells == [0, 90 + NEW - 1, 90 + NEW - 1]
    assert store.stats()["tokens_reused"] == 178
    with pytest.raises(ValueError, match="store"):
        hf.generation_cache(model, input_ids=prompts[0], max_new_tokens=NEW)
    with pytest.raises(ValueError, match="cache_for"):
        hf.generation_cache(model, store=store, max_new_tokens=NEW, capacity=64)


def test_generation_cache_layers_refuse_what_they_cannot_keep():
    # reset/beam reorder/crop/row selection would leave numbakv's rows stale: every layer kind
    # (the attention layers here; the recurrent ones share hf._refused.RefusedLayerOps) refuses
    from numbakv.hf._refused import RefusedLayerOps
    from numbakv.hf.recurrent import generation_layer_class
    assert issubclass(generation_layer_class(), RefusedLayerOps)
    cache = hf.generation_cache(tiny_model("llama"), max_new_tokens=NEW)
    layer = cache.layers[0]
    for call in (layer.reset, lambda: layer.reorder_cache(torch.tensor([0])),
                 lambda: layer.crop(1), lambda: layer.batch_repeat_interleave(2),
                 lambda: layer.batch_select_indices(torch.tensor([0]))):
        with pytest.raises(KVCacheError, match="numbakv"):
            call()
    layer.batch_repeat_interleave(1)          # a no-op repeat is fine


def test_decode_route_grows_its_lists_in_place_only_over_plain_decode_steps():
    """generate()'s decode attention keeps the kernel's page lists and work items across passes
    (hf.generation._DecodeRoute) and grows them by each pass's cells: over plain decode steps
    (the same sequences, one position further, nothing else changed) its output is attend()'s
    exactly, also past the lists' first room; any other pass (a sequence op between passes, a
    skipped position, another batch) is refused, the route dropped, and a new one made from the
    pass's validated route."""
    import numbakv as nkv
    from numbakv import attention
    from numbakv.attention import attend
    from numbakv.hf.generation import _DecodeRoute
    cfg = nkv.CacheConfig(1, 2, 8, capacity=160, max_seqs=2, max_batch=16, device="cpu",
                          dtype="float32")
    cache = nkv.CausalCache(cfg)
    g = np.random.default_rng(0)

    def step(positions, seqs, route=None):
        n = len(positions)
        cache.start_forward(np.array(positions, np.int32), np.array(seqs, np.int32))
        cache.put(g.standard_normal((n, 2, 8), np.float32),
                  g.standard_normal((n, 2, 8), np.float32))
        grown = route is not None and route.extend(cache)
        if not grown:
            route = _DecodeRoute.seed(cache, 4, attention._cpu_pass_route(cache, 4))
        q = torch.from_numpy(g.standard_normal((n, 4, 8), np.float32))
        want = attend(q, cache, scale=0.3)
        pools = attention._routed_layer_pools(cache, 0, route.legacy)
        got = route.run(q.numpy(), pools, 0.3, None)
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=0)
        return route, grown

    cache.start_forward(np.array([0, 1, 2, 0, 1], np.int32), np.array([0, 0, 0, 1, 1], np.int32))
    cache.put(g.standard_normal((5, 2, 8), np.float32), g.standard_normal((5, 2, 8), np.float32))
    route, grown = step([3, 2], [0, 1])
    assert route is not None and not grown and route.room == 4 + 64   # 4 cells + 64
    for i in range(70):                                  # past the first room
        route, grown = step([4 + i, 3 + i], [0, 1], route)
        assert grown
    assert route.room == 2 * (4 + 64)
    cache.seq_rm(1, 10, 20)          # a sequence op between passes (positions still line up)
    route, grown = step([74, 73], [0, 1], route)
    assert not grown
    route, grown = step([76, 74], [0, 1], route)         # a skipped position
    assert not grown
    route, grown = step([77], [0], route)                # another batch
    assert not grown
    route, grown = step([78], [0], route)
    assert grown


def test_trusted_decode_entries_hold_the_cache_like_the_public_calls():
    """The generation cache's decode entries, whose batch the caller checked: the pass start
    (CausalCache._start_forward_checked) still refuses a (sequence, position) already held,
    changing nothing, and the put (CausalCache._put_layer_trusted) writes the pass's cells of
    that layer as put() does; both refuse, changing nothing, while another thread is inside
    the cache (ConcurrentUseError, as every public call)."""
    import threading
    import numbakv as nkv
    from numbakv.errors import ConcurrentUseError
    cfg = nkv.CacheConfig(2, 2, 8, capacity=8, max_seqs=1, device="cpu", dtype="float32")
    cache = nkv.CausalCache(cfg)
    cache.start_forward(np.array([0, 1], np.int32), np.array([0, 0], np.int32))
    k, v = np.ones((2, 2, 8), np.float32), np.full((2, 2, 8), 2, np.float32)
    cache._put_layer_trusted(1, k, v)
    key, value = cache.layer_pool(1)
    lo = cache._forward.start
    assert (key[lo:lo + 2] == 1).all() and (value[lo:lo + 2] == 2).all()
    version, fwd = cache.cells.version, cache._forward
    with pytest.raises(ValueError, match="already stored"):
        cache._start_forward_checked(np.array([1], np.int32), np.array([0], np.int32))
    assert cache._forward is fwd and cache.n_used == 2
    cache._start_forward_checked(np.array([2], np.int32), np.array([0], np.int32))
    assert cache.n_used == 3 and cache.cells.version > version
    held, release = threading.Event(), threading.Event()

    def hold():
        with cache._thread_guard:
            held.set()
            release.wait(10)
    other = threading.Thread(target=hold)
    other.start()
    held.wait(10)
    try:
        with pytest.raises(ConcurrentUseError):
            cache._put_layer_trusted(0, k[:1], v[:1])
        with pytest.raises(ConcurrentUseError):
            cache._start_forward_checked(np.array([3], np.int32), np.array([0], np.int32))
    finally:
        release.set()
        other.join(10)
    assert not cache.layer_pool(0)[0].any() and cache.n_used == 3


def test_paged_generate_grows_its_decode_route_over_placed_slots():
    """Under paged placement (CacheConfig(page_size=16)) a decode step's cells are the slots
    the cell table placed (not one run): the decode route appends those, the trusted put
    writes them, and generate() still equals DynamicCache token for token."""
    model = tiny_model("llama")
    ids, mask = _batch(True)
    ref = _generate(model, ids, mask, None, False)
    past = hf.generation_cache(model, max_new_tokens=NEW, capacity=32, page_size=16,
                               cache_padding=16)
    assert torch.equal(_generate(model, ids, mask, past, False), ref)
    state = past._numbakv_state
    assert state.cache._forward.slots is not None and len(state.decode_routes) == 1
