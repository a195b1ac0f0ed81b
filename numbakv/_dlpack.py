"""DLPack interop beyond what numpy and CuPy do themselves (bfloat16 in both directions).

numpy and CuPy have no bfloat16 dtype, so the cache stores bfloat16 as uint16 bit patterns.
This module exports such storage as a real DLPack bfloat16 tensor and imports framework bfloat16
tensors as uint16 arrays over the same memory.
"""

from __future__ import annotations

import numpy as np

KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3


def host_array_from_dlpack(x) -> np.ndarray:
    """A numpy array over a host DLPack tensor's memory (no copy)."""
    return np.from_dlpack(x)


def cupy_array_from_dlpack(x):
    """A CuPy array over a GPU DLPack tensor's memory (no copy)."""
    import cupy
    return cupy.from_dlpack(x)


class BFloat16View:
    """A uint16 storage view that exports through DLPack as bfloat16."""

    def __init__(self, bits) -> None:
        self.bits = bits

    @property
    def shape(self):
        return self.bits.shape
