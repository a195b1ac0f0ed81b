"""Retention for agents (issue 36): priorities and TTLs by token range, a chain's tail before its
parent, extra keys (media hashes, LoRA ids) folded into the chained keys, and bad input refused
with nothing changed. The eviction order itself is a pure-Python class, tested without arrays."""

from __future__ import annotations

import numpy as np
import pytest

from numbakv.prefix import PrefixStore
from numbakv.prefix.keys import KEYED_BIT, block_keys, fold_extra_keys
from numbakv.prefix.policy import DEFAULT_PRIORITY, LFU, LRU, Retention

from prefix_helpers import check_holds, prefill, small_cache


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------- the order, without arrays
def test_retention_order_expired_then_priority_then_lru():
    clock = FakeClock()
    r = Retention(LRU(), clock)
    for k, prio, exp in (("a", 35, None), ("b", 80, None), ("c", 10, None), ("d", 90, 1005.0),
                         ("e", 35, None)):
        r.add(k, prio, exp)
    assert list(r.victims()) == ["c", "a", "e", "b", "d"]
    r.touch("a")                                   # LRU breaks ties inside a priority
    assert list(r.victims()) == ["c", "e", "a", "b", "d"]
    clock.t = 1005.0                               # d's TTL ran out: first out
    assert list(r.victims())[0] == "d" and r.expired("d") and r.rank("d") == (0, 90)
    r.set("c", 95, None)                           # changeable later
    assert list(r.victims()) == ["d", "e", "a", "b", "c"]
    r.remove("d")
    assert "d" not in r and len(r) == 4 and r.get("d") == (DEFAULT_PRIORITY, None)


def test_retention_tail_before_parent_and_default_fast_path():
    r = Retention(LRU(), FakeClock())
    for k in ("parent", "tail", "other"):
        r.add(k)
    assert list(r.victims()) == ["parent", "tail", "other"]        # plain LRU, no sort
    # parent is the ancestor of a live entry: among equals it waits behind the others
    assert list(r.victims(lambda k: k == "parent")) == ["tail", "other", "parent"]
    # priority still comes first: a low-priority parent goes before a high-priority tail
    r.set("parent", 5, None)
    r.set("tail", 60, None)
    assert list(r.victims(lambda k: k == "parent")) == ["parent", "other", "tail"]


def test_retention_over_lfu():
    r = Retention(LFU(), FakeClock())
    r.add("x")
    r.add("y")
    r.touch("x")
    r.touch("x")
    assert list(r.victims()) == ["y", "x"]
    r.set("x", 0, None)
    assert list(r.victims()) == ["x", "y"]


# ---------------------------------------------------------------- the store
def session(n=24, base=500):
    return list(range(base, base + n))


def one_off(i, n=20):
    return [10_000 + 100 * i + j for j in range(n)]


def run_burst(store, cache, count=6):
    for i in range(count):
        toks = one_off(i)
        prefill(cache, 0, toks)
        store.save(0, toks)
        cache.seq_rm(0)


def test_a_retained_session_survives_a_burst_of_one_off_requests():
    for retained in (False, True):
        cache = small_cache(max_seqs=4, capacity=32)
        store = PrefixStore(cache, retain_seqs=[2, 3], block_tokens=4, clock=FakeClock())
        s = session()
        prefill(cache, 0, s)
        store.save(0, s, priority=80 if retained else None)
        cache.seq_rm(0)
        run_burst(store, cache)
        assert store.match(s) == (24 if retained else 0)
        if retained:
            [e] = [e for e in store.entries() if e["tokens"] == s]
            assert e["priority"] == 80 and e["tier"] == "cells" and e["ttl"] is None
            assert store.load(1, s) == 24
            check_holds(cache, 1, s, 24)
            st = store.stats()["tiers"]["cells"]
            assert st["priorities"] == {35: 1, 80: 1} and st["expiring"] == 0
        store.close()


def test_ttl_expiry_makes_an_entry_first_out():
    clock = FakeClock()
    cache = small_cache(max_seqs=4, capacity=32)
    store = PrefixStore(cache, retain_seqs=[2, 3], block_tokens=4, clock=clock)
    s = session()
    prefill(cache, 0, s)
    store.save(0, s)
    cache.seq_rm(0)
    assert store.retain(s, priority=90, ttl=30) == 24
    [e] = store.entries()
    assert e["priority"] == 90 and e["ttl"] == 30.0 and not e["expired"]
    run_burst(store, cache, 3)
    assert store.match(s) == 24                    # retained while the TTL runs
    clock.t += 31
    assert store.stats()["tiers"]["cells"]["expired"] == 1
    assert store.match(s) == 24                    # expired: still served until evicted...
    run_burst(store, cache, 1)
    assert store.match(s) == 0                     # ...and the first one out
    store.close()


def test_retain_a_range_splits_so_the_tail_goes_before_its_parent():
    """Only a longer conversation entry holds the system prompt: retain(system) gives the
    range an entry of its own (metadata only in cells), so pressure evicts the conversation's
    tail and keeps the retained system prompt - never the parent before the child."""
    cache = small_cache(max_seqs=4, capacity=32)
    store = PrefixStore(cache, retain_seqs=[1, 2, 3], block_tokens=4, clock=FakeClock())
    system = session(16)
    convo = system + [7, 7, 7, 7, 8, 8, 8, 8]
    prefill(cache, 0, convo)
    store.save(0, convo)
    cache.seq_rm(0)
    store.take_events()
    assert store.retain(system, priority=70) == 16
    got = {tuple(e["tokens"]): e["priority"] for e in store.entries()}
    assert got == {tuple(system): 70, tuple(convo): 35}
    assert store.take_events() == []               # the blocks were already stored in cells
    run_burst(store, cache, 4)
    assert store.match(convo) == 16 and store.match(system) == 16
    assert store.load(0, convo) == 16
    check_holds(cache, 0, convo, 16)
    cache.seq_rm(0)
    removed = {h for e in store.take_events() if e["type"] == "BlockRemoved"
               and e["medium"] == "cells" for h in e["block_hashes"]}
    tail = block_keys(convo, 4, store._root(None))[4:]
    assert set(tail) <= removed                     # the tail's blocks went ...
    assert not removed & set(block_keys(system, 4, store._root(None)))   # ... not the parent's
    store.close()


def test_equal_priority_chain_keeps_the_parent_behind_its_tail():
    """Two entries of one chain at the same priority, the parent the LEAST recently used: the
    store still evicts the tail (the chain rule breaks LRU ties)."""
    cache = small_cache(max_seqs=4, capacity=32)
    store = PrefixStore(cache, retain_seqs=[2, 3], block_tokens=4, clock=FakeClock())
    parent = session(16)
    child = parent + [5] * 8
    prefill(cache, 0, parent)
    store.save(0, parent, priority=50)   # not merged into the child: another retention
    cache.seq_rm(0)
    prefill(cache, 0, child)
    store.save(0, child)                 # priority 35 (default) ...
    cache.seq_rm(0)
    store.retain(child, priority=50)     # ... now 50 too: same rank, parent older (LRU)
    parent_entry = [e for e in store.entries() if e["tokens"] == parent]
    assert parent_entry and parent_entry[0]["priority"] == 50
    # one more save needs one retained sequence: the victim is the tail (child), not parent
    toks = one_off(0)
    prefill(cache, 0, toks)
    store.save(0, toks, priority=50)
    cache.seq_rm(0)
    kept = [tuple(e["tokens"]) for e in store.entries()]
    assert tuple(parent) in kept and tuple(child) not in kept
    store.close()


def test_retention_moves_with_an_entry_between_tiers_and_shows_in_events():
    clock = FakeClock()
    cache = small_cache(max_seqs=4, capacity=32)
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4,
                        host_bytes=cache.config.nbytes(1) * 200, clock=clock)
    s = session()
    prefill(cache, 0, s)
    store.save(0, s, priority=60, ttl=100)
    cache.seq_rm(0)
    ev = store.take_events()
    assert ev[0]["priority"] == 60 and ev[0]["ttl"] == 100.0 and ev[0]["medium"] == "cells"
    # a request that needs the cells: the store gives them up (priority orders, never
    # refuses a live request), demoting the entry to host RAM with its retention
    prefill(cache, 0, list(range(110)))
    cache.seq_rm(0)
    [e] = [e for e in store.entries() if e["tokens"] == s]
    assert e["tier"] == "host" and e["priority"] == 60 and e["ttl"] == 100.0
    host_ev = [x for x in store.take_events() if x.get("medium") == "host"]
    assert host_ev and host_ev[0]["priority"] == 60
    assert store.stats()["tiers"]["host"]["priorities"] == {60: 1}
    store.close()


def test_save_retention_defaults_and_keeps():
    cache = small_cache(max_seqs=4, capacity=32)
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4, clock=FakeClock())
    s = session()
    prefill(cache, 0, s)
    store.save(0, s)
    assert store.entries()[0]["priority"] == 35
    store.save(0, s, priority=90)
    assert store.entries()[0]["priority"] == 90
    store.save(0, s)                                  # None: the entry keeps its own
    assert store.entries()[0]["priority"] == 90
    store.retain(s, priority=5)                       # lowered later
    assert store.entries()[0]["priority"] == 5
    assert store.retain(one_off(9)) == 0             # nothing stored: nothing changed
    store.close()


# ---------------------------------------------------------------- extra keys
def test_two_images_behind_the_same_placeholders_never_alias():
    cache = small_cache(max_seqs=4, capacity=32)
    store = PrefixStore(cache, retain_seqs=[2, 3], block_tokens=4)
    prompt = [1, 2, 3, 4, 5, 6] + [99] * 8 + [7, 8, 9, 10]     # image placeholders at 6..14
    img_a, img_b = [(6, 14, b"sha256:aaaa")], [(6, 14, b"sha256:bbbb")]
    prefill(cache, 0, prompt)
    assert store.save(0, prompt, extra_keys=img_a) == 18
    cache.seq_rm(0)
    assert store.match(prompt, extra_keys=img_a) == 18
    # the other image: only the text before it is shared (token granular)
    assert store.match(prompt, extra_keys=img_b) == 6
    assert store.match(prompt) == 6                  # no key: the placeholders alone
    assert store.load(1, prompt, extra_keys=img_b) == 6
    check_holds(cache, 1, prompt, 6)
    cache.seq_rm(1)
    # same image at the same place in a longer prompt: reused through the image
    longer = prompt + [11, 12]
    assert store.match(longer, extra_keys=img_a) == 18
    # pin / unpin / retain take the same keys
    assert store.pin(prompt, extra_keys=img_a) == 18
    assert store.unpin(prompt, extra_keys=img_a) and not store.unpin(prompt, extra_keys=img_b)
    assert store.retain(prompt, priority=70, extra_keys=img_a) == 18
    store.close()


def test_extra_keys_fold_from_the_block_holding_start():
    toks = np.arange(100, 120, dtype="<i8")
    buf = toks.tobytes()
    out = np.frombuffer(fold_extra_keys(buf, [(5, 9, b"lora:7")]), "<i8")
    assert np.array_equal(out[:5], toks[:5]) and np.array_equal(out[9:], toks[9:])
    assert (out[5:9] >= KEYED_BIT).all() and len(set(out[5:9].tolist())) == 4
    again = np.frombuffer(fold_extra_keys(buf, [(5, 9, b"lora:7")]), "<i8")
    other = np.frombuffer(fold_extra_keys(buf, [(5, 9, b"lora:8")]), "<i8")
    assert np.array_equal(out, again) and not np.array_equal(out[5:9], other[5:9])
    assert fold_extra_keys(buf, None) == buf


# ---------------------------------------------------------------- bad input
def _state(store, cache):
    return (store.entries(), store.stats()["tiers"]["cells"]["entries"],
            [cache.seq_pos_max(s) for s in range(4)], store.take_events())


@pytest.mark.parametrize("kw, name", [
    ({"priority": -1}, "priority"), ({"priority": 101}, "priority"),
    ({"priority": 3.5}, "priority"), ({"priority": True}, "priority"),
    ({"priority": "high"}, "priority"), ({"ttl": -1}, "ttl"), ({"ttl": float("nan")}, "ttl"),
    ({"ttl": float("inf")}, "ttl"), ({"ttl": "1s"}, "ttl"),
    ({"extra_keys": [(0, 30, b"k")]}, "extra_keys"),         # past the tokens
    ({"extra_keys": [(4, 4, b"k")]}, "extra_keys"),          # empty range
    ({"extra_keys": [(-1, 3, b"k")]}, "extra_keys"),
    ({"extra_keys": [(5, 9, b"a"), (2, 4, b"b")]}, "extra_keys"),   # unsorted
    ({"extra_keys": [(2, 6, b"a"), (5, 9, b"b")]}, "extra_keys"),   # overlapping
    ({"extra_keys": [(2, 6, "str")]}, "extra_keys"), ({"extra_keys": [(2, 6, b"")]}, "extra_keys"),
    ({"extra_keys": [(2, 6)]}, "extra_keys"), ({"extra_keys": b"abc"}, "extra_keys"),
    ({"extra_keys": [(2.0, 6, b"k")]}, "extra_keys"),
])
def test_bad_retention_input_is_refused_and_changes_nothing(kw, name):
    cache = small_cache(max_seqs=4, capacity=32)
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4, clock=FakeClock())
    s = session()
    prefill(cache, 0, s)
    store.save(0, s, priority=60)
    before = _state(store, cache)
    calls = [lambda: store.save(0, s, **kw), lambda: store.retain(s, **kw)]
    if "extra_keys" in kw:
        calls += [lambda: store.match(s, **kw), lambda: store.load(1, s, **kw),
                  lambda: store.pin(s, **kw), lambda: store.unpin(s, **kw)]
    for call in calls:
        with pytest.raises(ValueError, match=name):
            call()
        assert _state(store, cache)[:3] == before[:3] and store.take_events() == []
    store.close()


def test_keyed_token_range_refuses_ids_above_2_62():
    cache = small_cache(max_seqs=4, capacity=32)
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4)
    with pytest.raises(ValueError, match="extra_keys"):
        store.match([1, 2, KEYED_BIT + 5], extra_keys=[(1, 3, b"k")])
    assert store.match([1, 2, KEYED_BIT + 5]) == 0   # without keys: any id < 2**63 as before
    store.close()


# ---------------------------------------------------------------- cancelled prefills
def _cancel_scenario():
    import numbakv as nkv
    from prefix_helpers import kv_of
    cache = small_cache(max_seqs=3, capacity=64)
    store = PrefixStore(cache, retain_seqs=[2], block_tokens=4,
                        host_bytes=cache.config.nbytes(1) * 200)
    pc = nkv.PromptCache(cache, multi_user=True, store=store)
    prompt = list(range(300, 340))
    slot, remaining = pc.load(prompt)
    assert remaining == prompt
    pc.extend(slot, prompt)                           # the runner records what it batches
    prefill(cache, slot, prompt[:24])                 # 24 tokens fully evaluated ...
    pos = np.arange(24, 32, dtype=np.int32)           # ... then a batch cancelled mid-way:
    cache.start_forward(pos, np.full(8, slot, np.int32))
    cache.set_layer(0)                                # layer 0 written, layer 1 never
    k, v = kv_of(prompt[24:32], pos, 0, 2, 4)
    cache.put(k, v)
    return cache, store, pc, slot, prompt


def test_prompt_cache_cancel_saves_the_prefilled_part_for_the_retry():
    cache, store, pc, slot, prompt = _cancel_scenario()
    with pytest.raises(ValueError, match="evaluated"):
        pc.cancel(slot, 41)                           # more than the slot records
    with pytest.raises(ValueError, match="evaluated"):
        pc.cancel(slot, -1)
    assert pc.in_use(slot) and cache.seq_pos_max(slot) == 31   # nothing changed
    pc.cancel(slot, 24)
    assert not pc.in_use(slot) and cache.seq_pos_max(slot) == 23
    assert pc.inputs(slot) == prompt[:24] and store.match(prompt) == 24
    # other requests take both slots and drop what they held
    for other in (list(range(900, 930)), list(range(950, 980))):
        s, rem = pc.load(other)
        cache.seq_rm(s)
        prefill(cache, s, other)
        pc.extend(s, rem)
        pc.release(s)
    assert all(cache.seq_pos_max(s) != 23 or pc.inputs(s) != prompt[:24] for s in (0, 1))
    s, remaining = pc.load(prompt)                    # the retry
    assert remaining == prompt[24:] and pc.stats.store_reused >= 24
    check_holds(cache, s, prompt, 24)


def test_release_evaluated_none_keeps_todays_behaviour():
    cache, store, pc, slot, prompt = _cancel_scenario()
    cache.seq_rm(slot, 24, None)                      # the caller dropped the half batch
    pc.release(slot)                                  # saves what the sequence holds
    assert store.match(prompt) == 24


def test_save_priority_reaches_the_exact_entry_beside_a_longer_one():
    """Found by the model check: the prompt [0] held in host RAM while a longer prompt
    starting with it sits in cells; save([0], priority=0) must set the priority of the entry
    holding exactly [0], not leave it at 35 because the longer one is matched first."""
    cache = small_cache(max_seqs=4, capacity=32)
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4,
                        host_bytes=cache.config.nbytes(1) * 64, clock=FakeClock())
    for toks, priority in (([0], 20), ([0, 0, 0], None)):   # [0] ranked lower: demoted
        prefill(cache, 0, toks)
        store.save(0, toks, priority=priority)
        cache.seq_rm(0)
    tiers = {tuple(e["tokens"]): e["tier"] for e in store.entries()}
    assert tiers == {(0,): "host", (0, 0, 0): "cells"}
    prefill(cache, 0, [0])
    assert store.save(0, [0], priority=0) == 1
    cache.seq_rm(0)
    [e] = [e for e in store.entries() if e["tokens"] == [0]]
    assert e["priority"] == 0
    store.close()


def test_room_is_made_from_an_entrys_tail_before_the_whole_entry():
    """Without a host tier an evicted tier-0 entry is lost: when a request needs room, the
    store first drops the end of the first entry in eviction order, whole blocks only, and
    keeps its head servable (the tail before its parent, at token granularity); the removed
    blocks are announced in the KV events."""
    cache = small_cache(max_seqs=4, capacity=16)                  # 64 cells
    store = PrefixStore(cache, retain_seqs=[3], block_tokens=4, clock=FakeClock())
    s = session(40)
    prefill(cache, 0, s)
    store.save(0, s)
    cache.seq_rm(0)
    store.take_events()
    prefill(cache, 1, one_off(0, 34))        # needs 34 of the 24 free cells: 10 from s's tail
    [e] = store.entries()
    assert e["length"] == 28 and e["tokens"] == s[:28]           # 40 - 10 -> 30 -> a block: 28
    assert store.match(s) == 28
    removed = [ev for ev in store.take_events() if ev["type"] == "BlockRemoved"]
    assert [h for ev in removed for h in ev["block_hashes"]] == \
        block_keys(s, 4, store._root(None))[7:]
    cache.seq_rm(1)
    assert store.load(1, s) == 28
    check_holds(cache, 1, s, 28)
    store.close()
