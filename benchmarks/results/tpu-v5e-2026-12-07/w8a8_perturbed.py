"""What the chip's w8a8 test should expect, on the CPU: the tpu tier's engine outputs (tests/test_tpu.py) over w8a8
projections with every activation perturbed by `eps` of itself before its int8 rounding, as float32 rounding
differences between two machines perturb it, against the unperturbed run: the scored prompt's largest and mean
log-prob gap, and each greedy row's tokens in common, its largest gap before they part, and the CPU's margin between
its two best tokens where they part.

    PYTHONPATH=. python benchmarks/results/tpu-v5e-2026-12-07/w8a8_perturbed.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from meshlm import quant
from tests.test_tpu import engine_outputs

unperturbed = quant.absmax_int8
base = engine_outputs("cpu", "float32", quantize="w8a8", top=2)
exact = engine_outputs("cpu", "float32")


def prompt_gap(a: list, b: list) -> np.ndarray:
    return np.abs(np.array(a[-1].prompt_logprobs[1:]) - np.array(b[-1].prompt_logprobs[1:]))


rounding = prompt_gap(base, exact)
print(f"w8a8 against float weights: prompt largest {rounding.max():.5f} mean {rounding.mean():.6f}")
for eps in (1e-6, 1e-5, 3e-5, 1e-4):

    def perturbed(x: jax.Array, dims: int = 1, eps: float = eps) -> tuple[jax.Array, jax.Array]:
        wobble = jnp.sin(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape) * 12.9898)
        return unperturbed(x.astype(jnp.float32) * (1 + eps * wobble), dims)

    quant.absmax_int8 = perturbed
    jax.clear_caches()  # the engine's programs were traced with the unperturbed rounding
    out = engine_outputs("cpu", "float32", quantize="w8a8", top=2)
    gap = prompt_gap(out, base)
    print(f"eps {eps}: prompt largest {gap.max():.5f} mean {gap.mean():.6f}")
    for t, c in zip(out, base, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(t.tokens, c.tokens, strict=True)) if a != b), len(c.tokens))
        before = np.abs(np.array(t.logprobs[:same]) - np.array(c.logprobs[:same])).max()
        (_, best), (_, second) = c.top_logprobs[min(same, len(c.tokens) - 1)][:2]
        where = f"parts at {same}, the CPU's margin there {best - second:.5f}" if same < len(c.tokens) else "never parts"
        print(f"  a row: largest gap before {before:.5f}; {where}", flush=True)
