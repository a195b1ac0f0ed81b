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


#: ``(torch, transformers.cache_utils)`` once imported: generate()'s passes ask for them every
#: step, and the import statements cost ~5 us a call there (transformers' lazy module)
_MODULES: tuple = ()


def _transformers():
    global _MODULES
    if _MODULES:
        return _MODULES
    try:
        import torch
        from transformers import cache_utils
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("numbakv.hf needs transformers and torch: pip install numbakv[hf]") \
            from exc
    _MODULES = (torch, cache_utils)
    return _MODULES
