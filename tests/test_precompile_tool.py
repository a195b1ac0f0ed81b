"""numbakv precompile's tooling for shipping compiled code of several CPython versions (the
build itself is the maintainers' `numbakv precompile --ship [--python PATH ...]`)."""

import argparse
import sys

from numbakv.tools import precompile


def test_python_tag_names_the_interpreters_cache_files():
    here = f"py{sys.version_info[0]}{sys.version_info[1]}"
    assert precompile.python_tag() == here
    assert precompile.python_tag(sys.executable) == here


def test_python_option_needs_ship(capsys):
    p = argparse.ArgumentParser()
    precompile.add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["precompile", "--python", sys.executable])
    assert args.python == [sys.executable] and not args.ship
    assert precompile.run(args) == 2
    assert "--python applies to --ship" in capsys.readouterr().err
