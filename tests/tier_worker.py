"""Child processes of the tier tests (run as ``python tests/tier_worker.py <command> ...``).

Payloads are self-checking: ``payload(key, size, writer)`` is the key's bytes followed by
``size - len(key)`` copies of the writer's byte, so a reader can tell a whole entry from a torn
or mixed one (:func:`check_payload`)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NAMESPACE = "nkv1-00000000deadbeef"


def run_key(i: int) -> str:
    return f"{i:032x}"


def block_keys(i: int, n: int = 4):
    return [f"{i:024x}{j:08x}" for j in range(n)]


def payload(key: str, size: int, writer: int) -> bytes:
    head = key.encode()
    return head + bytes([writer & 0xFF]) * (size - len(head))


def check_payload(key: str, data: bytes) -> bool:
    """Whether ``data`` is one writer's whole payload for ``key``."""
    head = key.encode()
    if not data.startswith(head) or len(data) <= len(head):
        return False
    body = memoryview(data)[len(head):]
    return body.tobytes() == bytes([body[0]]) * len(body)


def cmd_write_loop(directory: str, budget: int, size: int, count: int, writer: int,
                   start: int = 0) -> None:
    """Write runs start..start+count-1, printing ``done <i>`` after each (for kill -9 tests)."""
    from numbakv.prefix.tiers import open_tier
    tier = open_tier(directory, NAMESPACE, budget)
    for i in range(start, start + count):
        key = run_key(i)
        ok = tier.write_run(key, block_keys(i), payload(key, size, writer))
        print(("done " if ok else "fail ") + str(i), flush=True)
    tier.close()


def cmd_hammer(spec: str, budget: int, size: int, keys: int, rounds: int, writer: int) -> None:
    """Write and read the same ``keys`` keys ``rounds`` times; report torn reads as JSON."""
    from numbakv.prefix.tiers import open_tier
    tier = open_tier(spec, NAMESPACE, budget, 5.0)
    torn = reads = writes = 0
    for r in range(rounds):
        for i in range(keys):
            key = run_key(i)
            writes += bool(tier.write_run(key, block_keys(i), payload(key, size, writer)))
            found = tier.find_blocks(block_keys(i))
            if found[0] is not None:
                data = tier.read_runs([found[0][0]])[0]
                if data is not None:
                    reads += 1
                    torn += not check_payload(found[0][0], data)
    used = tier.stats()["bytes_used"]
    tier.close()
    print(json.dumps({"torn": torn, "reads": reads, "writes": writes, "used": used}), flush=True)


def cmd_state_write(spec: str, budget: int) -> None:
    """Fill a cache with seeded random K/V and store seq 0's state bytes as run 1."""
    import hashlib
    from numbakv.prefix.tiers import open_tier
    cache = make_cache()
    fill(cache, 0, 40, seed=7)
    data = cache.state_bytes(seq=0)
    tier = open_tier(spec, NAMESPACE, budget, 5.0)
    ok = tier.write_run(run_key(1), block_keys(1, 3), data)
    tier.close()
    print(json.dumps({"ok": ok, "nbytes": len(data),
                      "sha": hashlib.sha256(data).hexdigest()}), flush=True)


def make_cache():
    import numbakv as nkv
    cfg = nkv.CacheConfig(2, 2, 16, capacity=128, max_seqs=2, device="cpu")
    return nkv.CausalCache(cfg)


def fill(cache, seq: int, n: int, seed: int) -> None:
    """Put n tokens of seeded random K/V at positions 0..n-1 of ``seq``."""
    import numpy as np
    rng = np.random.default_rng(seed)
    cache.start_forward(np.arange(n, dtype=np.int32), np.full(n, seq, dtype=np.int32))
    for layer in range(cache.config.n_layers):
        cache.set_layer(layer)
        cache.put(rng.standard_normal((n, 2, 16)).astype(np.float16),
                  rng.standard_normal((n, 2, 16)).astype(np.float16))


def store_cache(capacity: int = 64):
    """A 2-sequence CPU cache (seq 1 retained by the store) small enough that a long batch
    forces the store to evict (demote) what it keeps in cells."""
    import numbakv as nkv
    cfg = nkv.CacheConfig(2, 2, 16, capacity=capacity, max_seqs=2, max_batch=256, device="cpu")
    return nkv.CausalCache(cfg)


MODEL_ID = "tests/tiny@r1"


def open_store(cache, spec: str, salt: bytes = b"", model_id: str = MODEL_ID, **kw):
    import numbakv as nkv
    from numbakv.prefix.tiers import is_url
    lower = {"remote": spec} if is_url(spec) else {"disk_dir": spec, "disk_bytes": 1 << 24}
    return nkv.PrefixStore(cache, retain_seqs=(1,), salt=salt, model_id=model_id, **lower, **kw)


def prompt(n: int = 40):
    return list(range(1000, 1000 + n))


def cmd_store_save(spec: str, salt: str = "") -> None:
    """Process A: prefill seq 0 with seeded K/V for ``prompt()``, save it in a PrefixStore with
    a disk or Redis tier, then force the store to evict it from cells (a batch that needs the
    room), which demotes it to the lower tier. Exits without ``store.close()``: the runs stay."""
    import numpy as np
    cache = store_cache()
    store = open_store(cache, spec, salt.encode())
    fill(cache, 0, 40, seed=11)
    assert store.save(0, prompt()) == 40
    cache.seq_rm(0)
    n = 100  # 128 cells, 40 held by the retained copy: placing 100 needs the store's room
    cache.start_forward(np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int32))
    cache.seq_rm(0)
    store._writer.flush(30)   # the background writer's queue (no store.flush(), no close())
    tiers = store.stats()["tiers"]
    lower = {k: v["entries"] for k, v in tiers.items() if k in ("disk", "redis")}
    print(json.dumps({"lower_entries": lower}), flush=True)


def cmd_store_save_live(spec: str, mode: str) -> None:
    """Process A of the write-through tests: prefill seq 0 with seeded K/V, ``save`` it (it
    stays in cells: nothing is evicted), then either ``store.flush()`` (mode ``flush``) or just
    wait until the background writer reports the run written (mode ``through``: no flush, no
    close), print ``saved`` and sleep until killed (SIGKILL: no atexit, no close). Mode
    ``exit``: return right after the save (the interpreter's exit hook closes the store)."""
    import time
    cache = store_cache()
    store = open_store(cache, spec)
    fill(cache, 0, 40, seed=11)
    assert store.save(0, prompt()) == 40
    if mode == "exit":
        return           # a normal exit without flush() or close(): the exit hook writes
    if mode == "flush":
        assert store.flush(30)
    else:
        deadline = time.monotonic() + 30
        while store.stats()["writer"]["written"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    print(json.dumps({"saved": store.stats()["writer"]}), flush=True)
    time.sleep(300)


def cmd_fsize(directory: str, limit: int, size: int) -> None:
    """With RLIMIT_FSIZE = limit (a full disk for this process): write a small run, then one of
    ``size`` bytes; report both results, the tier's errors and what is left in the directory."""
    import resource
    import signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG instead of death
    from numbakv.prefix.tiers import open_tier
    tier = open_tier(directory, NAMESPACE, 1 << 30)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    small = tier.write_run(run_key(1), block_keys(1), payload(run_key(1), 1000, 1))
    big = tier.write_run(run_key(2), block_keys(2), payload(run_key(2), size, 2))
    found = tier.find_blocks(block_keys(1) + block_keys(2))
    data = tier.read_runs([run_key(1)])[0]
    errors = tier.stats()["errors"]
    tier.close()
    print(json.dumps({"small": small, "big": big, "errors": errors,
                      "found": [f is not None for f in found],
                      "small_ok": data is not None and check_payload(run_key(1), data)}),
          flush=True)


def cmd_as_nobody(directory: str, mode: str) -> None:
    """As user nobody, use ``directory`` (mode ``construct``: from the start; ``runtime``: built
    as root, then the effective user drops to nobody): report the construction error, or the
    results of a write, a lookup and a read."""
    from numbakv.prefix.tiers import open_tier
    if mode == "construct":
        os.setgid(65534)
        os.setuid(65534)
    try:
        tier = open_tier(directory, NAMESPACE, 1 << 20)
    except ValueError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return
    if mode == "runtime":   # built as root; now the files are someone else's
        os.setegid(65534)
        os.seteuid(65534)
    out = {"error": None,
           "write": tier.write_run(run_key(9), block_keys(9), payload(run_key(9), 100, 9)),
           "found": tier.find_blocks(block_keys(1))[0] is not None}
    data = tier.read_runs([run_key(1)])[0]
    out["read"] = data is not None and check_payload(run_key(1), data)
    out["errors"] = tier.stats()["errors"]
    tier.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    fn = globals()["cmd_" + name]
    fn(*[int(a) if a.lstrip("-").isdigit() else a for a in args])
