"""The command line: numbakv demo, numbakv bench, numbakv info."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from typing import List, Optional, Sequence, Tuple

#: Distributions ``numbakv info`` reports, each (label, candidate distribution names): read from
#: the installed metadata, so nothing is imported (importing torch alone takes seconds).
_DISTRIBUTIONS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("numpy", ("numpy",)),
    ("numba", ("numba",)),
    ("numba-cuda", ("numba-cuda",)),
    ("cuda-bindings", ("cuda-bindings",)),
    ("cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy")),
    ("safetensors", ("safetensors",)),
    ("torch", ("torch",)),
    ("transformers", ("transformers",)),
    ("jax", ("jax",)),
    ("matplotlib", ("matplotlib",)),
)


def installed_version(candidates: Sequence[str]) -> str:
    """The installed version of the first of ``candidates`` (distribution names) found, with its
    name when it is not the first; ``"not installed"`` when none is."""
    from importlib.metadata import PackageNotFoundError, version
    for name in candidates:
        try:
            found = version(name)
        except PackageNotFoundError:
            continue
        return found if name == candidates[0] else f"{found} ({name})"
    return "not installed"


def ptx_check() -> str:
    """Compile every kernel to PTX for sm_80 and sm_90 in a fresh process (the simulator, if on
    here, is off there); ``"works: ..."`` or ``"FAILS: ..."`` with its last line."""
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run([sys.executable, "-m", "numbakv.kernels.ptx"], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = (proc.stdout or proc.stderr).strip().splitlines()
    return ("works: " if proc.returncode == 0 else "FAILS: ") + (lines[-1] if lines else "")


def info(args: argparse.Namespace) -> int:
    """``numbakv info``: versions, the device ``auto`` picks, the GPU and the simulator; the PTX
    compilation check (several seconds) only with ``--ptx``. Returns 0, or 1 when ``--ptx``
    found a kernel that does not compile."""
    import numbakv
    from numbakv.device import cuda_usable, resolve_device, simulator_enabled
    rows = [("numbakv", numbakv.__version__), ("python", platform.python_version()),
            ("platform", platform.platform())]
    rows += [(label, installed_version(names)) for label, names in _DISTRIBUTIONS]
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
    from numbakv.tools.info_compiled import rows as compiled_rows
    rows += compiled_rows()
    status = 0
    if args.ptx:
        result = ptx_check()
        status = 0 if result.startswith("works") else 1
        rows.append(("PTX (sm_80, sm_90)", result))
    else:
        rows.append(("PTX (sm_80, sm_90)", "not checked (numbakv info --ptx)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return status


def build_parser() -> argparse.ArgumentParser:
    """The ``numbakv`` argument parser with its ``info``, ``demo`` and ``bench`` sub-commands."""
    from numbakv import __version__
    parser = argparse.ArgumentParser(
        prog="numbakv",
        description="numbakv: the KV cache of an LLM inference runtime. Commands: demo (a tiny "
                    "model serving several sequences through one cache, verified), bench "
                    "(decode-step cost against other caches), info (versions and device), "
                    "precompile (compile ahead of first use).")
    parser.add_argument("--version", action="version", version=f"numbakv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{demo,bench,info,precompile}")
    p_info = sub.add_parser("info", help="versions, device, GPU and simulator; --ptx also "
                                         "compiles every kernel to PTX",
                            description="Versions, the device numbakv would use, the GPU and "
                                        "whether the CUDA simulator is on.")
    p_info.add_argument("--ptx", action="store_true",
                        help="also compile every kernel to PTX for sm_80 and sm_90 (seconds; "
                             "needs numba-cuda's NVVM, e.g. pip install 'numbakv[cuda]')")
    p_info.add_argument("--no-ptx", action="store_false", dest="ptx", help=argparse.SUPPRESS)
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
    from . import precompile
    precompile.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
