"""What a request asks of a row: `SamplingParams` and the checks every token id and setting goes through.
Host-only: the scheduler and the front doors read it without a device."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from meshlm.config import InputError
from meshlm.serve.grammar import Constraint

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
    `meshlm.serve.grammar.Constraint`: a JSON schema, regex, choice or grammar) allows only the tokens that keep
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


SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))  # the settings a row takes, by name


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
