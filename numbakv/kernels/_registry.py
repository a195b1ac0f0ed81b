"""Every ``@cuda.jit`` kernel of numbakv registers here with the signatures it is launched with,
so one test compiles them all to PTX (sm_80, sm_90) and a new kernel cannot be forgotten.

Element math is written once as a plain Python function and turned into both a CUDA device
function and a CPU ``@njit`` function by :func:`element`; the CUDA launcher and the CPU launcher
of a kernel family call the same math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

from numba import cuda, njit


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
        return cuda.jit(fn)
    return wrap


class Element:
    """One piece of element math with its two compiled forms."""

    def __init__(self, fn: Callable) -> None:
        self.py_func = fn
        self.cpu = njit(inline="always", cache=False)(fn)
        self.cuda = cuda.jit(device=True)(fn)


def element(fn: Callable) -> Element:
    """Compile ``fn`` (plain Python, numba-compatible) once for the CPU twin and once as a CUDA
    device function; kernels use ``.cuda``, CPU launchers ``.cpu``."""
    return Element(fn)


def cuda_device(fn: Callable):
    """A CUDA-only device function: thread-level code shared by the branches of a kernel (the
    CPU twins loop differently, so it has no CPU form). Element math goes through
    :func:`element` instead."""
    return cuda.jit(device=True)(fn)


def registered() -> List[KernelSpec]:
    return [KERNELS[k] for k in sorted(KERNELS)]
