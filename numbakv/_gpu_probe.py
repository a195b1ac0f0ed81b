"""Whether the CUDA driver sees a GPU, asked through ctypes so that nothing imports numba.cuda.

Kept free of numbakv and numba imports: ``tests/conftest.py`` loads this file directly to decide
whether to switch on Numba's CUDA simulator, which must happen before numba.cuda is imported.
"""

import ctypes
import ctypes.util


def driver_gpu_count() -> int:
    """Number of CUDA devices the driver reports; 0 when there is no driver or no device."""
    names = ["libcuda.so.1", "libcuda.so", ctypes.util.find_library("cuda"), "nvcuda.dll"]
    for name in names:
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if lib.cuInit(0) != 0:
                return 0
            count = ctypes.c_int(0)
            if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return 0
            return int(count.value)
        except (AttributeError, OSError):
            return 0
    return 0
