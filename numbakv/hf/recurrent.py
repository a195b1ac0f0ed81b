"""The recurrent layers of transformers' hybrid models over numbakv's per-sequence state.

A transformers recurrent mixer (gated delta net, Mamba-1/2, LFM2's short convolution) runs
``forward(hidden_states [b, L, hidden], cache, attention_mask)`` and asks ``cache`` for one
conv state and one recurrent state per batch row (``get_conv_state``, ``update_conv_state``,
``get_recurrent_state``, ``update_recurrent_state``, ``has_previous_state``,
``is_recording_past``). :class:`StateRows` answers those questions for rows whose states are
handed in as tensors (views of a ``numbakv.RecurrentCache``'s rows, or gathered copies the
caller scatters back), exactly as transformers' own ``LinearAttentionLayer`` does: the first
call of a sequence pads its conv input on the left to the kernel, later ones prepend the kept
tail; the state after the call is the last ``kernel`` conv inputs and the scan's final state.

:func:`run_packed` runs one mixer over a packed batch ``[1, tokens, hidden]`` (many sequences,
``hf.attach``'s form): the decode tokens of every sequence with a state together as one batch of
single-token rows (the mixer's one-step path), each prompt chunk on its own, split where the
cache wants restore points (``segments``) so the state at each cut can be kept.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import NotSupportedError
from ._refused import RefusedLayerOps


class StateRows:
    """The recurrent-cache interface transformers' mixers call, for one call over ``n`` rows.

    Args:
        conv: the rows' conv states ``[n, conv_dim, kernel]`` (written in place).
        ssm: the rows' recurrent states (``[n, *shape]``, written in place) or ``None`` for
            layers that keep only a conv state (LFM2).
        has_previous: whether the rows hold a state (all of them or none: a sequence's first
            tokens run with a zero state, as in transformers).
    """

    def __init__(self, conv, ssm, has_previous: bool) -> None:
        self.conv, self.ssm, self.has_previous = conv, ssm, bool(has_previous)

    # -- what the mixers call (transformers.Cache's linear-attention API)
    def has_previous_state(self, layer_idx: Optional[int] = None,
                           state_idx: Optional[int] = None) -> bool:
        return self.has_previous

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.conv if self.has_previous else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.ssm if self.has_previous else None

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: Optional[int] = None, **kwargs):
        """``conv_states [n, conv_dim, L]`` (this call's conv inputs) -> the inputs the causal
        convolution must see (the kept tail prepended, or left zero padding on a first call);
        keeps the last ``kernel`` of them."""
        torch = _torch()
        kernel = self.conv.shape[-1]
        if self.has_previous:
            full = torch.cat([self.conv.to(conv_states.dtype), conv_states], dim=-1)
        else:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
            self.has_previous = True
        self.conv.copy_(full[..., -kernel:])
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx: int = 0, state_idx: int = 0,
                               **kwargs):
        if self.ssm is None:
            raise ValueError("this layer keeps no recurrent state (its layout declares only a "
                             "conv state)")
        self.ssm.copy_(recurrent_states)
        self.has_previous = True
        return self.ssm


def _torch():
    import torch
    return torch


def plan_groups(positions: np.ndarray, seqs: np.ndarray,
                first_of: Optional[Callable[[int], Optional[int]]] = None
                ) -> Tuple[List[Tuple[int, int]], List[Tuple[int, np.ndarray, int]]]:
    """Split a packed batch by sequence.

    Args:
        positions, seqs: ``[batch]`` as given to ``start_forward``.
        first_of: ``seq -> `` the first position its state has not seen (the state covers
            positions before it; 0 for a sequence without state); ``None`` (or a ``None``
            answer): the sequence's first position in the batch (the recurrent cache's
            ``start_forward`` checked it continues the state).

    Returns:
        ``(decodes, chunks)``: ``decodes`` = ``[(seq, batch index)]`` of sequences with exactly
        one token that continue a state; ``chunks`` = ``[(seq, batch indices, first
        position)]`` for every other sequence. Raises ``ValueError`` when a sequence's tokens
        are not consecutive positions, in batch order, starting where its state ends: a
        recurrent scan cannot skip or revisit a position.
    """
    order = np.argsort(seqs, kind="stable")
    s_sorted = seqs[order]
    cuts = np.flatnonzero(np.diff(s_sorted)) + 1
    decodes: List[Tuple[int, int]] = []
    chunks: List[Tuple[int, np.ndarray, int]] = []
    for idx in np.split(order, cuts):
        if not len(idx):
            continue
        seq = int(seqs[idx[0]])
        pos = positions[idx]
        start = None if first_of is None else first_of(seq)
        start = int(pos[0]) if start is None else start
        if int(pos[0]) != start or (len(pos) > 1 and not (np.diff(pos) == 1).all()):
            raise ValueError(f"sequence {seq}: a recurrent layer needs consecutive positions "
                             f"from {start} (where its state ends) in batch order, got "
                             f"{pos.tolist()[:8]}")
        if len(idx) == 1 and start > 0:
            decodes.append((seq, int(idx[0])))
        else:
            chunks.append((seq, idx, start))
    return decodes, chunks


def run_packed(forward: Callable, hidden, decodes: Sequence[Tuple[int, int]],
               chunks: Sequence[Tuple[int, np.ndarray, int, Sequence[int]]],
               rows: Callable[[Sequence[int]], Tuple[Any, Any, Callable[[], None]]],
               keep: Optional[Callable[[int, int, Any, Any], None]] = None,
               resumes_chunks: bool = True):
    """One recurrent mixer over a packed batch.

    Args:
        forward: the mixer's own ``forward(hidden_states, cache=..., attention_mask=None)``.
        hidden: ``[1, tokens, hidden]``.
        decodes: ``[(seq, batch index)]`` (see :func:`plan_groups`): run as one batch.
        chunks: ``[(seq, batch indices, first position, cuts)]``: each run on its own, split
            at ``cuts`` (offsets into the chunk, ascending, ``0 < cut < len``) so that
            ``keep(seq, position, conv, ssm)`` receives the state at each cut (copies).
        resumes_chunks: False for mixers whose multi-token scan ignores the state it is
            handed (transformers' Jamba starts every multi-token scan from zeros): a segment
            that continues a state then runs token by token (the one-step path, exact).
        rows: ``seqs -> (conv [n, ...], ssm [n, ...] or None, done)``: the sequences' states as
            tensors the mixer may write in place; ``done()`` after the call writes them back
            (a no-op for views).

    Returns:
        ``[1, tokens, hidden]``: the mixer's output, rows in batch order.
    """
    torch = _torch()
    out = torch.empty_like(hidden)
    if decodes:
        seqs = [s for s, _ in decodes]
        where = torch.as_tensor([b for _, b in decodes], device=hidden.device)
        conv, ssm, done = rows(seqs)
        part = hidden[0].index_select(0, where).unsqueeze(1)          # [n, 1, hidden]
        res = forward(part, cache=StateRows(conv, ssm, True), attention_mask=None)
        done()
        out[0].index_copy_(0, where, res[:, 0].to(out.dtype))
    for seq, idx, start, cuts in chunks:
        conv, ssm, done = rows([seq])
        state = StateRows(conv, ssm, start > 0)
        where = torch.as_tensor(idx, device=hidden.device)
        part = hidden[0].index_select(0, where).unsqueeze(0)          # [1, L, hidden]
        bounds = [0, *cuts, len(idx)]
        pieces = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            if state.has_previous and not resumes_chunks:
                pieces += [forward(part[:, t:t + 1], cache=state, attention_mask=None)
                           for t in range(a, b)]
            else:
                pieces.append(forward(part[:, a:b], cache=state, attention_mask=None))
            if keep is not None and b < len(idx):
                keep(seq, start + b, state.conv[0].clone(),
                     None if state.ssm is None else state.ssm[0].clone())
        done()
        res = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        out[0].index_copy_(0, where, res[0].to(out.dtype))
    return out





# ---------------------------------------------------------------------------- hf.attach
def _is_consecutive(seqs: Sequence[int]) -> bool:
    return all(b == a + 1 for a, b in zip(seqs[:-1], seqs[1:]))


def mixer_modules(model: Any, layout) -> Dict[int, Any]:
    """``{model layer: its recurrent mixer module}`` (the decoder layers' ``layout.mixer``
    attribute, a module with ``layer_idx``)."""
    found: Dict[int, Any] = {}
    for _, module in model.named_modules():
        mixer = getattr(module, layout.mixer, None)
        idx = getattr(mixer, "layer_idx", None)
        if mixer is None or isinstance(idx, bool) or not isinstance(idx, int) \
                or not callable(getattr(mixer, "forward", None)):
            continue
        found[idx] = mixer
    return found


class RecurrentBinding:
    """The recurrent half of ``hf.attach`` on a hybrid model: each recurrent mixer's
    ``forward`` runs over the packed batch through :func:`run_packed`, reading and writing the
    live states of a ``numbakv.RecurrentCache`` (zero-copy views for consecutive sequence ids,
    a gather and a scatter otherwise), handing it the state wherever its ``restore_plan`` cuts
    a prompt chunk (per layer, as the layers run) and keeping each sequence's batch end (the
    live state, lazily) once the last recurrent layer ran."""

    def __init__(self, recurrent: Any, mixers: Dict[int, Any], resumes_chunks: bool = True
                 ) -> None:
        self.recurrent = recurrent
        self.resumes_chunks = resumes_chunks
        self.mixers = mixers
        self.index = {layer: j for j, layer in enumerate(sorted(mixers))}
        self.last = max(mixers)
        self.names = [s.name for s in recurrent.config.states]
        self.decodes: List[Tuple[int, int]] = []
        self.chunks: List[Tuple[int, np.ndarray, int, List[int]]] = []
        self.ends: List[Tuple[int, int]] = []
        self.ready = False

    def install(self) -> None:
        for layer, mixer in self.mixers.items():
            mixer.forward = self._forward_of(layer, mixer.forward)

    def uninstall(self) -> None:
        for mixer in self.mixers.values():
            if "forward" in vars(mixer):
                del mixer.forward

    def begin(self, positions: np.ndarray, seqs: np.ndarray) -> None:
        """A forward pass placed (after the cache's ``start_forward``): group the batch by
        sequence and ask the recurrent cache where to cut each prompt chunk."""
        rc = self.recurrent
        decodes, chunks = plan_groups(positions, seqs, lambda s: None)
        self.decodes = sorted(decodes)
        self.chunks = []
        self.ends = [(s, int(positions[b]) + 1) for s, b in decodes]
        for seq, idx, start in chunks:
            n = len(idx)
            cuts = [k for k in rc.restore_plan(seq, n) if k < n]
            self.chunks.append((seq, idx, start, cuts))
            self.ends.append((seq, start + n))
        self.ready = True

    def _rows(self, layer: int):
        torch = _torch()
        rc = self.recurrent
        names = self.names

        def rows(seqs):
            seqs = list(seqs)
            if _is_consecutive(seqs):
                views = rc.state_views(layer, seqs)
                ts = {n: torch.from_dlpack(views[n]) for n in names}
                done = _noop
            else:
                ts = {n: torch.from_dlpack(a) for n, a in rc.read_states(layer, seqs).items()}

                def done():
                    rc.write_states(layer, seqs, ts)
            return ts["conv"], ts.get("ssm"), done
        return rows

    def _keep(self, layer: int):
        rc = self.recurrent

        def keep(seq, pos, conv, ssm):
            states = {"conv": conv} if ssm is None else {"conv": conv, "ssm": ssm}
            rc.keep_restore_point(seq, pos, states, layer=layer)
        return keep

    def _forward_of(self, layer: int, original: Callable):
        j = self.index[layer]

        def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
            if not self.ready:
                raise ValueError("no forward pass: call cache.start_forward(positions, seqs) "
                                 "before running the attached model")
            if hidden_states.shape[0] != 1:
                raise ValueError(f"numbakv runs one packed batch: input_ids must be [1, tokens], "
                                 f"got a batch of {hidden_states.shape[0]} rows")
            out = run_packed(original, hidden_states, self.decodes, self.chunks, self._rows(j),
                             self._keep(j), self.resumes_chunks)
            if layer == self.last:
                for seq, end in self.ends:
                    self.recurrent.keep_restore_point(seq, end)   # the live state, lazily
                self.ready = False
            return out
        return forward


def _noop() -> None:
    return None


# ---------------------------------------------------------------------------- generation_cache
def recurrent_half(cache: Any) -> Any:
    """The ``RecurrentCache`` of a ``HybridCache``."""
    rc = getattr(cache, "rc", None)
    if rc is None:
        raise ValueError(f"cache must be a numbakv HybridCache, got {type(cache).__name__}")
    return rc


def generation_layer_class():
    """The transformers cache layer of a recurrent layer in :func:`numbakv.hf.generation_cache`:
    transformers' own ``LinearAttentionLayer`` whose conv and recurrent states are zero-copy
    views of the ``RecurrentCache`` rows of sequences ``0 .. batch-1`` (row ``b`` of the padded
    batch is sequence ``b``), so the model's in-place updates (its one-step decode kernels
    write the states they are handed) land in numbakv's storage."""
    from ._deps import _transformers
    torch, cache_utils = _transformers()

    class NumbakvRecurrentLayer(RefusedLayerOps, cache_utils.LinearAttentionLayer):
        """One recurrent layer of a numbakv generation cache."""

        def __init__(self, state: Any, layer: int, recurrent_layer: int) -> None:
            super().__init__(number_of_states=1)
            self.state, self.layer, self.recurrent_layer = state, layer, recurrent_layer

        def _views(self) -> Dict[str, Any]:
            state = self.state
            state.ensure_begun()
            if state.cache is None or state.seqs is None:
                raise ValueError(f"layer {self.layer}: no forward pass began (the generation "
                                 "cache begins each pass in a forward pre-hook of its model)")
            seqs = [int(s) for s in state.seqs]
            if not _is_consecutive(seqs):
                raise NotSupportedError(f"the rows' sequences {seqs} are not consecutive ids: a "
                                        "hybrid model's generation cache hands the model views "
                                        "of consecutive state rows (keep retain_seqs at the "
                                        "ends of the id range)")
            views = recurrent_half(state.cache).state_views(self.recurrent_layer, seqs)
            return {n: torch.from_dlpack(a) for n, a in views.items()}

        def lazy_initialization(self, conv_states=None, recurrent_states=None,
                                state_idx: int = 0, conv_kernel_size: Optional[int] = None
                                ) -> None:
            views = self._views()
            if conv_states is not None:
                conv = views["conv"]
                self.dtype, self.device = conv.dtype, conv.device
                self.conv_kernel_size[state_idx] = conv.shape[-1]
                self.conv_states[state_idx] = conv
                self.is_conv_states_initialized[state_idx] = True
            if recurrent_states is not None:
                if "ssm" not in views:
                    raise ValueError(f"layer {self.layer} hands a recurrent state but its "
                                     "layout declares only a conv state")
                self.recurrent_states[state_idx] = views["ssm"]
                self.is_recurrent_states_initialized[state_idx] = True

        def sync(self) -> None:
            """Before the layer's first call: rows that already hold a state (a prefix the
            store loaded) hand it to the model as its previous state."""
            if self.is_conv_states_initialized[0] or not self.state.loaded:
                return
            views = self._views()
            conv = views["conv"]
            self.dtype, self.device = conv.dtype, conv.device
            self.conv_kernel_size[0] = conv.shape[-1]
            self.conv_states[0] = conv
            self.is_conv_states_initialized[0] = True
            if "ssm" in views:
                self.recurrent_states[0] = views["ssm"]
                self.is_recurrent_states_initialized[0] = True
            self.has_previous_state[0] = True


    return NumbakvRecurrentLayer


class RecurrentStateCalls:
    """The linear-attention calls of transformers' ``Cache`` (``get_conv_state``, ...) that
    first begin the pass the forward pre-hook saw start (:func:`begin_passes_in_a_hook`): in
    most hybrids a recurrent layer is the first to touch the cache, before any attention layer
    could say how many tokens the pass has. Mixed into a generation cache's class; the class
    sets ``_numbakv_state``."""

    _numbakv_state: Any = None

    def _begun(self, layer_idx: Optional[int] = None) -> None:
        if self._numbakv_state is not None:
            self._numbakv_state.ensure_begun()
        if layer_idx is not None and 0 <= layer_idx < len(self.layers):
            sync = getattr(self.layers[layer_idx], "sync", None)
            if sync is not None:
                sync()

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        self._begun(layer_idx)
        return super().get_conv_state(layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        self._begun(layer_idx)
        return super().get_recurrent_state(layer_idx, state_idx)

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, **kwargs):
        self._begun(layer_idx)
        return super().update_conv_state(conv_states, layer_idx, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0,
                               **kwargs):
        self._begun(layer_idx)
        return super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)

    def has_previous_state(self, layer_idx: Optional[int] = None,
                           state_idx: Optional[int] = None) -> bool:
        self._begun(layer_idx)
        return super().has_previous_state(layer_idx, state_idx)


def begin_passes_in_a_hook(model: Any, cache_obj: Any, state: Any) -> None:
    """Note every forward pass of ``model`` that runs with ``cache_obj`` (a forward pre-hook
    reads the batch and token count from ``input_ids`` / ``inputs_embeds`` into
    ``state.pending``); the pass begins at the first cache call of a layer (after the model
    computed its masks, which the pass needs). The hook goes when ``cache_obj`` does."""
    import weakref
    ref = weakref.ref(cache_obj)

    def hook(module, args, kwargs):
        cache = ref()
        if cache is None:
            return None
        given = kwargs.get("cache", kwargs.get("past_key_values"))
        if given is not cache:
            return None
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None and args:
            ids = args[0]
        state.pending = (int(ids.shape[0]), int(ids.shape[1]))
        return None

    def after(module, args, kwargs, output):
        # a model whose last layers are recurrent ends its pass here (no cache call follows a
        # recurrent layer's in-place decode update): the store's saves see every layer's state
        cache = ref()
        if cache is not None and kwargs.get("cache", kwargs.get("past_key_values")) is cache \
                and state.last_attention < 0:
            state.end_pass()
        return None

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    weakref.finalize(cache_obj, handle.remove)
    done = model.register_forward_hook(after, with_kwargs=True)
    weakref.finalize(cache_obj, done.remove)


__all__ = ["StateRows", "plan_groups", "run_packed", "RecurrentBinding", "mixer_modules",
           "generation_layer_class", "begin_passes_in_a_hook", "recurrent_half",
           "RecurrentStateCalls"]
