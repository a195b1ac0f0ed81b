"""Helpers shared by the tests: plain numpy references, and the emulated CUDA launch path."""

import numpy as np


def f32_to_bf16_bits(x) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and return the 16-bit patterns."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    out[nan] = 0x7FC0
    return out


def bf16_bits_to_f32(bits) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def random_storage(rng, shape, dtype: str) -> np.ndarray:
    """Random data in a storage dtype (uint16 bit patterns for bfloat16)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "bfloat16":
        return f32_to_bf16_bits(x)
    return x.astype(dtype)


def as_f32(arr, dtype: str) -> np.ndarray:
    return bf16_bits_to_f32(arr) if dtype == "bfloat16" else np.asarray(arr, dtype=np.float32)


# ------------------------------------------------------------------ the CUDA launch path, emulated
# Without a GPU the ``cuda`` code path (CuPy arrays described by pointer/shape/strides, packed
# host-to-device copies, cached slot buffers) still runs: a stand-in ``cupy`` over numpy memory
# (tests/fake_cupy.py), and the descriptors turned back into numpy views for the simulator.
# Shared by test_kernels.py and test_streams.py.

def desc_to_numpy(d) -> np.ndarray:
    """The numpy view of the host memory a ``kernels._common.Desc`` describes."""
    import ctypes
    span = sum((s - 1) * st for s, st in zip(d.shape, d.strides)) + d.dtype.itemsize \
        if all(d.shape) else 0
    buf = (ctypes.c_char * max(span, 1)).from_address(d.ptr)
    return np.ndarray(d.shape, dtype=d.dtype, buffer=buf, strides=d.strides)


def clear_launch_caches() -> None:
    """Forget the device buffers the put kernels and the launch path keep between calls."""
    from numbakv.kernels import launch, put
    for cache in (put._SLOT_CACHE, put._NO_SLOTS_DEV, put._CUDA_PLANS, launch._STAGING):
        cache.clear()


def emulate_cuda(monkeypatch, record):
    """Install the ``cupy`` stand-in and run every ``cuda`` launch of the put, quantize (ggml's
    and FlashMLA's), mask, move, rope, state-row and paged attention kernels in the simulator on the memory its
    descriptors name (dispatcher path: the fast
    launch is off), calling ``record(kernel, args)`` first. Returns the stand-in; the caller
    calls :func:`clear_launch_caches` at teardown."""
    import sys

    from fake_cupy import fake_cupy
    from numbakv.kernels import _common, decode, launch, mask, mla, move, put, quant, rope, rows
    cp = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(launch, "_FAST_ENABLED", False)
    clear_launch_caches()

    def fake_launch(device, kernel, grid, block, args):
        assert device == "cuda"
        record(kernel, args)
        host_args = [desc_to_numpy(a) if isinstance(a, _common.Desc) else a for a in args]
        stream = cp.cuda.get_current_stream()
        if stream.graph_nodes is not None:   # capturing (begin_capture): a node of the graph
            stream.graph_nodes.append(lambda: launch.launch("sim", kernel, grid, block,
                                                            host_args))
            return
        launch.launch("sim", kernel, grid, block, host_args)

    for mod in (put, quant, mla, mask, move, rope, rows):
        monkeypatch.setattr(mod, "_launch", fake_launch)
        monkeypatch.setattr(mod, "block_size", lambda device: _common.BLOCK_SIM)
    monkeypatch.setattr(decode, "_launch", fake_launch)      # the simulator's block size
    monkeypatch.setattr(decode, "BLOCK_CUDA", _common.BLOCK_SIM)
    monkeypatch.setattr(decode, "block_size", lambda device: _common.BLOCK_SIM)
    return cp


def reference_moves(keys, values, moves, permuted):
    """The sequential meaning of a move plan ``[(src, dst, length), ...]`` on host copies of
    ``keys [layers, cells, ...]`` and ``values`` (cells last when ``permuted``): each move a
    memmove, in order."""
    keys, values = keys.copy(), values.copy()
    for s, d, ln in moves:
        keys[:, d:d + ln] = keys[:, s:s + ln].copy()
        if permuted:
            values[..., d:d + ln] = values[..., s:s + ln].copy()
        else:
            values[:, d:d + ln] = values[:, s:s + ln].copy()
    return keys, values


def host(x) -> np.ndarray:
    """A host numpy copy/view of a cache array (numpy, CuPy, or a bfloat16 view's bits)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "bits"):
        return host(x.bits)
    return x.get()


def dev(x: np.ndarray, device: str):
    """``x`` on ``device`` (CuPy for ``cuda``, else as it is)."""
    if device == "cuda":
        import cupy
        return cupy.asarray(x)
    return x


def shares_memory(a, b) -> bool:
    """Whether two arrays' byte ranges overlap: numpy arrays through numpy, device arrays
    (CuPy, anything with the CUDA array interface) through their data pointers."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.shares_memory(a, b))

    def span(x):
        x = getattr(x, "bits", x)   # a bfloat16 view: its uint16 storage
        iface = x.__cuda_array_interface__
        ptr = iface["data"][0]
        itemsize = np.dtype(iface["typestr"]).itemsize
        strides = iface.get("strides") or [
            itemsize * int(np.prod(iface["shape"][i + 1:])) for i in range(len(iface["shape"]))]
        lo = ptr + sum((n - 1) * st for n, st in zip(iface["shape"], strides) if st < 0)
        hi = ptr + itemsize + sum((n - 1) * st for n, st in zip(iface["shape"], strides) if st > 0)
        return lo, hi

    (a_lo, a_hi), (b_lo, b_hi) = span(a), span(b)
    return a_lo < b_hi and b_lo < a_hi


def same(a, b) -> bool:
    """Bit-identical arrays (float compares would let -0.0 pass for 0.0 and fail on NaN)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def host_kv(cache):
    """Host copies of a cache's whole K ``[L, N, H, D]`` and V ``[L, N, H, Dv]`` storage,
    whatever the V layout (a permuted V is transposed back)."""
    k = np.array(host(cache.storage.keys))
    v = np.array(host(cache.storage.values))
    if cache.config.permuted_v:
        v = v.transpose(0, 3, 1, 2)
    return k, v


def seq_rows(cache, seq):
    """``(positions, K [L, k, H, D], V [L, k, H, Dv])`` of ``seq`` in position order, read from
    the cell table and the storage arrays (rows of one position in cell order)."""
    cells = np.asarray(cache.cells.seq_cells(seq))
    pos = cache.cells.cells["pos"][cells]
    order = np.argsort(pos, kind="stable")
    k, v = host_kv(cache)
    return pos[order], k[:, cells[order]], v[:, cells[order]]


def random_weight_model(config, std: float = 0.25, model_class=None):
    """A random-weight model of ``config`` in eval mode with eager attention (the reference
    path): seeded (``torch.manual_seed(0)``), every matrix drawn from N(0, ``std``) so attention
    is far from uniform and a wrong mask, window or RoPE changes the logits well beyond the
    tests' tolerances. ``model_class``: built as ``model_class(config)`` instead of
    ``AutoModelForCausalLM.from_config``."""
    import torch
    import transformers
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = (transformers.AutoModelForCausalLM.from_config(config) if model_class is None
             else model_class(config))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model.eval()


def gpu_compiler_missing() -> str:
    """'' when numba-cuda's GPU compiler is installed (NVVM for PTX, NVRTC for its C++ shims,
    nvJitLink for the cubin link), else what is missing and the extra that brings it: the
    tests that compile kernels to PTX skip with that reason on a CPU-only `[test]` install
    (CI installs `[test,ptx]`, so there they run)."""
    try:
        from cuda import pathfinder
    except ImportError as exc:
        return f"numba-cuda's cuda.pathfinder is missing ({exc}): pip install -e '.[ptx]'"
    missing = []
    for lib in ("nvvm", "nvrtc", "nvJitLink"):
        try:
            pathfinder.load_nvidia_dynamic_lib(lib)
        except Exception:  # noqa: BLE001 - not found, or not loadable: either way, absent
            missing.append(lib)
    if missing:
        return (f"the GPU compiler is not installed ({', '.join(missing)} not found): "
                "pip install -e '.[ptx]' (or '.[gpu]') to compile the kernels to PTX")
    return ""


def fake_cuda_cache(cp, cfg, stream_ptr=None, **kwargs):
    """A ``CausalCache`` whose storage is a ``cuda`` storage over the stand-in CuPy (``cfg``'s
    device is ``cpu``; no warm-up, which preloads through the driver); with ``stream_ptr`` its
    own stream (``use_stream``). Install the stand-in first (:func:`emulate_cuda`)."""
    import os

    import numbakv as nkv
    from numbakv.storage import KVStorage
    old = os.environ.get("NUMBAKV_WARM_UP")
    os.environ["NUMBAKV_WARM_UP"] = "0"
    try:
        cache = nkv.CausalCache(cfg, _storage_factory=lambda n, device: KVStorage(cfg, n, "cuda"),
                                **kwargs)
    finally:
        if old is None:
            del os.environ["NUMBAKV_WARM_UP"]
        else:
            os.environ["NUMBAKV_WARM_UP"] = old
    cache.device = "cuda"
    if stream_ptr is not None:
        cache.use_stream(cp.cuda.ExternalStream(stream_ptr))
    return cache
