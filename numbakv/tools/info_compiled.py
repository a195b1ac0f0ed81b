"""``numbakv info``'s "compiled code" rows: which compiled code serves this interpreter, and why.

numbakv's CPU functions are numba ``@njit(cache=True)``; each signature is served, in order, by
numba's own on-disk cache (host-tuned), by the compiled code shipped in the package (when it
fits this process, see :mod:`numbakv._jit`), or by compiling on first use. These rows say which
applies here and name the reason when the shipped code does not.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Tuple


def _shipped_python(entries: List[str]) -> str:
    """``"3.11"`` from entry names like ``cells._bit-116.py311.nbi``."""
    tags = {name.split(".py")[-1].split(".")[0] for name in entries if ".py" in name}
    if len(tags) != 1:
        return "?"
    tag = tags.pop()
    return f"{tag[0]}.{tag[1:]}"


def numba_cache_dir() -> Tuple[str, str]:
    """Where numba's own cache keeps numbakv's compiled functions, and why there."""
    from numba.core import config as nb_config
    pkg = Path(__file__).resolve().parents[1]
    if nb_config.CACHE_DIR:
        return str(Path(nb_config.CACHE_DIR)), "NUMBA_CACHE_DIR"
    if os.access(pkg, os.W_OK):
        return str(pkg / "__pycache__"), "beside the sources (writable)"
    from numba.misc.appdirs import AppDirs
    return str(Path(AppDirs(appname="numba", appauthor=False).user_cache_dir)), \
        "numba's user cache (the package directory is read-only)"


def _cached_count(root: str) -> int:
    """numbakv functions with an index in numba's cache under ``root``."""
    path = Path(root)
    if not path.is_dir():
        return 0
    names = {"attention", "cells", "pages", "storage", "_common", "_registry", "mask", "move",
             "put", "quant", "rope"}
    return sum(1 for p in path.rglob("*.nbi") if p.name.split(".", 1)[0] in names)


def shipped_status() -> str:
    """One line: the shipped compiled code's state here and why (in use / not for this Python,
    numba or CPU / switched off / stale)."""
    from numbakv import _jit
    from numba.core import config as nb_config
    m = _jit.shipped_manifest()
    if not m["entries"]:
        return "none shipped in this install: every function compiles on first use"
    py = _shipped_python(m["entries"])
    here_py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    what = f"{len(m['entries'])} functions for {_jit.SHIPPED_CPU}, CPython {py}, numba {m['numba']}"
    if os.environ.get(_jit.SWITCH_ENV, "1") == "0":
        return (f"shipped ({what}) but switched off by {_jit.SWITCH_ENV}=0: numba compiles "
                "host-tuned code on first use")
    if nb_config.CPU_NAME is not None or nb_config.CPU_FEATURES is not None:
        return (f"shipped ({what}) but not used: NUMBA_CPU_NAME/NUMBA_CPU_FEATURES ask for "
                "another target")
    if py != here_py:
        return (f"shipped ({what}) but not for this Python ({here_py}): every function "
                "compiles on first use")
    if m["numba"] != m["numba_here"]:
        return (f"shipped ({what}) but not for this numba ({m['numba_here']}): every function "
                "compiles on first use")
    if not _jit._host_has_shipped_level():
        return (f"shipped ({what}) but this CPU lacks {_jit.SHIPPED_CPU} (AVX2, FMA, F16C): "
                "every function compiles on first use")
    if m["stale"]:
        if len(m["stale"]) == len(m["entries"]):
            return (f"shipped ({what}) but stale: numbakv's compiled modules changed since it "
                    "was built (a source checkout; `numbakv precompile --ship` rebuilds it), so "
                    "every function compiles on first use")
        return (f"shipped, in use ({what}); {len(m['stale'])} stale entries compile on first "
                "use")
    return f"shipped, in use ({what})"


def rows() -> List[Tuple[str, str]]:
    """``numbakv info``'s rows about compiled code."""
    where, why = numba_cache_dir()
    n = _cached_count(where)
    cached = (f"{where} ({why}): {n} numbakv functions cached" if n else
              f"{where} ({why}): empty - what the shipped code does not serve compiles on "
              "first use (one line on stderr says so; up to a few minutes for everything on 2 "
              "cores) and is cached there")
    return [("compiled code", shipped_status()), ("numba cache", cached)]


__all__ = ["shipped_status", "numba_cache_dir", "rows"]
