"""numbakv.dist: one sequence (float16, 32 layers x 8 KV heads x 128) moved between two spawned
processes over gloo on loopback, against torch.distributed send/recv of one tensor of the same
bytes in the same run (numbakv.tools.bench_dist). Tracked: the ratio tensor time / sequence time
(issue 28's target: >= 0.5) and the sequence's transfer time."""

import argparse


def _args(tokens: int) -> argparse.Namespace:
    return argparse.Namespace(tokens=tokens, layers=32, heads=8, dim=128, dtype="float16",
                              k_dtype=None, v_dtype=None, repeat=3, timeout=600.0,
                              transport="torch")


class DistTransfer:
    params = [1024, 4096]
    param_names = ["tokens"]
    timeout = 900
    number = 1
    repeat = 1

    def setup_cache(self):
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            raise NotImplementedError("needs torch")  # asv skips the benchmark
        from numbakv.tools.bench_dist import run
        return {t: run(_args(t)) for t in self.params}

    def track_ratio_vs_one_tensor(self, results, tokens):
        return results[tokens]["ratio"]

    track_ratio_vs_one_tensor.unit = "ratio"

    def track_seq_seconds(self, results, tokens):
        return results[tokens]["seq_s"]

    track_seq_seconds.unit = "seconds"
