"""The LM head fused with its cross-entropy: per-target -log p and log Z from hidden states, without the
[tokens, vocab] logits ever existing whole or being kept for the backward pass.

Liger Kernel's fused linear cross-entropy (and Apple's Cut Cross-Entropy) as a `jax.custom_vjp` that XLA
fuses: the head runs on a few positions of every row at a time (a `lax.scan` over chunks of about
`CHUNK_TOKENS` tokens), and each chunk, while its softmax p is at hand, also computes what the gradient
needs from it. With cotangents g_nll and g_z of -log p(target) and log Z, the logits' gradient is

    dlogits = (g_nll + g_z) * p - g_nll * onehot(target)

- When the loss is a weighted sum over the targets fixed before the model runs, sum weights * (nll +
  z_loss * log_z^2) (the `lm` objective, `total` below), both cotangents are known in the forward pass:
  each chunk computes its whole gradient there and the backward pass only scales it: three matmuls the
  size of the head's and one exp over the logits, as autodiff of the plain head, which keeps the logits
  and their exp for the backward pass, where recomputing them (as chunking otherwise needs) takes four
  matmuls and two exps. On a CPU the head is most of a small model's training step.
- Per-target cotangents (DPO and ORPO combine nll per row) are known only in the backward pass. The
  forward pass keeps p @ W^T [tokens, d_model], so that d hidden = (g_nll + g_z) * (p @ W^T) - g_nll *
  W[target] needs no logits; the head's own gradient, hidden^T @ dlogits, needs p again: one sweep
  over the chunks recomputes it, and only when the head is trained (a LoRA run's head is frozen).

On a mesh, tokens stay split over the batch axes and the vocabulary over `model` (the logits' `act_vocab`):
log Z's max and sum cross `model` as [tokens] reductions, d hidden as [tokens, d_model] partial sums, and
the targets' rows are a Megatron lookup (`sharding.embedding_lookup`). No collective carries a whole
vocabulary (tests/test_fused_ce.py reads the compiled program's collectives).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from meshlm.sharding import batch_ways, constrain, embedding_lookup

# Tokens whose logits exist at once on a device. gptj-tiny's training step (batch 8 x 256) on this 2-core
# CPU took 1515, 1541, 1565 and 1709 ms with chunks of 256, 512, 1024 and 2048 tokens: below 1024 the size
# hardly matters here, and an accelerator's matmuls want rows, so 512, half the memory of 1024.
CHUNK_TOKENS = 512


class Losses(NamedTuple):
    nll: jax.Array  # [B, T] -log p(target)
    log_z: jax.Array  # [B, T] log of the softmax normaliser
    total: jax.Array | None  # sum of weights * (nll + z_loss * log_z^2), where weights were given


def chunk_positions(rows: int, seq_len: int, chunk_tokens: int | None = None) -> int:
    """Positions of every row that one step of the scan runs the head on, for `rows` rows on each device:
    `chunk_tokens` (by default `CHUNK_TOKENS`) tokens per device, whatever the mesh splits the batch into."""
    return max(1, min(seq_len, (chunk_tokens or CHUNK_TOKENS) // rows))


def cross_entropy(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None,
    targets: jax.Array,
    weights: jax.Array | None = None,
    *,
    z_loss: float = 0.0,
    vocab_first: bool = False,
    chunk_tokens: int | None = None,
) -> Losses:
    """-log p(target) and log Z [B, T] of the head `x @ w + b` on hidden states x [B, T, D] for targets
    [B, T]; `w` is [D, V], or [V, D] with `vocab_first` (a tied embedding), in x's dtype. With `weights`
    [B, T], also their weighted sum `total`, whose gradient is computed in the forward pass."""
    B, T, _ = x.shape
    mesh = jax.sharding.get_abstract_mesh()
    c = chunk_positions(max(1, B // (1 if mesh.empty else batch_ways(mesh))), T, chunk_tokens)
    pad = -T % c

    def split(a: jax.Array) -> jax.Array:  # [B, T, ...] -> [chunks, B, c, ...], padded with zeros
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(B, -1, c, *a.shape[2:]), 1, 0)

    def merge(a: jax.Array) -> jax.Array:
        return jnp.moveaxis(a, 0, 1).reshape(B, T + pad)[:, :T]

    spec = _Spec(vocab_first, float(z_loss))
    nll, log_z, total = _fused(split(x), w, b, split(targets), None if weights is None else split(weights), spec)
    return Losses(merge(nll), merge(log_z), total)


class _Spec(NamedTuple):
    vocab_first: bool
    z_loss: float


def _logits(x: jax.Array, w: jax.Array, b: jax.Array | None, spec: _Spec) -> jax.Array:
    logits = jnp.einsum("bcd,vd->bcv" if spec.vocab_first else "bcd,dv->bcv", x, w, preferred_element_type=jnp.float32)
    if b is not None:
        logits = logits + b.astype(jnp.float32)
    return constrain(logits, ("batch", "seq", "act_vocab"))


def _target_rows(w: jax.Array, targets: jax.Array, spec: _Spec) -> jax.Array:
    """[B, c, D]: the head's weights of each target (W's column; a tied embedding's row), looked up where
    the vocabulary is split over `model` and summed over it (XLA would gather the whole head for the
    backward pass's lookup)."""
    return embedding_lookup(w if spec.vocab_first else w.T, targets)


def _target_logits(x: jax.Array, w: jax.Array, b: jax.Array | None, targets: jax.Array, spec: _Spec) -> jax.Array:
    """The targets' logits [B, c] from their rows of the head: no pass over the chunk's logits."""
    z = jnp.einsum("bcd,bcd->bc", x, _target_rows(w, targets, spec), preferred_element_type=jnp.float32)
    return z if b is None else z + jnp.take(jnp.asarray(b, jnp.float32), targets)


def _total(nll: jax.Array, log_z: jax.Array, weights: jax.Array | None, spec: _Spec) -> jax.Array | None:
    return None if weights is None else jnp.sum(weights * (nll + spec.z_loss * jnp.square(log_z)))


@dataclasses.dataclass(frozen=True)
class _Wants:
    """Which gradients the backward pass returns: those of the inputs being differentiated."""

    x: bool
    w: bool
    b: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused(
    x: jax.Array, w: jax.Array, b: jax.Array | None, targets: jax.Array, weights: jax.Array | None, spec: _Spec
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(nll, log_z, total) of chunked inputs x [n, B, c, D], targets and weights [n, B, c]."""

    def chunk(_: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, tuple[jax.Array, jax.Array]]:
        xc, yc = xs
        log_z = jax.nn.logsumexp(_logits(xc, w, b, spec), axis=-1)
        return None, (log_z - _target_logits(xc, w, b, yc, spec), log_z)

    _, (nll, log_z) = jax.lax.scan(chunk, None, (x, targets))
    return nll, log_z, _total(nll, log_z, weights, spec)


def _sweep(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None,
    targets: jax.Array,
    per_chunk: tuple[jax.Array, ...],
    coefficients: Callable[..., tuple[jax.Array, jax.Array]],
    wants: _Wants,
    spec: _Spec,
    log_z: jax.Array | None = None,
) -> tuple[tuple[jax.Array | None, jax.Array | None, jax.Array | None], jax.Array, jax.Array]:
    """One pass over the chunks with dlogits = a * p - c * onehot(target), where (a, c) [B, c] =
    `coefficients(log_z, *per_chunk)`: the gradients (dx, dw, db) that `wants` asks for, log Z (from
    the logits, unless `log_z` gives it) and the targets' logits. The gradients are float32."""
    V = w.shape[0] if spec.vocab_first else w.shape[1]
    w_axes = ("vocab", "embed") if spec.vocab_first else ("embed", "vocab")

    def chunk(acc: tuple[jax.Array | None, jax.Array | None], xs: tuple[jax.Array, ...]):
        dw, db = acc
        xc, yc, known_z, *rest = xs
        logits = _logits(xc, w, b, spec)
        if known_z is None:
            m = jnp.max(logits, axis=-1, keepdims=True)
            e = jnp.exp(logits - m)
            s = jnp.sum(e, axis=-1, keepdims=True)
            p, lz = e / s, (m + jnp.log(s))[..., 0]
        else:
            p, lz = jnp.exp(logits - known_z[..., None]), known_z
        a, c = coefficients(lz, *rest)
        onehot = jnp.arange(V) == yc[..., None]
        dlogits = a[..., None] * p - jnp.where(onehot, c[..., None], 0.0)
        dx = None
        if wants.x:
            spec_x = "bcv,vd->bcd" if spec.vocab_first else "bcv,dv->bcd"
            dx = jnp.einsum(spec_x, dlogits, w, preferred_element_type=jnp.float32)
        if wants.w or wants.b:
            # the bias's gradient (a sum over tokens) as one more row of the weight's: XLA:CPU's column
            # sums over [tokens, vocab] are many times slower than its matmuls
            xa = jnp.concatenate([xc, jnp.ones_like(xc[..., :1])], axis=-1) if wants.b else xc
            spec_w = "bcv,bcd->vd" if spec.vocab_first else "bcd,bcv->dv"
            grad = jnp.einsum(spec_w, *((dlogits, xa) if spec.vocab_first else (xa, dlogits)))
            if wants.b:
                grad, gb = (grad[:, :-1], grad[:, -1]) if spec.vocab_first else (grad[:-1], grad[-1])
                db = db + gb
            if wants.w:
                dw = constrain(dw + grad, w_axes)
        return (dw, db), (dx, lz, _target_logits(xc, w, b, yc, spec))

    zeros = (
        jnp.zeros(w.shape, jnp.float32) if wants.w else None,
        jnp.zeros(b.shape, jnp.float32) if wants.b else None,
    )
    (dw, db), (dx, lz, target_logits) = jax.lax.scan(chunk, zeros, (x, targets, log_z, *per_chunk))
    return (dx, dw, db), lz, target_logits


@dataclasses.dataclass(frozen=True)
class _Saved:
    """What the forward pass keeps: the inputs (which the model keeps anyway), log Z [n, B, c], and either
    p @ W^T [n, B, c, D] (no weights) or the whole gradient of `total` (weights)."""

    x: jax.Array
    w: jax.Array
    b: jax.Array | None
    targets: jax.Array
    log_z: jax.Array
    p_w: jax.Array | None
    total_grads: tuple[jax.Array | None, jax.Array | None, jax.Array | None] | None
    wants: _Wants


jax.tree_util.register_dataclass(
    _Saved, data_fields=["x", "w", "b", "targets", "log_z", "p_w", "total_grads"], meta_fields=["wants"]
)


def _fused_fwd(x, w, b, targets, weights, spec: _Spec):
    wants = _Wants(x.perturbed, w.perturbed, b is not None and b.perturbed)
    x, w, targets = x.value, w.value, targets.value
    b = None if b is None else b.value
    if weights is None:
        # coefficients (1, 0): dlogits = p, and the "gradient" of x is p @ W^T
        ones = lambda lz: (jnp.ones_like(lz), jnp.zeros_like(lz))
        (p_w, _, _), log_z, target_logits = _sweep(x, w, b, targets, (), ones, _Wants(wants.x, False, False), spec)
        nll = log_z - target_logits
        saved = _Saved(x, w, b, targets, log_z, p_w, None, wants)
        return (nll, log_z, None), saved
    weights = weights.value
    z = spec.z_loss
    # d total / d nll = weights, d total / d log_z = 2 z_loss * weights * log_z
    known = lambda lz, wc: (wc * (1 + 2 * z * lz), wc)
    grads, log_z, target_logits = _sweep(x, w, b, targets, (weights,), known, wants, spec)
    nll = log_z - target_logits
    saved = _Saved(x, w, b, targets, log_z, None, grads, wants)
    return (nll, log_z, _total(nll, log_z, weights, spec)), saved


def _fused_bwd(spec: _Spec, saved: _Saved, cotangents):
    g_nll, g_z, g_total = cotangents
    wants = saved.wants
    grads = [None, None, None]
    if saved.total_grads is not None and not isinstance(g_total, SymbolicZero):
        grads = [None if g is None else g * g_total for g in saved.total_grads]
    if not (isinstance(g_nll, SymbolicZero) and isinstance(g_z, SymbolicZero)):
        g_nll = jnp.zeros_like(saved.log_z) if isinstance(g_nll, SymbolicZero) else g_nll
        g_z = jnp.zeros_like(saved.log_z) if isinstance(g_z, SymbolicZero) else g_z
        per_target = lambda lz, gn, gz: (gn + gz, gn)
        sweep = _Wants(wants.x and saved.p_w is None, wants.w, wants.b)
        more = [None, None, None]
        if sweep.x or sweep.w or sweep.b:
            args = (saved.x, saved.w, saved.b, saved.targets, (g_nll, g_z), per_target, sweep, spec, saved.log_z)
            more = list(_sweep(*args)[0])
        if wants.x and saved.p_w is not None:
            rows = _target_rows(saved.w, saved.targets, spec).astype(jnp.float32)
            more[0] = (g_nll + g_z)[..., None] * saved.p_w - g_nll[..., None] * rows
        grads = [m if g is None else (g if m is None else g + m) for g, m in zip(grads, more, strict=True)]
    inputs = (saved.x, saved.w, saved.b)
    dx, dw, db = (
        None if a is None else jnp.zeros_like(a) if g is None else g.astype(a.dtype)
        for a, g in zip(inputs, grads, strict=True)
    )
    return dx, dw, db, None, None


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)
