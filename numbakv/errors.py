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


class NoSlotError(KVCacheError):
    """Every slot of a ``PromptCache`` is in use: no sequence can take a new prompt (Ollama's
    runner: "no available cache slots")."""


class ReprocessError(KVCacheError):
    """A context shift the cache refused (no shift function, or cells shared with another
    sequence would move): the slot was emptied, and ``inputs`` (the kept inputs, in order) must
    be evaluated into it again (Ollama's ``ErrReprocessInputs``)."""

    def __init__(self, message: str = "", *, inputs) -> None:
        self.inputs = list(inputs)
        super().__init__(message or "the cache cannot shift this sequence: it was emptied and "
                         f"its {len(self.inputs)} kept inputs need evaluating again")

    def __reduce__(self):  # keyword-only ``inputs``: pickle through a helper
        return (_reprocess_error, (str(self), self.inputs))


def _reprocess_error(message: str, inputs) -> ReprocessError:
    return ReprocessError(message, inputs=inputs)


class ConcurrentUseError(KVCacheError):
    """A second thread entered a cache while another thread was inside one of its methods. A
    cache is meant for one thread at a time (as Ollama's and llama.cpp's are): use a lock
    around it, or one cache per thread."""


__all__ = ["KVCacheError", "KVCacheFullError", "NotSupportedError", "StateError", "NoSlotError",
           "ReprocessError", "ConcurrentUseError"]
