"""The command line: ``numbakv demo``, ``numbakv bench``, ``numbakv info``."""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from typing import List, Optional


def _version(module: str) -> str:
    try:
        mod = __import__(module)
        return str(getattr(mod, "__version__", "installed"))
    except Exception:  # noqa: BLE001
        return "not installed"


def _ptx_check() -> str:
    """Compile every kernel to PTX in a fresh process (the simulator, if on here, is off there)."""
    import os
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run([sys.executable, "-m", "numbakv.kernels.ptx"], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = (proc.stdout or proc.stderr).strip().splitlines()
    return ("works: " if proc.returncode == 0 else "FAILS: ") + (lines[-1] if lines else "")


def info(args: argparse.Namespace) -> int:
    import numbakv
    from numbakv.device import cuda_usable, resolve_device, simulator_enabled
    rows = [("numbakv", numbakv.__version__), ("python", platform.python_version()),
            ("platform", platform.platform())]
    for mod in ("numpy", "numba", "cupy", "safetensors", "torch", "jax"):
        rows.append((mod, _version(mod)))
    try:
        from importlib.metadata import version
        rows.append(("numba-cuda", version("numba-cuda")))
    except Exception:  # noqa: BLE001
        rows.append(("numba-cuda", "not installed"))
    rows.append(("device (auto)", resolve_device("auto")))
    rows.append(("CUDA simulator", "on" if simulator_enabled() else "off"))
    if cuda_usable():
        import cupy
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        free, total = cupy.cuda.runtime.memGetInfo()
        rows.append(("GPU", f"{name} (sm_{props['major']}{props['minor']})"))
        rows.append(("GPU memory", f"{total / 2**30:.1f} GiB total, {free / 2**30:.1f} GiB free"))
    else:
        rows.append(("GPU", "none usable"))
    if not args.no_ptx:
        rows.append(("PTX (sm_80, sm_90)", _ptx_check()))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="numbakv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, device, GPU, simulator and PTX status")
    p_info.add_argument("--no-ptx", action="store_true", help="skip the PTX compilation check")
    p_info.set_defaults(func=info)
    try:
        from . import demo
        demo.add_parser(sub)
    except ImportError:
        pass
    try:
        from . import bench
        bench.add_parser(sub)
    except ImportError:
        pass
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
