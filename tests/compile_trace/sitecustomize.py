"""Log every numba compile (not cache loads) of this interpreter and of every Python process it
starts, with the pytest test that caused it: a measuring aid for the suite's time, off unless
this folder is on ``PYTHONPATH``::

    NUMBAKV_TRACE_COMPILES=/tmp/trace NUMBA_CACHE_DIR=$(mktemp -d) \
        PYTHONPATH=tests/compile_trace:. python -m pytest -n 2
    python tests/compile_trace/report.py /tmp/trace

An empty ``NUMBA_CACHE_DIR`` stands for CI's clean clone. Each process appends JSON lines to
``$NUMBAKV_TRACE_COMPILES/<pid>.jsonl``: test (``PYTEST_CURRENT_TEST``, inherited by the
processes a test starts), function, argument types, nesting depth (0: the compile a call
asked for; deeper ones are inside its time) and thread CPU seconds. The listener is registered
when numba imports its event module, so nothing is imported early (the test harness switches
the CUDA simulator on before numba.cuda is imported)."""

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

_DIR = os.environ.get("NUMBAKV_TRACE_COMPILES")


def _register(event) -> None:
    class Listener(event.Listener):
        def __init__(self):
            self.started = []

        def on_start(self, ev):
            self.started.append(time.thread_time())

        def on_end(self, ev):
            cpu = time.thread_time() - self.started.pop()
            data = ev.data or {}
            fn = getattr(data.get("dispatcher"), "py_func", None)
            name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
            record = {"test": os.environ.get("PYTEST_CURRENT_TEST", "-"), "pid": os.getpid(),
                      "func": name,
                      "args": str(data.get("args")), "depth": len(self.started),
                      "cpu": round(cpu, 3)}
            try:
                with open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError:
                pass
    event.register("numba:compile", Listener())


class _AfterNumbaEvent(importlib.abc.MetaPathFinder):
    """Registers the listener right after ``numba.core.event`` is executed."""

    def find_spec(self, name, path, target=None):
        if name != "numba.core.event":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _register(module)
        spec.loader.exec_module = exec_module
        return spec


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    sys.meta_path.insert(0, _AfterNumbaEvent())
