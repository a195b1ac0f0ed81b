"""Tier 3 of the prefix store: runs kept in a Redis or Valkey server (the ``redis`` client speaks
to both), shared by every process and host that reaches it. The client is imported here only,
when the tier is built (``pip install 'numbakv[remote]'``).

Keys, all under the prefix ``nkv:t1:{<namespace>}:`` (``t1``: this layout's format version; the
namespace digests model fingerprint, storage layout and head range; the braces are a Redis Cluster
hash tag, so one namespace lives in one slot)::

    r:<run key>     string   the run's bytes as given (a SeqSnapshot.to_bytes() file)
    w:<run>.<rand>  string   a value being written (plain SET, expires in 2 minutes), renamed
                             to r:<run key> by the write script in the same round trip
    b:<block key>   string   "<run key>:<index of the block in the run>"  (pointer)
    meta            hash     run key -> "<accounted bytes>|<block key>,<block key>,..."
    lru             zset     run key -> time of last write or read (seconds, the writer's clock)
    bytes           string   accounted bytes of the namespace (sum over meta)
    stats           hash     hits, misses, writes, evictions, invalid (all processes)

Block and run keys already hash the salt (tenant), so tenants never share a key.

**Round trips.** ``find_blocks`` is one ``MGET`` of the pointers; ``read_runs`` is one pipeline
(``MGET`` of the values + ``ZADD XX`` of their LRU times + the counters this process has not
sent yet); ``write_run`` is one pipeline of a plain ``SET`` of the value under a staged key and
an ``EVALSHA`` that renames it into place (a run of >= 1 MiB handed in pieces: the ``SET`` is
sent piece by piece, never joined, then the ``EVALSHA``: two round trips); ``remove_run`` / ``clear`` are one ``EVALSHA``; the
value, its pointers and the books change atomically (other clients see all or nothing).

**Budget.** A shared server's ``maxmemory`` is not a per-model budget, so the tier keeps its own
books: a run accounts for its value's bytes plus its pointers' key and value bytes (Redis's own
per-key overhead, ~50-100 bytes, is not counted). The write script evicts the namespace's runs
with the oldest ``lru`` score (least recently written or read, by any process) until the new run
fits ``budget_bytes``, and drops a pointer only while it still points to the evicted run. If the
server itself evicted a value (``maxmemory-policy allkeys-*``), reads miss and the books are
corrected when the entry is next written or evicted.

**Faults.** Every ``RedisError``/``OSError`` (server down, refused, reset, slower than
``socket_timeout``) is a miss or a refused write, counted in ``stats()["errors"]``; no exception
escapes. The client does not retry (a retry would multiply the caller's timeout), and after a
connection failure the tier stops asking for a short, doubling pause (1 s, up to 30 s) so a dead
server costs each request nothing instead of a timeout. Values are returned as stored; the store
verifies them (``SeqSnapshot.from_bytes``: header, crc32, fingerprint) and calls
``report_invalid`` for corrupt or foreign ones, which drops them from the server.
"""

from __future__ import annotations

import os
import time
import urllib.parse
from typing import Dict, List, Optional, Sequence, Tuple

from .base import (FORMAT_VERSION, ByteTier, check_budget, check_chunks, check_key, check_keys,
                   check_namespace)

__all__ = ["RedisTier", "KEY_PREFIX", "DEFAULT_BUDGET_BYTES", "scan_server", "clear_server",
           "connect", "split_url"]

#: Every key of the tier starts with this, then ``{<namespace>}:``.
KEY_PREFIX = f"nkv:t{FORMAT_VERSION}:"
_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")
#: bytes a pointer costs in the books beyond its key and value text
_POINTER_OVERHEAD = 16
_PAUSE_FIRST, _PAUSE_MAX = 1.0, 30.0
#: milliseconds a staged value (``w:<run>.<random>``, set just before the write script renames
#: it into place) lives if its writer never gets to the script
_STAGED_MS = 120_000

# Lua helpers shared by the scripts. KEYS: meta, lru, bytes, stats; ARGV[1]: the key prefix.
# ``books()`` first: books that are not numbers (another client wrote them, a partial restore)
# are rebuilt from ``meta`` and counted (stats ``books_rebuilt``) instead of failing every write.
_LUA_DROP = """
local function bump(field, n)
  if not pcall(redis.call, 'HINCRBY', KEYS[4], field, n) then
    redis.call('HSET', KEYS[4], field, n)
  end
end
local function books()
  local used = tonumber(redis.call('GET', KEYS[3]) or '0')
  if used == nil or used < 0 or used ~= math.floor(used) then
    used = 0
    local all = redis.call('HGETALL', KEYS[1])
    for i = 2, #all, 2 do
      local sep = string.find(all[i], '|', 1, true)
      used = used + ((sep and tonumber(string.sub(all[i], 1, sep - 1))) or 0)
    end
    redis.call('SET', KEYS[3], used)
    bump('books_rebuilt', 1)
  end
  return used
end
local function drop(prefix, run, meta)
  local size = 0
  if meta then
    local sep = string.find(meta, '|', 1, true)
    if sep then
      size = tonumber(string.sub(meta, 1, sep - 1)) or 0
      local i = 0
      for bk in string.gmatch(string.sub(meta, sep + 1), '[^,]+') do
        local ptr = prefix .. 'b:' .. bk
        if redis.call('GET', ptr) == run .. ':' .. i then redis.call('DEL', ptr) end
        i = i + 1
      end
    end
    redis.call('HDEL', KEYS[1], run)
    redis.call('DECRBY', KEYS[3], size)
  end
  redis.call('ZREM', KEYS[2], run)
  redis.call('DEL', prefix .. 'r:' .. run)
  return size
end
"""

# ARGV: prefix, run, staged value key, accounted size, budget, now, blocks csv. The value was
# SET under the staged key (same hash slot, with an expiry) in the same pipeline: the script
# renames it into place instead of receiving the bytes as an argument (which would copy the
# whole run twice more inside the server: into a Lua string, then into the value).
_LUA_WRITE = _LUA_DROP + """
local prefix, run, size, budget = ARGV[1], ARGV[2], tonumber(ARGV[4]), tonumber(ARGV[5])
local staged = ARGV[3]
books()
if redis.call('EXISTS', staged) == 0 then return -2 end
local meta = redis.call('HGET', KEYS[1], run)
if meta then
  local sep = string.find(meta, '|', 1, true)
  if sep and redis.call('EXISTS', prefix .. 'r:' .. run) == 1 and
     string.sub(meta, sep + 1) == ARGV[7] then
    -- already stored: point its blocks at it again (a pointer rewritten to another run heals)
    local i = 0
    for bk in string.gmatch(ARGV[7], '[^,]+') do
      redis.call('SET', prefix .. 'b:' .. bk, run .. ':' .. i)
      i = i + 1
    end
    redis.call('ZADD', KEYS[2], ARGV[6], run)
    redis.call('DEL', staged)
    return 0
  end
  drop(prefix, run, meta)
end
if size > budget then
  redis.call('DEL', staged)
  return -1
end
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
local evicted = 0
while used + size > budget do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then
    -- books say bytes are used but no run is listed: they drifted; start them again
    redis.call('SET', KEYS[3], 0)
    used = 0
  else
    drop(prefix, oldest[1], redis.call('HGET', KEYS[1], oldest[1]))
    used = tonumber(redis.call('GET', KEYS[3]) or '0')
    evicted = evicted + 1
  end
end
redis.call('RENAME', staged, prefix .. 'r:' .. run)
redis.call('PERSIST', prefix .. 'r:' .. run)
local i = 0
for bk in string.gmatch(ARGV[7], '[^,]+') do
  redis.call('SET', prefix .. 'b:' .. bk, run .. ':' .. i)
  i = i + 1
end
redis.call('HSET', KEYS[1], run, ARGV[4] .. '|' .. ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[6], run)
redis.call('INCRBY', KEYS[3], size)
bump('writes', 1)
if evicted > 0 then bump('evictions', evicted) end
return evicted + 1
"""

# ARGV: prefix, run, invalid (0/1)
_LUA_REMOVE = _LUA_DROP + """
books()
drop(ARGV[1], ARGV[2], redis.call('HGET', KEYS[1], ARGV[2]))
if ARGV[3] == '1' then bump('invalid', 1) end
return 1
"""

# ARGV: prefix
_LUA_CLEAR = _LUA_DROP + """
books()
local runs = redis.call('HKEYS', KEYS[1])
for _, run in ipairs(runs) do drop(ARGV[1], run, redis.call('HGET', KEYS[1], run)) end
for _, run in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do drop(ARGV[1], run, nil) end
redis.call('SET', KEYS[3], 0)
return #runs
"""


#: runs in pieces at least this large are sent unjoined (``RedisTier._set_pieces``); smaller
#: ones are joined (a cheap copy) to keep the write to one round trip
_UNJOINED_BYTES = 1 << 20

#: the namespace's budget when neither the caller nor the URL (``?budget_bytes=``) gives one
DEFAULT_BUDGET_BYTES = 1 << 30


def split_url(url: str) -> Tuple[str, Optional[int]]:
    """``(client URL, budget)``: ``url`` checked, ``valkey://`` spelled ``redis://`` for the
    client, and its ``budget_bytes`` query parameter (numbakv's, not the client's) taken out
    (``None`` when absent). ``ValueError`` for anything else than a Redis/Valkey URL."""
    if not isinstance(url, str):
        raise ValueError(f"remote must be a URL string such as 'redis://host:6379/0', "
                         f"got {type(url).__name__}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"remote must be a redis://, rediss://, unix://, valkey:// or "
                         f"valkeys:// URL, got {url!r}")
    # the redis client knows redis(s)://; Valkey speaks the same protocol
    scheme = "redis" + parts.scheme[len("valkey"):] if parts.scheme.startswith("valkey") \
        else parts.scheme
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    budget = None
    kept = []
    for name, value in query:
        if name == "budget_bytes":
            try:
                budget = check_budget(int(value))
            except ValueError:
                raise ValueError(f"remote: budget_bytes must be an int >= 0, got {value!r}") \
                    from None
        else:
            kept.append((name, value))
    # spelled out rather than urlunsplit: that drops the "//" of an empty netloc, and the
    # client refuses "unix:/path" (it needs "unix:///path")
    query_text = urllib.parse.urlencode(kept)
    url = (f"{scheme}://{parts.netloc}{parts.path}" + (f"?{query_text}" if query_text else "")
           + (f"#{parts.fragment}" if parts.fragment else ""))
    return url, budget


def connect(url: str, timeout: float = 0.5):
    """A ``redis.Redis`` client for ``url`` that never retries and gives up after ``timeout``
    seconds (connect and each reply) unless the URL's query sets ``socket_timeout`` /
    ``socket_connect_timeout``; ``ValueError`` for a bad URL or option, ``ImportError`` with the
    install hint when the ``redis`` client is missing."""
    url = split_url(url)[0]
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the Redis/Valkey tier needs the redis client: "
                          "pip install 'numbakv[remote]'") from exc
    try:
        client = redis.Redis.from_url(url, socket_timeout=float(timeout),
                                      socket_connect_timeout=float(timeout),
                                      retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"remote {url!r}: {exc}") from exc
    if client.connection_pool.connection_kwargs.get("decode_responses"):
        raise ValueError("remote: decode_responses must be off (values are bytes)")
    return client


class RedisTier(ByteTier):
    """Runs in a Redis or Valkey server (see the module docstring for keys, round trips, the
    budget and faults).

    Parameters
    ----------
    namespace, budget_bytes
        As for every :class:`~numbakv.prefix.tiers.base.ByteTier`.
    url : str
        ``redis://[user:password@]host:port/db[?socket_timeout=0.5&budget_bytes=N&...]`` (also
        ``rediss://``, ``unix://``, and ``valkey://`` as a synonym); ``budget_bytes`` is the
        namespace's budget (it wins over the argument; the store has no separate remote budget
        argument); the other query parameters go to the redis client.
    timeout : float
        Seconds for connecting and for each reply when the URL does not say; a server down or
        stalled longer is a miss.
    """

    name = "redis"

    def __init__(self, namespace: str, budget_bytes: int, url: str, *,
                 timeout: float = 0.5) -> None:
        check_namespace(namespace)
        check_budget(budget_bytes)
        in_url = split_url(url)[1]
        if in_url is not None:
            budget_bytes = in_url
        elif budget_bytes == 0:  # not given (PrefixStore has no remote budget argument)
            budget_bytes = DEFAULT_BUDGET_BYTES
        client = connect(url, timeout)
        super().__init__(namespace, budget_bytes)
        import redis
        self._errors_caught = (redis.RedisError, OSError)
        self._down_errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self.url = url
        self._client = client
        self._prefix = f"{KEY_PREFIX}{{{namespace}}}:"
        p = self._prefix
        self._books = [p + "meta", p + "lru", p + "bytes", p + "stats"]
        self._write = client.register_script(_LUA_WRITE)
        self._remove = client.register_script(_LUA_REMOVE)
        self._clear = client.register_script(_LUA_CLEAR)
        self._pending = [0, 0]          # hits, misses not sent to the server's stats yet
        self._down_until = 0.0
        self._pause = _PAUSE_FIRST

    # -- failure handling ----------------------------------------------------------------------
    def _available(self) -> bool:
        return not self._closed and time.monotonic() >= self._down_until

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            self._counts["errors"] += 1
            if isinstance(exc, self._down_errors):
                self._down_until = time.monotonic() + self._pause
                self._pause = min(self._pause * 2, _PAUSE_MAX)

    def _ok(self) -> None:
        self._pause = _PAUSE_FIRST

    # -- the protocol --------------------------------------------------------------------------
    def find_blocks(self, block_keys: Sequence[str]) -> List[Optional[Tuple[str, int]]]:
        keys = check_keys(block_keys, "block_keys")
        out: List[Optional[Tuple[str, int]]] = [None] * len(keys)
        if keys and self._available():
            p = self._prefix + "b:"
            try:
                values = self._client.mget([p + k for k in keys])
                self._ok()
            except self._errors_caught as exc:
                self._failed(exc)
                values = []
            for i, value in enumerate(values):
                if value is None:
                    continue
                try:
                    run, _, idx = value.decode("ascii").rpartition(":")
                    out[i] = (check_key(run), int(idx))
                except (ValueError, UnicodeDecodeError, AttributeError):
                    self._count("errors")   # a pointer someone else wrote: not ours
        found = sum(1 for x in out if x is not None)
        with self._lock:
            self._counts["block_hits"] += found
            self._counts["block_misses"] += len(keys) - found
        return out

    def read_runs(self, run_keys: Sequence[str]) -> List[Optional[bytes]]:
        runs = check_keys(run_keys, "run_keys")
        out: List[Optional[bytes]] = [None] * len(runs)
        if runs and self._available():
            p = self._prefix + "r:"
            with self._lock:
                pending, self._pending = self._pending, [0, 0]
            try:
                pipe = self._client.pipeline(transaction=False)
                pipe.mget([p + r for r in runs])
                pipe.zadd(self._books[1], {r: time.time() for r in runs}, xx=True)
                if pending[0]:
                    pipe.hincrby(self._books[3], "hits", pending[0])
                if pending[1]:
                    pipe.hincrby(self._books[3], "misses", pending[1])
                values = pipe.execute()[0]
                self._ok()
                out = [v if isinstance(v, bytes) else None for v in values]
            except self._errors_caught as exc:
                self._failed(exc)
                with self._lock:
                    self._pending[0] += pending[0]
                    self._pending[1] += pending[1]
        hits = sum(1 for x in out if x is not None)
        with self._lock:
            self._counts["hits"] += hits
            self._counts["misses"] += len(runs) - hits
            self._pending[0] += hits
            self._pending[1] += len(runs) - hits
        return out

    def write_run(self, run_key: str, block_keys: Sequence[str], data: bytes) -> bool:
        run = check_key(run_key, "run_key")
        keys = check_keys(block_keys, "block_keys")
        chunks = check_chunks(data)
        nbytes = sum(len(c) for c in chunks)
        size = nbytes + sum(len(k) + len(run) + _POINTER_OVERHEAD for k in keys)
        if size > self.budget_bytes or not self._available():
            return False
        # the value goes up with a plain SET under a staged key that expires (a writer that
        # dies mid-way leaves nothing behind); the script then renames it into place with its
        # pointers and books, atomically
        staged = f"{self._prefix}w:{run}.{os.urandom(6).hex()}"
        args = [self._prefix, run, staged, size, self.budget_bytes, repr(time.time()),
                ",".join(keys)]
        try:
            if len(chunks) > 1 and nbytes >= _UNJOINED_BYTES:
                # a large run in pieces (a snapshot's header + views of each layer's rows):
                # the SET's bytes go out piece by piece, never joined into one buffer (the join
                # was a fresh copy of the whole run: ~0.15-0.3 s of page faults and copying at
                # 256 MiB, a third of the store's time); then the script, one more round trip
                self._set_pieces(staged, chunks, nbytes)
                result = self._write(keys=self._books, args=args)
            else:          # one round trip: SET and the script in one pipeline
                pipe = self._client.pipeline(transaction=False)
                pipe.set(staged, chunks[0] if len(chunks) == 1 else b"".join(chunks),
                         px=_STAGED_MS)
                self._write(keys=self._books, args=args, client=pipe)
                result = pipe.execute()[1]
            self._ok()
        except self._errors_caught as exc:
            self._failed(exc)
            return False
        result = int(result)
        if result < 0:
            return False
        if result > 0:
            with self._lock:
                self._counts["writes"] += 1
                self._counts["evictions"] += result - 1
        return True

    def _set_pieces(self, key: str, chunks: Sequence[memoryview], nbytes: int) -> None:
        """``SET key <the chunks joined> PX <staged expiry>`` with the value sent as the chunks
        themselves: the command is framed here (RESP: an array of bulk strings, which every
        Redis/Valkey server reads whatever protocol the client negotiated) and written to one
        pooled connection with the client's own ``send_packed_command``, which hands each piece
        to ``sendall``. A fault disconnects that connection (the client's own rule) and raises
        the client's error."""
        name = key.encode()
        expiry = b"%d" % _STAGED_MS
        head = (b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, nbytes))
        tail = b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(expiry), expiry)
        pool = self._client.connection_pool
        try:
            conn = pool.get_connection()
        except TypeError:      # redis-py < 6 names the command
            conn = pool.get_connection("SET")
        try:
            conn.send_packed_command([head, *chunks, tail])
            reply = conn.read_response()
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        if reply not in (b"OK", "OK", True):
            import redis
            raise redis.ResponseError(f"SET of a staged run answered {reply!r}")

    def remove_run(self, run_key: str) -> None:
        self._remove_run(check_key(run_key, "run_key"), False)

    def _remove_run(self, run: str, invalid: bool) -> None:
        if not self._available():
            return
        try:
            self._remove(keys=self._books, args=[self._prefix, run, "1" if invalid else "0"])
            self._ok()
        except self._errors_caught as exc:
            self._failed(exc)

    def report_invalid(self, run_key: str) -> None:
        run = check_key(run_key, "run_key")
        self._count("invalid")
        self._remove_run(run, True)

    def clear(self) -> int:
        if not self._available():
            return 0
        try:
            n = int(self._clear(keys=self._books, args=[self._prefix]))
            self._ok()
            return n
        except self._errors_caught as exc:
            self._failed(exc)
            return 0

    def stats(self) -> dict:
        used = entries = 0
        server: Dict[str, int] = {}
        if self._available():
            try:
                pipe = self._client.pipeline(transaction=False)
                pipe.get(self._books[2])
                pipe.hlen(self._books[0])
                pipe.hgetall(self._books[3])
                raw_used, entries, raw_stats = pipe.execute()
                try:
                    used = int(raw_used or 0)
                except ValueError:   # books another client broke: the next write rebuilds them
                    used = 0
                server = {}
                for k, v in raw_stats.items():
                    try:
                        server[k.decode()] = int(v)
                    except (ValueError, UnicodeDecodeError):
                        pass
                self._ok()
            except (ValueError, *self._errors_caught) as exc:
                self._failed(exc)
        out = self._budget_stats(used, entries)
        with self._lock:
            pending = list(self._pending)
        out.update(hits_all_processes=server.get("hits", 0) + pending[0],
                   misses_all_processes=server.get("misses", 0) + pending[1],
                   books_rebuilt=server.get("books_rebuilt", 0),
                   url=self.url)
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            pending, self._pending = self._pending, [0, 0]
        if (pending[0] or pending[1]) and self._available():
            try:
                pipe = self._client.pipeline(transaction=False)
                pipe.hincrby(self._books[3], "hits", pending[0])
                pipe.hincrby(self._books[3], "misses", pending[1])
                pipe.execute()
            except self._errors_caught:
                pass
        super().close()
        try:
            self._client.close()
        except self._errors_caught:
            pass


# -- whole-server operations (numbakv store stats / clear) -------------------------------------
def _server_namespaces(client) -> List[str]:
    found = set()
    for key in client.scan_iter(match=f"{KEY_PREFIX}{{*}}:meta", count=1000):
        key = key.decode("utf-8", "replace")
        ns = key[len(KEY_PREFIX) + 1:-len("}:meta")]
        try:
            found.add(check_namespace(ns))
        except ValueError:
            pass
    return sorted(found)


def _fingerprint_of(value: Optional[bytes]) -> Optional[dict]:
    import json
    try:
        n = int.from_bytes(value[:8], "little")
        header = json.loads(value[8:8 + n])
        meta = header["__metadata__"]
        config = json.loads(meta["config"])
        fp = config.get("fingerprint", config)
        if isinstance(fp, dict) and "meta.model_id" in meta:
            fp = {"model_id": meta["meta.model_id"], **fp}   # the store's model identity
        return fp if isinstance(fp, dict) else None
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


def scan_server(url: str, timeout: float = 2.0) -> dict:
    """What the server holds per namespace: ``{"namespaces": {ns: {"entries", "bytes", "hits",
    "misses", "fingerprint"}}, "entries", "bytes"}`` (for ``numbakv store stats``). Raises
    ``ConnectionError`` when the server cannot be reached."""
    client = connect(url, timeout)
    import redis
    try:
        out: dict = {"namespaces": {}, "entries": 0, "bytes": 0}
        for ns in _server_namespaces(client):
            p = f"{KEY_PREFIX}{{{ns}}}:"
            entries = client.hlen(p + "meta")
            nbytes = int(client.get(p + "bytes") or 0)
            st = {k.decode(): int(v) for k, v in client.hgetall(p + "stats").items()}
            first = client.zrange(p + "lru", -1, -1)
            value = client.getrange(p + "r:" + first[0].decode(), 0, 1 << 16) if first else None
            out["namespaces"][ns] = {"entries": entries, "bytes": nbytes,
                                     "hits": st.get("hits", 0), "misses": st.get("misses", 0),
                                     "fingerprint": _fingerprint_of(value)}
            out["entries"] += entries
            out["bytes"] += nbytes
        return out
    except redis.RedisError as exc:
        raise ConnectionError(f"{url}: {exc}") from exc
    finally:
        client.close()


def clear_server(url: str, namespace: Optional[str] = None, timeout: float = 2.0) -> Dict[str, int]:
    """Remove every namespace's runs on the server (or those whose namespace contains
    ``namespace``); returns ``{namespace: runs removed}``. ``ConnectionError`` when the server
    cannot be reached."""
    client = connect(url, timeout)
    import redis
    try:
        out = {}
        for ns in _server_namespaces(client):
            if namespace and namespace not in ns:
                continue
            p = f"{KEY_PREFIX}{{{ns}}}:"
            script = client.register_script(_LUA_CLEAR)
            out[ns] = int(script(keys=[p + "meta", p + "lru", p + "bytes", p + "stats"],
                                 args=[p]))
        return out
    except redis.RedisError as exc:
        raise ConnectionError(f"{url}: {exc}") from exc
    finally:
        client.close()
