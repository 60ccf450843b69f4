"""Where a small model's CPU training step goes: the LM head and its log-softmax, JAX vs torch.

The head of a training step at gptj-tiny's shape (batch 8 x 256 positions, d_model 256, vocab 50400,
float32), in three stages on both sides: the [tokens, d_model] x [d_model, vocab] product alone; with
the cross-entropy's log-sum-exp and target gather (torch: `cross_entropy`); and its gradient with
respect to both inputs. Best of `--repeats` after a warm-up; this is the evidence behind the training
ratio in `benchmarks/results/family.md`.

    PYTHONPATH=. python benchmarks/lm_head.py [--tokens 2048] [--d-model 256] [--vocab 50400] [--repeats 3]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks.timing import best_time


def jax_stages(x: np.ndarray, w: np.ndarray, targets: np.ndarray) -> dict[str, callable]:
    x, w, targets = jnp.asarray(x), jnp.asarray(w), jnp.asarray(targets)

    def nll(x: jax.Array, w: jax.Array) -> jax.Array:
        logits = x @ w
        return (jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[:, None], -1)[:, 0]).mean()

    matmul, loss, grad = jax.jit(jnp.matmul), jax.jit(nll), jax.jit(jax.grad(nll, argnums=(0, 1)))
    return {
        "matmul": lambda: jax.block_until_ready(matmul(x, w)),
        "matmul + cross-entropy": lambda: jax.block_until_ready(loss(x, w)),
        "gradient of both": lambda: jax.block_until_ready(grad(x, w)),
    }


def torch_stages(x: np.ndarray, w: np.ndarray, targets: np.ndarray) -> dict[str, callable]:
    x, w, targets = torch.as_tensor(x), torch.as_tensor(w), torch.as_tensor(targets, dtype=torch.long)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def grad() -> None:
        torch.nn.functional.cross_entropy(xg @ wg, targets).backward()
        xg.grad = wg.grad = None

    with torch.no_grad():
        return {
            "matmul": lambda: x @ w,
            "matmul + cross-entropy": lambda: torch.nn.functional.cross_entropy(x @ w, targets),
            "gradient of both": grad,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=50400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.tokens, args.d_model)).astype(np.float32)
    w = (0.02 * rng.normal(size=(args.d_model, args.vocab))).astype(np.float32)
    targets = rng.integers(0, args.vocab, args.tokens).astype(np.int32)
    print(
        f"LM head: {args.tokens} tokens x d_model {args.d_model} x vocab {args.vocab}, float32, "
        f"torch threads {torch.get_num_threads()}"
    )
    sides = {"jax": jax_stages(x, w, targets), "torch": torch_stages(x, w, targets)}
    for stage in sides["jax"]:
        t_jax, t_torch = (best_time(sides[s][stage], args.repeats) for s in ("jax", "torch"))
        print(f"{stage:>24}: jax {t_jax:6.3f} s  torch {t_torch:6.3f} s  jax / torch time {t_jax / t_torch:.2f}x")


if __name__ == "__main__":
    main()
