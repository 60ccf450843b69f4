"""Constrained output: JSON schemas, regexes, choices and grammars as per-step token bitmasks.

A request's constraint becomes a `Constraint` (the server reads it from OpenAI's and vLLM's fields:
`meshlm.http.constraints`); `Grammars` compiles it once for the model's
tokenizer, and each row being generated gets a `Matcher` that writes the tokens allowed next as a bitmask
row (bit t of int32 word t // 32) for the sampler, and advances by the token sampled.

llguidance does the matching, rather than xgrammar or outlines: it needs no torch, ships one abi3 CPU wheel,
compiles a schema in about a millisecond with no per-schema vocabulary pass, and fills a mask in tens of
microseconds; vLLM serves it as its `guidance` backend, so outputs follow the same rules there. JSON keeps
llguidance's defaults, as vLLM's: properties in the schema's order, whitespace between tokens allowed.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np
from llguidance.tiktoken import lltokenizer_from_encoding

from meshlm.config import ConfigError, InputError, one_line
from meshlm.tokenizer import HFTokenizer, TiktokenTokenizer, Tokenizer

KINDS = ("json", "regex", "choice", "grammar")
CACHE_SIZE = 256  # compiled grammars a Grammars keeps: a pristine matcher each, copied for every row
# Error messages carry no parser state or grammar dump: they go back to whoever sent the request.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# Budgets a constraint is held to before it is admitted (`Grammars.vet`), so that no request can fail while
# generating for want of them, nor stall the rows it runs beside:
MAX_CHOICES = LIMITS.max_items_in_row  # llguidance's items in a row: a longer choice list fails mid-generation
MAX_CONSTRAINT_BYTES = 256 * 1024  # a schema's, regex's, grammar's or choice list's text
MAX_REPEAT = 2000  # a bound in {n}, {n,}, {n,m}: each token's mask costs in proportion (e{100000}: 4 s a token)
MASK_SECONDS = 0.5  # a constraint's first token mask at most (each step of its row costs about as much)
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


@dataclass(frozen=True)
class Constraint:
    """What a generation must match. Hashable on (kind, text): the compile cache's key.

    `param` is the request field it came from, so a compile error names it; it is not part of the key."""

    kind: str  # one of KINDS
    text: str  # the JSON schema's text (keys in the given order: it is the order of the output), the regex,
    # the JSON list of choices, or the grammar (Lark, llguidance's syntax, or GBNF)
    param: str | None = field(default=None, compare=False)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | None = None, param: str | None = None) -> Constraint:
        """Output that is JSON valid against `schema`; None (or {}) is any JSON value."""
        return cls("json", json.dumps({} if schema is None else schema, separators=(",", ":")), param)

    @classmethod
    def json_object(cls, param: str | None = None) -> Constraint:
        """Any JSON object, as OpenAI's `response_format: {"type": "json_object"}`."""
        return cls.json_schema({"type": "object"}, param)

    @classmethod
    def regex(cls, pattern: str, param: str | None = None) -> Constraint:
        """Output that matches `pattern` whole (Rust regex syntax, as vLLM's guided_regex with llguidance)."""
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, choices: list[str], param: str | None = None) -> Constraint:
        """Output that is exactly one of `choices`."""
        return cls("choice", json.dumps(list(choices)), param)

    @classmethod
    def grammar(cls, grammar: str, param: str | None = None) -> Constraint:
        """Output that the grammar (Lark in llguidance's syntax, or GBNF) derives from its start rule."""
        return cls("grammar", grammar, param)


# ---------------------------------------------------------------------------------------------------
# Compiling and matching


@functools.lru_cache(maxsize=8)
def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` (each token's bytes, a trie over them): ~0.2 s to build, so once each.

    Built from the tokenizer's own tables (tiktoken's ranks, the tokenizer.json), not from decoded ids: a
    GPT-2 byte token holding part of a UTF-8 character has no text of its own."""
    if isinstance(tokenizer, TiktokenTokenizer):
        return lltokenizer_from_encoding(tokenizer.encoding, eos_token=tokenizer.eot_id)
    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eot_id)
    raise ConfigError(f"constrained output needs a tiktoken or tokenizer.json tokenizer, not {tokenizer.name}")


class Grammars:
    """Compiles constraints for one tokenizer, caching the compiled grammars (LRU, by Constraint)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        """`vocab_size`: the model's (padded) vocabulary, the width of a bitmask row; ids past the
        tokenizer's are never allowed."""
        if vocab_size < tokenizer.vocab_size:
            raise ConfigError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")
        self.tokenizer = tokenizer
        self.words = -(-vocab_size // 32)  # int32 words of one row's bitmask
        self._ll = ll_tokenizer(tokenizer)
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._vetted: OrderedDict[Constraint, str | None] = OrderedDict()  # constraint -> its refusal, or None
        self._lock = threading.Lock()  # requests are checked on the server's threads, matchers made on the engine's

    def check(self, c: Constraint) -> None:
        """Compile `c` (once: cached); an invalid schema, regex or grammar is an InputError with llguidance's
        reason, naming the request field `c` came from, as is one over the size budgets."""
        self._pristine(c)

    def vet(self, c: Constraint) -> None:
        """`check`, then time the mask of a fresh row's first token (llguidance builds its lexer lazily, in every
        row's matcher, so a compact regex like e{100000} compiles in a millisecond and then takes seconds per
        token): InputError when it takes more than MASK_SECONDS. Once per constraint (its verdict is cached).
        Holds no lock while it works and touches no device: a server runs it on a worker thread."""
        with self._lock:
            if c in self._vetted:
                self._vetted.move_to_end(c)
                if (refusal := self._vetted[c]) is not None:
                    raise InputError(refusal, c.param)
                return
        refusal = None
        try:
            matcher = self.matcher(c)
            start = time.perf_counter()
            matcher.fill(np.zeros(self.words, np.int32))
            took = time.perf_counter() - start
            if took > MASK_SECONDS:
                refusal = (f"this {c.kind} is too complex: a token's mask took {took:.1f} s "
                           f"(at most {MASK_SECONDS} s; a smaller one stalls no one)")  # fmt: skip
        except InputError as e:
            refusal = str(e)
        with self._lock:
            self._vetted[c] = refusal
            if len(self._vetted) > CACHE_SIZE:
                self._vetted.popitem(last=False)
        if refusal is not None:
            raise InputError(refusal, c.param)

    def matcher(self, c: Constraint) -> Matcher:
        """A matcher for one generation under `c`, at its start."""
        return Matcher(self._pristine(c).deep_copy(), self.tokenizer.vocab_size)

    def _pristine(self, c: Constraint) -> llguidance.LLMatcher:
        """The compiled matcher of `c` at its start, never advanced: each row's is a copy (about a microsecond)."""
        with self._lock:
            if c in self._compiled:
                self._compiled.move_to_end(c)
                return self._compiled[c]
        check_size(c)
        try:
            spec = llguidance.grammar_from(c.kind, c.text)  # type: ignore[arg-type]
        except ValueError as e:  # a GBNF grammar that does not convert; a choice list that is not JSON
            raise InputError(f"invalid {c.kind}: {_reason(str(e))}", c.param) from None
        compiled = llguidance.LLMatcher(self._ll, spec, log_level=0, limits=LIMITS)
        if compiled.is_error():
            raise InputError(f"invalid {c.kind}: {_reason(compiled.get_error())}", c.param)
        with self._lock:
            self._compiled[c] = compiled
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled


def check_size(c: Constraint) -> None:
    """InputError for a constraint over the size budgets (MAX_CONSTRAINT_BYTES, MAX_CHOICES, MAX_REPEAT)."""
    if len(c.text.encode()) > MAX_CONSTRAINT_BYTES:
        raise InputError(f"{c.param or c.kind}: {len(c.text.encode()):,} bytes; at most {MAX_CONSTRAINT_BYTES:,}",
                         c.param)  # fmt: skip
    if c.kind == "choice" and (n := len(json.loads(c.text))) > MAX_CHOICES:
        raise InputError(f"{c.param or c.kind}: {n:,} choices; at most {MAX_CHOICES:,}", c.param)
    if c.kind in ("regex", "grammar"):
        for m in _REPEAT.finditer(c.text):
            if max(int(m.group(1)), int(m.group(2) or 0)) > MAX_REPEAT:
                raise InputError(f"{c.param or c.kind}: repetition {m.group(0)} exceeds {MAX_REPEAT} "
                                 "(each token's mask would cost in proportion)", c.param)  # fmt: skip


def _reason(message: str) -> str:
    """llguidance's message on one line, without the `<state>` / `<non-verbose/>` block it may end with."""
    return one_line(message.split("\n<", 1)[0])


class Matcher:
    """One generation's position in its grammar: the bitmask of the tokens allowed next, and the step."""

    def __init__(self, matcher: llguidance.LLMatcher, n_tokens: int):
        self._m = matcher
        self._ll_words = -(-n_tokens // 32)  # the words llguidance writes; the row's others stay zero

    def fill(self, out: np.ndarray) -> None:
        """Write the allowed-next-token bitmask into `out` (int32 [words], a row of the batch's mask). Once the
        grammar is complete, only end-of-sequence is allowed."""
        if out.dtype != np.int32 or out.ndim != 1 or out.size < self._ll_words or not out.flags.c_contiguous:
            raise ValueError(f"a bitmask row is a contiguous int32 [words] array, not {out.dtype} {out.shape}")
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, self._ll_words * 4)
        out[self._ll_words :] = 0
        if self._m.is_error():  # a runtime limit (items in a row, lexer fuel): the request's constraint is at fault
            raise InputError(_reason(self._m.get_error()))

    def accept(self, token: int) -> None:
        """Advance by the sampled `token`; a RuntimeError if the mask did not allow it (a sampler bug)."""
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"token {token} is not allowed by the output constraint: {_reason(self._m.get_error())}")

    @property
    def done(self) -> bool:
        """The output is complete: the grammar allows nothing more but end-of-sequence (or took it already)."""
        return self._m.is_stopped()


@functools.cache
def all_allowed(words: int) -> np.ndarray:
    """The bitmask row of an unconstrained row: every bit set (read-only: one array is shared)."""
    row = np.full(words, -1, dtype=np.int32)
    row.flags.writeable = False
    return row
