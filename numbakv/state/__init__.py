"""Saving and restoring cache state (safetensors files or bytes): see ``files.py`` for the format.

- ``codec.py``: file/bytes framing, hostile-input parsing, atomic writes; never sees a cache.
- ``files.py``: save/load per cache kind (CausalCache, stream caches, WrapperCache,
  StepCache/RotatingCache); constructs no cache class (``simple.py`` registers its classes).

This package re-exports the names ``numbakv.state`` (then one module) always exposed, so
``from numbakv import state`` / ``from numbakv.state import fingerprint`` keep working.
"""

from .codec import (FORMAT, KINDS, MAX_HEADER_BYTES, PROGRESS_THRESHOLD, VERSION, Source, _host_le,
                    _Spec, _State)
from .files import (_fingerprint_diff, _write_rows, cache_from_bytes, cache_to_bytes, fingerprint,
                    load, load_cache, load_simple, load_streams, read_info, save, save_cache,
                    save_simple, save_streams, simple_to_bytes, streams_from_bytes,
                    streams_to_bytes, to_bytes)

__all__ = ["save", "load", "to_bytes", "read_info", "fingerprint", "save_cache", "load_cache",
           "cache_to_bytes", "cache_from_bytes", "save_simple", "load_simple", "simple_to_bytes",
           "FORMAT", "VERSION", "KINDS", "PROGRESS_THRESHOLD"]
