"""``numbakv precompile``: compile numbakv's common path ahead of its first use.

``numbakv precompile`` runs :func:`common_path` in a child process that ignores the shipped
code, so numba compiles (or loads) every function and signature it needs for this host and
caches them (numba's cache, which later runs consult first: see :mod:`numbakv._jit`). A
container image can run it once at build time; a host the shipped code does not fit (another
Python, ARM) then starts as fast as one it fits.

``numbakv precompile --ship`` is for numbakv's maintainers: it rebuilds the compiled code that
ships in the package (``numbakv/_precompiled/``) by running :func:`common_path` in a child
process that compiles for the ``x86-64-v3`` level and writes every signature there, then checks
in a second child that the same path loads all of it without compiling anything. Run it after
changing any ``@njit`` code (``tests/test_precompiled.py`` fails while the shipped code is stale)
and commit the result.

The common path is what a first session does: ``numbakv demo`` (float32, float16, bfloat16, with
and without a sliding window), the README's examples (its quantized one as pasted, and its
transformers ones: ``generate()`` with float and q8_0 K/V, ``hf.Server``, ``hf.attach``, when
torch and transformers are installed), the sequence operations, page tables and the dense
attention, quantized K/V (one side quantized and the other float too, attended on the CPU),
puts of strided (non-contiguous) K/V, MLA latents (attended, and a q8_0 latent shifted),
encoder caches, refused batches taken back, state save/load, stream caches,
the prompt cache and ``numbakv bench --quick``, on the CPU; and the host side of the CUDA path (the
``@njit`` bookkeeping a GPU cache runs on the CPU), run on device ``sim`` in a second child with
Numba's CUDA simulator on. Anything outside it still works; numba compiles it on first use.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List

import numpy as np

from .. import _jit

_CHILD_FLAG = "--child"


def _tour(dtype: str, tmp: str, device: str = "cpu") -> None:
    """One of every public operation of :class:`~numbakv.CausalCache` (and the stream and
    wrapper caches) on a tiny ``dtype`` cache on ``device``."""
    import ml_dtypes  # noqa: F401 -- numpy's "bfloat16" dtype (numba-cuda's dependency)

    import numbakv as nkv
    from ..attention import attend

    rng = np.random.default_rng(0)
    shift = nkv.RopeShift(base=10000.0, neox=True)
    for unified in (True, False):
        cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=2, head_dim=16, dtype=dtype, capacity=32,
                              max_seqs=4, max_batch=16, device=device, unified=unified)
        cache = nkv.CausalCache(cfg, shift=shift)
        batches = (([0, 1, 2, 3, 0, 1], [0, 0, 0, 0, 1, 1]), ([4, 2], [0, 1]))
        for positions, seqs in batches:
            cache.start_forward(positions, seqs)
            for layer in range(cfg.n_layers):
                cache.set_layer(layer)
                kv = rng.standard_normal((len(positions), 2, 16)).astype(np.float32)
                cache.put(kv.astype(cache.config.dtype), kv.astype(cache.config.dtype))
                cache.get()
            if unified:
                cache.page_table()
                cache.layer_pool()
                _attend(attend, cache, len(positions), rng)
        cache.seq_add(1, 1, None, 3)   # shifts apply to cells of one sequence
        cache.seq_div(1, 0, None, 2)
        cache.copy_prefix(0, 2, 3)
        cache.seq_cp(0, 3, 0, 2)
        cache.seq_rm(3, 0, None)
        cache.seq_keep(0) if not unified else cache.remove(1, 1, 2)
        cache.seq_pos_min(0)
        cache.seq_pos_max(0)
        cache.can_resume(0, 1)
        cache.apply_pending_shifts()
        cache.defrag()
        path = os.path.join(tmp, f"{dtype}-{unified}.safetensors")
        cache.save_state(path)
        cache.load_state(path)
        data = cache.state_bytes(0)
        cache.load_state_bytes(data, 0)
        cache.seq_keep(0)
        cache.close()


def _attend(attend, cache, batch: int, rng: np.random.Generator) -> None:
    """``attend`` with the dense backend and torch's (``attend`` takes torch queries: nothing
    to do without torch)."""
    try:
        import torch
    except ImportError:
        return
    from .. import attention

    q = torch.from_numpy(rng.standard_normal((batch, 4, 16)).astype(np.float32))
    for backend in ("dense", "auto"):
        attend(q, cache, backend=backend)
    # the CPU kernel's threaded form too (long decodes take it; these tiny lists do not)
    saved = attention._PARALLEL_WORK
    attention._PARALLEL_WORK = 0
    try:
        attend(q, cache, backend="torch")
    finally:
        attention._PARALLEL_WORK = saved


def _step_and_pages(device: str = "cpu") -> None:
    """A captured decode step replayed (``capture_step``) and paged placement
    (``CacheConfig(page_size=...)``) with its page table, shared-page copy and defrag."""
    import numbakv as nkv

    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=2, head_dim=16, dtype="float16", capacity=64,
                          max_seqs=2, max_batch=8, device=device)
    cache = nkv.CausalCache(cfg, shift=nkv.RopeShift())
    step = cache.capture_step(batch=2)
    kv = np.ones((cfg.n_layers, 2, 2, 16), np.float16)
    for pos in range(3):
        step.replay([pos, pos], [0, 1], k=kv, v=kv)
    cache.close()
    if device == "sim":     # the CUDA host half of a step with attention: lists grown in place
        cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=1, head_dim=8, dtype="float16",
                              capacity=16, max_seqs=2, max_batch=2, device=device)
        cache = nkv.CausalCache(cfg)
        step = cache.capture_step(batch=2, attend=True)
        kv1 = np.ones((1, 2, 1, 8), np.float16)
        for pos in range(3):
            step.replay([pos, pos], [0, 1], np.ones((1, 2, 1, 8), np.float32), kv1, kv1)
        cache.close()
    cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=2, head_dim=16, dtype="float16", capacity=64,
                          max_seqs=3, max_batch=16, device=device, page_size=8)
    cache = nkv.CausalCache(cfg, shift=nkv.RopeShift())
    kv = np.ones((6, 2, 16), np.float16)
    cache.start_forward([0, 1, 2, 0, 1, 2], [0, 0, 0, 1, 1, 1])
    cache.set_layer(0)
    cache.put(kv, kv)
    cache.seq_cp(0, 2, 0, None)            # a shared, partly filled last page
    cache.start_forward([3, 3], [0, 2])    # copy-on-write of that page
    cache.set_layer(0)
    cache.put(kv[:2], kv[:2])
    cache.page_table(page_size=8)
    cache.seq_rm(1, 1, 2)
    cache.defrag()
    cache.close()


def _windows_and_chunks(dtype: str, device: str = "cpu") -> None:
    """Sliding-window and chunked-attention caches over several forward passes."""
    import numbakv as nkv

    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=2, head_dim=16, dtype=dtype, capacity=64,
                          max_seqs=2, max_batch=16, device=device)
    kv = np.zeros((4, 2, 16), np.float32).astype(cfg.dtype)
    for kwargs in ({"swa_window": 4}, {"chunk_size": 8}):
        cache = nkv.CausalCache(cfg, shift=nkv.RopeShift(), **kwargs)
        for step in range(6):
            cache.start_forward(range(4 * step, 4 * step + 4), [0] * 4)
            for layer in range(cfg.n_layers):
                cache.set_layer(layer)
                cache.put(kv, kv)
                cache.get()
        cache.close()


def _quantized() -> None:
    """q8_0, q4_0 and fp8 K/V: put, get, a shift and a defrag; and a prefill large enough for
    the threaded put, get and shift (``kernels.quant.PARALLEL_MIN_VALUES``)."""
    import numbakv as nkv
    from ..kernels.quant import PARALLEL_MIN_VALUES

    tokens = PARALLEL_MIN_VALUES // (2 * 64)
    for quant in ("q8_0", "q4_0", "fp8"):
        cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=2, head_dim=64, dtype="float16",
                              k_dtype=quant, v_dtype=quant, capacity=tokens, max_seqs=1,
                              max_batch=tokens, device="cpu")
        cache = nkv.CausalCache(cfg, shift=nkv.RopeShift())
        cache.start_forward(np.arange(tokens), np.zeros(tokens, np.int64))
        cache.set_layer(0)
        kv = np.ones((tokens, 2, 64), np.float16)
        cache.put(kv, kv)
        cache.get()
        cache.seq_add(0, 0, None, 1)    # every cell turns: the threaded shift
        cache.apply_pending_shifts()
        cache.close()
    for quant in ("q8_0", "q4_0", "fp8"):
        cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=2, head_dim=32, dtype="float16",
                              k_dtype=quant, v_dtype=quant, capacity=32, max_seqs=2,
                              max_batch=8, device="cpu")
        cache = nkv.CausalCache(cfg, shift=nkv.RopeShift())
        kv = np.ones((4, 2, 32), np.float16)
        cache.start_forward([0, 1, 2, 3], [0, 0, 1, 1])
        cache.set_layer(0)
        cache.put(kv, kv)
        cache.get()
        cache.seq_add(0, 0, None, 2)
        cache.remove(1, 0, 1)
        cache.apply_pending_shifts()
        cache.defrag()
        cache.close()


def _mixed_formats() -> None:
    """One side quantized, the other float (a q8_0 or q4_0 K with a float16 V, as llama.cpp's
    ``-ctk q8_0``, or the reverse), with float16 and float32 storage: the CPU attention has a
    signature per pair of pool element types (uint8 blocks, uint16 bits, float32), for the
    prefill, decode and pooled forms and the threaded one. Skipped without torch (``attend``
    takes torch queries)."""
    try:
        import torch
    except ImportError:
        return
    import numbakv as nkv
    from .. import attention

    rng = np.random.default_rng(0)
    for dtype in ("float16", "float32"):
        for side in ("k_dtype", "v_dtype"):
            cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=2, head_dim=32, dtype=dtype,
                                  capacity=32, max_seqs=2, max_batch=8, device="cpu",
                                  **{side: "q8_0"})
            cache = nkv.CausalCache(cfg, shift=nkv.RopeShift())
            cache.start_forward([0, 1, 2, 0, 1], [0, 0, 0, 1, 1])
            cache.set_layer(0)
            kv = np.ones((5, 2, 32), dtype)
            cache.put(kv, kv)
            q = torch.from_numpy(rng.standard_normal((5, 4, 32)).astype(np.float32))
            for backend in ("torch", "auto"):
                attention.attend(q, cache, backend=backend)
            saved = attention._PARALLEL_WORK
            attention._PARALLEL_WORK = 0
            try:
                attention.attend(q, cache, backend="torch")
            finally:
                attention._PARALLEL_WORK = saved
            cache.close()


def _latents() -> None:
    """MLA latent caches (``v_head_dim=0``: the value is the first ``v_dim`` values of each
    cached row) on the CPU: ``attend(..., v_dim=)`` reads V as a strided view of the latent
    pool, another signature of the CPU attention than a plain cache's, per storage dtype (the
    one-thread form: the threaded one, ~12 s to compile, would add ~0.3 MiB a pool type); and
    a q8_0 latent whose rope dims are neither 64 nor 128 (MiniCPM3's 32: outside the fused
    per-row rotation), shifted: the quantized RoPE on a strided view of the rope blocks, one
    thread and threaded (a long sequence), each ~85 CPU s to compile on first use; and
    fp8_ds_mla latents put and read. The attention is skipped without torch (``attend`` takes
    torch queries)."""
    import ml_dtypes  # noqa: F401 -- numpy's "bfloat16" dtype (numba-cuda's dependency)

    import numbakv as nkv
    from .. import attention

    rank, rope = 16, 8
    rng = np.random.default_rng(0)
    try:
        import torch
    except ImportError:
        torch = None
    for dtype in ("float32", "float16", "bfloat16") if torch is not None else ():
        cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=1, head_dim=rank + rope, v_head_dim=0,
                              dtype=dtype, capacity=16, max_seqs=2, max_batch=8, device="cpu")
        cache = nkv.CausalCache(cfg, shift=nkv.RopeShift(dim=rope, offset=rank))
        cache.start_forward([0, 1, 2, 0, 1], [0, 0, 0, 1, 1])
        cache.set_layer(0)
        cache.put(rng.standard_normal((5, 1, rank + rope)).astype(np.float32).astype(
            cfg.dtype), None)
        q = torch.from_numpy(rng.standard_normal((5, 4, rank + rope)).astype(np.float32))
        q = q.to(getattr(torch, dtype))
        for backend in ("torch", "auto"):
            attention.attend(q, cache, backend=backend, v_dim=rank)
        cache.close()
    rank, rope = 64, 32
    for tokens in (6, 4096):         # the threaded rotation from 2**18 values on
        cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=1, head_dim=rank + rope, v_head_dim=0,
                              k_dtype="q8_0", capacity=tokens, max_seqs=1, max_batch=tokens,
                              device="cpu")
        cache = nkv.CausalCache(cfg, shift=nkv.RopeShift(dim=rope, offset=rank))
        cache.start_forward(np.arange(tokens), np.zeros(tokens, np.int64))
        rows = np.ones((tokens, 1, rank + rope), cfg.dtype)
        for layer in range(cfg.n_layers):
            cache.set_layer(layer)
            cache.put(rows, None)
        cache.seq_add(0, 0, None, 3)
        cache.apply_pending_shifts()
        cache.close()
    # DeepSeek V3.2's fp8_ds_mla rows (FlashMLA's 656 bytes) on the CPU: the put and get per
    # input / output dtype (float16 goes through float32)
    for dtype in ("bfloat16", "float16", "float32"):
        cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=1, head_dim=576, v_head_dim=0,
                              dtype=dtype, k_dtype="fp8_ds_mla", capacity=8, max_seqs=1,
                              device="cpu")
        cache = nkv.CausalCache(cfg, shift=nkv.RopeShift(dim=64, offset=512))
        cache.start_forward(np.arange(4), np.zeros(4, np.int64))
        cache.set_layer(0)
        cache.put(rng.standard_normal((4, 1, 576)).astype(np.float32).astype(cfg.dtype), None)
        cache.get()
        cache.close()


def _encoder_and_refusals() -> None:
    """Attention over an encoder cache (cross-attention: every token sees every cell, its own
    flag array); a batch refused for want of room by a wrapper of a sliding-window and a full
    cache after the window cache evicted and defragmented for it (both taken back); and a shift
    function that fails inside ``start_forward`` (the placement taken back)."""
    import numbakv as nkv

    try:
        import torch
        from ..attention import attend
    except ImportError:
        torch = None
    if torch is not None:
        cfg = nkv.CacheConfig(1, 2, 16, dtype="float32", capacity=8, max_seqs=2, device="cpu")
        enc = nkv.EncoderCache(cfg)
        enc.start_forward([0, 0, 1], [0, 1, 0], encoder_pos=0)
        kv = np.ones((4, 2, 16), np.float32)
        enc.put(kv, kv)
        attend(torch.ones((3, 4, 16)), enc)

    def cache(capacity, **kw):
        cfg = nkv.CacheConfig(1, 2, 16, dtype="float16", capacity=capacity, max_batch=2,
                              device="cpu")
        return nkv.CausalCache(cfg, **kw)
    wrap = nkv.WrapperCache([cache(8, swa_window=1, swa_memory=2), cache(4)],
                            layer_groups=[0, 1])
    for positions in ([0], [1, 2]):
        wrap.start_forward(positions, [0] * len(positions))
        for layer in range(2):
            wrap.set_layer(layer)
            kv = np.ones((len(positions), 2, 16), np.float16)
            wrap.put(kv, kv)
    try:
        wrap.start_forward([3, 4], [0, 0])
    except nkv.KVCacheFullError:
        pass
    failing = nkv.CausalCache(nkv.CacheConfig(1, 2, 16, dtype="float16", capacity=8,
                                              device="cpu"),
                              shift=lambda layer, key, deltas: key[:1])   # the wrong shape
    failing.start_forward([0, 1, 2], [0] * 3)
    failing.seq_add(0, 1, None, 5)
    try:
        failing.start_forward([10], [0])
    except ValueError:
        pass


def _readme_quantized() -> None:
    """The README's quantized example as pasted (float32 K/V into q8_0 blocks), and float32
    input to every quantized format: the quantizing put and the dequantizing get have a
    signature per input dtype."""
    import numbakv as nkv

    for quant in ("q8_0", "q4_0", "fp8"):
        cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=2, head_dim=64, capacity=256, max_seqs=1,
                              max_batch=64, dtype="float32", k_dtype=quant, v_dtype=quant,
                              device="cpu")
        cache = nkv.CausalCache(cfg)
        k = np.random.default_rng(0).standard_normal((16, 2, 64)).astype(np.float32)
        cache.start_forward(list(range(16)), [0] * 16)
        cache.set_layer(0)
        cache.put(k, k)
        key, value, mask = cache.get()
        float(np.abs(np.asarray(key)[:16] - k).max())
        cache.close()


def _strided_inputs() -> None:
    """Puts of strided K/V: a ``[heads, batch, dim]`` array transposed, or K and V split out of
    one fused projection (what a torch model hands over). numba types them as non-contiguous
    arrays, another signature than contiguous input, per storage width and per quantized
    format; both scatter puts and range puts."""
    import numbakv as nkv

    for dtype, quant in (("float32", None), ("float16", None), ("bfloat16", None),
                         ("float16", "q8_0"), ("float16", "q4_0"), ("float16", "fp8"),
                         ("float32", "q8_0"), ("float32", "q4_0"), ("float32", "fp8")):
        extra = {"k_dtype": quant, "v_dtype": quant} if quant else {}
        cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=2, head_dim=32, dtype=dtype, capacity=32,
                              max_seqs=2, max_batch=16, device="cpu", **extra)
        cache = nkv.CausalCache(cfg, shift=nkv.RopeShift())
        fused = np.ones((4, 2, 2 * 32), np.float32).astype(cfg.dtype)   # [batch, heads, K|V]
        key, value = fused[:, :, :32], fused[:, :, 32:]
        heads_first = np.ones((2, 4, 32), np.float32).astype(cfg.dtype).transpose(1, 0, 2)
        for positions, seqs in (([0, 1, 0, 1], [0, 0, 1, 1]), ([2, 3, 2, 3], [0, 0, 1, 1])):
            cache.start_forward(positions, seqs)     # the second batch: scattered cells
            cache.set_layer(0)
            cache.put(key, value)
            cache.get()
        cache.start_forward([4, 5, 6, 7], [0, 0, 0, 0])   # a contiguous run: the range put
        cache.set_layer(0)
        cache.put(heads_first, heads_first)
        cache.get()
        cache.close()


def _transformers() -> None:
    """The README's transformers examples on a tiny random Llama: ``generate()`` through
    ``hf.generation_cache`` (float K/V and q8_0), ``hf.Server`` and ``hf.attach``. Skipped
    without torch and transformers (the shipped code then lacks what only they reach)."""
    try:
        import torch
        import transformers
    except ImportError:
        return
    from .. import hf

    def llama(hidden: int):
        config = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden,
                                          intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config).eval()

    model = llama(64)                        # the README's: 4 heads of 16
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    # transformers 5.24 renamed generate's past_key_values= to cache= (and warns on the old)
    renamed = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24)
    # q8_0 blocks run along head_dim (a multiple of 32): heads of 32 for the quantized run,
    # on the unpadded row (a left-padded batch with q8_0 K/V raised "a padded pass after the
    # prompt" on 2026-11-26; the float run covers padding)
    runs = ((model, ids, mask, {}),
            (llama(128), ids[1:], mask[1:], {"k_dtype": "q8_0", "v_dtype": "q8_0"}))
    for gen_model, gen_ids, gen_mask, quant in runs:
        past = hf.generation_cache(gen_model, max_new_tokens=8, **quant)
        gen_model.generate(gen_ids, attention_mask=gen_mask, max_new_tokens=8, do_sample=False,
                           pad_token_id=0, **{"cache" if renamed else "past_key_values": past})
    server = hf.Server(model, hf.cache_for(model, capacity=256, max_seqs=4))
    for prompt in ([1, 5, 9], [1, 22, 7, 3], [1, 40], [1]):
        server.submit(prompt, max_new_tokens=8)
    while server.pending:
        server.step()
    hf.detach(model)                         # the server attached it
    cache = hf.cache_for(model, capacity=64, max_seqs=2)
    hf.attach(model, cache)
    try:
        positions = [0, 1, 2, 0, 1]
        cache.start_forward(positions, [0, 0, 0, 1, 1])
        model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), position_ids=torch.tensor([positions]))
    finally:
        hf.detach(model)


def _prompt_cache(tmp: str) -> None:
    """The README's prompt-cache walk: load, extend, shift, release, save and load a slot."""
    import numbakv as nkv

    cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=2, head_dim=16, capacity=16, max_seqs=2,
                          max_batch=16, device="cpu")
    cache = nkv.CausalCache(cfg, shift=nkv.RopeShift())
    pc = nkv.PromptCache(cache, multi_user=True)
    kv = np.zeros((12, 2, 16), cfg.dtype)
    slot, remaining = pc.load(list(range(12)))
    cache.start_forward(range(len(remaining)), [slot] * len(remaining))
    cache.set_layer(0)
    cache.put(kv, kv)
    pc.extend(slot, remaining)
    pc.shift(slot, num_keep=2)
    path = os.path.join(tmp, "slot.safetensors")
    pc.save_slot(slot, path)
    pc.release(slot)
    pc.load_slot(path)
    cache.close()


def _bench_quick() -> None:
    """``numbakv bench --quick`` (its timings cut short, its report discarded)."""
    import contextlib
    import io

    from . import bench  # bench's own sub-command parser: cli imports this module, not back
    parser = argparse.ArgumentParser(prog="numbakv")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--quick", "--no-plot", "--budget", "0.01"])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        args.func(args)


def _run_parts(parts: Dict[str, Callable[[str], object]], verbose: bool) -> Dict[str, float]:
    """Run each of ``parts`` (name -> callable taking a scratch folder) in order, in one
    temporary folder; returns seconds per part (printed as they finish when ``verbose``)."""
    times: Dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="numbakv-precompile-") as tmp:
        for name, part in parts.items():
            t0 = time.perf_counter()
            part(tmp)
            times[name] = time.perf_counter() - t0
            if verbose:
                print(f"  {name:<22} {times[name]:6.1f} s", flush=True)
    return times


def common_path(verbose: bool = False) -> Dict[str, float]:
    """Run the common path (module docstring) once on the CPU; returns seconds per part."""
    from .demo import run_demo

    parts = {
        "demo float32": lambda tmp: run_demo(device="cpu", plot_path=None, progress=False),
        "demo float16": lambda tmp: run_demo(device="cpu", plot_path=None, progress=False,
                                             dtype="float16", steps=30),
        "demo bfloat16": lambda tmp: run_demo(device="cpu", plot_path=None, progress=False,
                                              dtype="bfloat16", steps=30),
        "demo sliding window": lambda tmp: run_demo(device="cpu", plot_path=None,
                                                    progress=False, swa_window=8, steps=30),
        "tour float32": lambda tmp: _tour("float32", tmp),
        "tour float16": lambda tmp: _tour("float16", tmp),
        "tour bfloat16": lambda tmp: _tour("bfloat16", tmp),
        "windows and chunks": lambda tmp: [_windows_and_chunks(d)
                                             for d in ("float32", "float16")],
        "step and pages": lambda tmp: _step_and_pages(),
        "quantized": lambda tmp: _quantized(),
        "README quantized": lambda tmp: _readme_quantized(),
        "mixed quantized/float K/V": lambda tmp: _mixed_formats(),
        "strided inputs": lambda tmp: _strided_inputs(),
        "MLA latents": lambda tmp: _latents(),
        "encoder, refusals": lambda tmp: _encoder_and_refusals(),
        "transformers": lambda tmp: _transformers(),
        "prompt cache": _prompt_cache,
        "bench --quick": lambda tmp: _bench_quick(),
    }
    return _run_parts(parts, verbose)


class _CompileCounter:
    """Records numba compiles (not cache loads) of functions whose module starts with
    ``prefix`` while registered (a ``with`` block)."""

    def __init__(self, prefix: str = "numbakv") -> None:
        from numba.core import event

        class Listener(event.Listener):
            def on_start(inner, ev) -> None:  # noqa: N805 - numba's listener protocol
                dispatcher = ev.data.get("dispatcher")
                if type(getattr(dispatcher, "_cache", None)).__name__ == "NullCache":
                    # cache=False by design (inline="always" element math: compiled into its
                    # callers; the simulator calls it from Python): nothing to ship
                    return
                fn = getattr(dispatcher, "py_func", None)
                if getattr(fn, "__module__", "").startswith(prefix):
                    self.names.append(f"{fn.__module__}.{fn.__qualname__}")

            def on_end(inner, ev) -> None:  # noqa: N805
                pass

        self.names: List[str] = []
        self._listener = Listener()
        self._event = event

    def __enter__(self) -> "_CompileCounter":
        self._event.register("numba:compile", self._listener)
        return self

    def __exit__(self, *exc) -> None:
        self._event.unregister("numba:compile", self._listener)


def cuda_host_path(verbose: bool = False) -> Dict[str, float]:
    """The host side of the CUDA path (the ``@njit`` bookkeeping a GPU cache runs on the CPU:
    page tables and mask gathers for device pools, ...), run on tiny caches on device ``sim``:
    Numba's CUDA simulator runs the same host code a GPU does, so the functions only a GPU
    cache calls are compiled (and shipped) without a GPU. Needs ``NUMBA_ENABLE_CUDASIM=1`` in
    this process's environment before numba.cuda is imported (:func:`_run_child` sets it).
    Returns seconds per part."""
    parts = {
        "cuda host: tour float32": lambda tmp: _tour("float32", tmp, device="sim"),
        "cuda host: tour float16": lambda tmp: _tour("float16", tmp, device="sim"),
        "cuda host: tour bfloat16": lambda tmp: _tour("bfloat16", tmp, device="sim"),
        "cuda host: windows/chunks": lambda tmp: [_windows_and_chunks(d, device="sim")
                                                  for d in ("float32", "float16")],
        "cuda host: step/pages": lambda tmp: _step_and_pages(device="sim"),
    }
    return _run_parts(parts, verbose)


#: the child modes that run the CUDA host path under the simulator instead of the common path
_CUDA_HOST_MODES = {"build-cuda-host": "build", "check-cuda-host": "check",
                    "host-cuda-host": "host"}


def _child(mode: str) -> int:
    """The child process: ``build`` (of ``--ship``) compiles the common path for the shipped
    level; ``check`` runs it again and fails if anything of numbakv compiled; ``host`` (of
    ``numbakv precompile``) compiles it for this host into numba's cache. The same modes with
    ``-cuda-host`` appended run :func:`cuda_host_path` instead (in a simulator process)."""
    path = cuda_host_path if mode in _CUDA_HOST_MODES else common_path
    mode_kind = _CUDA_HOST_MODES.get(mode, mode)
    with _CompileCounter() as compiled:
        t0 = time.perf_counter()
        path(verbose=mode_kind != "check")
        took = time.perf_counter() - t0
    print(f"{mode}: {len(compiled.names)} numbakv compiles, {took:.1f} s", flush=True)
    if mode_kind == "check" and compiled.names:
        print("compiled although shipped: " + ", ".join(sorted(set(compiled.names))))
        return 1
    return 0


def _run_child(mode: str, python: str = "", **env: str) -> int:
    """Run :func:`_child` ``mode`` in a fresh interpreter (``python``, default this one) with
    ``env`` added to this one's (and the compile notice off: the parent reports), then the
    same mode over the CUDA host path in a second one with the CUDA simulator on; returns the
    first non-zero exit status (0 when both pass). Another interpreter imports this checkout's
    numbakv (``PYTHONPATH``)."""
    rc = _run_one_child(mode, python, **env)
    if rc:
        return rc
    return _run_one_child(f"{mode}-cuda-host", python, NUMBA_ENABLE_CUDASIM="1", **env)


def _run_one_child(mode: str, python: str = "", **env: str) -> int:
    """One child of :func:`_run_child`."""
    full = {k: v for k, v in os.environ.items() if k != _jit.BUILD_ENV}
    full.update(NUMBAKV_COMPILE_NOTICE="0", **env)
    if python:
        root = str(_jit.SHIPPED_DIR.parent.parent)
        full["PYTHONPATH"] = os.pathsep.join(
            [root] + [p for p in full.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.call([python or sys.executable, "-m", "numbakv.tools.precompile",
                            _CHILD_FLAG, mode], env=full)


def python_tag(python: str = "") -> str:
    """The ``pyXY`` tag numba's cache files of interpreter ``python`` (default this one) carry."""
    if not python:
        return f"py{sys.version_info[0]}{sys.version_info[1]}"
    out = subprocess.run([python, "-c", "import sys; print('py%d%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def interpreter_problem(python: str) -> str:
    """Why interpreter ``python`` cannot build shipped code for this checkout ('' if it can):
    it must import numba (the same version as this process: the shipped code is stamped with
    it), numpy and ml_dtypes (the common path puts bfloat16 arrays)."""
    import numba
    code = "import numba, numpy, ml_dtypes; print(numba.__version__)"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {exc}"
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["failed"])[-1]
        return f"{python}: {last} (install numbakv's dependencies and ml_dtypes there)"
    if out.stdout.strip() != numba.__version__:
        return (f"{python} has numba {out.stdout.strip()}, this process {numba.__version__}: "
                "install the same numba version")
    return ""


def ship(pythons=()) -> int:
    """Rebuild ``numbakv/_precompiled/`` (module docstring) for this interpreter, or for each
    interpreter in ``pythons`` (paths; each needs numbakv's dependencies, the same numba
    version, installed): only the files of the interpreters built are replaced, so the shipped
    code of several CPython versions lives side by side (numba tags its cache files
    ``.pyXY.``). Returns an exit status."""
    out = _jit.SHIPPED_DIR
    targets = list(pythons) or [""]
    for python in targets:
        problem = interpreter_problem(python) if python else ""
        if problem:
            print(f"numbakv precompile --ship: {problem}", file=sys.stderr)
            return 2
    tags = [python_tag(p) for p in targets]
    out.mkdir(exist_ok=True)
    for tag in tags:
        for stale in out.glob(f"*.{tag}.*"):
            stale.unlink()
    for python, tag in zip(targets, tags):
        print(f"compiling numbakv's common path for {_jit.SHIPPED_CPU} ({tag}) into {out}",
              flush=True)
        rc = _run_child("build", python, **{_jit.BUILD_ENV: "1",
                                            "NUMBA_CPU_NAME": _jit.SHIPPED_CPU,
                                            "NUMBA_CPU_FEATURES": _jit.SHIPPED_FEATURES})
        if rc:
            return rc
        mine = list(out.glob(f"*.{tag}.*"))
        size = sum(p.stat().st_size for p in mine)
        print(f"{tag}: {sum(p.suffix == '.nbi' for p in mine)} functions, "
              f"{sum(p.suffix == '.nbc' for p in mine)} signatures, {size / 2**20:.1f} MiB",
              flush=True)
        if not _jit.shipped_cache_usable():
            print("this host cannot load the shipped code (not x86-64-v3): check skipped")
            continue
        with tempfile.TemporaryDirectory(prefix="numbakv-precompile-check-") as empty_cache:
            rc = _run_child("check", python, NUMBA_CACHE_DIR=empty_cache)
        if rc:
            return rc
    return 0


def add_parser(sub) -> None:
    """Add ``precompile`` to the ``numbakv`` command line's sub-commands."""
    p = sub.add_parser(
        "precompile", help="compile numbakv's common path ahead of its first use",
        description="Compile numbakv's common path for this host into numba's cache ahead of "
                    "its first use, or (--ship, for maintainers) rebuild the compiled code "
                    "shipped in the package.")
    p.add_argument("--ship", action="store_true",
                   help="rebuild numbakv/_precompiled for x86-64-v3 and check that it loads")
    p.add_argument("--python", action="append", default=[], metavar="PATH",
                   help="with --ship: build with this interpreter instead (repeatable; e.g. "
                        "a CPython 3.12 and a 3.13 venv with the same numba): only its "
                        "Python version's shipped files are replaced")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``numbakv precompile [--ship]``; returns the exit status."""
    if getattr(args, "python", None) and not args.ship:
        print("--python applies to --ship", file=sys.stderr)
        return 2
    if args.ship:
        return ship(getattr(args, "python", None) or ())
    # a child that ignores the shipped code, so numba compiles (or finds) host-tuned code for
    # all of the path and caches it; later runs look in numba's cache first
    print("numbakv precompile: compiling the common path for this host into numba's cache",
          flush=True)
    return _run_child("host", **{_jit.SWITCH_ENV: "0"})


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == _CHILD_FLAG:
        sys.exit(_child(sys.argv[2]))
    _parser = argparse.ArgumentParser(prog="python -m numbakv.tools.precompile")
    add_parser(_parser.add_subparsers(dest="command", required=True))
    sys.exit(run(_parser.parse_args(["precompile"] + sys.argv[1:])))
