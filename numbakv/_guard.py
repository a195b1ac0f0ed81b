"""One thread at a time: the check that turns concurrent use of a cache into an error.

A cache is not thread-safe (its cell table, K/V and forward pass change together across many
statements, as in Ollama and llama.cpp). Rather than corrupt silently when two threads share
one, every public method of a guarded class holds the cache's non-blocking re-entrant lock
while it runs: a second thread that enters while another is inside gets
:class:`~numbakv.errors.ConcurrentUseError` at once (nothing waits, nothing changed). The same
thread may re-enter (a shift callable that reads the cache, a WrapperCache calling its groups).
Different caches have different locks, so two caches on two threads never interfere.

Cost: one C-level ``RLock.acquire(False)`` / ``release()`` pair and a Python call frame per
public call (measured in tests/test_reliability.py and reported in BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Callable, Iterable, TypeVar

from .errors import ConcurrentUseError

T = TypeVar("T", bound=type)

#: methods never wrapped: object protocol, and those that must work whatever the state
_SKIP = frozenset({"__init__", "__repr__", "__str__", "__enter__", "__exit__", "__len__",
                   "__del__", "__getattr__", "__getstate__", "__setstate__"})


def _busy(obj) -> ConcurrentUseError:
    return ConcurrentUseError(
        f"{type(obj).__name__} is in use by another thread: a cache is meant for one thread at "
        "a time (guard it with a lock, or give each thread its own cache)")


def _guarded(method: Callable) -> Callable:
    """``method`` wrapped in the check, with the same parameter list (so no ``*args/**kwargs``
    repacking on the hot path: that doubled the cost of the check)."""
    params, call = _signature_source(method)
    source = (f"def guarded({params}):\n"
              f"    lock = self._thread_guard\n"
              f"    if not lock.acquire(False):\n"
              f"        raise busy(self)\n"
              f"    try:\n"
              f"        return method({call})\n"
              f"    finally:\n"
              f"        lock.release()\n")
    namespace = {"method": method, "busy": _busy}
    exec(source, namespace)  # noqa: S102 - source built from parameter names only
    guarded = functools.wraps(method)(namespace["guarded"])
    guarded.__defaults__ = method.__defaults__
    guarded.__kwdefaults__ = method.__kwdefaults__
    guarded.__numbakv_guarded__ = True
    return guarded


def _signature_source(method: Callable):
    """``(parameter list, call arguments)`` as source text: names only (defaults are copied onto
    the wrapper), so ``f(self, a, b=1, *rest, c, **kw)`` gives ``"self, a, b, *rest, c, **kw"``
    and ``"self, a, b, *rest, c=c, **kw"``."""
    params, call, star = [], [], False
    for p in inspect.signature(method).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            params.append(f"*{p.name}")
            call.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            params.append(f"**{p.name}")
            call.append(f"**{p.name}")
        elif p.kind is p.KEYWORD_ONLY:
            if not star:
                params.append("*")
                star = True
            params.append(p.name)
            call.append(f"{p.name}={p.name}")
        else:
            params.append(p.name)
            call.append(p.name)
    return ", ".join(params), ", ".join(call)


def one_thread_at_a_time(cls: T, *, skip: Iterable[str] = ()) -> T:
    """Class decorator: every public method of ``cls`` (its own and inherited ones, not
    properties) raises ``ConcurrentUseError`` when another thread is inside the same object.
    ``__init__`` gets the lock first; ``skip`` names methods left unguarded."""
    skipped = _SKIP | frozenset(skip)
    for name in dir(cls):
        if name.startswith("_") or name in skipped:
            continue
        attr = None
        for klass in cls.__mro__:  # the raw attribute: staticmethod/classmethod stay as they are
            if name in klass.__dict__:
                attr = klass.__dict__[name]
                break
        if not callable(attr) or isinstance(attr, (staticmethod, classmethod, type)) \
                or getattr(attr, "__numbakv_guarded__", False):
            continue
        setattr(cls, name, _guarded(attr))
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if "_thread_guard" not in self.__dict__:
            self._thread_guard = threading.RLock()
        init(self, *args, **kwargs)
    cls.__init__ = __init__
    return cls


__all__ = ["one_thread_at_a_time"]
