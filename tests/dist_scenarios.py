"""What each rank runs in the numbakv.dist tests (``tests/test_dist.py`` spawns the ranks with
``dist_group.Group``). Every function takes ``(rank, world, **kwargs)``, asserts on its rank and
returns something small the test checks too."""

from __future__ import annotations

import base64
import os
import time

import numpy as np
import torch
import torch.distributed as tdist

import numbakv as nkv
from numbakv import dist

#: storage kinds the transfers must move bit-exactly (quantized blocks stay quantized)
KINDS = {
    "float16": dict(dtype="float16"),
    "bfloat16": dict(dtype="bfloat16"),
    "float32-permuted": dict(dtype="float32", permuted_v=True),
    "q8_0": dict(dtype="float16", k_dtype="q8_0", v_dtype="q8_0"),
    "q4_0-k": dict(dtype="float16", k_dtype="q4_0", permuted_v=True),
    "float8": dict(dtype="float32", k_dtype="float8_e4m3", v_dtype="float8_e4m3", k_scale=0.5,
                   v_scale=[0.25, 2.0]),
}
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
H, D = 4, 32


def make_cache(kind: str = "float16", head_shard=None, max_seqs: int = 3, capacity: int = 64,
               base: float = 10000.0):
    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=H, head_dim=D, capacity=capacity,
                          max_seqs=max_seqs, device="cpu", head_shard=head_shard, **KINDS[kind])
    return nkv.CausalCache(cfg, shift=nkv.RopeShift(base=base))


def fill(cache, seq: int, n: int, seed: int, first: int = 0) -> None:
    """Positions ``first .. first+n-1`` of ``seq``: random K/V of every head (the same on every
    rank for a seed), of which the cache keeps its head range."""
    cfg = cache.config
    a, b = cfg.head_range
    g = torch.Generator().manual_seed(seed)
    cache.start_forward(np.arange(first, first + n), [seq] * n)
    dt = TORCH_DTYPES[cfg.dtype]
    for layer in range(cfg.n_layers):
        k = torch.randn(n, H, D, generator=g).to(dt)
        v = torch.randn(n, H, D, generator=g).to(dt)
        cache.set_layer(layer)
        cache.put(k[:, a:b].contiguous(), v[:, a:b].contiguous())


def rows(snap):
    """Every array of a snapshot as raw bytes (bit-exact comparisons)."""
    out = []
    for p in snap.parts:
        out.append(np.asarray(p.positions).tobytes())
        for arr in list(p.keys) + list(p.values):
            out.append(np.ascontiguousarray(arr).view(np.uint8).tobytes())
    return out


def sliced(snap, a: int, b: int):
    """Raw bytes of heads [a, b) (absolute) of a full snapshot."""
    h0 = snap.head_range[0]
    out = []
    for p in snap.parts:
        out.append(np.asarray(p.positions).tobytes())
        for arr in list(p.keys) + list(p.values):
            out.append(np.ascontiguousarray(arr[:, a - h0:b - h0]).view(np.uint8).tobytes())
    return out


def warm_up() -> None:
    """Compile what the scenarios run (the numba cache makes this quick after the first run)."""
    for kind in KINDS:
        cache = make_cache(kind, head_shard=(0, 2))
        fill(cache, 0, 3, 0)
        cache.export_seq(0)
        cache.seq_rm(0)


# ------------------------------------------------------------------------------ resharding
def reshard(rank: int, world: int, kinds=tuple(KINDS)) -> dict:
    """Ranks 0, 1: a world=2 head-sharded pair; rank 2: an unsharded cache. 2 -> 1 then
    1 -> 2, for every storage kind, bit-exact."""
    pair = tdist.new_group([0, 1])
    moved = {}
    for i, kind in enumerate(kinds):
        seed = 100 + i
        if rank < 2:
            cache = make_cache(kind, head_shard=(rank, 2))
            fill(cache, 0, 13, seed, first=3)
            dist.check_replicated(cache, group=pair)
            assert dist.send_seq(cache, 0, 2) == 13
            # 1 -> 2: the unsharded rank sends the whole sequence to each shard
            n = dist.recv_seq(cache, 1, 2)
            assert n == 13, n
            mine = cache.export_seq(0)
            got = cache.export_seq(1)
            assert got.head_range == cache.config.head_range
            assert rows(got) == rows(mine), f"{kind}: 1 -> 2 rows differ on rank {rank}"
            dist.check_replicated(cache, group=pair)
            moved[kind] = got.nbytes
        else:
            cache = make_cache(kind)
            ref = make_cache(kind)
            fill(ref, 0, 13, seed, first=3)
            n = dist.recv_seq(cache, 2, [0, 1])
            assert n == 13
            got = cache.export_seq(2)
            want = ref.export_seq(0)
            assert rows(got) == rows(want), f"{kind}: 2 -> 1 rows differ"
            for dst in (0, 1):
                assert dist.send_seq(ref, 0, dst) == 13
            moved[kind] = got.nbytes
    return moved


# --------------------------------------------------------------------------- refusals, async
def refusals(rank: int, world: int) -> list:
    """Rank 0 sends, rank 1 receives: every mismatch raises on both sides with the reason and
    leaves the receiving cache unchanged; then a good transfer with ``at``."""
    if rank > 1:
        return []
    seen = []
    cases = [("shift", dict(base=500000.0), "fingerprint differs at 'shift.base'"),
             ("format", dict(kind="q8_0"), "fingerprint differs at 'k_dtype'"),
             ("heads", dict(head_shard=(1, 2)), None)]
    for name, recv_kw, expect in cases:
        if rank == 0:
            cache = make_cache()
            if name == "heads":
                cache = make_cache(head_shard=(0, 2))
            fill(cache, 0, 5, 7)
            try:
                dist.send_seq(cache, 0, 1, timeout=30)
            except dist.TransferRefused as exc:
                seen.append((name, str(exc)))
            else:
                raise AssertionError(f"{name}: the sender did not raise")
        else:
            cache = make_cache(**recv_kw)
            fill(cache, 1, 3, 8)
            before = dist.table_digest(cache)
            try:
                dist.recv_seq(cache, 0, 0, timeout=30)
            except dist.TransferRefused as exc:
                seen.append((name, str(exc)))
            else:
                raise AssertionError(f"{name}: the receiver did not raise")
            assert dist.table_digest(cache) == before, f"{name}: the receiver's cache changed"
            assert cache.seq_pos_max(0) == -1
        if expect is not None:
            assert expect in seen[-1][1], seen[-1]
    # import_seq refuses after the rows arrived (positions held): the sender hears it too
    if rank == 0:
        cache = make_cache()
        fill(cache, 0, 5, 9)
        try:
            dist.send_seq(cache, 0, 1, timeout=30)
        except dist.TransferRefused as exc:
            seen.append(("held", str(exc)))
        else:
            raise AssertionError("held: the sender did not raise")
        assert dist.send_seq(cache, 0, 1, p0=1, p1=4, timeout=30) == 3
    else:
        cache = make_cache()
        fill(cache, 0, 2, 10, first=3)
        before = dist.table_digest(cache)
        try:
            dist.recv_seq(cache, 0, 0, timeout=30)
        except (dist.TransferRefused, ValueError) as exc:
            seen.append(("held", str(exc)))
        else:
            raise AssertionError("held: the receiver did not raise")
        assert dist.table_digest(cache) == before
        assert dist.recv_seq(cache, 1, 0, at=20, timeout=30) == 3
        assert cache.seq_pos_min(1) == 20 and cache.seq_pos_max(1) == 22
    return seen


def async_transfer(rank: int, world: int) -> int:
    """irecv while the receiving cache keeps serving another sequence; isend likewise."""
    if rank > 1:
        return 0
    if rank == 0:
        cache = make_cache("q8_0")
        fill(cache, 0, 9, 21)
        h = dist.isend_seq(cache, 0, 1, timeout=30)
        fill(cache, 1, 4, 22)          # the sender's cache changes meanwhile: already exported
        n = h.wait()
        assert dist.send_seq(cache, 2, 1, timeout=30) == 0     # an empty sequence
        return n
    cache = make_cache("q8_0")
    ref = make_cache("q8_0")
    fill(ref, 0, 9, 21)
    h = dist.irecv_seq(cache, 0, 0, timeout=30)
    fill(cache, 1, 6, 23)              # serving another sequence while the rows arrive
    n = h.wait()
    assert n == 9 and h.wait() == 9
    assert rows(cache.export_seq(0)) == rows(ref.export_seq(0))
    assert cache.seq_pos_max(1) == 5
    assert dist.recv_seq(cache, 2, 0, timeout=30) == 0 and cache.seq_pos_max(2) == -1
    return n


def peer_dies(rank: int, world: int) -> str:
    """Rank 0 dies after the header handshake, before the rows: rank 1 gets a TransferTimeout
    naming rank 0 and its cache is unchanged."""
    if rank > 1:
        return ""
    if rank == 0:
        cache = make_cache()
        fill(cache, 0, 40, 31)
        real_post = dist._Link.post_send

        def dying_post(self, tensor, peer, what):
            if "rows of group 0 layer 1" in what:   # layer 0 is on its way: die mid-rows
                os._exit(17)
            return real_post(self, tensor, peer, what)

        dist._Link.post_send = dying_post
        dist.send_seq(cache, 0, 1, timeout=20)
        return "not reached"
    cache = make_cache()
    fill(cache, 1, 3, 32)
    before = dist.table_digest(cache)
    try:
        dist.recv_seq(cache, 0, 0, timeout=20)
    except dist.TransferTimeout as exc:
        assert "peer rank 0" in str(exc), exc
        assert isinstance(exc, TimeoutError)
        assert dist.table_digest(cache) == before
        assert cache.seq_pos_max(0) == -1
        return str(exc)
    raise AssertionError("the receiver did not raise")


# ------------------------------------------------------------------------------ HF Llama
VOCAB = 64


def tiny_llama(n_layers: int = 2):
    import transformers

    from helpers import random_weight_model
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=n_layers, max_position_embeddings=128)
    return random_weight_model(config)


def forward(model, cache, tokens, first: int, seq: int):
    tokens = torch.as_tensor(tokens)
    positions = torch.arange(first, first + len(tokens))
    cache.start_forward(positions, [seq] * len(tokens))
    with torch.no_grad():
        return model(input_ids=tokens[None], position_ids=positions[None]).logits[0]


def greedy(model, cache, seq: int, last_token: int, first: int, n: int):
    """``n`` greedy tokens from ``last_token`` at position ``first``; returns tokens, logits."""
    out, logits_all, tok = [], [], last_token
    for i in range(n):
        logits = forward(model, cache, [tok], first + i, seq)[-1]
        tok = int(logits.argmax())
        out.append(tok)
        logits_all.append(logits)
    return out, torch.stack(logits_all)


PROMPT = [5, 17, 3, 42, 8, 8, 60, 1, 33, 12, 7]


def disaggregated(rank: int, world: int, n_new: int = 6) -> list:
    """Rank 0 prefills through hf.attach and sends; rank 1 receives and decodes; the tokens
    equal one process doing both."""
    if rank > 1:
        return []
    from numbakv import hf
    model = tiny_llama()
    cache = hf.cache_for(model, capacity=64, max_seqs=2, device="cpu")
    hf.attach(model, cache)
    if rank == 0:
        forward(model, cache, PROMPT[:-1], 0, seq=0)
        dist.send_seq(cache, 0, 1, timeout=60)
        return []
    n = dist.recv_seq(cache, 1, 0, timeout=60)
    assert n == len(PROMPT) - 1
    tokens, logits = greedy(model, cache, 1, PROMPT[-1], len(PROMPT) - 1, n_new)
    # the single-process run: prefill and decode in one cache
    forward(model, cache, PROMPT[:-1], 0, seq=0)
    want, want_logits = greedy(model, cache, 0, PROMPT[-1], len(PROMPT) - 1, n_new)
    assert tokens == want, (tokens, want)
    assert torch.equal(logits, want_logits)
    return tokens


class _AllReduceLinear(torch.nn.Module):
    """A row-parallel output projection: this rank's input columns, then a sum over ranks."""

    def __init__(self, weight, group):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        self.group = group

    def forward(self, x):
        y = torch.nn.functional.linear(x, self.weight)
        tdist.all_reduce(y, group=self.group)
        return y


def shard_attention(model, rank: int, world: int, group) -> None:
    """Tensor parallelism of the attention: this rank's query and KV heads (column-parallel
    q/k/v projections), a row-parallel o_proj with an all-reduce after it."""
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    q_per = cfg.num_attention_heads // world * hd
    kv_per = cfg.num_key_value_heads // world * hd
    with torch.no_grad():
        for layer in model.model.layers:
            at = layer.self_attn
            for proj, per in ((at.q_proj, q_per), (at.k_proj, kv_per), (at.v_proj, kv_per)):
                proj.weight = torch.nn.Parameter(proj.weight[rank * per:(rank + 1) * per].clone())
                proj.out_features = per
            at.o_proj = _AllReduceLinear(at.o_proj.weight[:, rank * q_per:(rank + 1) * q_per],
                                         group)


def tensor_parallel(rank: int, world: int, n_new: int = 5) -> float:
    """TP=2 tiny Llama (ranks 0, 1; rank 2 idles) equals TP=1, each cache holding half the KV
    heads; check_replicated after every step."""
    from numbakv import hf
    pair = tdist.new_group([0, 1])
    if rank > 1:
        return 0.0
    model = tiny_llama()
    ref_model = tiny_llama()
    shard_attention(model, rank, 2, pair)
    cache = hf.cache_for(model, capacity=64, max_seqs=2, device="cpu", head_shard=(rank, 2))
    assert cache.config.local_kv_heads == 1 and cache.config.head_range == (rank, rank + 1)
    assert cache.storage.keys.shape[2] == 1
    ref = hf.cache_for(ref_model, capacity=64, max_seqs=2, device="cpu")
    hf.attach(model, cache)
    hf.attach(ref_model, ref)
    got = [forward(model, cache, PROMPT, 0, 0)]
    dist.check_replicated(cache, group=pair)
    want = [forward(ref_model, ref, PROMPT, 0, 0)]
    tok = int(got[0][-1].argmax())
    for i in range(n_new):
        got.append(forward(model, cache, [tok], len(PROMPT) + i, 0))
        dist.check_replicated(cache, group=pair)
        want.append(forward(ref_model, ref, [tok], len(PROMPT) + i, 0))
        tok = int(want[-1][-1].argmax())
    got, want = torch.cat(got), torch.cat(want)
    err = float((got - want).abs().max())
    assert err <= 2e-5 * max(1.0, float(want.abs().max())), err
    # diverged bookkeeping is caught: one rank places one more token
    if rank == 0:
        cache.start_forward([0], [1])
    try:
        dist.check_replicated(cache, group=pair)
    except dist.ReplicationError as exc:
        assert "rank 1" in str(exc)
    else:
        raise AssertionError("check_replicated missed diverged tables")
    return err


def nixl_transfer(rank: int, world: int) -> list:
    """The same transfers with transport="nixl": 0 -> 1 for two storage kinds, and 2 -> 1
    resharding (ranks 0, 1 shards -> rank 2), bit-exact."""
    pair_done = []
    for i, kind in enumerate(("float16", "q8_0")):
        seed = 300 + i
        if rank == 0:
            cache = make_cache(kind)
            fill(cache, 0, 17, seed)
            assert dist.send_seq(cache, 0, 1, transport="nixl", timeout=60) == 17
        elif rank == 1:
            cache, ref = make_cache(kind), make_cache(kind)
            fill(ref, 0, 17, seed)
            assert dist.recv_seq(cache, 2, 0, transport="nixl", timeout=60) == 17
            assert rows(cache.export_seq(2)) == rows(ref.export_seq(0)), kind
            pair_done.append(kind)
    if rank < 2:
        cache = make_cache("bfloat16", head_shard=(rank, 2))
        fill(cache, 0, 9, 400)
        dist.send_seq(cache, 0, 2, transport="nixl", timeout=60)
    else:
        cache, ref = make_cache("bfloat16"), make_cache("bfloat16")
        fill(ref, 0, 9, 400)
        assert dist.recv_seq(cache, 0, [0, 1], transport="nixl", timeout=60) == 9
        assert rows(cache.export_seq(0)) == rows(ref.export_seq(0))
        pair_done.append("reshard")
    return pair_done


def _wrapper(head_shard=None):
    """Two layer groups: a sliding-window group and a full one (Gemma-style)."""
    def cfg():
        return nkv.CacheConfig(n_layers=1, n_kv_heads=H, head_dim=D, capacity=32, max_seqs=2,
                               device="cpu", head_shard=head_shard)
    swa = nkv.CausalCache(cfg(), shift=nkv.RopeShift(), swa_window=4, swa_memory=6)
    full = nkv.CausalCache(cfg(), shift=nkv.RopeShift())
    return nkv.WrapperCache([swa, full], layer_groups=[0, 1])


def _fill_wrapper(cache, seq, n, seed):
    a, b = cache.caches[0].config.head_range
    g = torch.Generator().manual_seed(seed)
    cache.start_forward(np.arange(n), [seq] * n)
    for layer in range(2):
        k = torch.randn(n, H, D, generator=g).half()
        v = torch.randn(n, H, D, generator=g).half()
        cache.set_layer(layer)
        cache.put(k[:, a:b].contiguous(), v[:, a:b].contiguous())


def layer_groups_and_streams(rank: int, world: int) -> list:
    """A WrapperCache sequence (a sliding-window group and a full
    group) and a per-sequence-stream cache's sequence, 0 -> 1 and 2 -> 1 resharded (ranks 0, 2
    hold halves), bit-exact; check_replicated over a wrapper and a stream cache."""
    done = []
    if rank == 0:
        w = _wrapper()
        _fill_wrapper(w, 0, 11, 500)
        assert dist.send_seq(w, 0, 1, timeout=60) == 11
    if rank in (0, 2):      # each sends its half of a stream cache's KV heads
        s = nkv.CausalCache(
            nkv.CacheConfig(n_layers=2, n_kv_heads=H, head_dim=D, capacity=32, max_seqs=2,
                            unified=False, device="cpu", head_shard=(rank // 2, 2)),
            shift=nkv.RopeShift())
        fill(s, 1, 7, 501)
        assert dist.send_seq(s, 1, 1, timeout=60) == 7
    else:
        w, ref = _wrapper(), _wrapper()
        _fill_wrapper(ref, 0, 11, 500)
        assert dist.recv_seq(w, 1, 0, timeout=60) == 11
        got, want = w.export_seq(1), ref.export_seq(0)
        assert len(got.parts) == 2
        assert rows(got) == rows(want)
        done.append("wrapper")
        cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=H, head_dim=D, capacity=32, max_seqs=2,
                              unified=False, device="cpu")
        s, sref = nkv.CausalCache(cfg, shift=nkv.RopeShift()), \
            nkv.CausalCache(cfg, shift=nkv.RopeShift())
        fill(sref, 1, 7, 501)
        assert dist.recv_seq(s, 0, [0, 2], timeout=60) == 7
        assert rows(s.export_seq(0)) == rows(sref.export_seq(1))
        done.append("streams")
    # bookkeeping replicated across all three ranks, on caches built the same way
    w = _wrapper(head_shard=(rank % 2, 2) if rank < 2 else None)
    _fill_wrapper(w, 0, 9, 600)
    dist.check_replicated(w)
    return done


# ------------------------------------------------------------------------------ hybrid models
HYBRID_KINDS = ["recurrent", "attention", "recurrent"]


def make_hybrid(restore_every: int = 4):
    cfg = nkv.CacheConfig(n_layers=1, n_kv_heads=H, head_dim=D, capacity=64, max_seqs=3,
                          device="cpu", dtype="float16")
    rc = nkv.RecurrentCache(nkv.RecurrentConfig(
        2, [nkv.StateSpec("conv", (3, 8), "bfloat16"), nkv.StateSpec("ssm", (2, 4, 4))],
        max_seqs=3, restore_every=restore_every, max_restore_points=4, device="cpu"))
    return nkv.HybridCache(nkv.CausalCache(cfg, shift=nkv.RopeShift()), rc, HYBRID_KINDS)


def fill_hybrid(hc, seq: int, n: int, seed: int, first: int = 0) -> None:
    """K/V of the attention layer and recurrent states of both recurrent layers (random for a
    seed), with the restore points the cache asks for."""
    g = np.random.default_rng(seed)
    hc.start_forward(np.arange(first, first + n), [seq] * n)
    plan = hc.restore_plan(seq, n)
    for layer, kind in enumerate(HYBRID_KINDS):
        hc.set_layer(layer)
        if kind == "attention":
            hc.put(g.standard_normal((n, H, D)).astype(np.float16),
                   g.standard_normal((n, H, D)).astype(np.float16))
            continue
        for cut in plan:
            st = {"conv": g.integers(0, 2**16, (3, 8)).astype(np.uint16),
                  "ssm": g.standard_normal((2, 4, 4)).astype(np.float32)}
            if cut < n:
                hc.keep_restore_point(seq, first + cut, st, layer=layer)
            else:
                hc.write_states(layer, [seq], {k: v[None] for k, v in st.items()})
    hc.keep_restore_point(seq, first + n)


def hybrid_rows(hc, seq):
    snap = hc.export_seq(seq)
    return rows(snap) + [snap.recurrent.positions.tobytes(), snap.recurrent.flags.tobytes()] + \
        [np.ascontiguousarray(a).tobytes() for a in snap.recurrent.states.values()]


def hybrid_transfer(rank: int, world: int) -> list:
    """Rank 0 sends a hybrid sequence (K/V + recurrent state and restore points) to rank 1's
    HybridCache, bit-exact; a hybrid sequence into an attention-only cache and an attention-only
    sequence into a HybridCache are refused on both sides, the receiver unchanged."""
    if rank > 1:
        return []
    seen = []
    if rank == 0:
        hc = make_hybrid()
        fill_hybrid(hc, 0, 10, 5)
        assert dist.send_seq(hc, 0, 1, timeout=30) == 10
        for case in ("into attention-only", "attention-only into hybrid"):
            src = hc if case == "into attention-only" else make_cache()
            if src is not hc:
                fill(src, 0, 4, 6)
            try:
                dist.send_seq(src, 0, 1, timeout=30)
            except dist.TransferRefused as exc:
                seen.append((case, str(exc)))
            else:
                raise AssertionError(f"{case}: the sender did not raise")
        return seen
    hc = make_hybrid()
    ref = make_hybrid()
    fill_hybrid(ref, 0, 10, 5)
    assert dist.recv_seq(hc, 2, 0, timeout=30) == 10
    assert hybrid_rows(hc, 2) == hybrid_rows(ref, 0)
    assert hc.restore_points(2) == ref.restore_points(0) == [4, 8, 10]
    assert hc.rollback(2, 8) and hc.seq_pos_max(2) == 7
    for case, target in (("into attention-only", make_cache()),
                         ("attention-only into hybrid", make_hybrid())):
        before = dist.table_digest(target)
        state = {n: a.copy() for n, a in target.rc.pool.items()} if hasattr(target, "rc") \
            else {}
        try:
            dist.recv_seq(target, 0, 0, timeout=30)
        except dist.TransferRefused as exc:
            seen.append((case, str(exc)))
        else:
            raise AssertionError(f"{case}: the receiver did not raise")
        assert dist.table_digest(target) == before, case
        for n, a in state.items():
            assert np.array_equal(a, target.rc.pool[n]), case
    return seen


# ------------------------------------------------------------------------------ issue 37
def oversized(rank: int, world: int) -> list:
    """Rank 0 claims a sequence of 8M positions (a forged header) and then sends a real one
    larger than the receiver's cache: rank 1 refuses both from the header, before allocating
    anything, and both sides raise ``TransferRefused`` naming the room (#9)."""
    if rank > 1:
        return []
    seen = []
    if rank == 0:
        cache = make_cache()
        fill(cache, 0, 40, 41)
        real = dist._wire.make_header

        def forged(snap, n_kv_heads):
            h = real(snap, n_kv_heads)
            n = 8 << 20
            h["parts"][0]["n"] = n
            h["parts"][0]["positions"] = base64.b64encode(
                np.arange(n, dtype="<i4").tobytes()).decode("ascii")
            return h
        dist._wire.make_header = forged
        try:
            dist.send_seq(cache, 0, 1, timeout=60)
        except dist.TransferRefused as exc:
            seen.append(str(exc))
        finally:
            dist._wire.make_header = real
        try:
            dist.send_seq(cache, 0, 1, timeout=60)
        except dist.TransferRefused as exc:
            seen.append(str(exc))
        return seen
    cache = make_cache(max_seqs=1, capacity=16)          # 16 cells, 40 positions come
    before = dist.table_digest(cache)
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(2):
        try:
            dist.recv_seq(cache, 0, 0, timeout=60)
        except dist.TransferRefused as exc:
            seen.append(str(exc))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak   # KiB
    assert dist.table_digest(cache) == before
    seen.append(grown)
    return seen


def timeout_then_again(rank: int, world: int) -> list:
    """Rank 1 waits for rank 0, which stalls past the timeout: ``TransferTimeout``; every later
    call between the pair raises a ``TransferError`` that says to re-create the group, never a
    raw ``RuntimeError`` from posting (#5)."""
    if rank == 0:
        time.sleep(6)       # stalled: sends nothing
        return []
    if rank > 1:
        return []
    cache = make_cache()
    seen = []
    try:
        dist.recv_seq(cache, 0, 0, timeout=1)
    except dist.TransferTimeout as exc:
        seen.append(("first", type(exc).__name__, str(exc)))
    for _ in range(2):
        try:
            dist.recv_seq(cache, 0, 0, timeout=1)
            seen.append(("again", "no error", ""))
        except dist.TransferError as exc:
            seen.append(("again", type(exc).__name__, str(exc)))
        except Exception as exc:   # noqa: BLE001 - what the defect raised
            seen.append(("again", type(exc).__name__, str(exc)))
    fill(cache, 1, 2, 5)
    try:
        dist.send_seq(cache, 1, 0, timeout=1)
        seen.append(("send", "no error", ""))
    except dist.TransferError as exc:
        seen.append(("send", type(exc).__name__, str(exc)))
    except Exception as exc:   # noqa: BLE001
        seen.append(("send", type(exc).__name__, str(exc)))
    return seen


def _paired():
    main = nkv.CacheConfig(n_layers=2, n_kv_heads=1, head_dim=96, v_head_dim=0, capacity=16,
                           max_seqs=2, device="cpu")
    return nkv.PairedCache(main, main.replace(head_dim=32),
                           shift=nkv.RopeShift(dim=32, offset=64),
                           indexer_shift=nkv.RopeShift(dim=16, offset=16))


def _fill_paired(p, seq, n, seed):
    rng = np.random.default_rng(seed)
    p.start_forward(np.arange(n, dtype=np.int32), np.full(n, seq, np.int32))
    for layer in range(2):
        p.set_layer(layer)
        p.put(rng.standard_normal((n, 1, 96)).astype(np.float16), None)
        p.put_indexer(rng.standard_normal((n, 1, 32)).astype(np.float16))


def paired_transfer(rank: int, world: int) -> list:
    """Rank 0 sends a PairedCache sequence (MLA latent rows + indexer keys) to rank 1's pair:
    both halves arrive bit-exact and the pair stays paired."""
    if rank > 1:
        return []
    if rank == 0:
        p = _paired()
        _fill_paired(p, 0, 9, 77)
        assert dist.send_seq(p, 0, 1, timeout=60) == 9
        return []
    p, ref = _paired(), _paired()
    _fill_paired(ref, 0, 9, 77)
    assert dist.recv_seq(p, 1, 0, timeout=60) == 9
    p.check_paired()
    got, want = p.export_seq(1), ref.export_seq(0)
    assert len(got.parts) == 2
    assert rows(got) == rows(want)
    return ["paired"]
