"""The exceptions of ``numbakv.dist`` (re-exported there)."""

from __future__ import annotations

from ..errors import KVCacheError


class TransferError(KVCacheError):
    """A sequence transfer failed; the receiving cache is unchanged."""


class TransferRefused(TransferError):
    """The receiver refused the sequence (fingerprint, layout, head range, or its
    ``import_seq`` refused it); raised on both sides with the receiver's reason."""


class TransferTimeout(TransferError, TimeoutError):
    """The peer did not answer within the timeout, or its connection broke (it died): the
    message names the peer rank."""


class ReplicationError(KVCacheError):
    """The ranks' cell tables differ (``check_replicated``): bookkeeping diverged."""
