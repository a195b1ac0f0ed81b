"""How much memory a cache may still allocate, and the up-front check every cache runs.

The host's limit is the tightest of: ``MemAvailable`` (``/proc/meminfo``), the cgroup memory
limit (v2 ``memory.max`` - ``memory.current``, v1 ``memory.limit_in_bytes`` -
``memory.usage_in_bytes``, over the process's cgroup and its ancestors) and ``RLIMIT_AS`` minus
the address space already mapped (``VmSize``). A GPU's limit is CuPy's free device memory.
Refusing up front turns what would be a ``MemoryError`` half-way through allocation (or an OOM
kill) into a ``ValueError`` that says how much is needed and how much there is.
"""

from __future__ import annotations

import os
from typing import Dict, List, Mapping, Optional, Tuple

#: where /proc and the cgroup file systems are mounted (tests point these at fake trees)
PROC = "/proc"
CGROUP = "/sys/fs/cgroup"
#: cgroup limits at or above this mean "no limit" (v1 writes 2**63 rounded down to a page)
_NO_LIMIT = 1 << 62


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except (OSError, ValueError):
        return None
    if not text or text == "max":
        return None
    try:
        return int(text.split()[0])
    except ValueError:
        return None


def _meminfo_available() -> Optional[int]:
    try:
        with open(os.path.join(PROC, "meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_paths() -> List[Tuple[str, str]]:
    """``(version, path)`` of this process's memory cgroups from ``/proc/self/cgroup``."""
    out = []
    try:
        with open(os.path.join(PROC, "self", "cgroup")) as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                hid, controllers, path = parts
                if hid == "0" and controllers == "":
                    out.append(("v2", path))
                elif "memory" in controllers.split(","):
                    out.append(("v1", path))
    except OSError:
        pass
    return out


def _cgroup_dirs(mount: str, path: str) -> List[str]:
    """The cgroup's directory and its ancestors up to the mount (inside a cgroup namespace the
    process's own cgroup is the mount's root, so that is tried as well)."""
    dirs = []
    rel = path.strip("/")
    while True:
        d = os.path.join(mount, rel) if rel else mount
        if os.path.isdir(d):
            dirs.append(d)
        if not rel:
            break
        rel = os.path.dirname(rel)
    return dirs or ([mount] if os.path.isdir(mount) else [])


def _cgroup_available() -> Optional[Tuple[int, str]]:
    """The smallest ``limit - usage`` over the memory cgroups that bind this process, with the
    file that set it; None when no cgroup limits memory."""
    best: Optional[Tuple[int, str]] = None
    for version, path in _cgroup_paths():
        if version == "v2":
            mount, limit_file, usage_file = CGROUP, "memory.max", "memory.current"
            if not os.path.exists(os.path.join(CGROUP, "cgroup.controllers")):
                mount = os.path.join(CGROUP, "unified")
        else:
            mount, limit_file, usage_file = os.path.join(CGROUP, "memory"), \
                "memory.limit_in_bytes", "memory.usage_in_bytes"
        for d in _cgroup_dirs(mount, path):
            limit = _read_int(os.path.join(d, limit_file))
            if limit is None or limit >= _NO_LIMIT:
                continue
            usage = _read_int(os.path.join(d, usage_file)) or 0
            left = max(0, limit - usage)
            if best is None or left < best[0]:
                best = (left, f"cgroup {version} {os.path.join(d, limit_file)} = {limit} bytes, "
                              f"{usage} in use")
    return best


def _rlimit_available() -> Optional[Tuple[int, str]]:
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    mapped = 0
    try:
        with open(os.path.join(PROC, "self", "status")) as f:
            for line in f:
                if line.startswith("VmSize:"):
                    mapped = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    return max(0, soft - mapped), f"RLIMIT_AS = {soft} bytes, {mapped} mapped"


def host_available() -> Optional[Tuple[int, str]]:
    """``(bytes, what limits it)``: how much more host memory this process may allocate, the
    tightest of MemAvailable, the cgroup limit and RLIMIT_AS; None when nothing can be read."""
    options = []
    avail = _meminfo_available()
    if avail is not None:
        options.append((avail, "MemAvailable in /proc/meminfo"))
    for found in (_cgroup_available(), _rlimit_available()):
        if found is not None:
            options.append(found)
    return min(options, key=lambda o: o[0]) if options else None


def device_available(device: str) -> Optional[Tuple[int, str]]:
    """Free memory of the current CUDA device (``cuda``) or of the host (``cpu``, ``sim``)."""
    if device != "cuda":
        return host_available()
    try:
        import cupy
        return int(cupy.cuda.runtime.memGetInfo()[0]), "free GPU memory (cudaMemGetInfo)"
    except Exception:  # noqa: BLE001 - no readable figure: do not refuse
        return None


def _fmt(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


def check_memory(what: str, device: str, on_device: Mapping[str, int],
                 on_host: Optional[Mapping[str, int]] = None, hint: str = "") -> None:
    """Raise ``ValueError`` when the allocations ``on_device`` (name -> bytes, where the data
    lives: the GPU for ``cuda``, else the host) and ``on_host`` do not fit what is available.
    The message lists every part, the total needed and what is available (and what limits it)."""
    groups: Dict[str, Dict[str, int]] = {}
    if device == "cuda":
        groups["cuda"] = dict(on_device)
        groups["host"] = dict(on_host or {})
    else:
        groups["host"] = {**dict(on_device), **dict(on_host or {})}
    for where, parts in groups.items():
        need = sum(int(v) for v in parts.values())
        if need <= 0:
            continue
        found = device_available("cuda" if where == "cuda" else "cpu")
        if found is None:
            continue
        have, why = found
        if need > have:
            detail = ", ".join(f"{k} {_fmt(int(v))}" for k, v in parts.items() if v)
            raise ValueError(f"{what} needs {_fmt(need)} of {where} memory ({need} bytes: "
                             f"{detail}) but only {_fmt(have)} ({have} bytes) is available "
                             f"({why}){': ' + hint if hint else ''}")


__all__ = ["check_memory", "host_available", "device_available"]


def nbytes_of(obj) -> int:
    """Bytes held by the numpy arrays among ``obj``'s attributes (views of one buffer counted
    once): what a cell table and its indexes occupy, whatever fields it has."""
    import numpy as np
    seen = set()
    total = 0
    for value in vars(obj).values():
        if not isinstance(value, np.ndarray):
            continue
        base = value
        while isinstance(base.base, np.ndarray):
            base = base.base
        if id(base) in seen:
            continue
        seen.add(id(base))
        total += int(base.nbytes)
    return total
