"""``model_id``: which model a prefix store's K/V belong to.

Two models of the same shapes (a base model and its instruct tune, a fine-tune, a new revision)
produce different keys and values for the same tokens. A prefix store shared between processes
(a disk directory, a Redis server) must never hand one model's K/V to the other, so its keys
carry the model's identity: its name, its revision and a digest of its weights. The digest is
computed once per model object (hashing reads every weight once: about a second per GB) and
remembered.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

from ._deps import _import_torch

#: model object -> its identity string (weak: a model that is freed is forgotten)
_MEMO: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
#: bytes of one weight hashed per update call (bounds the temporary host copy of a GPU tensor)
_CHUNK_BYTES = 64 << 20


def weights_digest(model: Any) -> str:
    """A hex blake2b-128 digest of ``model``'s ``state_dict()``: every tensor's name, dtype,
    shape and bytes, in name order. Equal for two models with equal weights, different (with
    overwhelming probability) when any weight differs by one bit."""
    torch = _import_torch()
    h = hashlib.blake2b(digest_size=16)
    state = model.state_dict()
    for name in sorted(state):
        t = state[name]
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.reshape(-1)
        if flat.numel() == 0:
            continue
        per = max(1, _CHUNK_BYTES // max(1, flat.element_size()))
        for start in range(0, flat.numel(), per):
            part = flat[start:start + per].contiguous().to("cpu")
            h.update(part.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_id(model: Any) -> str:
    """The identity a ``numbakv.PrefixStore(..., model_id=...)`` of this model's cache must
    carry: ``"<name>@<revision>#<weights digest>"``.

    ``name`` is ``config._name_or_path`` (the hub id or directory it was loaded from; the
    model class name for a model built from a config), ``revision`` is ``config._commit_hash``
    when transformers recorded one (else ``"local"``), and the digest is
    :func:`weights_digest` - so two models that share a name and a directory but not their
    weights (a fine-tune saved over its base) never share K/V. Computed once per model object
    and remembered: change the weights in place and the identity is stale (build a new store).

    Args:
        model: a transformers model (``torch.nn.Module`` with a ``config``).

    Raises:
        ValueError: ``model`` is not a torch module with a ``config``.
    """
    torch = _import_torch()
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"model must be a transformers model (torch.nn.Module with a config), "
                         f"got {type(model).__name__}")
    known = _MEMO.get(model)
    if known is not None:
        return known
    config = model.config
    name = str(getattr(config, "_name_or_path", "") or type(model).__name__)
    revision = str(getattr(config, "_commit_hash", None) or "local")
    ident = f"{name}@{revision}#{weights_digest(model)}"
    _MEMO[model] = ident
    return ident


def check_store_model(store: Any, model: Any, what: str) -> None:
    """Refuse a prefix store that records another model's identity (``store.model_id``; a
    store without one - host RAM only - is accepted: it lives and dies with this process's
    cache)."""
    recorded = getattr(store, "model_id", None)
    if recorded is None:
        return
    mine = model_id(model)
    if recorded != mine:
        raise ValueError(f"{what}: store belongs to model_id={recorded!r} but this model is "
                         f"{mine!r}: build the store with model_id=hf.model_id(model)")
