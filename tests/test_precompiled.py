"""The compiled code numbakv ships (``numbakv/_precompiled``, see ``numbakv/_jit.py``).

A first run on a fresh machine loads numbakv's common path instead of compiling it for about
30 s. These tests check that the shipped code is fresh (built from today's sources), that the
common path loads all of it with an empty numba cache, that a function compiled here can call
shipped code, and that an edited source or a switch-off makes numba compile again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numba
import pytest

from numbakv import _jit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = _jit.shipped_manifest()
# every subprocess: an empty numba cache (no host-compiled code to fall back on), no notice
CHILD_ENV = {k: v for k, v in os.environ.items()
             if k not in ("NUMBA_ENABLE_CUDASIM", _jit.BUILD_ENV, _jit.SWITCH_ENV,
                          "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
CHILD_ENV["NUMBAKV_COMPILE_NOTICE"] = "0"

needs_shipped = pytest.mark.skipif(
    not MANIFEST["usable"] or MANIFEST["numba"] != numba.__version__,
    reason=f"the shipped code cannot serve this process (x86-64-v3 host: "
           f"{_jit._host_has_shipped_level()}, built with numba {MANIFEST['numba']}, here "
           f"{numba.__version__})")


def _run(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    cache = tmp_path / "numba-cache"
    cache.mkdir(exist_ok=True)
    full_env = dict(CHILD_ENV, NUMBA_CACHE_DIR=str(cache))
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def test_shipped_code_is_built_from_these_sources():
    """Every shipped entry's source file still has the content it was compiled from; after an
    edit of @njit code, `numbakv precompile --ship` rebuilds them."""
    assert MANIFEST["entries"], "numbakv/_precompiled is empty: run `numbakv precompile --ship`"
    if MANIFEST["numba"] != numba.__version__:
        pytest.skip(f"shipped for numba {MANIFEST['numba']}, here {numba.__version__}")
    assert not MANIFEST["stale"], (
        f"{len(MANIFEST['stale'])} shipped entries are stale (their module changed since "
        f"the build), e.g. {MANIFEST['stale'][:3]}: run `numbakv precompile --ship` and commit")


def test_readme_names_what_the_shipped_code_fits():
    """The README says which Python and numba the shipped code serves (it is rebuilt with
    whatever `numbakv precompile --ship` runs under)."""
    readme = open(os.path.join(REPO, "README.md")).read()
    tags = sorted({name.split(".py")[-1].split(".")[0] for name in MANIFEST["entries"]})
    versions = [f"{tag[0]}.{tag[1:]}" for tag in tags]     # e.g. "311" -> "3.11"
    named = ", ".join(versions[:-1]) + " and " + versions[-1] if len(versions) > 1 else versions[0]
    assert f"CPython {named} and numba {MANIFEST['numba']}" in readme, (tags, named)


@needs_shipped
def test_common_path_loads_everything_with_an_empty_numba_cache(tmp_path):
    """What `numbakv demo` and the rest of the common path run compiles nothing numbakv."""
    proc = subprocess.run([sys.executable, "-m", "numbakv.tools.precompile", "--child", "check"],
                          env=dict(CHILD_ENV, NUMBA_CACHE_DIR=str(tmp_path)), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check: 0 numbakv compiles" in proc.stdout


@needs_shipped
def test_cuda_host_path_loads_everything_with_an_empty_numba_cache(tmp_path):
    """The host side of the CUDA path (run on the simulator: the same @njit bookkeeping a GPU
    cache runs) compiles nothing numbakv either: a GPU machine's first step loads it."""
    proc = subprocess.run([sys.executable, "-m", "numbakv.tools.precompile", "--child",
                           "check-cuda-host"],
                          env=dict(CHILD_ENV, NUMBA_CACHE_DIR=str(tmp_path),
                                   NUMBA_ENABLE_CUDASIM="1"),
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check-cuda-host: 0 numbakv compiles" in proc.stdout


@needs_shipped
def test_host_compiled_function_calls_shipped_code(tmp_path):
    """A function numba compiles for the host links shipped functions (their bitcode) in."""
    proc = _run("""
        import numpy as np
        from numba import njit
        from numbakv import cells
        from numbakv.tools.precompile import _CompileCounter

        @njit
        def user(occ, i, n):
            cells._occ_set(occ, i)
            return cells._bit(i) + cells._next_free(occ, i - 3, n)

        occ = np.zeros(2, np.uint64)
        with _CompileCounter() as compiled:
            out = user(occ, np.int64(3), np.int64(128))
        print("result", out, int(occ[0]), "compiled", compiled.names)
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("result "), proc.stdout
    # the shipped callees loaded; only the user's own function compiled
    assert "compiled []" in line, line
    assert line.split()[1:3] == ["8", "8"]  # 1 << 3, + first free cell 0; bit 3 set


def test_every_module_with_compiled_code_stamps_the_shipped_code():
    """COMPILED_SOURCES lists every numbakv module that defines compiled code, so an edit to
    any of them makes the shipped code stale."""
    import re
    from pathlib import Path
    root = Path(REPO) / "numbakv"
    pattern = re.compile(r"^\s*@(\w+\.)?(njit|element|_bound_element|cuda_kernel|cuda_device|"
                         r"_?intrinsic|cuda\.jit)\b|= *(_njit_inline|njit)\(", re.M)
    # numbakv/tools (benches, not the library; nothing ships compiled from there) may hold a
    # throwaway module's text with a decorator in it, as bench_generate's numba floor does
    defining = {p.relative_to(root).as_posix() for p in root.rglob("*.py")
                if p.relative_to(root).parts[0] != "tools" and pattern.search(p.read_text())}
    assert defining == set(_jit.COMPILED_SOURCES)


def test_switched_off_or_other_target_compiles_for_the_host(tmp_path):
    """NUMBAKV_PRECOMPILED=0, or NUMBA_CPU_NAME asking for another target, bypass the shipped
    code."""
    code = "from numbakv import _jit; print(_jit.shipped_cache_usable())"
    assert _run(code, tmp_path, NUMBAKV_PRECOMPILED="0").stdout.strip() == "False"
    assert _run(code, tmp_path, NUMBA_CPU_NAME="generic").stdout.strip() == "False"


def test_a_numba_without_the_caching_names_still_imports_and_compiles(tmp_path):
    """numbakv builds on private classes of numba's caching module: a numba that renamed them
    must cost only the shipped code, never `import numbakv`."""
    proc = _run("""
        from numba.core import caching
        del caching._CacheLocator, caching.CompileResultCacheImpl  # unused by numba itself
        import numbakv.cells as cells
        print(type(cells._bit._cache).__name__, cells._bit(3))
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["FunctionCache", "8"]   # numba's own cache, unlayered


def test_build_load_and_stale_source(tmp_path):
    """The mechanism end to end on a throwaway module: the build child ships it, a fresh
    process loads it without compiling, and once the source changes it compiles again."""
    if not _jit._host_has_shipped_level():
        pytest.skip("this host cannot run x86-64-v3 code")
    (tmp_path / "ship").mkdir()
    module = tmp_path / "shipmod.py"
    module.write_text("from numbakv._jit import njit\n\n"
                      "@njit(cache=True)\n"
                      "def twice(x):\n"
                      "    return 2 * x\n")
    code = f"""
        import sys
        from pathlib import Path
        from numbakv import _jit
        _jit.SHIPPED_DIR = Path({str(tmp_path / 'ship')!r})
        sys.path.insert(0, {str(tmp_path)!r})
        from numbakv.tools.precompile import _CompileCounter
        import shipmod
        with _CompileCounter(prefix="") as compiled:
            print("value", shipmod.twice(21))
        print("compiled", len(compiled.names))
        """
    build = _run(code, tmp_path, **{_jit.BUILD_ENV: "1", "NUMBA_CPU_NAME": _jit.SHIPPED_CPU,
                                    "NUMBA_CPU_FEATURES": _jit.SHIPPED_FEATURES})
    assert build.returncode == 0, build.stderr
    assert "value 42" in build.stdout and "compiled 0" not in build.stdout
    assert list((tmp_path / "ship").glob("shipmod.twice-*.nbi"))

    (tmp_path / "other-cache").mkdir()
    load = _run(code, tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "other-cache"))
    assert load.returncode == 0, load.stderr
    assert "value 42" in load.stdout and "compiled 0" in load.stdout, load.stdout

    module.write_text(module.read_text().replace("2 * x", "x + x"))
    (tmp_path / "third-cache").mkdir()
    stale = _run(code, tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "third-cache"))
    assert stale.returncode == 0, stale.stderr
    assert "value 42" in stale.stdout and "compiled 1" in stale.stdout, stale.stdout
