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
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        lock = self._thread_guard
        if not lock.acquire(False):
            raise _busy(self)
        try:
            return method(self, *args, **kwargs)
        finally:
            lock.release()
    guarded.__numbakv_guarded__ = True
    return guarded


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
