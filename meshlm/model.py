"""GPT-J as pure functions over a parameter pytree.

Reads top to bottom like the architecture: token embedding, `n_layer` blocks with a parallel residual
(`x + attn(ln(x)) + mlp(ln(x))`), final LayerNorm, untied LM head. Every parameter is declared once in
`param_table` with its shape, its logical axis names and its initialiser; `meshlm.sharding` maps those
names to mesh axes, so nothing here knows about devices. The layers are stacked on a leading axis
and run with `lax.scan`, so compile time does not grow with depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from meshlm.config import ConfigError, ModelConfig
from meshlm.sharding import constrain, embedding_lookup

Params = dict[str, Any]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def dtype_of(name: str) -> jnp.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; allowed: {sorted(DTYPES)}") from None


@dataclass(frozen=True)
class Policy:
    """How to run the model: parameter storage dtype, compute dtype and what to rematerialise."""

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"

    def __post_init__(self) -> None:
        dtype_of(self.param_dtype)
        dtype_of(self.compute_dtype)
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"unknown remat policy {self.remat!r}; allowed: {sorted(REMAT_POLICIES)}")


class Param(NamedTuple):
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # one logical axis name per dimension
    init: str  # "normal", "zeros" or "ones"
    std: float = 0.0


def param_table(cfg: ModelConfig) -> Params:
    """Every parameter of the model: shape, logical axes, initialiser. Layer weights carry a leading
    `layers` axis; q/k/v/out keep heads as their own axis so tensor parallelism splits whole heads."""
    L, D, H, K, F, V = cfg.n_layer, cfg.d_model, cfg.n_head, cfg.d_head, cfg.d_ff, cfg.vocab_size
    std = 0.02
    resid_std = std / math.sqrt(2 * L)  # GPT-2's scaling of the projections that write the residual
    return {
        "embed": {"w": Param((V, D), ("vocab", "embed"), "normal", std)},
        "layers": {
            "ln": {
                "scale": Param((L, D), ("layers", "norm"), "ones"),
                "bias": Param((L, D), ("layers", "norm"), "zeros"),
            },
            "attn": {
                "q": Param((L, D, H, K), ("layers", "embed", "heads", "head_dim"), "normal", std),
                "k": Param((L, D, H, K), ("layers", "embed", "heads", "head_dim"), "normal", std),
                "v": Param((L, D, H, K), ("layers", "embed", "heads", "head_dim"), "normal", std),
                "out": Param((L, H, K, D), ("layers", "heads", "head_dim", "embed"), "normal", resid_std),
            },
            "mlp": {
                "fc_in": {
                    "w": Param((L, D, F), ("layers", "embed", "mlp"), "normal", std),
                    "b": Param((L, F), ("layers", "mlp"), "zeros"),
                },
                "fc_out": {
                    "w": Param((L, F, D), ("layers", "mlp", "embed"), "normal", resid_std),
                    "b": Param((L, D), ("layers", "norm"), "zeros"),
                },
            },
        },
        "ln_f": {
            "scale": Param((D,), ("norm",), "ones"),
            "bias": Param((D,), ("norm",), "zeros"),
        },
        "head": {
            "w": Param((D, V), ("embed", "vocab"), "normal", std),
            "b": Param((V,), ("vocab",), "zeros"),
        },
    }


def _is_param(x: Any) -> bool:
    return isinstance(x, Param)


def logical_axes(cfg: ModelConfig) -> Params:
    """The pytree of logical axis names, same structure as the parameters."""
    return jax.tree.map(lambda p: p.axes, param_table(cfg), is_leaf=_is_param)


def init(cfg: ModelConfig, key: jax.Array, dtype: str = "float32") -> Params:
    """Random parameters. Under `jax.jit` with `out_shardings`, each device creates only its shard."""
    table = param_table(cfg)
    leaves, treedef = jax.tree.flatten(table, is_leaf=_is_param)
    keys = jax.random.split(key, len(leaves))
    dt = dtype_of(dtype)

    def make(p: Param, k: jax.Array) -> jax.Array:
        if p.init == "zeros":
            return jnp.zeros(p.shape, dt)
        if p.init == "ones":
            return jnp.ones(p.shape, dt)
        return (p.std * jax.random.normal(k, p.shape, jnp.float32)).astype(dt)

    return jax.tree.unflatten(treedef, [make(p, k) for p, k in zip(leaves, keys, strict=True)])


def abstract_params(cfg: ModelConfig, dtype: str = "float32") -> Params:
    """ShapeDtypeStructs of the parameters, computed without allocating anything."""
    return jax.eval_shape(lambda: init(cfg, jax.random.key(0), dtype))


def param_name(path: tuple[Any, ...]) -> str:
    """A parameter's name as orbax and the converters spell it: its keys joined by "." ("layers.mlp.fc_in.w")."""
    return ".".join(str(getattr(k, "key", k)) for k in path)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape by name, in the parameter tree's order."""
    return {param_name(p): leaf.shape for p, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]}


def count_params(cfg: ModelConfig) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(cfg)))


# ---------------------------------------------------------------------------------------------------
# The forward pass


def layer_norm(x: jax.Array, p: Params, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def rotary_tables(positions: jax.Array, rotary_dim: int) -> tuple[jax.Array, jax.Array]:
    """sin and cos for each position, each frequency repeated for its (even, odd) pair: [B, T, rotary_dim]."""
    inv_freq = 1.0 / (10000 ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.repeat(jnp.sin(angles), 2, axis=-1), jnp.repeat(jnp.cos(angles), 2, axis=-1)


def rotate_every_two(x: jax.Array) -> jax.Array:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    pairs = jnp.stack([-x[..., 1::2], x[..., ::2]], axis=-1)
    return pairs.reshape(x.shape)


def apply_rotary(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotate the first `rotary_dim` dims of each head of x [B, T, H, K]; the rest pass through."""
    rot = sin.shape[-1]
    if rot == 0:
        return x
    sin, cos = sin[:, :, None, :], cos[:, :, None, :]
    x_rot = x[..., :rot].astype(jnp.float32)
    x_rot = (x_rot * cos + rotate_every_two(x_rot) * sin).astype(x.dtype)
    return jnp.concatenate([x_rot, x[..., rot:]], axis=-1)


# "auto": cuDNN's fused (flash) attention on a GPU where it takes the shapes and dtypes, XLA's otherwise;
# "xla" or "cudnn" force one (a forced "cudnn" raises where cuDNN cannot run).
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
attention_impl = "auto"


def _use_cudnn(q: jax.Array) -> bool:
    if attention_impl == "cudnn":
        return True
    return attention_impl == "auto" and jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """Softmax attention with fp32 scores. q [B, T, H, K], k/v [B, S, H, K], allowed [B, T, S].

    `jax.nn.dot_product_attention` either way: its XLA path is the plain einsum-softmax-einsum with
    fp32 scores; the cuDNN path fuses it into one kernel (the mask becomes an additive bias)."""
    if attention_impl not in ATTENTION_IMPLS:
        raise ConfigError(f"unknown attention implementation {attention_impl!r}; allowed: {list(ATTENTION_IMPLS)}")
    mask = allowed[:, None]
    if _use_cudnn(q):
        try:
            return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")
        except (NotImplementedError, ValueError, RuntimeError):
            if attention_impl == "cudnn":
                raise
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def attend_cached(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """`attend` over a cache layer: q [B, T, H, K], k/v [B, H, S, K] as stored, allowed [B, T, S].

    Plain einsums on the stored layout: `attend` takes keys and values as [B, S, H, K], and giving it
    the cache that way made XLA transpose every cached key and value of every layer at every step."""
    scores = jnp.einsum("bthk,bhsk->bhts", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    scores = jnp.where(allowed[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bhsk->bthk", probs, v)


class KVCache(NamedTuple):
    """Keys and values of every layer for incremental decoding, preallocated to `length` slots.

    Each row writes at its own `index`, so rows of different lengths (or rows that joined a running
    batch later) share one cache; `valid` marks the slots that hold real tokens, so left padding and
    unused slots are never attended to.
    """

    k: jax.Array  # [L, B, H, S, K]: heads before slots, the layout the attention einsums read directly
    v: jax.Array  # [L, B, H, S, K]
    valid: jax.Array  # [B, S] bool
    index: jax.Array  # [B] int32: the slot the row's next token is written to

    def slots(self, length: int) -> jax.Array:
        """[B, length] cache slots of the next `length` tokens of each row."""
        return self.index[:, None] + jnp.arange(length, dtype=jnp.int32)

    def write(self, layer: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
        """Store k/v [B, T, H, K] of `layer` at slots index..index+T-1 of each row.

        A loop of per-row dynamic_update_slices, which XLA applies in place; a batched scatter made a
        decode step twice as slow on CPU. The caller keeps index + T within the cache (a row past its
        end, which only a finished row can be, is written at the last slots instead)."""

        def put(buf: jax.Array, new: jax.Array) -> jax.Array:
            def row(b: jax.Array, buf: jax.Array) -> jax.Array:
                update = new[b].swapaxes(0, 1)[None, None].astype(buf.dtype)  # [T, H, K] -> [1, 1, H, T, K]
                return jax.lax.dynamic_update_slice(buf, update, (layer, b, 0, self.index[b], 0))

            return jax.lax.fori_loop(0, new.shape[0], row, buf)

        return self._replace(k=put(self.k, k), v=put(self.v, v))


CACHE_AXES = ("layers", "batch", "act_heads", "cache_seq", "head_dim")


def cache_axes() -> KVCache:
    """Logical axis names of the cache fields: heads are split like the attention weights."""
    return KVCache(k=CACHE_AXES, v=CACHE_AXES, valid=("batch", "cache_seq"), index=("batch",))


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype: str = "float32") -> KVCache:
    """An empty cache of `length` slots per row."""
    shape = (cfg.n_layer, batch, cfg.n_head, length, cfg.d_head)
    return KVCache(
        k=constrain(jnp.zeros(shape, dtype_of(dtype)), CACHE_AXES),
        v=constrain(jnp.zeros(shape, dtype_of(dtype)), CACHE_AXES),
        valid=jnp.zeros((batch, length), bool),
        index=jnp.zeros((batch,), jnp.int32),
    )


def attention(
    h: jax.Array,
    p: Params,
    sin: jax.Array,
    cos: jax.Array,
    allowed: jax.Array,
    cache: KVCache | None = None,
    layer_index: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Self-attention of h [B, T, D]. With a cache, this layer's new keys/values are stored first and
    the queries attend over every cached slot (`allowed` is then [B, T, S])."""
    q = apply_rotary(jnp.einsum("btd,dhk->bthk", h, p["q"].astype(h.dtype)), sin, cos)
    k = apply_rotary(jnp.einsum("btd,dhk->bthk", h, p["k"].astype(h.dtype)), sin, cos)
    v = jnp.einsum("btd,dhk->bthk", h, p["v"].astype(h.dtype))
    q, k, v = (constrain(t, ("batch", "seq", "act_heads", None)) for t in (q, k, v))
    if cache is None:
        out = attend(q, k, v, allowed)
    else:
        cache = cache.write(layer_index, k, v)
        k, v = (constrain(c[layer_index].astype(h.dtype), CACHE_AXES[1:]) for c in (cache.k, cache.v))
        if q.shape[1] == 1:  # a decode step: read the cache as stored
            out = attend_cached(q, k, v, allowed)
        else:  # a prompt: worth one transpose for `attend`'s fused kernel where there is one
            out = attend(q, k.swapaxes(1, 2), v.swapaxes(1, 2), allowed)
    return jnp.einsum("bthk,hkd->btd", out, p["out"].astype(h.dtype)), cache


def mlp(h: jax.Array, p: Params) -> jax.Array:
    up = jnp.einsum("btd,df->btf", h, p["fc_in"]["w"].astype(h.dtype)) + p["fc_in"]["b"].astype(h.dtype)
    up = constrain(jax.nn.gelu(up, approximate=True), ("batch", "seq", "act_mlp"))
    return jnp.einsum("btf,fd->btd", up, p["fc_out"]["w"].astype(h.dtype)) + p["fc_out"]["b"].astype(h.dtype)


def block(
    x: jax.Array,
    layer: Params,
    cfg: ModelConfig,
    sin: jax.Array,
    cos: jax.Array,
    allowed: jax.Array,
    cache: KVCache | None = None,
    layer_index: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    h = layer_norm(x, layer["ln"], cfg.layer_norm_eps)
    attn, cache = attention(h, layer["attn"], sin, cos, allowed, cache, layer_index)
    x = x + attn + mlp(h, layer["mlp"])
    return constrain(x, ("batch", "seq", "act_embed")), cache


def causal_mask(mask: jax.Array | None, batch: int, length: int) -> jax.Array:
    """[B, T, T] booleans: query t may see key s when s <= t and s is not padding."""
    allowed = jnp.tril(jnp.ones((length, length), bool))[None]
    if mask is not None:
        allowed = allowed & mask.astype(bool)[:, None, :]
    return jnp.broadcast_to(allowed, (batch, length, length))


def _run(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    allowed: jax.Array,
    cfg: ModelConfig,
    policy: Policy,
    cache: KVCache | None,
) -> tuple[jax.Array, KVCache | None]:
    """Embedding and the blocks (scanned over the stacked layers) up to the final LayerNorm: hidden
    states [B, T, d_model] and the updated cache."""
    dt = dtype_of(policy.compute_dtype)
    sin, cos = rotary_tables(positions, cfg.rotary_dim)

    x = embedding_lookup(params["embed"]["w"], tokens).astype(dt)
    x = constrain(x, ("batch", "seq", "act_embed"))

    def step(carry: tuple[jax.Array, KVCache | None], xs: tuple[Params, jax.Array]):
        x, cache = carry
        layer, layer_index = xs
        return block(x, layer, cfg, sin, cos, allowed, cache, layer_index), None

    remat = REMAT_POLICIES[policy.remat]
    if policy.remat != "none":
        step = jax.checkpoint(step, policy=remat, prevent_cse=False)
    (x, cache), _ = jax.lax.scan(step, (x, cache), (params["layers"], jnp.arange(cfg.n_layer)))
    return layer_norm(x, params["ln_f"], cfg.layer_norm_eps), cache


def unembed(params: Params, x: jax.Array) -> jax.Array:
    """The LM head: float32 logits [B, T, vocab_size] from final hidden states [B, T, d_model]."""
    logits = jnp.einsum("btd,dv->btv", x, params["head"]["w"].astype(x.dtype), preferred_element_type=jnp.float32)
    logits = logits + params["head"]["b"].astype(jnp.float32)
    return constrain(logits, ("batch", "seq", "act_vocab"))


def hidden_states(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    policy: Policy = Policy(),
    *,
    positions: jax.Array | None = None,
    mask: jax.Array | None = None,
) -> jax.Array:
    """The final LayerNorm's output [B, T, d_model] for tokens [B, T]: everything but the LM head.

    `mask` [B, T] marks real tokens (padding is never attended to); `positions` [B, T] are the rotary
    positions, by default 0..T-1 (pass `cumsum(mask) - 1` for left-padded rows).
    """
    B, T = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    x, _ = _run(params, tokens, positions, causal_mask(mask, B, T), cfg, policy, None)
    return x


def forward(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    policy: Policy = Policy(),
    *,
    positions: jax.Array | None = None,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Logits [B, T, vocab_size] in float32 for tokens [B, T]; `positions` and `mask` as in `hidden_states`."""
    return unembed(params, hidden_states(params, tokens, cfg, policy, positions=positions, mask=mask))


def decode(
    params: Params,
    tokens: jax.Array,
    cache: KVCache,
    cfg: ModelConfig,
    policy: Policy = Policy(),
    *,
    mask: jax.Array | None = None,
    at: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Run tokens [B, T] after what `cache` holds: logits [B, T, vocab_size] (or [B, 1, vocab_size] at
    position `at[b]` of each row, e.g. a prompt's last real token) and the cache advanced by T.

    The same blocks as `forward`; a prompt is one call (prefill), each new token another. `mask` [B, T]
    marks real tokens; padding takes a slot but is never attended to and does not advance positions,
    so a row's rotary position is the number of real tokens before it (`cumsum(mask) - 1` for a fresh,
    left-padded prompt).
    """
    B, T = tokens.shape
    S = cache.valid.shape[1]
    mask = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)
    positions = cache.valid.sum(-1, dtype=jnp.int32)[:, None] + jnp.cumsum(mask, -1, dtype=jnp.int32) - 1
    slots = cache.slots(T)
    valid = cache.valid.at[jnp.arange(B)[:, None], slots].set(mask, mode="drop")
    allowed = valid[:, None, :] & (jnp.arange(S)[None, None, :] <= slots[:, :, None])
    cache = cache._replace(valid=valid)
    x, cache = _run(params, tokens, positions, allowed, cfg, policy, cache)
    if at is not None:  # spares a long prompt's prefill a [B, T, vocab] array
        x = jnp.take_along_axis(x, at[:, None, None], axis=1)
    return unembed(params, x), cache._replace(index=cache.index + T)


LOSS_CHUNK = 512  # positions whose logits exist at once in the loss, for sequences it divides


def _nll(params: Params, x: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(-log p(target), log Z), each [B, T], from hidden states [B, T, D]."""
    logits = unembed(params, x)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    return log_z - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0], log_z


def _chunked_nll(params: Params, x: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`_nll` with the LM head applied `LOSS_CHUNK` positions at a time and recomputed in the backward
    pass: the float32 [B, T, vocab] logits (and their gradient) never exist whole, which at GPT-J's
    50400-entry vocabulary and 2048 positions is most of a step's activation memory. Sequences of one
    chunk or less keep their logits (recomputing them would cost more than they weigh)."""
    B, T = targets.shape
    if T <= LOSS_CHUNK or T % LOSS_CHUNK:
        return _nll(params, x, targets)
    split = lambda a: jnp.moveaxis(a.reshape(B, T // LOSS_CHUNK, LOSS_CHUNK, *a.shape[2:]), 1, 0)
    nll, log_z = jax.lax.map(jax.checkpoint(lambda xs: _nll(params, *xs)), (split(x), split(targets)))
    merge = lambda a: jnp.moveaxis(a, 0, 1).reshape(B, T)
    return merge(nll), merge(log_z)


def loss(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    policy: Policy = Policy(),
    *,
    loss_mask: jax.Array | None = None,
    z_loss: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy over tokens [B, T+1] (inputs tokens[:, :-1], targets tokens[:, 1:]).

    `loss_mask` [B, T] weights each target (0 for padding). `z_loss` adds z_loss * logsumexp^2, which
    keeps the softmax normaliser near 1 in low-precision training. Returns (loss, metrics).
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    nll, log_z = _chunked_nll(params, hidden_states(params, inputs, cfg, policy), targets)
    weights = jnp.ones_like(nll) if loss_mask is None else loss_mask.astype(jnp.float32)
    n = jnp.maximum(weights.sum(), 1.0)
    ce = (nll * weights).sum() / n
    total = ce + z_loss * (jnp.square(log_z) * weights).sum() / n
    return total, {"ce": ce, "tokens": weights.sum()}
