"""The NIXL transport for the rows of a transfer (``send_seq(..., transport="nixl")``).

The control messages (header, verdict, acknowledgement) still go over ``torch.distributed``;
only the K/V rows move through NIXL (UCX backend): the receiver registers its receive buffer
and sends the sender its agent metadata and the buffer's descriptors (one per K/V array, over
``torch.distributed``), the sender registers its arrays and WRITEs them into the receiver's
memory with a notification, the receiver waits for that notification. DRAM on the CPU, VRAM on
a GPU. Checked on a CPU-only machine with the ``nixl-cu12`` 1.5.1 wheel (two processes, UCX over
loopback); the ``nixl`` meta package picks ``nixl-cu13`` when it finds CUDA 13 libraries, so
install the variant that matches them.
"""

from __future__ import annotations

import importlib
import base64
import json
import threading
import time
import warnings
from typing import Any, List, Optional, Tuple

import numpy as np

_LOCK = threading.Lock()
_AGENT: Any = None
_PEERS: set = set()
_SEQ = [0]


def _api():
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("transport='nixl' needs NIXL: pip install nixl-cu12 (or nixl-cu13, "
                      "matching the CUDA libraries installed)")


def available() -> bool:
    try:
        _api()
    except ImportError:
        return False
    return True


def agent(rank: int):
    """This process's NIXL agent (UCX backend), created on first use."""
    global _AGENT
    with _LOCK:
        if _AGENT is None:
            api = _api()
            _AGENT = api.nixl_agent(f"numbakv-rank{rank}",
                                    api.nixl_agent_config(backends=["UCX"]))
        return _AGENT


def _mem_type(tensor) -> str:
    return "VRAM" if tensor.device.type == "cuda" else "DRAM"


def _dev(tensor) -> int:
    return tensor.device.index or 0 if tensor.device.type == "cuda" else 0


def receiver_offer(ag, rank: int, tensors_and_spans: List[Tuple[Any, List[Tuple[int, int]]]]):
    """Register the receive buffers; returns ``(blob for the sender, registrations, tag)``: the
    blob (bytes) holds this agent's metadata, the descriptors of every array's destination, in
    the order the sender sends them, and the notification tag to expect."""
    regs, descs = [], []
    mem = "DRAM"
    for t, spans in tensors_and_spans:
        regs.append(ag.register_memory([t]))
        mem = _mem_type(t)
        base = t.data_ptr()
        descs += [(base + lo, hi - lo, _dev(t)) for lo, hi in spans]
    with _LOCK:
        _SEQ[0] += 1
        tag = f"numbakv-{rank}-{_SEQ[0]}-{time.monotonic_ns()}".encode()
    blob = json.dumps({"meta": base64.b64encode(ag.get_agent_metadata()).decode("ascii"),
                       "name": ag.name, "descs": descs, "mem": mem,
                       "tag": tag.decode("ascii")}).encode("utf-8")
    return blob, regs, tag


def receiver_wait(ag, sender_name: str, tag: bytes, timeout: Optional[float], peer: int) -> None:
    from ._errors import TransferTimeout
    deadline = None if timeout is None else time.monotonic() + timeout
    while not ag.check_remote_xfer_done(sender_name, tag):
        if deadline is not None and time.monotonic() > deadline:
            raise TransferTimeout(f"peer rank {peer}: the NIXL write of the rows did not complete "
                                  f"within {timeout:g} s (the peer died or stalled)")
        time.sleep(0.0005)


def receiver_done(ag, regs) -> None:
    for r in regs:
        try:
            ag.deregister_memory(r)
        except Exception:  # noqa: BLE001 - best effort: the buffer stays alive with the pool
            pass


def sender_write(ag, blob: bytes, arrays: List[np.ndarray], timeout: Optional[float],
                 peer: int) -> None:
    """WRITE ``arrays`` (host arrays, in order) into the receiver's descriptors from ``blob``."""
    import torch

    from ._errors import TransferError, TransferTimeout
    try:   # JSON, never pickle: bytes from the network are data
        offer = json.loads(blob.decode("utf-8"))
        offer["meta"] = base64.b64decode(offer["meta"], validate=True)
        offer["tag"] = offer["tag"].encode("ascii")
        offer["descs"] = [tuple(int(x) for x in d) for d in offer["descs"]]
        if offer["mem"] not in ("DRAM", "VRAM") or not isinstance(offer["name"], str):
            raise ValueError("bad memory type or agent name")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TransferError(f"peer rank {peer} sent a malformed NIXL offer ({exc})") from None
    with _LOCK:
        if offer["name"] not in _PEERS:
            ag.add_remote_agent(offer["meta"])
            _PEERS.add(offer["name"])
    if len(offer["descs"]) != len(arrays):
        raise TransferError(f"peer rank {peer} offered {len(offer['descs'])} NIXL destinations "
                            f"for {len(arrays)} arrays")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensors = [torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
                   for a in arrays]
    keep = [t for t in tensors if t.numel()]
    pairs = [(t, d) for t, d in zip(tensors, offer["descs"]) if t.numel()]
    regs = ag.register_memory(keep) if keep else None
    try:
        if not pairs:
            ag.send_notif(offer["name"], offer["tag"])
            return
        local = ag.get_xfer_descs([t for t, _ in pairs])
        remote = ag.get_xfer_descs([d for _, d in pairs], offer["mem"])
        handle = ag.initialize_xfer("WRITE", local, remote, offer["name"], offer["tag"])
        try:
            state = ag.transfer(handle)
            deadline = None if timeout is None else time.monotonic() + timeout
            while state == "PROC":
                if deadline is not None and time.monotonic() > deadline:
                    raise TransferTimeout(f"peer rank {peer}: the NIXL write did not complete "
                                          f"within {timeout:g} s")
                time.sleep(0.0002)
                state = ag.check_xfer_state(handle)
            if state != "DONE":
                raise TransferTimeout(f"peer rank {peer}: the NIXL write failed ({state})")
        finally:
            try:
                ag.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001
                pass
    finally:
        if regs is not None:
            ag.deregister_memory(regs)
