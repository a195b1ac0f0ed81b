"""Byte tiers under the prefix store: a disk directory (:class:`DiskTier`) and a Redis/Valkey
server (:class:`RedisTier`, whose ``redis`` client is imported only when one is built). The
protocol they share is :class:`ByteTier` (``base.py``); :func:`open_tier` builds one from the
store's ``disk_dir`` or ``remote`` argument."""

from __future__ import annotations

import os
from typing import Optional

from .base import FORMAT_VERSION, ByteTier
from .disk import DiskTier

__all__ = ["ByteTier", "DiskTier", "FORMAT_VERSION", "open_tier", "is_url"]

_URL_SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://")


def is_url(spec) -> bool:
    """Whether ``spec`` names a Redis/Valkey server (a ``redis://``-like URL), not a directory."""
    return isinstance(spec, str) and spec.lower().startswith(_URL_SCHEMES)


def open_tier(spec, namespace: str, budget_bytes: int, timeout: Optional[float] = None) -> ByteTier:
    """The tier ``spec`` names: a :class:`RedisTier` for ``"redis://host:port/db?..."`` (also
    ``rediss://``, ``unix://``, ``valkey://``; query parameters such as ``socket_timeout=0.5``
    go to the redis client and win over ``timeout``), else a :class:`DiskTier` in the directory
    ``spec`` (a str or ``os.PathLike``; created if absent).

    For a URL, ``budget_bytes=0`` means "not given" (``PrefixStore`` has no remote budget
    argument): the URL's ``budget_bytes`` query parameter, else
    :data:`~numbakv.prefix.tiers.redis.DEFAULT_BUDGET_BYTES` (1 GiB); a ``budget_bytes`` in the
    URL always wins. For a directory, 0 stores nothing.

    ``timeout`` (seconds, default 0.5 for Redis, 2.0 for disk): how long a request may wait
    for the server / for the directory's shared lock before it counts as a miss.
    Raises ``ValueError`` for a bad spec, namespace, budget or timeout and for a directory that
    cannot be used (unreadable, read-only, not a directory); ``ImportError`` (with the install
    hint) for a URL when the ``redis`` client is not installed."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
    if is_url(spec):
        from .redis import RedisTier
        return RedisTier(namespace, budget_bytes, spec,
                         timeout=0.5 if timeout is None else timeout)
    if isinstance(spec, str) and "://" in spec:
        raise ValueError(f"unsupported tier URL {spec!r}: use redis://, rediss://, unix:// or "
                         "valkey://, or a directory path")
    if not isinstance(spec, (str, os.PathLike)) or isinstance(spec, bytes):
        raise ValueError(f"spec must be a directory path or a redis:// URL, got {spec!r:.80}")
    return DiskTier(namespace, budget_bytes, spec, lock_timeout=2.0 if timeout is None else timeout)
