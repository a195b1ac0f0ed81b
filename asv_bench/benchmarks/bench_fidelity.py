"""``shared_shift="copy"`` (issue 29): a forked sequence's ``remove`` that moves 510 cells it
shares with its parent, against the same ``remove`` on an unshared twin and against the copy
alone. ``track_extra_over_copy`` is the ratio (copy mode - twin) / copy alone measured in one
process (target <= 1.25: the extra cost is the copy of the shared cells only)."""

from numbakv.device import cuda_usable
from numbakv.tools.bench_fidelity import run


class SharedShiftCopy:
    params = [["cpu", "cuda"]]
    param_names = ["device"]
    timeout = 300

    def setup(self, device):
        if device == "cuda" and not cuda_usable():
            raise NotImplementedError("no CUDA GPU")

    def track_extra_over_copy(self, device):
        return run(device=device, repeats=9)["extra_over_copy"]

    track_extra_over_copy.unit = "ratio"
