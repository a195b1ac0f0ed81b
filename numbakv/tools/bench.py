"""``numbakv bench``: a quick, self-contained comparison of what a KV cache costs per decode step.

Three sections, all measured in one run on one device with one dtype and one set of shapes:

* **Decode step.** For ``B`` sequences each holding ``L`` tokens, one new token per sequence:
  the cache's bookkeeping for the step, then for each of ``n_layers`` layers store the new K/V
  ``[B, n_kv_heads, head_dim]`` and obtain the K/V (and mask, where the cache makes one) that
  attention would read. Attention itself is not timed (it is the same for every cache).
  Contenders: numbakv's ``CausalCache`` (``start_forward`` + per layer ``set_layer``/``put``/
  ``get``), Hugging Face transformers' ``StaticCache`` and ``DynamicCache`` (``update`` per
  layer, ``[B, H, 1, D]`` torch tensors), and plain "append" caches (``np.concatenate`` /
  ``torch.cat`` per layer). Every contender is pre-filled to ``L`` tokens, checked once to
  return the token it was given, and rolled back to ``L`` tokens after each timed step (the
  rollback is not timed), so every timed step runs at exactly context ``L``. On the CPU numbakv
  also runs with numba's parallel kernels held to one thread ("numbakv 1 thread"), which tells
  what its multi-threaded paths gain or lose on this machine.
* **Kernels.** Bytes moved per second by numbakv's put, mask fill, block move and rotary shift
  as a fraction of a plain copy of the same bytes measured in the same run (``np.copyto`` on
  the CPU, a CuPy device-to-device copy on a GPU; a memset for the mask).
* **Capacity.** numbakv's per-step cost at a fixed context while the cache's capacity grows
  from 4k to 128k cells: it should stay flat.
* **Sequence operations** (``--sections seqops``, not in the default run): see
  ``numbakv/tools/bench_seqops.py``.
* **shared_shift="copy"** (``--sections fidelity``, not in the default run): see
  ``numbakv/tools/bench_fidelity.py``.
* **transformers generate()** (``--sections generate``, not in the default run): per-step cost
  and tok/s against ``StaticCache`` / ``DynamicCache``, see ``numbakv/tools/bench_generate.py``.
* **Hybrid models through the prefix store** (``--sections hybrid``, not in the default run):
  a 10-turn chat and a 30-turn agent trace on a tiny Qwen3-Next, store vs no store, see
  ``numbakv/tools/bench_hybrid.py``.
* **Agent sessions** (``--sections agents``, not in the default run): seeded agent traces
  replayed through ``hf.Server`` with retention priorities and ``load_edit`` against plain LRU,
  see ``numbakv/tools/bench_agents.py``.
* **Recurrent state rows** (``--sections states``, not in the default run): gather / scatter /
  restore-point copies of ``RecurrentCache`` rows vs ``np.copyto``, see
  ``numbakv/tools/bench_states.py``.

Baselines that are not installed (torch, transformers, matplotlib for the plot) are skipped with
a note, never replaced by something else.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

# interleaved timing, one copy for every section (the asv benchmarks import it from here)
from ._timing import time_alternating as _time_alternating
from ._report import target_lines

#: tokens of spare room per sequence beyond the context (the timed step adds one, then rolls back)
_MARGIN = 16
#: a decode config is skipped when its largest contender needs more than this share of free memory
_MEMORY_SHARE = 0.6
#: what --sections may name; the first three run by default, the others on request
SECTIONS = ("decode", "kernels", "capacity", "quant", "seqops", "attention", "streams",
            "attend", "snapshot", "prefix", "fidelity", "generate", "states", "hybrid",
            "agents")


# --------------------------------------------------------------------------------- settings
@dataclass
class BenchSettings:
    """Everything one ``numbakv bench`` run measures; see :func:`settings_from_args`."""

    device: str = "cpu"
    dtype: str = "float16"
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    contexts: List[int] = field(default_factory=lambda: [512, 2048, 4096])
    batches: List[int] = field(default_factory=lambda: [1, 8])
    #: seconds of timed repetitions per measurement (at least ``min_reps`` are always taken)
    budget: float = 0.5
    min_reps: int = 5
    #: capacity section: cells of the cache, the context held, and how many layers (kept small
    #: enough that 128k cells fit in memory: the per-step bookkeeping does not depend on it)
    capacities: List[int] = field(default_factory=lambda: [4096, 16384, 65536, 131072])
    capacity_context: int = 256
    capacity_layers: int = 4
    #: kernel section: tokens per put, (rows, cells) per mask, cells per move and per rotation
    put_tokens: List[int] = field(default_factory=lambda: [1, 8, 64, 512, 4096])
    mask_shapes: List[Tuple[int, int]] = field(default_factory=lambda: [(8, 4096), (512, 4096)])
    move_cells: List[int] = field(default_factory=lambda: [64, 1024, 4096])
    rotate_cells: List[int] = field(default_factory=lambda: [64, 1024, 4096])
    kernel_layers: int = 4
    copy_bytes: int = 64 << 20
    #: seqops section (opt-in: ``--sections seqops``): cells of the caches the sequence
    #: operations run on, contexts and layers of the speculative-decoding step
    seqops_capacities: List[int] = field(default_factory=lambda: [4096, 32768, 262144])
    spec_contexts: List[int] = field(default_factory=lambda: [4096, 32768])
    spec_layers: int = 8
    #: decode section: rounds per (batch, context); each round rebuilds every contender and
    #: interleaves their steps, and the spread of the rounds' ratios is reported
    rounds: int = 3
    #: threads torch and numba's parallel kernels use (None: the CPUs this process may run on),
    #: set explicitly so a run says what it ran with
    threads: Optional[int] = None
    quick: bool = False
    sections: List[str] = field(default_factory=lambda: ["decode", "kernels", "capacity"])


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """Turn parsed command-line options into :class:`BenchSettings` (``--quick``: tiny shapes
    that run in seconds; ``--full``: adds context 8192)."""
    from ..device import resolve_device

    device = resolve_device(args.device)
    if device == "sim":
        raise ValueError("device='sim' runs kernels one Python thread at a time and measures "
                         "nothing useful: use --device cpu or cuda")
    s = BenchSettings(device=device, dtype=args.dtype)
    if args.quick:
        # the decode step at shapes where the comparison means something (8 layers of 8 KV
        # heads x 128, context 1024: K/V ~130 MiB at batch 8) and enough repetitions that the
        # ratios hold between runs; the other sections only when asked (--sections)
        s.layers, s.kv_heads, s.head_dim = 8, 8, 128
        s.contexts, s.batches = [1024], [1, 8]
        s.budget, s.min_reps, s.rounds = 0.25, 5, 5
        s.sections = ["decode"]
        s.capacities, s.capacity_context, s.capacity_layers = [64, 256, 1024], 16, 2
        s.put_tokens, s.mask_shapes = [1, 64, 512], [(2, 64), (16, 256)]
        s.move_cells, s.rotate_cells, s.kernel_layers = [8, 32], [8, 32], 2
        s.copy_bytes = 1 << 20
        s.quick = True
    elif args.full:
        s.contexts = [512, 2048, 4096, 8192]
        s.budget = 1.0
    if args.layers is not None:
        s.layers = _positive("--layers", args.layers)
    if args.kv_heads is not None:
        s.kv_heads = _positive("--kv-heads", args.kv_heads)
    if args.head_dim is not None:
        s.head_dim = _positive("--head-dim", args.head_dim)
    if args.contexts is not None:
        s.contexts = _int_list("--contexts", args.contexts)
    if args.batch is not None:
        s.batches = _int_list("--batch", args.batch)
    if args.budget is not None:
        if not args.budget > 0:
            raise ValueError(f"--budget must be > 0 seconds, got {args.budget}")
        s.budget = float(args.budget)
    if args.rounds is not None:
        s.rounds = _positive("--rounds", args.rounds)
    if args.threads is not None:
        s.threads = _positive("--threads", args.threads)
    if args.sections is not None:
        names = [x.strip() for x in args.sections.split(",") if x.strip()]
        bad = [x for x in names if x not in SECTIONS]
        if bad or not names:
            raise ValueError(f"--sections must be a comma list of {', '.join(SECTIONS)}, got "
                             f"{args.sections!r}")
        s.sections = names
    s.capacity_layers = min(s.capacity_layers, s.layers)
    s.kernel_layers = min(s.kernel_layers, s.layers)
    return s


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _int_list(name: str, text: str) -> List[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{name} must be a comma list of integers >= 1, got {text!r}")
    return values


# --------------------------------------------------------------------------------- device bits
class _Device:
    """Array module, synchronisation and GPU event timing for the device under test."""

    def __init__(self, device: str) -> None:
        self.name = device
        if device == "cuda":
            import cupy
            self.xp = cupy
        else:
            self.xp = np

    def sync(self) -> None:
        if self.name == "cuda":
            self.xp.cuda.get_current_stream().synchronize()
            torch = _optional_torch()
            if torch is not None and torch.cuda.is_available():
                torch.cuda.synchronize()

    def release(self) -> None:
        """Hand cached GPU blocks back (CuPy's pool and torch's caching allocator would otherwise
        keep the previous contender's memory from the next one)."""
        if self.name != "cuda":
            return
        self.xp.get_default_memory_pool().free_all_blocks()
        torch = _optional_torch()
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def asarray(self, host: np.ndarray):
        return self.xp.asarray(host)

    def free_bytes(self) -> Optional[int]:
        if self.name == "cuda":
            try:
                return int(self.xp.cuda.runtime.memGetInfo()[0])
            except Exception:  # noqa: BLE001
                return None
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None


def _optional_torch():
    try:
        import torch
        return torch
    except Exception:  # noqa: BLE001 - a broken torch install counts as "not installed"
        return None


def _torch_device(dev: _Device) -> str:
    return "cuda" if dev.name == "cuda" else "cpu"


def _to_torch(arr, dev: _Device):
    """A torch tensor over ``arr``'s memory (zero-copy through DLPack)."""
    torch = _optional_torch()
    if dev.name == "cuda":
        return torch.from_dlpack(arr)
    return torch.from_numpy(arr)


# --------------------------------------------------------------------------------- timing
def measure(step: Callable[[], Any], reset: Optional[Callable[[], Any]] = None, *,
            sync: Callable[[], None], budget: float, min_reps: int = 5,
            max_reps: int = 100_000, warmup: int = 2) -> Dict[str, float]:
    """Median wall time of ``step`` (synchronised) over repetitions after ``warmup`` calls.

    ``reset`` runs after every call, untimed. Repeats until ``budget`` seconds of timed calls
    have passed and at least ``min_reps`` were taken; a step slower than a third of the budget
    gets no more warm-up and 3 repetitions; one slower than the whole budget counts its first
    call and takes one more (callers make an untimed, checked call first, so it is warm): the
    contenders that copy their whole cache every step stay affordable.
    The garbage collector is off while timing (as in ``timeit``)."""
    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    if reset is not None:
        reset()
    times: List[float] = []
    if first > budget:
        # slower than the whole budget: callers have already made one checked, untimed call,
        # so this one is warm and counts as a sample
        warmup, min_reps = 0, min(min_reps, 2)
        times.append(first)
    elif first > budget / 3:
        warmup, min_reps = 0, min(min_reps, 3)
    for _ in range(max(warmup - 1, 0)):
        step()
        sync()
        if reset is not None:
            reset()
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        spent = 0.0
        while len(times) < max_reps:
            t0 = time.perf_counter()
            step()
            sync()
            dt = time.perf_counter() - t0
            times.append(dt)
            spent += dt
            if reset is not None:
                reset()
            if len(times) >= min_reps and spent >= budget:
                break
    finally:
        if gc_was_on:
            gc.enable()
    arr = np.asarray(times) * 1e6
    return {"median_us": float(np.median(arr)), "p10_us": float(np.percentile(arr, 10)),
            "p90_us": float(np.percentile(arr, 90)), "reps": len(times)}


def measure_kernel(fn: Callable[[], Any], dev: _Device, budget: float,
                   min_reps: int = 5) -> Dict[str, float]:
    """Per-call device time of ``fn``: wall time per call on the CPU; on a GPU, CUDA events
    around a run of calls (so launches overlap as they do in a real step), divided by the
    count."""
    if dev.name != "cuda":
        return measure(fn, sync=dev.sync, budget=budget, min_reps=min_reps, warmup=3)
    cupy = dev.xp
    for _ in range(3):
        fn()
    dev.sync()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    n = 1
    while True:  # grow the run until it lasts a tenth of the budget
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        ms = cupy.cuda.get_elapsed_time(start, end)
        if ms / 1e3 >= budget / 10 or n >= 1 << 16:
            break
        n *= 4
    samples = []
    for _ in range(max(min_reps, 5)):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / n)
    arr = np.asarray(samples)
    return {"median_us": float(np.median(arr)), "p10_us": float(np.percentile(arr, 10)),
            "p90_us": float(np.percentile(arr, 90)), "reps": len(samples) * n}


def measure_graph(fn: Callable[[], Any], dev: _Device, calls: int = 16,
                  reps: int = 15) -> Optional[float]:
    """Device time per call of ``fn`` with the host taken out: ``calls`` calls captured into one
    CUDA graph on a side stream, the graph replayed ``reps`` times between CUDA events (median
    per call). Back-to-back calls (:func:`measure_kernel`) are bound by the host whenever a call
    costs the CPU more than the GPU; this is what the kernels themselves (and the copies of
    their small inputs) take. None where capture fails (the reason is logged by the caller)."""
    cupy = dev.xp
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(3):  # warm: compiled kernels, this stream's staging buffers, the pool
            fn()
        stream.synchronize()
        stream.begin_capture()
        try:
            for _ in range(calls):
                fn()
        finally:
            graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        samples = []
        for _ in range(reps):
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / calls)
    return float(np.median(samples))


def _graph_pair(fn: Callable[[], Any], base: Callable[[], Any], dev: _Device,
                notes: List[str]) -> Tuple[Optional[float], Optional[float]]:
    """:func:`measure_graph` of a kernel and of its baseline; ``(None, None)`` off the GPU or
    where capture failed (noted once)."""
    if dev.name != "cuda":
        return None, None
    try:
        return measure_graph(fn, dev), measure_graph(base, dev)
    except Exception as exc:  # noqa: BLE001 - a report, not a failure: back-to-back stays
        msg = f"graph-replay kernel times unavailable: {type(exc).__name__}: {exc}"
        if msg not in notes:
            notes.append(msg)
        return None, None


def measure_pair(fn: Callable[[], Any], base: Callable[[], Any], dev: _Device, budget: float,
                 min_reps: int = 5) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Per-call time of a kernel ``fn`` and of its baseline ``base`` (a plain copy of the same
    bytes). On the CPU the two calls alternate, so both see the same machine: a load that comes
    and goes (other processes, memory pressure) moves both, and their ratio stays meaningful.
    On a GPU each is timed with CUDA events (:func:`measure_kernel`)."""
    if dev.name == "cuda":
        return measure_kernel(fn, dev, budget, min_reps), measure_kernel(base, dev, budget,
                                                                          min_reps)
    for _ in range(3):
        fn()
        base()
    t_fn: List[float] = []
    t_base: List[float] = []
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        spent = 0.0
        while len(t_fn) < 100_000:
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            base()
            t2 = time.perf_counter()
            t_fn.append(t1 - t0)
            t_base.append(t2 - t1)
            spent += t2 - t0
            if len(t_fn) >= min_reps and spent >= 2 * budget:
                break
    finally:
        if gc_was_on:
            gc.enable()

    def stats(times):
        arr = np.asarray(times) * 1e6
        return {"median_us": float(np.median(arr)), "p10_us": float(np.percentile(arr, 10)),
                "p90_us": float(np.percentile(arr, 90)), "reps": len(times)}

    return stats(t_fn), stats(t_base)


# --------------------------------------------------------------------------------- contenders
class _Contender:
    """One KV cache under test, pre-filled to ``context`` tokens for ``batch`` sequences.

    ``step()`` is one timed decode step and returns what the last layer would hand to
    attention; ``reset()`` (untimed) brings the cache back to ``context`` tokens; ``verify(out)``
    checks that ``out`` holds the token just stored; ``close()`` frees the memory."""

    name = "?"
    #: peak memory as a multiple of the K/V bytes at context L (copying caches hold two copies)
    memory_factor = 1

    def begin(self) -> None:
        """Called before the contender is checked and timed (and ``end`` after)."""

    def end(self) -> None:
        pass

    def step(self):  # pragma: no cover - overridden
        raise NotImplementedError

    def reset(self) -> None:
        pass

    def verify(self, out) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def close(self) -> None:
        pass


def _random(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def _prefill_block(rng: np.random.Generator, batch: int, heads: int, context: int, dim: int,
                   dtype) -> np.ndarray:
    """``[batch, heads, context, dim]`` filler: a small random block tiled (values only need to
    be finite; generating gigabytes of random numbers would dominate the run)."""
    chunk = min(context, 256)
    block = _random(rng, (1, heads, chunk, dim), dtype)
    reps = -(-context // chunk)
    return np.ascontiguousarray(np.tile(block, (batch, 1, reps, 1))[:, :, :context])


class _DecodeInputs:
    """The new K/V of one decode step, per layer, for every contender: host numpy
    ``[B, H, D]`` arrays plus device arrays and ``[B, H, 1, D]`` torch views of the same."""

    def __init__(self, s: BenchSettings, batch: int, dev: _Device, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        dt = np.dtype(s.dtype)
        self.host_k = [_random(rng, (batch, s.kv_heads, s.head_dim), dt) for _ in range(s.layers)]
        self.host_v = [_random(rng, (batch, s.kv_heads, s.head_dim), dt) for _ in range(s.layers)]
        self.k = [dev.asarray(x) for x in self.host_k]
        self.v = [dev.asarray(x) for x in self.host_v]
        self.k4 = [x[:, :, None, :] for x in self.k]
        self.v4 = [x[:, :, None, :] for x in self.v]
        self._torch: Optional[Tuple[list, list]] = None
        self._dev = dev

    def torch4(self) -> Tuple[list, list]:
        """``[B, H, 1, D]`` torch tensors over the same memory as ``k``/``v``."""
        if self._torch is None:
            self._torch = ([_to_torch(x, self._dev)[:, :, None, :] for x in self.k],
                           [_to_torch(x, self._dev)[:, :, None, :] for x in self.v])
        return self._torch


def _host(x) -> np.ndarray:
    """A host numpy copy of a numpy/CuPy array or torch tensor (for checks only)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy.asnumpy(x)
    return np.asarray(x)


def _bhld_holds(keys, values, index: int, inputs: _DecodeInputs) -> bool:
    """Whether ``[B, H, L, D]`` keys/values hold the last layer's new token at ``index``."""
    k, v = _host(keys), _host(values)
    return (k.shape[2] > index and np.array_equal(k[:, :, index, :], inputs.host_k[-1])
            and np.array_equal(v[:, :, index, :], inputs.host_v[-1]))


class NumbakvContender(_Contender):
    """numbakv's ``CausalCache``: ``start_forward`` + per layer ``set_layer``/``put``/``get``."""

    name = "numbakv"

    def __init__(self, s: BenchSettings, batch: int, context: int, inputs: _DecodeInputs,
                 dev: _Device, capacity: Optional[int] = None, layers: Optional[int] = None):
        from ..causal import CausalCache
        from ..config import CacheConfig

        self.layers = s.layers if layers is None else layers
        self.context, self.batch = context, batch
        per_seq = context + _MARGIN if capacity is None else capacity // batch
        cfg = CacheConfig(self.layers, s.kv_heads, s.head_dim, dtype=s.dtype, capacity=per_seq,
                          max_seqs=batch, max_batch=max(512, batch), device=dev.name)
        self.cache = CausalCache(cfg)
        self.inputs = inputs
        self._prefill(np.random.default_rng(1), cfg, dev)
        self.positions = np.full(batch, context, np.int32)
        self.seqs = np.arange(batch, dtype=np.int32)

    def _prefill(self, rng, cfg, dev: _Device) -> None:
        """Each sequence's first ``context`` tokens, in chunks of ``max_batch``."""
        chunk = min(cfg.max_batch, self.context)
        k = dev.asarray(_random(rng, (chunk, cfg.n_kv_heads, cfg.head_dim), np.dtype(cfg.dtype)))
        for seq in range(self.batch):
            for p0 in range(0, self.context, chunk):
                n = min(chunk, self.context - p0)
                self.cache.start_forward(np.arange(p0, p0 + n, dtype=np.int32),
                                         np.full(n, seq, np.int32))
                for layer in range(self.layers):
                    self.cache.set_layer(layer)
                    self.cache.put(k[:n], k[:n])

    def step(self):
        self.start_forward_only()
        return self.layers_only()

    def start_forward_only(self) -> None:
        self.cache.start_forward(self.positions, self.seqs)

    def layers_only(self):
        cache, ks, vs = self.cache, self.inputs.k, self.inputs.v
        out = None
        for layer in range(self.layers):
            cache.set_layer(layer)
            cache.put(ks[layer], vs[layer])
            out = cache.get()
        return out

    def reset(self) -> None:
        self.cache.seq_rm(-1, self.context)

    def verify(self, out) -> bool:
        key, value, mask = (_host(x) for x in out)
        want_k = self.inputs.host_k[self.layers - 1].reshape(self.batch, -1)
        want_v = self.inputs.host_v[self.layers - 1].reshape(self.batch, -1)
        flat_k, flat_v = key.reshape(len(key), -1), value.reshape(len(value), -1)
        if mask.shape[0] < self.batch or mask.shape[1] != len(key):
            return False
        for b in range(self.batch):
            rows = [r for r in np.flatnonzero(flat_k[:, 0] == want_k[b, 0])
                    if np.array_equal(flat_k[r], want_k[b])
                    and np.array_equal(flat_v[r], want_v[b])]
            if not rows or mask[b, rows[-1]] != 0:
                return False
        # every sequence sees exactly its context plus the new token
        visible = (mask[:self.batch] == 0).sum(axis=1)
        return bool(np.all(visible == self.context + 1))

    def close(self) -> None:
        self.cache.close()
        self.cache = None


@contextlib.contextmanager
def _one_numba_thread():
    """numba's parallel CPU kernels held to one thread (``numba.set_num_threads``) inside."""
    import numba
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(threads)


class NumbakvOneThreadContender(NumbakvContender):
    """numbakv with numba's parallel CPU kernels held to one thread (:func:`_one_numba_thread`):
    shows what the multi-threaded kernel paths (big masks, big puts) gain or, on a busy
    machine, lose to waiting for a core."""

    name = "numbakv 1 thread"

    def begin(self) -> None:
        self._held = _one_numba_thread()
        self._held.__enter__()

    def end(self) -> None:
        self._held.__exit__(None, None, None)


class _AppendContender(_Contender):
    """A plain append cache: per layer, concatenate the stored ``[B, H, L, D]`` K/V with the new
    token along the sequence axis, as a naive runtime would. Subclasses set ``base_k`` /
    ``base_v`` (the prefilled layers), ``k4`` / ``v4`` (the new token per layer) and ``cat``."""

    memory_factor = 2

    def _start(self, layers: int, block, copy, inputs: _DecodeInputs, context: int) -> None:
        self.base_k = [copy(block) for _ in range(layers)]
        self.base_v = [copy(block) for _ in range(layers)]
        self.cur_k, self.cur_v = list(self.base_k), list(self.base_v)
        self.inputs, self.context = inputs, context

    def step(self):
        cat, ck, cv, k4, v4 = self.cat, self.cur_k, self.cur_v, self.k4, self.v4
        for layer in range(len(ck)):
            ck[layer] = cat(ck[layer], k4[layer])
            cv[layer] = cat(cv[layer], v4[layer])
        return ck[-1], cv[-1]

    def reset(self) -> None:
        self.cur_k[:], self.cur_v[:] = self.base_k, self.base_v

    def verify(self, out) -> bool:
        return _bhld_holds(out[0], out[1], self.context, self.inputs)

    def close(self) -> None:
        self.base_k = self.base_v = self.cur_k = self.cur_v = None


class NumpyAppendContender(_AppendContender):
    """``np.concatenate`` per layer (``cupy.concatenate`` on a GPU)."""

    def __init__(self, s: BenchSettings, batch: int, context: int, inputs: _DecodeInputs,
                 dev: _Device):
        self.name = "cupy append" if dev.name == "cuda" else "numpy append"
        block = dev.asarray(_prefill_block(np.random.default_rng(2), batch, s.kv_heads, context,
                                           s.head_dim, np.dtype(s.dtype)))
        self._start(s.layers, block, lambda b: b.copy(), inputs, context)
        concatenate = dev.xp.concatenate
        self.cat = lambda a, b: concatenate((a, b), axis=2)
        self.k4, self.v4 = inputs.k4, inputs.v4


class TorchAppendContender(_AppendContender):
    """``torch.cat`` per layer along the sequence axis."""

    name = "torch append"

    def __init__(self, s: BenchSettings, batch: int, context: int, inputs: _DecodeInputs,
                 dev: _Device):
        torch = _optional_torch()
        block = _to_torch(dev.asarray(_prefill_block(np.random.default_rng(3), batch, s.kv_heads,
                                                     context, s.head_dim, np.dtype(s.dtype))),
                          dev)
        self._start(s.layers, block, lambda b: b.clone(), inputs, context)
        self.cat = lambda a, b: torch.cat((a, b), dim=2)
        self.k4, self.v4 = inputs.torch4()


def _hf_model_config(s: BenchSettings):
    """A Llama-shaped transformers config with the benchmark's shapes (GQA 4:1)."""
    from transformers import LlamaConfig
    heads = s.kv_heads * 4
    return LlamaConfig(hidden_size=heads * s.head_dim, num_attention_heads=heads,
                       num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                       num_hidden_layers=s.layers, intermediate_size=4 * heads * s.head_dim,
                       max_position_embeddings=1 << 20, vocab_size=32)


def _hf_layer_tensors(cache) -> Optional[List[list]]:
    """``[keys per layer, values per layer]`` of a DynamicCache, across transformers versions
    (``cache.layers[i].keys`` from 4.56 on, ``cache.key_cache[i]`` before)."""
    layers = getattr(cache, "layers", None)
    if layers and hasattr(layers[0], "keys"):
        return [[lay.keys for lay in layers], [lay.values for lay in layers]]
    if hasattr(cache, "key_cache"):
        return [list(cache.key_cache), list(cache.value_cache)]
    return None


def _hf_set_layer_tensors(cache, state: List[list]) -> None:
    layers = getattr(cache, "layers", None)
    if layers and hasattr(layers[0], "keys"):
        for lay, k, v in zip(layers, state[0], state[1]):
            lay.keys, lay.values = k, v
    else:
        cache.key_cache[:] = state[0]
        cache.value_cache[:] = state[1]


class HFDynamicContender(_Contender):
    """transformers' ``DynamicCache``: ``update(k, v, layer_idx)`` per layer (a ``torch.cat``
    of the whole layer cache with the new token)."""

    memory_factor = 2

    name = "HF DynamicCache"

    def __init__(self, s: BenchSettings, batch: int, context: int, inputs: _DecodeInputs,
                 dev: _Device):
        from transformers import DynamicCache
        block = _to_torch(dev.asarray(_prefill_block(np.random.default_rng(4), batch, s.kv_heads,
                                                     context, s.head_dim, np.dtype(s.dtype))),
                          dev)
        self.cache = DynamicCache()
        for layer in range(s.layers):
            self.cache.update(block, block, layer)
        del block
        self.saved = _hf_layer_tensors(self.cache)
        if self.saved is None:
            raise RuntimeError("this transformers version's DynamicCache keeps its tensors where "
                               "the bench cannot roll them back")
        self.seen = getattr(self.cache, "_seen_tokens", None)
        self.k4, self.v4 = inputs.torch4()
        self.inputs, self.context, self.layers = inputs, context, s.layers

    def step(self):
        update, k4, v4 = self.cache.update, self.k4, self.v4
        out = None
        for layer in range(self.layers):
            out = update(k4[layer], v4[layer], layer)
        return out

    def reset(self) -> None:
        _hf_set_layer_tensors(self.cache, self.saved)
        if self.seen is not None:
            self.cache._seen_tokens = self.seen

    def verify(self, out) -> bool:
        return _bhld_holds(out[0], out[1], self.context, self.inputs)

    def close(self) -> None:
        self.cache = self.saved = None


class HFStaticContender(_Contender):
    """transformers' ``StaticCache``: preallocated ``[B, H, max_len, D]`` per layer, ``update``
    writes the new token in place (``index_copy_``) and returns the whole buffers."""

    name = "HF StaticCache"

    def __init__(self, s: BenchSettings, batch: int, context: int, inputs: _DecodeInputs,
                 dev: _Device):
        import inspect

        import transformers
        torch = _optional_torch()
        from transformers import StaticCache
        max_len = context + _MARGIN
        tdt = {"float16": torch.float16, "float32": torch.float32}[s.dtype]
        params = inspect.signature(StaticCache.__init__).parameters
        offered = {"config": _hf_model_config(s), "max_cache_len": max_len,
                   "max_batch_size": batch, "batch_size": batch,
                   "device": _torch_device(dev), "dtype": tdt}
        kwargs = {k: v for k, v in offered.items() if k in params}
        if "config" not in kwargs or "max_cache_len" not in kwargs:
            raise RuntimeError(f"transformers {transformers.__version__}: StaticCache(...) "
                               "signature not understood")
        self.cache = StaticCache(**kwargs)
        block = _to_torch(dev.asarray(_prefill_block(np.random.default_rng(5), batch, s.kv_heads,
                                                     context, s.head_dim, np.dtype(s.dtype))),
                          dev)
        positions = torch.arange(context, device=_torch_device(dev))
        for layer in range(s.layers):
            # cache_kwargs is how transformers < 5 is told where to write; 5.x counts itself
            self.cache.update(block, block, layer, {"cache_position": positions})
        del block
        self.kwargs = {"cache_position": torch.tensor([context], device=_torch_device(dev))}
        self.counters = [lay.cumulative_length for lay in getattr(self.cache, "layers", [])
                         if hasattr(lay, "cumulative_length")
                         and hasattr(lay.cumulative_length, "fill_")]
        self.k4, self.v4 = inputs.torch4()
        self.inputs, self.context, self.layers = inputs, context, s.layers

    def step(self):
        update, k4, v4, kw = self.cache.update, self.k4, self.v4, self.kwargs
        out = None
        for layer in range(self.layers):
            out = update(k4[layer], v4[layer], layer, kw)
        return out

    def reset(self) -> None:
        for counter in self.counters:
            counter.fill_(self.context)

    def verify(self, out) -> bool:
        return _bhld_holds(out[0], out[1], self.context, self.inputs)

    def close(self) -> None:
        self.cache = None


#: (name, class, what it needs importable)
CONTENDERS = [("numbakv", NumbakvContender, ()),
              ("numbakv 1 thread", NumbakvOneThreadContender, ()),
              ("HF StaticCache", HFStaticContender, ("torch", "transformers")),
              ("HF DynamicCache", HFDynamicContender, ("torch", "transformers")),
              ("numpy append", NumpyAppendContender, ()),
              ("torch append", TorchAppendContender, ("torch",))]


#: How to get a baseline that is not installed (printed in the skip note).
INSTALL_HINTS = {"torch": "pip install torch (or 'numbakv[torch]')",
                 "transformers": "pip install 'numbakv[hf]' (transformers and torch)"}


def install_hint(missing: Sequence[str]) -> str:
    """The pip command that brings the ``missing`` modules of a skipped baseline."""
    if "transformers" in missing:
        return INSTALL_HINTS["transformers"]
    return "; ".join(INSTALL_HINTS.get(m, f"pip install {m}") for m in missing)


def _numba_threads_matter(dev: _Device) -> bool:
    """Whether a one-thread numbakv row says anything: CPU kernels with more than one thread."""
    if dev.name != "cpu":
        return False
    import numba
    return numba.get_num_threads() > 1


def _missing(modules: Sequence[str]) -> List[str]:
    out = []
    for mod in modules:
        try:
            __import__(mod)
        except Exception:  # noqa: BLE001 - broken installs count as missing
            out.append(mod)
    return out


# --------------------------------------------------------------------------------- sections
def measure_interleaved(contenders: Sequence["_Contender"], *, sync: Callable[[], None],
                        budget: float, min_reps: int = 5) -> List[Dict[str, Any]]:
    """Per-step wall times of several contenders, their steps interleaved (one step of each in
    turn, each followed by its untimed ``reset``), so that a load that comes and goes on a
    shared machine moves every contender alike and their ratios stay meaningful.

    Each contender is timed for ``budget`` seconds of its own steps and at least ``min_reps``
    steps; one whose warm step takes more than the whole budget gets 2 samples, more than a
    third of it 3 (the copying baselines stay affordable). ``begin``/``end`` run around each
    step, untimed. The garbage collector is off while timing. Returns one ``{"median_us",
    "p10_us", "p90_us", "reps", "times_us"}`` per contender, in order."""
    n = len(contenders)
    times: List[List[float]] = [[] for _ in range(n)]
    spent = [0.0] * n
    quota: List[Optional[int]] = [None] * n
    for i, c in enumerate(contenders):          # warm-up, and how slow each one is
        c.begin()
        try:
            t0 = time.perf_counter()
            c.step()
            sync()
            first = time.perf_counter() - t0
            c.reset()
        finally:
            c.end()
        if first > budget:
            quota[i] = min(min_reps, 2)
        elif first > budget / 3:
            quota[i] = min(min_reps, 3)

    max_reps = 100_000      # a step too fast for the clock to fill the budget stops here

    def done(i: int) -> bool:
        if quota[i] is not None:
            return len(times[i]) >= quota[i]
        return len(times[i]) >= max_reps or (len(times[i]) >= min_reps and spent[i] >= budget)

    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        while not all(done(i) for i in range(n)):
            for i, c in enumerate(contenders):
                if done(i):
                    continue
                c.begin()
                try:
                    t0 = time.perf_counter()
                    c.step()
                    sync()
                    dt = time.perf_counter() - t0
                    c.reset()
                finally:
                    c.end()
                times[i].append(dt)
                spent[i] += dt
    finally:
        if gc_was_on:
            gc.enable()
    out = []
    for t in times:
        arr = np.asarray(t) * 1e6
        out.append({"median_us": float(np.median(arr)), "p10_us": float(np.percentile(arr, 10)),
                    "p90_us": float(np.percentile(arr, 90)), "reps": len(t),
                    "times_us": arr.tolist()})
    return out


def _build_checked(name: str, cls, s: BenchSettings, batch: int, context: int,
                   inputs: "_DecodeInputs", dev: _Device, notes: List[str], skipped: set):
    """A contender built, its first step checked to return the token it stored (then rolled
    back); None (with a note) when it cannot run or does not store."""
    label = f"batch {batch} context {context} {name}"
    try:
        contender = cls(s, batch, context, inputs, dev)
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is noted
        if name == "numbakv":
            raise
        if name not in skipped:
            notes.append(f"{name}: skipped, {type(exc).__name__}: {exc}")
            skipped.add(name)
        return None
    contender.begin()
    try:
        out = contender.step()
        dev.sync()
        ok = bool(contender.verify(out))
        contender.reset()
    finally:
        contender.end()
    if not ok:
        if label not in skipped:
            notes.append(f"{label}: its step did not return the stored token; not timed")
            skipped.add(label)
        contender.close()
        return None
    return contender


def _close(contenders, dev: _Device) -> None:
    for c in contenders:
        c.close()
    contenders.clear()
    gc.collect()
    dev.release()


def run_decode(s: BenchSettings, dev: _Device, notes: List[str],
               log: Callable[[str], None]) -> List[dict]:
    """The decode-step table: one row per (batch, context, contender).

    Each (batch, context) is measured in ``s.rounds`` rounds. In a round every contender is
    built and checked; when they all fit in memory together their steps are interleaved
    (:func:`measure_interleaved`), else each is timed alone in turn (the order rotates from
    round to round). A row's ``median_us`` is the median of its rounds' medians and
    ``round_us`` lists those, so a ratio's spread between rounds is known (the report prints
    it and says when a difference is inside it)."""
    rows: List[dict] = []
    skipped: set = set()
    available = []
    for name, cls, needs in CONTENDERS:
        if cls is NumbakvOneThreadContender and not _numba_threads_matter(dev):
            continue
        missing = _missing(needs)
        if missing:
            notes.append(f"{name}: skipped, {' and '.join(missing)} not installed: "
                         f"{install_hint(missing)}")
            continue
        available.append((name, cls))
    itemsize = np.dtype(s.dtype).itemsize
    rounds = max(1, s.rounds)
    budget = s.budget / rounds
    for batch in s.batches:
        inputs = _DecodeInputs(s, batch, dev)
        for context in s.contexts:
            need = 2 * batch * (context + _MARGIN) * s.layers * s.kv_heads * s.head_dim * itemsize
            fitting = []
            for name, cls in available:
                free = dev.free_bytes()
                if free is not None and cls.memory_factor * need > _MEMORY_SHARE * free:
                    notes.append(f"batch {batch} context {context} {name}: skipped, needs "
                                 f"{cls.memory_factor * need / 2**30:.1f} GiB and "
                                 f"{free / 2**30:.1f} GiB is free")
                    continue
                fitting.append((name, cls))
            free = dev.free_bytes()
            together = free is None or \
                sum(cls.memory_factor for _, cls in fitting) * need <= _MEMORY_SHARE * free
            per_round: Dict[str, List[dict]] = {}
            breakdown: Dict[str, Tuple[float, float]] = {}
            for r in range(rounds):
                shift = r % max(1, len(fitting))
                order = fitting[shift:] + fitting[:shift]
                live: List[_Contender] = []
                try:
                    if together:
                        for name, cls in order:
                            c = _build_checked(name, cls, s, batch, context, inputs, dev, notes,
                                               skipped)
                            if c is not None:
                                live.append(c)
                        results = measure_interleaved(live, sync=dev.sync, budget=budget,
                                                      min_reps=s.min_reps)
                        for c, res in zip(live, results):
                            per_round.setdefault(c.name, []).append(res)
                    else:
                        for name, cls in order:
                            c = _build_checked(name, cls, s, batch, context, inputs, dev, notes,
                                               skipped)
                            if c is None:
                                continue
                            live.append(c)
                            res = measure_interleaved([c], sync=dev.sync, budget=budget,
                                                      min_reps=s.min_reps)[0]
                            per_round.setdefault(c.name, []).append(res)
                            if r == rounds - 1 and isinstance(c, NumbakvContender):
                                breakdown[c.name] = _breakdown(c, s, dev)
                            _close(live, dev)
                    if r == rounds - 1:
                        for c in live:
                            if isinstance(c, NumbakvContender):
                                breakdown[c.name] = _breakdown(c, s, dev)
                finally:
                    _close(live, dev)
            for name, _ in fitting:
                got = per_round.get(name)
                if not got:
                    continue
                pooled = np.concatenate([g["times_us"] for g in got])
                row = {"batch": batch, "context": context, "contender": name, "verified": True,
                       "median_us": float(np.median([g["median_us"] for g in got])),
                       "p10_us": float(np.percentile(pooled, 10)),
                       "p90_us": float(np.percentile(pooled, 90)),
                       "reps": int(sum(g["reps"] for g in got)),
                       "round_us": [g["median_us"] for g in got],
                       "interleaved": together}
                if name in breakdown:
                    row["start_forward_us"], row["layers_us"] = breakdown[name]
                rows.append(row)
                log(f"  batch {batch} context {context} {name}: {row['median_us']:.1f} us/step "
                    f"({row['reps']} reps, {len(got)} rounds)")
    return rows


def _breakdown(c: "NumbakvContender", s: BenchSettings, dev: _Device) -> Tuple[float, float]:
    """numbakv's step split: ``start_forward`` alone, and the layers' put + get alone."""
    c.begin()
    try:
        sf = measure(c.start_forward_only, c.reset, sync=dev.sync, budget=s.budget / 4,
                     min_reps=s.min_reps)["median_us"]
        c.start_forward_only()
        layers = measure(c.layers_only, sync=dev.sync, budget=s.budget / 4,
                         min_reps=s.min_reps)["median_us"]
        c.reset()
    finally:
        c.end()
    return sf, layers


def _storage(s: BenchSettings, dev: _Device, n_cells: int, layers: int):
    from ..config import CacheConfig
    from ..storage import KVStorage
    cfg = CacheConfig(layers, s.kv_heads, s.head_dim, dtype=s.dtype, capacity=n_cells,
                      max_seqs=1, max_batch=max(n_cells, 1), device=dev.name)
    return cfg, KVStorage(cfg, n_cells, dev.name)


def _copy_pair(dev: _Device, nbytes: int, fill: bool = False) -> Callable[[], None]:
    """A plain copy (or memset) of ``nbytes``: the baseline a kernel's bandwidth is held to."""
    xp = dev.xp
    n = max(nbytes, 1)
    dst = xp.zeros(n, dtype=np.uint8)
    if fill:
        return lambda: dst.fill(0)
    src = xp.ones(n, dtype=np.uint8)
    if dev.name == "cuda":
        return lambda: xp.copyto(dst, src)  # a device-to-device copy kernel
    return lambda: np.copyto(dst, src)


def _kernel_row(kernel: str, size: str, nbytes: int, res: dict, base: dict,
                host_us: Optional[float] = None,
                graph: Tuple[Optional[float], Optional[float]] = (None, None)) -> dict:
    gbps = nbytes / (res["median_us"] * 1e-6) / 1e9
    copy_gbps = nbytes / (base["median_us"] * 1e-6) / 1e9
    row = {"kernel": kernel, "size": size, "bytes": int(nbytes), "median_us": res["median_us"],
           "copy_us": base["median_us"], "gbps": gbps, "copy_gbps": copy_gbps,
           "fraction": gbps / copy_gbps}
    if host_us is not None:
        row["host_us"] = host_us
    if graph[0] is not None and graph[1] is not None:
        # the same bytes, with the host out of the picture (CUDA-graph replay of both sides)
        row["kernel_us"], row["kernel_copy_us"] = graph
        row["kernel_fraction"] = graph[1] / graph[0]
    return row


def _host_cost(fn: Callable[[], None], dev: _Device, n: int = 200) -> Optional[float]:
    """Host time per call without waiting for the GPU (what a launch costs the CPU)."""
    if dev.name != "cuda":
        return None
    for _ in range(5):
        fn()
    dev.sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    dev.sync()
    return dt / n * 1e6


def run_kernels(s: BenchSettings, dev: _Device, notes: List[str],
                log: Callable[[str], None]) -> Tuple[List[dict], dict]:
    """Kernel bandwidth vs a plain copy of the same bytes; returns rows and the device's copy
    bandwidth on ``copy_bytes``."""
    from ..cells import CellTable
    from ..config import RopeShift

    budget = max(s.budget / 2, 0.005)
    rng = np.random.default_rng(6)
    dt = np.dtype(s.dtype)
    big = measure_kernel(_copy_pair(dev, s.copy_bytes), dev, budget)
    peak = {"bytes": s.copy_bytes, "median_us": big["median_us"],
            "gbps": s.copy_bytes / (big["median_us"] * 1e-6) / 1e9,
            "how": "cupy.copyto (device to device)" if dev.name == "cuda" else "np.copyto"}
    rows: List[dict] = []
    max_tokens = max(s.put_tokens)
    move_cells = max(s.move_cells + s.rotate_cells)
    n_cells = max(2 * max_tokens, 2 * move_cells, max(n for _, n in s.mask_shapes))
    # put: one layer's K and V for n tokens, contiguous (put_range) and scattered (put)
    _, st = _storage(s, dev, n_cells, 1)
    try:
        for n in s.put_tokens:
            k = dev.asarray(_random(rng, (n, s.kv_heads, s.head_dim), dt))
            v = dev.asarray(_random(rng, (n, s.kv_heads, s.head_dim), dt))
            nbytes = 2 * k.nbytes
            copy = _copy_pair(dev, nbytes)
            fn = lambda k=k, v=v: st.put_range(0, 0, k, v)  # noqa: E731
            rows.append(_kernel_row("put_range", f"{n} tokens", nbytes,
                                    *measure_pair(fn, copy, dev, budget), _host_cost(fn, dev),
                                    _graph_pair(fn, copy, dev, notes)))
            slots_host = np.sort(rng.choice(2 * n, size=n, replace=False)).astype(np.int32)
            fn = lambda k=k, v=v, slots=slots_host: st.put(0, slots, k, v)  # noqa: E731
            rows.append(_kernel_row("put (scatter)", f"{n} tokens", nbytes,
                                    *measure_pair(fn, copy, dev, budget), _host_cost(fn, dev),
                                    _graph_pair(fn, copy, dev, notes)))
            log(f"  put {n} tokens: {rows[-2]['fraction']:.0%} / {rows[-1]['fraction']:.0%} "
                "of copy")
        # mask: rows x n visible/masked entries from the cell table's mask inputs
        for n_rows, n in s.mask_shapes:
            table = CellTable(n, 1)
            table.apply_batch(np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32),
                              np.zeros(n, np.int32))
            cell_pos, cell_seqs = table.mask_inputs(0, n)
            bpos = np.arange(n - n_rows, n, dtype=np.int32)
            bseq = np.zeros(n_rows, np.int32)
            causal = np.ones(n_rows, np.uint8)
            out = st.new_mask(n_rows, n)
            fn = lambda out=out, cp=cell_pos, cs=cell_seqs, bp=bpos, bs=bseq, c=causal: \
                st.fill_mask(out, cp, cs, bp, bs, c)  # noqa: E731
            nbytes = out.nbytes
            memset = _copy_pair(dev, nbytes, fill=True)
            rows.append(_kernel_row("mask fill", f"{n_rows}x{n}", nbytes,
                                    *measure_pair(fn, memset, dev, budget), _host_cost(fn, dev),
                                    _graph_pair(fn, memset, dev, notes)))
            log(f"  mask {n_rows}x{n}: {rows[-1]['fraction']:.0%} of memset")
    finally:
        st = None  # noqa: F841 (frees the storage before the next one is made)
        gc.collect()
        dev.release()
    # move and rotate: every layer of a block of cells
    cfg, st = _storage(s, dev, n_cells, s.kernel_layers)
    try:
        per_cell = cfg.n_layers * cfg.n_kv_heads * (cfg.head_dim + cfg.v_head_dim) * dt.itemsize
        for n in s.move_cells:
            moves = np.array([[0, n, n]], dtype=np.int64)  # [src, dst, length]
            fn = lambda moves=moves: st.move_blocks(moves)  # noqa: E731
            nbytes = n * per_cell
            copy = _copy_pair(dev, nbytes)
            rows.append(_kernel_row("move", f"{n} cells x {cfg.n_layers} layers", nbytes,
                                    *measure_pair(fn, copy, dev, budget),
                                    _host_cost(fn, dev), _graph_pair(fn, copy, dev, notes)))
            log(f"  move {n} cells: {rows[-1]['fraction']:.0%} of copy")
        rope = RopeShift()
        key_bytes = cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dt.itemsize
        for n in s.rotate_cells:
            cells = np.arange(n, dtype=np.int32)
            deltas = np.full(n, -3, np.int32)
            fn = lambda c=cells, d=deltas: st.rotate(c, d, rope)  # noqa: E731
            nbytes = n * key_bytes
            copy = _copy_pair(dev, nbytes)
            rows.append(_kernel_row("rotate", f"{n} cells x {cfg.n_layers} layers", nbytes,
                                    *measure_pair(fn, copy, dev, budget),
                                    _host_cost(fn, dev), _graph_pair(fn, copy, dev, notes)))
            log(f"  rotate {n} cells: {rows[-1]['fraction']:.0%} of copy")
    finally:
        st = None  # noqa: F841 (frees the storage before the next one is made)
        gc.collect()
        dev.release()
    return rows, peak


def run_capacity(s: BenchSettings, dev: _Device, notes: List[str],
                 log: Callable[[str], None]) -> List[dict]:
    """numbakv's decode step at a fixed context while the cache's capacity grows."""
    rows: List[dict] = []
    ctx = s.capacity_context
    for batch in s.batches:
        inputs = _DecodeInputs(s, batch, dev, seed=7)
        for cap in s.capacities:
            if cap < batch * (ctx + 1):
                continue
            contender = NumbakvContender(s, batch, ctx, inputs, dev, capacity=cap,
                                         layers=s.capacity_layers)
            try:
                out = contender.step()
                dev.sync()
                if not contender.verify(out):
                    notes.append(f"capacity {cap}: numbakv's step did not return the stored "
                                 "token; not timed")
                    continue
                contender.reset()
                step = measure(contender.step, contender.reset, sync=dev.sync,
                               budget=s.budget / 2, min_reps=s.min_reps)
                sf = measure(contender.start_forward_only, contender.reset, sync=dev.sync,
                             budget=s.budget / 2, min_reps=s.min_reps)
                rows.append({"batch": batch, "capacity_cells": contender.cache.n_cells,
                             "context": ctx, "layers": s.capacity_layers,
                             "step_us": step["median_us"], "start_forward_us": sf["median_us"]})
                log(f"  batch {batch} capacity {cap}: step {step['median_us']:.1f} us, "
                    f"start_forward {sf['median_us']:.1f} us")
            finally:
                contender.close()
                del contender
                gc.collect()
                dev.release()
    return rows


# --------------------------------------------------------------------------------- quantized K/V
QUANT_KINDS = ("q8_0", "q4_0", "float8_e4m3")


def run_quant(s: BenchSettings, dev: _Device, notes: List[str],
              log: Callable[[str], None]) -> List[dict]:
    """Quantized K/V (``k_dtype = v_dtype`` each of :data:`QUANT_KINDS`), one layer: memory per
    token against float16, and put (quantize), get (dequantize ``n`` cells into the scratch) and
    rotate (dequantize, rotate, requantize the keys) against a plain copy of the same tokens'
    ``dtype`` bytes, i.e. what a float cache moves for the same work (K and V for put/get, K for
    rotate)."""
    from ..config import CacheConfig, RopeShift
    from ..storage import KVStorage

    rows: List[dict] = []
    dim = -(-s.head_dim // 32) * 32  # ggml blocks need a multiple of 32
    if dim != s.head_dim:
        notes.append(f"quant: head_dim {s.head_dim} is not a multiple of 32; measured at {dim}")
    tokens = max(t for t in s.put_tokens if t <= 4096)
    n_cells = max(tokens, max(s.rotate_cells))
    rng = np.random.default_rng(11)
    f16 = CacheConfig(1, s.kv_heads, dim, dtype="float16", capacity=1)
    for kind in QUANT_KINDS:
        # unrotated here (the rows earlier runs measured); the rotated put/shift follow below
        cfg = CacheConfig(1, s.kv_heads, dim, dtype=s.dtype, capacity=n_cells,
                          max_batch=n_cells, device=dev.name, k_dtype=kind, v_dtype=kind,
                          kv_rotation="off")
        st = KVStorage(cfg, n_cells, dev.name)
        per_token = cfg.nbytes(1)
        row_mem = {"kernel": f"{kind} memory", "bytes_per_token": per_token,
                   "f16_bytes_per_token": f16.nbytes(1),
                   "memory_fraction": per_token / f16.nbytes(1)}
        rows.append(row_mem)
        x = dev.xp.asarray(rng.standard_normal((tokens, s.kv_heads, dim))
                           .astype(s.dtype))
        float_bytes = 2 * x.nbytes
        res, base = measure_pair(lambda: st.put_range(0, 0, x, x),
                                 _copy_pair(dev, float_bytes), dev, s.budget, s.min_reps)
        rows.append(_kernel_row(f"{kind} put", f"{tokens} tokens", float_bytes, res, base))
        res, base = measure_pair(lambda: st.dequantized_views(0, 0, tokens),
                                 _copy_pair(dev, float_bytes), dev, s.budget, s.min_reps)
        rows.append(_kernel_row(f"{kind} get", f"{tokens} cells", float_bytes, res, base))
        n_rot = max(s.rotate_cells)
        cells = np.arange(n_rot, dtype=np.int32)
        deltas = np.full(n_rot, -3, dtype=np.int64)
        rope = RopeShift()
        key_bytes = n_rot * s.kv_heads * dim * cfg.itemsize
        res, base = measure_pair(lambda: st.rotate(cells, deltas, rope),
                                 _copy_pair(dev, key_bytes), dev, s.budget, s.min_reps)
        rows.append(_kernel_row(f"{kind} rotate", f"{n_rot} cells", key_bytes, res, base))
        log(f"  {kind}: memory {row_mem['memory_fraction']:.3f} of f16, put "
            f"{rows[-3]['fraction']:.0%}, get {rows[-2]['fraction']:.0%}, rotate "
            f"{rows[-1]['fraction']:.0%} of copy")
        del st
        dev.release()
        rot_cfg = cfg.replace(kv_rotation="auto")
        if rot_cfg.k_rotation:
            # llama.cpp's rotated cache: Walsh-Hadamard rotation fused into the quantizing put
            # (and undone/redone around the RoPE of the shift)
            st = KVStorage(rot_cfg, n_cells, dev.name)
            if _numba_threads_matter(dev):
                # the put spreads its tokens over numba's threads, np.copyto runs on one: the
                # same put held to one thread is the like-for-like figure
                with _one_numba_thread():
                    res, base = measure_pair(lambda: st.put_range(0, 0, x, x),
                                             _copy_pair(dev, float_bytes), dev, s.budget,
                                             s.min_reps)
                rows.append(_kernel_row(f"{kind} put rotated", f"{tokens} tok, 1 thread",
                                        float_bytes, res, base))
                rows[-1]["threads"] = 1
            res, base = measure_pair(lambda: st.put_range(0, 0, x, x),
                                     _copy_pair(dev, float_bytes), dev, s.budget, s.min_reps)
            rows.append(_kernel_row(f"{kind} put rotated", f"{tokens} tokens", float_bytes,
                                    res, base))
            if dev.name == "cpu":
                import numba
                rows[-1]["threads"] = numba.get_num_threads()
            res, base = measure_pair(lambda: st.rotate(cells, deltas, rope),
                                     _copy_pair(dev, key_bytes), dev, s.budget, s.min_reps)
            rows.append(_kernel_row(f"{kind} rotate rotated", f"{n_rot} cells", key_bytes,
                                    res, base))
            log(f"  {kind} rotated (K block {rot_cfg.k_rotation}, V block "
                f"{rot_cfg.v_rotation}): put {rows[-2]['fraction']:.0%}, rotate "
                f"{rows[-1]['fraction']:.0%} of copy")
            del st
            dev.release()
    return rows


# --------------------------------------------------------------------------------- targets
def evaluate_targets(s: BenchSettings, results: dict) -> List[dict]:
    """Where this run stands against the issue's targets (met / missed and by how much)."""
    out: List[dict] = []
    decode = results.get("decode", [])
    table = {(r["batch"], r["context"], r["contender"]): r["median_us"] for r in decode}
    if decode:
        ctx = 4096 if 4096 in s.contexts else max(s.contexts)
        note = "" if ctx == 4096 else f" (4k not run; at {ctx})"
        for batch in s.batches:
            ours = table.get((batch, ctx, "numbakv"))
            for other, need in (("HF StaticCache", 1.0), ("HF DynamicCache", 20.0)):
                theirs = table.get((batch, ctx, other))
                target = f"{s.device} decode step >= {need:g}x {other}, batch {batch}, 4k{note}"
                if ours is None or theirs is None:
                    out.append({"target": target, "status": "not measured", "detail":
                                f"{other} not run" if ours is not None else "numbakv not run"})
                    continue
                speedup = theirs / ours
                out.append({"target": target, "status": "met" if speedup >= need else "missed",
                            "value": speedup, "detail": f"{speedup:.2f}x ({ours:.0f} vs "
                                                        f"{theirs:.0f} us/step)"})
    kernels = results.get("kernels", [])
    if kernels:
        puts = [r for r in kernels if r["kernel"] == "put_range"]
        if puts and s.device == "cpu":
            # judged where bandwidth is the question (>= 1 MiB, prefill sizes); the worst of
            # those counts. Decode-size puts are a few KiB: their cost is per call, shown apart.
            big = ([r for r in puts if r["bytes"] >= 1 << 20]
                   or [max(puts, key=lambda r: r["bytes"])])
            worst = min(big, key=lambda r: r["fraction"])
            sizes = ", ".join(f"{r['fraction']:.0%} at {r['size']}" for r in big)
            out.append({"target": "CPU put >= 70% of copy bandwidth",
                        "status": "met" if worst["fraction"] >= 0.7 else "missed",
                        "value": worst["fraction"], "detail": f"{sizes} (>= 1 MiB puts)"})
        if s.device == "cuda":
            for kernel in ("put_range", "move", "rotate"):
                rows = [r for r in kernels if r["kernel"] == kernel and r["bytes"] >= 16 << 20]
                if not rows:
                    out.append({"target": f"GPU {kernel} >= 85% of D2D copy for >= 16 MiB",
                                "status": "not measured", "detail": "no size >= 16 MiB run"})
                    continue
                # the kernel's bandwidth (graph replay, host excluded) where measured; the
                # host's share is the separate per-call cost below
                key = "kernel_fraction" if all("kernel_fraction" in r for r in rows) \
                    else "fraction"
                worst = min(rows, key=lambda r: r[key])
                b2b = min(r["fraction"] for r in rows)
                how = ("graph replay; back-to-back calls from Python: worst "
                       f"{b2b:.0%}" if key == "kernel_fraction" else "back-to-back calls")
                out.append({"target": f"GPU {kernel} >= 85% of D2D copy for >= 16 MiB",
                            "status": "met" if worst[key] >= 0.85 else "missed",
                            "value": worst[key],
                            "detail": f"worst {worst[key]:.0%} at {worst['size']} ({how})"})
            masks = [r for r in kernels if r["kernel"] == "mask fill" and r["bytes"] >= 1 << 20]
            if masks:
                key = "kernel_fraction" if all("kernel_fraction" in r for r in masks) \
                    else "fraction"
                worst = min(masks, key=lambda r: r[key])
                how = "graph replay" if key == "kernel_fraction" else "back-to-back calls"
                out.append({"target": "GPU mask fill >= 80% of a memset for >= 1 MiB",
                            "status": "met" if worst[key] >= 0.8 else "missed",
                            "value": worst[key],
                            "detail": f"worst {worst[key]:.0%} at {worst['size']} ({how})"})
            hosts = [r["host_us"] for r in puts if r.get("host_us") is not None]
            if hosts:
                worst = max(hosts)
                out.append({"target": "GPU host cost per put <= 10 us",
                            "status": "met" if worst <= 10 else "missed", "value": worst,
                            "detail": f"{worst:.1f} us (largest over put sizes)"})
    quant = [r for r in results.get("quant", []) if "fraction" in r and r.get("threads") != 1]
    if quant:
        device = "GPU" if s.device == "cuda" else "CPU"
        worst = min(quant, key=lambda r: r["fraction"])
        out.append({"target": f"{device} quantized put/get/rotate >= 50% of a copy of the same "
                              f"{s.dtype} bytes",
                    "status": "met" if worst["fraction"] >= 0.5 else "missed",
                    "value": worst["fraction"],
                    "detail": ", ".join(f"{r['kernel']} {r['fraction']:.0%}" for r in quant)})
    rotated_all = [r for r in results.get("quant", [])
                   if "fraction" in r and r["kernel"].endswith("put rotated")]
    for threads in sorted({r.get("threads") for r in rotated_all}, key=lambda t: -(t or 0)):
        # one target per thread count: the put as called (numba's threads) and, where that
        # is more than one, held to one thread like np.copyto
        rotated_puts = [r for r in rotated_all if r.get("threads") == threads]
        device = "GPU" if s.device == "cuda" else "CPU"
        worst = min(rotated_puts, key=lambda r: r["fraction"])
        need = 0.6 if s.device == "cuda" else 0.5
        how = ("" if threads is None else
               f" (numbakv's put on {threads} numba thread{'s' if threads > 1 else ''}, "
               "np.copyto on one)")
        out.append({"target": f"{device} rotated q8_0/q4_0 put+quantize >= {need:.0%} of a copy "
                              f"of the {s.dtype} input{how}",
                    "status": "met" if worst["fraction"] >= need else "missed",
                    "value": worst["fraction"],
                    "detail": ", ".join(f"{r['kernel']} {r['fraction']:.0%}"
                                        for r in rotated_puts)})
    for r in results.get("quant", []):
        if "memory_fraction" in r:
            want = {"q8_0": 34 / 64, "q4_0": 18 / 64, "float8_e4m3": 0.5}[r["kernel"].split()[0]]
            out.append({"target": f"{r['kernel']} per token = {want:.4f} of float16",
                        "status": "met" if abs(r["memory_fraction"] - want) < 1e-12
                        else "missed", "value": r["memory_fraction"],
                        "detail": f"{r['bytes_per_token']} vs {r['f16_bytes_per_token']} bytes"})
    if s.device != "cuda":
        out.append({"target": "GPU put/move/shift >= 85% of D2D copy; host cost per put <= 10 us",
                    "status": "not measured", "detail": "no GPU in this run"})
    from .bench_attend import targets as attend_targets
    out += attend_targets(results.get("attend", {}))
    cap = results.get("capacity", [])
    for batch in sorted({r["batch"] for r in cap}):
        rows = sorted((r for r in cap if r["batch"] == batch), key=lambda r: r["capacity_cells"])
        if len(rows) < 2:
            continue
        lo, hi = rows[0], rows[-1]
        ratio = hi["start_forward_us"] / lo["start_forward_us"]
        out.append({"target": f"bookkeeping at {hi['capacity_cells']} cells <= 2x at "
                              f"{lo['capacity_cells']}, batch {batch}",
                    "status": "met" if ratio <= 2 else "missed", "value": ratio,
                    "detail": f"{ratio:.2f}x ({lo['start_forward_us']:.1f} -> "
                              f"{hi['start_forward_us']:.1f} us per start_forward)"})
    if results.get("snapshot"):
        from . import bench_snapshot
        out += bench_snapshot.targets(results["snapshot"])
    if results.get("states"):
        from . import bench_states
        out += bench_states.targets(results["states"])
    if results.get("hybrid"):       # numbakv/tools/bench_hybrid.py
        from .bench_hybrid import targets as hybrid_targets
        out += hybrid_targets(results["hybrid"])
    if results.get("agents"):       # numbakv/tools/bench_agents.py
        from .bench_agents import targets as agents_targets
        out += agents_targets(results["agents"])
    return out


# --------------------------------------------------------------------------------- reporting
def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _set_threads(s: BenchSettings) -> None:
    """torch's intra-op threads and numba's parallel kernels get ``s.threads`` (default: the
    CPUs this process may use), explicitly: torch's own default (physical cores, or what
    OMP_NUM_THREADS says) differs between machines and made the baselines swing between runs."""
    if s.threads is None:
        s.threads = _usable_cpus()
    torch = _optional_torch()
    if torch is not None:
        torch.set_num_threads(s.threads)
    import numba
    numba.set_num_threads(min(s.threads, numba.config.NUMBA_NUM_THREADS))


def machine_info(dev: _Device) -> dict:
    """What the figures were measured on."""
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpu": _cpu_name(), "cores": os.cpu_count(), "device": dev.name}
    for mod in ("numpy", "numba", "torch", "transformers", "cupy"):
        try:
            info[mod] = str(__import__(mod).__version__)
        except Exception:  # noqa: BLE001
            info[mod] = None
    torch = _optional_torch()
    if torch is not None:
        info["torch_threads"] = torch.get_num_threads()
    import numba
    info["numba_threads"] = numba.get_num_threads()
    info["cpus"] = _usable_cpus()
    try:
        info["load_1min"] = os.getloadavg()[0]
    except (AttributeError, OSError):
        info["load_1min"] = None
    if dev.name == "cuda":
        cupy = dev.xp
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"]
        info["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _fmt_us(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def format_report(results: dict) -> str:
    """The tables ``numbakv bench`` prints."""
    s = results["settings"]
    m = results["machine"]
    lines = [f"numbakv bench: device {s['device']}, {s['dtype']}, {s['layers']} layers x "
             f"{s['kv_heads']} kv heads x head_dim {s['head_dim']}",
             f"machine: {m['cpu']} ({m['cores']} cores)"
             f"{', GPU ' + m['gpu'] if m.get('gpu') else ''}"
             f"; numpy {m['numpy']}, numba {m['numba']}, torch {m['torch'] or '-'}"
             f"{' (' + str(m.get('torch_threads')) + ' threads)' if m.get('torch') else ''}, "
             f"transformers {m['transformers'] or '-'}"
             + (f"; numba threads {m['numba_threads']}" if m.get("numba_threads") else "")
             + (f"; 1-minute load {m['load_1min']:.1f} on {m['cpus']} CPUs"
                if m.get("load_1min") is not None else "")]
    from .bench_summary import headline
    lines += headline(results)
    decode = results.get("decode", [])
    if decode:
        names = [n for n, _, _ in CONTENDERS]
        names = [n for n in names if any(r["contender"].replace("cupy", "numpy") == n
                                         for r in decode)]
        by = {(r["batch"], r["context"], r["contender"].replace("cupy", "numpy")): r
              for r in decode}
        lines += ["", "Decode step: median us per step (bookkeeping + per layer: store the new "
                  "K/V, obtain the K/V [+ mask] attention reads)"]
        w = max(15, *(len(n) for n in names))
        head = f"{'batch':>5} {'context':>7} " + " ".join(f"{n:>{w}}" for n in names)
        lines.append(head)
        keys = sorted({(r["batch"], r["context"]) for r in decode})
        for b, c in keys:
            cells = [_fmt_us(by[(b, c, n)]["median_us"]) if (b, c, n) in by else "-"
                     for n in names]
            lines.append(f"{b:>5} {c:>7} " + " ".join(f"{x:>{w}}" for x in cells))
        from .bench_summary import ratio_spread
        lines += ["", "numbakv speed-up (contender us / numbakv us; > 1: numbakv is faster; "
                  "[lowest-highest round]; ~ marks a difference inside the noise)"]
        others = [n for n in names if not n.startswith("numbakv")]
        w2 = 24
        lines.append(f"{'batch':>5} {'context':>7} " + " ".join(f"{n:>{w2}}" for n in others))
        for b, c in keys:
            ours = by.get((b, c, "numbakv"))
            cells = []
            for n in others:
                theirs = by.get((b, c, n))
                if not (ours and theirs):
                    cells.append("-")
                    continue
                ratio, lo, hi = ratio_spread(ours, theirs)
                cells.append(f"{'~' if lo is not None and lo < 1 < hi else ''}{ratio:.2f}x"
                             + (f" [{lo:.2f}-{hi:.2f}]" if lo is not None else ""))
            lines.append(f"{b:>5} {c:>7} " + " ".join(f"{x:>{w2}}" for x in cells))
        lines += _storage_only_table(decode, by, keys, others)
        lines += _what_differs(s, decode)
        ours = [r for r in decode if r["contender"].startswith("numbakv")
                and "start_forward_us" in r]
        if ours:
            lines += ["", f"numbakv step breakdown (us): start_forward (bookkeeping + mask) and "
                      f"{s['layers']} x (set_layer + put + get)"]
            lines.append(f"{'':<16} {'batch':>5} {'context':>7} {'step':>10} {'start_fwd':>10} "
                         f"{'layers':>10} {'per layer':>10}")
            for r in sorted(ours, key=lambda r: (r["contender"], r["batch"], r["context"])):
                lines.append(f"{r['contender']:<16} {r['batch']:>5} {r['context']:>7} "
                             f"{_fmt_us(r['median_us']):>10} "
                             f"{_fmt_us(r['start_forward_us']):>10} "
                             f"{_fmt_us(r['layers_us']):>10} "
                             f"{_fmt_us(r['layers_us'] / s['layers']):>10}")
    kernels = results.get("kernels", [])
    if kernels:
        peak = results["copy"]
        lines += ["", f"Kernels vs a plain copy of the same bytes ({peak['how']}; "
                  f"{peak['bytes'] / 2**20:.0f} MiB copy: {peak['gbps']:.1f} GB/s)"]
        host = any(r.get("host_us") is not None for r in kernels)
        graph = any("kernel_fraction" in r for r in kernels)
        lines.append(f"{'kernel':<14} {'size':<22} {'bytes':>10} {'us':>9} {'GB/s':>7} "
                     f"{'copy GB/s':>9} {'fraction':>8}" + (f" {'host us':>8}" if host else "")
                     + (f" {'kernel us':>9} {'copy us':>8} {'kernel/copy':>11}" if graph else ""))
        for r in kernels:
            g = (f" {_fmt_us(r['kernel_us']):>9} {_fmt_us(r['kernel_copy_us']):>8} "
                 f"{r['kernel_fraction']:>11.0%}" if "kernel_fraction" in r else
                 f" {'-':>9} {'-':>8} {'-':>11}") if graph else ""
            lines.append(f"{r['kernel']:<14} {r['size']:<22} {_bytes(r['bytes']):>10} "
                         f"{_fmt_us(r['median_us']):>9} {r['gbps']:>7.2f} "
                         f"{r['copy_gbps']:>9.2f} {r['fraction']:>8.0%}"
                         + (f" {_fmt_us(r.get('host_us')):>8}" if host else "") + g)
        if graph:
            lines.append("  us/GB/s/fraction: calls back to back from Python (bound by the host "
                         "when a call costs the CPU more than the GPU); kernel us: the same "
                         "calls replayed as a CUDA graph, host excluded")
    quant = [r for r in results.get("quant", []) if "fraction" in r]
    if quant:
        lines += ["", "Quantized K/V vs a plain copy of the same float bytes (one layer)"]
        lines.append(f"{'kernel':<20} {'size':<18} {'bytes':>10} {'us':>9} {'GB/s':>7} "
                     f"{'copy GB/s':>9} {'fraction':>8}")
        for r in quant:
            lines.append(f"{r['kernel']:<20} {r['size']:<18} {_bytes(r['bytes']):>10} "
                         f"{_fmt_us(r['median_us']):>9} {r['gbps']:>7.2f} "
                         f"{r['copy_gbps']:>9.2f} {r['fraction']:>8.0%}")
    cap = results.get("capacity", [])
    if cap:
        lines += ["", f"Capacity: numbakv per-step cost at context {cap[0]['context']} per "
                  f"sequence, {cap[0]['layers']} layers, as the cache grows"]
        lines.append(f"{'batch':>5} {'cells':>8} {'step us':>10} {'start_fwd us':>12}")
        for r in cap:
            lines.append(f"{r['batch']:>5} {r['capacity_cells']:>8} {_fmt_us(r['step_us']):>10} "
                         f"{_fmt_us(r['start_forward_us']):>12}")
    if results.get("seqops") or results.get("spec"):
        from .bench_seqops import format_section
        lines += ["", format_section(results)]
    lines += format_attention(results.get("attention", []))
    lines += format_streams(results.get("streams", []))
    from .bench_attend import format_attend
    lines += format_attend(results.get("attend", {}))
    if results.get("snapshot"):
        from . import bench_snapshot
        lines += bench_snapshot.format_lines(results["snapshot"])
    if results.get("states"):
        from . import bench_states
        lines += bench_states.format_lines(results["states"])
    if results.get("hybrid"):
        from .bench_hybrid import format_hybrid
        lines += format_hybrid(results["hybrid"])
    if results.get("agents"):
        from .bench_agents import format_agents
        lines += format_agents(results["agents"])
    if results.get("generate"):
        from .bench_generate import format_generate
        lines += format_generate(results["generate"])
    if results.get("prefix"):
        from .bench_prefix import format_prefix
        lines += ["", format_prefix(results["prefix"])]
    if results.get("fidelity"):
        from .bench_fidelity import format_section as format_fidelity
        lines += ["", format_fidelity(results["fidelity"])]
    targets = results.get("targets", [])
    if targets:
        lines += ["", "Targets" + (" (defined at real shapes: at --quick's tiny shapes these "
                                   "figures are indicative only)" if s.get("quick") else "")]
        lines += target_lines(targets, width=12)
    if results.get("notes"):
        lines += ["", "Notes"] + [f"  - {n}" for n in results["notes"]]
    return "\n".join(lines)


def _storage_only_table(decode: List[dict], by: dict, keys: list,
                        others: List[str]) -> List[str]:
    """The same work per step on both sides: numbakv's per-layer store + read (``layers_us``,
    without ``start_forward``) against each contender's whole step, which is only that."""
    if not any("layers_us" in r for r in decode if r["contender"] == "numbakv"):
        return []
    lines = ["", "Same work per step: store one token and read the K/V, per layer (numbakv "
             "without start_forward; contender us / numbakv us)",
             f"{'batch':>5} {'context':>7} " + " ".join(f"{n:>15}" for n in others)]
    for b, c in keys:
        ours = by.get((b, c, "numbakv"))
        cells = []
        for n in others:
            theirs = by.get((b, c, n))
            ok = ours and theirs and ours.get("layers_us")
            cells.append(f"{theirs['median_us'] / ours['layers_us']:.2f}x" if ok else "-")
        lines.append(f"{b:>5} {c:>7} " + " ".join(f"{x:>15}" for x in cells))
    return lines


def _what_differs(s: dict, decode: List[dict]) -> List[str]:
    """What the contenders do differently per step, so the ratios above read right."""
    ours = [r for r in decode if r["contender"] == "numbakv" and "start_forward_us" in r]
    sf = (f" (~{np.median([r['start_forward_us'] for r in ours]):.0f} us here)"
          if ours else "")
    lines = ["", "What differs per step:",
             f"  numbakv: start_forward{sf} places the batch in the shared cell pool (slot "
             "search, window and shift bookkeeping) and builds the [batch, n] attention mask; "
             "then per layer put + get (zero-copy views). One pool serves many sequences of "
             "different lengths, with prefix sharing, removal and context shift.",
             "  append caches (numpy/torch): per layer, concatenate one token onto a "
             "[B, H, L, D] array (a full copy); no placement, no mask, every sequence the same "
             "length, nothing shared or removed. HF StaticCache writes into a preallocated "
             "[B, H, max_len, D] buffer, HF DynamicCache concatenates; neither builds a mask.",
             "  The 'same work' table compares only the storage work both sides do."]
    if s.get("quick") and max(s["contexts"]) < 1024:
        ctx = max(s["contexts"])
        lines.append(f"  --quick: tiny shapes ({s['layers']} layers, context <= {ctx}) make "
                     "numbakv's fixed per-step start_forward the whole story; real models "
                     "spread it over 32+ layers and thousands of tokens. Run `numbakv bench` "
                     "without --quick (or see BENCHMARKS.md) for representative ratios.")
    return lines


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


_COLORS = [n for n, _, _ in CONTENDERS] + ["put_range", "put (scatter)", "mask fill", "move",
                                          "rotate"]


def _color(name: str) -> str:
    name = name.replace("cupy", "numpy")
    return f"C{_COLORS.index(name) % 10}" if name in _COLORS else "C9"


def save_plot(results: dict, path: str) -> Optional[str]:
    """Write the figure; returns None, or why it was not written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return "plot: skipped, matplotlib not installed"
    decode, kernels, cap = (results.get(k, []) for k in ("decode", "kernels", "capacity"))
    panels = [p for p, rows in (("decode", decode), ("kernels", kernels), ("capacity", cap))
              if rows]
    if not panels:
        return "plot: nothing to plot"
    widths = [1.6 if p == "decode" else 1.0 for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * sum(widths), 6), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    s = results["settings"]
    for ax, panel in zip(axes[0], panels):
        if panel == "decode":
            styles = ["-", "--", ":", "-."]
            for i, batch in enumerate(sorted({r["batch"] for r in decode})):
                for name in dict.fromkeys(r["contender"] for r in decode):
                    pts = sorted((r["context"], r["median_us"]) for r in decode
                                 if r["batch"] == batch and r["contender"] == name)
                    if pts:
                        ax.plot(*zip(*pts), styles[i % 4], marker="o",
                                label=f"{name}, batch {batch}", color=_color(name))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context (tokens per sequence)")
            ax.set_ylabel("us per decode step")
            ax.set_title(f"Decode step, {s['layers']} layers, {s['device']} {s['dtype']}")
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
        elif panel == "kernels":
            labels = [f"{r['kernel']}\n{r['size']}" for r in kernels]
            ax.bar(range(len(kernels)), [100 * r["fraction"] for r in kernels],
                   color=[_color(r["kernel"]) for r in kernels])
            ax.axhline(100, color="k", lw=0.8)
            ax.set_xticks(range(len(kernels)))
            ax.set_xticklabels(labels, rotation=90, fontsize=6)
            ax.set_ylabel("% of copy bandwidth (same bytes)")
            ax.set_title("Kernel bandwidth vs plain copy")
        else:
            for i, batch in enumerate(sorted({r["batch"] for r in cap})):
                rows = sorted((r for r in cap if r["batch"] == batch),
                              key=lambda r: r["capacity_cells"])
                xs = [r["capacity_cells"] for r in rows]
                ax.plot(xs, [r["step_us"] for r in rows], "-o", color=f"C{i}",
                        label=f"step ({cap[0]['layers']} layers), batch {batch}")
                ax.plot(xs, [r["start_forward_us"] for r in rows], "--o", color=f"C{i}",
                        label=f"start_forward, batch {batch}")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.set_xlabel("cache capacity (cells)")
            ax.set_ylabel("us")
            ax.set_title(f"Per-step cost vs capacity (context {cap[0]['context']})")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def run_bench(s: BenchSettings, log: Callable[[str], None] = lambda _: None) -> dict:
    """Run the sections of ``s`` and return every figure as a JSON-ready dict."""
    dev = _Device(s.device)
    notes: List[str] = []
    _set_threads(s)
    results: dict = {"settings": asdict(s), "machine": machine_info(dev), "notes": notes}
    load = results["machine"].get("load_1min")
    if load is not None and load > (results["machine"].get("cpus") or 1):
        notes.append(f"the machine was busy when the run started (1-minute load {load:.1f} on "
                     f"{results['machine'].get('cpus')} CPUs): absolute times are inflated; "
                     "the ratios come from interleaved steps and their spread says how much "
                     "to trust them")
    # machine_info imported torch and transformers: with their hundreds of thousands of objects
    # tracked, every gc.collect() between contenders would take half a second. Freezing moves
    # them out of the collector's sight for this run.
    gc.collect()
    gc.freeze()
    try:
        _run_sections(s, dev, notes, results, log)
    finally:
        gc.unfreeze()
    results["targets"] = evaluate_targets(s, results)
    return results


def _run_sections(s: BenchSettings, dev: _Device, notes: List[str], results: dict,
                  log: Callable[[str], None]) -> None:
    if s.dtype == "float16" and s.device == "cpu":
        notes.append("float16 on the CPU: numpy and torch copy float16 as plain bytes, so "
                     "the append and HF baselines are not slowed by missing fp16 arithmetic")
    if "decode" in s.sections:
        log("decode step ...")
        results["decode"] = run_decode(s, dev, notes, log)
        if any(r["contender"] == "numbakv" for r in results["decode"]):
            notes.append("numbakv's step also builds the [batch, n] attention mask; HF caches "
                         "return no mask (the model builds it outside the cache, not timed)")
    if "kernels" in s.sections:
        log("kernels ...")
        results["kernels"], results["copy"] = run_kernels(s, dev, notes, log)
    if "capacity" in s.sections:
        log("capacity ...")
        results["capacity"] = run_capacity(s, dev, notes, log)
    if "quant" in s.sections:
        log("quantized K/V ...")
        results["quant"] = run_quant(s, dev, notes, log)
    if "seqops" in s.sections:
        log("sequence operations ...")
        _run_seqops(s, dev, notes, results, log)
    if "attention" in s.sections:
        log("attention ...")
        results["attention"] = run_attention(s, dev, notes, log)
    if "streams" in s.sections:
        log("per-sequence streams ...")
        results["streams"] = run_streams(s, dev, notes, log)
    if "attend" in s.sections:      # numbakv/tools/bench_attend.py
        from .bench_attend import run_attend

        def decode_8x4k(dtype: str) -> dict:
            case = attention_case(_Device("cpu"), dtype, 8, 4096, 1)
            return {"cache": case["cache"], "q": case["q"],
                    "fns": {"floor": case["fns"]["floor"], "attend": case["fns"]["torch"]}}
        results["attend"] = run_attend(s, notes, log, timer=_time_alternating,
                                       decode_case=decode_8x4k)
    if "snapshot" in s.sections:     # numbakv/tools/bench_snapshot.py
        from . import bench_snapshot
        results["snapshot"] = bench_snapshot.run(
            s.device, s.dtype, layers=s.layers, heads=s.kv_heads, dim=s.head_dim,
            tokens=64 if s.quick else bench_snapshot.TOKENS, budget=max(s.budget * 4, 0.05),
            min_reps=3, log=log)
    if "states" in s.sections:      # numbakv/tools/bench_states.py (recurrent state rows)
        from . import bench_states
        log("recurrent state rows ...")
        results["states"] = bench_states.run(s.device, quick=s.quick, log=log,
                                             budget=max(s.budget * 4, 0.05), min_reps=3)
    if "prefix" in s.sections:      # numbakv/tools/bench_prefix.py (CPU figures)
        from .bench_prefix import run_prefix
        results["prefix"] = run_prefix(s.quick, log)
    if "generate" in s.sections:       # numbakv/tools/bench_generate.py (CPU, transformers)
        missing = _missing(["torch", "transformers"])
        if missing:
            notes.append(f"generate: skipped, {' and '.join(missing)} not installed: "
                         f"{install_hint(missing)}")
        else:
            log("generate() vs StaticCache / DynamicCache ...")
            from .bench_generate import run_generate
            results["generate"] = run_generate(s.quick, log)
    if "hybrid" in s.sections:       # numbakv/tools/bench_hybrid.py (CPU, transformers)
        missing = _missing(["torch", "transformers"])
        if missing:
            notes.append(f"hybrid: skipped, {' and '.join(missing)} not installed: "
                         f"{install_hint(missing)}")
        else:
            from .bench_hybrid import run_hybrid
            results["hybrid"] = run_hybrid(s.quick, log)
    if "agents" in s.sections:       # numbakv/tools/bench_agents.py (CPU, transformers)
        missing = _missing(["torch", "transformers"])
        if missing:
            notes.append(f"agents: skipped, {' and '.join(missing)} not installed: "
                         f"{install_hint(missing)}")
        else:
            from .bench_agents import run_agents
            results["agents"] = run_agents(s.quick, log)
    if "fidelity" in s.sections:           # numbakv/tools/bench_fidelity.py
        log("shared_shift='copy' ...")
        from .bench_fidelity import run as run_fidelity
        results["fidelity"] = run_fidelity(device=dev.name)


def _run_seqops(s: BenchSettings, dev: _Device, notes: List[str], results: dict,
                log: Callable[[str], None]) -> None:
    """The seqops section (numbakv/tools/bench_seqops.py): sequence operations vs capacity, the
    speculative-decoding step vs HF StaticCache, a server loop."""
    from . import bench_seqops as sq
    kw = dict(device=s.device, dtype=s.dtype, heads=s.kv_heads, dim=s.head_dim, log=log)
    caps = [4096, 16384] if s.quick else s.seqops_capacities
    results["seqops"] = sq.run_seqops(caps, measure, dev.sync, budget=s.budget / 4, **kw)
    results["spec"] = sq.run_spec([512, 2048] if s.quick else s.spec_contexts, measure,
                                  dev.sync, budget=s.budget / 2,
                                  layers=min(s.spec_layers, s.layers),
                                  notes=notes, **kw)
    results["server"] = sq.run_server([4096] if s.quick else s.seqops_capacities[:3:2], measure,
                                      dev.sync, budget=s.budget / 2,
                                      layers=s.capacity_layers, **kw)


# --------------------------------------------------------------------------------- attention
def _attention_cases(s: BenchSettings) -> List[Tuple[str, int, int, int]]:
    """(name, sequences, context per sequence before the step, query tokens per sequence)."""
    if s.quick:
        return [("decode 4 x 64", 4, 64, 1), ("prefill 16 into 64", 1, 48, 16),
                ("decode 8 x 32", 8, 32, 1)]
    return [("decode 8 x 4k", 8, 4096, 1), ("prefill 512 into 4k", 1, 3584, 512),
            ("decode 64 x 2k", 64, 2048, 1)]


def attention_case(dev: _Device, dtype: str, n_seq: int, context: int, n_q: int, *,
                   kv_heads: int = 8, head_dim: int = 128, seed: int = 0) -> dict:
    """One attention workload, one layer, ``4 * kv_heads`` query heads: ``n_seq`` sequences each
    prefilled (one sequence at a time) to ``context`` tokens of random K/V, then a forward pass
    of ``n_q`` new tokens per sequence. Returns the cache, ``q`` and the callables to time:
    ``attend`` (torch backend; ``flashinfer`` too where it runs), ``floor`` (SDPA over each
    sequence's own contiguous K/V, one call per sequence) and ``dense`` (``get()`` + the masked
    SDPA over the union of the batch's cells)."""
    torch = _optional_torch()
    from ..attention import attend, flashinfer_available
    from ..causal import CausalCache
    from ..config import CacheConfig
    F = torch.nn.functional
    tdev = _torch_device(dev)
    tdt = getattr(torch, dtype)
    hkv, d = kv_heads, head_dim
    H = 4 * hkv
    rng = np.random.default_rng(seed)
    cfg = CacheConfig(1, hkv, d, dtype=dtype, capacity=context + n_q + 8, max_seqs=n_seq,
                      max_batch=max(512, n_seq * n_q), device=dev.name)
    cache = CausalCache(cfg)
    for seq in range(n_seq):
        for p0 in range(0, context, 512):
            p1 = min(context, p0 + 512)
            cache.start_forward(np.arange(p0, p1), np.full(p1 - p0, seq))
    keys, vals = cache.storage.keys, cache.storage.values
    keys[...] = dev.asarray(rng.standard_normal(keys.shape, np.float32).astype(dtype))
    vals[...] = dev.asarray(rng.standard_normal(vals.shape, np.float32).astype(dtype))
    pos = np.concatenate([np.arange(context, context + n_q)] * n_seq)
    seqs = np.repeat(np.arange(n_seq), n_q)
    cache.start_forward(pos, seqs)
    q = torch.randn(len(pos), H, d, device=tdev).to(tdt)
    host = cache._host_pages()
    kp, vp = (torch.from_dlpack(x) for x in cache.layer_pool())
    own = []
    for b in range(n_seq):
        idx = torch.as_tensor(host.kv_indices[host.kv_indptr[b]:host.kv_indptr[b + 1]]
                              .astype(np.int64), device=tdev)
        own.append((kp.index_select(0, idx).transpose(0, 1).contiguous()[None],
                    vp.index_select(0, idx).transpose(0, 1).contiguous()[None]))
    causal = torch.ones(n_q, context + n_q, dtype=torch.bool, device=tdev).tril(context)
    causal = causal[:, None, :].expand(n_q, 4, context + n_q).reshape(n_q * 4, context + n_q)

    # the same K/V token-major ([n, Hkv, D] per sequence, as a cell pool or FlashInfer's NHD
    # pages hold them), seen by SDPA as strided [Hkv, n, D]
    own_nhd = [(k[0].transpose(0, 1).contiguous().transpose(0, 1)[None],
                v[0].transpose(0, 1).contiguous().transpose(0, 1)[None]) for k, v in own]

    def floor_of(kv):
        for b in range(n_seq):
            qb = q[b * n_q:(b + 1) * n_q].reshape(n_q, hkv, 4, d).transpose(0, 1)
            F.scaled_dot_product_attention(qb.reshape(1, hkv, n_q * 4, d), kv[b][0], kv[b][1],
                                           attn_mask=causal if n_q > 1 else None)

    def floor():
        floor_of(own)

    def floor_nhd():
        floor_of(own_nhd)

    def dense():
        key, value, mask = cache.get()
        k = torch.from_dlpack(key).transpose(0, 1)[None]
        v = torch.from_dlpack(value).transpose(0, 1)[None]
        m = torch.from_dlpack(mask)[:len(pos)].to(tdt)
        n = m.shape[1]
        qb = q.reshape(len(pos), hkv, 4, d).transpose(0, 1).reshape(1, hkv, -1, d)
        m = m[:, None, :].expand(len(pos), 4, n).reshape(-1, n)
        F.scaled_dot_product_attention(qb, k, v, attn_mask=m)

    def rebuild_page_table():
        cache._pages_cache = None
        cache.page_table()

    fns = {"floor": floor, "floor_nhd": floor_nhd, "dense": dense,
           "torch": lambda: attend(q, cache, backend="torch")}
    if dev.name == "cuda" and flashinfer_available():
        fns["flashinfer"] = lambda: attend(q, cache, backend="flashinfer")
    return {"cache": cache, "q": q, "fns": fns, "page_table": rebuild_page_table,
            "own": own, "own_nhd": own_nhd}


def run_attention(s: BenchSettings, dev: _Device, notes: List[str],
                  log: Callable[[str], None] = lambda _: None) -> List[dict]:
    """attend() vs SDPA over each sequence's own contiguous K/V (the floor) vs get() + dense
    masked SDPA over the union of the batch's cells, one layer, 4 query heads per KV head
    (32 per 8 by default), float32 and float16 (see :func:`attention_case`)."""
    torch = _optional_torch()
    if torch is None:
        notes.append("attention section skipped: PyTorch is not installed")
        return []
    from ..attention import attend, flashinfer_available
    rows = []
    if dev.name == "cuda" and not flashinfer_available():
        notes.append("attention: flashinfer is not importable here; its figures are unmeasured")
    for dtype in ("float32", "float16"):
        for name, n_seq, context, n_q in _attention_cases(s):
            log(f"attention {name} {dtype} ...")
            case = attention_case(dev, dtype, n_seq, context, n_q, kv_heads=s.kv_heads,
                                  head_dim=s.head_dim)
            cache, q, fns = case["cache"], case["q"], case["fns"]
            ref = attend(q, cache, backend="torch")
            dense = attend(q, cache, backend="dense")
            err = float((ref.float() - dense.float()).abs().max())
            t = _time_alternating(fns, s.budget, max(3, s.min_reps // 2))
            t_pt = measure(case["page_table"], sync=dev.sync, budget=min(s.budget, 0.2),
                           min_reps=3)
            pt = cache.page_table()
            lo, hi = cache.cell_range()
            row = {"case": name, "dtype": dtype, "seqs": n_seq, "context": context,
                   "q_tokens": n_q, "nnz": int(pt.kv_indices.shape[0]), "union_cells": hi - lo,
                   "floor_us": t["floor"] * 1e6, "dense_us": t["dense"] * 1e6,
                   "floor_nhd_us": t["floor_nhd"] * 1e6,
                   "torch_over_floor_nhd": t["torch"] / t["floor_nhd"],
                   "page_table_us": t_pt["median_us"], "max_abs_diff_vs_dense": err,
                   "dense_ratio": t["dense"] / t["floor"]}
            for be in fns:
                if be not in ("floor", "floor_nhd", "dense"):
                    row[f"{be}_us"] = t[be] * 1e6
                    row[f"{be}_ratio"] = t[be] / t["floor"]
            rows.append(row)
            cache.close()
            del case, cache, q, fns
            dev.release()
    return rows


def run_streams(s: BenchSettings, dev: _Device, notes: List[str],
                log: Callable[[str], None] = lambda _: None) -> List[dict]:
    """Decode attention over per-sequence streams (``unified=False``): a stream cache's ``get()``
    views (``[n_b, n_kv, Hkv, D]``, zero-copy for consecutive sequences) and one batched SDPA
    with its ``[n_b, 1, n_kv]`` mask, side by side with the unified cache of the same shapes
    (``attend()`` and ``get()`` + dense SDPA) and the per-sequence floor of
    :func:`attention_case`; one layer, 4 query heads per KV head, float32 and float16."""
    torch = _optional_torch()
    if torch is None:
        notes.append("streams section skipped: PyTorch is not installed")
        return []
    from ..causal import CausalCache
    from ..config import CacheConfig
    F = torch.nn.functional
    tdev = _torch_device(dev)
    cases = [("decode 4 x 64", 4, 64)] if s.quick else [("decode 8 x 4k", 8, 4096)]
    rows = []
    for dtype in ("float32", "float16"):
        for name, n_seq, context in cases:
            log(f"streams {name} {dtype} ...")
            case = attention_case(dev, dtype, n_seq, context, 1, kv_heads=s.kv_heads,
                                  head_dim=s.head_dim)
            q = case["q"]
            hkv, d = s.kv_heads, s.head_dim
            cfg = CacheConfig(1, hkv, d, dtype=dtype, capacity=context + 8, max_seqs=n_seq,
                              max_batch=512, device=dev.name, unified=False)
            st = CausalCache(cfg)
            for seq in range(n_seq):
                for p0 in range(0, context, 512):
                    p1 = min(context, p0 + 512)
                    st.start_forward(np.arange(p0, p1), np.full(p1 - p0, seq))
            rng = np.random.default_rng(1)
            for arr in (st.storage.keys, st.storage.values):
                arr[...] = dev.asarray(rng.standard_normal(arr.shape, np.float32).astype(dtype))
            st.start_forward(np.full(n_seq, context), np.arange(n_seq))
            st.set_layer(0)
            # decode: the 4 query heads of each KV head as 4 query rows of it (head h reads KV
            # head h // 4), as the floor does; torch's enable_gqa would copy K/V per query head
            qs = q.reshape(n_seq, hkv, 4, d)

            def streams():
                key, value, mask = st.get()
                k = torch.from_dlpack(key).permute(0, 2, 1, 3)       # [n_b, Hkv, n_kv, D]
                v = torch.from_dlpack(value).permute(0, 2, 1, 3)
                m = torch.from_dlpack(mask).to(k.dtype)[:, None]   # [n_b, 1, 1, n_kv]
                F.scaled_dot_product_attention(qs, k, v, attn_mask=m)

            fns = dict(case["fns"])
            fns["streams"] = streams
            t = _time_alternating(fns, s.budget, max(3, s.min_reps // 2))
            rows.append({"case": name, "dtype": dtype, "seqs": n_seq, "context": context,
                         "floor_us": t["floor"] * 1e6, "streams_us": t["streams"] * 1e6,
                         "streams_ratio": t["streams"] / t["floor"],
                         "floor_nhd_us": t["floor_nhd"] * 1e6,
                         "streams_over_floor_nhd": t["streams"] / t["floor_nhd"],
                         "attend_us": t["torch"] * 1e6, "attend_ratio": t["torch"] / t["floor"],
                         "dense_us": t["dense"] * 1e6, "dense_ratio": t["dense"] / t["floor"],
                         "n_kv": int(st._forward.n_kv)})
            st.close()
            case["cache"].close()
            del case, st, fns
            dev.release()
    if rows:
        notes.append("streams: get() views are zero-copy because the batch's sequences are "
                     "consecutive (0..n-1); a batch in another order gathers its rows")
    return rows


def format_streams(rows: List[dict]) -> List[str]:
    """Report lines of the streams section."""
    if not rows:
        return []
    lines = ["", "Per-sequence streams (unified=False), decode attention, one layer: stream get() "
             "+ batched SDPA vs the per-sequence floor (target <= 1.2x), beside the unified "
             "cache's attend() and get() + dense SDPA"]
    lines.append(f"{'case':<16} {'dtype':<8} {'floor us':>10} {'streams us':>11} {'ratio':>6} "
                 f"{'attend us':>10} {'ratio':>6} {'dense us':>10} {'ratio':>6} "
                 f"{'NHD floor us':>12} {'streams/NHD':>11}")
    for r in rows:
        lines.append(f"{r['case']:<16} {r['dtype']:<8} {_fmt_us(r['floor_us']):>10} "
                     f"{_fmt_us(r['streams_us']):>11} {r['streams_ratio']:>5.2f}x "
                     f"{_fmt_us(r['attend_us']):>10} {r['attend_ratio']:>5.2f}x "
                     f"{_fmt_us(r['dense_us']):>10} {r['dense_ratio']:>5.2f}x "
                     f"{_fmt_us(r['floor_nhd_us']):>12} {r['streams_over_floor_nhd']:>10.2f}x")
    return lines


def format_attention(rows: List[dict]) -> List[str]:
    """Report lines of the attention section."""
    if not rows:
        return []
    lines = ["", "Attention, one layer: attend() and get() + dense SDPA vs SDPA over each "
             "sequence's own contiguous K/V (the floor: [Hkv, n, D] per sequence; NHD floor: "
             "[n, Hkv, D] per sequence); ratio = time / floor"]
    lines.append(f"{'case':<20} {'dtype':<8} {'floor us':>10} {'attend us':>10} {'ratio':>6} "
                 f"{'dense us':>10} {'ratio':>6} {'NHD floor us':>12} {'ratio':>6} "
                 f"{'page_table us':>13}")
    for r in rows:
        lines.append(f"{r['case']:<20} {r['dtype']:<8} {_fmt_us(r['floor_us']):>10} "
                     f"{_fmt_us(r['torch_us']):>10} {r['torch_ratio']:>5.2f}x "
                     f"{_fmt_us(r['dense_us']):>10} {r['dense_ratio']:>5.2f}x "
                     f"{_fmt_us(r['floor_nhd_us']):>12} {r['torch_over_floor_nhd']:>5.2f}x "
                     f"{_fmt_us(r['page_table_us']):>13}")
        if "flashinfer_us" in r:
            lines.append(f"{'':<20} {'':<8} flashinfer {_fmt_us(r['flashinfer_us'])} us "
                         f"({r['flashinfer_ratio']:.2f}x)")
    return lines


# --------------------------------------------------------------------------------- command line
def add_parser(subparsers) -> None:
    """Register ``numbakv bench`` on the CLI's sub-parsers."""
    p = subparsers.add_parser(
        "bench", help="decode-step cost vs HF StaticCache/DynamicCache and append caches, "
                      "kernel bandwidth vs copy, cost vs capacity",
        description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--device", default="auto", help="auto (default), cpu or cuda")
    p.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    p.add_argument("--layers", type=int, default=None, help="layers (default 32)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128)")
    p.add_argument("--contexts", default=None,
                   help="comma list of tokens per sequence (default 512,2048,4096)")
    p.add_argument("--batch", default=None, help="comma list of sequences (default 1,8)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of timed repetitions per measurement (default 0.5)")
    p.add_argument("--sections", default=None,
                   help=f"comma list of {', '.join(SECTIONS)} (default: the first three)")
    p.add_argument("--quick", action="store_true",
                   help="the decode-step comparison at 8 layers x 8 KV heads x 128, context "
                        "1024, batch 1 and 8: under a minute")
    p.add_argument("--full", action="store_true", help="adds context 8192, longer timing")
    p.add_argument("--png", default=None, metavar="PATH",
                   help="save the plot there (nothing is written unless asked)")
    p.add_argument("--no-plot", action="store_true",
                   help="no plot (the default; kept for old scripts)")
    p.add_argument("--rounds", type=int, default=None,
                   help="decode section: rounds per shape, each rebuilding and interleaving "
                        "every contender; the report gives the spread between rounds "
                        "(default 3, --quick 5)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for torch and numba's parallel kernels (default: the CPUs "
                        "this process may use), set explicitly and reported")
    p.add_argument("--json", default=None, help="also write every figure to this JSON file")
    p.add_argument("--verbose", "-v", action="store_true", help="print progress")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import sys
    try:
        s = settings_from_args(args)
    except ValueError as exc:
        print(f"numbakv bench: {exc}", file=sys.stderr)
        return 2
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.verbose else \
        (lambda _: None)
    from .bench_summary import cost_note
    print(cost_note(s), file=sys.stderr, flush=True)
    results = run_bench(s, log)
    if args.png and not args.no_plot:
        why = save_plot(results, args.png)
        results["notes"].append(why if why else f"plot saved to {args.png}")
    print(format_report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


__all__ = ["BenchSettings", "run_bench", "format_report", "save_plot", "evaluate_targets",
           "measure", "add_parser", "main", "settings_from_args"]
