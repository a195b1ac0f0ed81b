"""State files that try to crash or lie (issue 17): another process truncating, rewriting or
deleting the file during a load; bytes changed after the checksum pass; hostile headers
(deep nesting, huge numbers, fields of the wrong type, forged simple-cache steps); OS errors;
and the model fingerprint that stops a state from loading into a cache of another model.

Every refusal must be a ``StateError`` (OS errors with the ``OSError`` as ``__cause__``) and the
cache must be left exactly as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import types

import numpy as np
import pytest

import numbakv as nkv
from numbakv import StateError, state
from numbakv.causal import CausalCache

from test_state import (assert_unchanged, edit_header, edit_meta, fill, host, make, populated,
                        snapshot, split)


@pytest.fixture
def saved():
    rng = np.random.default_rng(21)
    c = populated("cpu", rng)
    return c, c.state_bytes(), c.state_bytes(0)


def _kv_of_used(cache):
    used = np.flatnonzero(cache.cells.cells["pos"] >= 0)
    k, v = cache.storage.read_cells(used.astype(np.int32))
    return cache.cells.cells[used].tobytes(), k.tobytes(), v.tobytes()


# ============================================================================ the file changes
def test_bytes_rewritten_after_the_checksum_are_never_loaded(saved, tmp_path, monkeypatch):
    """Another process overwrites V with NaNs right after the checksum pass: the load commits
    the bytes it verified (read into memory), not the new ones."""
    src, whole, _ = saved
    path = tmp_path / "s.st"
    path.write_bytes(whole)
    real = state._State.verify_checksum

    def verify_then_scribble(self, bar=None):
        real(self, bar)
        header, body = split(whole)
        b, e = header["v.0"]["data_offsets"]
        data = bytearray(whole)
        start = len(whole) - len(body) + b
        data[start:start + (e - b)] = np.full((e - b) // 2, np.nan, np.float16).tobytes()
        path.write_bytes(bytes(data))
    monkeypatch.setattr(state._State, "verify_checksum", verify_then_scribble)
    dst = make("cpu")
    dst.load_state(path)
    assert _kv_of_used(dst) == _kv_of_used(src)
    assert not np.isnan(host(dst.storage.values).astype(np.float32)).any()


def test_file_truncated_before_the_read_is_refused(saved, tmp_path):
    _, whole, _ = saved
    path = tmp_path / "s.st"
    dst = make("cpu")
    snap = snapshot(dst)
    for size in (0, 7, 8, 100, len(whole) // 2, len(whole) - 1):
        path.write_bytes(whole[:size])
        with pytest.raises(StateError, match="truncated"):
            dst.load_state(path)
        assert_unchanged(dst, snap)


_WRITER = textwrap.dedent("""
    import os, random, sys, time
    path, good_path, stop = sys.argv[1], sys.argv[2], sys.argv[3]
    good = open(good_path, 'rb').read()
    rng = random.Random(7)
    while not os.path.exists(stop):
        what = rng.random()
        if what < 0.3:                                   # truncate in place
            os.truncate(path, rng.randrange(0, len(good)))
        elif what < 0.6:                                 # rewrite bytes in place
            with open(path, 'r+b') as f:
                f.seek(rng.randrange(0, len(good)))
                f.write(os.urandom(rng.randrange(1, 4096)))
        elif what < 0.7:                                 # delete it
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        with open(path, 'wb') as f:                      # and put the good state back, slowly
            for i in range(0, len(good), 65536):
                f.write(good[i:i + 65536])
                f.flush()
        time.sleep(rng.random() * 0.002)
""")


def test_another_process_truncating_and_rewriting_during_loads(tmp_path):
    """A second process truncates, rewrites, deletes and restores the file in a loop while this
    one loads it again and again: each load is a StateError (cache unchanged) or the saved state
    exactly, and this process never dies (a mapped file would raise SIGBUS)."""
    rng = np.random.default_rng(22)
    cfg = nkv.CacheConfig(4, 4, 64, dtype="float16", capacity=512, max_seqs=2, max_batch=512,
                          device="cpu")
    src = CausalCache(cfg)
    for seq in (0, 1):
        src.start_forward(np.arange(500), np.full(500, seq))
        for layer in range(cfg.n_layers):
            src.set_layer(layer)
            src.put(rng.standard_normal((500, 4, 64)).astype(np.float16),
                    rng.standard_normal((500, 4, 64)).astype(np.float16))
    good = tmp_path / "good.st"
    src.save_state(good)
    assert good.stat().st_size > 2 << 20
    path, stop = tmp_path / "live.st", tmp_path / "stop"
    path.write_bytes(good.read_bytes())
    want = _kv_of_used(src)
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(good), str(stop)])
    dst = CausalCache(cfg)
    outcomes = {"loaded": 0, "refused": 0}
    try:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline or not outcomes["loaded"] or not outcomes["refused"]:
            snap = snapshot(dst)
            try:
                dst.load_state(path)
            except StateError:
                outcomes["refused"] += 1
                assert_unchanged(dst, snap)
                continue
            outcomes["loaded"] += 1
            assert _kv_of_used(dst) == want
            dst.seq_rm(-1)
            if time.monotonic() > deadline + 60:
                break
    finally:
        stop.write_text("")
        writer.wait(30)
    assert writer.returncode == 0
    assert outcomes["loaded"] and outcomes["refused"], outcomes


# ============================================================================ hostile headers
def _raw(header_text: bytes, body: bytes = b"") -> bytes:
    return len(header_text).to_bytes(8, "little") + header_text + body


@pytest.mark.parametrize("depth", [10_000, 200_000])
def test_deeply_nested_header_is_a_state_error(depth):
    dst = make("cpu")
    snap = snapshot(dst)
    for text in (b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth):
        with pytest.raises(StateError):
            dst.load_state_bytes(_raw(text))
        with pytest.raises(StateError):
            state.read_info(_raw(text))
    assert_unchanged(dst, snap)


def test_deeply_nested_config_metadata_is_a_state_error(saved):
    _, whole, one = saved
    deep = "[" * 100_000 + "]" * 100_000
    for data in (whole, one):
        with pytest.raises(StateError, match="deeply|cannot be read|config"):
            make("cpu").load_state_bytes(edit_meta(data, config=deep),
                                         None if data is whole else 0)


def test_forged_simple_cache_step_is_a_state_error():
    c = nkv.StepCache(step=4, device="cpu")
    c.update(np.ones((1, 2, 3, 8), np.float32), np.ones((1, 2, 3, 8), np.float32))
    data = c.state_bytes()
    for step in (2**40, 2**62, 2**200, -1, 0, "4", None, [4], 1.5):
        def forge(h, step=step):
            cfg = json.loads(h["__metadata__"]["config"])
            cfg["meta"]["step"] = step
            h["__metadata__"]["config"] = json.dumps(cfg)
        with pytest.raises(StateError):
            nkv.StepCache.load_state(edit_header(data, forge), device="cpu")
    r = nkv.RotatingCache(4, step=2, device="cpu")
    r.update(np.ones((1, 2, 5, 8), np.float32), np.ones((1, 2, 5, 8), np.float32))
    rdata = r.state_bytes()
    for key, value in (("max_size", 0), ("idx", 2**70), ("max_size", -3), ("idx", "x"),
                       ("max_size", [4]), ("step", 2**40)):
        def forge(h, key=key, value=value):
            cfg = json.loads(h["__metadata__"]["config"])
            cfg["meta"][key] = value
            h["__metadata__"]["config"] = json.dumps(cfg)
        with pytest.raises(StateError):
            nkv.RotatingCache.load_state(edit_header(rdata, forge), device="cpu")


_WEIRD = [None, True, -1, 2**64, 2**4000, 1e308, -0.0, "x", "", [], [1, 2], {}, {"a": 1},
          [[[]]], "9" * 50]


def test_every_config_field_of_the_wrong_type_is_a_state_error(saved):
    """Each config field (and each fingerprint field) replaced by values of every JSON type:
    always a StateError or a load that still fits; never another exception."""
    _, whole, one = saved
    for data, seq in ((whole, None), (one, 0)):
        cfg = json.loads(split(data)[0]["__metadata__"]["config"])
        paths = [(k,) for k in cfg] + [("fingerprint", k) for k in cfg["fingerprint"]] + \
            [("fingerprint", "shift", "type")]
        for path in paths:
            for weird in _WEIRD:
                def change(h, path=path, weird=weird):
                    c = json.loads(h["__metadata__"]["config"])
                    node = c
                    for key in path[:-1]:
                        node = node[key]
                    node[path[-1]] = weird
                    h["__metadata__"]["config"] = json.dumps(c)
                dst = make("cpu")
                snap = snapshot(dst)
                try:
                    dst.load_state_bytes(edit_header(data, change), seq)
                except StateError:
                    assert_unchanged(dst, snap)


def test_hostile_tensor_entries_are_state_errors(saved):
    _, whole, _ = saved
    cases = [
        lambda h: h["k.0"].update(shape=[2**70, 2]),
        lambda h: h["k.0"].update(shape=[-1]),
        lambda h: h["k.0"].update(data_offsets=[0, 2**80]),
        lambda h: h["k.0"].update(dtype=["F16"]),
        lambda h: h["k.0"].update(shape="abc"),
        lambda h: h.update({"__metadata__": {"format": 1}}),
        lambda h: h["__metadata__"].update(kind=["causal"]),
        lambda h: h["__metadata__"].update(version="1" * 10_000),
        lambda h: h.update({"x" * 100_000: 1}),
    ]
    for change in cases:
        dst = make("cpu")
        snap = snapshot(dst)
        with pytest.raises(StateError):
            dst.load_state_bytes(edit_header(whole, change))
        assert_unchanged(dst, snap)


def test_random_header_garbage_is_always_a_state_error(saved):
    """Random edits of the JSON header text (checksum not even reached): never anything but a
    StateError."""
    _, whole, one = saved
    rng = np.random.default_rng(23)
    for data, seq in ((whole, None), (one, 0)):
        n = int.from_bytes(data[:8], "little")
        text = bytearray(data[8:8 + n])
        alphabet = b'{}[]":,0123456789e-+.tfnul\\ax'
        dst = make("cpu")
        snap = snapshot(dst)
        for _ in range(300):
            t = bytearray(text)
            for _ in range(int(rng.integers(1, 6))):
                t[int(rng.integers(0, len(t)))] = alphabet[int(rng.integers(0, len(alphabet)))]
            try:
                dst.load_state_bytes(_raw(bytes(t), data[8 + n:]), seq)
            except StateError:
                continue
            dst = make("cpu")   # a harmless edit (e.g. whitespace) loaded: start afresh
            snap = snapshot(dst)
        assert_unchanged(dst, snap)


# ============================================================================ OS errors
def test_os_errors_are_state_errors_naming_the_path(saved, tmp_path):
    src, whole, _ = saved
    dst = make("cpu")
    cases = [(tmp_path / "missing.st", FileNotFoundError), (tmp_path, IsADirectoryError)]
    (tmp_path / "file").write_bytes(b"x")
    cases.append((tmp_path / "file" / "below.st", NotADirectoryError))
    for path, cause in cases:
        with pytest.raises(StateError, match=str(path).replace("/", ".")) as info:
            dst.load_state(path)
        assert isinstance(info.value.__cause__, cause)
        with pytest.raises(StateError) as info:
            state.read_info(path)
        assert isinstance(info.value.__cause__, OSError)
    for path in (tmp_path / "nodir" / "x.st", tmp_path / "file" / "x.st", tmp_path):
        with pytest.raises(StateError, match="cannot write") as info:
            src.save_state(path)
        assert isinstance(info.value.__cause__, OSError)
        assert str(path) in str(info.value)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(StateError, match="regular file"):
        dst.load_state(fifo)


# ============================================================================ fingerprint
def _fingerprint_pair(device="cpu"):
    """(saving kwargs, loading kwargs, the field the error must name, loads with strict=False)"""
    rope = nkv.RopeShift()
    return [
        (dict(shift=rope), dict(shift=nkv.RopeShift(base=500000.0)), "shift.base", True),
        (dict(shift=rope), dict(shift=nkv.RopeShift(freq_scale=0.25)), "shift.freq_scale", True),
        (dict(shift=rope), dict(shift=nkv.RopeShift(dim=4)), "shift.dim", True),
        (dict(shift=rope), dict(shift=nkv.RopeShift(neox=False)), "shift.neox", True),
        (dict(shift=rope), dict(shift=nkv.RopeShift(freq_factors=[1, 2, 4, 8])),
         "shift.freq_factors", True),
        (dict(shift=None), dict(shift=rope), "shift.type", True),
        (dict(shift=rope), dict(shift=lambda layer, k, d: k), "shift.type", True),
        (dict(swa_window=4), dict(swa_window=5), "swa_window", True),
        (dict(swa_window=4), dict(), "swa_window", True),
        (dict(swa_window=4, swa_memory=6), dict(swa_window=4, swa_memory=7), "swa_memory",
         True),
        (dict(chunk_size=3), dict(chunk_size=4), "chunk_size", True),
        (dict(dtype="float16"), dict(dtype="bfloat16"), "dtype", False),
        (dict(n_kv_heads=2), dict(n_kv_heads=1), "n_kv_heads", False),
        (dict(head_dim=8), dict(head_dim=16), "head_dim", False),
        (dict(v_head_dim=4), dict(v_head_dim=8), "v_head_dim", False),
    ]


def _cache(capacity=16, **kw):
    cfg_kw = {k: kw.pop(k) for k in ("dtype", "n_kv_heads", "head_dim", "v_head_dim") if k in kw}
    cfg = nkv.CacheConfig(n_layers=2, **{"n_kv_heads": 2, "head_dim": 8, "v_head_dim": 4,
                                         **cfg_kw},
                          capacity=capacity, max_seqs=2, max_batch=8, device="cpu")
    return CausalCache(cfg, **kw)


@pytest.mark.parametrize("case", range(15))
def test_a_state_of_another_model_is_refused_naming_the_field(case, tmp_path):
    save_kw, load_kw, field, loose_ok = _fingerprint_pair()[case]
    rng = np.random.default_rng(case)
    src = _cache(**save_kw)
    fill(src, 0, range(3), rng)
    dst = _cache(**load_kw)
    fill(dst, 1, range(2), rng)
    for data, seq in ((src.state_bytes(0), 0), (src.state_bytes(), None)):
        if seq is None and src.n_cells != dst.n_cells:
            continue
        snap = snapshot(dst)
        with pytest.raises(StateError, match=f"fingerprint differs: {field.replace('.', '.')} "):
            dst.load_state_bytes(data, seq)
        assert_unchanged(dst, snap)
        path = tmp_path / "s.st"
        path.write_bytes(data)
        with pytest.raises(StateError, match=field):
            dst.load_state(path, seq)
        if loose_ok:
            dst.load_state_bytes(data, seq, strict=False)
            dst.load_state(path, seq, strict=False)
        else:
            with pytest.raises(StateError, match=field.split(".")[-1]):
                dst.load_state_bytes(data, seq, strict=False)
    same = _cache(**save_kw)
    same.load_state_bytes(src.state_bytes(0), 0)          # the same setup loads strictly


def test_strict_must_be_a_bool(saved):
    _, whole, _ = saved
    for bad in ("False", 0, None):
        with pytest.raises(ValueError, match="strict"):
            make("cpu").load_state_bytes(whole, strict=bad)


def test_a_state_without_a_fingerprint_needs_strict_false(saved):
    src, whole, _ = saved

    def drop(h):
        cfg = json.loads(h["__metadata__"]["config"])
        del cfg["fingerprint"]
        h["__metadata__"]["config"] = json.dumps(cfg)
    old = edit_header(whole, drop)
    dst = make("cpu")
    with pytest.raises(StateError, match="no model fingerprint.*strict=False"):
        dst.load_state_bytes(old)
    dst.load_state_bytes(old, strict=False)
    assert _kv_of_used(dst) == _kv_of_used(src)


def test_wrapper_groups_are_fingerprinted_one_by_one():
    rng = np.random.default_rng(24)

    def wrapper(window):
        return nkv.WrapperCache([_cache(swa_window=window, shift=nkv.RopeShift()),
                                 _cache(shift=nkv.RopeShift())])
    w = wrapper(4)
    fill(w.caches[0], 0, range(3), rng)
    fill(w.caches[1], 0, range(3), rng)
    data = w.state_bytes(0)
    with pytest.raises(StateError, match=r"differs \(group 0\): swa_window"):
        wrapper(5).load_state_bytes(data, 0)
    wrapper(5).load_state_bytes(data, 0, strict=False)
    wrapper(4).load_state_bytes(data, 0)


def test_fingerprint_is_a_dict_of_named_fields_that_new_config_fields_join():
    """Quantized storage adds CacheConfig fields (k_dtype, v_dtype, k_scale, v_scale): a config
    that has them puts them in the fingerprint without any other change."""
    c = _cache(shift=nkv.RopeShift(dim=4), swa_window=3, chunk_size=None)
    fp = state.fingerprint(c)
    assert fp["shift"] == {"type": "rope", "base": 10000.0, "freq_scale": 1.0, "dim": 4,
                           "neox": True, "freq_factors": None}
    assert (fp["swa_window"], fp["chunk_size"], fp["dtype"], fp["head_dim"]) == (3, None,
                                                                                  "float16", 8)
    assert (fp["k_dtype"], fp["v_dtype"], fp["k_scale"], fp["v_scale"]) == \
        ("float16", "float16", 1.0, 1.0)
    quant = types.SimpleNamespace(**{**c.config.to_dict(), "k_dtype": "q8_0", "v_dtype": "q4_0",
                                     "k_scale": 1.0, "v_scale": 0.5})
    fake = types.SimpleNamespace(config=quant, shift=c.shift, swa_window=3,
                                 swa_memory=c.swa_memory, chunk_size=None)
    fq = state.fingerprint(fake)
    assert {k: fq[k] for k in ("k_dtype", "v_dtype", "k_scale", "v_scale")} == \
        {"k_dtype": "q8_0", "v_dtype": "q4_0", "k_scale": 1.0, "v_scale": 0.5}
    assert state._fingerprint_diff(fp, fq)[0] == "k_dtype"
