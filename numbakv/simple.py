"""Single-stream caches of Ollama's MLX runner: a growing cache and a sliding-window ring.

Both hold one stream of K/V tensors in the MLX / Hugging Face layout
``[batch, n_kv_heads, L, head_dim]`` (values may have another head_dim than keys), on any
device: numpy arrays on ``cpu`` and ``sim`` (copying slices is the whole job, so there is no
kernel to simulate and ``sim`` behaves exactly like ``cpu``), CuPy arrays on ``cuda``.

Inputs may be numpy, CuPy, torch, JAX or any DLPack tensor, contiguous or strided, on the
cache's device (the cache never moves data between devices). The dtype is fixed by the first
update (or the ``dtype=`` argument): float16, float32 or bfloat16. bfloat16 comes in as a
framework bfloat16 tensor, a :class:`~numbakv._dlpack.BFloat16View` or a uint16 array of bit
patterns; it is stored as uint16 and handed out as ``BFloat16View`` (``torch.from_dlpack`` gives
``torch.bfloat16``). float16 / float32 come back as plain numpy / CuPy views.

Everything returned is a view of the cache's storage, valid until the next call that changes
the cache (a later update may overwrite or reallocate it): copy it to keep it.

Every public call validates its arguments before it changes anything; bad input raises
``ValueError`` naming the argument, and leaves the cache as it was. Storage growth of 1 MiB or
more is checked against the memory left first. A cache is for one thread at a time: a second
thread calling in while another is inside raises ``ConcurrentUseError``.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._guard import one_thread_at_a_time
from ._memory import check_memory
from .config import STORAGE_DTYPES, normalize_dtype, round_up
from .device import (array_module, as_array, count_host_wait, dtype_name, export_view,
                     input_device, resolve_device)
from .state.registry import register_simple_class as _register_simple_class

__all__ = ["StepCache", "RotatingCache"]

#: allocations of at least this many bytes are checked against the memory left first
_CHECKED_ALLOC = 1 << 20


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _infer_dtype(x: Any, name: str) -> str:
    """The storage dtype a first update fixes: its own dtype, uint16 read as bfloat16 bits."""
    got = dtype_name(x)
    if got == "uint16":
        return "bfloat16"
    try:
        return normalize_dtype(got, name)
    except ValueError:
        raise ValueError(f"{name} must have dtype float16, float32 or bfloat16 (or uint16 "
                         f"bfloat16 bit patterns), got {got}") from None


def _state_array(x: Any, device: str, dtype: str, name: str):
    """A saved array on ``device`` (the only place the caches move data between host and GPU:
    ``from_state`` copies anyway)."""
    target = "cuda" if device == "cuda" else "cpu"
    try:
        where = input_device(x)
    except BufferError as exc:  # a raw DLPack capsule already consumed
        raise ValueError(f"{name} could not be imported through DLPack: {exc}") from exc
    if where == target:
        return as_array(x, device, dtype, name=name)
    if target == "cuda" and where == "cpu":
        import cupy
        return cupy.asarray(as_array(x, "cpu", dtype, name=name))
    if target == "cpu" and where == "cuda":
        count_host_wait(copy=True)
        return as_array(x, "cuda", dtype, name=name).get()
    raise ValueError(f"{name} lives on {where}, which the cache cannot read")


class _SingleStreamCache:
    """Shared validation, storage and state for :class:`StepCache` and :class:`RotatingCache`.

    Storage is two backing arrays ``[batch, n_kv_heads, capacity, head_dim]`` (K) and
    ``[batch, n_kv_heads, capacity, v_head_dim]`` (V); slots ``[0, n_stored)`` hold tokens.
    """

    kind = "base"

    def __init__(self, step: int, device: str, dtype: Optional[Any]) -> None:
        self._step = _check_int("step", step, 1)
        self._device = resolve_device(device)
        self._xp = array_module(self._device)
        self._fixed_dtype = None if dtype is None else normalize_dtype(dtype, "dtype")
        self._reset()

    def _reset(self) -> None:
        self._dtype: Optional[str] = self._fixed_dtype
        self._k = None
        self._v = None
        self._geom: Optional[Tuple[int, int, int, int]] = None  # (B, H, Dk, Dv)
        self._n = 0          # tokens stored (slots [0, _n))
        self._offset = 0     # tokens seen (logical length of the stream)

    # ---------------------------------------------------------------- properties
    @property
    def offset(self) -> int:
        """How many tokens the stream holds logically (the position of the next token)."""
        return self._offset

    @property
    def dtype(self) -> Optional[str]:
        """``float16``, ``float32`` or ``bfloat16``; ``None`` until the first update fixes it."""
        return self._dtype

    @property
    def device(self) -> str:
        return self._device

    @property
    def step(self) -> int:
        return self._step

    @property
    def capacity(self) -> int:
        """Token slots allocated (0 before the first update and after ``free()``)."""
        return 0 if self._k is None else int(self._k.shape[2])

    @property
    def nbytes(self) -> int:
        return 0 if self._k is None else int(self._k.nbytes + self._v.nbytes)

    # ---------------------------------------------------------------- helpers
    def _check_update(self, keys: Any, values: Any):
        """Validated ``(k, v)`` arrays of the storage type; nothing is changed here."""
        dtype = self._dtype or _infer_dtype(keys, "keys")
        k = as_array(keys, self._device, dtype, name="keys")
        v = as_array(values, self._device, dtype, name="values")
        for arr, name, last in ((k, "keys", "head_dim"), (v, "values", "v_head_dim")):
            if arr.ndim != 4:
                raise ValueError(f"{name} must be 4-D [batch, n_kv_heads, L, {last}], got shape "
                                 f"{tuple(arr.shape)}")
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"keys and values must agree on batch, n_kv_heads and L: keys "
                             f"{tuple(k.shape)}, values {tuple(v.shape)}")
        if k.shape[2] < 1:
            raise ValueError(f"keys must hold at least one token (L = dim 2 >= 1), got shape "
                             f"{tuple(k.shape)}")
        geom = (int(k.shape[0]), int(k.shape[1]), int(k.shape[3]), int(v.shape[3]))
        if min(geom) < 1:
            raise ValueError(f"keys and values must have non-empty batch, n_kv_heads and "
                             f"head_dim: keys {tuple(k.shape)}, values {tuple(v.shape)}")
        if self._geom is not None and geom != self._geom:
            b, h, dk, dv = self._geom
            raise ValueError(f"keys/values shape changed: this cache holds batch={b}, "
                             f"n_kv_heads={h}, head_dim={dk}, v_head_dim={dv}; got keys "
                             f"{tuple(k.shape)}, values {tuple(v.shape)}")
        return k, v, dtype, geom

    def _alloc(self, geom, cap: int, dtype: str):
        b, h, dk, dv = geom
        sd = STORAGE_DTYPES[dtype]
        nbytes = b * h * cap * (dk + dv) * sd.itemsize
        if nbytes >= _CHECKED_ALLOC:  # small growth steps cannot matter; skip reading /proc
            check_memory(f"{type(self).__name__} storage for {cap} tokens", self._device,
                         {"K/V storage": nbytes}, hint="lower step or max_size")
        # Slots past the stored tokens are never handed out, so they need no zeroing.
        return (self._xp.empty((b, h, cap, dk), dtype=sd),
                self._xp.empty((b, h, cap, dv), dtype=sd))

    def _views(self, n: int):
        k = export_view(self._k[:, :, :n], self._dtype)
        v = export_view(self._v[:, :, :n], self._dtype)
        return k, v

    def _check_trim(self, n: Any) -> int:
        """``n`` clamped to the tokens held, as the seed's ``Trim`` does (``min(offset, n)``)."""
        return min(_check_int("n", n, 0), self._offset)

    def _meta(self) -> Dict[str, Any]:
        return {"kind": self.kind, "step": self._step, "dtype": self._dtype}

    def state(self) -> Tuple[Any, Any]:
        """``(keys, values)``: views of the stored tokens, ``[batch, n_kv_heads, n, head_dim]`` /
        ``[..., v_head_dim]``, as :meth:`update` would export them, or ``(None, None)`` when
        empty -- the seed's ``State()`` (Ollama's MLX runner) and mlx-lm's ``state``, so code
        ported from either (``keys, values = c.state()``) works. The views are live storage:
        save or copy them before the cache changes again. :meth:`meta_state` gives the rest."""
        if self._k is None or self._n == 0:
            return None, None
        return self._views(self._n)

    def meta_state(self) -> Dict[str, Any]:
        """The plain ints and strings :meth:`from_state` needs besides :meth:`state`'s arrays to
        rebuild this cache exactly: ``kind``, ``step``, ``dtype`` (None until fixed),
        ``offset``, and for a :class:`RotatingCache` ``max_size`` and the ring index ``idx``."""
        meta = self._meta()
        meta["offset"] = self._offset
        return meta

    @staticmethod
    def _parse_state(state: Any, meta_state: Any, kind: str):
        """``(keys, values, meta, offset)`` from ``from_state``'s arguments: ``(keys, values)``
        with :meth:`meta_state`'s dict, or (numbakv before round 3) one dict ``{"keys",
        "values", "offset", "meta"}``."""
        if meta_state is None and isinstance(state, dict):     # the round-2 form
            missing = [key for key in ("keys", "values", "offset", "meta") if key not in state]
            if missing:
                raise ValueError(f"state is missing {missing}")
            meta = state["meta"]
            if isinstance(meta, dict):
                meta = {**meta, "offset": state["offset"]}
            keys, values = state["keys"], state["values"]
        else:
            if not isinstance(state, (tuple, list)) or len(state) != 2:
                raise ValueError(f"state must be the (keys, values) pair {kind}.state() returns "
                                 f"(given with meta_state), got {type(state).__name__}")
            if meta_state is None:
                raise ValueError(f"meta_state must be the dict {kind}.meta_state() returns, "
                                 "got None")
            keys, values = state
            meta = meta_state
        if not isinstance(meta, dict) or meta.get("kind") != kind:
            got = meta.get("kind") if isinstance(meta, dict) else meta
            raise ValueError(f"meta_state['kind'] must be {kind!r}, got {got!r}")
        if "offset" not in meta:
            raise ValueError("meta_state is missing 'offset'")
        offset = _check_int("meta_state['offset']", meta["offset"], 0)
        return keys, values, meta, offset

    def _load_arrays(self, keys: Any, values: Any, offset: int) -> int:
        """Copies the saved tokens into fresh storage; returns how many there are."""
        if (keys is None) != (values is None):
            raise ValueError("state's keys and values must both be arrays or both None")
        if keys is None:
            return 0
        if self._dtype is None:
            raise ValueError("meta_state['dtype'] must be set when the state holds tokens")
        k = _state_array(keys, self._device, self._dtype, "state's keys")
        v = _state_array(values, self._device, self._dtype, "state's values")
        if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3] or k.shape[2] < 1 \
                or min(k.shape[:2] + k.shape[3:] + v.shape[3:]) < 1:
            raise ValueError(f"state's keys / values must be non-empty [batch, n_kv_heads, n, "
                             f"head_dim] arrays agreeing on the first three dims, got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        n = int(k.shape[2])
        if n > offset:
            raise ValueError(f"state holds {n} tokens but meta_state['offset'] is only {offset}")
        geom = (int(k.shape[0]), int(k.shape[1]), int(k.shape[3]), int(v.shape[3]))
        self._geom = geom
        self._k, self._v = self._alloc(geom, round_up(n, self._step), self._dtype)
        self._k[:, :, :n] = k
        self._v[:, :, :n] = v
        self._n = n
        return n

    def _copy_into(self, other: "_SingleStreamCache") -> None:
        other._dtype, other._geom = self._dtype, self._geom
        other._n, other._offset = self._n, self._offset
        if self._k is not None:
            other._k, other._v = self._alloc(self._geom, self.capacity, self._dtype)
            other._k[:, :, :self._n] = self._k[:, :, :self._n]
            other._v[:, :, :self._n] = self._v[:, :, :self._n]

    def save_state(self, path: "os.PathLike[str] | str", *, tokens: Optional[Sequence[int]] = None,
                   metadata: Optional[Mapping[str, str]] = None) -> None:
        """Save this cache to a safetensors file, atomically (``numbakv.state``)."""
        from . import state
        state.save_simple(self, path, tokens=tokens, metadata=metadata)

    def state_bytes(self, *, tokens: Optional[Sequence[int]] = None,
                    metadata: Optional[Mapping[str, str]] = None) -> bytes:
        """What :meth:`save_state` writes, as bytes."""
        from . import state
        return state.simple_to_bytes(self, tokens=tokens, metadata=metadata)

    @classmethod
    def load_state(cls, source, *, device: str = "auto"):
        """A new cache of this class from a :meth:`save_state` file path or its bytes."""
        from . import state
        cache = state.load_simple(source, device=device)
        if not isinstance(cache, cls):
            from .errors import StateError
            raise StateError(f"the saved state holds a {type(cache).__name__}, not a "
                             f"{cls.__name__}")
        return cache

    def free(self) -> None:
        """Release the storage. The cache then behaves as a new, empty one: offset 0, and the
        shape (and the dtype, unless given to the constructor) are fixed again by the next
        update."""
        self._reset()

    def __repr__(self) -> str:
        geom = "empty" if self._geom is None else \
            "batch={}, n_kv_heads={}, head_dim={}, v_head_dim={}".format(*self._geom)
        return (f"{type(self).__name__}(offset={self._offset}, len={len(self)}, "
                f"dtype={self._dtype}, device={self._device!r}, {geom})")


@one_thread_at_a_time
class StepCache(_SingleStreamCache):
    """A growing cache for one stream of ``[batch, n_kv_heads, L, head_dim]`` K/V tensors
    (Ollama MLX runner's ``KVCache``). Storage grows to the next multiple of ``step`` tokens.

    ``update(keys, values)`` appends ``L`` tokens and returns views of all ``offset`` tokens,
    ``[batch, n_kv_heads, offset, head_dim]`` / ``[..., v_head_dim]``.
    """

    kind = "StepCache"

    def __init__(self, step: int = 256, *, device: str = "auto", dtype: Optional[Any] = None) -> None:
        super().__init__(step, device, dtype)

    def __len__(self) -> int:
        return self._offset

    @property
    def trimmable(self) -> int:
        """How many tokens :meth:`trim` can remove now (all of them)."""
        return self._offset

    def update(self, keys: Any, values: Any) -> Tuple[Any, Any]:
        """Append ``keys`` ``[batch, n_kv_heads, L, head_dim]`` and ``values``
        ``[batch, n_kv_heads, L, v_head_dim]``; return ``(keys, values)`` views of everything
        stored, ``[batch, n_kv_heads, offset, ...]``."""
        k, v, dtype, geom = self._check_update(keys, values)
        prev, L = self._offset, int(k.shape[2])
        need = prev + L
        if self._k is None or need > self.capacity:
            nk, nv = self._alloc(geom, round_up(need, self._step), dtype)
            if self._k is not None and prev:
                nk[:, :, :prev] = self._k[:, :, :prev]
                nv[:, :, :prev] = self._v[:, :, :prev]
            self._k, self._v = nk, nv
        self._dtype, self._geom = dtype, geom
        self._k[:, :, prev:need] = k
        self._v[:, :, prev:need] = v
        self._n = self._offset = need
        return self._views(need)

    def trim(self, n: int) -> int:
        """Drop the newest ``min(n, offset)`` tokens (the seed's ``Trim``) and return how many
        were dropped; ``n`` must be an integer >= 0. Storage is kept for the tokens that
        follow."""
        n = self._check_trim(n)
        self._offset -= n
        self._n = self._offset
        return n

    def clone(self) -> "StepCache":
        """An independent copy (its own storage) on the same device."""
        other = StepCache(self._step, device=self._device, dtype=self._fixed_dtype)
        self._copy_into(other)
        return other

    @classmethod
    def from_state(cls, state: Any, meta_state: Optional[Dict[str, Any]] = None, *,
                   device: str = "auto") -> "StepCache":
        """A new cache holding a copy of ``state`` (``(keys, values)`` from :meth:`state`) as
        ``meta_state`` (from :meth:`meta_state`) describes it, on ``device`` (which may differ
        from the one the state came from). The round-2 form, one dict ``{"keys", "values",
        "offset", "meta"}`` and no ``meta_state``, is still read."""
        keys, values, meta, offset = cls._parse_state(state, meta_state, cls.kind)
        cache = cls(meta.get("step", 256), device=device, dtype=meta.get("dtype"))
        n = cache._load_arrays(keys, values, offset)
        if n != offset:
            raise ValueError(f"meta_state['offset'] is {offset} but the state holds {n} tokens")
        cache._offset = offset
        return cache


@one_thread_at_a_time
class RotatingCache(_SingleStreamCache):
    """A sliding-window cache bounded by ``max_size`` tokens (Ollama MLX runner's and mlx-lm's
    ``RotatingKVCache``): every token attends to at most ``max_size`` tokens, itself included.

    * A one-token update (decode) writes in place into a ring buffer of ``max_size`` slots once
      the ring is full, overwriting the oldest token, and returns the whole ring
      ``[batch, n_kv_heads, min(offset, max_size), head_dim]`` **in ring order, not temporal
      order**: the newest token is not necessarily last. That is fine for decode attention
      (RoPE is already in the keys and a single query needs no causal mask), as in Ollama/MLX.
    * A multi-token update (prefill, chunks) returns, in temporal order, the last
      ``min(stored, max_size - 1)`` tokens of history followed by the ``L`` new ones, so each new
      token can see a full window (the caller's sliding-window causal mask does the rest), and
      keeps them all; the next decode drops the surplus. Unlike the seed's ``concat``, the ring
      is put back in temporal order first, so no token of the window is lost after a wrap.
    * ``len(cache) == min(offset, max_size)``.
    * ``trim(n)`` removes the newest ``n`` tokens, correctly after a wrap too (the ring is put in
      temporal order first). Once the window has evicted tokens, only ``trimmable`` tokens can be
      removed (``stored - (max_size - 1)``, e.g. the rejected draft tokens of a multi-token
      update): trimming more would leave the next token without history that is already gone,
      so it raises ``ValueError`` instead of returning a short or wrong window (mlx-lm #1437).
    """

    kind = "RotatingCache"

    def __init__(self, max_size: int, step: int = 256, *, device: str = "auto",
                 dtype: Optional[Any] = None) -> None:
        self._max = _check_int("max_size", max_size, 1)
        super().__init__(step, device, dtype)

    def _reset(self) -> None:
        super()._reset()
        self._start = 0  # slot of the oldest stored token; nonzero only when the ring is full

    @property
    def max_size(self) -> int:
        """Tokens each token attends to at most, itself included (the ring's size)."""
        return self._max

    def __len__(self) -> int:
        return min(self._offset, self._max)

    @property
    def trimmable(self) -> int:
        """How many tokens :meth:`trim` can remove now: all while nothing was evicted, else the
        stored tokens beyond the ``max_size - 1`` the next token's window needs."""
        if self._n == self._offset:
            return self._offset
        return max(0, self._n - (self._max - 1))

    # ring helpers ------------------------------------------------------------------------
    def _copy_temporal(self, dst_k, dst_v, lo: int, hi: int, at: int) -> None:
        """Copy stored tokens ``[lo, hi)`` in temporal order (0 = oldest stored) into
        ``dst[:, :, at:at + hi - lo]``."""
        count = hi - lo
        if count <= 0:
            return
        n = self._n
        p0 = (self._start + lo) % n
        first = min(count, n - p0)
        dst_k[:, :, at:at + first] = self._k[:, :, p0:p0 + first]
        dst_v[:, :, at:at + first] = self._v[:, :, p0:p0 + first]
        rest = count - first
        if rest:
            dst_k[:, :, at + first:at + count] = self._k[:, :, :rest]
            dst_v[:, :, at + first:at + count] = self._v[:, :, :rest]

    def _shift_front(self, drop: int) -> None:
        """Drop the ``drop`` oldest tokens of a ring in temporal order (``_start == 0``) by
        moving the rest to the front of the same storage."""
        n = self._n
        src_k, src_v = self._k[:, :, drop:n], self._v[:, :, drop:n]
        if self._xp is not np:  # numpy handles overlapping copies itself; be explicit elsewhere
            src_k, src_v = src_k.copy(), src_v.copy()
        self._k[:, :, :n - drop] = src_k
        self._v[:, :, :n - drop] = src_v
        self._n = n - drop

    # public ------------------------------------------------------------------------------
    def update(self, keys: Any, values: Any) -> Tuple[Any, Any]:
        """Add ``keys`` ``[batch, n_kv_heads, L, head_dim]`` and ``values``
        ``[batch, n_kv_heads, L, v_head_dim]``; returns ``(keys, values)`` views: for ``L == 1``
        the ring (``min(offset, max_size)`` tokens, ring order), for ``L > 1`` the history the new
        tokens need plus the new tokens (temporal order). See the class docstring."""
        k, v, dtype, geom = self._check_update(keys, values)
        if k.shape[2] > 1:
            return self._concat(k, v, dtype, geom)
        return self._decode(k, v, dtype, geom)

    def _decode(self, k, v, dtype: str, geom):
        M = self._max
        n = self._n
        if n < M and (self._k is None or self.capacity < n + 1):
            # grow by `step` slots, never past max_size (the ring's size)
            nk, nv = self._alloc(geom, min(round_up(n + 1, self._step), M), dtype)
            if n:
                nk[:, :, :n] = self._k[:, :, :n]
                nv[:, :, :n] = self._v[:, :, :n]
            self._k, self._v = nk, nv
        self._dtype, self._geom = dtype, geom
        if n > M:
            # after a multi-token update (temporal order): keep the newest M-1, then write
            self._shift_front(n - M)
            n = M
        if n < M:  # not full: the ring is in temporal order (_start == 0), append
            slot = n
            self._n = n + 1
        else:      # full: overwrite the oldest
            slot = self._start
            self._start = (self._start + 1) % M
        self._k[:, :, slot:slot + 1] = k
        self._v[:, :, slot:slot + 1] = v
        self._offset += 1
        return self._views(self._n)

    def _concat(self, k, v, dtype: str, geom):
        L = int(k.shape[2])
        n = self._n
        h = min(n, self._max - 1)  # history each new token's window needs
        new_n = h + L
        if self._k is not None and self._start == 0 and h == n and self.capacity >= new_n:
            nk, nv = self._k, self._v  # append in place
        else:
            nk, nv = self._alloc(geom, round_up(new_n, self._step), dtype)
            if h:
                self._copy_temporal(nk, nv, n - h, n, 0)
        nk[:, :, h:new_n] = k
        nv[:, :, h:new_n] = v
        self._k, self._v, self._dtype, self._geom = nk, nv, dtype, geom
        self._n, self._start = new_n, 0
        self._offset += L
        return self._views(new_n)

    def _to_temporal(self) -> None:
        if self._start == 0:
            return
        nk, nv = self._alloc(self._geom, self.capacity, self._dtype)
        self._copy_temporal(nk, nv, 0, self._n, 0)
        self._k, self._v, self._start = nk, nv, 0

    def trim(self, n: int) -> int:
        """Drop the newest ``min(n, trimmable)`` tokens and return how many were dropped
        (``n`` must be an integer >= 0). The seed's ``Trim`` clamps to ``offset``; before the
        window has evicted anything :attr:`trimmable` is ``offset``, after it the clamp also
        keeps the ``max_size - 1`` tokens of history the next token needs (the seed would drop
        them and leave the next window short)."""
        n = min(self._check_trim(n), self.trimmable)
        if n == 0:
            return 0
        self._to_temporal()
        self._n -= n
        self._offset -= n
        return n

    def clone(self) -> "RotatingCache":
        """An independent copy (its own storage) on the same device."""
        other = RotatingCache(self._max, self._step, device=self._device, dtype=self._fixed_dtype)
        self._copy_into(other)
        other._start = self._start
        return other

    def _meta(self) -> Dict[str, Any]:
        meta = super()._meta()
        # `idx` as in mlx-lm: the slot the next token goes to before any wrap (the oldest token's
        # slot once the ring has rotated, else the number of stored tokens).
        meta.update(max_size=self._max, idx=self._start if self._start else self._n)
        return meta

    @classmethod
    def from_state(cls, state: Any, meta_state: Optional[Dict[str, Any]] = None, *,
                   device: str = "auto") -> "RotatingCache":
        """A new cache holding a copy of ``state`` (``(keys, values)`` from :meth:`state`, in
        ring order) as ``meta_state`` describes it (ring index included), on ``device``. The
        round-2 form, one dict and no ``meta_state``, is still read."""
        keys, values, meta, offset = cls._parse_state(state, meta_state, cls.kind)
        if "max_size" not in meta:
            raise ValueError("meta_state must give max_size")
        cache = cls(meta["max_size"], meta.get("step", 256), device=device,
                    dtype=meta.get("dtype"))
        M = cache._max
        n = cache._load_arrays(keys, values, offset)
        idx = _check_int("meta_state['idx']", meta.get("idx", n), 0)
        if idx > n:
            raise ValueError(f"meta_state['idx'] must be <= the {n} stored tokens, got {idx}")
        start = idx if 0 < idx < n else 0
        if start and n != M:
            raise ValueError(f"meta_state['idx']={idx} rotates a ring of {n} tokens, but a "
                             f"ring rotates only when it holds max_size={M}")
        if n < offset and n < M - 1:
            raise ValueError(f"state holds {n} of {offset} tokens: fewer than the max_size - 1 = "
                             f"{M - 1} the window needs")
        cache._start = start
        cache._offset = offset
        return cache


# load_simple builds these classes; registering them here keeps state/ below the caches
_register_simple_class(StepCache)
_register_simple_class(RotatingCache)
