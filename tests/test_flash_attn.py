"""attend's FlashAttention backend (numbakv/attention.py): the once-per-process probe, when a pass
fits ``flash_attn_with_kvcache`` (and why not), and the arguments numbakv hands it.

flash_attn needs CUDA to build, so it is not installed here: the plumbing is checked against a
stand-in ``flash_attn`` module that computes what flash_attn_with_kvcache's docstring defines
(``block_table`` pages, ``cache_seqlens``, bottom-right causal alignment, ``softmax_scale``,
``softcap``) on the CPU. The real library runs in ``test_auto_uses_flash_attn_on_a_gpu`` (marked
gpu: ``.ci/gpu`` runs it where flash_attn is installed)."""

import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numbakv as nkv  # noqa: E402
from numbakv import attention  # noqa: E402

pytestmark = pytest.mark.torch

PAGE = attention.FLASH_ATTN_PAGE


def _cache(device="cpu", dtype="float16", page_size=PAGE, **kw):
    cfg = nkv.CacheConfig(1, 2, 8, dtype=dtype, capacity=2 * PAGE, max_seqs=2, max_batch=512,
                          page_size=page_size, cache_padding=page_size, device=device)
    return nkv.CausalCache(cfg, **kw)


def _fill(cache, lengths, rng, seqs=(0, 1)):
    """Prefill each sequence with ``lengths[i]`` tokens (one pass each) and put random K/V."""
    for s, n in zip(seqs, lengths):
        cache.start_forward(np.arange(n, dtype=np.int32), np.full(n, s, np.int32))
        dt = np.float16 if cache.config.dtype == "float16" else np.float32
        cache.put(rng.standard_normal((n, 2, 8)).astype(dt),
                  rng.standard_normal((n, 2, 8)).astype(dt))


def _decode(cache, rng, seqs=(1, 0)):
    """A decode pass: one token per sequence at its next position (batch order ``seqs``)."""
    pos = np.array([cache.seq_pos_max(s) + 1 for s in seqs], np.int32)
    cache.start_forward(pos, np.array(seqs, np.int32))
    dt = np.float16 if cache.config.dtype == "float16" else np.float32
    cache.put(rng.standard_normal((len(seqs), 2, 8)).astype(dt),
              rng.standard_normal((len(seqs), 2, 8)).astype(dt))


def _unfit(cache, q_dtype="float16", **kw):
    args = dict(on_cuda=True, permuted=False, quantized=False, latent=False)
    args.update(kw)
    return attention.flash_attn_unfit(cache.config, cache._host_pages(), q_dtype, **args)


def test_probe_runs_once_per_process(monkeypatch):
    monkeypatch.setattr(attention, "_FLASH_ATTN", None)
    monkeypatch.setitem(sys.modules, "flash_attn", None)        # import fails
    assert attention.flash_attn_available() is False
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_with_kvcache = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    assert attention.flash_attn_available() is False            # memoised: not retried
    monkeypatch.setattr(attention, "_FLASH_ATTN", None)
    assert attention.flash_attn_available() is True


def test_which_passes_fit_and_why_not():
    rng = np.random.default_rng(0)
    cache = _cache()
    _fill(cache, (5, 300), rng)          # sequence 1 spans two pages
    _decode(cache, rng)
    assert _unfit(cache) is None
    assert "CUDA" in _unfit(cache, on_cuda=False)
    assert "q is float32" in _unfit(cache, "float32")
    assert "permuted" in _unfit(cache, permuted=True)
    assert "quantized" in _unfit(cache, quantized=True)
    cache.start_forward(np.array([6, 7], np.int32), np.array([0, 0], np.int32))
    assert "decode" in _unfit(cache)                              # two queries in a sequence
    small = _cache(page_size=16)
    _fill(small, (3, 3), rng)
    _decode(small, rng)
    assert "page_size=16" in _unfit(small)
    windowed = _cache(swa_window=4)
    _fill(windowed, (3, 3), rng)
    _decode(windowed, rng)
    assert "window" in _unfit(windowed)
    f32 = _cache(dtype="float32")
    _fill(f32, (3, 3), rng)
    _decode(f32, rng)
    assert "float32" in _unfit(f32, "float32")


def _fake_flash_attn(calls):
    """flash_attn_with_kvcache as its docstring defines it (CPU, float32 math)."""
    def flash_attn_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, block_table,
                                softmax_scale, causal, softcap=0.0):
        calls.append(dict(q=tuple(q.shape), k=tuple(k_cache.shape), table=block_table.clone(),
                          lens=cache_seqlens.clone(), causal=causal))
        b, sq, H, D = q.shape
        page, hkv = k_cache.shape[1], k_cache.shape[2]
        out = torch.zeros(b, sq, H, v_cache.shape[-1])
        for i in range(b):
            n = int(cache_seqlens[i])
            pages = block_table[i, :-(-n // page)].long()
            k = k_cache[pages].reshape(-1, hkv, D)[:n].float()
            v = v_cache[pages].reshape(-1, hkv, v_cache.shape[-1])[:n].float()
            g = H // hkv
            s = torch.einsum("qhd,nhd->hqn", q[i].float(), k.repeat_interleave(g, 1))
            s = s * softmax_scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            # causal, bottom-right aligned: query j of sq sees keys <= n - sq + j
            keep = torch.arange(n)[None, :] <= (n - sq + torch.arange(sq))[:, None]
            s = s.masked_fill(~keep[None], float("-inf"))
            out[i] = torch.einsum("hqn,nhd->qhd", torch.softmax(s, -1),
                                  v.repeat_interleave(g, 1))
        return out.to(q.dtype)
    return flash_attn_with_kvcache


def test_arguments_handed_to_flash_attn(monkeypatch):
    """The pass's pages, lengths and query order as flash_attn_with_kvcache takes them: its
    result (stand-in, see the module docstring) equals attend(backend='torch'), rows in batch
    order; a layout that does not fill pages is declined (None), not described wrongly."""
    calls = []
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_with_kvcache = _fake_flash_attn(calls)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    rng = np.random.default_rng(1)
    cache = _cache()
    _fill(cache, (5, 300), rng)
    _decode(cache, rng, seqs=(1, 0))
    q = torch.from_numpy(rng.standard_normal((2, 4, 8)).astype(np.float16))
    host = cache._host_pages()
    kp, vp = (torch.from_numpy(np.asarray(x)) for x in cache.layer_pool())
    out = attention._flash_attn(torch, q, cache, host, kp, vp, 0.3, 5.0)
    want = attention.attend(q, cache, scale=0.3, soft_cap=5.0, backend="torch")
    np.testing.assert_allclose(out.float().numpy(), want.float().numpy(), atol=2e-3)
    (call,) = calls
    assert call["q"] == (2, 1, 4, 8) and call["k"] == (4, PAGE, 2, 8)
    assert call["causal"] and sorted(call["lens"].tolist()) == [6, 301]
    assert attention._flash_attn(torch, q, cache, host, kp, vp, 0.3, 5.0) is not None
    assert len(calls) == 2 and "flash_attn" in host.plans          # planned once per pass
    # a middle range removed: sequence 1's cells no longer fill its pages in order
    cache.seq_rm(1, 10, 20)
    _decode(cache, rng, seqs=(1, 0))
    assert attention._flash_attn(torch, q, cache, cache._host_pages(), kp, vp, 0.3,
                                 None) is None


def test_explicit_backend_says_why_it_cannot_run(monkeypatch):
    monkeypatch.setattr(attention, "_FLASH_ATTN", False)
    rng = np.random.default_rng(2)
    cache = _cache()
    _fill(cache, (3, 3), rng)
    _decode(cache, rng)
    q = torch.zeros(2, 4, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="not installed"):
        attention.attend(q, cache, backend="flash_attn")
    monkeypatch.setattr(attention, "_FLASH_ATTN", True)
    with pytest.raises(ValueError, match="not on CUDA"):
        attention.attend(q, cache, backend="flash_attn")


@pytest.mark.gpu
def test_auto_uses_flash_attn_on_a_gpu():
    """On a GPU with flash_attn installed: attend(auto) over a page_size=256 float16 cache goes
    through flash_attn_with_kvcache and equals backend='torch'."""
    if not attention.flash_attn_available():
        pytest.skip("flash_attn is not installed")
    if attention.flashinfer_available():
        pytest.skip("FlashInfer is installed: auto prefers it")
    rng = np.random.default_rng(3)
    cache = _cache("cuda")
    import cupy
    for s, n in zip((0, 1), (5, 300)):
        cache.start_forward(np.arange(n, dtype=np.int32), np.full(n, s, np.int32))
        cache.put(cupy.asarray(rng.standard_normal((n, 2, 8)).astype(np.float16)),
                  cupy.asarray(rng.standard_normal((n, 2, 8)).astype(np.float16)))
    cache.start_forward(np.array([301, 6], np.int32), np.array([1, 0], np.int32))
    cache.put(cupy.asarray(rng.standard_normal((2, 2, 8)).astype(np.float16)),
              cupy.asarray(rng.standard_normal((2, 2, 8)).astype(np.float16)))
    q = torch.randn(2, 4, 8, dtype=torch.float16, device="cuda")
    got = attention.attend(q, cache)
    assert "flash_attn" in cache._host_pages().plans
    want = attention.attend(q, cache, backend="torch")
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
