"""The contract between the scheduler and the runner: what a step runs (`Prefill`, `Decode`, `Speculate`,
with each row's sampling `Settings`), the shapes they are padded to (`Shapes`), and what each row produced
(`Step`). Plain numpy arrays: the scheduler fills them without a device, the runner puts them on one.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from meshlm.serve.config import PREFILL_TOKENS
from meshlm.serve.pages import pages_for
from meshlm.serve.params import MAX_LOGIT_BIAS, MAX_STOP_IDS, SamplingParams

MAX_CHUNK = 64  # decode steps per device call at most; one compiled loop serves every chunk size up to it
MIN_PROMPT_BUCKET = 16
MIN_DECODE_TOKENS = 128  # a decode reads at least this many cache slots per row (fewer shapes to compile)
# A prefill call's cost in padded tokens' worth, to group rows into calls (`Shapes.prefill_cost`): a token
# costs 1, each key it attends over 1 / ATTENDED_KEYS_PER_TOKEN more, and a call CALL_TOKENS. Measured on a
# CPU (GPT-J d_model 256): a call of 1 x 64 tokens over 128 keys 25 ms, of 16 x 64 over 128 keys 166 ms,
# over 1280 keys 522 ms.
ATTENDED_KEYS_PER_TOKEN = 1024
CALL_TOKENS = 128


class Settings(NamedTuple):
    """Per-row sampling settings: host arrays the scheduler fills (`settings_for`), on the device in the
    compiled steps."""

    temperature: np.ndarray  # [B] float32, 0 = greedy
    top_k: np.ndarray  # [B] int32
    top_p: np.ndarray  # [B] float32
    penalty: np.ndarray  # [B] float32
    max_new: np.ndarray  # [B] int32
    stop_ids: np.ndarray  # [B, MAX_STOP_IDS] int32, -1 = unused
    seed: np.ndarray  # [B] uint32
    presence: np.ndarray  # [B] float32
    frequency: np.ndarray  # [B] float32
    min_p: np.ndarray  # [B] float32, 0 = off
    min_tokens: np.ndarray  # [B] int32
    bias_ids: np.ndarray  # [B, MAX_LOGIT_BIAS] int32, -1 = unused
    bias: np.ndarray  # [B, MAX_LOGIT_BIAS] float32
    logprobs: np.ndarray  # [B] int32: top alternatives wanted


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


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's output-constraint bitmask: a bit per token of the (padded) vocabulary."""
    return -(-vocab_size // 32)


def _bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


def _powers(lo: int, hi: int, factor: int = 2) -> list[int]:
    """lo, lo * factor, ... below hi, then hi."""
    out = []
    while lo < hi:
        out.append(lo)
        lo *= factor
    return [*out, hi]


@dataclass(frozen=True)
class Shapes:
    """The shapes the programs are compiled for: rows bucketed to powers of two the mesh's batch axes divide,
    prompt lengths to powers of four, page tables to powers of two; the scheduler fills batches to them."""

    max_batch: int
    max_len: int
    page_size: int
    batch_ways: int

    @classmethod
    def of(cls, max_batch: int, max_len: int, page_size: int, batch_ways: int) -> Shapes:
        """The shapes for at most `max_batch` rows, rounded up to a bucket."""
        rows = cls(max_batch, max_len, page_size, batch_ways).batch_bucket(max_batch)
        return cls(rows, max_len, page_size, batch_ways)

    @property
    def max_pages(self) -> int:
        """Pages of one whole row."""
        return pages_for(self.max_len, self.page_size)

    def batch_bucket(self, n: int) -> int:
        """Rows are padded to a power of two that the mesh's batch axes divide."""
        b = _bucket(n)
        return -(-b // self.batch_ways) * self.batch_ways

    def decode_batches(self) -> list[int]:
        return sorted({self.batch_bucket(n) for n in _powers(1, self.max_batch)})

    def page_buckets(self) -> list[int]:
        """Table widths of a decode: powers of two from MIN_DECODE_TOKENS' worth of pages."""
        return _powers(min(pages_for(MIN_DECODE_TOKENS, self.page_size), self.max_pages), self.max_pages)

    def page_bucket(self, n: int) -> int:
        return next(b for b in self.page_buckets() if b >= n)

    def prompt_buckets(self) -> list[int]:
        """Prompt lengths of a prefill: powers of four from MIN_PROMPT_BUCKET."""
        return _powers(min(MIN_PROMPT_BUCKET, self.max_len), self.max_len, factor=4)

    def prompt_bucket(self, n: int) -> int:
        return next(b for b in self.prompt_buckets() if b >= n)

    def prompt_chunk(self, budget: int) -> int:
        """The tokens of a long prompt that one step prefills within `budget`: the largest prompt bucket of whole
        pages within it (a chunk then fills its bucket), else the whole pages within it; a row's chunks start at
        page boundaries, as a prefill's writes do (`model.decode`'s `whole_pages`)."""
        whole = [b for b in self.prompt_buckets() if b <= budget and b % self.page_size == 0]
        return max(whole, default=budget // self.page_size * self.page_size)

    def prefill_rows(self, n: int) -> int:
        """Rows of a prefill for n new rows: powers of 4 (1, 4, 16, ...), so few prefill shapes compile."""
        rows = 1
        while rows < n:
            rows *= 4
        return min(self.batch_bucket(rows), self.max_batch)

    def prefill_widths(self, t: int) -> list[int]:
        """Page-table widths of a prefill of prompt bucket `t`: the narrowest decode width that holds t tokens
        (a prefill's attention reads every page of its table: rows without a long cached prefix need no
        more), and a whole row's."""
        return sorted({self.page_bucket(pages_for(t, self.page_size)), self.max_pages})

    def prefill_width(self, t: int, pages: int) -> int:
        """The table width of a prefill of prompt bucket `t` whose rows hold at most `pages` pages."""
        return next(w for w in self.prefill_widths(t) if w >= pages)

    def prefill_shapes(self) -> list[tuple[int, int, int]]:
        """(rows, prompt bucket, table width) triples a prefill can take."""
        rows = sorted({self.prefill_rows(n) for n in range(1, self.max_batch + 1)})
        return [(b, t, w) for t in self.prompt_buckets() for b in rows if b == rows[0] or b * t <= PREFILL_TOKENS
                for w in self.prefill_widths(t)]  # fmt: skip

    def prefill_cost(self, n: int, t: int, width: int) -> float:
        """What a prefill call of `n` rows (padded to `prefill_rows`) of prompt bucket `t` over `width` pages
        costs, in padded tokens' worth (see ATTENDED_KEYS_PER_TOKEN)."""
        keys = width * self.page_size
        return self.prefill_rows(n) * t * (1 + keys / ATTENDED_KEYS_PER_TOKEN) + CALL_TOKENS


class Prefill(NamedTuple):
    """New rows' prompts (the part not in the prefix cache) into `slots`: tokens and mask [rows, bucket],
    page tables [rows, width] (`Shapes.prefill_width`), the cached length each starts from, the tokens
    each has seen [rows, vocab] (for the repetition penalty) and their sampling settings. Padding rows have
    slots out of range.

    A scored row's first `scored` [rows] positions are scored (0: not scored); `refed` [rows] is 1 where a
    scored row's first token is its cached prefix's last, run again for the logits that score the token
    after it."""

    slots: np.ndarray
    tokens: np.ndarray
    mask: np.ndarray
    table: np.ndarray
    start: np.ndarray
    seen: np.ndarray
    settings: Settings
    refed: np.ndarray
    scored: np.ndarray
    adapter: np.ndarray  # [rows] each row's adapter slot (0: the base alone)
    allowed: np.ndarray  # [rows, words] each row's output-constraint bitmask for its first token (zeros: none)


class Decode(NamedTuple):
    """Up to `chunk` tokens of the rows in `slots`, over their page tables [rows, bucketed width], each among
    the tokens `allowed` [rows, words] allows (zeros: any)."""

    slots: np.ndarray
    table: np.ndarray
    chunk: int
    allowed: np.ndarray


class Mixed(NamedTuple):
    """A prefill call and one decode step of other rows, run in one pass over the weights: the rows decoding take a
    token while a prompt is prefilled, for little more than the prefill's own weight read. The decode's rows and
    table are padded to the runner's widest (`Runner.run_mixed`), so one program serves each prefill shape."""

    prefill: Prefill
    decode: Decode


class Speculate(NamedTuple):
    """One speculative step: `proposals` [rows, k] (-1: none; all -1 with a draft model, which proposes on the
    device) verified together."""

    slots: np.ndarray
    table: np.ndarray
    proposals: np.ndarray


# ---------------------------------------------------------------------------------------------------
# The runner
