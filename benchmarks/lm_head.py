"""Where a small model's CPU training step goes: the LM head and its log-softmax, JAX vs torch, and
meshlm's fused head (`meshlm.fused_ce`) against both.

The head of a training step at gptj-tiny's shape (batch 8 x 256 positions, d_model 256, vocab 50400,
float32, with the GPT-J head's bias), in three stages on each side: the [tokens, d_model] x [d_model,
vocab] product alone; with the cross-entropy's log-sum-exp and target gather (torch: `cross_entropy`);
and its gradient with respect to hidden states, weight and bias. JAX's plain head is the autodiff of
`x @ w + b` and `logsumexp`; the fused head computes the mean loss's gradient in its forward pass (the
`lm` objective), or, given per-target cotangents (DPO, ORPO), in a sweep that recomputes the logits.
Every variant's runs are taken in turn, best of `--repeats` after a warm-up, so that other work on the
machine slows all alike; the load average is printed before and after.

    PYTHONPATH=. python benchmarks/lm_head.py [--rows 8] [--seq 256] [--d-model 256] [--vocab 50400] [--repeats 5]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks.timing import best_times, load_average
from meshlm import fused_ce


def jax_stages(x: np.ndarray, w: np.ndarray, b: np.ndarray, targets: np.ndarray) -> dict[str, callable]:
    x, w, b, targets = (jnp.asarray(a) for a in (x, w, b, targets))

    def nll(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
        logits = jnp.einsum("btd,dv->btv", x, w) + b
        return (jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]).mean()

    matmul, loss = jax.jit(lambda x, w: jnp.einsum("btd,dv->btv", x, w)), jax.jit(nll)
    grad = jax.jit(jax.grad(nll, argnums=(0, 1, 2)))
    return {
        "matmul": lambda: jax.block_until_ready(matmul(x, w)),
        "matmul + cross-entropy": lambda: jax.block_until_ready(loss(x, w, b)),
        "gradient of all three": lambda: jax.block_until_ready(grad(x, w, b)),
    }


def fused_stages(x: np.ndarray, w: np.ndarray, b: np.ndarray, targets: np.ndarray) -> dict[str, callable]:
    x, w, b, targets = (jnp.asarray(a) for a in (x, w, b, targets))
    weights = jnp.ones(targets.shape, jnp.float32)

    def mean(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:  # the lm objective's form
        return fused_ce.cross_entropy(x, w, b, targets, weights).total / targets.size

    def per_target(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:  # cotangents known only backward
        return fused_ce.cross_entropy(x, w, b, targets).nll.mean()

    loss = jax.jit(per_target)
    grad, grad_per_target = (jax.jit(jax.grad(f, argnums=(0, 1, 2))) for f in (mean, per_target))
    return {
        "matmul + cross-entropy": lambda: jax.block_until_ready(loss(x, w, b)),
        "gradient of all three": lambda: jax.block_until_ready(grad(x, w, b)),
        "the same, per-target": lambda: jax.block_until_ready(grad_per_target(x, w, b)),
    }


def torch_stages(x: np.ndarray, w: np.ndarray, b: np.ndarray, targets: np.ndarray) -> dict[str, callable]:
    x, w, b = (torch.tensor(a) for a in (x.reshape(-1, x.shape[-1]), w, b))
    targets = torch.as_tensor(targets.reshape(-1), dtype=torch.long)
    xg, wg, bg = (a.clone().requires_grad_() for a in (x, w, b))

    def grad() -> None:
        torch.nn.functional.cross_entropy(xg @ wg + bg, targets).backward()
        xg.grad = wg.grad = bg.grad = None

    with torch.no_grad():
        return {
            "matmul": lambda: x @ w,
            "matmul + cross-entropy": lambda: torch.nn.functional.cross_entropy(x @ w + b, targets),
            "gradient of all three": grad,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=50400)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, args.seq, args.d_model)).astype(np.float32)
    w = (0.02 * rng.normal(size=(args.d_model, args.vocab))).astype(np.float32)
    b = (0.02 * rng.normal(size=args.vocab)).astype(np.float32)
    targets = rng.integers(0, args.vocab, (args.rows, args.seq)).astype(np.int32)
    print(
        f"LM head: {args.rows} x {args.seq} tokens x d_model {args.d_model} x vocab {args.vocab}, float32, "
        f"torch threads {torch.get_num_threads()}; load average {load_average()}"
    )
    sides = {name: stages(x, w, b, targets) for name, stages in
             (("jax", jax_stages), ("fused", fused_stages), ("torch", torch_stages))}  # fmt: skip
    runs = {(side, stage): fn for side, stages in sides.items() for stage, fn in stages.items()}
    best = best_times(runs, args.repeats)
    for stage in ("matmul", "matmul + cross-entropy", "gradient of all three", "the same, per-target"):
        peer = best.get(("torch", stage), best[("torch", "gradient of all three")])
        cells = [f"{side} {best[side, stage]:6.3f} s ({best[side, stage] / peer:.2f}x)"
                 for side in ("jax", "fused") if (side, stage) in best]  # fmt: skip
        print(f"{stage:>24}: {'  '.join(cells)}  torch {peer:6.3f} s   (time / torch's)")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
