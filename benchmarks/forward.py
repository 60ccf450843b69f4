"""Forward-pass throughput: meshlm (JAX) vs transformers (torch), same weights and batch, for GPT-J
(`GPTJForCausalLM`), GPT-NeoX/Pythia (`GPTNeoXForCausalLM`) or GPT-Neo (`GPTNeoForCausalLM`) at one shape.

    python benchmarks/forward.py [--arch gptj|neox|neo] [--d-model 512 --layers 4 --batch 8 --seq 256 --repeats 10]

Both run on this machine's CPU in float32, one after the other in the same process; the figure that
matters is the ratio, printed last.
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
import torch
from family import ARCHS, shaped_as, torch_model  # benchmarks/family.py and timing.py, beside this script
from timing import best_time

import meshlm
from meshlm.config import GPT2_VOCAB, ModelConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="gptj", choices=sorted(ARCHS))
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50400)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    shape = ModelConfig(
        n_layer=args.layers,
        d_model=args.d_model,
        n_head=args.heads,
        d_ff=4 * args.d_model,
        rotary_dim=32,
        vocab_size=args.vocab,
        n_vocab_used=min(args.vocab, GPT2_VOCAB),
        max_seq_len=max(2048, args.seq),
    )
    peer = torch_model(shaped_as(args.arch, shape)).eval()
    tokens = np.random.default_rng(0).integers(0, shape.n_vocab_used, (args.batch, args.seq))
    with tempfile.TemporaryDirectory() as folder:
        peer.save_pretrained(folder)
        lm = meshlm.load(folder)

    torch_tokens = torch.as_tensor(tokens)

    def run_torch() -> None:
        with torch.inference_mode():
            peer(torch_tokens).logits.numpy()

    with torch.inference_mode():  # same weights, same function: the timings compare like with like
        expected = peer(torch_tokens).logits.numpy()
    difference = float(np.abs(lm.logits(tokens) - expected).max())
    n_tokens = args.batch * args.seq
    t_meshlm = best_time(lambda: lm.logits(tokens), args.repeats)
    t_torch = best_time(run_torch, args.repeats)
    print(
        f"config: {args.arch} ({type(peer).__name__}), d_model {args.d_model}, {args.layers} layers, "
        f"{args.heads} heads, vocab {args.vocab}, batch {args.batch} x seq {args.seq}, float32, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"meshlm        {n_tokens / t_meshlm:10.0f} tokens/s  ({t_meshlm * 1e3:.1f} ms/batch)")
    print(f"transformers  {n_tokens / t_torch:10.0f} tokens/s  ({t_torch * 1e3:.1f} ms/batch)")
    print(f"ratio meshlm / transformers: {t_torch / t_meshlm:.2f}x (logits agree to {difference:.1e})")


if __name__ == "__main__":
    main()
