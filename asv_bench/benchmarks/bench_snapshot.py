"""Moving one sequence's K/V: ``export_seq`` + ``import_seq`` of 4,096 tokens of a 32-layer,
8 x 128 float16 cache (512 MiB) against a plain copy of the same bytes (``np.copyto`` on the
CPU, a pinned device -> host -> device copy on a GPU), timed interleaved in the same process
(see ``numbakv/tools/bench_snapshot.py``). ``track_fraction`` is the share of the copy's
bandwidth the snapshot reaches (issue 24's target: >= 50% on the CPU, >= 80% on a GPU, for
``views``: a sequence prefilled into one run of cells; issue 36's: >= 50% on the CPU for
``export_gather_pooled``, a snapshot of interleaved cells into recycled memory). CPU cases are
timed in thread CPU time."""

from numbakv.device import cuda_usable
from numbakv.tools import bench_snapshot

_MEMO = {}


def _rows(device):
    if device not in _MEMO:
        _MEMO[device] = {r["case"]: r for r in bench_snapshot.run(device, "float16",
                                                                 budget=3.0, min_reps=3)}
    return _MEMO[device]


class Snapshot:
    params = [["cpu", "cuda"], ["views", "gather", "export_gather", "export_gather_pooled",
                                "bytes"]]
    param_names = ["device", "case"]
    timeout = 900
    number = 1
    repeat = 1

    def setup(self, device, case):
        if device == "cuda" and not cuda_usable():
            raise NotImplementedError("no usable CUDA GPU")

    def track_fraction(self, device, case):
        return _rows(device)[case]["fraction"]

    track_fraction.unit = "fraction of copy bandwidth"

    def track_snapshot_gbps(self, device, case):
        return _rows(device)[case]["gbps"]

    track_snapshot_gbps.unit = "GB/s"
