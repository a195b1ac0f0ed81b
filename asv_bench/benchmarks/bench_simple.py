"""Decode cost of the single-stream caches (one token per update) against the naive cache that
np.concatenate's every new token onto its history (O(length) per token)."""

import numpy as np

from numbakv.simple import RotatingCache, StepCache

B, H, D = 1, 8, 128


class _Decode:
    params = [[256, 2048, 8192], ["float16", "bfloat16"]]
    param_names = ["length", "dtype"]

    def setup(self, length, dtype):
        storage = np.uint16 if dtype == "bfloat16" else np.float16
        rng = np.random.default_rng(0)
        self.prompt = rng.integers(0, 2**14, size=(B, H, length, D)).astype(storage)
        self.token = rng.integers(0, 2**14, size=(B, H, 1, D)).astype(storage)


class StepCacheDecode(_Decode):
    def setup(self, length, dtype):
        super().setup(length, dtype)
        self.cache = StepCache(256, device="cpu")
        self.cache.update(self.prompt, self.prompt)
        self.cache.update(self.token, self.token)  # grow now: time_update measures an append

    def time_update(self, length, dtype):
        self.cache.update(self.token, self.token)

    def time_decode_256(self, length, dtype):
        """One step's worth of tokens: 255 appends and one growth (the amortized cost)."""
        for _ in range(256):
            self.cache.update(self.token, self.token)


class RotatingCacheDecode(_Decode):
    """A window of ``length`` tokens, already full: every update overwrites in place."""

    def setup(self, length, dtype):
        super().setup(length, dtype)
        self.cache = RotatingCache(length, 256, device="cpu")
        self.cache.update(self.prompt, self.prompt)
        self.cache.update(self.token, self.token)

    def time_update(self, length, dtype):
        self.cache.update(self.token, self.token)

    def time_decode_256(self, length, dtype):
        for _ in range(256):
            self.cache.update(self.token, self.token)


class ConcatenateDecode(_Decode):
    """The naive reference: a new array of the whole history per token."""

    def setup(self, length, dtype):
        super().setup(length, dtype)
        self.k = self.prompt.copy()
        self.v = self.prompt.copy()

    def time_update(self, length, dtype):
        k = np.concatenate([self.k, self.token], axis=2)
        v = np.concatenate([self.v, self.token], axis=2)
        # keep the length fixed so every sample measures the same work
        self.k, self.v = k[:, :, 1:], v[:, :, 1:]
