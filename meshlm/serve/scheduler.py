"""The engine's host side: requests, the queue, the slots and the KV pages, and the batch each step runs.

Continuous batching over a paged KV cache:
- requests wait in a queue and join the running batch between decode chunks, when a slot and the
  KV pages for their whole budget (prompt + max_new_tokens) are free; they leave as soon as they
  finish, are cancelled or fail, and give their pages back at once;
- a step prefills at most `prefill_tokens` prompt tokens: a longer prompt runs a chunk a step (`prefilling`
  until its last), and the rows already running decode between its chunks;
- a row holds pages only for the tokens it has (`meshlm.serve.pages`), so memory follows live tokens;
  rows whose prompts share full pages of a prefix share those pages (prefix caching);
- a decode chunk runs only the running rows (bucketed to a power of two) over as many pages as the
  longest of them holds (bucketed too), so its cost follows the live rows and their lengths.

The scheduler never touches a device (it imports no jax): it describes each batch in plain arrays
(`meshlm.serve.batch`'s `Prefill`, `Decode`, `Speculate`) and reads back what each row produced.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import NamedTuple

import numpy as np

from meshlm.config import InputError
from meshlm.serve.batch import (
    MAX_CHUNK,
    Decode,
    Prefill,
    Shapes,
    Speculate,
    Step,
    bitmask_words,
    settings_for,
)
from meshlm.serve.config import PREFILL_TOKENS, check_prefill_tokens
from meshlm.serve.grammar import Matcher
from meshlm.serve.outputs import RowOutput
from meshlm.serve.pages import PAD_PAGE, PagePool, pages_for
from meshlm.serve.params import TOP_LOGPROBS

_ids = count()


@dataclass(eq=False)
class Request:
    """One row to generate: its prompt, its output as it arrives, and the scheduler's bookkeeping.

    `notify` (if given) is called from the engine's thread after every change; `lock` guards `output`
    between that thread and a reader."""

    prompt: list[int]
    output: RowOutput
    notify: Callable[[], None] | None = None
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    error: str | None = None  # why the row failed: it alone ends (see `fail`)
    error_status: int = 500  # the HTTP status that error maps to (400: the request's own constraint failed)
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None  # perf_counter time of the first token
    slot: int = -1
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens in the cache
    piece: int = 0  # tokens its next prefill call runs (`Scheduler._piece`), set when the call is scheduled
    proposed: int = 0  # speculated tokens offered
    accepted: int = 0  # of which kept
    adapter: int = 0  # the adapter slot the row runs (0: the base alone)
    adapter_key: int = 0  # which adapter that is (0: none): the salt of its prefix-cache keys
    matcher: Matcher | None = None  # where the output stands in its constraint (`SamplingParams.constraint`)

    @property
    def finished(self) -> bool:
        return self.output.finished or self.cancelled or self.error is not None

    def fail(self, error: str, status: int = 500) -> None:
        """End this row alone with `error`; the step frees its slot and pages."""
        self.error, self.error_status = error, status
        _notify(self)

    def fail_from(self, what: str, e: Exception) -> None:
        """End this row alone for `e`, raised while `what`: 400 for an InputError (the request's own), else 500."""
        self.fail(f"{what}: {e}", 400 if isinstance(e, InputError) else 500)

    @property
    def prefilling(self) -> bool:
        """Whether part of its prompt is still to be prefilled (a long prompt runs a chunk a step): it holds a
        slot and pages but does not decode yet."""
        return self.length < len(self.prompt)

    @property
    def budget(self) -> int:
        """Tokens this row may ever hold in the cache."""
        return len(self.prompt) + self.output.sampling.max_new_tokens

    @property
    def scored(self) -> bool:
        """Whether the prompt's tokens are scored (their logprobs reported)."""
        return self.output.sampling.prompt_logprobs is not None

    @property
    def refed(self) -> int:
        """1 when a scored row runs its cached prefix's last token again, for the logits after it."""
        return int(self.scored and self.length > 0)

    def prefill_from(self, cached: int) -> int:
        """Tokens its prefill would run past a cached prefix of `cached` tokens (admission asks before it
        sets `length`)."""
        return len(self.prompt) - cached + int(self.scored and cached > 0)

    @property
    def to_score(self) -> int:
        """Positions of its prefill that score a prompt token (each scores the token after it): the fed
        tokens but the prompt's last, or none when the prompt is not scored."""
        return len(self.prompt) - self.length - (1 - self.refed) if self.scored else 0


@dataclass
class Stats:
    """What the scheduler has done, for /health and /metrics."""

    tokens_generated: int = 0
    prompt_tokens: int = 0
    prefill_calls: int = 0
    decode_calls: int = 0
    proposed: int = 0  # speculated tokens offered, all rows
    accepted: int = 0  # of which kept
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


class Scheduled(NamedTuple):
    """A batch to run and the requests in its rows, in order."""

    rows: list[Request]
    batch: Prefill | Decode | Speculate


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


class Scheduler:
    """The queue and `max_rows` slots (default `shapes.max_batch`, the compiled rows, which round `max_rows` up to a
    bucket) over a pool of `n_pages` KV pages. `speculate` tokens per row and step are proposed by prompt lookup
    over `ngram` tokens, or by a draft model on the device (`draft`). A step prefills at most `prefill_tokens` prompt
    tokens (a longer prompt a chunk a step: `Shapes.prompt_chunk`)."""

    def __init__(
        self,
        shapes: Shapes,
        n_pages: int,
        vocab_size: int,
        *,
        n_tokens: int | None = None,
        prefix_caching: bool = True,
        speculate: int = 0,
        ngram: int = 0,
        draft: bool = False,
        max_rows: int | None = None,
        prefill_tokens: int = PREFILL_TOKENS,
    ):
        """`n_tokens`: the ids a row may produce (the tokenizer's; default `vocab_size`): a row whose step
        yields another (NaN logits from a diverged adapter pick a padded id) fails alone."""
        self.shapes, self.vocab_size = shapes, vocab_size
        self.n_tokens = vocab_size if n_tokens is None else n_tokens
        self.words = bitmask_words(vocab_size)
        self.speculate, self.ngram, self.draft = speculate, ngram, draft
        self.page_size = shapes.page_size
        self.pool = PagePool(n_pages, shapes.page_size, prefix_caching)
        self.queue: deque[Request] = deque()
        if max_rows is not None and not 1 <= max_rows <= shapes.max_batch:
            raise ValueError(f"max_rows {max_rows} must be 1 to the compiled batch's {shapes.max_batch}")
        self.slots: list[Request | None] = [None] * (max_rows or shapes.max_batch)  # no more rows run at once
        check_prefill_tokens(prefill_tokens, shapes.page_size)
        self.prefill_tokens, self.prompt_chunk = prefill_tokens, shapes.prompt_chunk(prefill_tokens)
        self.stats = Stats()

    # requests -------------------------------------------------------------------------------------

    def check(self, prompt_len: int, max_new: int) -> None:
        """A clear error for a request that can never run."""
        max_len = self.shapes.max_len
        if prompt_len < 1:
            raise InputError("a prompt must have at least one token", param="prompt")
        if prompt_len > max_len:
            raise InputError(f"prompt has {prompt_len} tokens, more than the context of {max_len}")
        if prompt_len + max_new > max_len:
            raise InputError(
                f"prompt ({prompt_len} tokens) plus max_new_tokens ({max_new}) exceeds the context of {max_len}"
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
        """The rows holding a slot: decoding, or still prefilling a long prompt."""
        return [r for r in self.slots if r is not None]

    @property
    def decoding(self) -> list[Request]:
        """The rows that decode: holding a slot, their prompts prefilled, not finished (a row that finished within
        this step keeps its slot until the step's calls have all run)."""
        return [r for r in self.slots if r is not None and not r.prefilling and not r.finished]

    def has_work(self) -> bool:
        return bool(self.queue) or bool(self.running)

    def fail_all(self, error: str) -> None:
        """Fail every queued and running row and free their slots and every page (after a device failure,
        when the engine starts from a fresh pool: nothing cached survives it)."""
        for r in [*self.queue, *self.running]:
            r.error = error
            _notify(r)
        self.queue.clear()
        for r in self.running:
            r.pages = []
            self.slots[r.slot] = None
        self.pool.reset()

    def drop_finished(self) -> None:
        for r in self.running:
            if r.finished:
                self._release(r)
        self.queue = deque(r for r in self.queue if not r.cancelled)

    def _release(self, r: Request) -> None:
        self.pool.release(r.pages, failed=r.error is not None)
        r.pages = []
        self.slots[r.slot] = None

    # batches --------------------------------------------------------------------------------------

    def schedule_prefill(self) -> list[Scheduled]:
        """This step's prefill calls, grouped by length (`_groups`), within its `prefill_tokens`: the next piece of
        each prompt being prefilled (in slot order, while the budget lasts), then the queued rows (in order) that
        free slots, the pool's pages and what is left of the budget take, with their cached prefix; none when
        nothing runs."""
        going, left = [], self.prefill_tokens
        for r in self.running:
            if r.prefilling and (piece := self._piece(r, r.length, left)):
                r.piece, left = piece, left - piece
                going.append(r)
        return [self._prefill(rows) for rows in self._groups(going + self._admit(left))]

    def _piece(self, r: Request, cached: int, left: int) -> int:
        """Tokens row r's next prefill runs past `cached` tokens within `left` of the step's budget (0: it waits):
        the rest of its prompt (`Request.prefill_from`) where it fits, else one chunk (`prompt_chunk`) where that
        fits. The step's first prefill always runs (the rest, or a chunk where longer), and a scored row's prompt
        runs whole, its scores coming from one call: such a prompt longer than the budget runs alone."""
        rest = r.prefill_from(cached)
        if rest <= left or (r.scored and left == self.prefill_tokens):
            return rest
        return self.prompt_chunk if not r.scored and self.prompt_chunk <= left else 0

    def _end(self, r: Request) -> int:
        """The tokens row r holds after its next prefill."""
        return r.length - r.refed + r.piece

    def _prefill(self, rows: list[Request]) -> Scheduled:
        """One prefill call of admitted rows, each its next piece (`_piece`)."""
        n = self.shapes.prefill_rows(len(rows))
        new = [r.prompt[r.length - r.refed : self._end(r)] for r in rows]
        t = self.shapes.prompt_bucket(max(map(len, new)))
        for r in rows:
            self._grow(r, self._end(r))
        width = self.shapes.prefill_width(t, max(len(r.pages) for r in rows))
        tokens = np.zeros((n, t), np.int32)
        mask = np.zeros((n, t), bool)
        table = np.full((n, width), PAD_PAGE, np.int32)
        start = np.zeros(n, np.int32)
        seen = np.zeros((n, self.vocab_size), bool)
        slots = np.full(n, self.shapes.max_batch, np.int32)  # padding rows: out of range, dropped
        for i, (r, prompt) in enumerate(zip(rows, new, strict=True)):
            tokens[i, : len(prompt)], mask[i, : len(prompt)] = prompt, True
            table[i, : len(r.pages)] = r.pages
            start[i], slots[i] = r.length, r.slot
            seen[i, r.prompt] = True
        settings = settings_for([r.output.sampling for r in rows], n)
        refed, scored, adapter = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32)
        refed[: len(rows)], scored[: len(rows)] = [r.refed for r in rows], [r.to_score for r in rows]
        adapter[: len(rows)] = [r.adapter for r in rows]
        allowed = self._allowed(rows, n)
        batch = Prefill(slots, tokens, mask, table, start, seen, settings, refed, scored, adapter, allowed)
        return Scheduled(rows, batch)

    def _groups(self, rows: list[Request]) -> list[list[Request]]:
        """Admitted rows split into the prefill calls of least total cost (`Shapes.prefill_cost`): sorted by
        their new tokens and cut into runs, so a short prompt is neither padded to a long one's bucket nor
        attends over its pages. Shortest first."""
        rows = sorted(rows, key=lambda r: r.piece)
        shapes = self.shapes
        best, cut = [0.0] + [float("inf")] * len(rows), [0] * (len(rows) + 1)
        for j in range(1, len(rows) + 1):
            t = shapes.prompt_bucket(rows[j - 1].piece)
            pages = 0
            for i in range(j - 1, -1, -1):  # the call of rows[i:j]
                pages = max(pages, pages_for(self._end(rows[i]), self.page_size))
                if i < j - 1 and shapes.prefill_rows(j - i) * t > PREFILL_TOKENS:
                    break
                cost = best[i] + shapes.prefill_cost(j - i, t, shapes.prefill_width(t, pages))
                if cost < best[j]:
                    best[j], cut[j] = cost, i
        groups, j = [], len(rows)
        while j:
            groups.append(rows[cut[j] : j])
            j = cut[j]
        return groups[::-1]

    def schedule_decode(self, chunk: int) -> Scheduled | None:
        """The running rows' next step: a speculative one when there are proposals, else a decode of up to
        `chunk` tokens (as many as a speculative step could keep, when speculating); None when none runs."""
        running = self.decoding
        if not running:
            return None
        proposals = self._proposals(running) if self.speculate else None
        if proposals is not None:
            k = proposals.shape[1]
            for i, r in enumerate(running):
                self._grow(r, r.length + 1 + (k if self.draft else int((proposals[i] >= 0).sum())))
            table, slots = self._tables(running, len(proposals))
            return Scheduled(running, Speculate(slots, table, proposals))
        chunk = min(chunk, MAX_CHUNK, self.speculate + 1 if self.speculate else MAX_CHUNK)
        if any(r.matcher is not None for r in running):  # each token's mask follows from the one before
            chunk = 1
        for r in running:
            self._grow(r, r.length + chunk)
        n = self.shapes.batch_bucket(len(running))
        table, slots = self._tables(running, n)
        return Scheduled(running, Decode(slots, table, chunk, self._allowed(running, n)))

    def _allowed(self, rows: list[Request], n: int) -> np.ndarray:
        """The rows' output-constraint bitmasks for their next token, padded to n rows (zeros: unconstrained)."""
        allowed = np.zeros((n, self.words), np.int32)
        for i, r in enumerate(rows):
            if r.matcher is not None and r.error is None:
                try:
                    r.matcher.fill(allowed[i])
                except Exception as e:  # this row's constraint failed: it alone ends (its tokens are dropped)
                    allowed[i] = 0
                    r.fail_from("the output constraint failed", e)
        return allowed

    def update(self, scheduled: Scheduled, step: Step, drop: bool = True) -> None:
        """Take in what a batch produced: each row's new tokens (and a prefill's prompt into the prefix
        cache); then free the rows that finished (unless not `drop`: an engine step's calls before its last, whose
        rows keep their slots and pages until every call of the step has run)."""
        rows, batch = scheduled
        chunked = set()  # rows whose prefill ran one chunk of their prompt, not its last: no token yet
        if isinstance(batch, Prefill):
            self.stats.prefill_calls += 1
            now = time.perf_counter()
            for i, r in enumerate(rows):
                held = self._end(r)
                if held < len(r.prompt):  # its chunk's pages are written: later rows may share them
                    r.length = held
                    self.pool.publish(r.prompt[:held], r.pages, None, r.adapter_key)
                    chunked.add(r)
                    continue
                try:
                    scores = self._score(r, step, i) if r.scored else None
                except Exception as e:  # as in `_take` below: one row's failure never fails the others
                    r.fail_from("generation failed for this request", e)
                    continue
                r.length = len(r.prompt)
                self.pool.publish(r.prompt, r.pages, scores, r.adapter_key)
                self.stats.prompt_tokens += len(r.prompt)
                r.first_token = now
        else:
            self.stats.decode_calls += 1
            for i, r in enumerate(rows):
                r.length += int(step.emitted[i].sum())
        if isinstance(batch, Speculate):
            k = batch.proposals.shape[1]
            offered_all = step.proposed[:, :k] >= 0
            kept_all = step.emitted[:, :k] & (step.token[:, :k] == step.proposed[:, :k])
            for i, r in enumerate(rows):
                offered, kept = int(offered_all[i].sum()), int(kept_all[i].sum())
                r.proposed, r.accepted = r.proposed + offered, r.accepted + kept
                self.stats.proposed, self.stats.accepted = self.stats.proposed + offered, self.stats.accepted + kept
        for i, r in enumerate(rows):
            if r.error is not None or r in chunked:
                continue  # failed while this batch was made: what it produced is dropped (or it has none yet)
            try:
                self._take(r, step, i)
            except Exception as e:  # one row's failure (a bad id, its constraint) never fails the others
                r.fail_from("generation failed for this request", e)
                continue
            _notify(r)
        if drop:
            self.drop_finished()

    def _take(self, r: Request, step: Step, i: int) -> None:
        """Row i's new tokens into its output and its constraint. An id past the tokenizer's never reaches the
        detokenizer: a ValueError."""
        emitted = step.token[i][step.emitted[i]]
        if emitted.size and not (0 <= emitted.min() and emitted.max() < self.n_tokens):
            bad = next(int(t) for t in emitted if not 0 <= t < self.n_tokens)
            raise ValueError(f"the model produced token id {bad}, outside the tokenizer's {self.n_tokens} ids "
                             "(its weights or its adapter's may hold NaN or inf)")  # fmt: skip
        with r.lock:
            before = len(r.output.tokens)
            r.output.add(step, i)
            self.stats.record(len(r.output.tokens) - before)
            if r.matcher is not None and not r.output.finished:
                for token in r.output.tokens[before:]:
                    r.matcher.accept(token)

    def _score(self, r: Request, step: Step, i: int) -> list[tuple[np.ndarray, ...]]:
        """Fill a scored row's prompt logprobs: those of its cached pages' tokens from the pool, the rest
        from this prefill. Returns the scores of the prompt's full pages, for the pool: logprobs [page_size],
        top ids and top logprobs [page_size, TOP_LOGPROBS] (NaN and -1 for the first token, which nothing
        predicts)."""
        size = self.page_size
        cached = [self.pool.scores[page] for page in r.pages[: r.length // size]]
        first = (np.full(1, np.nan, np.float32), np.full((1, TOP_LOGPROBS), -1, np.int32),
                 np.zeros((1, TOP_LOGPROBS), np.float32))  # fmt: skip
        # this prefill's position j scores prompt token r.length - r.refed + j + 1, up to the prompt's last; a
        # one-token prompt has nothing to score (and a call scoring no row returns no prompt logprobs)
        n = r.to_score
        fresh = (
            tuple(x[:0] for x in first)
            if n == 0
            else (step.prompt_logprob[i, :n], step.prompt_top_ids[i, :n], step.prompt_top_logprobs[i, :n])
        )
        lp, ids, lps = (np.concatenate(parts) for parts in zip(*(cached or [first]), fresh, strict=True))
        k = r.output.sampling.prompt_logprobs
        with r.lock:
            r.output.prompt_logprobs = [None, *lp[1:].tolist()]
            tops = zip(ids[1:, :k].tolist(), lps[1:, :k].tolist(), strict=True)
            r.output.prompt_top_logprobs = [None, *(list(zip(i, v, strict=True)) for i, v in tops)]
        pages = range(len(r.prompt) // size)
        return [tuple(x[p * size : (p + 1) * size] for x in (lp, ids, lps)) for p in pages]

    def _reserved(self) -> int:
        """Pages the running rows may still need for their budgets."""
        return sum(pages_for(r.budget, self.page_size) - len(r.pages) for r in self.running)

    def _admit(self, left: int) -> list[Request]:
        """Queued rows (in order) that a free slot, the pool's pages and `left` of the step's `prefill_tokens` can
        take (each its first piece, `_piece`), with their cached prefix.

        A row whose next page of prompt an admitted row is about to write, or a row still prefilling will write,
        waits for a later prefill, which finds that page cached: a multiple-choice task's continuations, a prompt
        sent `n` times, or prompts opening with one long context compute their shared context once."""
        free_slots = [i for i, r in enumerate(self.slots) if r is None]
        admitted: list[Request] = []
        deferred: list[Request] = []
        writing: dict[tuple, bool] = {}  # the pages being written (their prefix keys): with scores?
        for r in self.running:  # a prompt being prefilled (never scored) writes its pages from its length on
            if r.prefilling:
                keys = self.pool.keys(r.prompt, self.pool.matchable(r.prompt), r.adapter_key)
                writing |= dict.fromkeys(keys[r.length // self.page_size :], False)
        reserved = self._reserved()
        while self.queue and len(admitted) < len(free_slots):
            r = self.queue[0]
            keys = self.pool.keys(r.prompt, self.pool.matchable(r.prompt), r.adapter_key)
            shared = self.pool.match(r.prompt, scored=r.scored, salt=r.adapter_key)
            next_key = keys[len(shared)] if len(shared) < len(keys) else None
            if _written_now(next_key, r.scored, writing):
                self.pool.release(shared)
                deferred.append(self.queue.popleft())
                continue
            need = pages_for(r.budget, self.page_size) - len(shared)
            piece = self._piece(r, len(shared) * self.page_size, left)
            if not (piece and self.pool.available - reserved >= need):
                self.pool.release(shared)
                break
            self.queue.popleft()
            self.pool.record(len(r.prompt), len(shared))
            r.slot, r.pages, r.length = free_slots[len(admitted)], shared, len(shared) * self.page_size
            self.slots[r.slot] = r
            reserved += need
            r.piece, left = piece, left - piece
            admitted.append(r)
            for key in keys[len(shared) :]:
                writing[key] = writing.get(key, False) or r.scored
        self.queue.extendleft(reversed(deferred))
        return admitted

    def _grow(self, r: Request, tokens: int) -> None:
        """Give `r` pages for its first `tokens` tokens."""
        missing = pages_for(min(tokens, r.budget), self.page_size) - len(r.pages)
        if missing > 0:
            r.pages += self.pool.allocate(missing)

    def _proposals(self, running: list[Request]) -> np.ndarray | None:
        """Prompt lookup's proposals [rows, k] for the `running` rows (-1 past a row's own), or None when no
        row has any: then plain decoding is cheaper than verifying nothing. With a draft model, all -1:
        the draft proposes on the device."""
        proposals = np.full((self.shapes.batch_bucket(len(running)), self.speculate), -1, np.int32)
        if not self.draft:
            for i, r in enumerate(running):
                # positions written: length .. length + proposals, kept inside the row's budget
                guess = lookup(r.prompt + r.output.tokens, self.ngram, min(self.speculate, r.budget - r.length - 2))
                proposals[i, : len(guess)] = guess
            if (proposals < 0).all():
                return None
        return proposals

    def _tables(self, running: list[Request], n: int) -> tuple[np.ndarray, np.ndarray]:
        """Page tables [n, bucketed width] and slots [n] of the running rows, padded to n rows."""
        width = self.shapes.page_bucket(max(len(r.pages) for r in running))
        table = np.full((n, width), PAD_PAGE, np.int32)
        slots = np.full(n, self.shapes.max_batch, np.int32)
        for i, r in enumerate(running):
            table[i, : len(r.pages)] = r.pages
            slots[i] = r.slot
        return table, slots


def _written_now(next_key: tuple | None, scored: bool, writing: dict[tuple, bool]) -> bool:
    """Whether a row's next uncached page (its prefix key; None when it has no further page to match) is being
    written by a row admitted to this prefill, with the scores the row needs when it is scored."""
    return next_key in writing and (writing[next_key] or not scored)


def _notify(r: Request) -> None:
    if r.notify is not None:
        r.notify()
