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
import hashlib
import itertools
from types import MappingProxyType
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np

from .keys import DIGEST_BYTES, FULL_MARK, TAIL_MARK

_TOKEN = 8   # bytes per token id (int64)


#: the children of a node that has none: one shared read-only mapping (a save makes 128 nodes
#: for a 2k-token prompt, most of them leaves: an empty dict each was a fifth of a save)
NO_CHILDREN: Mapping[bytes, "Node"] = MappingProxyType({})
#: nodes with at most this many children find a partial match's candidates by scanning them;
#: more (a root under many prompts) build their ``by_first`` map once and keep it up to date
_SCAN_CHILDREN = 8


class Node:
    """One block of a prompt (see the module docstring). ``children`` is the shared read-only
    :data:`NO_CHILDREN` until the node gets its first child; ``by_first`` (first token's bytes
    -> children) is built on first use by a node with many children."""

    __slots__ = ("parent", "tok", "start", "end", "full", "_digest", "children", "by_first",
                 "entries", "h", "__weakref__")

    def __init__(self, parent: Optional["Node"], tok: bytes, start: int,
                 digest: Optional[bytes] = None, h: int = 0, full: bool = True) -> None:
        self.parent = parent
        self.tok = tok                      # int64-LE token bytes of this block
        self.start = start                  # position of its first token
        self.end = start + len(tok) // _TOKEN
        self.full = full                    # a whole block (else a prompt's shorter last one)
        self._digest = digest               # made on first use (see ``digest``)
        self.children: Mapping[bytes, "Node"] = NO_CHILDREN   # token bytes -> child
        self.by_first: Optional[Dict[bytes, List["Node"]]] = None
        self.entries: Dict[int, "Entry"] = {}            # entries covering this node
        self.h = h                                       # prefix hash of full-block paths

    def starting_with(self, first: bytes):
        """The children whose first token's bytes are ``first``."""
        children = self.children
        if len(children) <= _SCAN_CHILDREN:
            return [c for c in children.values() if c.tok.startswith(first)]
        by_first = self.by_first
        if by_first is None:
            by_first = self.by_first = {}
            for c in children.values():
                by_first.setdefault(c.tok[:_TOKEN], []).append(c)
        return by_first.get(first, ())

    @property
    def digest(self) -> bytes:
        """The block's chained key (``keys.block_digest`` of its parent's and its tokens), made
        on first use: matching walks token bytes, so only the KV events and the lower tiers
        need it, and a save no longer hashes every block of its prompt. A node keeps its
        parent link after it leaves the trie, so its key can still be made then."""
        digest = self._digest
        if digest is None:
            todo = []
            node = self
            while node._digest is None:
                todo.append(node)
                node = node.parent
            digest = node._digest
            blake2b = hashlib.blake2b
            for node in reversed(todo):     # keys.block_digest, written out
                h = blake2b(digest_size=DIGEST_BYTES)
                h.update(digest)
                h.update(FULL_MARK if node.full else TAIL_MARK)
                h.update(node.tok)
                digest = node._digest = h.digest()
        return digest

    @property
    def key(self) -> str:
        """The block's content key (hex)."""
        return self.digest.hex()


def hex_keys(nodes: List[Node]) -> List[str]:
    """The hex keys of ``nodes`` (``Node.key`` each), making the missing ones in one pass: a
    run of consecutive nodes of one prompt (each the parent of the next), as the KV events
    name them, costs one hash per node not made yet and no property call."""
    out: List[str] = []
    blake2b = hashlib.blake2b
    prev: Optional[Node] = None
    for node in nodes:
        digest = node._digest
        if digest is None:
            parent = node.parent
            h = blake2b(digest_size=DIGEST_BYTES)
            h.update(parent._digest if parent is prev else parent.digest)
            h.update(FULL_MARK if node.full else TAIL_MARK)
            h.update(node.tok)
            digest = node._digest = h.digest()
        out.append(digest.hex())
        prev = node
    return out


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
                 restore: Optional[Tuple[int, ...]] = None, buf: Optional[bytes] = None) -> None:
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
        # its tokens (int64 LE; ``buf``: the caller's bytes of them): one compare checks a walk
        self.buf = b"".join(n.tok for n in path) if buf is None else buf
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
        #: root -> {depth in full blocks << 64 | rolling prefix hash of the path -> its last
        #: node} (one int key: the depth keeps paths of equal hashes apart, e.g. every path of
        #: zero tokens hashes to 0): the walk's binary search
        self.deep: Dict[bytes, Dict[int, Node]] = {}
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
            for cand in node.starting_with(rest[:_TOKEN]):
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
        deep = self.deep.get(root)
        if deep is None:
            return None
        lo, hi = 0, len(hashes)        # depths 1..lo exist; find the largest
        node = None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = deep.get(mid << 64 | int(hashes[mid - 1]))
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
            for first in (rnode.starting_with(buf[:_TOKEN]) if rnode is not None else ()):
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
        width, size = self.width, len(buf)
        pos = 0
        while pos < size:                       # the blocks the trie holds already
            child = node.children.get(buf[pos:pos + width])
            if child is None:
                break
            path.append(child)
            node = child
            pos += width
        if pos >= size:
            return path
        # the rest is new: a chain of fresh nodes (keys made lazily, see Node.digest). Every
        # full block's rolling prefix hash comes from one vectorised pass (per-block numpy
        # calls were most of a save's cost)
        deep = self.deep.get(root)
        if deep is None:
            deep = self.deep[root] = {}
        bt = self.block_tokens
        hashes = _prefix_hashes(_fingerprints(buf, bt)).tolist()
        chunk = buf[pos:pos + width]
        full = len(chunk) == width
        child = Node(node, chunk, pos // _TOKEN, None, hashes[pos // width] if full else 0, full)
        if node.children is NO_CHILDREN:
            node.children = {chunk: child}
        else:
            node.children[chunk] = child
        if node.by_first is not None:
            node.by_first.setdefault(chunk[:_TOKEN], []).append(child)
        while True:
            if full:
                deep.setdefault(child.end // bt << 64 | child.h, child)   # a collision: the first
            path.append(child)
            node = child
            pos += width
            if pos >= size:
                return path
            chunk = buf[pos:pos + width]
            full = len(chunk) == width
            child = Node(node, chunk, pos // _TOKEN, None, hashes[pos // width] if full else 0,
                         full)
            node.children = {chunk: child}      # a fresh node: its first child

    @staticmethod
    def _uncovered_tail(path: List[Node], tier: str) -> int:
        """The index in ``path`` from which no node is covered by an entry of ``tier`` (the
        nodes a tier covers are closed under parents: a suffix of any path is uncovered)."""
        i = len(path)
        while i > 0:
            entries = path[i - 1].entries
            if entries:     # (new or no longer covered nodes have none: the common case)
                for e in entries.values():
                    if e.tier == tier:
                        return i
            i -= 1
        return 0

    def add(self, entry: Entry) -> List[Node]:
        """Register ``entry``; returns the nodes newly covered in its tier (for events). The
        nodes a tier covers are closed under parents (an entry covers its whole path), so
        they are the end of the path below the deepest node already covered in the tier."""
        self.entries[entry.id] = entry
        path, eid = entry.path, entry.id
        fresh = path[self._uncovered_tail(path, entry.tier):]
        for node in path:
            node.entries[eid] = entry
        return fresh

    def remove(self, entry: Entry) -> List[Node]:
        """Drop ``entry``; nodes no entry covers any more leave the trie. Returns the nodes no
        longer covered in its tier (for events): the end of its path below the deepest node
        another entry of the tier still covers."""
        if self.entries.pop(entry.id, None) is None:
            return []
        return self._uncover(entry, entry.path)

    def truncate(self, entry: Entry, k: int) -> List[Node]:
        """Shorten the registered ``entry`` to its first ``k`` nodes (``0 < k < len(path)``;
        its length becomes their end): its tail's nodes no entry covers any more leave the
        trie. Returns the nodes no longer covered in its tier (for events). The entry keeps
        its id (and so its place in the eviction order)."""
        tail = entry.path[k:]
        entry.path = entry.path[:k]
        entry.length = entry.path[-1].end
        entry.buf = entry.buf[:_TOKEN * entry.length]
        return self._uncover(entry, tail)

    def _uncover(self, entry: Entry, path: List[Node]) -> List[Node]:
        """``entry`` no longer covers ``path`` (the end of its path, or all of it): drop it
        from those nodes and unlink the ones no entry covers; returns those its tier no longer
        covers."""
        eid = entry.id
        for node in path:
            del node.entries[eid]
        gone = path[self._uncovered_tail(path, entry.tier):]
        # the nodes no entry covers any more: the tail of the path that holds no entries and
        # only the next such node as a child. Only the top one is unlinked from its parent
        # (the rest go with it); the deeper ones only leave ``deep`` and drop their children
        # (no reference cycle left for the garbage collector; the parent link stays, so a
        # removed node's lazily made key can still be made). One dict operation per node
        # instead of a full unlink each: most of an evicting save's index work.
        deep, bt = self.deep.get(entry.root, {}), self.block_tokens
        top = None                      # the chain's top node so far (None: no chain)
        i = len(path)
        while i > 0:
            node = path[i - 1]
            if node.entries:
                break
            children = node.children
            if top is None:
                if children:
                    break
            elif len(children) != 1 or children.get(top.tok) is not top:
                break
            if top is not None:         # top is below node: it leaves ``deep`` here (the
                key = top.end // bt << 64 | top.h     # chain's top leaves it in _unlink)
                if top.full and deep.get(key) is top:
                    del deep[key]
            node.children = NO_CHILDREN
            node.by_first = None
            top = node
            i -= 1
        if top is not None:
            self._unlink(top, entry.root)
        for node in path[:i]:
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
            if node.full:
                deep = self.deep.get(root if root is not None else self._root_of(node), {})
                key = node.end // self.block_tokens << 64 | node.h
                if deep.get(key) is node:
                    del deep[key]
            lst = parent.by_first.get(node.tok[:_TOKEN]) if parent.by_first is not None \
                else None
            if lst is not None:
                lst.remove(node)
                if not lst:
                    del parent.by_first[node.tok[:_TOKEN]]
        if parent.parent is None and not parent.children:
            self.roots.pop(parent.digest, None)
            self.deep.pop(parent.digest, None)

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


__all__ = ["BlockIndex", "Entry", "Match", "Node", "hex_keys"]
