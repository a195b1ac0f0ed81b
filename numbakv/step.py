"""A decode step that replays as a CUDA graph: :meth:`numbakv.CausalCache.capture_step`.

A CUDA graph freezes its kernels' launch arguments, so a graph of an ordinary ``put`` would
write every replay's tokens into the cells of the first one. A :class:`DecodeStep` instead gives
the captured kernels inputs that sit in device buffers at fixed addresses, owned by the step
and kept for its lifetime:

* ``descriptor``: int32 ``[HEADER + 3 * batch]`` (:data:`HEADER` = 4), the *step descriptor*:
  ``[n_tokens, start, batch, 0, slots[batch], positions[batch], seqs[batch]]``. The put kernel
  reads its slots from ``slots`` (slot list mode: a token whose slot is -1 writes nothing, so a
  step captured for ``batch`` tokens replays with any ``n_tokens <= batch``); positions and
  sequence ids travel beside them for kernels that need them. No kernel of the graph has a start
  slot or a length among its launch arguments.
* ``key``/``value``: the step's inputs, ``[n_stored_layers, batch, n_kv_heads, head_dim]`` and
  ``[n_stored_layers, batch, n_kv_heads, v_head_dim]`` in the storage dtype (a model may write
  its K/V straight into them and pass ``k=None, v=None`` to :meth:`DecodeStep.replay`).

:meth:`DecodeStep.replay` does the host half of a decode step -- ``start_forward`` (the cell
table's bookkeeping, and any pending key rotation or defrag, launched eagerly on the cache's
stream), the descriptor written into a pinned host buffer and sent by one ``cudaMemcpyAsync``,
the caller's K/V copied into the fixed inputs -- then launches the graph: one put per stored
layer, all reading the descriptor. Everything is queued on the cache's stream in that order.

An engine that captures its own graph (the whole model) instead calls :meth:`DecodeStep.put`
per layer inside its capture, on the cache's stream, and :meth:`DecodeStep.prepare` before each
replay of its graph: the same descriptor-reading put, launched where the engine wants it.

On ``cpu`` and ``sim`` there is no graph to capture; the step records the same launches (the
CPU twin, or the real kernel in the simulator) reading the same descriptor array, and
:meth:`DecodeStep.replay` runs them: the results, the validation and the error behaviour are
those of the GPU path, so code written against a step runs unchanged on every device.

Not captured (``NotSupportedError`` at :meth:`~numbakv.CausalCache.capture_step`): attention
(``attend=True``; its paged kernel's table is rebuilt per pass, so it does not sit at a fixed
address yet), quantized K/V, V-less (MLA) caches and per-sequence streams (``unified=False``).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

from ._jit import njit
from .device import as_array
from .errors import KVCacheError, NotSupportedError
from .kernels import put as _put
from .kernels._common import Desc

#: int32 entries before the slots: n_tokens, start, batch, 0 (16 bytes: the slots start aligned)
HEADER = 4
#: pinned host descriptors in flight: a replay refills the one whose copy ran longest ago, and
#: waits for that copy only when the GPU is this many replays behind
PINNED_RING = 4
#: cudaMemcpyHostToDevice, cudaMemcpyDeviceToDevice
_H2D, _D2D = 1, 3


@njit(cache=True)
def fill_descriptor(host, pos, seqs, start, batch):
    """The step descriptor (see the module docstring) of ``n = len(pos)`` tokens placed at
    cells ``start ..`` into ``host`` (int32 ``[HEADER + 3 * batch]``), -1 past ``n``; one
    compiled pass instead of a dozen numpy slice assignments per replay."""
    n = pos.shape[0]
    host[0] = n
    host[1] = start
    host[2] = batch
    host[3] = 0
    for t in range(batch):
        if t < n:
            host[HEADER + t] = start + t
            host[HEADER + batch + t] = pos[t]
            host[HEADER + 2 * batch + t] = seqs[t]
        else:
            host[HEADER + t] = -1
            host[HEADER + batch + t] = -1
            host[HEADER + 2 * batch + t] = -1


class DecodeStep:
    """A captured decode step of a :class:`~numbakv.CausalCache` (see the module docstring).

    Attributes: ``cache``, ``batch`` (most tokens a replay takes), ``layers`` (the model layers
    whose K/V the step stores, in the order of ``key``'s first axis), ``key`` ``[len(layers),
    batch, n_kv_heads, head_dim]`` and ``value`` ``[len(layers), batch, n_kv_heads, v_head_dim]``
    (the fixed input buffers, storage dtype), ``descriptor`` (int32 ``[4 + 3 * batch]``, device
    memory on ``cuda``), ``graph`` (the CuPy graph on ``cuda``, None elsewhere), ``replays``.
    """

    def __init__(self, cache: Any, batch: int) -> None:
        storage = cache.storage
        cfg = cache.config
        self.cache = cache
        self.batch = int(batch)
        self.device = storage.device
        self.layers: Tuple[int, ...] = tuple(cfg.owner_layers)
        self.replays = 0
        self.graph = None
        self._user_plans: dict = {}   # put(): one launch plan per (layer, input addresses)
        xp = storage.xp
        n_layers = len(self.layers)
        sdt = cfg.storage_dtype
        H = cfg.local_kv_heads
        self._storage = storage
        self._scope = storage._on_device
        with self._scope():
            self.key = xp.zeros((n_layers, self.batch, H, cfg.head_dim), dtype=sdt)
            self.value = xp.zeros((n_layers, self.batch, H, cfg.v_head_dim), dtype=sdt)
            self.descriptor = xp.full(HEADER + 3 * self.batch, -1, dtype=np.int32) \
                if self.device != "cuda" else xp.zeros(HEADER + 3 * self.batch, dtype=np.int32)
        self._nbytes = (HEADER + 3 * self.batch) * 4
        self._slots_at = HEADER
        self._pos_at = HEADER + self.batch
        self._seq_at = HEADER + 2 * self.batch
        if self.device == "cuda":
            self._ring: List[list] = []
            self._ring_next = 0
            self._capture()
        else:
            self._host = self.descriptor   # the kernels' descriptor is host memory here
            self._launches = self._record()

    # ------------------------------------------------------------------ building
    def _record(self) -> List[Any]:
        """cpu/sim: one put per stored layer, each reading ``descriptor``'s slots when called."""
        storage = self._storage
        slots = self.descriptor[self._slots_at:self._slots_at + self.batch]
        out = []
        for i in range(len(self.layers)):
            k_in, v_in = self.key[i], self.value[i]
            if self.device == "cpu":
                k_l, v_l = storage._k_layers[i], storage._v_layers[i]
                out.append(lambda k_l=k_l, v_l=v_l, k_in=k_in, v_in=v_in:
                           _put.launch_cpu(k_l, v_l, slots, k_in, v_in))
            else:
                k_l, v_l = storage._k_layers[i], storage._v_layers[i]
                out.append(lambda k_l=k_l, v_l=v_l, k_in=k_in, v_in=v_in:
                           _put.launch("sim", k_l, v_l, slots, k_in, v_in, storage.permuted))
        return out

    def _capture(self) -> None:
        """cuda: per stored layer a put plan whose slot array is the descriptor's, launched once
        eagerly with every slot -1 (loads the kernel, writes nothing), then captured into one
        graph on a private stream."""
        import cupy
        storage = self._storage
        desc_ptr = int(self.descriptor.data.ptr)
        slots = Desc(desc_ptr + 4 * self._slots_at, (self.batch,), (4,), np.dtype(np.int32))
        device_id = cupy.cuda.runtime.getDevice()
        self._plans = []
        for i in range(len(self.layers)):
            k_l, v_l = storage._k_layers[i], storage._v_layers[i]
            k_in, v_in = self.key[i], self.value[i]
            plan = _put._CudaPut(k_l, v_l, k_in, v_in, slots, storage.permuted, device_id)
            ptrs = (int(k_l.data.ptr), int(v_l.data.ptr), slots.ptr, int(k_in.data.ptr),
                    int(v_in.data.ptr))
            self._plans.append((plan, ptrs))
        with self._scope():
            stream = cupy.cuda.get_current_stream()
            self._write_descriptor(np.zeros(0, np.int32), np.zeros(0, np.int32), 0, stream)
            self._launch_all(stream)           # every slot -1: loads the kernels, writes nothing
            capture = cupy.cuda.Stream(non_blocking=True)
            # the capture stream must not run ahead of the buffers' initialisation: graphs
            # record no cross-stream order, so finish it first (once, at capture time)
            stream.synchronize()
            with capture:   # current too: Numba's dispatcher (the fallback) launches there
                capture.begin_capture()
                try:
                    self._launch_all(capture)
                finally:
                    graph = capture.end_capture()
        self.graph = graph
        self._capture_stream = capture

    def _launch_all(self, stream) -> None:
        for plan, ptrs in self._plans:
            plan.launch(ptrs, -1, stream.ptr)

    # ------------------------------------------------------------------ replay
    def _pinned(self, stream) -> list:
        """A pinned host descriptor whose previous copy has run (a ring of
        :data:`PINNED_RING`)."""
        import cupy
        ring = self._ring
        if len(ring) < PINNED_RING:
            mem = cupy.cuda.alloc_pinned_memory(self._nbytes)
            host = np.frombuffer(mem, np.int32, self._nbytes // 4)
            slot = [mem, host, None, int(host.ctypes.data)]
            ring.append(slot)
            return slot
        slot = ring[self._ring_next]
        self._ring_next = (self._ring_next + 1) % PINNED_RING
        if slot[2] is not None and not slot[2].done:
            slot[2].synchronize()   # the GPU is PINNED_RING replays behind
        return slot

    def _write_descriptor(self, pos: np.ndarray, seqs: np.ndarray, start: int, stream,
                          slots: Optional[np.ndarray] = None) -> None:
        n = pos.shape[0]
        if self.device == "cuda":
            slot = self._pinned(stream)
            host = slot[1]
        else:
            host = self._host
        fill_descriptor(host, pos, seqs, start, self.batch)
        if slots is not None:       # paged placement (CacheConfig(page_size)): scattered cells
            host[HEADER:HEADER + n] = slots
        if self.device == "cuda":
            import cupy
            cupy.cuda.runtime.memcpyAsync(int(self.descriptor.data.ptr), slot[3], self._nbytes,
                                          _H2D, stream.ptr)
            if slot[2] is None:
                slot[2] = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
            slot[2].record(stream)

    def _check_input(self, x, name: str, n: int, dim: int):
        """``x`` as an array of the cache's device and storage dtype ``[n_layers, n, H, dim]``
        (None or the step's own buffer: already in place)."""
        own = self.key if name == "k" else self.value
        if x is None or x is own:
            return None
        cfg = self.cache.config
        with self._scope():   # a DLPack producer is ordered before the cache's stream
            arr = as_array(x, self.device, cfg.dtype, name=name)
        want = (len(self.layers), n, cfg.local_kv_heads, dim)
        if tuple(arr.shape) != want:
            raise ValueError(f"{name} must have shape [n_stored_layers={want[0]}, tokens={n}, "
                             f"n_kv_heads={want[2]}, {'head_dim' if name == 'k' else 'v_head_dim'}"
                             f"={dim}], got {list(arr.shape)}")
        return arr

    def _copy_in(self, own, arr, n: int, stream) -> None:
        """``arr`` into the first ``n`` tokens of the fixed input ``own`` (on the cache's
        stream: one asynchronous device copy when both are contiguous and whole)."""
        if self.device == "cuda" and n == self.batch and arr.flags.c_contiguous:
            import cupy
            cupy.cuda.runtime.memcpyAsync(int(own.data.ptr), int(arr.data.ptr), own.nbytes,
                                          _D2D, stream.ptr)
            self._storage._keep_inputs(arr, arr)
            return
        own[:, :n] = arr
        if self.device == "cuda":
            self._storage._keep_inputs(arr, arr)

    def _count(self, positions: Any) -> int:
        n = int(np.size(positions)) if isinstance(positions, np.ndarray) else None
        if n is None:
            try:
                n = len(positions)
            except TypeError:
                raise ValueError(f"positions must be a 1-d integer array, got "
                                 f"{type(positions).__name__}") from None
        if not 1 <= n <= self.batch:
            raise ValueError(f"positions must hold 1 to batch={self.batch} tokens (the step's "
                             f"captured size), got {n}")
        return n

    def prepare(self, positions: Any, seqs: Any) -> None:
        """The host half of a step without the graph, for an engine that captures its own
        (the whole model, say) with :meth:`put` inside it: ``start_forward(positions, seqs)``
        and the step descriptor sent to the device (on the cache's stream), so kernels
        captured earlier by :meth:`put` store this batch's ``n <= batch`` tokens when the
        engine replays its graph next on that stream. Raises like ``start_forward``, nothing
        changed."""
        cache = self.cache
        if cache.closed:
            raise KVCacheError("the cache is closed")
        self._count(positions)
        cache.start_forward(positions, seqs)
        fwd = cache._forward
        with self._scope():
            stream = None
            if self.device == "cuda":
                import cupy
                stream = cupy.cuda.get_current_stream()
            self._write_descriptor(fwd.positions, fwd.seqs, int(fwd.start), stream, fwd.slots)

    def put(self, layer: int, key: Any, value: Any) -> None:
        """Store ``key [batch, n_kv_heads, head_dim]`` and ``value [batch, n_kv_heads,
        v_head_dim]`` (arrays of the cache's device, storage dtype) for model ``layer`` at the
        cells the step descriptor names: token ``t < n`` of the last :meth:`prepare` (or
        :meth:`replay`) goes to its cell, rows past ``n`` are skipped. The kernel reads its
        slots from the descriptor when it runs, never from its launch arguments, so a call made
        while the engine captures a CUDA graph (on the cache's stream) stores each later
        replay's tokens where that replay's ``prepare`` placed them. On cpu/sim the put runs
        at once, reading the same descriptor."""
        cfg = self.cache.config
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or \
                not 0 <= layer < cfg.n_layers:
            raise ValueError(f"layer must be an integer in [0, {cfg.n_layers}), got {layer!r}")
        slot = cfg.storage_layers[int(layer)]
        if cfg.owner_layer(int(layer)) != layer or slot < 0:
            raise ValueError(f"layer {layer} stores no K/V of its own (layer_reuse)")
        storage = self._storage
        storage._check_kv(key, value, self.batch)
        k_l, v_l = storage._k_layers[slot], storage._v_layers[slot]
        slots = self.descriptor[self._slots_at:self._slots_at + self.batch]
        if self.device == "cpu":
            _put.launch_cpu(k_l, v_l, slots, key, value)
            return
        if self.device == "sim":
            _put.launch("sim", k_l, v_l, slots, key, value, storage.permuted)
            return
        import cupy
        ptrs = (int(k_l.data.ptr), int(v_l.data.ptr),
                int(self.descriptor.data.ptr) + 4 * self._slots_at, int(key.data.ptr),
                int(value.data.ptr))
        pkey = (slot, ptrs, key.shape, key.strides, value.shape, value.strides)
        plan = self._user_plans.get(pkey)
        if plan is None:
            desc = Desc(ptrs[2], (self.batch,), (4,), np.dtype(np.int32))
            plan = self._user_plans[pkey] = _put._CudaPut(
                k_l, v_l, key, value, desc, storage.permuted, cupy.cuda.runtime.getDevice())
        with self._scope():
            plan.launch(ptrs, -1, cupy.cuda.get_current_stream().ptr)
            storage._keep_inputs(key, value)

    def replay(self, positions: Any, seqs: Any, q: Any = None, k: Any = None,
               v: Any = None) -> None:
        """Run the captured step for a batch of ``n <= batch`` tokens: ``positions`` and
        ``seqs`` ``[n]`` (as :meth:`~numbakv.CausalCache.start_forward` takes them),
        ``k [n_stored_layers, n, n_kv_heads, head_dim]`` and ``v [n_stored_layers, n,
        n_kv_heads, v_head_dim]`` (arrays of the cache's device and dtype, or DLPack tensors;
        None when the caller wrote them into :attr:`key` / :attr:`value`, which then hold
        ``batch`` tokens of which the first ``n`` are stored). ``q`` must be None (attention is
        not captured). Afterwards the cache is in that forward pass: ``get()``, ``attend`` and
        ``page_table()`` see the tokens. Raises like ``start_forward`` (``KVCacheFullError``,
        ``ValueError``) with nothing changed."""
        cache = self.cache
        if cache.closed:
            raise KVCacheError("the cache is closed")
        if q is not None:
            raise ValueError("q must be None: this step was captured without attention "
                             "(capture_step(attend=False))")
        n = self._count(positions)
        cfg = cache.config
        k_arr = self._check_input(k, "k", n, cfg.head_dim)
        v_arr = self._check_input(v, "v", n, cfg.v_head_dim)
        cache.start_forward(positions, seqs)      # validates; all or nothing
        fwd = cache._forward
        with self._scope():
            stream = None
            if self.device == "cuda":
                import cupy
                stream = cupy.cuda.get_current_stream()
            self._write_descriptor(fwd.positions, fwd.seqs, int(fwd.start), stream, fwd.slots)
            if k_arr is not None:
                self._copy_in(self.key, k_arr, n, stream)
            if v_arr is not None:
                self._copy_in(self.value, v_arr, n, stream)
            if self.device == "cuda":
                self.graph.launch(stream)
            else:
                for launch in self._launches:
                    launch()
        self.replays += 1

    def __repr__(self) -> str:
        return (f"DecodeStep(batch={self.batch}, layers={len(self.layers)}, device="
                f"{self.device!r}, graph={'yes' if self.graph is not None else 'no'}, "
                f"replays={self.replays})")


def check_capturable(cache: Any, batch: Any, attend: bool) -> int:
    """The checks of :meth:`~numbakv.CausalCache.capture_step` (``batch`` as an int)."""
    cfg = cache.config
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or \
            not 1 <= batch <= cfg.max_batch:
        raise ValueError(f"batch must be an integer in [1, max_batch={cfg.max_batch}], "
                         f"got {batch!r}")
    if not isinstance(attend, (bool, np.bool_)):
        raise ValueError(f"attend must be a bool, got {attend!r}")
    if attend:
        raise NotSupportedError(
            "capture_step(attend=True): attention is not captured yet (the paged attention "
            "kernel's page table is rebuilt every pass, not kept at a fixed device address); "
            "capture the put step and call numbakv.attention.attend after replay()")
    if cfg.k_quantized or cfg.v_quantized:
        raise NotSupportedError("capture_step: quantized K/V are not captured (their put "
                                "kernel takes host slots)")
    if cfg.v_less:
        raise NotSupportedError("capture_step: a V-less (MLA) cache is not captured")
    if cache.storage is None:
        raise NotSupportedError("capture_step needs a cache with its own K/V storage")
    return int(batch)


__all__ = ["DecodeStep", "HEADER", "check_capturable", "fill_descriptor"]
