"""Agent sessions replayed through hf.Server with a PrefixStore capped at 50% of the working set
(``numbakv/tools/bench_agents.py``, the quick trace): token hit rate with retention priorities
and load_edit, its lead over plain LRU on the same trace (target: >= 90% and >= 15 points, on
the full trace of ``numbakv bench --sections agents``), and the share of a stripped-reasoning
turn's prompt that is prefilled again (target <= 10%)."""

from numbakv.tools import bench_agents as ba


class AgentReplay:
    number = 1
    repeat = (1, 1, 300.0)
    timeout = 900

    def setup_cache(self):
        return ba.run_agents(quick=True)

    setup_cache.timeout = 900

    def track_hit_rate_retained(self, res):
        return res["retained"]["hit_rate"]

    track_hit_rate_retained.unit = "percent"

    def track_hit_rate_lead_over_lru(self, res):
        return res["retained"]["hit_rate"] - res["lru"]["hit_rate"]

    track_hit_rate_lead_over_lru.unit = "points"

    def track_strip_prefill_pct_max(self, res):
        return res["retained"]["strip_prefill_pct_max"]

    track_strip_prefill_pct_max.unit = "percent"

    def track_ttft_speedup(self, res):
        return res["retained"]["ttft_speedup"]

    track_ttft_speedup.unit = "ratio"
