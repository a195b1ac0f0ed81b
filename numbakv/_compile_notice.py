"""One line on stderr the first time numbakv's code is compiled in a process.

numbakv's CPU functions are numba ``@njit(cache=True)`` functions. The common path loads
compiled code shipped in the package (``numbakv/_jit.py``); anything else is compiled on first
use (per signature) and cached on disk: next to the sources in ``__pycache__`` when that is
writable, else in numba's user-wide cache directory (``~/.cache/numba`` on Linux), or in
``NUMBA_CACHE_DIR`` when set. Such a first use pauses for seconds (up to about a minute for
everything, on a small machine the shipped code does not fit); this says so instead of sitting
silent. Cache hits compile nothing and print nothing.
``NUMBAKV_COMPILE_NOTICE=0`` turns the line off.
"""

from __future__ import annotations

import os
import sys

from numba.core import event

MESSAGE = ("numbakv: compiling for first use (code outside the compiled common path numbakv "
           "ships, or a machine it does not fit; once: later runs load it from numba's cache)")


class CompileNotice(event.Listener):
    """A numba event listener that prints :data:`MESSAGE` once, when a numbakv function starts
    compiling (numba fires ``numba:compile`` only on a real compile, not on a cache load)."""

    def __init__(self, stream=None) -> None:
        self.stream = stream
        self.printed = False

    def on_start(self, ev: event.Event) -> None:
        """Print the notice for the first compile of a function defined in numbakv."""
        if self.printed:
            return
        py_func = getattr(ev.data.get("dispatcher"), "py_func", None)
        # a function made by exec() without a __name__ has __module__ None: not numbakv's
        module = getattr(py_func, "__module__", None) or ""
        if module.partition(".")[0] != "numbakv":
            return
        self.printed = True
        print(MESSAGE, file=self.stream or sys.stderr, flush=True)

    def on_end(self, ev: event.Event) -> None:
        """Nothing to do when a compile ends."""


def install() -> None:
    """Register the notice once per process, unless ``NUMBAKV_COMPILE_NOTICE=0``."""
    if os.environ.get("NUMBAKV_COMPILE_NOTICE", "1") == "0" or getattr(install, "done", False):
        return
    install.done = True
    event.register("numba:compile", CompileNotice())
