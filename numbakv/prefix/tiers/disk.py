"""Tier 2 of the prefix store: runs kept as files in a directory that outlives the process and
that several processes (one host, or hosts sharing a POSIX file system with working ``flock``)
may share.

Layout of ``directory`` (``disk_dir``)::

    <directory>/t1.<namespace>/          one folder per tier format version and namespace
        lock                             advisory fcntl.flock: writers, evictions, compaction
        index.log                        the index: one line per change, rebuilt by scanning
        runs/<run key>.run               one file per run
        runs/.tmp.<host>.<pid>.<rand>    a run being written (never read)

Anything else in ``<directory>`` (other models' namespaces, other format versions, unrelated
files) is ignored and counted (``stats()["other_namespaces"]``, ``["foreign_files"]``).

A run file is ``b"NKVRUN\\0" + u8 version``, ``u32 header length``, ``u64 payload length`` (little
endian), a JSON header ``{"namespace", "run", "blocks": [block keys]}`` and the payload: the run's
bytes exactly as given (a ``SeqSnapshot.to_bytes()`` safetensors file, whose own crc32 the store
checks). A read is one ``open`` and one ``pread`` of the payload after a 20-byte ``pread`` of the
fixed header.

**Atomicity.** A run is written to a temporary file, fsynced, renamed to its name and the
directory fsynced: a reader (this process or another) opens either the whole file or nothing,
whatever happens to the writer (``kill -9``, power loss after the fsyncs, ``ENOSPC``/``EFBIG``).
A second writer of the same key finds it present under the lock and drops its copy.

**The index** ``index.log`` is append-only text, one change per line, each line ending with the
crc32 of the line (a torn or foreign line is skipped): ``+ <run> <file bytes> <block>,<block>,..``
(stored), ``- <run>`` (removed), ``h <hits> <misses>`` (read counts, for ``numbakv store
stats``). Every process keeps the parsed index in memory and, before each lookup, reads only
what was appended since (one ``stat`` and at most one ``pread``). Stored/removed lines are
written under the lock, so the log is exact there. When the log is missing it is rebuilt by
scanning the run files' headers; when it grows past ~4 lines per live run it is rewritten
(compacted) under the lock and renamed over the old one (readers notice the new inode). Each
construction reconciles the log with the files (a writer killed between its rename and its log
line leaves a file the log lacks; a file deleted by hand leaves a line without a file) and removes
temporary files of dead writers.

**Budget and eviction.** ``budget_bytes`` bounds the total file size of the namespace folder's
runs, for every process sharing it (each should pass the same budget; the smallest wins in
practice since every writer evicts down to its own). Under the lock, a writer evicts runs in
order of file modification time, oldest first, until its run fits; a read sets the file's times
to now (``utime``), so the order is least-recently-*used* across processes (to the file
system's timestamp granularity, a few milliseconds: runs used within one tick leave in key
order).

**Faults.** An unreadable, read-only or non-directory ``directory`` is a ``ValueError`` at
construction; at run time every I/O failure (file gone, permission changed, disk full, lock not
obtained within ``lock_timeout``) is a miss or a refused write, counted in ``stats()["errors"]``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import struct
import time
import zlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from ...state.codec import fsync_dir
from .base import (FORMAT_VERSION, ByteTier, RunReader, check_budget, check_chunks, check_key,
                   check_keys, check_namespace)

__all__ = ["DiskTier", "scan_directory", "clear_directory"]

_MAGIC = b"NKVRUN\0" + bytes([FORMAT_VERSION])
_FIXED = struct.Struct("<8sIQ")          # magic, header length, payload length
_MAX_HEADER = 1 << 24
_DIR_PREFIX = f"t{FORMAT_VERSION}."
_RUN_SUFFIX = ".run"
_TMP_PREFIX = ".tmp."
#: temporary files of a writer that is not known to be dead are removed after this long
_TMP_MAX_AGE = 3600.0
#: rewrite the log when it holds more than this many lines per live run (plus a floor)
_COMPACT_FACTOR, _COMPACT_FLOOR = 4, 1024
#: seconds between appends of this process's hit/miss counts to the log (and at close)
_FLUSH_EVERY = 1.0
_HOST = socket.gethostname().replace(".", "_")[:64] or "host"


class _LockTimeout(OSError):
    pass


def _line(text: str) -> bytes:
    """One index line: ``text``, a space, the crc32 of ``text`` in hex, a newline."""
    raw = text.encode("ascii")
    return raw + b" %08x\n" % zlib.crc32(raw)


#: buffers one ``writev`` call takes at most (POSIX IOV_MAX is at least 16; Linux's 1024)
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16, 1024) \
    if hasattr(os, "writev") else 0


def _writev_all(fd: int, chunks: Sequence[memoryview]) -> None:
    """Write every byte of ``chunks`` in order, as few ``writev`` calls as the OS allows (the
    rows of a run's layers go to the file straight from the snapshot's arrays, never joined
    into one buffer first); short writes are resumed."""
    if _IOV_MAX <= 0:
        for chunk in chunks:
            _write_all(fd, chunk)
        return
    pending = [c for c in chunks if len(c)]
    while pending:
        batch = pending[:_IOV_MAX]
        n = os.writev(fd, batch)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done = 0
        while done < len(batch) and n >= len(batch[done]):
            n -= len(batch[done])
            done += 1
        pending = pending[done:]
        if n:
            pending[0] = pending[0][n:]


def _write_all(fd: int, data) -> None:
    """os.write until every byte of ``data`` is written (a short write is retried; EFBIG/ENOSPC
    raise OSError)."""
    view = memoryview(data)
    pos = 0
    while pos < len(view):
        n = os.write(fd, view[pos:pos + (64 << 20)])
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        pos += n


#: payloads at least this large are read through :func:`_read_bytes`'s huge-page path
_HUGE_READ = 4 << 20
_HUGE = 2 << 20


def _bytes_maker():
    """CPython's ``PyBytes_FromStringAndSize(NULL, n)`` (an uninitialised bytes object) and the
    offset of its data, or None where that is not available (another interpreter)."""
    import ctypes
    import platform
    if platform.python_implementation() != "CPython" or not hasattr(os, "preadv"):
        return None
    try:
        make = ctypes.pythonapi.PyBytes_FromStringAndSize
        make.restype = ctypes.py_object
        make.argtypes = [ctypes.c_char_p, ctypes.c_ssize_t]
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        import mmap
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
    except (AttributeError, OSError):
        return None
    probe = make(None, 8)
    if len(probe) != 8:
        return None
    return make, bytes.__basicsize__ - 1, madvise, advice, ctypes


_MAKER = _bytes_maker()


def _read_bytes(fd: int, n: int, offset: int) -> bytes:
    """``os.pread(fd, n, offset)``, faster for large ``n``: the bytes object is allocated
    uninitialised, its pages advised as transparent huge pages, and the file read straight into
    it (one ``preadv``). A fresh ``bytes`` object (nobody else holds it yet) is filled the way
    CPython itself fills them; the page faults of 4 KiB pages otherwise cost half the time of a
    128 MiB read (``np.fromfile`` gets huge pages from numpy's allocator). Short reads give a
    shorter object, as ``os.pread`` would."""
    if _MAKER is None or n < _HUGE_READ:
        return os.pread(fd, n, offset)
    make, data_offset, madvise, advice, ctypes = _MAKER
    out = make(None, n)
    addr = id(out) + data_offset
    if advice is not None:
        start = (addr + _HUGE - 1) & ~(_HUGE - 1)
        end = (addr + n) & ~(_HUGE - 1)
        if end > start:
            madvise(start, end - start, advice)   # advice only: failure changes nothing
    view = memoryview((ctypes.c_char * n).from_address(addr)).cast("B")
    got = 0
    while got < n:   # one call reads at most ~2 GiB
        step = os.preadv(fd, [view[got:]], offset + got)
        if step <= 0:
            return out[:got]
        got += step
    return out


def _namespace_dir(directory: str, namespace: str) -> str:
    return os.path.join(directory, _DIR_PREFIX + namespace)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _read_header(path: str) -> Tuple[dict, int]:
    """The JSON header and the total size of the run file at ``path``; ``ValueError`` when it
    is not a whole run file of this format version, ``OSError`` when it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        size = st.st_size
        fixed = os.pread(fd, _FIXED.size, 0)
        if len(fixed) != _FIXED.size:
            raise ValueError("shorter than the fixed header")
        magic, hlen, plen = _FIXED.unpack(fixed)
        if magic != _MAGIC:
            raise ValueError("not a numbakv run file of this format version")
        if hlen > _MAX_HEADER or _FIXED.size + hlen + plen != size:
            raise ValueError("sizes in the header do not match the file")
        header = json.loads(os.pread(fd, hlen, _FIXED.size))
    finally:
        os.close(fd)
    if not isinstance(header, dict) or not isinstance(header.get("blocks"), list):
        raise ValueError("malformed header")
    return header, size


def _open_run(path: str, namespace: str, run: str) -> Tuple[int, int, int]:
    """Open the run file at ``path`` for reading: ``(fd, payload length, payload offset)``.

    Never follows a symbolic link (``O_NOFOLLOW``) nor blocks on a FIFO or device
    (``O_NONBLOCK``; anything but a regular file is refused), and binds the bytes to their key:
    the fixed header's sizes must add up to the file's size (a corrupted u64 length never
    reaches the allocator), and the JSON header must name this namespace and ``run``. Raises
    ``FileNotFoundError`` when absent, ``ValueError`` / ``OSError`` otherwise (the fd closed)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        fixed = os.pread(fd, _FIXED.size, 0)
        if len(fixed) != _FIXED.size:
            raise ValueError("shorter than the fixed header")
        magic, hlen, plen = _FIXED.unpack(fixed)
        if magic != _MAGIC:
            raise ValueError("not a numbakv run file of this format version")
        if hlen > _MAX_HEADER or _FIXED.size + hlen + plen != st.st_size:
            raise ValueError("sizes in the header do not match the file")
        header = json.loads(os.pread(fd, hlen, _FIXED.size))
        if not isinstance(header, dict) or header.get("namespace") != namespace \
                or header.get("run") != run:
            raise ValueError("the header names another namespace or run")
        return fd, plen, _FIXED.size + hlen
    except BaseException:
        os.close(fd)
        raise


class _FileRun(RunReader):
    """A run file opened by :meth:`DiskTier.open_run`: reads are ``preadv`` calls from the
    payload's offset straight into the caller's buffers (a cache's rows: no page of the run is
    copied twice). The descriptor stays on the file opened, whatever is renamed over it."""

    def __init__(self, fd: int, base: int, size: int) -> None:
        self._fd, self._base, self.size = fd, base, size

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> bool:
        if self._fd < 0 or offset + sum(len(b) for b in buffers) > self.size:
            return False
        pending = [b for b in buffers if len(b)]
        pos = self._base + offset
        try:
            while pending:
                if hasattr(os, "preadv"):
                    n = os.preadv(self._fd, pending[:_IOV_MAX or 16], pos)
                else:                # no preadv on this platform: one buffer at a time
                    data = os.pread(self._fd, len(pending[0]), pos)
                    n = len(data)
                    pending[0][:n] = data
                if n <= 0:
                    return False     # the file shrank under us: the caller's checksum fails
                pos += n
                while pending and n >= len(pending[0]):
                    n -= len(pending[0])
                    pending.pop(0)
                if n:
                    pending[0] = pending[0][n:]
        except OSError:
            return False
        return True

    def read(self, offset: int, n: int) -> bytes:
        if self._fd < 0:
            return b""
        n = max(0, min(n, self.size - offset))
        try:
            return os.pread(self._fd, n, self._base + offset)
        except OSError:
            return b""

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


class _Index:
    """The parsed ``index.log`` of one namespace folder: ``runs`` (run key -> (file bytes, block
    keys)), ``blocks`` (block key -> (run key, index)), ``used`` (bytes of the runs), the hit and
    miss totals, and how far the log has been read (``ino``, ``off``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1
        self.ino = -1
        self.runs: Dict[str, Tuple[int, Tuple[str, ...]]] = {}
        self.blocks: Dict[str, Tuple[str, int]] = {}
        self.reset()

    def reset(self) -> None:
        self.runs.clear()
        self.blocks.clear()
        self.used = self.lines = self.hits = self.misses = 0
        self.off = 0

    def apply(self, line: bytes) -> None:
        """Apply one complete index line (without its newline); skip it when malformed."""
        body, _, crc = line.rpartition(b" ")
        if len(crc) != 8:
            return
        try:
            if int(crc, 16) != zlib.crc32(body):
                return
            parts = body.decode("ascii").split(" ")
        except (ValueError, UnicodeDecodeError):
            return
        self.lines += 1
        op = parts[0]
        if op == "+" and len(parts) == 4:
            run, size, blocks = parts[1], parts[2], parts[3]
            try:
                check_key(run)
                nbytes = int(size)
                keys = tuple(check_key(b) for b in blocks.split(",")) if blocks else ()
            except ValueError:
                return
            self.add(run, nbytes, keys)
        elif op == "-" and len(parts) == 2:
            self.drop(parts[1])
        elif op == "h" and len(parts) == 3:
            try:
                self.hits += int(parts[1])
                self.misses += int(parts[2])
            except ValueError:
                return

    def add(self, run: str, nbytes: int, keys: Tuple[str, ...]) -> None:
        if run in self.runs:
            self.drop(run)
        self.runs[run] = (nbytes, keys)
        self.used += nbytes
        for i, key in enumerate(keys):
            self.blocks[key] = (run, i)

    def drop(self, run: str) -> None:
        entry = self.runs.pop(run, None)
        if entry is None:
            return
        self.used -= entry[0]
        for key in entry[1]:
            if self.blocks.get(key, (None,))[0] == run:
                del self.blocks[key]

    def refresh(self) -> bool:
        """Bring the in-memory index up to date with the log: read what was appended since the
        last call (a new inode: the log was compacted or rebuilt, read it all). ``False`` when
        the log cannot be read (the index stays as it was)."""
        try:
            st = os.stat(self.path)
        except OSError:   # gone (rebuilt by the caller) or unreadable: keep what we know
            return False
        if st.st_ino != self.ino or st.st_size < self.off:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
                             | os.O_NONBLOCK)
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    return False
            except OSError:
                return False
            if self.fd >= 0:
                os.close(self.fd)
            self.fd = fd
            self.ino = os.fstat(fd).st_ino
            self.reset()
            st = os.fstat(fd)
        if st.st_size == self.off:
            return True
        try:
            chunk = os.pread(self.fd, st.st_size - self.off, self.off)
        except OSError:
            return False
        end = chunk.rfind(b"\n")
        if end < 0:
            return True
        for line in chunk[:end].split(b"\n"):
            self.apply(line)
        self.off += end + 1
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class DiskTier(ByteTier):
    """Runs as files in ``directory`` (see the module docstring for layout, atomicity, the
    shared index, the budget and faults).

    Parameters
    ----------
    namespace : str
        The store's namespace (model fingerprint + layout + head range digest); runs live in
        ``<directory>/t1.<namespace>/``.
    budget_bytes : int
        Upper bound on the bytes of this namespace's run files, for all processes together.
    directory : str or os.PathLike
        Created (with parents) if absent; must be readable and writable.
    lock_timeout : float
        Seconds a write waits for the shared lock before giving up (``False``, counted).
    """

    name = "disk"

    def __init__(self, namespace: str, budget_bytes: int, directory, *,
                 lock_timeout: float = 2.0) -> None:
        check_namespace(namespace)
        check_budget(budget_bytes)
        if isinstance(directory, (bytes, bytearray)) \
                or not isinstance(directory, (str, os.PathLike)):
            raise ValueError(f"directory (disk_dir) must be a str or os.PathLike, "
                             f"got {type(directory).__name__}")
        if not isinstance(lock_timeout, (int, float)) or isinstance(lock_timeout, bool) \
                or not lock_timeout > 0:
            raise ValueError(f"lock_timeout must be a number of seconds > 0, got {lock_timeout!r}")
        super().__init__(namespace, budget_bytes)
        self.directory = os.path.abspath(os.fspath(directory))
        self.lock_timeout = float(lock_timeout)
        self._dir = _namespace_dir(self.directory, namespace)
        self._runs_dir = os.path.join(self._dir, "runs")
        self._log_path = os.path.join(self._dir, "index.log")
        self._lock_fd = -1
        self._ix = _Index(self._log_path)   # the index, parsed from the log
        self._open_checked()
        self._pending = [0, 0]          # hits, misses not yet appended to the log
        self._flushed = 0.0
        self._foreign = 0
        self._others = 0
        try:
            with self._locked():
                self._reconcile()
        except OSError as exc:
            self.close()
            # name the file at fault (os.replace's target is filename2)
            what = exc.filename2 or exc.filename
            raise ValueError(f"directory (disk_dir) {self.directory!r} cannot be used: "
                             + (f"{what}: " if what else "")
                             + f"{exc.strerror or exc}") from exc

    # -- construction --------------------------------------------------------------------------
    def _open_checked(self) -> None:
        """Create/open the folders and the lock file; ``ValueError`` saying what is wrong."""
        where = f"directory (disk_dir) {self.directory!r}"
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ValueError(f"{where} exists and is not a directory")
        try:
            os.makedirs(self._runs_dir, exist_ok=True)
            self._lock_fd = os.open(os.path.join(self._dir, "lock"),
                                    os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            os.listdir(self._runs_dir)
            try:
                mode = os.lstat(self._log_path).st_mode
            except FileNotFoundError:
                mode = stat.S_IFREG
            if not stat.S_ISREG(mode):   # a directory, FIFO or link (never leave the folder)
                raise OSError(errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL,
                              "the index log is not a regular file", self._log_path)
            # a real write probe: os.access says yes to root on a read-only mount
            probe = os.path.join(self._runs_dir, f"{_TMP_PREFIX}{_HOST}.{os.getpid()}.probe")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
            kind = {errno.EACCES: "is not readable and writable (permission denied)",
                    errno.EPERM: "is not readable and writable (operation not permitted)",
                    errno.EROFS: "is on a read-only file system",
                    errno.ENOSPC: "is on a full file system",
                    errno.ENOTDIR: "has a path component that is not a directory"}.get(
                        exc.errno, f"cannot be used ({exc.strerror or exc})")
            what = exc.filename2 or exc.filename or ""     # os.replace's target: filename2
            raise ValueError(f"{where} {kind}: {what}".rstrip(": ")) from exc

    # -- locking -------------------------------------------------------------------------------
    class _Held:
        def __init__(self, tier: "DiskTier", blocking: bool) -> None:
            self.tier, self.blocking = tier, blocking

        def __enter__(self) -> None:
            tier = self.tier
            tier._lock.acquire()
            if tier._lock_fd < 0:
                tier._lock.release()
                raise _LockTimeout(errno.EBADF, "the tier is closed")
            deadline = time.monotonic() + (tier.lock_timeout if self.blocking else 0.0)
            delay = 0.0005
            while True:
                try:
                    fcntl.flock(tier._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        tier._lock.release()
                        raise _LockTimeout(errno.EAGAIN, "the shared lock is held elsewhere")
                    time.sleep(delay)
                    delay = min(delay * 2, 0.02)
                except BaseException:
                    tier._lock.release()
                    raise

        def __exit__(self, *exc) -> None:
            try:
                fcntl.flock(self.tier._lock_fd, fcntl.LOCK_UN)
            finally:
                self.tier._lock.release()

    def _locked(self, blocking: bool = True) -> "DiskTier._Held":
        return DiskTier._Held(self, blocking)

    # -- the index -----------------------------------------------------------------------------
    def _append(self, lines: Sequence[bytes]) -> None:
        """Append index lines (the caller holds the lock for stored/removed lines)."""
        if not lines:
            return
        fd = os.open(self._log_path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                     | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
        try:
            data = b"".join(lines)
            # a line torn by a crash has no newline: start ours on a line of its own
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data
            _write_all(fd, data)
        finally:
            os.close(fd)

    def _write_log(self, runs: Dict[str, Tuple[int, Tuple[str, ...]]], hits: int,
                   misses: int) -> None:
        """Replace the log with one describing ``runs`` (atomic: temp file, fsync, rename)."""
        # beside the runs' temporary files, so a crashed writer's is cleaned up the same way
        tmp = os.path.join(self._runs_dir,
                           f"{_TMP_PREFIX}{_HOST}.{os.getpid()}.{os.urandom(6).hex()}")
        lines = [_line(f"h {hits} {misses}")]
        lines += [_line(f"+ {run} {size} {','.join(keys)}") for run, (size, keys) in runs.items()]
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            try:
                _write_all(fd, b"".join(lines))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self._log_path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _scan_files(self) -> Iterator[os.DirEntry]:
        with os.scandir(self._runs_dir) as it:
            yield from it

    def _reconcile(self) -> None:
        """Under the lock: make the log describe exactly the run files present (rebuilding it by
        scanning when it is missing), drop dead writers' temporary files, count foreign files."""
        have_log = self._ix.refresh()
        present: Dict[str, int] = {}
        foreign = 0
        now = time.time()
        for entry in self._scan_files():
            name = entry.name
            if name.startswith(_TMP_PREFIX):
                self._drop_stale_tmp(entry, now)
                continue
            run = name[:-len(_RUN_SUFFIX)] if name.endswith(_RUN_SUFFIX) else ""
            try:
                check_key(run)
                if not entry.is_file(follow_symlinks=False):
                    raise ValueError("not a regular file")
                present[run] = entry.stat().st_size
            except (ValueError, OSError):
                foreign += 1
        # files the log lacks (or all of them when the log is gone): read their headers
        adds: Dict[str, Tuple[int, Tuple[str, ...]]] = {}
        for run, size in present.items():
            known = self._ix.runs.get(run)
            if known is not None and known[0] == size:
                continue
            try:
                header, size = _read_header(os.path.join(self._runs_dir, run + _RUN_SUFFIX))
                if header.get("namespace") != self.namespace or header.get("run") != run:
                    raise ValueError("another namespace's or key's file")
                keys = tuple(check_key(k) for k in header["blocks"])
            except (ValueError, OSError, TypeError):
                foreign += 1
                continue
            adds[run] = (size, keys)
        gone = [run for run in self._ix.runs if run not in present]
        self._foreign = foreign
        self._others = self._count_other_namespaces()
        if not have_log:
            runs = {run: self._ix.runs[run] for run in present if run in self._ix.runs}
            runs.update(adds)
            self._write_log(runs, self._ix.hits, self._ix.misses)
            self._ix.ino = -1
            self._ix.refresh()
            return
        lines = [_line(f"- {run}") for run in gone]
        lines += [_line(f"+ {run} {size} {','.join(keys)}") for run, (size, keys) in adds.items()]
        self._append(lines)
        self._ix.refresh()
        self._maybe_compact()

    def _drop_stale_tmp(self, entry: os.DirEntry, now: float) -> None:
        parts = entry.name[len(_TMP_PREFIX):].split(".")
        try:
            dead = (len(parts) >= 2 and parts[0] == _HOST and int(parts[1]) != os.getpid()
                    and not _pid_alive(int(parts[1])))
            old = now - entry.stat(follow_symlinks=False).st_mtime > _TMP_MAX_AGE
            if dead or old:
                os.unlink(entry.path)
        except (ValueError, OSError):
            pass

    def _count_other_namespaces(self) -> int:
        try:
            return sum(1 for name in os.listdir(self.directory)
                       if name != _DIR_PREFIX + self.namespace)
        except OSError:
            return 0

    def _maybe_compact(self) -> None:
        """Under the lock: rewrite the log when it is mostly history."""
        if self._ix.lines <= _COMPACT_FACTOR * len(self._ix.runs) + _COMPACT_FLOOR:
            return
        self._write_log(dict(self._ix.runs), self._ix.hits, self._ix.misses)
        self._ix.refresh()

    def _flush_counts(self, force: bool = False) -> None:
        """Append this process's pending hit/miss counts to the log (at most once a second
        unless ``force``), if the lock is free now: a reader never waits for a writer."""
        if not (self._pending[0] or self._pending[1]):
            return
        now = time.monotonic()
        if not force and now - self._flushed < _FLUSH_EVERY:
            return
        self._flushed = now
        try:
            with self._locked(blocking=False):
                self._append([_line(f"h {self._pending[0]} {self._pending[1]}")])
                self._pending = [0, 0]
        except OSError:
            pass

    # -- the protocol --------------------------------------------------------------------------
    def _path(self, run: str) -> str:
        return os.path.join(self._runs_dir, run + _RUN_SUFFIX)

    def find_blocks(self, block_keys: Sequence[str]) -> List[Optional[Tuple[str, int]]]:
        keys = check_keys(block_keys, "block_keys")
        with self._lock:
            if self._closed:
                out: List[Optional[Tuple[str, int]]] = [None] * len(keys)
            else:
                if not self._ix.refresh():
                    self._count("errors")
                    if not os.path.exists(self._log_path):
                        try:  # the log was deleted: rebuild it by scanning
                            with self._locked():
                                self._reconcile()
                        except OSError:
                            pass
                get = self._ix.blocks.get
                out = [get(k) for k in keys]
            found = sum(1 for x in out if x is not None)
            self._counts["block_hits"] += found
            self._counts["block_misses"] += len(keys) - found
        return out

    def read_runs(self, run_keys: Sequence[str]) -> List[Optional[bytes]]:
        runs = check_keys(run_keys, "run_keys")
        out: List[Optional[bytes]] = []
        errors = 0
        with self._lock:
            closed = self._closed
            if not closed:
                self._ix.refresh()
            # only runs the index lists: a file under a run's name that no writer of this
            # namespace logged (copied in, another model's) is never served
            known = [not closed and run in self._ix.runs for run in runs]
        bad, gone = [], []
        for run, listed in zip(runs, known):
            data = self._read_one(run) if listed else None
            if data is None and listed:
                gone.append(run)
            if data is False:
                errors += 1
                bad.append(run)
                data = None
            out.append(data)
        for run in bad:   # not a whole run of ours: drop it, so neither a lookup nor a
            self.report_invalid(run)   # rewrite of the same key trusts it again
        for run in gone:  # listed but its file is gone (deleted by hand): unlist it, so
            self.remove_run(run)       # lookups stop promising it
        hits = sum(1 for x in out if x is not None)
        with self._lock:
            self._counts["hits"] += hits
            self._counts["misses"] += len(runs) - hits
            self._counts["errors"] += errors
            if not closed:
                self._pending[0] += hits
                self._pending[1] += len(runs) - hits
                self._flush_counts()
        return out

    def open_run(self, run_key: str) -> Optional[RunReader]:
        """The run's file opened for reads straight into the caller's buffers (see
        :class:`_FileRun`), its header checked as :meth:`read_runs` checks it (a file that is
        not a whole run of ours is dropped); counted as a read."""
        run = check_key(run_key, "run_key")
        with self._lock:
            closed = self._closed
            if not closed:
                self._ix.refresh()
            listed = not closed and run in self._ix.runs
        reader: Optional[RunReader] = None
        bad = False
        if listed:
            try:
                fd, plen, offset = _open_run(self._path(run), self.namespace, run)
                reader = _FileRun(fd, offset, plen)
                try:
                    os.utime(fd)  # least recently *used*: a read makes the run young again
                except OSError:
                    pass
            except FileNotFoundError:   # listed, file gone (deleted by hand): unlist it
                self.remove_run(run)
            except (OSError, ValueError):
                bad = True
        if bad:
            self.report_invalid(run)
        hit = reader is not None
        with self._lock:
            self._counts["hits"] += hit
            self._counts["misses"] += not hit
            self._counts["errors"] += bad
            if not closed:
                self._pending[0] += hit
                self._pending[1] += not hit
                self._flush_counts()
        return reader

    def _read_one(self, run: str):
        """The payload of ``run``'s file; ``None`` when absent, ``False`` on an I/O error or a
        file that is not a whole run of ours (see :func:`_open_run`)."""
        try:
            fd, plen, offset = _open_run(self._path(run), self.namespace, run)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return False
        try:
            data = _read_bytes(fd, plen, offset)
            if len(data) != plen:
                return False
            try:
                os.utime(fd)  # least recently *used*: a read makes the run young again
            except OSError:
                pass
            return data
        except (OSError, MemoryError, OverflowError):
            return False
        finally:
            os.close(fd)

    def write_run(self, run_key: str, block_keys: Sequence[str], data: bytes) -> bool:
        run = check_key(run_key, "run_key")
        keys = check_keys(block_keys, "block_keys")
        chunks = check_chunks(data)
        header = json.dumps({"namespace": self.namespace, "run": run, "blocks": keys},
                            separators=(",", ":")).encode()
        payload = sum(len(c) for c in chunks)
        size = _FIXED.size + len(header) + payload
        if self._closed or size > self.budget_bytes:
            return False
        with self._lock:
            self._ix.refresh()
            if self._stored(run, keys):
                return True
        tmp = os.path.join(self._runs_dir,
                           f"{_TMP_PREFIX}{_HOST}.{os.getpid()}.{os.urandom(6).hex()}")
        try:
            self._write_tmp(tmp, header, chunks, payload)
            with self._locked():
                self._ix.refresh()
                if self._stored(run, keys):
                    os.unlink(tmp)          # another writer stored it meanwhile
                    return True
                if not self._make_room(size, keep=run):
                    os.unlink(tmp)
                    return False
                os.replace(tmp, self._path(run))
                self._fsync_dir()
                self._append([_line(f"+ {run} {size} {','.join(keys)}")])
                self._ix.refresh()
                self._maybe_compact()
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._count("errors")
            return False
        self._count("writes")
        return True

    def _write_tmp(self, tmp: str, header: bytes, chunks: List[memoryview],
                   payload: int) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            # one writev: the fixed header, the JSON header and the payload's pieces as given
            _writev_all(fd, [memoryview(_FIXED.pack(_MAGIC, len(header), payload) + header),
                             *chunks])
            os.fsync(fd)
        finally:
            os.close(fd)

    def _fsync_dir(self) -> None:
        fsync_dir(self._runs_dir)

    def _stored(self, run: str, keys: Sequence[str]) -> bool:
        """Whether ``run`` is stored with exactly ``keys``, every one of them pointing to it,
        and its file still whole (then made young again): a rewrite can be skipped."""
        entry = self._ix.runs.get(run)
        blocks = self._ix.blocks
        return entry is not None and entry[1] == tuple(keys) \
            and all(blocks.get(k) == (run, i) for i, k in enumerate(keys)) and self._touch(run)

    def _touch(self, run: str) -> bool:
        """Make ``run`` young again if its file is still a regular file of the size the index
        records (a truncated or replaced one is written again instead)."""
        entry = self._ix.runs.get(run)
        try:
            st = os.stat(self._path(run), follow_symlinks=False)
            if entry is None or not stat.S_ISREG(st.st_mode) or st.st_size != entry[0]:
                return False
            os.utime(self._path(run), follow_symlinks=False)
            return True
        except (OSError, NotImplementedError):
            return False

    def _make_room(self, size: int, keep: str) -> bool:
        """Under the lock (index fresh): evict least-recently-used runs until ``size`` more
        bytes fit the budget. ``False`` when they cannot."""
        old = self._ix.runs.get(keep)
        need = self._ix.used - (old[0] if old else 0) + size - self.budget_bytes
        if need <= 0:
            return True
        ages = []
        for run, (nbytes, _) in self._ix.runs.items():
            if run == keep:
                continue
            try:
                ages.append((os.stat(self._path(run)).st_mtime_ns, run, nbytes))
            except FileNotFoundError:
                ages.append((-1, run, nbytes))   # already gone: free in the books first
        ages.sort()
        victims = []
        for _, run, nbytes in ages:
            if need <= 0:
                break
            victims.append(run)
            need -= nbytes
        if need > 0:
            return False
        for run in victims:
            try:
                os.unlink(self._path(run))
            except FileNotFoundError:
                pass
        self._append([_line(f"- {run}") for run in victims])
        self._ix.refresh()
        self._count("evictions", len(victims))
        return True

    def remove_run(self, run_key: str) -> None:
        run = check_key(run_key, "run_key")
        try:
            with self._locked():
                self._ix.refresh()
                try:
                    os.unlink(self._path(run))
                except FileNotFoundError:
                    pass
                if run in self._ix.runs:
                    self._append([_line(f"- {run}")])
                    self._ix.refresh()
        except OSError:
            self._count("errors")

    def clear(self) -> int:
        try:
            with self._locked():
                self._ix.refresh()
                removed = 0
                for entry in self._scan_files():
                    name = entry.name
                    if name.endswith(_RUN_SUFFIX) or name.startswith(_TMP_PREFIX):
                        try:
                            os.unlink(entry.path)
                            removed += name.endswith(_RUN_SUFFIX)
                        except OSError:
                            self._count("errors")
                self._write_log({}, self._ix.hits, self._ix.misses)
                self._ix.refresh()
                return removed
        except OSError:
            self._count("errors")
            return 0

    def stats(self) -> dict:
        with self._lock:
            if not self._closed:
                self._ix.refresh()
            out = self._budget_stats(self._ix.used, len(self._ix.runs))
            out.update(other_namespaces=self._others, foreign_files=self._foreign,
                       hits_all_processes=self._ix.hits + self._pending[0],
                       misses_all_processes=self._ix.misses + self._pending[1],
                       directory=self._dir)
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._lock_fd >= 0:
                self._flush_counts(force=True)
            super().close()
            self._ix.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    def __del__(self) -> None:
        try:
            if getattr(self, "_lock_fd", -1) >= 0:
                os.close(self._lock_fd)
            if getattr(self, "_ix", None) is not None:
                self._ix.close()
        except Exception:
            pass


# -- whole-directory operations (numbakv store stats / clear) ----------------------------------
def _namespaces(directory: str) -> List[str]:
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise ValueError(f"directory {directory!r} cannot be read: {exc.strerror or exc}") from exc
    out = []
    for name in names:
        if name.startswith(_DIR_PREFIX) and os.path.isdir(os.path.join(directory, name)):
            try:
                out.append(check_namespace(name[len(_DIR_PREFIX):]))
            except ValueError:
                pass
    return out


def _fingerprint_summary(directory: str, namespace: str) -> Optional[dict]:
    """The model fingerprint recorded in one run of ``namespace`` (its safetensors metadata),
    or None when no run is readable."""
    runs = os.path.join(_namespace_dir(directory, namespace), "runs")
    try:
        names = [n for n in os.listdir(runs) if n.endswith(_RUN_SUFFIX)]
    except OSError:
        return None
    for name in names[:4]:
        try:
            fd = os.open(os.path.join(runs, name), os.O_RDONLY)
            try:
                magic, hlen, plen = _FIXED.unpack(os.pread(fd, _FIXED.size, 0))
                start = _FIXED.size + hlen
                n = int.from_bytes(os.pread(fd, 8, start), "little")
                if n > _MAX_HEADER:
                    continue
                st_header = json.loads(os.pread(fd, n, start + 8))
            finally:
                os.close(fd)
            meta = st_header.get("__metadata__", {})
            config = json.loads(meta.get("config", "{}"))
            fp = config.get("fingerprint", config)
            if isinstance(fp, dict) and "meta.model_id" in meta:
                fp = {"model_id": meta["meta.model_id"], **fp}   # the store's model identity
            return fp if isinstance(fp, dict) else None
        except (OSError, ValueError, struct.error, AttributeError):
            continue
    return None


def scan_directory(directory) -> dict:
    """What ``directory`` holds, per namespace: ``{"namespaces": {ns: {"entries", "bytes",
    "hits", "misses", "fingerprint"}}, "entries", "bytes", "foreign"}`` (read-only; for
    ``numbakv store stats``). ``ValueError`` when the directory cannot be read."""
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise ValueError(f"directory {directory!r} does not exist or is not a directory")
    out: dict = {"namespaces": {}, "entries": 0, "bytes": 0}
    namespaces = _namespaces(directory)
    out["foreign"] = len(os.listdir(directory)) - len(namespaces)
    for ns in namespaces:
        # read-only: parse the log without taking the lock or writing anything
        ix = _Index(os.path.join(_namespace_dir(directory, ns), "index.log"))
        ix.refresh()
        ix.close()
        entries, nbytes = len(ix.runs), ix.used
        out["namespaces"][ns] = {"entries": entries, "bytes": nbytes, "hits": ix.hits,
                                 "misses": ix.misses,
                                 "fingerprint": _fingerprint_summary(directory, ns)}
        out["entries"] += entries
        out["bytes"] += nbytes
    return out


def clear_directory(directory, namespace: Optional[str] = None) -> Dict[str, int]:
    """Remove the runs of every namespace in ``directory`` (or those whose namespace starts with
    / contains ``namespace``), under each namespace's lock; returns ``{namespace: runs removed}``.
    Files that are not numbakv's are left alone."""
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise ValueError(f"directory {directory!r} does not exist or is not a directory")
    out: Dict[str, int] = {}
    for ns in _namespaces(directory):
        if namespace and namespace not in ns:
            continue
        with DiskTier(ns, 0, directory) as tier:
            out[ns] = tier.clear()
    return out
