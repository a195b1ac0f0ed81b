"""Eviction orders of the prefix store's tiers: small pure-Python classes over entry ids (any
hashable), tested without arrays. ``victims()`` yields ids from the first to evict to the last;
the store skips the pinned ones (pinned entries are never evicted)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, Hashable, Iterator, List, Optional, Tuple


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


#: TensorRT-LLM's default retention priority (0..100): what an entry gets unless told
DEFAULT_PRIORITY = 35
PRIORITY_RANGE = (0, 100)


class Retention:
    """The eviction order of a tier with retention (agents' sessions): **expired entries first,
    then the lowest priority, then the base policy's order** (LRU or LFU); among those equal, an
    entry that is the ancestor of another live entry (``is_ancestor``) after the entries that
    are not, so a chain loses its tail before its parent.

    Pure Python over entry ids; ``clock`` (seconds, monotonic) is injectable for tests. An
    entry's ``expires`` is a time on that clock (None: never); once past it the entry is first
    out (it is still served until then evicted). With every entry at the default priority and
    none expiring, ``victims()`` is the base order itself (no sort)."""

    def __init__(self, base, clock) -> None:
        self.base = base
        self.name = base.name
        self.clock = clock
        self._meta: Dict[Hashable, Tuple[int, Optional[float]]] = {}
        self._special = 0     # entries with a non-default priority or an expiry

    @staticmethod
    def _is_special(meta: Tuple[int, Optional[float]]) -> bool:
        return meta[0] != DEFAULT_PRIORITY or meta[1] is not None

    def add(self, key: Hashable, priority: int = DEFAULT_PRIORITY,
            expires: Optional[float] = None) -> None:
        self.base.add(key)
        self.set(key, priority, expires)

    def set(self, key: Hashable, priority: int, expires: Optional[float]) -> None:
        """(Re)set ``key``'s priority and expiry time."""
        old = self._meta.get(key)
        if old is not None and self._is_special(old):
            self._special -= 1
        meta = (int(priority), expires)
        self._meta[key] = meta
        if self._is_special(meta):
            self._special += 1

    def get(self, key: Hashable) -> Tuple[int, Optional[float]]:
        """``(priority, expires)`` of ``key``."""
        return self._meta.get(key, (DEFAULT_PRIORITY, None))

    def expired(self, key: Hashable, now: Optional[float] = None) -> bool:
        expires = self.get(key)[1]
        return expires is not None and (self.clock() if now is None else now) >= expires

    def touch(self, key: Hashable) -> None:
        self.base.touch(key)

    def remove(self, key: Hashable) -> None:
        self.base.remove(key)
        old = self._meta.pop(key, None)
        if old is not None and self._is_special(old):
            self._special -= 1

    def rank(self, key: Hashable, now: Optional[float] = None) -> Tuple[int, int]:
        """``(0 if expired else 1, priority)``: the class ``victims`` orders first by."""
        priority, expires = self.get(key)
        now = self.clock() if now is None else now
        return (0 if expires is not None and now >= expires else 1, priority)

    def victims(self, is_ancestor: Optional[Callable[[Hashable], bool]] = None
                ) -> Iterator[Hashable]:
        """Ids, first to evict first (the order is a snapshot: the caller may remove while
        iterating): by ``rank`` (expired, then priority), then, within a rank, entries that
        are not ``is_ancestor`` before those that are, each in the policy's order.

        Lazy: ``is_ancestor`` is asked only as far as the caller iterates (a save that evicts
        one entry asks about the first few, not every entry: flat in the number of entries);
        an entry whose descendants went meanwhile is no longer held back."""
        order = list(self.base.victims())
        if not self._special:
            groups = [order]        # every entry ranks (1, default priority)
        else:
            now = self.clock()
            ranks = {k: self.rank(k, now) for k in order}
            by_rank: Dict[Tuple[int, int], List[Hashable]] = {}
            for k in order:                     # stable: policy order inside each rank
                by_rank.setdefault(ranks[k], []).append(k)
            groups = [by_rank[r] for r in sorted(by_rank)]
        if is_ancestor is None:
            return (k for g in groups for k in g)
        return self._tails_first(groups, is_ancestor)

    @staticmethod
    def _tails_first(groups, is_ancestor) -> Iterator[Hashable]:
        for group in groups:
            held = []
            for k in group:
                if is_ancestor(k):
                    held.append(k)
                else:
                    yield k
            yield from held

    def __contains__(self, key: Hashable) -> bool:
        return key in self.base

    def __len__(self) -> int:
        return len(self.base)


POLICIES = {"lru": LRU, "lfu": LFU}


def make_policy(name: str):
    """A new policy object for ``name`` (``"lru"`` or ``"lfu"``)."""
    try:
        return POLICIES[name]()
    except (KeyError, TypeError):
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}") from None


__all__ = ["LRU", "LFU", "Retention", "make_policy", "POLICIES", "DEFAULT_PRIORITY",
           "PRIORITY_RANGE"]
