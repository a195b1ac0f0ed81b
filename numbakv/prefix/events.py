"""KV events of the prefix store, shaped like vLLM's (``vllm/distributed/kv_events.py``) so a
router that follows vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` stream can
follow a numbakv store, plus an optional ZeroMQ publisher (``pip install pyzmq``; imported only
when a publisher is made).

Each event is a plain dict:

* ``{"type": "BlockStored", "block_hashes": [hex, ...], "parent_block_hash": hex | None,
  "token_ids": [int, ...], "block_size": int, "lora_id": None, "medium": tier}`` - blocks that
  became held in ``medium`` (consecutive blocks of one prompt; the last one may be a partial
  block, then ``token_ids`` is shorter than ``len(block_hashes) * block_size``), plus two
  extra fields: ``"priority"`` (0..100) and ``"ttl"`` (seconds left, or None) of the entry's
  retention (None for the lower tiers). Token ids under ``extra_keys`` ranges appear as the
  store's keyed ids (``2**62 +`` a hash of the key, the offset and the token);
* ``{"type": "BlockRemoved", "block_hashes": [hex, ...], "medium": tier}``;
* ``{"type": "AllBlocksCleared"}``.

``medium`` is the store's tier name: ``"cells"`` (the cache's own cells, on the cache's
device), ``"host"`` (host RAM), and the lower tiers' names (``"disk"``, ``"redis"``).
"""

from __future__ import annotations

import json
import threading
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .index import hex_keys


def block_stored(nodes: Sequence[Any], block_size: int, medium: str, *,
                 priority: Optional[int] = None, ttl: Optional[float] = None) -> Dict[str, Any]:
    """A ``BlockStored`` event for consecutive index nodes of one prompt; ``priority`` and
    ``ttl`` (seconds left, None: no expiry) are the entry's retention (extra fields beside
    vLLM's; None in the lower tiers, which keep no retention)."""
    return block_stored_later(nodes, block_size, medium, priority=priority, ttl=ttl)[0]()


def block_removed(nodes: Sequence[Any], medium: str) -> Dict[str, Any]:
    return block_removed_later(nodes, medium)[0]()


#: an event not formatted yet, and its size estimate (:func:`event_nbytes` of the event)
Later = Tuple[Callable[[], Dict[str, Any]], int]


def block_stored_later(nodes: Sequence[Any], block_size: int, medium: str, *,
                       priority: Optional[int] = None, ttl: Optional[float] = None) -> Later:
    """:func:`block_stored`, formatted when read (:meth:`EventLog.emit_later`): the hex block
    hashes and the token id list of a 2k-token prompt were a tenth of a ``save``, and a store
    nobody reads events from never needs them. What the event says is fixed now (the nodes'
    digests and tokens never change; their parent's digest is taken now)."""
    nodes = list(nodes)
    parent = nodes[0].parent      # (a node's parent and key never change: read them later)
    if parent is not None and parent.parent is None:
        parent = None             # a root: the first block has no parent block

    def make() -> Dict[str, Any]:
        toks = np.frombuffer(b"".join(n.tok for n in nodes), dtype="<i8")
        return {"type": "BlockStored", "block_hashes": hex_keys(nodes),
                "parent_block_hash": None if parent is None else parent.digest.hex(),
                "token_ids": toks.tolist(), "block_size": block_size, "lora_id": None,
                "medium": medium, "priority": priority, "ttl": ttl}
    n_tokens = sum(len(n.tok) for n in nodes) // 8
    return make, 400 + 40 * n_tokens + 100 * len(nodes)


def block_removed_later(nodes: Sequence[Any], medium: str) -> Later:
    """:func:`block_removed`, formatted when read."""
    nodes = list(nodes)

    def make() -> Dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": hex_keys(nodes),
                "medium": medium}
    return make, 400 + 100 * len(nodes)


def all_cleared() -> Dict[str, Any]:
    return {"type": "AllBlocksCleared"}


#: default bound of the events waiting for ``take`` (estimated bytes of their Python objects)
DEFAULT_MAX_BYTES = 4 << 20


def event_nbytes(event: Dict[str, Any]) -> int:
    """A cheap estimate of the memory an event holds: a dict, ~40 bytes per token id (list slot
    + int object) and ~100 per block hash (hex str + list slot)."""
    return 400 + 40 * len(event.get("token_ids", ())) + 100 * len(event.get("block_hashes", ()))


class EventLog:
    """Events waiting for ``take``, bounded in bytes (``max_bytes``, estimated by
    :func:`event_nbytes`; 0 keeps none): past it the oldest are dropped and counted in
    ``dropped``, so a store nobody reads holds at most ``max_bytes`` of events whatever the
    prompts' lengths (a bound by count let 8k-token prompts hold gigabytes). Every event is
    also fanned out to an optional publisher as it happens, kept or not."""

    def __init__(self, limit: int = 100_000, publisher: Optional["ZmqPublisher"] = None,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        self.limit = limit
        self.max_bytes = int(max_bytes)
        self.events: Deque[Any] = deque()   # dicts, or the makers of events not formatted yet
        self._sizes: Deque[int] = deque()
        self.nbytes = 0
        self.dropped = 0
        self.publisher = publisher

    def emit(self, event: Dict[str, Any]) -> None:
        if self.publisher is not None:
            self.publisher.publish([event])
        self._keep(event, event_nbytes(event))

    def emit_later(self, later: Later) -> None:
        """Keep an event formatted only when :meth:`take` reads it (``later``: ``(make,
        size)``, e.g. :func:`block_stored_later`); with a publisher it is formatted and
        published now."""
        make, size = later
        if self.publisher is not None:
            self.emit(make())
            return
        self._keep(make, size)

    def _keep(self, event: Any, size: int) -> None:
        if size > self.max_bytes:
            self.dropped += 1
            return
        self.events.append(event)
        self._sizes.append(size)
        self.nbytes += size
        while self.nbytes > self.max_bytes or len(self.events) > self.limit:
            self.events.popleft()
            self.nbytes -= self._sizes.popleft()
            self.dropped += 1

    def take(self) -> List[Dict[str, Any]]:
        out = [e if isinstance(e, dict) else e() for e in self.events]
        self.events.clear()
        self._sizes.clear()
        self.nbytes = 0
        return out


class ZmqPublisher:
    """Publishes event batches on a ZeroMQ PUB socket, as vLLM's ``ZmqEventPublisher`` does:
    each message is ``[topic, sequence number (8 bytes big-endian), JSON payload]`` where the
    payload is ``{"ts": float, "events": [...]}``. Subscribers connect a SUB socket to
    ``endpoint`` (e.g. ``"tcp://127.0.0.1:5557"``). Publishing never blocks the store: messages a
    slow subscriber cannot take are dropped by ZeroMQ (high-water mark).

    Args:
        endpoint: where to bind, e.g. ``"tcp://127.0.0.1:5557"`` or ``"tcp://127.0.0.1:*"``
            (``self.endpoint`` then holds the port picked).
        topic: the message topic (bytes or str).
    """

    def __init__(self, endpoint: str, topic: str = "kv-events") -> None:
        try:
            import zmq
        except ImportError as exc:  # pragma: no cover - pyzmq is in the test extra
            raise ImportError("the KV events publisher needs pyzmq: pip install pyzmq") from exc
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(f"endpoint must be a ZeroMQ endpoint such as "
                             f"'tcp://127.0.0.1:5557', got {endpoint!r}")
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.topic = topic.encode() if isinstance(topic, str) else bytes(topic)
        self._seq = 0
        self._lock = threading.Lock()

    def publish(self, events: List[Dict[str, Any]]) -> None:
        import time
        payload = json.dumps({"ts": time.time(), "events": events}).encode()
        with self._lock:
            self._seq += 1
            try:
                self._sock.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload],
                                          flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                pass   # no room at the high-water mark: dropped, never blocking the engine

    def close(self) -> None:
        self._sock.close(0)


__all__ = ["block_stored", "block_removed", "block_stored_later", "block_removed_later", "all_cleared", "EventLog", "ZmqPublisher",
           "event_nbytes", "DEFAULT_MAX_BYTES"]
