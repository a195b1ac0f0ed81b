"""The demo's verification error, in a module of its own so that the demo and its prefix-store
segment (``demo_prefix``) both raise it without importing each other."""


class DemoVerificationError(AssertionError):
    """The cached forward disagreed with the recomputation without the cache."""
