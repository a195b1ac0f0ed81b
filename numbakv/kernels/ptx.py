"""Compile every registered kernel to PTX for the target GPUs, with or without a GPU present.

Run as ``python -m numbakv.kernels.ptx`` (prints one line per kernel and exits non-zero on any
failure). Needs Numba's real CUDA target: not available while the simulator is on.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Dict, Iterable, Tuple

TARGETS: Tuple[Tuple[int, int], ...] = ((8, 0), (9, 0))


@contextlib.contextmanager
def _offline_device(cc: Tuple[int, int]):
    """Device functions ask the driver for the current device's compute capability while they
    are typed; without a GPU there is none, so answer with the target being compiled for."""
    from numba.cuda import dispatcher
    original = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = original


def compile_all(targets: Iterable[Tuple[int, int]] = TARGETS) -> Dict[Tuple[str, Tuple[int, int]], str]:
    """PTX of every registered kernel for every signature and target; raises on the first error."""
    from numba import cuda
    from ..device import simulator_enabled
    if simulator_enabled():
        raise RuntimeError("PTX compilation needs Numba's CUDA target; the simulator is on "
                           "(unset NUMBA_ENABLE_CUDASIM)")
    from . import registered  # imports every kernel module
    have_gpu = False
    try:
        have_gpu = bool(cuda.is_available())
    except Exception:  # noqa: BLE001
        have_gpu = False
    results = {}
    for cc in targets:
        ctx = contextlib.nullcontext() if have_gpu else _offline_device(cc)
        with ctx:
            for spec in registered():
                for sig in spec.signatures:
                    ptx, _ = cuda.compile_ptx(spec.py_func, sig, cc=cc)
                    marker = f".target sm_{cc[0]}{cc[1]}"
                    if marker not in ptx:
                        raise RuntimeError(f"{spec.name}: PTX lacks {marker}")
                    results[(spec.name, cc)] = ptx
    return results


def main(argv=None) -> int:
    from . import registered
    try:
        compiled = compile_all()
    except Exception as exc:  # noqa: BLE001
        print(f"PTX compilation failed: {type(exc).__name__}: {exc}")
        return 1
    for spec in registered():
        ccs = sorted({cc for (name, cc) in compiled if name == spec.name})
        print(f"{spec.name}: {len(spec.signatures)} signature(s) -> "
              + ", ".join(f"sm_{a}{b}" for a, b in ccs))
    print(f"ok: {len(registered())} kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
