"""A request's rows: its fields checked and made the engine's settings, its rows added through the engine's
public methods, then waited for or followed piece by piece until they finish, time out or the server stops."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request as HTTPRequest
from pydantic import BaseModel

from meshlm.config import InputError
from meshlm.http.constraints import request_constraint
from meshlm.http.protocol import CONSTRAINT_FIELDS, MAX_STOP_STRINGS, APIError, ChatRequest, Sampling, error_kind
from meshlm.http.state import STOPPING, Group, ServerState
from meshlm.serve.engine import QueueFull, SlotsBusy
from meshlm.serve.grammar import Constraint
from meshlm.serve.params import SAMPLING_FIELDS, SamplingParams

COMPILE_SECONDS = 5.0  # an output constraint's compile and first mask, on a worker thread, at most (else 400)


def encode(state: ServerState, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids (a token list as given: the engine checks every request's ids)."""
    return state.lm.encode_prompt(prompt) if isinstance(prompt, str) else prompt


async def off_loop(work: Callable[..., Any], *args: Any) -> Any:
    """`work(*args)` on a worker thread: tokenizing and rendering a long prompt must not stall every route.
    Only host work goes there (tokenizers, templates), never the device's."""
    return await asyncio.to_thread(work, *args)


async def vet_constraint(state: ServerState, constraint: Constraint | None) -> None:
    """Compile the request's output constraint and time its first mask (`Engine.check_constraint`) on a grammar
    worker thread, off the event loop and the engine's: 400 for one that is invalid, over the size budgets,
    or not done within COMPILE_SECONDS (its worker finishes in the background; the verdict is cached)."""
    if constraint is None:
        return
    work = state.vetting.get(constraint)
    if work is None:  # one worker per constraint: the same slow one sent again waits on the first's verdict
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(state.grammar_pool, state.engine.check_constraint, constraint, state.tokenizer)
        state.vetting[constraint] = work
        work.add_done_callback(lambda done: _vetted(state, constraint, done))
    try:
        await asyncio.wait_for(asyncio.shield(work), COMPILE_SECONDS)
    except TimeoutError:
        raise APIError(400, f"{constraint.param or 'the output constraint'}: too complex: it did not compile within "
                       f"{COMPILE_SECONDS:g} s", param=constraint.param) from None  # fmt: skip
    except InputError as e:
        raise APIError(400, str(e), param=e.param or constraint.param) from None


def check_unsupported(body: BaseModel, table: dict[str, tuple[Any, ...]]) -> None:
    for name, off in table.items():
        if getattr(body, name) not in off:
            raise APIError(400, f"{name} is not supported by this server", param=name)


def budget(state: ServerState, prompt: list[int], max_tokens: int | None, name: str) -> int:
    """The tokens a row may generate: `max_tokens`, or (None) what the context leaves; 400 if it does not fit."""
    ctx = state.ctx
    if max_tokens is None:
        if len(prompt) >= ctx:
            raise APIError(400, f"this model's context is {ctx} tokens; the prompt has {len(prompt)}", param=name)
        return ctx - len(prompt)
    if len(prompt) + max_tokens > ctx:
        raise APIError(
            400,
            f"this model's context is {ctx} tokens; the prompt has {len(prompt)} and {name} is {max_tokens}",
            param=name if len(prompt) < ctx else "prompt",
        )
    return max_tokens


def output_constraint(body: Sampling, tools: Constraint | None = None) -> Constraint | None:
    """The request's output constraint (`tools`: a forced tool call's), 400 for a malformed one or for two."""
    try:
        found = request_constraint(body.model_dump(include=CONSTRAINT_FIELDS))
    except InputError as e:
        raise APIError(400, str(e), param=e.param) from None
    if found is not None and tools is not None:
        raise APIError(400, f"a forced tool call constrains the output already; drop {found.param}", param=found.param)
    return found or tools


def alternatives(body: Sampling) -> int:
    """The top alternatives a request reports per output token: a chat request's top_logprobs (with logprobs
    on), a completion's logprobs."""
    if isinstance(body, ChatRequest):
        return (body.top_logprobs or 0) if body.logprobs else 0
    return getattr(body, "logprobs", None) or 0


# The request fields that are `SamplingParams`' fields by the same name and meaning, passed on as they are;
# `sampling_params` converts the ones named alike that differ (vLLM's -1 for top_k, OpenAI's string keys, ...).
CONVERTED = {"top_k", "logit_bias", "stop", "seed", "prompt_logprobs"}
AS_GIVEN = sorted((SAMPLING_FIELDS & Sampling.model_fields.keys()) - CONVERTED)


def sampling_params(
    state: ServerState, body: Sampling, max_new: int, prompt_logprobs: int | None, constraint: Constraint | None
) -> SamplingParams:
    """The request's fields as the engine's settings, built by `LanguageModel.sampling`, the one builder of them
    (400 for what cannot be); as in vLLM, `stop_token_ids` add to the EOS ids unless `ignore_eos` (`sampling`
    applies `LanguageModel.end_ids`, the one rule), and the seed is the request's, or random."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.strip().lstrip("-").isdecimal():
            raise APIError(400, f"logit_bias: keys must be token ids (integers), got {key!r}", param="logit_bias")
        bias[int(key)] = value
    if body.min_tokens > max_new:
        raise APIError(400, f"min_tokens ({body.min_tokens}) must be at most the tokens to generate ({max_new})",
                       param="min_tokens")  # fmt: skip
    try:
        return state.lm.sampling(
            max_new,
            **{name: getattr(body, name) for name in AS_GIVEN},
            top_k=max(body.top_k, 0),
            logit_bias=bias,
            stop=tuple(s for s in stop if s),
            ignore_eos=body.ignore_eos,
            seed=secrets.randbits(31) if body.seed is None else body.seed,
            prompt_logprobs=prompt_logprobs,
            constraint=constraint,
            logprobs=alternatives(body),
        )
    except ValueError as e:  # InputError among them
        raise APIError(400, str(e)) from None


def check_stream_options(body: Sampling) -> bool:
    """Whether a final usage chunk is wanted."""
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options: only allowed with stream: true", param="stream_options")
    return body.stream_options is not None and body.stream_options.include_usage


def add_rows(
    state: ServerState, prompts: list[list[int]], params: list[SamplingParams], n: int, adapter: str | None = None
) -> Group:
    """The request's rows, `n` per prompt (completion j of a prompt samples with seed + j), added to the engine
    to run LoRA adapter `adapter` (None: the served model)."""
    if state.stopping:
        raise APIError(503, "the server is shutting down", kind="server_error")
    group = Group(state.engine)
    rows = [p for p in prompts for _ in range(n)]
    settings = [sp.replace(seed=sp.seed + j) for sp in params for j in range(n)]
    try:
        group.add(rows, settings, state.tokenizer, adapter)
    except ValueError as e:  # InputError among them: a request that can never run, or ids out of range
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None
    except QueueFull:
        raise APIError(503, "the server is busy (queue full); retry shortly", kind="server_overloaded") from None
    except SlotsBusy as e:
        raise APIError(503, str(e), kind="server_overloaded") from None
    return group


async def next_update(state: ServerState, group: Group, deadline: float | None) -> int:
    """The index of the next row that changed; 408 once the request's time is up, 503 once the server stops."""
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        index = await asyncio.wait_for(group.updates.get(), timeout)
    except TimeoutError:
        raise APIError(408, f"the request ran past the server's timeout of {state.request_timeout:g} s",
                       kind="timeout") from None  # fmt: skip
    if index == STOPPING:
        raise APIError(503, "the server is shutting down", kind="server_error")
    return index


@contextlib.contextmanager
def answering(state: ServerState, group: Group) -> Iterator[None]:
    """While a request is answered `stop` reaches it; once it is (or its client has gone), its rows stop
    and its latencies are recorded."""
    state.in_flight.add(group)
    try:
        yield
    finally:
        state.in_flight.discard(group)
        group.cancel()
        state.metrics.observe(group.rows)


async def wait(state: ServerState, group: Group, request: HTTPRequest) -> None:
    """Until every row of a request has finished; a client that goes away cancels its rows at once."""
    until = state.deadline()
    watcher = asyncio.create_task(_disconnected(request))
    with answering(state, group):
        try:
            while not all(r.output.finished or r.error for r in group.rows):
                update = asyncio.create_task(next_update(state, group, until))
                await asyncio.wait({update, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if watcher.done():
                    update.cancel()
                    return
                update.result()
        finally:
            watcher.cancel()
    for row in group.rows:
        if row.error:
            raise APIError(row.error_status, row.error, kind=error_kind(row.error_status))


def _vetted(state: ServerState, constraint: Constraint, done: asyncio.Future) -> None:
    """A constraint's worker is done: forget it (its verdict is cached), and take its refusal, which nobody may
    be waiting for any more (asyncio would log it as never retrieved)."""
    state.vetting.pop(constraint, None)
    if not done.cancelled():
        done.exception()


async def _disconnected(request: HTTPRequest, every: float = 0.25) -> None:
    """Returns once the client has gone away."""
    while not await request.is_disconnected():
        await asyncio.sleep(every)


@dataclass
class Piece:
    """What changed in one row: its new text and the new tokens with their logprobs, and whether it finished."""

    index: int
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # the row failed (it alone): why
    error_status: int = 500
    first: bool = False  # the row's first piece: its prompt's logprobs are known from here on


async def pieces(state: ServerState, group: Group) -> AsyncIterator[Piece]:
    """Each row's changes as they come, until every row has finished (APIError: timeout, shutdown)."""
    rows = group.rows
    sent = [0] * len(rows)
    seen: set[int] = set()
    until = state.deadline()
    open_rows = set(range(len(rows)))
    while open_rows:
        i = await next_update(state, group, until)
        if i not in open_rows:
            continue
        row = rows[i]
        first = i not in seen
        seen.add(i)
        if row.error:
            open_rows.discard(i)
            yield Piece(i, error=row.error, error_status=row.error_status, first=first)
            continue
        with row.lock:
            out = row.output
            start, sent[i] = min(sent[i], len(out.tokens)), len(out.tokens)
            piece = Piece(i, out.take_text(), out.tokens[start:], out.logprobs[start:], out.top_logprobs[start:],
                          out.finish_reason, first=first)  # fmt: skip
        if piece.finish_reason is not None:
            open_rows.discard(i)
        if piece.text or piece.tokens or piece.finish_reason or first:
            yield piece
