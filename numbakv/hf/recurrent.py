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


def plan_groups(positions: np.ndarray, seqs: np.ndarray, first_of: Callable[[int], int]
                ) -> Tuple[List[Tuple[int, int]], List[Tuple[int, np.ndarray, int]]]:
    """Split a packed batch by sequence.

    Args:
        positions, seqs: ``[batch]`` as given to ``start_forward``.
        first_of: ``seq -> `` the first position its state has not seen (the state covers
            positions before it; 0 for a sequence without state).

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
        start = first_of(seq)
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
               keep: Optional[Callable[[int, int, Any, Any], None]] = None):
    """One recurrent mixer over a packed batch.

    Args:
        forward: the mixer's own ``forward(hidden_states, cache=..., attention_mask=None)``.
        hidden: ``[1, tokens, hidden]``.
        decodes: ``[(seq, batch index)]`` (see :func:`plan_groups`): run as one batch.
        chunks: ``[(seq, batch indices, first position, cuts)]``: each run on its own, split
            at ``cuts`` (offsets into the chunk, ascending, ``0 < cut < len``) so that
            ``keep(seq, position, conv, ssm)`` receives the state at each cut (copies).
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
            pieces.append(forward(part[:, a:b], cache=state, attention_mask=None))
            if keep is not None and b < len(idx):
                keep(seq, start + b, state.conv[0].clone(),
                     None if state.ssm is None else state.ssm[0].clone())
        done()
        res = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        out[0].index_copy_(0, where, res[0].to(out.dtype))
    return out


__all__ = ["StateRows", "plan_groups", "run_packed"]
