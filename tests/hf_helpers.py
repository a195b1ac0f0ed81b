"""Helpers of the transformers tests (tests/test_hf*.py): a model's own forward as the
reference, one packed forward pass through a numbakv cache, and the logits comparison. torch is
imported here, so only modules that already skipped without it import this one."""

from __future__ import annotations

import torch

from numbakv import hf


def full_logits(model, tokens, start: int = 0) -> torch.Tensor:
    """The model's own forward over one whole sequence (no numbakv): logits ``[len, vocab]``."""
    assert hf.attached_cache(model) is None
    ids = torch.as_tensor(tokens)[None]
    pos = torch.arange(start, start + ids.shape[1])[None]
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos).logits[0]


def run_batch(model, cache, parts):
    """One packed forward pass: ``parts`` = [(seq, tokens, first_position)]; returns each part's
    logits ``[len(tokens), vocab]``."""
    tokens, positions, seqs = [], [], []
    for seq, toks, first in parts:
        tokens += list(toks)
        positions += range(first, first + len(toks))
        seqs += [seq] * len(toks)
    tokens, positions = torch.tensor(tokens), torch.tensor(positions)
    cache.start_forward(positions, seqs)
    with torch.no_grad():
        logits = model(input_ids=tokens[None], position_ids=positions[None]).logits[0]
    out, i = [], 0
    for _, toks, _ in parts:
        out.append(logits[i:i + len(toks)])
        i += len(toks)
    return out


def assert_logits(got, want, what: str, tol: float = 2e-5) -> None:
    """``got`` equals ``want`` to ``tol`` relative to the logits' scale (at least 1)."""
    scale = max(1.0, float(want.abs().max()))
    err = float((got - want).abs().max())
    assert err <= tol * scale, f"{what}: max |logit diff| {err:.3g} (scale {scale:.3g})"
