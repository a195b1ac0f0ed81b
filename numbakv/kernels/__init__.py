"""The kernel families (``put``, ``mask``, ``move``, ``rope``, ``quant``, ``mla``, ``rows``): each a ``@cuda.jit`` kernel and a
CPU twin sharing one element function. Importing this package registers every kernel."""

from ._registry import KERNELS, KernelSpec, cuda_device, cuda_kernel, element, registered
from . import _common, decode, mask, mla, move, put, quant, rope, rows  # noqa: E402,F401 - importing registers the kernels

__all__ = ["KERNELS", "KernelSpec", "cuda_device", "cuda_kernel", "element", "registered", "mask", "mla", "move",
           "put", "quant", "rope", "rows"]
