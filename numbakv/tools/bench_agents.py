"""A replay harness of agent sessions through ``hf.Server`` and a ``PrefixStore``
(``numbakv bench --sections agents``; also ``python -m numbakv.tools.bench_agents [--quick]``).

Seeded synthetic sessions shaped like published coding-agent traces: a system prompt shared by
every session, a task, then per turn the model's reasoning and tool call followed by the tool's
output (33 turns; input:output tokens near 131:1 counted over every call's prompt). 20% of turns
strip the oldest reasoning block still in the prompt (a single-range edit, as clients drop old
thinking blocks), 5% of turns are cancelled after one prefill chunk and retried. Several sessions
run interleaved with one-off requests (some sharing the system prompt) between their turns.
Served one request at a time by ``hf.Server`` on a tiny random-weight Llama (CPU), with the
store's cells capped at 50% of the working set (every session's final prompt plus the one-off
prompts): the cache holds that many cells plus room for the running request, and the store
keeps its entries in those cells (tier 0). ``Shape(working_set="window")`` reads "working set"
as Denning's W(t, tau) instead (the peak of one round of turns' distinct tokens,
``window_working_set``): an alternative reading with a cap that binds, not the section's figures.

Two policies replay the same trace in the same run:

* ``retained``: live sessions' turns are saved with priority 80 (``Server.submit(priority=)``,
  one-off requests keep the default 35) and a finished session's prefix drops to 0
  (``store.retain``); ``hf.Server(edit_reuse=True)`` loads stripped prompts with ``load_edit``;
* ``lru``: the plain store (LRU, default priorities, exact prefix loads only).

Figures: token hit rate (prompt tokens served by the store / prompt tokens, every request),
orphaned descendants (from the store's KV events: a block still held whose parent block was
removed; checked after every request), time to first token of sessions' last turns against the
same prompt on a store-less server (cold), and the tokens prefilled again at
stripped-reasoning turns (prefilled minus the tokens new since the session's previous turn) as a
share of the prompt; beside them, the trace's ceilings (``ceilings``: what an unbounded store
could reuse with exact prefixes, and with edit reuse), which bound every policy's hit rate and
the gap between two. The reasoning tokens are put in the history by the client (synthetic,
counted as output); only the tool call is generated (decode steps of the tiny model are not the
cache's work). One torch thread: stable timings on a shared machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ._models import random_model
from ._report import section_main, target_lines

VOCAB = 512
LIVE, DONE = 80, 0       # retention priorities of a live / finished session's prefix


@dataclass
class Shape:
    """Sizes of one replay."""

    sessions: int = 4
    turns: int = 33
    system: int = 512
    task: int = 64
    tool: int = 112
    reasoning: int = 16
    call: int = 4
    one_off_every: int = 3      # one one-off request after every this many session turns
    one_off: int = 384
    strip_share: float = 0.20
    cancel_share: float = 0.05
    prefill_chunk: int = 512
    seed: int = 0
    #: the store's cells as a share of the working set (the issue's shape: 0.5; smaller values
    #: are diagnostics of a cap that binds, not the section's figures)
    store_share: float = 0.5
    #: what "the working set" the cap is a share of means (``working_set_tokens``):
    #: ``"footprint"`` (the section's figures: every session's final prompt plus every one-off
    #: prompt over the whole trace) or ``"window"`` (Denning's W(t, tau) with tau one round of
    #: turns, peaked over the replay: an alternative reading of the issue's words)
    working_set: str = "footprint"


QUICK = Shape(sessions=2, turns=8, system=128, task=32, tool=48, reasoning=16, call=2,
              one_off=160, prefill_chunk=128)


def tiny_llama(seed: int = 0):
    """A seeded random-weight Llama (2 layers, hidden 64, GQA 4/2, vocab 512), eager attention,
    eval mode."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=16384)
    return random_model(transformers.LlamaForCausalLM, cfg, seed)


def make_trace(shape: Shape) -> List[Dict[str, Any]]:
    """The requests in arrival order: ``{"kind": "turn", "session", "turn", "append": [tool
    output tokens], "reasoning": [tokens], "strip": bool, "cancel": bool, "last": bool}`` and
    ``{"kind": "one_off", "prompt": [...]}``. Seeded."""
    rng = np.random.default_rng(shape.seed)
    tok = lambda n: rng.integers(3, VOCAB, n).tolist()   # noqa: E731
    system = tok(shape.system)
    out: List[Dict[str, Any]] = []
    tasks = [system + tok(shape.task) for _ in range(shape.sessions)]
    n_turns = 0
    for t in range(shape.turns):
        for s in range(shape.sessions):
            out.append({"kind": "turn", "session": s, "turn": t,
                        "start": tasks[s] if t == 0 else None,
                        "append": tok(shape.tool) if t else [],
                        "reasoning": tok(shape.reasoning),
                        "strip": t >= 2 and rng.random() < shape.strip_share,
                        "cancel": t >= 1 and rng.random() < shape.cancel_share,
                        "last": t == shape.turns - 1})
            n_turns += 1
            if n_turns % shape.one_off_every == 0:
                prompt = (system if rng.random() < 0.5 else []) + tok(shape.one_off)
                out.append({"kind": "one_off", "prompt": prompt})
    return out


class Session:
    """A session's prompt as segments (so a strip can drop one reasoning block)."""

    def __init__(self, start: List[int]) -> None:
        self.segments: List[List[Any]] = [["text", list(start)]]
        self.new = len(start)     # tokens added since the last turn's prompt

    def prompt(self) -> List[int]:
        return [t for _, seg in self.segments for t in seg]

    def strip_oldest_reasoning(self) -> int:
        for i, (kind, seg) in enumerate(self.segments):
            if kind == "reasoning":
                del self.segments[i]
                return len(seg)
        return 0


def open_turn(sessions: Dict[int, Session], r: Dict[str, Any]) -> Tuple[Session, int]:
    """A turn request ``r`` of ``make_trace`` applied to its session (made at its first turn):
    the tool output appended (counted in ``new``), the oldest reasoning block dropped when the
    turn strips. Returns the session and the tokens stripped. The turn's prompt is then
    ``session.prompt()``."""
    s = r["session"]
    if r["start"] is not None:
        sessions[s] = Session(r["start"])
    sess = sessions[s]
    sess.segments.append(["text", r["append"]])
    sess.new += len(r["append"])
    stripped = sess.strip_oldest_reasoning() if r["strip"] else 0
    return sess, stripped


def _orphans(live: Dict[str, Optional[str]], events: List[Dict[str, Any]]) -> int:
    """Apply the store's KV events to ``live`` (block -> parent block) and count blocks held
    whose parent block is no longer held."""
    for e in events:
        if e["type"] == "BlockStored":
            parent = e["parent_block_hash"]
            for h in e["block_hashes"]:
                live[h] = parent
                parent = h
        elif e["type"] == "BlockRemoved":
            for h in e["block_hashes"]:
                live.pop(h, None)
        elif e["type"] == "AllBlocksCleared":
            live.clear()
    return sum(1 for p in live.values() if p is not None and p not in live)


def _serve(srv, prompt: List[int], out: int, cancel_after_one_step: bool = False,
           priority: Optional[int] = None):
    """Submit ``prompt`` and step to completion; ``(generated, reused, prefilled, ttft_s)``.
    ``cancel_after_one_step``: cancel after the first step (one prefill chunk), then retry
    (the figures are the retry's; ``reused`` counts what the cancelled part saved)."""
    if cancel_after_one_step:
        rid = srv.submit(prompt, max_new_tokens=out, priority=priority)
        srv.step()
        if rid in srv._reqs:
            srv.cancel(rid)
    before = dict(srv.stats)
    t0 = time.perf_counter()
    rid = srv.submit(prompt, max_new_tokens=out, priority=priority)
    ttft = None
    while srv.pending:
        new = srv.step()
        if ttft is None and rid in new:
            ttft = time.perf_counter() - t0
    return (srv.finished[rid], srv.stats["reused_tokens"] - before["reused_tokens"],
            srv.stats["prefill_tokens"] - before["prefill_tokens"], ttft)


def working_set(shape: Shape, trace: List[Dict[str, Any]]) -> int:
    """Tokens of every session's final prompt plus every one-off prompt (an upper bound of
    the distinct tokens the trace could reuse)."""
    per_turn = shape.tool + shape.reasoning + shape.call
    session = shape.system + shape.task + shape.turns * per_turn
    return shape.sessions * session + sum(len(r["prompt"]) for r in trace
                                          if r["kind"] == "one_off")


def window_working_set(shape: Shape, trace: List[Dict[str, Any]]) -> int:
    """Denning's working set W(t, tau) with tau = one round of turns, peaked over the replay.

    After each request ``i`` (in arrival order), the window is the requests ``j`` with
    ``start(i) <= j <= i``, where ``start(i)`` is the index of the *oldest* of the started
    sessions' latest turns (so it holds every live session's current prompt and the one-off
    requests since the least recently served session came back). W(i) is the number of distinct
    token prefixes among the prompts of the window's requests: a token counts once however many
    of those prompts share it *and everything before it* (what a prefix store holds once; the
    system prompt shared by the sessions counts once, a token equal by chance at a different
    prefix counts again), i.e. the nodes of a trie of those prompts, computed as the sum of the
    prompts' lengths minus the longest common prefixes of neighbours in sorted order. Prompts
    are what each request asks the server to load (the replay's session prompts, the generated
    calls in the history stood in by ids that match nothing, as in ``ceilings``); the calls a
    request generates past its prompt are not counted. Returns ``max_i W(i)``. No model is run.
    """
    sessions: Dict[int, Session] = {}
    latest: Dict[int, int] = {}              # session -> index of its latest turn
    prompts: List[List[int]] = []            # every request's prompt, by index
    fresh = iter(range(VOCAB, 1 << 40))      # stand-in ids of generated calls
    peak = 0
    for i, r in enumerate(trace):
        if r["kind"] == "one_off":
            prompts.append(list(r["prompt"]))
        else:
            s = r["session"]
            sess, _ = open_turn(sessions, r)
            prompts.append(sess.prompt())
            latest[s] = i
            sess.segments.append(["reasoning", r["reasoning"]])
            sess.segments.append(["text", [next(fresh) for _ in range(shape.call)]])
        window = sorted(prompts[min(latest.values(), default=i):i + 1])
        distinct = sum(len(p) for p in window) - sum(
            _lcp(a, b) for a, b in zip(window, window[1:]))
        peak = max(peak, distinct)
    return peak


def working_set_tokens(shape: Shape, trace: List[Dict[str, Any]]) -> int:
    """The working set the store's cap is ``shape.store_share`` of, as ``shape.working_set``
    reads it: ``"footprint"`` -> ``working_set`` (the whole trace's footprint), ``"window"`` ->
    ``window_working_set`` (the peak of one round's distinct tokens)."""
    if shape.working_set == "footprint":
        return working_set(shape, trace)
    if shape.working_set == "window":
        return window_working_set(shape, trace)
    raise ValueError(f"Shape.working_set: expected 'footprint' or 'window', got "
                     f"{shape.working_set!r}")


def _lcp(a: List[int], b: List[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def ceilings(shape: Shape, trace: List[Dict[str, Any]], recompute_after: int = 16
             ) -> Dict[str, float]:
    """The most any policy can reuse of ``trace`` (token hit rates, %): a store of unbounded
    size that keeps every prompt a request computed (with its generated call), loading the
    longest stored prefix of each prompt (``exact``) and, at stripped-reasoning turns, also the
    session's previous prompt after the stripped block minus ``recompute_after`` tokens
    (``edit``: what ``load_edit`` can place; ``edit_k0``: the same with nothing recomputed
    after the edit, the knob's limit); ``exact_sessions``, ``edit_sessions``: the same over
    session turns only. A cancelled turn's retry may also load what the cancelled attempt
    prefilled (one ``prefill_chunk`` past what it loaded; the store keeps it, issue 36 item 2),
    counted for every variant. A prompt's last token is always computed (its logits). Each
    call's tokens are stand-ins that match nothing else (the model generates them at replay;
    the client's reasoning tokens in the history were never computed). No model is run: it says
    how close each policy's figure is to its bound, so ``edit_k0`` minus a policy's measured
    hit rate is the most any policy could gain over it on this trace."""
    saved: List[List[int]] = []
    sessions: Dict[int, Session] = {}
    previous: Dict[int, List[int]] = {}
    fresh = iter(range(VOCAB, 1 << 40))       # stand-in ids of generated calls
    total = exact = edit = edit0 = s_total = s_exact = s_edit = 0
    for r in trace:
        if r["kind"] == "one_off":
            prompt = r["prompt"]
            best = min(max((_lcp(prompt, x) for x in saved), default=0), len(prompt) - 1)
            total, exact, edit, edit0 = (total + len(prompt), exact + best, edit + best,
                                         edit0 + best)
            saved.append(prompt)
            continue
        s = r["session"]
        sess, stripped = open_turn(sessions, r)
        prompt = sess.prompt()
        last = len(prompt) - 1
        best = min(max((_lcp(prompt, x) for x in saved), default=0), last)
        moved0 = 0
        if stripped and s in previous:          # the suffix after the edit, shifted back
            old = previous[s][best + stripped:]
            moved0 = _lcp(prompt[best:last], old)
        moved = max(0, moved0 - recompute_after)
        got = [best, best + moved, best + moved0]
        if r["cancel"]:     # the retry also loads what the cancelled attempt prefilled
            got = [min(last, g + shape.prefill_chunk) for g in got]
        total, exact, edit, edit0 = (total + len(prompt), exact + got[0], edit + got[1],
                                     edit0 + got[2])
        s_total, s_exact, s_edit = s_total + len(prompt), s_exact + got[0], s_edit + got[1]
        call = [next(fresh) for _ in range(shape.call)]
        previous[s] = prompt + call[:-1]        # what the server saves: prompt + computed call
        saved.append(previous[s])
        sess.segments.append(["reasoning", r["reasoning"]])
        sess.segments.append(["text", call])
    return {"exact": 100.0 * exact / max(total, 1), "edit": 100.0 * edit / max(total, 1),
            "edit_k0": 100.0 * edit0 / max(total, 1),
            "exact_sessions": 100.0 * s_exact / max(s_total, 1),
            "edit_sessions": 100.0 * s_edit / max(s_total, 1)}


def replay(model, cold_model, shape: Shape, trace: List[Dict[str, Any]], *, policy: str,
           log: Callable[[str], None] = lambda _: None) -> Dict[str, Any]:
    """Replay ``trace`` with ``policy`` (``"retained"`` or ``"lru"``); the cold TTFT of each
    session's last turn on ``cold_model`` (a store-less server) is measured beside it."""
    from numbakv import PrefixStore, hf
    ws = working_set_tokens(shape, trace)
    longest = shape.system + shape.task + shape.turns * (shape.tool + shape.reasoning
                                                         + shape.call) + shape.one_off
    budget = int(ws * shape.store_share)
    # the cache's cells: the store's budget plus room for the running request. ``capacity`` is
    # per sequence (a unified cache has max_seqs x capacity cells): before, passing the total
    # as capacity gave 12x the cells and the cap never bound
    max_seqs = 12
    cache = hf.cache_for(model, capacity=-(-(budget + longest + 64) // max_seqs),
                         max_seqs=max_seqs, max_batch=shape.prefill_chunk)
    store = PrefixStore(cache, retain_seqs=list(range(2, max_seqs)), block_tokens=16,
                        event_bytes=64 << 20)
    retained = policy == "retained"
    srv = hf.Server(model, cache, store=store, prefill_chunk=shape.prefill_chunk,
                    edit_reuse=retained)
    cold = None
    sessions: Dict[int, Session] = {}
    live: Dict[str, Optional[str]] = {}
    rows: List[Dict[str, Any]] = []
    worst_orphans = 0
    try:
        for r in trace:
            if r["kind"] == "one_off":
                _, reused, prefilled, _ = _serve(srv, r["prompt"], 1)
                rows.append({"kind": "one_off", "prompt": len(r["prompt"]), "reused": reused,
                             "prefilled": prefilled})
            else:
                s = r["session"]
                sess, stripped = open_turn(sessions, r)
                prompt = sess.prompt()
                row = {"kind": "turn", "session": s, "turn": r["turn"], "prompt": len(prompt),
                       "stripped": stripped, "cancelled": r["cancel"], "last": r["last"],
                       "new": sess.new}
                if r["last"]:
                    if cold is None:
                        cold = hf.Server(cold_model, hf.cache_for(
                            cold_model, capacity=longest + 64, max_seqs=2,
                            max_batch=shape.prefill_chunk), prefill_chunk=shape.prefill_chunk)
                    row["ttft_cold_s"] = _serve(cold, prompt, 1)[3]
                call, reused, prefilled, ttft = _serve(
                    srv, prompt, shape.call, cancel_after_one_step=r["cancel"],
                    priority=LIVE if retained else None)
                row.update(reused=reused, prefilled=prefilled, ttft_s=ttft)
                rows.append(row)
                # the reply goes into the history: reasoning (client-side) then the call
                sess.segments.append(["reasoning", r["reasoning"]])
                sess.segments.append(["text", call])
                sess.new = len(r["reasoning"]) + len(call)
                if retained and r["last"]:     # the session ended: its prefix goes first
                    store.retain(prompt + call[:-1], priority=DONE)
            worst_orphans = max(worst_orphans, _orphans(live, store.take_events()))
        entries = len(store.entries())
    finally:
        hf.detach(model)
        if cold is not None:
            hf.detach(cold_model)
        store.close()
    return summarize(rows, policy=policy, working_set=ws, budget=budget,
                     orphans=worst_orphans, entries=entries)


def summarize(rows: List[Dict[str, Any]], *, policy: str, working_set: int, budget: int,
              orphans: int, entries: int) -> Dict[str, Any]:
    """The replay's figures from its per-request rows."""
    turns = [r for r in rows if r["kind"] == "turn"]
    prompt = sum(r["prompt"] for r in rows)
    reused = sum(r["reused"] for r in rows)
    s_prompt = sum(r["prompt"] for r in turns)
    s_reused = sum(r["reused"] for r in turns)
    strips = [r for r in turns if r["stripped"]]
    lasts = [r for r in turns if r["last"] and r.get("ttft_cold_s")]
    return {"policy": policy, "requests": len(rows), "turns": len(turns),
            "prompt_tokens": prompt, "working_set": working_set, "store_budget": budget,
            "hit_rate": 100.0 * reused / max(prompt, 1),
            "session_hit_rate": 100.0 * s_reused / max(s_prompt, 1),
            "orphans": orphans, "entries_at_end": entries,
            "strip_turns": len(strips),
            # re-prefilled: tokens computed again (the turn's new tokens are computed anyway)
            "strip_prefill_pct_max": max((100.0 * (r["prefilled"] - r["new"]) / r["prompt"]
                                          for r in strips), default=0.0),
            "strip_prefill_pct_mean": float(np.mean([100.0 * (r["prefilled"] - r["new"])
                                                     / r["prompt"] for r in strips]))
            if strips else 0.0,
            "strip_total_pct_max": max((100.0 * r["prefilled"] / r["prompt"] for r in strips),
                                       default=0.0),
            "cancelled": sum(1 for r in turns if r["cancelled"]),
            "ttft_speedup": float(np.median([r["ttft_cold_s"] / r["ttft_s"] for r in lasts]))
            if lasts else None,
            "rows": rows}


def run_agents(quick: bool = False, log: Callable[[str], None] = lambda _: None,
               shape: Optional[Shape] = None) -> Dict[str, Any]:
    """The trace under both policies (same trace, same run) and the input:output ratio."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # stable timings on a shared machine; restored below
    try:
        shape = shape or (QUICK if quick else Shape())
        if shape.working_set not in ("footprint", "window"):    # before any model is built
            raise ValueError(f"Shape.working_set: expected 'footprint' or 'window', got "
                             f"{shape.working_set!r}")
        trace = make_trace(shape)
        out: Dict[str, Any] = {"shape": dict(shape.__dict__),
                               "ceilings": ceilings(shape, trace)}
        model, cold_model = tiny_llama(), tiny_llama()
        for policy in ("retained", "lru"):
            log(f"agents: {shape.sessions} sessions x {shape.turns} turns + one-offs, "
                f"policy {policy} ...")
            out[policy] = replay(model, cold_model, shape, trace, policy=policy, log=log)
        turns = [r for r in out["retained"]["rows"] if r["kind"] == "turn"]
        outputs = len(turns) * (shape.reasoning + shape.call)
        out["input_output_ratio"] = sum(r["prompt"] for r in turns) / max(outputs, 1)
        return out
    finally:
        torch.set_num_threads(threads)


def targets(res: Dict[str, Any]) -> List[Dict[str, str]]:
    """The section's targets, met or missed."""
    a, b = res["retained"], res["lru"]
    ceil = res.get("ceilings")
    lead = a["hit_rate"] - b["hit_rate"]
    speed = a["ttft_speedup"]
    return [
        {"target": "agents: token hit rate >= 90% (retain priorities + load_edit)",
         "status": "met" if a["hit_rate"] >= 90 else "missed",
         "detail": f"{a['hit_rate']:.1f}% (sessions only {a['session_hit_rate']:.1f}%)"},
        {"target": "agents: hit rate >= 15 points above plain LRU (same trace)",
         "status": "met" if lead >= 15 else "missed",
         "detail": f"{a['hit_rate']:.1f}% vs LRU {b['hit_rate']:.1f}% ({lead:+.1f} points)"
                   + (f"; unbounded-store ceilings on this trace: exact prefix "
                      f"{ceil['exact']:.1f}%, with edit reuse {ceil['edit']:.1f}% "
                      f"({ceil.get('edit_k0', ceil['edit']):.1f}% recomputing nothing after "
                      f"the edit): the most any policy could lead this LRU run by is "
                      f"{ceil.get('edit_k0', ceil['edit']) - b['hit_rate']:+.1f} points"
                      if ceil else "")},
        {"target": "agents: 0 orphaned descendants (KV events, after every request)",
         "status": "met" if a["orphans"] == 0 and b["orphans"] == 0 else "missed",
         "detail": f"retained {a['orphans']}, lru {b['orphans']}"},
        {"target": "agents: retained sessions' TTFT >= 5x faster than cold",
         "status": "met" if speed is not None and speed >= 5 else "missed",
         "detail": "not measured" if speed is None else
         f"{speed:.1f}x (median over sessions' last turns)"},
        {"target": "agents: re-prefilled after a stripped-reasoning edit <= 10% of the prompt",
         "status": "met" if a["strip_prefill_pct_max"] <= 10 else "missed",
         "detail": f"max {a['strip_prefill_pct_max']:.1f}%, mean "
                   f"{a['strip_prefill_pct_mean']:.1f}% over {a['strip_turns']} edits, beside "
                   f"the turn's new tokens (with them: max {a['strip_total_pct_max']:.1f}%); "
                   f"LRU, exact loads only: max {b['strip_prefill_pct_max']:.1f}%"}]


def format_agents(res: Dict[str, Any], with_targets: bool = False) -> List[str]:
    """The section's table (``numbakv bench`` lists the targets in its own Targets section)."""
    sh = res["shape"]
    lines = ["", f"Agent sessions through hf.Server (tiny Llama): {sh['sessions']} sessions x "
             f"{sh['turns']} turns + one-offs, input:output {res['input_output_ratio']:.0f}:1, "
             f"store cells capped at {100 * sh.get('store_share', 0.5):.0f}% of the working set "
             f"({sh.get('working_set', 'footprint')}: {res['retained']['working_set']} tokens, "
             f"{res['retained']['store_budget']} cells)"]
    lines.append("  policy    requests  prompt tok  hit%   sessions hit%  orphans  strip "
                 "re-prefill% max/mean  TTFT vs cold")
    for name in ("retained", "lru"):
        r = res[name]
        speed = "-" if r["ttft_speedup"] is None else f"{r['ttft_speedup']:.1f}x"
        lines.append(f"  {name:<9} {r['requests']:>8} {r['prompt_tokens']:>11} "
                     f"{r['hit_rate']:>5.1f} {r['session_hit_rate']:>14.1f} {r['orphans']:>8} "
                     f"{r['strip_prefill_pct_max']:>11.1f}/{r['strip_prefill_pct_mean']:<6.1f} "
                     f"{speed:>10}")
    ceil = res.get("ceilings")
    if ceil:
        lines.append(f"  ceiling (unbounded store, same trace): exact prefix {ceil['exact']:.1f}%,"
                     f" with edit reuse {ceil['edit']:.1f}% (recomputing nothing after the "
                     f"edit: {ceil.get('edit_k0', ceil['edit']):.1f}%); sessions only "
                     f"{ceil['exact_sessions']:.1f}% / {ceil['edit_sessions']:.1f}%")
    return lines + (target_lines(targets(res)) if with_targets else [])


if __name__ == "__main__":  # pragma: no cover
    section_main(run_agents, format_agents, targets)
