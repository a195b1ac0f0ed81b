"""Disaggregated serving in two processes: a prefill rank and a decode rank (gloo on the CPU).

Rank 0 (prefill) runs the prompt through a tiny random-weight Llama attached to its numbakv
cache and sends the sequence's K/V to rank 1 with ``numbakv.dist.send_seq``. Rank 1 (decode)
receives it with ``recv_seq`` into its own cache and generates greedily from there. Rank 1 then
checks itself: the same prompt prefilled and decoded in one process gives the same tokens.

    python examples/disaggregated.py [--tokens 8] [--prompt 24]

Needs torch and transformers (``pip install numbakv[dist,hf]``). On GPUs, use the NCCL backend
and ``device="cuda"`` caches; the calls are the same.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import sys


def tiny_llama():
    import torch
    import transformers
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, max_position_embeddings=256)
    config._attn_implementation = "eager"
    torch.manual_seed(0)       # both ranks build the same weights
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25)
    return model


def step(model, cache, seq, tokens, first):
    """One forward pass of ``tokens`` at positions ``first..`` of ``seq``: the logits."""
    import torch
    tokens = torch.as_tensor(tokens)
    positions = torch.arange(first, first + len(tokens))
    cache.start_forward(positions, [seq] * len(tokens))
    with torch.no_grad():
        return model(input_ids=tokens[None], position_ids=positions[None]).logits[0]


def decode(model, cache, seq, last, first, n):
    out = []
    for i in range(n):
        last = int(step(model, cache, seq, [last], first + i)[-1].argmax())
        out.append(last)
    return out


def rank_main(rank: int, port: int, args, results) -> None:
    import torch
    import torch.distributed as tdist

    from numbakv import dist, hf
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=2, timeout=datetime.timedelta(seconds=120))
    model = tiny_llama()
    cache = hf.cache_for(model, capacity=256, max_seqs=2, device="cpu")
    hf.attach(model, cache)
    prompt = torch.randint(0, 128, (args.prompt,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    if rank == 0:
        # prefill every prompt token but the last (the decode rank's first step feeds that one)
        step(model, cache, 0, prompt[:-1], 0)
        n = dist.send_seq(cache, 0, dst=1)
        print(f"[prefill] sent {n} tokens of K/V ({cache.export_seq(0).nbytes} bytes)")
        cache.seq_rm(0)        # the prefill rank is free for the next prompt
    else:
        n = dist.recv_seq(cache, 1, src=0)
        got = decode(model, cache, 1, prompt[-1], len(prompt) - 1, args.tokens)
        print(f"[decode] received {n} tokens, generated {got}")
        step(model, cache, 0, prompt[:-1], 0)       # one process doing both, for the check
        want = decode(model, cache, 0, prompt[-1], len(prompt) - 1, args.tokens)
        results.put(got == want)
        print("[decode] same tokens as one process:", got == want)
    tdist.barrier()
    tdist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="prefill and decode in two processes")
    ap.add_argument("--tokens", type=int, default=8, help="tokens to generate")
    ap.add_argument("--prompt", type=int, default=24, help="prompt length")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, args, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        ok = results.get(timeout=300)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
