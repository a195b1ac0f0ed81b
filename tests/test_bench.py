"""``numbakv bench`` at tiny sizes: it runs, checks every contender returns what it stored before
timing it, reports each section, skips missing baselines with a note, and judges the targets.
No timing is asserted (performance claims live in asv_bench/ and BENCHMARKS.md)."""

import importlib.util
import json
import sys

import numpy as np
import pytest

from numbakv.tools import bench, cli

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_HF = HAVE_TORCH and importlib.util.find_spec("transformers") is not None
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None

# --budget 0.05 (the quick preset's is 0.25 s per measurement): the tests check the rows, the
# report and the plot, not the figures; each contender still takes its minimum repetitions
QUICK = ["bench", "--quick", "--device", "cpu", "--contexts", "16,40", "--batch", "1,3",
         "--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--sections",
         "decode,kernels,capacity", "--budget", "0.05"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick run through the command line, with its JSON, plot and printed report."""
    out = tmp_path_factory.mktemp("bench")
    png, js = out / "bench.png", out / "bench.json"
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(QUICK + ["--png", str(png), "--json", str(js)])
    assert rc == 0
    return json.loads(js.read_text()), buf.getvalue(), png


def test_decode_rows_cover_every_contender_and_shape(quick_run):
    res, _, _ = quick_run
    rows = res["decode"]
    expected = ["numbakv", "numpy append"]
    if HAVE_TORCH:
        expected.append("torch append")
    if HAVE_HF:
        expected += ["HF StaticCache", "HF DynamicCache"]
    for batch in (1, 3):
        for ctx in (16, 40):
            got = {r["contender"]: r for r in rows if r["batch"] == batch and r["context"] == ctx}
            assert set(expected) <= set(got), (batch, ctx, sorted(got))
            for r in got.values():
                assert r["verified"] is True
                assert r["median_us"] > 0 and r["reps"] >= 2
                assert r["p10_us"] <= r["median_us"] <= r["p90_us"]
            ours = got["numbakv"]
            assert ours["start_forward_us"] > 0 and ours["layers_us"] > 0
    if not HAVE_TORCH:
        assert any(n.startswith("torch append: skipped, torch not installed") for n in res["notes"])


def test_kernel_and_capacity_sections(quick_run):
    res, _, _ = quick_run
    kernels = {r["kernel"] for r in res["kernels"]}
    assert kernels == {"put_range", "put (scatter)", "mask fill", "move", "rotate"}
    for r in res["kernels"]:
        assert r["bytes"] > 0 and r["fraction"] > 0
        assert r["fraction"] == pytest.approx(r["copy_us"] / r["median_us"], rel=1e-9)
    assert res["copy"]["gbps"] > 0
    cap = res["capacity"]
    # quick capacities are 64, 256, 1024 cells; batch 3 at context 16 needs at least 51 cells
    assert sorted({r["capacity_cells"] for r in cap if r["batch"] == 1}) == [64, 256, 1024]
    assert all(r["step_us"] > 0 and r["start_forward_us"] > 0 for r in cap)
    names = [t["target"] for t in res["targets"]]
    assert any("bookkeeping" in n for n in names)
    assert any("GPU" in n and "not measured" == t["status"] for n, t in zip(names, res["targets"]))


def test_report_and_plot(quick_run):
    res, text, png = quick_run
    for title in ("Where numbakv stands", "Decode step", "numbakv speed-up",
                  "Same work per step", "What differs per step", "--quick: tiny shapes",
                  "numbakv step breakdown", "Kernels vs a plain copy", "Capacity",
                  "Targets (defined at real shapes"):
        assert title in text
    # the same-work ratios divide by numbakv's per-layer work alone
    same = text.split("Same work per step")[1].split("What differs")[0].splitlines()[2]
    ours = next(r for r in res["decode"] if r["contender"] == "numbakv" and r["batch"] == 1
                and r["context"] == 16)
    theirs = next(r for r in res["decode"] if r["contender"] == "numpy append"
                  and r["batch"] == 1 and r["context"] == 16)
    expect = f"{theirs['median_us'] / ours['layers_us']:.2f}x"
    assert expect in same.split(), same
    assert res["machine"]["cores"] >= 1 and res["machine"]["numpy"] == np.__version__
    if HAVE_MPL:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plot saved to {png}" in res["notes"]
    else:
        assert not png.exists()
        assert "plot: skipped, matplotlib not installed" in res["notes"]


def test_missing_baselines_are_skipped_with_a_note(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import now raises ImportError
    js = tmp_path / "r.json"
    rc = cli.main(["bench", "--quick", "--device", "cpu", "--sections", "decode", "--contexts",
                   "8", "--batch", "1", "--no-plot", "--json", str(js)])
    assert rc == 0
    res = json.loads(js.read_text())
    assert {r["contender"] for r in res["decode"]} >= {"numbakv", "numpy append"}
    assert not any(r["contender"].startswith("HF") for r in res["decode"])
    for name in ("HF StaticCache", "HF DynamicCache"):
        assert any(n.startswith(f"{name}: skipped, ") and "transformers not installed" in n
                   for n in res["notes"]), res["notes"]
    assert "kernels" not in res and "capacity" not in res
    out = capsys.readouterr().out
    assert "transformers not installed: pip install 'numbakv[hf]'" in out


def test_a_contender_that_does_not_store_is_not_timed(monkeypatch, tmp_path):
    """The bench checks each contender's step returns the token it was given before timing it:
    an append cache that forgets to append is reported, not timed."""
    monkeypatch.setattr(bench, "CONTENDERS",
                        [c for c in bench.CONTENDERS if c[0] in ("numbakv", "numpy append")])
    monkeypatch.setattr(bench.NumpyAppendContender, "step",
                        lambda self: (self.cur_k[-1], self.cur_v[-1]))
    s = bench.BenchSettings(device="cpu", layers=2, kv_heads=2, head_dim=8, contexts=[8],
                            batches=[2], budget=0.001, min_reps=2, sections=["decode"])
    res = bench.run_bench(s)
    assert [r["contender"] for r in res["decode"]] == ["numbakv"]
    assert any("numpy append: its step did not return the stored token" in n
               for n in res["notes"])


def test_measure_counts_and_resets():
    calls = {"step": 0, "reset": 0}

    def step():
        calls["step"] += 1

    def reset():
        calls["reset"] += 1

    r = bench.measure(step, reset, sync=lambda: None, budget=1e9, min_reps=3, max_reps=7,
                      warmup=3)
    assert r["reps"] == 7  # the budget is never reached: max_reps stops it
    assert calls["step"] == 7 + 3 and calls["reset"] == calls["step"]
    assert 0 <= r["p10_us"] <= r["median_us"] <= r["p90_us"]
    # a step slower than the whole budget: its first call counts, plus one more
    calls.update(step=0, reset=0)
    r = bench.measure(step, reset, sync=lambda: None, budget=1e-12, min_reps=7, warmup=3)
    assert r["reps"] == 2 and calls["step"] == 2 and calls["reset"] == 2


def test_targets_are_judged_from_the_figures():
    s = bench.BenchSettings(device="cpu", contexts=[512, 4096], batches=[1])
    decode = [{"batch": 1, "context": 4096, "contender": c, "median_us": us}
              for c, us in (("numbakv", 100.0), ("HF StaticCache", 150.0),
                            ("HF DynamicCache", 1000.0))]
    kernels = [{"kernel": "put_range", "size": "4096 tokens", "bytes": 16 << 20,
                "fraction": 0.8}, {"kernel": "put_range", "size": "1 tokens", "bytes": 4096,
                                   "fraction": 0.1}]
    cap = [{"batch": 1, "capacity_cells": 4096, "start_forward_us": 10.0},
           {"batch": 1, "capacity_cells": 131072, "start_forward_us": 25.0}]
    got = {t["target"]: t for t in bench.evaluate_targets(
        s, {"decode": decode, "kernels": kernels, "capacity": cap})}
    static = got["cpu decode step >= 1x HF StaticCache, batch 1, 4k"]
    assert static["status"] == "met" and static["value"] == pytest.approx(1.5)
    dynamic = got["cpu decode step >= 20x HF DynamicCache, batch 1, 4k"]
    assert dynamic["status"] == "missed" and dynamic["value"] == pytest.approx(10.0)
    assert got["CPU put >= 70% of copy bandwidth"]["status"] == "met"  # judged at the largest
    book = got["bookkeeping at 131072 cells <= 2x at 4096, batch 1"]
    assert book["status"] == "missed" and book["value"] == pytest.approx(2.5)
    # the rotated put: judged as called (numba's threads) and held to one thread, apart
    quant = [{"kernel": "q8_0 put rotated", "size": "4096 tok, 1 thread", "fraction": 0.42,
              "threads": 1},
             {"kernel": "q8_0 put rotated", "size": "4096 tokens", "fraction": 0.76,
              "threads": 2},
             {"kernel": "q8_0 get", "size": "4096 cells", "fraction": 1.4}]
    got = {t["target"]: t for t in bench.evaluate_targets(s, {"quant": quant})}
    rot = "CPU rotated q8_0/q4_0 put+quantize >= 50% of a copy of the float16 input"
    both = got[f"{rot} (numbakv's put on 2 numba threads, np.copyto on one)"]
    one = got[f"{rot} (numbakv's put on 1 numba thread, np.copyto on one)"]
    assert both["status"] == "met" and one["status"] == "missed"
    assert one["value"] == pytest.approx(0.42)
    mixed = got["CPU quantized put/get/rotate >= 50% of a copy of the same float16 bytes"]
    assert mixed["status"] == "met" and mixed["value"] == pytest.approx(0.76)  # no 1-thread row


def test_bad_options_are_refused(capsys):
    assert cli.main(["bench", "--quick", "--device", "cpu", "--contexts", "0"]) == 2
    assert "--contexts" in capsys.readouterr().err
    assert cli.main(["bench", "--quick", "--device", "cpu", "--sections", "bogus"]) == 2
    assert "--sections" in capsys.readouterr().err
    assert cli.main(["bench", "--quick", "--device", "sim"]) == 2
    assert "sim" in capsys.readouterr().err


@pytest.mark.torch
def test_attention_section_quick(capsys):
    pytest.importorskip("torch")
    assert cli.main(["bench", "--quick", "--device", "cpu", "--sections", "attention",
                     "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "Attention, one layer" in out
    for case in ("decode 4 x 64", "prefill 16 into 64", "decode 8 x 32"):
        assert out.count(case) == 2            # float32 and float16 rows


def test_attention_rows_agree_with_dense():
    pytest.importorskip("torch")
    from numbakv.tools import bench
    s = bench.BenchSettings(device="cpu", budget=0.01, min_reps=3, quick=True,
                            kv_heads=2, head_dim=16, sections=["attention"])
    rows = bench.run_attention(s, bench._Device("cpu"), [])
    assert len(rows) == 6
    for r in rows:
        assert r["max_abs_diff_vs_dense"] < (1e-4 if r["dtype"] == "float32" else 2e-2)
        assert r["torch_ratio"] > 0 and r["nnz"] <= r["seqs"] * r["union_cells"]
        if r["seqs"] > 1:              # each sequence reads its own cells, not the union
            assert r["nnz"] < r["seqs"] * r["union_cells"]


@pytest.mark.torch
def test_streams_section_quick(capsys):
    pytest.importorskip("torch")
    assert cli.main(["bench", "--quick", "--device", "cpu", "--sections", "streams",
                     "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "Per-sequence streams (unified=False)" in out
    assert out.count("decode 4 x 64") == 2      # float32 and float16 rows


def test_quick_writes_nothing_unasked_and_leads_with_the_comparison(monkeypatch, tmp_path,
                                                                      capsys):
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["bench", "--quick", "--device", "cpu", "--sections", "decode", "--contexts",
                   "8", "--batch", "1", "--layers", "1", "--kv-heads", "1", "--head-dim", "8"])
    assert rc == 0
    assert list(tmp_path.iterdir()) == []          # no PNG (or anything) without --png
    out, err = capsys.readouterr()
    assert "expect about" in err and "GiB of memory" in err      # the cost, said up front
    if HAVE_TORCH:
        assert out.index("Where numbakv stands") < out.index("Decode step")


def test_rounds_spread_and_noise_are_reported(quick_run):
    """Every decode row keeps its rounds' medians; the report gives each ratio's spread over the
    rounds, and says so when the rounds disagree on which side is faster."""
    from numbakv.tools.bench_summary import format_ratio, ratio_spread
    res, text, _ = quick_run
    assert res["settings"]["rounds"] == 5 and res["settings"]["threads"] >= 1
    assert res["machine"]["numba_threads"] >= 1
    for r in res["decode"]:
        assert len(r["round_us"]) == 5 and r["interleaved"] is True
        assert r["median_us"] == pytest.approx(float(np.median(r["round_us"])))
    assert "lowest and highest of 5 rounds" in text
    ours = {"median_us": 10.0, "round_us": [9.0, 10.0, 11.0]}
    steady = {"median_us": 20.0, "round_us": [18.0, 20.0, 23.0]}
    assert ratio_spread(ours, steady) == (2.0, 20 / 10, 23 / 11)
    assert format_ratio(2.0, 1.9, 2.2, "X") == "2.00x vs X (1.90-2.20x)"
    noisy = format_ratio(*ratio_spread(ours, {"median_us": 11.0, "round_us": [12, 11, 8]}), "X")
    assert noisy.startswith("1.10x vs X (") and "inside the noise" in noisy
    assert format_ratio(0.5, 0.4, 0.8, "X") == "2.00x SLOWER than X (1.25-2.50x)"
    assert format_ratio(2.0, None, None, "X") == "2.00x vs X"


def test_measure_interleaved_alternates_and_resets():
    """Steps of the contenders alternate (one of each in turn), each followed by its reset, and
    a slow one stops at its small quota while the fast ones fill their budget."""
    log = []

    class Fake(bench._Contender):
        def __init__(self, name, seconds):
            self.name, self.seconds = name, seconds

        def step(self):
            log.append(self.name)
            if self.seconds:
                import time
                time.sleep(self.seconds)

        def reset(self):
            log.append(self.name + ".reset")

    fast_a, fast_b, slow = Fake("a", 0), Fake("b", 0), Fake("slow", 0.03)
    res = bench.measure_interleaved([fast_a, fast_b, slow], sync=lambda: None, budget=0.02,
                                    min_reps=4)
    assert [r["reps"] for r in res][2] == 2 and min(r["reps"] for r in res[:2]) >= 4
    steps = [x for x in log if not x.endswith(".reset")]
    assert steps[:6] == ["a", "b", "slow", "a", "b", "slow"]      # warm-up, then interleaved
    assert all(log[i + 1] == log[i] + ".reset" for i in range(0, len(log), 2))
    assert all(r["p10_us"] <= r["median_us"] <= r["p90_us"] for r in res)


@pytest.mark.torch
def test_generate_section_quick(capsys):
    pytest.importorskip("transformers")
    from numbakv.tools import bench_generate
    res = bench_generate.run_generate(quick=True)
    assert [(r["dtype"], r["threads"]) for r in res["steps"]] == [
        ("float32", 1), ("float32", 2), ("bfloat16", 1), ("bfloat16", 2)]
    for r in res["steps"]:
        # numbakv's step attends over what it holds: the same output as SDPA over StaticCache
        assert r["max_abs_diff_vs_static"] < (1e-4 if r["dtype"] == "float32" else 3e-2)
        assert all(r[k]["median"] > 0 for k in bench_generate.STEP_CONTENDERS)
    assert [r["threads"] for r in res["generate"]] == [1, 2]
    for r in res["generate"]:     # each run's decode steps timed forward to forward
        for k in bench_generate.CONTENDERS:
            step = r[f"{k}_step"]
            assert 0 < step["wall_ms_min"] <= step["wall_ms"] <= step["wall_ms_max"]
            assert 0 < step["cpu_ms"] <= step["cpu_ms_max"]
    text = "\n".join(bench_generate.format_generate(res))
    assert "StaticCache" in text and "tok/s" in text and "decode step" in text


def test_states_section_quick(capsys):
    assert cli.main(["bench", "--quick", "--device", "cpu", "--sections", "states",
                     "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "Recurrent state rows" in out
    for case in ("gather", "scatter", "restore point", "read_states"):
        assert case in out
    assert "state gather >= 50% of np.copyto bandwidth" in out


@pytest.mark.torch
def test_hybrid_trace_reuses_the_history_and_matches_the_cold_run():
    """bench_hybrid's trace runner on a 3-turn chat: from turn 2 only the new tokens (and the
    last reply token) are prefilled with the store, replies and first-token logits equal the
    run without it; the section's targets and table come out of the comparison."""
    pytest.importorskip("transformers")
    from numbakv.tools import bench_hybrid as bh
    model = bh.tiny_qwen3_next(hidden=32)
    trace = bh.chat_trace(turns=3, system=300, user=12, reply=2)
    total = sum(len(t["append"]) + t["out"] for t in trace) + 16
    stored = bh.run_trace(model, trace, store=True, capacity=total)
    cold = bh.run_trace(model, trace, store=False, capacity=total)
    res = bh.compare(stored, cold)
    assert [t["prefilled"] for t in res["turns"]] == [312, 13, 13]
    assert [t["reused"] for t in res["turns"]] == [0, 313, 327]
    assert res["same_replies"] and res["max_rel_logit_diff"] < 1e-4
    assert res["max_excess_prefill"] == 0
    text = "\n".join(bh.format_hybrid({"spacing": bh.SPACING, "chat": res}, with_targets=True))
    assert "state per restore point" in text and "TTFT" in text


@pytest.mark.torch
def test_agents_replay_counts_hits_edits_and_orphans():
    """bench_agents' replay on a tiny trace: both policies replay the same requests, the
    retained one reuses at least as much, load_edit cuts the prefill of stripped-reasoning
    turns below the exact-prefix run's, 0 orphaned blocks, and the table/targets come out."""
    pytest.importorskip("transformers")
    from numbakv.tools import bench_agents as ba
    shape = ba.Shape(sessions=2, turns=5, system=64, task=16, tool=32, reasoning=16, call=2,
                     one_off=48, prefill_chunk=64, strip_share=0.5, cancel_share=0.3, seed=3)
    res = ba.run_agents(shape=shape)
    a, b = res["retained"], res["lru"]
    assert a["requests"] == b["requests"] and a["prompt_tokens"] == b["prompt_tokens"]
    assert a["strip_turns"] > 0 and a["cancelled"] > 0
    assert a["orphans"] == 0 and b["orphans"] == 0
    assert a["strip_prefill_pct_mean"] < b["strip_prefill_pct_mean"]
    assert 0 < b["hit_rate"] <= a["hit_rate"] <= 100
    # the ceilings bound what was measured (cancelled prefills' saves included)
    c = res["ceilings"]
    assert b["hit_rate"] <= c["exact"] + 1e-9 and a["hit_rate"] <= c["edit_k0"] + 1e-9
    text = "\n".join(ba.format_agents(res, with_targets=True))
    assert "orphaned" in text and "LRU" in text


def test_agents_ceilings_bound_the_policies():
    """bench_agents.ceilings: an unbounded store's hit rates on the trace (no model run); edit
    reuse adds only at stripped-reasoning turns, and a trace without strips has none to add."""
    from numbakv.tools import bench_agents as ba
    shape = ba.Shape(sessions=2, turns=6, system=64, task=16, tool=32, reasoning=16, call=2,
                     one_off=48, strip_share=0.5, seed=3)
    c = ba.ceilings(shape, ba.make_trace(shape))
    assert 0 < c["exact"] < c["edit"] < 100 and c["exact_sessions"] < c["edit_sessions"] < 100
    flat = ba.Shape(**{**shape.__dict__, "strip_share": 0.0})
    c = ba.ceilings(flat, ba.make_trace(flat))
    assert c["exact"] == c["edit"] and c["exact_sessions"] == c["edit_sessions"]
    # one session, no one-offs, no strips: each turn reuses all but its new tokens
    one = ba.Shape(sessions=1, turns=3, system=8, task=4, tool=5, reasoning=3, call=2,
                   one_off_every=1000, strip_share=0.0, cancel_share=0.0)
    c = ba.ceilings(one, ba.make_trace(one))
    # prompts 12, 12+3+2+5=22 (the client's reasoning comes before the call: reuses 12),
    # 22+10=32 (reuses 22)
    assert c["exact"] == pytest.approx(100.0 * (0 + 12 + 22) / (12 + 22 + 32))
    assert c["edit"] == c["edit_k0"] == c["exact"]
    # every later turn cancelled once: the retry loads what the cancelled attempt prefilled
    # (one chunk past the loaded prefix covers the turn), all but the last token
    cancels = ba.Shape(**{**one.__dict__, "cancel_share": 1.0})
    c = ba.ceilings(cancels, ba.make_trace(cancels))
    assert c["exact"] == pytest.approx(100.0 * (0 + 21 + 31) / (12 + 22 + 32))
    # nothing recomputed after an edit reuses at least as much as recompute_after=16
    strips = ba.Shape(**{**shape.__dict__, "cancel_share": 0.0})
    c = ba.ceilings(strips, ba.make_trace(strips))
    assert c["edit"] < c["edit_k0"] < 100


def test_agents_window_working_set_on_a_hand_made_trace():
    """bench_agents.window_working_set: the peak over the replay of the distinct token prefixes
    of the requests since the oldest of the sessions' latest turns (one round)."""
    from numbakv.tools import bench_agents as ba
    shape = ba.Shape(sessions=2, call=1)

    def turn(s, t, start=None, append=(), strip=False):
        return {"kind": "turn", "session": s, "turn": t, "start": start, "append": list(append),
                "reasoning": [9], "strip": strip, "cancel": False, "last": False}

    trace = [turn(0, 0, start=[1, 2, 3]),          # W = 3
             turn(1, 0, start=[1, 2, 4, 5]),       # + 4, sharing [1, 2]: 5
             {"kind": "one_off", "prompt": [7, 7]},  # 7
             # s0: [1, 2, 3, 9, call, 6]; the window starts at s1's turn (index 1): 4 + 2 + 6
             # minus the shared [1, 2] = 10
             turn(0, 1, append=[6]),
             {"kind": "one_off", "prompt": [1, 2, 8]},  # + 3 - 2 shared = 11
             # s1: [1, 2, 4, 5, 9, call, 6]; the window starts at s0's turn (index 3), [7, 7]
             # has left it: 6 + 3 + 7 - 2 - 2 = 12 (14 if the one-off had stayed)
             turn(1, 1, append=[6])]
    assert ba.window_working_set(shape, trace) == 12
    assert ba.window_working_set(shape, trace[:5]) == 11
    # a stripped reasoning block leaves the prompt, so it leaves the window
    stripped = trace[:5] + [turn(1, 1, append=[6], strip=True)]   # s1: [1, 2, 4, 5, call, 6]
    assert ba.window_working_set(shape, stripped) == 11
    assert ba.Shape().working_set == "footprint"
    tiny = ba.QUICK
    t = ba.make_trace(tiny)
    assert ba.working_set_tokens(tiny, t) == ba.working_set(tiny, t)
    window = ba.Shape(**{**tiny.__dict__, "working_set": "window"})
    assert 0 < ba.working_set_tokens(window, t) == ba.window_working_set(tiny, t) \
        < ba.working_set(tiny, t)
    bad = ba.Shape(**{**tiny.__dict__, "working_set": "recent"})
    with pytest.raises(ValueError, match="working_set"):
        ba.working_set_tokens(bad, t)
    with pytest.raises(ValueError, match="working_set"):
        ba.run_agents(shape=bad)


def test_agents_orphan_count_follows_the_events():
    from numbakv.tools.bench_agents import _orphans
    live = {}
    stored = {"type": "BlockStored", "block_hashes": ["a", "b", "c"], "parent_block_hash": None}
    assert _orphans(live, [stored]) == 0
    assert _orphans(live, [{"type": "BlockRemoved", "block_hashes": ["c"]}]) == 0
    assert _orphans(live, [{"type": "BlockRemoved", "block_hashes": ["a"]}]) == 1   # b lost a
    assert _orphans(live, [{"type": "AllBlocksCleared"}]) == 0


def test_prefix_save_bench_and_its_peers():
    """bench_prefix.bench_save runs at a tiny size; the peer baselines keep what they should
    (the hash chain and the trie drop the oldest prompt past their bound)."""
    from numbakv.tools import bench_prefix as bp
    chain = bp.HashChainPeer(block=4, max_prompts=2)
    trie = bp.TriePeer(max_prompts=2)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7, 7, 7, 7]]
    for p in prompts:
        chain.insert(p)
        trie.insert(p)
    assert len(chain.prompts) == 2 and len(chain.blocks) == 3   # [1..4] + [9..] + [7..]
    assert 5 not in trie.root[1][2][3][4] and 9 in trie.root[1][2][3][4] and 7 in trie.root
    res = bp.bench_save(256, (4, 8), reps=5)
    assert [r["entries"] for r in res["runs"]] == [4, 8]
    assert all(r["save_us"] > 0 and r["hash_chain_us"] > 0 and r["save_events_us"] > 0
               for r in res["runs"])
    assert "save growth" in bp.format_prefix({"save": res})
