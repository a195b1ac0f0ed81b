"""numbakv.hf for hybrid models (recurrent layers beside attention layers): the family table
(``hf.hybrid_layout``) against the states transformers' own DynamicCache keeps, for tiny
random-weight models of every hybrid family transformers 5.24 has (tests/hybrid_models.py)."""

from __future__ import annotations

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
