"""Recurrent state rows (``numbakv.RecurrentCache``): the state-row kernel gathering /
scattering the gated-delta-net states of 8 of 16 sequences (4 layers, a float32 [32, 128, 128]
delta state and a bfloat16 [3, 8192] conv tail each), copying one sequence's state to a
restore-point row, and ``read_states``, against ``np.copyto`` of the same bytes timed
interleaved in the same process (``numbakv/tools/bench_states.py``). ``track_fraction``: the
share of the copy's bandwidth (issue 33's CPU target: >= 50% for gather and scatter)."""

from numbakv.tools import bench_states

_MEMO = {}


def _rows():
    if "cpu" not in _MEMO:
        _MEMO["cpu"] = {r["case"]: r for r in bench_states.run("cpu", budget=2.0, min_reps=5)}
    return _MEMO["cpu"]


class StateRows:
    params = [["gather", "scatter", "restore point", "read_states"]]
    param_names = ["case"]
    timeout = 600
    number = 1
    repeat = 1

    def track_fraction(self, case):
        return _rows()[case]["fraction"]

    track_fraction.unit = "fraction of np.copyto bandwidth"

    def track_gbps(self, case):
        return _rows()[case]["gbps"]

    track_gbps.unit = "GB/s"
