"""Random operation sequences (Hypothesis) on the disk and Redis tiers, two instances sharing one
directory / server as two processes would, checked against a reference of what was written:

- a read returns exactly the bytes last written under that run key, or None (evicted/removed);
- a run written with success is readable at once, from either instance;
- a pointer names a run that holds that block at that index, per the writes;
- the budget holds (bytes used <= budget; on disk, the files' sizes are the books' total);
- nothing raises."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from numbakv.prefix.tiers import open_tier  # noqa: E402
from redis_server import redis_server  # noqa: E402,F401

NS = "nkv1-0000000000c0ffee"
BUDGET = 6_000

KEYS = [f"{i:032x}" for i in range(1, 9)]
BLOCKS = [f"{i:032x}" for i in range(100, 112)]

op = st.one_of(
    st.tuples(st.just("write"), st.integers(0, 1), st.sampled_from(KEYS),
              st.lists(st.sampled_from(BLOCKS), min_size=0, max_size=4, unique=True),
              st.integers(1, 2_500), st.integers(0, 255)),
    st.tuples(st.just("read"), st.integers(0, 1), st.lists(st.sampled_from(KEYS), max_size=3)),
    st.tuples(st.just("find"), st.integers(0, 1), st.lists(st.sampled_from(BLOCKS), max_size=5)),
    st.tuples(st.just("remove"), st.integers(0, 1), st.sampled_from(KEYS)),
    st.tuples(st.just("invalid"), st.integers(0, 1), st.sampled_from(KEYS)),
)
#: damage done from outside (issue 37): the disk tier's run files truncated, emptied, a length
#: bit flipped, replaced by another run's file, a FIFO or a link out of the directory; the Redis
#: tier's books made non-numeric. A damaged run is never served until written again.
DISK_DAMAGE = ["truncate", "empty", "length", "copy", "fifo", "symlink"]
REDIS_DAMAGE = ["books", "stats"]


def damage_op(kinds):
    return st.tuples(st.just("damage"), st.integers(0, 1), st.sampled_from(KEYS),
                     st.sampled_from(kinds), st.sampled_from(KEYS))


def run_ops(tiers, ops, files_total=None, damage=None):
    """Apply ``ops`` to ``tiers`` (two instances of one namespace) and check the invariants.
    ``damage(what, key, other)`` damages ``key``'s stored run from outside; it returns whether
    the run's bytes are gone (then it must never be served until written again)."""
    # run key -> (the bytes it may hold, its block keys). Run keys are content keys in the
    # store (same key, same bytes), so a tier may keep the first copy when the same key comes
    # again with the same blocks: both are acceptable then.
    last = {}
    damaged = set()
    for o in ops:
        kind, who = o[0], tiers[o[1]]
        if kind == "damage":
            if damage(o[3], o[2], o[4]):
                last.pop(o[2], None)
                damaged.add(o[2])
            continue
        if kind == "write":
            _, _, key, blocks, size, fill = o
            data = key.encode() + bytes([fill]) * size
            if who.write_run(key, blocks, data):
                old = last.get(key)
                same = old is not None and old[1] == tuple(blocks)
                last[key] = ((old[0] if same else set()) | {data}, tuple(blocks))
                for t in tiers:   # readable at once, by either "process"
                    [got] = t.read_runs([key])
                    assert got in last[key][0]
        elif kind == "read":
            got = who.read_runs(o[2])
            for key, data in zip(o[2], got):
                assert data is None or (key in last and data in last[key][0])
        elif kind == "find":
            for block, hit in zip(o[2], who.find_blocks(o[2])):
                if hit is None:
                    continue
                run, idx = hit
                if run in damaged and run not in last:
                    continue    # a pointer may outlive its run: the read then misses
                assert run in last and last[run][1][idx] == block
        elif kind == "remove":
            who.remove_run(o[2])
            last.pop(o[2], None)
            assert all(t.read_runs([o[2]]) == [None] for t in tiers)
        else:
            who.report_invalid(o[2])
            last.pop(o[2], None)
        for t in tiers:
            s = t.stats()
            assert 0 <= s["bytes_used"] <= BUDGET
            assert s["bytes_used"] + s["bytes_free"] + s["bytes_pinned"] == BUDGET
        if files_total is not None and not damaged:
            assert files_total() == tiers[0].stats()["bytes_used"]


_SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow,
                                            HealthCheck.function_scoped_fixture])


def disk_damage(runs, outside):
    def damage(what, key, other):
        path = os.path.join(runs, key + ".run")
        if not os.path.lexists(path):
            return False
        if what in ("truncate", "empty", "length"):
            if not os.path.isfile(path) or os.path.islink(path):
                return False
            with open(path, "r+b") as f:
                if what == "truncate":
                    f.truncate(max(0, os.path.getsize(path) - 7))
                elif what == "empty":
                    f.truncate(0)
                else:
                    f.seek(19)
                    b = f.read(1)
                    f.seek(19)
                    f.write(bytes([(b[0] if b else 0) ^ 0x40]))
            return True
        src = os.path.join(runs, other + ".run")
        if what == "copy":
            if other == key or not os.path.isfile(src) or os.path.islink(src):
                return False
            with open(src, "rb") as f:
                data = f.read()
            os.unlink(path)
            with open(path, "wb") as f:
                f.write(data)
            return True
        os.unlink(path)
        if what == "fifo":
            os.mkfifo(path)
        else:
            with open(outside, "wb") as f:
                f.write(b"outside the directory")
            os.symlink(outside, path)
        return True
    return damage


@_SETTINGS
@given(ops=st.lists(st.one_of(op, damage_op(DISK_DAMAGE)), min_size=1, max_size=25))
def test_disk_tier_against_reference(ops):
    root = tempfile.mkdtemp(prefix="nkv-model-")
    runs = os.path.join(root, "t1." + NS, "runs")

    def files_total():
        return sum(os.path.getsize(os.path.join(runs, n)) for n in os.listdir(runs)
                   if n.endswith(".run"))
    try:
        tiers = [open_tier(root, NS, BUDGET), open_tier(root, NS, BUDGET)]
        try:
            run_ops(tiers, ops, files_total, disk_damage(runs, os.path.join(root, "out")))
        finally:
            for t in tiers:
                t.close()
        # a restart sees the same books (what is not a whole run file of ours left out)
        with open_tier(root, NS, BUDGET) as again:
            if not any(o[0] == "damage" for o in ops):
                assert again.stats()["bytes_used"] == files_total()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@_SETTINGS
@given(ops=st.lists(st.one_of(op, damage_op(REDIS_DAMAGE)), min_size=1, max_size=25))
def test_redis_tier_against_reference(redis_server, ops):  # noqa: F811
    pytest.importorskip("redis")
    raw = redis_server.client()
    raw.flushall()
    prefix = f"nkv:t1:{{{NS}}}:"

    def damage(what, key, other):
        if what == "books":
            raw.set(prefix + "bytes", b"garbage")
        else:
            raw.hset(prefix + "stats", mapping={"writes": "x", "evictions": "y"})
        return False   # the runs are intact: only the books are broken (and rebuilt)
    tiers = [open_tier(redis_server.url, NS, BUDGET), open_tier(redis_server.url, NS, BUDGET)]
    try:
        run_ops(tiers, ops, damage=damage)
    finally:
        for t in tiers:
            t.close()
        raw.close()


def _threads(tier, n_threads=4, rounds=30):
    """``n_threads`` threads writing, finding and reading the same keys through one tier: every
    read is one writer's whole payload, nothing raises."""
    import threading
    import tier_worker as tw
    errors = []

    def work(w):
        try:
            for r in range(rounds):
                i = (r * 7 + w) % 6
                key = tw.run_key(i)
                tier.write_run(key, tw.block_keys(i, 2), tw.payload(key, 3_000 + 100 * w, w))
                hit = tier.find_blocks(tw.block_keys(i, 2))[0]
                if hit is not None:
                    [data] = tier.read_runs([hit[0]])
                    assert data is None or tw.check_payload(hit[0], data)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert tier.stats()["bytes_used"] <= tier.budget_bytes


def test_disk_tier_threads(tmp_path):
    with open_tier(tmp_path, NS, 4 * 3_500) as tier:
        _threads(tier)


def test_redis_tier_threads(redis_server):  # noqa: F811
    raw = redis_server.client()
    raw.flushall()
    raw.close()
    with open_tier(redis_server.url, NS, 4 * 3_600) as tier:
        _threads(tier)
