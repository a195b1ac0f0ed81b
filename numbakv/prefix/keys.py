"""Content keys of token blocks: a chained ``hashlib.blake2b`` over the token ids (int64
little-endian bytes), the parent block's key, and a root that folds in the caller's salt and the
cache's model fingerprint + storage layout + head range.

Never Python's ``hash()``: it is seeded per process (``PYTHONHASHSEED``), so keys made with it
would never match between processes (LMCache lost every cross-process hit that way). These keys
are the same in every process, on every machine, for the same model, layout, salt and tokens.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, List, Mapping, Sequence

import numpy as np

#: bytes of a digest (128 bits: collisions are not a concern at any realistic store size)
DIGEST_BYTES = 16
#: the key format version, part of every root: a change of the scheme changes every key
KEY_VERSION = b"numbakv-prefix-1"
#: the marker hashed between a block's parent digest and its tokens: a full block of
#: block_tokens tokens, or a partial last block (never confused with a full one)
FULL_MARK = _FULL = b"B"
TAIL_MARK = _TAIL = b"T"
_blake2b = hashlib.blake2b


def root_digest(salt: bytes, fingerprint: Mapping[str, Any], layout: Mapping[str, Any]) -> bytes:
    """The parent digest of a prompt's first block: blake2b over the key version, ``salt``
    (tenant isolation: two salts never share a key), and the canonical JSON of the model
    ``fingerprint`` and storage ``layout`` (e.g. head range, group structure)."""
    if not isinstance(salt, (bytes, bytearray)):
        raise ValueError(f"salt must be bytes, got {type(salt).__name__}")
    doc = json.dumps({"fingerprint": fingerprint, "layout": layout}, sort_keys=True,
                     separators=(",", ":"), default=str).encode()
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"nkv-root")
    h.update(KEY_VERSION)
    h.update(len(salt).to_bytes(8, "little"))
    h.update(bytes(salt))
    h.update(doc)
    return h.digest()


def namespace(fingerprint: Mapping[str, Any], layout: Mapping[str, Any]) -> str:
    """``"nkv1-<16 hex>"``: the lower tiers' namespace for this model + layout (+ heads)."""
    return "nkv1-" + root_digest(b"", fingerprint, layout).hex()[:16]


def block_digest(parent: bytes, token_bytes: bytes, full: bool) -> bytes:
    """The digest of one block: blake2b(parent digest, full/tail marker, int64-LE token bytes)."""
    # the same digest as blake2b(parent + marker + tokens); made empty and then updated: passing
    # the data to the constructor costs ~3x as much (CPython's keyword-argument path)
    h = _blake2b(digest_size=DIGEST_BYTES)
    h.update(parent)
    h.update(_FULL if full else _TAIL)
    h.update(token_bytes)
    return h.digest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as the bytes keys hash: int64 little-endian."""
    return np.asarray(tokens, dtype="<i8").tobytes()


def block_keys(tokens: Sequence[int], block_tokens: int, root: bytes) -> List[str]:
    """Hex keys of ``tokens``'s blocks: one per full block, then one for the partial last block
    if ``len(tokens)`` is not a multiple of ``block_tokens``. Key ``i`` depends on every token of
    blocks ``0..i`` and on ``root``."""
    buf = token_bytes(tokens)
    width = 8 * block_tokens
    out: List[str] = []
    parent = root
    for start in range(0, len(buf), width):
        chunk = buf[start:start + width]
        parent = block_digest(parent, chunk, len(chunk) == width)
        out.append(parent.hex())
    return out


#: keyed token ids live in [2**62, 2**63): token ids below 2**62 (every real vocabulary) never
#: equal one, so a prompt with extra keys never aliases one without
KEYED_BIT = 1 << 62
_MASK62 = np.uint64(KEYED_BIT - 1)


def fold_extra_keys(buf: bytes, extra_keys) -> bytes:
    """``buf`` (int64-LE token ids) with the tokens of each ``(start, end, key_bytes)`` range
    replaced by *keyed ids*: ``2**62 + h(key_bytes, offset in the range, token id)`` (a 62-bit
    blake2b-seeded mix). Every key the store makes then depends on the extra key from the block
    holding ``start`` onwards (the chain carries it further), two images behind the same
    placeholder ids never share a key, and the tokens before ``start`` still share theirs.
    ``extra_keys`` must already be checked (sorted, non-overlapping, within ``buf``)."""
    if not extra_keys:
        return buf
    toks = np.frombuffer(buf, "<i8").astype(np.uint64)
    for start, end, key in extra_keys:
        seed = int.from_bytes(hashlib.blake2b(bytes(key), digest_size=8,
                                              person=b"nkv-extra").digest(), "little")
        x = (np.uint64(seed) + np.arange(end - start, dtype=np.uint64)
             * np.uint64(0x9E3779B97F4A7C15) + toks[start:end] * np.uint64(0xC2B2AE3D27D4EB4F))
        x ^= x >> np.uint64(30)          # splitmix64's finalizer (uint64 arrays wrap silently)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        toks[start:end] = (x & _MASK62) | np.uint64(KEYED_BIT)
    return toks.astype("<i8").tobytes()


__all__ = ["fold_extra_keys", "KEYED_BIT", "FULL_MARK", "TAIL_MARK", "root_digest", "namespace", "block_digest",
           "token_bytes", "block_keys",
           "DIGEST_BYTES", "KEY_VERSION"]
