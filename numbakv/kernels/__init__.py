"""The kernel families (``put``, ``mask``, ``move``, ``rope``, ``quant``, ``mla``, ``rows``): each a ``@cuda.jit`` kernel and a
CPU twin sharing one element function; ``decode``: the batched paged attention kernel (its CPU
counterpart is ``numbakv.attention``'s own kernel). Importing this package registers every
kernel."""

from ._registry import KERNELS, KernelSpec, cuda_device, cuda_kernel, element, registered
from . import _common, decode, mask, mla, move, put, quant, rope, rows  # noqa: E402,F401 - importing registers the kernels

__all__ = ["KERNELS", "KernelSpec", "cuda_device", "cuda_kernel", "element", "registered", "decode", "mask", "mla", "move",
           "put", "quant", "rope", "rows"]
