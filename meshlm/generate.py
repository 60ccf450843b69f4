"""Sampling and the host side of a generated row.

- sampling filters (pure functions over logits [B, V] with per-row settings), in vLLM's and transformers'
  order: logit bias, repetition penalty, frequency and presence penalties, min_tokens' ban on stop
  tokens (these change the greedy choice too), then temperature, top-k, top-p, min-p (transformers'
  order), then greedy argmax or a seeded draw; `choose` applies them inside the engine's compiled steps
  (`meshlm.engine`);
- `SamplingParams`, what a row asks for, and `Settings`, the same on the devices;
- host bookkeeping (`RowOutput`): collects a row's tokens, detokenises incrementally, applies stop
  strings and holds back text that could still become one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import InputError
from meshlm.grammar import Constraint
from meshlm.tokenizer import Tokenizer

MAX_STOP_IDS = 8  # stop token ids per row
MAX_LOGIT_BIAS = 300  # biased tokens per row (OpenAI's limit)
TOP_LOGPROBS = 5  # alternatives reported per token (OpenAI's limit for completions)


def check_chunk(chunk: int) -> int:
    """A chunk of decode steps per device call must make progress: 0 would loop forever."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InputError(f"chunk (decode steps per device call) must be an integer >= 1, got {chunk!r}")
    return chunk


def check_token_ids(ids: Sequence[int], n_vocab: int, name: str) -> None:
    """The one rule for every token id a request gives (its prompt, stop_token_ids, logit_bias): ids the
    model's tokenizer has, [0, n_vocab_used); the embedding rows beyond them are padding, never trained."""
    if len(ids) and (min(ids) < 0 or max(ids) >= n_vocab):
        raise InputError(f"{name}: token ids must lie in [0, {n_vocab})", param=name)


@dataclass(frozen=True)
class SamplingParams:
    """How one row is generated. temperature 0 means greedy; top_k 0, top_p 1 and min_p 0 disable those
    filters.

    The rest follow OpenAI's and vLLM's meanings: `presence_penalty` and `frequency_penalty` (in [-2, 2])
    lower a token's logit by frequency_penalty * c + presence_penalty * (c > 0), where c counts the token
    in the output so far (not the prompt); `logit_bias` (token id -> bias in [-100, 100], at most
    MAX_LOGIT_BIAS of them; a dict or (id, bias) pairs, kept as pairs sorted by id) is added to the
    logits first; `min_p` drops tokens less likely than min_p times the likeliest (after temperature,
    top-k and top-p); until `min_tokens` tokens are produced the stop token ids cannot be and stop
    strings do not apply; `include_stop_str_in_output` keeps a stop string in the text. `constraint` (a
    `meshlm.grammar.Constraint`: a JSON schema, regex, choice or grammar) allows only the tokens that keep
    the output inside it, until it is complete. `logprobs`: how many top alternatives each output token
    reports (0 to TOP_LOGPROBS; its own logprob always); a step whose rows want none skips their top-k."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    prompt_logprobs: int | None = None  # score the prompt: each token's logprob and this many alternatives
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    constraint: Constraint | None = None
    logprobs: int = TOP_LOGPROBS

    def __post_init__(self) -> None:
        def check(ok: bool, what: str) -> None:
            if not ok:
                raise InputError(what)

        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))

        check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens must be an integer >= 0")
        check(_is_number(self.temperature) and self.temperature >= 0, "temperature must be a number >= 0")
        check(_is_int(self.top_k) and self.top_k >= 0, "top_k must be an integer >= 0 (0 disables it)")
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p must be a number in (0, 1]")
        check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty must be > 0")
        check(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids >= 0")
        check(len(self.stop_token_ids) <= MAX_STOP_IDS, f"at most {MAX_STOP_IDS} stop_token_ids")
        check(self.seed is None or _is_int(self.seed), "seed must be an integer")
        n = self.prompt_logprobs
        check(n is None or (_is_int(n) and 0 <= n <= TOP_LOGPROBS), f"prompt_logprobs must be in [0, {TOP_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(_is_number(value) and -2 <= value <= 2, f"{name} must be a number in [-2, 2]")
        check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p must be a number in [0, 1]")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens must be an integer >= 0")
        check(self.min_tokens <= self.max_new_tokens, "min_tokens must be at most max_new_tokens")
        check(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output must be true or false")
        check(self.constraint is None or isinstance(self.constraint, Constraint), "constraint must be a Constraint")
        check(_is_int(self.logprobs) and 0 <= self.logprobs <= TOP_LOGPROBS, f"logprobs must be in [0, {TOP_LOGPROBS}]")

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def _is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float | np.number) and not isinstance(x, bool) and math.isfinite(x)


def _logit_bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs sorted by id, from a mapping or pairs; ids may be integers or
    strings of them (JSON object keys, as OpenAI's API sends them). Whether an id is in the model's
    vocabulary is checked where that is known (`Engine.add_requests`)."""
    if bias is None:
        return ()
    items = bias.items() if isinstance(bias, Mapping) else bias
    if isinstance(items, str | bytes) or not isinstance(items, Iterable):
        raise InputError("logit_bias must map token ids to biases")
    pairs: dict[int, float] = {}
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise InputError("logit_bias must map token ids to biases")
        key, value = item
        if isinstance(key, str) and key.strip().isdecimal():
            key = int(key)
        if not (_is_int(key) and key >= 0):
            raise InputError(f"logit_bias: token ids must be integers >= 0, got {key!r}")
        if not (_is_number(value) and -100 <= value <= 100):
            raise InputError(f"logit_bias: biases must be numbers in [-100, 100], got {value!r} for token {key}")
        if int(key) in pairs:
            raise InputError(f"logit_bias: token {key} is given twice")
        pairs[int(key)] = float(value)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise InputError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}")
    return tuple(sorted(pairs.items()))


# ---------------------------------------------------------------------------------------------------
# Sampling filters: logits [B, V] float32, settings [B]. Removed entries become -inf.


def repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """CTRL's penalty, as transformers applies it: a seen token's logit is divided by the penalty when
    positive and multiplied by it when negative."""
    p = penalty[:, None]
    return jnp.where(seen, jnp.where(logits > 0, logits / p, logits * p), logits)


def apply_logit_bias(logits: jax.Array, ids: jax.Array, bias: jax.Array) -> jax.Array:
    """Add each row's `bias` [B, N] to its logits at token `ids` [B, N] (-1: unused)."""
    V = logits.shape[-1]
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, jnp.where(ids >= 0, ids, V)].add(bias.astype(logits.dtype), mode="drop")


def frequency_presence_penalty(
    logits: jax.Array, counts: jax.Array, frequency: jax.Array, presence: jax.Array
) -> jax.Array:
    """OpenAI's penalties: logit[j] -= frequency * c[j] + presence * (c[j] > 0), with `counts` c [B, V] the
    times each token occurs in the row's output so far."""
    c = counts.astype(logits.dtype)
    return logits - frequency[:, None] * c - presence[:, None] * (c > 0)


def apply_temperature(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """Divide by the temperature; rows with temperature 0 (greedy) are left as they are."""
    return logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]


CANDIDATES = 256  # largest logits per row that top-k and top-p read their thresholds from


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


def min_p_filter(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drop tokens whose probability is below min_p times the row's largest (transformers' MinPLogitsWarper);
    the likeliest token always stays."""
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.where(probs < min_p[:, None] * probs.max(-1, keepdims=True), -jnp.inf, logits)


def filter_logits(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array | None = None
) -> jax.Array:
    """Temperature, then top-k, then top-p, then min-p (transformers' order); each filter runs only when a
    row asks for it."""
    logits = apply_temperature(logits, temperature)
    asked = jnp.any(top_k > 0) | jnp.any(top_p < 1)
    logits = jax.lax.cond(asked, _top_k_top_p, lambda x, *_: x, logits, top_k, top_p)
    if min_p is None:
        return logits
    return jax.lax.cond(jnp.any(min_p > 0), min_p_filter, lambda x, _: x, logits, min_p)


def _top_k_top_p(logits: jax.Array, k: jax.Array, p: jax.Array) -> jax.Array:
    """Top-k, then top-p, from each row's CANDIDATES largest logits (one `lax.top_k`, sorted): the k-th
    largest and the nucleus's last token are read off the candidates, and a row whose k exceeds them, or
    whose candidates hold less than p of its probability, takes the exact bisection filters instead. Keeps
    the same tokens as `top_k_filter` then `top_p_filter` (ties with the threshold kept too)."""
    n = min(CANDIDATES, logits.shape[-1])
    values, _ = jax.lax.top_k(logits, n)  # [B, n], largest first
    few = (k > 0) & (k <= n)
    kth = jnp.take_along_axis(values, jnp.clip(k - 1, 0, n - 1)[:, None], axis=-1)
    logits = jnp.where(few[:, None] & (logits < kth), -jnp.inf, logits)
    values = jnp.where(few[:, None] & (values < kth), -jnp.inf, values)
    many = k > n  # the candidates are still the row's largest: only values below them go
    logits = jax.lax.cond(jnp.any(many), lambda x: top_k_filter(x, jnp.where(many, k, 0)), lambda x: x, logits)

    mass = jnp.cumsum(jnp.exp(values - jax.nn.logsumexp(logits, axis=-1, keepdims=True)), axis=-1)
    reached = mass >= p[:, None]
    covered = reached[:, -1]
    last = jnp.take_along_axis(values, argmax(reached)[:, None], axis=-1)  # the first candidate reaching p
    logits = jnp.where(((p < 1) & covered)[:, None] & (logits < last), -jnp.inf, logits)
    short = (p < 1) & ~covered
    return jax.lax.cond(jnp.any(short), lambda x: top_p_filter(x, jnp.where(short, p, 1.0)), lambda x: x, logits)


def argmax(x: jax.Array) -> jax.Array:
    """First index of each row's maximum: two plain reductions, 3x faster on CPU than jnp.argmax's
    two-operand one."""
    best = x.max(axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == best, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def sample(logits: jax.Array, keys: jax.Array) -> jax.Array:
    """One draw per row from softmax(logits), by the Gumbel-max trick: the argmax of the logits plus
    independent Gumbel noise. No softmax, no cumulative sum, no sort: one pass over the vocabulary, and a
    token at -inf (filtered out, or refused by an output constraint) is never taken."""
    noise = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(keys)
    return argmax(logits.astype(jnp.float32) + noise)


def draw(weights: jax.Array, keys: jax.Array) -> jax.Array:
    """One draw per row in proportion to `weights` [B, V] (>= 0, not all 0): a zero weight is never taken."""
    return sample(jnp.log(weights), keys)


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
    presence: jax.Array  # [B] float32
    frequency: jax.Array  # [B] float32
    min_p: jax.Array  # [B] float32, 0 = off
    min_tokens: jax.Array  # [B] int32
    bias_ids: jax.Array  # [B, MAX_LOGIT_BIAS] int32, -1 = unused
    bias: jax.Array  # [B, MAX_LOGIT_BIAS] float32
    logprobs: jax.Array  # [B] int32: top alternatives wanted


class Step(NamedTuple):
    """What each row of a device call produced at each step: [B, n] (top_* [B, n, TOP_LOGPROBS])."""

    token: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    emitted: np.ndarray  # bool: the row was still running at this step
    done: np.ndarray  # [B] bool: the row has finished (stop token or max_new_tokens)
    proposed: np.ndarray | None = None  # speculative steps: the token proposed at each step (-1: none)
    # a scoring prefill: each fed position's logprob of the token after it [B, T] and its top alternatives
    prompt_logprob: np.ndarray | None = None
    prompt_top_ids: np.ndarray | None = None
    prompt_top_logprobs: np.ndarray | None = None


def seed_word(seed: int) -> int:
    """The 32-bit word a row's random key is made from: a seed in [0, 2^32) as it is (what earlier versions
    drew), any other integer hashed whole, so that seeds differing only in high bits (2^32 and 0, 2^70 and
    2^63) do not draw alike; distinct seeds then share a word with a chance of 2^-32."""
    if 0 <= seed < 2**32:
        return seed
    return int.from_bytes(hashlib.blake2b(str(seed).encode(), digest_size=4).digest(), "little")


def settings_for(params: Sequence[SamplingParams | None], n_rows: int) -> Settings:
    """Host arrays for `n_rows` rows; rows beyond `params` (padding) are greedy and produce nothing."""
    stop_ids = np.full((n_rows, MAX_STOP_IDS), -1, np.int32)
    bias_ids = np.full((n_rows, MAX_LOGIT_BIAS), -1, np.int32)
    bias = np.zeros((n_rows, MAX_LOGIT_BIAS), np.float32)
    values = np.zeros((10, n_rows), np.float64)
    values[2] = 1.0  # top_p
    values[3] = 1.0  # penalty
    seeds = np.zeros(n_rows, np.uint32)
    for i, sp in enumerate(params):
        if sp is None:
            continue
        values[:, i] = (sp.temperature, sp.top_k, sp.top_p, sp.repetition_penalty, sp.max_new_tokens,
                        sp.presence_penalty, sp.frequency_penalty, sp.min_p, sp.min_tokens, sp.logprobs)  # fmt: skip
        stop_ids[i, : len(sp.stop_token_ids)] = sp.stop_token_ids
        seeds[i] = secrets.randbits(32) if sp.seed is None else seed_word(sp.seed)
        if sp.logit_bias:
            ids, biases = zip(*sp.logit_bias, strict=True)
            bias_ids[i, : len(ids)], bias[i, : len(ids)] = ids, biases
    return Settings(
        temperature=values[0].astype(np.float32),
        top_k=values[1].astype(np.int32),
        top_p=values[2].astype(np.float32),
        penalty=values[3].astype(np.float32),
        max_new=values[4].astype(np.int32),
        stop_ids=stop_ids,
        seed=seeds,
        presence=values[5].astype(np.float32),
        frequency=values[6].astype(np.float32),
        min_p=values[7].astype(np.float32),
        min_tokens=values[8].astype(np.int32),
        bias_ids=bias_ids,
        bias=bias,
        logprobs=values[9].astype(np.int32),
    )


def used_vocabulary(logits: jax.Array, n_vocab_used: int) -> jax.Array:
    """Logits [B, V] with the padded vocabulary rows (>= n_vocab_used), which are never produced, at -inf."""
    return jnp.where(jnp.arange(logits.shape[-1]) < n_vocab_used, logits, -jnp.inf)


def row_keys(s: Settings, count: jax.Array) -> jax.Array:
    """Each row's random key for its `count`-th token: a seeded row draws the same tokens in any batch."""
    return jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.key(seed), n))(s.seed, count)


def penalize(logits: jax.Array, seen: jax.Array, counts: jax.Array | None, count: jax.Array, s: Settings) -> jax.Array:
    """The logits a row chooses from, greedy or not (vLLM's order): logit bias, repetition penalty over the
    prompt and output (`seen` [B, V]), frequency and presence penalties over the output (`counts` [B, V];
    None: nothing counted), then min_tokens' ban on the stop token ids while `count` < min_tokens
    (transformers' MinNewTokensLengthLogitsProcessor).

    One scatter adds the biases and the ban's -inf (which stays -inf through the penalties), and one
    elementwise pass applies the penalties; the scatter, and the read of the counts, run only when some
    row asks for them."""
    banned = (s.stop_ids >= 0) & (count < s.min_tokens)[:, None]
    ids = jnp.concatenate([s.bias_ids, jnp.where(banned, s.stop_ids, -1)], axis=1)
    added = jnp.concatenate([s.bias, jnp.full(s.stop_ids.shape, -jnp.inf, s.bias.dtype)], axis=1)
    x = jax.lax.cond(jnp.any(ids >= 0), lambda x: apply_logit_bias(x, ids, added), lambda x: x, logits)
    repeated = lambda x: repetition_penalty(x, seen, s.penalty)
    if counts is None:
        return repeated(x)
    counted = lambda x: frequency_presence_penalty(repeated(x), counts, s.frequency, s.presence)
    return jax.lax.cond(jnp.any((s.frequency != 0) | (s.presence != 0)), counted, repeated, x)


def distribution(x: jax.Array, s: Settings) -> jax.Array:
    """What a sampling row draws from, given its (penalised) logits: temperature, top-k, top-p, min-p, softmax."""
    return jax.nn.softmax(filter_logits(x, s.temperature, s.top_k, s.top_p, s.min_p), axis=-1)


def choose(
    logits: jax.Array,
    seen: jax.Array,
    count: jax.Array,
    s: Settings,
    n_vocab_used: int,
    proposal: jax.Array | None = None,
    draft_probs: jax.Array | None = None,
    counts: jax.Array | None = None,
    allowed: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """The next token of every row from logits [B, V], its log-probability under the model, and the
    top alternatives (zeros when no row wants them: `SamplingParams.logprobs`). `seen` [B, V] feeds the
    repetition penalty, `counts` [B, V] (each token's count in the output; None: none) the frequency and
    presence penalties; `count` [B] (tokens produced so far) holds back the stop tokens until min_tokens
    and picks each row's random key, so a seeded row draws the same tokens in any batch. The draw runs
    only when some row samples (temperature above 0).

    With `proposal` [B] (a speculated token per row, -1 for none) a row keeps its proposal when the
    target agrees: a greedy row when the proposal is its argmax; a sampling row with probability
    min(1, p(d) / q(d)) under the filtered target distribution p and the draft's q, else it draws from
    max(p - q, 0), renormalised (Leviathan et al. 2023), so the token follows p whatever q is.
    `draft_probs` [B, V] is q; without it q is certainty on d (prompt lookup), so d is kept with
    probability p(d) and a rejection draws from p without d. A row kept its proposal exactly when the
    token returned equals it.

    `allowed` [B, V] bool (an output constraint's mask; None: all) limits the choice, not the logprobs
    reported, which stay the model's (as vLLM's raw logprobs)."""
    V = logits.shape[-1]
    logits = used_vocabulary(logits, n_vocab_used)
    log_z = jax.nn.logsumexp(logits, axis=-1, keepdims=True)

    def alternatives(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        top, ids = jax.lax.top_k(x, TOP_LOGPROBS)
        return top - log_z, ids.astype(jnp.int32)

    none = lambda x: (
        jnp.zeros((x.shape[0], TOP_LOGPROBS), jnp.float32),
        jnp.zeros((x.shape[0], TOP_LOGPROBS), jnp.int32),
    )
    top_logprobs, top_ids = jax.lax.cond(jnp.any(s.logprobs > 0), alternatives, none, logits)
    x = penalize(logits, seen, counts, count, s)
    if allowed is not None:
        x = jnp.where(allowed, x, -jnp.inf)
    greedy = argmax(x)

    def sampled(x: jax.Array) -> jax.Array:
        keys = row_keys(s, count)
        if proposal is None:
            return sample(filter_logits(x, s.temperature, s.top_k, s.top_p, s.min_p), keys)
        p = distribution(x, s)
        offered = proposal >= 0
        d = jnp.maximum(proposal, 0)[:, None]
        q = jax.nn.one_hot(d[:, 0], V, dtype=p.dtype) if draft_probs is None else draft_probs
        p_d, q_d = (jnp.take_along_axis(probs, d, axis=-1)[:, 0] for probs in (p, q))
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)
        residual = jnp.where(offered[:, None], jnp.maximum(p - q, 0.0), p)
        residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p)  # p == q: never rejected anyway
        drawn = draw(residual, jax.vmap(lambda k: jax.random.fold_in(k, 2))(keys))
        return jnp.where(offered & (u * q_d < p_d), proposal, drawn)

    token = jax.lax.cond(jnp.any(s.temperature > 0), sampled, lambda x: greedy, x)
    token = jnp.where(s.temperature > 0, token, greedy)
    logprob = (jnp.take_along_axis(logits, token[:, None], axis=-1) - log_z)[:, 0]
    return token, logprob, top_ids, top_logprobs


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's output-constraint bitmask: a bit per token of the (padded) vocabulary."""
    return -(-vocab_size // 32)


def unpack_bitmask(words: jax.Array, vocab_size: int) -> jax.Array:
    """[B, vocab_size] bool from a bitmask [B, ceil(vocab_size / 32)] int32: bit t % 32 of word t // 32 is
    token t (the layout `meshlm.grammar.Matcher.fill` writes)."""
    ids = jnp.arange(vocab_size)
    return ((jnp.take(words, ids // 32, axis=1) >> (ids % 32)) & 1).astype(bool)


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
    prompt_logprobs: list[float | None] | None = None  # with SamplingParams.prompt_logprobs
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


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
    # with `sampling.prompt_logprobs`: each prompt token's logprob and top alternatives (None for the first)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # characters of text the first min_tokens - 1 tokens make: a stop string must end beyond them
    _stop_floor: int | None = field(default=None, repr=False)

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
            # a stop token ends the row once min_tokens are produced, this one included (as on the device)
            if token in stop_ids and len(self.tokens) + 1 >= self.sampling.min_tokens:
                self.finish_reason = "stop"
                break
            self.tokens.append(token)
            self.logprobs.append(float(step.logprob[row, j]))
            ids, lps = (
                step.top_ids[row, j, : self.sampling.logprobs],
                step.top_logprobs[row, j, : self.sampling.logprobs],
            )
            self.top_logprobs.append([(int(i), float(lp)) for i, lp in zip(ids, lps, strict=True)])
        if self.tokenizer is not None:
            self._update_text()
        if not self.finished and (step.done[row] or len(self.tokens) >= self.sampling.max_new_tokens):
            self.finish_reason = "length"

    def _update_text(self) -> None:
        """The text so far, cut before the first stop string (after it with include_stop_str_in_output).
        As vLLM, stop strings apply from the min_tokens-th token on: one must end in the text that token
        or a later one adds."""
        text = self.tokenizer.decode(self.tokens)
        sp = self.sampling
        if sp.stop and len(self.tokens) >= sp.min_tokens:
            if self._stop_floor is None:
                before = self.tokenizer.decode(self.tokens[: sp.min_tokens - 1]) if sp.min_tokens > 1 else ""
                self._stop_floor = len(before.rstrip("\ufffd"))  # an unfinished character may end a stop string
            floor = self._stop_floor
            found = [(i, len(s)) for s in sp.stop if (i := text.find(s, max(0, floor - len(s) + 1))) >= 0]
            if found:
                at, size = min(found)
                text = text[: at + size if sp.include_stop_str_in_output else at]
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
        return Completion(self.tokens, self.logprobs, self.top_logprobs, self.finish_reason or "length", text,
                          self.prompt_logprobs, self.prompt_top_logprobs)  # fmt: skip
