import ast
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import numbakv as nkv
from numbakv import device as dev
from numbakv.config import CacheConfig, RopeShift

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_config_defaults_and_sizing():
    cfg = CacheConfig(2, 4, 64)
    assert cfg.v_head_dim == 64 and cfg.dtype == "float16" and cfg.device == "auto"
    assert cfg.n_cells() == 2048
    cfg = CacheConfig(2, 4, 64, capacity=100, max_seqs=3, cache_padding=32, max_batch=8)
    assert cfg.n_cells() == 320  # 300 rounded up to 32
    assert cfg.n_cells(swa_memory=10) == 64  # 3*10 + 8 = 38 -> 64
    assert cfg.nbytes() == 320 * 2 * 4 * (64 + 64) * 2
    assert CacheConfig(1, 1, 8, v_head_dim=4, dtype="float32", capacity=10).nbytes() == 10 * 12 * 4


@pytest.mark.parametrize("kwargs, needle", [
    (dict(n_layers=0), "n_layers"), (dict(n_kv_heads=-1), "n_kv_heads"),
    (dict(head_dim=1.5), "head_dim"), (dict(dtype="int8"), "dtype"),
    (dict(mask_dtype="int8"), "mask_dtype"), (dict(max_seqs=257), "max_seqs"),
    (dict(device="tpu"), "device"), (dict(capacity=0), "capacity"),
    (dict(permuted_v="yes"), "permuted_v"), (dict(v_head_dim=0), "v_head_dim"),
])
def test_config_rejects_bad_values(kwargs, needle):
    base = dict(n_layers=1, n_kv_heads=1, head_dim=8)
    base.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        CacheConfig(**base)


def test_config_accepts_dtype_aliases():
    assert CacheConfig(1, 1, 8, dtype=np.float32).dtype == "float32"
    assert CacheConfig(1, 1, 8, dtype="bf16").dtype == "bfloat16"
    assert CacheConfig(1, 1, 8, dtype="bfloat16").storage_dtype == np.uint16


def test_rope_shift_params():
    rs = RopeShift()
    assert rs.rotary_dim(64) == 64
    np.testing.assert_allclose(rs.inv_freq(4), [1.0, 0.01], rtol=1e-6)
    with pytest.raises(ValueError, match="dim"):
        RopeShift(dim=3)
    with pytest.raises(ValueError, match="head_dim"):
        RopeShift(dim=128).rotary_dim(64)
    with pytest.raises(ValueError, match="base"):
        RopeShift(base=-1)
    with pytest.raises(ValueError, match="freq_factors"):
        RopeShift(dim=8, freq_factors=[1, 2])
    np.testing.assert_allclose(RopeShift(dim=4, freq_factors=[1, 2]).inv_freq(8), [1.0, 0.005])


def test_resolve_device(kernel_device):
    assert dev.resolve_device("cpu") == "cpu"
    assert dev.resolve_device("auto") in ("cpu", "cuda", "sim")
    if kernel_device == "sim":
        assert dev.simulator_enabled()
        assert dev.resolve_device("auto") == "sim"
        with pytest.raises(ValueError, match="cuda"):
            dev.resolve_device("cuda")
    with pytest.raises(ValueError, match="device"):
        dev.resolve_device("gpu0")


def test_as_array_zero_copy_and_checks():
    x = np.zeros((3, 2, 4), np.float16)
    y = dev.as_array(x, "cpu", "float16", name="key")
    assert y is x or np.shares_memory(x, y)
    with pytest.raises(ValueError, match="key must have dtype float32"):
        dev.as_array(x, "cpu", "float32", name="key")
    bits = np.zeros(4, np.uint16)
    assert dev.as_array(bits, "cpu", "bfloat16").dtype == np.uint16


def test_errors_hierarchy():
    for err in (nkv.KVCacheFullError, nkv.NotSupportedError, nkv.StateError):
        assert issubclass(err, nkv.KVCacheError)


def _ptx_env():
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


def test_every_kernel_compiles_to_ptx_for_sm80_and_sm90():
    """Runs in a fresh process: the simulator (on in this one) has no PTX compiler."""
    proc = subprocess.run([sys.executable, "-m", "numbakv.kernels.ptx"], env=_ptx_env(),
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from numbakv.kernels import registered
    for spec in registered():
        assert re.search(rf"^{re.escape(spec.name)}: .*sm_80, sm_90$", proc.stdout, re.M), \
            f"{spec.name} missing from PTX report:\n{proc.stdout}"


def test_no_kernel_escapes_the_registry():
    """A @cuda.jit kernel must register through kernels._registry.cuda_kernel (so the PTX test
    sees it); device functions go through kernels._registry.element."""
    offenders = []
    for path in (ROOT / "numbakv").rglob("*.py"):
        if path.name == "_registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "jit"
                    and isinstance(node.value, ast.Name) and node.value.id == "cuda"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"use kernels._registry.cuda_kernel/element instead of cuda.jit in {offenders}"


def test_info_command_runs():
    proc = subprocess.run([sys.executable, "-m", "numbakv", "info", "--no-ptx"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "device (auto)" in proc.stdout and "numba" in proc.stdout
