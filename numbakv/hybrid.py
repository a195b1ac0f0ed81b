"""``HybridCache``: the attention layers and the recurrent layers of a hybrid model (Qwen3.5 /
Qwen3-Next gated delta net, Granite-4, Nemotron-H, Falcon-H1, Bamba and Jamba Mamba layers, LFM2
short convolutions, ...) behind one cache, as llama.cpp's ``llama_memory_hybrid`` (and its
``_iswa`` variant, with a ``WrapperCache`` for the sliding-window groups).

It composes, never bends, the two memories: ``attn`` (a ``CausalCache``, ``StreamCache`` or
``WrapperCache``) keeps the K/V of the attention layers, ``rc`` (a :class:`~numbakv.
RecurrentCache`) the state of the recurrent ones. ``layer_kinds`` says which model layer is
which; each half numbers its own layers either as the model does (``n_layers`` = every model
layer: the other kind's layers simply unused, e.g. ``layer_reuse=-1`` on the attention cache) or
compactly (``n_layers`` = the layers of its kind, in model order).

Every operation is all or nothing across both halves: the recurrent half checks first
(changing nothing), the attention half runs (itself all or nothing), then the recurrent half
applies what it checked. So a refusal in either half changes neither.

Rules the recurrent half brings (see :mod:`numbakv.recurrent`): a sequence's batch tokens must
continue at its end; ``seq_rm``/``remove`` of a suffix goes back only to a kept restore point;
the middle of a sequence cannot be removed; ``seq_cp``/``copy_prefix`` of a prefix needs a
restore point at its end. ``seq_pos_min`` / ``seq_pos_max`` are llama.cpp's: the larger of the
two halves' minimums, the smaller of their maximums.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._guard import one_thread_at_a_time
from ._inputs import UNLIMITED
from ._inputs import check_index as _check_index
from .causal import CausalCache
from .errors import KVCacheError, NotSupportedError, StateError
from .recurrent import RecurrentCache, plan_recurrent, recurrent_specs
from .state import codec as _st
from .state import files as _files
from .state.methods import StateMethods
from .state.snapshot import SeqSnapshot
from .wrappers import WrapperCache

KINDS = ("attention", "recurrent")


def _attn_layers(attn) -> int:
    return attn.n_layers if isinstance(attn, WrapperCache) else attn.config.n_layers


def _layer_map(kinds: Tuple[str, ...], kind: str, n_layers: int, what: str) -> List[int]:
    """Model layer -> layer of the half holding ``kind`` (-1 for the other kind's layers)."""
    mine = [i for i, k in enumerate(kinds) if k == kind]
    if n_layers == len(kinds):
        return [i if k == kind else -1 for i, k in enumerate(kinds)]
    if n_layers == len(mine):
        out = [-1] * len(kinds)
        for j, i in enumerate(mine):
            out[i] = j
        return out
    raise ValueError(f"{what} has n_layers={n_layers}: it must equal the model's layers "
                     f"(len(layer_kinds) = {len(kinds)}) or its {kind} layers ({len(mine)})")


@one_thread_at_a_time
class HybridCache(StateMethods):
    """Attention K/V + recurrent state of one hybrid model (see the module docstring).

    Args:
        attn: a ``CausalCache`` (or ``StreamCache``) or ``WrapperCache`` for the attention
            layers.
        rc: a ``RecurrentCache`` for the recurrent layers.
        layer_kinds: per model layer, ``"attention"`` or ``"recurrent"``.
    """

    _STATE_IO = "hybrid"

    def __init__(self, attn: Any, rc: RecurrentCache, layer_kinds: Sequence[str]) -> None:
        if not isinstance(attn, (CausalCache, WrapperCache)):
            raise ValueError(f"attn must be a numbakv CausalCache or WrapperCache, got "
                             f"{type(attn).__name__}")
        if not isinstance(rc, RecurrentCache):
            raise ValueError(f"rc must be a numbakv.RecurrentCache, got {type(rc).__name__}")
        if isinstance(layer_kinds, (str, bytes)) or not hasattr(layer_kinds, "__iter__"):
            raise ValueError("layer_kinds must be a list of 'attention' / 'recurrent'")
        kinds = tuple(layer_kinds)
        bad = [(i, k) for i, k in enumerate(kinds) if k not in KINDS]
        if not kinds or bad:
            raise ValueError(f"layer_kinds must list 'attention' or 'recurrent' per model layer, "
                             f"got {bad[:3] or 'nothing'}")
        if attn.closed or rc.closed:
            raise ValueError("attn and rc must be open caches")
        a_seqs = attn.caches[0].config.max_seqs if isinstance(attn, WrapperCache) \
            else attn.config.max_seqs
        if a_seqs != rc.config.max_seqs:
            raise ValueError(f"attn and rc must share max_seqs, got {a_seqs} and "
                             f"{rc.config.max_seqs}")
        a_dev = attn.caches[0].device if isinstance(attn, WrapperCache) else attn.device
        if a_dev != rc.device:
            raise ValueError(f"attn and rc must be on one device, got {a_dev!r} and "
                             f"{rc.device!r}")
        self._attn_of = _layer_map(kinds, "attention", _attn_layers(attn), "attn")
        self._rec_of = _layer_map(kinds, "recurrent", rc.config.n_layers, "rc")
        self.attn = attn
        self.rc = rc
        self.layer_kinds = kinds
        self.max_seqs = rc.config.max_seqs
        self.device = rc.device
        self._layer: Optional[int] = None

    @property
    def n_layers(self) -> int:
        """Model layers: ``len(layer_kinds)``."""
        return len(self.layer_kinds)

    # ------------------------------------------------------------------ forward pass
    def start_forward(self, positions: Any, seqs: Any, reserve: bool = False) -> None:
        """Place a batch in both halves, all or nothing: the recurrent half checks it (each
        sequence's tokens continue its state), the attention half places it (may raise
        ``KVCacheFullError``, nothing changed), then the recurrent states are readied
        (zeroed for new sequences, lazy restore points copied before they are overwritten).
        ``reserve=True`` is the attention half's worst-case sizing pass; the states do not
        move."""
        self._check_open()
        plan = None if reserve else self.rc._plan_forward(positions, seqs)
        self.attn.start_forward(positions, seqs, reserve)
        if plan is not None:
            self.rc._apply_forward(plan)
        self._layer = None

    def capture_step(self, batch: int, **kwargs: Any) -> Any:
        """A captured decode step of the attention half (:class:`numbakv.step.HybridStep`):
        ``attn.capture_step(batch, **kwargs)`` (a ``CausalCache`` or ``WrapperCache`` step),
        driven after this cache's ``start_forward`` so the recurrent half keeps its
        bookkeeping; the recurrent layers' states (row ``seq`` of ``rc.state_views``) are
        the model's to update, the batch's sequence ids in the step's descriptor. Raises as
        the attention half's ``capture_step``, nothing changed."""
        self._check_open()
        from .step import HybridStep
        return HybridStep(self, self.attn.capture_step(batch, **kwargs))

    def set_layer(self, layer: int) -> None:
        """Select model ``layer``: an attention layer selects its layer in ``attn`` (then
        ``put``/``get``/``page_table``/``attend`` read it); a recurrent one makes
        :meth:`state_views` & co default to it."""
        self._check_open()
        layer = _check_index("layer", layer, 0, self.n_layers)
        if self.layer_kinds[layer] == "attention":
            self.attn.set_layer(self._attn_of[layer])
        self._layer = layer

    def _attention_layer(self, what: str) -> None:
        if self._layer is not None and self.layer_kinds[self._layer] != "attention":
            raise ValueError(f"{what}: layer {self._layer} is a recurrent layer (no K/V): use "
                             "state_views / read_states / write_states")

    def put(self, key: Any, value: Any) -> None:
        """``put`` of the current attention layer (see ``CausalCache.put``)."""
        self._attention_layer("put()")
        self.attn.put(key, value)

    def get(self) -> Tuple[Any, Any, Any]:
        """``(key, value, mask)`` of the current attention layer."""
        self._attention_layer("get()")
        return self.attn.get()

    def set_causal(self, except_: Optional[Sequence[int]] = None) -> None:
        """Turn off the future-position test for batch indices ``except_`` in the attention half
        until the next ``start_forward`` (see ``CausalCache.set_causal``)."""
        self.attn.set_causal(except_)

    def page_table(self, page_size: int = 1) -> Any:
        """The current attention layer's page table (see ``CausalCache.page_table``;
        ``page_size > 1``: in pages, e.g. over a ``CacheConfig(page_size=64)`` attention
        half)."""
        self._attention_layer("page_table()")
        return self.attn.page_table(page_size)

    def layer_pool(self, layer: Optional[int] = None) -> Tuple[Any, Any]:
        """Zero-copy K/V views of every cell of an attention ``layer`` (model numbering; the
        current one when None), see ``CausalCache.layer_pool``."""
        if layer is None:
            self._attention_layer("layer_pool()")
            return self.attn.layer_pool()
        return self.attn.layer_pool(self._attention_index(layer))

    @property
    def _attention_cache(self):
        """What ``attend`` reads for the current layer."""
        self._attention_layer("attend()")
        return self.attn._attention_cache

    def _host_pages(self):
        return self.attn._host_pages()

    def _attention_index(self, layer) -> int:
        layer = _check_index("layer", layer, 0, self.n_layers)
        if self.layer_kinds[layer] != "attention":
            raise ValueError(f"layer {layer} is a recurrent layer (no K/V)")
        return self._attn_of[layer]

    def _recurrent_index(self, layer) -> int:
        if layer is None:
            layer = self._layer
            if layer is None:
                raise ValueError("layer must be given (no set_layer since start_forward)")
        layer = _check_index("layer", layer, 0, self.n_layers)
        if self.layer_kinds[layer] != "recurrent":
            raise ValueError(f"layer {layer} is an attention layer (no recurrent state)")
        return self._rec_of[layer]

    # ------------------------------------------------------------------ recurrent state
    def state_views(self, layer: Optional[int], seqs: Any) -> Dict[str, Any]:
        """Zero-copy views of the recurrent states of ``seqs`` in model ``layer`` (None: the
        current one); see ``RecurrentCache.state_views``."""
        return self.rc.state_views(self._recurrent_index(layer), seqs)

    def read_states(self, layer: Optional[int], seqs: Any) -> Dict[str, Any]:
        """Copies of the recurrent states of any ``seqs`` in model ``layer``: ``{name: [len(seqs),
        *shape]}`` (see ``RecurrentCache.read_states``)."""
        return self.rc.read_states(self._recurrent_index(layer), seqs)

    def write_states(self, layer: Optional[int], seqs: Any, states: Mapping[str, Any]) -> None:
        """Write the recurrent states of ``seqs`` in model ``layer`` (see
        ``RecurrentCache.write_states``)."""
        self.rc.write_states(self._recurrent_index(layer), seqs, states)

    def restore_plan(self, seq: int, n_new: int) -> List[int]:
        """See ``RecurrentCache.restore_plan``."""
        return self.rc.restore_plan(seq, n_new)

    def mark_restore(self, seq: int, pos: int) -> None:
        """Ask for an explicit restore point at ``pos`` (see ``RecurrentCache.mark_restore``)."""
        self.rc.mark_restore(seq, pos)

    def keep_restore_point(self, seq: int, pos: int, states: Optional[Mapping[str, Any]] = None,
                           *, layer: Optional[int] = None, explicit: bool = False) -> None:
        """See ``RecurrentCache.keep_restore_point``; ``layer`` is a model layer number."""
        rlayer = None if layer is None else self._recurrent_index(layer)
        self.rc.keep_restore_point(seq, pos, states, layer=rlayer, explicit=explicit)

    def restore_points(self, seq: int) -> List[int]:
        """Positions of the restore points ``seq`` keeps, ascending."""
        return self.rc.restore_points(seq)

    def rollback(self, seq: int, pos: int) -> bool:
        """Both halves back to position ``pos`` of ``seq`` (a kept restore point): the K/V from
        ``pos`` on are removed, the state restored. False, nothing changed, when no restore
        point is kept at ``pos``."""
        self._check_open()
        seq = self.rc._check_seq(seq)
        pos = _check_index("pos", pos, 0, UNLIMITED)
        apply = self.rc._plan_rollback(seq, pos)
        if apply is None:
            return False
        if not self.attn.seq_rm(seq, pos, None):
            return False
        apply()
        return True

    # ------------------------------------------------------------------ sequences
    def _both(self, rc_plan, attn_call):
        """The recurrent plan (checked, nothing changed), then the attention operation (all or
        nothing), then the recurrent change."""
        out = attn_call()
        rc_plan()
        return out

    def seq_rm(self, seq: int, p0: int = 0, p1: Optional[int] = None) -> bool:
        """llama.cpp's ``seq_rm`` on both halves; False, nothing changed, when the recurrent
        half refuses (a prefix or the middle of a sequence, or a suffix without a restore
        point at ``p0``)."""
        self._check_open()
        apply = self.rc._plan_seq_rm(seq, p0, p1)
        if apply is None:
            return False
        if not self.attn.seq_rm(seq, p0, p1):
            return False
        apply()
        return True

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: Optional[int] = None) -> None:
        """llama.cpp's ``seq_cp`` on both halves (the recurrent half copies the state at the
        range's end: ``ValueError`` when it keeps none there; nothing changed). ``dst`` must be
        empty: its recurrent state would be replaced while its K/V stayed beside the copied
        ones (``seq_rm(dst)`` first; ``copy_prefix`` does both)."""
        self._check_open()
        apply = self.rc._plan_seq_cp(src, dst, p0, p1)
        if src != dst and max(self.attn.seq_pos_max(dst), self.rc.seq_pos_max(dst)) >= 0:
            raise ValueError(f"seq_cp: dst {dst} holds positions: a recurrent state cannot be "
                             "merged with another; seq_rm(dst) first (or copy_prefix, which "
                             "replaces it)")
        self._both(apply, lambda: self.attn.seq_cp(src, dst, p0, p1))

    def seq_keep(self, seq: int) -> None:
        """Drop every sequence but ``seq`` in both halves."""
        self._check_open()
        apply = self.rc._plan_seq_keep(seq)
        self._both(apply, lambda: self.attn.seq_keep(seq))

    def seq_add(self, seq: int, p0: int, p1: Optional[int], delta: int) -> None:
        """Move positions ``[p0, p1)`` of ``seq`` by ``delta`` in both halves (keys
        re-rotated; the state's position labels and restore points move)."""
        self._check_open()
        d = _check_index("delta", delta, -UNLIMITED, UNLIMITED + 1)
        apply = self.rc._plan_relabel(seq, p0, p1, lambda p: p + d)
        self._both(apply, lambda: self.attn.seq_add(seq, p0, p1, delta))

    def seq_div(self, seq: int, p0: int, p1: Optional[int], d: int) -> None:
        """Divide positions ``[p0, p1)`` of ``seq`` by ``d`` in both halves (keys re-rotated; the
        state's labels move)."""
        self._check_open()
        dd = _check_index("d", d, 1, UNLIMITED + 1)
        apply = self.rc._plan_relabel(seq, p0, p1, lambda p: p // dd)
        self._both(apply, lambda: self.attn.seq_div(seq, p0, p1, d))

    def seq_pos_min(self, seq: int) -> int:
        """llama.cpp's hybrid rule: the larger of the two halves' first positions."""
        return max(self.attn.seq_pos_min(seq), self.rc.seq_pos_min(seq))

    def seq_pos_max(self, seq: int) -> int:
        """The smaller of the two halves' last positions."""
        return min(self.attn.seq_pos_max(seq), self.rc.seq_pos_max(seq))

    def remove(self, seq: int, begin: int, end: Optional[int] = None) -> None:
        """Ollama's ``remove`` on both halves: ``end=None`` (a suffix) needs a restore point at
        ``begin`` (``ValueError`` otherwise); a finite ``end`` inside the sequence would remove
        the middle of a recurrent state: ``NotSupportedError``. Nothing changes on a refusal."""
        self._check_open()
        apply = self.rc._plan_seq_rm(seq, begin, end)
        if apply is None:
            held = self.rc.restore_points(self.rc._check_seq(seq))
            if end is None:
                raise ValueError(f"remove: the recurrent state of sequence {seq} cannot go back "
                                 f"to position {begin}: restore point {begin} is not held "
                                 f"(held: {held})")
            raise NotSupportedError(f"remove: positions [{begin}, {end}) of sequence {seq} are "
                                    "inside its recurrent state, which cannot forget part of "
                                    "what it read")
        self.attn.remove(seq, begin, end)
        apply()

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        """``dst_seq`` drops what it held and shares the first ``length`` positions of
        ``src_seq``: K/V shared, the state at ``length`` copied (a restore point at ``length``
        or ``src_seq``'s end; ``ValueError`` otherwise)."""
        self._check_open()
        src = self.rc._check_seq(src_seq, "src_seq")
        dst = self.rc._check_seq(dst_seq, "dst_seq")
        length = _check_index("length", length, 0, UNLIMITED)
        if src == dst:
            return self.attn.copy_prefix(src_seq, dst_seq, length)
        copy = self.rc._plan_seq_cp(src, dst, 0, length if length else 0)

        def apply():
            self.rc._clear(dst)
            copy()
        self._both(apply, lambda: self.attn.copy_prefix(src_seq, dst_seq, length))

    def can_resume(self, seq: int, pos: int) -> bool:
        """Whether ``seq`` can continue at ``pos``: the attention half can, and the recurrent
        state is at ``pos`` (its end), keeps a restore point there, or ``pos`` is at or before
        its start (a fresh state)."""
        self._check_open()
        seq = self.rc._check_seq(seq)
        pos = _check_index("pos", pos, 0, UNLIMITED)
        lo, hi = self.rc._lo[seq], self.rc._hi[seq]
        ok = hi < 0 or pos == hi + 1 or pos <= lo or pos in self.rc.restore_points(seq)
        return bool(self.attn.can_resume(seq, pos)) and ok

    def defrag(self) -> None:
        """Defragment the attention half (the recurrent rows never fragment)."""
        self.attn.defrag()

    def apply_pending_shifts(self) -> None:
        """Re-rotate now the keys whose positions ``seq_add``/``seq_div`` moved."""
        if hasattr(self.attn, "apply_pending_shifts"):
            self.attn.apply_pending_shifts()
        else:
            for c in self.attn.caches:
                c.apply_pending_shifts()

    # ------------------------------------------------------------------ one sequence as a unit
    def export_seq(self, seq: int, p0: int = 0, p1: Optional[int] = None, *,
                   device: bool = False) -> SeqSnapshot:
        """A ``SeqSnapshot`` of positions ``[p0, p1)`` of ``seq``: the attention half's K/V rows
        and, as its ``recurrent`` part, the state at the restore points in ``(p0, p1]`` (and at
        the sequence's end when it lies there), with ``layer_kinds``."""
        self._check_open()
        snap = self.attn.export_seq(seq, p0, p1, device=device)
        part = self.rc.export_part(seq, p0, p1)
        return snap._with(recurrent=part, layer_kinds=self.layer_kinds)

    def import_seq(self, seq: int, snap: SeqSnapshot, *, at: Optional[int] = None) -> int:
        """Import a hybrid snapshot for ``seq``: its K/V up to its deepest recurrent entry
        (positions after it are not servable without their state and are left out), and that
        entry as ``seq``'s live state, the kept entries as restore points. ``seq`` must be empty
        in the recurrent half or continue there (its state ends where the snapshot begins, the
        chained pieces of one prompt). Returns the K/V tokens placed. Refused, nothing changed:
        an attention-only snapshot (``ValueError``), another layer layout or recurrent layout
        (``StateError``), and everything ``import_seq`` of the attention half refuses."""
        self._check_open()
        seq = self.rc._check_seq(seq)
        if not isinstance(snap, SeqSnapshot):
            raise ValueError(f"snap must be a numbakv.SeqSnapshot, got {type(snap).__name__}")
        if snap.recurrent is None:
            raise ValueError("snap holds no recurrent state (exported from an attention-only "
                             "cache): a HybridCache cannot serve its tokens without the state "
                             "of its recurrent layers")
        if snap.layer_kinds != self.layer_kinds:
            raise StateError(f"snap comes from another layer layout: layer_kinds "
                             f"{list(snap.layer_kinds)[:8]}..., this cache "
                             f"{list(self.layer_kinds)[:8]}...")
        self.rc.check_part(snap.recurrent, "snap.recurrent")
        rec = snap.recurrent
        cut = snap.below(rec.end)
        pos = [p.positions for p in cut.parts if len(p.positions)]
        first = min(int(p[0]) for p in pos) if pos else rec.end
        delta = 0 if at is None else _check_index("at", at, 0, UNLIMITED) - first
        lo, hi = self.rc._lo[seq], self.rc._hi[seq]
        if not len(rec.positions):
            return 0
        if hi >= 0 and (hi + 1 != first + delta or lo != rec.first + delta):
            raise ValueError(f"sequence {seq} holds recurrent state for positions {lo}..{hi}: "
                             f"the snapshot (state from {rec.first + delta}, K/V from "
                             f"{first + delta}) neither continues it nor starts it afresh")
        apply = self.rc._plan_import(seq, rec, delta)
        n = self.attn.import_seq(seq, cut.attention_only(), at=at)
        apply()
        return n

    # ------------------------------------------------------------------ misc
    def _check_open(self) -> None:
        if self.attn.closed or self.rc.closed:
            raise KVCacheError("the cache is closed")

    def use_stream(self, stream: Any) -> None:
        """Queue both halves' GPU work on ``stream`` (see ``CausalCache.use_stream``)."""
        self.rc.use_stream(stream)      # checks first: a cpu cache refuses a stream
        self.attn.use_stream(stream)

    def close(self) -> None:
        """Close both halves; any later call raises ``KVCacheError``."""
        self.attn.close()
        self.rc.close()

    @property
    def closed(self) -> bool:
        """Whether either half is closed."""
        return self.attn.closed or self.rc.closed

    def __repr__(self) -> str:
        n_a = self.layer_kinds.count("attention")
        return (f"HybridCache({n_a} attention + {len(self.layer_kinds) - n_a} recurrent layers, "
                f"attn={type(self.attn).__name__}, {self.rc!r})")

    def __enter__(self) -> "HybridCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ============================================================================== state files
def _build(cache: HybridCache, seq, tokens, metadata):
    def build():
        if not isinstance(cache, HybridCache):
            raise ValueError(f"cache must be a numbakv.HybridCache, got {type(cache).__name__}")
        cache._check_open()
        s = None if seq is None else cache.rc._check_seq(seq)
        toks = _st._check_tokens(tokens)
        user = _st._check_metadata(metadata)
        attn = np.frombuffer(cache.attn.state_bytes(s), dtype=np.uint8)
        rconfig, specs = recurrent_specs(cache.rc, s, prefix="rec.")
        config = {"layer_kinds": list(cache.layer_kinds), "recurrent": rconfig}
        specs = [_st._Spec("attn", "U8", (len(attn),), lambda: attn)] + specs
        meta = _st._base_metadata("hybrid" if s is None else "hybrid-seq", config, user)
        return meta, specs + _st._tokens_spec(toks)
    return build


def load_hybrid(cache: HybridCache, source, seq: Optional[int] = None, *,
                strict: bool = True) -> dict:
    """Load a ``hybrid`` / ``hybrid-seq`` state: every check of both halves (layer kinds, the
    recurrent layout and values, the checksum; then the attention half's own load, all or
    nothing) before the recurrent half changes."""
    if not isinstance(cache, HybridCache):
        raise ValueError(f"cache must be a numbakv.HybridCache, got {type(cache).__name__}")
    cache._check_open()
    s = None if seq is None else cache.rc._check_seq(seq)
    strict = _st._check_strict(strict)
    with _st._Opened(source) as state, _st._untrusted(state.what):
        want = "hybrid" if s is None else "hybrid-seq"
        if state.kind != want:
            raise state.fail(f"the state has kind {state.kind!r}, {want!r} was asked for "
                             f"(seq={s}); a HybridCache loads only hybrid states")
        kinds = state.config.get("layer_kinds")
        if kinds != list(cache.layer_kinds):
            raise state.fail(f"the state comes from another layer layout (layer_kinds "
                             f"{_st._clip(str(kinds))}, this cache "
                             f"{_st._clip(str(list(cache.layer_kinds)))})")
        expected, finish = plan_recurrent(cache.rc, state, s, state.config.get("recurrent"),
                                          prefix="rec.")
        t = state.tensors.get("attn")
        if t is None or t.dtype != "U8" or len(t.shape) != 1:
            raise state.fail("tensor attn must be there, U8 [n]")
        expected["attn"] = ("U8", tuple(t.shape))
        state.expect(expected, optional=("tokens",))
        tokens = state.tokens()
        state.verify_checksum()
        apply = finish()
        inner = bytes(state.tensor("attn"))
    cache.attn.load_state_bytes(inner, s, strict=strict)
    apply()
    return {"tokens": tokens, "metadata": state.user_metadata()}


_files.register_family("hybrid", HybridCache, _build, load_hybrid)

__all__ = ["HybridCache", "load_hybrid"]
