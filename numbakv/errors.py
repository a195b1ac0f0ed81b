"""numbakv's exceptions. Every error the library raises on purpose is a ``KVCacheError`` or a
``ValueError``; a call that raises leaves the cache exactly as it was."""


class KVCacheError(Exception):
    """Base class of numbakv's own errors."""


class KVCacheFullError(KVCacheError):
    """No run of free cells can hold the batch, even after a defrag (Ollama's ErrKvCacheFull)."""


class NotSupportedError(KVCacheError):
    """The operation is not supported by this cache's configuration (Ollama's ErrNotSupported),
    e.g. removing from the middle of a sequence without a shift function."""


class StateError(KVCacheError):
    """A saved state is truncated, corrupted, of an unknown format version, or does not fit the
    cache it is loaded into."""


__all__ = ["KVCacheError", "KVCacheFullError", "NotSupportedError", "StateError"]


class ConcurrentUseError(KVCacheError):
    """A second thread entered a cache while another thread was inside one of its methods. A
    cache is meant for one thread at a time (as Ollama's and llama.cpp's are): use a lock
    around it, or one cache per thread."""


__all__ += ["ConcurrentUseError"]
