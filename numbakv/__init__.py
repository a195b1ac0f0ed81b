"""numbakv: the KV cache of an LLM inference runtime.

    import numbakv as nkv
    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=4, head_dim=64, capacity=1024, max_seqs=4)
    cache = nkv.CausalCache(cfg, shift=nkv.RopeShift())
"""

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
from .paired import PairedCache
from .errors import NoSlotError, ReprocessError
from .prompt import PromptCache
from .state.snapshot import SeqSnapshot, SnapshotPart
from .prefix import PrefixStore
from .rotation import rotate_queries, unrotate_output
from .recurrent import RecurrentCache, RecurrentConfig, StateSpec  # registers its state files
from .hybrid import HybridCache  # registers its state files
from .state.snapshot import RecurrentPart
from .step import register_cpu_attend as _register_cpu_attend


def _attend_on_first_use(*args, **kwargs):
    """:func:`numbakv.attention.attend`, imported at the first cpu captured step with attention
    (``import numbakv`` stays free of the attention module)."""
    from .attention import attend
    return attend(*args, **kwargs)


_register_cpu_attend(_attend_on_first_use)

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
