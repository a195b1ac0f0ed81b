"""A hybrid model (tiny Qwen3-Next: gated delta net + attention) served by hf.Server over a
HybridCache: a 3-turn chat's last turn with the prefix stored against the same turn computed
from scratch (``numbakv/tools/bench_hybrid.py``; target: time to first token >= 5x faster with
the store, ``numbakv bench --sections hybrid`` runs the 10- and 30-turn traces)."""

from numbakv.tools import bench_hybrid as bh


class HybridChatTurn:
    number = 1
    repeat = (1, 3, 120.0)
    timeout = 600

    def setup(self):
        import torch
        torch.set_num_threads(1)
        self.model = bh.tiny_qwen3_next()
        self.trace = bh.chat_trace(turns=3, system=1024, user=32, reply=2)

    def _run(self, store):
        total = sum(len(t["append"]) + t["out"] for t in self.trace) + 64
        return bh.run_trace(self.model, self.trace, store=store, capacity=total)

    def track_ttft_speedup(self):
        stored, cold = self._run(True), self._run(False)
        return cold["turns"][-1]["ttft_s"] / stored["turns"][-1]["ttft_s"]

    track_ttft_speedup.unit = "ratio"

    def track_reuse_pct_last_turn(self):
        t = self._run(True)["turns"][-1]
        return 100.0 * t["reused"] / t["prompt"]

    track_reuse_pct_last_turn.unit = "percent"
