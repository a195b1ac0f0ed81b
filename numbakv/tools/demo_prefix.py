"""The prefix-store segment of ``numbakv demo``: several users hold multi-turn conversations over
one small cache through ``PromptCache(store=PrefixStore(...))``. The cache is too small to keep
every conversation in cells, so the store evicts finished ones to host RAM and promotes them
back when their user returns. Every turn reports where its prompt's tokens came from (a live
slot, the store's cells, host RAM, or computed) and every row a turn reuses is checked against
the K/V written for that token at that position (the K/V here encode (token, position, layer),
so a wrong row cannot pass). ``numbakv demo`` runs it after the main demo (``--no-prefix-store``
skips it) and draws it as the picture's lower panel."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import numpy as np

import numbakv as nkv
from numbakv.prefix import PrefixStore
from numbakv.prefix.store import HOST
from ._demo_errors import DemoVerificationError


def _kv(tokens, positions, layer: int, heads: int, dim: int):
    t = np.asarray(tokens, np.float32)[:, None, None]
    p = np.asarray(positions, np.float32)[:, None, None]
    k = np.broadcast_to(t + 4096.0 * p + 0.25 * layer, (len(t), heads, dim)).astype(np.float32)
    return k, k + np.float32(0.5)


def _evaluate(cache, seq: int, tokens, first: int) -> None:
    cfg = cache.config
    for lo in range(0, len(tokens), cfg.max_batch):
        part = tokens[lo:lo + cfg.max_batch]
        pos = np.arange(first + lo, first + lo + len(part), dtype=np.int32)
        cache.start_forward(pos, np.full(len(part), seq, np.int32))
        for layer in range(cfg.n_layers):
            cache.set_layer(layer)
            cache.put(*_kv(part, pos, layer, cfg.n_kv_heads, cfg.head_dim))


def _verify(cache, seq: int, tokens) -> None:
    cells = cache.cells.seq_cells(seq)
    pos, _ = cache.cells.mask_inputs(0, cache.n_cells)
    p = pos[cells]
    if sorted(p.tolist()) != list(range(len(tokens))):
        raise DemoVerificationError(f"seq {seq} holds positions {sorted(p.tolist())[:8]}..., expected "
                             f"0..{len(tokens) - 1}")
    for layer in range(cache.config.n_layers):
        want, _ = _kv([tokens[i] for i in p], p, layer, cache.config.n_kv_heads,
                      cache.config.head_dim)
        if not np.array_equal(np.asarray(cache.storage.keys[layer, cells]), want):
            raise DemoVerificationError(f"seq {seq}: a reused K row is not its token's")


def _host_entries(store: PrefixStore) -> Dict[int, Any]:
    # the store's index is the only place that says which entry moved to host RAM in a turn
    # (stats() counts hits, not demotions); entries are never re-tiered in place: a demotion
    # adds a new host entry, a promotion a new cells entry
    return {e.id: e for e in store.index.entries.values() if e.tier == HOST}


def run_prefix_demo(users: int = 6, turns: int = 4, system: int = 96, message: int = 24,
                    reply: int = 16, seed: int = 0) -> Dict[str, Any]:
    """Run the workload; returns ``{"rows", "totals", "stats", "time"}``: one row per
    (turn, user) request with its prompt length, the tokens reused and where from
    (``"slot"``, ``"cells"`` = tier 0, ``"host"`` = tier 1, ``"-"``), the tokens computed, and
    ``"demoted"``: ``[(user, tokens)]`` for each conversation the store moved from its cells to
    host RAM during that request, ``"dropped"``: host entries evicted without a promotion.
    Raises ``DemoVerificationError`` when a reused row is not its token's K/V."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=2, head_dim=8, dtype="float32",
                          capacity=system + turns * (message + reply) + 8, max_seqs=6,
                          max_batch=128, device="cpu")
    cache = nkv.CausalCache(cfg)
    per_conv = cfg.capacity
    store = PrefixStore(cache, retain_seqs=[2, 3, 4, 5], block_tokens=16,
                        host_bytes=cfg.nbytes(1) * per_conv * users)
    pc = nkv.PromptCache(cache, multi_user=True, store=store)
    sys_prompt = rng.integers(0, 30_000, system).tolist()
    history: Dict[int, List[int]] = {u: list(sys_prompt) for u in range(users)}
    rows: List[Dict[str, Any]] = []
    totals = {"slot": 0, "cells": 0, "host": 0, "computed": 0}
    for turn in range(turns):
        for user in rng.permutation(users).tolist():
            prompt = history[user] + rng.integers(0, 30_000, message).tolist()
            host_before = _host_entries(store)
            before = store.stats()
            hits0 = {t: before["tiers"].get(t, {}).get("hits", 0) for t in ("cells", "host")}
            store_before = pc.stats.store_reused
            slot, remaining = pc.load(prompt)
            reused = len(prompt) - len(remaining)
            from_store = pc.stats.store_reused - store_before
            after = store.stats()
            tier = next((t for t in ("cells", "host")
                         if after["tiers"].get(t, {}).get("hits", 0) > hits0[t]), None)
            source = tier if from_store else ("slot" if reused else None)
            if reused:
                _verify(cache, slot, prompt[:reused])
            _evaluate(cache, slot, remaining, reused)
            pc.extend(slot, remaining)
            answer = rng.integers(0, 30_000, reply).tolist()
            _evaluate(cache, slot, answer[:-1], len(prompt))   # the last reply token is not fed
            pc.extend(slot, answer[:-1])
            pc.release(slot)
            history[user] = prompt + answer
            host_after = _host_entries(store)
            demoted = []
            for eid in sorted(set(host_after) - set(host_before)):
                toks = np.frombuffer(host_after[eid].tokens_bytes(), "<i8").tolist()
                owner = next((u for u, h in history.items() if h[:len(toks)] == toks), -1)
                demoted.append((owner, len(toks)))
            gone = set(host_before) - set(host_after)
            dropped = len(gone) - (1 if source == "host" and gone else 0)
            if source:
                totals[source] += reused
            totals["computed"] += len(remaining)
            rows.append({"turn": turn + 1, "user": user, "prompt": len(prompt),
                         "reused": reused, "source": source or "-",
                         "computed": len(remaining), "demoted": demoted,
                         "dropped": dropped})
    stats = store.stats()
    store.close()
    return {"rows": rows, "totals": totals, "stats": stats, "time": time.perf_counter() - t0}


def format_prefix_demo(res: Dict[str, Any]) -> str:
    lines = ["Prefix store: multi-user, multi-turn chat over a cache whose store keeps 4 conversations in cells "
             "(PromptCache(multi_user=True, store=PrefixStore(retain_seqs=[2, 3, 4, 5], host_bytes)))",
             f"{'turn':>4} {'user':>4} {'prompt':>6} {'reused':>6} {'from':>6} {'computed':>8}"
             "  tier moves"]
    for r in res["rows"]:
        moves = ", ".join(f"user {u} ({n} tokens) cells -> host" for u, n in r.get("demoted", ()))
        if r["source"] == "host":
            moves = "host -> cells" + (f"; {moves}" if moves else "")
        lines.append(f"{r['turn']:>4} {r['user']:>4} {r['prompt']:>6} {r['reused']:>6} "
                     f"{r['source']:>6} {r['computed']:>8}  {moves}".rstrip())
    t = res["totals"]
    total = sum(t.values())
    lines.append(f"tokens: {t['slot']} from live slots, {t['cells']} from the store's cells "
                 f"(tier 0, no copy), {t['host']} from host RAM (tier 1, promoted back), "
                 f"{t['computed']} computed ({(total - t['computed']) / max(total, 1):.0%} "
                 f"reused); every reused row checked against its token's K/V"
                 + (f"; {res['time']:.2f} s" if "time" in res else ""))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    print(format_prefix_demo(run_prefix_demo()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
