"""Four prompts served with continuous batching through numbakv: ``hf.Server`` packs their
prefill chunks and decode tokens into one forward pass per step and frees each finished request.

A tiny random-weight Llama is built from a config (nothing downloaded); with a real model use
``AutoModelForCausalLM.from_pretrained(name, attn_implementation="eager")`` and a tokenizer.

    python examples/serve_batch.py
"""

import sys

try:
    import torch
    import transformers
except ImportError as exc:  # an optional dependency: say which one and how to get it
    _NEED = (f"examples/serve_batch.py needs PyTorch and transformers, which did not import "
             f"({exc}): pip install 'numbakv[hf]'")
    if __name__ == "__main__":
        sys.exit(_NEED)
    raise ImportError(_NEED) from exc

from numbakv import hf


def tiny_llama():
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def main() -> dict:
    model = tiny_llama()
    prompts = [[1, 5, 9, 14], [1, 22, 7], [1, 40, 41, 42, 43, 44], [1, 3]]
    # -- the user code: 5 lines
    server = hf.Server(model, hf.cache_for(model, capacity=256, max_seqs=4))
    rids = [server.submit(p, max_new_tokens=8) for p in prompts]
    while server.pending:
        server.step()
    outputs = {rid: server.finished[rid] for rid in rids}
    # --
    for rid, prompt in zip(rids, prompts):
        print(f"request {rid}: prompt {prompt} -> {outputs[rid]}")
    return outputs


if __name__ == "__main__":
    main()
