"""bfloat16 through DLPack (export as bfloat16, import as uint16 bit patterns, never a copy) and
what device.as_array accepts and refuses."""

import gc
import weakref

import numpy as np
import pytest

from numbakv import _dlpack
from numbakv import device as dev
from numbakv._dlpack import BFloat16View

from helpers import bf16_bits_to_f32, f32_to_bf16_bits


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def jax():
    """JAX with its arrays on the host: these tests feed a cpu cache, and on a GPU machine JAX
    puts new arrays on the GPU by default."""
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax.numpy")
    with jax.default_device(jax.devices("cpu")[0]):
        yield jax


def _bits(shape, seed=0):
    rng = np.random.default_rng(seed)
    return f32_to_bf16_bits(rng.standard_normal(shape).astype(np.float32))


def _addr(arr) -> int:
    return arr.__array_interface__["data"][0]


# ---------------------------------------------------------------- BFloat16View on its own

def test_view_attributes_and_float32():
    bits = _bits((3, 4, 5))
    v = BFloat16View(bits)
    assert v.shape == (3, 4, 5) and v.ndim == 3 and v.dtype == "bfloat16"
    assert v.strides == (20, 5, 1) and v.size == 60 and v.nbytes == 120 and len(v) == 3
    assert v.device == "cpu" and dev.dtype_name(v) == "bfloat16"
    assert v.__dlpack_device__() == (_dlpack.KDL_CPU, 0)
    np.testing.assert_array_equal(v.to_float32(), bf16_bits_to_f32(bits))
    sub = v[:, 1:, ::2]
    assert isinstance(sub, BFloat16View) and sub.shape == (3, 3, 3) and sub.strides == (20, 5, 2)
    assert np.shares_memory(sub.bits, bits)
    one = v[1, 2, 3]
    assert one.shape == () and np.shares_memory(one.bits, bits) and one.bits == bits[1, 2, 3]
    c = v.copy()
    assert not np.shares_memory(c.bits, bits) and np.array_equal(c.bits, bits)
    with pytest.raises(TypeError, match="bfloat16"):
        np.asarray(v)


@pytest.mark.parametrize("bad", [np.zeros(3, np.float16), np.zeros(3, np.int16), [1, 2]])
def test_view_rejects_non_uint16(bad):
    with pytest.raises(ValueError, match="bits"):
        BFloat16View(bad)


def test_capsules_legacy_and_versioned():
    bits = _bits((2, 3))
    v = BFloat16View(bits[:, ::2])
    legacy = v.__dlpack__()
    info = _dlpack.capsule_info(legacy)
    assert not info["versioned"] and info["dtype"] == (_dlpack.KDL_BFLOAT, 16, 1)
    assert info["shape"] == (2, 2) and info["strides"] == (3, 2)
    assert info["device"] == (_dlpack.KDL_CPU, 0)
    assert info["data"] + info["byte_offset"] == _addr(bits)
    versioned = v.__dlpack__(max_version=(1, 0))
    info = _dlpack.capsule_info(versioned)
    assert info["versioned"] and info["dtype"] == (_dlpack.KDL_BFLOAT, 16, 1)
    assert info["flags"] & _dlpack.DLPACK_FLAG_IS_COPIED == 0
    copied = _dlpack.capsule_info(v.__dlpack__(max_version=(1, 0), copy=True))
    assert copied["flags"] & _dlpack.DLPACK_FLAG_IS_COPIED
    assert copied["data"] + copied["byte_offset"] != _addr(bits)
    with pytest.raises(BufferError):
        v.__dlpack__(dl_device=(_dlpack.KDL_CUDA, 0))
    # exporting twice gives two independent capsules of the same memory
    a, b = _dlpack.import_dlpack(legacy), _dlpack.import_dlpack(versioned)
    assert a[1] and b[1] and np.shares_memory(a[0], bits) and np.shares_memory(b[0], bits)


def test_import_through_capsule_round_trip_without_torch():
    bits = _bits((4, 6))
    view = BFloat16View(bits.T[1:, ::3])
    arr, was_bf16 = _dlpack.import_dlpack(view)
    assert was_bf16 and arr.dtype == np.uint16 and arr.shape == view.shape
    assert np.shares_memory(arr, bits) and np.array_equal(arr, bits.T[1:, ::3])
    plain, was_bf16 = _dlpack.import_dlpack(np.zeros(3, np.float16))
    assert not was_bf16 and plain.dtype == np.float16


def test_capsule_consumed_twice_is_an_error():
    capsule = BFloat16View(_bits((3,))).__dlpack__()
    _dlpack.import_dlpack(capsule)
    with pytest.raises(BufferError, match="already consumed"):
        _dlpack.import_dlpack(capsule)
    with pytest.raises(ValueError, match="key could not be imported"):
        dev.as_array(capsule, "cpu", "bfloat16", name="key")


def test_owner_released_after_import_dies():
    base = _bits((8, 8))
    ref = weakref.ref(base)
    arr, _ = _dlpack.import_dlpack(BFloat16View(base[2:]))
    del base
    gc.collect()
    assert ref() is not None, "the import must keep the producer's memory alive"
    np.testing.assert_array_equal(arr, ref()[2:])
    del arr
    gc.collect()
    assert ref() is None, "the producer's memory leaked"


def test_unconsumed_capsule_does_not_leak():
    base = _bits((5,))
    ref = weakref.ref(base)
    capsule = BFloat16View(base).__dlpack__(max_version=(1, 0))
    legacy = BFloat16View(base).__dlpack__()
    del base
    gc.collect()
    assert ref() is not None
    del capsule, legacy
    gc.collect()
    assert ref() is None


# ---------------------------------------------------------------- torch

@pytest.mark.torch
def test_torch_bfloat16_shares_memory_both_ways(torch):
    bits = _bits((2, 3, 4))
    t = torch.from_dlpack(BFloat16View(bits))
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == bits.shape
    assert t.data_ptr() == _addr(bits)
    np.testing.assert_array_equal(t.float().numpy(), bf16_bits_to_f32(bits))
    t[1, 2, 3] = 3.5
    assert bits[1, 2, 3] == f32_to_bf16_bits(np.float32([3.5]))[0]
    bits[0, 0, 0] = f32_to_bf16_bits(np.float32([-2.0]))[0]
    assert t[0, 0, 0].item() == -2.0


@pytest.mark.torch
@pytest.mark.parametrize("make", [
    lambda b: b[:, ::2, 1:],
    lambda b: b.transpose(2, 0, 1),
    lambda b: b[1, :, 2],
])
def test_torch_non_contiguous_views(torch, make):
    bits = _bits((4, 6, 5))
    sub = make(bits)
    t = torch.from_dlpack(BFloat16View(sub))
    assert tuple(t.shape) == sub.shape
    assert tuple(t.stride()) == tuple(s // 2 for s in sub.strides)
    np.testing.assert_array_equal(t.float().numpy(), bf16_bits_to_f32(sub))
    t.add_(1.0)  # write-through
    np.testing.assert_array_equal(bf16_bits_to_f32(sub), t.float().numpy())


def test_negative_strides_refused_not_crashing_consumers():
    bits = _bits((4, 3))
    with pytest.raises(BufferError, match="negative strides"):
        BFloat16View(bits[::-1]).__dlpack__()
    BFloat16View(bits[::-1]).copy().__dlpack__()


@pytest.mark.torch
def test_torch_legacy_capsule_and_consumed_twice(torch):
    bits = _bits((3,))
    capsule = BFloat16View(bits).__dlpack__()
    t = torch.utils.dlpack.from_dlpack(capsule)
    assert t.dtype == torch.bfloat16 and t.data_ptr() == _addr(bits)
    with pytest.raises(Exception):
        torch.utils.dlpack.from_dlpack(capsule)


@pytest.mark.torch
def test_torch_tensor_keeps_storage_alive_then_releases_it(torch):
    base = _bits((16,))
    ref = weakref.ref(base)
    t = torch.from_dlpack(BFloat16View(base[4:]))
    expected = bf16_bits_to_f32(base[4:]).copy()
    del base
    gc.collect()
    assert ref() is not None
    np.testing.assert_array_equal(t.float().numpy(), expected)
    del t
    gc.collect()
    assert ref() is None


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "permuted"])
def test_as_array_torch_cpu_zero_copy(torch, dtype, layout):
    t = torch.randn(4, 3, 6).to(getattr(torch, dtype))
    if layout == "strided":
        t = t[1:, :, ::2]
    elif layout == "permuted":
        t = t.permute(2, 0, 1)
    arr = dev.as_array(t, "cpu", dtype, name="key")
    assert isinstance(arr, np.ndarray) and arr.shape == tuple(t.shape)
    assert arr.dtype == (np.uint16 if dtype == "bfloat16" else np.dtype(dtype))
    assert _addr(arr) == t.data_ptr()
    assert tuple(s // arr.itemsize for s in arr.strides) == tuple(t.stride())
    if dtype == "bfloat16":
        np.testing.assert_array_equal(bf16_bits_to_f32(arr), t.float().numpy())
    else:
        np.testing.assert_array_equal(arr, t.numpy())
    # the same data goes to "sim" storage (numpy as well)
    assert _addr(dev.as_array(t, "sim", dtype, name="key")) == t.data_ptr()


@pytest.mark.torch
def test_as_array_torch_bfloat16_survives_tensor_deletion(torch):
    t = torch.arange(64, dtype=torch.float32).to(torch.bfloat16)
    arr = dev.as_array(t, "cpu", "bfloat16", name="key")
    del t
    gc.collect()
    _ = [torch.full((64,), 7.0, dtype=torch.bfloat16) for _ in range(8)]
    np.testing.assert_array_equal(bf16_bits_to_f32(arr), np.arange(64, dtype=np.float32))


@pytest.mark.torch
def test_as_array_torch_errors(torch):
    with pytest.raises(ValueError, match="key must have dtype float16, got bfloat16"):
        dev.as_array(torch.zeros(2, dtype=torch.bfloat16), "cpu", "float16", name="key")
    with pytest.raises(ValueError, match="value must have dtype bfloat16, got float32"):
        dev.as_array(torch.zeros(2), "cpu", "bfloat16", name="value")
    with pytest.raises(ValueError, match="keys must have dtype float32, got float64"):
        dev.as_array(torch.zeros(2, dtype=torch.float64), "cpu", "float32", name="keys")
    with pytest.raises(ValueError, match="key could not be imported"):
        dev.as_array(torch.zeros(2, requires_grad=True), "cpu", "float32", name="key")


@pytest.mark.torch
def test_as_array_raw_torch_capsule(torch):
    t = torch.randn(5).to(torch.bfloat16)
    arr = dev.as_array(torch.utils.dlpack.to_dlpack(t), "cpu", "bfloat16", name="key")
    assert arr.dtype == np.uint16 and _addr(arr) == t.data_ptr()


# ---------------------------------------------------------------- as_array without torch

def test_as_array_numpy_and_views():
    x16 = np.zeros((2, 3), np.float16)
    assert dev.as_array(x16, "cpu", "float16", name="key") is x16
    x32 = np.ones((2, 3), np.float32)[:, ::2]
    assert dev.as_array(x32, "sim", "float32", name="key") is x32
    bits = _bits((2, 3))
    assert dev.as_array(bits, "cpu", "bfloat16", name="key") is bits  # documented bit patterns
    got = dev.as_array(BFloat16View(bits[:, 1:]), "cpu", "bfloat16", name="key")
    assert got.dtype == np.uint16 and np.shares_memory(got, bits)


@pytest.mark.parametrize("x, dtype, needle", [
    (np.zeros(2, np.float64), "float32", "key must have dtype float32, got float64"),
    (np.zeros(2, np.float32), "float16", "key must have dtype float16, got float32"),
    (np.zeros(2, np.uint16), "float16", "key must have dtype float16, got uint16"),
    (np.zeros(2, np.float16), "bfloat16", "key must have dtype bfloat16, got float16"),
    (BFloat16View(np.zeros(2, np.uint16)), "float16", "key must have dtype float16, got bfloat16"),
])
def test_as_array_rejects_wrong_dtypes(x, dtype, needle):
    with pytest.raises(ValueError, match=needle):
        dev.as_array(x, "cpu", dtype, name="key")


class _FakeGPUTensor:
    """A DLPack producer that says its memory is on CUDA device 0."""

    dtype = "float16"

    def __dlpack_device__(self):
        return (_dlpack.KDL_CUDA, 0)

    def __dlpack__(self, **kwargs):  # pragma: no cover - must never be reached
        raise AssertionError("a GPU tensor must be refused before it is imported")


class _BrokenCudaInterface:
    """Like torch's bfloat16 CUDA tensors: __cuda_array_interface__ raises a non-AttributeError."""

    @property
    def __cuda_array_interface__(self):
        raise KeyError("bfloat16")


def test_gpu_inputs_refused_on_a_cpu_cache():
    for x in (_FakeGPUTensor(), _BrokenCudaInterface()):
        assert dev.input_device(x) == "cuda"
        with pytest.raises(ValueError, match="value lives on cuda but the cache stores on cpu"):
            dev.as_array(x, "cpu", "float16", name="value")


def test_non_arrays_refused():
    with pytest.raises(ValueError, match="key must be an array"):
        dev.as_array(object(), "cpu", "float16", name="key")
    # for a GPU cache too: a str is not an array, whatever device it "lives" on
    with pytest.raises(ValueError, match="key must be a GPU array .*got str"):
        dev.as_array("keys", "cuda", "float16", name="key")


# ---------------------------------------------------------------- JAX

def test_jax_bfloat16_both_ways(jax):
    import jax.numpy as jnp
    x = jnp.asarray(np.arange(12, dtype=np.float32).reshape(3, 4), dtype=jnp.bfloat16)
    arr = dev.as_array(x, "cpu", "bfloat16", name="key")
    assert arr.dtype == np.uint16
    assert _addr(arr) == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(bf16_bits_to_f32(arr), np.arange(12).reshape(3, 4))
    host = np.asarray(x)  # numpy array of ml_dtypes' bfloat16
    got = dev.as_array(host, "cpu", "bfloat16", name="key")
    assert got.dtype == np.uint16 and np.shares_memory(got, host)
    np.testing.assert_array_equal(got, arr)
    f16 = jnp.ones((2, 2), dtype=jnp.float16)
    a16 = dev.as_array(f16, "cpu", "float16", name="key")
    assert a16.dtype == np.float16 and _addr(a16) == f16.unsafe_buffer_pointer()
    with pytest.raises(ValueError, match="key must have dtype float16, got bfloat16"):
        dev.as_array(x, "cpu", "float16", name="key")
    # export: jax reads the cache's bfloat16 view
    bits = _bits((2, 5))
    j = jax.dlpack.from_dlpack(BFloat16View(bits))
    assert j.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(j.astype(jnp.float32)), bf16_bits_to_f32(bits))


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_host_torch_tensor_is_taken_as_a_view(torch, dtype):
    """``as_array``'s host torch fast path (what hf.attach puts every layer): the same memory,
    strided views included, bfloat16 as its bit patterns; tensors that require grad, other
    dtypes and a GPU cache still go through the checked path and its errors."""
    tdt = getattr(torch, dtype)
    t = torch.randn(4, 6, 8).to(tdt)[:, ::2]
    a = dev.as_array(t, "cpu", dtype)
    want = t.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else t.numpy()
    assert a.shape == (4, 3, 8) and np.shares_memory(a, want)
    assert np.array_equal(a, want)
    t[0, 0, 0] = 7.0                    # a view, not a copy
    assert np.array_equal(a, want)
    other = "float32" if dtype != "float32" else "float16"
    with pytest.raises(ValueError, match=f"must have dtype {other}"):
        dev.as_array(t, "cpu", other)
    with pytest.raises(ValueError, match="require"):
        dev.as_array(torch.zeros(2, 3, dtype=tdt, requires_grad=True), "cpu", dtype)
