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


def test_interpreter_check(tmp_path):
    assert precompile.interpreter_problem(sys.executable) == ""
    assert "missing-python" in precompile.interpreter_problem(str(tmp_path / "missing-python"))
    fake = tmp_path / "fake-python"
    fake.write_text("#!/bin/sh\necho 0.0.1\n")
    fake.chmod(0o755)
    assert "numba 0.0.1" in precompile.interpreter_problem(str(fake))
