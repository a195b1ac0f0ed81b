"""The optional imports of ``numbakv.hf``: transformers and torch (``pip install numbakv[hf]``),
imported only when a function needs them."""

from __future__ import annotations


def _import_torch():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("numbakv.hf needs transformers and torch: pip install numbakv[hf]") \
            from exc
    return torch


def _transformers():
    try:
        import torch
        from transformers import cache_utils
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("numbakv.hf needs transformers and torch: pip install numbakv[hf]") \
            from exc
    return torch, cache_utils
