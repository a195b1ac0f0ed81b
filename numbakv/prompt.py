"""``PromptCache``: the slot logic of Ollama's runner (``runner/ollamarunner/cache.go``'s
``InputCache``) over any numbakv cache, so a Python engine reuses cached prompts as Ollama does.

A *slot* is one of the cache's sequences (ids ``[0, max_seqs)``); the prompt cache remembers which
inputs (token ids, or any hashable input such as an image hash) each slot's sequence holds, at
positions ``0 .. len(inputs) - 1``. For each incoming prompt it

* picks a slot: the unused one with the longest common prefix (single user), or Ollama's
  ``findBestCacheSlot`` (``multi_user=True``): the longest prefix over *all* slots; that slot is
  used when its whole content is the prefix and it is free, else the least recently used free
  slot is taken and the prefix is forked into it with ``copy_prefix`` (shared cells, no copy);
* keeps one input to evaluate when the prompt is fully cached (the engine needs logits);
* starts from 0 when ``can_resume`` says a sliding window no longer covers the prefix;
* removes what the slot holds past the reused prefix (emptying the slot when that fails).

It also runs Ollama's context shift (``shift_discard`` / ``shift``: drop the oldest half of the
history after ``num_keep`` inputs, the later keys re-rotated by the cache) and saves / loads a
slot with its inputs so a conversation survives a restart.

Calls that change what the cache holds (``load``, ``shift``, ``load_slot``) run sequence
operations, which end the forward pass in progress: call them between forward passes, then
``start_forward`` the remaining inputs at positions ``len(pc.inputs(slot))`` onwards, and record
them with ``extend`` once evaluated.

The prompt cache knows its cache only through the public cache API (``remove``, ``copy_prefix``,
``can_resume``, ``seq_pos_max``, ``config.capacity`` / ``config.max_seqs`` and the state calls), so
it works over ``CausalCache``, ``WrapperCache`` and stream caches alike.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ._inputs import check_index as _check_index
from .errors import KVCacheError, NoSlotError, ReprocessError, StateError


def common_prefix_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """How many leading inputs ``a`` and ``b`` share (Ollama's ``countCommonPrefix``)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class SlotState:
    """What the prompt cache knows of one slot: the inputs its sequence holds (position ``i``
    holds ``inputs[i]``), whether a request is using it, and when it was last used (the
    ``clock``'s time; ``-inf``: never)."""

    slot: int
    inputs: List[Hashable] = field(default_factory=list)
    in_use: bool = False
    last_used: float = -math.inf


@dataclass(frozen=True)
class LoadInfo:
    """What the last ``load`` did: the slot it picked, how many leading inputs it reused from the
    cache, the slot a prefix was forked from with ``copy_prefix`` (``None``: no fork in effect)
    and how many inputs the slot held before (``evicted``: those it dropped)."""

    slot: int
    reused: int
    forked_from: Optional[int]
    held: int
    evicted: int


@dataclass
class PromptStats:
    """Running totals: prompts loaded, prompt inputs reused from the cache vs returned to be
    evaluated, forks, context shifts (inputs discarded) and refused shifts (inputs returned for
    reprocessing)."""

    loads: int = 0
    reused: int = 0
    evaluated: int = 0
    forks: int = 0
    shifts: int = 0
    discarded: int = 0
    reprocessed: int = 0
    store_reused: int = 0


def _check_inputs(name: str, inputs, allow_empty: bool) -> List[Hashable]:
    """``inputs`` as a list of hashable items (numpy integers kept as Python ints)."""
    if isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__len__") \
            or not hasattr(inputs, "__getitem__"):
        raise ValueError(f"{name} must be a sequence of hashable inputs (token ids), got "
                         f"{type(inputs).__name__}")
    if isinstance(inputs, np.ndarray):
        if inputs.ndim != 1 or (inputs.size and inputs.dtype.kind not in "iu"):
            raise ValueError(f"{name} must be a 1-D integer array, got shape {inputs.shape} "
                             f"dtype {inputs.dtype}")
        out = inputs.tolist()
    else:
        out = list(inputs)
        for i, item in enumerate(out):
            if isinstance(item, np.integer):
                out[i] = int(item)
                continue
            try:
                hash(item)
            except TypeError:
                raise ValueError(f"{name}[{i}] must be hashable (a token id or an input's "
                                 f"hash), got {type(item).__name__}") from None
    if not out and not allow_empty:
        raise ValueError(f"{name} must hold at least one input")
    return out


def _all_token_ids(inputs: Sequence[Hashable]) -> bool:
    """Whether every input is a non-negative integer token id (what a prefix store keys)."""
    return all(type(t) is int and t >= 0 for t in inputs)


def _geometry(cache) -> Tuple[int, int]:
    """``(max_seqs, num_ctx)`` of ``cache``: its config's, or for a cache of caches
    (``WrapperCache``) the shared ``max_seqs`` and the smallest ``capacity``."""
    config = getattr(cache, "config", None)
    if config is not None and hasattr(config, "capacity") and hasattr(config, "max_seqs"):
        return int(config.max_seqs), int(config.capacity)
    caches = getattr(cache, "caches", None)
    if caches:
        configs = [getattr(c, "config", None) for c in caches]
        if all(c is not None and hasattr(c, "capacity") for c in configs):
            return int(configs[0].max_seqs), min(int(c.capacity) for c in configs)
    raise ValueError("cache must be a numbakv cache with a config (CausalCache, WrapperCache or "
                     f"a stream cache), got {type(cache).__name__}")


class PromptCache:
    """Ollama runner's input cache over ``cache``: one slot per sequence of the cache.

    Args:
        cache: a ``CausalCache``, ``WrapperCache`` or stream cache; ``config.max_seqs`` slots of
            ``config.capacity`` inputs each (``num_ctx``).
        multi_user: pick slots as Ollama does with ``OLLAMA_MULTIUSER_CACHE`` (forks a shared
            prefix into the least recently used slot) instead of the longest free prefix.
        clock: returns the current time as a number; ``release`` and ``load`` record it, and
            the least recently used slot is the one with the smallest time.
        store: a ``numbakv.PrefixStore`` of ``cache``: ``load`` takes the store's prefix when it
            is longer than the best slot's common prefix, ``release`` saves the slot's prefix
            into it. The store's ``retain_seqs`` are never slots.
    """

    _REQUIRED = ("remove", "copy_prefix", "can_resume", "seq_pos_max")

    def __init__(self, cache, *, multi_user: bool = False,
                 clock: Callable[[], float] = time.monotonic, store=None) -> None:
        missing = [name for name in self._REQUIRED if not callable(getattr(cache, name, None))]
        if missing:
            raise ValueError(f"cache must offer {', '.join(self._REQUIRED)}; "
                             f"{type(cache).__name__} lacks {', '.join(missing)}")
        if not isinstance(multi_user, (bool, np.bool_)):
            raise ValueError(f"multi_user must be a bool, got {multi_user!r}")
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning the time, got {clock!r}")
        if store is not None:
            # duck-typed: prefix/ is an outer layer of prompt.py (DESIGN's table)
            if not all(callable(getattr(store, n, None)) for n in ("match", "load", "save")) \
                    or not hasattr(store, "retain_seqs"):
                raise ValueError(f"store must be a numbakv.PrefixStore or None, got "
                                 f"{type(store).__name__}")
            if store.cache is not cache:
                raise ValueError("store must be a PrefixStore of this cache (PrefixStore(cache, "
                                 "...)); it was made for another cache")
        self.num_slots, self.num_ctx = _geometry(cache)
        self.cache = cache
        #: the prefix store slots load from and release into (None: slots only)
        self.store = store
        #: sequences the store keeps prefixes in: never a slot
        self._reserved = frozenset(store.retain_seqs) if store is not None else frozenset()
        self.multi_user = bool(multi_user)
        self.clock = clock
        self.slots: List[SlotState] = [SlotState(i) for i in range(self.num_slots)]
        self.stats = PromptStats()
        self.last_load: Optional[LoadInfo] = None

    # ------------------------------------------------------------------ slot choice
    def find_longest_slot(self, prompt: Sequence[Hashable]) -> Tuple[int, int]:
        """Single-user choice: ``(slot, prefix length)`` of the free slot sharing the longest
        prefix with ``prompt`` (the lowest id on ties). Raises ``NoSlotError``. Changes
        nothing."""
        best, best_len = -1, -1
        for s in self.slots:
            if s.in_use or s.slot in self._reserved:
                continue
            n = common_prefix_length(s.inputs, prompt)
            if n > best_len:
                best, best_len = s.slot, n
        if best < 0:
            raise NoSlotError(f"every slot of the prompt cache ({self.num_slots}) is in use")
        return best, best_len

    def find_best_slot(self, prompt: Sequence[Hashable]) -> Tuple[int, int, Optional[int]]:
        """Multi-user choice (Ollama's ``findBestCacheSlot``): ``(slot, prefix length, fork
        source)``. The longest prefix over every slot, in use or not; when that slot's whole
        content is the prefix and it is free, it is the answer. Otherwise the least recently used
        free slot is, and the prefix (if any) is to be forked into it from the source slot
        (``None``: nothing to fork). Raises ``NoSlotError``. Changes nothing."""
        longest, longest_len = -1, -1
        oldest = -1
        for s in self.slots:
            if s.slot in self._reserved:
                continue
            n = common_prefix_length(s.inputs, prompt)
            if n > longest_len:
                longest, longest_len = s.slot, n
            if not s.in_use and (oldest < 0 or s.last_used < self.slots[oldest].last_used):
                oldest = s.slot
        src = self.slots[longest]
        if longest_len == len(src.inputs) and not src.in_use:
            return longest, longest_len, None
        if oldest < 0:
            raise NoSlotError(f"every slot of the prompt cache ({self.num_slots}) is in use")
        fork = longest if longest_len > 0 and longest != oldest else None
        return oldest, longest_len, fork

    def load(self, prompt: Sequence[Hashable], cache_prompt: bool = True) -> Tuple[int, list]:
        """Take a slot for ``prompt`` (Ollama's ``LoadCacheSlot``) and return ``(slot,
        remaining)``: the inputs still to evaluate, at positions ``len(prompt) -
        len(remaining)`` onwards. The slot's sequence then holds exactly the reused prefix
        (forked from another slot with ``copy_prefix`` when ``multi_user`` chose so); at least
        one input always remains. ``cache_prompt=False`` reuses nothing. The slot is marked in
        use until ``release``. Raises ``NoSlotError`` when every slot is in use (nothing
        changed)."""
        prompt = _check_inputs("prompt", prompt, allow_empty=False)
        if not isinstance(cache_prompt, (bool, np.bool_)):
            raise ValueError(f"cache_prompt must be a bool, got {cache_prompt!r}")
        if self.multi_user:
            slot, num_past, fork = self.find_best_slot(prompt)
        else:
            (slot, num_past), fork = self.find_longest_slot(prompt), None
        state = self.slots[slot]
        held = len(state.inputs)
        if self.store is not None and cache_prompt and len(prompt) > 1 \
                and _all_token_ids(prompt):
            # the store's prefix (keeping one input to evaluate) beats the slots' best? (a
            # slot prefix a sliding window no longer covers counts as none)
            usable = min(num_past, len(prompt) - 1)
            if usable > 0 and not self.cache.can_resume(slot, usable):
                usable = 0
            if self.store.match(prompt[:-1]) > usable:
                return self._load_from_store(state, prompt, held)
        if fork is not None:
            # Share the source's first num_past cells; the slot now holds that prefix.
            try:
                self.cache.copy_prefix(fork, slot, num_past)
            except KVCacheError:
                # A cache that cannot share cells between these sequences (e.g. separate
                # streams): no fork, the slot keeps what it has in common with the prompt.
                fork = None
                num_past = common_prefix_length(state.inputs, prompt)
            else:
                state.inputs = self.slots[fork].inputs[:num_past]
                self.stats.forks += 1
        if not cache_prompt:
            num_past = 0
        state.in_use = True
        state.last_used = self.clock()
        if num_past == len(prompt):
            num_past -= 1  # leave one input to evaluate, so the caller gets its logits
        if num_past > 0 and not self.cache.can_resume(slot, num_past):
            num_past = 0  # a sliding window no longer covers the prefix
        try:
            self.cache.remove(slot, num_past, None)
        except KVCacheError:
            # Some caches cannot drop a suffix (e.g. a shared cell would have to move): start
            # over from an empty slot.
            num_past = 0
            try:
                self.cache.remove(slot, 0, None)
            except BaseException:
                state.inputs = []
                state.in_use = False
                raise
        state.inputs = prompt[:num_past]
        remaining = prompt[num_past:]
        self.stats.loads += 1
        self.stats.reused += num_past
        self.stats.evaluated += len(remaining)
        self.last_load = LoadInfo(slot, num_past, fork if num_past > 0 else None, held,
                                  max(0, held - num_past) if fork is None else held)
        return slot, remaining

    def _load_from_store(self, state: SlotState, prompt: list, held: int) -> Tuple[int, list]:
        """``load`` through the prefix store: empty the slot, load the store's longest prefix
        of ``prompt[:-1]`` into it (one input is left to evaluate)."""
        self.cache.remove(state.slot, 0, None)
        state.inputs = []
        state.in_use = True
        state.last_used = self.clock()
        try:
            n = self.store.load(state.slot, prompt[:-1])
        except BaseException:
            state.in_use = False
            raise
        state.inputs = prompt[:n]
        remaining = prompt[n:]
        self.stats.loads += 1
        self.stats.reused += n
        self.stats.store_reused += n
        self.stats.evaluated += len(remaining)
        self.last_load = LoadInfo(state.slot, n, None, held, held)
        return state.slot, remaining

    # ------------------------------------------------------------------ per slot
    def extend(self, slot: int, inputs: Sequence[Hashable]) -> None:
        """Record that ``inputs`` were (or are being) evaluated into ``slot``'s sequence, at
        positions ``len(self.inputs(slot))`` onwards. Bookkeeping only, as Ollama's runner
        appends to a slot's inputs while it builds a batch; ``save_slot`` checks the record
        against what the cache holds."""
        state = self._slot(slot, in_use=True)
        inputs = _check_inputs("inputs", inputs, allow_empty=True)
        state.inputs.extend(inputs)

    def inputs(self, slot: int) -> list:
        """A copy of the inputs ``slot``'s sequence holds (position ``i`` holds item ``i``)."""
        return list(self._slot(slot).inputs)

    def in_use(self, slot: int) -> bool:
        """Whether ``slot`` is serving a prompt (between ``load`` and ``release``)."""
        return self._slot(slot).in_use

    def release(self, slot: int, *, evaluated: Optional[int] = None) -> None:
        """The request using ``slot`` is done: the slot becomes free (its inputs stay cached for
        later prompts) and its last-used time is the clock's now. With a store, what the slot
        holds is saved to it, so a later prompt (the retry of a cancelled request too) reuses
        it.

        ``evaluated``: how many of the slot's inputs have their K/V complete in every layer
        (a request cancelled mid-prefill: the batch in flight may be half written). The slot
        then keeps (and the store saves) only ``inputs[:evaluated]``; the positions after it
        are removed from the sequence. None: every recorded input the sequence holds."""
        state = self._slot(slot, in_use=True)
        if evaluated is not None:
            if isinstance(evaluated, (bool, np.bool_)) or not isinstance(
                    evaluated, (int, np.integer)) or not 0 <= int(evaluated) <= len(state.inputs):
                raise ValueError(f"evaluated must be an integer in [0, {len(state.inputs)}] (the "
                                 f"inputs slot {state.slot} records), got {evaluated!r}")
            evaluated = int(evaluated)
            held = self.cache.seq_pos_max(state.slot) + 1
            if evaluated > held:
                raise ValueError(f"evaluated={evaluated} but slot {state.slot}'s sequence holds "
                                 f"only {held} positions")
            if held > evaluated:
                self.cache.seq_rm(state.slot, evaluated, None)
            del state.inputs[evaluated:]
        state.in_use = False
        state.last_used = self.clock()
        if self.store is not None and state.inputs:
            # what the slot's sequence holds (a caller may have recorded inputs it has not
            # evaluated yet: only the evaluated ones are saved)
            n = min(len(state.inputs), self.cache.seq_pos_max(state.slot) + 1)
            if n > 0 and _all_token_ids(state.inputs[:n]):
                self.store.save(state.slot, state.inputs[:n])

    def cancel(self, slot: int, evaluated: int) -> None:
        """A request cancelled after ``evaluated`` of its slot's inputs were prefilled (their
        K/V complete in every layer): ``release(slot, evaluated=evaluated)``. The prefilled
        part stays in the slot and, with a store, is saved to it, so the retry reuses it."""
        self.release(slot, evaluated=evaluated)

    # ------------------------------------------------------------------ context shift
    def shift_discard(self, n_inputs: int, num_keep: int) -> int:
        """How many inputs a context shift of a slot holding ``n_inputs`` discards after the
        first ``num_keep`` (Ollama's ``ShiftDiscard``, without same-batch groups): enough that
        ``max((num_ctx - num_keep) // 2, 1)`` positions are free afterwards."""
        n_inputs = _check_index("n_inputs", n_inputs, 0)
        num_keep = self._check_keep(num_keep)
        target_free = max((self.num_ctx - num_keep) // 2, 1)
        current_free = self.num_ctx - n_inputs
        return max(0, min(target_free - current_free, n_inputs - num_keep))

    def shift(self, slot: int, num_keep: int) -> int:
        """Context shift of ``slot`` (Ollama's ``ShiftCacheSlot``): remove positions
        ``[num_keep, num_keep + discard)`` through the cache (later keys move down and are
        re-rotated) and drop those inputs. Returns ``discard`` (0: nothing to do).

        If the cache refuses (``NotSupportedError``: no shift function, or cells shared with
        another sequence would move; ``KVCacheFullError``: with ``shared_shift="copy"``, no room
        for the forked slot's own copies of the shared cells), the slot is emptied and
        ``ReprocessError`` is raised with ``inputs`` = the kept inputs, to evaluate again from
        position 0. A cache built with ``shared_shift="copy"`` shifts forked slots whose shared
        prefix reaches past ``num_keep``."""
        state = self._slot(slot)
        num_keep = self._check_keep(num_keep)
        discard = self.shift_discard(len(state.inputs), num_keep)
        if discard <= 0:
            return 0
        kept = state.inputs[:num_keep] + state.inputs[num_keep + discard:]
        try:
            self.cache.remove(state.slot, num_keep, num_keep + discard)
        except KVCacheError as exc:
            try:
                self.cache.remove(state.slot, 0, None)
            finally:
                state.inputs = []
            self.stats.reprocessed += len(kept)
            raise ReprocessError(f"the cache cannot shift slot {state.slot} ({exc}); it was "
                                 f"emptied and its {len(kept)} kept inputs need evaluating "
                                 "again", inputs=kept) from exc
        state.inputs = kept
        self.stats.shifts += 1
        self.stats.discarded += discard
        return discard

    # ------------------------------------------------------------------ state
    def save_slot(self, slot: int, path: Union[str, "os.PathLike[str]"], *,
                  metadata: Optional[Mapping[str, str]] = None) -> None:
        """Save ``slot``'s sequence and its inputs (as ``tokens``) to a safetensors file, so
        ``load_slot`` brings the conversation back (after a restart too). The inputs must be
        integer token ids."""
        tokens = self._tokens_to_save(slot)
        if callable(getattr(self.cache, "save_state", None)):
            self.cache.save_state(path, slot, tokens=tokens, metadata=metadata)
        else:
            from . import state as state_io
            state_io.save(self.cache, path, slot, tokens=tokens, metadata=metadata)

    def slot_bytes(self, slot: int, *, metadata: Optional[Mapping[str, str]] = None) -> bytes:
        """What ``save_slot`` writes, as bytes."""
        tokens = self._tokens_to_save(slot)
        if callable(getattr(self.cache, "state_bytes", None)):
            return self.cache.state_bytes(slot, tokens=tokens, metadata=metadata)
        from . import state as state_io
        return state_io.to_bytes(self.cache, slot, tokens=tokens, metadata=metadata)

    def load_slot(self, source: Union[str, "os.PathLike[str]", bytes],
                  slot: Optional[int] = None) -> int:
        """Load a slot saved by ``save_slot`` / ``slot_bytes`` (a path, or bytes) into ``slot``
        (``None``: the least recently used free slot), replacing what it held; its inputs become
        the saved tokens, so later prompts are prefix-matched against them. The slot stays free.
        Returns the slot. Raises ``NoSlotError`` (no free slot), ``ValueError`` (slot in use) or
        ``StateError`` (no tokens saved, or they do not match the saved positions)."""
        from . import state as state_io
        if not isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
            raise ValueError(f"source must be a path or bytes (save_slot / slot_bytes output), "
                             f"got {type(source).__name__}")
        if slot is None:
            free = [s for s in self.slots if not s.in_use]
            if not free:
                raise NoSlotError(f"every slot of the prompt cache ({self.num_slots}) is in use")
            target = min(free, key=lambda s: s.last_used)
        else:
            target = self._slot(slot)
            if target.in_use:
                raise ValueError(f"slot {target.slot} is in use: release it before loading "
                                 "into it")
        if isinstance(source, (bytearray, memoryview)):
            source = bytes(source)
        info = state_io.read_info(source, verify=False)
        tokens = info.get("tokens")
        if tokens is None:
            raise StateError("the state holds no tokens: save it with PromptCache.save_slot "
                             "(or save_state(..., tokens=inputs))")
        if not str(info.get("kind", "")).endswith("-seq"):
            raise StateError(f"the state holds a whole cache (kind {info.get('kind')!r}), not "
                             "one slot's sequence")
        if isinstance(source, bytes):
            loader = getattr(self.cache, "load_state_bytes", None)
        else:
            loader = getattr(self.cache, "load_state", None)
        if callable(loader):
            loader(source, target.slot)
        else:
            state_io.load(source, self.cache, target.slot)
        held = self.cache.seq_pos_max(target.slot) + 1
        if held != len(tokens):
            self.cache.remove(target.slot, 0, None)
            target.inputs = []
            raise StateError(f"the state holds {len(tokens)} tokens but positions up to "
                             f"{held - 1}: its tokens do not describe its sequence")
        target.inputs = [int(t) for t in tokens]
        target.last_used = self.clock()
        return target.slot

    # ------------------------------------------------------------------ helpers
    def _slot(self, slot, in_use: Optional[bool] = None) -> SlotState:
        state = self.slots[_check_index("slot", slot, 0, self.num_slots)]
        if in_use and not state.in_use:
            raise ValueError(f"slot {state.slot} is not in use: take it with load() first")
        return state

    def _check_keep(self, num_keep) -> int:
        num_keep = _check_index("num_keep", num_keep, 0)
        if num_keep >= self.num_ctx:
            raise ValueError(f"num_keep must be < the context size num_ctx ({self.num_ctx}), got "
                             f"{num_keep}: nothing would be left to discard")
        return num_keep

    def _tokens_to_save(self, slot) -> List[int]:
        state = self._slot(slot)
        for i, item in enumerate(state.inputs):
            if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, np.integer)):
                raise ValueError(f"slot {state.slot}'s inputs must be integer token ids to be "
                                 f"saved; inputs[{i}] is {item!r}")
        held = self.cache.seq_pos_max(state.slot) + 1
        if held != len(state.inputs):
            raise ValueError(f"slot {state.slot} records {len(state.inputs)} inputs but its "
                             f"sequence holds positions up to {held - 1}: extend() the slot with "
                             "what was evaluated before saving it")
        return [int(t) for t in state.inputs]

    def __repr__(self) -> str:
        used = sum(s.in_use for s in self.slots)
        return (f"PromptCache(slots={self.num_slots}, in_use={used}, num_ctx={self.num_ctx}, "
                f"multi_user={self.multi_user})")


__all__ = ["PromptCache", "SlotState", "LoadInfo", "PromptStats", "common_prefix_length"]
