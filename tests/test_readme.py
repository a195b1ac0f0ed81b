"""Every ```python block of README.md and docs/*.md runs as pasted, each in a fresh interpreter
in an empty directory, without a FutureWarning (a deprecated argument in our own docs). A block
that needs a GPU says so with a ``# needs: gpu`` comment (skipped here); ``# needs: redis`` runs
the block against a throwaway Redis server (tests/redis_server.py) whose URL replaces the
block's ``redis://host:port/db``; blocks that import torch or transformers are skipped when
those are not installed; a block that starts with ``# continues the block above`` runs after
the block before it. API listings that are not meant to run are plain ``` blocks."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from redis_server import redis_server  # noqa: E402,F401  (the fixture "# needs: redis" uses)

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
_CONTINUES = "# continues the block above"


def _blocks(path: pathlib.Path):
    """The file's python blocks; one that starts with ``# continues the block above`` runs after
    the code of the block before it (as a reader pasting both would)."""
    out = []
    for code in _FENCE.findall(path.read_text()):
        if code.startswith(_CONTINUES) and out:
            code = out[-1] + code
        out.append(code)
    return out


#: (file name, index in that file, code)
BLOCKS = [(path.relative_to(ROOT).as_posix(), i, code)
          for path in DOCS for i, code in enumerate(_blocks(path))]
_REDIS_URL = re.compile(r"redis://[\w.-]+:\d+/\d+")


def test_readme_has_python_blocks():
    assert sum(1 for name, _, _ in BLOCKS if name == "README.md") >= 5
    assert sum(1 for name, _, _ in BLOCKS if name.startswith("docs/")) >= 8


@pytest.mark.parametrize("name, index, code", BLOCKS,
                         ids=[f"{name}:{i}" for name, i, _ in BLOCKS])
def test_doc_block_runs(name, index, code, tmp_path, request):
    if "# needs: gpu" in code:
        pytest.skip("needs a GPU")
    for module in ("torch", "transformers"):
        if re.search(rf"^\s*(import|from) {module}\b", code, re.M) and \
                importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    if "# needs: redis" in code:
        server = request.getfixturevalue("redis_server")
        code = _REDIS_URL.sub(server.url, code)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} block {index} failed:\n{code}\n{proc.stderr[-3000:]}"
    assert "FutureWarning" not in proc.stderr, f"{name} block {index}:\n{proc.stderr[-3000:]}"
    assert not list(tmp_path.iterdir()), f"{name} block {index} wrote files into the working " \
                                         "directory"
