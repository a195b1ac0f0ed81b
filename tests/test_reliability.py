"""Reliability (issue 17): all-or-nothing WrapperCache fan-outs (K/V included), caches that
cannot be grouped, input validation that names the argument and changes nothing, concurrent use
from two threads detected, and the up-front memory check (RLIMIT_AS, cgroup v1/v2, every cache
kind)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import numbakv as nkv
from numbakv import _memory
from numbakv.errors import ConcurrentUseError, KVCacheError

H, D = 2, 8
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(device="cpu", **kw):
    base = dict(n_layers=1, n_kv_heads=H, head_dim=D, dtype="float32", capacity=8, max_seqs=2,
                max_batch=4, device=device)
    base.update(kw)
    return nkv.CacheConfig(**base)


def _snapshot(cache):
    """Everything observable of a CausalCache: its cell table, forward pass and all K/V bits."""
    cells = cache.cells.cells
    k, v = cache.storage.read_cells(np.arange(cache.n_cells, dtype=np.int32))
    return (cells["pos"].copy(), cells["shift"].copy(), cells["seqs"].copy(),
            cache.cells.n_used, cache._forward, k.view(np.uint8), v.view(np.uint8))


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y)
        else:
            assert x is y or x == y


def _fill(cache, seq, positions, rng):
    positions = np.asarray(positions)
    cache.start_forward(positions, np.full(len(positions), seq))
    cfg = cache.config if hasattr(cache, "config") else cache.caches[0].config
    n_layers = cache.n_layers if hasattr(cache, "n_layers") else cfg.n_layers
    for layer in range(n_layers):
        cache.set_layer(layer)
        cache.put(rng.standard_normal((len(positions), H, D)).astype(np.float32),
                  rng.standard_normal((len(positions), H, D)).astype(np.float32))


class FailingShift:
    """A shift callable (adds the delta to every element: deterministic and not its own
    inverse) that raises when armed."""

    def __init__(self):
        self.armed = False

    def __call__(self, layer, key, deltas):
        if self.armed:
            raise RuntimeError("shift failed on the device")
        return key + np.asarray(deltas, np.float32)[:, None, None]


# ============================================================================ wrapper fan-out
@pytest.mark.parametrize("failing_group", [0, 1])
def test_failed_remove_restores_every_group_bit_exact(failing_group):
    """The second group's rotation fails after the first group re-rotated its keys: every
    group's cells and K/V come back bit-exact (a rotation back would not be)."""
    rng = np.random.default_rng(1)
    shifts = [FailingShift(), FailingShift()]
    swa = nkv.CausalCache(_cfg(n_layers=2, capacity=16, max_batch=8), swa_window=6,
                          shift=shifts[0])
    full = nkv.CausalCache(_cfg(capacity=16, max_batch=8), shift=shifts[1])
    caches = [swa, full] if failing_group == 1 else [full, swa]
    groups = [0, 1, 0] if failing_group == 1 else [1, 0, 1]
    w = nkv.WrapperCache(caches, layer_groups=groups)
    _fill(w, 0, range(6), rng)
    _fill(w, 1, range(5), rng)
    w.seq_add(1, 2, None, 3)               # a pending rotation in both groups too
    before = [_snapshot(c) for c in caches]
    [s for s in shifts if s is caches[failing_group].shift][0].armed = True
    with pytest.raises(RuntimeError, match="shift failed"):
        w.remove(0, 1, 3)
    for cache, snap in zip(caches, before):
        _assert_same(_snapshot(cache), snap)
        cache.cells.check_consistency()
    for s in shifts:
        s.armed = False
    w.remove(0, 1, 3)                      # and it works once the device does
    assert w.seq_pos_max(0) == 3


def test_failed_fan_out_of_a_metadata_op_restores_forward_and_tables(monkeypatch):
    rng = np.random.default_rng(2)
    a = nkv.CausalCache(_cfg(), shift=nkv.RopeShift())
    b = nkv.CausalCache(_cfg(), shift=nkv.RopeShift())
    w = nkv.WrapperCache([a, b])
    _fill(w, 0, range(4), rng)
    before = [_snapshot(c) for c in (a, b)]

    def broken(*args, **kwargs):
        raise MemoryError("no memory for the copy")
    monkeypatch.setattr(b.cells, "seq_cp", broken)
    with pytest.raises(MemoryError):
        w.seq_cp(0, 1, 0, 2)
    for cache, snap in zip((a, b), before):
        _assert_same(_snapshot(cache), snap)


def test_same_cache_twice_or_ungroupable_caches_are_refused():
    a = nkv.CausalCache(_cfg())
    with pytest.raises(ValueError, match=r"caches\[1\] is the same cache as caches\[0\]"):
        nkv.WrapperCache([a, a])
    with pytest.raises(ValueError, match="max_seqs"):
        nkv.WrapperCache([a, nkv.CausalCache(_cfg(max_seqs=3))])
    with pytest.raises(ValueError, match="n_layers"):
        nkv.WrapperCache([a, nkv.CausalCache(_cfg(n_layers=2))])
    nkv.WrapperCache([a, nkv.CausalCache(_cfg(n_layers=2))], layer_groups=[0, 1, 1])
    with pytest.raises(ValueError, match="device"):
        nkv.WrapperCache([a, nkv.CausalCache(_cfg(device="sim"))])
    closed = nkv.CausalCache(_cfg())
    closed.close()
    with pytest.raises(ValueError, match="closed"):
        nkv.WrapperCache([a, closed])
    with pytest.raises(ValueError, match="caches"):
        nkv.WrapperCache(a)


# ============================================================================ validation
def test_encoder_cache_checks_its_inputs_and_changes_nothing():
    enc = nkv.EncoderCache(_cfg(capacity=4))
    k = np.ones((2, H, D), np.float32)
    with pytest.raises(ValueError, match="start_forward"):
        enc.put(k, k)
    with pytest.raises(ValueError, match="start_forward"):
        enc.get()
    for positions, seqs, name in (([-1, 0], [0, 0], "positions"), ([0, 1], [0, 2], "seqs"),
                                  ([0, 1], [-1, 0], "seqs"), ([[0], [1, 2]], [0, 0], "positions"),
                                  ([0], [0, 0], "length")):
        with pytest.raises(ValueError, match=name):
            enc.start_forward(positions, seqs, encoder_pos=0)
        assert not enc._started and enc.encoder_pos is None
    with pytest.raises(ValueError, match="reserve"):
        enc.start_forward([0], [0], reserve="False")
    enc.start_forward([0, 1], [0, 1], encoder_pos=0)
    enc.put(k, k)
    with pytest.raises(ValueError, match="except_"):
        enc.set_causal([5])
    enc.close()
    for call in (lambda: enc.can_resume(0, 1), lambda: enc.set_layer(0), enc.defrag,
                 lambda: enc.start_forward([0], [0])):
        with pytest.raises(KVCacheError, match="closed"):
            call()


def test_closed_caches_refuse_set_layer():
    c = nkv.CausalCache(_cfg())
    w = nkv.WrapperCache([nkv.CausalCache(_cfg())])
    for cache in (c, w):
        cache.close()
        with pytest.raises(KVCacheError, match="closed"):
            cache.set_layer(0)


@pytest.mark.parametrize("reserve", ["False", 0, 1, None, "yes"])
def test_reserve_must_be_a_bool(reserve):
    c = nkv.CausalCache(_cfg())
    w = nkv.WrapperCache([nkv.CausalCache(_cfg()), nkv.CausalCache(_cfg())])
    for cache in (c, w):
        with pytest.raises(ValueError, match="reserve must be a bool"):
            cache.start_forward([0], [0], reserve=reserve)
    assert c._forward is None and c.n_used == 0
    c.start_forward([0], [0], reserve=np.bool_(True))
    assert c._forward.reserve and c.n_used == 0


@pytest.mark.parametrize("kwargs, needle", [
    (dict(neox="False"), "neox must be a bool"),
    (dict(neox=1), "neox must be a bool"),
    (dict(freq_factors={1: 2}), "freq_factors must be a 1-D sequence"),
    (dict(freq_factors=[[1.0, 2.0], [3.0, 4.0]]), r"freq_factors must be 1-D"),
    (dict(freq_factors=np.ones((2, 2))), r"freq_factors must be 1-D"),
    (dict(freq_factors=[[1.0], [2.0, 3.0]]), "freq_factors"),
    (dict(freq_factors="1234"), "freq_factors"),
    (dict(freq_factors=[1.0, "x"]), "freq_factors"),
    (dict(freq_factors=[1.0, -1.0]), "freq_factors"),
    (dict(base=True), "base"),
    (dict(freq_scale=False), "freq_scale"),
])
def test_rope_shift_parameters_are_checked(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        nkv.RopeShift(**kwargs)


def _bad_arrays():
    torch = pytest.importorskip("torch")
    return {"ragged": [[0, 1], [2]], "meta": torch.zeros(2, dtype=torch.int64, device="meta"),
            "object": object(), "strings": ["a", "b"]}


@pytest.mark.parametrize("kind", ["ragged", "meta", "object", "strings"])
def test_unreadable_inputs_name_the_argument(kind):
    """Ragged lists, tensors on torch's `meta` device and the like: every message names the
    argument, and nothing changes."""
    bad = _bad_arrays()[kind]
    torch = pytest.importorskip("torch")
    bad_kv = {"ragged": [[[0.0] * D] * H, [[0.0] * (D - 1)] * H],
              "meta": torch.zeros(2, H, D, device="meta"), "object": object(),
              "strings": np.array([["a"] * D] * H * 2).reshape(2, H, D)}[kind]
    rng = np.random.default_rng(3)
    c = nkv.CausalCache(_cfg(), shift=nkv.RopeShift())
    _fill(c, 0, range(2), rng)
    c.start_forward([2, 3], [0, 0])
    before = _snapshot(c)
    good = np.zeros((2, H, D), np.float32)
    calls = [("positions", lambda: c.start_forward(bad, [0, 0])),
             ("seqs", lambda: c.start_forward([4, 5], bad)),
             ("except_", lambda: c.set_causal(bad)),
             ("key", lambda: c.put(bad_kv, good)),
             ("value", lambda: c.put(good, bad_kv)),
             ("tokens", lambda: c.state_bytes(tokens=bad))]
    for name, call in calls:
        with pytest.raises(ValueError, match=name):
            call()
        _assert_same(_snapshot(c), before)
    enc = nkv.EncoderCache(_cfg())
    with pytest.raises(ValueError, match="positions"):
        enc.start_forward(bad, [0, 0])
    step = nkv.StepCache(device="cpu")
    with pytest.raises(ValueError, match="keys"):
        step.update(bad_kv if kind != "strings" else bad_kv[None], good[None])
    assert step.offset == 0


# ============================================================================ threads
def test_a_second_thread_inside_a_cache_is_detected():
    """Thread A is inside ``remove`` (blocked in the shift callable); thread B's calls raise
    ConcurrentUseError instead of corrupting, and the cache is intact afterwards."""
    rng = np.random.default_rng(4)
    inside, release = threading.Event(), threading.Event()

    def slow_shift(layer, key, deltas):
        inside.set()
        release.wait(10)
        return key + np.asarray(deltas, np.float32)[:, None, None]

    c = nkv.CausalCache(_cfg(capacity=8, max_batch=8), shift=slow_shift)
    _fill(c, 0, range(6), rng)
    errors = []
    a = threading.Thread(target=lambda: c.remove(0, 1, 2))
    a.start()
    assert inside.wait(10)
    good = np.zeros((1, H, D), np.float32)
    calls = [lambda: c.start_forward([6], [0]), lambda: c.put(good, good), c.get,
             lambda: c.seq_rm(0), c.defrag, lambda: c.state_bytes(), lambda: c.set_layer(0)]
    for call in calls:
        t = threading.Thread(target=lambda call=call: errors.append(_raises(call)))
        t.start()
        t.join(10)
    release.set()
    a.join(10)
    assert errors == [ConcurrentUseError] * len(calls)
    c.cells.check_consistency()
    assert c.seq_pos_max(0) == 4 and c.n_used == 5


def _raises(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001
        return type(exc)
    return None


def test_two_threads_hammering_one_cache_never_corrupt_it():
    """Two threads call into one cache as fast as they can (thread switches forced every
    microsecond): every call completes or raises ConcurrentUseError, some are refused, and the
    cell table stays consistent and saves a state that loads back (before the guard, 490 of
    ~500 cells ended up with wrong K/V and state_bytes wrote checksum mismatches). A round
    whose threads never overlapped (the OS ran one alone: seen on a loaded 2-core machine) is
    checked all the same and followed by another, up to five, until one is refused."""
    c = nkv.CausalCache(_cfg(capacity=64, max_seqs=2, max_batch=4))

    def hammer_round(r):
        barrier = threading.Barrier(2)
        outcomes = {0: [], 1: []}

        def work(seq):
            rng = np.random.default_rng(10 * r + seq)
            barrier.wait()
            for i in range(300):
                pos = i % 40
                ops = [lambda: c.start_forward([pos], [seq]) if pos > c.seq_pos_max(seq) else None,
                       lambda: c.seq_rm(seq, int(rng.integers(0, 40))),
                       lambda: c.seq_cp(seq, 1 - seq, 0, 3), lambda: c.state_bytes(),
                       lambda: c.start_forward([0, 1], [0, 1], reserve=True), c.defrag]
                try:
                    ops[int(rng.integers(0, len(ops)))]()
                    outcomes[seq].append(None)
                except ConcurrentUseError:
                    outcomes[seq].append(ConcurrentUseError)
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            threads = [threading.Thread(target=work, args=(s,)) for s in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        finally:
            sys.setswitchinterval(old)
        assert len(outcomes[0]) == len(outcomes[1]) == 300     # no other exception escaped
        c.cells.check_consistency()
        copy = nkv.CausalCache(_cfg(capacity=64, max_seqs=2, max_batch=4))
        copy.load_state_bytes(c.state_bytes())
        assert np.array_equal(copy.cells.cells, c.cells.cells)
        return outcomes[0].count(ConcurrentUseError) + outcomes[1].count(ConcurrentUseError)

    refused = 0
    for r in range(5):
        refused += hammer_round(r)
        if refused:
            break
    assert refused > 0


def test_two_caches_on_two_threads_keep_working():
    results = {}

    def work(seq):
        rng = np.random.default_rng(seq)
        c = nkv.CausalCache(_cfg(capacity=32, max_seqs=1, max_batch=4), shift=nkv.RopeShift())
        for step in range(30):
            c.start_forward([step], [0])
            c.put(np.full((1, H, D), step, np.float32), np.full((1, H, D), step, np.float32))
            k, v, mask = c.get()
            assert float(v[-1, 0, 0]) == step
        c.remove(0, 3, 5)
        results[seq] = (c.seq_pos_max(0), c.n_used, float(rng.random()) >= 0)
    threads = [threading.Thread(target=work, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: (27, 28, True), 1: (27, 28, True)}


def test_same_thread_may_reenter():
    """A shift callable that reads the cache it is called from (same thread) is fine."""
    seen = []

    def shift(layer, key, deltas):
        seen.append(c.seq_pos_max(0))
        return key
    c = nkv.CausalCache(_cfg(), shift=shift)
    _fill(c, 0, range(4), np.random.default_rng(5))
    c.remove(0, 0, 1)
    assert seen and c.seq_pos_max(0) == 2


# ============================================================================ memory
def _fake_cgroup(tmp_path, monkeypatch, version: str, limit: int, usage: int):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 1048576000 kB\nMemAvailable: 1048576000 kB\n")
    (proc / "self" / "status").write_text("VmSize: 1000 kB\n")
    cg = tmp_path / "cgroup"
    if version == "v2":
        (proc / "self" / "cgroup").write_text("0::/job/worker\n")
        d = cg / "job" / "worker"
        d.mkdir(parents=True)
        (cg / "cgroup.controllers").write_text("memory\n")
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text(f"{usage}\n")
        (cg / "job" / "memory.max").write_text("max\n")
    else:
        (proc / "self" / "cgroup").write_text("4:memory:/job\n0::/\n")
        d = cg / "memory" / "job"
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (cg / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    monkeypatch.setattr(_memory, "PROC", str(proc))
    monkeypatch.setattr(_memory, "CGROUP", str(cg))


@pytest.mark.parametrize("version, limit_file", [("v2", "memory.max"),
                                                 ("v1", "memory.limit_in_bytes")])
def test_memory_check_respects_the_cgroup_limit(tmp_path, monkeypatch, version, limit_file):
    _fake_cgroup(tmp_path, monkeypatch, version, limit=64 << 20, usage=32 << 20)
    have, why = _memory.host_available()
    assert have == 32 << 20 and limit_file in why
    cfg = _cfg(n_layers=4, head_dim=64, capacity=4096, max_seqs=2, dtype="float32")
    assert cfg.nbytes() == 4 * 8192 * 2 * 128 * 4          # 32 MiB of K/V alone
    with pytest.raises(ValueError, match=limit_file) as info:
        nkv.CausalCache(cfg)
    msg = str(info.value)
    need = int(re.search(r"memory \((\d+) bytes", msg).group(1))
    assert need > cfg.nbytes() and "cell table" in msg and "mask at max_batch" in msg
    assert f"({32 << 20} bytes) is available" in msg
    nkv.CausalCache(cfg.replace(capacity=1024))            # a smaller one fits
    with pytest.raises(ValueError, match="EncoderCache"):
        nkv.EncoderCache(cfg.replace(capacity=4096 * 8))
    with pytest.raises(ValueError, match="StepCache"):
        nkv.StepCache(step=1 << 20, device="cpu").update(np.zeros((1, 2, 1, 8), np.float32),
                                                         np.zeros((1, 2, 1, 8), np.float32))


def test_memory_check_counts_everything_the_cache_allocates(tmp_path, monkeypatch):
    """K/V, the mask at max_batch, the cell table and its snapshot: a cache whose K/V alone fit
    but whose worst-case mask does not is refused."""
    cfg = _cfg(n_layers=1, head_dim=8, capacity=4096, max_seqs=4, max_batch=512)
    kv = cfg.nbytes()                                       # 2 MiB
    mask = 512 * 4096 * 4 * 4                               # 32 MiB
    _fake_cgroup(tmp_path, monkeypatch, "v2", limit=kv + mask // 2, usage=0)
    with pytest.raises(ValueError, match="mask at max_batch 32.00 MiB"):
        nkv.CausalCache(cfg)
    nkv.CausalCache(cfg.replace(max_batch=16))


def test_memory_check_respects_rlimit_as():
    """In a process limited by RLIMIT_AS, a cache that does not fit is a ValueError naming the
    limit, not numpy's MemoryError half-way through allocating."""
    script = textwrap.dedent("""
        import resource, sys
        import numbakv as nkv
        from numbakv import _memory
        with open('/proc/self/status') as f:
            vm = [int(l.split()[1]) * 1024 for l in f if l.startswith('VmSize:')][0]
        resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
        cfg = nkv.CacheConfig(4, 8, 128, dtype='float32', capacity=65536, device='cpu')
        try:
            nkv.CausalCache(cfg)
        except ValueError as exc:
            print('REFUSED', exc)
            sys.exit(0)
        print('ACCEPTED')
    """)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    assert "RLIMIT_AS" in out.stdout and "GiB" in out.stdout


# ============================================================================ argument sweep
def _garbage():
    torch = pytest.importorskip("torch")
    return {"ragged": [[0, 1], [2]], "meta": torch.zeros(2, dtype=torch.int64, device="meta"),
            "object": object(), "str": "abc", "none": None, "nan": float("nan"), "huge": 2**70,
            "neg": -5, "bool": True, "float": 1.5, "dict": {1: 2}, "nested": [[[1]]],
            "meta3": torch.zeros(2, 2, 8, device="meta"),
            "meta4": torch.zeros(1, 2, 2, 8, device="meta")}


def _sweep_caches():
    def causal():
        c = nkv.CausalCache(_cfg(), shift=nkv.RopeShift())
        _fill(c, 0, range(2), np.random.default_rng(6))
        c.start_forward([2, 3], [0, 0])
        return c

    def wrapper():
        w = nkv.WrapperCache([nkv.CausalCache(_cfg(), shift=nkv.RopeShift()),
                              nkv.CausalCache(_cfg(), shift=nkv.RopeShift())])
        _fill(w, 0, range(2), np.random.default_rng(7))
        w.start_forward([2, 3], [0, 0])
        return w

    def encoder():
        e = nkv.EncoderCache(_cfg())
        e.start_forward([0, 1], [0, 0], encoder_pos=0)
        return e

    def step():
        s = nkv.StepCache(step=4, device="cpu")
        s.update(np.ones((1, H, 2, D), np.float32), np.ones((1, H, 2, D), np.float32))
        return s

    def rotating():
        r = nkv.RotatingCache(4, step=2, device="cpu")
        r.update(np.ones((1, H, 2, D), np.float32), np.ones((1, H, 2, D), np.float32))
        return r
    seq_ops = ["remove", "copy_prefix", "can_resume", "seq_rm", "seq_cp", "seq_keep", "seq_add",
               "seq_div", "seq_pos_min", "seq_pos_max", "state_bytes"]
    return {"causal": (causal, ["start_forward", "set_layer", "put", "set_causal"] + seq_ops
                       + ["load_state_bytes", "save_state"]),
            "wrapper": (wrapper, ["start_forward", "set_layer_type", "set_layer", "put",
                                  "set_causal", "save_state"] + seq_ops),
            "encoder": (encoder, ["start_forward", "set_layer", "put", "remove", "can_resume",
                                  "set_causal"]),
            "step": (step, ["update", "trim", "state_bytes"]),
            "rotating": (rotating, ["update", "trim", "state_bytes"])}


_GOOD = {"positions": [2, 3], "seqs": [0, 0], "reserve": False, "layer": 0, "except_": [0],
         "seq": 0, "begin": 0, "end": 1, "src_seq": 0, "dst_seq": 1, "length": 1, "pos": 1,
         "src": 0, "dst": 1, "p0": 0, "p1": 1, "delta": 1, "d": 2, "tokens": [1],
         "metadata": {"a": "b"}, "strict": True, "index": 0, "encoder_pos": 0, "n": 1,
         "progress": False}


def _observable(cache):
    if isinstance(cache, nkv.WrapperCache):
        return [_snapshot(c) for c in cache.caches]
    if isinstance(cache, nkv.CausalCache):
        return [_snapshot(cache)]
    return None


@pytest.mark.parametrize("kind", ["causal", "wrapper", "encoder", "step", "rotating"])
def test_every_public_argument_rejects_garbage_naming_it(kind, tmp_path, monkeypatch):
    """Each argument of each public method, given garbage of every kind (ragged lists, torch
    `meta` tensors, objects, strings, None, NaN, huge and negative numbers, bools, dicts):
    a ValueError or KVCacheError whose message names the argument, and (for the cell caches)
    nothing changed."""
    import inspect
    monkeypatch.chdir(tmp_path)   # a garbage string is still a valid relative path to save to
    make, methods = _sweep_caches()[kind]
    good = dict(_GOOD, path=str(tmp_path / "s.st"),
                key=np.ones((2, H, D), np.float32), value=np.ones((2, H, D), np.float32),
                keys=np.ones((1, H, 1, D), np.float32), values=np.ones((1, H, 1, D), np.float32))
    failures = []
    for name in methods:
        params = [p for p in inspect.signature(getattr(type(make()), name)).parameters
                  if p != "self"]
        for arg in params:
            for label, bad in _garbage().items():
                cache = make()
                kwargs = {p: good[p] for p in params if p in good}
                if name == "load_state_bytes":
                    kwargs["data"] = cache.state_bytes(0)
                kwargs[arg] = bad
                before = _observable(cache)
                try:
                    getattr(cache, name)(**kwargs)
                except (ValueError, KVCacheError) as exc:
                    if arg.rstrip("_") not in str(exc):
                        failures.append((name, arg, label, str(exc)[:100]))
                    after = _observable(cache)
                    if before is not None:
                        for a, b in zip(after, before):
                            _assert_same(a, b)
                except Exception as exc:  # noqa: BLE001 - the failure this test looks for
                    failures.append((name, arg, label, f"{type(exc).__name__}: {exc}"[:100]))
    assert not failures, failures


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_failed_defrag_in_a_later_group_restores_the_first_bit_exact(device, monkeypatch):
    """issue 37: ``WrapperCache.defrag`` is all or nothing, as every other wrapper operation:
    the second group failing leaves the first group's cells, K/V (every cell's bits), forward
    pass and defrag count exactly as they were."""
    rng = np.random.default_rng(4)
    a = nkv.CausalCache(_cfg(device=device, capacity=8), shift=nkv.RopeShift())
    b = nkv.CausalCache(_cfg(device=device, capacity=8), shift=nkv.RopeShift())
    w = nkv.WrapperCache([a, b])
    _fill(w, 0, range(3), rng)
    _fill(w, 1, range(4), rng)
    w.seq_rm(0, 0, 2)                       # holes at the front: defrag has moves to make
    _fill(w, 0, [5], rng)
    before = [_snapshot(c) for c in (a, b)]
    counts = [a.defrag_count, b.defrag_count]

    def broken(moves):
        raise MemoryError("the device ran out of memory mid-defrag")
    monkeypatch.setattr(b.storage, "move_blocks", broken)
    with pytest.raises(MemoryError):
        w.defrag()
    for cache, snap in zip((a, b), before):
        _assert_same(_snapshot(cache), snap)
        cache.cells.check_consistency()
    assert [a.defrag_count, b.defrag_count] == counts
    monkeypatch.undo()
    w.defrag()                              # and it works once the device does
    assert a.cells.n_used == a.cells.cells["pos"][:a.cells.n_used].size
