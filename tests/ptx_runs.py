"""The PTX check (``python -m numbakv.kernels.ptx --check``) run once per group of kernels per test
session, its report and PTX shared by every test and every xdist worker that asks for it.

Compiling every kernel x signature for sm_80 and sm_90 and linking each with nvJitLink takes most
of a minute of one core; as one test it could not be spread over ``pytest -n 2``'s workers, and
tests that look at the PTX of some kernels (tests/test_kernels.py) compiled those again. Here
the kernels are split into :data:`PTX_GROUPS` (each checked in its own fresh process: the
simulator, on in the test process, has no PTX compiler), and a group's run is kept in the
session's temporary folder, shared by the workers (``tmp_path_factory``'s parent under xdist)
and guarded by a file lock: the first test that needs a group runs it, the others read it.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Dict, List, NamedTuple, Optional, Tuple

from filelock import FileLock

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: kernel groups (registered names) checked in one process each, about equal in compile time;
#: "rest" is every registered kernel not named in another group
PTX_GROUPS: Dict[str, Optional[Tuple[str, ...]]] = {
    "paged": ("paged_attention", "paged_attention_merge", "extend_page_lists"),
    "copies": ("put_kv", "move_cells", "move_lanes", "move_runs", "quant_move"),
    "rest": None,
}


class PtxRun(NamedTuple):
    """One group's check: exit status, output and the folder holding its PTX files
    (``numbakv.kernels.ptx.ptx_file_name``)."""
    kernels: List[str]
    returncode: int
    stdout: str
    stderr: str
    ptx_dir: pathlib.Path


def group_kernels(group: str) -> List[str]:
    """The registered kernel names of ``group`` (sorted)."""
    from numbakv.kernels import registered
    named = PTX_GROUPS[group]
    if named is not None:
        return sorted(named)
    others = {name for names in PTX_GROUPS.values() if names for name in names}
    return sorted(spec.name for spec in registered() if spec.name not in others)


def ptx_env() -> dict:
    """The test environment without the simulator switch (the check needs Numba's CUDA
    target)."""
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


def ptx_check(group: str, tmp_path_factory) -> PtxRun:
    """``group``'s check, run by the first caller of the session (any worker) and read back by
    the others."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent                 # shared by the workers of this run
    out = root / f"ptx-check-{group}"
    result = out / "result.json"
    kernels = group_kernels(group)
    with FileLock(str(out) + ".lock"):
        if not result.exists():
            out.mkdir(exist_ok=True)
            proc = subprocess.run([sys.executable, "-m", "numbakv.kernels.ptx", "--check",
                                   "--kernels", ",".join(kernels), "--ptx-dir", str(out)],
                                  env=ptx_env(), capture_output=True, text=True, timeout=900,
                                  cwd=ROOT)
            result.write_text(json.dumps({"kernels": kernels, "returncode": proc.returncode,
                                          "stdout": proc.stdout, "stderr": proc.stderr}))
    data = json.loads(result.read_text())
    assert data["kernels"] == kernels, (data["kernels"], kernels)
    return PtxRun(data["kernels"], data["returncode"], data["stdout"], data["stderr"], out)
