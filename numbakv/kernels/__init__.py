"""The kernel families (``put``, ``mask``, ``move``, ``rope``): each a ``@cuda.jit`` kernel and a
CPU twin sharing one element function. Importing this package registers every kernel."""

from ._registry import KERNELS, KernelSpec, cuda_kernel, element, registered

__all__ = ["KERNELS", "KernelSpec", "cuda_kernel", "element", "registered"]
