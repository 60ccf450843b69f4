"""The generation engine behind `lm.generate`, `meshlm sample`, `meshlm serve` and lm-eval's `generate_until`.

Continuous batching over a paged KV cache:
- requests wait in a queue and join the running batch between decode chunks, when a slot and the
  KV pages for their whole budget (prompt + max_new_tokens) are free; they leave as soon as they
  finish, are cancelled or fail, and give their pages back at once;
- a row holds pages only for the tokens it has (`meshlm.pages`), so memory follows live tokens;
  rows whose prompts share full pages of a prefix share those pages (prefix caching);
- a decode chunk runs only the running rows (bucketed to a power of two) over as many pages as the
  longest of them holds (bucketed too), so its cost follows the live rows and their lengths;
- every shape the engine can use is known in advance: `warm_up` compiles all of them, so nothing
  compiles while requests are served.

The engine is synchronous: `step` admits what fits and runs one prefill and one decode chunk. `run`
drives it for a fixed set of prompts; the HTTP server calls `step` from its own thread.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from meshlm import model
from meshlm.config import InputError, ModelConfig, dtype_of
from meshlm.footprint import Footprint, OutOfMemory, free_memory, gib
from meshlm.generate import (
    TOP_LOGPROBS,
    Completion,
    RowOutput,
    SamplingParams,
    Settings,
    Step,
    argmax,
    check_chunk,
    choose,
    distribution,
    draw,
    repetition_penalty,
    row_keys,
    settings_for,
    used_vocabulary,
)
from meshlm.pages import PAD_PAGE, PagePool, pages_for
from meshlm.sharding import batch_ways, from_host, named_sharding, shard_bytes, to_host
from meshlm.tokenizer import Tokenizer

PAGE_SIZE = 16  # tokens per KV page
SPECULATE_TOKENS = 4  # tokens proposed per row and step with prompt-lookup speculation
MAX_CHUNK = 64  # decode steps per device call at most; one compiled loop serves every chunk size up to it
MIN_PROMPT_BUCKET = 16
MIN_DECODE_TOKENS = 128  # a decode reads at least this many cache slots per row (fewer shapes to compile)
PREFILL_TOKENS = 2048  # rows x prompt bucket of one prefill call at most (a longer prompt goes alone)
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


def _advance(rows: Rows, token: jax.Array) -> Rows:
    """Record each running row's new token; finished rows keep their state."""
    running = ~rows.done
    count = rows.count + running
    stopped = jnp.any(token[:, None] == rows.settings.stop_ids, axis=-1)
    done = rows.done | stopped | (count >= rows.settings.max_new)
    seen = rows.seen.at[jnp.arange(token.shape[0]), token].max(running)
    return rows._replace(token=jnp.where(running, token, rows.token), seen=seen, count=count, done=done)


def _choose(
    logits: jax.Array,
    rows: Rows,
    cfg: ModelConfig,
    proposal: jax.Array | None = None,
    draft_probs: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    return choose(logits, rows.seen, rows.count, rows.settings, cfg.n_vocab_used, proposal, draft_probs)


def _active(rows: Rows, slots: jax.Array) -> Rows:
    """The rows in `slots`; padding (slots out of range) comes back done."""
    padding = slots >= rows.token.shape[0]
    active = jax.tree.map(lambda x: x.at[slots].get(mode="clip"), rows)
    return active._replace(done=active.done | padding)


def _scatter(rows: Rows, slots: jax.Array, new: Rows) -> Rows:
    """`new` rows into `rows` at `slots`; slots out of range (padding) are dropped."""
    return jax.tree.map(lambda dst, src: dst.at[slots].set(src, mode="drop"), rows, new)


# Every compiled step takes the target's weights, its KV pool and the slots, then its own arguments; with
# a draft model also the draft's weights and pool (`draft` names its static config and policy). It
# returns the updated pool, the draft's pool (None without a draft), the slots and what each row produced.
STATIC = ("cfg", "policy", "draft")
DONATED = ("cache", "rows", "draft_cache")
Out = tuple[model.KVCache, model.KVCache | None, Rows, tuple[jax.Array, ...]]


@partial(jax.jit, static_argnames=STATIC, donate_argnames=DONATED)
def _prefill(
    params: model.Params,
    cache: model.KVCache,
    rows: Rows,
    slots: jax.Array,
    tokens: jax.Array,
    mask: jax.Array,
    table: jax.Array,
    start: jax.Array,
    seen: jax.Array,
    settings: Settings,
    draft_params: model.Params | None = None,
    draft_cache: model.KVCache | None = None,
    *,
    cfg: ModelConfig,
    policy: model.Policy,
    draft: tuple[ModelConfig, model.Policy] | None = None,
) -> Out:
    """Write new rows' prompts [B, T] (right-padded, after the `start` tokens a cached prefix gave
    them) into the cache (and the draft's), choose each row's first token and put the rows into `slots`."""
    n_new = mask.sum(-1, dtype=jnp.int32)
    at = jnp.maximum(n_new - 1, 0)
    logits, cache = model.decode(params, tokens, cache, table, start, cfg, policy, mask=mask, at=at)
    if draft is not None:
        _, draft_cache = model.decode(draft_params, tokens, draft_cache, table, start, *draft, mask=mask, at=at)
    zeros = jnp.zeros_like(start)
    new = Rows(zeros, seen, zeros, settings.max_new <= 0, start + n_new, settings)
    out = _choose(logits[:, 0], new, cfg)
    emitted = ~new.done
    new = _advance(new, out[0])
    return cache, draft_cache, _scatter(rows, slots, new), (*(o[:, None] for o in out), emitted[:, None], new.done)


@partial(jax.jit, static_argnames=STATIC, donate_argnames=DONATED)
def _decode(
    params: model.Params,
    cache: model.KVCache,
    rows: Rows,
    slots: jax.Array,
    table: jax.Array,
    n_steps: jax.Array,
    draft_params: model.Params | None = None,
    draft_cache: model.KVCache | None = None,
    *,
    cfg: ModelConfig,
    policy: model.Policy,
    draft: tuple[ModelConfig, model.Policy] | None = None,
) -> Out:
    """Up to `n_steps` (<= MAX_CHUNK) decode steps of the rows in `slots` (padding: out of range), in one
    `while_loop` that stops early once every row is done. (An engine with a draft model speculates instead.)"""
    active = _active(rows, slots)
    B = slots.shape[0]
    bufs = (
        jnp.full((B, MAX_CHUNK), -1, jnp.int32),
        jnp.zeros((B, MAX_CHUNK), jnp.float32),
        jnp.zeros((B, MAX_CHUNK, TOP_LOGPROBS), jnp.int32),
        jnp.zeros((B, MAX_CHUNK, TOP_LOGPROBS), jnp.float32),
        jnp.zeros((B, MAX_CHUNK), bool),
    )

    def cond(carry: tuple) -> jax.Array:
        i, active, _, _ = carry
        return (i < n_steps) & ~jnp.all(active.done)

    def body(carry: tuple) -> tuple:
        i, active, cache, bufs = carry
        logits, cache = model.decode(params, active.token[:, None], cache, table, active.length, cfg, policy)
        out = _choose(logits[:, 0], active, cfg)
        running = ~active.done
        bufs = tuple(b.at[:, i].set(v) for b, v in zip(bufs, (*out, running), strict=True))
        active = _advance(active, out[0])._replace(length=active.length + running)
        return i + 1, active, cache, bufs

    _, active, cache, bufs = jax.lax.while_loop(cond, body, (jnp.int32(0), active, cache, bufs))
    return cache, draft_cache, _scatter(rows, slots, active), (*bufs, active.done)


@partial(jax.jit, static_argnames=STATIC, donate_argnames=DONATED)
def _speculate(
    params: model.Params,
    cache: model.KVCache,
    rows: Rows,
    slots: jax.Array,
    table: jax.Array,
    proposals: jax.Array,
    draft_params: model.Params | None = None,
    draft_cache: model.KVCache | None = None,
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
    active = _active(rows, slots)
    B, k = proposals.shape
    q = None
    if draft is not None:
        proposals, q, draft_cache = _propose(draft_params, draft_cache, active, table, k, draft, cfg.vocab_size)
        q = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # nothing is proposed after the last
    tokens = jnp.concatenate([active.token[:, None], jnp.maximum(proposals, 0)], axis=1)
    mask = jnp.concatenate([jnp.ones((B, 1), bool), proposals >= 0], axis=1)
    logits, cache = model.decode(params, tokens, cache, table, active.length, cfg, policy, mask=mask)
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
    outs = tuple(jnp.moveaxis(o, 0, 1) for o in outs)  # [k + 1, B, ...] -> [B, k + 1, ...]
    return cache, draft_cache, _scatter(rows, slots, active), (*outs, active.done, offered)


def _propose(
    params: model.Params,
    cache: model.KVCache,
    active: Rows,
    table: jax.Array,
    k: int,
    draft: tuple[ModelConfig, model.Policy],
    vocab_size: int,
) -> tuple[jax.Array, jax.Array, model.KVCache]:
    """k tokens per row from the draft model, one step at a time after each row's last token: proposals
    [B, k], the draft's filtered distributions q [B, k, vocab_size] they were drawn from (a greedy row
    proposes the draft's argmax), and the draft's pool holding every proposal's keys and values, so the
    draft's next step can start from any of them."""
    cfg, policy = draft
    s = active.settings

    def step(token: jax.Array, i: jax.Array, cache: model.KVCache) -> tuple[jax.Array, model.KVCache]:
        logits, cache = model.decode(params, token[:, None], cache, table, active.length + i, cfg, policy)
        return logits[:, 0], cache

    def propose(carry: tuple[jax.Array, model.KVCache], i: jax.Array) -> tuple[tuple, tuple[jax.Array, jax.Array]]:
        token, cache = carry
        logits, cache = step(token, i, cache)
        logits = used_vocabulary(logits, cfg.n_vocab_used)  # then padded or cut to the target's vocabulary
        logits = jnp.pad(logits, ((0, 0), (0, max(0, vocab_size - logits.shape[-1]))), constant_values=-jnp.inf)
        x = repetition_penalty(logits[:, :vocab_size], active.seen, s.penalty)
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
    return named_sharding(mesh, ("batch",) + (None,) * (ndim - 1))


def _batch_spec(mesh: Mesh, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=_batch_sharding(mesh, len(shape)))


def abstract_state(
    cfg: ModelConfig, policy: model.Policy, mesh: Mesh, pages: int, page_size: int, max_batch: int
) -> tuple[model.KVCache, Rows]:
    """Shapes and shardings of the engine's KV pool and slots, without allocating them (for the planner)."""
    with jax.set_mesh(mesh):
        cache = jax.eval_shape(partial(model.init_cache, cfg, pages, page_size, policy.compute_dtype))
    cache = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=named_sharding(mesh, model.CACHE_AXES)), cache
    )
    B, spec = max_batch, partial(_batch_spec, mesh)
    settings = jax.tree.map(lambda x: spec((B, *x.shape[1:]), x.dtype), settings_for([], 1))  # no B-row host arrays
    int32 = spec((B,), np.int32)
    return cache, Rows(int32, spec((B, cfg.vocab_size), bool), int32, spec((B,), bool), int32, settings)


def prefill_args(cfg: ModelConfig, mesh: Mesh, rows: int, length: int, table_width: int) -> tuple[Any, ...]:
    """Shapes of `_prefill`'s per-call arguments for `rows` prompts of (bucketed) `length` new tokens."""
    settings = jax.tree.map(lambda x: _batch_spec(mesh, (rows, *x.shape[1:]), x.dtype), settings_for([], 1))
    spec = partial(_batch_spec, mesh)
    return (
        spec((rows,), np.int32),  # slots
        spec((rows, length), np.int32),  # tokens
        spec((rows, length), bool),  # mask
        spec((rows, table_width), np.int32),  # table
        spec((rows,), np.int32),  # start
        spec((rows, cfg.vocab_size), bool),  # seen
        settings,
    )


def speculate_args(mesh: Mesh, rows: int, table_width: int, k: int) -> tuple[Any, ...]:
    """Shapes of `_speculate`'s per-call arguments: slots, page tables and k proposals per row."""
    spec = partial(_batch_spec, mesh)
    return spec((rows,), np.int32), spec((rows, table_width), np.int32), spec((rows, k), np.int32)


def decode_args(mesh: Mesh, rows: int, table_width: int) -> tuple[Any, ...]:
    """Shapes of `_decode`'s per-call arguments for `rows` rows of up to `table_width` pages."""
    return _batch_spec(mesh, (rows,), np.int32), _batch_spec(mesh, (rows, table_width), np.int32), np.int32(1)


# ---------------------------------------------------------------------------------------------------
# Host side


@dataclass(eq=False)
class Request:
    """One row to generate: its prompt, its output as it arrives, and the engine's bookkeeping.

    `notify` (if given) is called from the engine's thread after every change; `lock` guards `output`
    between that thread and a reader."""

    prompt: list[int]
    output: RowOutput
    notify: Callable[[], None] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    error: str | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None  # perf_counter time of the first token
    slot: int = -1
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens in the cache
    proposed: int = 0  # speculated tokens offered
    accepted: int = 0  # of which kept

    @property
    def finished(self) -> bool:
        return self.output.finished or self.cancelled or self.error is not None

    @property
    def budget(self) -> int:
        """Tokens this row may ever hold in the cache."""
        return len(self.prompt) + self.output.sampling.max_new_tokens


def _check_draft(draft: Draft, cfg: ModelConfig, max_len: int, ngram: int) -> None:
    """A draft model must be able to propose every token the target can emit, at every position."""
    if ngram:
        raise InputError("speculate with a draft model or with prompt lookup (ngram), not both")
    if draft.cfg.n_vocab_used != cfg.n_vocab_used:
        raise InputError(
            f"the draft model's vocabulary ({draft.cfg.n_vocab_used} tokens) is not the target's "
            f"({cfg.n_vocab_used}): a draft must share the target's tokenizer"
        )
    if draft.cfg.max_seq_len < max_len:
        raise InputError(f"the draft model's context ({draft.cfg.max_seq_len}) is shorter than max_len ({max_len})")


def lookup(history: Sequence[int], ngram: int, k: int) -> list[int]:
    """Prompt-lookup speculation: the up to k tokens that followed the latest earlier occurrence of the
    history's last `ngram` tokens (or of a shorter suffix, down to one token); none if nothing matches."""
    if k <= 0:
        return []
    tokens = np.asarray(history)
    for size in range(min(ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-size:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], size)  # starts before the tail's own
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + size
            return tokens[start : start + k].tolist()
    return []


def _count_compiles(stats: weakref.ref) -> None:
    """Count every XLA compilation in this process from now on into `stats` (while it lives)."""

    def listen(event: str, seconds: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and (s := stats()) is not None:
            s.compiles_since_warm_up += 1

    jax.monitoring.register_event_duration_secs_listener(listen)


def _bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


def _powers(lo: int, hi: int, factor: int = 2) -> list[int]:
    """lo, lo * factor, ... below hi, then hi."""
    out = []
    while lo < hi:
        out.append(lo)
        lo *= factor
    return [*out, hi]


@dataclass
class Stats:
    """Counters for /health and /metrics."""

    tokens_generated: int = 0
    prompt_tokens: int = 0
    prefill_calls: int = 0
    decode_calls: int = 0
    compile_seconds: float = 0.0
    compiled_shapes: int = 0
    proposed: int = 0  # speculated tokens offered, all rows
    accepted: int = 0  # of which kept
    compiles_since_warm_up: int = 0  # XLA compilations in this process since `warm_up` (0 when serving as designed)
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (time, tokens generated by then)

    def record(self, tokens: int) -> None:
        self.tokens_generated += tokens
        self.recent.append((time.perf_counter(), self.tokens_generated))

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generation speed over the last `window` seconds of work."""
        now = time.perf_counter()
        points = [(t, n) for t, n in self.recent if now - t <= window]
        if len(points) < 2:
            return 0.0
        (t0, n0), (t1, n1) = points[0], points[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


class Engine:
    """Continuous batching of `max_batch` rows over a KV pool of `kv_tokens` tokens, for one model on one mesh.

    `max_len` bounds a row's prompt plus output (the model's context by default). `kv_tokens` defaults to
    what fits in `KV_MEMORY_FRACTION` of the device memory free beside the weights (loaded already) and the
    slots, at most `max_batch` full rows. A pool and slots larger than the free memory are refused."""

    def __init__(
        self,
        params: model.Params,
        cfg: ModelConfig,
        policy: model.Policy,
        mesh: Mesh,
        *,
        max_batch: int = 8,
        max_len: int | None = None,
        kv_tokens: int | None = None,
        page_size: int = PAGE_SIZE,
        prefix_caching: bool = True,
        ngram: int = 0,
        speculate: int = SPECULATE_TOKENS,
        draft: Draft | None = None,
    ):
        for name, value, least in (("max_batch", max_batch, 1), ("page_size", page_size, 1), ("ngram", ngram, 0),
                                   ("speculate", speculate, 1)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InputError(f"{name} must be an integer >= {least}, got {value!r}")
        if max_len is not None and not 0 < max_len <= cfg.max_seq_len:
            raise InputError(f"max_len must be in [1, {cfg.max_seq_len}] (the model's context), got {max_len}")
        if draft is not None:
            _check_draft(draft, cfg, max_len or cfg.max_seq_len, ngram)
        self.ngram, self.draft = ngram, draft
        self.speculate = speculate if ngram or draft else 0
        self.params, self.cfg, self.policy, self.mesh = params, cfg, policy, mesh
        self.batch_ways = batch_ways(mesh)
        self.max_batch = self._batch_bucket(max_batch)
        self.max_len = max_len or cfg.max_seq_len
        self.page_size = page_size
        self.max_pages = pages_for(self.max_len, page_size)  # of one row
        free, slots = free_memory(self._local_device()), self._slot_bytes()
        chosen = kv_tokens is not None
        kv_tokens = kv_tokens if chosen else self._default_kv_tokens(None if free is None else free - sum(slots))
        if isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int) or kv_tokens < 1:
            raise InputError(f"kv_tokens must be an integer >= 1, got {kv_tokens!r}")
        self.kv_tokens = max(kv_tokens, page_size)
        n_pages = pages_for(self.kv_tokens, page_size) + 1
        self._check_memory(n_pages * page_size * self.kv_bytes_per_token(), slots, free, chosen)
        self.pool = PagePool(n_pages, page_size, prefix_caching)
        self.queue: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * self.max_batch
        self.stats = Stats()
        self._reset_device()

    # sizes ----------------------------------------------------------------------------------------

    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes on each device (the draft model's included)."""
        sharding = named_sharding(self.mesh, model.CACHE_AXES)

        def per_token(cfg: ModelConfig, policy: model.Policy) -> int:
            shape = (cfg.n_head, cfg.n_layer, 1, 1, cfg.d_head)
            return 2 * shard_bytes(jax.ShapeDtypeStruct(shape, dtype_of(policy.compute_dtype), sharding=sharding))

        draft = 0 if self.draft is None else per_token(self.draft.cfg, self.draft.policy)
        return per_token(self.cfg, self.policy) + draft

    def _local_device(self) -> jax.Device:
        return next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())

    def _slot_bytes(self) -> tuple[int, int]:
        """Bytes per device that `max_batch` alone sets: the slots' state (a [rows, vocab] mask among it) and
        one step's float32 logits, [rows, positions, vocab]: the least of a step's working memory (XLA's
        is several times that)."""
        _, rows = abstract_state(self.cfg, self.policy, self.mesh, 1, self.page_size, self.max_batch)
        shape = (self.max_batch, self.speculate + 1, self.cfg.vocab_size)
        logits = jax.ShapeDtypeStruct(shape, np.float32, sharding=named_sharding(self.mesh, ("batch", None, "vocab")))
        return shard_bytes(rows), shard_bytes(logits)

    def _default_kv_tokens(self, spare: int | None) -> int:
        """What `KV_MEMORY_FRACTION` of the `spare` bytes hold (unknown: no limit), at most `max_batch` full rows."""
        rows = self.max_batch * self.max_len
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
            rows = f"{self.max_batch} rows (state {gib(state)}, one step's logits {gib(logits)})"
            if chosen:
                what, lower = f"{self.kv_tokens:,} KV tokens ({gib(pool)}) and {rows}", "kv_tokens or max_batch"
            else:  # the default pool is a share of what the rows leave: the rows alone do not fit
                what, lower = rows, "max_batch"
            raise OutOfMemory(f"{what} need {gib(needed)} per device, but {gib(free)} are free: lower {lower}",
                              needed, free)  # fmt: skip

    def _batch_bucket(self, n: int) -> int:
        """Rows are padded to a power of two that the mesh's batch axes divide."""
        b = _bucket(n)
        return -(-b // self.batch_ways) * self.batch_ways

    def _decode_batches(self) -> list[int]:
        return sorted({self._batch_bucket(n) for n in _powers(1, self.max_batch)})

    def _page_buckets(self) -> list[int]:
        """Table widths of a decode: powers of two from MIN_DECODE_TOKENS' worth of pages."""
        return _powers(min(pages_for(MIN_DECODE_TOKENS, self.page_size), self.max_pages), self.max_pages)

    def _page_bucket(self, n: int) -> int:
        return next(b for b in self._page_buckets() if b >= n)

    def _prompt_buckets(self) -> list[int]:
        """Prompt lengths of a prefill: powers of four from MIN_PROMPT_BUCKET."""
        return _powers(min(MIN_PROMPT_BUCKET, self.max_len), self.max_len, factor=4)

    def _prompt_bucket(self, n: int) -> int:
        return next(b for b in self._prompt_buckets() if b >= n)

    def _prefill_rows(self, n: int) -> int:
        """Rows of a prefill for n new rows: powers of 4 (1, 4, 16, ...), so few prefill shapes compile."""
        rows = 1
        while rows < n:
            rows *= 4
        return min(self._batch_bucket(rows), self.max_batch)

    def _prefill_shapes(self) -> list[tuple[int, int]]:
        """(rows, prompt bucket) pairs a prefill can take."""
        rows = sorted({self._prefill_rows(n) for n in range(1, self.max_batch + 1)})
        return [(b, t) for t in self._prompt_buckets() for b in rows if b == rows[0] or b * t <= PREFILL_TOKENS]

    # device state ---------------------------------------------------------------------------------

    def _reset_device(self) -> None:
        """A fresh pool and empty slots (at start, and after a failed device call, which may have
        consumed the donated buffers)."""

        def pool(cfg: ModelConfig, policy: model.Policy) -> model.KVCache:
            with jax.set_mesh(self.mesh):
                return jax.jit(
                    partial(model.init_cache, cfg, self.pool.n_pages, self.page_size, policy.compute_dtype)
                )()

        self.cache = pool(self.cfg, self.policy)
        self.draft_cache = None if self.draft is None else pool(self.draft.cfg, self.draft.policy)
        B = self.max_batch
        zeros = np.zeros(B, np.int32)
        settings = settings_for([], B)._replace(max_new=zeros)
        host = Rows(zeros, np.zeros((B, self.cfg.vocab_size), bool), zeros, np.ones(B, bool), zeros, settings)
        self.rows = jax.tree.map(self._from_host, host)

    def _from_host(self, x: np.ndarray) -> jax.Array:
        """A host array split over the batch axes (the same on every process when there are several)."""
        return from_host(np.asarray(x), _batch_sharding(self.mesh, np.ndim(x)))

    def _state(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """What every compiled step takes besides its own arguments (see STATIC)."""
        draft = {}
        if self.draft is not None:
            draft = dict(draft_params=self.draft.params, draft_cache=self.draft_cache, draft=self.draft[1:])
        return (self.params, self.cache, self.rows), dict(cfg=self.cfg, policy=self.policy, **draft)

    def _call(self, fn: Any, *args: Any) -> Step:
        """Run a compiled step on the pools and the slots, which it updates in place."""
        state, options = self._state()
        with jax.set_mesh(self.mesh):
            self.cache, self.draft_cache, self.rows, out = fn(*state, *args, **options)
        return Step(*(to_host(x) for x in out))

    # compiling ------------------------------------------------------------------------------------

    def warm_up(self) -> tuple[int, float]:
        """Compile every prefill and decode shape the engine can use (on as many threads as there are CPU
        cores: XLA compiles outside Python's lock), then run each once on padding rows, which write only
        to the padding page, so the first requests find every program loaded; (shapes, seconds)."""
        began = time.perf_counter()
        programs = [
            (_prefill, prefill_args(self.cfg, self.mesh, b, t, self.max_pages)) for b, t in self._prefill_shapes()
        ]
        for b in self._decode_batches():
            for n in self._page_buckets():
                if self.speculate:
                    programs.append((_speculate, speculate_args(self.mesh, b, n, self.speculate)))
                if not self.draft:  # prompt lookup decodes plainly when it has nothing to propose
                    programs.append((_decode, decode_args(self.mesh, b, n)))
        state, options = self._state()
        with jax.set_mesh(self.mesh):
            lowered = [fn.lower(*state, *args, **options) for fn, args in programs]

        def compile(lowered: Any) -> Footprint:
            with jax.set_mesh(self.mesh):  # the compilation cache is keyed by the thread's mesh context too
                return Footprint.of(lowered.compile())

        free = free_memory(self._local_device())
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            try:  # the steps of the most rows first: a server they do not fit is refused after one compile
                for step in pool.map(compile, lowered[::-1]):
                    self._check_working_memory(step, free)
            except BaseException:  # a refusal or Ctrl-C: the programs not started yet are dropped
                pool.shutdown(cancel_futures=True)
                raise
        for fn, args in programs:
            self._call(fn, *self._padding(args))
        seconds = time.perf_counter() - began
        self.stats.compiled_shapes, self.stats.compile_seconds = len(programs), seconds
        _count_compiles(weakref.ref(self.stats))
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

    def _padding(self, args: tuple[Any, ...]) -> list[Any]:
        """Arguments of the given shapes for padding rows only: slots out of range, pages all page 0."""
        slots, *rest = args
        zeros = lambda x: self._from_host(np.zeros(x.shape, x.dtype)) if isinstance(x, jax.ShapeDtypeStruct) else x
        return [self._from_host(np.full(slots.shape, self.max_batch, np.int32)), *jax.tree.map(zeros, rest)]

    # requests -------------------------------------------------------------------------------------

    def check(self, prompt_len: int, max_new: int) -> None:
        """A clear error for a request that can never run."""
        if prompt_len < 1:
            raise InputError("a prompt must have at least one token")
        if prompt_len > self.max_len:
            raise InputError(f"prompt has {prompt_len} tokens, more than the context of {self.max_len}")
        if prompt_len + max_new > self.max_len:
            raise InputError(
                f"prompt ({prompt_len} tokens) plus max_new_tokens ({max_new}) exceeds the context of {self.max_len}"
            )
        if pages_for(prompt_len + max_new, self.page_size) > self.pool.capacity:
            raise InputError(
                f"prompt ({prompt_len} tokens) plus max_new_tokens ({max_new}) needs more KV cache than the "
                f"engine's {self.pool.capacity * self.page_size} tokens (kv_tokens)"
            )

    def submit(self, requests: Sequence[Request]) -> None:
        for r in requests:
            self.check(len(r.prompt), r.output.sampling.max_new_tokens)
        self.queue.extend(requests)

    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    def has_work(self) -> bool:
        return bool(self.queue) or bool(self.running)

    def step(self, chunk: int = 4) -> None:
        """Drop cancelled rows, admit what fits (one prefill), then decode up to `chunk` tokens of every running row."""
        check_chunk(chunk)
        self._drop_finished()
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)
            self._drop_finished()
        if self.running:
            proposals = self._proposals() if self.speculate else None
            if proposals is not None:
                self._speculate(proposals)
            else:  # speculating with nothing to propose decodes as many tokens as a step could keep, then looks again
                self._decode(min(chunk, MAX_CHUNK, self.speculate + 1 if self.speculate else MAX_CHUNK))
            self._drop_finished()

    def fail_all(self, error: str) -> None:
        """Fail every queued and running row and start from an empty cache (after a device failure)."""
        for r in [*self.queue, *self.running]:
            r.error = error
            self._notify(r)
        self.queue.clear()
        for r in self.running:
            self._release(r)
        self._reset_device()

    def _drop_finished(self) -> None:
        for r in self.running:
            if r.finished:
                self._release(r)
        self.queue = deque(r for r in self.queue if not r.cancelled)

    def _release(self, r: Request) -> None:
        self.pool.release(r.pages)
        r.pages = []
        self.slots[r.slot] = None

    def _reserved(self) -> int:
        """Pages the running rows may still need for their budgets."""
        return sum(pages_for(r.budget, self.page_size) - len(r.pages) for r in self.running)

    def _admit(self) -> list[Request]:
        """Queued rows (in order) that a free slot and the pool's pages can take, with their cached prefix."""
        free_slots = [i for i, r in enumerate(self.slots) if r is None]
        admitted: list[Request] = []
        longest = 0
        reserved = self._reserved()
        while self.queue and len(admitted) < len(free_slots):
            r = self.queue[0]
            shared = self.pool.match(r.prompt)
            need = pages_for(r.budget, self.page_size) - len(shared)
            new_tokens = len(r.prompt) - len(shared) * self.page_size
            t = self._prompt_bucket(max(longest, new_tokens))
            rows = self._prefill_rows(len(admitted) + 1)
            fits_pool = self.pool.available - reserved >= need
            fits_call = not admitted or rows * t <= PREFILL_TOKENS
            if not (fits_pool and fits_call):
                self.pool.release(shared)
                break
            self.queue.popleft()
            self.pool.record(len(r.prompt), len(shared))
            r.slot, r.pages, r.length = free_slots[len(admitted)], shared, len(shared) * self.page_size
            self.slots[r.slot] = r
            reserved += need
            longest = max(longest, new_tokens)
            admitted.append(r)
        return admitted

    def _grow(self, r: Request, tokens: int) -> None:
        """Give `r` pages for its first `tokens` tokens."""
        missing = pages_for(min(tokens, r.budget), self.page_size) - len(r.pages)
        if missing > 0:
            r.pages += self.pool.allocate(missing)

    def _prefill(self, admitted: list[Request]) -> None:
        n = self._prefill_rows(len(admitted))
        new = [r.prompt[r.length :] for r in admitted]
        t = self._prompt_bucket(max(map(len, new)))
        tokens = np.zeros((n, t), np.int32)
        mask = np.zeros((n, t), bool)
        table = np.full((n, self.max_pages), PAD_PAGE, np.int32)
        start = np.zeros(n, np.int32)
        seen = np.zeros((n, self.cfg.vocab_size), bool)
        slots = np.full(n, self.max_batch, np.int32)  # padding rows: out of range, dropped
        for i, (r, prompt) in enumerate(zip(admitted, new, strict=True)):
            self._grow(r, len(r.prompt))
            tokens[i, : len(prompt)], mask[i, : len(prompt)] = prompt, True
            table[i, : len(r.pages)] = r.pages
            start[i], slots[i] = r.length, r.slot
            seen[i, r.prompt] = True
        settings = settings_for([r.output.sampling for r in admitted], n)
        if jax.process_count() > 1:  # a row without a seed draws one on each process: all take process 0's
            settings = settings._replace(seed=multihost_utils.broadcast_one_to_all(settings.seed))
        arrays = (slots, tokens, mask, table, start, seen)
        step = self._call(_prefill, *map(self._from_host, arrays), jax.tree.map(self._from_host, settings))
        self.stats.prefill_calls += 1
        now = time.perf_counter()
        for i, r in enumerate(admitted):
            r.length = len(r.prompt)
            self.pool.publish(r.prompt, r.pages)
            self.stats.prompt_tokens += len(r.prompt)
            r.first_token = now
            self._deliver(r, step, i)

    def _decode(self, chunk: int) -> None:
        running = self.running
        for r in running:
            self._grow(r, r.length + chunk)
        table, slots = self._tables(running, self._batch_bucket(len(running)))
        step = self._call(_decode, *map(self._from_host, (slots, table)), np.int32(chunk))
        self.stats.decode_calls += 1
        for i, r in enumerate(running):
            r.length += int(step.emitted[i].sum())
            self._deliver(r, step, i)

    def _proposals(self) -> np.ndarray | None:
        """Prompt lookup's proposals [rows, k] for the running rows (-1 past a row's own), or None when no
        row has any: then plain decoding is cheaper than verifying nothing. With a draft model, all -1:
        the draft proposes on the device."""
        running = self.running
        proposals = np.full((self._batch_bucket(len(running)), self.speculate), -1, np.int32)
        if self.draft is None:
            for i, r in enumerate(running):
                # positions written: length .. length + proposals, kept inside the row's budget
                guess = lookup(r.prompt + r.output.tokens, self.ngram, min(self.speculate, r.budget - r.length - 2))
                proposals[i, : len(guess)] = guess
            if (proposals < 0).all():
                return None
        return proposals

    def _speculate(self, proposals: np.ndarray) -> None:
        """One speculative step: k proposals per row, from the draft model or prompt lookup, verified together."""
        running = self.running
        n, k = proposals.shape
        for i, r in enumerate(running):
            self._grow(r, r.length + 1 + (k if self.draft else int((proposals[i] >= 0).sum())))
        table, slots = self._tables(running, n)
        step = self._call(_speculate, *map(self._from_host, (slots, table, proposals)))
        self.stats.decode_calls += 1
        offered_all = step.proposed[:, :k] >= 0
        kept_all = step.emitted[:, :k] & (step.token[:, :k] == step.proposed[:, :k])
        for i, r in enumerate(running):
            emitted = int(step.emitted[i].sum())
            offered, kept = int(offered_all[i].sum()), int(kept_all[i].sum())
            r.proposed, r.accepted = r.proposed + offered, r.accepted + kept
            self.stats.proposed, self.stats.accepted = self.stats.proposed + offered, self.stats.accepted + kept
            r.length += emitted
            self._deliver(r, step, i)

    def _tables(self, running: list[Request], n: int) -> tuple[np.ndarray, np.ndarray]:
        """Page tables [n, bucketed width] and slots [n] of the running rows, padded to n rows."""
        width = self._page_bucket(max(len(r.pages) for r in running))
        table = np.full((n, width), PAD_PAGE, np.int32)
        slots = np.full(n, self.max_batch, np.int32)
        for i, r in enumerate(running):
            table[i, : len(r.pages)] = r.pages
            slots[i] = r.slot
        return table, slots

    def _deliver(self, r: Request, step: Step, i: int) -> None:
        with r.lock:
            before = len(r.output.tokens)
            r.output.add(step, i)
            self.stats.record(len(r.output.tokens) - before)
        self._notify(r)

    @staticmethod
    def _notify(r: Request) -> None:
        if r.notify is not None:
            r.notify()

    # a fixed set of prompts -----------------------------------------------------------------------

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        tokenizer: Tokenizer | None = None,
        chunk: int = 64,
    ) -> Iterator[list[RowOutput]]:
        """Generate for token prompts, yielding their `RowOutput`s after every engine step until all have
        finished; streaming reads them. Rows beyond `max_batch` or the pool wait for earlier ones."""
        check_chunk(chunk)
        if len(prompts) != len(params):
            raise InputError("one SamplingParams per prompt is needed")
        if any(p.stop for p in params) and tokenizer is None:
            raise InputError("stop strings need a tokenizer")
        requests = [Request(list(p), RowOutput(sp, tokenizer)) for p, sp in zip(prompts, params, strict=True)]
        self.submit(requests)
        try:
            while not all(r.finished for r in requests):
                try:
                    self.step(chunk)
                except Exception:
                    self.fail_all("generation failed")
                    raise
                yield [r.output for r in requests]
        finally:  # the caller stopped early: free what is still held
            for r in requests:
                r.cancelled = not r.output.finished
            self._drop_finished()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        tokenizer: Tokenizer | None = None,
        chunk: int = 64,
    ) -> list[Completion]:
        """Generate for token prompts until every row finishes."""
        outputs = [RowOutput(sp, tokenizer) for sp in params]
        for outputs in self.run(prompts, params, tokenizer, chunk):  # noqa: B007
            pass
        return [o.result() for o in outputs]
