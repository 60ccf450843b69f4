"""The device sampler: pure functions over logits [B, V] with per-row settings, in vLLM's and transformers'
order: logit bias, repetition penalty, frequency and presence penalties, min_tokens' ban on stop tokens (these
change the greedy choice too), then temperature, top-k, top-p, min-p (transformers' order), then greedy argmax
or a seeded draw. `choose` applies them inside the runner's compiled steps (`meshlm.serve.runner`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from meshlm.serve.batch import Settings
from meshlm.serve.params import TOP_LOGPROBS

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


DRAW_BLOCK = 256  # tokens per block of `draw`'s first level


def sample(logits: jax.Array, keys: jax.Array) -> jax.Array:
    """One draw per row from softmax(logits): `draw` over exp(logits - the row's max). A token at -inf
    (filtered out, or refused by an output constraint) has weight 0 and is never taken; a row of NaN logits
    (a diverged adapter's) draws an id past the vocabulary, as its greedy argmax does, so the scheduler
    fails it."""
    x = logits.astype(jnp.float32)
    return draw(jnp.exp(x - x.max(axis=-1, keepdims=True)), keys)


def draw(weights: jax.Array, keys: jax.Array) -> jax.Array:
    """One draw per row in proportion to `weights` [B, V] (>= 0), by inverting the cumulative sum in two
    levels: a block of DRAW_BLOCK tokens by the blocks' sums, then a token of that block, one uniform each:
    two uniforms a row where a Gumbel-max draw takes V, and two short scans where one over the whole
    vocabulary costs its length in steps. `choose` at temperature 0.8 over 16 rows x 50,400: 1.25 ms on a
    2-core CPU against the Gumbel-max draw's 3.71 (`benchmarks/sampler.py`). An entry of weight 0 is never
    taken; a row with no positive total (NaN weights, or none above 0) draws V, an id past the vocabulary."""
    B, V = weights.shape
    blocks = -(-V // DRAW_BLOCK)
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, blocks * DRAW_BLOCK - V))).reshape(B, blocks, DRAW_BLOCK)
    u = 1.0 - jax.vmap(lambda key: jax.random.uniform(key, (2,)))(keys)  # [B, 2] in (0, 1]
    sums = w.sum(axis=-1)  # [B, blocks]
    block = jnp.maximum(_first_reaching(sums, u[:, 0]), 0)  # -1 (no weight) gathers block 0; V is returned
    chosen = jnp.take_along_axis(w, block[:, None, None], axis=1)[:, 0]  # [B, DRAW_BLOCK]
    token = block * DRAW_BLOCK + _first_reaching(chosen, u[:, 1])
    return jnp.where(sums.sum(axis=-1) > 0, token, V)


def _first_reaching(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Per row of `weights` [B, n], the first entry of positive weight whose cumulative sum reaches u [B]
    (in (0, 1]) times the row's total. Where rounding leaves none reaching it (a parallel scan's sums need
    not be exactly monotone), the last entry of positive weight; -1 where there is none."""
    n = weights.shape[-1]
    cdf = jnp.cumsum(weights, axis=-1)
    ids = jnp.arange(n, dtype=jnp.int32)
    drawable = weights > 0
    first = jnp.min(jnp.where(drawable & (cdf >= u[:, None] * cdf[:, -1:]), ids, n), axis=-1)
    last = jnp.max(jnp.where(drawable, ids, -1), axis=-1)
    return jnp.where(first < n, first, last)


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


def unpack_bitmask(words: jax.Array, vocab_size: int) -> jax.Array:
    """[B, vocab_size] bool from a bitmask [B, ceil(vocab_size / 32)] int32: bit t % 32 of word t // 32 is
    token t (the layout `meshlm.serve.grammar.Matcher.fill` writes)."""
    ids = jnp.arange(vocab_size)
    return ((jnp.take(words, ids // 32, axis=1) >> (ids % 32)) & 1).astype(bool)
