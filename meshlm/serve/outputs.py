"""The host side of a generated row (`RowOutput`): collects its tokens, detokenises them (`Detokenizer`:
incrementally where the tokenizer allows), applies stop strings and holds back text that could still become
one; `Completion` is a finished row."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from meshlm.serve.batch import Step
from meshlm.serve.params import SamplingParams
from meshlm.tokenizer import Tokenizer


class Detokenizer:
    """A row's text as its tokens arrive, the same as decoding them whole at every step.

    A byte-level tokenizer (`byte_level`: its text is its tokens' bytes in order, read as UTF-8 with each
    invalid or unfinished sequence replaced by U+FFFD) is decoded incrementally: once the text of the tokens
    so far ends on a whole character (no U+FFFD last), the decoder starts afresh at the next byte, so that text
    is kept and later steps decode only the tokens after it. A token that splits a multi-byte character
    leaves the tail open until a later token finishes it. Other tokenizers (a decoder that strips a leading
    space or joins tokens otherwise) are decoded whole."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.incremental = bool(getattr(tokenizer, "byte_level", False))
        self._settled = 0  # tokens whose text is kept
        self._text = ""  # their text

    def text(self, tokens: list[int]) -> str:
        """The text of `tokens`, which extend the tokens of the previous call."""
        if not self.incremental:
            return self.tokenizer.decode(tokens)
        if len(tokens) < self._settled:  # not an extension: start again
            self._settled, self._text = 0, ""
        tail = self.tokenizer.decode(tokens[self._settled :])
        if tail.endswith("\ufffd"):
            return self._text + tail
        self._settled, self._text = len(tokens), self._text + tail
        return self._text


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
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that ended it; None: length


@dataclass
class RowOutput:
    """A row's output as it arrives: tokens, incremental text with stop strings and held-back partials."""

    sampling: SamplingParams
    tokenizer: Tokenizer | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the row
    text: str = ""
    sent: int = 0  # characters of `text` already handed out by `take_text`
    # with `sampling.prompt_logprobs`: each prompt token's logprob and top alternatives (None for the first)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # characters of text the first min_tokens - 1 tokens make: a stop string must end beyond them
    _stop_floor: int | None = field(default=None, repr=False)
    _detokenizer: Detokenizer | None = field(default=None, repr=False)

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
                self.finish_reason, self.stop_reason = "stop", token
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
        if self._detokenizer is None:
            self._detokenizer = Detokenizer(self.tokenizer)
        text = self._detokenizer.text(self.tokens)
        sp = self.sampling
        if sp.stop and len(self.tokens) >= sp.min_tokens:
            if self._stop_floor is None:
                before = self.tokenizer.decode(self.tokens[: sp.min_tokens - 1]) if sp.min_tokens > 1 else ""
                self._stop_floor = len(before.rstrip("\ufffd"))  # an unfinished character may end a stop string
            floor = self._stop_floor
            found = [(i, len(s), s) for s in sp.stop if (i := text.find(s, max(0, floor - len(s) + 1))) >= 0]
            if found:
                at, size, stop = min(found)
                text = text[: at + size if sp.include_stop_str_in_output else at]
                self.finish_reason, self.stop_reason = "stop", stop
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
                          self.prompt_logprobs, self.prompt_top_logprobs, self.stop_reason)  # fmt: skip
