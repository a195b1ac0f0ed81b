"""A waiting block barrier for Numba's CUDA simulator (installed by conftest.py when the simulator
is on).

The simulator runs each CUDA thread of a block as a Python thread. Its ``BlockManager`` finds
out that every thread reached ``cuda.syncthreads()`` by polling them in a loop that never sleeps
(numba-cuda 0.30: ``is_alive()`` and a flag per thread, over and over, until the block ends). The
polling thread competes with the block's threads for the GIL: measured on a decode-kernel test
it was about two thirds of the CPU time the simulator took. Here the barrier is a condition
variable instead: a thread arriving at ``syncthreads`` waits on it, and the last live thread to
arrive (or the last one to finish, when the others wait) releases the block; the manager just
joins the threads.

Semantics kept from the simulator: a barrier is passed when every thread still running has
reached it (a thread that returned no longer counts, as in the polling loop); a thread's
exception aborts the block (threads waiting at or reaching a later barrier raise) and the
launch re-raises the first exception raised, with the thread and block it came from.
"""

from __future__ import annotations

import threading

import numpy as np


def install() -> None:
    """Replace the simulator's ``BlockManager.run`` and ``BlockThread.run`` / ``syncthreads``
    (``syncthreads_count`` / ``_and`` / ``_or`` and grid-group syncs call ``syncthreads``)."""
    from numba.cuda.simulator import kernel as sim

    if getattr(sim.BlockManager, "_numbakv_waiting_barrier", False):
        return
    original_thread_run = sim.BlockThread.run

    def block_run(self, grid_point, *args):
        def target():
            self._f(*args)
        self._cond = threading.Condition()
        self._live = int(np.prod(self._block_dim))
        self._arrived = 0
        self._generation = 0
        self._failed = None
        self._threads = [sim.BlockThread(target, self, grid_point, block_point, self._debug)
                         for block_point in np.ndindex(*self._block_dim)]
        for t in self._threads:
            t.start()
        for t in self._threads:
            t.join()
        failed = self._failed
        if failed is not None:
            raise failed.exception[0].with_traceback(failed.exception[1])

    def _release(m) -> None:
        m._arrived = 0
        m._generation += 1
        m._cond.notify_all()

    def thread_run(self):
        try:
            original_thread_run(self)       # records an exception in self.exception
        finally:
            m = self._manager
            with m._cond:
                m._live -= 1
                if self.exception is not None and m._failed is None:
                    m._failed = self
                    for t in m._threads:
                        t.abort = True
                    _release(m)
                elif m._arrived and m._arrived == m._live:
                    _release(m)              # the others wait at a barrier this one skipped

    def syncthreads(self):
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        m = self._manager
        with m._cond:
            generation = m._generation
            m._arrived += 1
            if m._arrived == m._live:
                _release(m)
            else:
                while m._generation == generation:
                    m._cond.wait()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    sim.BlockManager.run = block_run
    sim.BlockThread.run = thread_run
    sim.BlockThread.syncthreads = syncthreads
    sim.BlockManager._numbakv_waiting_barrier = True
