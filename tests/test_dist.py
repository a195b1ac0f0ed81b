"""numbakv.dist over loopback: ranks are processes spawned with torch.multiprocessing, joined by
a gloo process group on 127.0.0.1 (one group per module: spawning costs seconds of imports).
What each rank does is in ``dist_scenarios.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="numbakv.dist needs PyTorch (numbakv[dist])")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("this PyTorch build has no torch.distributed", allow_module_level=True)

import numbakv as nkv  # noqa: E402
from dist_group import Group  # noqa: E402

S = "dist_scenarios"


class _Groups:
    """One live group of 3 ranks for the module, started on first use; a scenario that kills a
    rank breaks it, and the next test gets a fresh one (under xdist any order is possible)."""

    def __init__(self):
        self.current = None

    def get(self) -> Group:
        if self.current is None or self.current.broken:
            if self.current is not None:
                self.current.close()
            self.current = Group(3)
        return self.current


@pytest.fixture(scope="module")
def groups():
    # compile once here (numba's disk cache), so the spawned ranks load instead of all three
    # compiling the same code at once on a cold cache
    import dist_scenarios
    dist_scenarios.warm_up()
    holder = _Groups()
    yield holder
    if holder.current is not None:
        holder.current.close()


@pytest.fixture
def group(groups):
    return groups.get()


def test_reshard_two_to_one_and_one_to_two_bit_exact(group):
    moved = group.run(S, "reshard", timeout=180)
    # the shards each received half of what the unsharded rank holds
    for kind, nbytes in moved[2].items():
        assert moved[0][kind] * 2 == nbytes == moved[1][kind] * 2, kind


def test_refusals_raise_on_both_sides(group):
    seen = group.run(S, "refusals")
    sender, receiver = seen[0], seen[1]
    assert [n for n, _ in sender] == [n for n, _ in receiver] == ["shift", "format", "heads",
                                                                  "held"]
    for (name, s_msg), (_, r_msg) in zip(sender, receiver):
        assert "refused" in s_msg or "could not import" in s_msg, (name, s_msg)
    assert "do not cover" in receiver[2][1] and "do not cover" in sender[2][1]
    assert "already holds" in receiver[3][1] or "holds" in receiver[3][1], receiver[3]


def test_layer_groups_and_streams(group):
    out = group.run(S, "layer_groups_and_streams")
    assert out[1] == ["wrapper", "streams"]


def test_async_send_and_receive(group):
    assert group.run(S, "async_transfer")[:2] == [9, 9]


def test_disaggregated_prefill_decode_equals_one_process(group):
    pytest.importorskip("transformers")
    tokens = group.run(S, "disaggregated", timeout=180)[1]
    assert len(tokens) == 6


def test_tensor_parallel_two_ranks_equals_one(group):
    pytest.importorskip("transformers")
    errs = group.run(S, "tensor_parallel", timeout=180)
    assert errs[0] <= 1e-4 and errs[1] <= 1e-4


def test_nixl_transport(group):
    from numbakv.dist import _nixl
    if not _nixl.available():
        pytest.skip("NIXL is not installed (pip install nixl-cu12 or nixl-cu13)")
    out = group.run(S, "nixl_transfer", timeout=180)
    assert out[1] == ["float16", "q8_0"] and out[2] == ["reshard"]


def test_head_shard_config():
    cfg = nkv.CacheConfig(2, 8, 16, head_shard=(3, 4), device="cpu")
    assert cfg.head_range == (6, 8) and cfg.local_kv_heads == 2 and cfg.n_kv_heads == 8
    # world > n_kv_heads: heads replicated as vLLM does, rank r keeps head r * H // world
    assert [nkv.CacheConfig(2, 2, 16, head_shard=(r, 4)).head_range for r in range(4)] == \
        [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert nkv.CacheConfig(2, 8, 16).head_range == (0, 8)
    for bad in [(4, 4), (-1, 2), (0, 0), (0, 3), (1.0, 2), "01", (0, 1, 2)]:
        with pytest.raises(ValueError, match="head_shard"):
            nkv.CacheConfig(2, 8, 16, head_shard=bad)
    assert cfg.nbytes(10) * 4 == cfg.replace(head_shard=None).nbytes(10)


def test_cover_plan_and_header_parsing():
    """The receiver's pure decisions (no processes): which sender gives which heads, and
    malformed headers refused with a reason."""
    from numbakv.dist import _wire
    # 2 -> 1, in any order of the senders
    assert _wire.plan_cover([(4, 8), (0, 4)], (0, 8)) == [(4, 8), (0, 4)]
    # replicated heads (H=2, world=4): the first sender of each head, the others skip
    assert _wire.plan_cover([(0, 1), (0, 1), (1, 2), (1, 2)], (0, 2)) == \
        [(0, 1), None, (1, 2), None]
    # a receiver shard keeps only the overlap
    assert _wire.plan_cover([(2, 4)], (2, 4)) == [(2, 4)]
    for ranges in ([(0, 4)], [(0, 3), (4, 8)], [None, None]):
        with pytest.raises(_wire.Refusal, match="do not cover"):
            _wire.plan_cover(ranges, (0, 8))
    for data, why in [(b"\xff", "UTF-8"), (b"[1]", "protocol"),
                      (b'{"protocol": "other/9"}', "protocol"),
                      (b'{"protocol": "numbakv-seq/1"}', "lacks"),
                      (b'{"protocol": "numbakv-seq/1", "fingerprint": {}, "head_range": [2, 1],'
                       b' "n_kv_heads": 4, "parts": []}', "head_range"),
                      (b'{"protocol": "numbakv-seq/1", "fingerprint": {}, "head_range": [0, 1],'
                       b' "n_kv_heads": 4, "parts": [{"n": 2, "positions": "AAAA"}]}',
                       "malformed")]:
        with pytest.raises(_wire.Refusal, match=why):
            _wire.decode_header(data)
    code, reason = _wire.decode_verdict(_wire.encode_verdict(_wire.REFUSED, "é" * 2000))
    assert code == _wire.REFUSED and reason.startswith("éé")


def test_header_of_a_position_held_twice_is_accepted():
    """A sequence may hold one position in several cells (seq_add / seq_div merge positions);
    its header passes the receiver's check, a descending one is refused (no processes)."""
    import numpy as np
    from numbakv.dist import _wire
    cfg = nkv.CacheConfig(1, 2, 4, dtype="float32", capacity=8, max_batch=4, device="cpu")
    c = nkv.CausalCache(cfg, shift=nkv.RopeShift())
    c.start_forward([0, 1, 2, 3], [0] * 4)
    c.set_layer(0)
    c.put(np.ones((4, 2, 4), np.float32), np.ones((4, 2, 4), np.float32))
    c.seq_div(0, 0, None, 2)                                   # 0 0 1 1
    snap = c.export_seq(0)
    header = _wire.decode_header(_wire.encode_header(_wire.make_header(snap, 2)))
    assert header["parts"][0]["positions"].tolist() == [0, 0, 1, 1]
    probe = _wire.Probe(c, nkv.state.snapshot.cache_fingerprint(c))
    assert _wire.check_header(header, probe, (0, 2), 2) == (0, 2)
    header["parts"][0]["positions"] = np.array([1, 1, 0, 0], np.int32)
    with pytest.raises(_wire.Refusal, match="ascending"):
        _wire.check_header(header, probe, (0, 2), 2)


def test_hybrid_sequences_carry_their_recurrent_state(group):
    seen = group.run(S, "hybrid_transfer")
    sender, receiver = seen[0], seen[1]
    assert [c for c, _ in sender] == [c for c, _ in receiver] == [
        "into attention-only", "attention-only into hybrid"]
    assert "attention-only" in receiver[0][1] and "recurrent" in receiver[1][1]


def test_oversized_sequence_refused_from_the_header_on_both_sides(group):
    out = group.run(S, "oversized", timeout=180)
    sender, receiver = out[0], out[1]
    assert len(sender) == 2 and len(receiver) == 3, out
    for msg in sender + receiver[:2]:
        assert "room" in msg, msg
    assert "8388608" in receiver[0]
    assert receiver[2] < 256 * 1024, f"the receiver's peak RSS grew {receiver[2]} KiB"


def test_paired_cache_sequences_move_both_halves(group):
    seen = group.run(S, "paired_transfer")
    assert seen[1] == ["paired"]


def test_header_room_is_checked_before_any_allocation_for_every_size():
    """issue 37 #9, the class that found it: headers claiming any number of positions (up to
    what the 64 MiB header limit allows) against caches with any number of free cells. The
    check refuses exactly when the positions exceed the cells or the free cells, and only ever
    raises ``Refusal`` (never an allocation error): it runs before anything is allocated."""
    import base64

    import numpy as np
    from hypothesis import given, settings, strategies as st

    from numbakv.dist import _wire
    from numbakv.state.snapshot import cache_fingerprint

    cfg = nkv.CacheConfig(n_layers=2, n_kv_heads=2, head_dim=4, dtype="float16", capacity=16,
                          max_seqs=2, device="cpu")
    sender = nkv.CausalCache(cfg)
    sender.start_forward(list(range(3)), [0] * 3)
    for layer in range(2):
        sender.set_layer(layer)
        sender.put(np.ones((3, 2, 4), np.float16), np.ones((3, 2, 4), np.float16))
    template = _wire.make_header(sender.export_seq(0), 2)

    @settings(max_examples=60, deadline=None)
    @given(n=st.one_of(st.integers(0, 40), st.integers(0, 16 << 20)), used=st.integers(0, 32))
    def check(n, used):
        cache = nkv.CausalCache(cfg)                       # 32 cells
        if used:
            cache.start_forward(list(range(used)), [1] * used)
        probe = _wire.Probe(cache, cache_fingerprint(cache))
        h = dict(template, parts=[dict(template["parts"][0], n=n, positions=base64.b64encode(
            np.arange(n, dtype="<i4").tobytes()).decode("ascii"))])
        h = _wire.decode_header(_wire.encode_header(h))
        fits = n <= cache.cells.n_free
        try:
            _wire.check_header(h, probe, (0, 2), 2)
            assert fits, (n, cache.cells.n_free)
        except _wire.Refusal as exc:
            assert not fits and "no room" in str(exc), (n, used, exc)
    check()


def test_peer_killed_mid_transfer_times_out_naming_it(groups):
    # rank 0 dies on purpose: a group of its own, of the 2 ranks the scenario uses, so the
    # module's group stays whole for the tests after this one (a new 3-rank group cost ~13-19 s)
    pair = Group(2)
    try:
        out = pair.run(S, "peer_dies", timeout=90)
    finally:
        pair.close()
    assert out[0] == {"died": 17}
    assert "peer rank 0" in out[1]


def test_after_a_timeout_every_call_says_to_recreate_the_group(group):
    # last in the module: it leaves the group unusable, and a test after it would pay for a
    # new one (each xdist worker runs its share of a module in file order)
    group.broken = True     # the pair's connection is gone after the timeout
    out = group.run(S, "timeout_then_again", timeout=120)
    seen = out[1]
    assert seen[0][:2] == ("first", "TransferTimeout")
    assert "re-create" in seen[0][2]
    for step, kind, msg in seen[1:]:
        assert kind in ("TransferTimeout", "TransferError"), (step, kind, msg)
        assert "re-create" in msg, msg
