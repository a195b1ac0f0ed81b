"""numbakv's ``@njit``: numba's, plus a cache of compiled code shipped with the package.

Every CPU function of numbakv is a numba ``@njit(cache=True)`` function. Numba compiles each on
first use, per signature, and caches the machine code for the host CPU on disk; on a fresh
install that made the first run of ``numbakv demo`` compile for about 30 s on a 2-core machine
(numba's typing and lowering, not LLVM, take most of it: there is no cheap setting that cuts it).
So numbakv ships the compiled code of its common path in ``numbakv/_precompiled/``, and every
function decorated with this module's :func:`njit` looks for a signature in three places:

1. numba's own cache, as any ``cache=True`` function does (host-tuned code: ``__pycache__``
   beside the sources, numba's user cache or ``NUMBA_CACHE_DIR``);
2. the shipped cache, when it fits this process (:func:`shipped_cache_usable`): x86-64 with
   every feature of the ``x86-64-v3`` level (AVX2, FMA, F16C: x86 server CPUs since 2013), the
   numba version and Python version it was built with, no ``NUMBA_CPU_NAME`` /
   ``NUMBA_CPU_FEATURES`` asking for another target, and ``NUMBAKV_PRECOMPILED`` not ``0``.
   Entries are used only while the modules holding compiled code (:data:`COMPILED_SOURCES`)
   have the content (SHA-256) they were built from, so an edit means compiling again;
3. numba compiles it (``_compile_notice`` prints one line the first time) and saves it to (1).

The shipped code is built by ``numbakv precompile --ship`` (see :mod:`numbakv.tools.precompile`): a
child process with ``NUMBA_CPU_NAME=x86-64-v3`` runs the common path and writes every compiled
signature here, zlib-compressed. Code for that level runs on any CPU that has its features; it
is not tuned to the host's (AVX-512 goes unused). ``numbakv precompile`` without ``--ship``
compiles the same path for the host into numba's own cache instead (a container image can run
it at build time).

Nothing here is on a hot path: the cache is consulted once per function and signature, when
numba would otherwise compile.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import numba
from numba import njit as _numba_njit
from numba.core import caching
from numba.core import config as _nb_config

#: where the shipped compiled code lives (package data)
SHIPPED_DIR = Path(__file__).resolve().with_name("_precompiled")
#: the CPU level the shipped code is compiled for, and its features spelled out: numba keys cache
#: entries by (triple, CPU name, feature string), and the host must have every one of them
SHIPPED_CPU = "x86-64-v3"
SHIPPED_FEATURES = ("+avx,+avx2,+bmi,+bmi2,+cx16,+f16c,+fma,+lzcnt,+movbe,+popcnt,+sahf,+sse3,"
                    "+sse4.1,+sse4.2,+ssse3,+xsave")
#: set (to anything) in the child process that builds the shipped cache
BUILD_ENV = "NUMBAKV_PRECOMPILE_BUILD"
#: ``0`` turns the shipped cache off (numba then compiles for the host)
SWITCH_ENV = "NUMBAKV_PRECOMPILED"


def building_shipped_cache() -> bool:
    """Whether this process is the child that builds the shipped cache."""
    return bool(os.environ.get(BUILD_ENV))


@functools.lru_cache(maxsize=1)
def _host_has_shipped_level() -> bool:
    """Whether the host is x86-64 with every feature in :data:`SHIPPED_FEATURES` (asked once:
    LLVM's feature query costs ~0.4 ms, and every decorated function asks)."""
    try:
        import llvmlite.binding as llvm
        if not llvm.get_process_triple().startswith("x86_64"):
            return False
        host = llvm.get_host_cpu_features()
        return all(host.get(name[1:], False) for name in SHIPPED_FEATURES.split(","))
    except Exception:  # noqa: BLE001 - no feature map: compile for the host instead
        return False


def shipped_cache_usable() -> bool:
    """Whether functions may load the shipped compiled code in this process (see the module
    docstring); the build child answers False (it must compile everything itself)."""
    if building_shipped_cache() or os.environ.get(SWITCH_ENV, "1") == "0":
        return False
    if _nb_config.CPU_NAME is not None or _nb_config.CPU_FEATURES is not None:
        return False  # the user asked numba for another target: give them that
    return _host_has_shipped_level()


#: numbakv's modules that hold compiled code (``@njit``, element functions, kernels, intrinsics),
#: relative to the package; tests/test_precompiled.py keeps this list complete. Compiled code
#: inlines and links code of other modules, so a shipped entry is stamped with all of them: an
#: edit to any one makes every shipped entry stale (numba's own cache only looks at the
#: function's file).
COMPILED_SOURCES = ("attention.py", "cells.py", "pages.py", "storage.py", "kernels/_common.py",
                    "kernels/_registry.py", "kernels/decode.py", "kernels/hadamard.py",
                    "kernels/mask.py", "kernels/mla.py", "kernels/move.py",
                    "kernels/put.py", "kernels/quant.py", "kernels/rope.py", "kernels/rows.py",
                    "step.py")

_SOURCE_HASHES: Dict[str, str] = {}


def _file_hash(path: str) -> str:
    """SHA-256 of a file's bytes, once per file and process."""
    digest = _SOURCE_HASHES.get(path)
    if digest is None:
        with open(path, "rb") as f:
            digest = _SOURCE_HASHES[path] = hashlib.sha256(f.read()).hexdigest()
    return digest


def _source_hash(path: str) -> str:
    """The shipped cache's freshness stamp for a function defined in ``path``: SHA-256 over the
    content of every module in :data:`COMPILED_SOURCES` and of ``path`` (content, not
    modification times, which copies and installs change)."""
    root = Path(__file__).resolve().parent
    parts = [_file_hash(str(root / name)) for name in COMPILED_SOURCES]
    parts.append(_file_hash(path))
    return hashlib.sha256("".join(parts).encode()).hexdigest()


def _numba_base(name: str) -> type:
    """A class of numba's caching module to build on, or ``object`` where a numba version lacks
    it: then constructing the shipped cache fails, :func:`_layer` catches that, and functions
    keep numba's own cache (``import numbakv`` must not depend on numba's private names)."""
    return getattr(caching, name, object)


class _ShippedLocator(_numba_base("_CacheLocator")):
    """Locates a function's entries in :data:`SHIPPED_DIR`, stamped by source content."""

    def __init__(self, py_func, py_file: str) -> None:
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno

    def ensure_cache_path(self) -> None:
        os.makedirs(SHIPPED_DIR, exist_ok=True)

    def get_cache_path(self) -> str:
        return str(SHIPPED_DIR)

    def get_source_stamp(self) -> str:
        return _source_hash(self._py_file)

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        return cls(py_func, py_file)


class _CompressedFile(_numba_base("IndexDataCacheFile")):
    """numba's index + data files, with the data (object code, mostly) zlib-compressed: about
    a third of the bytes in the package."""

    def _save_data(self, name: str, data) -> None:
        path = self._data_path(name)
        with self._open_for_write(path) as f:
            f.write(zlib.compress(self._dump(data), 6))

    def _load_data(self, name: str):
        with open(self._data_path(name), "rb") as f:
            return pickle.loads(zlib.decompress(f.read()))


class _ShippedImpl(_numba_base("CompileResultCacheImpl")):
    """numba's compile-result (de)serialisation with the shipped locator, whatever
    ``NUMBA_CACHE_LOCATOR_CLASSES`` says (that setting is about the user's own cache)."""

    def __init__(self, py_func) -> None:  # pylint: disable=super-init-not-called
        self._lineno = py_func.__code__.co_firstlineno
        source_path = py_func.__code__.co_filename
        self._locator = _ShippedLocator(py_func, source_path)
        modname = os.path.splitext(os.path.basename(source_path))[0]
        self._filename_base = self.get_filename_base(f"{modname}.{py_func.__qualname__}",
                                                     getattr(sys, "abiflags", ""))


class ShippedCache(_numba_base("FunctionCache")):
    """The shipped entries of one function: loaded when :func:`shipped_cache_usable`, written
    only by the build child. Keys name the shipped CPU level, not the host's CPU."""

    _impl_class = _ShippedImpl

    def __init__(self, py_func) -> None:
        super().__init__(py_func)   # numba's Cache makes a plain index/data file: compress it
        plain = self._cache_file
        self._cache_file = _CompressedFile(cache_path=plain._cache_path,
                                           filename_base=self._impl.filename_base,
                                           source_stamp=plain._source_stamp)

    def _index_key(self, sig, codegen):
        sig_key, (triple, _cpu, _features), code_hashes = super()._index_key(sig, codegen)
        return sig_key, (triple, SHIPPED_CPU, SHIPPED_FEATURES), code_hashes

    def _save_overload(self, sig, data) -> None:
        # only code really compiled for the shipped level goes in
        if data.codegen.magic_tuple()[1:] == (SHIPPED_CPU, SHIPPED_FEATURES):
            super()._save_overload(sig, data)


class LayeredCache(_numba_base("_Cache")):
    """numba's own cache first, then the shipped one; compiled code is saved to numba's own
    (or, in the build child, to the shipped one)."""

    def __init__(self, own, py_func) -> None:
        self._own = own
        self._shipped = ShippedCache(py_func)
        self._build = building_shipped_cache()
        self._use_shipped = shipped_cache_usable()

    @property
    def cache_path(self) -> str:
        return self._own.cache_path

    def load_overload(self, sig, target_context):
        if self._build:
            return None  # the build compiles everything it ships
        data = self._own.load_overload(sig, target_context)
        if data is None and self._use_shipped:
            data = self._shipped.load_overload(sig, target_context)
        return data

    def save_overload(self, sig, data) -> None:
        (self._shipped if self._build else self._own).save_overload(sig, data)

    def enable(self) -> None:
        self._own.enable()
        self._shipped.enable()

    def disable(self) -> None:
        self._own.disable()
        self._shipped.disable()

    def flush(self) -> None:
        self._own.flush()


def _layer(dispatcher):
    """Give a ``cache=True`` dispatcher the layered cache over the numba cache it already has;
    any surprise from numba's internals (another numba version) leaves that cache in place."""
    try:
        dispatcher._cache = LayeredCache(dispatcher._cache, dispatcher.py_func)
    except Exception:  # noqa: BLE001 - the plain numba cache still works
        pass
    return dispatcher


def njit(*args: Any, **kwargs: Any) -> Callable:
    """``numba.njit`` with the same arguments; ``cache=True`` functions also look in the shipped
    cache (module docstring). Used as ``@njit``, ``@njit(cache=True, ...)`` or ``njit(fn)``."""
    if not kwargs.get("cache", False):
        return _numba_njit(*args, **kwargs)
    if args and callable(args[0]):
        return _layer(_numba_njit(*args, **kwargs))

    def decorate(fn: Callable) -> Callable:
        return _layer(_numba_njit(*args, **kwargs)(fn))
    return decorate


def shipped_manifest() -> Dict[str, Any]:
    """What the shipped cache holds and whether it fits this process: ``{"usable": bool,
    "numba": version built with (or None), "entries": index files, "stale": index files whose
    source changed since the build}``."""
    entries, stale, version = [], [], None
    for index in sorted(SHIPPED_DIR.glob("*.nbi")):
        entries.append(index.name)
        with open(index, "rb") as f:
            version = pickle.load(f)
            stamp, _ = pickle.loads(f.read())
        source = _module_source(index.name.split(".", 1)[0])
        if source is None or _source_hash(source) != stamp:
            stale.append(index.name)
    return {"usable": shipped_cache_usable(), "numba": version, "numba_here": numba.__version__,
            "python": f"py{sys.version_info[0]}{sys.version_info[1]}", "entries": entries,
            "stale": stale}


def _module_source(module: str) -> Optional[str]:
    """The numbakv source file named ``module`` (a file stem, as in cache file names)."""
    root = Path(__file__).resolve().parent
    for path in (root / f"{module}.py", root / "kernels" / f"{module}.py"):
        if path.exists():
            return str(path)
    return None


__all__ = ["njit", "shipped_cache_usable", "shipped_manifest", "LayeredCache", "ShippedCache",
           "COMPILED_SOURCES", "SHIPPED_DIR", "SHIPPED_CPU", "SHIPPED_FEATURES"]
