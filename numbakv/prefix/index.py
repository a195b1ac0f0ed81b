"""The prefix store's block index: a trie of token blocks per salt root, token-granular longest
match in O(prompt blocks), and the entries (stored prefixes, in any tier) that cover each block.

A *node* is one block of ``block_tokens`` tokens (or a shorter last block, a *tail*) at a place
in a prompt; its key is the chained blake2b digest of its path (``keys.py``), computed once when
the node is made. An *entry* is one stored prefix: ``tokens[:length]`` of some prompt, held in a
tier (tier 0: a retained sequence's cells; tier 1: a host snapshot), ending exactly at a node's
end; it covers every node of its path. A node lives while at least one entry covers it, so every
node the index reaches can be served by some entry.

Matching walks full blocks through dicts keyed by the block's token bytes (no hashing on the
read path: a 32k-token prompt is 2,048 dict look-ups), then compares the next block token by
token against the children that start with the same token: a partial last block matches token
by token.

Entries on sliding-window caches can serve only lengths ``n`` with ``floor <= n <= length``
(the window of ``n`` must still be held); ``floor`` is 0 elsewhere.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from .keys import block_digest

_TOKEN = 8   # bytes per token id (int64)


class Node:
    """One block of a prompt (see the module docstring)."""

    __slots__ = ("parent", "tok", "start", "end", "digest", "children", "by_first", "entries",
                 "tier_count", "fp", "fast", "__weakref__")

    def __init__(self, parent: Optional["Node"], tok: bytes, start: int, digest: bytes) -> None:
        self.parent = parent
        self.tok = tok                      # int64-LE token bytes of this block
        self.start = start                  # position of its first token
        self.end = start + len(tok) // _TOKEN
        self.digest = digest
        self.children: Dict[bytes, "Node"] = {}          # token bytes -> child (full or tail)
        self.by_first: Dict[bytes, List["Node"]] = {}    # first token's bytes -> children
        self.entries: Dict[int, "Entry"] = {}            # entries covering this node
        self.tier_count: Dict[str, int] = {}             # tier -> entries of it covering this
        self.fp = None                                   # fingerprint of a full block
        self.fast: Dict[int, "Node"] = {}                # full children by fingerprint

    @property
    def key(self) -> str:
        """The block's content key (hex)."""
        return self.digest.hex()


class Entry:
    """One stored prefix: ``length`` tokens of a prompt, held in ``tier`` (``"cells"``:
    ``seq`` holds them; ``"host"``: ``payload`` is its snapshot). ``path`` is its nodes, root
    excluded; ``floor``: the smallest length it can serve (sliding windows), ``pins``: how many
    ``pin`` calls hold it (never evicted while > 0)."""

    _ids = itertools.count(1)
    __slots__ = ("id", "tier", "root", "path", "length", "floor", "seq", "payload", "nbytes",
                 "pins", "hits", "buf")

    def __init__(self, tier: str, root: bytes, path: List[Node], *, floor: int = 0,
                 seq: Optional[int] = None, payload: Any = None, nbytes: int = 0) -> None:
        self.id = next(Entry._ids)
        self.tier = tier
        self.root = root
        self.path = path
        self.length = path[-1].end if path else 0
        self.floor = floor
        self.seq = seq
        self.payload = payload
        self.nbytes = nbytes
        self.pins = 0
        self.hits = 0
        self.buf = b"".join(n.tok for n in path)   # its tokens (int64 LE): one compare checks a walk

    def tokens_bytes(self) -> bytes:
        return self.buf

    def __repr__(self) -> str:
        return (f"Entry(id={self.id}, tier={self.tier}, length={self.length}, floor={self.floor},"
                f" seq={self.seq}, pins={self.pins})")


class Match:
    """What :meth:`BlockIndex.match` found: ``n`` tokens servable by ``entry`` (None when
    ``n == 0``), and ``path``: the nodes of the query's prefix the index holds (full blocks, then
    the node the last partial match was in)."""

    __slots__ = ("n", "entry", "path", "tokens_matched")

    def __init__(self, n: int, entry: Optional[Entry], path: List[Node], tokens_matched: int):
        self.n = n
        self.entry = entry
        self.path = path
        self.tokens_matched = tokens_matched


_MULT_CACHE: Dict[int, np.ndarray] = {}


def block_fingerprints(buf: bytes, block_tokens: int) -> List[int]:
    """A 64-bit fingerprint of each full block of ``buf`` (int64-LE tokens), vectorised: the
    fast path of a walk. Collisions cost a slower walk, never a wrong answer (every fast walk is
    checked against an entry's tokens with one compare)."""
    nb = len(buf) // (8 * block_tokens)
    if nb == 0:
        return []
    mult = _MULT_CACHE.get(block_tokens)
    if mult is None:
        rng = np.random.default_rng(0x6E6B76)   # fixed: fingerprints are per-process anyway
        mult = _MULT_CACHE[block_tokens] = (rng.integers(1, 2**63, block_tokens,
                                                         dtype=np.uint64) | np.uint64(1))
    toks = np.frombuffer(buf, dtype=np.uint64, count=nb * block_tokens).reshape(nb,
                                                                                  block_tokens)
    with np.errstate(over="ignore"):
        fp = (toks * mult).sum(axis=1, dtype=np.uint64)
        fp ^= fp >> np.uint64(29)
    return fp.tolist()


def _common_tokens(a: bytes, b: bytes) -> int:
    """Leading whole tokens two int64-LE byte strings share."""
    n = min(len(a), len(b)) // _TOKEN
    i = 0
    while i < n and a[i * _TOKEN:(i + 1) * _TOKEN] == b[i * _TOKEN:(i + 1) * _TOKEN]:
        i += 1
    return i


class BlockIndex:
    """The trie of every salt root (see the module docstring). ``tier_rank`` orders tiers for
    serving a match (lower is better: cells before host)."""

    def __init__(self, block_tokens: int, tier_rank: Optional[Dict[str, int]] = None) -> None:
        self.block_tokens = block_tokens
        self.width = _TOKEN * block_tokens
        self.roots: Dict[bytes, Node] = {}
        self.entries: Dict[int, Entry] = {}
        self.tier_rank = tier_rank or {"cells": 0, "host": 1}

    # ------------------------------------------------------------------ matching
    def walk(self, root: bytes, buf: bytes) -> Tuple[List[Node], int, List[Node]]:
        """``(full path, tokens matched, partial nodes)``: the nodes whose whole block matches
        ``buf`` from the start, how many tokens match in all, and the children the match ends
        inside (every one sharing the most tokens with the next block: a full block and a
        tail may tie; empty when the match ends on a node boundary)."""
        node = self.roots.get(root)
        if node is None:
            return [], 0, []
        path = self._walk_fast(node, buf)
        if path is None:                       # a fingerprint collision: the exact walk
            path = []
            width = self.width
            pos, size = 0, len(buf)
            children = node.children
            while pos + width <= size:
                child = children.get(buf[pos:pos + width])
                if child is None or len(child.tok) != width:
                    break
                path.append(child)
                children = child.children
                pos += width
        if path:
            node = path[-1]
        width = self.width
        pos = len(path) * width
        matched = pos // _TOKEN
        rest = buf[pos:pos + width]
        best: List[Node] = []
        best_n = 0
        if rest:
            for cand in node.by_first.get(rest[:_TOKEN], ()):
                k = _common_tokens(cand.tok, rest)
                if k > best_n:
                    best, best_n = [cand], k
                elif k == best_n and k:
                    best.append(cand)
        return path, matched + best_n, best

    def _walk_fast(self, node: Node, buf: bytes) -> Optional[List[Node]]:
        """The full-block path by fingerprints, checked with one compare against the tokens of
        an entry covering its end; None when the check fails (a collision)."""
        path: List[Node] = []
        for fp in block_fingerprints(buf, self.block_tokens):
            child = node.fast.get(fp)
            if child is None:
                break
            path.append(child)
            node = child
        if not path:
            return path
        n = _TOKEN * path[-1].end
        for e in path[-1].entries.values():
            return path if e.buf[:n] == buf[:n] else None
        return None

    def match(self, root: bytes, buf: bytes) -> Match:
        """The longest prefix of the prompt ``buf`` (int64-LE token bytes) some entry can serve,
        and the best entry to serve it (the lowest tier rank, then the shortest entry). O(prompt
        blocks) without sliding windows; with them, entries of the path are checked against
        their ``floor`` too."""
        path, n_tok, partials = self.walk(root, buf)
        if n_tok == 0:
            return Match(0, None, path, 0)
        deepest = partials if partials else [path[-1]]
        rank = self.tier_rank
        best: Optional[Entry] = None
        for node in deepest:
            for e in node.entries.values():   # every one of them covers n_tok tokens
                if e.floor <= n_tok and (best is None or (rank[e.tier], e.length) <
                                         (rank[best.tier], best.length)):
                    best = e
        full_path = path + partials[:1]
        if best is not None:
            return Match(n_tok, best, full_path, n_tok)
        # sliding windows: the deepest length some entry can still resume at. Nodes deepest
        # first; an entry is judged at the deepest node of the query's path it covers: it
        # shares the query's tokens up to that node's end (n_tok at the partial nodes), plus
        # what its next block shares with the query's next block
        best_n = 0
        seen = set()
        levels = ([(len(path), n_tok, partials)] if partials else []) + \
            [(i, node.end, [node]) for i, node in reversed(list(enumerate(path)))]
        for i, node_n, nodes in levels:
            if best_n >= node_n + (self.block_tokens if i < len(path) else 0):
                break
            for node in nodes:
                for e in node.entries.values():
                    if e.id in seen:
                        continue
                    seen.add(e.id)
                    c = min(e.length, node_n)
                    if i < len(path) and e.length > node_n:
                        nxt = e.path[i + 1]
                        c = node_n + _common_tokens(nxt.tok, buf[_TOKEN * node_n:])
                    if e.floor > c:
                        continue
                    if c > best_n or (c == best_n and best is not None
                                      and rank[e.tier] < rank[best.tier]):
                        best, best_n = e, c
        return Match(best_n, best, full_path, n_tok)

    # ------------------------------------------------------------------ entries
    def insert_path(self, root: bytes, buf: bytes) -> List[Node]:
        """The nodes of prompt ``buf`` (made where missing, not yet covered by any entry)."""
        node = self.roots.get(root)
        if node is None:
            node = self.roots[root] = Node(None, b"", 0, root)
        path: List[Node] = []
        width = self.width
        for pos in range(0, len(buf), width):
            chunk = buf[pos:pos + width]
            child = node.children.get(chunk)
            if child is None:
                child = Node(node, chunk, pos // _TOKEN,
                             block_digest(node.digest, chunk, len(chunk) == width))
                node.children[chunk] = child
                node.by_first.setdefault(chunk[:_TOKEN], []).append(child)
                if len(chunk) == width:
                    child.fp = block_fingerprints(chunk, self.block_tokens)[0]
                    node.fast.setdefault(child.fp, child)   # a collision keeps the first
            path.append(child)
            node = child
        return path

    def add(self, entry: Entry) -> List[Node]:
        """Register ``entry``; returns the nodes newly covered in its tier (for events)."""
        self.entries[entry.id] = entry
        fresh = []
        for node in entry.path:
            node.entries[entry.id] = entry
            c = node.tier_count.get(entry.tier, 0)
            node.tier_count[entry.tier] = c + 1
            if c == 0:
                fresh.append(node)
        return fresh

    def remove(self, entry: Entry) -> List[Node]:
        """Drop ``entry``; nodes no entry covers any more leave the trie. Returns the nodes no
        longer covered in its tier (for events)."""
        self.entries.pop(entry.id, None)
        gone = []
        for node in entry.path:
            if node.entries.pop(entry.id, None) is None:
                continue
            c = node.tier_count.get(entry.tier, 0) - 1
            if c <= 0:
                node.tier_count.pop(entry.tier, None)
                gone.append(node)
            else:
                node.tier_count[entry.tier] = c
        for node in reversed(entry.path):
            if node.entries or node.children:
                continue
            self._unlink(node)
        return gone

    def prune(self, path: Iterable[Node]) -> None:
        """Unlink nodes of ``path`` that no entry covers (after a failed save)."""
        for node in reversed(list(path)):
            if not node.entries and not node.children:
                self._unlink(node)

    def _unlink(self, node: Node) -> None:
        parent = node.parent
        if parent is None:
            return
        if parent.children.get(node.tok) is node:
            del parent.children[node.tok]
            if node.fp is not None and parent.fast.get(node.fp) is node:
                del parent.fast[node.fp]
                for other in parent.children.values():   # a colliding sibling takes its place
                    if other.fp == node.fp:
                        parent.fast[node.fp] = other
                        break
            lst = parent.by_first.get(node.tok[:_TOKEN])
            if lst is not None:
                lst.remove(node)
                if not lst:
                    del parent.by_first[node.tok[:_TOKEN]]
        if parent.parent is None and not parent.children:
            self.roots.pop(parent.digest, None)

    def clear(self) -> List[Entry]:
        out = list(self.entries.values())
        self.roots.clear()
        self.entries.clear()
        return out

    def in_tier(self, tier: str) -> List[Entry]:
        return [e for e in self.entries.values() if e.tier == tier]


__all__ = ["BlockIndex", "Entry", "Match", "Node"]
