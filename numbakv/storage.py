"""K/V storage: allocation, per-layer views, and launching the kernels on the right device.

``keys`` is one array ``[n_layers, n_cells, n_kv_heads, head_dim]``; ``values`` is ``[n_layers,
n_cells, n_kv_heads, v_head_dim]`` or, with ``config.permuted_v``, ``[n_layers, n_kv_heads,
v_head_dim, n_cells]`` (llama.cpp's ``v_trans``, Ollama's ``PermutedV``). CuPy arrays on
``cuda``, numpy arrays on ``cpu`` and ``sim``; bfloat16 is stored as its uint16 bit patterns.
Storage knows nothing of cells' meaning: callers say which slots, ranges and moves.

Every method checks its arguments before touching the data and raises ``ValueError`` naming
the argument; a failed call changes nothing.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional, Tuple

import numpy as np
from ._jit import njit
from .device import count_host_wait

from .config import (CacheConfig, MASK_DTYPES, MAX_SEQS_LIMIT, QUANT_TYPES, RopeShift,
                     check_rope_layout)
from .kernels import mask as _mask
from .kernels import mla as _mla
from .kernels import move as _move
from .kernels import put as _put
from .kernels import quant as _quant
from .kernels import rope as _rope

_SEQ_WORDS = MAX_SEQS_LIMIT // 64
#: compared as dtype objects: formatting a dtype's name costs microseconds on every forward pass
_MASK_NP_DTYPES = tuple(MASK_DTYPES.values())


def _host_ints(x, name: str, dtype=np.int32, ndim: int = 1) -> np.ndarray:
    """``x`` as a contiguous host integer array of ``dtype`` (checked, never silently wrapped)."""
    if type(x) is np.ndarray and x.dtype == dtype and x.ndim == ndim:
        return x  # strided views too: every kernel launcher takes any layout
    if hasattr(x, "__cuda_array_interface__") or type(x).__module__.split(".")[0] == "cupy":
        raise ValueError(f"{name} must be a host (numpy) integer array, got a GPU array")
    arr = np.asarray(x)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-d integer array, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind == "b" and dtype == np.uint8:
            return np.ascontiguousarray(arr, dtype=np.uint8)
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype != dtype:
        info = np.iinfo(dtype)
        lo, hi = arr.min(), arr.max()
        if lo < info.min or hi > info.max:
            raise ValueError(f"{name} values must fit {np.dtype(dtype).name}, got range "
                             f"[{lo}, {hi}]")
    return np.ascontiguousarray(arr, dtype=dtype)


@njit(cache=True)
def _slots_problem(slots, n_cells):
    """0 when ``slots`` is a valid put target, 1 when one is >= n_cells, 2 when a cell repeats
    (one pass for the usual increasing slots; a sort only otherwise)."""
    prev = -1
    increasing = True
    for i in range(slots.shape[0]):
        s = slots[i]
        if s >= n_cells:
            return 1
        if s >= 0:
            if s <= prev:
                increasing = False
            prev = s
    if increasing:
        return 0
    used = np.sort(slots)
    for i in range(1, used.shape[0]):
        if used[i] >= 0 and used[i] == used[i - 1]:
            return 2
    return 0


@njit(cache=True)
def _all_in(values, lo, hi):
    """Whether every entry is in ``[lo, hi)``: one compiled pass (two numpy reductions cost
    about 6 us on the rotation's host path)."""
    for i in range(values.shape[0]):
        if values[i] < lo or values[i] >= hi:
            return False
    return True


#: host storage alignment: JAX's CPU DLPack import copies unless data is 64-byte aligned, and
#: numpy's allocator only guarantees 16
HOST_ALIGN = 64


def _host_zeros(shape, dtype, align: int = HOST_ALIGN) -> np.ndarray:
    """Zeroed host array whose data starts on an ``align``-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buf = np.zeros(nbytes + align, dtype=np.uint8)
    offset = (-buf.ctypes.data) % align
    return buf[offset:offset + nbytes].view(dtype).reshape(shape)


#: the scope of a storage that needs none (reentrant and reusable)
_NO_SCOPE = contextlib.nullcontext()


class _CudaScope:
    """Enter the storage's device (when another is current) and its stream (when one is set)."""

    __slots__ = ("device_id", "stream", "_dev", "_entered")

    def __init__(self, device_id: int, stream) -> None:
        self.device_id = device_id
        self.stream = stream

    def __enter__(self):
        import cupy
        self._dev = None
        if cupy.cuda.runtime.getDevice() != self.device_id:
            self._dev = cupy.cuda.Device(self.device_id)
            self._dev.__enter__()
        if self.stream is not None:
            self.stream.__enter__()
        return self

    def __exit__(self, *exc):
        if self.stream is not None:
            self.stream.__exit__(*exc)
        if self._dev is not None:
            self._dev.__exit__(*exc)
        return False


def _as_cupy_stream(stream, device_id: int):
    """A CuPy stream for ``stream`` (CuPy stream, torch stream, raw ``cudaStream_t`` int or
    None)."""
    if stream is None:
        return None
    import cupy
    if type(stream).__module__.split(".")[0] == "cupy":
        return stream
    if hasattr(stream, "ptr") and hasattr(stream, "is_capturing") and \
            hasattr(stream, "__enter__"):
        return stream  # a CuPy-compatible stream object
    handle = getattr(stream, "cuda_stream", stream)  # torch.cuda.Stream / ExternalStream
    if isinstance(handle, bool) or not isinstance(handle, (int, np.integer)) or handle < 0:
        raise ValueError(f"stream must be a CuPy stream, a torch CUDA stream or a cudaStream_t "
                         f"handle (int), got {type(stream).__name__}")
    return cupy.cuda.ExternalStream(int(handle), device_id)


class KVStorage:
    """The K and V arrays of a cache and the kernels that update them.

    ``KVStorage(config, n_cells, device)`` allocates zeroed storage (free cells inside a
    ``get()`` range must hold finite data) on ``device`` (already resolved: ``cpu``, ``sim`` or
    ``cuda``). Attributes: ``config``, ``n_cells``, ``device``, ``dtype`` (name), ``xp`` (numpy
    or cupy), ``keys``, ``values``.
    """

    def __init__(self, config: CacheConfig, n_cells: int, device: str) -> None:
        if not isinstance(config, CacheConfig):
            raise ValueError(f"config must be a CacheConfig, got {type(config).__name__}")
        if isinstance(n_cells, bool) or not isinstance(n_cells, (int, np.integer)) or n_cells < 1:
            raise ValueError(f"n_cells must be an integer >= 1, got {n_cells!r}")
        if device not in ("cpu", "sim", "cuda"):
            raise ValueError(f"device must be a resolved device ('cpu', 'sim' or 'cuda'), "
                             f"got {device!r}")
        self.config = config
        self.n_cells = int(n_cells)
        self.device = device
        self.dtype = config.dtype
        self.permuted = bool(config.permuted_v)
        if device == "cuda":
            import cupy
            self.xp = cupy
            self._device_id = cupy.cuda.runtime.getDevice()
            # one GPU and no stream of its own: nothing to enter around a launch (every put
            # paid for a scope object and a device query)
            self._single_gpu = cupy.cuda.runtime.getDeviceCount() == 1
        else:
            self.xp = np
            self._device_id = None
        L, N, H = config.n_layers, self.n_cells, config.local_kv_heads
        D, Dv = config.head_dim, config.v_head_dim
        sdt = config.storage_dtype
        vshape = (L, H, Dv, N) if self.permuted else (L, N, H, Dv)
        zeros = self.xp.zeros if device == "cuda" else _host_zeros
        # quantized sides: raw blocks, uint8 [L, N, H, row_bytes] (see kernels/quant.py)
        self.k_quantized = config.k_quantized
        self.v_quantized = config.v_quantized
        self.quantized = self.k_quantized or self.v_quantized
        self.keys = (zeros((L, N, H, config.k_row_bytes), dtype=np.uint8) if self.k_quantized
                     else zeros((L, N, H, D), dtype=sdt))
        self.values = (zeros((L, N, H, config.v_row_bytes), dtype=np.uint8) if self.v_quantized
                       else zeros(vshape, dtype=sdt))
        if self.quantized:
            self._init_quantized()
        self._key_shape = (H, D)
        self._value_shape = (H, Dv)
        self._sdt = sdt
        self._bind_layers()
        # the stream contract (cuda only; see use_stream): None = CuPy's current stream
        self._stream = None
        self._mover = None            # kernels.move.RunMover, built at the first move
        self._roper = None            # kernels.rope.RopeLauncher, built at the first rotation
        self._rope_memo = (None, None, 0)   # (RopeShift, inv_freq, rotary dim) of the last one
        self._order_event = None      # order_before / order_after: one reused event each
        self._after_event = None
        self._pending: list = []      # inputs of queued launches not yet covered by an event
        self._retired: list = []      # [(event, objects)], oldest first
        self._last_mask = None
        if device == "cuda" and os.environ.get("NUMBAKV_WARM_UP", "1").lower() not in \
                ("0", "false", "no"):
            self.warm_up()

    def _bind_layers(self) -> None:
        """Per-layer views, built once (the put path runs per layer per forward pass); the CPU
        twins take raw unsigned views (Numba's CPU target has no float16)."""
        L, sdt = self.config.n_layers, self._sdt
        if self.device == "cpu":
            # indexed [cell, head, dim] whatever the layout (permuted V transposed); 16-bit data
            # as uint16 (Numba's CPU target has no float16), float32 as it is
            raw = np.dtype(np.uint16) if sdt.itemsize == 2 else sdt
            self._k_layers = [self.keys[i] if self.k_quantized else self.keys[i].view(raw)
                              for i in range(L)]
            self._v_layers = [(self.values[i] if self.v_quantized
                               else self.values[i].view(raw).transpose(2, 0, 1) if self.permuted
                               else self.values[i].view(raw)) for i in range(L)]
        else:
            self._k_layers = [self.keys[i] for i in range(L)]
            self._v_layers = [self.values[i] for i in range(L)]

    def cell_slice(self, lo: int, hi: int) -> "KVStorage":
        """A storage over cells ``[lo, hi)`` of this one, sharing its arrays (no copy): cell
        ``c`` of the slice is cell ``lo + c`` here. Used for llama.cpp's per-sequence streams,
        where each stream's cache works on its own slice of one allocation."""
        lo, hi = self._check_range(lo, hi)
        if hi <= lo:
            raise ValueError(f"cell_slice needs lo < hi, got [{lo}, {hi})")
        part = object.__new__(KVStorage)
        part.__dict__.update(self.__dict__)
        part.n_cells = hi - lo
        part.keys = self.keys[:, lo:hi]
        part.values = self.values[..., lo:hi] if self.permuted else self.values[:, lo:hi]
        part._bind_layers()
        # its own in-flight bookkeeping (the stream handle itself is shared: use_stream on the
        # parent's owner sets every slice)
        part._pending, part._retired, part._last_mask = [], [], None
        part._mover = part._roper = None      # its own storage views
        return part

    # ---------------------------------------------------------------- basics
    @property
    def nbytes(self) -> int:
        """Bytes of K and V storage."""
        return int(self.keys.nbytes + self.values.nbytes)

    def _on_device(self):
        """Make the storage's GPU and stream current for launches and copies (a no-op on
        cpu/sim)."""
        if self._device_id is None or (self._stream is None and self._single_gpu):
            return _NO_SCOPE
        return _CudaScope(self._device_id, self._stream)

    # ---------------------------------------------------------------- streams (cuda)
    def use_stream(self, stream) -> None:
        """Run every launch and copy of this storage on ``stream`` from now on.

        ``stream``: a CuPy stream (``cupy.cuda.Stream`` / ``ExternalStream``), a torch stream
        (anything with an integer ``cuda_stream``, e.g. ``torch.cuda.current_stream()``), a raw
        ``cudaStream_t`` handle as an int, or None for CuPy's current stream at each call (the
        default). The rules, for callers on other streams:

        - Inputs given to ``put`` are kept referenced until an event recorded on this stream
          after their copy has passed, so an allocator (torch's caching allocator included) can
          not hand their memory out while the kernel may still read it.
        - Masks from :meth:`new_mask` (and whatever a caller passes to :meth:`retire`, e.g. page
          tables) stay referenced until an event recorded at the *next* forward pass has passed:
          attention that read them must be queued on this stream (or ordered before it) by then.
        - Host-to-device inputs travel through pinned, reused buffers (asynchronous copies).
        - While the stream captures a CUDA graph, nothing synchronises or queries events.
        - Outputs are ready in this stream's order. ``get()``, ``layer_pool()``,
          ``page_table()`` and ``get_quantized()`` make CuPy's current stream wait for it (an
          event, :meth:`order_before`), so CuPy work and DLPack exports (which order their
          consumer after CuPy's current stream) read after the puts; ``attend`` makes torch's
          current stream wait. Other consumers call :meth:`order_before` with their stream.
        - Inputs imported through DLPack are imported on this stream (the producer orders it
          after its own work); plain CuPy arrays made on another stream need
          :meth:`order_after` with that stream first.
        """
        if self.device != "cuda":
            if stream is None:
                return
            raise ValueError(f"stream applies to a cuda cache; this one stores on {self.device}")
        self._flush_pending()
        self._stream = _as_cupy_stream(stream, self._device_id)

    @property
    def stream(self):
        """The CuPy stream launches go on (None: CuPy's current stream at each call)."""
        return self._stream

    def order_before(self, consumer=None) -> None:
        """Make ``consumer`` wait for the work queued so far on this storage's stream: an event
        recorded here, waited on there (``cudaStreamWaitEvent``; the host never waits).
        ``consumer``: a stream as :meth:`use_stream` takes it, or None for CuPy's current
        stream. What hands out views of the storage calls it (``get()``, ``layer_pool()``,
        ``page_table()``, ``attend`` for torch's stream), so a consumer on another stream never
        reads K/V before the puts that wrote them. Without a stream of its own the storage's
        work is on CuPy's current stream, which then stands for it. A no-op on cpu/sim, on the
        same stream, and while either stream captures a graph (an event crossing a capture
        boundary is illegal)."""
        self._order_streams(consumer, waits_on_own=True)

    def order_after(self, producer) -> None:
        """Make this storage's stream wait for the work queued so far on ``producer`` (a stream
        as :meth:`use_stream` takes it; None: CuPy's current stream): what an engine whose K/V
        come from another stream as plain CuPy arrays calls before ``put`` (DLPack inputs are
        ordered by the protocol itself: they are imported on this stream). Same no-op cases as
        :meth:`order_before`."""
        self._order_streams(producer, waits_on_own=False)

    def _order_streams(self, other, waits_on_own: bool) -> None:
        """One event between this storage's stream and ``other`` (a stream as :meth:`use_stream`
        takes it; None: CuPy's current stream): recorded on ours and waited on by ``other`` when
        ``waits_on_own`` (:meth:`order_before`), else recorded on ``other`` and waited on by
        ours (:meth:`order_after`). Each direction keeps its own event: a later record does not
        move waits already queued, but the two directions must not share one."""
        if self.device != "cuda":
            return
        import cupy
        from .device import capturing
        current = cupy.cuda.get_current_stream()
        own = self._stream if self._stream is not None else current
        other = current if other is None else _as_cupy_stream(other, self._device_id)
        if other.ptr == own.ptr or capturing(own) or capturing(other):
            return
        attr = "_order_event" if waits_on_own else "_after_event"
        ev = getattr(self, attr)
        if ev is None:
            ev = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
            setattr(self, attr, ev)
        first, then = (own, other) if waits_on_own else (other, own)
        ev.record(first)
        then.wait_event(ev)

    def retire(self, *objects) -> None:
        """Keep ``objects`` (device buffers a launch or a consumer may still read) referenced until
        an event recorded on this storage's stream at the next forward pass has passed. A no-op on
        cpu/sim."""
        if self.device == "cuda":
            self._pending.extend(objects)

    def _flush_pending(self) -> None:
        """Cover the pending objects with one event on the stream and drop every retired group
        whose event has passed. Skipped while the stream is capturing a graph (recording there
        would bind the event to the graph; querying would be an implicit synchronisation)."""
        import cupy
        from .device import capturing
        stream = self._stream if self._stream is not None else cupy.cuda.get_current_stream()
        if capturing(stream):
            return
        retired = self._retired
        while retired and retired[0][0].done:
            retired.pop(0)
        if self._pending:
            ev = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
            ev.record(stream)
            retired.append((ev, self._pending))
            self._pending = []

    def warm_up(self) -> None:
        """Compile, link and load the kernels this storage launches (the put and mask kernels by
        launching them on no data, block moves and the rotary shift for the storage's word
        types), so that the first forward pass does not pay for it. Called by the constructor on
        ``cuda``."""
        from .kernels import _common, launch as _launch_mod
        cfg = self.config
        xp = self.xp
        sdt = self._sdt
        with self._on_device():
            # put: one token with slot -1 writes nothing but runs the kernel of contiguous inputs
            key = xp.zeros((1, cfg.local_kv_heads, cfg.head_dim), dtype=sdt)
            value = xp.zeros((1, cfg.local_kv_heads, cfg.v_head_dim), dtype=sdt)
            self.put(0, np.array([-1], np.int32), key, value)
            # mask: one padding row over one cell
            for mdt in (MASK_DTYPES[self.config.mask_dtype],):
                out = xp.empty((1, 1), dtype=mdt)
                self.fill_mask(out, np.zeros(1, np.int32), np.zeros((1, _SEQ_WORDS), np.uint64),
                               np.zeros(0, np.int32), np.zeros(0, np.int32),
                               np.zeros(0, np.uint8))
            if not _launch_mod.fast_launch_enabled():
                return
            k, v = _move.storage_args("cuda", self.keys, self.values, self.permuted)
            i32 = _common.Desc(0, (1,), (4,), np.dtype(np.int32))
            i64 = _common.Desc(0, (1, 3), (24, 8), np.dtype(np.int64))
            sigs = [(_move.move_cells_kernel, (k, v, i32, i32, 0, 0)),
                    (_move.move_runs_kernel, (k, v, i64, 0, 0, 0)),
                    (_move.move_lanes_kernel, (k, v, i64, 0))]
            view_dtype, _ = _rope.storage_kind("cuda", self.dtype)
            f32 = _common.Desc(0, (1, 1), (4, 4), np.dtype(np.float32))
            kd = _common.desc_of(self.keys, view_dtype)
            sigs.append((_rope.rope_shift_kernel, (kd, i32, i32, i32, f32, f32, 0, 0, 0)))
            for kernel, args in sigs:
                _launch_mod.preload(kernel, [_launch_mod.numba_type(a) for a in args],
                                    self._device_id)
    def _check_layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) \
                or not 0 <= layer < self.config.n_layers:
            raise ValueError(f"layer must be an integer in [0, {self.config.n_layers}), "
                             f"got {layer!r}")
        return int(layer)

    def _check_data(self, x, name: str, shape_tail, batch: Optional[int]):
        """``x`` must be an array of this storage's kind and dtype, ``[batch, *shape_tail]``."""
        if not isinstance(x, self.xp.ndarray):
            kind = "a CuPy array" if self.device == "cuda" else "a numpy array"
            raise ValueError(f"{name} must be {kind} (convert it with device.as_array), "
                             f"got {type(x).__name__}")
        if x.dtype != self.config.storage_dtype:
            raise ValueError(f"{name} must have the storage dtype {self.config.storage_dtype} "
                             f"({self.dtype}), got {x.dtype}")
        if x.ndim != 3 or tuple(x.shape[1:]) != tuple(shape_tail) or \
                (batch is not None and x.shape[0] != batch):
            want = ("batch" if batch is None else str(batch),) + tuple(str(s) for s in shape_tail)
            raise ValueError(f"{name} must have shape [{', '.join(want)}], got {tuple(x.shape)}")

    def _check_kv(self, key, value, batch: Optional[int]) -> int:
        xp_array = self.xp.ndarray
        # fast path (every put pays this): exact types, dtypes and shapes
        if type(key) is xp_array and type(value) is xp_array and key.dtype == self._sdt \
                and value.dtype == self._sdt and key.ndim == 3 and value.ndim == 3 \
                and key.shape[1:] == self._key_shape and value.shape[1:] == self._value_shape \
                and key.shape[0] == value.shape[0] and (batch is None or key.shape[0] == batch):
            return key.shape[0]
        self._check_data(key, "key", self._key_shape, batch)
        self._check_data(value, "value", self._value_shape, key.shape[0])
        return key.shape[0]

    # ---------------------------------------------------------------- put
    def put(self, layer: int, slots, key, value) -> None:
        """Write ``key [batch, n_kv_heads, head_dim]`` and ``value [batch, n_kv_heads,
        v_head_dim]`` (arrays of this storage, storage dtype, possibly strided) into layer
        ``layer`` at ``slots`` (int32 host ``[batch]``; a negative slot skips its token; the
        other slots must be distinct cells)."""
        if type(layer) is not int or not 0 <= layer < self.config.n_layers:
            layer = self._check_layer(layer)
        if not (type(slots) is np.ndarray and slots.dtype == np.int32 and slots.ndim == 1):
            slots = _host_ints(slots, "slots")
        batch = self._check_kv(key, value, None)
        if slots.shape[0] != batch:
            raise ValueError(f"slots must have one entry per token ({batch}), got {slots.shape[0]}")
        if batch == 0:
            return
        problem = _slots_problem(slots, self.n_cells)
        if problem == 1:
            raise ValueError(f"slots must be < n_cells={self.n_cells}, got {int(slots.max())}")
        if problem == 2:
            raise ValueError("slots must not name the same cell twice")
        if self.quantized:
            self._put_quantized(layer, slots, -1, key, value)
            return
        if self.device == "cpu":
            _put.launch_cpu(self._k_layers[layer], self._v_layers[layer], slots, key, value)
            return
        with self._on_device():
            _put.launch(self.device, self._k_layers[layer], self._v_layers[layer], slots, key,
                        value, self.permuted)
            if self.device == "cuda":
                self._keep_inputs(key, value)

    def _keep_inputs(self, key, value) -> None:
        """Hold a put's inputs until the stream has run past it (see :meth:`use_stream`); one
        event covers up to 64 puts, so this costs a list append per put."""
        pending = self._pending
        pending.append(key)
        pending.append(value)
        if len(pending) >= 128:
            self._flush_pending()

    def put_range(self, layer: int, start: int, key, value) -> None:
        """Like :meth:`put` with slots ``start .. start + batch - 1`` (no slot array is built or
        sent)."""
        if type(layer) is not int or not 0 <= layer < self.config.n_layers:
            layer = self._check_layer(layer)
        batch = self._check_kv(key, value, None)
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0 \
                or start + batch > self.n_cells:
            raise ValueError(f"start must be an integer with 0 <= start and start + batch "
                             f"({batch}) <= n_cells={self.n_cells}, got {start!r}")
        if batch == 0:
            return
        if self.quantized:
            self._put_quantized(layer, None, int(start), key, value)
            return
        if self.device == "cpu":
            _put.launch_cpu(self._k_layers[layer], self._v_layers[layer], None, key, value,
                            int(start))
            return
        with self._on_device():
            _put.launch(self.device, self._k_layers[layer], self._v_layers[layer], None, key,
                        value, self.permuted, start=int(start))
            if self.device == "cuda":
                self._keep_inputs(key, value)

    # ---------------------------------------------------------------- trusted fast paths
    def put_range_trusted(self, layer: int, start: int, key, value) -> None:
        """:meth:`put_range` without its checks, for a caller that made them all (CausalCache's
        per-layer hot path): ``key``/``value`` arrays of this storage in the storage dtype and
        shape, ``layer`` and ``start .. start + batch`` in range."""
        if self.quantized:
            self._put_quantized(layer, None, start, key, value)
            return
        if self.device == "cpu":
            _put.launch_cpu(self._k_layers[layer], self._v_layers[layer], None, key, value, start)
            return
        with self._on_device():
            _put.launch(self.device, self._k_layers[layer], self._v_layers[layer], None, key,
                        value, self.permuted, start=start)
            if self.device == "cuda":
                self._keep_inputs(key, value)

    def put_slots_trusted(self, layer: int, slots: np.ndarray, key, value) -> None:
        """:meth:`put` without its checks, for a caller that made them all (CausalCache's
        per-layer hot path under paged placement): ``slots`` int32 host ``[batch]`` of distinct
        cells in range (the cell table placed them), ``key``/``value`` as for
        :meth:`put_range_trusted`."""
        if self.quantized:
            self._put_quantized(layer, slots, -1, key, value)
            return
        if self.device == "cpu":
            _put.launch_cpu(self._k_layers[layer], self._v_layers[layer], slots, key, value)
            return
        with self._on_device():
            _put.launch(self.device, self._k_layers[layer], self._v_layers[layer], slots, key,
                        value, self.permuted)
            if self.device == "cuda":
                self._keep_inputs(key, value)

    def fill_mask_trusted(self, out, cell_pos, cell_seqs, batch_pos, batch_seq, causal,
                          window: int, chunk: int) -> None:
        """:meth:`fill_mask` without its checks (CausalCache's start_forward made them)."""
        if self._device_id is None:
            _mask.launch(self.device, out, cell_pos, cell_seqs, batch_pos, batch_seq, causal,
                         window=window, chunk=chunk)
            return
        with self._on_device():
            _mask.launch(self.device, out, cell_pos, cell_seqs, batch_pos, batch_seq, causal,
                         window=window, chunk=chunk)

    def views_trusted(self, layer: int, lo: int, hi: int):
        """``(key_view, value_view)`` of cells ``lo .. hi-1`` of ``layer`` without the checks of
        :meth:`key_view` / :meth:`value_view` (the caller made them)."""
        if self.permuted:
            return self.keys[layer, lo:hi], self.values[layer, :, :, lo:hi]
        if self.device != "cpu":  # one 1-D slice of the bound layer view (CuPy indexing is slow)
            return self._k_layers[layer][lo:hi], self._v_layers[layer][lo:hi]
        return self.keys[layer, lo:hi], self.values[layer, lo:hi]

    # ---------------------------------------------------------------- views
    def _check_range(self, lo, hi) -> Tuple[int, int]:
        for name, v in (("lo", lo), ("hi", hi)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if not 0 <= lo <= hi <= self.n_cells:
            raise ValueError(f"cell range must satisfy 0 <= lo <= hi <= n_cells={self.n_cells}, "
                             f"got lo={lo}, hi={hi}")
        return int(lo), int(hi)

    def key_view(self, layer: int, lo: int, hi: int):
        """Keys of cells ``lo .. hi-1`` of ``layer``: a view ``[hi-lo, n_kv_heads, head_dim]``
        of the storage (no copy; raw storage dtype)."""
        layer = self._check_layer(layer)
        lo, hi = self._check_range(lo, hi)
        return self.keys[layer, lo:hi]

    def value_view(self, layer: int, lo: int, hi: int):
        """Values of cells ``lo .. hi-1``: a view ``[hi-lo, n_kv_heads, v_head_dim]``, or
        ``[n_kv_heads, v_head_dim, hi-lo]`` when permuted (no copy)."""
        layer = self._check_layer(layer)
        lo, hi = self._check_range(lo, hi)
        if self.permuted:
            return self.values[layer, :, :, lo:hi]
        return self.values[layer, lo:hi]

    # ---------------------------------------------------------------- mask
    def new_mask(self, rows: int, n: int):
        """A fresh device array ``[rows, n]`` of ``config.mask_dtype`` for :meth:`fill_mask`. Not
        reused between calls: a mask handed to a model must stay valid while the model runs, and
        CuPy's memory pool makes a fresh one as cheap as a reused one."""
        for name, v in (("rows", rows), ("n", n)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.device == "cuda":  # the previous mask may still be read by attention
            with self._on_device():
                if self._last_mask is not None:
                    self._pending.append(self._last_mask)
                self._flush_pending()
                mask = self.xp.empty((int(rows), int(n)), dtype=MASK_DTYPES[self.config.mask_dtype])
            self._last_mask = mask
            return mask
        return self.xp.empty((int(rows), int(n)), dtype=MASK_DTYPES[self.config.mask_dtype])

    def fill_mask(self, out, cell_pos, cell_seqs, batch_pos, batch_seq, causal, *,
                  window: int = -1, symmetric: bool = False, chunk: int = 0) -> None:
        """Fill ``out [batch_padded, n]`` (float32/float16 device array) with 0 where batch token
        ``i`` (position ``batch_pos[i]``, sequence ``batch_seq[i]``, causal test on unless
        ``causal[i]`` is False) may attend to cell ``j`` (position ``cell_pos[j]``, sequence set
        ``cell_seqs[j]``: uint64 ``[n, 4]``, bit ``s % 64`` of word ``s // 64``), and ``-inf``
        elsewhere and in rows ``>= len(batch_pos)``. ``window >= 0``: sliding window (Ollama's
        ``window + 1`` positions, or llama.cpp's symmetric ``|p - q| <= window // 2``);
        ``chunk > 0``: chunked attention. See :func:`numbakv.kernels.mask.visible`."""
        if not isinstance(out, self.xp.ndarray) or out.ndim != 2 or \
                out.dtype not in _MASK_NP_DTYPES:
            raise ValueError(f"out must be a 2-d float32/float16 array of this storage's device, "
                             f"got {type(out).__name__} "
                             f"{getattr(out, 'shape', '')} {getattr(out, 'dtype', '')}")
        rows, n = out.shape
        cell_pos = _host_ints(cell_pos, "cell_pos")
        cell_seqs = _host_ints(cell_seqs, "cell_seqs", np.uint64, ndim=2)
        batch_pos = _host_ints(batch_pos, "batch_pos")
        batch_seq = _host_ints(batch_seq, "batch_seq")
        causal = _host_ints(causal, "causal", np.uint8)
        if cell_pos.shape[0] != n:
            raise ValueError(f"cell_pos must have n={n} entries (out's columns), "
                             f"got {cell_pos.shape[0]}")
        if cell_seqs.shape[0] != n or not 1 <= cell_seqs.shape[1] <= _SEQ_WORDS:
            raise ValueError(f"cell_seqs must have shape ({n}, words) with 1 <= words <= "
                             f"{_SEQ_WORDS}, got {cell_seqs.shape}")
        b = batch_pos.shape[0]
        if b > rows:
            raise ValueError(f"the batch ({b} tokens) must fit out's {rows} rows")
        if batch_seq.shape[0] != b or causal.shape[0] != b:
            raise ValueError(f"batch_seq and causal must have {b} entries (batch_pos), got "
                             f"{batch_seq.shape[0]} and {causal.shape[0]}")
        if b and (batch_seq.min() < 0 or batch_seq.max() >= 64 * cell_seqs.shape[1]):
            raise ValueError(f"batch_seq must be in [0, {64 * cell_seqs.shape[1]}), got range "
                             f"[{batch_seq.min()}, {batch_seq.max()}]")
        for name, v, lo in (("window", window, -1), ("chunk", chunk, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        with self._on_device():
            _mask.launch(self.device, out, cell_pos, cell_seqs, batch_pos, batch_seq, causal,
                         window=int(window), symmetric=bool(symmetric), chunk=int(chunk))

    # ---------------------------------------------------------------- moves and copies
    def move_blocks(self, moves) -> None:
        """Apply a defrag plan ``moves`` (int ``[m, 3]``: src, dst, length) to every layer of K
        and V in one launch: in order, each move as a memmove (overlaps are safe)."""
        if not (type(moves) is np.ndarray and moves.dtype == np.int64 and moves.ndim == 2):
            moves = _host_ints(moves, "moves", np.int64, ndim=2) if np.asarray(moves).size \
                else np.zeros((0, 3), dtype=np.int64)
        if moves.shape[1:] != (3,):
            raise ValueError(f"moves must have shape [m, 3] (src, dst, length), got {moves.shape}")
        if moves.shape[0] == 0:
            return
        if self.device != "cpu" and not self.quantized:
            self._move_runs(moves)
            return
        src, dst, ln = moves[:, 0], moves[:, 1], moves[:, 2]
        if ln.min() < 0:
            raise ValueError("moves' lengths must be >= 0")
        if min(src.min(), dst.min()) < 0 or max((src + ln).max(), (dst + ln).max()) > self.n_cells:
            raise ValueError(f"moves must stay inside the {self.n_cells} cells")
        if self.quantized:
            self._move_quantized(moves)
            return
        with self._on_device():
            _move.launch(self.device, self.keys, self.values, moves, self.permuted)

    def _move_runs(self, moves: np.ndarray) -> None:
        """A plan on the GPU (or the simulator) through :class:`kernels.move.RunMover`: checked,
        normalised and sent in one compiled pass over the moves, expanded into cells on the
        device (host time independent of the cells moved)."""
        mover = self._mover
        if mover is None:
            mover = self._mover = _move.RunMover(self.device, self.keys, self.values,
                                                 self.permuted)
        with self._on_device():
            problem = mover.launch(moves)
        if problem == 1:
            raise ValueError("moves' lengths must be >= 0")
        if problem == 2:
            raise ValueError(f"moves must stay inside the {self.n_cells} cells")

    def copy_cells(self, src, dst) -> None:
        """Copy cell ``src[i]`` to cell ``dst[i]`` (int32 host ``[k]`` each) in every layer, K and
        V, in one launch; applied in order, as if one copy after another."""
        src = _host_ints(src, "src")
        dst = _host_ints(dst, "dst")
        if src.shape != dst.shape:
            raise ValueError(f"src and dst must have the same length, got {src.shape[0]} and "
                             f"{dst.shape[0]}")
        if src.size == 0:
            return
        for name, a in (("src", src), ("dst", dst)):
            if a.min() < 0 or a.max() >= self.n_cells:
                raise ValueError(f"{name} cells must be in [0, {self.n_cells})")
        if self.quantized:  # in order, as one-cell moves (what move.copy_launch does)
            self._move_quantized(np.stack([src, dst, np.ones_like(src)], axis=1).astype(np.int64))
            return
        if self.device != "cpu":   # in order, as one-cell moves
            self._move_runs(np.stack([src, dst, np.ones_like(src)], axis=1).astype(np.int64))
            return
        with self._on_device():
            _move.copy_launch(self.device, self.keys, self.values, src, dst, self.permuted)

    # ---------------------------------------------------------------- rotary shift
    def rotate(self, cells, deltas, rope: RopeShift, layers=None) -> None:
        """Re-rotate the keys of ``cells`` (int32 host ``[k]``) by position ``deltas`` (int host
        ``[k]``) with ``rope``'s parameters, in every layer (or ``layers``), in one launch. A
        cell listed twice turns by the sum of its deltas."""
        if not isinstance(rope, RopeShift):
            raise ValueError(f"rope must be a RopeShift, got {type(rope).__name__}")
        memo = self._rope_memo
        if memo[0] is rope:    # a cache shifts with one RopeShift: its tables, once
            inv_freq, dim = memo[1], memo[2]
        else:
            inv_freq = rope.inv_freq(self.config.head_dim)  # checks the rotary dim fits
            dim = check_rope_layout(self.config, rope)
            self._rope_memo = (rope, inv_freq, dim)
        cells = _host_ints(cells, "cells")
        deltas = _host_ints(deltas, "deltas", np.int64)
        if cells.shape != deltas.shape:
            raise ValueError(f"deltas must have one entry per cell ({cells.shape[0]}), "
                             f"got {deltas.shape[0]}")
        if cells.size and not _all_in(cells, 0, self.n_cells):
            raise ValueError(f"cells must be in [0, {self.n_cells})")
        if layers is not None:
            layers = _host_ints(layers, "layers")
            if layers.size and (layers.min() < 0 or layers.max() >= self.config.n_layers):
                raise ValueError(f"layers must be in [0, {self.config.n_layers})")
            if np.unique(layers).size != layers.size:
                raise ValueError("layers must not repeat")
        if cells.size == 0:
            return
        if not self.k_quantized and self.device != "cpu":
            launcher = self._roper
            if launcher is None:
                launcher = self._roper = _rope.RopeLauncher(self.device, self.keys, self.dtype)
            with self._on_device():
                launcher.launch(cells, deltas, inv_freq, rope.neox, layers, rope.offset)
            return
        if not self.k_quantized:   # the kernel indexes the rope dims of the contiguous rows
            with self._on_device():
                _rope.launch(self.device, self.keys, self.dtype, cells, deltas, inv_freq,
                             rope.neox, layers, col=rope.offset)
            return
        if self._k_ds_mla:   # FlashMLA's row: the bfloat16 rope values turn in place
            with self._on_device():
                _rope.launch(self.device, self.keys.view(np.uint16), "bfloat16", cells, deltas,
                             inv_freq, rope.neox, layers, col=_mla.ROPE_AT // 2)
            return
        if self.k_quantized:
            dim = self.rope_keys(rope)[1]   # values a row the kernel turns (pairs: the rope's)
            if dim > _quant.MAX_ROTATE_DIM:
                raise ValueError(f"the rotary shift on quantized keys takes head_dim <= "
                                 f"{_quant.MAX_ROTATE_DIM}, got {dim}")
            # the whole storage and the byte where the rotated blocks start (an MLA latent's
            # rope blocks; check_rope_layout made sure they are whole blocks)
            per_block, block_bytes = QUANT_TYPES[self.config.k_dtype]
            col = rope.offset // per_block * block_bytes
            with self._on_device():   # rotated keys: whole blocks, turned back around the RoPE
                _quant.rope_launch(self.device, self.keys, dim, cells, deltas, inv_freq,
                                   rope.neox, self._k_fmt, self._k_scales, layers,
                                   self.config.k_rotation, col=col)
            return

    def rope_keys(self, rope: RopeShift) -> Tuple[Any, int]:
        """``(keys, dim)``: the part of the key storage a shift by ``rope`` rewrites, as a strided
        view ``[n_layers, n_cells, n_kv_heads, row]`` of the storage (no copy), and the values
        per row in it. The whole row unless ``rope.offset`` is set; with an offset (an MLA
        latent's trailing rope dims) only the dims ``offset .. offset + rotary_dim`` -- for
        quantized keys the blocks holding them, which must not hold other dims. The rotary kernels
        run on the view as on a whole row, so their element math serves both."""
        dim = check_rope_layout(self.config, rope)
        if rope.offset == 0:
            return self.keys, self.config.head_dim
        lo, hi = rope.offset, rope.offset + dim
        if self.k_quantized:   # whole blocks (check_rope_layout made sure)
            per_block, block_bytes = QUANT_TYPES[self.config.k_dtype]
            return (self.keys[..., lo // per_block * block_bytes:hi // per_block * block_bytes],
                    dim)
        return self.keys[..., lo:hi], dim

    # ---------------------------------------------------------------- quantized K/V
    def _init_quantized(self) -> None:
        """Formats, per-layer scales (on the device) and the lazily allocated dequantize
        scratch of a cache with a quantized side."""
        cfg = self.config
        self._k_fmt = _quant.FORMATS.get(cfg.k_dtype, 0)
        #: FlashMLA's fp8_ds_mla latent rows (kernels/mla.py) rather than a ggml/float8 format
        self._k_ds_mla = cfg.k_dtype == "fp8_ds_mla"
        self._v_fmt = _quant.FORMATS.get(cfg.v_dtype, 0)
        self._k_scales = self.xp.asarray(cfg.layer_scales("k"))
        self._v_scales = self.xp.asarray(cfg.layer_scales("v"))
        #: ``[n_cells, n_kv_heads, dim]`` in ``dtype``, reused by every dequantizing get()
        self._k_scratch = None
        self._v_scratch = None

    def _put_quantized(self, layer: int, slots, start: int, key, value) -> None:
        """put/put_range for a cache with a quantized side (inputs checked): the quantized
        side through the quantize kernel, a float side by a plain array copy."""
        with self._on_device():
            for quantized, fmt, scales, store, x, rot in (
                    (self.k_quantized, self._k_fmt, self._k_scales, self.keys, key,
                     self.config.k_rotation),
                    (self.v_quantized, self._v_fmt, self._v_scales, self.values, value,
                     self.config.v_rotation)):
                if quantized and store is self.keys and self._k_ds_mla:
                    _mla.put_launch(self.device, store, layer, x, slots, start, self.dtype)
                    continue
                if quantized:
                    _quant.put_launch(self.device, store, layer, x, slots, start, fmt, scales,
                                      self.dtype, rot)
                    continue
                if slots is None:
                    idx, rows = slice(start, start + x.shape[0]), x
                else:
                    keep = slots >= 0
                    idx = self.xp.asarray(slots[keep].astype(np.int64))
                    rows = x if keep.all() else x[self.xp.asarray(np.flatnonzero(keep))]
                if store is self.values and self.permuted:
                    store[layer][:, :, idx] = rows.transpose(1, 2, 0)
                else:
                    store[layer][idx] = rows

    def dequantized_views(self, layer: int, lo: int, hi: int):
        """``(key, value)`` of cells ``lo .. hi-1`` of ``layer`` in the cache's ``dtype`` (raw
        storage dtype, as :meth:`key_view`): a quantized side is dequantized into this storage's
        scratch, which the next call overwrites; a float side is a view of the storage."""
        layer = self._check_layer(layer)
        lo, hi = self._check_range(lo, hi)
        cfg = self.config
        out = []
        with self._on_device():
            for quantized, which, dim in ((self.k_quantized, "k", cfg.head_dim),
                                          (self.v_quantized, "v", cfg.v_head_dim)):
                if not quantized:
                    out.append(self.key_view(layer, lo, hi) if which == "k"
                               else self.value_view(layer, lo, hi))
                    continue
                name = f"_{which}_scratch"
                scratch = getattr(self, name)
                if scratch is None:
                    zeros = self.xp.zeros if self.device == "cuda" else _host_zeros
                    scratch = zeros((self.n_cells, cfg.local_kv_heads, dim), dtype=self._sdt)
                    setattr(self, name, scratch)
                view = scratch[:hi - lo]
                if which == "k" and self._k_ds_mla:
                    _mla.get_launch(self.device, self.keys, layer, lo, view, self.dtype)
                    out.append(view)
                    continue
                _quant.get_launch(self.device, self.keys if which == "k" else self.values,
                                  layer, lo, view, getattr(self, f"_{which}_fmt"),
                                  getattr(self, f"_{which}_scales"), self.dtype)
                out.append(view)
        return out[0], out[1]

    def quantized_views(self, layer: int, lo: int, hi: int):
        """Raw rows ``(key, value)`` of cells ``lo .. hi-1``: uint8 ``[hi-lo, n_kv_heads,
        row_bytes]`` views for a quantized side (ggml block layout); a float side is viewed as
        its bytes, ``[hi-lo, n_kv_heads, dim * itemsize]`` (not when stored permuted)."""
        layer = self._check_layer(layer)
        lo, hi = self._check_range(lo, hi)
        k = self.keys[layer, lo:hi]
        if self.permuted:
            raise ValueError("get_quantized() needs V in the row layout (permuted_v=False)")
        v = self.values[layer, lo:hi]
        return k if self.k_quantized else k.view(np.uint8), \
            v if self.v_quantized else v.view(np.uint8)

    def _move_quantized(self, moves: np.ndarray) -> None:
        """A move plan (validated) on a cache with a quantized side: each array on its raw bytes,
        in order (K, then V: the arrays are independent)."""
        with self._on_device():
            _quant.move_launch(self.device, self.keys, moves)
            _quant.move_launch(self.device, self.values, moves, 3 if self.permuted else 1)

    # ---------------------------------------------------------------- state
    def _check_cells(self, cells, name: str = "cells", distinct: bool = False) -> np.ndarray:
        cells = _host_ints(cells, name)
        if cells.size and (cells.min() < 0 or cells.max() >= self.n_cells):
            raise ValueError(f"{name} must be in [0, {self.n_cells})")
        if distinct and np.unique(cells).size != cells.size:
            raise ValueError(f"{name} must not repeat")
        return cells

    def _to_host(self, x) -> np.ndarray:
        if self.device == "cuda":
            with self._on_device():  # in this stream's order (get() waits for it)
                count_host_wait(copy=True)
                return x.get()
        return np.array(x, copy=True)

    def read_cells(self, cells) -> Tuple[np.ndarray, np.ndarray]:
        """Host copies ``(K [n_layers, k, n_kv_heads, head_dim], V [n_layers, k, n_kv_heads,
        v_head_dim])`` of ``cells``, in the storage dtype (V in the standard layout whatever the
        storage's)."""
        cells = self._check_cells(cells)
        with self._on_device():
            idx = self.xp.asarray(cells.astype(np.int64))
            k = self.keys.take(idx, axis=1)
            if self.permuted:
                v = self.values.take(idx, axis=3).transpose(0, 3, 1, 2)
            else:
                v = self.values.take(idx, axis=1)
        return (np.ascontiguousarray(self._to_host(k)), np.ascontiguousarray(self._to_host(v)))

    def write_cells(self, cells, k, v) -> None:
        """Inverse of :meth:`read_cells`: host ``k [n_layers, len(cells), n_kv_heads, head_dim]``
        and ``v [n_layers, len(cells), n_kv_heads, v_head_dim]`` in the storage dtype."""
        cells = self._check_cells(cells, distinct=True)
        cfg = self.config
        n = cells.shape[0]
        v_row = self.values.shape[2] if self.permuted else self.values.shape[3]
        for name, x, d, dt in (("k", k, self.keys.shape[3], self.keys.dtype),
                               ("v", v, v_row, self.values.dtype)):
            if not isinstance(x, np.ndarray):
                raise ValueError(f"{name} must be a host numpy array, got {type(x).__name__}")
            want = (cfg.n_layers, n, cfg.local_kv_heads, d)
            if x.shape != want:
                raise ValueError(f"{name} must have shape {want}, got {x.shape}")
            if x.dtype != dt:
                raise ValueError(f"{name} must have the storage dtype {dt} "
                                 f"({self.dtype}), got {x.dtype}")
        if n == 0:
            return
        with self._on_device():
            xp = self.xp
            idx = xp.asarray(cells.astype(np.int64))
            self.keys[:, idx] = xp.asarray(k)
            if self.permuted:
                vt = np.ascontiguousarray(v.transpose(0, 2, 3, 1))
                self.values[:, :, :, idx] = xp.asarray(vt)
            else:
                self.values[:, idx] = xp.asarray(v)


__all__ = ["KVStorage"]
