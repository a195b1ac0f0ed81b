"""Summarise a compile trace (``sitecustomize.py`` here): per outermost compile, its CPU
seconds, test, function and how its argument types differ from the nearest signature the
shipped code holds (``numbakv/_precompiled``, this interpreter's files), heaviest first.

    python tests/compile_trace/report.py TRACE_DIR
"""

import glob
import json
import os
import pickle
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shipped() -> dict:
    """``{"module.qualname": [argument type strings]}`` of this Python's shipped entries."""
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}"
    out = {}
    for index in glob.glob(os.path.join(ROOT, "numbakv", "_precompiled", f"*.{tag}.nbi")):
        with open(index, "rb") as f:
            pickle.load(f)                       # numba's version
            _, overloads = pickle.loads(f.read())
        name = os.path.basename(index).split("-", 1)[0]
        out.setdefault(name, []).extend(str(key[0]) for key in overloads)
    return out


def _types(sig: str) -> list:
    return re.findall(r"Array\([^)]*\)|[\w.]+(?=[,)])", sig)


def difference(name: str, args: str, ships: dict) -> str:
    short = ".".join(name.split(".")[-2:])
    if short not in ships:
        return "not shipped"
    mine, best = _types(args), None
    for sig in ships[short]:
        theirs = _types(sig)
        if len(theirs) == len(mine):
            diff = [f"#{i} {a} -> {b}" for i, (a, b) in enumerate(zip(theirs, mine)) if a != b]
            best = diff if best is None or len(diff) < len(best) else best
    return "; ".join(best) if best else ("shipped" if best == [] else "other arity")


def main(trace: str) -> None:
    ships = shipped()
    rows = [json.loads(line) for path in glob.glob(os.path.join(trace, "*.jsonl"))
            for line in open(path)]
    top = sorted((r for r in rows if r["depth"] == 0), key=lambda r: -r["cpu"])
    for r in top:
        print(f"{r['cpu']:7.2f}  {r['test'].rsplit(' ', 1)[0]}  {r['func']}  "
              f"[{difference(r['func'], r['args'], ships)}]")
    print(f"{len(top)} compiles, {sum(r['cpu'] for r in top):.1f} CPU s")


if __name__ == "__main__":
    main(sys.argv[1])
