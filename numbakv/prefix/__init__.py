"""The prefix store: reuse any earlier request's prefix, token by token, from a bounded, tiered
store (tier 0: the cache's own cells; tier 1: host RAM; then disk and Redis/Valkey). See
``store.py`` and ``docs/prefix.md``."""

from .store import PrefixStore

__all__ = ["PrefixStore"]
