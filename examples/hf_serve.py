"""Serve a transformers model through numbakv: continuous batching, a shared system prompt,
context shift, and saving/restoring one conversation.

A small random-weight Llama (built from a config, nothing downloaded) answers several requests.
Every request starts from the same system prompt, prefilled once and shared by ``copy_prefix``
(no K/V copied). Each forward pass packs the prefills of newly admitted requests beside one
decode token of every running one. A request that outgrows the per-sequence context drops the
oldest half of its conversation after the system prompt (``cache.remove`` re-rotates the keys
that move, with the RoPE of the model's config). One finished conversation is saved with
``save_state``, and later restored into a free slot with ``load_state`` to answer a follow-up.

Every token of a request that did not shift is checked against the model's own full forward
(a copy of the model without numbakv): the logits must agree.

    python examples/hf_serve.py [--device auto|cpu|cuda] [--requests N] [--context N]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional

try:
    import torch
except ImportError as exc:  # an optional dependency: say which one and how to get it
    _NEED = (f"examples/hf_serve.py needs PyTorch and transformers, which did not import "
             f"({exc}): pip install 'numbakv[hf]'")
    if __name__ == "__main__":
        sys.exit(_NEED)
    raise ImportError(_NEED) from exc

VOCAB = 96
SYSTEM_PROMPT = [1, 17, 42, 8, 23, 5, 61, 30, 12, 77, 3, 50]      # shared by every request


@dataclass
class Request:
    rid: int
    prompt: List[int]
    max_new: int
    generated: List[int] = field(default_factory=list)
    logits: List[torch.Tensor] = field(default_factory=list)   # one row per generated token
    slot: Optional[int] = None
    shifted: int = 0            # positions dropped by context shifts
    fed: int = 0                # prompt tokens already in the cache (after the system prompt)

    @property
    def tokens(self) -> List[int]:
        return SYSTEM_PROMPT + self.prompt + self.generated


def build_model(device: str):
    import transformers
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=512,
                                      rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                       "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 64,
                                                       "rope_theta": 10000.0})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25)
    return model.eval().to(device)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--requests", type=int, default=5, help="requests to serve (default 5)")
    parser.add_argument("--slots", type=int, default=3, help="concurrent requests (default 3)")
    parser.add_argument("--context", type=int, default=40,
                        help="positions each sequence may hold (default 40)")
    args = parser.parse_args(argv)

    from numbakv import hf

    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and device != "cuda":
        print("no CUDA device for torch", file=sys.stderr)
        return 2
    model = build_model(device)
    reference = copy.deepcopy(model)            # the model's own full forward, for checking

    # sequence 0 holds the system prompt; sequences 1..slots serve requests
    cache = hf.cache_for(model, capacity=args.context, max_seqs=args.slots + 1, max_batch=128)
    hf.attach(model, cache)
    print(f"model: tiny random-weight Llama (llama3 RoPE), cache: {cache}")

    def forward(parts) -> List[torch.Tensor]:
        """One packed pass: parts = [(seq, tokens, first_position)] -> logits per part."""
        tokens, positions, seqs = [], [], []
        for seq, toks, first in parts:
            tokens += toks
            positions += range(first, first + len(toks))
            seqs += [seq] * len(toks)
        tokens = torch.tensor(tokens, device=device)
        positions = torch.tensor(positions, device=device)
        cache.start_forward(positions, seqs)
        with torch.no_grad():
            logits = model(input_ids=tokens[None], position_ids=positions[None]).logits[0]
        out, i = [], 0
        for _, toks, _ in parts:
            out.append(logits[i:i + len(toks)])
            i += len(toks)
        return out

    forward([(0, SYSTEM_PROMPT, 0)])             # the system prompt, once
    n_sys = len(SYSTEM_PROMPT)

    gen = torch.Generator().manual_seed(1)
    queue = [Request(r, torch.randint(4, VOCAB, (int(torch.randint(3, 9, (1,), generator=gen)),),
                                      generator=gen).tolist(),
                     max_new=int(torch.randint(4, 12, (1,), generator=gen)))
             for r in range(args.requests)]
    queue[0].max_new = args.context + 10         # outgrows its context: shifts
    free = list(range(1, args.slots + 1))
    running: Dict[int, Request] = {}
    done: List[Request] = []
    saved_path = os.path.join(tempfile.mkdtemp(prefix="numbakv_hf_"), "conversation.safetensors")
    saved: Optional[Request] = None
    steps = 0

    while queue or running:
        # admit waiting requests into free slots: fork the system prompt, prefill the rest
        parts, owners = [], []
        while queue and free:
            req = queue.pop(0)
            req.slot = free.pop(0)
            cache.copy_prefix(0, req.slot, n_sys)
            running[req.slot] = req
        for slot, req in running.items():
            pos = n_sys + len(req.prompt) + len(req.generated) - req.shifted
            if req.fed < len(req.prompt):          # prefill what is left of its prompt
                chunk = req.prompt[req.fed:]
                parts.append((slot, chunk, n_sys + req.fed))
                req.fed = len(req.prompt)
            else:                                  # one decode token
                if pos - 1 >= args.context:        # context shift: keep the system prompt
                    discard = (pos - 1 - n_sys) // 2
                    cache.remove(slot, n_sys, n_sys + discard)
                    req.shifted += discard
                    pos -= discard
                    print(f"  request {req.rid}: context shift, dropped {discard} positions "
                          f"after the system prompt (keys re-rotated)")
                parts.append((slot, [req.generated[-1]], pos - 1))
            owners.append(req)
        results = forward(parts)
        steps += 1
        for req, logits in zip(owners, results):
            req.logits.append(logits[-1])
            req.generated.append(int(logits[-1].argmax()))
            if len(req.generated) >= req.max_new:
                running.pop(req.slot)
                if saved is None and req.shifted == 0:   # save one whole conversation
                    cache.save_state(saved_path, seq=req.slot, tokens=req.tokens)
                    saved = req
                cache.seq_rm(req.slot)
                free.append(req.slot)
                done.append(req)
    print(f"served {len(done)} requests in {steps} forward passes "
          f"(prefills and decodes packed together)")

    # check every request that did not shift against the model's own full forward
    worst = 0.0
    for req in done:
        if req.shifted:
            continue
        with torch.no_grad():
            ids = torch.tensor(req.tokens[:-1], device=device)[None]
            want = reference(input_ids=ids).logits[0, -len(req.generated):]
        worst = max(worst, float((torch.stack(req.logits) - want).abs().max()))
    print(f"max |logits - full forward| over unshifted requests: {worst:.2e}")
    shifted = [r for r in done if r.shifted]
    for r in shifted:
        print(f"request {r.rid}: {len(r.generated)} tokens generated in a {args.context}-position"
              f" context ({r.shifted} positions shifted out)")

    # restore the saved conversation into a free slot and answer a follow-up
    ok = worst < 1e-3 and bool(shifted)
    if saved is not None:
        slot = free[0]
        info = cache.load_state(saved_path, seq=slot)
        restored = [int(t) for t in info["tokens"]]
        assert restored == saved.tokens
        follow_up = [9, 14, 2]
        history = restored + follow_up
        # the last generated token was never fed: feed it with the follow-up
        feed = [saved.generated[-1]] + follow_up
        logits = forward([(slot, feed, len(restored) - 1)])[0]
        with torch.no_grad():
            want = reference(input_ids=torch.tensor(history, device=device)[None]).logits[0]
        err = float((logits - want[-len(feed):]).abs().max())
        print(f"conversation {saved.rid} saved to {os.path.basename(saved_path)} and restored as "
              f"sequence {slot}: follow-up logits vs full forward {err:.2e}")
        ok = ok and err < 1e-3
        cache.seq_rm(slot)
    hf.detach(model)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
