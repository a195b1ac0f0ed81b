"""transformers generate() through numbakv: one decode step's cache + attention (8 layers x
8 KV heads x 128 at 2k tokens, batch 1) through a generation cache's layers and numbakv's
attention dispatcher, against StaticCache and DynamicCache with SDPA, measured interleaved in
one process at 1 and 2 torch threads (``numbakv/tools/bench_generate.py``; target: numbakv /
StaticCache <= 1)."""

from numbakv.tools.bench import _time_alternating

_MEMO = {}


class GenerateDecodeStep:
    params = [["float16", "bfloat16"], [1, 2]]
    param_names = ["dtype", "threads"]
    number = 1
    repeat = (3, 10, 30.0)

    def setup(self, dtype, threads):
        import torch
        from numbakv.tools.bench_generate import step_cases
        torch.set_num_threads(threads)
        if _MEMO.get("dtype") != dtype:
            fns = step_cases(layers=8, kv_heads=8, head_dim=128, context=2048, dtype=dtype)
            fns.pop("check")
            _MEMO.update(dtype=dtype, fns=fns)
        self.fns = _MEMO["fns"]

    def time_numbakv(self, dtype, threads):
        self.fns["numbakv"]()

    def time_static(self, dtype, threads):
        self.fns["static"]()

    def time_dynamic(self, dtype, threads):
        self.fns["dynamic"]()

    def track_numbakv_over_static(self, dtype, threads):
        t = _time_alternating(self.fns, 0.5, 10)
        return t["numbakv"] / t["static"]

    track_numbakv_over_static.unit = "ratio"
