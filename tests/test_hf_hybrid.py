"""numbakv.hf for hybrid models (recurrent layers beside attention layers): the family table
(``hf.hybrid_layout``) against the states transformers' own DynamicCache keeps, for tiny
random-weight models of every hybrid family transformers 5.24 has (tests/hybrid_models.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hybrid_models as hm  # noqa: E402
from numbakv.errors import NotSupportedError  # noqa: E402
from numbakv.hf import families  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("family", hm.FAMILIES)
def test_layout_matches_the_states_transformers_keeps(family):
    model = hm.tiny_model(family)
    layout = families.hybrid_layout(model)
    assert layout is not None and layout.family == model.config.model_type
    ids, _ = hm.padded_batch(rows=(5,))
    ref = hm.dynamic_states(model, ids)
    recurrent = [i for i, layer in enumerate(ref.layers) if hasattr(layer, "conv_states")]
    assert layout.recurrent_layers == recurrent
    attention = [i for i, layer in enumerate(ref.layers) if hasattr(layer, "keys")]
    assert layout.attention_layers == attention
    for i in recurrent:
        layer = ref.layers[i]
        kept = {"conv": layer.conv_states[0], "ssm": layer.recurrent_states[0]}
        kept = {name: t for name, t in kept.items() if t is not None}
        assert [s.name for s in layout.states] == list(kept)
        for spec in layout.states:
            assert tuple(kept[spec.name].shape[1:]) == spec.shape, (family, spec)
            want = torch.float32 if spec.dtype == "float32" else model.dtype
            assert kept[spec.name].dtype == want
    mixer_of = {i: getattr(model.model.layers[i], layout.mixer) for i in recurrent}
    assert all(m.layer_idx == i for i, m in mixer_of.items())


def test_layout_of_attention_only_models_is_none_and_unknown_families_are_refused():
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2)
    assert families.hybrid_layout(cfg) is None
    odd = hm.tiny_config("bamba")
    odd.model_type = "not_a_family"
    with pytest.raises(NotSupportedError, match="not_a_family"):
        families.hybrid_layout(odd)


# ---------------------------------------------------------------------- the mixer shim
def _mixer_reference(model, mixer, hidden, splits):
    """The mixer's outputs for ``hidden [1, L, H]`` run through a DynamicCache in the chunks
    ``splits`` cuts it into, and the states it keeps."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    bounds = [0, *splits, hidden.shape[1]]
    outs = [mixer(hidden[:, a:b], cache=cache, attention_mask=None)
            for a, b in zip(bounds[:-1], bounds[1:])]
    layer = cache.layers[mixer.layer_idx]
    return torch.cat(outs, dim=1), layer.conv_states[0], layer.recurrent_states[0]


@pytest.mark.parametrize("family", hm.FAMILIES)
def test_packed_mixer_equals_transformers_per_sequence(family):
    """Three sequences packed in one row (a prompt chunk each, one cut where a restore point is
    asked for), then one decode token each batched together: every output row and the states
    kept equal transformers' own cache run sequence by sequence."""
    from numbakv.hf.recurrent import plan_groups, run_packed
    model = hm.tiny_model(family)
    layout = families.hybrid_layout(model)
    layer = layout.recurrent_layers[0]
    mixer = getattr(model.model.layers[layer], layout.mixer)
    gen = torch.Generator().manual_seed(5)
    lengths = {0: 9, 1: 4, 2: 13}
    hidden = {s: torch.randn(1, n + 1, model.config.hidden_size, generator=gen)
              for s, n in lengths.items()}
    shapes = {spec.name: spec.shape for spec in layout.states}
    states = {s: {name: torch.zeros(1, *shape) for name, shape in shapes.items()}
              for s in lengths}
    held = {s: 0 for s in lengths}
    kept = {}

    def rows(seqs):
        conv = torch.cat([states[s]["conv"] for s in seqs])
        ssm = torch.cat([states[s]["ssm"] for s in seqs]) if "ssm" in shapes else None

        def done():
            for i, s in enumerate(seqs):
                states[s]["conv"].copy_(conv[i:i + 1])
                if ssm is not None:
                    states[s]["ssm"].copy_(ssm[i:i + 1])
        return conv, ssm, done

    def keep(seq, pos, conv, ssm):
        kept[(seq, pos)] = (conv, ssm)

    with torch.no_grad():
        # pass 1: the prompts (interleaved in the row: 0, 2, 1, 0, 2, ...), sequence 2 cut at 6
        order = [(s, p) for p in range(max(lengths.values())) for s in (0, 2, 1)
                 if p < lengths[s]]
        seqs = np.array([s for s, _ in order])
        positions = np.array([p for _, p in order])
        packed = torch.cat([hidden[s][:, p:p + 1] for s, p in order], dim=1)
        decodes, chunks = plan_groups(positions, seqs, held.__getitem__)
        assert decodes == [] and [c[0] for c in chunks] == [0, 1, 2]
        cuts = {2: [6]}
        out = run_packed(mixer.forward, packed,
                         decodes, [(s, i, a, cuts.get(s, [])) for s, i, a in chunks], rows, keep)
        for s, n in lengths.items():
            held[s] = n
        # pass 2: one decode token each, batched
        seqs2 = np.array([1, 0, 2])
        positions2 = np.array([lengths[s] for s in seqs2])
        packed2 = torch.cat([hidden[s][:, lengths[s]:] for s in seqs2], dim=1)
        decodes, chunks = plan_groups(positions2, seqs2, held.__getitem__)
        assert chunks == [] and sorted(decodes) == [(0, 1), (1, 0), (2, 2)]
        out2 = run_packed(mixer.forward, packed2, decodes, [], rows, keep)
        for s, n in lengths.items():
            ref, conv, ssm = _mixer_reference(model, mixer, hidden[s], [6, n] if s == 2 else [n])
            rows_of = [i for i, (t, _) in enumerate(order) if t == s]
            got = torch.cat([out[0, rows_of], out2[0, list(seqs2).index(s)][None]])
            torch.testing.assert_close(got, ref[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(states[s]["conv"], conv, rtol=1e-5, atol=1e-5)
            if ssm is not None:
                torch.testing.assert_close(states[s]["ssm"], ssm, rtol=1e-5, atol=1e-5)
        # the restore point at 6 of sequence 2 is the state after its first 6 tokens
        _, conv6, ssm6 = _mixer_reference(model, mixer, hidden[2][:, :6], [])
        torch.testing.assert_close(kept[(2, 6)][0], conv6[0], rtol=1e-5, atol=1e-5)
        if ssm6 is not None:
            torch.testing.assert_close(kept[(2, 6)][1], ssm6[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="consecutive positions"):
        plan_groups(np.array([3, 5]), np.array([0, 0]), lambda s: 3)
    with pytest.raises(ValueError, match="from 4"):
        plan_groups(np.array([3]), np.array([0]), lambda s: 4)


# ---------------------------------------------------------------------- generate()
#: the families numbakv's HybridCache serves (Falcon-H1 keeps attention and a mixer in one layer)
SERVED = [f for f in hm.FAMILIES if f != "falcon_h1"]


def _numbakv_generate(model, ids, mask, *, do_sample=False, seed=0, new=6):
    from numbakv import hf
    past = hf.generation_cache(model, max_new_tokens=new)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **{hm.cache_kwarg(): past},
                             max_new_tokens=new, do_sample=do_sample, pad_token_id=0)
    return out, past


@pytest.mark.parametrize("family", SERVED)
def test_generate_equals_dynamic_cache(family):
    """Greedy and sampled (one seed), batch 1 and a left-padded batch of 3: token-equal to
    transformers' DynamicCache; the numbakv cache behind it is a HybridCache holding every
    row's prompt and new tokens."""
    from numbakv import HybridCache
    model = hm.tiny_model(family)
    for rows in ((8,), (11, 7, 9)):
        ids, mask = hm.padded_batch(seed=len(rows), rows=rows)
        for sample in (False, True):
            ref = hm.dynamic_generate(model, ids, mask, max_new_tokens=6, do_sample=sample,
                                      seed=3)
            out, past = _numbakv_generate(model, ids, mask, do_sample=sample, seed=3)
            assert torch.equal(out, ref), (family, rows, sample)
            hc = past.numbakv_cache
            assert isinstance(hc, HybridCache)
            width = ids.shape[1] + 6 - 1          # the last token is never fed back
            for b in range(len(rows)):
                assert hc.rc.seq_pos_max(b) == width - 1 and hc.attn.seq_pos_max(b) == width - 1


# ---------------------------------------------------------------------- attach / Server
def _reference_logits(model, tokens):
    """Logits of one sequence run alone through transformers' own cache, in one pass."""
    from transformers import DynamicCache
    with torch.no_grad():
        return model(torch.tensor([tokens]), **{hm.cache_kwarg(): DynamicCache(
            config=model.config)}, use_cache=True).logits[0]


@pytest.mark.parametrize("family", SERVED)
def test_attached_packed_batches_equal_each_sequence_alone(family):
    """Three sequences' prompts packed in one forward pass (one of them split where the cache
    asks for restore points), then two decode passes of all three: every row's logits equal
    the sequence run alone through DynamicCache; the restore points handed over are kept."""
    from numbakv import hf
    model, alone = hm.tiny_model(family), hm.tiny_model(family)   # same seeded weights
    cache = hf.cache_for(model, capacity=64, max_seqs=3, restore_every=4)
    hf.attach(model, cache)
    gen = torch.Generator().manual_seed(7)
    prompts = {0: 6, 1: 10, 2: 3}
    toks = {s: torch.randint(3, hm.VOCAB, (n + 2,), generator=gen).tolist()
            for s, n in prompts.items()}
    try:
        rows = [(s, p) for s in (1, 0, 2) for p in range(prompts[s])]
        passes = [rows, [(s, prompts[s]) for s in (2, 0, 1)],
                  [(s, prompts[s] + 1) for s in (0, 1, 2)]]
        for batch in passes:
            seqs = np.array([s for s, _ in batch])
            positions = np.array([p for _, p in batch])
            cache.start_forward(positions, seqs)
            ids = torch.tensor([[toks[s][p] for s, p in batch]])
            with torch.no_grad():
                logits = model(input_ids=ids,
                               position_ids=torch.as_tensor(positions)[None]).logits[0]
            for row, (s, p) in enumerate(batch):
                ref = _reference_logits(alone, toks[s][:p + 1])[p]
                # a scan cut at restore points rounds differently from one whole scan (chunked
                # delta rule: ~1e-4); a lost or wrong state moves logits by whole units
                torch.testing.assert_close(logits[row], ref, rtol=1e-3, atol=1e-3)
        # sequence 1 (10 prompt tokens, spacing 4): points at 4 and 8 handed over mid-prompt
        assert {4, 8} <= set(cache.restore_points(1))
        assert cache.rc.seq_pos_max(1) == prompts[1] + 1
    finally:
        hf.detach(model)


@pytest.mark.parametrize("family", ["qwen3_next", "bamba", "lfm2"])
def test_server_serves_concurrent_requests_like_generate(family):
    """Four requests (two sharing a prefix) served together by hf.Server over a HybridCache:
    each one's greedy tokens equal generate() with DynamicCache on its prompt alone."""
    from numbakv import hf
    model = hm.tiny_model(family)
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(3, hm.VOCAB, (9,), generator=gen).tolist()
    prompts = [shared + [5, 6], torch.randint(3, hm.VOCAB, (5,), generator=gen).tolist(),
               shared + [7], torch.randint(3, hm.VOCAB, (13,), generator=gen).tolist()]
    expected = [hm.dynamic_generate(model, torch.tensor([p]), max_new_tokens=5)[0, len(p):]
                .tolist() for p in prompts]
    cache = hf.cache_for(model, capacity=64, max_seqs=3, restore_every=4)
    srv = hf.Server(model, cache, prefill_chunk=4)
    try:
        rids = [srv.submit(p, max_new_tokens=5) for p in prompts]
        done = srv.run()
        assert [done[r] for r in rids] == expected
        assert all(cache.seq_pos_max(s) == -1 for s in range(3))
    finally:
        hf.detach(model)


@pytest.mark.parametrize("family", ["qwen3_next", "granitemoehybrid", "lfm2"])
def test_server_reuses_stored_prefixes_of_a_hybrid(family):
    """hf.Server with a PrefixStore over a HybridCache: a second wave of requests sharing
    prefixes with the first loads them (up to a restore point) and computes only the rest;
    every request's greedy tokens still equal generate() with DynamicCache on its prompt."""
    from numbakv import PrefixStore, hf
    model = hm.tiny_model(family)
    gen = torch.Generator().manual_seed(13)
    shared = torch.randint(3, hm.VOCAB, (21,), generator=gen).tolist()
    first = [shared + [5, 6], torch.randint(3, hm.VOCAB, (6,), generator=gen).tolist()]
    second = [shared + [9], shared[:14] + [4, 4, 4]]
    expected = {i: hm.dynamic_generate(model, torch.tensor([p]), max_new_tokens=4)[0, len(p):]
                .tolist() for i, p in enumerate(first + second)}
    cache = hf.cache_for(model, capacity=64, max_seqs=4, restore_every=4)
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4)
    srv = hf.Server(model, cache, prefill_chunk=8, store=store)
    try:
        rids = [srv.submit(p, max_new_tokens=4) for p in first]
        srv.run()
        computed = srv.stats["prefill_tokens"]
        rids += [srv.submit(p, max_new_tokens=4) for p in second]
        done = srv.run()
        assert [done[r] for r in rids] == [expected[i] for i in range(4)]
        # shared[:20] (restore point 20) and shared[:12] (point 12) came from the store
        assert srv.stats["reused_tokens"] == 20 + 12
        assert srv.stats["prefill_tokens"] - computed == (22 - 20) + (17 - 12)
    finally:
        hf.detach(model)
        store.close()


@pytest.mark.parametrize("family", ["qwen3_next", "bamba_recurrent_last"])
def test_generation_cache_with_a_store_reuses_a_hybrid_prefix(family):
    """generation_cache(store=, input_ids=) on a hybrid: the first generate() saves its rows
    (K/V and the state at their ends), a second one on a prompt extending the first loads the
    stored prefix (state included) and computes only the rest, token-equal to DynamicCache.
    ``bamba_recurrent_last``: Bamba whose last layers are recurrent (a pass ends after them)."""
    from numbakv import PrefixStore, hf
    if family == "bamba_recurrent_last":
        cfg = hm.tiny_config("bamba")
        cfg.attn_layer_indices = [1]
        model = hm.random_weight_model(cfg)
    else:
        model = hm.tiny_model(family)
    gen = torch.Generator().manual_seed(17)
    first = torch.randint(3, hm.VOCAB, (1, 14), generator=gen)
    cache = hf.cache_for(model, capacity=64, max_seqs=2, restore_every=4)
    store = PrefixStore(cache, retain_seqs=[1], block_tokens=4)
    try:
        past = hf.generation_cache(model, store=store, max_new_tokens=4)
        with torch.no_grad():
            out1 = model.generate(first, **{hm.cache_kwarg(): past}, max_new_tokens=4,
                                  do_sample=False, pad_token_id=0)
        assert torch.equal(out1, hm.dynamic_generate(model, first, max_new_tokens=4))
        second = torch.cat([out1, torch.randint(3, hm.VOCAB, (1, 5), generator=gen)], dim=1)
        past2 = hf.generation_cache(model, store=store, input_ids=second, max_new_tokens=4)
        assert past2.reused_tokens == out1.shape[1] - 1       # the saved rows' end
        with torch.no_grad():
            out2 = model.generate(second, **{hm.cache_kwarg(): past2}, max_new_tokens=4,
                                  do_sample=False, pad_token_id=0)
        assert torch.equal(out2, hm.dynamic_generate(model, second, max_new_tokens=4))
    finally:
        store.close()


def test_server_survives_a_failed_pass_of_a_hybrid():
    """A forward pass that raises mid-model (a recurrent layer updated its state in place, no
    restore point where the pass began): the server restarts that request from its prompt;
    the next passes give the same tokens as generate()."""
    from numbakv import hf
    model = hm.tiny_model("qwen3_next")
    gen = torch.Generator().manual_seed(19)
    prompts = [torch.randint(3, hm.VOCAB, (n,), generator=gen).tolist() for n in (7, 10)]
    expected = [hm.dynamic_generate(model, torch.tensor([p]), max_new_tokens=5)[0, len(p):]
                .tolist() for p in prompts]
    cache = hf.cache_for(model, capacity=64, max_seqs=2, restore_every=256)
    srv = hf.Server(model, cache, prefill_chunk=16)
    attention = model.model.layers[1].self_attn
    try:
        rids = [srv.submit(p, max_new_tokens=5) for p in prompts]
        srv.step()
        srv.step()                                      # decoding now
        original = attention.forward

        def broken(*args, **kwargs):
            raise RuntimeError("boom")
        attention.forward = broken
        with pytest.raises(RuntimeError, match="boom"):
            srv.step()
        attention.forward = original
        done = srv.run()
        assert [done[r] for r in rids] == expected
    finally:
        hf.detach(model)


def test_hybrid_refusals_name_what_is_wrong():
    """Falcon-H1 (attention and a Mamba mixer side by side in one layer) is refused by name;
    a hybrid model attached to an attention-only cache, an attention-only model to a
    HybridCache, and restore options for a model without recurrent layers are ValueErrors;
    nothing is attached after a refusal."""
    from numbakv import hf
    from numbakv.errors import NotSupportedError
    with pytest.raises(NotSupportedError, match="falcon_h1"):
        hf.cache_for(hm.tiny_config("falcon_h1"), capacity=16)
    llama = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=2, num_attention_heads=2)
    with pytest.raises(ValueError, match="restore_every"):
        hf.cache_for(llama, capacity=16, restore_every=8)
    model = hm.tiny_model("bamba")
    plain = hf.cache_for(llama, capacity=16)
    with pytest.raises(ValueError, match="recurrent layers"):
        hf.attach(model, plain)
    assert hf.attached_cache(model) is None
    hc = hf.cache_for(model, capacity=16)
    lm = hm.random_weight_model(llama)
    with pytest.raises(ValueError, match="recurrent layers"):
        hf.attach(lm, hc)
    assert hf.attached_cache(lm) is None
