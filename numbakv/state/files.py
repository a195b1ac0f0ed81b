"""Saving and restoring cache state: what llama.cpp's ``state_write``/``state_read`` and mlx-lm's
prompt-cache files do, for numbakv's caches, so a server can park a conversation and bring it
back later, or ship a prefilled prompt to another process.

Files are `safetensors <https://github.com/huggingface/safetensors>`_: an 8-byte little-endian
header length, a JSON header (tensor dtypes, shapes and byte ranges, plus string metadata) and
the raw tensor bytes. Any safetensors reader opens them. The metadata holds

- ``format`` = ``numbakv.state``, ``version`` = ``1``,
- ``kind``: ``causal`` (a whole ``CausalCache``, cell layout included), ``causal-seq`` (one
  sequence), ``wrapper`` / ``wrapper-seq`` (every group cache of a ``WrapperCache``; tensors
  prefixed ``g<i>.``), ``step`` / ``rotating`` (a ``StepCache`` / ``RotatingCache``:
  ``keys`` / ``values`` ``[batch, n_kv_heads, n, dim]``), ``simple-list`` (a list of them, one
  per layer as in mlx-lm's prompt-cache files; tensors prefixed ``c<i>.``),
- ``config``: JSON of the shapes the state fits (layers, heads, dims, dtype, cells, ...),
- ``checksum``: ``crc32:<8 hex>`` over the canonical JSON header (without the checksum) and every
  tensor byte, so a flipped byte anywhere is caught,
- ``meta.<key>``: the caller's string metadata.

Tensors of a whole ``CausalCache``: ``cells.seqs`` uint64 ``[n_cells, words]`` (the sequence
bitsets), ``cells.pos`` / ``cells.shift`` int32 ``[n_cells]``, and per layer ``k.<l>``
``[n_cells, n_kv_heads, head_dim]`` and ``v.<l>`` ``[n_cells, n_kv_heads, v_head_dim]``. One
sequence: ``positions`` int32 ``[k]`` (ascending) and ``k.<l>`` / ``v.<l>`` ``[k, ...]`` in
position order. V is always written in the non-permuted layout, so a state loads into a cache
with either V layout. ``tokens`` int64 ``[t]`` is there when tokens were given. bfloat16 data
is stored as safetensors ``BF16`` (its raw bits).

Saves stream layer by layer (one layer on the host at a time when the cache is on a GPU) into a
temporary file in the target's directory, which is then renamed over the target: a save either
fully happens or leaves the old file. Loads read the file into memory (never a shared mapping:
another process may truncate or rewrite the file while it is read, which through a mapping
means SIGBUS or bytes changed after they were verified), check everything (structure, format
version, kind, config, model fingerprint, tensor names, dtypes and shapes, counts against the
target's cells, positions, the checksum) before the cache changes, then copy from exactly
the verified bytes layer by layer to the cache's device. Bad input of any kind (truncated,
rewritten while read, corrupted, hostile headers) raises ``StateError`` saying what did not
match, OS errors become ``StateError`` naming the path (the ``OSError`` as ``__cause__``), and
the cache is left exactly as it was.

The model fingerprint (``config.fingerprint``, see :func:`fingerprint`) records the shift
definition, window, memory, chunk, dtypes and head shapes of each cache; a strict load (the
default) into a cache whose fingerprint differs raises ``StateError`` naming the field.

This module knows the caches only through their attributes (it imports none of them, and builds
StepCache / RotatingCache through the classes ``simple.py`` registers with
:func:`register_simple_class`); the caches' ``save_state`` / ``load_state`` methods call into it.
The framing, parsing and atomic writes are ``codec.py``'s.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..device import synchronize
from ..errors import KVCacheError, KVCacheFullError
from .codec import (_POS_LIMIT, _SIMPLE_KINDS, _ST_DTYPES, _STORAGE_ST, Source, _base_metadata,
                    _cfg_int, _check_data, _check_metadata, _check_path, _check_progress,
                    _check_source, _check_strict, _check_tokens, _clip, _close_bar, _host_le,
                    _is_int, _load_bar, _Opened, _save, _Spec, _State, _to_bytes, _tokens_spec,
                    _untrusted)
from . import snapshot
# the model fingerprint and the row writer live with the snapshot, which every one-sequence
# save and load goes through (re-exported here: numbakv.state's names)
from .snapshot import _MISSING, _fingerprint_diff, _write_rows, fingerprint
# the single-stream class registry lives in ``registry`` (``simple.py`` registers there without
# loading this module); re-exported here as before. The caches' state methods are ``methods``'.
from .registry import _SIMPLE_CLASSES, _SIMPLE_REGISTRY, register_simple_class


def _side_format(cfg, which: str) -> Tuple[str, int]:
    """(safetensors dtype, row length) of the saved K (``which="k"``) or V rows: the storage's
    own representation, so quantized sides are saved as their raw ggml/float8 blocks
    (``U8 [rows, n_kv_heads, row_bytes]``) and restored bit for bit."""
    if which == "k":
        quantized, dim, row = cfg.k_quantized, cfg.head_dim, cfg.k_row_bytes
    else:
        quantized, dim, row = cfg.v_quantized, cfg.v_head_dim, cfg.v_row_bytes
    return ("U8", row) if quantized else (_STORAGE_ST[cfg.dtype], dim)



# ====================================================================================== causal
_SHAPE_FIELDS = ("n_layers", "n_kv_heads", "head_dim", "v_head_dim")


def _check_causal(cache) -> None:
    if getattr(cache, "closed", False):
        raise KVCacheError("the cache is closed")
    if isinstance(getattr(cache, "streams", None), list):
        raise ValueError(f"cache is a per-sequence stream cache ({type(cache).__name__}): save "
                         "and load it with its own save_state/state_bytes methods (it keeps one "
                         "cell table per stream)")
    for attr in ("config", "cells", "storage", "n_cells"):
        if not hasattr(cache, attr):
            raise ValueError(f"cache must be a numbakv.CausalCache, got {type(cache).__name__}")


def _check_seq(cache, seq) -> int:
    n = cache.config.max_seqs
    if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)) \
            or not 0 <= int(seq) < n:
        raise ValueError(f"seq must be None or an integer in [0, max_seqs={n}), got {seq!r}")
    return int(seq)


def _causal_config(cache) -> dict:
    cfg = cache.config
    return {"n_layers": cfg.n_layers, "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "v_head_dim": cfg.v_head_dim, "dtype": cfg.dtype, "permuted_v": cfg.permuted_v,
            "capacity": cfg.capacity, "max_seqs": cfg.max_seqs, "n_cells": int(cache.n_cells),
            "swa_window": cache.swa_window, "swa_memory": cache.swa_memory,
            "chunk_size": cache.chunk_size, **_quant_config(cfg),
            "fingerprint": fingerprint(cache)}


def _quant_config(cfg) -> dict:
    """The storage types of K and V and their float8 scales (a list per layer, or one float):
    raw blocks mean nothing without them."""
    return {"k_dtype": cfg.k_dtype, "v_dtype": cfg.v_dtype,
            "k_scale": list(cfg.k_scale) if isinstance(cfg.k_scale, tuple) else cfg.k_scale,
            "v_scale": list(cfg.v_scale) if isinstance(cfg.v_scale, tuple) else cfg.v_scale,
            # Walsh-Hadamard block of rotated rows (0: not rotated), checked whatever `strict`
            # says: rotated blocks read by an unrotated cache (or the reverse) are garbage
            "k_rotation": int(getattr(cfg, "k_rotation", 0)),
            "v_rotation": int(getattr(cfg, "v_rotation", 0))}


def _check_fingerprint(state: "_State", cache, config: dict, where: str, strict: bool) -> None:
    """A strict load refuses a state whose model fingerprint differs from the cache's, naming
    the first field that differs (shapes and dtypes are checked whatever ``strict`` says: the
    data could not be read otherwise)."""
    if not strict:
        return
    saved = config.get("fingerprint", _MISSING)
    if saved is _MISSING:
        raise state.fail(f"the state records no model fingerprint{where} (saved by an older "
                         "numbakv): pass strict=False to load it without checking the model")
    if not isinstance(saved, dict):
        raise state.fail(f"config{where} field 'fingerprint' must be an object, got "
                         f"{type(saved).__name__}")
    diff = _fingerprint_diff(saved, fingerprint(cache))
    if diff is not None:
        field, was, now = diff
        raise state.fail(f"model fingerprint differs{where}: {field} is {was!r} in the state "
                         f"but {now!r} in this cache (saved by another model or cache setup; "
                         "pass strict=False to load it anyway)")


def _seq_words(cache) -> int:
    """Sequence-bit words per cell in a state file: always the widest table's (256 sequences),
    whatever the table keeps in memory (one word up to 64 sequences), so files do not depend
    on max_seqs' in-memory layout."""
    from ..cells import SEQ_WORDS
    return SEQ_WORDS


def _on_device(cache):
    """The storage's GPU as the current device (CuPy indexes and copies there); a no-op on the
    host."""
    if cache.device == "cuda":
        return cache.storage.keys.device
    return contextlib.nullcontext()


def _to_device(cache, arr: np.ndarray):
    if cache.device == "cuda":
        import cupy
        return cupy.asarray(arr)
    return arr


def _v_rows(cache, layer: int, idx=None):
    """Layer ``layer``'s V rows (all cells, or the cells ``idx``) as ``[k, n_kv_heads,
    v_head_dim]`` on the storage's device, whatever the storage layout."""
    v = cache.storage.values[layer]
    if cache.config.permuted_v:
        v = v if idx is None else v[:, :, idx]
        return v.transpose(2, 0, 1)
    return v if idx is None else v[idx]


def _layer_specs(cache, prefix: str, rows: int, idx=None) -> List[_Spec]:
    """``k.<l>`` and ``v.<l>`` for every layer, over all cells (``idx=None``) or ``idx``."""
    cfg = cache.config
    (k_st, k_row), (v_st, v_row) = _side_format(cfg, "k"), _side_format(cfg, "v")
    k_le, v_le = _ST_DTYPES[k_st], _ST_DTYPES[v_st]
    specs = []
    for layer in range(cfg.n_stored_layers):     # owning layers only (layer_reuse)
        def k_rows(layer=layer):
            if rows == 0:  # an empty sequence: nothing to gather
                return np.zeros(0, k_le)
            with _on_device(cache):
                k = cache.storage.keys[layer]
                return _host_le(k if idx is None else k[idx], k_le)

        def v_rows(layer=layer):
            if rows == 0:
                return np.zeros(0, v_le)
            with _on_device(cache):
                return _host_le(_v_rows(cache, layer, idx), v_le)

        specs.append(_Spec(f"{prefix}k.{layer}", k_st, (rows, cfg.local_kv_heads, k_row), k_rows))
        specs.append(_Spec(f"{prefix}v.{layer}", v_st, (rows, cfg.local_kv_heads, v_row), v_rows))
    return specs


def _causal_specs(cache, seq: Optional[int], prefix: str = "") -> Tuple[dict, List[_Spec]]:
    """The config record and tensors of one CausalCache (whole, or sequence ``seq``)."""
    # Keys still waiting for a rotation would not match the positions saved beside them.
    cache.apply_pending_shifts()
    config = _causal_config(cache)
    if seq is None:
        table = cache.cells.cells
        n = int(cache.n_cells)
        words = _seq_words(cache)
        # Snapshots: the metadata must describe exactly the data written after it.
        seqs = np.zeros((n, words), dtype="<u8")
        seqs[:, :table["seqs"].reshape(n, -1).shape[1]] = table["seqs"].reshape(n, -1)
        pos = np.array(table["pos"], dtype="<i4", order="C", copy=True)
        shift = np.array(table["shift"], dtype="<i4", order="C", copy=True)
        specs = [_Spec(prefix + "cells.seqs", "U64", (n, words), lambda: seqs),
                 _Spec(prefix + "cells.pos", "I32", (n,), lambda: pos),
                 _Spec(prefix + "cells.shift", "I32", (n,), lambda: shift)]
        specs += _layer_specs(cache, prefix, n)
        return config, specs
    return _seq_specs(cache, config, seq, prefix)


def _build_causal(cache, seq, tokens, metadata):
    def build():
        _check_causal(cache)
        s = None if seq is None else _check_seq(cache, seq)
        toks = _check_tokens(tokens)
        user = _check_metadata(metadata)
        config, specs = _causal_specs(cache, s)
        meta = _base_metadata("causal" if s is None else "causal-seq", config, user)
        return meta, specs + _tokens_spec(toks)
    return build


def save_cache(cache, path, seq: Optional[int] = None, *, tokens=None,
               metadata: Optional[Mapping[str, str]] = None,
               progress: Optional[bool] = None) -> None:
    """Save a ``CausalCache`` (``seq=None``: all of it, cell layout included) or one sequence to
    the safetensors file ``path``, atomically (a temporary file renamed over ``path``).

    ``tokens``: optional ``[t]`` integers stored beside it (the prompt, for prompt caching);
    ``metadata``: optional str -> str. ``progress``: a progress bar (None: for payloads of at
    least ``PROGRESS_THRESHOLD`` bytes when stderr is a terminal). Pending key rotations are
    applied first so the saved keys match the saved positions."""
    _save(path, _build_causal(cache, seq, tokens, metadata), progress)


def cache_to_bytes(cache, seq: Optional[int] = None, *, tokens=None,
                   metadata: Optional[Mapping[str, str]] = None,
                   progress: Optional[bool] = None) -> bytes:
    """``save_cache`` into bytes in memory (the same safetensors layout)."""
    return _to_bytes(_build_causal(cache, seq, tokens, metadata), progress)


class _Plan:
    """A validated change to one CausalCache: ``commit(state, bar)`` applies it, ``rollback()``
    takes a committed plan back (used when a later group of a WrapperCache fails)."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.old_cells = cache.cells
        self.old_forward = getattr(cache, "_forward", None)

    def rollback(self) -> None:  # pragma: no cover - every plan says how it is taken back
        raise NotImplementedError


def _check_shapes(state: _State, cache, config: dict, where: str = "") -> None:
    cfg = cache.config
    for key in _SHAPE_FIELDS:
        saved = _cfg_int(state, config, key, where=where)
        if saved != getattr(cfg, key):
            raise state.fail(f"{key} does not match: the state has {saved}, the cache "
                             f"{getattr(cfg, key)}{where}")
    if config.get("dtype") != cfg.dtype:
        raise state.fail(f"dtype does not match: the state has {config.get('dtype')!r}, the "
                         f"cache {cfg.dtype!r}{where}")
    # states written before quantized K/V existed hold float rows of `dtype`, scale 1
    saved = {"k_dtype": cfg.dtype, "v_dtype": cfg.dtype, "k_scale": 1.0, "v_scale": 1.0,
             "k_rotation": 0, "v_rotation": 0}   # and before rotated K/V: unrotated rows
    saved.update({k: config[k] for k in saved if k in config})
    for key, value in _quant_config(cfg).items():
        if saved[key] != value:
            raise state.fail(f"{key} does not match: the state has {saved[key]!r}, the cache "
                             f"{value!r}{where}")


def _layer_expect(cache, prefix: str, rows: int) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    cfg = cache.config
    (k_st, k_row), (v_st, v_row) = _side_format(cfg, "k"), _side_format(cfg, "v")
    out = {}
    for layer in range(cfg.n_stored_layers):     # owning layers only (layer_reuse)
        out[f"{prefix}k.{layer}"] = (k_st, (rows, cfg.local_kv_heads, k_row))
        out[f"{prefix}v.{layer}"] = (v_st, (rows, cfg.local_kv_heads, v_row))
    return out


class _WholePlan(_Plan):
    """Replace a CausalCache's cell table and all of its K/V."""

    def __init__(self, cache, state: _State, config: dict, prefix: str, where: str) -> None:
        super().__init__(cache)
        self.prefix = prefix
        n = int(cache.n_cells)
        words = _seq_words(cache)
        saved_cells = _cfg_int(state, config, "n_cells", where=where)
        if saved_cells != n:
            raise state.fail(f"n_cells does not match: the state has {saved_cells} cells, the "
                             f"cache {n}{where} (a whole-cache state restores the exact cell "
                             "layout; save one sequence to move it between caches of other "
                             "sizes)")
        expected = {prefix + "cells.seqs": ("U64", (n, words)),
                    prefix + "cells.pos": ("I32", (n,)),
                    prefix + "cells.shift": ("I32", (n,))}
        expected.update(_layer_expect(cache, prefix, n))
        self.expected = expected
        self.n = n
        self.words = words

    def check_values(self, state: _State, where: str) -> None:
        """Cell table consistency (after the checksum: these read the cell arrays)."""
        cache, p = self.cache, self.prefix
        pos = state.tensor(p + "cells.pos")
        shift = state.tensor(p + "cells.shift")
        seqs = state.tensor(p + "cells.seqs")
        if len(pos) and (pos.min() < -1 or pos.max() >= _POS_LIMIT):
            raise state.fail(f"cells.pos holds {int(pos.min())}..{int(pos.max())}, outside "
                             f"[-1, {_POS_LIMIT}){where}")
        used = seqs.any(axis=1)
        if (used != (pos >= 0)).any():
            bad = int(np.flatnonzero(used != (pos >= 0))[0])
            raise state.fail(f"cell {bad} has position {int(pos[bad])} but "
                             f"{'a' if used[bad] else 'no'} sequence{where} (a cell holds "
                             "tokens exactly when its position is >= 0)")
        if (shift[~used] != 0).any():
            raise state.fail(f"a free cell has a pending shift{where}")
        max_seqs = cache.config.max_seqs
        allowed = np.zeros(self.words, np.uint64)
        for s in range(max_seqs):
            allowed[s // 64] |= np.uint64(1) << np.uint64(s % 64)
        stray = seqs & ~allowed
        if stray.any():
            cell, word = (int(x) for x in np.argwhere(stray)[0])
            bits = int(stray[cell, word])
            bit = (bits & -bits).bit_length() - 1  # the lowest stray sequence
            raise state.fail(f"cell {cell} holds sequence {word * 64 + bit}, but the cache has "
                             f"max_seqs={max_seqs}{where}")
        if (shift != 0).any() and getattr(cache, "shift", None) is None:
            raise state.fail(f"the state has pending key shifts but the cache has no shift "
                             f"function{where}")
        from ..cells import CELL_DTYPE     # the file's width; load_cells takes any
        records = np.zeros(self.n, CELL_DTYPE)
        records["pos"] = pos
        records["shift"] = shift
        records["seqs"] = seqs.reshape(records["seqs"].shape)
        table = cache.cells.copy()
        try:
            table.load_cells(records)
        except ValueError as exc:
            raise state.fail(f"the cell table does not fit this cache{where}: {exc}") from None
        self.table = table

    def commit(self, state: _State, bar) -> None:
        cache, p = self.cache, self.prefix
        try:
            with _on_device(cache):
                for layer in range(cache.config.n_stored_layers):
                    k = state.tensor(f"{p}k.{layer}")
                    v = state.tensor(f"{p}v.{layer}")
                    _write_rows(cache, layer, None, _to_device(cache, k), _to_device(cache, v))
                    if bar is not None:
                        bar.update(k.nbytes + v.nbytes)
                    del k, v
                synchronize(cache.device)
        except BaseException:
            self.rollback()
            raise
        cache.cells = self.table
        cache._forward = None

    def rollback(self) -> None:
        """All K/V may have been overwritten and there is no second copy to restore it from:
        leave the cache empty (every cell free), so no cell pairs with foreign data."""
        empty = self.old_cells.copy()
        empty.seq_rm(-1, 0, None)
        self.cache.cells = empty
        self.cache._forward = None


# ============================================================ one sequence (begin)
# Saving / loading ONE sequence of a CausalCache ("causal-seq" and the per-group "wrapper-seq"
# states) is a SeqSnapshot (state/snapshot.py) in this file's tensor names: the specs come from
# export_seq, the plan places the rows as import_seq does (dropping what the sequence held).
def _seq_specs(cache, config: dict, seq: int, prefix: str = "") -> Tuple[dict, List[_Spec]]:
    """The config record and tensors of sequence ``seq`` (``config`` from ``_causal_config``)."""
    config["seq"] = seq
    part = snapshot.export_seq(cache, seq).parts[0]
    return config, snapshot._part_specs(part, prefix)


class _SeqPlan(_Plan):
    """Replace sequence ``seq`` of a CausalCache with a saved sequence."""

    def __init__(self, cache, state: _State, config: dict, prefix: str, where: str,
                 seq: int) -> None:
        super().__init__(cache)
        self.prefix = prefix
        self.seq = seq
        t = state.tensors.get(prefix + "positions")
        if t is None:
            raise state.fail(f"tensor {prefix}positions missing")
        if t.dtype != "I32":
            raise state.fail(f"tensor {prefix}positions has dtype {t.dtype}, expected I32")
        if len(t.shape) != 1:
            raise state.fail(f"tensor {prefix}positions has shape {list(t.shape)}, expected "
                             "[k]")
        k = t.shape[0]
        # not bounded by `capacity`: a sequence may hold more than that when others leave room
        # (Ollama's cells are shared), and a cache must be able to reload its own sequences
        if k > cache.n_cells:
            raise state.fail(f"the sequence holds {k} positions, more than the cache's "
                             f"{cache.n_cells} cells{where}")
        expected = {prefix + "positions": ("I32", (k,))}
        expected.update(_layer_expect(cache, prefix, k))
        self.expected = expected
        self.k = k

    def check_values(self, state: _State, where: str) -> None:
        """The saved rows as a ``SnapshotPart`` and its placement, checked."""
        cfg, p = self.cache.config, self.prefix
        try:
            part = snapshot.SnapshotPart(
                positions=state.tensor(p + "positions"),
                keys=[snapshot._native(state.tensor(f"{p}k.{l}"), cfg.k_dtype)
                      for l in range(cfg.n_stored_layers)],
                values=[snapshot._native(state.tensor(f"{p}v.{l}"), cfg.v_dtype)
                        for l in range(cfg.n_stored_layers)],
                k_format=cfg.k_dtype, v_format=cfg.v_dtype)
            self.placement = snapshot._placement(self.cache, self.seq, part, replace=True)
        except (ValueError, KVCacheFullError) as exc:
            raise state.fail(f"{exc}{where}") from None

    def commit(self, state: _State, bar) -> None:
        self.placement.commit()
        if bar is not None:
            bar.update(self.placement.part.nbytes)

    def rollback(self) -> None:
        self.placement.rollback()


# ============================================================ one sequence (end)


def _plan_causal(cache, state: _State, config: dict, seq: Optional[int], prefix: str = "",
                 where: str = "", strict: bool = True) -> _Plan:
    """Structure and config checks for one CausalCache (no data read yet)."""
    _check_fingerprint(state, cache, config, where, strict)
    _check_shapes(state, cache, config, where)
    if seq is None:
        plan: _Plan = _WholePlan(cache, state, config, prefix, where)
    else:
        plan = _SeqPlan(cache, state, config, prefix, where, seq)
    return plan


def _load_into(caches: Sequence[Any], state: _State, seq: Optional[int], seq_kind: str,
               whole_kind: str, configs: Sequence[dict], progress: Optional[bool],
               strict: bool = True, seqs: Optional[list] = None) -> dict:
    """Validate ``state`` against every cache, verify the checksum, then commit all of them
    (``seqs[i]``, when given: the sequence cache ``i`` loads instead of ``seq``)."""
    bar = None
    try:
        with _untrusted(state.what):
            plans, tokens, bar = _validate_into(caches, state, seq, seq_kind, whole_kind,
                                                configs, progress, strict, seqs)
        done: List[_Plan] = []
        try:
            for plan in plans:
                plan.commit(state, bar)
                done.append(plan)
        except BaseException:
            for plan in reversed(done):
                plan.rollback()
            raise
    finally:
        _close_bar(bar)
    return {"tokens": tokens, "metadata": state.user_metadata()}


def _validate_into(caches: Sequence[Any], state: _State, seq: Optional[int], seq_kind: str,
                   whole_kind: str, configs: Sequence[dict], progress: Optional[bool],
                   strict: bool, seqs: Optional[list] = None):
    """Everything ``_load_into`` checks before the first cache changes; returns the plans, the
    saved tokens and the progress bar (already advanced past the checksum pass)."""
    want = whole_kind if seq is None else seq_kind
    if state.kind != want:
        other = "a whole cache" if state.kind == whole_kind else \
            "one sequence" if state.kind == seq_kind else f"a {state.kind!r} cache"
        expected = "a whole cache (seq=None)" if seq is None else f"one sequence (seq={seq})"
        raise state.fail(f"the state holds {other} (kind {state.kind!r}), but {expected} was "
                         f"asked for (kind {want!r})")
    multi = len(caches) > 1 or whole_kind in ("wrapper", "streams")
    plans = []
    expected: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
    for i, (cache, config) in enumerate(zip(caches, configs)):
        prefix = f"g{i}." if multi else ""
        where = f" (group {i})" if multi else ""
        if not isinstance(config, dict):
            raise state.fail(f"config{where} must be an object")
        plan = _plan_causal(cache, state, config, seq if seqs is None else seqs[i], prefix,
                            where, strict)
        plans.append(plan)
        expected.update(plan.expected)
    state.expect(expected, optional=("tokens",))
    tokens = state.tokens()
    bar = _load_bar(state, progress)
    try:
        state.verify_checksum(bar)
        for i, plan in enumerate(plans):
            plan.check_values(state, f" (group {i})" if multi else "")
    except BaseException:
        _close_bar(bar)
        raise
    return plans, tokens, bar


def _load_causal(cache, source: Source, seq, progress: Optional[bool],
                 strict: bool = True) -> dict:
    _check_causal(cache)
    s = None if seq is None else _check_seq(cache, seq)
    strict = _check_strict(strict)
    _check_progress(progress)
    with _Opened(source) as state:
        return _load_into([cache], state, s, "causal-seq", "causal", [state.config], progress,
                          strict)


def load_cache(cache, path, seq: Optional[int] = None, *, strict: bool = True,
               progress: Optional[bool] = None) -> dict:
    """Load a ``save_cache`` file into the ``CausalCache`` ``cache``.

    ``seq=None``: the file must hold a whole cache of the same shapes and cell count; the cell
    table and all K/V are replaced. ``seq=s``: the file must hold one sequence; it replaces what
    ``s`` held (other sequences stay), placed in a contiguous run of free cells when there is
    one. The capacity and V layout may differ from the saving cache's. Ends the forward pass in
    progress. Returns ``{"tokens": list[int] | None, "metadata": dict[str, str]}``.

    ``strict`` (default): the state's model fingerprint (shift, window, memory, chunk, dtypes,
    head shapes; see :func:`fingerprint`) must equal the cache's, else ``StateError`` names the
    first field that differs; ``strict=False`` skips that check (shapes and dtypes must still
    fit).

    Raises ``StateError`` (missing or unreadable file, truncated, corrupted, other version, or
    not fitting this cache) before anything changes."""
    return _load_causal(cache, _check_path(path), seq, progress, strict)


def cache_from_bytes(cache, data, seq: Optional[int] = None, *, strict: bool = True,
                     progress: Optional[bool] = None) -> dict:
    """``load_cache`` from bytes in memory."""
    _check_data(data)
    return _load_causal(cache, data, seq, progress, strict)


# ====================================================================================== wrapper
def _check_wrapper(cache) -> list:
    caches = getattr(cache, "caches", None)
    if not isinstance(caches, list) or not caches:
        raise ValueError(f"cache must be a numbakv.WrapperCache, got {type(cache).__name__}")
    for c in caches:
        if isinstance(getattr(c, "streams", None), list):
            _check_streams(c)
        else:
            _check_causal(c)
    return caches


def _wrapper_leaves(caches: list, seq: Optional[int]) -> Tuple[list, list, list]:
    """``(leaves, seqs, layout)``: the cell tables a WrapperCache's state is made of. A unified
    group is one leaf (sequence ``seq``); a stream cache group is one leaf per stream for a
    whole state (``layout[g]`` = its stream count), or for one sequence the stream holding it
    (sequence 0 there, as its own per-sequence files are)."""
    leaves, seqs, layout = [], [], []
    for c in caches:
        streams = getattr(c, "streams", None)
        if isinstance(streams, list):
            if seq is None:
                leaves += streams
                seqs += [None] * len(streams)
                layout.append(len(streams))
            else:
                leaves.append(streams[seq])
                seqs.append(0)
                layout.append(1)
        else:
            leaves.append(c)
            seqs.append(seq)
            layout.append(1)
    return leaves, seqs, layout


def _build_wrapper(cache, seq, tokens, metadata):
    def build():
        caches = _check_wrapper(cache)
        s = None if seq is None else _check_seq(caches[0], seq)
        toks = _check_tokens(tokens)
        user = _check_metadata(metadata)
        leaves, seqs, layout = _wrapper_leaves(caches, s)
        groups, specs = _group_specs(leaves, s, seqs)
        config: Dict[str, Any] = {"groups": groups}
        if any(n != 1 for n in layout):
            config["layout"] = layout      # stream groups: their cell tables, in order
        meta = _base_metadata("wrapper" if s is None else "wrapper-seq", config, user)
        return meta, specs + _tokens_spec(toks)
    return build


def _group_specs(caches: list, seq: Optional[int],
                 seqs: Optional[list] = None) -> Tuple[list, List[_Spec]]:
    """``(configs, specs)`` of several group caches (a WrapperCache's groups, a stream cache's
    streams), group ``i``'s tensors prefixed ``g{i}.``; ``seqs[i]``, when given, is the sequence
    group ``i`` saves instead of ``seq``."""
    groups, specs = [], []
    for i, c in enumerate(caches):
        config, group_specs = _causal_specs(c, seq if seqs is None else seqs[i],
                                            prefix=f"g{i}.")
        groups.append(config)
        specs += group_specs
    return groups, specs


def _load_wrapper(cache, source: Source, seq, progress: Optional[bool],
                  strict: bool = True) -> dict:
    caches = _check_wrapper(cache)
    s = None if seq is None else _check_seq(caches[0], seq)
    leaves, seqs, layout = _wrapper_leaves(caches, s)
    return _load_groups(leaves, source, "wrapper", "wrapper-seq", progress, strict, s,
                        seqs=seqs, layout=layout)


def _load_groups(caches: list, source: Source, whole_kind: str, seq_kind: str,
                 progress: Optional[bool], strict: bool, seq: Optional[int] = None, *,
                 seqs: Optional[list] = None, layout: Optional[list] = None) -> dict:
    """Load a state of several group caches (a WrapperCache's groups, a stream cache's streams)
    whose config lists one object per group under ``groups``. ``layout`` (a WrapperCache's
    whole state): cell tables per group, which the saved ``layout`` must equal."""
    strict = _check_strict(strict)
    _check_progress(progress)
    what = {"wrapper": "cache groups, the WrapperCache", "streams": "streams, the cache"}[whole_kind]
    with _Opened(source) as state:
        if state.kind in (whole_kind, seq_kind):
            groups = state.config.get("groups")
            if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
                raise state.fail("config field 'groups' must be a list of objects")
            if layout is not None and state.kind == whole_kind:
                saved = state.config.get("layout", [1] * len(groups))
                if not isinstance(saved, list) or not all(_is_int(n) and n >= 1 for n in saved):
                    raise state.fail("config field 'layout' must be a list of integers >= 1")
                if saved != layout:
                    raise state.fail(
                        f"the state's groups hold {_clip(str(saved))} cell tables each (a stream "
                        f"cache group holds one per sequence), the WrapperCache's {layout}")
            if len(groups) != len(caches):
                raise state.fail(f"the state has {len(groups)} {what} {len(caches)}")
        else:
            groups = [state.config] * len(caches)  # _load_into reports the kind mismatch
        return _load_into(caches, state, seq, seq_kind, whole_kind, groups, progress, strict,
                          seqs=seqs)


# ====================================================================================== streams
def _check_streams(cache) -> list:
    streams = getattr(cache, "streams", None)
    if not isinstance(streams, list) or not streams:
        raise ValueError(f"cache must be a per-sequence stream cache, got {type(cache).__name__}")
    if getattr(cache, "closed", False):
        raise KVCacheError("the cache is closed")
    return streams


def _build_streams(cache, tokens, metadata):
    """A whole stream cache: every stream's cells and K/V as group ``g{s}`` (kind ``streams``)."""
    def build():
        streams = _check_streams(cache)
        toks = _check_tokens(tokens)
        user = _check_metadata(metadata)
        groups, specs = _group_specs(streams, None)
        return _base_metadata("streams", {"groups": groups}, user), specs + _tokens_spec(toks)
    return build


def _stream_of(cache, seq):
    """The one-sequence cache that holds ``seq`` (its sequence id there is 0)."""
    return _check_streams(cache)[_check_seq(cache, seq)]


def save_streams(cache, path, seq: Optional[int] = None, *, tokens=None,
                 metadata: Optional[Mapping[str, str]] = None,
                 progress: Optional[bool] = None) -> None:
    """``save_cache`` for a per-sequence stream cache: the whole cache (kind ``streams``) or one
    sequence (kind ``causal-seq``, the file a unified cache writes, so it loads into either)."""
    if seq is not None:
        return save_cache(_stream_of(cache, seq), path, 0, tokens=tokens, metadata=metadata,
                          progress=progress)
    _save(path, _build_streams(cache, tokens, metadata), progress)


def streams_to_bytes(cache, seq: Optional[int] = None, *, tokens=None,
                     metadata: Optional[Mapping[str, str]] = None,
                     progress: Optional[bool] = None) -> bytes:
    """``save_streams`` into bytes."""
    if seq is not None:
        return cache_to_bytes(_stream_of(cache, seq), 0, tokens=tokens, metadata=metadata,
                              progress=progress)
    return _to_bytes(_build_streams(cache, tokens, metadata), progress)


def _load_streams(cache, source: Source, seq, progress: Optional[bool],
                  strict: bool = True) -> dict:
    if seq is not None:
        return _load_causal(_stream_of(cache, seq), source, 0, progress, strict)
    return _load_groups(_check_streams(cache), source, "streams", "streams", progress, strict)


def load_streams(cache, path, seq: Optional[int] = None, *, strict: bool = True,
                 progress: Optional[bool] = None) -> dict:
    """``load_cache`` for a per-sequence stream cache: a whole ``streams`` state, or one
    sequence saved by any CausalCache (unified or streams) into ``seq``'s stream."""
    return _load_streams(cache, _check_path(path), seq, progress, strict)


def streams_from_bytes(cache, data, seq: Optional[int] = None, *, strict: bool = True,
                       progress: Optional[bool] = None) -> dict:
    """``load_streams`` from bytes in memory."""
    _check_data(data)
    return _load_streams(cache, data, seq, progress, strict)


# ====================================================================================== simple


def _is_simple(cache) -> bool:
    return hasattr(cache, "meta_state") and hasattr(type(cache), "from_state") and \
        hasattr(cache, "update")


def _simple_list(caches) -> Tuple[list, bool]:
    """``(caches, is_list)``: one StepCache/RotatingCache, or a non-empty sequence of them (one
    per layer, like an mlx-lm prompt cache)."""
    if _is_simple(caches):
        return [caches], False
    if isinstance(caches, (list, tuple)) and caches and all(_is_simple(c) for c in caches):
        return list(caches), True
    raise ValueError("cache must be a numbakv.StepCache or RotatingCache, or a non-empty list of "
                     f"them, got {type(caches).__name__}")


def _json_scalar(x):
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def _simple_entry(cache, prefix: str) -> Tuple[dict, List[_Spec]]:
    """The config record and tensors (``keys``, ``values``: ``[batch, n_kv_heads, n, dim]``) of
    one single-stream cache, from its ``state()``."""
    keys, values = cache.state()
    meta = dict(cache.meta_state())
    offset = meta.pop("offset")     # the file keeps the offset beside the meta record
    entry = {"class": type(cache).__name__, "offset": int(offset),
             "meta": json.loads(json.dumps(meta, default=_json_scalar))}
    if entry["class"] not in _SIMPLE_CLASSES:
        raise ValueError(f"cannot save a {entry['class']}: not a StepCache or RotatingCache")
    if keys is None:
        return entry, []
    sd = _STORAGE_ST[meta["dtype"]]
    le = _ST_DTYPES[sd]
    specs = []
    for name, arr in (("keys", keys), ("values", values)):
        raw = arr.bits if type(arr).__name__ == "BFloat16View" else arr  # bfloat16 bits
        specs.append(_Spec(prefix + name, sd, tuple(int(d) for d in raw.shape),
                           lambda raw=raw: _host_le(raw, le)))
    return entry, specs


def _build_simple(caches, tokens, metadata):
    def build():
        items, is_list = _simple_list(caches)
        toks = _check_tokens(tokens)
        user = _check_metadata(metadata)
        entries, specs = [], []
        for i, cache in enumerate(items):
            entry, entry_specs = _simple_entry(cache, f"c{i}." if is_list else "")
            entries.append(entry)
            specs += entry_specs
        if is_list:
            kind, config = "simple-list", {"caches": entries}
        else:
            kind, config = _SIMPLE_CLASSES[entries[0]["class"]], entries[0]
        return _base_metadata(kind, config, user), specs + _tokens_spec(toks)
    return build


def save_simple(cache, path, *, tokens=None, metadata: Optional[Mapping[str, str]] = None,
                progress: Optional[bool] = None) -> None:
    """Save a ``StepCache`` / ``RotatingCache``, or a list of them (one per layer, as mlx-lm's
    prompt-cache files hold), to the safetensors file ``path``, atomically: the stored tokens
    ``[batch, n_kv_heads, n, head_dim]``, the offset and what ``from_state`` needs (ring index,
    step, dtype, max_size)."""
    _save(path, _build_simple(cache, tokens, metadata), progress)


def simple_to_bytes(cache, *, tokens=None, metadata: Optional[Mapping[str, str]] = None,
                    progress: Optional[bool] = None) -> bytes:
    """``save_simple`` into bytes in memory."""
    return _to_bytes(_build_simple(cache, tokens, metadata), progress)


def _simple_classes() -> Dict[str, type]:
    if set(_SIMPLE_REGISTRY) != set(_SIMPLE_CLASSES):  # pragma: no cover - numbakv imports simple
        raise KVCacheError("numbakv.simple has not registered StepCache / RotatingCache")
    return _SIMPLE_REGISTRY


def _simple_plan(state: _State, entry, prefix: str, where: str):
    """Check one saved single-stream cache; returns ``(class name, expected tensors)``."""
    if not isinstance(entry, dict):
        raise state.fail(f"config{where} must be an object")
    cls = entry.get("class")
    if cls not in _SIMPLE_CLASSES:
        raise state.fail(f"config{where} class {cls!r} is not StepCache or RotatingCache")
    offset = entry.get("offset")
    if not _is_int(offset) or offset < 0:
        raise state.fail(f"config{where} offset must be an integer >= 0, got {offset!r}")
    meta = entry.get("meta")
    if not isinstance(meta, dict) or meta.get("kind") != cls:
        raise state.fail(f"config{where} meta must be an object with kind {cls!r}")
    dtype = meta.get("dtype")
    has = [prefix + n in state.tensors for n in ("keys", "values")]
    if not any(has):
        return cls, {}
    if dtype not in _STORAGE_ST:
        raise state.fail(f"config{where} meta dtype {dtype!r} is not one of "
                         f"{sorted(_STORAGE_ST)}")
    sd = _STORAGE_ST[dtype]
    k = state.tensors.get(prefix + "keys")
    v = state.tensors.get(prefix + "values")
    if k is None or v is None or len(k.shape) != 4 or len(v.shape) != 4 \
            or k.shape[:3] != v.shape[:3]:
        raise state.fail(f"tensors {prefix}keys / {prefix}values must both be there, 4-D "
                         "[batch, n_kv_heads, n, dim] and agree on the first three dims")
    if k.shape[2] > offset:
        raise state.fail(f"{prefix}keys holds {k.shape[2]} tokens but the offset is {offset}")
    return cls, {prefix + "keys": (sd, k.shape), prefix + "values": (sd, v.shape)}


def _load_simple_state(state: _State, device: str, progress: Optional[bool]):
    """Build the saved single-stream cache(s); nothing exists before, so every failure is the
    input's (a forged step or offset asking for absurd storage included): ``StateError``."""
    with _untrusted(state.what):
        return _load_simple_checked(state, device, progress)


def _load_simple_checked(state: _State, device: str, progress: Optional[bool]):
    if state.kind not in _SIMPLE_KINDS:
        raise state.fail(f"the state holds a {state.kind!r} cache, not a StepCache or "
                         "RotatingCache")
    if state.kind == "simple-list":
        entries = state.config.get("caches")
        if not isinstance(entries, list) or not entries:
            raise state.fail("config field 'caches' must be a non-empty list")
        prefixes = [f"c{i}." for i in range(len(entries))]
        wheres = [f" (cache {i})" for i in range(len(entries))]
    else:
        entries, prefixes, wheres = [state.config], [""], [""]
    plans = []
    expected: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
    for entry, prefix, where in zip(entries, prefixes, wheres):
        cls, exp = _simple_plan(state, entry, prefix, where)
        if state.kind != "simple-list" and _SIMPLE_CLASSES[cls] != state.kind:
            raise state.fail(f"kind {state.kind!r} does not match class {cls!r}")
        plans.append(cls)
        expected.update(exp)
    state.expect(expected, optional=("tokens",))
    tokens = state.tokens()
    classes = _simple_classes()
    bar = _load_bar(state, progress)
    try:
        state.verify_checksum(bar)
        caches = []
        for cls, entry, prefix, where in zip(plans, entries, prefixes, wheres):
            has = prefix + "keys" in state.tensors
            values = (state.tensor(prefix + "keys") if has else None,
                      state.tensor(prefix + "values") if has else None)
            meta = {**entry["meta"], "offset": entry["offset"]}
            try:  # from_state copies the arrays into fresh storage on `device`
                caches.append(classes[cls].from_state(values, meta, device=device))
            except ValueError as exc:  # the device was resolved before: this is the state's
                raise state.fail(f"the saved {cls} state is inconsistent{where}: "
                                 f"{_clip(str(exc))}") from None
            del values
        if bar is not None:
            bar.update(state.data_bytes)
    finally:
        _close_bar(bar)
    result = caches if state.kind == "simple-list" else caches[0]
    return result, {"tokens": tokens, "metadata": state.user_metadata()}


def load_simple(source: Source, *, device: str = "auto", return_info: bool = False,
                progress: Optional[bool] = None):
    """A new ``StepCache`` / ``RotatingCache`` (or the list of them that was saved) on
    ``device``, rebuilt from a ``save_simple`` file (a path) or its bytes. With ``return_info``
    returns ``(cache, {"tokens": list[int] | None, "metadata": dict[str, str]})``."""
    source = _check_source(source)
    from ..device import resolve_device
    device = resolve_device(device)  # a bad device is the caller's ValueError, checked first
    _check_progress(progress)
    with _Opened(source) as state:
        cache, info = _load_simple_state(state, device, progress)
    return (cache, info) if return_info else cache


# ====================================================================================== generic
#: cache families that bring their own state format (``numbakv.RecurrentCache``,
#: ``numbakv.HybridCache``): name -> (class, builder(cache, seq, tokens, metadata) -> build(),
#: loader(cache, source, seq, *, strict) -> {"tokens", "metadata"}); the classes register
#: themselves (this module imports no cache)
_FAMILIES: Dict[str, Tuple[type, Any, Any]] = {}


def register_family(name: str, cls: type, builder, loader) -> None:
    """Register a cache class whose state files its own module writes and reads, so
    :func:`save` / :func:`to_bytes` / :func:`load` accept it like the built-in families, and
    a class with :class:`StateMethods` and ``_STATE_IO = name`` gets the four state methods."""
    _FAMILIES[name] = (cls, builder, loader)
    _STATE_IO[name] = (save, to_bytes, load_registered, registered_from_bytes)


def _cache_family(cache) -> str:
    if cache is None:
        return "none"
    for name, (cls, _, _) in _FAMILIES.items():
        if isinstance(cache, cls):
            return name
    if hasattr(cache, "caches") and isinstance(getattr(cache, "caches"), list):
        return "wrapper"
    if hasattr(cache, "cells") and hasattr(cache, "storage"):
        return "causal"
    if _is_simple(cache) or (isinstance(cache, (list, tuple)) and cache
                             and all(_is_simple(c) for c in cache)):
        return "simple"
    raise ValueError("cache must be a numbakv CausalCache, WrapperCache, StepCache or "
                     f"RotatingCache, got {type(cache).__name__}")


def _builder(cache, seq, tokens, metadata):
    family = _cache_family(cache)
    if family in _FAMILIES:
        return _FAMILIES[family][1](cache, seq, tokens, metadata)
    if family == "causal":
        return _build_causal(cache, seq, tokens, metadata)
    if family == "wrapper":
        return _build_wrapper(cache, seq, tokens, metadata)
    if family == "simple":
        if seq is not None:
            raise ValueError("seq must be None for a StepCache/RotatingCache (it holds a single "
                             "stream)")
        return _build_simple(cache, tokens, metadata)
    raise ValueError("cache must be given")


def save(cache, path, seq: Optional[int] = None, *, tokens=None,
         metadata: Optional[Mapping[str, str]] = None, progress: Optional[bool] = None) -> None:
    """Save any numbakv cache to the safetensors file ``path``, atomically: a ``CausalCache`` or
    ``WrapperCache`` whole (``seq=None``) or one sequence, a ``StepCache`` / ``RotatingCache``
    (or a list of them, one per layer) whole. ``tokens`` and str -> str ``metadata`` travel
    with it."""
    _save(path, _builder(cache, seq, tokens, metadata), progress)


def to_bytes(cache, seq: Optional[int] = None, *, tokens=None,
             metadata: Optional[Mapping[str, str]] = None,
             progress: Optional[bool] = None) -> bytes:
    """``save`` into bytes in memory."""
    return _to_bytes(_builder(cache, seq, tokens, metadata), progress)


def load(source: Source, cache=None, seq: Optional[int] = None, *, device: str = "auto",
         strict: bool = True, progress: Optional[bool] = None) -> Tuple[Any, dict]:
    """Load a state from a path or from bytes; returns ``(cache, {"tokens", "metadata"})``.

    ``causal*`` / ``wrapper*`` states load into ``cache`` (a ``CausalCache`` / ``WrapperCache``,
    required; ``seq`` as in ``load_cache``). ``step`` / ``rotating`` / ``simple-list`` states
    build a new cache (or list of caches) on ``device`` (``cache`` must be None). ``strict``: as
    in ``load_cache`` (each group of a WrapperCache is checked)."""
    source = _check_source(source)
    strict = _check_strict(strict)
    _check_progress(progress)
    family = _cache_family(cache)
    if family == "simple":
        raise ValueError("cache must be None to load a StepCache/RotatingCache state (a new "
                         "cache is built), or a CausalCache/WrapperCache to load into")
    if family in _FAMILIES:
        return cache, _FAMILIES[family][2](cache, source, seq, strict=strict)
    if family == "causal":
        return cache, _load_causal(cache, source, seq, progress, strict)
    if family == "wrapper":
        return cache, _load_wrapper(cache, source, seq, progress, strict)
    if seq is not None:
        raise ValueError("seq needs a cache to load into")
    from ..device import resolve_device
    device = resolve_device(device)
    with _Opened(source) as state:
        if state.kind not in _SIMPLE_KINDS:
            raise ValueError(f"a {state.kind!r} state loads into an existing cache: pass "
                             "cache=")
        return _load_simple_state(state, device, progress)


def read_info(source: Source, *, verify: bool = True) -> dict:
    """What a state holds, without loading it: ``{"kind", "version", "config", "tokens",
    "metadata", "nbytes"}`` (``nbytes``: tensor payload). ``verify`` checks the checksum too."""
    source = _check_source(source)
    with _Opened(source) as state, _untrusted(state.what):
        if verify:
            state.verify_checksum()
        return {"kind": state.kind, "version": state.metadata["version"],
                "config": state.config, "tokens": state.tokens(),
                "metadata": state.user_metadata(), "nbytes": state.data_bytes}



def load_wrapper(cache, path, seq: Optional[int] = None, *, strict: bool = True,
                 progress: Optional[bool] = None) -> dict:
    """``load_cache`` for a ``WrapperCache``: every group cache, all or nothing (``strict`` per
    group)."""
    return _load_wrapper(cache, _check_path(path), seq, progress, _check_strict(strict))


def wrapper_from_bytes(cache, data, seq: Optional[int] = None, *, strict: bool = True,
                       progress: Optional[bool] = None) -> dict:
    """``load_wrapper`` from bytes in memory."""
    _check_data(data)
    return _load_wrapper(cache, data, seq, progress, _check_strict(strict))


# ============================================================================ the cache methods
def load_registered(cache, path, seq: Optional[int] = None, *, strict: bool = True,
                    progress: Optional[bool] = None) -> dict:
    """Load the file ``path`` into a cache of a family its own module registered
    (:func:`register_family`: ``RecurrentCache``, ``HybridCache``), through that loader."""
    return _FAMILIES[_cache_family(cache)][2](cache, _check_path(path), seq, strict=strict)


def registered_from_bytes(cache, data, seq: Optional[int] = None, *, strict: bool = True,
                          progress: Optional[bool] = None) -> dict:
    """``load_registered`` from bytes in memory."""
    _check_data(data)
    return _FAMILIES[_cache_family(cache)][2](cache, data, seq, strict=strict)


#: (save, to bytes, load, from bytes) of each family of caches that hold sequences
_STATE_IO = {"causal": (save_cache, cache_to_bytes, load_cache, cache_from_bytes),
             "streams": (save_streams, streams_to_bytes, load_streams, streams_from_bytes),
             "wrapper": (save, to_bytes, load_wrapper, wrapper_from_bytes)}


__all__ = ["save", "load", "to_bytes", "read_info", "fingerprint", "save_cache", "load_cache",
           "cache_to_bytes", "cache_from_bytes", "save_simple", "load_simple", "simple_to_bytes",
           "save_streams", "load_streams", "streams_to_bytes", "streams_from_bytes",
           "load_wrapper", "wrapper_from_bytes", "register_simple_class",
           "register_family", "load_registered", "registered_from_bytes"]
