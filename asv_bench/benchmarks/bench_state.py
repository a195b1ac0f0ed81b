"""Saving and restoring cache state: a whole CausalCache (8 layers, 8 KV heads, head_dim 128,
float16, 4096 cells = 128 MiB of K/V) and one 1024-token sequence of it, to a file (atomic save:
temporary file, fsync, rename) and to bytes in memory; plus a StepCache of the same size as one
sequence layer. The cache lives on the CPU, or on the GPU when one is usable (``cuda``)."""

import os
import shutil
import tempfile

import numpy as np

from numbakv import CacheConfig, state
from numbakv.causal import CausalCache
from numbakv.device import cuda_usable
from numbakv.simple import StepCache

N_LAYERS, N_HEADS, HEAD_DIM, SEQ_LEN, N_SEQS = 8, 8, 128, 1024, 4


def _filled_cache(device: str) -> CausalCache:
    cfg = CacheConfig(n_layers=N_LAYERS, n_kv_heads=N_HEADS, head_dim=HEAD_DIM, dtype="float16",
                      capacity=SEQ_LEN, max_seqs=N_SEQS, max_batch=SEQ_LEN, device=device)
    cache = CausalCache(cfg)
    rng = np.random.default_rng(0)
    xp = np
    if device == "cuda":
        import cupy as xp
    data = xp.asarray(rng.standard_normal((SEQ_LEN, N_HEADS, HEAD_DIM)).astype(np.float16))
    for seq in range(N_SEQS):
        cache.start_forward(np.arange(SEQ_LEN), np.full(SEQ_LEN, seq))
        for layer in range(N_LAYERS):
            cache.set_layer(layer)
            cache.put(data, data)
    return cache


def _device(device: str) -> None:
    if device == "cuda" and not cuda_usable():
        raise NotImplementedError("no usable CUDA GPU")  # asv skips the benchmark


class CausalState:
    """``what``: ``whole`` (128 MiB, the exact cell layout) or ``seq`` (one 1024-token sequence,
    32 MiB, loaded back as another sequence id)."""

    params = (["cpu", "cuda"], ["whole", "seq"])
    param_names = ["device", "what"]
    timeout = 300
    number = 1
    repeat = 5

    def setup(self, device, what):
        _device(device)
        self.cache = _filled_cache(device)
        self.save_seq = None if what == "whole" else 1
        self.load_seq = None if what == "whole" else 3
        self.dir = tempfile.mkdtemp(prefix="numbakv-bench-")
        self.path = os.path.join(self.dir, "state.safetensors")
        self.out = os.path.join(self.dir, "out.safetensors")
        state.save_cache(self.cache, self.path, self.save_seq, progress=False)
        self.data = state.cache_to_bytes(self.cache, self.save_seq, progress=False)

    def teardown(self, device, what):
        # asv runs teardown after a setup that skipped (no GPU) too, before self.dir exists
        if getattr(self, "dir", None):
            shutil.rmtree(self.dir, ignore_errors=True)

    def time_save_file(self, device, what):
        state.save_cache(self.cache, self.out, self.save_seq, progress=False)

    def time_load_file(self, device, what):
        state.load_cache(self.cache, self.path, self.load_seq, progress=False)

    def time_to_bytes(self, device, what):
        state.cache_to_bytes(self.cache, self.save_seq, progress=False)

    def time_from_bytes(self, device, what):
        state.cache_from_bytes(self.cache, self.data, self.load_seq, progress=False)

    def track_state_mib(self, device, what):
        return len(self.data) / 2**20

    track_state_mib.unit = "MiB"


class SimpleState:
    """A StepCache holding ``[1, 8, 1024, 128]`` float16 K and V (4 MiB), through bytes."""

    params = ["cpu", "cuda"]
    param_names = ["device"]

    def setup(self, device):
        _device(device)
        xp = np
        if device == "cuda":
            import cupy as xp
        rng = np.random.default_rng(0)
        kv = xp.asarray(rng.standard_normal((1, N_HEADS, SEQ_LEN, HEAD_DIM)).astype(np.float16))
        self.cache = StepCache(device=device)
        self.cache.update(kv, kv)
        self.device = device
        self.data = state.simple_to_bytes(self.cache)

    def time_to_bytes(self, device):
        state.simple_to_bytes(self.cache)

    def time_from_bytes(self, device):
        state.load_simple(self.data, device=device)
