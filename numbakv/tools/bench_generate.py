"""``numbakv bench --sections generate``: transformers ``generate()`` through numbakv against
transformers' own ``StaticCache`` and ``DynamicCache`` (CPU, torch threads set explicitly).

Two measurements, each at 1 and 2 torch threads, contenders interleaved rep by rep (a busy
machine slows them together), median and spread (min-max) reported:

* **per-step cost** of the cache and the attention of one decode token (batch 1), every layer
  of a ``layers x kv_heads x head_dim`` model at ``context`` tokens: StaticCache ``update`` +
  SDPA over its fixed-size buffer with the step's mask, DynamicCache ``update`` + SDPA (then
  ``crop`` back), and a numbakv generation cache's layers (``update`` = put, the attention
  through the dispatcher ``generate()`` uses: ``attend`` over the cell pool), then rolled back;
  no model weights (a meta-device model gives the shapes).
* **generate() tok/s**: a small random-weight Llama, a ``context``-token prompt, greedy;
  the decode rate is ``(new - 1) / (t(new tokens) - t(1 token))`` so the prompt's pass cancels;
  and the **decode step** itself, timed forward to forward inside the same runs (wall and CPU
  time): the prompt's pass is most of a run and most of the rate's noise, the step is not.
* **peak RSS** of one ``generate()`` per contender, each in its own child process, rounds
  interleaved; beside them the floor of numba's runtime: StaticCache in a process that first
  loads one cached ``@njit`` function (``import numba``, LLVM's NRT module, numba's registries),
  which is what any CPU process running numba code pays whatever the function.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import numpy as np

CONTENDERS = ("numbakv", "static", "dynamic")
#: the peak-RSS section also runs StaticCache after numba's runtime is loaded (see _rss_child)
RSS_CONTENDERS = CONTENDERS + ("numba_floor",)
#: interleaved rounds of the peak-RSS children (one child per contender and round)
RSS_ROUNDS = 3
#: a module with one cached ``@njit`` function, nothing of numbakv: loading it sets up numba's
#: runtime exactly as a cached numbakv function does (``Cache.load_overload`` refreshes the
#: target context and compiles the NRT module first)
_NUMBA_FLOOR_MODULE = """import numba
import numpy as np


@numba.njit(cache=True)
def one(a):
    return a.sum()


def load():
    return one(np.ones(4))
"""
#: the per-step section also times numbakv with q8_0 K/V (read quantized by attend's kernel)
STEP_CONTENDERS = CONTENDERS + ("numbakv_q8_0",)


def _spread_timer(fns: Dict[str, Callable[[], Any]], reps: int) -> Dict[str, dict]:
    """Each function ``reps`` times, interleaved after one warm-up call each: median, min, max
    seconds."""
    for fn in fns.values():
        fn()
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: {"median": float(np.median(v)), "min": float(min(v)), "max": float(max(v))}
            for k, v in times.items()}


def _llama_config(layers: int, kv_heads: int, head_dim: int, hidden_heads: int, vocab: int,
                  context: int):
    import transformers
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden_heads * head_dim,
                                    intermediate_size=2 * hidden_heads * head_dim,
                                    num_hidden_layers=layers, num_attention_heads=hidden_heads,
                                    num_key_value_heads=kv_heads, head_dim=head_dim,
                                    max_position_embeddings=context + 256)


# ------------------------------------------------------------------------- per-step cost
def step_cases(layers: int, kv_heads: int, head_dim: int, context: int, dtype: str) -> dict:
    """The three contenders' decode-step callables over caches prefilled to ``context``."""
    import torch
    import transformers
    from numbakv import hf
    from numbakv.hf.generation import _dispatch, _local
    from numbakv.hf.attach import _attention_modules
    tdt = getattr(torch, dtype)
    n_heads = 4 * kv_heads
    config = _llama_config(layers, kv_heads, head_dim, n_heads, 64, context)
    config.dtype = dtype
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    modules = _attention_modules(model)
    g = torch.Generator().manual_seed(0)
    pk = torch.randn(1, kv_heads, context, head_dim, generator=g).to(tdt)
    pv = torch.randn(1, kv_heads, context, head_dim, generator=g).to(tdt)
    q = torch.randn(1, n_heads, 1, head_dim, generator=g).to(tdt)
    k1 = torch.randn(1, kv_heads, 1, head_dim, generator=g).to(tdt)
    v1 = torch.randn(1, kv_heads, 1, head_dim, generator=g).to(tdt)
    scale = head_dim ** -0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention

    static = transformers.StaticCache(config=config, max_cache_len=context + 16)
    for layer in range(layers):
        static.update(pk, pv, layer, {"cache_position": torch.arange(context)})
    pos = torch.tensor([context])

    outs: Dict[str, Any] = {}

    def static_step():
        mask = (torch.arange(context + 16) <= context)[None, None, None, :]   # once per step
        for layer in range(layers):
            k, v = static.update(k1, v1, layer, {"cache_position": pos})
            outs["static"] = sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        for lay in static.layers:            # back to `context` tokens (5.x counts them itself)
            if hasattr(lay, "cumulative_length") and torch.is_tensor(lay.cumulative_length):
                lay.cumulative_length.fill_(context)

    dynamic = transformers.DynamicCache(config=config)
    for layer in range(layers):
        dynamic.update(pk, pv, layer)

    def dynamic_step():
        for layer in range(layers):
            k, v = dynamic.update(k1, v1, layer)
            outs["dynamic"] = sdpa(q, k, v, scale=scale, enable_gqa=True)
        dynamic.crop(-1)                       # back to `context` tokens

    def numbakv_contender(name: str, **kw):
        past = hf.generation_cache(model, max_new_tokens=16, dtype=dtype, device="cpu", **kw)
        for layer in range(layers):
            past.layers[layer].update(pk, pv)
            _local.handoff = None              # the prompt's attention is not timed
        state = past.layers[0].state

        def step():
            for layer in range(layers):
                k, v = past.layers[layer].update(k1, v1)
                outs[name] = _dispatch(modules[layer], q, k, v, None, scaling=scale)[0]
            past.numbakv_cache.seq_rm(int(state.seqs[0]), context)   # back to `context`
            state.columns -= 1
            for lay in past.layers:
                lay.cumulative_length -= 1
        return step

    numbakv_step = numbakv_contender("numbakv")
    q8_step = numbakv_contender("numbakv_q8_0", k_dtype="q8_0", v_dtype="q8_0")

    def max_abs_diff() -> float:
        """numbakv's last-layer output against StaticCache's SDPA (one step each)."""
        numbakv_step()
        static_step()
        ref = outs["static"].transpose(1, 2).float()          # [1, 1, H, D]
        return float((outs["numbakv"].float() - ref).abs().max())

    return {"numbakv": numbakv_step, "static": static_step, "dynamic": dynamic_step,
            "numbakv_q8_0": q8_step, "check": max_abs_diff}


# ------------------------------------------------------------------------- generate()
def _tiny_model(layers: int, context: int, seed: int = 0):
    import torch
    import transformers
    config = _llama_config(layers, 2, 64, 4, 256, context)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    return model


def generate_fns(model, context: int, new: int) -> Dict[str, Callable[[int], Any]]:
    """``{contender: f(n_new)}`` running one greedy generate() of ``n_new`` tokens."""
    import torch
    import warnings
    ids = torch.randint(3, 256, (1, context), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)

    def run(n, **kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0, **kw)

    def numbakv(n):
        from numbakv import hf       # here: the baselines' peak-RSS children never import it
        return run(n, past_key_values=hf.generation_cache(model, max_new_tokens=n))

    return {"numbakv": numbakv,
            "static": lambda n: run(n, cache_implementation="static"),
            "dynamic": lambda n: run(n)}


def _stepped(model, fn: Callable[[int], Any], new: int,
             out: List[np.ndarray]) -> Callable[[], Any]:
    """``fn(new)`` that also appends to ``out`` the median decode step of the run, ``[wall,
    CPU]`` seconds: the time from one forward pass of ``model`` to the next (and from the last
    one to the end of generate()), the prompt's pass left out. Each step is timed on its own,
    so the prompt's pass - ~90% of a 2k-token generate() of 32 tokens on the CPU, and most of
    the noise of the ``t(new) - t(1)`` rate - does not enter it. CPU time is this thread's
    (``time.thread_time``: torch at 1 thread computes on it), which preemption by other
    processes does not inflate."""
    def run():
        stamps: List[tuple] = []
        hook = model.register_forward_pre_hook(
            lambda *_: stamps.append((time.perf_counter(), time.thread_time())))
        try:
            result = fn(new)
        finally:
            hook.remove()
        stamps.append((time.perf_counter(), time.thread_time()))
        out.append(np.median(np.diff(np.array(stamps[1:]), axis=0), axis=0))
        return result
    return run


def _peak_rss_mib() -> float:
    """This process's peak resident set (MiB): ``VmHWM`` (getrusage's ru_maxrss is inherited
    from the parent across fork and exec on Linux, so a child would report the parent's)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_child(contender: str, layers: int, context: int, new: int,
               floor_dir: str = "") -> float:
    """Peak RSS (MiB) of a child process that runs one generate() through ``contender``. The
    child loads this file by path, not as ``numbakv.tools.bench_generate``: importing the
    package would load numbakv and numba into the StaticCache / DynamicCache children too,
    which a user of those never has (it hid ~70 MiB of numbakv's cost in the first figures).
    ``numba_floor``: StaticCache after loading the cached function of the module in
    ``floor_dir`` (:data:`_NUMBA_FLOOR_MODULE`, compiled there by :func:`_numba_floor_dir`)."""
    floor = contender == "numba_floor"
    code = ("import importlib.util, json, sys, torch\n"
            f"spec = importlib.util.spec_from_file_location('_bench_generate', {__file__!r})\n"
            "b = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(b)\n"
            + (f"sys.path.insert(0, {floor_dir!r})\nimport _numba_floor\n_numba_floor.load()\n"
               if floor else "")
            + f"torch.set_num_threads(1)\nm = b._tiny_model({layers}, {context})\n"
            f"b.generate_fns(m, {context}, {new})[{'static' if floor else contender!r}]({new})\n"
            f"assert ('numbakv' in sys.modules) == ({contender!r} == 'numbakv')\n"
            "print(json.dumps(b._peak_rss_mib()))\n")
    out = _run_child(code, f"peak-RSS child ({contender})", 900)
    return float(out.strip().splitlines()[-1])


def _run_child(code: str, what: str, timeout: int) -> str:
    """stdout of a child Python running ``code`` (this interpreter and environment), bounded by
    ``timeout`` seconds; ``RuntimeError`` naming ``what`` with the tail of its stderr if it
    fails."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout, env=dict(os.environ))
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def _numba_floor_dir(directory: str) -> str:
    """Write :data:`_NUMBA_FLOOR_MODULE` into ``directory`` and compile its function once, in a
    child, into numba's cache there (so the measured children load it, as numbakv's shipped code
    is loaded, instead of compiling it)."""
    with open(os.path.join(directory, "_numba_floor.py"), "w") as f:
        f.write(_NUMBA_FLOOR_MODULE)
    code = (f"import sys\nsys.path.insert(0, {directory!r})\n"
            "import _numba_floor\n_numba_floor.load()\n")
    _run_child(code, "numba floor module", 600)
    return directory


def peak_rss(layers: int, context: int, new: int, rounds: int = RSS_ROUNDS,
             log: Callable[[str], None] = lambda _: None) -> Dict[str, dict]:
    """``{contender: {"median", "min", "max", "rounds"}}`` (MiB) over ``rounds`` interleaved
    rounds of :func:`_rss_child` for every contender of :data:`RSS_CONTENDERS`."""
    per: Dict[str, List[float]] = {name: [] for name in RSS_CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="numbakv_floor_") as floor_dir:
        _numba_floor_dir(floor_dir)
        for r in range(rounds):
            for name in RSS_CONTENDERS:
                log(f"generate: peak RSS, {name}, round {r + 1}/{rounds} ...")
                per[name].append(_rss_child(name, layers, context, new, floor_dir))
    return {name: {"median": float(np.median(v)), "min": min(v), "max": max(v), "rounds": v}
            for name, v in per.items()}


def run_generate(quick: bool, log: Callable[[str], None] = lambda _: None) -> dict:
    """Every figure of the section (see the module docstring)."""
    import torch
    if quick:
        step_shape = dict(layers=4, kv_heads=2, head_dim=64, context=256)
        gen = dict(layers=2, context=256, new=8)
        reps, gen_reps = 5, 3
    else:
        step_shape = dict(layers=32, kv_heads=8, head_dim=128, context=2048)
        gen = dict(layers=4, context=2048, new=32)
        reps, gen_reps = 15, 5
    threads_before = torch.get_num_threads()
    res: dict = {"step_shape": step_shape, "generate_shape": gen, "steps": [], "generate": [],
                 "rss_mib": {}}
    try:
        for dtype in (("float32", "bfloat16") if quick else ("float16", "bfloat16")):
            fns = step_cases(dtype=dtype, **step_shape)
            diff = fns.pop("check")()
            for threads in (1, 2):
                torch.set_num_threads(threads)
                log(f"generate: per-step cost, {dtype}, {threads} thread(s) ...")
                t = _spread_timer(fns, reps)
                res["steps"].append({"dtype": dtype, "threads": threads,
                                     "max_abs_diff_vs_static": diff, **{
                    k: {m: v * 1e3 for m, v in d.items()} for k, d in t.items()}})
        model = _tiny_model(gen["layers"], gen["context"])
        fns = generate_fns(model, gen["context"], gen["new"])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            log(f"generate: generate() tok/s, {threads} thread(s) ...")
            steps: Dict[str, List[np.ndarray]] = {name: [] for name in fns}
            with torch.no_grad():
                pairs = {}
                for name, fn in fns.items():
                    pairs[f"{name}:n"] = _stepped(model, fn, gen["new"], steps[name])
                    pairs[f"{name}:1"] = (lambda f=fn: f(1))
                t = _spread_timer(pairs, gen_reps)
            row = {"threads": threads}
            for name in fns:
                per_rep = np.array(steps[name][1:]) * 1e3     # the warm-up call left out
                row[f"{name}_step"] = {
                    "wall_ms": float(np.median(per_rep[:, 0])),
                    "wall_ms_min": float(per_rep[:, 0].min()),
                    "wall_ms_max": float(per_rep[:, 0].max()),
                    "cpu_ms": float(np.median(per_rep[:, 1])),
                    "cpu_ms_min": float(per_rep[:, 1].min()),
                    "cpu_ms_max": float(per_rep[:, 1].max())}
                dt = t[f"{name}:n"]["median"] - t[f"{name}:1"]["median"]
                lo = t[f"{name}:n"]["min"] - t[f"{name}:1"]["max"]
                hi = t[f"{name}:n"]["max"] - t[f"{name}:1"]["min"]
                n = gen["new"] - 1
                row[name] = {"tok_s": n / dt if dt > 0 else float("nan"),
                             "tok_s_min": n / hi if hi > 0 else float("nan"),
                             "tok_s_max": n / lo if lo > 0 else float("inf")}
            res["generate"].append(row)
        if not quick:
            res["rss_mib"] = peak_rss(gen["layers"], gen["context"], gen["new"], log=log)
    finally:
        torch.set_num_threads(threads_before)
    return res


def _format_rss(rss: Dict[str, dict]) -> List[str]:
    """Report lines of :func:`peak_rss`'s figures."""
    own = rss["numbakv"]["median"] - rss["numba_floor"]["median"]
    runtime = rss["numba_floor"]["median"] - rss["static"]["median"]
    return [f"peak RSS of one generate() (own process, MiB, median [min-max] of "
            f"{len(rss['numbakv']['rounds'])} interleaved rounds): " + ", ".join(
                f"{k} {v['median']:.0f} [{v['min']:.0f}-{v['max']:.0f}]" for k, v in rss.items()),
            f"  numba_floor = StaticCache after numba's runtime (import numba, one cached "
            f"function): numbakv - floor {own:+.0f} MiB, floor - StaticCache {runtime:+.0f} MiB"]


def format_generate(res: dict) -> List[str]:
    """Report lines of the section."""
    if not res:
        return []
    s = res["step_shape"]
    lines = ["", f"generate(): per decode step, cache + attention of {s['layers']} layers x "
             f"{s['kv_heads']} KV heads x {s['head_dim']} at {s['context']} tokens, batch 1 "
             "(ms, median [min-max]; ratio = numbakv / StaticCache; |diff| = numbakv's output "
             "vs StaticCache's)"]
    lines.append(f"{'dtype':<9} {'thr':>3} {'numbakv':>22} {'StaticCache':>22} "
                 f"{'DynamicCache':>22} {'numbakv q8_0':>22} {'vs static':>9} {'|diff|':>8}")
    for r in res["steps"]:
        cells = [f"{r[k]['median']:.2f} [{r[k]['min']:.2f}-{r[k]['max']:.2f}]"
                 for k in STEP_CONTENDERS]
        lines.append(f"{r['dtype']:<9} {r['threads']:>3} {cells[0]:>22} {cells[1]:>22} "
                     f"{cells[2]:>22} {cells[3]:>22} "
                     f"{r['numbakv']['median'] / r['static']['median']:>9.2f} "
                     f"{r['max_abs_diff_vs_static']:>8.1e}")
    g = res["generate_shape"]
    lines += ["", f"generate() decode tok/s: random-weight Llama, {g['layers']} layers, "
              f"{g['context']}-token prompt, {g['new']} new tokens, greedy (median [range])"]
    lines.append(f"{'thr':>3} {'numbakv':>22} {'StaticCache':>22} {'DynamicCache':>22}")
    for r in res["generate"]:
        cells = [f"{r[k]['tok_s']:.1f} [{r[k]['tok_s_min']:.1f}-{r[k]['tok_s_max']:.1f}]"
                 for k in CONTENDERS]
        lines.append(f"{r['threads']:>3} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22}")
    lines += ["", "generate() decode step, timed forward to forward inside the runs above (ms, "
              "median [range] of the runs' medians; wall, and this thread's CPU time: all of a step's "
              "CPU at 1 torch thread, not torch's workers at 2)"]
    lines.append(f"{'thr':>3} {'clock':>5} {'numbakv':>22} {'StaticCache':>22} "
                 f"{'DynamicCache':>22} {'numbakv/dyn':>11}")
    for r in res["generate"]:
        if "numbakv_step" not in r:
            continue
        for clock in ("wall", "cpu"):
            cells = [f"{r[k + '_step'][clock + '_ms']:.3f} [{r[k + '_step'][clock + '_ms_min']:.3f}-"
                     f"{r[k + '_step'][clock + '_ms_max']:.3f}]" for k in CONTENDERS]
            ratio = r["numbakv_step"][clock + "_ms"] / r["dynamic_step"][clock + "_ms"]
            lines.append(f"{r['threads']:>3} {clock:>5} {cells[0]:>22} {cells[1]:>22} "
                         f"{cells[2]:>22} {ratio:>11.2f}")
    if res.get("rss_mib"):
        lines += _format_rss(res["rss_mib"])
    return lines


if __name__ == "__main__":      # pragma: no cover - a quick look without the CLI
    print("\n".join(format_generate(run_generate("--quick" in sys.argv, print))))
    print(json.dumps({}))
