"""Test harness: without a usable GPU, switch on Numba's CUDA simulator *before* numba.cuda is
imported, so the same tests run the real ``@cuda.jit`` kernels everywhere (device ``sim``)."""

import importlib.util
import os
import pathlib

import pytest

_probe_path = pathlib.Path(__file__).resolve().parents[1] / "numbakv" / "_gpu_probe.py"
_spec = importlib.util.spec_from_file_location("_numbakv_gpu_probe", _probe_path)
_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_probe)

if "NUMBA_ENABLE_CUDASIM" not in os.environ and _probe.driver_gpu_count() == 0:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    # numba-cuda's .pth redirector imports numba (and reads its config) at interpreter start-up,
    # before this file runs: re-read the environment so numba.cuda sees the simulator switch.
    import sys
    if "numba" in sys.modules:
        assert "numba.cuda" not in sys.modules or "numba.cuda.simulator" in sys.modules, \
            "numba.cuda was imported before the simulator could be switched on"
        from numba.core import config as _numba_config
        _numba_config.reload_config()

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
if SIMULATOR:
    # the simulator's block barrier without its busy polling (a third of the CPU time)
    import sim_barrier
    sim_barrier.install()
#: the device that runs the @cuda.jit kernels here: the simulator or a real GPU
KERNEL_DEVICE = "sim" if SIMULATOR else "cuda"
ALL_DEVICES = ["cpu", KERNEL_DEVICE]


def pytest_report_header(config):
    return f"numbakv devices under test: {ALL_DEVICES} (CUDA simulator {'on' if SIMULATOR else 'off'})"


@pytest.fixture(params=ALL_DEVICES)
def device(request):
    """Each device the suite can run here: ``cpu`` and ``sim`` (or ``cuda`` on a GPU machine)."""
    return request.param


@pytest.fixture
def kernel_device():
    return KERNEL_DEVICE


@pytest.fixture
def fake_gpu(kernel_device, monkeypatch):
    """``(cupy stand-in, launches)`` for the cuda path without a GPU: every kernel launch
    recorded as (kernel name, stream handle). Skipped on a GPU machine (the real path runs)."""
    if kernel_device != "sim":
        pytest.skip("a real GPU runs the cuda path itself")
    import sys
    from helpers import clear_launch_caches, emulate_cuda
    launches = []
    cp = emulate_cuda(monkeypatch, lambda kernel, args: launches.append(
        (kernel.py_func.__name__, sys.modules["cupy"].cuda.get_current_stream().ptr)))
    yield cp, launches
    clear_launch_caches()


def pytest_collection_modifyitems(config, items):
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    skip_torch = pytest.mark.skip(reason="PyTorch is not installed")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    # `slow` tests (long stateful runs) are left out unless the -m expression asks for them:
    # CI runs `pytest -n 2`, `pytest -m slow` runs them
    want_slow = "slow" in (config.getoption("markexpr", "") or "")
    skip_slow = pytest.mark.skip(reason="slow: run with pytest -m slow")
    for item in items:
        if "slow" in item.keywords and not want_slow:
            item.add_marker(skip_slow)
        if "torch" in item.keywords and not have_torch:
            item.add_marker(skip_torch)
        # the marker itself, not item.keywords: keywords hold every parent node's name, so a
        # checkout in a directory named "gpu" would skip the whole suite
        if item.get_closest_marker("gpu") is not None and SIMULATOR:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session):
    """Collect garbage now and freeze what survives.

    An xdist worker gets 5 seconds between reporting "finished" and the end of its execution
    before execnet sends it SIGINT (the KeyboardInterrupt traceback printed after a green
    ``pytest -n 2`` run). What runs in that window is pytest's unconfigure, whose unraisable-
    exception check does a full ``gc.collect()`` over every object the run loaded (torch,
    transformers, hypothesis, numba: about half a million, 2 s per pass on a busy 2-core
    machine, more after a whole run). This hook runs before the worker reports (inside xdist's
    wrapper), so the collection and its finalizers happen while the worker still counts as
    running; frozen objects are not traversed again, so the later pass takes milliseconds."""
    import gc
    gc.collect()
    gc.freeze()
