"""A group of worker processes joined by a gloo process group over loopback, for the
``numbakv.dist`` tests: spawned once per test module (imports cost seconds), each scenario runs
on every rank and returns per-rank results; bounded in time; children killed at teardown."""

from __future__ import annotations

import datetime
import importlib
import os
import queue
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as tdist
    torch.set_num_threads(1)   # 2 cores shared by every rank
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world, timeout=datetime.timedelta(seconds=60))
    # compile numbakv's code paths here, every rank at once, so that the first scenario's
    # timeouts do not run while a peer is still compiling (a cold numba cache takes a minute)
    import dist_scenarios
    dist_scenarios.warm_up()
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        module, name, kwargs = task
        try:
            fn = getattr(importlib.import_module(module), name)
            value = fn(rank, world, **kwargs)
            results.put((rank, "ok", value))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results.put((rank, "error", f"{type(exc).__name__}: {exc}\n"
                                        f"{traceback.format_exc()}"))
    # no destroy_process_group: with a dead peer it can block; the process exits instead
    results.close()
    results.join_thread()
    os._exit(0)


class Group:
    """``world`` spawned processes (torch.multiprocessing, spawn) in one gloo group."""

    def __init__(self, world: int, start_timeout: float = 300.0) -> None:
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.world = world
        self.broken = False
        port = free_port()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.tasks[r],
                                                        self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        try:
            self._collect(start_timeout, "ready")
        except BaseException:
            self.close()
            raise

    def _collect(self, timeout: float, want: str) -> list:
        out = [None] * self.world
        got = set()
        deadline = time.monotonic() + timeout
        errors = []
        while len(got) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world)) - got)
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:g} s"
                                   + (": " + "\n".join(errors) if errors else ""))
            try:
                rank, status, value = self.results.get(timeout=min(left, 1.0))
            except queue.Empty:
                # a rank that exited without reporting (a scenario may kill one on purpose)
                for r, p in enumerate(self.procs):
                    if r not in got and not p.is_alive():
                        got.add(r)
                        out[r] = {"died": p.exitcode}
                continue
            if rank in got:
                continue
            got.add(rank)
            if status == "error":
                errors.append(f"rank {rank}: {value}")
            out[rank] = value if status != "error" else None
        if want == "ready" and any(isinstance(o, dict) and "died" in o for o in out):
            raise RuntimeError(f"a rank died while starting: {out}")
        if errors:
            raise AssertionError("\n".join(errors))
        return out

    def run(self, module: str, name: str, timeout: float = 120.0, **kwargs) -> list:
        """Run ``module.name(rank, world, **kwargs)`` on every rank; per-rank return values."""
        for q in self.tasks:
            q.put((module, name, kwargs))
        return self._collect(timeout, "ok")

    def close(self) -> None:
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001
                    pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)


os.environ.setdefault("OMP_NUM_THREADS", "1")
