"""Tiny random-weight transformers models the benchmark sections replay traces through (CPU):
seeded, eager attention, weights N(0, 0.25) so that attention is not uniform."""

from __future__ import annotations

from typing import Any


def random_model(model_cls: Any, cfg: Any, seed: int = 0, std: float = 0.25):
    """``model_cls(cfg)`` with eager attention, every matrix drawn N(0, ``std``) from
    ``torch.manual_seed(seed)``, in eval mode."""
    import torch
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model.eval()


__all__ = ["random_model"]
