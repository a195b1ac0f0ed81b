"""Saving and restoring cache state (safetensors files or bytes): see ``files.py`` for the format.

- ``codec.py``: file/bytes framing, hostile-input parsing, atomic writes; never sees a cache.
- ``files.py``: save/load per cache kind (CausalCache, stream caches, WrapperCache,
  StepCache/RotatingCache); constructs no cache class (``simple.py`` registers its classes).
- ``snapshot.py``: one sequence's rows out and in (``SeqSnapshot``).
- ``methods.py``: the caches' ``save_state`` / ``load_state`` methods without the format (the
  caches import it; the modules above load at the first save or load); ``registry.py``: the
  single-stream classes ``simple.py`` registers.

This package re-exports the names ``numbakv.state`` (then one module) always exposed, so
``from numbakv import state`` / ``from numbakv.state import fingerprint`` keep working; they
load their module on first access.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

#: the names this package re-exports, by module: loaded on first access (PEP 562), so importing
#: a cache (which imports ``state.methods``) does not load the state format (~1 MiB of RSS)
_NAMES = {"codec": ("FORMAT", "KINDS", "MAX_HEADER_BYTES", "PROGRESS_THRESHOLD", "VERSION",
                    "Source", "_host_le", "_Spec", "_State"),
          "files": ("_fingerprint_diff", "_write_rows", "cache_from_bytes", "cache_to_bytes",
                    "fingerprint", "load", "load_cache", "load_simple", "load_streams",
                    "read_info", "save", "save_cache", "save_simple", "save_streams",
                    "simple_to_bytes", "streams_from_bytes", "streams_to_bytes", "to_bytes")}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}

if _TYPE_CHECKING:  # type checkers see the re-exported names' own types
    from .codec import (FORMAT, KINDS, MAX_HEADER_BYTES, PROGRESS_THRESHOLD,  # noqa: F401
                        VERSION, Source, _host_le, _Spec, _State)
    from .files import (_fingerprint_diff, _write_rows, cache_from_bytes,  # noqa: F401
                        cache_to_bytes, fingerprint, load, load_cache, load_simple, load_streams,
                        read_info, save, save_cache, save_simple, save_streams, simple_to_bytes,
                        streams_from_bytes, streams_to_bytes, to_bytes)


def __getattr__(name: str):
    """A re-exported name (its module imported now), or a submodule not imported yet."""
    import importlib
    module = _MODULE_OF.get(name)
    if module is None:
        if name in ("codec", "files", "snapshot", "methods", "registry"):
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module 'numbakv.state' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value          # later accesses skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = ["save", "load", "to_bytes", "read_info", "fingerprint", "save_cache", "load_cache",
           "cache_to_bytes", "cache_from_bytes", "save_simple", "load_simple", "simple_to_bytes",
           "FORMAT", "VERSION", "KINDS", "PROGRESS_THRESHOLD"]
