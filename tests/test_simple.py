"""StepCache / RotatingCache against plain references: the full concatenated history (sliced to
the window) and a list-based port of mlx-lm's RotatingKVCache (the seed's semantics with the
multi-token wrap bug fixed)."""

import numpy as np
import pytest

from numbakv._dlpack import BFloat16View
from numbakv.simple import RotatingCache, StepCache

from helpers import as_f32, dev, host, random_storage

DTYPES = ["float16", "float32", "bfloat16"]


def raw(view):
    """A host copy of the storage array behind a returned view (uint16 bits for bfloat16); on
    ``cuda`` the views are CuPy arrays."""
    return host(view)


def legacy(cache):
    """The round-2 state dict (``{"keys", "values", "offset", "meta"}``), which ``from_state``
    still reads, built from the seed's protocol: ``state()`` and ``meta_state()``."""
    keys, values = cache.state()
    meta = cache.meta_state()
    offset = meta.pop("offset")
    return {"keys": keys, "values": values, "offset": offset, "meta": meta}


def snapshot(cache):
    st = legacy(cache)
    keys = None if st["keys"] is None else raw(st["keys"]).copy()
    values = None if st["values"] is None else raw(st["values"]).copy()
    return keys, values, st["offset"], dict(st["meta"]), len(cache)


def same_snapshot(a, b):
    if (a[0] is None) != (b[0] is None):
        return False
    arrays = a[0] is None or (np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]))
    return arrays and a[2:] == b[2:]


class Stream:
    """Random K/V chunks with fixed batch / heads / head dims, and the full history (on the
    host). Chunks come on ``device`` (the cache takes inputs only on its own device)."""

    def __init__(self, rng, dtype, b=1, h=2, dk=4, dv=3, device="cpu"):
        self.rng, self.dtype, self.shape, self.device = rng, dtype, (b, h, dk, dv), device
        self.k = random_storage(rng, (b, h, 0, dk), dtype)
        self.v = random_storage(rng, (b, h, 0, dv), dtype)

    def chunk(self, n):
        b, h, dk, dv = self.shape
        return (dev(random_storage(self.rng, (b, h, n, dk), self.dtype), self.device),
                dev(random_storage(self.rng, (b, h, n, dv), self.dtype), self.device))

    def append(self, k, v):
        self.k = np.concatenate([self.k, host(k)], axis=2)
        self.v = np.concatenate([self.v, host(v)], axis=2)

    def trim(self, n):
        t = self.k.shape[2] - n
        self.k, self.v = self.k[:, :, :t], self.v[:, :, :t]

    @property
    def total(self):
        return self.k.shape[2]


def check_rotation(out, expected):
    """``out`` holds exactly the tokens of ``expected`` (temporal order) in ring order: some
    rotation of it along the token axis."""
    assert out.shape == expected.shape
    w = expected.shape[2]
    assert any(np.array_equal(out, np.roll(expected, r, axis=2)) for r in range(max(w, 1))), \
        "decode output is not a rotation of the window"


class MlxRotatingRef:
    """mlx-lm's RotatingKVCache (keep=0) over token ids, ported to lists; its trim is only used
    where mlx-lm allows it (offset < max_size)."""

    def __init__(self, max_size, step):
        self.M, self.step = max_size, step
        self.buf, self.offset, self.idx = None, 0, 0

    def _temporal(self):
        if self.idx == len(self.buf):
            return list(self.buf)
        if self.idx < self.offset:
            return self.buf[self.idx:] + self.buf[:self.idx]
        return self.buf[:self.idx]

    def update(self, ids):
        if len(ids) == 1:
            return self._in_place(ids[0])
        if self.buf is None:
            self.buf = list(ids)
        else:
            self.buf = self._temporal()
            self.idx = len(self.buf)
            cut = self.idx - self.M + 1
            if cut > 0:
                self.buf = self.buf[cut:]
            self.buf = self.buf + list(ids)
        self.offset += len(ids)
        self.idx = len(self.buf)
        return list(self.buf)

    def _in_place(self, tok):
        prev = self.offset
        if self.buf is None or (prev >= len(self.buf) and len(self.buf) < self.M):
            self.buf = (self.buf or []) + [None] * min(self.step, self.M - prev)
            self.idx = prev
        cut = len(self.buf) - self.M
        if cut > 0:
            self.buf = self.buf[cut:]
            self.idx = self.M
        if self.idx == self.M:
            self.idx = 0
        self.buf[self.idx] = tok
        self.offset += 1
        self.idx += 1
        return self.buf[:self.offset] if self.offset < self.M else list(self.buf)

    def trim(self, n):
        assert self.offset < self.M
        n = min(self.offset, n)
        self.offset -= n
        self.idx -= n


# ------------------------------------------------------------------------------ StepCache

@pytest.mark.parametrize("dtype", DTYPES)
def test_step_cache_random_updates_and_trims(device, dtype):
    rng = np.random.default_rng(hash(dtype) % 1000)
    for trial in range(6):
        step = int(rng.integers(1, 6))
        s = Stream(rng, dtype, b=int(rng.integers(1, 3)), dk=int(rng.integers(2, 5)),
                   device=device)
        c = StepCache(step, device=device)
        for _ in range(25):
            if s.total and rng.random() < 0.2:
                n = int(rng.integers(0, s.total + 4))  # past the offset too: the seed clamps
                assert c.trim(n) == min(n, s.total)
                s.trim(min(n, s.total))
            else:
                k, v = s.chunk(int(rng.integers(1, 8)))
                s.append(k, v)
                ko, vo = c.update(k, v)
                assert isinstance(ko, BFloat16View) == (dtype == "bfloat16")
                np.testing.assert_array_equal(raw(ko), s.k)
                np.testing.assert_array_equal(raw(vo), s.v)
            assert c.offset == len(c) == s.total == c.trimmable
            assert c.capacity % step == 0 and c.capacity >= c.offset
            st = legacy(c)
            if s.total:
                np.testing.assert_array_equal(raw(st["keys"]), s.k)
                np.testing.assert_array_equal(raw(st["values"]), s.v)
            assert st["offset"] == s.total and st["meta"]["dtype"] == dtype


def test_step_cache_grows_in_steps_like_the_seed(device):
    c = StepCache(4, device=device)
    k = dev(np.zeros((1, 1, 1, 2), np.float32), device)
    capacities = []
    for _ in range(9):
        c.update(k, k)
        capacities.append(c.capacity)
    assert capacities == [4, 4, 4, 4, 8, 8, 8, 8, 12]
    z = dev(np.zeros((1, 1, 6, 2), np.float32), device)
    c.update(z, z)
    assert c.offset == 15 and c.capacity == 16
    c.trim(14)
    o = dev(np.ones((1, 1, 3, 2), np.float32), device)
    c.update(o, o)
    assert c.capacity == 16  # trimmed space is reused


@pytest.mark.parametrize("dtype", DTYPES)
def test_step_cache_clone_state_round_trip(device, dtype):
    rng = np.random.default_rng(3)
    s = Stream(rng, dtype, device=device)
    c = StepCache(3, device=device)
    for n in (5, 1, 2):
        c.update(*s.chunk(n))
    c.trim(2)
    before = snapshot(c)
    twin = c.clone()
    restored = StepCache.from_state(legacy(c), device=device)
    assert same_snapshot(snapshot(twin), before) and same_snapshot(snapshot(restored), before)
    assert restored.step == 3 and restored.dtype == dtype
    # all three go on independently and identically
    k, v = s.chunk(4)
    outs = [raw(x.update(k, v)[0]).copy() for x in (c, twin, restored)]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    k2, v2 = s.chunk(1)
    c.update(k2, v2)
    assert twin.offset == restored.offset == c.offset - 1
    np.testing.assert_array_equal(raw(legacy(twin)["keys"]), outs[0])


def test_step_cache_free_and_empty_state(device):
    c = StepCache(device=device)
    st = legacy(c)
    assert st["keys"] is None and st["offset"] == 0 and st["meta"]["dtype"] is None
    assert StepCache.from_state(st, device=device).offset == 0
    o = dev(np.ones((1, 2, 3, 4), np.float16), device)
    c.update(o, o)
    c.free()
    assert c.offset == 0 and len(c) == 0 and c.capacity == 0 and c.dtype is None
    ko, _ = c.update(dev(np.ones((2, 1, 1, 8), np.float32), device),
                     dev(np.ones((2, 1, 1, 2), np.float32), device))
    assert ko.shape == (2, 1, 1, 8) and ko.dtype == np.float32


# ------------------------------------------------------------------------------ RotatingCache

def run_rotating(device, dtype, rng, M, step, n_ops, trim_prob, mlx=True):
    s = Stream(rng, dtype, b=int(rng.integers(1, 3)), dk=int(rng.integers(2, 4)),
               dv=int(rng.integers(1, 4)), device=device)
    c = RotatingCache(M, step, device=device)
    ref = MlxRotatingRef(M, step) if mlx else None
    for _ in range(n_ops):
        if s.total and rng.random() < trim_prob:
            n = int(rng.integers(0, s.total + 3))
            expect = min(n, c.trimmable)  # clamped: to the offset, and to the needed history
            assert expect <= min(n, s.total)
            assert c.trim(n) == expect
            n = expect
            s.trim(n)
            if ref is not None:
                if ref.offset < M:
                    ref.trim(n)
                else:
                    ref = None  # mlx-lm refuses trims once the ring may have wrapped
        else:
            L = 1 if rng.random() < 0.6 else int(rng.integers(2, 2 * M + 3))
            k, v = s.chunk(L)
            prev = s.total
            s.append(k, v)
            ko, vo = c.update(k, v)
            if L == 1:
                w = min(s.total, M)
                check_rotation(raw(ko), s.k[:, :, s.total - w:])
                check_rotation(raw(vo), s.v[:, :, s.total - w:])
            else:
                h = min(prev, M - 1)  # every new token sees a full window
                np.testing.assert_array_equal(raw(ko), s.k[:, :, prev - h:])
                np.testing.assert_array_equal(raw(vo), s.v[:, :, prev - h:])
            if ref is not None:
                ids = ref.update(list(range(prev, prev + L)))
                np.testing.assert_array_equal(raw(ko), s.k[:, :, ids])
                np.testing.assert_array_equal(raw(vo), s.v[:, :, ids])
        assert c.offset == s.total and len(c) == min(s.total, M)
    return c, s


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotating_matches_mlx_and_window_reference(device, dtype):
    rng = np.random.default_rng(7 + len(dtype))
    for trial in range(8):
        M, step = int(rng.integers(1, 9)), int(rng.integers(1, 6))
        run_rotating(device, dtype, rng, M, step, n_ops=30, trim_prob=0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotating_random_with_trims(device, dtype):
    rng = np.random.default_rng(11 + len(dtype))
    for trial in range(10):
        M, step = int(rng.integers(1, 9)), int(rng.integers(1, 6))
        run_rotating(device, dtype, rng, M, step, n_ops=35, trim_prob=0.25)


def test_rotating_prefill_longer_than_window_then_decode(device):
    rng = np.random.default_rng(0)
    s = Stream(rng, "float32", device=device)
    c = RotatingCache(4, 2, device=device)
    k, v = s.chunk(10)
    s.append(k, v)
    ko, _ = c.update(k, v)
    np.testing.assert_array_equal(raw(ko), s.k)  # the whole prompt: each token's window is inside
    assert len(c) == 4 and c.offset == 10
    for _ in range(6):  # decode across several wraps
        k, v = s.chunk(1)
        s.append(k, v)
        ko, vo = c.update(k, v)
        assert ko.shape[2] == 4
        check_rotation(raw(ko), s.k[:, :, -4:])
        check_rotation(raw(vo), s.v[:, :, -4:])
    assert c.capacity == 10  # the prompt's storage is reused, no reallocation per token


def test_rotating_multi_token_after_wrap_keeps_whole_window(device):
    """The seed's concat sliced the ring as if it were in temporal order; after a wrap that
    dropped tokens still inside the window (NOTES.md)."""
    rng = np.random.default_rng(1)
    s = Stream(rng, "float16", device=device)
    c = RotatingCache(5, 8, device=device)
    for _ in range(7):  # wrapped: ring order differs from temporal order
        k, v = s.chunk(1)
        s.append(k, v)
        c.update(k, v)
    k, v = s.chunk(3)
    s.append(k, v)
    ko, vo = c.update(k, v)
    np.testing.assert_array_equal(raw(ko), s.k[:, :, 7 - 4:])
    np.testing.assert_array_equal(raw(vo), s.v[:, :, 7 - 4:])


def test_rotating_trim_before_wrap(device):
    rng = np.random.default_rng(2)
    s = Stream(rng, "float32", device=device)
    c = RotatingCache(8, 4, device=device)
    for n in (3, 1, 1):
        k, v = s.chunk(n)
        s.append(k, v)
        c.update(k, v)
    assert c.trimmable == 5
    assert c.trim(3) == 3
    s.trim(3)
    k, v = s.chunk(1)
    s.append(k, v)
    ko, _ = c.update(k, v)
    np.testing.assert_array_equal(raw(ko), s.k)
    assert c.trim(3) == 3  # back to zero tokens is fine before any eviction
    assert c.offset == 0 and len(c) == 0 and legacy(c)["keys"] is None


def test_rotating_trim_after_wrap(device):
    rng = np.random.default_rng(4)
    s = Stream(rng, "bfloat16", device=device)
    M = 4
    c = RotatingCache(M, 2, device=device)
    for _ in range(6):
        k, v = s.chunk(1)
        s.append(k, v)
        c.update(k, v)
    # wrapped: one token can go (the next token's window still has its M - 1 predecessors)
    assert c.trimmable == 1
    assert c.trim(2) == 1  # clamped: the next token's window keeps its M - 1 predecessors
    s.trim(1)
    k, v = s.chunk(1)
    s.append(k, v)
    ko, vo = c.update(k, v)
    check_rotation(raw(ko), s.k[:, :, -M:])
    check_rotation(raw(vo), s.v[:, :, -M:])
    # speculative decoding: a draft of 3 after the wrap, 2 rejected
    k, v = s.chunk(3)
    prev = s.total
    s.append(k, v)
    ko, _ = c.update(k, v)
    np.testing.assert_array_equal(raw(ko), s.k[:, :, prev - (M - 1):])
    assert c.trimmable == 3
    assert c.trim(2) == 2
    s.trim(2)
    for _ in range(3):
        k, v = s.chunk(1)
        s.append(k, v)
        ko, _ = c.update(k, v)
        check_rotation(raw(ko), s.k[:, :, -M:])
    k, v = s.chunk(2)
    prev = s.total
    s.append(k, v)
    ko, _ = c.update(k, v)
    np.testing.assert_array_equal(raw(ko), s.k[:, :, prev - (M - 1):])


def test_rotating_max_size_one(device):
    rng = np.random.default_rng(5)
    s = Stream(rng, "float32", device=device)
    c = RotatingCache(1, 1, device=device)
    for L in (1, 1, 3, 1, 2, 1):
        k, v = s.chunk(L)
        s.append(k, v)
        ko, _ = c.update(k, v)
        np.testing.assert_array_equal(raw(ko), s.k[:, :, -L:])
    # a window of one needs no history: the newest token can go, and the next one stands alone
    assert len(c) == 1 and c.trimmable == 1
    assert c.trim(2) == 1 and legacy(c)["keys"] is None and c.offset == 8
    assert c.trim(5) == 0 and c.offset == 8  # nothing left that may go
    assert RotatingCache.from_state(legacy(c), device=device).offset == 8
    k, v = s.chunk(1)
    ko, _ = c.update(k, v)
    np.testing.assert_array_equal(raw(ko), host(k))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotating_clone_and_state_round_trip(device, dtype):
    rng = np.random.default_rng(6)
    M = 5
    # states in every shape the ring can take: growing, full in temporal order, wrapped,
    # longer than max_size after a multi-token update, trimmed after a wrap
    scripts = [[2, 1], [5], [1] * 7, [1] * 6 + [3], [1] * 8 + ["t1"], [9], []]
    for script in scripts:
        s = Stream(rng, dtype, device=device)
        c = RotatingCache(M, 2, device=device)
        for op in script:
            if op == "t1":
                c.trim(1)
            else:
                c.update(*s.chunk(op))
        before = snapshot(c)
        twin = c.clone()
        restored = RotatingCache.from_state(legacy(c), device=device)
        assert same_snapshot(snapshot(twin), before), script
        assert same_snapshot(snapshot(restored), before), script
        assert restored.trimmable == twin.trimmable == c.trimmable
        for L in (1, 1, 3, 1):  # identical futures, independent storage
            k, v = s.chunk(L)
            outs = [raw(x.update(k, v)[0]).copy() for x in (c, twin, restored)]
            assert all(np.array_equal(outs[0], o) for o in outs[1:]), script
        c.update(*s.chunk(1))
        assert twin.offset == restored.offset == c.offset - 1


@pytest.mark.torch
def test_torch_bfloat16_in_and_out(device):
    torch = pytest.importorskip("torch")
    where = "cuda" if device == "cuda" else "cpu"  # the cache takes tensors on its own device
    c = RotatingCache(3, device=device)
    ref = []
    for i in range(5):
        k = torch.randn(1, 2, 1, 4).to(torch.bfloat16).to(where)
        v = k.permute(0, 1, 2, 3).clone()[..., :2]  # strided values with another head_dim
        ko, vo = c.update(k, v)
        ref.append(k)
        tk = torch.from_dlpack(ko)
        assert tk.dtype == torch.bfloat16 and tuple(tk.shape) == (1, 2, min(i + 1, 3), 4)
        assert torch.from_dlpack(vo).shape[-1] == 2
    window = torch.cat(ref[-3:], dim=2)
    assert sorted(tk.float().flatten().tolist()) == sorted(window.float().flatten().tolist())
    s = StepCache(device=device)
    k = torch.randn(2, 4, 8, 3).to(torch.float16).to(where).transpose(1, 2)  # [2, 8, 4, 3] strided
    ko, _ = s.update(k, k)
    assert torch.equal(torch.from_dlpack(ko), k)


# ------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("cls", ["step", "rotating"])
def test_bad_input_leaves_cache_unchanged(device, cls):
    c = StepCache(2, device=device) if cls == "step" else RotatingCache(3, 2, device=device)
    good = dev(np.ones((1, 2, 2, 4), np.float16), device)
    c.update(good, good[..., :3])
    c.update(good[:, :, :1], good[:, :, :1, :3])
    before = snapshot(c)
    bad = [
        ((np.ones((2, 2, 1, 4), np.float16), np.ones((2, 2, 1, 3), np.float16)), "shape changed"),
        ((np.ones((1, 3, 1, 4), np.float16), np.ones((1, 3, 1, 3), np.float16)), "shape changed"),
        ((np.ones((1, 2, 1, 5), np.float16), np.ones((1, 2, 1, 3), np.float16)), "head_dim=4"),
        ((np.ones((1, 2, 1, 4), np.float16), np.ones((1, 2, 1, 4), np.float16)), "v_head_dim=3"),
        ((np.ones((1, 2, 1, 4), np.float32), np.ones((1, 2, 1, 3), np.float32)),
         "keys must have dtype float16, got float32"),
        ((np.ones((1, 2, 1, 4), np.float16), np.ones((1, 2, 1, 3), np.float64)),
         "values must have dtype float16, got float64"),
        ((np.ones((2, 1, 4), np.float16), np.ones((2, 1, 3), np.float16)), "keys must be 4-D"),
        ((np.ones((1, 2, 2, 4), np.float16), np.ones((1, 2, 1, 3), np.float16)),
         "must agree on batch, n_kv_heads and L"),
        ((np.ones((1, 2, 0, 4), np.float16), np.ones((1, 2, 0, 3), np.float16)),
         "at least one token"),
        (("keys", "values"), "keys must"),
    ]
    for (k, v), needle in bad:
        if isinstance(k, np.ndarray):
            k, v = dev(k, device), dev(v, device)
        with pytest.raises(ValueError, match=needle):
            c.update(k, v)
        assert same_snapshot(snapshot(c), before), needle
    for n, needle in ((-1, "n must be >= 0"), (1.5, "integer"), (True, "integer")):
        with pytest.raises(ValueError, match=needle):
            c.trim(n)
        assert same_snapshot(snapshot(c), before)


def test_constructor_and_dtype_checks(device):
    for bad in (0, -3, 2.0, None):
        with pytest.raises(ValueError, match="step"):
            StepCache(bad, device=device)
        with pytest.raises(ValueError, match="max_size"):
            RotatingCache(bad, device=device)
    with pytest.raises(ValueError, match="dtype"):
        StepCache(dtype="int8", device=device)
    with pytest.raises(ValueError, match="device"):
        StepCache(device="tpu")
    def ones(dtype=np.float64):
        return dev(np.ones((1, 1, 1, 2), dtype), device)

    c = StepCache(dtype="bfloat16", device=device)
    with pytest.raises(ValueError, match="keys must have dtype bfloat16, got float16"):
        c.update(ones(np.float16), ones(np.float16))
    with pytest.raises(ValueError, match="keys must have dtype float16, float32 or bfloat16"):
        StepCache(device=device).update(ones(), ones())
    if device == "cuda":  # host arrays are refused, naming both devices
        with pytest.raises(ValueError, match="keys lives on cpu but the cache stores on cuda"):
            c.update(np.ones((1, 1, 1, 2), np.uint16), np.ones((1, 1, 1, 2), np.uint16))
    ko, _ = c.update(ones(np.uint16), ones(np.uint16))
    assert isinstance(ko, BFloat16View)
    c.free()
    assert c.dtype == "bfloat16"  # a constructor dtype survives free()


def test_from_state_rejects_inconsistent_states(device):
    def ones(shape, dtype):
        return dev(np.ones(shape, dtype), device)

    c = RotatingCache(4, 2, device=device)
    for _ in range(6):
        c.update(ones((1, 1, 1, 2), np.float32), ones((1, 1, 1, 2), np.float32))
    st = legacy(c)
    with pytest.raises(ValueError, match="kind"):
        StepCache.from_state(st, device=device)
    with pytest.raises(ValueError, match="state must be the"):
        RotatingCache.from_state([1], device=device)
    with pytest.raises(ValueError, match="idx"):
        RotatingCache.from_state({**st, "meta": {**st["meta"], "idx": 9}}, device=device)
    with pytest.raises(ValueError, match="offset"):
        RotatingCache.from_state({**st, "offset": 2}, device=device)
    short = {**st, "keys": st["keys"][:, :, :2], "values": st["values"][:, :, :2],
             "meta": {**st["meta"], "idx": 2}}
    with pytest.raises(ValueError, match="max_size - 1"):
        RotatingCache.from_state(short, device=device)
    s = StepCache(device=device)
    s.update(ones((1, 1, 3, 2), np.float16), ones((1, 1, 3, 2), np.float16))
    with pytest.raises(ValueError, match="offset"):
        StepCache.from_state({**legacy(s), "offset": 5}, device=device)
    with pytest.raises(ValueError, match="offset"):
        StepCache.from_state({**legacy(s), "keys": None, "values": None}, device=device)
    with pytest.raises(ValueError, match="both"):
        StepCache.from_state({**legacy(s), "keys": None}, device=device)
    with pytest.raises(ValueError, match="max_size - 1"):
        RotatingCache.from_state({**st, "keys": None, "values": None,
                                  "meta": {**st["meta"], "idx": 0}}, device=device)
    with pytest.raises(ValueError, match="float16"):
        StepCache.from_state({**legacy(s), "keys": ones((1, 1, 3, 2), np.float32)},
                             device=device)


def test_values_are_kept_exactly(device):
    """No dtype conversion anywhere: float32 of what went in == float32 of what comes out."""
    rng = np.random.default_rng(9)
    for dtype in DTYPES:
        k = random_storage(rng, (1, 1, 3, 4), dtype)
        ko, _ = StepCache(device=device).update(dev(k, device), dev(k, device))
        out = host(ko.to_float32()) if isinstance(ko, BFloat16View) else as_f32(raw(ko), dtype)
        np.testing.assert_array_equal(out, as_f32(k, dtype))


def test_trim_clamps_like_the_seed(device):
    """The seed's ``Trim``: ``n = min(offset, n)``; returns how many went (mlx-lm does the same)."""
    rng = np.random.default_rng(12)
    s = Stream(rng, "float32", device=device)
    step = StepCache(4, device=device)
    step.update(*s.chunk(3))
    assert step.trim(10) == 3 and step.offset == 0 and len(step) == 0
    assert step.trim(1) == 0
    ring = RotatingCache(8, 4, device=device)
    ring.update(*s.chunk(5))
    assert ring.trim(7) == 5 and ring.offset == 0 and legacy(ring)["keys"] is None
    k, v = s.chunk(2)
    ko, _ = ring.update(k, v)  # usable again after a clamped trim
    np.testing.assert_array_equal(raw(ko), host(k))
