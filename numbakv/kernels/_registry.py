"""Every ``@cuda.jit`` kernel of numbakv registers here with the signatures it is launched with,
so one test compiles them all to PTX (sm_80, sm_90) and a new kernel cannot be forgotten.

Element math is written once as a plain Python function and turned into both a CUDA device
function and a CPU ``@njit`` function by :func:`element`; the CUDA launcher and the CPU launcher
of a kernel family call the same math.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

from numba import njit


# ---------------------------------------------------------------------------- deferred CUDA
# Importing numba.cuda and creating the CUDA dispatchers costs ~55 MiB of resident memory and
# ~0.2 s (numba-cuda's typing and lowering registries, cuda.core, the CUDA bindings), which a
# CPU-only process (``device="cpu"``, a transformers ``generate()``) never uses. So the kernel
# modules get stand-ins: ``cuda`` for the module, and for every ``@cuda.jit`` kernel or device
# function a :class:`Deferred` that makes it on first use. The first use of any of them runs
# :func:`ensure_cuda`: numba.cuda is imported, the CUDA-only overloads register
# (:func:`on_cuda_import`), and every stand-in in numbakv's module globals is replaced by the
# real object, so the kernels compile against real globals (and the simulator finds the
# ``cuda`` module it swaps for its fake one).

class Deferred:
    """A CUDA object (the ``numba.cuda`` module, a ``cuda.jit`` kernel or device function) made
    by ``make()`` on first use; attribute access, indexing (``kernel[grid, block]``) and calls
    go to it."""

    __slots__ = ("_make", "_real")

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._real = None

    def resolve(self) -> Any:
        """The real object (imports numba.cuda and readies every kernel the first time)."""
        if self._real is None:
            ensure_cuda()
            if self._real is None:
                self._real = self._make()
        return self._real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.resolve(), name)

    def __getitem__(self, key: Any) -> Any:
        return self.resolve()[key]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        state = "made" if self._real is not None else "not made yet"
        return f"<numbakv deferred CUDA object, {state}>"


def _import_cuda():
    from numba import cuda as numba_cuda
    return numba_cuda


#: stands in for ``numba.cuda`` in the kernel modules (``from ._registry import cuda``)
cuda = Deferred(_import_cuda)
_SETUP: List[Callable[[], None]] = []
_LOCK = threading.RLock()
_STATE = {"ready": False, "busy": False}


def on_cuda_import(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` (a CUDA-only registration, e.g. a ``numba.cuda.extending.overload``) when
    numba.cuda is imported for numbakv's kernels, before any of them compiles."""
    with _LOCK:
        _SETUP.append(fn)
        if _STATE["ready"]:
            fn()
    return fn


def resolved(value: Any) -> Any:
    """``value``, or the real object when it is a :class:`Deferred`."""
    return value.resolve() if type(value) is Deferred else value


def ensure_cuda() -> None:
    """Import numba.cuda, run the :func:`on_cuda_import` registrations and replace every
    :class:`Deferred` in the globals of numbakv's loaded modules by its real object (once)."""
    if _STATE["ready"]:
        return
    with _LOCK:
        if _STATE["ready"] or _STATE["busy"]:
            return              # done meanwhile, or this thread is doing it (a resolve inside)
        _STATE["busy"] = True
        try:
            _import_cuda()
            for fn in _SETUP:
                fn()
            for name, module in list(sys.modules.items()):
                if module is None or not name.startswith("numbakv"):
                    continue
                space = vars(module)
                for key, value in list(space.items()):
                    if type(value) is Deferred:
                        space[key] = value.resolve()
            _STATE["ready"] = True
        finally:
            _STATE["busy"] = False


def cuda_jit(fn: Callable, **options: Any) -> Deferred:
    """``numba.cuda.jit(**options)(fn)``, made on first use."""
    return cuda_jit_from(lambda: fn, **options)


def cuda_jit_from(make_fn: Callable[[], Callable], **options: Any) -> Deferred:
    """``numba.cuda.jit(**options)(make_fn())``, made on first use (``make_fn`` runs once
    numba.cuda is imported and the module globals hold real objects). Once numba.cuda is in
    use (a module imported after that), the object is made at once: nothing swaps it later."""
    made = Deferred(lambda: _import_cuda().jit(**options)(make_fn()))
    return made.resolve() if _STATE["ready"] else made


@dataclass(frozen=True)
class KernelSpec:
    name: str
    py_func: Callable
    signatures: Tuple[tuple, ...]  # each a tuple of numba argument types


KERNELS: Dict[str, KernelSpec] = {}


def cuda_kernel(name: str, signatures: Sequence[tuple]):
    """Decorate a kernel body: registers it (with the argument-type tuples it is launched with,
    for the PTX check) and returns the lazily compiled ``cuda.jit`` kernel."""
    def wrap(fn):
        if name in KERNELS:
            raise RuntimeError(f"kernel {name!r} registered twice")
        KERNELS[name] = KernelSpec(name, fn, tuple(tuple(s) for s in signatures))
        return cuda_jit(fn)
    return wrap


class Element:
    """One piece of element math with its two compiled forms."""

    def __init__(self, fn: Callable) -> None:
        self.py_func = fn
        self.cpu = njit(inline="always", cache=False)(fn)
        self.cuda = cuda_jit(fn, device=True)


def element(fn: Callable) -> Element:
    """Compile ``fn`` (plain Python, numba-compatible) once for the CPU twin and once as a CUDA
    device function; kernels use ``.cuda``, CPU launchers ``.cpu``."""
    return Element(fn)


def cuda_device(fn: Callable):
    """A CUDA-only device function: thread-level code shared by the branches of a kernel (the
    CPU twins loop differently, so it has no CPU form). Element math goes through
    :func:`element` instead."""
    return cuda_jit(fn, device=True)


def registered() -> List[KernelSpec]:
    """Every registered kernel, numba.cuda imported and the kernel modules' globals real (their
    ``py_func`` compile with ``cuda.compile_ptx`` as they are)."""
    ensure_cuda()
    return [KERNELS[k] for k in sorted(KERNELS)]
