"""The numbakv state codec: file and bytes framing, hostile-input parsing and atomic writes.

States are `safetensors <https://github.com/huggingface/safetensors>`_: an 8-byte little-endian
header length, a JSON header (tensor dtypes, shapes and byte ranges, plus string metadata) and
the raw tensor bytes. This module writes them (``_Spec``: one tensor produced on demand, so only
one is on the host at a time; ``_atomic_write``: a temporary file renamed over the target, so a
save either fully happens or leaves the old file) and reads them (``_Opened`` / ``_parse``: a
file is read into memory once, never mapped; every structural property safetensors' parser
checks, plus numbakv's envelope: format, version, kind, config JSON, checksum field; any failure
is a ``StateError``, never a crash).

It never sees a cache: what the tensors mean for each kind of cache is ``files.py``'s job.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import stat
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import KVCacheError, StateError


def crc32(data, value: int = 0) -> int:
    """zlib's ``crc32(data, value)``, computed by ISA-L's (python-isal) where it is installed: the
    same CRC-32 values with SIMD carry-less multiplication at ~4x zlib's speed on x86-64 and
    arm64. The checksum is the only pass over the rows when a run is read straight into the
    cells, so it bounds a tier's load; the file format is unchanged (old files read, new files
    read without it). isal (optional: the `fast` and `test` extras) is imported at the first
    checksum, not with numbakv: its two extension modules cost ~0.4 MiB of RSS in every process,
    most of which never saves or loads a state; this function then rebinds the module's name to
    the implementation itself, so later calls go straight to it."""
    global crc32
    try:
        from isal.isal_zlib import crc32 as implementation
    except ImportError:  # zlib's computes the same values
        from zlib import crc32 as implementation
    crc32 = implementation
    return implementation(data, value)

#: ``format`` metadata value of every numbakv state.
FORMAT = "numbakv.state"
#: The format version this module writes and reads.
VERSION = "1"
#: With ``progress=None``, saves and loads of at least this many tensor bytes show a progress bar.
PROGRESS_THRESHOLD = 64 << 20
#: safetensors' own limit on the JSON header.
MAX_HEADER_BYTES = 100_000_000
#: Largest valid position (Ollama's math.MaxInt32 is "no position").
_POS_LIMIT = 2**31 - 1
#: Bytes handed to the checksum at a time while verifying.
_CHUNK = 16 << 20

#: safetensors dtype name -> little-endian numpy dtype (BF16 read as its 16-bit pattern).
_ST_DTYPES: Dict[str, np.dtype] = {
    "BOOL": np.dtype("|b1"), "U8": np.dtype("|u1"), "I8": np.dtype("|i1"),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"), "U32": np.dtype("<u4"), "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"), "U64": np.dtype("<u8"), "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
}
#: numbakv storage dtype name -> safetensors dtype name.
_STORAGE_ST = {"float16": "F16", "float32": "F32", "bfloat16": "BF16"}
_CAUSAL_KINDS = ("causal", "causal-seq")
_WRAPPER_KINDS = ("wrapper", "wrapper-seq")
_STREAM_KINDS = ("streams",)
_SIMPLE_KINDS = ("step", "rotating", "simple-list")
#: one sequence's rows of any cache (``numbakv.state.snapshot.SeqSnapshot.to_bytes``)
_SNAPSHOT_KINDS = ("seq-snapshot",)
#: recurrent state (``numbakv.RecurrentCache``) and attention + recurrent (``numbakv.HybridCache``)
_RECURRENT_KINDS = ("recurrent", "recurrent-seq", "hybrid", "hybrid-seq")
KINDS = _CAUSAL_KINDS + _WRAPPER_KINDS + _STREAM_KINDS + _SIMPLE_KINDS + _SNAPSHOT_KINDS + \
    _RECURRENT_KINDS

Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]
# ====================================================================================== writing
@dataclass
class _Spec:
    """One tensor to write: its name, safetensors dtype, shape and a function giving its bytes
    as a C-contiguous host array (called once, in file order, so only one tensor is alive)."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ST_DTYPES[self.dtype].itemsize


def _host_le(arr, dtype: np.dtype) -> np.ndarray:
    """A C-contiguous little-endian host copy (or view) of a numpy/CuPy array."""
    if not isinstance(arr, np.ndarray):  # CuPy: device -> host, one tensor at a time
        import cupy
        arr = cupy.ascontiguousarray(arr).get()
    return np.ascontiguousarray(arr, dtype=dtype)


def _canonical(header: dict) -> bytes:
    """The header as the checksum sees it: without the checksum itself, keys sorted, no
    whitespace, so any change of meaning changes it and nothing else does."""
    meta = dict(header.get("__metadata__", {}))
    meta.pop("checksum", None)
    stripped = dict(header)
    stripped["__metadata__"] = meta
    return json.dumps(stripped, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True).encode("ascii")


def _header_bytes(header: dict) -> bytes:
    """The header as written: compact JSON padded with spaces so the data starts 8-aligned (the
    8-byte length prefix + the header is a multiple of 8, as safetensors writes it)."""
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return raw + b" " * (-len(raw) % 8)


def _progress_bar(total: int, progress: Optional[bool], desc: str):
    """A tqdm bar over ``total`` bytes, or None. ``progress=None``: shown when ``total`` reaches
    ``PROGRESS_THRESHOLD`` and stderr is a terminal."""
    if progress is False or (progress is None and total < PROGRESS_THRESHOLD):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                disable=None if progress is None else False, leave=False)


def _write(out, metadata: Dict[str, str], specs: Sequence[_Spec],
           progress: Optional[bool], preallocate: bool = False) -> int:
    """Write a safetensors stream to the seekable binary file ``out``; returns its size.

    The header goes first with a placeholder checksum of the final length; once every tensor
    has passed through the checksum the header is written again in place. ``preallocate``
    sizes an in-memory ``out`` once instead of letting it grow by reallocation."""
    header: Dict[str, Any] = {"__metadata__": dict(metadata, checksum="crc32:00000000")}
    offset = 0
    for spec in specs:
        end = offset + spec.nbytes
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                             "data_offsets": [offset, end]}
        offset = end
    total = offset
    head = _header_bytes(header)
    start = out.tell()
    if preallocate:
        out.seek(start + 8 + len(head) + total - 1)
        out.write(b"\0")
        out.seek(start)
    out.write(len(head).to_bytes(8, "little"))
    out.write(head)
    crc = crc32(_canonical(header))
    bar = _progress_bar(total, progress, "saving state")
    try:
        for spec in specs:
            arr = spec.produce()
            data = memoryview(arr).cast("B") if arr.size else b""
            if len(data) != spec.nbytes:  # a bug here, never the caller's input
                raise KVCacheError(f"tensor {spec.name} produced {len(data)} bytes, expected "
                                   f"{spec.nbytes}")
            crc = crc32(data, crc)
            out.write(data)
            del data, arr
            if bar is not None:
                bar.update(spec.nbytes)
    finally:
        if bar is not None:
            bar.close()
    header["__metadata__"]["checksum"] = f"crc32:{crc:08x}"
    final = _header_bytes(header)
    assert len(final) == len(head)
    end = out.tell()
    out.seek(start + 8)
    out.write(final)
    out.seek(end)
    return end - start


def _atomic_write(path, write: Callable[[Any], Any]) -> None:
    """Run ``write(file)`` on a temporary file beside ``path``, fsync it and rename it over
    ``path``; on any failure the temporary file is removed and ``path`` is untouched."""
    path = _check_path(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".numbakv-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _file_mode(path))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)  # make the rename itself durable where the platform allows it


def fsync_dir(directory: str) -> None:
    """fsync a directory, so a rename into it survives a crash; a platform or file system
    that cannot (no O_RDONLY directory handles, fsync refused) is left as it is."""
    try:
        dfd = os.open(directory, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _file_mode(path: str) -> int:
    """The mode a plainly created file would get (mkstemp makes 0600): the old file's mode when
    it is replaced, else 0666 minus the umask."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


_BYTES_LIKE = (bytes, bytearray, memoryview)


def _check_data(data) -> None:
    """``data`` of the ``*_from_bytes`` calls must be bytes-like."""
    if not isinstance(data, _BYTES_LIKE):
        raise ValueError(f"data must be bytes-like, got {type(data).__name__}")


def _check_source(source) -> Source:
    """A ``Source``: bytes-like data as it is, anything else checked as a path."""
    return source if isinstance(source, _BYTES_LIKE) else _check_path(source)


def _check_path(path) -> str:
    if isinstance(path, _BYTES_LIKE) or not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return os.fspath(path)


def _base_metadata(kind: str, config: dict,
                   metadata: Optional[Mapping[str, str]]) -> Dict[str, str]:
    meta = {"format": FORMAT, "version": VERSION, "kind": kind,
            "config": json.dumps(config, sort_keys=True)}
    for key, value in _check_metadata(metadata).items():
        meta["meta." + key] = value
    return meta


def _check_metadata(metadata) -> Dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ValueError(f"metadata must be a mapping of str to str, got {type(metadata).__name__}")
    out = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError("metadata keys and values must be str, got "
                             f"{key!r}: {type(value).__name__}")
        out[key] = value
    return out


def _check_tokens(tokens) -> Optional[np.ndarray]:
    """Tokens as an int64 ``[t]`` host array (None stays None)."""
    if tokens is None:
        return None
    if hasattr(tokens, "get") and type(tokens).__module__.split(".")[0] == "cupy":
        tokens = tokens.get()
    try:
        arr = np.asarray(tokens)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"tokens must be a 1-D sequence of integers: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype == object:
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))
                   for t in arr):
            raise ValueError("tokens must hold integers")
        try:
            return arr.astype(np.int64)
        except OverflowError:
            raise ValueError("tokens must fit in int64") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.max() > np.iinfo(np.int64).max:
        raise ValueError("tokens must fit in int64")
    return arr.astype(np.int64)


def _tokens_spec(tokens: Optional[np.ndarray], prefix: str = "") -> List[_Spec]:
    if tokens is None:
        return []
    return [_Spec(prefix + "tokens", "I64", (len(tokens),), lambda: _host_le(tokens, "<i8"))]


def _save(path, build: Callable[[], Tuple[Dict[str, str], List[_Spec]]],
          progress: Optional[bool]) -> None:
    path = _check_path(path)
    _check_progress(progress)
    meta, specs = build()  # every input check happens here, before a file is created
    try:
        _atomic_write(path, lambda f: _write(f, meta, specs, progress))
    except OSError as exc:  # missing directory, no permission, a directory in the way, ENOSPC
        raise StateError(f"state file {path!r}: cannot write it: {_os_reason(exc)}") from exc


def _os_reason(exc: OSError) -> str:
    return f"{type(exc).__name__}: {exc.strerror or exc}"


def _to_chunks(build: Callable[[], Tuple[Dict[str, str], List[_Spec]]]) -> List[memoryview]:
    """The bytes ``_to_bytes`` would return, as a list of flat byte views: the 8-byte length
    and the header first, then each tensor's bytes in file order, where possible views of the
    arrays themselves (a C-contiguous little-endian host array is not copied). What a byte tier
    writes with one ``writev`` (or sends as one value) without joining them first: the only
    pass over the data here is the crc32."""
    meta, specs = build()
    header: Dict[str, Any] = {"__metadata__": dict(meta, checksum="crc32:00000000")}
    offset = 0
    for spec in specs:
        end = offset + spec.nbytes
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                             "data_offsets": [offset, end]}
        offset = end
    crc = crc32(_canonical(header))
    chunks: List[memoryview] = []
    for spec in specs:
        arr = spec.produce()
        data = memoryview(arr).cast("B") if arr.size else memoryview(b"")
        if len(data) != spec.nbytes:  # a bug here, never the caller's input
            raise KVCacheError(f"tensor {spec.name} produced {len(data)} bytes, expected "
                               f"{spec.nbytes}")
        crc = crc32(data, crc)
        if len(data):
            chunks.append(data)
    header["__metadata__"]["checksum"] = f"crc32:{crc:08x}"
    head = _header_bytes(header)
    return [memoryview(len(head).to_bytes(8, "little") + head)] + chunks


def _to_bytes(build: Callable[[], Tuple[Dict[str, str], List[_Spec]]],
              progress: Optional[bool]) -> bytes:
    _check_progress(progress)
    meta, specs = build()
    out = io.BytesIO()
    _write(out, meta, specs, progress, preallocate=True)
    return out.getvalue()


# ====================================================================================== reading
@dataclass
class _Tensor:
    dtype: str
    shape: Tuple[int, ...]
    begin: int
    end: int


class _State:
    """A parsed, structurally valid safetensors buffer (file mapping or bytes).

    ``tensor(name)`` is a read-only zero-copy numpy view of the buffer."""

    def __init__(self, buf: memoryview, what: str, header: dict, data_start: int) -> None:
        self.buf = buf
        self.what = what
        self.header = header
        self.metadata: Dict[str, str] = header.get("__metadata__", {})
        self.tensors: Dict[str, _Tensor] = {}
        for name, info in header.items():
            if name != "__metadata__":
                self.tensors[name] = _Tensor(info["dtype"], tuple(info["shape"]),
                                             *info["data_offsets"])
        self.data_start = data_start
        self.kind = ""
        self.config: dict = {}

    @property
    def data_bytes(self) -> int:
        return len(self.buf) - self.data_start

    def tensor(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        dtype = _ST_DTYPES[t.dtype]
        count = math.prod(t.shape)
        if count == 0:
            return np.zeros(t.shape, dtype)
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.data_start + t.begin)
        return arr.reshape(t.shape)

    def fail(self, message: str) -> StateError:
        return StateError(f"{self.what}: {message}")

    def expect(self, expected: Mapping[str, Tuple[str, Tuple[int, ...]]],
               optional: Iterable[str] = ()) -> None:
        """The tensors must be exactly ``expected`` (name -> (dtype, shape)) plus any of
        ``optional`` names."""
        names = set(self.tensors)
        missing = sorted(set(expected) - names)
        extra = sorted(names - set(expected) - set(optional))
        if missing:
            raise self.fail(f"tensor(s) {_short(missing)} missing")
        if extra:
            raise self.fail(f"unexpected tensor(s) {_short(extra)}")
        for name, (dtype, shape) in expected.items():
            t = self.tensors[name]
            if t.dtype != dtype:
                raise self.fail(f"tensor {name} has dtype {t.dtype}, expected {dtype}")
            if tuple(t.shape) != tuple(shape):
                raise self.fail(f"tensor {name} has shape {list(t.shape)}, expected "
                                f"{list(shape)}")

    def tokens(self, prefix: str = "") -> Optional[List[int]]:
        name = prefix + "tokens"
        if name not in self.tensors:
            return None
        t = self.tensors[name]
        if t.dtype != "I64" or len(t.shape) != 1:
            raise self.fail(f"tensor {name} must have dtype I64 and shape [t], got {t.dtype} "
                            f"{list(t.shape)}")
        return self.tensor(name).tolist()

    def user_metadata(self) -> Dict[str, str]:
        return {k[5:]: v for k, v in self.metadata.items() if k.startswith("meta.")}

    def verify_checksum(self, bar=None) -> None:
        """Recompute the checksum over the canonical header and all tensor bytes."""
        crc = crc32(_canonical(self.header))
        pos, end = self.data_start, len(self.buf)
        while pos < end:
            stop = min(pos + _CHUNK, end)
            crc = crc32(self.buf[pos:stop], crc)
            if bar is not None:
                bar.update(stop - pos)
            pos = stop
        want = self.metadata.get("checksum", "")
        if want != f"crc32:{crc:08x}":
            raise self.fail(f"checksum mismatch (stored {want!r}, computed crc32:{crc:08x}): "
                            "the data is corrupted")


def _short(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _unique_object(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@contextlib.contextmanager
def _untrusted(what: str):
    """Reading what a state says: any failure but our own is a ``StateError`` naming the input
    (a hostile header can make the JSON parser recurse too deep, numbers overflow, arithmetic on
    absurd shapes run out of memory, or a field of an unexpected type reach code that expected
    another). ``KVCacheError`` passes through: it is already ours."""
    try:
        yield
    except KVCacheError:
        raise
    except Exception as exc:  # noqa: BLE001 - everything else the input can provoke
        raise StateError(f"{what}: the state cannot be read: {type(exc).__name__}: "
                         f"{_clip(str(exc))} (corrupted or not made by numbakv)") from exc


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _parse(buf: memoryview, what: str) -> _State:
    """Check the safetensors structure of ``buf`` (what safetensors' own parser checks, and the
    numbakv envelope: format, version, checksum field) and return it parsed. Every failure is a
    ``StateError``."""
    with _untrusted(what):
        return _parse_checked(buf, what)


def _parse_checked(buf: memoryview, what: str, size: Optional[int] = None) -> _State:
    """(``size``: the input's length when ``buf`` holds only its beginning, at least the
    header: a run read straight into a cache's rows parses its header first.)"""
    size = len(buf) if size is None else size
    if size < 8:
        raise StateError(f"{what}: truncated: {size} bytes, not even the 8-byte header length")
    n = int.from_bytes(buf[:8], "little")
    if n == 0 or n > MAX_HEADER_BYTES:
        raise StateError(f"{what}: header length {n} is not in [1, {MAX_HEADER_BYTES}]: not a "
                         "safetensors file, or corrupted")
    if 8 + n > size or 8 + n > len(buf):
        raise StateError(f"{what}: truncated: the header needs {8 + n} bytes, the input has "
                         f"{size}")
    try:
        text = bytes(buf[8:8 + n]).decode("utf-8")
        header = json.loads(text, object_pairs_hook=_unique_object,
                            parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise StateError(f"{what}: the header is not valid JSON ({_clip(str(exc))}): "
                         "corrupted") from None
    except RecursionError:
        raise StateError(f"{what}: the header nests JSON too deeply: corrupted or hostile") \
            from None
    if not isinstance(header, dict):
        raise StateError(f"{what}: the header is not a JSON object: corrupted")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in meta.items()):
        raise StateError(f"{what}: __metadata__ must map strings to strings")
    data_start = 8 + n
    data_len = size - data_start
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise StateError(f"{what}: tensor {name!r}: entry must have exactly dtype, shape and "
                             "data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _ST_DTYPES:
            raise StateError(f"{what}: tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise StateError(f"{what}: tensor {name!r}: shape must be a list of integers >= 0, "
                             f"got {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(_is_int(o) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise StateError(f"{what}: tensor {name!r}: data_offsets must be [begin, end] with "
                             f"0 <= begin <= end, got {offsets!r}")
        nbytes = math.prod(shape) * _ST_DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise StateError(f"{what}: tensor {name!r}: {dtype} {shape} needs {nbytes} bytes but "
                             f"data_offsets span {offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    at = 0
    for begin, end, name in spans:
        if begin != at:
            raise StateError(f"{what}: tensor {name!r} starts at byte {begin} of the data, "
                             f"expected {at} (tensors must tile the data without gaps or "
                             "overlaps)")
        at = end
    if at != data_len:
        if at > data_len:
            raise StateError(f"{what}: truncated: the tensors need {at} data bytes, the input "
                             f"has {data_len}")
        raise StateError(f"{what}: {data_len - at} bytes after the last tensor: corrupted")
    state = _State(buf, what, header, data_start)
    fmt = meta.get("format")
    if fmt != FORMAT:
        raise state.fail(f"not a numbakv state (metadata format={fmt!r}, expected {FORMAT!r})")
    version = meta.get("version")
    if version != VERSION:
        raise state.fail(f"format version {version!r} is not supported (this numbakv reads "
                         f"version {VERSION!r})")
    kind = meta.get("kind")
    if kind not in KINDS:
        raise state.fail(f"unknown kind {kind!r} (expected one of {', '.join(KINDS)})")
    checksum = meta.get("checksum", "")
    if not (checksum.startswith("crc32:") and len(checksum) == 14):
        raise state.fail(f"checksum must be 'crc32:<8 hex digits>', got {checksum!r}")
    try:
        config = json.loads(meta.get("config", ""), parse_constant=_reject_constant)
    except ValueError as exc:
        raise state.fail(f"config metadata is not valid JSON ({_clip(str(exc))})") from None
    except RecursionError:
        raise state.fail("config metadata nests JSON too deeply: corrupted or hostile") \
            from None
    if not isinstance(config, dict):
        raise state.fail("config metadata must be a JSON object")
    state.kind = kind
    state.config = config
    return state


class _Opened:
    """Context manager giving a parsed ``_State`` for a path or bytes.

    A path is read into memory once (``_read_file``): what is verified is exactly what is
    committed, whatever another process does to the file meanwhile. Immutable ``bytes`` are used
    in place; a mutable buffer (bytearray, writable memoryview) is copied first, for the same
    reason."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self._buf: Optional[memoryview] = None

    def __enter__(self) -> _State:
        src = self.source
        if isinstance(src, _BYTES_LIKE):
            buf = memoryview(src)
            if not buf.c_contiguous:
                raise ValueError("data must be a contiguous bytes-like object")
            buf = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
            if not isinstance(src, bytes):  # bytearray, or a view of memory that may change
                buf = _copy_bytes(buf, "state bytes")
            what = "state bytes"
        else:
            path = _check_path(src)
            what = f"state file {path!r}"
            buf = _read_file(path, what)
        self._buf = buf
        return _parse(buf, what)

    def __exit__(self, *exc) -> None:
        self._buf = None


def _copy_bytes(buf: memoryview, what: str) -> memoryview:
    try:
        return memoryview(bytes(buf))
    except MemoryError as exc:
        raise StateError(f"{what}: no memory for a private copy of {len(buf)} bytes") from exc


def _read_file(path: str, what: str) -> memoryview:
    """The whole file, read into memory: truncated, grown or rewritten while it is read, it
    gives short or inconsistent bytes that the parser or the checksum rejects, never a crash.
    OS errors become ``StateError`` naming the path."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (a regular file ignores it)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise StateError(f"{what}: not a regular file")
            size = info.st_size
            _check_room(size, what)
            try:
                data = bytearray(size)
            except MemoryError as exc:
                raise StateError(f"{what}: no memory to read its {size} bytes") from exc
            view = memoryview(data)
            got = 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            if got < size:
                raise StateError(f"{what}: truncated while it was read ({got} of {size} bytes "
                                 "arrived): another process is changing it")
            if f.read(1):
                raise StateError(f"{what}: grew while it was read (more than its {size} bytes): "
                                 "another process is changing it")
    except OSError as exc:  # missing, a directory, no permission, I/O error
        raise StateError(f"{what}: cannot read it: {_os_reason(exc)}") from exc
    return view.toreadonly()


def _check_room(size: int, what: str) -> None:
    """Refuse to read a file larger than the host memory left (reading it would end in a
    MemoryError or an out-of-memory kill, not an error the caller can handle)."""
    from .._memory import check_memory
    try:
        check_memory(what, "cpu", {"file contents": size})
    except ValueError as exc:
        raise StateError(str(exc)) from None


def _load_bar(state: _State, progress: Optional[bool]):
    """One bar for both passes over the data: verifying, then copying to the cache."""
    return _progress_bar(2 * state.data_bytes, progress, "loading state")


def _close_bar(bar) -> None:
    if bar is not None:
        bar.close()


def _cfg_int(state: _State, config: dict, key: str, *, optional: bool = False,
             where: str = "") -> Optional[int]:
    value = config.get(key)
    if value is None and optional:
        return None
    if not _is_int(value):
        raise state.fail(f"config{where} field {key!r} must be an integer, got {value!r}")
    return value


def _check_progress(progress) -> None:
    if progress is not None and not isinstance(progress, (bool, np.bool_)):
        raise ValueError(f"progress must be None or a bool, got {progress!r}")


def _check_strict(strict) -> bool:
    if not isinstance(strict, (bool, np.bool_)):
        raise ValueError(f"strict must be a bool, got {strict!r}")
    return bool(strict)

