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
(the window of ``n`` must still be held); ``floor`` is 0 elsewhere. Entries of hybrid caches
(recurrent layers beside attention) serve only the lengths where they hold the recurrent state:
their ``restore`` points (``Entry.servable``).
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from .keys import block_digest

_TOKEN = 8   # bytes per token id (int64)


class Node:
    """One block of a prompt (see the module docstring)."""

    __slots__ = ("parent", "tok", "start", "end", "digest", "children", "by_first", "entries",
                 "tier_count", "fp", "fast", "h", "__weakref__")

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
        self.h = 0                                       # prefix hash of full-block paths

    @property
    def key(self) -> str:
        """The block's content key (hex)."""
        return self.digest.hex()


class Entry:
    """One stored prefix: ``length`` tokens of a prompt, held in ``tier`` (``"cells"``:
    ``seq`` holds them; ``"host"``: ``payload`` is its snapshot). ``path`` is its nodes, root
    excluded; ``floor``: the smallest length it can serve (sliding windows), ``pins``: how many
    ``pin`` calls hold it (never evicted while > 0). ``restore``: on hybrid caches, the
    ascending lengths at which it holds the recurrent state (restore points; ``length`` among
    them), the only lengths it can serve; ``None`` elsewhere (any length from ``floor``)."""

    _ids = itertools.count(1)
    __slots__ = ("id", "tier", "root", "path", "length", "floor", "seq", "payload", "nbytes",
                 "pins", "hits", "buf", "restore")

    def __init__(self, tier: str, root: bytes, path: List[Node], *, floor: int = 0,
                 seq: Optional[int] = None, payload: Any = None, nbytes: int = 0,
                 restore: Optional[Tuple[int, ...]] = None) -> None:
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
        self.restore = None if restore is None else tuple(sorted(int(r) for r in restore))

    def tokens_bytes(self) -> bytes:
        return self.buf

    def servable(self, n: int) -> int:
        """The deepest length ``<= n`` this entry can serve (0: none): ``n`` itself from
        ``floor`` up, or on hybrid caches the deepest restore point ``<= n``."""
        if n < self.floor:
            return 0
        if self.restore is None:
            return n
        i = bisect.bisect_right(self.restore, n)
        r = self.restore[i - 1] if i else 0
        return r if r >= self.floor else 0

    def __repr__(self) -> str:
        return (f"Entry(id={self.id}, tier={self.tier}, length={self.length}, floor={self.floor},"
                f" seq={self.seq}, pins={self.pins})")


class Match:
    """What :meth:`BlockIndex.match` found: ``n`` tokens servable by ``entry`` (None when
    ``n == 0``), ``tokens_matched`` (the token match before windows), and ``path``: the nodes of
    the query's prefix the index holds (full blocks, then the node the last partial match was
    in), built on first use."""

    __slots__ = ("n", "entry", "_path", "_end", "_partial", "tokens_matched")

    def __init__(self, n: int, entry: Optional[Entry], end: Optional["Node"],
                 partial: Optional["Node"], tokens_matched: int):
        self.n = n
        self.entry = entry
        self._end = end
        self._partial = partial
        self._path = None
        self.tokens_matched = tokens_matched

    @property
    def path(self) -> List["Node"]:
        if self._path is None:
            self._path = _path_to(self._end) + ([self._partial] if self._partial else [])
        return self._path


def _path_to(node: Optional["Node"]) -> List["Node"]:
    """The nodes from the root's child down to ``node`` (root excluded)."""
    out: List[Node] = []
    while node is not None and node.parent is not None:
        out.append(node)
        node = node.parent
    out.reverse()
    return out


_MULT_CACHE: Dict[int, np.ndarray] = {}
_SHIFT = np.uint64(29)


def block_fingerprints(buf: bytes, block_tokens: int) -> List[int]:
    """A 64-bit fingerprint of each full block of ``buf`` (int64-LE tokens), vectorised: the
    fast path of a walk. Collisions cost a slower walk, never a wrong answer (every fast walk is
    checked against an entry's tokens with one compare)."""
    return _fingerprints(buf, block_tokens).tolist()


def _fingerprints(buf: bytes, block_tokens: int) -> np.ndarray:
    nb = len(buf) // (8 * block_tokens)
    mult = _MULT_CACHE.get(block_tokens)
    if mult is None:
        rng = np.random.default_rng(0x6E6B76)   # fixed: fingerprints are per-process anyway
        mult = _MULT_CACHE[block_tokens] = (rng.integers(1, 2**63, block_tokens,
                                                         dtype=np.uint64) | np.uint64(1))
    toks = np.frombuffer(buf, dtype=np.uint64, count=nb * block_tokens).reshape(nb,
                                                                                  block_tokens)
    # uint64 array arithmetic wraps mod 2**64 without a warning (no errstate needed: it costs
    # more than the product here); matmul is sum(toks * mult) per row, 2-3x faster
    fp = toks @ mult
    fp ^= fp >> _SHIFT
    return fp


_POW: np.ndarray = np.zeros(0, np.uint64)
_P = 0x9E3779B97F4A7C15


def _powers(n: int) -> np.ndarray:
    """``P**j`` mod 2**64 for j < n (the rolling prefix hash's weights)."""
    global _POW
    if len(_POW) < n:
        size = max(n, 2 * len(_POW), 1024)
        out = np.empty(size, np.uint64)
        acc = 1
        for j in range(size):
            out[j] = acc
            acc = (acc * _P) & 0xFFFFFFFFFFFFFFFF
        _POW = out
    return _POW[:n]


def prefix_hashes(fps: np.ndarray) -> List[int]:
    """The rolling hash of every full-block prefix: ``H_i = sum_{j <= i} fp_j * P**j`` mod
    2**64 (vectorised; collisions only cost the exact walk)."""
    return _prefix_hashes(fps).tolist()


def _prefix_hashes(fps: np.ndarray) -> np.ndarray:
    """:func:`prefix_hashes` as a uint64 array ``[blocks]`` (array arithmetic wraps silently).
    ``add.accumulate`` of the uint64 products: the same sums as ``cumsum(..., dtype=uint64)``
    at a third of its cost (no dtype resolution), a few us of every match of a long prompt."""
    return np.add.accumulate(fps * _powers(len(fps)))


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
        #: (root, depth in full blocks, rolling prefix hash) -> node: the walk's binary search
        self.deep: Dict[Tuple[bytes, int, int], Node] = {}
        self.tier_rank = tier_rank or {"cells": 0, "host": 1}

    # ------------------------------------------------------------------ matching
    def walk(self, root: bytes, buf: bytes) -> Tuple[Optional[Node], int, List[Node]]:
        """``(deepest full node, tokens matched, partial nodes)``: the deepest node whose whole
        path of full blocks matches ``buf`` from the start (None: not even the first block),
        how many tokens match in all, and the children the match ends inside (every one sharing
        the most tokens with the next block: a full block and a tail may tie; empty when the
        match ends on a node boundary)."""
        rnode = self.roots.get(root)
        if rnode is None:
            return None, 0, []
        end = self._deepest_fast(root, buf)
        if end is False:                       # a hash collision: the exact walk
            end = None
            width = self.width
            pos, size = 0, len(buf)
            children = rnode.children
            while pos + width <= size:
                child = children.get(buf[pos:pos + width])
                if child is None or len(child.tok) != width:
                    break
                end = child
                children = child.children
                pos += width
        node = end if end is not None else rnode
        width = self.width
        pos = _TOKEN * node.end
        matched = node.end
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
        return end, matched + best_n, best

    def _deepest_fast(self, root: bytes, buf: bytes):
        """The deepest full-block node of ``buf``'s path, by a binary search over the rolling
        prefix hashes of its blocks (O(log blocks) dict look-ups after one vectorised pass),
        checked with one compare against the tokens of an entry covering it. None: no block
        matches; False: the check failed (a collision), use the exact walk."""
        # the array, not a list: the search reads O(log blocks) of them (int(): exact keys)
        hashes = _prefix_hashes(_fingerprints(buf, self.block_tokens))
        deep = self.deep
        lo, hi = 0, len(hashes)        # depths 1..lo exist; find the largest
        node = None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = deep.get((root, mid, int(hashes[mid - 1])))
            if found is not None:
                lo, node = mid, found
            else:
                hi = mid - 1
        if node is None:
            return None
        n = _TOKEN * node.end
        for e in node.entries.values():   # a view: no copy of either prompt's bytes
            return node if buf.startswith(memoryview(e.buf)[:n]) else False
        return False

    def match(self, root: bytes, buf: bytes) -> Match:
        """The longest prefix of the prompt ``buf`` (int64-LE token bytes) some entry can serve,
        and the best entry to serve it (the lowest tier rank, then the shortest entry). O(prompt
        blocks) without sliding windows; with them, entries of the path are checked against
        their ``floor`` too (and on hybrid caches against their restore points: the answer is
        the deepest restore point some entry holds at or below the token match)."""
        end, n_tok, partials = self.walk(root, buf)
        if n_tok == 0:
            return Match(0, None, None, None, 0)
        deepest = partials if partials else [end]
        rank = self.tier_rank
        best: Optional[Entry] = None
        for node in deepest:
            for e in node.entries.values():   # every one of them covers n_tok tokens
                if e.servable(n_tok) == n_tok and (best is None or (rank[e.tier], e.length) <
                                                   (rank[best.tier], best.length)):
                    best = e
        if best is not None:
            return Match(n_tok, best, end, partials[0] if partials else None, n_tok)
        path = _path_to(end)
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
                    c = e.servable(c)      # windows / restore points: maybe shallower
                    if c == 0:
                        continue
                    if c > best_n or (c == best_n and best is not None
                                      and rank[e.tier] < rank[best.tier]):
                        best, best_n = e, c
        if best_n < self.block_tokens:
            # the root holds no entries: an entry whose first block is beside the query's
            # (a shorter tail, or a block sharing fewer tokens than the partial match) is
            # judged here, by what its first block shares with the query
            rnode = self.roots.get(root)
            for first in (rnode.by_first.get(buf[:_TOKEN], ()) if rnode is not None else ()):
                k = _common_tokens(first.tok, buf)
                for e in first.entries.values():
                    if e.id in seen:
                        continue
                    c = min(e.length, k)
                    if e.floor <= c and (c > best_n or (c == best_n and best is not None
                                                         and rank[e.tier] < rank[best.tier])):
                        best, best_n = e, c
        return Match(best_n, best, end, partials[0] if partials else None, n_tok)

    # ------------------------------------------------------------------ entries
    def insert_path(self, root: bytes, buf: bytes) -> List[Node]:
        """The nodes of prompt ``buf`` (made where missing, not yet covered by any entry)."""
        node = self.roots.get(root)
        if node is None:
            node = self.roots[root] = Node(None, b"", 0, root)
        path: List[Node] = []
        width = self.width
        fps = pows = None      # every block's fingerprint and weight: one vectorised pass,
        # made on the first new node (per-block numpy calls were most of a save's cost)
        for pos in range(0, len(buf), width):
            chunk = buf[pos:pos + width]
            child = node.children.get(chunk)
            if child is None:
                child = Node(node, chunk, pos // _TOKEN,
                             block_digest(node.digest, chunk, len(chunk) == width))
                node.children[chunk] = child
                node.by_first.setdefault(chunk[:_TOKEN], []).append(child)
                if len(chunk) == width:
                    if fps is None:
                        fps = block_fingerprints(buf, self.block_tokens)
                        pows = _powers(len(fps)).tolist()
                    depth = child.end // self.block_tokens
                    child.fp = fps[depth - 1]
                    node.fast.setdefault(child.fp, child)   # a collision keeps the first
                    child.h = (node.h + child.fp * pows[depth - 1]) & 0xFFFFFFFFFFFFFFFF
                    self.deep.setdefault((root, depth, child.h), child)
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
        # the nodes no entry covers any more: the tail of the path that holds no entries and
        # only the next such node as a child. Only the top one is unlinked from its parent
        # (the rest go with it); the deeper ones only leave ``deep`` and drop their parent
        # link (no reference cycle left for the garbage collector). One dict operation per
        # node instead of a full unlink each: most of an evicting save's index work.
        chain: List[Node] = []
        below: Optional[Node] = None
        for node in reversed(entry.path):
            if node.entries or len(node.children) > (below is not None) or (
                    below is not None and node.children.get(below.tok) is not below):
                break
            chain.append(node)
            below = node
        if chain:
            bt, deep = self.block_tokens, self.deep
            for node in chain[:-1]:
                if node.fp is not None:
                    key = (entry.root, node.end // bt, node.h)
                    if deep.get(key) is node:
                        del deep[key]
                node.parent = None
                node.children = {}
            chain[-1].children = {}
            self._unlink(chain[-1], entry.root)
        for node in entry.path[:len(entry.path) - len(chain)]:
            if not node.entries and not node.children:   # (not expected: kept for safety)
                self._unlink(node, entry.root)
        return gone

    def prune(self, path: Iterable[Node]) -> None:
        """Unlink nodes of ``path`` that no entry covers (after a failed save)."""
        path = list(path)
        root = self._root_of(path[0]) if path else None
        for node in reversed(path):
            if not node.entries and not node.children:
                self._unlink(node, root)

    def _unlink(self, node: Node, root: Optional[bytes] = None) -> None:
        """Take ``node`` out of the trie (``root``: its root's digest when the caller knows
        it; else found by walking up, O(depth))."""
        parent = node.parent
        if parent is None:
            return
        if parent.children.get(node.tok) is node:
            del parent.children[node.tok]
            if node.fp is not None:
                key = (root if root is not None else self._root_of(node),
                       node.end // self.block_tokens, node.h)
                if self.deep.get(key) is node:
                    del self.deep[key]
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

    def _root_of(self, node: Node) -> bytes:
        while node.parent is not None:
            node = node.parent
        return node.digest

    def clear(self) -> List[Entry]:
        out = list(self.entries.values())
        self.deep.clear()
        self.roots.clear()
        self.entries.clear()
        return out

    def in_tier(self, tier: str) -> List[Entry]:
        return [e for e in self.entries.values() if e.tier == tier]


__all__ = ["BlockIndex", "Entry", "Match", "Node"]
