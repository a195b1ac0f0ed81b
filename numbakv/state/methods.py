"""The state methods of the caches, without the state format: ``StateMethods`` (the
``save_state`` / ``load_state`` / ``state_bytes`` / ``load_state_bytes`` every cache that holds
sequences inherits).

The caches' modules import this module, not :mod:`~numbakv.state.files`: the format's modules
(``files``, ``codec``, ``snapshot``: ~1 MiB of resident memory in every process) are imported
when a state is first saved or loaded, so a process that never does (a ``generate()`` user)
never loads them. ``files`` never imports this module (no circle).
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence, Union

PathLike = Union[str, "os.PathLike[str]"]   # a file path


def _io(family: str):
    """``(save, to bytes, load, from bytes)`` of a family of caches (``files._STATE_IO``);
    imports the state format on the first call."""
    from .files import _STATE_IO
    return _STATE_IO[family]


class StateMethods:
    """``save_state`` / ``load_state`` / ``state_bytes`` / ``load_state_bytes``, written once for
    the caches that hold sequences (``CausalCache``, ``StreamCache``, ``WrapperCache``, and the
    families whose own module reads and writes their files, ``files.register_family``'s:
    ``RecurrentCache``, ``HybridCache``). A class names its family of ``files``' functions in
    ``_STATE_IO`` and says what a load ends in ``_after_state_load``."""

    _STATE_IO = "causal"

    def _after_state_load(self) -> None:
        """What a state load ends (the forward pass in progress); nothing by default."""

    def save_state(self, path: PathLike, seq: Optional[int] = None, *,
                   tokens: Optional[Sequence[int]] = None,
                   metadata: Optional[Mapping[str, str]] = None,
                   progress: Optional[bool] = None) -> None:
        """Save the whole cache (``seq=None``; every stream / group cache / half) or one
        sequence to the safetensors file ``path``, atomically (``numbakv.state``: a sequence's
        attention K/V file loads into any cache of the same model, unified or streams; a
        recurrent cache's holds per sequence its live state and restore points, tensors
        ``s<id>.*``; a hybrid's the attention half as tensor ``attn`` and the recurrent half as
        ``rec.*``). ``tokens`` (integers ``[t]``) and str -> str ``metadata`` travel with it."""
        _io(self._STATE_IO)[0](self, path, seq, tokens=tokens, metadata=metadata,
                               progress=progress)

    def state_bytes(self, seq: Optional[int] = None, *, tokens: Optional[Sequence[int]] = None,
                    metadata: Optional[Mapping[str, str]] = None,
                    progress: Optional[bool] = None) -> bytes:
        """What ``save_state`` writes, as bytes."""
        return _io(self._STATE_IO)[1](self, seq, tokens=tokens, metadata=metadata,
                                      progress=progress)

    def load_state(self, path: PathLike, seq: Optional[int] = None, *, strict: bool = True,
                   progress: Optional[bool] = None) -> dict:
        """Restore what ``save_state`` wrote: the whole cache, or a saved sequence as ``seq``
        (replacing what ``seq`` held), all or nothing; ends the forward pass in progress.
        Returns ``{"tokens": list[int] | None, "metadata": dict[str, str]}``. ``strict``: a
        state saved by a cache with another model fingerprint (shift, window, memory, chunk,
        dtypes, head shapes) raises ``StateError`` naming the field (recurrent states of another
        layout raise it whatever ``strict`` says: they mean nothing here)."""
        out = _io(self._STATE_IO)[2](self, path, seq, strict=strict, progress=progress)
        self._after_state_load()
        return out

    def load_state_bytes(self, data: bytes, seq: Optional[int] = None, *, strict: bool = True,
                         progress: Optional[bool] = None) -> dict:
        """Load ``state_bytes`` output (as ``load_state``)."""
        out = _io(self._STATE_IO)[3](self, data, seq, strict=strict, progress=progress)
        self._after_state_load()
        return out


__all__ = ["StateMethods"]
