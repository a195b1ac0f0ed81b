"""``numbakv store stats DIR|URL`` and ``numbakv store clear DIR|URL [--fingerprint F] [--yes]``:
look into and empty the prefix store's disk directory or Redis/Valkey server (the tiers of
``numbakv.prefix.tiers``), without a model or a cache."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

#: fingerprint fields shown in the table (the whole fingerprint is in --json)
_SHOWN = ("model_id", "n_layers", "n_kv_heads", "head_dim", "k_dtype", "v_dtype", "swa_window")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _summary(fp: Optional[dict]) -> str:
    if not fp:
        return "?"
    parts = [f"{k}={fp[k]}" for k in _SHOWN if k in fp and fp[k] is not None]
    shift = fp.get("shift")
    if isinstance(shift, dict):
        parts.append(f"shift={shift.get('type')}")
    return " ".join(parts) or "?"


def _check_target(target: str) -> None:
    """A URL of a scheme no tier speaks (http://, s3://, a typo) is refused rather than taken
    for a directory of that name."""
    from numbakv.prefix.tiers import is_url
    if "://" in target and not is_url(target):
        raise ValueError(f"{target!r} is neither a directory nor a redis://, rediss://, "
                         "unix://, valkey:// or valkeys:// URL")


def _scan(target: str, timeout: float) -> dict:
    from numbakv.prefix.tiers import is_url
    _check_target(target)
    if is_url(target):
        from numbakv.prefix.tiers.redis import scan_server
        return scan_server(target, timeout)
    from numbakv.prefix.tiers.disk import scan_directory
    return scan_directory(target)


def stats(args: argparse.Namespace) -> int:
    """Entries, bytes, hit/miss counts (every process's) and the model fingerprint of each
    namespace held by ``args.target``."""
    try:
        info = _scan(args.target, args.timeout)
    except (ValueError, ConnectionError, ImportError) as exc:
        print(f"numbakv store stats: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    spaces = info["namespaces"]
    print(f"{args.target}: {len(spaces)} namespace(s) (one per model fingerprint + layout), "
          f"{info['entries']} entries, {_human(info['bytes'])}"
          + (f", {info['foreign']} other file(s) ignored" if info.get("foreign") else ""))
    for ns, row in spaces.items():
        total = row["hits"] + row["misses"]
        rate = f" ({100 * row['hits'] / total:.0f}% hit)" if total else ""
        print(f"  {ns}: {row['entries']} entries, {_human(row['bytes'])}, {row['hits']} hits, "
              f"{row['misses']} misses{rate}")
        print(f"    fingerprint: {_summary(row['fingerprint'])}")
    return 0


def _confirm(args: argparse.Namespace, info: dict) -> Optional[str]:
    """None when the clear may go ahead (``--yes``, or the user typed y), else why not."""
    matching = [row for ns, row in info["namespaces"].items()
                if not args.fingerprint or args.fingerprint in ns]
    what = (f"{sum(r['entries'] for r in matching)} entries "
            f"({_human(sum(r['bytes'] for r in matching))}) in {len(matching)} namespace(s)"
            + (f" matching {args.fingerprint!r}" if args.fingerprint else "")
            + f" of {args.target}")
    if args.yes:
        return None
    if not sys.stdin or not sys.stdin.isatty():
        return (f"would remove {what}; stdin is not a terminal, so nothing was asked and "
                "nothing removed: pass --yes to clear without asking")
    try:
        answer = input(f"Remove {what}? [y/N] ")
    except EOFError:
        answer = ""
    return None if answer.strip().lower() in ("y", "yes") else "not confirmed: nothing removed"


def clear(args: argparse.Namespace) -> int:
    """Remove the runs of every namespace (or of those matching ``--fingerprint``), after a
    confirmation (``--yes`` skips it; without a terminal to ask on, nothing is removed)."""
    from numbakv.prefix.tiers import is_url
    try:
        info = _scan(args.target, args.timeout)
        refusal = _confirm(args, info)
        if refusal is not None:
            print(f"numbakv store clear: {refusal}", file=sys.stderr)
            return 1
        if is_url(args.target):
            from numbakv.prefix.tiers.redis import clear_server
            removed = clear_server(args.target, args.fingerprint, args.timeout)
        else:
            from numbakv.prefix.tiers.disk import clear_directory
            removed = clear_directory(args.target, args.fingerprint)
    except (ValueError, ConnectionError, ImportError) as exc:
        print(f"numbakv store clear: {exc}", file=sys.stderr)
        return 2
    if not removed:
        matching = f" matching {args.fingerprint!r}" if args.fingerprint else ""
        print(f"{args.target}: no namespace{matching}: nothing removed")
    for ns, n in removed.items():
        print(f"{ns}: removed {n} entries")
    return 0


def add_parser(sub) -> None:
    """Register ``store`` (with ``stats`` and ``clear``) on the ``numbakv`` sub-parsers."""
    p = sub.add_parser("store", help="the prefix store's disk directory or Redis/Valkey server: "
                                     "stats, clear",
                       description="Look into or empty the prefix store's disk tier (a directory) "
                                   "or Redis/Valkey tier (redis://host:port/db).")
    ops = p.add_subparsers(dest="store_command", required=True, metavar="{stats,clear}")
    for name, fn, text in (("stats", stats, "entries, bytes, hit counts and model fingerprints "
                                            "per namespace"),
                           ("clear", clear, "remove the stored prefixes (all models, or "
                                            "--fingerprint F)")):
        q = ops.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        q.add_argument("target", metavar="DIR|URL",
                       help="the store's disk_dir, or its remote URL (redis://host:port/db)")
        q.add_argument("--timeout", type=float, default=2.0,
                       help="seconds to wait for a server (default 2)")
        if name == "stats":
            q.add_argument("--json", action="store_true", help="machine-readable output")
        else:
            q.add_argument("--fingerprint", metavar="F", default=None,
                           help="only namespaces containing F (the 16-hex fingerprint digest "
                                "`stats` shows, or a part of it)")
            q.add_argument("--yes", "-y", action="store_true",
                           help="do not ask for confirmation (needed when stdin is not a "
                                "terminal)")
        q.set_defaults(func=fn)
