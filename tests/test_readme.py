"""Every ```python block of README.md runs as pasted, each in a fresh interpreter. A block that
needs a GPU says so with a ``# needs: gpu`` comment (skipped here); blocks that import torch or
transformers are skipped when those are not installed."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
    code = BLOCKS[index]
    if "# needs: gpu" in code:
        pytest.skip("needs a GPU")
    for module in ("torch", "transformers"):
        if re.search(rf"^\s*(import|from) {module}\b", code, re.M) and \
                importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"README block {index} failed:\n{code}\n{proc.stderr[-3000:]}"
    assert not list(tmp_path.iterdir()), "a README block wrote files into the working directory"
