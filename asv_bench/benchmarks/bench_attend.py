"""attend() on the CPU at the demo's shapes (4 query / 2 KV heads of 16, four sequences with
interleaved cells, a 16-token prefill chunk mixed with three decodes) against SDPA per sequence
over its own contiguous K/V, measured interleaved in one process
(``numbakv/tools/bench_attend.py``; target <= 1.3x). 8 x 4k decode is in ``bench_attention``."""

from numbakv.tools.bench import _time_alternating
from numbakv.tools.bench_attend import demo_shape_case

_MEMO = {}


class AttendDemoShapes:
    params = [["float32", "float16"]]
    param_names = ["dtype"]
    number = 1
    repeat = (3, 10, 30.0)

    def setup(self, dtype):
        if _MEMO.get("dtype") != dtype:
            old = _MEMO.pop("case", None)
            if old is not None:
                old["cache"].close()
            _MEMO.update(dtype=dtype, case=demo_shape_case(dtype))
        self.case = _MEMO["case"]

    def time_attend(self, dtype):
        self.case["fns"]["attend"]()

    def time_floor(self, dtype):
        self.case["fns"]["floor"]()

    def track_attend_over_floor(self, dtype):
        t = _time_alternating(self.case["fns"], 0.5, 20)
        return t["attend"] / t["floor"]

    track_attend_over_floor.unit = "ratio"
