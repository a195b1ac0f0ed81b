"""Edit-tolerant reuse for agent prompts (``PrefixStore.match_edit`` / ``load_edit``).

An agent client rewrites its own prompt between turns: it strips earlier reasoning, swaps the
tool list, drops a cancelled tool call. The new prompt then equals a stored one up to the edit
(the ordinary prefix match) and again after it, shifted by the edit's change in length. The
stored K/V of that suffix can be moved to its new positions (keys re-rotated by the cache's
shift, ``import_seq(at=...)``) instead of being computed again.

This is an approximation, and the API says so: a suffix token's K/V was computed while it
attended to the OLD tokens of the edited range. As CacheBlend / LegoLink do, the caller
recomputes the edited tokens plus the first ``recompute_after`` tokens after the edit (where the
old context weighs most) and keeps the rest as stored (:attr:`EditMatch.approximated`).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import numpy as np

_TOKEN = 8   # bytes per token id in the store's int64-LE prompt buffers

Range = Tuple[int, int]


class EditMatch(NamedTuple):
    """What ``PrefixStore.match_edit`` found for a prompt.

    Attributes:
        prefix: tokens of the prompt the store serves exactly (``match``).
        suffix_src: ``(a, b)``: positions of the stored prompt whose K/V are re-used after the
            edit (``None``: no suffix; the load is a plain prefix load).
        suffix_dst: ``(a', b')``: where that suffix sits in the new prompt (same length).
        recompute: ranges ``[(a, b)]`` of new-prompt positions the caller must compute before
            continuing from ``suffix_dst[1]``: the edited tokens and the first
            ``recompute_after`` tokens of the moved suffix. Empty for a plain prefix load.
        approximated: ``(a, b)``: new-prompt positions whose K/V are taken from the stored
            prompt without recomputation (their attention saw the pre-edit tokens); ``None``
            when nothing was approximated.
    """

    prefix: int
    suffix_src: Optional[Range] = None
    suffix_dst: Optional[Range] = None
    recompute: List[Range] = []
    approximated: Optional[Range] = None

    @property
    def end(self) -> int:
        """Where the caller's prefill continues after loading: the end of the moved suffix,
        else the prefix."""
        return self.suffix_dst[1] if self.suffix_dst is not None else self.prefix


def find_suffix(stored: bytes, prompt: bytes, prefix: int, anchor: int,
                tries: int = 4) -> Optional[Tuple[Range, Range]]:
    """The longest run of ``stored`` after ``prefix`` (token ids, int64-LE bytes) that occurs
    again in ``prompt`` after ``prefix``: ``((a, b), (a', b'))`` with ``stored[a:b] ==
    prompt[a':b']``, or None.

    The run is found from an ``anchor``-token block: first the stored prompt's last block
    (the usual agent shape: the edit, then everything the stored prompt had, then the new
    turn), then blocks ending earlier (a stored tail the new prompt dropped); each found block
    is extended both ways as far as the tokens agree. O(prompt) per try (``bytes.find``)."""
    n_s, n_q = len(stored) // _TOKEN, len(prompt) // _TOKEN
    if n_s - prefix < 1 or n_q - prefix < 1:
        return None
    s = np.frombuffer(stored, dtype="<i8")
    q = np.frombuffer(prompt, dtype="<i8")
    best = None
    end = n_s
    for _ in range(tries):
        width = min(anchor, end - prefix)
        if width < 1:
            break
        block = stored[_TOKEN * (end - width):_TOKEN * end]
        at = prompt.find(block, _TOKEN * prefix)
        while at >= 0 and at % _TOKEN:
            at = prompt.find(block, at + 1)
        if at >= 0:
            i0, j0 = end - width, at // _TOKEN
            # extend back while both sides stay after the prefix and agree
            k = min(i0 - prefix, j0 - prefix)
            if k > 0:
                same = s[i0 - k:i0][::-1] == q[j0 - k:j0][::-1]
                back = k if same.all() else int(np.argmin(same))
                i0, j0 = i0 - back, j0 - back
            i1, j1 = end, at // _TOKEN + width
            k = min(n_s - i1, n_q - j1)
            if k > 0:
                same = s[i1:i1 + k] == q[j1:j1 + k]
                fwd = k if same.all() else int(np.argmin(same))
                i1, j1 = i1 + fwd, j1 + fwd
            if best is None or i1 - i0 > best[0][1] - best[0][0]:
                best = ((i0, i1), (j0, j1))
            if i1 - i0 >= (end - prefix) // 2:
                break      # an earlier anchor cannot find a longer run
        end = prefix + (end - prefix) // 2
    return best


def plan(prefix: int, found: Optional[Tuple[Range, Range]], recompute_after: int) -> EditMatch:
    """The :class:`EditMatch` for a found suffix: recompute ``[prefix, a' + recompute_after)``,
    re-use the rest of the suffix. A plain prefix match when nothing would be re-used (no
    suffix, or one no longer than ``recompute_after``)."""
    if found is None:
        return EditMatch(prefix, recompute=[])
    (a, b), (a2, b2) = found
    if a2 < prefix:               # the run's head is inside the exact prefix already
        a, a2 = a + prefix - a2, prefix
    keep = a2 + recompute_after
    if keep >= b2 or a >= b:
        return EditMatch(prefix, recompute=[])
    return EditMatch(prefix, (a, b), (a2, b2), [(prefix, keep)], (keep, b2))
