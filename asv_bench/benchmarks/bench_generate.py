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


class GenerateDecodeRate:
    """generate()'s decode step through numbakv against DynamicCache: the random-weight Llama
    of ``numbakv bench --sections generate`` (4 layers, 4 heads / 2 KV heads of 64, float32),
    a 2,048-token prompt, 32 new tokens, 1 torch thread; each step timed forward to forward in
    this thread's CPU time (``bench_generate._stepped``), the two contenders interleaved run by
    run (target: numbakv / DynamicCache <= 1)."""
    number = 1
    repeat = (1, 3, 300.0)
    timeout = 900

    def setup(self):
        import torch
        from numbakv.tools.bench_generate import _tiny_model, generate_fns
        torch.set_num_threads(1)
        if "model" not in _MEMO:
            model = _tiny_model(4, 2048)
            _MEMO.update(model=model, gen=generate_fns(model, 2048, 32))
        self.model, self.fns = _MEMO["model"], _MEMO["gen"]

    def track_numbakv_step_over_dynamic(self):
        import numpy as np
        import torch
        from numbakv.tools.bench_generate import _stepped
        steps = {"numbakv": [], "dynamic": []}
        runs = {k: _stepped(self.model, self.fns[k], 32, v) for k, v in steps.items()}
        with torch.no_grad():
            for _ in range(4):
                for run in runs.values():
                    run()
        cpu = {k: float(np.median([s[1] for s in v[1:]])) for k, v in steps.items()}
        return cpu["numbakv"] / cpu["dynamic"]

    track_numbakv_step_over_dynamic.unit = "ratio"


class GeneratePeakRSS:
    """Peak RSS of one generate() (the model and shape of ``GenerateDecodeRate``), each
    contender in a fresh process, 3 interleaved rounds (``bench_generate.peak_rss``), medians:
    numbakv against StaticCache (target: <= 1) and against StaticCache after numba's runtime
    alone (``numba_floor``: import numba and one cached ``@njit`` function), which separates
    numbakv's own share from numba's (~100 MiB on CPython 3.11, numba 0.68)."""
    number = 1
    repeat = (1, 1, 600.0)
    timeout = 900

    def setup(self):
        if "rss" not in _MEMO:
            from numbakv.tools.bench_generate import peak_rss
            _MEMO["rss"] = peak_rss(4, 2048, 32)
        self.rss = _MEMO["rss"]

    def track_numbakv_over_static(self):
        return self.rss["numbakv"]["median"] / self.rss["static"]["median"]

    track_numbakv_over_static.unit = "ratio"

    def track_numbakv_minus_numba_floor(self):
        return self.rss["numbakv"]["median"] - self.rss["numba_floor"]["median"]

    track_numbakv_minus_numba_floor.unit = "MiB"
