"""Saving and restoring cache state (``numbakv.state``).

Round trips compare the restored cache with the saved one cell by cell and row by row; the
corruption tests damage a state in every way we could think of and require ``StateError`` with
the cache left exactly as it was (cell table, K and V storage, forward pass).

The format helpers at the top (``split``, ``restamp``, ``edit_header``, ``edit_tensor``) are an
independent reading of the file format (8-byte length, JSON header, data; ``crc32`` over the
canonical header without the checksum, then the data), so a test can craft a file that is valid
in every respect but the one under test.
"""

from __future__ import annotations

import json
import os
import tracemalloc
import zlib

import numpy as np
import pytest

import numbakv as nkv
from numbakv import StateError, state
from numbakv.causal import CausalCache
from numbakv.simple import RotatingCache, StepCache
from numbakv.wrappers import WrapperCache

from helpers import dev, host, host_kv, random_storage, same, seq_rows

L, H, D, DV = 2, 2, 8, 4
DTYPES = ["float16", "float32", "bfloat16"]


# ============================================================================ helpers
def make(device, *, dtype="float16", permuted_v=False, capacity=8, max_seqs=3, shift=None,
         **kw) -> CausalCache:
    cfg = nkv.CacheConfig(n_layers=L, n_kv_heads=H, head_dim=D, v_head_dim=DV, dtype=dtype,
                          capacity=capacity, max_seqs=max_seqs, max_batch=16, device=device,
                          permuted_v=permuted_v, **kw)
    return CausalCache(cfg, shift=shift)


def fill(cache, seq, positions, rng) -> None:
    positions = np.asarray(positions)
    n = len(positions)
    cache.start_forward(positions, np.full(n, seq))
    cfg = cache.config
    for layer in range(cfg.n_layers):
        cache.set_layer(layer)
        cache.put(dev(random_storage(rng, (n, cfg.n_kv_heads, cfg.head_dim), cfg.dtype),
                      cache.device),
                  dev(random_storage(rng, (n, cfg.n_kv_heads, cfg.v_head_dim), cfg.dtype),
                      cache.device))


def snapshot(cache):
    k = np.array(host(cache.storage.keys))
    v = np.array(host(cache.storage.values))
    return (cache.cells.cells.copy(), k, v, cache._forward, cache.n_used)


def assert_unchanged(cache, snap):
    cells, k, v, forward, used = snap
    assert cache.cells.cells.tobytes() == cells.tobytes(), "cell table changed"
    assert same(host(cache.storage.keys), k), "K changed"
    assert same(host(cache.storage.values), v), "V changed"
    assert cache._forward is forward, "the forward pass changed"
    assert cache.n_used == used
    cache.cells.check_consistency()


def populated(device, rng, **kw) -> CausalCache:
    """Three sequences, a shared prefix, holes: a cell layout worth restoring exactly."""
    c = make(device, **kw)
    fill(c, 0, range(0, 5), rng)
    fill(c, 1, range(0, 3), rng)
    fill(c, 0, range(5, 7), rng)
    c.seq_cp(0, 2, 0, 3)          # seq 2 shares seq 0's first 3 cells
    fill(c, 2, range(3, 6), rng)
    c.seq_rm(1, 1, 2)             # a hole inside seq 1
    return c


# --- the file format, read independently -----------------------------------------------------
def split(data: bytes):
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header: dict, body: bytes, *, stamp: bool = True) -> bytes:
    if stamp and "__metadata__" in header:
        meta = dict(header["__metadata__"])
        meta.pop("checksum", None)
        canon = dict(header, __metadata__=meta)
        crc = zlib.crc32(json.dumps(canon, sort_keys=True, separators=(",", ":"),
                                    ensure_ascii=True).encode())
        crc = zlib.crc32(body, crc)
        header = dict(header, __metadata__=dict(meta, checksum=f"crc32:{crc:08x}"))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + body


def restamp(data: bytes) -> bytes:
    return join(*split(data))


def edit_header(data: bytes, fn, stamp: bool = True) -> bytes:
    header, body = split(data)
    fn(header)
    return join(header, body, stamp=stamp)


def edit_meta(data: bytes, **changes) -> bytes:
    return edit_header(data, lambda h: h["__metadata__"].update(changes))


def edit_config(data: bytes, **changes) -> bytes:
    def fn(h):
        cfg = json.loads(h["__metadata__"]["config"])
        cfg.update(changes)
        h["__metadata__"]["config"] = json.dumps(cfg)
    return edit_header(data, fn)


def tensor_of(data: bytes, name: str) -> np.ndarray:
    header, body = split(data)
    info = header[name]
    dt = {"I32": "<i4", "U64": "<u8", "I64": "<i8", "F16": "<f2", "F32": "<f4",
          "BF16": "<u2"}[info["dtype"]]
    b, e = info["data_offsets"]
    return np.frombuffer(body[b:e], dtype=dt).reshape(info["shape"]).copy()


def edit_tensor(data: bytes, name: str, fn) -> bytes:
    """Change a tensor's values in place (same dtype and size), checksum recomputed."""
    header, body = split(data)
    arr = tensor_of(data, name)
    arr = np.ascontiguousarray(fn(arr), dtype=arr.dtype)
    b, e = header[name]["data_offsets"]
    assert arr.nbytes == e - b
    return join(header, body[:b] + arr.tobytes() + body[e:])


def rebuild(data: bytes, drop=(), add=None) -> bytes:
    """Re-lay the tensors (dropping some, adding others), checksum recomputed."""
    header, body = split(data)
    tensors = {}
    for name, info in header.items():
        if name != "__metadata__" and name not in drop:
            b, e = info["data_offsets"]
            tensors[name] = (info["dtype"], info["shape"], body[b:e])
    for name, (dtype, shape, raw) in (add or {}).items():
        tensors[name] = (dtype, shape, raw)
    new = {"__metadata__": header["__metadata__"]}
    out, at = b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        new[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        out += raw
        at += len(raw)
    return join(new, out)


# ============================================================================ round trips
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("src_perm, dst_perm", [(False, False), (True, True), (True, False),
                                                (False, True)])
def test_whole_cache_round_trip(device, dtype, src_perm, dst_perm):
    if device == "sim" and not ((src_perm, dst_perm) == (True, False)
                                or ((src_perm, dst_perm) == (False, True) and dtype == "float16")):
        pytest.skip("slow in the simulator: each dtype and each layout change once")
    rng = np.random.default_rng(1)
    src = populated(device, rng, dtype=dtype, permuted_v=src_perm)
    data = src.state_bytes()
    dst = make(device, dtype=dtype, permuted_v=dst_perm)
    fill(dst, 1, range(10), rng)  # replaced entirely
    info = dst.load_state_bytes(data)
    assert info == {"tokens": None, "metadata": {}}
    assert dst.cells.cells.tobytes() == src.cells.cells.tobytes()
    dst.cells.check_consistency()
    for a, b in zip(host_kv(src), host_kv(dst)):
        assert same(a, b)
    assert dst._forward is None
    for s in range(3):
        assert dst.seq_pos_min(s) == src.seq_pos_min(s)
        assert dst.seq_pos_max(s) == src.seq_pos_max(s)
    # the restored cache carries on exactly like the original
    for cache in (src, dst):
        cache.start_forward([7], [0])
    assert (src._forward.lo, src._forward.hi, src._forward.start) == \
        (dst._forward.lo, dst._forward.hi, dst._forward.start)
    assert np.array_equal(host(src._forward_mask()), host(dst._forward_mask()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("src_perm, dst_perm", [(False, False), (True, False), (False, True)])
def test_sequence_round_trip_into_a_busy_cache(device, dtype, src_perm, dst_perm):
    if device == "sim" and (src_perm, dst_perm, dtype) not in ((True, False, "float16"),
                                                                (False, True, "bfloat16")):
        pytest.skip("slow in the simulator: two combinations")
    rng = np.random.default_rng(2)
    src = populated(device, rng, dtype=dtype, permuted_v=src_perm)
    want = seq_rows(src, 2)            # shares cells with seq 0
    data = src.state_bytes(2, tokens=[11, 12, 13, 14, 15, 16], metadata={"user": "ana"})
    # other capacity, other max_seqs, other sequences present, the target seq holds tokens
    dst = make(device, dtype=dtype, permuted_v=dst_perm, capacity=12, max_seqs=4)
    fill(dst, 0, range(4), rng)
    fill(dst, 3, range(5), rng)
    fill(dst, 0, range(4, 6), rng)
    dst.seq_cp(3, 1, 0, 2)             # seq 1 shares two cells with seq 3
    keep = {s: seq_rows(dst, s) for s in (0, 3)}
    info = dst.load_state_bytes(data, 1)
    assert info == {"tokens": [11, 12, 13, 14, 15, 16], "metadata": {"user": "ana"}}
    got = seq_rows(dst, 1)
    assert np.array_equal(got[0], want[0])
    assert same(got[1], want[1])
    assert same(got[2], want[2])
    for s, rows in keep.items():       # the other sequences kept their cells and data
        for a, b in zip(rows, seq_rows(dst, s)):
            assert same(a, b)
    dst.cells.check_consistency()
    assert dst._forward is None
    assert dst.n_used == 4 + 5 + 2 + len(want[0])
    dst.start_forward([6], [1])        # and it continues from there
    assert dst.seq_pos_max(1) == 6


def test_sequence_reload_replaces_itself_and_empty_sequence(device):
    rng = np.random.default_rng(3)
    c = make(device, capacity=6, max_seqs=2)
    fill(c, 0, range(6), rng)
    fill(c, 1, range(6), rng)          # the cache is full
    data = c.state_bytes(0)
    want = seq_rows(c, 0)
    c.seq_rm(0, 4, None)
    fill(c, 0, range(4, 6), rng)       # different data at positions 4, 5
    c.load_state_bytes(data, 0)        # only seq 0's own cells are free for it: reused
    got = seq_rows(c, 0)
    for a, b in zip(want, got):
        assert same(a, b)
    c.cells.check_consistency()
    empty = make(device, capacity=6, max_seqs=2).state_bytes(1)
    c.load_state_bytes(empty, 0)       # an empty sequence clears the target
    assert c.seq_pos_max(0) == -1 and c.seq_pos_max(1) == 5
    assert c.n_used == 6


def test_file_round_trip_is_the_bytes_and_a_safetensors_file(tmp_path):
    from safetensors import safe_open
    rng = np.random.default_rng(4)
    c = populated("cpu", rng)
    path = tmp_path / "conv.safetensors"
    c.save_state(path, 0, tokens=np.arange(7), metadata={"model": "m", "note": "é"})
    data = c.state_bytes(0, tokens=np.arange(7), metadata={"model": "m", "note": "é"})
    assert path.read_bytes() == data
    assert os.listdir(tmp_path) == ["conv.safetensors"]  # no temporary file left
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
        assert meta["format"] == "numbakv.state" and meta["version"] == "1"
        assert meta["kind"] == "causal-seq" and meta["meta.note"] == "é"
        pos = f.get_tensor("positions")
        k0 = f.get_tensor("k.0")
    want = seq_rows(c, 0)
    assert np.array_equal(pos, want[0])
    assert np.array_equal(k0, want[1][0])
    dst = make("cpu")
    assert dst.load_state(str(path), 2) == {"tokens": list(range(7)),
                                            "metadata": {"model": "m", "note": "é"}}
    for a, b in zip(want, seq_rows(dst, 2)):
        assert np.array_equal(a, b)
    info = state.read_info(path)
    assert info["kind"] == "causal-seq" and info["tokens"] == list(range(7))
    assert info["config"]["head_dim"] == D


def test_checksum_is_zlibs_crc32_with_or_without_isal():
    """The codec's crc32 (ISA-L's when python-isal is installed) is zlib's CRC-32: a state
    written with either reads with the other, and the bytes are the same."""
    from numbakv.state import codec
    rng = np.random.default_rng(5)
    for n in (0, 1, 63, 64, 1000, 65537):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        for seed in (0, 1, 0xFFFFFFFF, 0x1234ABCD):
            assert codec.crc32(data, seed) == zlib.crc32(data, seed)
    c = populated("cpu", rng)
    data = c.state_bytes(0, tokens=np.arange(7))
    assert restamp(data) == data          # the stamp computed by zlib here is the same one


def test_whole_file_round_trip_and_overwrite(tmp_path, device):
    rng = np.random.default_rng(5)
    c = populated(device, rng, permuted_v=True)
    path = tmp_path / "cache.st"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    c.save_state(path)
    assert os.stat(path).st_mode & 0o777 == 0o640
    dst = make(device)
    dst.load_state(path)
    assert dst.cells.cells.tobytes() == c.cells.cells.tobytes()
    for a, b in zip(host_kv(c), host_kv(dst)):
        assert np.array_equal(a, b)


def test_save_is_atomic(tmp_path, monkeypatch):
    rng = np.random.default_rng(6)
    c = populated("cpu", rng)
    path = tmp_path / "s.st"
    c.save_state(path)
    before = path.read_bytes()
    fill(c, 1, range(3, 5), rng)
    calls = []
    real = state._host_le

    def failing(arr, dtype):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return real(arr, dtype)

    monkeypatch.setattr(state.files, "_host_le", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        c.save_state(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["s.st"]
    monkeypatch.undo()
    # bad arguments fail before a file is created
    for kwargs in (dict(metadata={"a": 1}), dict(metadata={1: "a"}), dict(metadata="a=b"),
                   dict(tokens=[1.5, 2.0]), dict(tokens=[[1, 2]]), dict(tokens=[True])):
        with pytest.raises(ValueError):
            c.save_state(tmp_path / "new.st", **kwargs)
    with pytest.raises(ValueError, match="seq"):
        c.save_state(tmp_path / "new.st", 3)
    with pytest.raises(ValueError, match="path"):
        state.save_cache(c, b"bytes path")
    assert os.listdir(tmp_path) == ["s.st"]


@pytest.mark.parametrize("tokens", [None, [], [0, 5, 2**40, 151_000], np.arange(3, dtype=np.int32)])
def test_tokens_and_metadata_travel(tokens):
    rng = np.random.default_rng(7)
    c = populated("cpu", rng)
    meta = {"": "", "k": "v" * 1000, "json": '{"a": [1, "\\u0000"]}'}
    data = c.state_bytes(1, tokens=tokens, metadata=meta)
    got = make("cpu").load_state_bytes(data, 1)
    assert got["tokens"] == (None if tokens is None else [int(t) for t in tokens])
    assert got["metadata"] == meta


def test_pending_shifts_are_applied_before_saving(device):
    rng = np.random.default_rng(8)
    c = make(device, shift=nkv.RopeShift())
    fill(c, 0, range(6), rng)
    c.seq_add(0, 2, None, 3)           # keys of positions 2.. wait for a rotation
    assert c.cells.has_pending_shifts()
    data = c.state_bytes(0)
    assert not c.cells.has_pending_shifts()
    want = seq_rows(c, 0)              # rotated keys, shifted positions
    assert list(want[0]) == [0, 1, 5, 6, 7, 8]
    dst = make(device, shift=nkv.RopeShift())
    dst.load_state_bytes(data, 0)
    for a, b in zip(want, seq_rows(dst, 0)):
        assert np.array_equal(a, b)


def test_save_and_load_hold_no_second_copy(tmp_path):
    """Saves write straight from the storage: the Python heap never holds more than a layer.
    Loads read the file into memory once (a mapping another process could truncate or rewrite
    under the load is never used) and copy from there: the file plus at most a layer."""
    cfg = nkv.CacheConfig(n_layers=8, n_kv_heads=4, head_dim=64, dtype="float32", capacity=1024,
                          device="cpu", permuted_v=True)
    c = CausalCache(cfg)
    c.start_forward(np.arange(512), np.zeros(512, int))
    total = c.storage.nbytes
    layer = total // cfg.n_layers
    path = tmp_path / "big.st"
    tracemalloc.start()
    try:
        state.save_cache(c, path, progress=False)
        _, peak_save = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        state.load_cache(c, path, progress=False)
        _, peak_load = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert os.path.getsize(path) > total
    assert peak_save < 1.5 * layer, (peak_save, layer)
    assert peak_load < os.path.getsize(path) + 1.5 * layer, (peak_load, layer)


def test_progress_bar(tmp_path, capsys, monkeypatch):
    rng = np.random.default_rng(9)
    c = populated("cpu", rng)
    state.save_cache(c, tmp_path / "a.st", progress=True)
    assert "saving state" in capsys.readouterr().err
    state.load_cache(make("cpu"), tmp_path / "a.st", progress=True)
    assert "loading state" in capsys.readouterr().err
    c.save_state(tmp_path / "b.st")    # small: no bar
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(state.codec, "PROGRESS_THRESHOLD", 0)
    state.save_cache(c, tmp_path / "c.st", progress=False)
    assert capsys.readouterr().err == ""
    c.save_state(tmp_path / "d.st")    # above the threshold, but stderr is not a terminal
    assert capsys.readouterr().err == ""


# ============================================================================ corruption
@pytest.fixture(scope="module")
def states():
    """A source cache's whole and one-sequence states (float16, cpu)."""
    rng = np.random.default_rng(10)
    c = populated("cpu", rng)
    return {"whole": c.state_bytes(), "seq": c.state_bytes(0, tokens=[1, 2, 3],
                                                             metadata={"a": "b"})}


@pytest.fixture
def target():
    rng = np.random.default_rng(11)
    c = make("cpu")
    fill(c, 0, range(3), rng)
    fill(c, 2, range(4), rng)
    c.start_forward([3], [0])
    return c


def refused(cache, data, seq=None, match=None):
    snap = snapshot(cache)
    with pytest.raises(StateError, match=match):
        cache.load_state_bytes(data, seq)
    assert_unchanged(cache, snap)


def test_valid_states_load(states, target):
    """The baseline the corruption tests damage does load."""
    target.load_state_bytes(states["seq"], 1)
    target.load_state_bytes(states["whole"])


@pytest.mark.parametrize("which, seq", [("seq", 1), ("whole", None)])
def test_truncated_anywhere(states, target, which, seq):
    data = states[which]
    cuts = sorted(set(range(0, len(data), 7)) | {1, 7, 8, 9, len(data) - 1})
    snap = snapshot(target)
    for cut in cuts:
        with pytest.raises(StateError):
            target.load_state_bytes(data[:cut], seq)
    assert_unchanged(target, snap)


@pytest.mark.parametrize("which, seq", [("seq", 1), ("whole", None)])
def test_flipped_bytes_anywhere(states, target, which, seq):
    data = states[which]
    snap = snapshot(target)
    n_header = 8 + int.from_bytes(data[:8], "little")
    # every byte of the length and header, and every 5th byte of the data
    offsets = list(range(n_header)) + list(range(n_header, len(data), 5)) + [len(data) - 1]
    for i, at in enumerate(offsets):
        bad = bytearray(data)
        bad[at] ^= (0xFF, 0x01, 0x20, 0x80)[i % 4]
        with pytest.raises(StateError):
            target.load_state_bytes(bytes(bad), seq)
    assert_unchanged(target, snap)


def test_garbage_and_envelope(states, target):
    data = states["seq"]
    header, body = split(data)
    raw_header = data[8:8 + int.from_bytes(data[:8], "little")]
    cases = {
        "empty": b"",
        "length past the end": (10**6).to_bytes(8, "little") + data[8:],
        "zero length": (0).to_bytes(8, "little") + data[8:],
        "huge length": (2**63).to_bytes(8, "little") + data[8:],
        "not json": len(b"{nope").to_bytes(8, "little") + b"{nope",
        "json list": len(b"[1]").to_bytes(8, "little") + b"[1]",
        "not utf-8": len(b'{"\xff":1}').to_bytes(8, "little") + b'{"\xff":1}',
        "trailing bytes": data + b"\0\0\0\0",
        "duplicate key": _with_duplicate(raw_header, header["positions"]) + body,
        "pickle": b"\x80\x04\x95" + bytes(100),
    }
    for name, bad in cases.items():
        with pytest.raises(StateError):
            target.load_state_bytes(bad, 1)
    snap = snapshot(target)
    for match, bad in [
        ("version", edit_meta(data, version="2")),
        ("not a numbakv state", edit_meta(data, format="other")),
        ("kind", edit_meta(data, kind="mystery")),
        ("checksum", edit_header(data, lambda h: h["__metadata__"].update(checksum="md5:0"),
                                 stamp=False)),
        ("checksum", edit_header(data, lambda h: h["__metadata__"].pop("checksum"),
                                 stamp=False)),
        ("checksum mismatch", edit_header(data, lambda h: h["__metadata__"].update(x="y"),
                                          stamp=False)),
        ("checksum mismatch", join(header, body, stamp=False)[:-1] + b"\x55"),
        ("config", edit_meta(data, config="{")),
        ("config", edit_meta(data, config="[1]")),
        ("metadata", edit_header(data, lambda h: h["__metadata__"].update(x=1))),
    ]:
        refused(target, bad, 1, match)
    assert_unchanged(target, snap)
    no_meta = edit_header(data, lambda h: h.pop("__metadata__"))
    refused(target, no_meta, 1, "not a numbakv state")


def _with_duplicate(raw_header: bytes, entry: dict) -> bytes:
    dup = b'{"positions":' + json.dumps(entry).encode() + b"," + raw_header[1:]
    return len(dup).to_bytes(8, "little") + dup


def test_kind_mismatch(states, target):
    refused(target, states["whole"], 1, "whole cache")
    refused(target, states["seq"], None, "one sequence")


@pytest.mark.parametrize("field, value", [("n_layers", 3), ("n_kv_heads", 1), ("head_dim", 16),
                                          ("v_head_dim", 8), ("dtype", "float32"),
                                          ("n_layers", "2"), ("head_dim", None)])
def test_config_mismatch_in_the_file(states, target, field, value):
    for which, seq in (("seq", 1), ("whole", None)):
        refused(target, edit_config(states[which], **{field: value}), seq, field)


@pytest.mark.parametrize("change", [dict(head_dim=4), dict(v_head_dim=8), dict(n_layers=3),
                                    dict(n_kv_heads=1), dict(dtype="float32"),
                                    dict(dtype="bfloat16")])
def test_real_caches_that_do_not_fit(change):
    rng = np.random.default_rng(12)
    src = populated("cpu", rng)
    base = dict(n_layers=L, n_kv_heads=H, head_dim=D, v_head_dim=DV, dtype="float16",
                capacity=8, max_seqs=3, device="cpu")
    base.update(change)
    dst = CausalCache(nkv.CacheConfig(**base))
    fill(dst, 0, range(2), rng)
    key = next(iter(change))
    refused(dst, src.state_bytes(0), 0, key)
    refused(dst, src.state_bytes(), None, key)


def test_whole_cache_needs_the_same_cell_count(states):
    for kw in (dict(capacity=9), dict(max_seqs=2)):
        c = make("cpu", **kw)
        refused(c, states["whole"], None, "n_cells")
    c = make("cpu", cache_padding=5)   # 25 cells
    refused(c, states["whole"], None, "n_cells")


def test_tensor_shape_dtype_and_names(states, target):
    seq, whole = states["seq"], states["whole"]
    cases = [
        (seq, 1, "dtype", lambda h: h["k.0"].update(dtype="BF16")),
        (seq, 1, "dtype", lambda h: h["positions"].update(dtype="U32")),
        (seq, 1, "shape", lambda h: h["v.1"].update(shape=[H, DV, h["v.1"]["shape"][0]])),
        (seq, 1, "shape", lambda h: h["k.1"].update(shape=[h["k.1"]["shape"][0], D, H])),
        (seq, 1, "needs", lambda h: h["k.1"].update(shape=[10**12, H, D])),
        (seq, 1, "unknown dtype", lambda h: h["k.0"].update(dtype="F8")),
        (seq, 1, "shape", lambda h: h["k.0"].update(shape=[-1, H, D])),
        (seq, 1, "data_offsets", lambda h: h["k.0"].update(data_offsets=[5])),
        (seq, 1, "exactly", lambda h: h["k.0"].update(extra=1)),
        (seq, 1, "starts at|truncated", lambda h: h["k.0"].update(
            data_offsets=[o + 2 for o in h["k.0"]["data_offsets"]])),
        (seq, 1, "starts at", lambda h: h["v.1"].update(
            data_offsets=list(h["v.0"]["data_offsets"]))),
        (whole, None, "dtype", lambda h: h["cells.seqs"].update(dtype="I64")),
        (whole, None, "shape", lambda h: h["cells.seqs"].update(
            shape=[h["cells.seqs"]["shape"][0] * 2, 2])),
        (whole, None, "tokens", lambda h: h.update(tokens={"dtype": "I32", "shape": [0],
                                                            "data_offsets": [0, 0]})),
    ]
    for data, s, match, fn in cases:
        refused(target, edit_header(data, fn), s, match)
    refused(target, rebuild(seq, drop=("v.1",)), 1, "missing")
    refused(target, rebuild(seq, add={"k.2": ("F16", [0, H, D], b"")}), 1, "unexpected")
    refused(target, rebuild(whole, drop=("cells.shift",)), None, "missing")
    # the tensors may come in any order (a third-party writer's), checksum permitting
    header, body = split(seq)
    names = [n for n in header if n != "__metadata__"][::-1]
    reordered = rebuild(rebuild(seq, drop=names), add={
        n: (header[n]["dtype"], header[n]["shape"],
            body[header[n]["data_offsets"][0]:header[n]["data_offsets"][1]]) for n in names})
    target.load_state_bytes(reordered, 1)


def test_positions_must_be_valid(states, target):
    seq = states["seq"]
    k = len(tensor_of(seq, "positions"))
    assert k >= 3
    for match, fn in [("outside", lambda p: np.where(np.arange(k) == 1, -1, p)),
                      ("outside", lambda p: np.where(np.arange(k) == k - 1, 2**31 - 1, p)),
                      ("ascending", lambda p: p[::-1]),
                      ("ascending", lambda p: np.where(np.arange(k) == 0, 100, p))]:
        refused(target, edit_tensor(seq, "positions", fn), 1, match)


def test_counts_bounded_by_the_target(target):
    rng = np.random.default_rng(13)
    big = make("cpu", capacity=40, max_seqs=1)
    fill(big, 0, range(16), rng)
    fill(big, 0, range(16, 30), rng)
    refused(target, big.state_bytes(0), 1, "24 cells")  # 30 > the target's 3 x 8 cells
    big.seq_rm(0, 12)
    data = big.state_bytes(0)
    roomy = make("cpu", capacity=12, max_seqs=2)      # 24 cells
    fill(roomy, 0, range(14), rng)
    fill(roomy, 1, range(3), rng)
    refused(roomy, data, 1, "free")                   # 12 > 7 free + 3 of seq 1
    roomy.load_state_bytes(data, 0)                   # seq 0's own 14 cells make room
    assert roomy.seq_pos_max(0) == 11
    # a count in the header larger than the data is a truncation, not a huge allocation
    huge = edit_header(data, lambda h: h["positions"].update(shape=[2**40]))
    refused(target, huge, 1, "needs")


def test_cell_table_must_fit(states, target):
    whole = states["whole"]
    pos = tensor_of(whole, "cells.pos")
    seqs = tensor_of(whole, "cells.seqs")
    used = int(np.flatnonzero(seqs.any(axis=1))[0])
    free = int(np.flatnonzero(~seqs.any(axis=1))[0])
    bad = [
        ("outside", "cells.pos", lambda p: np.where(np.arange(len(p)) == used, -7, p)),
        ("position", "cells.pos", lambda p: np.where(np.arange(len(p)) == used, -1, p)),
        ("position", "cells.pos", lambda p: np.where(np.arange(len(p)) == free, 4, p)),
        ("outside", "cells.pos", lambda p: np.where(np.arange(len(p)) == used, 2**31 - 1, p)),
        ("sequence 5", "cells.seqs", lambda s: _set_bit(s, used, 5)),
        ("sequence 200", "cells.seqs", lambda s: _set_bit(s, used, 200)),
        ("free cell", "cells.shift", lambda s: np.where(np.arange(len(s)) == free, 3, s)),
        ("shift function", "cells.shift", lambda s: np.where(np.arange(len(s)) == used, 3, s)),
    ]
    assert pos[used] >= 0
    for match, name, fn in bad:
        refused(target, edit_tensor(whole, name, fn), None, match)


def _set_bit(seqs, cell, s):
    seqs = seqs.copy()
    seqs[cell, s // 64] |= np.uint64(1) << np.uint64(s % 64)
    return seqs


def test_pending_shift_restores_with_a_shift_function(states):
    whole = states["whole"]
    seqs = tensor_of(whole, "cells.seqs")
    used = int(np.flatnonzero(seqs.any(axis=1))[0])
    data = edit_tensor(whole, "cells.shift", lambda s: np.where(np.arange(len(s)) == used, 3, s))
    c = make("cpu", shift=nkv.RopeShift())
    with pytest.raises(StateError, match="shift.type"):   # saved without a shift function
        c.load_state_bytes(data)
    c.load_state_bytes(data, strict=False)
    assert c.cells.has_pending_shifts()


def test_failed_write_rolls_back(monkeypatch):
    """A device error in the middle of a load that reuses the sequence's own cells puts the old
    data and table back."""
    rng = np.random.default_rng(14)
    c = make("cpu", capacity=6, max_seqs=2)
    fill(c, 0, range(6), rng)
    data = c.state_bytes(0)
    fill(c, 1, range(6), rng)
    c.seq_rm(0, 0, None)
    fill(c, 0, range(6), rng)          # full: the load must reuse seq 0's cells
    snap = snapshot(c)
    calls = []
    real = state._write_rows

    def failing(cache, layer, idx, k, v):
        calls.append(layer)
        if len(calls) == 2:
            raise RuntimeError("device error")
        return real(cache, layer, idx, k, v)

    monkeypatch.setattr(state.snapshot, "_write_rows", failing)
    with pytest.raises(RuntimeError, match="device error"):
        c.load_state_bytes(data, 0)
    assert_unchanged(c, snap)


def test_failed_whole_write_leaves_an_empty_consistent_cache(states, target, monkeypatch):
    """A whole-cache load overwrites all K/V: after a device error in the middle there is no
    old data to go back to, so the cache is emptied rather than left pairing cells with the
    wrong rows."""
    def failing(cache, layer, idx, k, v):
        raise RuntimeError("device error")

    monkeypatch.setattr(state.files, "_write_rows", failing)
    with pytest.raises(RuntimeError, match="device error"):
        target.load_state_bytes(states["whole"])
    assert target.n_used == 0 and target._forward is None
    target.cells.check_consistency()


def test_bad_arguments(states, target, tmp_path):
    for seq in (-1, 3, 1.0, True, "0"):
        with pytest.raises(ValueError, match="seq"):
            target.load_state_bytes(states["seq"], seq)
    with pytest.raises(ValueError, match="bytes-like"):
        target.load_state_bytes("not bytes", 1)
    with pytest.raises(StateError, match="missing.st") as info:
        target.load_state(tmp_path / "missing.st", 1)
    assert isinstance(info.value.__cause__, FileNotFoundError)
    (tmp_path / "empty.st").write_bytes(b"")
    (tmp_path / "half.st").write_bytes(states["seq"][:len(states["seq"]) // 2])
    refused(target, b"", 1, "truncated")
    snap = snapshot(target)
    for name in ("empty.st", "half.st"):   # the file path
        with pytest.raises(StateError, match="truncated"):
            target.load_state(tmp_path / name, 1)
    assert_unchanged(target, snap)
    closed = make("cpu")
    closed.close()
    with pytest.raises(nkv.KVCacheError, match="closed"):
        closed.state_bytes()
    with pytest.raises(nkv.KVCacheError, match="closed"):
        closed.load_state_bytes(states["whole"])


# ============================================================================ wrapper caches
def test_wrapper_cache_round_trip_and_mismatch():
    rng = np.random.default_rng(15)

    def wrapper():
        a, b = make("cpu", max_seqs=2), make("cpu", max_seqs=2, permuted_v=True)
        return WrapperCache([a, b])

    w = wrapper()
    for positions, seq in ((range(4), 0), (range(3), 1)):
        w.start_forward(np.asarray(positions), np.full(len(positions), seq))
        for cache in w.caches:
            for layer in range(L):
                cache.set_layer(layer)
                cache.put(random_storage(rng, (len(positions), H, D), "float16"),
                          random_storage(rng, (len(positions), H, DV), "float16"))
    whole = state.to_bytes(w, tokens=[1])
    one = state.to_bytes(w, 1)
    w2 = wrapper()
    _, info = state.load(whole, w2)
    assert info["tokens"] == [1]
    for a, b in zip(w.caches, w2.caches):
        assert a.cells.cells.tobytes() == b.cells.cells.tobytes()
        for x, y in zip(host_kv(a), host_kv(b)):
            assert np.array_equal(x, y)
    w3 = wrapper()
    state.load(one, w3, 0)
    for a, b in zip(w.caches, w3.caches):
        for x, y in zip(seq_rows(a, 1), seq_rows(b, 0)):
            assert np.array_equal(x, y)
    # a wrapper with one group fewer, or a plain cache: refused, nothing changed
    lone = WrapperCache([make("cpu", max_seqs=2)])
    snap = snapshot(lone.caches[0])
    with pytest.raises(StateError, match="groups"):
        state.load(whole, lone)
    assert_unchanged(lone.caches[0], snap)
    plain = make("cpu", max_seqs=2)
    refused(plain, whole, None, "kind")
    # the second group does not fit: the first is not touched either
    wide = CausalCache(nkv.CacheConfig(n_layers=L, n_kv_heads=H, head_dim=16, v_head_dim=DV,
                                       capacity=8, max_seqs=2, device="cpu"))
    w4 = WrapperCache([make("cpu", max_seqs=2), wide])
    snaps = [snapshot(c) for c in w4.caches]
    with pytest.raises(StateError, match="group 1"):
        state.load(one, w4, 0)
    for c, s in zip(w4.caches, snaps):
        assert_unchanged(c, s)


# ============================================================================ simple caches
def _stream(rng, n, dtype, dk=D, dv=DV):
    return (random_storage(rng, (1, H, n, dk), dtype), random_storage(rng, (1, H, n, dv), dtype))


def _same_simple(a, b):
    sa, sb = a.state(), b.state()
    assert type(a) is type(b)
    assert a.meta_state() == b.meta_state()
    assert len(a) == len(b)
    for x, y in zip(sa, sb):
        if x is None:
            assert y is None
        else:
            assert np.array_equal(host(x), host(y))


@pytest.mark.parametrize("dtype", DTYPES)
def test_step_and_rotating_round_trip(device, dtype, tmp_path):
    rng = np.random.default_rng(16)
    step = StepCache(4, device=device)
    step.update(*(dev(x, device) for x in _stream(rng, 6, dtype)))
    ring = RotatingCache(5, 2, device=device)
    ring.update(*(dev(x, device) for x in _stream(rng, 3, dtype)))
    for _ in range(4):                 # wrap the ring
        ring.update(*(dev(x, device) for x in _stream(rng, 1, dtype)))
    for cache in (step, ring, StepCache(device=device)):
        data = state.simple_to_bytes(cache, tokens=[3, 4], metadata={"m": "x"})
        back, info = state.load_simple(data, device=device, return_info=True)
        _same_simple(cache, back)
        assert info == {"tokens": [3, 4], "metadata": {"m": "x"}}
        # the restored cache carries on like the original
        if cache.offset:
            nxt = _stream(rng, 1, dtype)
            out_a = cache.update(*(dev(x, device) for x in nxt))
            out_b = back.update(*(dev(x, device) for x in nxt))
            assert np.array_equal(host(out_a[0]), host(out_b[0]))
    path = tmp_path / "layers.st"
    state.save(path=path, cache=[step, ring])
    caches, info = state.load(path, device=device)
    assert [type(c) for c in caches] == [StepCache, RotatingCache]
    _same_simple(step, caches[0])
    _same_simple(ring, caches[1])
    assert state.load_simple(path, device=device)[1].offset == ring.offset


def test_simple_corruption():
    rng = np.random.default_rng(17)
    ring = RotatingCache(4, device="cpu")
    ring.update(*_stream(rng, 6, "float16"))
    data = state.simple_to_bytes(ring, tokens=[1])
    state.load_simple(data, device="cpu")
    for cut in range(0, len(data), 11):
        with pytest.raises(StateError):
            state.load_simple(data[:cut], device="cpu")
    for at in range(0, len(data), 3):
        bad = bytearray(data)
        bad[at] ^= 0xFF
        with pytest.raises(StateError):
            state.load_simple(bytes(bad), device="cpu")

    def cfg_edit(fn):
        def inner(h):
            cfg = json.loads(h["__metadata__"]["config"])
            fn(cfg)
            h["__metadata__"]["config"] = json.dumps(cfg)
        return edit_header(data, inner)

    for match, bad in [
        ("offset", cfg_edit(lambda c: c.update(offset=2))),          # fewer than stored
        ("class", cfg_edit(lambda c: c.update({"class": "Other"}))),
        ("kind", cfg_edit(lambda c: c.update({"class": "StepCache"}))),
        ("inconsistent", cfg_edit(lambda c: c["meta"].update(idx=3))),
        ("inconsistent", cfg_edit(lambda c: c["meta"].update(idx=7))),
        ("dtype", cfg_edit(lambda c: c["meta"].update(dtype="float32"))),
        ("keys", rebuild(data, drop=("values",))),
        ("StepCache or RotatingCache", edit_meta(data, kind="causal")),
    ]:
        with pytest.raises(StateError, match=match):
            state.load_simple(bad, device="cpu")
    causal = make("cpu").state_bytes()
    with pytest.raises(StateError, match="StepCache"):
        state.load_simple(causal, device="cpu")
    with pytest.raises(ValueError, match="existing cache"):
        state.load(causal)
    with pytest.raises(ValueError, match="seq"):
        state.save(ring, "x.st", seq=0)
    with pytest.raises(ValueError, match="cache must be"):
        state.to_bytes(object())
