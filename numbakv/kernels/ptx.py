"""Compile every registered kernel to PTX for the target GPUs, link it to a cubin with
nvJitLink and check what the GPU compiler says, with or without a GPU present.

Run as ``python -m numbakv.kernels.ptx`` (PTX only) or ``python -m numbakv.kernels.ptx --check``
(every kernel x signature x target also linked to a cubin by nvJitLink, i.e. run through ptxas,
and refused on any register spill, stack frame, local memory, ``.extern`` declaration, parameter
space over the limit, registers above :data:`MAX_REGISTERS`, or a fast-launch parameter layout
that differs from Numba's data model). Prints one line per kernel and exits non-zero on any
failure. Needs Numba's real CUDA target: not available while the simulator is on.

``--kernels NAME,NAME`` checks only those registered kernels (the test suite spreads the check
over several processes); ``--ptx-dir DIR`` with ``--check`` also writes each kernel's PTX there
as ``<kernel>.<signature index>.sm_XY.ptx`` (tests read it instead of compiling it again).
"""

from __future__ import annotations

import contextlib
import re
import sys
import types
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

TARGETS: Tuple[Tuple[int, int], ...] = ((8, 0), (9, 0))

#: the register bound every kernel must stay under at every target: 64 keeps a 256-thread block
#: at full occupancy headroom (64K registers per SM hold 4 such blocks) and is well above what
#: the kernels use today (ptxas reports 18-54), so a change that blows up a kernel's register
#: use fails the check instead of silently halving occupancy
MAX_REGISTERS = 64
#: stated exceptions to MAX_REGISTERS, each with what ptxas reported when it was set (NVVM 12.9):
#: mask_fill 66 at sm_90 (the visible-interval row test of the split cell table); quant_put 128
#: for float32 input (a 32-value ggml block is held in registers between its amax pass and its
#: quantize pass); quant_rope_shift 92 / 72 (dequantize, rotate and requantize fused; the row
#: itself is in shared memory); paged_attention 81 / 80 (eighteen strided array arguments, the
#: visible-run searches and the split-K bounds live across the tile loop; its 128-thread blocks
#: still fit 6 per SM; float pools 80 / 79 after the quantized formats came in, which only the
#: uint8 signatures compile: quantized K with float V 87 / 86, float K with quantized V 94 / 88,
#: both quantized 102 / 92 -- the accumulate loop dequantizes a V value per cell, its block's
#: f16 scale converted in software, and LLVM unrolls that loop: 5 blocks of 128 per SM at
#: 102, where an unroll-free form would cost a second pass over the tile); put_kv 72 at sm_80 with 16-byte words (a lane holds four 16-byte words
#: between their loads and their stores: 16 registers of data; at 3 blocks of 256 per SM that is
#: still twice the bytes in flight of 6 blocks loading one word per thread); paged_latent_attention
#: 96 / 91 at every pool word (the paged kernel's arguments and split-K bounds, plus the staged
#: tile's bounds and the score lanes; 85 / 86 with one thread per score; its 46-47 KiB of static
#: shared memory already limits it to 4 blocks of 128 per SM on sm_90, 3 on sm_80, which 96
#: registers allow, so registers are not the bound). Any growth past these still fails the
#: check.
REGISTER_BOUNDS: Dict[str, int] = {"mask_fill": 72, "quant_put": 128, "quant_rope_shift": 96,
                                   "paged_attention": 104, "put_kv": 80,
                                   "paged_latent_attention": 96}
#: kernel parameter space on sm_70+ (CUDA < 12.1 drivers; 32 KB needs 12.1+ and sm_70+)
MAX_PARAM_BYTES = 4096


class Resources(NamedTuple):
    """What ptxas reports for one kernel entry."""
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    local_bytes: int


_REGS = re.compile(r"[Uu]sed (\d+) registers")
_STACK = re.compile(r"(\d+) bytes stack frame")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_LMEM = re.compile(r"(\d+) bytes lmem")


def parse_resources(info_log: str) -> Resources:
    """The resource figures of a one-kernel link's verbose log (ptxas's and nvJitLink's lines;
    the largest figure where both report)."""
    def biggest(rx, group=1):
        found = [int(m.group(group)) for m in rx.finditer(info_log)]
        if not found and rx is _REGS:
            raise RuntimeError(f"no register count in the link log:\n{info_log}")
        return max(found, default=0)
    return Resources(biggest(_REGS), biggest(_STACK), biggest(_SPILL, 1), biggest(_SPILL, 2),
                     biggest(_LMEM))


def ptx_problems(ptx: str) -> List[str]:
    """What the PTX itself must not contain: calls out of the module (``.extern``: a libdevice
    or runtime function the driver would have to resolve), local memory (``.local``) and a
    parameter space over :data:`MAX_PARAM_BYTES`."""
    out = []
    if re.search(r"^\s*\.extern\b", ptx, re.M):
        out.append(".extern declaration")
    if re.search(r"\.local\b", ptx):
        out.append(".local memory")
    params = re.findall(r"\.param\s+\.([a-z]+)(\d+)", ptx)
    nbytes = sum(int(bits) // 8 for _, bits in params)
    if nbytes > MAX_PARAM_BYTES:
        out.append(f"{nbytes} bytes of parameters (> {MAX_PARAM_BYTES})")
    return out


def resource_problems(res: Resources, kernel: str = "") -> List[str]:
    """What is wrong with one kernel entry's resources: any spill, stack frame or local memory,
    and registers above ``REGISTER_BOUNDS.get(kernel, MAX_REGISTERS)``."""
    bound = REGISTER_BOUNDS.get(kernel, MAX_REGISTERS)
    out = []
    if res.spill_stores or res.spill_loads:
        out.append(f"register spills ({res.spill_stores} B stored, {res.spill_loads} B loaded)")
    if res.stack:
        out.append(f"{res.stack} B stack frame")
    if res.local_bytes:
        out.append(f"{res.local_bytes} B local memory")
    if res.registers > bound:
        out.append(f"{res.registers} registers (> {bound})")
    return out


def layout_problems(sig) -> List[str]:
    """Whether :func:`numbakv.kernels.launch._flatten` lays out the arguments of ``sig`` exactly
    as Numba's CUDA data model does, *by order*: each array as meminfo, parent, nitems, itemsize,
    data, shape..., strides...; each scalar as its value. Distinct sentinel values stand in for
    every field, so swapping any two (say nitems and data) is caught, not just a wrong count."""
    import numpy as np
    from numba import types as nbtypes
    from numba.cuda.descriptor import cuda_target
    from . import _common, launch as _launch_mod
    ctx = cuda_target.target_context
    args, expected = [], []
    for i, t in enumerate(sig):
        if isinstance(t, nbtypes.Array):
            shape = tuple(3 + 2 * i + j for j in range(t.ndim))
            strides = tuple(1000 * (i + 1) + 8 * j for j in range(t.ndim))
            dt = np.dtype(str(t.dtype))
            d = _common.Desc(0x10000 * (i + 1), shape, strides, dt)
            args.append(d)
            values = {"meminfo": [0], "parent": [0], "nitems": [int(np.prod(shape))],
                      "itemsize": [dt.itemsize], "data": [d.ptr], "shape": list(shape),
                      "strides": list(strides)}
            for field in ctx.data_model_manager[t]._fields:
                expected.extend(values[field])
        else:
            args.append(70000 + i)
            expected.append(70000 + i)
    packed = len(ctx.get_arg_packer(sig).argument_types)
    flat = _launch_mod._flatten(args)
    out = []
    if flat != expected:
        out.append(f"parameter layout {flat} != data model {expected}")
    if packed != len(flat):
        out.append(f"{len(flat)} flat parameters but the data model packs {packed}")
    return out


@contextlib.contextmanager
def _offline_device(cc: Tuple[int, int]):
    """Device functions ask the driver for the current device's compute capability while they
    are typed; without a GPU there is none, so answer with the target being compiled for."""
    from numba.cuda import dispatcher
    original = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = original


def compile_all(targets: Iterable[Tuple[int, int]] = TARGETS,
                kernels: Optional[Iterable[str]] = None
                ) -> Dict[Tuple[str, Tuple[int, int]], str]:
    """PTX of every registered kernel (or of those named in ``kernels``) for every signature and
    target; raises on the first error."""
    from numba import cuda
    from ..device import simulator_enabled
    if simulator_enabled():
        raise RuntimeError("PTX compilation needs Numba's CUDA target; the simulator is on "
                           "(unset NUMBA_ENABLE_CUDASIM)")
    have_gpu = False
    try:
        have_gpu = bool(cuda.is_available())
    except Exception:  # noqa: BLE001
        have_gpu = False
    results = {}
    for cc in targets:
        ctx = contextlib.nullcontext() if have_gpu else _offline_device(cc)
        with ctx:
            for spec in selected(kernels):   # imports every kernel module
                for sig in spec.signatures:
                    ptx, _ = cuda.compile_ptx(spec.py_func, sig, cc=cc)
                    marker = f".target sm_{cc[0]}{cc[1]}"
                    if marker not in ptx:
                        raise RuntimeError(f"{spec.name}: PTX lacks {marker}")
                    results[(spec.name, cc)] = ptx
    return results


def selected(kernels: Optional[Iterable[str]] = None) -> list:
    """The registered kernels named in ``kernels`` (all of them when None), in registry order;
    raises ``ValueError`` naming any name that is not a registered kernel."""
    from . import registered
    specs = registered()
    if kernels is None:
        return specs
    wanted = set(kernels)
    unknown = sorted(wanted - {spec.name for spec in specs})
    if unknown:
        raise ValueError(f"kernels {unknown} are not registered (registered: "
                         f"{[spec.name for spec in specs]})")
    return [spec for spec in specs if spec.name in wanted]


def ptx_file_name(kernel: str, signature: int, cc: Tuple[int, int]) -> str:
    """The file :func:`check_all` writes the PTX of ``kernel``'s signature number ``signature``
    for target ``cc`` to, inside its ``ptx_dir``."""
    return f"{kernel}.{signature}.sm_{cc[0]}{cc[1]}.ptx"


def check_all(targets: Iterable[Tuple[int, int]] = TARGETS,
              kernels: Optional[Iterable[str]] = None,
              ptx_dir: Optional[str] = None) -> Dict[str, List[str]]:
    """Every kernel x signature x target: PTX compiled, checked (:func:`ptx_problems`), linked to
    a cubin by nvJitLink and its resources checked (:func:`resource_problems`), plus the
    fast-launch parameter layout and count (:func:`layout_problems`,
    :func:`numbakv.kernels.launch.ptx_entry`). ``kernels``: only these registered kernels (names;
    all when None). ``ptx_dir``: an existing folder the PTX is also written to
    (:func:`ptx_file_name`). Returns per kernel the lines to print; raises ``RuntimeError``
    listing every problem found."""
    import os
    from numba import cuda
    from ..device import simulator_enabled
    from . import launch as _launch_mod
    if simulator_enabled():
        raise RuntimeError("the check needs Numba's CUDA target; the simulator is on "
                           "(unset NUMBA_ENABLE_CUDASIM)")
    specs = selected(kernels)
    have_gpu = False
    try:
        have_gpu = bool(cuda.is_available())
    except Exception:  # noqa: BLE001
        have_gpu = False
    report: Dict[str, List[str]] = {}
    problems: List[str] = []
    for spec in specs:
        for k, sig in enumerate(spec.signatures):
            where = f"{spec.name}[{k}]"
            problems += [f"{where}: {p}" for p in layout_problems(sig)]
            for cc in targets:
                tag = f"sm_{cc[0]}{cc[1]}"
                ctx = contextlib.nullcontext() if have_gpu else _offline_device(cc)
                with ctx:
                    try:
                        ptx, _, _ = _launch_mod.ptx_entry(spec.py_func, sig, cc)
                    except Exception as exc:  # noqa: BLE001
                        problems.append(f"{where} {tag}: {type(exc).__name__}: {exc}")
                        continue
                problems += [f"{where} {tag}: {p}" for p in ptx_problems(ptx)]
                if ptx_dir is not None:
                    with open(os.path.join(ptx_dir, ptx_file_name(spec.name, k, cc)), "w") as fh:
                        fh.write(ptx)
                try:
                    _, log = _launch_mod.link_cubin(ptx, cc)
                    res = parse_resources(log)
                except Exception as exc:  # noqa: BLE001
                    problems.append(f"{where} {tag}: link failed: {type(exc).__name__}: {exc}")
                    continue
                problems += [f"{where} {tag}: {p}"
                             for p in resource_problems(res, spec.name)]
                report.setdefault(spec.name, []).append(
                    f"  sig {k} {tag}: {res.registers} registers, {res.stack} B stack, "
                    f"{res.spill_stores}/{res.spill_loads} B spilled, {res.local_bytes} B lmem")
    if problems:
        raise RuntimeError("\n".join(problems))
    return report


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m numbakv.kernels.ptx",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="also link each PTX with nvJitLink and check its resources")
    parser.add_argument("--kernels", default=None, metavar="NAME,NAME",
                        help="only these registered kernels (default: all)")
    parser.add_argument("--ptx-dir", default=None, metavar="DIR",
                        help="with --check: write each kernel's PTX into DIR")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    check = args.check
    kernels = None if args.kernels is None else [k for k in args.kernels.split(",") if k]
    if args.ptx_dir is not None and not check:
        parser.error("--ptx-dir applies to --check")
    try:
        specs = selected(kernels)
        if check:
            details = check_all(kernels=kernels, ptx_dir=args.ptx_dir)
            compiled = {(name, cc): "" for name in details for cc in TARGETS}
        else:
            details = {}
            compiled = compile_all(kernels=kernels)
    except Exception as exc:  # noqa: BLE001
        print(f"{'check' if check else 'PTX compilation'} failed: {type(exc).__name__}: {exc}")
        return 1
    for spec in specs:
        ccs = sorted({cc for (name, cc) in compiled if name == spec.name})
        print(f"{spec.name}: {len(spec.signatures)} signature(s) -> "
              + ", ".join(f"sm_{a}{b}" for a, b in ccs))
        for line in details.get(spec.name, []):
            print(line)
    print(f"ok: {len(specs)} kernels"
          + (f" (linked by nvJitLink; <= {MAX_REGISTERS} registers or the stated bound "
             f"{REGISTER_BOUNDS}, no spills, stack, local "
             f"memory or .extern)" if check else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
