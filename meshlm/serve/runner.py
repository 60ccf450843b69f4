"""The engine's device side: the compiled prefill, decode and speculation programs, the KV pool and the
slots they update in place, the shapes they are compiled for, and the memory checks before any of it is
allocated.

Every shape the runner can be asked for is known in advance (`Shapes`): `warm_up` compiles all of them, so
nothing compiles while requests are served. The runner takes a plain batch description (`Prefill`,
`Decode`, `Speculate`: numpy arrays the scheduler fills) and returns what each row produced (`Step`);
it knows nothing of requests, queues or pages' owners. `lower` gives the planner a program for any shape.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from meshlm import kv_cache, lora, model, quant
from meshlm.config import InputError, ModelConfig, dtype_of
from meshlm.footprint import Footprint, OutOfMemory, free_memory, gib
from meshlm.kv_dma import MAX_PAGE_COPIES
from meshlm.param import axes_of, is_param
from meshlm.serve.batch import (
    MAX_CHUNK,
    Decode,
    Mixed,
    Prefill,
    Settings,
    Shapes,
    Speculate,
    Step,
    bitmask_words,
    settings_for,
)
from meshlm.serve.config import EngineConfig
from meshlm.serve.pages import PAD_PAGE, pages_for
from meshlm.serve.params import TOP_LOGPROBS
from meshlm.serve.sampler import (
    argmax,
    choose,
    distribution,
    draw,
    penalize,
    row_keys,
    unpack_bitmask,
    used_vocabulary,
)
from meshlm.sharding import (
    SERVING,
    Rules,
    batch_ways,
    from_host,
    named_sharding,
    plan,
    shard_bytes,
    to_host,
    using,
    with_shardings,
)

SCORE_CHUNK = 64  # positions whose logits exist at once when a prompt is scored
KV_MEMORY_FRACTION = 0.8  # of the memory free beside the weights and the slots, for the default KV pool


# ---------------------------------------------------------------------------------------------------
# Device state and the compiled steps


class Draft(NamedTuple):
    """A smaller model with the target's tokenizer that proposes tokens for speculative decoding. It keeps
    its own KV pool, paged exactly like the target's: a row's pages hold both models' keys and values."""

    params: model.Params
    cfg: ModelConfig
    policy: model.Policy


class Rows(NamedTuple):
    """Every slot's generation state, on the devices between calls ([max_batch] each)."""

    token: jax.Array  # int32: the last token produced, the next input
    seen: jax.Array  # [B, V] bool: tokens in the prompt or output (for the repetition penalty)
    count: jax.Array  # int32: tokens produced so far
    done: jax.Array  # bool
    length: jax.Array  # int32: tokens in the KV cache
    settings: Settings
    counts: jax.Array  # [B, V] int32: each token's count in the output (for frequency and presence penalties)
    adapter: jax.Array  # int32: the row's adapter slot (0: the base alone)


def _advance(rows: Rows, token: jax.Array) -> Rows:
    """Record each running row's new token; finished rows keep their state. A stop token ends a row only
    once it has min_tokens tokens, this one included (as vLLM; before that they are banned anyway)."""
    running = ~rows.done
    count = rows.count + running
    stopped = jnp.any(token[:, None] == rows.settings.stop_ids, axis=-1) & (count >= rows.settings.min_tokens)
    done = rows.done | stopped | (count >= rows.settings.max_new)
    at = (jnp.arange(token.shape[0]), token)
    seen = rows.seen.at[at].max(running)
    counts = rows.counts.at[at].add(running.astype(rows.counts.dtype))
    return rows._replace(token=jnp.where(running, token, rows.token), seen=seen, count=count, done=done, counts=counts)


def _choose(
    logits: jax.Array,
    rows: Rows,
    cfg: ModelConfig,
    proposal: jax.Array | None = None,
    draft_probs: jax.Array | None = None,
    allowed: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """`choose` for the rows; `allowed` [B, words] is their output constraints' bitmask (a row of zeros: none)."""
    if allowed is not None:
        allowed = unpack_bitmask(allowed, logits.shape[-1])
        allowed |= ~allowed.any(axis=-1, keepdims=True)
    return choose(
        logits, rows.seen, rows.count, rows.settings, cfg.n_vocab_used, proposal, draft_probs, counts=rows.counts,
        allowed=allowed,
    )  # fmt: skip


def _active(rows: Rows, slots: jax.Array) -> Rows:
    """The rows in `slots`; padding (slots out of range) comes back done and holding no tokens, so that attention
    reads none for it (not the last slot's, which the clipped gather gives it)."""
    padding = slots >= rows.token.shape[0]
    active = jax.tree.map(lambda x: x.at[slots].get(mode="clip"), rows)
    return active._replace(done=active.done | padding, length=jnp.where(padding, 0, active.length))


def _scatter(rows: Rows, slots: jax.Array, new: Rows) -> Rows:
    """`new` rows into `rows` at `slots`; slots out of range (padding) are dropped."""
    return jax.tree.map(lambda dst, src: dst.at[slots].set(src, mode="drop"), rows, new)


class Weights(NamedTuple):
    """What every compiled step reads and never writes: the target's weights, and a draft model's."""

    params: model.Params
    draft: model.Params | None = None


class DeviceState(NamedTuple):
    """What every compiled step updates in place (donated): the KV pool, the rows' slots, a draft's pool."""

    cache: kv_cache.KVCache
    rows: Rows
    draft_cache: kv_cache.KVCache | None = None


# Every compiled step takes the weights, the device state and its batch whole (`Prefill`, `Decode`, `Speculate` or
# `Mixed` of device arrays), with the static configs (`draft`: the draft model's config and policy), and returns the
# updated state and what each row produced (a `Step` of device arrays; a mixed step, its prefill's and its decode's).
STATIC = ("cfg", "policy", "draft")
Out = tuple[DeviceState, Step]


@partial(jax.jit, static_argnames=STATIC, donate_argnames="state")
def _prefill(
    weights: Weights,
    state: DeviceState,
    batch: Prefill,
    *,
    cfg: ModelConfig,
    policy: model.Policy,
    draft: tuple[ModelConfig, model.Policy] | None = None,
) -> Out:
    """Write new rows' prompts [B, T] (right-padded, after the `start` tokens a cached prefix gave
    them) into the cache (and the draft's), choose each row's first token and put the rows into `slots`.

    A row's first `scored[b]` positions are scored: the logprob of the token after each and its top
    alternatives come back too (rows that are not scored have 0). A row with `refed[b]` 1 runs its cached
    prefix's last token again first (not written), for the logits that score the token after it. Row b
    runs adapter slot `adapter[b]` (0: the base alone), from now on; its first token is one `allowed[b]` allows
    (a bitmask, zeros: any)."""
    b, draft_cache = batch, state.draft_cache
    prompt = _prompt(b)
    [x], cache = model.decode_spans(weights.params, (prompt,), state.cache, cfg, policy)
    new, step = _prefilled(weights.params, x, b, cfg)
    if draft is not None:
        at = jnp.maximum(b.mask.sum(-1, dtype=jnp.int32) - 1, 0)  # each row's last real token
        _, draft_cache = model.decode(weights.draft, b.tokens, draft_cache, b.table, prompt.length, *draft,
                                      mask=b.mask, at=at, write_from=b.refed, whole_pages=True)  # fmt: skip
    return DeviceState(cache, _scatter(state.rows, b.slots, new), draft_cache), step


def _prompt(b: Prefill) -> model.Span:
    """A prefill's rows as `model.decode_spans` runs them: a scored row's cached prefix's last token again first."""
    return model.Span(b.tokens, b.table, b.start - b.refed, b.mask, b.refed, b.adapter, whole_pages=True)


def _prefilled(params: model.Params, x: jax.Array, b: Prefill, cfg: ModelConfig) -> tuple[Rows, Step]:
    """New rows from their prompts' final hidden states x [B, T, D] (`_prompt`): each row's first token chosen
    (rows whose max_new is 0 are done without one), and the scores of its prompt's scored positions."""
    n_new = b.mask.sum(-1, dtype=jnp.int32)
    at = jnp.maximum(n_new - 1, 0)
    length = b.start - b.refed
    scores = _prompt_scores(params, x, b.tokens, b.scored, cfg)
    logits = model.unembed(params, jnp.take_along_axis(x, at[:, None, None], axis=1), cfg)
    zeros = jnp.zeros_like(b.start)
    # a new row's output counts start at zero (the slot's previous row's are overwritten)
    new = Rows(zeros, b.seen, zeros, b.settings.max_new <= 0, length + n_new, b.settings,
               jnp.zeros(b.seen.shape, jnp.int32), b.adapter)  # fmt: skip
    out = _choose(logits[:, 0], new, cfg, allowed=b.allowed)
    emitted = ~new.done
    new = _advance(new, out[0])
    token, logprob, top_ids, top_logprobs = (o[:, None] for o in out)
    lp, ids, lps = scores
    step = Step(token, logprob, top_ids, top_logprobs, emitted=emitted[:, None], done=new.done,
                prompt_logprob=lp, prompt_top_ids=ids, prompt_top_logprobs=lps)  # fmt: skip
    return new, step


def _prompt_scores(
    params: model.Params, x: jax.Array, tokens: jax.Array, scored: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, ...]:
    """Each of a row's first `scored[b]` positions' log-probability of the token after it in `tokens` [B, T]
    and its top alternatives (ids the tokenizer has), from the final hidden states x [B, T, D]: [B, T] and
    [B, T, TOP_LOGPROBS] twice (ids, logprobs). Normalised over the whole padded vocabulary, as the model's
    logits (and transformers, and so lm-eval's `hf` backend) normalise them.

    The scored positions of all rows are gathered and run through the LM head SCORE_CHUNK at a time: the
    logits never exist as one [B, T, vocab] array, and neither a prefill that scores nothing nor the
    padding of the rows and of the prompt bucket runs the head. (The positions' list holds one chunk more
    than the positions: a chunk that always spans the whole list would be hoisted out of the loop and run
    unconditionally.)"""
    B, T = tokens.shape
    n, c = B * T, SCORE_CHUNK
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1).reshape(n)
    wanted = (jnp.arange(T) < scored[:, None]).reshape(n)
    where = jnp.nonzero(wanted, size=(-(-n // c) + 1) * c, fill_value=n)[0]  # n: no position (dropped)
    hidden = x.reshape(n, x.shape[-1])

    def chunk(i: jax.Array, out: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        at = jax.lax.dynamic_slice_in_dim(where, i * c, c)
        h, t = jnp.take(hidden, at, axis=0, mode="clip"), jnp.take(targets, at, mode="clip")
        logp = jax.nn.log_softmax(model.unembed(params, h[None], cfg)[0], axis=-1)  # over the padded vocabulary,
        top_lps, top_ids = jax.lax.top_k(used_vocabulary(logp, cfg.n_vocab_used), TOP_LOGPROBS)  # as `forward`
        new = (jnp.take_along_axis(logp, t[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lps)
        return tuple(o.at[at].set(v, mode="drop") for o, v in zip(out, new, strict=True))

    out = (jnp.zeros(n, jnp.float32), jnp.full((n, TOP_LOGPROBS), -1, jnp.int32),
           jnp.zeros((n, TOP_LOGPROBS), jnp.float32))  # fmt: skip
    lp, ids, lps = jax.lax.fori_loop(0, -(-wanted.sum() // c), chunk, out)
    return lp.reshape(B, T), ids.reshape(B, T, TOP_LOGPROBS), lps.reshape(B, T, TOP_LOGPROBS)


@partial(jax.jit, donate_argnums=0)
def _write_slot(slots: model.Params, slot: jax.Array, weights: model.Params) -> model.Params:
    """The adapter slots with slot `slot` replaced by `weights` (same structure, without the slot axis)."""
    return jax.tree.map(lambda s, w: s.at[:, slot].set(w.astype(s.dtype)), slots, weights)


@partial(jax.jit, static_argnames=STATIC, donate_argnames="state")
def _decode(
    weights: Weights,
    state: DeviceState,
    batch: Decode,
    *,
    cfg: ModelConfig,
    policy: model.Policy,
    draft: tuple[ModelConfig, model.Policy] | None = None,
) -> Out:
    """Up to `chunk` (<= MAX_CHUNK) decode steps of the rows in `slots` (padding: out of range), in one
    `while_loop` that stops early once every row is done. (An engine with a draft model speculates instead.)
    Every step chooses among the tokens `allowed` [B, words] allows: a batch with output constraints runs one
    step, for its next masks depend on the token chosen."""
    params, table, allowed = weights.params, batch.table, batch.allowed
    active = _active(state.rows, batch.slots)
    B = batch.slots.shape[0]
    bufs = (
        jnp.full((B, MAX_CHUNK), -1, jnp.int32),
        jnp.zeros((B, MAX_CHUNK), jnp.float32),
        jnp.zeros((B, MAX_CHUNK, TOP_LOGPROBS), jnp.int32),
        jnp.zeros((B, MAX_CHUNK, TOP_LOGPROBS), jnp.float32),
        jnp.zeros((B, MAX_CHUNK), bool),
    )

    def cond(carry: tuple) -> jax.Array:
        i, active, _, _ = carry
        return (i < batch.chunk) & ~jnp.all(active.done)

    def body(carry: tuple) -> tuple:
        i, active, cache, bufs = carry
        logits, cache = model.decode(params, active.token[:, None], cache, table, active.length, cfg, policy,
                                     adapter_rows=active.adapter)  # fmt: skip
        active, out = _decoded(logits[:, 0], active, cfg, allowed)
        bufs = tuple(b.at[:, i].set(v) for b, v in zip(bufs, out, strict=True))
        return i + 1, active, cache, bufs

    _, active, cache, bufs = jax.lax.while_loop(cond, body, (jnp.int32(0), active, state.cache, bufs))
    token, logprob, top_ids, top_logprobs, emitted = bufs
    step = Step(token, logprob, top_ids, top_logprobs, emitted=emitted, done=active.done)
    return state._replace(cache=cache, rows=_scatter(state.rows, batch.slots, active)), step


def _decoded(logits: jax.Array, active: Rows, cfg: ModelConfig, allowed: jax.Array) -> tuple[Rows, tuple]:
    """The rows after one decode step whose logits [B, V] choose each running row's next token (its input token
    now in the cache), and what each produced: token, logprob, top ids, top logprobs, and whether it ran."""
    out = _choose(logits, active, cfg, allowed=allowed)
    running = ~active.done
    return _advance(active, out[0])._replace(length=active.length + running), (*out, running)


@partial(jax.jit, static_argnames=STATIC, donate_argnames="state")
def _mixed(
    weights: Weights,
    state: DeviceState,
    batch: Mixed,
    *,
    cfg: ModelConfig,
    policy: model.Policy,
    draft: tuple[ModelConfig, model.Policy] | None = None,
) -> tuple[DeviceState, tuple[Step, Step]]:
    """A prefill call and one decode step of other rows (`Mixed`) in one pass over the weights
    (`model.decode_spans`): what `_prefill` and a one-token `_decode` do apart, the weights read once. (An
    engine with a draft model or speculation runs none: `draft` is always None here.)"""
    p, d = batch.prefill, batch.decode
    active = _active(state.rows, d.slots)
    rows = model.Span(active.token[:, None], d.table, active.length, adapter_rows=active.adapter)
    (x, y), cache = model.decode_spans(weights.params, (_prompt(p), rows), state.cache, cfg, policy)
    new, prefilled = _prefilled(weights.params, x, p, cfg)
    active, out = _decoded(model.unembed(weights.params, y, cfg)[:, 0], active, cfg, d.allowed)
    token, logprob, top_ids, top_logprobs, emitted = (o[:, None] for o in out)
    decoded = Step(token, logprob, top_ids, top_logprobs, emitted=emitted, done=active.done)
    slots = _scatter(_scatter(state.rows, p.slots, new), d.slots, active)
    return state._replace(cache=cache, rows=slots), (prefilled, decoded)


@partial(jax.jit, static_argnames=STATIC, donate_argnames="state")
def _speculate(
    weights: Weights,
    state: DeviceState,
    batch: Speculate,
    *,
    cfg: ModelConfig,
    policy: model.Policy,
    draft: tuple[ModelConfig, model.Policy] | None = None,
) -> Out:
    """One speculative step of the rows in `slots`: their last token and k proposed tokens run in one
    forward pass; position j's logits then choose the row's next token, keeping proposal j when the
    target agrees (`choose`), and the row goes on to position j + 1 only while it keeps them. Each row
    emits 1 to k + 1 tokens.

    `proposals` [B, k] are prompt lookup's (-1 past a row's own); with a draft model they are -1 and
    only their shape counts: the draft proposes k tokens per row itself, from its distribution q."""
    table, proposals, draft_cache = batch.table, batch.proposals, state.draft_cache
    active = _active(state.rows, batch.slots)
    B, k = proposals.shape
    q = None
    if draft is not None:
        proposals, q, draft_cache = _propose(weights.draft, draft_cache, active, table, k, draft, cfg.vocab_size)
        q = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # nothing is proposed after the last
    tokens = jnp.concatenate([active.token[:, None], jnp.maximum(proposals, 0)], axis=1)
    mask = jnp.concatenate([jnp.ones((B, 1), bool), proposals >= 0], axis=1)
    logits, cache = model.decode(weights.params, tokens, state.cache, table, active.length, cfg, policy, mask=mask,
                                 adapter_rows=active.adapter)  # fmt: skip
    offered = jnp.concatenate([proposals, jnp.full((B, 1), -1, jnp.int32)], axis=1)

    def position(carry: tuple[Rows, jax.Array], j: jax.Array) -> tuple[tuple[Rows, jax.Array], tuple]:
        active, going = carry  # going: every proposal so far was kept
        out = _choose(logits[:, j], active, cfg, jnp.where(going, offered[:, j], -1), None if q is None else q[:, j])
        running = going & ~active.done
        advanced = _advance(active._replace(done=~running), out[0])
        active = advanced._replace(done=jnp.where(running, advanced.done, active.done))
        active = active._replace(length=active.length + running)  # the token at position j is now in the cache
        return (active, running & (out[0] == offered[:, j])), (*out, running)

    (active, _), outs = jax.lax.scan(position, (active, jnp.ones(B, bool)), jnp.arange(k + 1))
    token, logprob, top_ids, top_logprobs, emitted = (jnp.moveaxis(o, 0, 1) for o in outs)  # [B, k + 1, ...]
    step = Step(token, logprob, top_ids, top_logprobs, emitted=emitted, done=active.done, proposed=offered)
    return DeviceState(cache, _scatter(state.rows, batch.slots, active), draft_cache), step


def _propose(
    params: model.Params,
    cache: kv_cache.KVCache,
    active: Rows,
    table: jax.Array,
    k: int,
    draft: tuple[ModelConfig, model.Policy],
    vocab_size: int,
) -> tuple[jax.Array, jax.Array, kv_cache.KVCache]:
    """k tokens per row from the draft model, one step at a time after each row's last token: proposals
    [B, k], the draft's filtered distributions q [B, k, vocab_size] they were drawn from (a greedy row
    proposes the draft's argmax), and the draft's pool holding every proposal's keys and values, so the
    draft's next step can start from any of them."""
    cfg, policy = draft
    s = active.settings

    def step(token: jax.Array, i: jax.Array, cache: kv_cache.KVCache) -> tuple[jax.Array, kv_cache.KVCache]:
        logits, cache = model.decode(params, token[:, None], cache, table, active.length + i, cfg, policy)
        return logits[:, 0], cache

    def propose(carry: tuple[jax.Array, kv_cache.KVCache], i: jax.Array) -> tuple[tuple, tuple[jax.Array, jax.Array]]:
        token, cache = carry
        logits, cache = step(token, i, cache)
        logits = used_vocabulary(logits, cfg.n_vocab_used)  # then padded or cut to the target's vocabulary
        logits = jnp.pad(logits, ((0, 0), (0, max(0, vocab_size - logits.shape[-1]))), constant_values=-jnp.inf)
        x = penalize(logits[:, :vocab_size], active.seen, active.counts, active.count + i, s)
        q = distribution(x, s)
        # apart from the keys `choose` uses at the same count
        keys = jax.vmap(lambda key: jax.random.fold_in(key, 3))(row_keys(s, active.count + i))
        greedy = argmax(x)
        sampled = jax.lax.cond(jnp.any(s.temperature > 0), lambda: draw(q, keys), lambda: greedy)
        token = jnp.where(s.temperature > 0, sampled, greedy)
        return (token, cache), (token, q)

    (last, cache), (proposals, q) = jax.lax.scan(propose, (active.token, cache), jnp.arange(k))
    _, cache = step(last, jnp.int32(k), cache)  # the last proposal's keys and values (its logits are unused)
    return proposals.T, jnp.moveaxis(q, 0, 1), cache


def _batch_sharding(mesh: Mesh, ndim: int) -> jax.sharding.NamedSharding:
    """Rows split over the mesh's batch axes, the other dimensions whole."""
    return named_sharding(mesh, ("batch",) + (None,) * (ndim - 1), SERVING)


def _batch_spec(mesh: Mesh, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=_batch_sharding(mesh, len(shape)))


def abstract_state(
    cfg: ModelConfig, policy: model.Policy, mesh: Mesh, pages: int, page_size: int, max_batch: int
) -> tuple[kv_cache.KVCache, Rows]:
    """Shapes and shardings of the engine's KV pool and slots, without allocating them (for the planner; its
    targets without devices, a GPU's, give an AbstractMesh)."""
    with using(mesh):
        cache = jax.eval_shape(partial(kv_cache.init_cache, cfg, pages, page_size, policy.kv_dtype))
    axes = (kv_cache.CACHE_AXES,) * 2 + (kv_cache.SCALE_AXES,) * 2  # keys, values, and an int8 pool's scales
    cache = kv_cache.KVCache(*(None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                          sharding=named_sharding(mesh, a, SERVING))
                               for x, a in zip(cache, axes, strict=True)))  # fmt: skip
    B, spec = max_batch, partial(_batch_spec, mesh)
    settings = jax.tree.map(lambda x: spec((B, *x.shape[1:]), x.dtype), settings_for([], 1))  # no B-row host arrays
    int32 = spec((B,), np.int32)
    vocab = partial(spec, (B, cfg.vocab_size))
    return cache, Rows(int32, vocab(bool), int32, spec((B,), bool), int32, settings, vocab(np.int32), int32)


def abstract_adapter_slots(
    cfg: ModelConfig, policy: model.Policy, mesh: Mesh, n: int, rank: int, rules: Rules = SERVING
) -> model.Params:
    """Shapes and shardings of `n` adapter slots of `rank` (`lora.slot_table`), laid out by `rules` like their
    projections: As and Bs in the compute dtype, the scales [layers, slots] in float32."""
    table = lora.slot_table(model.projections(cfg), n, rank)
    dt = dtype_of(policy.compute_dtype)
    abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dt if len(p.shape) > 2 else np.float32), table,
                            is_leaf=is_param)  # fmt: skip
    return with_shardings(abstract, plan(abstract, axes_of(table), mesh, rules))


def weight_axes(params: model.Params, cfg: ModelConfig) -> model.Params:
    """The logical axis names of the weights an engine is given: the base's (its projections quantized as
    they are stored) and an unmerged adapter's."""
    q = model.projection(params, "q")  # int8 codes keep the order they were stored in
    axes = model.logical_axes(cfg, quantize=quant.kind_of(q), heads_first=getattr(q, "heads_first", None))
    if "lora" in params:
        axes["lora"] = lora.placed_axes(model.projections(cfg), params["lora"])
    return axes


def place(params: model.Params, cfg: ModelConfig, mesh: Mesh, rules: Rules = SERVING) -> model.Params:
    """`params` laid out by `rules`, by default the serving set: whole over the batch axes, so that a
    decode step gathers no weights. Arrays that lie so already are not copied."""
    return jax.device_put(params, plan(params, weight_axes(params, cfg), mesh, rules))


def prefill_args(cfg: ModelConfig, mesh: Mesh, rows: int, length: int, table_width: int) -> Prefill:
    """The shapes of a `Prefill` of `rows` prompts of (bucketed) `length` new tokens, as `_prefill` takes it."""
    settings = jax.tree.map(lambda x: _batch_spec(mesh, (rows, *x.shape[1:]), x.dtype), settings_for([], 1))
    spec = partial(_batch_spec, mesh)
    return Prefill(
        slots=spec((rows,), np.int32),
        tokens=spec((rows, length), np.int32),
        mask=spec((rows, length), bool),
        table=spec((rows, table_width), np.int32),
        start=spec((rows,), np.int32),
        seen=spec((rows, cfg.vocab_size), bool),
        settings=settings,
        refed=spec((rows,), np.int32),
        scored=spec((rows,), np.int32),
        adapter=spec((rows,), np.int32),
        allowed=spec((rows, bitmask_words(cfg.vocab_size)), np.int32),
    )


def speculate_args(mesh: Mesh, rows: int, table_width: int, k: int) -> Speculate:
    """The shapes of a `Speculate`: slots, page tables and k proposals per row."""
    spec = partial(_batch_spec, mesh)
    return Speculate(slots=spec((rows,), np.int32), table=spec((rows, table_width), np.int32),
                     proposals=spec((rows, k), np.int32))  # fmt: skip


def decode_args(cfg: ModelConfig, mesh: Mesh, rows: int, table_width: int) -> Decode:
    """The shapes of a `Decode` of `rows` rows of up to `table_width` pages (its chunk a traced scalar)."""
    spec = partial(_batch_spec, mesh)
    allowed = spec((rows, bitmask_words(cfg.vocab_size)), np.int32)
    return Decode(slots=spec((rows,), np.int32), table=spec((rows, table_width), np.int32), chunk=np.int32(1),
                  allowed=allowed)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# The runner


class Runner:
    """The device state of one engine: the weights, a KV pool of `n_pages` pages (the draft's beside it) and
    `max_batch` slots (the compiled batch: the config's `max_batch`, `max_rows` here, rounded up to a bucket), and
    the programs that update them in place, sized by the engine's `EngineConfig`.

    The config's `kv_tokens` defaults to what fits in `KV_MEMORY_FRACTION` of the device memory free beside the
    weights (loaded already) and the slots, at most `max_rows` full rows. A pool and slots larger than the free
    memory are refused before they are allocated. The weights (the draft's too) and the adapter slots are
    laid out by `rules` (`sharding.SERVING` unless a comparison asks for another set)."""

    def __init__(
        self,
        params: model.Params,
        cfg: ModelConfig,
        policy: model.Policy,
        mesh: Mesh,
        config: EngineConfig,
        *,
        draft: Draft | None,
        adapter_slots: int = 0,
        adapter_rank: int = 0,
        rules: Rules = SERVING,
    ):
        self.cfg, self.policy, self.mesh = cfg, policy, mesh
        self.speculate = config.speculated(draft is not None)
        self.rules = rules
        self.draft = None if draft is None else draft._replace(params=place(draft.params, draft.cfg, mesh, rules))
        params = place(params, cfg, mesh, rules)
        self.params = params if not adapter_slots else {**params, "adapters": self._slots(adapter_slots, adapter_rank)}
        page_size = config.tokens_per_page(mesh.devices.flat[0].platform)
        self.shapes = Shapes.of(config.max_batch, config.context(cfg.max_seq_len), page_size, batch_ways(mesh))
        self.max_batch, self.page_size = self.shapes.max_batch, page_size  # the slots: max_rows in a bucket
        self.max_rows = config.max_batch
        platform = mesh.devices.flat[0].platform
        self.mixing = config.mixes(platform, self._paged_decode(), bool(self.speculate), batch_ways(mesh))  # run_mixed
        free, slots = free_memory(self._local_device()), self._slot_bytes()
        chosen = config.kv_tokens is not None
        kv_tokens = config.kv_tokens if chosen else self._default_kv_tokens(None if free is None else free - sum(slots))
        self.kv_tokens = max(kv_tokens, page_size)
        self.n_pages = pages_for(self.kv_tokens, page_size) + 1  # page 0 is padding's
        self._check_memory(self.n_pages * page_size * self.kv_bytes_per_token(), slots, free, chosen)
        self.compiled_shapes, self.compile_seconds, self.cached_shapes = 0, 0.0, 0
        self.compiles_since_warm_up = 0  # XLA compilations in this process since `warm_up` (0 when serving as designed)
        self.reset()

    def set_weights(self, params: model.Params) -> None:
        """New weights of the same shapes and dtypes (a trainer's policy after an update), laid out by the runner's
        rules (not copied where they lie so already); the adapter slots stay. Every compiled program serves them."""
        old = {k: v for k, v in self.params.items() if k != "adapters"}
        shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
        if jax.tree.structure(params) != jax.tree.structure(old) or shapes(params) != shapes(old):
            raise InputError("new weights must have the shapes and dtypes of the engine's own")
        slots = {"adapters": self.params["adapters"]} if "adapters" in self.params else {}
        self.params = {**place(params, self.cfg, self.mesh, self.rules), **slots}

    # adapter slots --------------------------------------------------------------------------------

    def _slots(self, n: int, rank: int) -> model.Params:
        """`n` adapter slots of `rank`, zeros (see `abstract_adapter_slots`)."""
        abstract = abstract_adapter_slots(self.cfg, self.policy, self.mesh, n, rank, self.rules)
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), abstract)

    def write_adapter(self, slot: int, weights: Any) -> None:
        """Put an adapter (host arrays from `lora.fill_slot`) into adapter slot `slot`, in place: one
        compiled program serves every slot and adapter."""
        slots = self.params["adapters"]
        one = jax.tree.map(lambda x: x.sharding.update(spec=(x.sharding.spec[:1] + x.sharding.spec[2:])), slots)
        weights = from_host(jax.tree.map(lambda w, x: np.asarray(w, x.dtype), weights, slots), one)
        with jax.set_mesh(self.mesh):
            self.params = {**self.params, "adapters": _write_slot(slots, np.int32(slot), weights)}

    # sizes ----------------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes on each device (the draft model's included), their
        scales too in an int8 pool."""

        def per_token(cfg: ModelConfig, policy: model.Policy) -> int:
            pool, _ = abstract_state(cfg, policy, self.mesh, pages=1, page_size=1, max_batch=1)
            return sum(shard_bytes(x) for x in jax.tree.leaves(pool))

        draft = 0 if self.draft is None else per_token(self.draft.cfg, self.draft.policy)
        return per_token(self.cfg, self.policy) + draft

    def _paged_decode(self) -> bool:
        """Whether every layer of a decode step reads the pool in place by a paged kernel (`attention.resolve`)."""
        with jax.set_mesh(self.mesh):
            kernels = model.attention_kernels(self.cfg, self.policy, (self.max_batch, 1), self.shapes.max_len,
                                              self.cfg.position == "t5", True, self.policy.kv_dtype)  # fmt: skip
        return all(kernel.paged for kernel in kernels.values())

    def _local_device(self) -> jax.Device:
        return next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())

    def _slot_bytes(self) -> tuple[int, int]:
        """Bytes per device that `max_batch` alone sets: the slots' state (a [rows, vocab] mask and counts among it) and
        one step's float32 logits, [rows, positions, vocab]: the least of a step's working memory (XLA's
        is several times that)."""
        _, rows = abstract_state(self.cfg, self.policy, self.mesh, 1, self.page_size, self.max_batch)
        shape = (self.max_batch, self.speculate + 1, self.cfg.vocab_size)
        vocab = named_sharding(self.mesh, ("batch", None, "vocab"), SERVING)
        logits = jax.ShapeDtypeStruct(shape, np.float32, sharding=vocab)
        return shard_bytes(rows), shard_bytes(logits)

    def _default_kv_tokens(self, spare: int | None) -> int:
        """What `KV_MEMORY_FRACTION` of the `spare` bytes hold (unknown: no limit), at most the config's `max_batch`
        full rows (the rows that run at once, not the compiled batch that rounds them up), each in whole pages (a
        `max_len` not a multiple of the page size leaves part of a row's last page empty)."""
        rows = self.max_rows * pages_for(self.shapes.max_len, self.page_size) * self.page_size
        if spare is None:
            return rows
        return max(self.page_size, min(int(KV_MEMORY_FRACTION * spare) // self.kv_bytes_per_token(), rows))

    def _check_memory(self, pool: int, slots: tuple[int, int], free: int | None, chosen: bool) -> None:
        """Refuse a pool and slots the device cannot hold before allocating them: past its memory an
        accelerator fails the allocation, and a CPU host kills the process. `chosen`: kv_tokens was given."""
        if free is None:
            return
        state, logits = slots
        needed = pool + state + logits
        if needed > free:
            compiled = f", compiled as {self.max_batch}" if self.max_batch != self.max_rows else ""
            rows = f"{self.max_rows} rows{compiled} (state {gib(state)}, one step's logits {gib(logits)})"
            if chosen:
                what, lower = f"{self.kv_tokens:,} KV tokens ({gib(pool)}) and {rows}", "kv_tokens or max_batch"
            else:  # the default pool is a share of what the rows leave: the rows alone do not fit
                what, lower = rows, "max_batch"
            raise OutOfMemory(f"{what} need {gib(needed)} per device, but {gib(free)} are free: lower {lower}",
                              needed, free)  # fmt: skip

    # device state ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """A fresh pool and empty slots (at start, and after a failed device call, which may have
        consumed the donated buffers)."""

        def pool(cfg: ModelConfig, policy: model.Policy) -> kv_cache.KVCache:
            with jax.set_mesh(self.mesh):
                return jax.jit(partial(kv_cache.init_cache, cfg, self.n_pages, self.page_size, policy.kv_dtype))()

        self.cache = pool(self.cfg, self.policy)
        self.draft_cache = None if self.draft is None else pool(self.draft.cfg, self.draft.policy)
        B, V = self.max_batch, self.cfg.vocab_size
        zeros = lambda: np.zeros(B, np.int32)  # one array a field: the steps donate each slot field's buffer
        settings = settings_for([], B)._replace(max_new=zeros())
        host = Rows(zeros(), np.zeros((B, V), bool), zeros(), np.ones(B, bool), zeros(), settings,
                    np.zeros((B, V), np.int32), zeros())  # fmt: skip
        self.rows = self._from_host(host)

    def zero_pages(self, pages: Sequence[int]) -> None:
        """Zero `pages` of the pool (and of the draft's) in place: a failed row's, which may hold NaN. One
        program serves any pages: their ids are padded with an out-of-range one, which ends them."""
        ids = np.full(self.n_pages, self.n_pages, np.int32)
        ids[: len(pages)] = pages
        with jax.set_mesh(self.mesh):
            self.cache = _zero_pages(self.cache, ids)
            if self.draft_cache is not None:
                self.draft_cache = _zero_pages(self.draft_cache, ids)

    def _from_host(self, tree: Any) -> Any:
        """Host arrays split over the batch axes (the same on every process when there are several), in one
        transfer; a scalar (a decode's chunk) stays on the host, where the compiled steps take it."""
        leaves, structure = jax.tree.flatten(tree)
        put = [i for i, x in enumerate(leaves) if np.ndim(x)]
        arrays = [np.asarray(leaves[i]) for i in put]
        for i, x in zip(put, from_host(arrays, [_batch_sharding(self.mesh, x.ndim) for x in arrays]), strict=True):
            leaves[i] = x
        return jax.tree.unflatten(structure, leaves)

    def _inputs(self) -> tuple[Weights, DeviceState, dict[str, Any]]:
        """What every compiled step takes besides its batch: the weights, the device state, the static configs."""
        drafting = self.draft is not None
        weights = Weights(self.params, self.draft.params if drafting else None)
        options = dict(cfg=self.cfg, policy=self.policy, draft=self.draft[1:] if drafting else None)
        return weights, DeviceState(self.cache, self.rows, self.draft_cache), options

    def _call(self, fn: Any, batch: Prefill | Decode | Speculate | Mixed) -> Any:
        """Run a compiled step on the pools and the slots, which it updates in place; what it produced (a `Step`, or
        a mixed step's two)."""
        weights, state, options = self._inputs()
        with jax.set_mesh(self.mesh):
            (self.cache, self.rows, self.draft_cache), out = fn(weights, state, batch, **options)
        return out

    # compiling ------------------------------------------------------------------------------------

    def warm_up(self) -> tuple[int, float]:
        """Compile every prefill, decode (and mixed) shape the engine can use (on as many threads as there are CPU
        cores: XLA compiles outside Python's lock), then run each once on padding rows, which write
        nothing, so the first requests find every program loaded; (shapes, seconds). `cached_shapes`: how many
        of them JAX's persistent compilation cache served (a restart's, where `meshlm` keeps it)."""
        began = time.perf_counter()
        programs = [(_prefill, prefill_args(self.cfg, self.mesh, b, t, w)) for b, t, w in self.shapes.prefill_shapes()]
        if self.mixing:  # each prefill shape that mixes (`_mixable`) with the widest decode step
            widest = decode_args(self.cfg, self.mesh, self.max_batch, self.shapes.max_pages)
            programs += [(_mixed, Mixed(prefill_args(self.cfg, self.mesh, b, t, w), widest))
                         for b, t, w in self.shapes.prefill_shapes() if self._mixable(b, t)]  # fmt: skip
        for b in self.shapes.decode_batches():
            for n in self.shapes.page_buckets():
                if self.speculate:
                    programs.append((_speculate, speculate_args(self.mesh, b, n, self.speculate)))
                if not self.draft:  # prompt lookup decodes plainly when it has nothing to propose
                    programs.append((_decode, decode_args(self.cfg, self.mesh, b, n)))
        weights, state, options = self._inputs()
        with jax.set_mesh(self.mesh):
            lowered = [fn.lower(weights, state, batch, **options) for fn, batch in programs]

        def compile(lowered: Any) -> Footprint:
            with jax.set_mesh(self.mesh):  # the compilation cache is keyed by the thread's mesh context too
                return Footprint.of(lowered.compile())

        free = free_memory(self._local_device())
        _COMPILES.listen()
        hits = _COMPILES.cache_hits  # the process's: this warm-up's own, unless another compiles beside it
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            try:  # the steps of the most rows first: a server they do not fit is refused after one compile
                for step in pool.map(compile, lowered[::-1]):
                    self._check_working_memory(step, free)
            except BaseException:  # a refusal or Ctrl-C: the programs not started yet are dropped
                pool.shutdown(cancel_futures=True)
                raise
        self.cached_shapes = _COMPILES.cache_hits - hits
        for fn, batch in programs:
            jax.block_until_ready(self._call(fn, self._padding(batch)))
        self.zero_pages([])  # compiles it
        if "adapters" in self.params:  # slot 0 (the base's) is zeros: writing zeros there compiles the write
            self.write_adapter(0, jax.tree.map(lambda x: np.zeros(x.shape[:1] + x.shape[2:]), self.params["adapters"]))
        seconds = time.perf_counter() - began
        self.compiled_shapes, self.compile_seconds = len(programs), seconds
        _COMPILES.count_into(self)
        return len(programs), seconds

    def _check_working_memory(self, step: Footprint, free: int | None) -> None:
        """Refuse a compiled step whose working memory (XLA's own figure) exceeds what the weights, the pool
        and the slots leave free, before a run allocates it."""
        working = step.outputs - step.aliased + step.temporaries
        if free is not None and working > free:
            raise OutOfMemory(
                f"a compiled step needs {gib(working)} of working memory per device beside the weights, the KV "
                f"cache and the slots, but {gib(free)} are free: lower max_batch or kv_tokens",
                working,
                free,
            )

    def _padding(self, batch: Prefill | Decode | Speculate | Mixed) -> Prefill | Decode | Speculate | Mixed:
        """A batch of these shapes for padding rows only: slots out of range, everything else zeros (page 0)."""
        if isinstance(batch, Mixed):
            return Mixed(self._padding(batch.prefill), self._padding(batch.decode))
        zeros = lambda x: np.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x
        padded = jax.tree.map(zeros, batch)
        return self._from_host(padded._replace(slots=np.full(batch.slots.shape, self.max_batch, np.int32)))

    # requests -------------------------------------------------------------------------------------

    # running a batch --------------------------------------------------------------------------------

    def run(self, batch: Prefill | Decode | Speculate) -> Step:
        """Run one batch on the pool and the slots; what each of its rows produced."""
        if isinstance(batch, Prefill):
            return self.prefill(batch)
        return self.decode(batch) if isinstance(batch, Decode) else self.verify(batch)

    def prefill(self, batch: Prefill) -> Step:
        return _prefilled_on_host(self._call(_prefill, self._from_host(self._agreed(batch))), batch)

    def decode(self, batch: Decode) -> Step:
        return to_host(self._call(_decode, self._from_host(_scalar_chunk(batch))))

    def mixes(self, batch: Prefill) -> bool:
        """Whether this prefill call can run in one pass with a decode step (`run_mixed`): the engine mixes
        (`EngineConfig.mixes`), and the call's shape does (`_mixable`)."""
        return self.mixing and self._mixable(*batch.tokens.shape)

    def _mixable(self, rows: int, length: int) -> bool:
        """Whether a prefill of `rows` x `length` tokens has a mixed program: one row (a prompt's chunk, or a prompt
        alone), of at most `kv_dma.MAX_PAGE_COPIES` pages, which it writes by DMA as the decode rows' kernel reads
        the pool (a scatter would leave the pool in a layout that kernel copies it out of in every layer)."""
        return rows == self.shapes.prefill_rows(1) and length <= MAX_PAGE_COPIES * self.page_size

    def run_mixed(self, prefill: Prefill, decode: Decode) -> tuple[Step, Step]:
        """A prefill call (`mixes`) and one decode step (chunk 1) of other rows in one pass over the weights: what
        each call's rows produced. The decode is padded to every slot and a whole row's pages, the one decode shape
        the mixed programs are compiled for (the paged kernel reads no page past a row's length, and a padding row
        holds none)."""
        if decode.chunk != 1:
            raise ValueError(f"a mixed step decodes one token, not {decode.chunk}")
        B, n, k = self.max_batch, self.shapes.max_pages, len(decode.slots)
        table = np.full((B, n), PAD_PAGE, np.int32)
        table[:k, : decode.table.shape[1]] = decode.table
        slots = np.full(B, self.max_batch, np.int32)
        slots[:k] = decode.slots
        allowed = np.zeros((B, decode.allowed.shape[1]), np.int32)
        allowed[:k] = decode.allowed
        widest = _scalar_chunk(Decode(slots, table, 1, allowed))
        prefilled, decoded = self._call(_mixed, self._from_host(Mixed(self._agreed(prefill), widest)))
        return _prefilled_on_host(prefilled, prefill), to_host(decoded)

    def _agreed(self, batch: Prefill) -> Prefill:
        """A prefill whose rows without a seed, which draw one on each process, take process 0's."""
        if jax.process_count() == 1:
            return batch
        seed = multihost_utils.broadcast_one_to_all(batch.settings.seed)
        return batch._replace(settings=batch.settings._replace(seed=seed))

    def verify(self, batch: Speculate) -> Step:
        return to_host(self._call(_speculate, self._from_host(batch)))


_zero_pages = jax.jit(kv_cache.KVCache.zero_pages, donate_argnums=0)


def _scalar_chunk(batch: Decode) -> Decode:
    """The chunk as the compiled steps take it: a host scalar, not a static number (one program serves every
    chunk) nor a device array."""
    return batch._replace(chunk=np.int32(batch.chunk))


def _prefilled_on_host(out: Step, batch: Prefill) -> Step:
    """A prefill's outputs on the host: its prompt logprobs only where it scored a row, worth the copy then."""
    if not batch.scored.any():
        out = out._replace(prompt_logprob=None, prompt_top_ids=None, prompt_top_logprobs=None)
    return to_host(out)


class _CompileCounter:
    """Counts every XLA compilation in this process into each runner warmed up, from its latest `warm_up` on
    and while it lives, and the compilations JAX's persistent compilation cache served (`cache_hits`, process-wide:
    a warm-up reads it before and after its compiles). JAX keeps a monitoring listener for the life of the process
    (and changes its list of them unlocked), so each listener is registered once, on the first warm-up; a runner is
    held weakly and leaves when it is collected."""

    def __init__(self) -> None:
        self._runners: weakref.WeakSet[Runner] = weakref.WeakSet()
        self._lock = threading.Lock()  # compilations report from the threads that compile
        self._listening = False
        self.cache_hits = 0

    def listen(self) -> None:
        with self._lock:
            if not self._listening:
                jax.monitoring.register_event_duration_secs_listener(self._compiled)
                jax.monitoring.register_event_listener(self._event)
                self._listening = True

    def count_into(self, runner: Runner) -> None:
        self.listen()
        with self._lock:
            runner.compiles_since_warm_up = 0
            self._runners.add(runner)

    def _compiled(self, event: str, seconds: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            with self._lock:
                for runner in self._runners:
                    runner.compiles_since_warm_up += 1

    def _event(self, event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            with self._lock:
                self.cache_hits += 1


_COMPILES = _CompileCounter()


def lower(
    program: str,
    cfg: ModelConfig,
    policy: model.Policy,
    mesh: Mesh,
    *,
    rows: int,
    pages: int,
    width: int,
    length: int = 0,
    params: Any = None,
    page_size: int,
) -> Any:
    """The "prefill" (of `rows` prompts of `length` tokens), "decode" or "mixed" (a one-row prefill of `length`
    tokens and a decode step of `rows` rows, on a mesh without batch axes) program, lowered for abstract weights
    (`params`, ShapeDtypeStructs with shardings), a pool of `pages` pages of `page_size` tokens and `rows` slots of
    up to `width` pages: what the planner compiles for a target it does not have."""
    state = DeviceState(*abstract_state(cfg, policy, mesh, pages, page_size, rows))
    if program == "prefill":
        fn, batch = _prefill, prefill_args(cfg, mesh, rows, length, width)
    elif program == "decode":
        fn, batch = _decode, decode_args(cfg, mesh, rows, width)
    elif program == "mixed":
        fn, batch = _mixed, Mixed(prefill_args(cfg, mesh, 1, length, width), decode_args(cfg, mesh, rows, width))
    else:
        raise ValueError(f"program must be 'prefill', 'decode' or 'mixed', got {program!r}")
    with jax.set_mesh(mesh):
        return fn.lower(Weights(params), state, batch, cfg=cfg, policy=policy)
