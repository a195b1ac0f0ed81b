"""Text shared by the benchmark sections' reports: the targets' lines and a section module's
``__main__`` (run it, print its table with its targets). Imported by bench.py and the section
modules (no section imports bench.py, which imports them)."""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Optional, Sequence


def target_lines(targets: Sequence[Dict[str, str]], width: int = 6) -> List[str]:
    """One line per target: ``  [status] target: detail`` (status right-aligned in ``width``)."""
    return [f"  [{t['status']:>{width}}] {t['target']}: {t['detail']}" for t in targets]


def section_main(run: Callable[..., Dict[str, Any]], fmt: Callable[[Dict[str, Any]], List[str]],
                 targets: Callable[[Dict[str, Any]], Sequence[Dict[str, str]]],
                 argv: Optional[Sequence[str]] = None) -> None:
    """``python -m numbakv.tools.bench_<section> [--quick]``: run the section (``run(quick,
    log=print)``) and print its table (``fmt(res)``) and its targets (``targets(res)``)."""
    argv = sys.argv[1:] if argv is None else argv
    res = run("--quick" in argv, log=print)
    print("\n".join(list(fmt(res)) + target_lines(targets(res))))


__all__ = ["section_main", "target_lines"]
