"""``numbakv demo``: a tiny Llama-style model serving several sequences through one cache.

What it shows, on the default device of the machine it runs on (CuPy on a GPU, numpy on the
CPU; no framework needed):

* ``TinyLlama``: RMSNorm, rotary embeddings with NeoX pairing, grouped-query attention that reads
  ``get()``'s keys, values and mask, a SwiGLU MLP; seeded random weights, float32 math, keys and
  values stored in the cache's dtype.
* ``Workload``: a deterministic serving trace: requests arriving and finishing at different
  times, chunked prefill mixed with decode in the same batch, a shared system prompt, and
  follow-up turns of earlier conversations. Requests are served through ``nkv.PromptCache``
  (Ollama's runner slot logic): a new request takes the slot holding its longest prefix, a
  shared system prompt is forked from another sequence with ``copy_prefix``, a follow-up turn
  reuses its conversation still cached in a released slot, and context shift (keep the first
  tokens, drop half of the rest: ``remove`` + rotary re-rotation of the keys that move) runs
  through ``PromptCache.shift``; the automatic defrag runs when fragmentation leaves no
  contiguous run for a batch.
* Verification at every step: each token's logits equal a recomputation without the cache, and
  every cell a batch reads holds the layer-0 key and value of its (sequence, position), freshly
  computed from the token id and position (the keys moved by a shift included). A mismatch raises
  ``DemoVerificationError``.
* A progress bar, a final table and a picture of which request owns which cell over time (PNG
  with matplotlib, a terminal rendering without it).
* The prefix-store segment (``demo_prefix``; ``prefix_store=True``, on by default on the command
  line): users' multi-turn chats through ``PromptCache(store=PrefixStore(...))``, tokens reused
  per tier vs computed, drawn as the picture's lower panel.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..causal import CausalCache
from ..config import CacheConfig, RopeShift, normalize_dtype
from ..device import array_module, resolve_device, synchronize
from ..errors import NoSlotError, ReprocessError
from ..prompt import PromptCache
from ._demo_errors import DemoVerificationError  # re-exported (__all__)

#: Owner codes in the occupancy picture besides request ids (>= 0).
FREE = -1
SHARED = -2   # a cell shared by more than one sequence (the system prompt, via copy_prefix)


# ---------------------------------------------------------------------------- dtype helpers
def _to_host(x) -> np.ndarray:
    if type(x).__module__.split(".")[0] == "cupy":
        return x.get()
    return np.asarray(x)


def _bf16_bits(x, xp):
    """float32 -> bfloat16 bit patterns (round to nearest, ties to even)."""
    bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32).astype(xp.uint64)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    return ((bits + rounding) >> 16).astype(xp.uint16)


def _bf16_to_f32(bits, xp):
    return (xp.asarray(bits).astype(xp.uint32) << 16).view(xp.float32)


def to_storage(x, dtype: str, xp):
    """float32 model tensor -> what ``put`` takes for a cache of ``dtype``."""
    if dtype == "float32":
        return xp.ascontiguousarray(x, dtype=xp.float32)
    if dtype == "float16":
        return x.astype(xp.float16)
    return _bf16_bits(x, xp)


def _attend_torch():
    """torch when it is importable (the demo's attention then runs numbakv.attention.attend over
    the page table), else None (attention over get()'s dense views and mask)."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - a missing or broken torch: use get()
        return None
    return torch


def from_storage(x, dtype: str, xp):
    """A ``get()`` view (bfloat16 views included) as float32."""
    if dtype == "bfloat16":
        return _bf16_to_f32(getattr(x, "bits", x), xp)
    return xp.asarray(x).astype(xp.float32, copy=False)


def quantize(x, dtype: str, xp):
    """float32 values rounded to what a cache of ``dtype`` keeps."""
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(xp.float16).astype(xp.float32)
    return _bf16_to_f32(_bf16_bits(x, xp), xp)


# ---------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the tiny model: ``n_heads`` query heads share ``n_kv_heads`` key/value heads."""

    n_layers: int = 4
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    d_ff: int = 128
    vocab: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


class TinyLlama:
    """A Llama-style decoder with seeded random weights, written with the device's array module.

    Per layer: ``x += Wo · attn(rope(Wq·n), rope(Wk·n), Wv·n)`` with ``n = rmsnorm(x)`` and
    grouped-query attention, then ``x += W_down · (silu(W_gate·m) * (W_up·m))`` with
    ``m = rmsnorm(x)``; logits ``= W_out · rmsnorm(x)``. float32 throughout.
    """

    def __init__(self, config: ModelConfig = ModelConfig(), *, seed: int = 0, xp=np) -> None:
        self.config = c = config
        self.xp = xp
        rng = np.random.default_rng(seed)

        def w(*shape, scale):
            return xp.asarray((rng.standard_normal(shape) * scale).astype(np.float32))

        def norm_weight():
            return xp.asarray((1.0 + 0.1 * rng.standard_normal(c.d_model)).astype(np.float32))

        d, hd = c.d_model, c.head_dim
        self.embed = w(c.vocab, d, scale=1.0)
        self.layers = []
        for _ in range(c.n_layers):
            self.layers.append(dict(
                attn_norm=norm_weight(),
                wq=w(d, c.n_heads * hd, scale=d ** -0.5),
                wk=w(d, c.n_kv_heads * hd, scale=d ** -0.5),
                wv=w(d, c.n_kv_heads * hd, scale=d ** -0.5),
                wo=w(c.n_heads * hd, d, scale=(c.n_heads * hd) ** -0.5),
                ffn_norm=norm_weight(),
                w_gate=w(d, c.d_ff, scale=d ** -0.5),
                w_up=w(d, c.d_ff, scale=d ** -0.5),
                w_down=w(c.d_ff, d, scale=c.d_ff ** -0.5)))
        self.final_norm = norm_weight()
        self.w_out = w(d, c.vocab, scale=d ** -0.5)
        #: the cache re-rotates moved keys with exactly the model's rotary parameters
        self.rope_shift = RopeShift(base=c.rope_base, neox=True)
        self.inv_freq = xp.asarray(self.rope_shift.inv_freq(hd))

    # -- pieces (x: [tokens, d_model]) --------------------------------------------------
    def rmsnorm(self, x, weight):
        xp = self.xp
        return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + self.config.norm_eps) * weight

    def rope(self, x, positions):
        """NeoX (rotate-half) rotary embedding of ``x`` ``[tokens, heads, head_dim]`` at
        ``positions`` ``[tokens]``: pair ``(x[i], x[i + head_dim/2])`` turns by
        ``pos * base**(-2i/head_dim)``."""
        xp = self.xp
        angle = xp.asarray(positions, dtype=xp.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = xp.cos(angle)[:, None, :], xp.sin(angle)[:, None, :]
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return xp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def qkv(self, layer: int, x, positions):
        """Roped queries ``[t, n_heads, hd]``, roped keys and values ``[t, n_kv_heads, hd]``."""
        c, p = self.config, self.layers[layer]
        h = self.rmsnorm(x, p["attn_norm"])
        q = (h @ p["wq"]).reshape(x.shape[0], c.n_heads, c.head_dim)
        return (self.rope(q, positions),) + self._roped_kv(p, h, positions)

    def key_value(self, layer: int, x, positions):
        """Roped keys and values ``[t, n_kv_heads, hd]`` of layer inputs ``x`` ``[t, d]``."""
        p = self.layers[layer]
        return self._roped_kv(p, self.rmsnorm(x, p["attn_norm"]), positions)

    def _roped_kv(self, p, h, positions):
        """Roped keys and values ``[t, n_kv_heads, hd]`` of the normed inputs ``h`` ``[t, d]``
        of the layer whose weights are ``p``."""
        c, t = self.config, h.shape[0]
        k = (h @ p["wk"]).reshape(t, c.n_kv_heads, c.head_dim)
        v = (h @ p["wv"]).reshape(t, c.n_kv_heads, c.head_dim)
        return self.rope(k, positions), v

    def attention(self, q, keys, values, mask):
        """Grouped-query attention: ``q`` ``[t, n_heads, hd]``, ``keys``/``values``
        ``[n, n_kv_heads, hd]``, additive ``mask`` ``[t, n]`` (0 or -inf) -> ``[t, n_heads*hd]``."""
        xp, c = self.xp, self.config
        t = q.shape[0]
        group = c.n_heads // c.n_kv_heads
        qg = q.reshape(t, c.n_kv_heads, group, c.head_dim).transpose(1, 0, 2, 3)  # [kv, t, g, hd]
        qg = qg.reshape(c.n_kv_heads, t * group, c.head_dim)
        k = keys.transpose(1, 2, 0)                                              # [kv, hd, n]
        scores = (qg @ k) * (c.head_dim ** -0.5)                                 # [kv, t*g, n]
        scores = scores.reshape(c.n_kv_heads, t, group, -1) + mask[None, :, None, :]
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = xp.exp(scores)
        probs = probs / probs.sum(axis=-1, keepdims=True)
        out = probs.reshape(c.n_kv_heads, t * group, -1) @ values.transpose(1, 0, 2)
        out = out.reshape(c.n_kv_heads, t, group, c.head_dim).transpose(1, 0, 2, 3)
        return out.reshape(t, c.n_heads * c.head_dim)

    def finish_layer(self, layer: int, x, attn):
        p = self.layers[layer]
        x = x + attn @ p["wo"]
        m = self.rmsnorm(x, p["ffn_norm"])
        gate = m @ p["w_gate"]
        return x + ((gate / (1.0 + self.xp.exp(-gate))) * (m @ p["w_up"])) @ p["w_down"]

    def logits(self, x):
        return self.rmsnorm(x, self.final_norm) @ self.w_out

    # -- the two ways to run it ---------------------------------------------------------
    def forward_cached(self, cache: CausalCache, tokens, positions, timer: Optional[list] = None):
        """One forward pass of a batch (any mix of sequences) through ``cache``, after
        ``cache.start_forward(positions, seqs)``. Returns logits ``[batch, vocab]``.

        ``timer`` (a one-element list) accumulates the seconds spent in ``put``/``get``."""
        xp, dtype = self.xp, cache.config.dtype
        sync = cache.device == "cuda"
        t = len(tokens)
        # resolved before any timing: the first `import torch` takes ~1.5 s, which must not be
        # counted as cache calls
        torch = _attend_torch()
        x = self.embed[xp.asarray(tokens)]
        pos = xp.asarray(positions)
        for layer in range(self.config.n_layers):
            q, k, v = self.qkv(layer, x, pos)
            if timer is not None and sync:
                synchronize("cuda")  # time the cache's own GPU work, not the model's before it
            t0 = time.perf_counter()
            cache.set_layer(layer)
            cache.put(to_storage(k, dtype, xp), to_storage(v, dtype, xp))
            if torch is not None:
                cache.page_table()          # the cache's part of attention (once per pass)
            else:
                keys, values, mask = cache.get()
            if timer is not None:
                if sync:
                    synchronize("cuda")
                timer[0] += time.perf_counter() - t0
            if torch is not None:
                # each sequence attends over its own cells only (cache.page_table())
                from ..attention import attend
                out = attend(torch.from_dlpack(xp.ascontiguousarray(q, dtype=xp.float32)), cache)
                attn = xp.from_dlpack(out).reshape(t, -1)
            else:
                attn = self.attention(q, from_storage(keys, dtype, xp),
                                      from_storage(values, dtype, xp),
                                      xp.asarray(mask[:t], dtype=xp.float32))
            x = self.finish_layer(layer, x, attn)
        return self.logits(x)


class _RefSeq:
    """A sequence as the cache-free reference sees it: its tokens (position = index) and, per
    layer, each token's layer input as the reference computed it when the token was processed.

    Keys and values are recomputed from these at every step at the tokens' current positions.
    Without a context shift this is exactly a full causal forward over the tokens (the layer
    input of a token depends only on earlier tokens); after a shift the kept tokens keep their
    layer inputs (that is what a context shift means) while their keys are roped afresh at the
    new positions, so it checks the cache's re-rotation, not a copy of the cache's state."""

    def __init__(self, n_layers: int, d_model: int, xp) -> None:
        self.tokens: List[int] = []
        self.inputs = [xp.zeros((0, d_model), dtype=xp.float32) for _ in range(n_layers)]
        self.shifted_from: Optional[int] = None  # positions >= this were moved by a shift

    def prefix(self, length: int) -> "_RefSeq":
        """A new sequence holding this one's first ``length`` tokens, as the cache's
        ``copy_prefix`` (or a prompt cache reusing a slot's prefix) leaves them: same layer
        inputs, same positions (those a shift moved stay marked as moved)."""
        new = _RefSeq.__new__(_RefSeq)
        new.tokens = self.tokens[:length]
        new.inputs = [a[:length] for a in self.inputs]
        new.shifted_from = self.shifted_from if self.shifted_from is not None and \
            self.shifted_from < length else None
        return new

    def drop(self, begin: int, end: int, xp) -> None:
        self.tokens = self.tokens[:begin] + self.tokens[end:]
        self.inputs = [xp.concatenate([a[:begin], a[end:]]) for a in self.inputs]


def reference_forward(model: TinyLlama, ref: _RefSeq, new_tokens: Sequence[int], dtype: str,
                      window: Optional[int]):
    """Logits ``[len(new_tokens), vocab]`` of ``new_tokens`` appended to ``ref`` (which records
    them), computed without any cache: every layer's keys and values are recomputed for all the
    sequence's tokens at their current positions, rounded to the storage dtype, and attended with
    a plain causal (and sliding-window) mask."""
    xp = model.xp
    start = len(ref.tokens)
    n = start + len(new_tokens)
    positions = np.arange(n)
    q_pos = positions[start:]
    visible = positions[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= positions[None, :] >= q_pos[:, None] - window
    mask = xp.asarray(np.where(visible, 0.0, -np.inf).astype(np.float32))
    x = model.embed[xp.asarray(list(new_tokens))]
    for layer in range(model.config.n_layers):
        all_inputs = xp.concatenate([ref.inputs[layer], x])
        keys, values = model.key_value(layer, all_inputs, xp.asarray(positions))
        q, _, _ = model.qkv(layer, x, xp.asarray(q_pos))
        attn = model.attention(q, quantize(keys, dtype, xp), quantize(values, dtype, xp), mask)
        ref.inputs[layer] = all_inputs
        x = model.finish_layer(layer, x, attn)
    ref.tokens.extend(int(t) for t in new_tokens)
    return model.logits(x)


# ---------------------------------------------------------------------------- the workload
@dataclass(frozen=True)
class Request:
    """One request: it arrives at step ``arrival`` with ``prompt`` (after the system prompt when
    ``system``) and generates ``n_decode`` tokens. A follow-up turn (``follows`` = an earlier
    request's id) starts once that request is done; its prompt is that conversation so far (what
    the model saw, then its last generated token) followed by ``prompt``."""

    rid: int
    arrival: int
    prompt: Tuple[int, ...]
    n_decode: int
    system: bool
    follows: Optional[int] = None


@dataclass(frozen=True)
class Workload:
    """A deterministic serving trace (see ``generate``)."""

    system_prompt: Tuple[int, ...]
    requests: Tuple[Request, ...]
    capacity: int
    slots: int
    prefill_chunk: int

    @property
    def num_keep(self) -> int:
        """Tokens a context shift keeps at the front: the system prompt's length."""
        return len(self.system_prompt)

    @classmethod
    def generate(cls, n_seqs: int, steps: int, *, capacity: int = 64, seed: int = 0,
                 vocab: int = 256, slots: Optional[int] = None,
                 follow_ups: float = 0.25) -> "Workload":
        """``n_seqs`` requests over ``steps`` steps, sized relative to ``capacity`` (the tokens a
        sequence may hold): a system prompt of ``capacity/8`` tokens; prompts of 1/8 to 1/2 of
        the capacity, prefilled in chunks of ``capacity/4`` tokens mixed with the decode tokens
        of the running requests; 1/4 to 3/4 of the capacity generated. The first request
        generates 1.5x the capacity, so it is context-shifted; the first requests arrive at
        once, the others over the first 60% of the steps; three in four use the system prompt
        (the first two always do); at most ``slots`` (default 4) are served at a time. A
        fraction ``follow_ups`` of the requests after the first two are follow-up turns of an
        earlier conversation (drawn from their own random stream, so the rest of the trace does
        not depend on it)."""
        if capacity < 16:
            raise ValueError(f"capacity must be >= 16 for the demo's workload, got {capacity}")
        if n_seqs < 1:
            raise ValueError(f"n_seqs must be >= 1, got {n_seqs}")
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if isinstance(follow_ups, bool) or not isinstance(follow_ups, (int, float)) \
                or not 0 <= follow_ups <= 1:
            raise ValueError(f"follow_ups must be a fraction in [0, 1], got {follow_ups!r}")
        rng = np.random.default_rng(seed)
        turns = np.random.default_rng([seed, 1])
        slots = min(4, n_seqs) if slots is None else slots
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        sys_len = max(2, capacity // 8)
        system_prompt = tuple(int(t) for t in rng.integers(0, vocab, sys_len))
        n_first = min(n_seqs, slots)
        later = np.sort(rng.integers(1, max(2, int(0.6 * steps)), max(0, n_seqs - n_first)))
        arrivals = [0] * n_first + [int(a) for a in later]
        requests = []
        for rid in range(n_seqs):
            n_prompt = int(rng.integers(capacity // 8, capacity // 2 + 1))
            n_decode = int(rng.integers(capacity // 4, 3 * capacity // 4 + 1))
            system = rid < 2 or bool(rng.random() < 0.75)
            if rid == 0:
                n_decode = capacity + capacity // 2
            prompt = tuple(int(t) for t in rng.integers(0, vocab, n_prompt))
            follows = None
            if rid >= 2 and turns.random() < follow_ups:
                follows = int(turns.integers(1, rid))   # not request 0: it runs long
                system = requests[follows].system   # the conversation starts as it did
                prompt = prompt[:max(1, n_prompt // 2)]
            requests.append(Request(rid, arrivals[rid], prompt, n_decode, system, follows))
        return cls(system_prompt, tuple(requests), capacity, slots, max(4, capacity // 4))


# ---------------------------------------------------------------------------- the report
@dataclass
class DemoReport:
    """What a demo run did and measured. ``owners`` is the occupancy picture: ``[steps,
    n_cells]`` owner per cell after each step (request id, ``FREE`` or ``SHARED``);
    ``events`` lists ``(step, kind, detail)`` for defrags, shifts, copy_prefix reuses, arrivals
    and finishes."""

    device: str
    dtype: str
    n_layers: int
    swa_window: Optional[int]
    n_cells: int
    capacity: int
    requests: int
    steps: int = 0
    prefill_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_step_tokens: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    cache_time: float = 0.0
    warmup_time: float = 0.0
    #: of ``warmup_time``: numba compiling numbakv's functions (outermost compiles), how many
    #: it compiled, and importing torch (the demo's attention runs through it when installed)
    warmup_compile_time: float = 0.0
    warmup_compiled: int = 0
    warmup_torch_import: float = 0.0
    verify_time: float = 0.0
    wall_time: float = 0.0
    peak_cells: int = 0
    final_cells: int = 0
    defrags: int = 0
    shifts: int = 0
    shifted_tokens: int = 0
    copy_prefix: int = 0
    prompt_reused: int = 0        # prompt tokens the prompt cache found in the cache
    prompt_evaluated: int = 0     # prompt tokens it returned to be evaluated
    follow_ups: int = 0           # follow-up turns started
    reprocessed: int = 0          # tokens re-evaluated after a refused context shift
    served: int = 0
    started: int = 0
    verified_tokens: int = 0
    checked_cells: int = 0
    checked_shifted_cells: int = 0
    max_logit_err: float = 0.0
    max_layer0_err: float = 0.0
    max_shifted_key_err: float = 0.0
    verification: str = "not run"
    plot_path: Optional[str] = None
    #: the prefix-store segment's result (``demo_prefix.run_prefix_demo``), when it ran
    prefix: Optional[Dict[str, Any]] = None
    owners: Optional[np.ndarray] = None
    events: List[Tuple[int, str, str]] = field(default_factory=list)

    @property
    def steps_recorded(self) -> int:
        """Rows of ``owners``: every step, idle ones (nothing arrived yet) included."""
        return 0 if self.owners is None else len(self.owners)

    @property
    def prompt_reuse(self) -> float:
        """Fraction of the prompt tokens the prompt cache did not have to evaluate."""
        return self.prompt_reused / max(self.prompt_reused + self.prompt_evaluated, 1)

    @property
    def forward_time(self) -> float:
        return self.prefill_time + self.decode_time

    def table(self) -> str:
        """The final table (plain text, aligned)."""
        def rate(tokens, seconds):
            return f"{tokens / seconds:,.0f} tok/s" if seconds > 0 else "-"
        decode_only = self.steps - self.prefill_steps
        fwd = self.forward_time
        window = f", sliding window {self.swa_window}" if self.swa_window else ""
        rows = [
            ("device", f"{self.device} ({self.dtype} K/V, {self.n_layers} layer"
                       f"{'s' if self.n_layers != 1 else ''}{window})"),
            ("cache", f"{self.n_cells} cells, {self.capacity} tokens per sequence"),
            ("forward passes", f"{self.steps} ({self.prefill_steps} with prefill, "
                               f"{decode_only} decode only)"),
            ("tokens processed", f"{self.prefill_tokens + self.decode_tokens} (prefill "
                                 f"{self.prefill_tokens}, decode {self.decode_tokens})"),
            ("throughput", f"{rate(self.prefill_tokens + self.decode_tokens, fwd)} overall"),
            ("  steps with prefill", rate(self.prefill_step_tokens, self.prefill_time)),
            ("  decode-only steps", rate(self.prefill_tokens + self.decode_tokens
                                         - self.prefill_step_tokens, self.decode_time)),
            ("cache calls", f"{1000 * self.cache_time / max(self.steps, 1):.2f} ms per step "
                            f"({100 * self.cache_time / fwd if fwd else 0:.0f}% of forward time)"),
            ("occupancy", f"peak {self.peak_cells}/{self.n_cells} cells "
                          f"({100 * self.peak_cells / self.n_cells:.0f}%), final "
                          f"{self.final_cells}/{self.n_cells}"),
            ("defrags", str(self.defrags)),
            ("context shifts", f"{self.shifts} ({self.shifted_tokens} tokens discarded)"),
            ("copy_prefix reuses", f"{self.copy_prefix} (prefixes of other sequences forked "
                                   "by the prompt cache, not recomputed)"),
            ("prompt cache", f"{self.prompt_reused} prompt tokens reused, "
                             f"{self.prompt_evaluated} evaluated ({self.prompt_reuse:.0%} "
                             f"reused; {self.follow_ups} follow-up turns)"),
            ("sequences served", f"{self.served} finished of {self.requests} "
                                 f"({self.started} started)"),
            ("verification", self.verification),
        ]
        if self.verified_tokens:
            rows += [
                ("  logits", f"{self.verified_tokens} tokens, max |diff| "
                             f"{self.max_logit_err:.1e}"),
                ("  layer-0 K/V", f"{self.checked_cells} cell reads ({self.checked_shifted_cells} "
                                  f"keys re-rotated by shifts), max |diff| "
                                  f"{max(self.max_layer0_err, self.max_shifted_key_err):.1e}"),
            ]
        rows += [
            ("warm-up", self.warmup_summary()),
            ("wall time", f"{self.wall_time:.1f} s (verification {self.verify_time:.1f} s)"),
        ]
        if self.plot_path:
            rows.append(("picture", self.plot_path))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def warmup_summary(self) -> str:
        """What the warm-up's seconds went to: numba compiling (only when it did), importing
        torch (only when the demo uses it), and the rest: loading compiled code (shipped or
        numba's cache) and first calls."""
        parts = []
        if self.warmup_compiled:
            parts.append(f"numba compiled {self.warmup_compiled} functions in "
                         f"{self.warmup_compile_time:.1f} s")
        else:
            parts.append("nothing compiled")
        if self.warmup_torch_import >= 0.05:
            parts.append(f"import torch {self.warmup_torch_import:.1f} s")
        rest = self.warmup_time - self.warmup_compile_time - self.warmup_torch_import
        parts.append(f"loading compiled code and first calls {max(rest, 0.0):.1f} s")
        return f"{self.warmup_time:.1f} s ({'; '.join(parts)})"

    def terminal_picture(self, width: int = 64, rows: int = 12) -> str:
        """A compact rendering of ``owners``: one character per group of cells (the group's most
        common owner), ``rows`` steps sampled over time; ``.`` free, ``#`` shared, ``0-9a-zA-Z``
        request ids."""
        if self.owners is None or len(self.owners) == 0:
            return ""
        n_steps, n_cells = self.owners.shape
        symbols = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        picks = sorted(set(np.linspace(0, n_steps - 1, min(rows, n_steps)).round().astype(int)))
        columns, group = picture_columns(self.owners[picks], width)
        marks: Dict[int, List[str]] = {}
        for step, kind, _ in self.events:
            if kind in ("defrag", "shift"):
                marks.setdefault(step, []).append(kind)
        lines = [f"cells 0..{n_cells - 1}, {group} per character; '.' free, '#' shared, "
                 "0-9a-z request id"]
        for step, row in zip(picks, columns):
            chars = ["." if top == FREE else "#" if top == SHARED else symbols[top % len(symbols)]
                     for top in row.tolist()]
            since = picks[picks.index(step) - 1] + 1 if step != picks[0] else 0
            near = [k for s in range(since, step + 1) for k in marks.get(s, [])]
            note = f"  {', '.join(sorted(set(near)))}" if near else ""
            lines.append(f"step {step:>4} |{''.join(chars)}|{note}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------- the run
class _Live:
    """A request being served in sequence ``slot``."""

    def __init__(self, req: Request, slot: int, ref: _RefSeq, pending: List[int]) -> None:
        self.req = req
        self.slot = slot
        self.ref = ref
        self.pending = pending        # tokens still to feed (prompt, or the last generated one)
        self.generated = 0
        self.prefilling = True


def _tolerances(dtype: str) -> Tuple[float, float]:
    """(logits tolerance, layer-0 K/V tolerance), each used as atol and rtol."""
    return {"float32": (1e-4, 1e-5), "float16": (2e-2, 2e-3),
            "bfloat16": (1e-1, 1.6e-2)}[dtype]


def _close(a: np.ndarray, b: np.ndarray, tol: float) -> Tuple[bool, float]:
    err = np.abs(a - b)
    return bool((err <= tol + tol * np.abs(b)).all()), float(err.max()) if err.size else 0.0


def cell_owners(cache: CausalCache, slot_owner: Dict[int, int]) -> np.ndarray:
    """The owner of each cell ``[n_cells]``: ``slot_owner[seq]`` for a cell held by one sequence,
    ``SHARED`` for one held by more than one sequence, ``FREE`` for an empty one."""
    bits = np.ascontiguousarray(cache.cells.cells["seqs"])           # uint64 [n_cells, words]
    counts = np.zeros(len(bits), np.int64)
    first = np.full(len(bits), -1, np.int64)
    for word in range(bits.shape[1]):
        w = bits[:, word]
        counts += _popcount64(w)
        lowest = w & (~w + np.uint64(1))                                 # lowest set bit
        has = (w != 0) & (first < 0)
        first[has] = word * 64 + np.log2(lowest[has].astype(np.float64)).astype(np.int64)
    out = np.full(len(bits), FREE, np.int32)
    lut = np.full(bits.shape[1] * 64, FREE, np.int32)
    for seq, owner in slot_owner.items():
        lut[seq] = owner
    single = counts == 1
    out[single] = lut[first[single]]
    out[counts > 1] = SHARED
    return out


def _popcount64(words: np.ndarray) -> np.ndarray:
    """Set bits of each uint64 ``[n]`` as int64 (numpy < 2 has no ``bitwise_count``)."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words).astype(np.int64)
    as_bytes = np.ascontiguousarray(words).view(np.uint8).reshape(len(words), 8)
    return np.unpackbits(as_bytes, axis=1).sum(axis=1).astype(np.int64)


def _seq_rows(cache: CausalCache, seq: int) -> Tuple[np.ndarray, np.ndarray]:
    """Rows of the current ``get()`` range that hold ``seq``, and their positions."""
    lo, hi = cache.cell_range()
    cells = cache.cells.cells[lo:hi]
    word = np.ascontiguousarray(cells["seqs"])[:, seq // 64]
    rows = np.nonzero((word >> np.uint64(seq % 64)) & np.uint64(1))[0]
    return rows, cells["pos"][rows].astype(np.int64)


class _CompileTimer:
    """Seconds numba spends compiling (outermost compiles only: a function's callees compile
    inside it) and how many functions, while registered (a ``with`` block); loading compiled
    code from the shipped or numba's cache is not a compile."""

    def __init__(self) -> None:
        from numba.core import event

        timer = self

        class Listener(event.Listener):
            def on_start(self, ev) -> None:
                if timer._depth == 0:
                    timer._t0 = time.perf_counter()
                timer._depth += 1

            def on_end(self, ev) -> None:
                timer._depth -= 1
                if timer._depth == 0:
                    timer.seconds += time.perf_counter() - timer._t0
                    timer.count += 1

        self._event, self._listener = event, Listener()
        self._depth, self._t0, self.seconds, self.count = 0, 0.0, 0.0, 0

    def __enter__(self) -> "_CompileTimer":
        self._event.register("numba:compile", self._listener)
        return self

    def __exit__(self, *exc) -> None:
        self._event.unregister("numba:compile", self._listener)


def _warm_up(cfg: CacheConfig, shift: RopeShift, swa_window: Optional[int],
             report: Optional["DemoReport"] = None) -> float:
    """Compile (or load) the cache's numba functions (and kernels) before the timed run: one of
    every operation the demo uses, on a small cache of the same dtype and shapes. ``report``
    gets what the time went to (numba compiles, the torch import)."""
    with _CompileTimer() as compiles:
        took = _warm_up_calls(cfg, shift, swa_window, report)
    if report is not None:
        report.warmup_compile_time, report.warmup_compiled = compiles.seconds, compiles.count
    return took


def _warm_up_calls(cfg: CacheConfig, shift: RopeShift, swa_window: Optional[int],
                   report: Optional["DemoReport"]) -> float:
    t0 = time.perf_counter()
    # with a window, a capacity above its memory, so that window pruning compiles too
    small = cfg.replace(n_layers=1, capacity=16 if swa_window is None else 2 * swa_window + 4,
                        max_seqs=2, max_batch=8)
    cache = CausalCache(small, shift=shift, swa_window=swa_window)
    xp = array_module(small.device)
    k = xp.zeros((3, small.n_kv_heads, small.head_dim), np.float32)
    for positions, seqs in (([0, 1, 2], [0, 0, 0]), ([3, 0, 1], [0, 1, 1])):
        cache.start_forward(positions, seqs)
        cache.set_layer(0)
        cache.put(to_storage(k, small.dtype, xp), to_storage(k, small.dtype, xp))
        cache.get()
        t_import = time.perf_counter()
        torch = _attend_torch()     # imported here (~1.5 s), not inside the first timed step
        if report is not None and positions[0] == 0:
            report.warmup_torch_import = time.perf_counter() - t_import
        if torch is not None:
            from ..attention import attend
            # q where the cache is: attend() takes no host q for a GPU cache
            attend(torch.zeros((3, small.n_kv_heads, small.head_dim),
                               device="cuda" if cache.device == "cuda" else "cpu"), cache)
    cache.copy_prefix(0, 1, 2)
    cache.remove(0, 1, 2)
    cache.remove(1, 0)
    cache.defrag()
    cache.close()
    synchronize(cfg.device)
    return time.perf_counter() - t0


def run_demo(n_seqs: int = 8, steps: int = 100, n_layers: int = 4, swa_window: Optional[int] = None,
             device: str = "auto", seed: int = 0, capacity: int = 64, progress: bool = True,
             plot_path: Optional[str] = "numbakv_demo.png", *, dtype: str = "float32",
             model: Optional[ModelConfig] = None, slots: Optional[int] = None,
             verify: bool = True, multi_user: bool = True, follow_ups: float = 0.25,
             after_step: Optional[Callable[[CausalCache, int, Dict[int, int]], None]] = None,
             prefix_store: bool = False) -> DemoReport:
    """Serve ``n_seqs`` requests of a seeded ``Workload`` with a ``TinyLlama`` of ``n_layers``
    through one ``CausalCache`` for at most ``steps`` forward passes (fewer when every request is
    done), verifying every step (see the module docstring).

    Args:
        swa_window: a sliding-window model (every layer sees the last ``swa_window + 1``
            positions); it must be at most half of ``capacity`` less the system prompt, so a
            context shift never brings a token the cache already let go of back into view.
        device: ``auto``, ``cpu``, ``cuda`` or ``sim``.
        capacity: tokens per sequence (the context length that triggers a shift).
        dtype: the cache's K/V dtype (``float32``, ``float16``, ``bfloat16``); the model
            computes in float32 either way.
        plot_path: where to save the occupancy picture as PNG (needs matplotlib); ``None``: no
            file.
        model: shapes of the model (``n_layers`` overrides its layer count).
        slots: sequences served at once (default ``min(4, n_seqs)``).
        verify: compare with the recomputation without the cache (on by default).
        multi_user: the prompt cache picks slots as Ollama's ``OLLAMA_MULTIUSER_CACHE`` does
            (forking shared prefixes with ``copy_prefix``); False: the free slot with the longest
            common prefix.
        follow_ups: fraction of the requests that are follow-up turns of an earlier
            conversation (see ``Workload.generate``).
        after_step: called as ``after_step(cache, step, running)`` after each step's
            verification, with ``running`` mapping each busy sequence id to the tokens its
            request still has to generate (tests use it to corrupt the cache).
        prefix_store: also run the prefix-store segment (``demo_prefix.run_prefix_demo``, on
            the CPU, seeded with ``seed``) into ``report.prefix``; the picture then gets its
            panel.

    Returns the ``DemoReport``; raises ``DemoVerificationError`` at the first mismatch.
    """
    t_start = time.perf_counter()
    dtype = normalize_dtype(dtype)
    device = resolve_device(device)
    model_cfg = model or ModelConfig()
    if model_cfg.n_layers != n_layers:
        model_cfg = dataclasses.replace(model_cfg, n_layers=n_layers)
    work = Workload.generate(n_seqs, steps, capacity=capacity, seed=seed, vocab=model_cfg.vocab,
                             slots=slots, follow_ups=follow_ups)
    if swa_window is not None:
        if isinstance(swa_window, bool) or not isinstance(swa_window, (int, np.integer)) \
                or swa_window < 1:
            raise ValueError(f"swa_window must be an integer >= 1 or None, got {swa_window!r}")
        limit = (capacity - work.num_keep) // 2
        if swa_window > limit:
            raise ValueError(f"swa_window must be <= (capacity - system prompt) / 2 = {limit} for "
                             f"capacity {capacity}, got {swa_window}")
    xp = array_module(device)
    net = TinyLlama(model_cfg, seed=seed, xp=xp)
    max_batch = work.prefill_chunk + work.slots
    cfg = CacheConfig(n_layers=model_cfg.n_layers, n_kv_heads=model_cfg.n_kv_heads,
                      head_dim=model_cfg.head_dim, dtype=dtype, capacity=capacity,
                      max_seqs=work.slots, max_batch=max_batch, device=device)
    logit_tol, kv_tol = _tolerances(dtype)

    report = DemoReport(device=device, dtype=dtype, n_layers=model_cfg.n_layers,
                        swa_window=swa_window, n_cells=0, capacity=capacity,
                        requests=n_seqs)
    report.warmup_time = _warm_up(cfg, net.rope_shift, swa_window, report)
    cache = CausalCache(cfg, shift=net.rope_shift, swa_window=swa_window)
    report.n_cells = cache.n_cells

    pc = PromptCache(cache, multi_user=multi_user)
    queue = list(work.requests)
    live: Dict[int, _Live] = {}
    slot_refs: Dict[int, _RefSeq] = {}      # what each slot's sequence holds, for the reference
    slot_owner: Dict[int, int] = {}         # the request whose conversation a slot holds
    transcripts: Dict[int, List[int]] = {}  # finished conversations, for their follow-up turns
    owners_rows: List[np.ndarray] = []
    events = report.events
    sys_prompt = list(work.system_prompt)
    n_sys = len(sys_prompt)

    def _end_step() -> None:
        used = cache.n_used
        report.peak_cells = max(report.peak_cells, used)
        report.final_cells = used
        owners_rows.append(cell_owners(cache, slot_owner))
        if after_step is not None:
            after_step(cache, step, {sl: s.req.n_decode - s.generated for sl, s in live.items()})
        if bar is not None:
            bar.set_postfix(cells=f"{used}/{cache.n_cells}", seqs=len(live),
                            defrag=report.defrags, shift=report.shifts, refresh=False)
            bar.update(1)

    def _prompt_of(req: Request) -> Optional[List[int]]:
        """The request's whole prompt, or None while it must wait: a follow-up until its
        conversation is done; a new request with the system prompt while another one is still
        prefilling it (then it can fork the prompt instead of computing it again)."""
        if req.follows is not None:
            if req.follows not in transcripts:
                return None
            return transcripts[req.follows] + list(req.prompt)
        if req.system and any(o.req.system and o.req.follows is None and len(o.ref.tokens) < n_sys
                              for o in live.values()):
            return None
        return (sys_prompt if req.system else []) + list(req.prompt)

    def _admit(req: Request, prompt: List[int]) -> None:
        """Load ``req``'s prompt into the slot the prompt cache picks; the reference takes the
        reused prefix from the sequence the cache took it from."""
        slot, remaining = pc.load(prompt)
        info = pc.last_load
        if info.reused == 0:
            ref = _RefSeq(model_cfg.n_layers, model_cfg.d_model, xp)
        else:
            source = slot if info.forked_from is None else info.forked_from
            ref = slot_refs[source].prefix(info.reused)
        if info.forked_from is not None:
            report.copy_prefix += 1
            events.append((step, "copy_prefix", f"request {req.rid} shares {info.reused} tokens "
                           f"of sequence {info.forked_from} (request "
                           f"{slot_owner.get(info.forked_from)})"))
        s = _Live(req, slot, ref, list(remaining))
        live[slot] = s
        slot_refs[slot] = ref
        slot_owner[slot] = req.rid
        report.started += 1
        report.follow_ups += req.follows is not None
        report.prompt_reused += info.reused
        report.prompt_evaluated += len(remaining)
        events.append((step, "arrive", f"request {req.rid} in sequence {slot}: {info.reused} of "
                       f"{len(prompt)} prompt tokens cached"))

    def _make_room(slot: int, chunk: List[int]) -> List[int]:
        """Context shift before ``slot`` would outgrow its capacity, as Ollama's runner does
        (``PromptCache.shift``: keep the system prompt, drop half of the rest). Returns the part
        of ``chunk`` that fits this step; when the cache refuses the shift, the kept tokens go
        back to be evaluated again and nothing of the request runs this step."""
        s = live[slot]
        have = len(s.ref.tokens)
        if have + len(chunk) <= capacity:
            return chunk
        try:
            discard = pc.shift(slot, work.num_keep)
        except ReprocessError as exc:
            s.ref = slot_refs[slot] = _RefSeq(model_cfg.n_layers, model_cfg.d_model, xp)
            s.pending = list(exc.inputs) + s.pending
            s.prefilling = True
            report.reprocessed += len(exc.inputs)
            events.append((step, "reprocess", f"request {s.req.rid}: the cache refused the "
                           f"shift, {len(exc.inputs)} tokens evaluated again"))
            return []
        if discard:
            keep = work.num_keep
            s.ref.drop(keep, keep + discard, xp)
            s.ref.shifted_from = keep
            report.shifts += 1
            report.shifted_tokens += discard
            events.append((step, "shift", f"request {s.req.rid}: kept {keep}, "
                           f"discarded {discard} of {have} tokens"))
        return chunk[:capacity - len(s.ref.tokens)]

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=steps, desc="numbakv demo", unit="step", leave=True, file=sys.stderr)
    try:
        for step in range(steps):
            # -- admit arrived requests into the slots the prompt cache picks
            for req in [r for r in queue if r.arrival <= step]:
                prompt = _prompt_of(req)
                if prompt is None:
                    continue
                try:
                    _admit(req, prompt)
                except NoSlotError:  # every slot is serving a request: wait for one
                    break
                queue.remove(req)
            if not live and not queue:
                break

            # -- the batch: every decoding sequence's next token, then prefill chunks, each
            # shifted first if it would overflow its sequence
            parts: List[Tuple[int, List[int]]] = []   # (sequence, tokens)
            for slot, s in live.items():
                if not s.prefilling:
                    chunk = _make_room(slot, s.pending[:1])
                    if chunk:
                        parts.append((slot, chunk))
            budget = work.prefill_chunk
            for slot, s in live.items():
                if s.prefilling and budget > 0:
                    chunk = _make_room(slot, s.pending[:budget])
                    if chunk:
                        parts.append((slot, chunk))
                        budget -= len(chunk)
            tokens, positions, seqs = [], [], []
            for slot, chunk in parts:
                start = len(live[slot].ref.tokens)
                tokens += chunk
                positions += range(start, start + len(chunk))
                seqs += [slot] * len(chunk)
            if not tokens:  # an idle step: nothing to run yet
                _end_step()
                continue

            # -- the cached forward pass
            defrags_before = cache.defrag_count
            timer = [0.0]
            t0 = time.perf_counter()
            cache.start_forward(positions, seqs)
            timer[0] += time.perf_counter() - t0
            logits = net.forward_cached(cache, tokens, positions, timer)
            synchronize(device)
            elapsed = time.perf_counter() - t0
            if cache.defrag_count > defrags_before:
                report.defrags += cache.defrag_count - defrags_before
                events.append((step, "defrag", f"no contiguous run of {len(tokens)} free cells "
                               f"({cache.n_cells - cache.n_used + len(tokens)} free in all)"))
            prefill = sum(len(c) for sl, c in parts if live[sl].prefilling)
            report.steps += 1
            report.cache_time += timer[0]
            report.prefill_tokens += prefill
            report.decode_tokens += len(tokens) - prefill
            if prefill:
                report.prefill_steps += 1
                report.prefill_time += elapsed
                report.prefill_step_tokens += len(tokens)
            else:
                report.decode_time += elapsed

            # -- verification against the recomputation without the cache
            t_verify = time.perf_counter()
            if verify:
                _verify_step(net, cache, step, parts, logits, live, dtype, swa_window,
                             logit_tol, kv_tol, report)
            else:  # keep the token lists in step without computing anything
                for slot, chunk in parts:
                    live[slot].ref.tokens.extend(chunk)
            for slot, chunk in parts:
                pc.extend(slot, chunk)
                if verify and pc.inputs(slot) != live[slot].ref.tokens:
                    raise DemoVerificationError(
                        f"step {step}: the prompt cache records other tokens for sequence "
                        f"{slot} than it holds")
            report.verify_time += time.perf_counter() - t_verify

            # -- sample, advance, finish
            host_logits = _to_host(logits)
            row = 0
            for slot, chunk in parts:
                row += len(chunk)
                s = live[slot]
                del s.pending[:len(chunk)]
                if s.pending:
                    continue
                s.prefilling = False
                s.generated += 1
                sampled = int(np.argmax(host_logits[row - 1]))
                if s.generated >= s.req.n_decode:
                    # the request is done: its slot stays cached for later prompts
                    transcripts[s.req.rid] = pc.inputs(slot) + [sampled]
                    pc.release(slot)
                    del live[slot]
                    report.served += 1
                    events.append((step, "finish", f"request {s.req.rid} done: "
                                   f"{s.req.n_decode} tokens generated"))
                else:
                    s.pending = [sampled]
            _end_step()
    finally:
        if bar is not None:
            bar.total = len(owners_rows)  # the run may end early, every request served
            bar.refresh()
            bar.close()
        cache.close()

    report.owners = np.array(owners_rows, dtype=np.int32).reshape(-1, report.n_cells)
    report.verification = ("passed: every step equals the recomputation without the cache"
                           if verify else "off")
    if prefix_store:
        from .demo_prefix import run_prefix_demo
        report.prefix = run_prefix_demo(seed=seed)
    if plot_path:
        report.plot_path = save_picture(report, plot_path)
    report.wall_time = time.perf_counter() - t_start
    return report


def _verify_step(net: TinyLlama, cache: CausalCache, step: int, parts, logits, live,
                 dtype: str, window: Optional[int], logit_tol: float, kv_tol: float,
                 report: DemoReport) -> None:
    """``verify_forward`` for one step of the demo's run."""
    verify_forward(net, cache, parts, logits, {slot: live[slot].ref for slot, _ in parts},
                   dtype=dtype, window=window, report=report, where=f"step {step}",
                   names={slot: f"request {live[slot].req.rid}" for slot, _ in parts},
                   tolerances=(logit_tol, kv_tol))


def verify_forward(net: TinyLlama, cache: CausalCache, parts: Sequence[Tuple[int, Sequence[int]]],
                   logits, refs: Dict[int, _RefSeq], *, dtype: str, window: Optional[int] = None,
                   report: Optional[DemoReport] = None, where: str = "forward pass",
                   names: Optional[Dict[int, str]] = None,
                   tolerances: Optional[Tuple[float, float]] = None) -> DemoReport:
    """Check a forward pass of ``net.forward_cached`` over ``parts`` (``(sequence, tokens)`` in
    batch order; ``logits`` ``[batch, vocab]``), for each sequence: (1) the rows of ``get()``'s
    range that hold the sequence hold each position it needs exactly once, with the layer-0 key
    and value of the token at that position recomputed from its id (keys moved by a context shift
    included); (2) each token's logits equal ``reference_forward``'s over ``refs[sequence]``
    (what the sequence held before the pass; it records the new tokens), computed without the
    cache. Raises ``DemoVerificationError`` naming ``where`` and the sequence; returns ``report``
    (a new one when None) with the counts and largest differences added."""
    xp = net.xp
    if report is None:
        report = DemoReport(device=cache.device, dtype=dtype, n_layers=net.config.n_layers,
                            swa_window=window, n_cells=cache.n_cells,
                            capacity=cache.config.capacity, requests=0)
    logit_tol, kv_tol = tolerances or _tolerances(dtype)
    host_logits = _to_host(logits)
    cache.set_layer(0)
    keys, values, _ = cache.get()
    keys = _to_host(from_storage(keys, dtype, xp))
    values = _to_host(from_storage(values, dtype, xp))
    row = 0
    for slot, chunk in parts:
        ref = refs[slot]
        who = (names or {}).get(slot, f"sequence {slot}")
        first_new = len(ref.tokens)
        seq_tokens = np.asarray(ref.tokens + list(chunk), np.int64)
        n = len(seq_tokens)

        # (1) the cells: bookkeeping and layer-0 data
        rows, pos = _seq_rows(cache, slot)
        need_from = 0 if window is None else max(0, first_new - window)
        if len(np.unique(pos)) != len(pos) or (pos >= n).any() or \
                not np.isin(np.arange(need_from, n), pos).all():
            raise DemoVerificationError(
                f"{where}: the cells of {who} (sequence {slot}) in get()'s range hold "
                f"positions {sorted(pos.tolist())}; expected each of {need_from}..{n - 1} once")
        k_exp, v_exp = net.key_value(0, net.embed[xp.asarray(seq_tokens[pos])], xp.asarray(pos))
        k_exp = _to_host(quantize(k_exp, dtype, xp))
        v_exp = _to_host(quantize(v_exp, dtype, xp))
        ok_k, err_k = _close(keys[rows], k_exp, kv_tol)
        ok_v, err_v = _close(values[rows], v_exp, kv_tol)
        report.max_layer0_err = max(report.max_layer0_err, err_k, err_v)
        report.checked_cells += len(rows)
        moved = (pos >= ref.shifted_from) if ref.shifted_from is not None \
            else np.zeros(len(pos), bool)
        if moved.any():
            report.checked_shifted_cells += int(moved.sum())
            report.max_shifted_key_err = max(report.max_shifted_key_err,
                                             float(np.abs(keys[rows][moved] - k_exp[moved]).max()))
        if not (ok_k and ok_v):
            what = "keys" if not ok_k else "values"
            bad = np.abs(keys[rows] - k_exp).reshape(len(rows), -1).max(axis=1) > \
                kv_tol + kv_tol * np.abs(k_exp).reshape(len(rows), -1).max(axis=1)
            raise DemoVerificationError(
                f"{where}: layer-0 {what} of {who} (sequence {slot}) in the cache differ "
                f"from the ones recomputed from its tokens at their positions: max |diff| "
                f"{max(err_k, err_v):.3g} > tolerance {kv_tol:g}"
                + (" (keys re-rotated by a context shift)" if not ok_k and (bad & moved).any()
                   else ""))

        # (2) the outputs
        expect = _to_host(reference_forward(net, ref, chunk, dtype, window))
        got = host_logits[row:row + len(chunk)]
        row += len(chunk)
        ok, err = _close(got, expect, logit_tol)
        report.max_logit_err = max(report.max_logit_err, err)
        if not ok:
            bad_row = int(np.argmax(np.abs(got - expect).max(axis=1)))
            raise DemoVerificationError(
                f"{where}: the logits of {who} (sequence {slot}) at position "
                f"{first_new + bad_row} differ from the recomputation without the cache: max "
                f"|diff| {err:.3g} > tolerance {logit_tol:g}; the cache returned wrong keys, "
                "values or mask")
        report.verified_tokens += len(chunk)
    return report


# ---------------------------------------------------------------------------- the picture
#: Colours of the picture: free cells, cells shared through copy_prefix, event marks.
FREE_COLOR = "#f2f2f2"
SHARED_COLOR = "#3a3a3a"
EVENT_COLOR = "#000000"
#: Request colours: tab10 then its light tab20 twins, without the greys (too close to "free"
#: and "shared"), olive and light purple (greyish on some screens); Set2 yellow instead.
REQUEST_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                  "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#ffd92f", "#c49c94",
                  "#f7b6d2", "#9edae5")
#: Pixels across one column of the picture at least: below that interleaved decode tokens turn
#: into a comb of one-pixel stripes, so wide caches show groups of cells per column.
MIN_COLUMN_PX = 4
_PLOT_WIDTH_PX = 1280
_DPI = 100
#: What each event kind is called on the plot.
EVENT_LABELS = {"defrag": "defrag", "shift": "context shift", "copy_prefix": "prefix reuse"}


def request_color(rid: int) -> str:
    """The colour of request ``rid`` (cycles after 16 requests; never free's or shared's)."""
    return REQUEST_COLORS[rid % len(REQUEST_COLORS)]


@dataclass(frozen=True)
class PictureMark:
    """One labelled event on the picture: ``kind`` (``defrag``, ``shift``, ``copy_prefix``) at
    ``step``, spanning picture columns ``[col_lo, col_hi]``, with its ``label``."""

    step: int
    kind: str
    col_lo: float
    col_hi: float
    label: str
    #: the runs of picture columns ``(lo, hi)`` (inclusive) the mark is drawn over: only the
    #: cells the event touched (a shift: the shifted request's own cells, not the span between)
    segments: Tuple[Tuple[int, int], ...] = ()


def picture_columns(owners: np.ndarray, max_columns: int) -> Tuple[np.ndarray, int]:
    """``owners [steps, n_cells]`` reduced to at most ``max_columns`` columns of ``group`` cells
    each (the group's most common owner, free only when at least half of it is free, as the
    terminal picture does); returns ``(columns [steps, n_columns], group)``."""
    n_steps, n_cells = owners.shape
    group = max(1, math.ceil(n_cells / max(1, max_columns)))
    if group == 1:
        return owners, 1
    n_cols = math.ceil(n_cells / group)
    padded = np.full((n_steps, n_cols * group), FREE, owners.dtype)
    padded[:, :n_cells] = owners
    blocks = padded.reshape(n_steps, n_cols, group)
    out = np.full((n_steps, n_cols), FREE, owners.dtype)
    codes = np.unique(blocks)
    best = np.zeros((n_steps, n_cols), np.int64)
    for code in codes[codes != FREE]:
        count = (blocks == code).sum(axis=2)
        better = count > best
        out[better] = code
        best[better] = count[better]
    out[2 * (blocks != FREE).sum(axis=2) < group] = FREE
    return out, group


def picture_marks(report: DemoReport, group: int) -> List[PictureMark]:
    """A labelled mark per defrag, context shift and prefix reuse, placed over the cells the
    event touched: the whole cache for a defrag, the shifted request's cells for a shift, the
    shared system prompt's cells for a reuse; events of one kind at one step share a mark."""
    owners = report.owners
    n_cols = math.ceil(owners.shape[1] / group)
    merged: Dict[Tuple[int, str], List[str]] = {}
    for step, kind, detail in report.events:
        if kind in EVENT_LABELS:
            merged.setdefault((step, kind), []).append(detail)
    # events of one kind a few steps apart share a mark, so their labels do not overlap
    near = max(2, len(owners) // 40)
    runs: List[Tuple[int, str, List[str]]] = []
    for (step, kind), details in sorted(merged.items()):
        last = next((r for r in reversed(runs) if r[1] == kind), None)
        if last is not None and step - last[0] <= near:
            last[2].extend(details)
        else:
            runs.append((step, kind, list(details)))
    marks = []
    for step, kind, details in sorted(runs, key=lambda r: (r[0], r[1])):
        row = owners[min(step, len(owners) - 1)]
        rids = [int(d.split()[1].rstrip(":")) for d in details
                if d.startswith("request ") and d.split()[1].rstrip(":").isdigit()]
        if kind == "defrag":
            cells = np.arange(len(row))
            label = "defrag"
        elif kind == "shift":
            cells = np.nonzero(np.isin(row, rids))[0]
            label = "context shift " + ", ".join(f"r{r}" for r in rids)
        else:
            cells = np.nonzero(row == SHARED)[0]
            label = "prefix reuse → " + ", ".join(f"r{r}" for r in rids)
        if len(cells) == 0:
            cells = np.arange(len(row))
        cols = np.unique(np.minimum(cells // group, n_cols - 1))
        breaks = np.nonzero(np.diff(cols) > 1)[0]
        starts = np.concatenate([[0], breaks + 1])
        ends = np.concatenate([breaks, [len(cols) - 1]])
        segments = tuple((int(cols[a]), int(cols[b])) for a, b in zip(starts, ends))
        marks.append(PictureMark(step, kind, float(cols.min()), float(cols.max()), label,
                                 segments))
    return marks


def label_rows(steps: Sequence[float], gap: float, top: float, bottom: float) -> List[float]:
    """Rows for labels wanted at ``steps`` (ascending) so that no two are closer than ``gap``
    and all lie in ``[top, bottom]``: pushed down past their predecessors, then back up from
    the bottom edge."""
    rows: List[float] = []
    for y in steps:
        rows.append(max(y, top) if not rows else max(y, rows[-1] + gap))
    for i in range(len(rows) - 1, -1, -1):
        limit = bottom if i == len(rows) - 1 else rows[i + 1] - gap
        rows[i] = min(rows[i], limit)
    return rows


def save_picture(report: DemoReport, path: str) -> Optional[str]:
    """Save the occupancy picture as PNG: steps down, cache cells across, each cell coloured by
    the request that owns it (shared system-prompt cells and free cells in their own greys),
    with every defrag, context shift and prefix reuse marked and labelled where it happened, and
    a legend. Returns the path, or ``None`` when matplotlib is not installed. Uses no pyplot
    state (safe in notebooks)."""
    fig = picture_figure(report)
    if fig is None:
        return None
    fig.savefig(path)
    return str(path)


def picture_figure(report: DemoReport):
    """The matplotlib ``Figure`` that ``save_picture`` saves (``None`` without matplotlib)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        return None
    owners = report.owners
    n_steps, n_cells = owners.shape
    columns, group = picture_columns(owners, _PLOT_WIDTH_PX // MIN_COLUMN_PX)
    n_cols = columns.shape[1]
    rids = sorted(int(r) for r in np.unique(owners) if r >= 0)
    n_req = max([report.requests] + [r + 1 for r in rids])
    # owner codes SHARED (-2), FREE (-1) and request ids 0.. map to colour index code + 2
    colors = [SHARED_COLOR, FREE_COLOR] + [request_color(r) for r in range(n_req)]
    plot_px = min(_PLOT_WIDTH_PX, n_cols * max(MIN_COLUMN_PX, _PLOT_WIDTH_PX // n_cols))
    width = plot_px + 600          # y labels, the cells, the event labels' column, the legend
    # the occupancy picture keeps its 700 px; the prefix-store panel (when the segment ran)
    # adds its own band below it, so nothing above moves or overlaps
    panel_px = _prefix_panel_px(report.prefix) if report.prefix else 0
    height = 700 + panel_px

    def fy(px: float) -> float:   # a height in pixels above the occupancy band's bottom
        return (panel_px + px) / height

    fig = Figure(figsize=(width / _DPI, height / _DPI), dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((90 / width, fy(98), plot_px / width, 546 / height))
    ax.imshow(columns + 2, aspect="auto", interpolation="nearest", cmap=ListedColormap(colors),
              vmin=-0.5, vmax=len(colors) - 0.5, origin="upper",
              extent=(-0.5, n_cols - 0.5, n_steps - 0.5, -0.5))
    per = f" ({group} cells per column)" if group > 1 else ""
    ax.set_xlabel(f"cache cell{per}")
    ax.set_ylabel("step (forward pass)")
    if group > 1:
        ticks = ax.get_xticks()
        ax.set_xticks(ticks[(ticks >= 0) & (ticks < n_cols)])
        ax.set_xticklabels([str(int(t) * group) for t in ax.get_xticks()])
    window = f", sliding window {report.swa_window}" if report.swa_window else ""
    ax.set_title(f"numbakv demo: which request owns each of the {report.n_cells} cache cells "
                 f"over time ({report.device}, {report.dtype}{window})", fontsize=10)
    styles = {"defrag": dict(linestyle="--", linewidth=1.6),
              "shift": dict(linestyle="-", linewidth=2.2),
              "copy_prefix": dict(linestyle=":", linewidth=2.2)}
    box = dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor=EVENT_COLOR,
               linewidth=0.6, alpha=0.9)
    marks = sorted(picture_marks(report, group), key=lambda m: (m.step, m.kind))
    # labels sit in a column right of the cells, one per mark, never overlapping (rows at least
    # one label height apart), each joined to its line by a thin leader
    axes_px = 546.0
    gap = n_steps * 13.0 / axes_px
    rows = label_rows([m.step - 0.5 for m in marks], gap, -0.5 + gap / 2, n_steps - 0.5 - gap / 2)
    for mark, row in zip(marks, rows):
        y = mark.step - 0.5   # the event happened before this step's tokens were placed
        for lo, hi in mark.segments or ((int(mark.col_lo), int(mark.col_hi)),):
            ax.plot([lo - 0.5, hi + 0.5], [y, y], color=EVENT_COLOR, solid_capstyle="butt",
                    **styles[mark.kind])
        ax.plot([mark.col_hi + 0.5, n_cols - 0.5], [y, y], color="#888888", linewidth=0.5,
                linestyle=":")
        ax.annotate(mark.label, (n_cols - 0.5, y), xytext=(n_cols + 0.03 * n_cols, row),
                    textcoords="data", ha="left", va="center", fontsize=7.5, bbox=box,
                    annotation_clip=False,
                    arrowprops=dict(arrowstyle="-", color="#888888", linewidth=0.5))
    ax.set_xlim(-0.5, n_cols - 0.5)
    ax.set_ylim(n_steps - 0.5, -0.5)
    handles = [Patch(facecolor=FREE_COLOR, edgecolor="#999999", label="free"),
               Patch(facecolor=SHARED_COLOR, label="shared system prompt (copy_prefix)")]
    shown = rids[:len(REQUEST_COLORS)]
    handles += [Patch(facecolor=request_color(r), label=f"request r{r}") for r in shown]
    handles += [Line2D([], [], color=EVENT_COLOR, label=EVENT_LABELS[k], **st)
                for k, st in styles.items()]
    fig.legend(handles=handles, loc="upper left", fontsize=8, frameon=False,
               bbox_to_anchor=((plot_px + 300) / width, fy(644)))
    fig.text(90 / width, fy(10.5),
             "Each row is one step: one forward pass of the model over a packed batch (new "
             "requests' prompt chunks and one decode token of every running request).\n"
             "Light grey is free cells: a light-grey band opening across a request's cells "
             "is where that request finished (its cells freed) or a context shift discarded "
             "its oldest tokens.\nEvent lines run over the cells the event touched: a context "
             "shift over the shifted request's own cells, a prefix reuse over the shared "
             "prompt, a defrag over the whole cache.", fontsize=8, va="bottom", ha="left")
    if report.prefix:
        _draw_prefix_panel(fig, report.prefix, width, height, plot_px, panel_px)
    return fig


#: Colours of the prefix-store panel: where a prompt's tokens came from.
PREFIX_SOURCES = (("slot", "#9ecae1", "live slot (still held)"),
                  ("cells", "#2ca02c", "tier 0 hit: cells, no copy"),
                  ("host", "#ff7f0e", "tier 1 hit: host RAM, copied"),
                  ("computed", "#bdbdbd", "computed (prefill)"))
_PANEL_ROW_PX = 15     # one request's bar: room for a 7-pt label per row, so none overlap


def _prefix_panel_px(prefix: Dict[str, Any]) -> int:
    """Height of the prefix-store panel: a row per request, its title, axis and caption."""
    return 60 + _PANEL_ROW_PX * len(prefix["rows"]) + 105


def _draw_prefix_panel(fig, prefix: Dict[str, Any], width: int, height: int, plot_px: int,
                       panel_px: int) -> None:
    """The prefix-store segment under the occupancy picture: one horizontal bar per (turn,
    user) request, its prompt tokens split by where they came from (live slot, tier 0 hit,
    tier 1 promotion, computed), and a label right of the bar for each tier move of that
    request (a promotion host -> cells, a demotion cells -> host)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    rows = prefix["rows"]
    n = len(rows)
    axes_px = _PANEL_ROW_PX * n
    ax = fig.add_axes((90 / width, 105 / height, plot_px / width, axes_px / height))
    colors = {k: c for k, c, _ in PREFIX_SOURCES}
    longest = max(r["prompt"] for r in rows)
    # one barh call per source (not per request): drawing the panel stays a small part of
    # the demo's time
    reused = np.array([r["reused"] for r in rows])
    sources = np.array([r["source"] if r["source"] in colors else "slot" for r in rows])
    for src in ("slot", "cells", "host"):
        on = np.nonzero((sources == src) & (reused > 0))[0]
        if len(on):
            ax.barh(on, reused[on], left=0, height=0.8, color=colors[src], linewidth=0)
    ax.barh(np.arange(n), [r["computed"] for r in rows], left=reused, height=0.8,
            color=colors["computed"], linewidth=0)
    for i, r in enumerate(rows):
        moves = []
        if r["source"] == "host":
            moves.append("\u25b2 promoted")
        moves += [f"\u25bc u{u} demoted ({k})" for u, k in r.get("demoted", ())]
        if r.get("dropped"):
            moves.append(f"{r['dropped']} dropped")
        if moves:
            # one line per row (the row is one label high), in the label column right of the
            # bars, short enough to end before the legend
            ax.text(longest * 1.01, i, "  ".join(moves), va="center", ha="left", fontsize=7,
                    clip_on=False, gid="prefix-move")
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(0, longest)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"t{r['turn']} u{r['user']}" for r in rows], fontsize=6.5)
    ax.set_ylabel("request (turn, user)")
    ax.set_xlabel("prompt tokens", labelpad=2)
    t = prefix["totals"]
    total = sum(t.values())
    ax.set_title(f"prefix store segment (a second, smaller cache): {len(rows)} requests of "
                 f"multi-turn chats; {t['cells']} tokens from tier 0, {t['host']} from tier 1, "
                 f"{t['slot']} from live slots, {t['computed']} computed "
                 f"({(total - t['computed']) / max(total, 1):.0%} reused)", fontsize=10)
    handles = [Patch(facecolor=c, label=label) for _, c, label in PREFIX_SOURCES]
    handles += [Line2D([], [], linestyle="", marker="^", color=EVENT_COLOR,
                       label="promoted: host \u2192 cells"),
                Line2D([], [], linestyle="", marker="v", color=EVENT_COLOR,
                       label="uN demoted (tokens): cells \u2192 host")]
    fig.legend(handles=handles, loc="upper left", fontsize=8, frameon=False,
               bbox_to_anchor=((plot_px + 300) / width, (105 + axes_px) / height))
    fig.text(90 / width, 8 / height,
             "Lower panel: each bar is one request of the prefix-store segment (t turn, u user), "
             "its prompt split by where the tokens came from; right of a bar, the tier moves "
             "during that request\n(\u25b2 its conversation promoted from host RAM to the "
             "cells; \u25bc another user's conversation demoted from the cells to host RAM to "
             "make room).\nThe store keeps 4 finished conversations in the cache's cells (tier "
             "0: a hit shares the cells, no copy) and demotes the least recently used to host "
             "RAM (tier 1: a hit copies the rows back).", fontsize=8, va="bottom", ha="left")


# ---------------------------------------------------------------------------- command line
def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``numbakv demo``."""
    p = subparsers.add_parser(
        "demo", help="a tiny Llama-style model serving several sequences through one cache, "
                     "verified against a recomputation without the cache",
        description="A tiny Llama-style model serving several sequences through one numbakv "
                    "cache, every step checked against a recomputation without the cache.")
    p.add_argument("--seqs", type=int, default=8, help="requests to serve (default 8)")
    p.add_argument("--steps", type=int, default=100, help="forward passes at most (default 100)")
    p.add_argument("--layers", type=int, default=4, help="model layers (default 4)")
    p.add_argument("--swa", type=int, default=None, metavar="W",
                   help="sliding-window model: each token sees the last W+1 positions")
    p.add_argument("--capacity", type=int, default=64,
                   help="tokens per sequence before a context shift (default 64)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "sim"],
                   help="where the cache and model live (default: cuda if usable, else cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="K/V storage dtype (default float32: the tightest verification)")
    p.add_argument("--seed", type=int, default=0, help="workload and weights seed")
    p.add_argument("--single-user", action="store_true",
                   help="prompt cache slot choice without forks (Ollama's default; the demo "
                        "uses OLLAMA_MULTIUSER_CACHE's by default)")
    p.add_argument("--png", default="numbakv_demo.png", metavar="PATH",
                   help="where to save the occupancy picture (default numbakv_demo.png)")
    p.add_argument("--no-plot", action="store_true", help="do not save the picture")
    p.add_argument("--prefix-store", dest="prefix_store", action="store_true", default=True,
                   help="run the prefix-store segment after the demo (the default): users' "
                        "multi-turn chats through PromptCache(store=PrefixStore), tokens reused "
                        "per tier vs computed, drawn in the picture's lower panel")
    p.add_argument("--no-prefix-store", dest="prefix_store", action="store_false",
                   help="skip the prefix-store segment")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar and no terminal picture; only the table")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """``numbakv demo``: 0 when every step verified, 1 on a mismatch, 2 on bad options."""
    try:
        report = run_demo(args.seqs, args.steps, args.layers, swa_window=args.swa,
                          device=args.device, seed=args.seed, capacity=args.capacity,
                          dtype=args.dtype, progress=not args.quiet,
                          multi_user=not args.single_user,
                          plot_path=None if args.no_plot else args.png,
                          prefix_store=getattr(args, "prefix_store", True))
    except DemoVerificationError as exc:
        print(f"numbakv demo: VERIFICATION FAILED: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"numbakv demo: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    if report.prefix is not None:
        from .demo_prefix import format_prefix_demo
        print()
        print(format_prefix_demo(report.prefix))
    if not report.plot_path and not args.quiet:
        print()
        print(report.terminal_picture())
        if not args.no_plot:
            print("(install matplotlib, e.g. pip install 'numbakv[plot]', for the PNG picture)")
    return 0


__all__ = ["TinyLlama", "ModelConfig", "Workload", "Request", "DemoReport",
           "DemoVerificationError", "run_demo", "reference_forward", "cell_owners",
           "save_picture", "picture_figure", "picture_columns", "picture_marks", "PictureMark", "request_color",
           "add_parser", "main"]
__all__ += ["verify_forward"]
