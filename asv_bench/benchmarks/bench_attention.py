"""Attention over the cache, one layer, 32 query heads per 8 KV heads x 128: numbakv's
``attend`` (per-sequence page tables) against SDPA over each sequence's own contiguous K/V (the
floor, what attention costs with no cache in the way) and against ``get()`` + dense masked SDPA
over the union of the batch's cells (Ollama's form). Cases: decode of 8 sequences x 4k, a 512-token
prefill chunk into a 4k sequence, decode of 64 sequences x 2k; float32 and float16.

``track_attend_over_floor`` / ``track_dense_over_floor`` report the time ratios measured in the
same process with the calls interleaved (the issue's target: attend <= 1.3x the floor for 8 x 4k
decode). The workload is built once per process and parameter set.
"""

from numbakv.tools.bench import _Device, _time_alternating, attention_case
from numbakv.device import cuda_usable

CASES = {"decode 8x4k": (8, 4096, 1), "prefill 512 into 4k": (1, 3584, 512),
         "decode 64x2k": (64, 2048, 1)}

_MEMO = {}


def _case(device, dtype, case):
    key = (device, dtype, case)
    if _MEMO.get("key") != key:
        old = _MEMO.pop("case", None)
        if old is not None:
            old["cache"].close()
        _MEMO.clear()
        n_seq, context, n_q = CASES[case]
        _MEMO.update(key=key, case=attention_case(_Device(device), dtype, n_seq, context, n_q))
    return _MEMO["case"]


class Attention:
    params = [["cpu", "cuda"], ["float32", "float16"], list(CASES)]
    param_names = ["device", "dtype", "case"]
    timeout = 600
    number = 1
    repeat = (3, 10, 60.0)

    def setup(self, device, dtype, case):
        try:
            import torch  # noqa: F401
        except ImportError:
            raise NotImplementedError("needs PyTorch")
        if device == "cuda" and not cuda_usable():
            raise NotImplementedError("no usable CUDA GPU")
        self.case = _case(device, dtype, case)
        self.fns = self.case["fns"]
        self.sync = _Device(device).sync

    def time_attend(self, device, dtype, case):
        """numbakv.attention.attend, torch backend (page table built once per pass)."""
        self.fns["torch"]()
        self.sync()

    def time_floor(self, device, dtype, case):
        """SDPA over each sequence's own contiguous K/V."""
        self.fns["floor"]()
        self.sync()

    def time_floor_nhd(self, device, dtype, case):
        """SDPA over each sequence's own K/V, token-major [n, Hkv, D] (the cell pool's layout)."""
        self.fns["floor_nhd"]()
        self.sync()

    def time_dense(self, device, dtype, case):
        """get() + masked SDPA over the union of the batch's cells."""
        self.fns["dense"]()
        self.sync()

    def time_page_table(self, device, dtype, case):
        """Building the page table (once per forward pass)."""
        self.case["page_table"]()
        self.sync()

    def track_attend_over_floor(self, device, dtype, case):
        t = _time_alternating({"a": self.fns["torch"], "f": self.fns["floor"]}, 2.0, 3)
        return t["a"] / t["f"]

    track_attend_over_floor.unit = "x floor"

    def track_attend_over_floor_nhd(self, device, dtype, case):
        t = _time_alternating({"a": self.fns["torch"], "f": self.fns["floor_nhd"]}, 2.0, 3)
        return t["a"] / t["f"]

    track_attend_over_floor_nhd.unit = "x floor"

    def track_dense_over_floor(self, device, dtype, case):
        t = _time_alternating({"d": self.fns["dense"], "f": self.fns["floor"]}, 2.0, 3)
        return t["d"] / t["f"]

    track_dense_over_floor.unit = "x floor"
