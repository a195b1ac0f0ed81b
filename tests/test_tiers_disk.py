"""The disk tier under the prefix store (numbakv/prefix/tiers/disk.py): byte-level behaviour,
restarts, kill -9 mid-write, processes sharing a directory, budgets and faults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from numbakv.prefix.tiers import ByteTier, DiskTier, open_tier
from numbakv.prefix.tiers.disk import clear_directory, scan_directory

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import tier_worker as tw  # noqa: E402

NS = tw.NAMESPACE
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def cli_main():
    """``numbakv``'s main(): numbakv/tools/cli.py since the layout move, numbakv/cli.py before."""
    try:
        from numbakv.tools.cli import main
    except ImportError:
        from numbakv.cli import main
    return main


def worker(*args, timeout=120, **kw):
    return subprocess.run([sys.executable, os.path.join(HERE, "tier_worker.py"), *map(str, args)],
                          env=ENV, capture_output=True, text=True, timeout=timeout, **kw)


def hammer(target, budget: int) -> list:
    """Two ``tier_worker.py hammer`` processes (writers 1 and 2: different bytes for the same
    keys) on the tier at ``target`` (a directory or a Redis URL) under ``budget``, run to the end
    (killed on a failure); their last JSON lines."""
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "tier_worker.py"), "hammer",
                              str(target), str(budget), "65000", "10", "8", str(w)],
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for w in (1, 2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    return outs


def last_json(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def put(tier, i, size=1000, writer=1, n=4):
    key = tw.run_key(i)
    return tier.write_run(key, tw.block_keys(i, n), tw.payload(key, size, writer))


def run_files(directory):
    runs = os.path.join(directory, "t1." + NS, "runs")
    return {name: os.path.getsize(os.path.join(runs, name)) for name in os.listdir(runs)}


def test_round_trip_and_pointers(tmp_path):
    with open_tier(tmp_path, NS, 1 << 20) as tier:
        assert isinstance(tier, DiskTier) and isinstance(tier, ByteTier) and tier.name == "disk"
        assert put(tier, 1, n=3) and put(tier, 2, n=2)
        found = tier.find_blocks(tw.block_keys(1, 3) + tw.block_keys(2, 2) + [tw.run_key(77)])
        assert found == [(tw.run_key(1), 0), (tw.run_key(1), 1), (tw.run_key(1), 2),
                         (tw.run_key(2), 0), (tw.run_key(2), 1), None]
        got = tier.read_runs([tw.run_key(2), tw.run_key(5), tw.run_key(1)])
        assert got[0] == tw.payload(tw.run_key(2), 1000, 1) and got[1] is None
        assert got[2] == tw.payload(tw.run_key(1), 1000, 1) and type(got[2]) is bytes
        st = tier.stats()
        assert st["entries"] == 2 and st["hits"] == 2 and st["misses"] == 1
        assert st["block_hits"] == 5 and st["block_misses"] == 1 and st["writes"] == 2
        assert st["bytes_pinned"] == 0 and st["bytes_evictable"] == st["bytes_used"]
        assert st["bytes_used"] + st["bytes_free"] + st["bytes_pinned"] == 1 << 20
        assert st["bytes_used"] == sum(run_files(tmp_path).values())
        tier.remove_run(tw.run_key(1))
        assert tier.find_blocks(tw.block_keys(1, 1)) == [None]
        assert tier.read_runs([tw.run_key(1)]) == [None]
        tier.report_invalid(tw.run_key(2))
        assert tier.stats()["invalid"] == 1 and tier.stats()["entries"] == 0
        assert put(tier, 3) and tier.clear() == 1 and tier.stats()["entries"] == 0
        assert run_files(tmp_path) == {}


def test_state_bytes_survive_a_restart_bit_exact(tmp_path):
    """A cache's state bytes (the codec the store's snapshots use) written by one process are
    read by another and load into a fresh cache bit-exact."""
    out = last_json(worker("state_write", tmp_path, 1 << 22))
    assert out["ok"]
    with open_tier(str(tmp_path), NS, 1 << 22) as tier:
        [(run, idx)] = tier.find_blocks(tw.block_keys(1, 3)[2:])
        assert (run, idx) == (tw.run_key(1), 2)
        [data] = tier.read_runs([run])
    assert len(data) == out["nbytes"]
    import hashlib
    assert hashlib.sha256(data).hexdigest() == out["sha"]
    src, dst = tw.make_cache(), tw.make_cache()
    tw.fill(src, 0, 40, seed=7)
    dst.load_state_bytes(data, seq=1)
    assert_same_rows(src.state_bytes(seq=0), dst.state_bytes(seq=1))


def assert_same_rows(a: bytes, b: bytes) -> None:
    """Two sequence states hold the same positions and bit-identical K/V rows."""
    from safetensors.numpy import load
    ta, tb = load(a), load(b)
    assert sorted(ta) == sorted(tb) and any(k.startswith("k.") for k in ta)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and ta[name].tobytes() == tb[name].tobytes(), name


def test_lru_eviction_and_budget(tmp_path):
    size = 1000
    with DiskTier(NS, 10 * 1000, tmp_path) as tier:
        for i in range(8):
            assert put(tier, i, size, n=1)
            time.sleep(0.01)                 # distinct mtimes
        per_run = tier.stats()["bytes_used"] // 8
        tier.read_runs([tw.run_key(0)])      # 0 becomes the most recently used
        time.sleep(0.01)
        for i in range(8, 12):
            assert put(tier, i, size, n=1)
            time.sleep(0.01)
        st = tier.stats()
        assert st["bytes_used"] <= 10 * 1000 and st["evictions"] >= 2
        held = {r for r in range(12) if tier.find_blocks(tw.block_keys(r, 1))[0] is not None}
        assert 0 in held and 1 not in held and 2 not in held and {8, 9, 10, 11} <= held
        assert sum(run_files(tmp_path).values()) == st["bytes_used"]
        # a run larger than the whole budget is refused, nothing evicted
        before = tier.stats()["entries"]
        assert not put(tier, 99, 20 * 1000)
        assert tier.stats()["entries"] == before
        assert per_run > size
    with DiskTier(NS, 0, tmp_path / "zero") as tier:      # budget 0 stores nothing
        assert not put(tier, 1) and tier.stats()["bytes_free"] == 0


def test_index_is_rebuilt_by_scanning(tmp_path):
    with DiskTier(NS, 1 << 20, tmp_path) as tier:
        for i in range(5):
            assert put(tier, i)
    ns_dir = tmp_path / ("t1." + NS)
    (ns_dir / "index.log").unlink()
    with DiskTier(NS, 1 << 20, tmp_path) as tier:
        assert all(f is not None for f in tier.find_blocks(tw.block_keys(3)))
        assert tier.stats()["entries"] == 5
    # garbage and torn lines in the log are skipped; a file removed by hand is a miss
    with open(ns_dir / "index.log", "ab") as f:
        f.write(b"+ zz 12 q 00000000\n+ 0000 garbage")
    os.unlink(ns_dir / "runs" / (tw.run_key(4) + ".run"))
    with DiskTier(NS, 1 << 20, tmp_path) as tier:
        assert tier.stats()["entries"] == 4
        assert tier.find_blocks(tw.block_keys(4, 1)) == [None]
        assert tier.read_runs([tw.run_key(0)])[0] == tw.payload(tw.run_key(0), 1000, 1)
        assert put(tier, 6)   # appends cleanly after the torn line
    with DiskTier(NS, 1 << 20, tmp_path) as tier:
        assert tier.stats()["entries"] == 5
        # a second process deleting the log while this one runs: the next lookup rebuilds it
        (ns_dir / "index.log").unlink()
        assert tier.find_blocks(tw.block_keys(6, 1))[0] is not None
        assert (ns_dir / "index.log").exists()


def test_log_compaction_keeps_the_index(tmp_path, monkeypatch):
    from numbakv.prefix.tiers import disk
    monkeypatch.setattr(disk, "_COMPACT_FLOOR", 40)
    with DiskTier(NS, 30 * 1200, tmp_path) as tier:
        for i in range(150):               # ~300 index lines for <= 30 live runs
            assert put(tier, i, 1000, n=2)
        log = tmp_path / ("t1." + NS) / "index.log"
        lines = log.read_bytes().count(b"\n")
        assert lines <= disk._COMPACT_FACTOR * 30 + disk._COMPACT_FLOOR + 2
        live = tier.stats()["entries"]
    with DiskTier(NS, 30 * 1200, tmp_path) as tier:
        assert tier.stats()["entries"] == live
        assert tier.find_blocks(tw.block_keys(149, 2))[1] == (tw.run_key(149), 1)


def test_kill_9_mid_write_leaves_every_file_whole_or_absent(tmp_path):
    """A writer killed at a random moment during large writes: a new process hits every run the
    writer reported as stored, every file is whole, and the dead writer's temp file goes."""
    size = 6 << 20
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "tier_worker.py"), "write_loop",
                             str(tmp_path), str(1 << 30), str(size), "40", "3"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = []
    try:
        deadline = time.monotonic() + 120
        while len(done) < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("done"):
                done.append(int(line.split()[1]))
        time.sleep(np.random.default_rng().uniform(0.0, 0.05))   # somewhere inside a write
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        rest, _ = proc.communicate(timeout=30)
        done += [int(x.split()[1]) for x in rest.splitlines() if x.startswith("done")]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert len(done) >= 3, proc.stderr.read() if proc.stderr else ""
    with DiskTier(NS, 1 << 30, tmp_path) as tier:
        for i in range(40):
            key = tw.run_key(i)
            found = tier.find_blocks(tw.block_keys(i))
            [data] = tier.read_runs([key])
            if i in done:
                assert found[0] == (key, 0) and data is not None
            if data is not None:
                assert len(data) == size and tw.check_payload(key, data)
        assert not [n for n in run_files(tmp_path) if n.startswith(".tmp")]


def test_two_processes_write_the_same_keys(tmp_path):
    """Two writers (different bytes for the same keys) and their reads interleave under a budget
    that forces evictions: no torn or mixed entry is ever read, the budget holds."""
    budget = 6 * 70_000
    outs = hammer(tmp_path, budget)
    assert all(o["torn"] == 0 for o in outs) and sum(o["reads"] for o in outs) > 0
    assert sum(run_files(tmp_path).values()) <= budget
    with DiskTier(NS, budget, tmp_path) as tier:
        assert tier.stats()["bytes_used"] <= budget
        for i in range(10):
            [data] = tier.read_runs([tw.run_key(i)])
            assert data is None or tw.check_payload(tw.run_key(i), data)


def test_other_models_files_are_ignored_and_counted(tmp_path):
    other = "nkv1-ffffffffffffffff"
    with DiskTier(other, 1 << 20, tmp_path) as tier:
        assert put(tier, 1)
    (tmp_path / "notes.txt").write_text("not ours")
    with DiskTier(NS, 1 << 20, tmp_path) as tier:
        assert tier.find_blocks(tw.block_keys(1)) == [None] * 4
        runs = tmp_path / ("t1." + NS) / "runs"
        # another namespace's run file copied in under a valid name, and junk: foreign
        src = tmp_path / ("t1." + other) / "runs" / (tw.run_key(1) + ".run")
        (runs / (tw.run_key(1) + ".run")).write_bytes(src.read_bytes())
        (runs / "junk.run").write_bytes(b"x")
    with DiskTier(NS, 1 << 20, tmp_path) as tier:
        st = tier.stats()
        assert st["other_namespaces"] == 2 and st["foreign_files"] == 2 and st["entries"] == 0
        assert tier.find_blocks(tw.block_keys(1)) == [None] * 4
        assert tier.read_runs([tw.run_key(1)]) == [None]       # never served by name either
    scan = scan_directory(tmp_path)
    assert scan["namespaces"][other]["entries"] == 1 and scan["foreign"] == 1
    assert clear_directory(tmp_path, other[-8:]) == {other: 1}
    assert (tmp_path / "notes.txt").exists()


def test_bad_arguments_raise_before_anything_changes(tmp_path):
    with pytest.raises(ValueError, match="namespace"):
        DiskTier("../up", 1, tmp_path)
    with pytest.raises(ValueError, match="budget_bytes"):
        DiskTier(NS, -1, tmp_path)
    with pytest.raises(ValueError, match="budget_bytes"):
        DiskTier(NS, 1.5, tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        DiskTier(NS, 1, tmp_path / "file")
    with pytest.raises(ValueError, match="not a directory"):
        DiskTier(NS, 1, tmp_path / "file" / "below")
    with pytest.raises(ValueError, match="spec"):
        open_tier(b"/tmp", NS, 1)
    with pytest.raises(ValueError, match="unsupported tier URL"):
        open_tier("http://x", NS, 1)
    with pytest.raises(ValueError, match="timeout"):
        open_tier(tmp_path, NS, 1, timeout=0)
    with DiskTier(NS, 1 << 20, tmp_path / "d") as tier:
        for bad in ("../../etc/passwd", "ABCDEF0123", "abc", 12, "g" * 32):
            with pytest.raises(ValueError, match="run_key"):
                tier.write_run(bad, [], b"x")
        with pytest.raises(ValueError, match=r"block_keys\[1\]"):
            tier.write_run(tw.run_key(1), [tw.run_key(2), "x/y"], b"x")
        with pytest.raises(ValueError, match="block_keys"):
            tier.find_blocks(tw.run_key(1))
        with pytest.raises(ValueError, match=r"block_keys\[1\]"):   # a comma inside a key
            tier.find_blocks([tw.run_key(1), tw.run_key(2) + "," + tw.run_key(3)])
        with pytest.raises(ValueError, match=r"run_keys\[0\]"):
            tier.read_runs([None])
        assert tier.find_blocks([]) == [] and tier.read_runs([]) == []
        with pytest.raises(ValueError, match="data"):
            tier.write_run(tw.run_key(1), [], "text")
        assert tier.stats()["entries"] == 0 and run_files(tmp_path / "d") == {}


needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="switches user in a child: needs root")


@needs_root
def test_permissions_error_at_construction_miss_at_run_time():
    import shutil
    import tempfile
    base = tempfile.mkdtemp(prefix="nkv-perm-")   # pytest's tmp_path is 0700 up the tree
    try:
        os.chmod(base, 0o755)
        _permissions(os.path.join(base, "shared"))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _permissions(d):
    with DiskTier(NS, 1 << 20, d) as tier:
        assert put(tier, 1)
    # nobody cannot write root's 0755 folders: a clear error at construction
    out = last_json(worker("as_nobody", d, "construct"))
    assert "not readable and writable" in out["error"] and "disk_dir" in out["error"]
    # built, then the permissions change under it: writes refused, reads still hit, no raise
    out = last_json(worker("as_nobody", d, "runtime"))
    assert out["error"] is None and out["write"] is False and out["errors"] >= 1
    assert out["found"] and out["read"]
    # nor can nobody read a 0700 directory
    os.chmod(d, 0o700)
    out = last_json(worker("as_nobody", d, "construct"))
    assert "permission denied" in out["error"]


def test_read_only_file_system(tmp_path):
    """A directory on a read-only mount: a clear error at construction (skipped when this
    machine cannot mount)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                         capture_output=True)
    if res.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pytest.raises(ValueError, match="read-only"):
            DiskTier(NS, 1 << 20, ro)
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_full_disk_refuses_the_write_and_keeps_the_rest(tmp_path):
    out = last_json(worker("fsize", tmp_path, 64 << 10, 1 << 20))
    assert out["small"] is True and out["big"] is False and out["errors"] >= 1
    assert out["found"] == [True] * 4 + [False] * 4 and out["small_ok"]
    assert not [n for n in run_files(tmp_path) if n.startswith(".tmp")]
    with DiskTier(NS, 1 << 30, tmp_path) as tier:
        assert tier.stats()["entries"] == 1


def test_closed_tier_misses(tmp_path):
    tier = DiskTier(NS, 1 << 20, tmp_path)
    assert put(tier, 1)
    tier.close()
    assert tier.find_blocks(tw.block_keys(1, 1)) == [None]
    assert tier.read_runs([tw.run_key(1)]) == [None]
    assert not put(tier, 2)
    tier.close()


def test_store_cli_on_a_directory(tmp_path, capsys):
    main = cli_main()
    tw.cmd_state_write(str(tmp_path), 1 << 22)          # in-process: no child needed here
    assert json.loads(capsys.readouterr().out)["ok"]
    with DiskTier("nkv1-2222222222222222", 1 << 20, tmp_path) as other:
        assert put(other, 1) and put(other, 2)
        other.read_runs([tw.run_key(1), tw.run_key(3)])
    assert main(["store", "stats", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 namespace(s)" in out and "3 entries" in out and "1 hits, 1 misses" in out
    assert "n_layers=2 n_kv_heads=2 head_dim=16" in out          # from the state's fingerprint
    assert main(["store", "stats", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["namespaces"][NS]["fingerprint"]["head_dim"] == 16
    # no terminal to ask on (pytest's stdin): refused, nothing removed, --yes says how
    assert main(["store", "clear", str(tmp_path), "--fingerprint", "2222"]) == 1
    err = capsys.readouterr().err
    assert "would remove 2 entries" in err and "--yes" in err
    assert scan_directory(tmp_path)["entries"] == 3
    assert main(["store", "clear", str(tmp_path), "--fingerprint", "2222", "--yes"]) == 0
    assert "nkv1-2222222222222222: removed 2 entries" in capsys.readouterr().out
    assert scan_directory(tmp_path)["entries"] == 1
    assert main(["store", "clear", str(tmp_path), "-y"]) == 0
    assert scan_directory(tmp_path)["entries"] == 0
    assert main(["store", "stats", str(tmp_path / "absent")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # a URL no tier speaks is not taken for a directory of that name
    for args in (["stats", "http://127.0.0.1:6379/0"], ["clear", "s3://bucket/kv", "--yes"]):
        assert main(["store", *args]) == 2
        assert "neither a directory nor a redis://" in capsys.readouterr().err


def test_store_clear_asks_on_a_terminal(tmp_path, capsys, monkeypatch):
    """On a terminal `store clear` asks; anything but y/yes removes nothing."""
    import io
    main = cli_main()
    with DiskTier(NS, 1 << 20, tmp_path) as tier:
        assert put(tier, 1)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for answer, removed in (("n\n", False), ("\n", False), ("y\n", True)):
        monkeypatch.setattr("sys.stdin", Terminal(answer))
        code = main(["store", "clear", str(tmp_path)])
        out, err = capsys.readouterr()
        assert "Remove 1 entries" in out
        assert (code, scan_directory(tmp_path)["entries"]) == ((0, 0) if removed else (1, 1))
        assert removed or "nothing removed" in err


def test_full_tmpfs_enospc(tmp_path):
    """A really full file system (a 1 MiB tmpfs; skipped where mounting is not allowed): the
    write that does not fit is refused, the runs before it stay whole, no temporary file left."""
    small = tmp_path / "small"
    small.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                         capture_output=True)
    if res.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with DiskTier(NS, 64 << 20, small) as tier:
            assert put(tier, 1, 600_000)
            assert not put(tier, 2, 600_000)            # ENOSPC: refused, not raised
            st = tier.stats()
            assert st["errors"] == 1 and st["entries"] == 1
            assert tier.read_runs([tw.run_key(1)]) == [tw.payload(tw.run_key(1), 600_000, 1)]
            assert not [n for n in run_files(small) if n.startswith(".tmp")]
            tier.remove_run(tw.run_key(1))
            assert put(tier, 2, 600_000)                # room again
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)
