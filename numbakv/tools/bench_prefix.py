"""Benchmarks of the prefix store (``numbakv bench --sections prefix``; also
``python -m numbakv.tools.bench_prefix``). Every target is a ratio or a time measured in this
run, on this machine:

* ``match`` on a 32k-token prompt (target <= 1 ms);
* a tier-0 hit of a 4k-token prefix at several cache sizes (target <= 100 us whatever the size);
* a tier-1 (host RAM) hit of a 2k-token prefix against ``np.copyto`` of the same bytes
  (target >= 50% of its bandwidth; on a GPU the snapshot import's copy is host -> device);
* time to first token of a 2k-token prompt with a 1.9k-token prefix in the store, tiny Llama,
  against the same prompt without the store (target >= 5x);
* a 10-turn chat on a tiny Gemma-3-style model (5 sliding + 1 full layers) and on a tiny Llama
  through ``hf.attach``: prompt tokens reused per turn (target >= 95% from turn 2 on) and the
  largest logit difference against the same chat without the store (target: 0 up to float32
  rounding of the batch shapes, <= 1e-4 relative).
"""

from __future__ import annotations

import hashlib
import pickle
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

import numbakv as nkv
from numbakv.prefix import PrefixStore

from ._timing import time_alternating


def _median(fn: Callable[[], Any], reps: int, setup: Optional[Callable[[], Any]] = None,
            budget: float = 2.0) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls (``setup()`` untimed before each)."""
    times = []
    t_end = time.perf_counter() + budget
    for i in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if i >= 4 and time.perf_counter() > t_end:
            break
    return float(np.median(times))


def _tiny_cache(cells: int, max_seqs: int = 4, layers: int = 1, heads: int = 1, dim: int = 8,
                dtype: str = "float16", device: str = "cpu"):
    cfg = nkv.CacheConfig(n_layers=layers, n_kv_heads=heads, head_dim=dim, dtype=dtype,
                          capacity=max(1, cells // max_seqs), max_seqs=max_seqs, max_batch=512,
                          device=device)
    return nkv.CausalCache(cfg)


def _fill(cache, seq: int, n: int, chunk: int = 512, seed: int = 0) -> None:
    """Evaluate ``n`` positions of random K/V into ``seq`` (what a prefill stores)."""
    cfg = cache.config
    rng = np.random.default_rng(seed)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        pos = np.arange(lo, hi, dtype=np.int32)
        cache.start_forward(pos, np.full(hi - lo, seq, np.int32))
        k = rng.standard_normal((hi - lo, cfg.n_kv_heads, cfg.head_dim)).astype(cfg.dtype)
        for layer in range(cfg.n_layers):
            cache.set_layer(layer)
            cache.put(k, k)


class HashChainPeer:
    """vLLM's prefix-cache bookkeeping re-implemented as a baseline: a hash per full block of
    ``block`` tokens chained through its parent's, a dict from block hash to its reference
    count (shared blocks stay while a prompt holds them); least
    recently inserted prompt evicted past ``max_prompts``. ``algo="sha256"``: SHA-256 of the
    pickled ``(parent, tokens, extra)`` (vLLM's default, collision-safe like numbakv's BLAKE2b
    block keys); ``"builtin"``: Python's ``hash`` (vLLM's fast, non-cryptographic option)."""

    def __init__(self, block: int = 16, max_prompts: int = 64, algo: str = "sha256") -> None:
        self.block, self.max_prompts, self.algo = block, max_prompts, algo
        self.blocks: Dict[int, int] = {}
        self.prompts: List[List[int]] = []

    def insert(self, tokens: List[int]) -> None:
        h, hashes = None, []
        for i in range(0, len(tokens) - self.block + 1, self.block):
            key = (h, tuple(tokens[i:i + self.block]), None)
            h = hash(key) if self.algo == "builtin" else \
                hashlib.sha256(pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)).digest()
            hashes.append(h)
            self.blocks[h] = self.blocks.get(h, 0) + 1      # reference count
        self.prompts.append(hashes)
        if len(self.prompts) > self.max_prompts:
            for h in self.prompts.pop(0):
                c = self.blocks[h] - 1
                if c:
                    self.blocks[h] = c
                else:
                    del self.blocks[h]


class TriePeer:
    """mlx-lm's prompt cache trie (``LRUPromptCache``) re-implemented as a baseline: one dict
    level per token, the cache object at the prompt's last node; least recently inserted
    prompt evicted past ``max_prompts``."""

    def __init__(self, max_prompts: int = 64) -> None:
        self.root: Dict[Any, Any] = {}
        self.max_prompts = max_prompts
        self.prompts: List[List[int]] = []

    def insert(self, tokens: List[int], value: Any = True) -> None:
        node = self.root
        for t in tokens:
            node = node.setdefault(t, {})
        node["cache"] = value
        self.prompts.append(tokens)
        if len(self.prompts) > self.max_prompts:
            self._remove(self.prompts.pop(0))

    def _remove(self, tokens: List[int]) -> None:
        path, node = [], self.root
        for t in tokens:
            path.append((node, t))
            node = node[t]
        node.pop("cache", None)
        for parent, t in reversed(path):
            if parent[t]:
                break
            del parent[t]


def bench_save(n_tokens: int = 2048, entries=(16, 128), reps: int = 48) -> Dict[str, Any]:
    """``store.save`` of a fresh ``n_tokens`` prompt (tier 0, 32 bytes of K/V per token) into a
    store already holding ``entries`` prompts (each save evicts one), against the two peers'
    insert of the same prompts at the same fill (vLLM's builtin-hash option reported beside),
    interleaved call by call (a busy machine's load moves them together), and a save whose KV
    events are read at once (``take_events``: the block keys and events a save leaves to be
    made when read). Medians. Targets: save <= 2x the faster peer's insert, and flat in the
    number of entries (the largest fill <= 1.5x the smallest)."""
    rng = np.random.default_rng(5)
    out = []
    for n_entries in entries:
        cache = _tiny_cache((n_entries + 4) * n_tokens, max_seqs=n_entries + 2)
        store = PrefixStore(cache, retain_seqs=list(range(2, n_entries + 2)))
        _fill(cache, 0, n_tokens)
        prompts = [rng.integers(0, 1 << 30, n_tokens) for _ in range(n_entries + 2 * reps)]
        lists = [p.tolist() for p in prompts]
        peers = {"hash_chain": HashChainPeer(max_prompts=n_entries),
                 "hash_builtin": HashChainPeer(max_prompts=n_entries, algo="builtin"),
                 "trie": TriePeer(max_prompts=n_entries)}
        for p, lst in zip(prompts[:n_entries], lists[:n_entries]):
            store.save(0, p)
            for peer in peers.values():
                peer.insert(lst)
        store.take_events()
        times: Dict[str, List[float]] = {k: [] for k in ("save", "save_events", *peers)}
        clock = time.perf_counter
        for i in range(n_entries, n_entries + 2 * reps, 2):
            t0 = clock()
            store.save(0, prompts[i])
            times["save"].append(clock() - t0)
            for name, peer in peers.items():
                t0 = clock()
                peer.insert(lists[i])
                times[name].append(clock() - t0)
            t0 = clock()
            store.save(0, prompts[i + 1])
            store.take_events()
            times["save_events"].append(clock() - t0)
        med = {k: float(np.median(v)) for k, v in times.items()}
        faster = min(med["hash_chain"], med["trie"])
        store.close()
        out.append({"tokens": n_tokens, "entries": n_entries, "save_us": 1e6 * med["save"],
                    "save_events_us": 1e6 * med["save_events"],
                    "hash_chain_us": 1e6 * med["hash_chain"], "trie_us": 1e6 * med["trie"],
                    "hash_builtin_us": 1e6 * med["hash_builtin"],
                    "vs_faster_peer": med["save"] / faster,
                    "events_vs_faster_peer": med["save_events"] / faster,
                    "vs_builtin_hash": med["save"] / med["hash_builtin"]})
    return {"runs": out, "growth": out[-1]["save_us"] / out[0]["save_us"]}


def bench_match(n_tokens: int = 32768, reps: int = 50) -> Dict[str, Any]:
    """``store.match`` of a ``n_tokens`` prompt whose whole prefix is stored (the worst case:
    every block is walked), int64 numpy input."""
    cache = _tiny_cache(n_tokens + 1024, max_seqs=2)
    store = PrefixStore(cache, retain_seqs=[1])
    tokens = np.random.default_rng(1).integers(0, 128_000, n_tokens).astype(np.int64)
    _fill(cache, 0, n_tokens)
    store.save(0, tokens)
    query = np.concatenate([tokens[:-5], tokens[-5:] + 1])
    assert store.match(query) == n_tokens - 5
    t = _median(lambda: store.match(query), reps)
    store.close()
    return {"tokens": n_tokens, "median_us": t * 1e6, "target_us": 1000.0}


def bench_tier0_hit(n_tokens: int = 4096, cells_list=(8192, 65536, 262144),
                    reps: int = 30) -> List[Dict[str, Any]]:
    """``store.load`` of a ``n_tokens`` prefix held in cells (copy_prefix: metadata only) as
    the cache grows; the cache is otherwise full of other sequences' tokens."""
    out = []
    for cells in cells_list:
        cache = _tiny_cache(cells, max_seqs=4)
        store = PrefixStore(cache, retain_seqs=[3])
        tokens = np.arange(n_tokens, dtype=np.int64) + 7
        _fill(cache, 0, n_tokens)
        store.save(0, tokens)
        cache.seq_rm(0)
        _fill(cache, 1, min(cells - 2 * n_tokens - 512, cells // 2))   # others' tokens around
        t = _median(lambda: store.load(0, tokens), reps, setup=lambda: cache.seq_rm(0))
        out.append({"cells": cache.n_cells, "tokens": n_tokens, "median_us": t * 1e6,
                    "target_us": 100.0})
        store.close()
    return out


def bench_tier1_hit(n_tokens: int = 2048, layers: int = 8, heads: int = 8, dim: int = 64,
                    reps: int = 12, device: str = "cpu") -> Dict[str, Any]:
    """A host-RAM hit: ``store.load`` of a ``n_tokens`` prefix demoted to tier 1 (import_seq of
    its rows + promotion to cells) against ``np.copyto`` of the same number of bytes."""
    cache = _tiny_cache(4 * n_tokens + 1024, max_seqs=4, layers=layers, heads=heads, dim=dim,
                        device=device)
    per_token = cache.config.nbytes(1)
    store = PrefixStore(cache, retain_seqs=[3], host_bytes=2 * per_token * n_tokens)
    tokens = np.arange(n_tokens, dtype=np.int64)
    _fill(cache, 0, n_tokens)
    store.save(0, tokens)
    cache.seq_rm(0)

    def demote():
        cache.seq_rm(0)
        for e in list(store.index.entries.values()):
            if e.tier == "cells":
                store._evict_cells(e)       # back to host RAM, untimed
        assert store.stats()["tiers"]["host"]["entries"] == 1

    def hit():
        assert store.load(0, tokens) == n_tokens

    t = _median(hit, reps, setup=demote, budget=5.0)
    nbytes = per_token * n_tokens
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    t_copy = _median(lambda: np.copyto(dst, src), reps * 3)
    store.close()
    return {"tokens": n_tokens, "bytes": nbytes, "median_us": t * 1e6,
            "gbps": nbytes / t / 1e9, "copyto_us": t_copy * 1e6,
            "copyto_gbps": nbytes / t_copy / 1e9, "fraction": t_copy / t, "target": 0.5}


# ------------------------------------------------------------------------------- models
def _torch():
    import torch
    torch.set_flush_denormal(True)   # denormal exp() in attention (see NOTES)
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)         # both sides alike, and no oversubscription of shared cores
    return torch


def tiny_llama(layers: int = 4, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
               vocab: int = 1024, max_pos: int = 8192):
    torch = _torch()
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden,
                                   intermediate_size=2 * hidden, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, num_hidden_layers=layers,
                                   max_position_embeddings=max_pos)
    return _random_model(cfg, torch, transformers)


def tiny_gemma3(layers: int = 6, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                window: int = 32, vocab: int = 1024, max_pos: int = 8192):
    """Gemma-3-style: five sliding layers per full one, local/global RoPE bases."""
    torch = _torch()
    import transformers
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
             for i in range(layers)]
    cfg = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=layers,
        head_dim=hidden // heads, query_pre_attn_scalar=hidden // heads, sliding_window=window,
        layer_types=types, max_position_embeddings=max_pos, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    return _random_model(cfg, torch, transformers)


def _random_model(cfg, torch, transformers):
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    return model.eval()


def _forward(model, cache, seq: int, tokens, first: int, chunk: int = 512):
    """Evaluate ``tokens`` into ``seq`` from position ``first``; returns the last logits."""
    torch = _torch()
    logits = None
    for lo in range(0, len(tokens), chunk):
        part = tokens[lo:lo + chunk]
        pos = torch.arange(first + lo, first + lo + len(part))
        cache.start_forward(pos, [seq] * len(part))
        logits = model(input_ids=torch.tensor(part)[None], position_ids=pos[None]).logits[0]
    return logits[-1]


def bench_ttft(prompt: int = 2048, cached: int = 1900, reps: int = 5) -> Dict[str, Any]:
    """Time to first token (prefill + logits of the last prompt token) of a ``prompt``-token
    prompt on a tiny Llama through ``hf.attach``, with and without ``cached`` tokens of it in
    the store (tier 0), interleaved in one run; also checks the logits agree."""
    from numbakv import hf
    model = tiny_llama()
    cache = hf.cache_for(model, capacity=prompt + 64, max_seqs=3, device="cpu")
    store = PrefixStore(cache, retain_seqs=[2])
    hf.attach(model, cache)
    try:
        rng = np.random.default_rng(3)
        tokens = rng.integers(0, 1024, prompt).tolist()
        _forward(model, cache, 0, tokens[:cached], 0)
        store.save(0, tokens[:cached])
        cache.seq_rm(0)
        out = {}

        def cold():
            cache.seq_rm(0)
            out["cold"] = _forward(model, cache, 0, tokens, 0)

        def warm():
            cache.seq_rm(0)
            n = store.load(0, tokens[:-1])
            out["warm"] = _forward(model, cache, 0, tokens[n:], n)
            out["n"] = n

        t = time_alternating({"cold": cold, "warm": warm}, 0.0, reps)
        diff = float((out["cold"] - out["warm"]).abs().max())
        tc, tw = t["cold"], t["warm"]
        return {"prompt": prompt, "cached": out["n"], "cold_ms": tc * 1e3, "warm_ms": tw * 1e3,
                "speedup": tc / tw, "max_logit_diff": diff, "target": 5.0}
    finally:
        hf.detach(model)
        store.close()


def chat(model, *, turns: int = 10, system: int = 256, user: int = 8, reply: int = 8,
         use_store: bool = True, seed: int = 5, swa_memory: Optional[int] = None):
    """A multi-turn chat through ``hf.attach``: each turn's prompt is the whole history (the
    previous prompt, the reply generated to it) plus a new user message; the reply is
    ``reply`` greedy tokens. With the store, each turn loads its longest stored prefix and the
    finished request saves what its sequence holds; without it, every turn prefills from 0.
    Returns per-turn (prompt length, tokens reused) and the logits of every evaluated prompt
    end and reply step."""
    from numbakv import hf
    torch = _torch()
    capacity = system + turns * (user + reply) + 64
    cache = hf.cache_for(model, capacity=capacity, max_seqs=4, device="cpu",
                         **({"swa_memory": swa_memory} if swa_memory else {}))
    store = PrefixStore(cache, retain_seqs=[2, 3], block_tokens=16) if use_store else None
    hf.attach(model, cache)
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    history = rng.integers(0, vocab, system).tolist()
    rows, logits_out = [], []
    try:
        for turn in range(turns):
            prompt = history + rng.integers(0, vocab, user).tolist()
            cache.seq_rm(0)
            n = store.load(0, prompt[:-1]) if store is not None else 0
            last = _forward(model, cache, 0, prompt[n:], n)
            logits_out.append(last.clone())
            out = []
            pos = len(prompt)
            for _ in range(reply):
                tok = int(torch.argmax(last))
                out.append(tok)
                if len(out) == reply:
                    break
                last = _forward(model, cache, 0, [tok], pos)
                logits_out.append(last.clone())
                pos += 1
            held = prompt + out[:-1]
            assert cache.seq_pos_max(0) == len(held) - 1
            if store is not None:
                store.save(0, held)
            rows.append({"turn": turn + 1, "prompt": len(prompt), "reused": n})
            history = prompt + out
        return rows, logits_out, (store.stats() if store is not None else None)
    finally:
        hf.detach(model)
        if store is not None:
            store.close()


def bench_chat(family: str, turns: int = 10) -> Dict[str, Any]:
    model = tiny_gemma3() if family == "gemma3" else tiny_llama()
    t0 = time.perf_counter()
    rows, with_store, stats = chat(model, turns=turns)
    t_store = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, without, _ = chat(model, turns=turns, use_store=False)
    t_plain = time.perf_counter() - t0
    diff = max(float((a - b).abs().max()) for a, b in zip(with_store, without))
    scale = max(float(b.abs().max()) for b in without)
    later = [r["reused"] / r["prompt"] for r in rows[1:]]
    return {"family": family, "turns": rows, "min_reuse_from_turn_2": min(later),
            "max_logit_diff": diff, "logit_scale": scale, "seconds_store": t_store,
            "seconds_plain": t_plain, "target_reuse": 0.95}


def run_prefix(quick: bool = False, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Every figure of the section, as a JSON-ready dict."""
    res: Dict[str, Any] = {}
    log("prefix: match ...")
    res["match"] = bench_match(8192 if quick else 32768)
    log("prefix: tier-0 hits ...")
    res["tier0"] = bench_tier0_hit(1024 if quick else 4096,
                                   (8192, 32768) if quick else (8192, 65536, 262144))
    log("prefix: save vs the peers' insert ...")
    res["save"] = bench_save(2048, (16, 64) if quick else (16, 64, 240), 16 if quick else 48)
    if hasattr(nkv.CausalCache, "export_seq"):
        log("prefix: tier-1 hit ...")
        res["tier1"] = bench_tier1_hit(512 if quick else 2048)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        res["notes"] = ["torch/transformers missing: TTFT and chat benchmarks skipped"]
        return res
    log("prefix: time to first token (tiny Llama) ...")
    res["ttft"] = bench_ttft(512 if quick else 2048, 450 if quick else 1900, 2 if quick else 5)
    for fam in ("gemma3", "llama"):
        log(f"prefix: 10-turn chat ({fam}) ...")
        res.setdefault("chat", []).append(bench_chat(fam, 4 if quick else 10))
    return res


def _status(ok: bool) -> str:
    return "met" if ok else "MISSED"


def format_prefix(res: Dict[str, Any]) -> str:
    lines = ["Prefix store (numbakv.PrefixStore)"]
    m = res.get("match")
    if m:
        lines.append(f"  match, {m['tokens']}-token prompt: {m['median_us']:.0f} us "
                     f"[{_status(m['median_us'] <= m['target_us'])}: <= 1 ms]")
    for r in res.get("tier0", []):
        lines.append(f"  tier-0 hit, {r['tokens']} tokens, cache of {r['cells']} cells: "
                     f"{r['median_us']:.1f} us [{_status(r['median_us'] <= r['target_us'])}: "
                     f"<= 100 us]")
    sv = res.get("save")
    if sv:
        for r in sv["runs"]:
            lines.append(f"  save, {r['tokens']}-token prompt, {r['entries']} entries: "
                         f"{r['save_us']:.0f} us vs insert: vLLM-style hash chain (sha256) "
                         f"{r['hash_chain_us']:.0f} us, mlx-lm-style trie {r['trie_us']:.0f} us "
                         f"= {r['vs_faster_peer']:.1f}x the faster "
                         f"[{_status(r['vs_faster_peer'] <= 2)}: <= 2x]; with its KV events "
                         f"read at once {r['save_events_us']:.0f} us "
                         f"({r['events_vs_faster_peer']:.1f}x); vLLM's builtin-hash "
                         f"option {r['hash_builtin_us']:.0f} us ({r['vs_builtin_hash']:.0f}x)")
        lines.append(f"  save growth from {sv['runs'][0]['entries']} to "
                     f"{sv['runs'][-1]['entries']} entries: {sv['growth']:.2f}x "
                     f"[{_status(sv['growth'] <= 1.5)}: flat, <= 1.5x]")
    t = res.get("tier1")
    if t:
        lines.append(f"  tier-1 hit, {t['tokens']} tokens ({t['bytes'] / 2**20:.1f} MiB): "
                     f"{t['median_us'] / 1e3:.2f} ms, {t['gbps']:.2f} GB/s vs np.copyto "
                     f"{t['copyto_gbps']:.2f} GB/s = {t['fraction']:.0%} "
                     f"[{_status(t['fraction'] >= t['target'])}: >= 50%]")
    t = res.get("ttft")
    if t:
        lines.append(f"  TTFT tiny Llama, {t['prompt']}-token prompt, {t['cached']} cached: "
                     f"{t['cold_ms']:.0f} ms -> {t['warm_ms']:.0f} ms = {t['speedup']:.1f}x "
                     f"[{_status(t['speedup'] >= t['target'])}: >= 5x]; max |logit diff| "
                     f"{t['max_logit_diff']:.2g}")
    for c in res.get("chat", []):
        per = ", ".join(f"{r['reused']}/{r['prompt']}" for r in c["turns"])
        lines.append(f"  {len(c['turns'])}-turn chat, tiny {c['family']}: reused/prompt per "
                     f"turn {per}; min from turn 2 {c['min_reuse_from_turn_2']:.1%} "
                     f"[{_status(c['min_reuse_from_turn_2'] >= 0.95)}: >= 95%]; max |logit "
                     f"diff| vs no store {c['max_logit_diff']:.2g} (logits up to "
                     f"{c['logit_scale']:.2g}); {c['seconds_plain']:.2f} s -> "
                     f"{c['seconds_store']:.2f} s")
    for n in res.get("notes", []):
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    import argparse
    import json
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    res = run_prefix(args.quick, log=lambda s: print(s, flush=True))
    print(format_prefix(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
