"""numbakv info's compiled-code rows name what serves this interpreter and why."""

import sys

from numbakv import _jit
from numbakv.tools import info_compiled


def _manifest(monkeypatch, py: str, numba_v: str = None, stale: int = 0):
    numba_here = _jit.numba.__version__
    entries = [f"cells._bit-1.py{py}.nbi", f"cells._x-2.py{py}.nbi"]
    monkeypatch.setattr(_jit, "shipped_manifest", lambda: {
        "usable": True, "numba": numba_v or numba_here, "numba_here": numba_here,
        "python": f"py{py}", "entries": entries, "stale": entries[:stale]})


HERE = f"{sys.version_info[0]}{sys.version_info[1]}"


def test_in_use(monkeypatch):
    _manifest(monkeypatch, HERE)
    monkeypatch.delenv(_jit.SWITCH_ENV, raising=False)
    monkeypatch.setattr(_jit, "_host_has_shipped_level", lambda: True)
    assert info_compiled.shipped_status().startswith("shipped, in use (2 functions")


def test_switched_off_is_not_called_unusable(monkeypatch):
    _manifest(monkeypatch, HERE)
    monkeypatch.setenv(_jit.SWITCH_ENV, "0")
    assert "switched off by NUMBAKV_PRECOMPILED=0" in info_compiled.shipped_status()


def test_other_python_other_numba_other_cpu_stale(monkeypatch):
    monkeypatch.delenv(_jit.SWITCH_ENV, raising=False)
    monkeypatch.setattr(_jit, "_host_has_shipped_level", lambda: True)
    _manifest(monkeypatch, "39")
    assert "not for this Python" in info_compiled.shipped_status()
    _manifest(monkeypatch, HERE, numba_v="0.1.0")
    assert "not for this numba" in info_compiled.shipped_status()
    _manifest(monkeypatch, HERE, stale=2)
    assert "stale" in info_compiled.shipped_status()
    assert "in use" not in info_compiled.shipped_status()
    _manifest(monkeypatch, HERE)
    monkeypatch.setattr(_jit, "_host_has_shipped_level", lambda: False)
    assert "this CPU lacks" in info_compiled.shipped_status()


def test_numba_cache_row_names_the_directory(monkeypatch, tmp_path):
    from numba.core import config
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    rows = dict(info_compiled.rows())
    assert str(tmp_path) in rows["numba cache"] and "NUMBA_CACHE_DIR" in rows["numba cache"]
    assert "empty" in rows["numba cache"]
