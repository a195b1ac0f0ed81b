"""The demo's workload at small size, its verification (which must catch a corrupted cache), the
occupancy picture and the ``numbakv demo`` command line."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import numbakv as nkv
from numbakv.causal import CausalCache
from numbakv.tools.demo import (FREE, SHARED, DemoVerificationError, ModelConfig, TinyLlama, Workload,
                          _RefSeq, cell_owners, reference_forward, run_demo)

#: small enough for the CUDA simulator (Python per GPU thread)
SIM_MODEL = ModelConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                        vocab=64)
SMALL_MODEL = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                          vocab=128)


def tiny(device, **over):
    """The demo at test size: 2 layers, 4 requests, 25 steps (the simulator: 1 layer, 3 requests,
    20 steps). Placement depends only on the workload's lengths, so these seeds were picked for
    workloads in which a shift, a copy_prefix reuse, a finished request and a defrag all happen
    (most seeds do at the default size; tiny workloads rarely fragment the cache)."""
    if device == "sim":
        kw = dict(n_seqs=3, steps=20, n_layers=1, capacity=16, model=SIM_MODEL, slots=2, seed=0)
    else:
        kw = dict(n_seqs=4, steps=25, n_layers=2, capacity=24, model=SMALL_MODEL, slots=2, seed=3)
    kw.update(device=device, progress=False, plot_path=None)
    kw.update(over)
    return kw


def test_demo_runs_and_verifies(device):
    report = run_demo(**tiny(device))
    assert report.verification.startswith("passed"), report.verification
    assert report.shifts >= 1 and report.shifted_tokens >= 1
    assert report.defrags >= 1
    assert report.copy_prefix >= 1
    assert report.served >= 1
    # every token of every forward pass was compared with the recomputation
    assert report.verified_tokens == report.prefill_tokens + report.decode_tokens > 0
    assert report.checked_shifted_cells > 0
    assert report.max_logit_err < 1e-4 and report.max_shifted_key_err < 1e-5
    assert report.owners.shape == (report.steps_recorded, report.n_cells)
    kinds = {kind for _, kind, _ in report.events}
    assert {"arrive", "finish", "shift", "defrag", "copy_prefix"} <= kinds
    table = report.table()
    for label in ("throughput", "occupancy", "defrags", "context shifts", "copy_prefix",
                  "sequences served", "verification"):
        assert label in table


def test_default_run_shows_every_feature():
    """What ``numbakv demo`` runs by default (README's first command), on the CPU."""
    report = run_demo(device="cpu", progress=False, plot_path=None)
    assert report.verification.startswith("passed")
    assert report.n_layers == 4 and report.requests == 8 and report.n_cells == 4 * 64
    assert report.shifts >= 1 and report.defrags >= 1 and report.copy_prefix >= 1
    # finished conversations stay cached in their slots for later prompts (the prompt cache)
    assert report.served == 8 and report.final_cells > 0
    assert report.prompt_reused > 0
    assert report.prompt_evaluated + report.reprocessed == report.prefill_tokens
    assert report.peak_cells > report.n_cells // 2


def test_demo_sliding_window_cpu():
    report = run_demo(**tiny("cpu", swa_window=5))
    assert report.verification.startswith("passed")
    assert report.swa_window == 5
    assert report.shifts >= 1
    # a window memory keeps far fewer cells than max_seqs * capacity
    assert report.n_cells < 3 * 24


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_demo_half_precision_cpu(dtype):
    report = run_demo(**tiny("cpu", dtype=dtype, steps=20))
    assert report.verification.startswith("passed")
    assert report.dtype == dtype


def _corrupt(layer, which, at_step):
    """An after_step hook that adds 1 to one element of one cell of the busy sequence that has the
    most tokens left to generate (so it is read again at the next step)."""
    hits = []

    def hook(cache, step, running):
        if step != at_step or not running:
            return
        seq = max(running, key=running.get)
        # the step's sequence operations ended its forward pass: corrupt the storage itself
        cells = cache.cells.cells
        mine = np.nonzero((cells["seqs"][:, seq // 64] >> np.uint64(seq % 64)) & np.uint64(1))[0]
        row = int(mine[-1])
        if which == "key":
            cache.storage.keys[layer, row, 0, 0] += 1.0
        elif cache.config.permuted_v:
            cache.storage.values[layer, 0, 0, row] += 1.0
        else:
            cache.storage.values[layer, row, 0, 0] += 1.0
        hits.append((step, seq, row))
    return hook, hits


@pytest.mark.parametrize("layer,which", [(1, "value"), (0, "key"), (1, "key")])
def test_verification_catches_a_corrupted_cell(layer, which):
    hook, hits = _corrupt(layer, which, at_step=8)
    with pytest.raises(DemoVerificationError) as info:
        run_demo(**tiny("cpu", after_step=hook))
    assert hits, "the hook never corrupted anything"
    assert f"step {hits[0][0] + 1}:" in str(info.value)
    if layer == 0:
        assert "layer-0 keys" in str(info.value)
    else:
        assert "logits" in str(info.value)


def test_verification_passes_with_a_hook_that_changes_nothing():
    calls = []
    report = run_demo(**tiny("cpu", after_step=lambda cache, step, running: calls.append(step)))
    assert report.verification.startswith("passed")
    assert calls == list(range(report.steps_recorded))


def test_verification_catches_a_wrong_rotation():
    """A cache whose shift rotates keys by the wrong angle fails the layer-0 key check."""
    hits = []

    def hook(cache, step, running):
        if not hits:
            cache.shift = nkv.RopeShift(base=500.0, neox=True)  # not the model's RoPE base
            hits.append(step)
    with pytest.raises(DemoVerificationError, match="re-rotated by a context shift"):
        run_demo(**tiny("cpu", after_step=hook))


def test_verification_catches_a_defrag_that_loses_data(monkeypatch):
    """A defrag that moves the cell records but not their keys and values is caught."""
    from numbakv.storage import KVStorage
    monkeypatch.setattr(KVStorage, "move_blocks", lambda self, moves: None)
    with pytest.raises(DemoVerificationError, match="layer-0"):
        run_demo(**tiny("cpu"))


def test_reference_is_a_full_causal_forward():
    """Feeding the reference chunk by chunk equals one forward over all tokens (the layer input
    of a token depends only on the tokens before it)."""
    net = TinyLlama(SMALL_MODEL, seed=3)
    tokens = np.random.default_rng(0).integers(0, SMALL_MODEL.vocab, 17).tolist()
    whole = reference_forward(net, _RefSeq(2, SMALL_MODEL.d_model, np), tokens, "float32", None)
    ref = _RefSeq(2, SMALL_MODEL.d_model, np)
    parts = [reference_forward(net, ref, tokens[a:b], "float32", None)
             for a, b in ((0, 5), (5, 6), (6, 13), (13, 17))]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-5, atol=1e-5)
    # a plain numpy forward of the same model, written out here, agrees too
    x = net.embed[tokens]
    n = len(tokens)
    for p in net.layers:
        h = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * p["attn_norm"]
        out = np.zeros((n, 4 * 8), np.float32)
        inv = 10000.0 ** (-np.arange(4) * 2 / 8)
        def rope(t):
            ang = np.arange(n)[:, None, None] * inv
            a, b = t[..., :4], t[..., 4:]
            return np.concatenate([a * np.cos(ang) - b * np.sin(ang),
                                   a * np.sin(ang) + b * np.cos(ang)], -1)
        q = rope((h @ p["wq"]).reshape(n, 4, 8))
        k = rope((h @ p["wk"]).reshape(n, 2, 8))
        v = (h @ p["wv"]).reshape(n, 2, 8)
        for i in range(n):
            for head in range(4):
                s = k[:i + 1, head // 2] @ q[i, head] / np.sqrt(8)
                w = np.exp(s - s.max())
                out[i, head * 8:(head + 1) * 8] = (w / w.sum()) @ v[:i + 1, head // 2]
        x = x + out @ p["wo"]
        m = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * p["ffn_norm"]
        g = m @ p["w_gate"]
        x = x + (g / (1 + np.exp(-g)) * (m @ p["w_up"])) @ p["w_down"]
    logits = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * net.final_norm @ net.w_out
    np.testing.assert_allclose(whole, logits, rtol=1e-4, atol=1e-4)


def test_workload_is_deterministic_and_exercises_the_cache():
    a = Workload.generate(8, 100, capacity=64, seed=0)
    assert a == Workload.generate(8, 100, capacity=64, seed=0)
    assert a != Workload.generate(8, 100, capacity=64, seed=1)
    assert len(a.requests) == 8 and a.slots == 4
    assert a.requests[0].system and a.requests[1].system
    # the first request outgrows its capacity, so it must be context-shifted
    r0 = a.requests[0]
    assert len(a.system_prompt) + len(r0.prompt) + r0.n_decode > a.capacity
    assert all(r.arrival <= 60 for r in a.requests)
    with pytest.raises(ValueError, match="capacity"):
        Workload.generate(3, 10, capacity=8)


def test_cell_owners_matches_the_bitsets():
    cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=1, head_dim=8, dtype="float32", capacity=8,
                          max_seqs=3, max_batch=8, device="cpu")
    cache = CausalCache(cfg, shift=nkv.RopeShift())
    cache.start_forward([0, 1, 2, 0, 1], [0, 0, 0, 1, 1])
    cache.copy_prefix(0, 2, 2)
    owners = cell_owners(cache, {0: 10, 1: 11, 2: 12})
    expect = []
    for c in range(cache.n_cells):
        seqs = [s for s in range(3)
                if (int(cache.cells.cells["seqs"][c, s // 64]) >> (s % 64)) & 1]
        expect.append(FREE if not seqs else SHARED if len(seqs) > 1 else 10 + seqs[0])
    assert owners.tolist() == expect
    assert sorted(owners.tolist()).count(SHARED) == 2


def test_run_demo_rejects_bad_options():
    with pytest.raises(ValueError, match="swa_window"):
        run_demo(**tiny("cpu", swa_window=50))
    with pytest.raises(ValueError, match="dtype"):
        run_demo(**tiny("cpu", dtype="int8"))
    with pytest.raises(ValueError, match="device"):
        run_demo(**{**tiny("cpu"), "device": "tpu"})


def test_picture_png_and_terminal(tmp_path):
    report = run_demo(**tiny("cpu", steps=12))
    text = report.terminal_picture(width=40, rows=6)
    lines = text.splitlines()
    assert len(lines) == 1 + min(6, report.steps_recorded)
    assert all(line.count("|") == 2 for line in lines[1:])
    pytest.importorskip("matplotlib")
    from numbakv.tools.demo import save_picture
    path = tmp_path / "occupancy.png"
    assert save_picture(report, str(path)) == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _cli_env():
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # as a user runs it: auto is cuda or cpu, not sim
    return env


def test_cli_demo_exits_zero(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "numbakv", "demo", "--seqs", "2", "--steps",
                           "10", "--layers", "1", "--no-plot", "--quiet"],
                          capture_output=True, text=True, env=_cli_env(), cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "verification" in proc.stdout and "passed" in proc.stdout
    assert not list(tmp_path.glob("*.png"))


def test_cli_demo_bad_option_exits_two(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "numbakv", "demo", "--steps", "5", "--swa",
                           "1000", "--no-plot", "--quiet"],
                          capture_output=True, text=True, env=_cli_env(), cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 2
    assert "swa_window" in proc.stderr


def test_demo_reports_prompt_cache_reuse():
    """The workload runs through nkv.PromptCache: the summary reports prompt tokens reused vs
    evaluated, and follow-up turns find their conversations in released slots."""
    report = run_demo(**tiny("cpu", n_seqs=8, steps=60, follow_ups=0.6))
    assert report.verification.startswith("passed")
    assert report.follow_ups > 0 and report.prompt_reused > 0
    assert report.prefill_tokens <= report.prompt_evaluated + report.reprocessed + \
        sum(kind == "reprocess" for _, kind, _ in report.events)
    row = next(line for line in report.table().splitlines() if line.startswith("prompt cache"))
    assert f"{report.prompt_reused} prompt tokens reused" in row
    assert f"{report.prompt_evaluated} evaluated" in row


def test_demo_single_user_slot_choice_never_forks():
    report = run_demo(**tiny("cpu", multi_user=False))
    assert report.verification.startswith("passed")
    assert report.copy_prefix == 0 and report.prompt_reused > 0


def test_workload_follow_ups():
    w = Workload.generate(12, 100, capacity=32, seed=4, follow_ups=1.0)
    assert all(r.follows is None for r in w.requests[:2])
    assert all(r.follows is not None and 1 <= r.follows < r.rid for r in w.requests[2:])
    # the follow-up draws do not change the rest of the trace
    plain = Workload.generate(12, 100, capacity=32, seed=4, follow_ups=0.0)
    assert [r.arrival for r in w.requests] == [r.arrival for r in plain.requests]
    assert w.system_prompt == plain.system_prompt
    with pytest.raises(ValueError, match="follow_ups"):
        Workload.generate(3, 10, capacity=16, follow_ups=2)


def _synthetic_report(n_cells, n_steps=30, n_req=20):
    """A DemoReport with interleaved one-cell decode tokens (the comb the picture must not draw
    one pixel wide), a shared prefix and one event of each marked kind."""
    from numbakv.tools.demo import DemoReport
    owners = np.full((n_steps, n_cells), FREE, np.int32)
    owners[:, :8] = SHARED
    for step in range(n_steps):
        owners[step, 8:n_cells - 3] = (np.arange(8, n_cells - 3) % 4) + 4 * (step >= 20)
    report = DemoReport(device="cpu", dtype="float32", n_layers=1, swa_window=None,
                        n_cells=n_cells, capacity=64, requests=n_req, owners=owners)
    report.events += [(3, "copy_prefix", "request 1 shares the system prompt (8 tokens) of "
                       "request 0"), (4, "copy_prefix", "request 2 shares the system prompt"),
                      (12, "shift", "request 0: kept 8, discarded 28 of 64 tokens"),
                      (20, "defrag", "no contiguous run of 4 free cells"),
                      (25, "arrive", "request 5 in sequence 1")]
    return report


def test_picture_colours_are_distinct_and_never_free_or_shared():
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_rgb
    from numbakv.tools.demo import FREE_COLOR, REQUEST_COLORS, SHARED_COLOR, request_color
    rgb = [to_rgb(c) for c in REQUEST_COLORS]
    assert len(set(rgb)) == len(rgb)
    for special in (FREE_COLOR, SHARED_COLOR):
        s = np.array(to_rgb(special))
        assert min(np.abs(np.array(c) - s).sum() for c in rgb) > 0.3
    for c in rgb:  # no grey: every request colour has some saturation
        assert max(c) - min(c) > 0.15, c
    assert request_color(3) == REQUEST_COLORS[3]


def test_picture_marks_label_every_defrag_shift_and_reuse():
    from numbakv.tools.demo import picture_marks
    marks = picture_marks(_synthetic_report(64), group=1)
    kinds = [m.kind for m in marks]
    assert sorted(kinds) == ["copy_prefix", "defrag", "shift"]  # arrivals are not marked
    by_kind = {m.kind: m for m in marks}
    assert by_kind["copy_prefix"].label.endswith("r1, r2")  # two steps apart: one label
    assert (by_kind["copy_prefix"].col_lo, by_kind["copy_prefix"].col_hi) == (0, 7)
    assert by_kind["shift"].label == "context shift r0" and by_kind["shift"].col_lo >= 8
    assert (by_kind["defrag"].col_lo, by_kind["defrag"].col_hi) == (0, 63)


def test_picture_groups_wide_caches_instead_of_one_pixel_stripes(tmp_path):
    pytest.importorskip("matplotlib")
    from numbakv.tools.demo import MIN_COLUMN_PX, picture_columns, save_picture
    report = _synthetic_report(4096)
    cols, group = picture_columns(report.owners, 1280 // MIN_COLUMN_PX)
    assert group == 13 and cols.shape == (30, 316)
    assert (cols[:, 0] == SHARED).all()      # the majority owner of each group
    assert cols[-1, -1] == FREE              # 3 used cells of 13 in the last group: free
    assert set(np.unique(cols[:, 1:-1])) <= {0, 1, 2, 3, 4, 5, 6, 7}
    narrow, g1 = picture_columns(report.owners[:, :64], 320)
    assert g1 == 1 and np.array_equal(narrow, report.owners[:, :64])
    path = tmp_path / "wide.png"
    assert save_picture(report, str(path)) == str(path)
    from matplotlib.image import imread
    img = imread(str(path))
    # the widest run of one colour along a row through the interleaved cells is >= the minimum
    row = img[int(img.shape[0] * 0.5), :, :3]
    change = np.nonzero(np.any(np.abs(np.diff(row, axis=0)) > 0.05, axis=1))[0]
    runs = np.diff(change)
    assert np.median(runs[runs > 1]) >= MIN_COLUMN_PX - 1


def test_shift_mark_covers_only_the_shifted_requests_cells_and_labels_do_not_overlap():
    from numbakv.tools.demo import label_rows, picture_marks
    report = _synthetic_report(64)
    shift = next(m for m in picture_marks(report, group=1) if m.kind == "shift")
    row = report.owners[min(shift.step, len(report.owners) - 1)]
    covered = {c for lo, hi in shift.segments for c in range(lo, hi + 1)}
    assert covered == set(np.nonzero(row == 0)[0].tolist())     # r0's cells, nothing between
    rows = label_rows([3.0, 3.5, 4.0, 40.0, 99.0, 99.0], gap=2.0, top=0.0, bottom=100.0)
    assert all(b - a >= 2.0 - 1e-9 for a, b in zip(rows, rows[1:]))
    assert rows[0] >= 3.0 - 1e-9 and rows[-1] <= 100.0 and rows[3] == 40.0


def test_cli_demo_runs_the_prefix_store_segment_by_default_and_draws_it(tmp_path):
    """``numbakv demo`` (no flag) reports the prefix-store segment's tokens per tier and the
    picture has its panel; ``--no-prefix-store`` skips it."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "demo.png"
    proc = subprocess.run([sys.executable, "-m", "numbakv", "demo", "--seqs", "2", "--steps",
                           "10", "--layers", "1", "--quiet", "--png", str(png)],
                          capture_output=True, text=True, env=_cli_env(), cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "Prefix store:" in out and "from the store's cells (tier 0" in out
    assert "from host RAM (tier 1" in out and "cells -> host" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("tokens: "))
    m = re.match(r"tokens: (\d+) from live slots, (\d+) from the store's cells \(tier 0, no "
                 r"copy\), (\d+) from host RAM \(tier 1, promoted back\), (\d+) computed", line)
    assert m and all(int(c) > 0 for c in m.groups()), line   # slot, tier 0, tier 1, computed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread
    assert imread(str(png)).shape[0] > 700          # the occupancy band plus the store panel
    skip = subprocess.run([sys.executable, "-m", "numbakv", "demo", "--seqs", "2", "--steps",
                           "10", "--layers", "1", "--quiet", "--no-plot", "--no-prefix-store"],
                          capture_output=True, text=True, env=_cli_env(), cwd=tmp_path,
                          timeout=300)
    assert skip.returncode == 0, skip.stderr
    assert "Prefix store:" not in skip.stdout


def test_prefix_panel_marks_tier_moves_and_no_labels_overlap():
    pytest.importorskip("matplotlib")
    from numbakv.tools.demo import picture_figure
    from numbakv.tools.demo_prefix import run_prefix_demo
    report = _synthetic_report(64)
    report.prefix = run_prefix_demo()
    rows = report.prefix["rows"]
    # the segment moves conversations both ways: promotions (tier 1 hits) and demotions
    assert any(r["source"] == "host" for r in rows) and any(r["source"] == "cells" for r in rows)
    assert sum(len(r["demoted"]) for r in rows) >= 1
    assert all(0 <= u < 6 and k > 0 for r in rows for u, k in r["demoted"])
    fig = picture_figure(report)
    renderer = fig.canvas.get_renderer()
    moves = [t for ax in fig.axes for t in ax.texts if t.get_gid() == "prefix-move"]
    assert len(moves) == sum(1 for r in rows if r["demoted"] or r["source"] == "host")
    assert any("\u25b2" in t.get_text() for t in moves) and any("\u25bc" in t.get_text()
                                                                 for t in moves)
    boxes = [t.get_window_extent(renderer) for t in moves]
    boxes += [lg.get_window_extent(renderer) for lg in fig.legends]
    boxes += [t.get_window_extent(renderer) for t in fig.texts]          # the captions
    boxes += [ax.get_window_extent(renderer) for ax in fig.axes]
    w, h = fig.canvas.get_width_height()
    for i, a in enumerate(boxes):
        assert a.x0 >= 0 and a.y0 >= 0 and a.x1 <= w and a.y1 <= h, a   # nothing cut off
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)


def test_bench_demo_child_surfaces_the_childs_error(monkeypatch):
    """``numbakv bench --sections attend`` runs the demo in child processes: when one fails,
    the error names the child's own exception, not just its exit status."""
    from numbakv.tools import bench_attend

    def failed_child(args, **kw):
        return subprocess.CompletedProcess(args, 1, "", "Traceback (most recent call last):\n"
                                           "ValueError: q must be on the cache's device\n")

    monkeypatch.setattr(bench_attend.subprocess, "run", failed_child)
    with pytest.raises(RuntimeError, match="status 1:\nTraceback.*\nValueError: q must be on"):
        bench_attend._demo_child(hide_torch=True)


def test_warm_up_says_what_its_time_went_to():
    """The warm-up line counts numba compiles (none once the code is loaded: a second run in
    one process compiles nothing) and the torch import apart from the rest, instead of calling
    all of it "compile"."""
    import importlib.util
    run_demo(**tiny("cpu"))
    report = run_demo(**tiny("cpu"))
    assert report.warmup_compiled == 0 and report.warmup_compile_time == 0.0
    assert report.warmup_torch_import < 0.5       # already imported by the first run
    line = report.warmup_summary()
    assert line.startswith(f"{report.warmup_time:.1f} s (nothing compiled")
    assert "loading compiled code and first calls" in line and "warm-up" in report.table()
    report.warmup_compiled, report.warmup_compile_time = 3, 0.25
    report.warmup_torch_import = 0.5 if importlib.util.find_spec("torch") else 0.0
    assert "numba compiled 3 functions in 0.2 s" in report.warmup_summary()


def test_compile_timer_counts_outermost_compiles_only():
    import numba
    from numbakv.tools.demo import _CompileTimer

    @numba.njit
    def inner(x):
        return x + 1

    @numba.njit
    def outer(x):
        return inner(x) * 2

    with _CompileTimer() as timer:
        assert outer(1) == 4
    assert timer.count == 1 and timer.seconds > 0
    with _CompileTimer() as again:
        outer(2)
    assert again.count == 0 and again.seconds == 0.0
