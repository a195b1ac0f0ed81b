"""Eviction orders of the prefix store's tiers: small pure-Python classes over entry ids (any
hashable), tested without arrays. ``victims()`` yields ids from the first to evict to the last;
the store skips the pinned ones (pinned entries are never evicted)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Hashable, Iterator, Tuple


class LRU:
    """Least recently used first (vLLM's free-block queue, mlx-lm's prompt trie)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: "OrderedDict[Hashable, None]" = OrderedDict()

    def add(self, key: Hashable) -> None:
        """A new entry: the most recently used."""
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        """``key`` was used (a hit): it becomes the most recently used."""
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        """Ids, least recently used first (a snapshot: the caller may remove while iterating)."""
        return iter(list(self._order))

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


class LFU:
    """Least frequently used first; ties broken by least recently used (SGLang's LFU)."""

    name = "lfu"

    def __init__(self) -> None:
        self._meta: Dict[Hashable, Tuple[int, int]] = {}   # key -> (uses, last tick)
        self._tick = 0

    def _next(self) -> int:
        self._tick += 1
        return self._tick

    def add(self, key: Hashable) -> None:
        uses = self._meta.get(key, (0, 0))[0]
        self._meta[key] = (uses + 1, self._next())

    def touch(self, key: Hashable) -> None:
        if key in self._meta:
            self._meta[key] = (self._meta[key][0] + 1, self._next())

    def remove(self, key: Hashable) -> None:
        self._meta.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(sorted(self._meta, key=self._meta.__getitem__))

    def uses(self, key: Hashable) -> int:
        return self._meta[key][0]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._meta

    def __len__(self) -> int:
        return len(self._meta)


POLICIES = {"lru": LRU, "lfu": LFU}


def make_policy(name: str):
    """A new policy object for ``name`` (``"lru"`` or ``"lfu"``)."""
    try:
        return POLICIES[name]()
    except (KeyError, TypeError):
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}") from None


__all__ = ["LRU", "LFU", "make_policy", "POLICIES"]
