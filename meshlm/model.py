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
from jax.ad_checkpoint import checkpoint_name

from meshlm import fused_ce, lora, quant
from meshlm.attention import Kernel, dense, mesh_shards, resolve, splash
from meshlm.config import PROJECTIONS, REMAT_NAMES, ModelConfig, Policy, dtype_of, remat_names
from meshlm.kv_cache import NOT_WRITTEN, CacheView, KVCache
from meshlm.param import Param, axes_of, init_table
from meshlm.sharding import TRAINING, Rules, constrain, embedding_lookup, plan, traced_backend, using, with_shardings

Params = dict[str, Any]


def remat_policy(remat: str) -> Any:
    """The `jax.checkpoint` policy of a `Policy.remat` name (see `REMAT_NAMES` in meshlm.config): what each
    layer keeps for the backward pass. The named activations are those `attention` and `mlp` name."""
    fixed = {
        "none": None,
        "full": jax.checkpoint_policies.nothing_saveable,
        "dots": jax.checkpoint_policies.checkpoint_dots,
        "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    }
    if remat in fixed:
        return fixed[remat]
    saved, offloaded = remat_names(remat)
    if not offloaded:
        return jax.checkpoint_policies.save_only_these_names(*saved)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(saved),
        names_which_can_be_offloaded=list(offloaded),
        offload_src="device",
        offload_dst="pinned_host",
    )


REMAT_POLICIES = {name: remat_policy(name) for name in REMAT_NAMES}

DEFAULT_POLICY = Policy()
T5_BUCKETS, T5_MAX_DISTANCE = 32, 128  # the seed's relative position buckets


# Where each projection's stacked weight sits in the parameters, and how many input dimensions it has.
PROJECTION_PATHS: quant.Projections = {
    "q": (("layers", "attn", "q"), 1),
    "k": (("layers", "attn", "k"), 1),
    "v": (("layers", "attn", "v"), 1),
    "out": (("layers", "attn", "out"), 2),
    "fc_in": (("layers", "mlp", "fc_in", "w"), 1),
    "fc_out": (("layers", "mlp", "fc_out", "w"), 1),
}
assert tuple(PROJECTION_PATHS) == PROJECTIONS


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


def projection(params: Params, role: str) -> Any:
    """The stacked weight of projection `role` ("q", ..., "fc_out") in the parameters (or a tree like them)."""
    return quant.weight(params, PROJECTION_PATHS[role][0])


def projection_name(role: str) -> str:
    """The stacked weight's parameter name ("layers.attn.q", "layers.mlp.fc_in.w")."""
    return ".".join(PROJECTION_PATHS[role][0])


def projections(cfg: ModelConfig) -> dict[str, lora.Projection]:
    """Each projection as a LoRA adapter sees it: its stacked weight's declaration and input dimensions."""
    table = param_table(cfg)
    return {role: lora.Projection(projection(table, role), n_in) for role, (_, n_in) in PROJECTION_PATHS.items()}


def logical_axes(cfg: ModelConfig, quantize: str | None = None, heads_first: bool | None = None) -> Params:
    """The pytree of logical axis names, same structure as the parameters (with the projections'
    quantized arrays, when given; int8's `heads_first` or not, None: as `quant.heads_first_here`)."""
    table = param_table(cfg)
    axes = axes_of(table)
    return axes if quantize is None else quant.projection_axes(axes, table, PROJECTION_PATHS, quantize, heads_first)


def init(cfg: ModelConfig, key: jax.Array, dtype: str = "float32") -> Params:
    """Random parameters. Under `jax.jit` with `out_shardings`, each device creates only its shard."""
    return init_table(param_table(cfg), key, dtype)


def abstract_params(
    cfg: ModelConfig, dtype: str = "float32", quantize: str | None = None, heads_first: bool | None = None
) -> Params:
    """ShapeDtypeStructs of the parameters as stored (with `quantize`, the projections quantized, int8's codes
    `heads_first` or not: None, as `quant.heads_first_here`), computed without allocating anything."""
    abstract = jax.eval_shape(lambda: init(cfg, jax.random.key(0), dtype))
    if quantize is None:
        return abstract
    quantized = lambda p: quant.quantize_projections(p, PROJECTION_PATHS, quantize, heads_first)
    return jax.eval_shape(quantized, abstract)


def placed_params(
    cfg: ModelConfig, mesh: Any, dtype: str = "float32", quantize: str | None = None, rules: Rules = TRAINING
) -> Params:
    """`abstract_params` with the shardings `rules` give their logical axes on `mesh` (a mesh of devices, or a
    plan's abstract one), int8 codes laid out for the mesh's chips (`quant.heads_first_here`)."""
    with using(mesh):
        abstract = abstract_params(cfg, dtype, quantize)
        return with_shardings(abstract, plan(abstract, logical_axes(cfg, quantize=quantize), mesh, rules))


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
    """sin and cos [B, T, d_head] for each position, laid out as `rotation` pairs the dimensions: each
    frequency repeated for its (even, odd) pair (interleaved), or the frequencies twice (half); past
    `rotary_dim`, sin 0 and cos 1, so those dimensions pass through unchanged."""
    rot = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rotary_base ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    if cfg.rotary_style == "interleaved":
        angles = jnp.repeat(angles, 2, axis=-1)
    else:
        angles = jnp.concatenate([angles, angles], axis=-1)
    rest = [(0, 0)] * positions.ndim + [(0, cfg.d_head - rot)]
    return jnp.pad(jnp.sin(angles), rest), jnp.pad(jnp.cos(angles), rest, constant_values=1.0)


def rotation(cfg: ModelConfig) -> np.ndarray:
    """The signed permutation R [d_head, d_head] with x @ R the rotated partner of each rotary dimension:
    interleaved, (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...); half, (a, b) -> (-b, a); zero past
    `rotary_dim`. A matmul rather than strided slices and a stack: on a TPU those move the head dimension
    off its 128 lanes, which cost a third of a GPT-J training step (benchmarks/results, 2026-12-06)."""
    rot, r = cfg.rotary_dim, np.zeros((cfg.d_head, cfg.d_head), np.float32)
    source = np.arange(rot)
    if cfg.rotary_style == "interleaved":
        partner, sign = source ^ 1, np.where(source % 2, 1.0, -1.0)
    else:
        partner, sign = (source + rot // 2) % rot, np.where(source < rot // 2, -1.0, 1.0)
    r[partner, source] = sign  # output dim j reads input dim partner[j]
    return r


def apply_rotary(x: jax.Array, sin: jax.Array, cos: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rotate the first `rotary_dim` dims of each head of x [B, T, H, K] in float32; the rest pass through.
    The permutation's products are exact (each output one input times +-1), in x's own dtype. The matrix
    carries the rows' batch dimension so that the `dots_no_batch` remat policy, which keeps every unbatched
    matmul's output, does not keep these float32 partners as well as the projections."""
    if cfg.rotary_dim == 0:
        return x
    r = jnp.broadcast_to(jnp.asarray(rotation(cfg), x.dtype), (x.shape[0], cfg.d_head, cfg.d_head))
    partner = jnp.einsum(
        "bthk,bkj->bthj", x, r, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    sin, cos = sin[:, :, None, :], cos[:, :, None, :]
    return (x.astype(jnp.float32) * cos + partner * sin).astype(x.dtype)


def t5_buckets(length: int) -> np.ndarray:
    """The seed's bucket of each causal distance 0..length-1: exact below 16, log-spaced up to 128."""
    n = np.arange(length)
    exact = T5_BUCKETS // 2
    scaled = np.log(n.astype(np.float32) / exact + np.finfo(np.float32).eps) / np.log(T5_MAX_DISTANCE / exact)
    large = np.minimum(exact + (scaled * (T5_BUCKETS - exact)).astype(np.int32), T5_BUCKETS - 1)
    return np.where(n < exact, n, large).astype(np.int32)


class Positions(NamedTuple):
    """What attention needs to know about where tokens are: queries' positions [B, T], keys' [B, S],
    which keys each query may see before windows apply [B, T, S], and (for kernels that take them
    instead of `allowed`: a forward pass without the cache) each token's segment id [B, T], which only
    tokens of the same id see: packed documents, and padding apart from real tokens."""

    query: jax.Array
    key: jax.Array
    allowed: jax.Array
    segments: jax.Array | None = None


class Context(NamedTuple):
    """Per-call inputs shared by every block, computed once per call: rotary tables, which keys each
    query may see in a global and in a local layer, the t5 bias, the kernel each kind of layer runs
    (`meshlm.attention.resolve`), and the adapters' dropout."""

    sin: jax.Array
    cos: jax.Array
    allowed: jax.Array | None  # [B, T, S]; None for a mixed call's tokens (`spans`), whose rows' are their spans'
    allowed_local: jax.Array | None  # [B, T, S] within `local_window` too; None without local layers
    bias: jax.Array | None  # [B, H, T, S] float32
    kernels: dict[str, Kernel]  # layer kind ("global", "local") -> its kernel
    segments: jax.Array | None = None  # [B, T] Positions.segments
    dropout: float = 0.0
    dropout_key: jax.Array | None = None  # None: no dropout (inference)
    adapter_rows: jax.Array | None = None  # [B] each row's slot in `params["adapters"]` (an engine's adapters)
    whole_pages: bool = False  # each row's written tokens start a page (`decode`'s prompt): see `CacheView.write`
    spans: tuple[SpanAttention, ...] = ()  # a mixed call's spans (`decode_spans`): tokens [1, N], attention per span


class SpanAttention(NamedTuple):
    """What one span of a mixed call (`decode_spans`) attends with: its rows' context and its view of the pool,
    without the pool itself, which the layer scan carries (a copy held here would be a constant of the scan)."""

    ctx: Context
    view: CacheView


class Layer(NamedTuple):
    """One layer's share of what the scan runs over."""

    params: Params
    adapter: Params  # role -> {"a", "b", "scale"}; empty without an adapter
    slots: Params  # role -> {"a", "b", "scale"} with a slot axis after layers; empty without adapter slots
    index: jax.Array
    local: jax.Array


def linear(x: jax.Array, w: Any, role: str, layer: Layer, ctx: Context) -> jax.Array:
    """Projection `role` of x [B, T, in...] by w [in..., out...] (a float array, or quantized and
    rebuilt here one layer at a time), plus the adapter's update of dropout(x) where it targets `role`."""
    y = quant.times(x, w, PROJECTION_PATHS[role][1])
    if role in layer.slots:
        y = y + _slot_delta(x, layer.slots[role], ctx)
    if role not in layer.adapter:
        return y
    adapter = layer.adapter[role]
    x = lora.dropout(x, ctx.dropout, ctx.dropout_key, layer.index, role)
    scale = jax.lax.stop_gradient(adapter["scale"])  # a constant of the adapter, never trained
    return y + lora.delta(adapter["a"], adapter["b"], scale, x)


def _slot_delta(x: jax.Array, slots: Params, ctx: Context) -> jax.Array:
    """Each row's own adapter's update of x [B, T, in...], gathered from the adapter slots: once a row, so a
    mixed call's tokens [1, N, in...] take their span's rows' adapters span by span."""
    if not ctx.spans:
        rows = ctx.adapter_rows
        return lora.row_delta(slots["a"][rows], slots["b"][rows], slots["scale"][rows], x)
    parts = [_slot_delta(part, slots, span.ctx) for span, part in zip(ctx.spans, _split(x, ctx.spans), strict=True)]
    return _join(parts)


def _split(x: jax.Array, spans: tuple[SpanAttention, ...]) -> list[jax.Array]:
    """A mixed call's tokens x [1, N, ...] as each span's rows [B, T, ...] (its tokens lie row after row)."""
    parts, start = [], 0
    for span in spans:
        B, T = span.view.slots.shape
        parts.append(x[0, start : start + B * T].reshape(B, T, *x.shape[2:]))
        start += B * T
    return parts


def _join(parts: list[jax.Array]) -> jax.Array:
    """The spans' rows [B, T, ...] back as one mixed call's tokens [1, N, ...] (`_split`'s inverse)."""
    return jnp.concatenate([x.reshape(1, -1, *x.shape[2:]) for x in parts], axis=1)


def _qkv(h: jax.Array, layer: Layer, ctx: Context, name: str) -> jax.Array:
    p = layer.params["attn"]
    out = linear(h, p[name], name, layer, ctx)
    if f"{name}_bias" in p:
        out = out + p[f"{name}_bias"].astype(h.dtype)
    return out


def score_scale(cfg: ModelConfig) -> float:
    """What the scores q.k are multiplied by: 1/sqrt(d_head), or 1 for GPT-Neo."""
    return 1 / math.sqrt(cfg.d_head) if cfg.scale_attn else 1.0


def attend(
    kind: str, q: jax.Array, k: jax.Array, v: jax.Array, cfg: ModelConfig, policy: Policy, ctx: Context
) -> jax.Array:
    """Causal attention of q [B, T, H, K] over k, v [B, S, H, K] for a layer of `kind` ("global" or
    "local"), by the kernel `ctx.kernels` names for it: splash reads the segment ids and the window,
    XLA and cuDNN the [B, T, S] mask (and the t5 bias)."""
    scale = score_scale(cfg)
    kernel = ctx.kernels[kind]
    if kernel.name == "splash":
        return splash(kernel, q, k, v, ctx.segments, scale, cfg.local_window if kind == "local" else 0)
    allowed = ctx.allowed_local if kind == "local" else ctx.allowed
    return dense(kernel, q, k, v, allowed, ctx.bias, scale, strict=policy.attention == "cudnn")


def attention(
    h: jax.Array, layer: Layer, cfg: ModelConfig, policy: Policy, ctx: Context, cache: CacheView | None = None
) -> tuple[jax.Array, CacheView | None]:
    """Self-attention of h [B, T, D]; a `local` layer sees only the last `local_window` positions. With
    a cache, this layer's new keys/values are stored first and the queries attend over every cached slot
    (in place by a paged kernel for a decode step, else gathered). Each kind of layer runs the kernel
    `ctx.kernels` names for it. A mixed call's tokens [1, N, D] are projected together, each span's rows
    attending on their own (`decode_spans`)."""
    p = layer.params["attn"]
    q = apply_rotary(_qkv(h, layer, ctx, "q"), ctx.sin, ctx.cos, cfg)
    k = apply_rotary(_qkv(h, layer, ctx, "k"), ctx.sin, ctx.cos, cfg)
    v = _qkv(h, layer, ctx, "v")
    q, k, v = (constrain(t, ("batch", "seq", "act_heads", None)) for t in (q, k, v))
    q, k, v = (checkpoint_name(t, name) for t, name in zip((q, k, v), ("q", "k", "v"), strict=True))
    if not ctx.spans:
        out, cache = _attend_rows(q, k, v, h.dtype, layer, cfg, policy, ctx, cache)
    else:  # the pool the scan carries passes from span to span, each writing and reading it by its own tables
        assert cache is not None
        parts = []
        for span, qs, ks, vs in zip(ctx.spans, *(_split(t, ctx.spans) for t in (q, k, v)), strict=True):
            if traced_backend() == "tpu":
                # each span's part its own array, laid out for its own kernels: the packed row's values, heads major
                # for the prompt's page writes and token major for the decode rows', were copied whole from one to
                # the other, in every layer (the int8 quantization's reduction then read the slow layout)
                qs, ks, vs = jax.lax.optimization_barrier((qs, ks, vs))
            view = span.view._replace(cache=cache.cache)
            out, view = _attend_rows(qs, ks, vs, h.dtype, layer, cfg, policy, span.ctx, view)
            cache = cache._replace(cache=view.cache)
            parts.append(out)
        out = _join(parts)
    out = linear(checkpoint_name(out, "attn"), p["out"], "out", layer, ctx)
    if "out_bias" in p:
        out = out + p["out_bias"].astype(h.dtype)
    return out, cache


def _attend_rows(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dtype: Any,
    layer: Layer,
    cfg: ModelConfig,
    policy: Policy,
    ctx: Context,
    cache: CacheView | None,
) -> tuple[jax.Array, CacheView | None]:
    """Attention of rows' queries q [B, T, H, K] given their keys and values: with a cache, those are stored first
    and the queries attend over every token the rows hold, this call's included."""
    if cache is not None:
        cache = cache.write(layer.index, k, v, ctx.whole_pages)

    def run(kind: str, ctx: Context) -> jax.Array:
        kernel = ctx.kernels[kind]
        if kernel.paged:  # a decode step reads the pool in place
            assert cache is not None
            return cache.attend(layer.index, q, score_scale(cfg), kernel.name.removeprefix("paged_"))
        keys, values = (k, v) if cache is None else cache.read(layer.index, dtype, ctx.whole_pages)
        return attend(kind, q, keys, values, cfg, policy, ctx)

    kernels = ctx.kernels
    if len(kernels) == 1:
        out = run(next(iter(kernels)), ctx)
    elif kernels["global"] == kernels["local"] and kernels["global"].name in ("xla", "cudnn"):  # by the mask
        out = run("global", ctx._replace(allowed=jnp.where(layer.local, ctx.allowed_local, ctx.allowed)))
    else:  # each kind of layer its own kernel
        out = jax.lax.cond(layer.local, lambda: run("local", ctx), lambda: run("global", ctx))
    return out, cache


def mlp(h: jax.Array, layer: Layer, cfg: ModelConfig, ctx: Context) -> jax.Array:
    p = layer.params["mlp"]
    up = linear(h, p["fc_in"]["w"], "fc_in", layer, ctx) + p["fc_in"]["b"].astype(h.dtype)
    up = constrain(jax.nn.gelu(up, approximate=cfg.activation == "gelu_new"), ("batch", "seq", "act_mlp"))
    up = checkpoint_name(up, "mlp")
    return linear(up, p["fc_out"]["w"], "fc_out", layer, ctx) + p["fc_out"]["b"].astype(h.dtype)


def block(
    x: jax.Array, layer: Layer, cfg: ModelConfig, policy: Policy, ctx: Context, cache: CacheView | None = None
) -> tuple[jax.Array, CacheView | None]:
    """One block in the configured residual form (see the module docstring)."""
    p = layer.params
    h = norm(x, p["ln"], cfg)
    attn, cache = attention(h, layer, cfg, policy, ctx, cache)
    if cfg.residual == "parallel":
        x = x + attn + mlp(h, layer, cfg, ctx)
    elif cfg.residual == "parallel_two_norms":
        x = x + attn + mlp(norm(x, p["ln_mlp"], cfg), layer, cfg, ctx)
    else:
        x = x + attn
        x = x + mlp(norm(x, p["ln_mlp"], cfg), layer, cfg, ctx)
    return constrain(x, ("batch", "seq", "act_embed")), cache


def causal_mask(mask: jax.Array | None, batch: int, length: int, segments: jax.Array | None = None) -> jax.Array:
    """[B, T, T] booleans: query t may see key s when s <= t, s is not padding, and (with `segments`
    [B, T]) both belong to the same packed document."""
    allowed = jnp.tril(jnp.ones((length, length), bool))[None]
    if mask is not None:
        allowed = allowed & mask.astype(bool)[:, None, :]
    if segments is not None:
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])
    return jnp.broadcast_to(allowed, (batch, length, length))


def segment_positions(segments: jax.Array) -> jax.Array:
    """[B, T] each token's position within its packed document: 0 wherever the segment id changes."""
    index = jnp.broadcast_to(jnp.arange(segments.shape[1]), segments.shape)
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def _t5_bias(params: Params, cfg: ModelConfig, pos: Positions) -> jax.Array:
    """[B, H, T, S]: each head's learned bias for the (causal, bucketed) distance from query to key."""
    distance = jnp.clip(pos.query[:, :, None] - pos.key[:, None, :], 0, cfg.max_seq_len - 1)
    buckets = jnp.asarray(t5_buckets(cfg.max_seq_len))[distance]
    bias = jnp.moveaxis(params["rel_bias"]["w"].astype(jnp.float32)[:, buckets], 0, 1)
    return constrain(bias, ("batch", "act_heads", "seq", None))


def attention_kernels(
    cfg: ModelConfig,
    policy: Policy,
    shape: tuple[int, int],
    keys: int,
    biased: bool,
    cached: bool,
    pool_dtype: str | None = None,
) -> dict[str, Kernel]:
    """The kernel each kind of layer of `cfg` runs for tokens of `shape` [B, T] over `keys` keys: a
    forward pass without the cache, a prefill over it, or a decode step (one token per row) over a pool
    stored in `pool_dtype` (None: the compute dtype)."""
    phase = "train" if not cached else "decode" if shape[1] == 1 else "prefill"
    return {
        kind: resolve(
            phase=phase,
            kind=kind,
            impl=policy.attention,
            batch=shape[0],
            q_len=shape[1],
            kv_len=keys,
            heads=cfg.n_head,
            head_dim=cfg.d_head,
            dtype=pool_dtype or policy.compute_dtype,
            biased=biased,
            shards=mesh_shards(),
        )
        for kind in sorted(set(cfg.layer_kinds))
    }


def _context(
    params: Params,
    pos: Positions,
    cfg: ModelConfig,
    policy: Policy,
    cache: CacheView | None,
    dropout_key: jax.Array | None = None,
    adapter_rows: jax.Array | None = None,
    whole_pages: bool = False,
) -> Context:
    """The `Context` of a call over rows [B, T] at `pos` (its tokens' shape is `pos.query`'s), over `cache` or
    without one."""
    sin, cos = rotary_tables(pos.query, cfg)
    bias = _t5_bias(params, cfg, pos) if cfg.position == "t5" else None
    allowed_local = None
    if "local" in cfg.attention_layers:
        allowed_local = pos.allowed & (pos.query[:, :, None] - pos.key[:, None, :] < cfg.local_window)
    pool = None if cache is None else str(cache.cache.k.dtype)
    shape = pos.query.shape
    kernels = attention_kernels(cfg, policy, shape, pos.key.shape[1], bias is not None, cache is not None, pool)
    dropout = policy.lora_dropout
    return Context(sin, cos, pos.allowed, allowed_local, bias, kernels, pos.segments, dropout, dropout_key,
                   adapter_rows, whole_pages)  # fmt: skip


def _run(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    ctx: Context,
    cfg: ModelConfig,
    policy: Policy,
    cache: CacheView | None,
) -> tuple[jax.Array, CacheView | None]:
    """Embedding of tokens [B, T] at `positions` [B, T] and the blocks (scanned over the stacked layers) up to
    the final norm: hidden states [B, T, d_model] and the updated cache. An adapter in `params["lora"]` is
    scanned with its layers, and so are an engine's adapter slots in `params["adapters"]`, of which row b runs
    slot `ctx.adapter_rows[b]`."""
    dt = dtype_of(policy.compute_dtype)
    x = embedding_lookup(params["embed"]["w"], tokens).astype(dt)
    if cfg.position == "learned":  # padding's position -1 is clipped: it is never attended to
        x = x + jnp.take(params["pos_embed"]["w"], jnp.clip(positions, 0, cfg.max_seq_len - 1), axis=0).astype(dt)
    x = constrain(x, ("batch", "seq", "act_embed"))

    def step(carry: tuple[jax.Array, CacheView | None], layer: Layer):
        x, cache = carry
        return block(x, layer, cfg, policy, ctx, cache), None

    if policy.remat != "none":
        step = jax.checkpoint(step, policy=remat_policy(policy.remat), prevent_cse=False)
    local = jnp.array([kind == "local" for kind in cfg.layer_kinds])
    slots = params.get("adapters", {})
    if slots and any(c.adapter_rows is None for c in [span.ctx for span in ctx.spans] or [ctx]):
        raise ValueError("a model with adapter slots needs each row's slot (adapter_rows)")
    layers = Layer(params["layers"], params.get("lora", {}), slots, jnp.arange(cfg.n_layer), local)
    (x, cache), _ = jax.lax.scan(step, (x, cache), layers)
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
    segments: jax.Array | None = None,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """The final norm's output [B, T, d_model] for tokens [B, T]: everything but the LM head.

    `mask` [B, T] marks real tokens (padding is never attended to); `positions` [B, T] are the
    tokens' positions, by default 0..T-1 (pass `cumsum(mask) - 1` for left-padded rows). `segments`
    [B, T] numbers the documents packed in a row: a token sees only its own document, whose positions
    (by default) restart at 0, so each document computes what it would alone. With `dropout_key`, an
    adapter's inputs are dropped out at `policy.lora_dropout` (training).
    """
    B, T = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T), (B, T)) if segments is None else segment_positions(segments)
    ids = segments
    if mask is not None:  # padding is a segment of its own, which no real token sees
        ids = jnp.where(mask.astype(bool), 0 if segments is None else segments, -1)
    pos = Positions(positions, positions, causal_mask(mask, B, T, segments), ids)
    x, _ = _run(params, tokens, positions, _context(params, pos, cfg, policy, None, dropout_key), cfg, policy, None)
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


class Span(NamedTuple):
    """Rows of tokens [B, T] that run after the `length[b]` tokens each holds in the pages of its `table` [B, n]:
    one call of `decode`, or one of the spans of `decode_spans`. The other fields are `decode`'s arguments."""

    tokens: jax.Array
    table: jax.Array
    length: jax.Array
    mask: jax.Array | None = None
    write_from: jax.Array | None = None
    adapter_rows: jax.Array | None = None
    whole_pages: bool = False

    def inputs(self, cache: KVCache) -> tuple[Positions, CacheView]:
        """Where its tokens and the keys they see lie, and the pool as its rows see it (where each token is
        written: not padding, nor a token past the row's pages, its table's page 0, nor one before `write_from`)."""
        B, T = self.tokens.shape
        size = cache.page_size
        S = self.table.shape[1] * size
        mask = jnp.ones((B, T), bool) if self.mask is None else self.mask.astype(bool)
        positions = self.length[:, None] + jnp.arange(T, dtype=jnp.int32)
        page = jnp.take_along_axis(self.table, jnp.minimum(positions // size, self.table.shape[1] - 1), axis=1)
        write = mask & (positions < S) & (page != 0)
        if self.write_from is not None:
            write &= jnp.arange(T) >= self.write_from[:, None]
        slots = jnp.where(write, page * size + positions % size, NOT_WRITTEN)
        key_positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        allowed = key_positions[:, None, :] <= positions[:, :, None]
        view = CacheView(cache, self.table, slots, self.length + mask.sum(axis=1, dtype=jnp.int32))  # padding: not held
        return Positions(positions, key_positions, allowed), view


def decode_spans(
    params: Params, spans: tuple[Span, ...], cache: KVCache, cfg: ModelConfig, policy: Policy = DEFAULT_POLICY
) -> tuple[list[jax.Array], KVCache]:
    """Each span's final hidden states [B, T, d_model] and the pool with every span's keys and values written,
    from one pass over the layers: spans of different shapes (a prompt's chunk and a decode step's rows) read
    the weights once between them. Their tokens are projected together, laid out one after another as one packed
    row [1, N]; each span's rows attend by the kernel its own shape takes (`attention_kernels`: the decode step's
    rows by a paged kernel on a TPU). The spans' rows must hold different pages, or their writes would meet. The
    one row cannot split over a mesh's batch axes: an engine mixes only on a mesh without them."""
    inputs = [span.inputs(cache) for span in spans]
    ctxs = [_context(params, pos, cfg, policy, view, None, s.adapter_rows, s.whole_pages)
            for s, (pos, view) in zip(spans, inputs, strict=True)]  # fmt: skip
    if len(spans) == 1:
        (pos, view), ctx = inputs[0], ctxs[0]
        x, view = _run(params, spans[0].tokens, pos.query, ctx, cfg, policy, view)
        return [x], view.cache
    parts = tuple(SpanAttention(c, view._replace(cache=None)) for c, (_, view) in zip(ctxs, inputs, strict=True))
    tokens = jnp.concatenate([s.tokens.reshape(1, -1) for s in spans], axis=1)
    positions = jnp.concatenate([pos.query.reshape(1, -1) for pos, _ in inputs], axis=1)
    sin, cos = rotary_tables(positions, cfg)
    ctx = Context(sin, cos, None, None, None, {}, spans=parts)  # the rest is each span's
    x, view = _run(params, tokens, positions, ctx, cfg, policy, inputs[0][1])
    return _split(x, parts), view.cache


def decode(
    params: Params,
    tokens: jax.Array,
    cache: KVCache,
    table: jax.Array,
    length: jax.Array,
    cfg: ModelConfig,
    policy: Policy = DEFAULT_POLICY,
    *,
    mask: jax.Array | None = None,
    at: jax.Array | None = None,
    write_from: jax.Array | None = None,
    hidden: bool = False,
    adapter_rows: jax.Array | None = None,
    whole_pages: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Run tokens [B, T] after the `length[b]` tokens each row already holds in the pages of its
    `table` [B, n]: logits [B, T, vocab_size] (or [B, 1, vocab_size] at index `at[b]` of each row,
    e.g. a prompt's last real token; with `hidden`, the final hidden states instead of logits) and the
    pool with the new keys and values written.

    The same blocks as `forward`; a prompt is one call (prefill), each new token another. `mask` [B, T]
    marks real tokens, which come first in a row (right padding): padding is not stored and its
    outputs mean nothing; nor is a token past the row's pages (its table's page 0). The caller gives
    each row pages for positions up to length + T. A row's tokens before index `write_from[b]` are run
    but not written: they are in the cache already (a cached prefix's last token, run again for the
    logits that follow it), in pages other rows may share.
    `adapter_rows` [B]: each row's adapter slot, with adapter slots in `params["adapters"]`. `whole_pages`: each
    row's written tokens start a page (a prompt after a cached prefix of whole pages), so a TPU writes them a
    page at a time (`CacheView.write`).
    """
    span = Span(tokens, table, length, mask, write_from, adapter_rows, whole_pages)
    [x], cache = decode_spans(params, (span,), cache, cfg, policy)
    if at is not None:  # spares a long prompt's prefill a [B, T, vocab] array
        x = jnp.take_along_axis(x, at[:, None, None], axis=1)
    return (x if hidden else unembed(params, x, cfg)), cache


def target_nll(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    policy: Policy = DEFAULT_POLICY,
    *,
    segments: jax.Array | None = None,
    dropout_key: jax.Array | None = None,
    weights: jax.Array | None = None,
    z_loss: float = 0.0,
) -> fused_ce.Losses:
    """(-log p(target), log Z), each [B, T], of the next-token predictions in tokens [B, T+1] (inputs
    tokens[:, :-1], targets tokens[:, 1:]); `segments` [B, T+1] as in `hidden_states`, `dropout_key` too.
    With `weights` [B, T], also `total`, their sum of nll + z_loss * log Z^2, whose gradient comes from
    the head's forward pass. The LM head is fused with the loss (`fused_ce`): the float32 [B, T, vocab]
    logits, at GPT-J's vocabulary most of a step's activation memory, never exist whole."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    segments = None if segments is None else segments[:, :-1]
    x = hidden_states(params, inputs, cfg, policy, segments=segments, dropout_key=dropout_key)
    w = params["embed"]["w"] if cfg.tie_embeddings else params["head"]["w"]
    b = params["head"]["b"] if cfg.head_bias else None
    return fused_ce.cross_entropy(
        x, w.astype(x.dtype), b, targets, weights, z_loss=z_loss, vocab_first=cfg.tie_embeddings
    )


def loss(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    policy: Policy = DEFAULT_POLICY,
    *,
    loss_mask: jax.Array | None = None,
    segments: jax.Array | None = None,
    z_loss: float = 0.0,
    dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy over tokens [B, T+1] (see `target_nll`).

    `loss_mask` [B, T] weights each target (0 for padding). `z_loss` adds z_loss * logsumexp^2, which
    keeps the softmax normaliser near 1 in low-precision training. Returns (loss, metrics).
    """
    B, T = tokens.shape[0], tokens.shape[1] - 1
    weights = jnp.ones((B, T), jnp.float32) if loss_mask is None else loss_mask.astype(jnp.float32)
    out = target_nll(
        params, tokens, cfg, policy, segments=segments, dropout_key=dropout_key, weights=weights, z_loss=z_loss
    )
    n = jnp.maximum(weights.sum(), 1.0)
    return out.total / n, {"ce": (out.nll * weights).sum() / n, "tokens": weights.sum()}
