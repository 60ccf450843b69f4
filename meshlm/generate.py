"""Batched text generation with a KV cache.

Three layers, each used by the next:
- sampling filters (pure functions over logits [B, V] with per-row settings): repetition penalty,
  temperature, top-k, top-p, in that order, then greedy argmax or a seeded draw;
- `Generator`: compiled prefill (the whole prompt in one call) and a decode loop that runs up to a
  chunk of steps inside one `lax.while_loop`, over a batch of rows whose state (`Rows`) stays on the
  devices; rows can be written into the slots of a running batch, which is how the server batches
  requests that arrive at different times;
- host bookkeeping (`RowOutput`): collects a row's tokens, detokenises incrementally, applies stop
  strings, and `generate` drives a fixed batch to the end.

Shapes are bucketed (batch and prompt to powers of two, the cache to a power of two or the context),
so new prompt lengths rarely compile anything new.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from meshlm import model
from meshlm.config import InputError, ModelConfig
from meshlm.sharding import batch_ways, constrain, from_host, named_sharding, to_host
from meshlm.tokenizer import Tokenizer

MAX_STOP_IDS = 8  # stop token ids per row
TOP_LOGPROBS = 5  # alternatives reported per token (OpenAI's limit for completions)
MIN_PROMPT_BUCKET = 16
MAX_CHUNK = 64  # decode steps per device call at most; one compiled loop serves every chunk size up to it


def check_chunk(chunk: int) -> int:
    """A chunk of decode steps per device call must make progress: 0 would loop forever."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InputError(f"chunk (decode steps per device call) must be an integer >= 1, got {chunk!r}")
    return chunk


@dataclass(frozen=True)
class SamplingParams:
    """How one row is generated. temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, what: str) -> None:
            if not ok:
                raise InputError(what)

        check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens must be an integer >= 0")
        check(_is_number(self.temperature) and self.temperature >= 0, "temperature must be a number >= 0")
        check(_is_int(self.top_k) and self.top_k >= 0, "top_k must be an integer >= 0 (0 disables it)")
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p must be a number in (0, 1]")
        check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty must be > 0")
        check(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids >= 0")
        check(len(self.stop_token_ids) <= MAX_STOP_IDS, f"at most {MAX_STOP_IDS} stop_token_ids")
        check(self.seed is None or _is_int(self.seed), "seed must be an integer")

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def _is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float | np.number) and not isinstance(x, bool) and math.isfinite(x)


# ---------------------------------------------------------------------------------------------------
# Sampling filters: logits [B, V] float32, settings [B]. Removed entries become -inf.


def repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """CTRL's penalty, as transformers applies it: a seen token's logit is divided by the penalty when
    positive and multiplied by it when negative."""
    p = penalty[:, None]
    return jnp.where(seen, jnp.where(logits > 0, logits / p, logits * p), logits)


def apply_temperature(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """Divide by the temperature; rows with temperature 0 (greedy) are left as they are."""
    return logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys that order like the float32 values (flip negatives, set the sign bit of positives)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_threshold(keys: jax.Array, enough: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Per row, the largest key m such that `enough(keys >= m)` holds, by bisection over the 32 key bits.

    Sorting a 50k vocabulary per row per step is slow on some backends (about a second for 16 rows on
    CPU); 32 masked reductions are not, and select exactly the same tokens."""

    def halve(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        gap = hi - lo
        mid = lo + (gap >> 1) + (gap & 1)
        ok = enough(keys >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    B = keys.shape[0]
    lo, _ = jax.lax.fori_loop(0, 32, halve, (jnp.zeros(B, jnp.uint32), jnp.full(B, 0xFFFFFFFF, jnp.uint32)))
    return lo


def top_k_filter(logits: jax.Array, k: jax.Array) -> jax.Array:
    """Keep each row's k largest logits (ties with the k-th kept too); k = 0 keeps all."""
    keys = _order_keys(logits)
    kth = _largest_threshold(keys, lambda kept: kept.sum(-1) >= k)
    return jnp.where((k[:, None] > 0) & (keys < kth[:, None]), -jnp.inf, logits)


def top_p_filter(logits: jax.Array, p: jax.Array) -> jax.Array:
    """Nucleus filter: keep the most probable tokens until their probability reaches p (at least one)."""
    keys = _order_keys(logits)
    probs = jax.nn.softmax(logits, axis=-1)
    threshold = _largest_threshold(keys, lambda kept: jnp.where(kept, probs, 0.0).sum(-1) >= p)
    return jnp.where((p[:, None] < 1) & (keys < threshold[:, None]), -jnp.inf, logits)


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Temperature, then top-k, then top-p (transformers' order); each filter runs only when a row asks for it."""
    logits = apply_temperature(logits, temperature)
    logits = jax.lax.cond(jnp.any(top_k > 0), top_k_filter, lambda x, _: x, logits, top_k)
    return jax.lax.cond(jnp.any(top_p < 1), top_p_filter, lambda x, _: x, logits, top_p)


def argmax(x: jax.Array) -> jax.Array:
    """First index of each row's maximum: two plain reductions, 3x faster on CPU than jnp.argmax's
    two-operand one."""
    best = x.max(axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == best, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def sample(logits: jax.Array, keys: jax.Array) -> jax.Array:
    """One draw per row from softmax(logits), by inverting the CDF with a single uniform number per row
    (a Gumbel draw needs a random number per vocabulary entry, ten times slower on CPU)."""
    probs = jax.nn.softmax(logits, axis=-1)
    cdf = jnp.cumsum(probs, axis=-1)
    u = jax.vmap(jax.random.uniform)(keys) * cdf[:, -1]
    return argmax(cdf > u[:, None])


# ---------------------------------------------------------------------------------------------------
# Device state and the compiled steps


class Settings(NamedTuple):
    """Per-row sampling settings, on the device."""

    temperature: jax.Array  # [B] float32, 0 = greedy
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] float32
    penalty: jax.Array  # [B] float32
    max_new: jax.Array  # [B] int32
    stop_ids: jax.Array  # [B, MAX_STOP_IDS] int32, -1 = unused
    seed: jax.Array  # [B] uint32


class Rows(NamedTuple):
    """A batch of rows being generated; stays on the devices between steps."""

    cache: model.KVCache
    token: jax.Array  # [B] int32: the last token produced, the next input
    seen: jax.Array  # [B, V] bool: tokens in the prompt or output (for the repetition penalty)
    count: jax.Array  # [B] int32: tokens produced so far
    done: jax.Array  # [B] bool
    settings: Settings


class Step(NamedTuple):
    """What a row produced at each step of a chunk: [B, n] (top_* [B, n, TOP_LOGPROBS])."""

    token: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    emitted: np.ndarray  # bool: the row was still running at this step
    done: np.ndarray  # [B] bool: the row has finished (stop token or max_new_tokens)


def any_sampling(params: Sequence[SamplingParams | None]) -> bool:
    """Whether any row draws at random (temperature above 0), rather than all decoding greedily."""
    return any(sp is not None and sp.temperature > 0 for sp in params)


def settings_for(params: Sequence[SamplingParams | None], n_rows: int) -> Settings:
    """Host arrays for `n_rows` rows; rows beyond `params` (padding) are greedy and produce nothing."""
    stop_ids = np.full((n_rows, MAX_STOP_IDS), -1, np.int32)
    values = np.zeros((5, n_rows), np.float64)
    values[2] = 1.0  # top_p
    values[3] = 1.0  # penalty
    seeds = np.zeros(n_rows, np.uint32)
    for i, sp in enumerate(params):
        if sp is None:
            continue
        values[:, i] = (sp.temperature, sp.top_k, sp.top_p, sp.repetition_penalty, sp.max_new_tokens)
        stop_ids[i, : len(sp.stop_token_ids)] = sp.stop_token_ids
        seeds[i] = (secrets.randbits(32) if sp.seed is None else sp.seed) & 0xFFFFFFFF
    return Settings(
        temperature=values[0].astype(np.float32),
        top_k=values[1].astype(np.int32),
        top_p=values[2].astype(np.float32),
        penalty=values[3].astype(np.float32),
        max_new=values[4].astype(np.int32),
        stop_ids=stop_ids,
        seed=seeds,
    )


def choose(logits: jax.Array, rows: Rows, n_vocab_used: int, sampling: bool = True) -> tuple[jax.Array, ...]:
    """The next token of every row from logits [B, V], and its log-probability under the model.

    `sampling` (static) says whether any row has a temperature above 0; without it every row is
    greedy and no draw is compiled. (A `lax.cond` deciding that on the device cost more, on CPU,
    than the whole greedy choice.)"""
    V = logits.shape[-1]
    s = rows.settings
    logits = jnp.where(jnp.arange(V) < n_vocab_used, logits, -jnp.inf)  # padded vocabulary rows
    logp = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logp, TOP_LOGPROBS)
    x = repetition_penalty(logits, rows.seen, s.penalty)
    greedy = argmax(x)

    def draw(x: jax.Array) -> jax.Array:
        x = filter_logits(x, s.temperature, s.top_k, s.top_p)
        keys = jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.key(seed), n))(s.seed, rows.count)
        return sample(x, keys)

    token = jnp.where(s.temperature > 0, draw(x), greedy) if sampling else greedy
    logprob = jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
    return token, logprob, top_ids.astype(jnp.int32), top_logprobs


def advance(rows: Rows, cache: model.KVCache, token: jax.Array) -> Rows:
    """Record each running row's new token; finished rows keep their state."""
    running = ~rows.done
    count = rows.count + running
    stopped = jnp.any(token[:, None] == rows.settings.stop_ids, axis=-1)
    done = rows.done | stopped | (count >= rows.settings.max_new)
    seen = rows.seen.at[jnp.arange(token.shape[0]), token].max(running)
    return rows._replace(cache=cache, token=jnp.where(running, token, rows.token), seen=seen, count=count, done=done)


def _bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


@partial(jax.jit, static_argnames=("cfg", "policy", "cache_len", "sampling"))
def _prefill(
    params: model.Params,
    tokens: jax.Array,
    mask: jax.Array,
    settings: Settings,
    *,
    cfg: ModelConfig,
    policy: model.Policy,
    cache_len: int,
    sampling: bool,
) -> tuple[Rows, tuple[jax.Array, ...]]:
    """Fresh rows from right-padded prompts [B, P], with each row's first token chosen.

    Right padding: a row's generated tokens take the slots right after its prompt (overwriting the
    padding, which is never attended to), so a row needs only len(prompt) + max_new_tokens slots and
    the prompt's bucket does not depend on how much will be generated."""
    B = tokens.shape[0]
    tokens = constrain(tokens, ("batch", "seq"))
    lengths = mask.sum(-1, dtype=jnp.int32)
    cache = model.init_cache(cfg, B, cache_len, policy.compute_dtype)
    logits, cache = model.decode(params, tokens, cache, cfg, policy, mask=mask, at=jnp.maximum(lengths - 1, 0))
    cache = cache._replace(index=lengths)
    seen = jnp.zeros((B, cfg.vocab_size), bool).at[jnp.arange(B)[:, None], tokens].max(mask)
    zeros = jnp.zeros((B,), jnp.int32)
    rows = Rows(cache, zeros, seen, zeros, settings.max_new <= 0, settings)
    out = choose(logits[:, 0], rows, cfg.n_vocab_used, sampling)
    return advance(rows, cache, out[0]), (*(o[:, None] for o in out), ~rows.done[:, None])


@partial(jax.jit, static_argnames=("cfg", "policy", "sampling"), donate_argnames="rows")
def _decode(
    params: model.Params,
    rows: Rows,
    n_steps: jax.Array,
    *,
    cfg: ModelConfig,
    policy: model.Policy,
    sampling: bool,
) -> tuple[Rows, tuple[jax.Array, ...]]:
    """Up to `n_steps` (<= MAX_CHUNK) decode steps in one `while_loop`, stopping early once every row is done."""
    B = rows.token.shape[0]
    bufs = (
        jnp.full((B, MAX_CHUNK), -1, jnp.int32),
        jnp.zeros((B, MAX_CHUNK), jnp.float32),
        jnp.zeros((B, MAX_CHUNK, TOP_LOGPROBS), jnp.int32),
        jnp.zeros((B, MAX_CHUNK, TOP_LOGPROBS), jnp.float32),
        jnp.zeros((B, MAX_CHUNK), bool),
    )

    def cond(carry: tuple) -> jax.Array:
        i, rows, _ = carry
        return (i < n_steps) & ~jnp.all(rows.done)

    def body(carry: tuple) -> tuple:
        i, rows, bufs = carry
        logits, cache = model.decode(params, rows.token[:, None], rows.cache, cfg, policy)
        out = choose(logits[:, 0], rows, cfg.n_vocab_used, sampling)
        bufs = tuple(b.at[:, i].set(v) for b, v in zip(bufs, (*out, ~rows.done), strict=True))
        return i + 1, advance(rows, cache, out[0]), bufs

    _, rows, bufs = jax.lax.while_loop(cond, body, (jnp.int32(0), rows, bufs))
    return rows, bufs


@partial(jax.jit, donate_argnames="rows")
def _insert(rows: Rows, new: Rows, slots: jax.Array) -> Rows:
    """Write `new` rows into `rows` at `slots` (slots out of range, for padding rows, are dropped)."""

    def put(dst: jax.Array, src: jax.Array) -> jax.Array:
        if dst.ndim == 5:  # cache k/v: [L, B, H, S, K], batch on axis 1
            return dst.at[:, slots].set(src, mode="drop")
        return dst.at[slots].set(src, mode="drop")

    return jax.tree.map(put, rows, new)


class Generator:
    """Prefill / decode / insert for one model on one mesh, and the shape buckets they compile for.

    The compiled functions are shared by every model with the same config and policy."""

    def __init__(self, params: model.Params, cfg: ModelConfig, policy: model.Policy, mesh: Mesh):
        self.params, self.cfg, self.policy, self.mesh = params, cfg, policy, mesh
        self.batch_ways = batch_ways(mesh)

    def batch_bucket(self, n: int) -> int:
        """Rows are padded to a power of two that the mesh's batch axes divide."""
        b = _bucket(n)
        return -(-b // self.batch_ways) * self.batch_ways

    def prompt_bucket(self, n: int, cache_len: int) -> int:
        return min(_bucket(n, MIN_PROMPT_BUCKET), cache_len)

    def cache_bucket(self, n: int) -> int:
        return min(_bucket(n, 2 * MIN_PROMPT_BUCKET), self.cfg.max_seq_len)

    def check_fits(self, prompt_len: int, max_new: int) -> None:
        """A clear error for a request that cannot fit the model's context."""
        ctx = self.cfg.max_seq_len
        if prompt_len > ctx:
            raise InputError(f"prompt has {prompt_len} tokens, more than the model's context of {ctx}")
        if prompt_len + max_new > ctx:
            raise InputError(
                f"prompt ({prompt_len} tokens) plus max_new_tokens ({max_new}) exceeds the model's context of {ctx}"
            )

    def prefill(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], n_rows: int, cache_len: int
    ) -> tuple[Rows, Step]:
        """Run the prompts (right-padded to a common bucketed length) and choose each row's first token."""
        for prompt, sp in zip(prompts, params, strict=True):
            if not len(prompt):
                raise InputError("a prompt must have at least one token")
            self.check_fits(len(prompt), sp.max_new_tokens)
            if len(prompt) + sp.max_new_tokens > cache_len:
                raise InputError(f"{len(prompt)} prompt tokens + {sp.max_new_tokens} new exceed a cache of {cache_len}")
        length = self.prompt_bucket(max(len(p) for p in prompts), cache_len)
        tokens = np.zeros((n_rows, length), np.int32)
        mask = np.zeros((n_rows, length), bool)
        for i, prompt in enumerate(prompts):
            tokens[i, : len(prompt)] = prompt
            mask[i, : len(prompt)] = True
        tokens, mask = self._from_host(tokens), self._from_host(mask)
        settings = jax.tree.map(self._from_host, settings_for(params, n_rows))
        static = dict(cfg=self.cfg, policy=self.policy, cache_len=cache_len, sampling=any_sampling(params))
        with jax.set_mesh(self.mesh):
            rows, out = _prefill(self.params, tokens, mask, settings, **static)
        return rows, self._to_host(out, rows)

    def decode(self, rows: Rows, n_steps: int, sampling: bool = True) -> tuple[Rows, Step]:
        """Up to `n_steps` (at most MAX_CHUNK) more tokens for every running row, in one device call.
        `sampling=False` promises that every row is greedy (`any_sampling` of the rows' settings)."""
        n_steps = min(n_steps, MAX_CHUNK)
        with jax.set_mesh(self.mesh):
            rows, out = _decode(
                self.params, rows, np.int32(n_steps), cfg=self.cfg, policy=self.policy, sampling=sampling
            )
        return rows, self._to_host(out, rows)

    def insert(self, rows: Rows, new: Rows, slots: Sequence[int]) -> Rows:
        """Rows of `new` into `slots` of a running batch (the rest of `new` is padding)."""
        index = np.full(new.token.shape[0], rows.token.shape[0], np.int32)  # out of range: dropped
        index[: len(slots)] = slots
        with jax.set_mesh(self.mesh):
            return _insert(rows, new, self._replicated(index))

    def finish(self, rows: Rows, finished: np.ndarray) -> Rows:
        """Mark rows done from the host (stop strings, cancelled requests) so they stop decoding."""
        if to_host(rows.done)[finished].all():
            return rows
        with jax.set_mesh(self.mesh):
            return rows._replace(done=rows.done | self._from_host(finished))

    def empty(self, n_rows: int, cache_len: int) -> Rows:
        """A batch of `n_rows` free slots (all done)."""
        rows, _ = self.prefill([[0]], [SamplingParams(max_new_tokens=0)], n_rows, cache_len)
        return rows

    def _from_host(self, x: np.ndarray) -> jax.Array:
        """A host array split over the batch axes (the same on every process when there are several)."""
        return from_host(np.asarray(x), named_sharding(self.mesh, ("batch",) + (None,) * (np.ndim(x) - 1)))

    def _replicated(self, x: np.ndarray) -> jax.Array:
        return from_host(np.asarray(x), named_sharding(self.mesh, (None,) * np.ndim(x)))

    @staticmethod
    def _to_host(out: tuple[jax.Array, ...], rows: Rows) -> Step:
        token, logprob, top_ids, top_logprobs, emitted = (to_host(x) for x in out)
        return Step(token, logprob, top_ids, top_logprobs, emitted, to_host(rows.done))


# ---------------------------------------------------------------------------------------------------
# Host bookkeeping


@dataclass
class Completion:
    """One finished row: the generated tokens (stop token excluded), their log-probabilities, the text."""

    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str  # "stop" (stop token or stop string) or "length"
    text: str | None = None


@dataclass
class RowOutput:
    """A row's output as it arrives: tokens, incremental text with stop strings and held-back partials."""

    sampling: SamplingParams
    tokenizer: Tokenizer | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    sent: int = 0  # characters of `text` already handed out by `take_text`

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, step: Step, row: int) -> None:
        """Take this row's tokens from a chunk of steps."""
        if self.finished:
            return
        stop_ids = set(self.sampling.stop_token_ids)
        for j in np.flatnonzero(step.emitted[row]):
            token = int(step.token[row, j])
            if token in stop_ids:
                self.finish_reason = "stop"
                break
            self.tokens.append(token)
            self.logprobs.append(float(step.logprob[row, j]))
            ids, lps = step.top_ids[row, j], step.top_logprobs[row, j]
            self.top_logprobs.append([(int(i), float(lp)) for i, lp in zip(ids, lps, strict=True)])
        if self.tokenizer is not None:
            self._update_text()
        if not self.finished and (step.done[row] or len(self.tokens) >= self.sampling.max_new_tokens):
            self.finish_reason = "length"

    def _update_text(self) -> None:
        text = self.tokenizer.decode(self.tokens)
        cuts = [i for i in (text.find(s) for s in self.sampling.stop) if i >= 0]
        if cuts:
            text = text[: min(cuts)]
            self.finish_reason = "stop"
            self._drop_tokens_after(len(text))
        self.text = text

    def _drop_tokens_after(self, n_chars: int) -> None:
        """Keep the tokens up to the one that reaches `n_chars` characters of text."""
        keep = 0
        while keep < len(self.tokens) and len(self.tokenizer.decode(self.tokens[:keep])) < n_chars:
            keep += 1
        del self.tokens[keep:], self.logprobs[keep:], self.top_logprobs[keep:]

    def take_text(self) -> str:
        """New text since the last call. While running, text that could still become a stop string or an
        unfinished UTF-8 character is held back."""
        end = len(self.text)
        if not self.finished:
            end = len(self.text.rstrip("\ufffd"))
            for s in self.sampling.stop:
                for k in range(min(len(s) - 1, end), 0, -1):
                    if self.text[:end].endswith(s[:k]):
                        end -= k
                        break
            end = max(end, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def result(self) -> Completion:
        text = self.text if self.tokenizer is not None else None
        return Completion(self.tokens, self.logprobs, self.top_logprobs, self.finish_reason or "length", text)


def run(
    generator: Generator,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    tokenizer: Tokenizer | None = None,
    chunk: int = 64,
) -> Iterator[list[RowOutput]]:
    """Generate for a fixed batch of token prompts, yielding the rows' `RowOutput`s after every device call
    (prefill, then up to `chunk` decode steps each) until all have finished; streaming reads them."""
    check_chunk(chunk)
    if len(prompts) != len(params):
        raise InputError("one SamplingParams per prompt is needed")
    if any(p.stop for p in params) and tokenizer is None:
        raise InputError("stop strings need a tokenizer")
    if not prompts:
        return
    seqs = [RowOutput(p, tokenizer) for p in params]
    max_new = max(p.max_new_tokens for p in params)
    longest = max(len(p) for p in prompts)
    generator.check_fits(longest, max_new)
    cache_len = generator.cache_bucket(longest + max_new)
    rows, step = generator.prefill(prompts, params, generator.batch_bucket(len(prompts)), cache_len)
    while True:
        for i, seq in enumerate(seqs):
            seq.add(step, i)
        yield seqs
        if all(s.finished for s in seqs):
            return
        finished = np.array([s.finished for s in seqs] + [True] * (rows.token.shape[0] - len(seqs)))
        rows = generator.finish(rows, finished)  # a stop string ends a row early
        rows, step = generator.decode(rows, chunk, any_sampling(params))


def generate(
    generator: Generator,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    tokenizer: Tokenizer | None = None,
    chunk: int = 64,
) -> list[Completion]:
    """Generate for a fixed batch of token prompts until every row finishes."""
    seqs: list[RowOutput] = []
    for seqs in run(generator, prompts, params, tokenizer, chunk):  # noqa: B007
        pass
    return [s.result() for s in seqs]
