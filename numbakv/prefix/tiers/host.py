"""Tier 1 of the prefix store: host RAM under a hard byte budget.

Entries demoted from tier 0 (the cache's cells) are kept here as ``SeqSnapshot`` objects
(``cache.export_seq``: numpy rows in the stored format, quantized blocks stay quantized; on a GPU
the snapshot engineer's export copies through pinned host memory on the cache's stream). A hit
promotes one back with ``cache.import_seq`` (one batched copy per layer). This class only keeps
the accounts; the index (``index.py``) keeps the entries, the store decides what moves.
"""

from __future__ import annotations

from typing import Any, Dict


class HostTier:
    """Byte accounting of the host tier: ``budget_bytes`` is a hard limit (``used <= budget``
    always; the store evicts before it adds)."""

    name = "host"

    def __init__(self, budget_bytes: int) -> None:
        self.budget = int(budget_bytes)
        self.used = 0
        self.pinned = 0
        self.entries = 0

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit the budget now."""
        return self.used + nbytes <= self.budget

    def add(self, nbytes: int) -> None:
        if self.used + nbytes > self.budget:   # the store evicts first: a bug if reached
            raise AssertionError(f"host tier over budget: {self.used} + {nbytes} > "
                                 f"{self.budget}")
        self.used += nbytes
        self.entries += 1

    def remove(self, nbytes: int) -> None:
        self.used -= nbytes
        self.entries -= 1

    def stats(self) -> Dict[str, Any]:
        used = self.used
        pinned = min(self.pinned, used)
        return {"bytes_used": used, "bytes_evictable": used - pinned, "bytes_pinned": pinned,
                "bytes_free": self.budget - used, "entries": self.entries}


__all__ = ["HostTier"]
