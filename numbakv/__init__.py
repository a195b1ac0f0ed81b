"""numbakv: the KV cache of an LLM inference runtime.

    import numbakv as nkv
    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=4, head_dim=64, capacity=1024, max_seqs=4)
    cache = nkv.CausalCache(cfg, shift=nkv.RopeShift())
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from . import _compile_notice

_compile_notice.install()  # one stderr line while numba compiles numbakv code on first use

from .config import CacheConfig, RopeShift  # noqa: E402
from .errors import (ConcurrentUseError, KVCacheError, KVCacheFullError,  # noqa: E402
                     NotSupportedError, StateError)
from .device import resolve_device
from .simple import RotatingCache, StepCache
from .causal import CausalCache
from .step import DecodeStep
from .streams import StreamCache  # registers itself for CacheConfig(unified=False)
from .wrappers import EncoderCache, WrapperCache
from .errors import NoSlotError, ReprocessError
from .rotation import rotate_queries, unrotate_output
from .step import register_cpu_attend as _register_cpu_attend


def _attend_on_first_use(*args, **kwargs):
    """:func:`numbakv.attention.attend`, imported at the first cpu captured step with attention
    (``import numbakv`` stays free of the attention module)."""
    from .attention import attend
    return attend(*args, **kwargs)


_register_cpu_attend(_attend_on_first_use)

#: public names whose modules load on first access (PEP 562): a ``generate()`` or plain-cache
#: user never touches them, and importing them all cost ~2.2 MiB of RSS per process (the prefix
#: store and its tiers, the recurrent and hybrid caches, the prompt and paired caches, the
#: sequence snapshots and with them the state format). Nothing of the library relies on their
#: import-time work: RecurrentCache / HybridCache register their state-file families when their
#: module loads, and a file of a family is only ever read or written through an instance of its
#: class; the prefix store's exit hook concerns live stores.
_LAZY = {"PairedCache": ".paired", "PromptCache": ".prompt", "PrefixStore": ".prefix",
         "RecurrentCache": ".recurrent", "RecurrentConfig": ".recurrent",
         "StateSpec": ".recurrent", "HybridCache": ".hybrid", "SeqSnapshot": ".state.snapshot",
         "SnapshotPart": ".state.snapshot", "RecurrentPart": ".state.snapshot"}

if _TYPE_CHECKING:  # type checkers (the package is py.typed) see the lazy names' own types
    from .hybrid import HybridCache
    from .paired import PairedCache
    from .prefix import PrefixStore
    from .prompt import PromptCache
    from .recurrent import RecurrentCache, RecurrentConfig, StateSpec
    from .state.snapshot import RecurrentPart, SeqSnapshot, SnapshotPart


#: their modules, reachable as ``numbakv.<module>`` without an import as before
_LAZY_MODULES = frozenset(module[1:] for module in _LAZY.values() if "." not in module[1:])


def __getattr__(name: str):
    """A name of :data:`_LAZY` (or one of its modules): its module imported now."""
    import importlib
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)   # binds numbakv.<name> itself
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'numbakv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value          # later accesses skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | _LAZY_MODULES)


__version__ = "0.1.0"

__all__ = ["CacheConfig", "RopeShift", "KVCacheError", "KVCacheFullError", "NotSupportedError",
           "StateError", "resolve_device", "StepCache", "RotatingCache", "CausalCache", "StreamCache", "WrapperCache",
           "EncoderCache", "__version__"]
__all__ += ["PromptCache", "NoSlotError", "ReprocessError"]
__all__ += ["PairedCache", "DecodeStep"]
__all__ += ["ConcurrentUseError"]
__all__ += ["SeqSnapshot", "SnapshotPart"]
__all__ += ["PrefixStore"]
__all__ += ["rotate_queries", "unrotate_output"]
__all__ += ["StateSpec", "RecurrentConfig", "RecurrentCache", "RecurrentPart", "HybridCache"]
