"""Benchmarks of hybrid models (recurrent layers beside attention) through the prefix store
(``numbakv bench --sections hybrid``; also ``python -m numbakv.tools.bench_hybrid``). A tiny
random-weight Qwen3-Next (gated delta net + attention layers, transformers' CPU scan) served by
``hf.Server`` over ``hf.cache_for``'s ``HybridCache`` with a ``PrefixStore``, on two traces:

* a 10-turn chat (a system prompt, then per turn a user message and a generated reply);
* a 30-turn agent session (per turn a tool output appended and a short call generated, ~100
  input tokens per output token).

Each trace runs twice, with the store and without it (every turn prefilled from scratch), and
reports per turn: prompt tokens, tokens the store served, tokens prefilled, the time to first
token, and the largest logit difference of the turn's first token between the two runs.
Targets, measured in this run: from turn 2 on >= 95% of prompt tokens reused; re-prefilled
tokens after a hit <= the turn's new tokens + the restore spacing (256); logits equal the
no-store run within float tolerance (a scan cut at restore points rounds differently);
time to first token of the last turns >= 5x faster with the store. Also: bytes of recurrent
state per restore point beside the K/V bytes of the tokens between two restore points. (The
state rows' gather/scatter against ``np.copyto`` is ``--sections states``.) One torch thread:
stable timings on a shared machine.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from ._models import random_model
from ._report import section_main, target_lines

SPACING = 256


def tiny_qwen3_next(hidden: int = 64, layers: int = 4, seed: int = 0):
    """A seeded random-weight Qwen3-Next (gated delta net, attention every other layer, MoE
    MLPs), eager attention, eval mode."""
    import transformers
    cfg = transformers.Qwen3NextConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=hidden,
        shared_expert_intermediate_size=hidden, num_experts_per_tok=2, num_experts=4,
        layer_types=["linear_attention", "full_attention"] * (layers // 2))
    return random_model(transformers.Qwen3NextForCausalLM, cfg, seed)


def chat_trace(turns: int = 10, system: int = 1024, user: int = 32, reply: int = 4,
               seed: int = 1) -> List[Dict[str, Any]]:
    """Turn specs: ``{"append": new input tokens, "out": tokens to generate}``."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(turns):
        new = (system if t == 0 else 0) + user
        out.append({"append": rng.integers(3, 512, new).tolist(), "out": reply})
    return out


def agent_trace(turns: int = 30, system: int = 2048, tool: int = 100, call: int = 1,
                seed: int = 2) -> List[Dict[str, Any]]:
    """An agent session: a system prompt, then per turn a tool output appended (100 tokens of
    input per token of output, as the published traces' ~100-130:1)."""
    rng = np.random.default_rng(seed)
    return [{"append": rng.integers(3, 512, (system if t == 0 else 0) + tool).tolist(),
             "out": call} for t in range(turns)]


class TraceServer:
    """One side of a trace: ``hf.Server`` over its own ``HybridCache`` (with a
    ``PrefixStore`` keeping each finished turn when ``store``), serving one turn at a time."""

    def __init__(self, model, *, store: bool, capacity: int, prefill_chunk: int = 1024):
        from numbakv import PrefixStore, hf
        self.model = model
        self.cache = hf.cache_for(model, capacity=capacity, max_seqs=2, restore_every=SPACING,
                                  max_batch=prefill_chunk)
        self.store = PrefixStore(self.cache, retain_seqs=[1], block_tokens=16) if store \
            else None
        self.srv = hf.Server(model, self.cache, prefill_chunk=prefill_chunk, store=self.store)
        self.first_logits: Dict[int, Any] = {}
        pick = self.srv._pick

        def recording_pick(logits, r):          # the logits of each request's first token
            rid = r.get("rid")
            if rid is not None and rid not in self.first_logits:
                self.first_logits[rid] = logits.detach().clone()
            return pick(logits, r)
        self.srv._pick = recording_pick

    def turn(self, prompt: List[int], out: int) -> Dict[str, Any]:
        srv = self.srv
        before = dict(srv.stats)
        rid = srv.submit(prompt, max_new_tokens=out)
        srv._reqs[rid]["rid"] = rid
        t0 = time.perf_counter()
        ttft = None
        while srv.pending:
            new = srv.step()
            if ttft is None and rid in new:
                ttft = time.perf_counter() - t0
        return {"prompt": len(prompt),
                "reused": srv.stats["reused_tokens"] - before["reused_tokens"],
                "prefilled": srv.stats["prefill_tokens"] - before["prefill_tokens"],
                "ttft_s": ttft, "logits": self.first_logits[rid], "reply": srv.finished[rid]}

    def close(self) -> Dict[str, int]:
        from numbakv import hf
        sizes = {"kv_bytes_per_token": self.cache.attn.config.nbytes(1),
                 "state_bytes_per_point": self.cache.rc.config.state_bytes}
        hf.detach(self.model)
        if self.store is not None:
            self.store.close()
        return sizes


def run_trace(model, trace: List[Dict[str, Any]], *, store: bool, capacity: int,
              prefill_chunk: int = 1024) -> Dict[str, Any]:
    """Serve ``trace`` turn by turn (the history grows by each turn's input and reply)."""
    side = TraceServer(model, store=store, capacity=capacity, prefill_chunk=prefill_chunk)
    history: List[int] = []
    rows = []
    try:
        for spec in trace:
            prompt = history + spec["append"]
            row = side.turn(prompt, spec["out"])
            row["new"] = len(spec["append"])
            rows.append(row)
            history = prompt + row["reply"]
    finally:
        sizes = side.close()
    return {"turns": rows, **sizes}


def run_pair(trace: List[Dict[str, Any]], capacity: int) -> Tuple[Dict[str, Any],
                                                                   Dict[str, Any]]:
    """The trace with and without the store, turn by turn in lockstep (alternating which side
    goes first), on two copies of the seeded model: both sides see the same machine load.
    Each side's history grows by its own replies (equal when the logits are)."""
    sides = {True: TraceServer(tiny_qwen3_next(), store=True, capacity=capacity),
             False: TraceServer(tiny_qwen3_next(), store=False, capacity=capacity)}
    history = {True: [], False: []}
    rows: Dict[bool, List[Dict[str, Any]]] = {True: [], False: []}
    try:
        for i, spec in enumerate(trace):
            for store in ((True, False) if i % 2 == 0 else (False, True)):
                prompt = history[store] + spec["append"]
                row = sides[store].turn(prompt, spec["out"])
                row["new"] = len(spec["append"])
                rows[store].append(row)
                history[store] = prompt + row["reply"]
    finally:
        sizes = {k: side.close() for k, side in sides.items()}
    return ({"turns": rows[True], **sizes[True]}, {"turns": rows[False], **sizes[False]})


def compare(with_store: Dict[str, Any], without: Dict[str, Any]) -> Dict[str, Any]:
    """Per-turn figures of a trace served with and without the store."""
    turns = []
    for i, (a, b) in enumerate(zip(with_store["turns"], without["turns"])):
        diff = float((a["logits"] - b["logits"]).abs().max())
        scale = float(b["logits"].abs().max())
        turns.append({"turn": i + 1, "prompt": a["prompt"], "new": a["new"],
                      "reused": a["reused"], "prefilled": a["prefilled"],
                      "reuse_pct": 100.0 * a["reused"] / a["prompt"],
                      "ttft_store_ms": 1e3 * a["ttft_s"], "ttft_cold_ms": 1e3 * b["ttft_s"],
                      "max_logit_diff": diff, "logit_scale": scale,
                      "same_reply": a["reply"] == b["reply"]})
    later = turns[1:]
    tail = turns[-3:]
    speedup = float(np.median([t["ttft_cold_ms"] / t["ttft_store_ms"] for t in tail]))
    return {"turns": turns,
            "min_reuse_pct_from_turn_2": min(t["reuse_pct"] for t in later),
            "max_excess_prefill": max(t["prefilled"] - (t["new"] + 1) for t in later),
            "max_rel_logit_diff": max(t["max_logit_diff"] / max(t["logit_scale"], 1e-30)
                                      for t in turns),
            "same_replies": all(t["same_reply"] for t in turns),
            "ttft_speedup_last_turns": speedup,
            "kv_bytes_per_token": with_store["kv_bytes_per_token"],
            "state_bytes_per_point": with_store["state_bytes_per_point"],
            "kv_bytes_between_points": with_store["kv_bytes_per_token"] * SPACING}


def run_hybrid(quick: bool = False, log: Callable[[str], None] = lambda _: None
               ) -> Dict[str, Any]:
    """Both traces with and without the store, and the state-row copies."""
    import torch
    torch.set_flush_denormal(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # stable timings on a shared machine; restored below
    try:
        return _run_hybrid(quick, log)
    finally:
        torch.set_num_threads(threads)


def _run_hybrid(quick: bool, log: Callable[[str], None]) -> Dict[str, Any]:
    out: Dict[str, Any] = {"spacing": SPACING}
    if quick:
        traces = {"chat": chat_trace(turns=4, system=512, user=16, reply=2),
                  "agent": agent_trace(turns=6, system=1024, tool=40, call=1)}
    else:
        traces = {"chat": chat_trace(), "agent": agent_trace()}
    for name, trace in traces.items():
        total = sum(len(t["append"]) + t["out"] for t in trace) + 64
        log(f"hybrid {name}: {len(trace)} turns, {total} tokens, with and without the store "
            "...")
        stored, cold = run_pair(trace, capacity=total)
        out[name] = compare(stored, cold)
    return out


def targets(res: Dict[str, Any]) -> List[Dict[str, str]]:
    """The section's targets, met or missed."""
    out: List[Dict[str, str]] = []
    for name in ("chat", "agent"):
        r = res.get(name)
        if not r:
            continue
        out += [
            {"target": f"hybrid {name}: >= 95% of prompt tokens reused from turn 2",
             "status": "met" if r["min_reuse_pct_from_turn_2"] >= 95 else "missed",
             "detail": f"min {r['min_reuse_pct_from_turn_2']:.1f}%"},
            {"target": f"hybrid {name}: re-prefilled after a hit <= new tokens + {SPACING}",
             "status": "met" if r["max_excess_prefill"] <= SPACING else "missed",
             "detail": f"at most {r['max_excess_prefill']} tokens beyond the turn's new ones"},
            {"target": f"hybrid {name}: logits equal the no-store run (float tolerance)",
             "status": "met" if r["max_rel_logit_diff"] <= 1e-3 and r["same_replies"]
             else "missed",
             "detail": f"max relative logit difference {r['max_rel_logit_diff']:.2e}, "
                       f"replies {'equal' if r['same_replies'] else 'DIFFER'}"},
            {"target": f"hybrid {name}: TTFT with the prefix stored >= 5x faster",
             "status": "met" if r["ttft_speedup_last_turns"] >= 5 else "missed",
             "detail": f"{r['ttft_speedup_last_turns']:.1f}x (median of the last 3 turns)"}]
    return out


def format_hybrid(res: Dict[str, Any], with_targets: bool = False) -> List[str]:
    """The section's table (``numbakv bench`` lists the targets in its own Targets section)."""
    lines = ["", f"Hybrid model (tiny Qwen3-Next, restore spacing {res['spacing']}): store vs "
             "no store"]
    for name in ("chat", "agent"):
        r = res.get(name)
        if not r:
            continue
        lines.append(f"  {name}: turn  prompt  new  reused  prefilled  reuse%  TTFT store/cold "
                     "ms  max|dlogit|")
        for t in r["turns"]:
            lines.append(f"  {'':>{len(name)}} {t['turn']:>5} {t['prompt']:>7} {t['new']:>4} "
                         f"{t['reused']:>7} {t['prefilled']:>10} {t['reuse_pct']:>6.1f} "
                         f"{t['ttft_store_ms']:>8.1f}/{t['ttft_cold_ms']:<8.1f} "
                         f"{t['max_logit_diff']:.1e}")
        lines.append(f"  {name}: state per restore point {r['state_bytes_per_point']} B beside "
                     f"K/V {r['kv_bytes_per_token']} B/token ({r['kv_bytes_between_points']} B "
                     f"between two points)")
    return lines + (target_lines(targets(res)) if with_targets else [])


if __name__ == "__main__":  # pragma: no cover
    section_main(run_hybrid, format_hybrid, targets)
