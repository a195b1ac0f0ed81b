"""PromptCache: the cases of Ollama's runner/ollamarunner/cache_test.go that fit numbakv's contract
(each with its expected slot and prefix length), checked on a real cache, plus what the cache
itself must show afterwards, the state round trip, and a randomized serving run verified against
a recomputation without the cache (the demo's verification)."""

import math
from dataclasses import dataclass

import numpy as np
import pytest

import numbakv as nkv
from numbakv.prompt import PromptCache, common_prefix_length

from helpers import dev

NOW = 1000.0


class Clock:
    """An injected clock: ``now`` is what it returns."""

    def __init__(self, now=NOW):
        self.now = now

    def __call__(self):
        return self.now


def make_cache(max_seqs=2, capacity=16, shift="rope", device="cpu", **kw):
    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=1, head_dim=8, dtype="float32",
                          capacity=capacity, max_seqs=max_seqs, max_batch=capacity, device=device)
    return nkv.CausalCache(cfg, shift=nkv.RopeShift() if shift == "rope" else shift, **kw)


def token_kv(tokens, positions, head_dim=8):
    """Keys roped at ``positions`` (NeoX pairs, base 10000) and values, both a function of the
    token id only: what a model would store for ``tokens``. ``[n, 1, head_dim]`` each."""
    tokens = np.asarray(tokens, np.float64)
    base = np.sin(np.outer(tokens + 1.0, np.arange(1, head_dim + 1)))      # [n, hd]
    half = head_dim // 2
    ang = np.asarray(positions, np.float64)[:, None] * 10000.0 ** (-np.arange(half) * 2 / head_dim)
    a, b = base[:, :half], base[:, half:]
    key = np.concatenate([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)], 1)
    value = np.cos(np.outer(tokens + 1.0, np.arange(1, head_dim + 1)))
    return key[:, None, :].astype(np.float32), value[:, None, :].astype(np.float32)


def evaluate(cache, slot, start, tokens):
    """Store ``tokens`` into ``slot`` at positions ``start..`` (a forward pass without a
    model: every layer stores ``token_kv``)."""
    tokens = list(tokens)
    if not tokens:
        return
    positions = np.arange(start, start + len(tokens))
    cache.start_forward(positions, [slot] * len(tokens))
    where = cache.caches[0].device if isinstance(cache, nkv.WrapperCache) else cache.device
    key, value = (dev(x, where) for x in token_kv(tokens, positions))
    for layer in range(2):
        cache.set_layer(layer)
        cache.put(key, value)


def seed_slot(pc, slot, inputs, in_use=False, last_used=-math.inf):
    """Put a slot in the state an Ollama test case describes: its sequence holds ``inputs``."""
    evaluate(pc.cache, slot, 0, inputs)
    state = pc.slots[slot]
    state.inputs = list(inputs)
    state.in_use = in_use
    state.last_used = last_used


def seq_keys(cache, seq, layer=0):
    """``{position: key}`` of what ``seq`` holds in ``layer``, read through the public state API
    (a saved sequence lists its positions and keys in position order)."""
    from safetensors.numpy import load
    tensors = load(cache.state_bytes(seq))
    return {int(p): k for p, k in zip(tensors["positions"], tensors[f"k.{layer}"])}


def assert_holds(cache, seq, tokens):
    """``seq`` holds exactly positions ``0..len(tokens)-1`` with the K of ``tokens`` there."""
    got = seq_keys(cache, seq)
    assert sorted(got) == list(range(len(tokens)))
    if tokens:
        key, _ = token_kv(tokens, np.arange(len(tokens)))
        np.testing.assert_allclose(np.stack([got[p] for p in range(len(tokens))]), key,
                                   atol=2e-6)


# ------------------------------------------------------------------ TestCountCommon
@dataclass(frozen=True)
class Input:
    """Ollama's input.Input: a token, or a multimodal input known by its hash."""

    token: int = 0
    mm_hash: int = 0


@pytest.mark.parametrize("a,b,expected", [
    ([Input(1), Input(2), Input(3)], [Input(1), Input(2), Input(3)], 3),        # Equal
    ([Input(1)], [Input(1), Input(2), Input(3)], 1),                            # Prefix
    ([Input(mm_hash=1)], [Input(mm_hash=1), Input(mm_hash=2), Input(mm_hash=3)], 1),  # Image
    ([Input(1), Input(mm_hash=1)], [Input(1), Input(mm_hash=1), Input(5)], 2),  # Mixed
    ([Input(1), Input(mm_hash=1)], [Input(1), Input(mm_hash=2)], 1),            # Mixed, same len
    ([], [Input(1), Input(2), Input(3)], 0),                                    # Empty
    ([], [], 0),                                                                # Both empty
], ids=["equal", "prefix", "image-prefix", "mixed", "mixed-same-length", "empty", "both-empty"])
def test_count_common(a, b, expected):
    assert common_prefix_length(a, b) == expected
    assert common_prefix_length(b, a) == expected


# ------------------------------------------------------------------ TestFindCacheSlot
# (slot 0 state, slot 1 state, prompt, longest -> (slot, len), best -> (slot, len, fork source))
# each state: (inputs, in_use, last_used)
FIND_CASES = {
    "empty": (([], False, -math.inf), ([], False, -math.inf), [1], (0, 0), (0, 0, None)),
    "extend": (([1], False, NOW - 1), ([1, 2], False, NOW - 2), [1, 2], (1, 2), (1, 2, None)),
    "new": (([1, 2], False, NOW - 1), ([], False, -math.inf), [2], (0, 0), (1, 0, None)),
    "fork": (([1, 2], False, NOW - 1), ([], False, -math.inf), [1], (0, 1), (1, 1, 0)),
    "evict": (([1], False, NOW - 1), ([1, 2], False, NOW - 2), [2, 3], (0, 0), (1, 0, None)),
    "in-use": (([1, 2], True, NOW - 1), ([1], False, NOW - 2), [1, 2], (1, 1), (1, 2, 0)),
}


def _case_cache(case, multi_user):
    s0, s1 = FIND_CASES[case][:2]
    pc = PromptCache(make_cache(), multi_user=multi_user, clock=Clock())
    seed_slot(pc, 0, *s0)
    seed_slot(pc, 1, *s1)
    return pc


@pytest.mark.parametrize("case", list(FIND_CASES))
def test_find_cache_slot(case):
    prompt = FIND_CASES[case][2]
    pc = _case_cache(case, multi_user=False)
    assert pc.find_longest_slot(prompt) == FIND_CASES[case][3]
    pc = _case_cache(case, multi_user=True)
    assert pc.find_best_slot(prompt) == FIND_CASES[case][4]


@pytest.mark.parametrize("multi_user", [False, True], ids=["single-user", "multi-user"])
@pytest.mark.parametrize("case", list(FIND_CASES))
def test_load_follows_find_cache_slot(case, multi_user):
    """``load`` takes the slot the find step chose and leaves its sequence holding exactly the
    reused prefix (forked from the source slot when multi-user chose to), at least one input left
    to evaluate, the slot in use and stamped with the clock; the other slot is untouched."""
    s0, s1, prompt, longest, best = FIND_CASES[case]
    pc = _case_cache(case, multi_user)
    pc.clock.now = NOW + 5
    before = [pc.inputs(0), pc.inputs(1)]
    slot, remaining = pc.load(prompt)
    want_slot, want_len = (best[0], best[1]) if multi_user else longest
    reused = min(want_len, len(prompt) - 1)
    assert slot == want_slot
    assert remaining == prompt[reused:] and len(remaining) >= 1
    assert pc.inputs(slot) == prompt[:reused]
    assert pc.in_use(slot) and pc.slots[slot].last_used == NOW + 5
    assert_holds(pc.cache, slot, prompt[:reused])
    other = 1 - slot
    assert pc.inputs(other) == before[other]
    assert_holds(pc.cache, other, before[other])
    assert pc.last_load.slot == slot and pc.last_load.reused == reused
    fork = best[2] if multi_user else None
    assert pc.last_load.forked_from == (fork if reused else None)
    assert pc.stats.forks == (1 if fork is not None else 0)


# ------------------------------------------------------------------ TestShiftDiscard
@pytest.mark.parametrize("num_ctx,num_keep,n_inputs,expected", [
    (2048, 5, 2048, 1021),     # Shift
    (2048, 2047, 2048, 1),     # Max Keep
    (2048, 0, 2048, 1024),     # No Keep
    (2048, 5, 5000, 3973),     # Truncate
    (2048, 2047, 5000, 2953),  # Truncate Keep
    (2048, 5, 512, 0),         # No Op
], ids=["shift", "max-keep", "no-keep", "truncate", "truncate-keep", "no-op"])
def test_shift_discard(num_ctx, num_keep, n_inputs, expected):
    cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=1, head_dim=2, dtype="float32",
                          capacity=num_ctx, max_seqs=1, max_batch=8, device="cpu")
    pc = PromptCache(nkv.CausalCache(cfg))
    assert pc.num_ctx == num_ctx
    assert pc.shift_discard(n_inputs, num_keep) == expected


def test_shift_discard_rejects_keep_beyond_context():
    pc = PromptCache(make_cache(capacity=10))
    with pytest.raises(ValueError, match="num_keep"):
        pc.shift_discard(12, 10)
    with pytest.raises(ValueError, match="n_inputs"):
        pc.shift_discard(-1, 2)


# ------------------------------------------------------------------ TestLoadCacheSlot
@pytest.mark.parametrize("multi_user", [False, True], ids=["single-user", "multi-user"])
def test_load_cache_slot_basic_hit(multi_user):
    pc = PromptCache(make_cache(), multi_user=multi_user, clock=Clock())
    seed_slot(pc, 0, [1, 2], last_used=NOW - 1)
    seed_slot(pc, 1, [], last_used=NOW - 2)
    slot, remaining = pc.load([1, 2, 3])
    assert (slot, remaining) == (0, [3])    # only token 3 remains
    assert pc.in_use(0) and not pc.in_use(1)
    assert_holds(pc.cache, 0, [1, 2])


def test_load_cache_slot_exact_match_leaves_one_input():
    pc = PromptCache(make_cache(max_seqs=1), clock=Clock())
    seed_slot(pc, 0, [1, 2], last_used=NOW - 1)
    slot, remaining = pc.load([1, 2])
    assert (slot, remaining) == (0, [2])    # one input left to sample from
    assert_holds(pc.cache, 0, [1])


@pytest.mark.parametrize("multi_user", [False, True], ids=["single-user", "multi-user"])
def test_load_cache_slot_no_available_slots(multi_user):
    pc = PromptCache(make_cache(max_seqs=1), multi_user=multi_user, clock=Clock())
    seed_slot(pc, 0, [1, 2], in_use=True, last_used=NOW - 1)
    with pytest.raises(nkv.NoSlotError):
        pc.load([1, 2, 3])
    assert pc.inputs(0) == [1, 2] and pc.slots[0].last_used == NOW - 1
    assert_holds(pc.cache, 0, [1, 2])
    assert isinstance(nkv.NoSlotError("x"), nkv.KVCacheError)


def test_load_without_cache_prompt_reuses_nothing():
    pc = PromptCache(make_cache(), clock=Clock())
    seed_slot(pc, 0, [1, 2, 3], last_used=NOW - 1)
    slot, remaining = pc.load([1, 2, 3, 4], cache_prompt=False)
    assert (slot, remaining) == (0, [1, 2, 3, 4])
    assert pc.cache.seq_pos_max(0) == -1 and pc.inputs(0) == []


def test_load_starts_over_when_the_window_no_longer_covers_the_prefix():
    """can_resume false (a sliding window let the prefix's window go): start from 0."""
    pc = PromptCache(make_cache(max_seqs=1, capacity=32, swa_window=2, swa_memory=3),
                     clock=Clock())
    seed_slot(pc, 0, list(range(11)))
    evaluate(pc.cache, 0, 11, [11])             # this pass evicts what the window let go
    pc.slots[0].inputs.append(11)
    assert pc.cache.seq_pos_min(0) > 0
    slot, remaining = pc.load([0, 1, 2, 3, 99])  # shares 4 inputs, whose window is gone
    assert remaining == [0, 1, 2, 3, 99]
    assert pc.cache.seq_pos_max(0) == -1 and pc.inputs(0) == []
    # a prefix whose window is still stored is reused
    evaluate(pc.cache, 0, 0, list(range(11)))
    evaluate(pc.cache, 0, 11, [11])
    pc.extend(0, list(range(12)))
    pc.release(0)
    slot, remaining = pc.load(list(range(12)) + [7])
    assert remaining == [7] and pc.cache.seq_pos_max(0) == 11


class PartialEraseRefused:
    """A cache that cannot drop a suffix from position > 0 (Ollama: "some models don't support
    partial erasure", e.g. recurrent state): everything else is the real cache's."""

    def __init__(self, cache):
        self._cache = cache

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def remove(self, seq, begin, end=None):
        if begin > 0:
            raise nkv.NotSupportedError("partial erasure is not supported")
        self._cache.remove(seq, begin, end)


def test_load_empties_the_slot_when_removing_the_suffix_fails():
    inner = make_cache()
    pc = PromptCache(PartialEraseRefused(inner), clock=Clock())
    seed_slot(pc, 0, [1, 2, 3], last_used=NOW - 1)
    slot, remaining = pc.load([1, 2, 9])
    assert (slot, remaining) == (0, [1, 2, 9])
    assert inner.seq_pos_max(0) == -1 and pc.inputs(0) == []


# ------------------------------------------------------------------ TestShiftCacheSlot
def _full_slot(shift="rope", device="cpu"):
    pc = PromptCache(make_cache(max_seqs=2, capacity=10, shift=shift, device=device),
                     clock=Clock())
    tokens = list(range(1, 11))
    slot, remaining = pc.load(tokens)
    evaluate(pc.cache, slot, 0, remaining)
    pc.extend(slot, remaining)
    return pc, slot, tokens


def test_shift_cache_slot_remove_succeeds(device):
    pc, slot, tokens = _full_slot(device=device)
    assert pc.shift(slot, 2) == 4               # num_ctx 10, keep 2: discard 4
    assert pc.inputs(slot) == [1, 2, 7, 8, 9, 10]
    # the cache dropped positions 2..5 and moved 6..9 down to 2..5, keys re-rotated
    assert_holds(pc.cache, slot, [1, 2, 7, 8, 9, 10])
    assert pc.stats.shifts == 1 and pc.stats.discarded == 4
    assert pc.shift(slot, 2) == 0               # already enough room


def test_shift_cache_slot_remove_fails_without_shift_function():
    pc, slot, tokens = _full_slot(shift=None)
    with pytest.raises(nkv.ReprocessError) as info:
        pc.shift(slot, 2)
    assert info.value.inputs == [1, 2, 7, 8, 9, 10]
    assert isinstance(info.value, nkv.KVCacheError)
    assert pc.inputs(slot) == [] and pc.cache.seq_pos_max(slot) == -1
    assert pc.in_use(slot)                      # still the caller's, to evaluate again


def test_shift_cache_slot_refused_for_cells_shared_after_a_fork():
    pc = PromptCache(make_cache(max_seqs=2, capacity=10), multi_user=True, clock=Clock())
    slot, rem = pc.load(list(range(1, 11)))
    evaluate(pc.cache, slot, 0, rem)
    pc.extend(slot, rem)
    # a second request shares 8 inputs with the first (in use): forked into the other slot
    other, rem2 = pc.load(list(range(1, 9)) + [50, 51])
    assert other != slot and rem2 == [50, 51] and pc.last_load.forked_from == slot
    with pytest.raises(nkv.ReprocessError) as info:
        pc.shift(slot, 2)                       # positions 6.. are shared with the fork
    assert info.value.inputs == [1, 2, 7, 8, 9, 10]
    assert pc.inputs(slot) == [] and pc.cache.seq_pos_max(slot) == -1
    assert_holds(pc.cache, other, list(range(1, 9)))   # the fork kept its cells


def test_shift_rejects_keep_beyond_context():
    pc, slot, _ = _full_slot()
    with pytest.raises(ValueError, match="num_keep"):
        pc.shift(slot, 10)
    assert pc.inputs(slot) == list(range(1, 11))


# ------------------------------------------------------------------ the rest of the API
def test_release_records_the_clock_and_lru_eviction_follows_it():
    clock = Clock()
    pc = PromptCache(make_cache(max_seqs=3), multi_user=True, clock=clock)
    slots = []
    for i, t in enumerate((10.0, 30.0, 20.0)):
        clock.now = t
        slot, rem = pc.load([100 + i, 1])
        evaluate(pc.cache, slot, 0, rem)
        pc.extend(slot, rem)
        slots.append(slot)
    for slot, t in zip(slots, (40.0, 60.0, 50.0)):
        clock.now = t
        pc.release(slot)
        assert pc.slots[slot].last_used == t
    clock.now = 70.0
    slot, rem = pc.load([7, 7])                  # no prefix anywhere: the LRU slot is evicted
    assert slot == slots[0] and pc.last_load.evicted == 2


def test_every_slot_in_use_and_release_frees_one():
    pc = PromptCache(make_cache(max_seqs=2), clock=Clock())
    a, _ = pc.load([1])
    b, _ = pc.load([2])
    assert {a, b} == {0, 1}
    with pytest.raises(nkv.NoSlotError):
        pc.load([3])
    pc.release(b)
    assert pc.load([3])[0] == b


def test_extend_records_inputs_of_a_slot_in_use():
    pc = PromptCache(make_cache(), clock=Clock())
    slot, rem = pc.load([1, 2, 3])
    evaluate(pc.cache, slot, 0, rem)
    pc.extend(slot, rem[:1])
    pc.extend(slot, np.array(rem[1:]))
    assert pc.inputs(slot) == [1, 2, 3]
    with pytest.raises(ValueError, match="inputs"):
        pc.extend(slot, [[4]])
    pc.release(slot)
    with pytest.raises(ValueError, match="not in use"):
        pc.extend(slot, [4])
    assert pc.inputs(slot) == [1, 2, 3]


def test_arguments_are_validated_before_anything_changes():
    pc = PromptCache(make_cache(), clock=Clock())
    seed_slot(pc, 0, [1, 2], last_used=NOW - 1)
    for bad, match in (([], "prompt"), ("abc", "prompt"), ([[1], [2]], r"prompt\[0\]"),
                       (np.zeros((2, 2), np.int64), "prompt"), (3, "prompt")):
        with pytest.raises(ValueError, match=match):
            pc.load(bad)
    with pytest.raises(ValueError, match="cache_prompt"):
        pc.load([1], cache_prompt=1)
    for call in (lambda: pc.inputs(2), lambda: pc.release(-1), lambda: pc.shift(True, 0),
                 lambda: pc.extend(5, [1])):
        with pytest.raises(ValueError, match="slot"):
            call()
    with pytest.raises(ValueError, match="not in use"):
        pc.release(0)
    assert pc.inputs(0) == [1, 2] and not pc.in_use(0) and pc.stats.loads == 0
    assert_holds(pc.cache, 0, [1, 2])
    with pytest.raises(ValueError, match="cache"):
        PromptCache(object())
    with pytest.raises(ValueError, match="multi_user"):
        PromptCache(make_cache(), multi_user="yes")
    with pytest.raises(ValueError, match="clock"):
        PromptCache(make_cache(), clock=5)


def test_numpy_prompts_match_python_ints():
    pc = PromptCache(make_cache(), clock=Clock())
    seed_slot(pc, 0, [1, 2, 3], last_used=NOW - 1)
    slot, rem = pc.load(np.array([1, 2, 3, 4], np.int32))
    assert (slot, rem) == (0, [4]) and all(type(t) is int for t in pc.inputs(0))


def test_reprocess_error_pickles():
    import pickle
    err = pickle.loads(pickle.dumps(nkv.ReprocessError("m", inputs=[1, 2])))
    assert err.inputs == [1, 2] and str(err) == "m"


# ------------------------------------------------------------------ WrapperCache
def _wrapper(max_seqs=2, capacity=12):
    cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=1, head_dim=8, dtype="float32",
                          capacity=capacity, max_seqs=max_seqs, max_batch=capacity, device="cpu")
    return nkv.WrapperCache([nkv.CausalCache(cfg, shift=nkv.RopeShift(), swa_window=4),
                             nkv.CausalCache(cfg, shift=nkv.RopeShift())], layer_groups=[0, 1])


def test_wrapper_cache_fork_and_shift():
    cache = _wrapper()
    pc = PromptCache(cache, multi_user=True, clock=Clock())
    assert (pc.num_slots, pc.num_ctx) == (2, 12)
    slot, rem = pc.load(list(range(1, 13)))
    evaluate(cache, slot, 0, rem)
    pc.extend(slot, rem)
    other, rem2 = pc.load([1, 2, 3, 40])
    assert other != slot and rem2 == [40] and pc.last_load.forked_from == slot
    for c in cache.caches:
        assert c.seq_pos_max(other) == 2
    assert pc.shift(slot, 3) == 4                # keep 3 (the shared cells), discard (12-3)//2
    assert pc.inputs(slot) == [1, 2, 3] + list(range(8, 13))
    full = cache.caches[1]
    got = seq_keys(full, slot)
    assert sorted(got) == list(range(8))
    key, _ = token_kv(pc.inputs(slot), np.arange(8))
    np.testing.assert_allclose(np.stack([got[p] for p in range(8)]), key, atol=2e-6)


# ------------------------------------------------------------------ state
@pytest.mark.parametrize("kind", ["causal", "wrapper"])
@pytest.mark.parametrize("as_bytes", [False, True], ids=["file", "bytes"])
def test_a_saved_slot_survives_a_restart_and_is_prefix_matched(kind, as_bytes, tmp_path):
    build = (lambda: make_cache(max_seqs=2, capacity=16)) if kind == "causal" else _wrapper
    pc = PromptCache(build(), clock=Clock())
    conversation = [5, 6, 7, 8, 9, 10]
    slot, rem = pc.load(conversation)
    evaluate(pc.cache, slot, 0, rem)
    pc.extend(slot, rem)
    path = tmp_path / "slot.safetensors"
    if as_bytes:
        source = pc.slot_bytes(slot, metadata={"user": "u1"})
    else:
        pc.save_slot(slot, path, metadata={"user": "u1"})
        source = str(path)
    pc.cache.close()

    restarted = PromptCache(build(), clock=Clock(NOW + 100))
    restored = restarted.load_slot(source, slot=1)
    assert restored == 1 and restarted.inputs(1) == conversation
    assert not restarted.in_use(1) and restarted.slots[1].last_used == NOW + 100
    # the next turn of the conversation reuses all of it
    slot2, rem2 = restarted.load(conversation + [11, 12])
    assert (slot2, rem2) == (1, [11, 12])
    # the restored sequence holds the saved keys (the full-attention group of the wrapper)
    holder = restarted.cache if kind == "causal" else restarted.cache.caches[1]
    assert_holds(holder, 1, conversation)


def test_load_slot_checks():
    pc = PromptCache(make_cache(), clock=Clock())
    slot, rem = pc.load([1, 2, 3])
    evaluate(pc.cache, slot, 0, rem)
    with pytest.raises(ValueError, match="extend"):
        pc.slot_bytes(slot)                      # evaluated but not recorded
    pc.extend(slot, rem)
    data = pc.slot_bytes(slot)
    with pytest.raises(ValueError, match="in use"):
        pc.load_slot(data, slot=slot)
    no_tokens = pc.cache.state_bytes(slot)
    with pytest.raises(nkv.StateError, match="tokens"):
        pc.load_slot(no_tokens, slot=1)
    assert pc.cache.seq_pos_max(1) == -1
    whole = pc.cache.state_bytes(tokens=[1, 2, 3])
    with pytest.raises(nkv.StateError, match="whole cache"):
        pc.load_slot(whole, slot=1)
    wrong = pc.cache.state_bytes(slot, tokens=[1, 2])
    with pytest.raises(nkv.StateError, match="tokens"):
        pc.load_slot(wrong, slot=1)
    assert pc.cache.seq_pos_max(1) == -1 and pc.inputs(1) == []
    other = PromptCache(make_cache(), clock=Clock())
    other.slots[0].inputs = ["image"]
    with pytest.raises(ValueError, match="token ids"):
        other.slot_bytes(0)
    with pytest.raises(ValueError, match="source"):
        pc.load_slot(123)
    assert pc.load_slot(data) == 1               # None: the LRU free slot


# ------------------------------------------------------------------ randomized serving, verified
def _serve(seed, multi_user, **over):
    """Many conversations (new ones sharing a system prompt, and follow-up turns of finished
    ones) served through a PromptCache on a small cache by the demo's run loop, every forward
    pass checked against the recomputation without the cache (the demo's verification)."""
    from numbakv.tools.demo import ModelConfig, run_demo
    model = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                        vocab=128)
    kw = dict(n_seqs=14, steps=90, n_layers=2, capacity=24, model=model, slots=3, seed=seed,
              device="cpu", progress=False, plot_path=None, multi_user=multi_user,
              follow_ups=0.6)
    kw.update(over)
    return run_demo(**kw)


@pytest.mark.parametrize("multi_user", [True, False], ids=["multi-user", "single-user"])
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_many_conversations_equal_recomputation(seed, multi_user):
    report = _serve(seed, multi_user)
    assert report.verification.startswith("passed")
    assert report.verified_tokens == report.prefill_tokens + report.decode_tokens > 0
    # only what the prompt cache returned was prefilled, plus what a refused shift handed back
    # (with the token a decoding request was about to feed)
    refused = sum(kind == "reprocess" for _, kind, _ in report.events)
    assert report.prefill_tokens <= report.prompt_evaluated + report.reprocessed + refused
    assert report.follow_ups > 0 and report.shifts > 0
    n_sys = max(2, 24 // 8)
    # follow-up turns found their conversations: more reused than system prompts alone
    assert report.prompt_reused > n_sys * report.started
    assert (report.copy_prefix > 0) == multi_user


def test_a_refused_shift_is_reprocessed_and_still_verifies():
    """In this workload two follow-ups of one conversation run at once: the second forks the
    first's 23 tokens, so a shift of either would move shared cells; the cache refuses, the
    slot is emptied and its kept tokens are evaluated again (ReprocessError), verified."""
    report = _serve(3, True)
    assert report.verification.startswith("passed")
    assert report.reprocessed > 0
    assert any(kind == "reprocess" for _, kind, _ in report.events)


def test_many_conversations_sliding_window():
    report = _serve(2, True, swa_window=5)
    assert report.verification.startswith("passed")
    assert report.prompt_reused > 0 and report.shifts > 0
