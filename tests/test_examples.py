"""The framework examples in ``examples/`` run on the CPU and check themselves: attention computed
by the framework on ``get()``'s DLPack views equals attention without the cache."""

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"numbakv_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.torch
def test_torch_decode_example(capsys):
    pytest.importorskip("torch")
    example = load("torch_decode")
    assert example.main(["--device", "cpu", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "zero-copy (torch data_ptr == the cache's view address): True" in out
    assert out.strip().endswith("OK")


def test_jax_decode_example(capsys):
    pytest.importorskip("jax")
    example = load("jax_decode")
    assert example.main(["--device", "cpu", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "max |diff|" in out and out.strip().endswith("OK")


@pytest.mark.parametrize("name, module, hint", [
    ("jax_decode", "jax", "numbakv[jax]"), ("torch_decode", "torch", "numbakv[torch]"),
    ("torch_stream", "torch", "numbakv[torch]"), ("serve_batch", "transformers", "numbakv[hf]")])
def test_example_without_its_framework_says_what_to_install(tmp_path, name, module, hint):
    """Run as a script where its framework does not import (a stand-in package that raises
    ImportError shadows it): one line naming the framework and the extra, exit status 1, no
    traceback."""
    import os
    import subprocess
    import sys
    fake = tmp_path / module
    fake.mkdir()
    (fake / "__init__.py").write_text(f"raise ImportError('stand-in: no {module}')\n")
    root = str(EXAMPLES.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), root]))
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"examples/{name}.py needs" in proc.stderr and hint in proc.stderr
    assert "Traceback" not in proc.stderr


def test_flashinfer_decode_example(capsys):
    example = load("flashinfer_decode")
    assert example.main(["--seqs", "2", "--prompt", "16", "--steps", "2"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("skipped:") or out.endswith("OK")


@pytest.mark.torch
def test_serve_batch_example(capsys):
    pytest.importorskip("transformers")
    example = load("serve_batch")
    outputs = example.main()
    assert len(outputs) == 4 and all(len(toks) == 8 for toks in outputs.values())
    assert capsys.readouterr().out.count("request ") == 4


@pytest.mark.slow
def test_disaggregated_example(capsys):
    """Two spawned processes (gloo): ~40 s of imports, hence slow; tests/test_dist.py covers the
    same transfer in its module-wide group."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    example = load("disaggregated")
    assert example.main(["--tokens", "4", "--prompt", "12"]) == 0
    assert capsys.readouterr().out.strip().endswith("OK")
