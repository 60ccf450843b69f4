"""Forward-pass throughput: meshlm (JAX) vs transformers' GPTJForCausalLM (torch), same weights and batch.

    python benchmarks/forward.py [--d-model 512 --layers 4 --batch 8 --seq 256 --repeats 10]

Both run on this machine's CPU in float32, one after the other in the same process; the figure that
matters is the ratio, printed last.
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
import torch
from timing import best_time  # benchmarks/timing.py, beside this script
from transformers import GPTJConfig, GPTJForCausalLM

import meshlm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50400)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    hf_config = GPTJConfig(
        n_embd=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
        rotary_dim=32,
        vocab_size=args.vocab,
        n_positions=max(2048, args.seq),
        bos_token_id=0,
        eos_token_id=0,
    )
    torch_model = GPTJForCausalLM(hf_config).eval()
    tokens = np.random.default_rng(0).integers(0, min(args.vocab, 50257), (args.batch, args.seq))
    with tempfile.TemporaryDirectory() as folder:
        torch_model.save_pretrained(folder)
        lm = meshlm.load(folder)

    torch_tokens = torch.as_tensor(tokens)

    def run_torch() -> None:
        with torch.inference_mode():
            torch_model(torch_tokens).logits.numpy()

    n_tokens = args.batch * args.seq
    t_meshlm = best_time(lambda: lm.logits(tokens), args.repeats)
    t_torch = best_time(run_torch, args.repeats)
    print(
        f"config: d_model {args.d_model}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, "
        f"batch {args.batch} x seq {args.seq}, float32, torch threads {torch.get_num_threads()}"
    )
    print(f"meshlm        {n_tokens / t_meshlm:10.0f} tokens/s  ({t_meshlm * 1e3:.1f} ms/batch)")
    print(f"transformers  {n_tokens / t_torch:10.0f} tokens/s  ({t_torch * 1e3:.1f} ms/batch)")
    print(f"ratio meshlm / transformers: {t_torch / t_meshlm:.2f}x")


if __name__ == "__main__":
    main()
