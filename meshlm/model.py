"""The GPT-J family as pure functions over a parameter pytree.

Reads top to bottom like the architecture: token embedding (plus learned positions where the model
has them), `n_layer` blocks, a final norm, the LM head. A block is GPT-J's parallel residual
`x + attn(ln(x)) + mlp(ln(x))`, GPT-NeoX's with a second norm before the MLP, or GPT-Neo's sequential
`x += attn(ln(x)); x += mlp(ln_mlp(x))`; `ModelConfig` names the few choices the family differs in.
Every parameter is declared once in `param_table` with its shape, its logical axis names and its
initialiser; `meshlm.sharding` maps those names to mesh axes, so nothing here knows about devices.
The layers are stacked on a leading axis and run with `lax.scan`, so compile time does not grow with
depth.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import ModelConfig, Policy, dtype_of
from meshlm.sharding import constrain, embedding_lookup

Params = dict[str, Any]

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

DEFAULT_POLICY = Policy()
T5_BUCKETS, T5_MAX_DISTANCE = 32, 128  # the seed's relative position buckets


class Param(NamedTuple):
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # one logical axis name per dimension
    init: str  # "normal", "zeros" or "constant"
    value: float = 0.0  # the normal's standard deviation, or the constant


def _norm_table(cfg: ModelConfig, layers: int | None) -> Params:
    """A norm's scale (one per channel, or one number for scalenorm) and, where it has one, its offset."""
    lead, lead_axes = ((layers,), ("layers",)) if layers else ((), ())
    shape, axes = (lead, lead_axes) if cfg.norm_is_scalar else ((*lead, cfg.d_model), (*lead_axes, "norm"))
    # the seed's rmsnorm/scalenorm start at sqrt(d): x / |x|_2 has unit norm, not unit RMS
    one = 1.0 if cfg.norm.startswith("layernorm") else math.sqrt(cfg.d_model)
    table = {"scale": Param(shape, axes, "constant", one)}
    if cfg.norm_has_bias:
        table["bias"] = Param(shape, axes, "zeros")
    return table


def param_table(cfg: ModelConfig) -> Params:
    """Every parameter of the model: shape, logical axes, initialiser. Layer weights carry a leading
    `layers` axis; q/k/v/out keep heads as their own axis so tensor parallelism splits whole heads."""
    L, D, H, K, F, V = cfg.n_layer, cfg.d_model, cfg.n_head, cfg.d_head, cfg.d_ff, cfg.vocab_size
    std = 0.02
    resid_std = std / math.sqrt(2 * L)  # GPT-2's scaling of the projections that write the residual
    attn = {
        "q": Param((L, D, H, K), ("layers", "embed", "heads", "head_dim"), "normal", std),
        "k": Param((L, D, H, K), ("layers", "embed", "heads", "head_dim"), "normal", std),
        "v": Param((L, D, H, K), ("layers", "embed", "heads", "head_dim"), "normal", std),
        "out": Param((L, H, K, D), ("layers", "heads", "head_dim", "embed"), "normal", resid_std),
    }
    if cfg.qkv_bias:
        for name in ("q", "k", "v"):
            attn[f"{name}_bias"] = Param((L, H, K), ("layers", "heads", "head_dim"), "zeros")
    if cfg.out_bias:
        attn["out_bias"] = Param((L, D), ("layers", "norm"), "zeros")
    layers = {
        "ln": _norm_table(cfg, L),
        "attn": attn,
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
    }
    if cfg.two_norms:
        layers["ln_mlp"] = _norm_table(cfg, L)
    table: Params = {"embed": {"w": Param((V, D), ("vocab", "embed"), "normal", std)}}
    if cfg.position == "learned":  # replicated: small, and a lookup in an fsdp-split table made XLA gather it whole
        table["pos_embed"] = {"w": Param((cfg.max_seq_len, D), (None, None), "normal", std)}
    if cfg.position == "t5":  # one table of per-head biases, shared by every layer
        table["rel_bias"] = {"w": Param((H, T5_BUCKETS), ("heads", None), "normal", std)}
    table["layers"] = layers
    table["ln_f"] = _norm_table(cfg, None)
    head = {} if cfg.tie_embeddings else {"w": Param((D, V), ("embed", "vocab"), "normal", std)}
    if cfg.head_bias:
        head["b"] = Param((V,), ("vocab",), "zeros")
    if head:
        table["head"] = head
    return table


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
        if p.init == "constant":
            return jnp.full(p.shape, p.value, dt)
        return (p.value * jax.random.normal(k, p.shape, jnp.float32)).astype(dt)

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
    """Parameter count from shapes alone (no allocation), as Hugging Face counts it."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(cfg)))


# ---------------------------------------------------------------------------------------------------
# The forward pass


def norm(x: jax.Array, p: Params, cfg: ModelConfig) -> jax.Array:
    """LayerNorm, or the seed's rmsnorm/scalenorm (x / (|x|_2 + eps) times the scale), in float32."""
    x32 = x.astype(jnp.float32)
    if cfg.norm.startswith("layernorm"):
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + cfg.layer_norm_eps)
    else:
        y = x32 / (jnp.sqrt(jnp.square(x32).sum(-1, keepdims=True)) + cfg.layer_norm_eps)
    y = y * p["scale"].astype(jnp.float32)
    if "bias" in p:
        y = y + p["bias"].astype(jnp.float32)
    return y.astype(x.dtype)


def rotary_tables(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """sin and cos [B, T, rotary_dim] for each position, laid out as `rotate` pairs the dimensions:
    each frequency repeated for its (even, odd) pair (interleaved), or the frequencies twice (half)."""
    rot = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rotary_base ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    if cfg.rotary_style == "interleaved":
        angles = jnp.repeat(angles, 2, axis=-1)
    else:
        angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.sin(angles), jnp.cos(angles)


def rotate(x: jax.Array, style: str) -> jax.Array:
    """interleaved: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...); half: (a, b) -> (-b, a)."""
    if style == "interleaved":
        return jnp.stack([-x[..., 1::2], x[..., ::2]], axis=-1).reshape(x.shape)
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-second, first], axis=-1)


def apply_rotary(x: jax.Array, sin: jax.Array, cos: jax.Array, style: str) -> jax.Array:
    """Rotate the first `rotary_dim` dims of each head of x [B, T, H, K]; the rest pass through."""
    rot = sin.shape[-1]
    if rot == 0:
        return x
    sin, cos = sin[:, :, None, :], cos[:, :, None, :]
    x_rot = x[..., :rot].astype(jnp.float32)
    x_rot = (x_rot * cos + rotate(x_rot, style) * sin).astype(x.dtype)
    return jnp.concatenate([x_rot, x[..., rot:]], axis=-1)


def t5_buckets(length: int) -> np.ndarray:
    """The seed's bucket of each causal distance 0..length-1: exact below 16, log-spaced up to 128."""
    n = np.arange(length)
    exact = T5_BUCKETS // 2
    scaled = np.log(n.astype(np.float32) / exact + np.finfo(np.float32).eps) / np.log(T5_MAX_DISTANCE / exact)
    large = np.minimum(exact + (scaled * (T5_BUCKETS - exact)).astype(np.int32), T5_BUCKETS - 1)
    return np.where(n < exact, n, large).astype(np.int32)


class Positions(NamedTuple):
    """What attention needs to know about where tokens are: queries' positions [B, T], keys' [B, S],
    and which keys each query may see before windows apply [B, T, S]."""

    query: jax.Array
    key: jax.Array
    allowed: jax.Array


def _use_cudnn(q: jax.Array, impl: str) -> bool:
    if impl == "cudnn":
        return True
    return impl == "auto" and jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, bias: jax.Array | None, scale: float, impl: str
) -> jax.Array:
    """Softmax attention with fp32 scores. q [B, T, H, K], k/v [B, S, H, K], allowed [B, T, S], bias
    [B, H, T, S] or None.

    `jax.nn.dot_product_attention` either way: its XLA path is the plain einsum-softmax-einsum with
    fp32 scores; the cuDNN path fuses it into one kernel (the mask becomes an additive bias)."""
    mask = allowed[:, None]
    if _use_cudnn(q, impl):
        try:
            return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, implementation="cudnn")
        except (NotImplementedError, ValueError, RuntimeError):
            if impl == "cudnn":
                raise
    return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, implementation="xla")


def attend_cached(
    q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, bias: jax.Array | None, scale: float
) -> jax.Array:
    """`attend` over a cache layer: q [B, T, H, K], k/v [B, H, S, K] as stored, allowed [B, T, S].

    Plain einsums on the stored layout: `attend` takes keys and values as [B, S, H, K], and giving it
    the cache that way made XLA transpose every cached key and value of every layer at every step."""
    scores = jnp.einsum("bthk,bhsk->bhts", q, k, preferred_element_type=jnp.float32) * scale
    if bias is not None:
        scores = scores + bias
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


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype: str = "float32") -> KVCache:
    """An empty cache of `length` slots per row."""
    shape = (cfg.n_layer, batch, cfg.n_head, length, cfg.d_head)
    return KVCache(
        k=constrain(jnp.zeros(shape, dtype_of(dtype)), CACHE_AXES),
        v=constrain(jnp.zeros(shape, dtype_of(dtype)), CACHE_AXES),
        valid=jnp.zeros((batch, length), bool),
        index=jnp.zeros((batch,), jnp.int32),
    )


class Context(NamedTuple):
    """Per-call inputs shared by every block, computed once per call: rotary tables, which keys each
    query may see in a global and in a local layer, and the t5 bias."""

    sin: jax.Array
    cos: jax.Array
    allowed: jax.Array  # [B, T, S]
    allowed_local: jax.Array | None  # [B, T, S] within `local_window` too; None without local layers
    bias: jax.Array | None  # [B, H, T, S] float32


def _project(h: jax.Array, p: Params, name: str) -> jax.Array:
    out = jnp.einsum("btd,dhk->bthk", h, p[name].astype(h.dtype))
    if f"{name}_bias" in p:
        out = out + p[f"{name}_bias"].astype(h.dtype)
    return out


def attention(
    h: jax.Array,
    p: Params,
    cfg: ModelConfig,
    policy: Policy,
    ctx: Context,
    local: jax.Array,
    cache: KVCache | None = None,
    layer_index: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Self-attention of h [B, T, D]; a `local` layer sees only the last `local_window` positions. With
    a cache, this layer's new keys/values are stored first and the queries attend over every cached slot."""
    q = apply_rotary(_project(h, p, "q"), ctx.sin, ctx.cos, cfg.rotary_style)
    k = apply_rotary(_project(h, p, "k"), ctx.sin, ctx.cos, cfg.rotary_style)
    v = _project(h, p, "v")
    q, k, v = (constrain(t, ("batch", "seq", "act_heads", None)) for t in (q, k, v))
    allowed = ctx.allowed if ctx.allowed_local is None else jnp.where(local, ctx.allowed_local, ctx.allowed)
    scale = 1 / math.sqrt(cfg.d_head) if cfg.scale_attn else 1.0
    if cache is None:
        out = attend(q, k, v, allowed, ctx.bias, scale, policy.attention)
    else:
        cache = cache.write(layer_index, k, v)
        k, v = (constrain(c[layer_index].astype(h.dtype), CACHE_AXES[1:]) for c in (cache.k, cache.v))
        if q.shape[1] == 1:  # a decode step: read the cache as stored
            out = attend_cached(q, k, v, allowed, ctx.bias, scale)
        else:  # a prompt: worth one transpose for `attend`'s fused kernel where there is one
            out = attend(q, k.swapaxes(1, 2), v.swapaxes(1, 2), allowed, ctx.bias, scale, policy.attention)
    out = jnp.einsum("bthk,hkd->btd", out, p["out"].astype(h.dtype))
    if "out_bias" in p:
        out = out + p["out_bias"].astype(h.dtype)
    return out, cache


def mlp(h: jax.Array, p: Params, cfg: ModelConfig) -> jax.Array:
    up = jnp.einsum("btd,df->btf", h, p["fc_in"]["w"].astype(h.dtype)) + p["fc_in"]["b"].astype(h.dtype)
    up = constrain(jax.nn.gelu(up, approximate=cfg.activation == "gelu_new"), ("batch", "seq", "act_mlp"))
    return jnp.einsum("btf,fd->btd", up, p["fc_out"]["w"].astype(h.dtype)) + p["fc_out"]["b"].astype(h.dtype)


def block(
    x: jax.Array,
    layer: Params,
    cfg: ModelConfig,
    policy: Policy,
    ctx: Context,
    local: jax.Array,
    cache: KVCache | None = None,
    layer_index: jax.Array | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """One block in the configured residual form (see the module docstring)."""
    h = norm(x, layer["ln"], cfg)
    attn, cache = attention(h, layer["attn"], cfg, policy, ctx, local, cache, layer_index)
    if cfg.residual == "parallel":
        x = x + attn + mlp(h, layer["mlp"], cfg)
    elif cfg.residual == "parallel_two_norms":
        x = x + attn + mlp(norm(x, layer["ln_mlp"], cfg), layer["mlp"], cfg)
    else:
        x = x + attn
        x = x + mlp(norm(x, layer["ln_mlp"], cfg), layer["mlp"], cfg)
    return constrain(x, ("batch", "seq", "act_embed")), cache


def causal_mask(mask: jax.Array | None, batch: int, length: int) -> jax.Array:
    """[B, T, T] booleans: query t may see key s when s <= t and s is not padding."""
    allowed = jnp.tril(jnp.ones((length, length), bool))[None]
    if mask is not None:
        allowed = allowed & mask.astype(bool)[:, None, :]
    return jnp.broadcast_to(allowed, (batch, length, length))


def _t5_bias(params: Params, cfg: ModelConfig, pos: Positions) -> jax.Array:
    """[B, H, T, S]: each head's learned bias for the (causal, bucketed) distance from query to key."""
    distance = jnp.clip(pos.query[:, :, None] - pos.key[:, None, :], 0, cfg.max_seq_len - 1)
    buckets = jnp.asarray(t5_buckets(cfg.max_seq_len))[distance]
    bias = jnp.moveaxis(params["rel_bias"]["w"].astype(jnp.float32)[:, buckets], 0, 1)
    return constrain(bias, ("batch", "act_heads", "seq", None))


def _run(
    params: Params,
    tokens: jax.Array,
    pos: Positions,
    cfg: ModelConfig,
    policy: Policy,
    cache: KVCache | None,
) -> tuple[jax.Array, KVCache | None]:
    """Embedding and the blocks (scanned over the stacked layers) up to the final norm: hidden states
    [B, T, d_model] and the updated cache."""
    dt = dtype_of(policy.compute_dtype)
    sin, cos = rotary_tables(pos.query, cfg)
    bias = _t5_bias(params, cfg, pos) if cfg.position == "t5" else None
    allowed_local = None
    if "local" in cfg.attention_layers:
        allowed_local = pos.allowed & (pos.query[:, :, None] - pos.key[:, None, :] < cfg.local_window)
    ctx = Context(sin, cos, pos.allowed, allowed_local, bias)

    x = embedding_lookup(params["embed"]["w"], tokens).astype(dt)
    if cfg.position == "learned":  # padding's position -1 is clipped: it is never attended to
        x = x + jnp.take(params["pos_embed"]["w"], jnp.clip(pos.query, 0, cfg.max_seq_len - 1), axis=0).astype(dt)
    x = constrain(x, ("batch", "seq", "act_embed"))

    def step(carry: tuple[jax.Array, KVCache | None], xs: tuple[Params, jax.Array, jax.Array]):
        x, cache = carry
        layer, layer_index, local = xs
        return block(x, layer, cfg, policy, ctx, local, cache, layer_index), None

    if policy.remat != "none":
        step = jax.checkpoint(step, policy=REMAT_POLICIES[policy.remat], prevent_cse=False)
    local = jnp.array([kind == "local" for kind in cfg.layer_kinds])
    (x, cache), _ = jax.lax.scan(step, (x, cache), (params["layers"], jnp.arange(cfg.n_layer), local))
    return norm(x, params["ln_f"], cfg), cache


def unembed(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The LM head (the embedding, transposed, where it is tied): float32 logits [B, T, vocab_size]."""
    if cfg.tie_embeddings:
        w = params["embed"]["w"].astype(x.dtype)
        logits = jnp.einsum("btd,vd->btv", x, w, preferred_element_type=jnp.float32)
    else:
        w = params["head"]["w"].astype(x.dtype)
        logits = jnp.einsum("btd,dv->btv", x, w, preferred_element_type=jnp.float32)
    if cfg.head_bias:
        logits = logits + params["head"]["b"].astype(jnp.float32)
    return constrain(logits, ("batch", "seq", "act_vocab"))


def hidden_states(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    policy: Policy = DEFAULT_POLICY,
    *,
    positions: jax.Array | None = None,
    mask: jax.Array | None = None,
) -> jax.Array:
    """The final norm's output [B, T, d_model] for tokens [B, T]: everything but the LM head.

    `mask` [B, T] marks real tokens (padding is never attended to); `positions` [B, T] are the
    tokens' positions, by default 0..T-1 (pass `cumsum(mask) - 1` for left-padded rows).
    """
    B, T = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    x, _ = _run(params, tokens, Positions(positions, positions, causal_mask(mask, B, T)), cfg, policy, None)
    return x


def forward(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    policy: Policy = DEFAULT_POLICY,
    *,
    positions: jax.Array | None = None,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Logits [B, T, vocab_size] in float32 for tokens [B, T]; `positions` and `mask` as in `hidden_states`."""
    return unembed(params, hidden_states(params, tokens, cfg, policy, positions=positions, mask=mask), cfg)


def decode(
    params: Params,
    tokens: jax.Array,
    cache: KVCache,
    cfg: ModelConfig,
    policy: Policy = DEFAULT_POLICY,
    *,
    mask: jax.Array | None = None,
    at: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Run tokens [B, T] after what `cache` holds: logits [B, T, vocab_size] (or [B, 1, vocab_size] at
    position `at[b]` of each row, e.g. a prompt's last real token) and the cache advanced by T.

    The same blocks as `forward`; a prompt is one call (prefill), each new token another. `mask` [B, T]
    marks real tokens; padding takes a slot but is never attended to and does not advance positions,
    so a row's position is the number of real tokens before it (`cumsum(mask) - 1` for a fresh,
    left-padded prompt).
    """
    B, T = tokens.shape
    S = cache.valid.shape[1]
    mask = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)
    positions = cache.valid.sum(-1, dtype=jnp.int32)[:, None] + jnp.cumsum(mask, -1, dtype=jnp.int32) - 1
    slots = cache.slots(T)
    valid = cache.valid.at[jnp.arange(B)[:, None], slots].set(mask, mode="drop")
    allowed = valid[:, None, :] & (jnp.arange(S)[None, None, :] <= slots[:, :, None])
    key_positions = jnp.cumsum(valid, -1, dtype=jnp.int32) - 1
    cache = cache._replace(valid=valid)
    x, cache = _run(params, tokens, Positions(positions, key_positions, allowed), cfg, policy, cache)
    if at is not None:  # spares a long prompt's prefill a [B, T, vocab] array
        x = jnp.take_along_axis(x, at[:, None, None], axis=1)
    return unembed(params, x, cfg), cache._replace(index=cache.index + T)


LOSS_CHUNK = 512  # positions whose logits exist at once in the loss, for sequences it divides


def _nll(params: Params, x: jax.Array, targets: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(-log p(target), log Z), each [B, T], from hidden states [B, T, D]."""
    logits = unembed(params, x, cfg)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    return log_z - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0], log_z


def _chunked_nll(params: Params, x: jax.Array, targets: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """`_nll` with the LM head applied `LOSS_CHUNK` positions at a time and recomputed in the backward
    pass: the float32 [B, T, vocab] logits (and their gradient) never exist whole, which at GPT-J's
    50400-entry vocabulary and 2048 positions is most of a step's activation memory. Sequences of one
    chunk or less keep their logits (recomputing them would cost more than they weigh)."""
    B, T = targets.shape
    if T <= LOSS_CHUNK or T % LOSS_CHUNK:
        return _nll(params, x, targets, cfg)
    split = lambda a: jnp.moveaxis(a.reshape(B, T // LOSS_CHUNK, LOSS_CHUNK, *a.shape[2:]), 1, 0)
    nll, log_z = jax.lax.map(jax.checkpoint(lambda xs: _nll(params, *xs, cfg)), (split(x), split(targets)))
    merge = lambda a: jnp.moveaxis(a, 0, 1).reshape(B, T)
    return merge(nll), merge(log_z)


def loss(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    policy: Policy = DEFAULT_POLICY,
    *,
    loss_mask: jax.Array | None = None,
    z_loss: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy over tokens [B, T+1] (inputs tokens[:, :-1], targets tokens[:, 1:]).

    `loss_mask` [B, T] weights each target (0 for padding). `z_loss` adds z_loss * logsumexp^2, which
    keeps the softmax normaliser near 1 in low-precision training. Returns (loss, metrics).
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    nll, log_z = _chunked_nll(params, hidden_states(params, inputs, cfg, policy), targets, cfg)
    weights = jnp.ones_like(nll) if loss_mask is None else loss_mask.astype(jnp.float32)
    n = jnp.maximum(weights.sum(), 1.0)
    ce = (nll * weights).sum() / n
    total = ce + z_loss * (jnp.square(log_z) * weights).sum() / n
    return total, {"ce": ce, "tokens": weights.sum()}
