"""Memory and time of one training gradient with the LM head fused with its loss vs on whole logits.

The peer is the same gradient computed the way transformers' GPT-J loss (and meshlm before chunking)
does it: logits for every position at once, [B, T, 50400] in float32, kept for the backward pass.
meshlm's loss runs the head in chunks of `fused_ce.CHUNK_TOKENS` tokens and computes its gradient in the
forward pass (`meshlm.fused_ce`). XLA's compiled memory analysis gives each version's temporary memory;
both run on this machine's CPU. A third row is the floor the head's chunking cannot go below: the same
gradient with no head at all (a loss on the final hidden states), what the layers alone keep.

    python benchmarks/loss_memory.py [--batch 2] [--seq 2048] [--d-model 256] [--layers 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import best_time
from meshlm import fused_ce, model
from meshlm.config import preset


def whole_logits_loss(params: model.Params, tokens: jax.Array, cfg) -> jax.Array:
    """The mean next-token cross-entropy from the whole [B, T, vocab] logits."""
    logits = model.forward(params, tokens[:, :-1], cfg)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    return (log_z - jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]).mean()


def measure(cfg, tokens: np.ndarray, loss: Callable[..., jax.Array], repeats: int) -> tuple[float, float]:
    """(temporary GiB, best seconds) of value_and_grad of `loss`."""
    params = model.init(cfg, jax.random.key(0))
    grad = jax.jit(jax.value_and_grad(lambda p, t: loss(p, t, cfg)))
    compiled = grad.lower(params, tokens).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
    seconds = best_time(lambda: jax.block_until_ready(compiled(params, tokens)), repeats)
    return temp, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    cfg = preset("gptj-tiny").replace(d_model=args.d_model, n_layer=args.layers, max_seq_len=args.seq)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.seq + 1))
    fused = lambda p, t, cfg: model.loss(p, t, cfg)[0]
    rows = [
        (f"whole logits (peer: transformers' way, meshlm before) [{args.batch}, {args.seq}, {cfg.vocab_size}]",
         *measure(cfg, tokens, whole_logits_loss, args.repeats)),
        (f"meshlm, LM head fused with the loss, {fused_ce.CHUNK_TOKENS} tokens at a time",
         *measure(cfg, tokens, fused, args.repeats)),
        ("the floor: no LM head at all (a loss on the final hidden states)",
         *measure(cfg, tokens, lambda p, t, cfg: model.hidden_states(p, t[:, :-1], cfg).mean(), args.repeats)),
    ]  # fmt: skip
    print(f"d_model {cfg.d_model}, {cfg.n_layer} layers, vocab {cfg.vocab_size}, batch {args.batch} x {args.seq}")
    print(f"{'loss':<78} {'temp GiB':>9} {'step s':>7}")
    for name, temp, seconds in rows:
        print(f"{name:<78} {temp:>9.2f} {seconds:>7.2f}")
    (_, peer_temp, peer_s), (_, temp, s), (_, floor, _) = rows
    print(f"fused / whole: memory {temp / peer_temp:.2f}x, time {s / peer_s:.2f}x; "
          f"without any head: {floor / peer_temp:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
