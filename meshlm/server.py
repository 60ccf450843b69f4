"""HTTP serving, as vLLM's OpenAI-compatible server serves: `/v1/completions` (with prompt scoring),
`/v1/chat/completions`, `/v1/models`, the tokenizer endpoints (`/tokenize`, `/detokenize`, `/tokenizer_info`),
`/health`, Prometheus `/metrics`, and the seed's `/complete`.

The generation engine (`meshlm.serve.engine`) steps on its own thread: requests become rows in its bounded
queue, join the running batch between decode chunks and leave as soon as they finish. This module is HTTP
only: it validates, adds rows through the engine's public methods (`add_requests`, `abort`, `snapshot`) and
relays their outputs; it never compiles anything, since the engine compiled every shape it can use before the
server started listening. The handlers live at module level and `ROUTES` lists them; what they share (the
model, the engine, the names served, the key, the timeout, the requests in flight, the metrics) is one
`ServerState` on `app.state.server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import secrets
import socket
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from meshlm.api import LanguageModel, is_adapter, read_adapter
from meshlm.chat import ChatTemplate, check_messages, load_chat_template
from meshlm.config import ConfigError, DataError, InputError
from meshlm.serve.engine import Engine, QueueFull, Request, SlotsBusy
from meshlm.serve.grammar import Constraint, request_constraint, tool_calls, tool_constraint
from meshlm.serve.params import SamplingParams
from meshlm.tokenizer import Tokenizer

MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 5
MIN_LOGPROB = -9999.0  # what a logprob of -inf is reported as (JSON has no infinity), as vLLM reports it
# OpenAI fields meshlm does not implement, with the values that mean "off"; anything else is refused
UNSUPPORTED = {
    "suffix": (None, ""),
    "best_of": (None, 1),
}
CONSTRAINT_FIELDS = {"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs"}  # fmt: skip
# What a field of a union type must be, for an error message that says so (not pydantic's per-member errors)
EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": f"a string or a list of at most {MAX_STOP_STRINGS} strings",
}
BACKLOG = 2048  # connections the kernel queues before the server accepts them (uvicorn's default)
STOPPING = -1  # the update that tells a handler the server is stopping
SHUTDOWN_TIMEOUT = 5.0  # seconds uvicorn waits for requests to answer once stopping, then cancels them
MAX_REQUEST_BYTES = 4 * 2**20  # a request body's default limit (413 past it): a 128k-token prompt is ~1 MB
COMPILE_SECONDS = 5.0  # an output constraint's compile and first mask, on a worker thread, at most (else 400)
GRAMMAR_WORKERS = 2  # threads compiling constraints: a slow one (up to its budget) leaves the other free
SEED_RANGE = (-(2**63), 2**63 - 1)  # a request's seed: a 64-bit integer, as vLLM takes it (torch.long)
# chat_template_kwargs a request may not set: the server's own arguments to the template
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "continue_final_message")
# what a template variable the server also fills must be, when a request's chat_template_kwargs gives it
LIST_TEMPLATE_KWARGS = ("tools", "documents")
REFUSED_ADAPTER_PATH = "lora_path: not an adapter folder under the server's --adapter-root"


# ---------------------------------------------------------------------------------------------------
# Request bodies: a field the server does not know is refused (400 naming it), never silently ignored


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """The sampling fields that completions and chat completions share (OpenAI's, and vLLM's extensions)."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # vLLM's -1 means off, as 0 does
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: Annotated[int, Field(ge=1, le=64)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    include_stop_str_in_output: bool = False
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end user's id, for the caller's own records
    # output constraints: OpenAI's, and vLLM's extensions (checked by `meshlm.serve.grammar.request_constraint`)
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None


class CompletionRequest(Sampling):
    """POST /v1/completions, as OpenAI defines it, with vLLM's extensions (top_k, min_p, repetition_penalty,
    min_tokens, stop_token_ids, ignore_eos, include_stop_str_in_output, prompt_logprobs)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatRequest(Sampling):
    """POST /v1/chat/completions, as OpenAI defines it, with the same extensions and vLLM's template switches."""

    messages: list[dict[str, Any]]
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # OpenAI's deprecated name for max_completion_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None  # rendered by the chat template; a named or "required" tool_choice constrains the output
    tool_choice: Any = None


class TokenizeRequest(Strict):
    """POST /tokenize, as vLLM takes it: a `prompt`, or chat `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class LoadAdapterRequest(Strict):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str


class UnloadAdapterRequest(Strict):
    """vLLM's /v1/unload_lora_adapter body (`lora_int_id` is accepted and unused: adapters go by name)."""

    lora_name: str
    lora_int_id: int | None = None


class LegacyRequest(BaseModel):
    """POST /complete, the seed's endpoint: {"context", "top_p", "temp"} and optionally "gen_len"."""

    model_config = ConfigDict(extra="ignore")

    context: str
    top_p: Annotated[float, Field(gt=0, le=1)] = 0.9
    temp: Annotated[float, Field(ge=0, le=2)] = 1.0
    gen_len: Annotated[int, Field(ge=1)] = 512


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------------
# What the handlers share


class Group:
    """The rows of one HTTP request and the queue that wakes its handler (with a row's index) on every change."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.updates: asyncio.Queue[int] = asyncio.Queue()
        self.rows: list[Request] = []

    def add(
        self, prompts: list[list[int]], params: list[SamplingParams], tokenizer: Tokenizer, adapter: str | None = None
    ) -> None:
        """Add the rows to the engine (all or none), running LoRA adapter `adapter` (None: the base)."""
        adapters = [adapter] * len(prompts)
        self.rows = self.engine.add_requests(prompts, params, self._changed, tokenizer, adapters)

    def _changed(self, index: int) -> None:
        """Wake the handler; called from the engine's thread, which may outlive the event loop at shutdown."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for this row any more
            self.loop.call_soon_threadsafe(self.updates.put_nowait, index)

    def cancel(self) -> None:
        """Stop every row still running (client gone, timeout, or done): the engine frees them at its next step."""
        for row in self.rows:
            self.engine.abort(row.id)


@dataclass(eq=False)
class ServerState:
    """Everything the handlers share: the model and its engine, the names served, the key, the timeout, the
    chat template, the requests in flight and the metrics."""

    lm: LanguageModel
    engine: Engine
    model_name: str
    api_key: str | None
    request_timeout: float | None
    chat: ChatTemplate | None
    metrics: Metrics
    tokenizer: Tokenizer
    adapter_roots: tuple[Path, ...] | None = None  # where /v1/load_lora_adapter may read (None: it is off)
    max_request_bytes: int = MAX_REQUEST_BYTES
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: set[Group] = field(default_factory=set)
    stopping: bool = False
    token_texts: dict[int, str] = field(default_factory=dict)
    vetting: dict[Constraint, asyncio.Future] = field(default_factory=dict)  # constraints being compiled
    grammar_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(GRAMMAR_WORKERS, thread_name_prefix="meshlm-grammar")
    )

    def token_text(self, token: int) -> str:
        """One token's text, as logprobs show it (remembered: a scored prompt shows thousands)."""
        text = self.token_texts.get(token)
        if text is None:
            text = self.token_texts[token] = self.tokenizer.decode([token])
        return text

    @property
    def ctx(self) -> int:
        return self.engine.max_len

    @property
    def models(self) -> list[str]:
        """The model names requests may ask for: the served name, then the LoRA adapters' names."""
        return [self.model_name, *self.engine.adapter_sources()]

    def card(self, name: str) -> dict[str, Any]:
        """/v1/models' entry: an adapter's root is its folder and its parent the base, as vLLM lists them."""
        root, parent = self.model_name, None
        if name != self.model_name:
            root, parent = self.engine.adapter_sources()[name], self.model_name
        return {"id": name, "object": "model", "created": self.created, "owned_by": "meshlm", "root": root,
                "parent": parent, "max_model_len": self.ctx}  # fmt: skip

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the served model); 404 for one not served."""
        if name is None or name == self.model_name:
            return None
        if name not in self.models:
            raise APIError(404, f"The model `{name}` does not exist.", code="model_not_found")
        return name

    def stop(self) -> None:
        """Answer every request in flight 503 and refuse new ones (the server is stopping)."""
        self.stopping = True
        for group in self.in_flight:
            group.updates.put_nowait(STOPPING)

    def deadline(self) -> float | None:
        return None if self.request_timeout is None else time.monotonic() + self.request_timeout


def state_of(request: HTTPRequest) -> ServerState:
    return request.app.state.server


# ---------------------------------------------------------------------------------------------------
# Middleware and error handlers


async def authorize(request: HTTPRequest, call_next: Callable[[HTTPRequest], Awaitable[Any]]) -> Any:
    """With an API key, every route but /health needs `Authorization: Bearer KEY` (the scheme in any case).
    An error no handler expected is answered here, a JSON 500 in OpenAI's shape: past this point Starlette
    would re-raise it to uvicorn, which logs a traceback and closes the client's connection."""
    key = state_of(request).api_key
    if key is not None and request.url.path != "/health":
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
            body = error_body("a valid API key is needed: Authorization: Bearer <key>", "invalid_request_error",
                              code="invalid_api_key")  # fmt: skip
            return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
    try:
        return await call_next(request)
    except Exception as e:
        return await on_crash(request, e)


class LimitBody:
    """ASGI middleware: a request body over `limit` bytes is answered 413 (by its Content-Length before it is
    read; a chunked one once it is), before anything parses or tokenizes it."""

    def __init__(self, app: Any, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.state.max_request_bytes
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            response = JSONResponse(error_body(_too_large(limit), "invalid_request_error"), status_code=413)
            return await response(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HTTPException(413, _too_large(limit))  # FastAPI's body parser passes it on
            return message

        return await self.app(scope, counted, send)


def _too_large(limit: int) -> str:
    return f"the request body exceeds this server's limit of {limit:,} bytes (--max-request-bytes)"


async def on_api_error(request: HTTPRequest, e: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(error_body(e.message, e.kind, e.param, e.code), status_code=e.status, headers=headers)


async def on_invalid(request: HTTPRequest, e: RequestValidationError) -> JSONResponse:
    """A 400 in OpenAI's shape naming the field: malformed JSON, an unknown field, a wrong type or range."""
    first = e.errors()[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first["type"] == "json_invalid":  # loc is a character position, not a field
        reason = (first.get("ctx") or {}).get("error", first["msg"])
        return JSONResponse(error_body(f"invalid JSON: {reason}", "invalid_request_error"), status_code=400)
    name = str(loc[0]) if loc else None
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if first["type"] == "extra_forbidden":
        message = f"{where}: unknown field; this server does not support it"
    elif name in EXPECTED and len(loc) > 1 and isinstance(loc[1], str):  # a union member's error
        message = f"{name}: must be {EXPECTED[name]}"
    else:
        message = f"{where}: {first['msg']}" if where else first["msg"]
    return JSONResponse(error_body(message, "invalid_request_error", name), status_code=400)


async def on_http(request: HTTPRequest, e: HTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code)


async def on_crash(request: HTTPRequest, e: Exception) -> JSONResponse:
    traceback.print_exception(e, file=sys.stderr)
    return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)


# ---------------------------------------------------------------------------------------------------
# Rows: validation, sampling settings, waiting and streaming


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


def sampling_params(
    state: ServerState, body: Sampling, max_new: int, prompt_logprobs: int | None, constraint: Constraint | None
) -> SamplingParams:
    """The request's fields as the engine's settings, built by `LanguageModel.sampling` (400 for what cannot be);
    as in vLLM, `stop_token_ids` add to the EOS ids, and the seed is the request's, or random."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    extra = list(body.stop_token_ids or ())
    eos = () if body.ignore_eos else state.lm.eos_ids
    stop_ids = tuple(dict.fromkeys([*eos, *extra]))
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
            max_new_tokens=max_new,
            temperature=body.temperature,
            top_k=max(body.top_k, 0),
            top_p=body.top_p,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=bias,
            min_tokens=body.min_tokens,
            stop=tuple(s for s in stop if s),
            stop_token_ids=stop_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
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
        state.metrics.observe(group)


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
            raise APIError(row.error_status, row.error, kind=_error_kind(row.error_status))


def _vetted(state: ServerState, constraint: Constraint, done: asyncio.Future) -> None:
    """A constraint's worker is done: forget it (its verdict is cached), and take its refusal, which nobody may
    be waiting for any more (asyncio would log it as never retrieved)."""
    state.vetting.pop(constraint, None)
    if not done.cancelled():
        done.exception()


def _error_kind(status: int) -> str:
    return "server_error" if status >= 500 else "invalid_request_error"


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


def usage_of(state: ServerState, group: Group, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """OpenAI's usage: each prompt counted once, however many completions it has."""
    n_prompt = sum(map(len, prompts))
    n_out = sum(len(r.output.tokens) for r in group.rows)
    usage: dict[str, Any] = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    if state.engine.speculate:  # OpenAI's names for predicted tokens kept and thrown away
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(r.accepted for r in group.rows),
            "rejected_prediction_tokens": sum(r.proposed - r.accepted for r in group.rows),
        }
    return usage


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# ---------------------------------------------------------------------------------------------------
# Logprobs in the shapes clients read


def _lp(x: float | None) -> float | None:
    return None if x is None else max(float(x), MIN_LOGPROB)


def legacy_logprobs(
    text_of: Callable[[int], str],
    tokens: Sequence[int],
    logprobs: Sequence[float | None],
    tops: Sequence[Sequence[tuple[int, float]] | None],
    n_top: int,
    offset: int,
) -> dict[str, Any]:
    """OpenAI's legacy (completions) logprobs object: each token's text, logprob, the `n_top` likeliest
    alternatives with the token itself (up to n_top + 1 entries, as OpenAI and vLLM give them; a prompt's
    first token, which nothing predicts, has null for both) and where its text starts."""
    texts = [text_of(t) for t in tokens]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    top_logprobs: list[dict[str, float] | None] = []
    for text, lp, alts in zip(texts, logprobs, tops, strict=True):
        if lp is None:
            top_logprobs.append(None)
            continue
        top = {text_of(i): _lp(v) for i, v in (alts or [])[:n_top]}
        top[text] = _lp(lp)  # the token's own: lm-eval's "is greedy" compares it with the largest of these
        top_logprobs.append(top)
    return {
        "tokens": texts,
        "token_logprobs": [_lp(lp) for lp in logprobs],
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(
    tok: Tokenizer,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[Sequence[tuple[int, float]]],
    n_top: int,
) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs `content`: each token's text, logprob and UTF-8 bytes, and its `n_top` likeliest
    alternatives."""

    def entry(token: int, lp: float) -> dict[str, Any]:
        return {"token": tok.decode([token]), "logprob": _lp(lp), "bytes": list(tok.decode_bytes([token]))}

    return [
        {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in alts[:n_top]]}
        for t, lp, alts in zip(tokens, logprobs, tops, strict=True)
    ]


def prompt_logprobs_of(
    text_of: Callable[[int], str], row: Request, n_top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: for each prompt token (null for the first) {token id: {logprob, rank,
    decoded_token}} for the token itself and its `n_top` likeliest alternatives. A rank is known for the
    alternatives; the token's own is its place among them, null when it is not one."""
    out = row.output
    result: list[dict[str, dict[str, Any]] | None] = []
    for token, lp, alts in zip(row.prompt, out.prompt_logprobs or [], out.prompt_top_logprobs or [], strict=False):
        if lp is None:
            result.append(None)
            continue
        alts = list(alts or [])
        ranks = {i: r for r, (i, _) in enumerate(alts, 1)}
        entries = {str(token): {"logprob": _lp(lp), "rank": ranks.get(token), "decoded_token": text_of(token)}}
        for r, (i, v) in enumerate(alts[:n_top], 1):
            entries.setdefault(str(i), {"logprob": _lp(v), "rank": r, "decoded_token": text_of(i)})
        result.append(entries)
    return result


def _prompt_scores(row: Request) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    out = row.output
    if out.prompt_logprobs is None or out.prompt_top_logprobs is None:
        raise APIError(500, "the engine did not score the prompt", kind="server_error")
    return out.prompt_logprobs, out.prompt_top_logprobs


# ---------------------------------------------------------------------------------------------------
# Handlers


async def health(request: HTTPRequest) -> dict[str, Any]:
    s = state_of(request).engine.snapshot()
    rate = s.acceptance_rate
    return {
        "status": "ok",
        "active": s.running,
        "queued": s.queued,
        "max_batch": s.max_batch,
        "kv_tokens": s.kv_tokens,
        "kv_tokens_used": s.kv_pages_used * s.page_size,
        "kv_live_tokens": s.kv_live_tokens,
        "kv_bytes_per_token": s.kv_bytes_per_token,
        "prefix_cache_hit_rate": round(s.prefix_cache_hit_rate, 4),
        "speculative_acceptance_rate": None if rate is None else round(rate, 4),
        "tokens_generated": s.tokens_generated,
        "decode_calls": s.decode_calls,
        "prefill_calls": s.prefill_calls,
        "compiled_shapes": s.compiled_shapes,
        "compile_seconds": round(s.compile_seconds, 2),
        "compiles_since_warm_up": s.compiles_since_warm_up,
    }


async def prometheus(request: HTTPRequest) -> Response:
    return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def models(request: HTTPRequest) -> dict[str, Any]:
    state = state_of(request)
    return {"object": "list", "data": [state.card(name) for name in state.models]}


async def model_card(model_id: str, request: HTTPRequest) -> dict[str, Any]:
    state = state_of(request)
    state.check_model(model_id)
    return state.card(model_id)


async def completions(body: CompletionRequest, request: HTTPRequest) -> Any:
    state = state_of(request)
    tok = state.tokenizer
    adapter = state.check_model(body.model)
    check_unsupported(body, UNSUPPORTED)
    include_usage = check_stream_options(body)
    if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)):
        raw = [body.prompt]
    else:
        raw = list(body.prompt)
    if not raw:
        raise APIError(400, "prompt: must not be an empty list", param="prompt")
    prompts = await off_loop(lambda: [encode(state, p) for p in raw])
    # echo with logprobs scores the prompt (lm-eval's loglikelihood requests); so does vLLM's prompt_logprobs
    scored = body.echo and body.logprobs is not None
    wanted = [k for k in (body.logprobs if scored else None, body.prompt_logprobs) if k is not None]
    constraint = output_constraint(body)
    params = [sampling_params(state, body, budget(state, p, body.max_tokens, "max_tokens"), max(wanted, default=None),
                              constraint) for p in prompts]  # fmt: skip
    await vet_constraint(state, constraint)
    group = add_rows(state, prompts, params, body.n, adapter)
    echoes = [(p if isinstance(p, str) else tok.decode(p)) if body.echo else "" for p in raw for _ in range(body.n)]
    cid = f"cmpl-{secrets.token_hex(12)}"
    now = int(time.time())
    if body.stream:
        events = stream_completion(state, group, prompts, body, echoes, scored, include_usage, cid, now)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    await wait(state, group, request)
    choices = []
    for i, (row, echo) in enumerate(zip(group.rows, echoes, strict=True)):
        out = row.output
        lp = None
        if body.logprobs is not None:
            tokens, lps, tops = list(out.tokens), list(out.logprobs), list(out.top_logprobs)
            if scored:
                prompt_lps, prompt_tops = _prompt_scores(row)
                tokens, lps, tops = row.prompt + tokens, [*prompt_lps, *lps], [*prompt_tops, *tops]
            lp = legacy_logprobs(state.token_text, tokens, lps, tops, body.logprobs, 0 if scored else len(echo))
        choice = {"index": i, "text": echo + out.text, "logprobs": lp, "finish_reason": out.finish_reason}
        if body.prompt_logprobs is not None:
            _prompt_scores(row)
            choice["prompt_logprobs"] = prompt_logprobs_of(state.token_text, row, body.prompt_logprobs)
        choices.append(choice)
    # a JSONResponse is written as is: FastAPI would walk a scored prompt's thousands of entries first
    model = body.model or state.model_name
    return JSONResponse({"id": cid, "object": "text_completion", "created": now, "model": model, "choices": choices,
                         "usage": usage_of(state, group, prompts)})  # fmt: skip


async def stream_completion(
    state: ServerState,
    group: Group,
    prompts: list[list[int]],
    body: CompletionRequest,
    echoes: list[str],
    scored: bool,
    include_usage: bool,
    cid: str,
    now: int,
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of new text, a last chunk per row with its finish_reason, a usage
    chunk if asked. An echoed prompt comes first (with its logprobs, once the row's prefill has scored it).
    A client that goes away closes this generator, which cancels the rows."""
    model = body.model or state.model_name
    extra = {"usage": None} if include_usage else {}

    def event(index: int, text: str, lp: dict | None, reason: str | None, **more: Any) -> str:
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason, **more}
        return sse({"id": cid, "object": "text_completion", "created": now, "model": model, "choices": [choice],
                    **extra})  # fmt: skip

    rows = group.rows
    offsets = [len(e) if not scored else 0 for e in echoes]
    with answering(state, group):
        if not scored:
            for i, echo in enumerate(echoes):
                if echo:
                    yield event(i, echo, None, None)
        try:
            async for piece in pieces(state, group):
                i = piece.index
                if piece.error:  # this choice alone failed; the others go on
                    yield sse(error_body(piece.error, _error_kind(piece.error_status)))
                    continue
                if piece.first and (scored or body.prompt_logprobs is not None):  # the prefill scored the prompt
                    row = rows[i]
                    prompt_lps, prompt_tops = _prompt_scores(row)
                    more = {}
                    if body.prompt_logprobs is not None:
                        more["prompt_logprobs"] = prompt_logprobs_of(state.token_text, row, body.prompt_logprobs)
                    if scored:
                        lp = legacy_logprobs(state.token_text, row.prompt, prompt_lps, prompt_tops, body.logprobs, 0)
                        offsets[i] = len(echoes[i])
                        yield event(i, echoes[i], lp, None, **more)
                    else:  # the echo (if any) went first
                        yield event(i, "", None, None, **more)
                lp = None
                if body.logprobs is not None:
                    lp = legacy_logprobs(state.token_text, piece.tokens, piece.logprobs, piece.top_logprobs,
                                         body.logprobs, offsets[i])  # fmt: skip
                offsets[i] += len(piece.text)
                if piece.text or piece.finish_reason or (lp and piece.tokens):  # a held-back token has its logprob
                    yield event(i, piece.text, lp, piece.finish_reason)
        except APIError as e:
            yield sse(error_body(e.message, e.kind))
        else:
            if include_usage:
                yield sse({"id": cid, "object": "text_completion", "created": now, "model": model, "choices": [],
                           "usage": usage_of(state, group, prompts)})  # fmt: skip
        yield sse("[DONE]")


def render_chat(
    state: ServerState,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    kwargs: dict[str, Any] | None,
) -> str:
    """The chat as the model's template writes it (transformers' `apply_chat_template(tokenize=False)`)."""
    if state.chat is None:
        raise APIError(400, "this model has no chat template; start the server with --chat-template FILE",
                       param="messages")  # fmt: skip
    if continue_final_message and add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")  # fmt: skip
    kwargs = dict(kwargs or {})
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in kwargs:
            raise APIError(400, f"chat_template_kwargs.{key}: the server sets it; give it as the request's own field"
                           if key != "messages" else "chat_template_kwargs.messages: give the chat as messages",
                           param="chat_template_kwargs")  # fmt: skip
    for key in LIST_TEMPLATE_KWARGS:
        if kwargs.get(key) is not None and not isinstance(kwargs[key], list):
            raise APIError(400, f"chat_template_kwargs.{key}: must be a list or null, got {type(kwargs[key]).__name__}",
                           param="chat_template_kwargs")  # fmt: skip
    chat = [_template_message(m) for m in messages]
    try:
        check_messages(chat)
        text = state.chat.render(chat, add_generation_prompt, **kwargs)
    except DataError as e:
        raise APIError(400, str(e), param="messages") from None
    if continue_final_message:  # end the text with the last message's content, open for the model to continue
        last = chat[-1]["content"]
        if not last or last not in text:
            raise APIError(400, "continue_final_message: the template does not render the last message's content",
                           param="continue_final_message")  # fmt: skip
        text = text[: text.rindex(last) + len(last)]
    return text


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the template takes it, as vLLM passes it to transformers: content given as a list of text
    parts ([{"type": "text", "text": ...}], as OpenAI allows) joined into one string; an assistant's
    `tool_calls` with their `arguments` (OpenAI's JSON text) parsed into the object templates iterate.
    Anything else stays as it is, for `check_messages`."""
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        message = {**message, "content": "\n".join(str(p.get("text", "")) for p in content)}
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        message = {**message, "tool_calls": [_parsed_arguments(c) for c in calls]}
    return message


def _parsed_arguments(call: Any) -> Any:
    """A tool call whose function's `arguments` is JSON text, with them parsed (left as they are otherwise)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


async def chat_completions(body: ChatRequest, request: HTTPRequest) -> Any:
    state = state_of(request)
    tok = state.tokenizer
    adapter = state.check_model(body.model)
    include_usage = check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    try:
        constraint = output_constraint(body, tool_constraint(body.tools, body.tool_choice))
    except InputError as e:
        raise APIError(400, str(e), param=e.param) from None
    template_kwargs = {**({"tools": body.tools} if body.tools else {}), **(body.chat_template_kwargs or {})}

    def tokens() -> list[int]:
        text = render_chat(state, body.messages, body.add_generation_prompt, body.continue_final_message,
                           template_kwargs)  # fmt: skip
        return tok.encode(text)

    prompt = await off_loop(tokens)
    if not prompt:
        raise APIError(400, "messages: the chat template renders this chat as no tokens", param="messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    params = sampling_params(state, body, budget(state, prompt, max_tokens, name), body.prompt_logprobs, constraint)
    await vet_constraint(state, constraint)
    group = add_rows(state, [prompt], [params], body.n, adapter)
    cid = f"chatcmpl-{secrets.token_hex(12)}"
    now = int(time.time())
    n_top = alternatives(body)
    if body.stream:
        events = stream_chat(state, group, prompt, body, include_usage, cid, now)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    await wait(state, group, request)
    choices = []
    for i, row in enumerate(group.rows):
        out = row.output
        lp = None
        if body.logprobs:
            lp = {"content": chat_logprobs(tok, out.tokens, out.logprobs, out.top_logprobs, n_top), "refusal": None}
        choice = {"index": i, "message": assistant_message(body, out.text), "logprobs": lp,
                  "finish_reason": out.finish_reason}  # fmt: skip
        if body.prompt_logprobs is not None:
            _prompt_scores(row)
            choice["prompt_logprobs"] = prompt_logprobs_of(state.token_text, row, body.prompt_logprobs)
        choices.append(choice)
    model = body.model or state.model_name
    return JSONResponse({"id": cid, "object": "chat.completion", "created": now, "model": model, "choices": choices,
                         "usage": usage_of(state, group, [prompt])})  # fmt: skip


def assistant_message(body: ChatRequest, text: str) -> dict[str, Any]:
    """The reply as a message: its text, or the tool calls a forced `tool_choice` made (as vLLM, the
    finish_reason stays the row's own)."""
    calls = tool_calls(text, body.tools, body.tool_choice)
    if calls:
        return {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}
    return {"role": "assistant", "content": text, "refusal": None}


def tool_delta(body: ChatRequest, text: str) -> dict[str, Any]:
    """A streamed choice's last delta under a forced `tool_choice`: its calls (indexed), or its text."""
    message = assistant_message(body, text)
    if "tool_calls" not in message:
        return {"content": text}
    return {"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]}


async def stream_chat(
    state: ServerState, group: Group, prompt: list[int], body: ChatRequest, include_usage: bool, cid: str, now: int
) -> AsyncIterator[str]:
    """Server-sent `chat.completion.chunk`s, as OpenAI sends them: per choice a first delta with the role, then
    content deltas, the last with its finish_reason; then a usage chunk if asked, and [DONE]. Under a forced
    `tool_choice` a choice's calls come whole, in its last delta."""
    tok, model = state.tokenizer, body.model or state.model_name
    extra = {"usage": None} if include_usage else {}
    n_top = alternatives(body)
    calling = tool_constraint(body.tools, body.tool_choice) is not None
    texts = [""] * len(group.rows)  # the calls' text so far, per choice

    def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
        return sse({"id": cid, "object": "chat.completion.chunk", "created": now, "model": model,
                    "choices": choices, **more})  # fmt: skip

    with answering(state, group):
        for i in range(len(group.rows)):
            delta = {"role": "assistant", "content": ""}
            yield chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}], **extra)
        try:
            async for piece in pieces(state, group):
                if piece.error:  # this choice alone failed; the others go on
                    yield sse(error_body(piece.error, _error_kind(piece.error_status)))
                    continue
                if not (piece.text or piece.finish_reason or (body.logprobs and piece.tokens)):
                    continue
                lp = None
                if body.logprobs:
                    content = chat_logprobs(tok, piece.tokens, piece.logprobs, piece.top_logprobs, n_top)
                    lp = {"content": content, "refusal": None}
                delta = {"content": piece.text} if piece.text else {}
                if calling:  # the calls come whole, once the choice is done
                    texts[piece.index] += piece.text
                    if not piece.finish_reason:
                        continue
                    delta = tool_delta(body, texts[piece.index])
                choice = {"index": piece.index, "delta": delta, "logprobs": lp, "finish_reason": piece.finish_reason}
                yield chunk([choice], **extra)
        except APIError as e:
            yield sse(error_body(e.message, e.kind))
        else:
            if include_usage:
                yield chunk([], usage=usage_of(state, group, [prompt]))
        yield sse("[DONE]")


async def tokenize(body: TokenizeRequest, request: HTTPRequest) -> dict[str, Any]:
    """vLLM's /tokenize: {"prompt"} or chat {"messages"} -> {"count", "max_model_len", "tokens"}."""
    state = state_of(request)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")

    def encoded() -> list[int]:
        if body.prompt is not None:
            text, special = body.prompt, True if body.add_special_tokens is None else body.add_special_tokens
        else:
            text = render_chat(state, body.messages, body.add_generation_prompt, body.continue_final_message,
                               body.chat_template_kwargs)  # fmt: skip
            special = bool(body.add_special_tokens)
        return state.tokenizer.encode(text, add_special_tokens=special)

    tokens = await off_loop(encoded)
    return {"count": len(tokens), "max_model_len": state.ctx, "tokens": tokens}


async def detokenize(body: DetokenizeRequest, request: HTTPRequest) -> dict[str, Any]:
    """vLLM's /detokenize: {"tokens"} -> {"prompt"}."""
    state = state_of(request)
    state.check_model(body.model)
    vocab = state.tokenizer.vocab_size
    if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= vocab):
        raise APIError(400, f"tokens: token ids must lie in [0, {vocab})", param="tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}


async def tokenizer_info(request: HTTPRequest) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's configuration (its named special tokens, the context, the chat
    template), what lm-eval's `local-completions` reads to use the server's own tokenizer."""
    state = state_of(request)
    tok = state.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__, **tok.special_tokens}
    info.setdefault("eos_token", tok.decode([tok.eot_id]))
    info["model_max_length"] = state.ctx
    if state.chat is not None:
        info["chat_template"] = state.chat.source
    return info


async def complete(body: LegacyRequest, request: HTTPRequest) -> dict[str, str]:
    """The seed's /complete."""
    state = state_of(request)
    prompt = await off_loop(encode, state, body.context)
    ctx = state.ctx
    if len(prompt) >= ctx:
        raise APIError(400, f"context has {len(prompt)} tokens; this model's context is {ctx}", param="context")
    try:
        completion = CompletionRequest(
            prompt=[prompt], max_tokens=min(body.gen_len, ctx - len(prompt)), temperature=body.temp, top_p=body.top_p
        )
    except ValidationError as e:
        raise APIError(400, e.errors()[0]["msg"]) from None
    params = sampling_params(state, completion, completion.max_tokens, None, None)
    group = add_rows(state, [prompt], [params], 1)
    await wait(state, group, request)
    return {"completion": group.rows[0].output.text}


def check_runtime_adapters(state: ServerState) -> tuple[Path, ...]:
    """The folders runtime adapters may come from; 404 when runtime loading is off (as vLLM answers without
    VLLM_ALLOW_RUNTIME_LORA_UPDATING: the route is not there)."""
    if state.adapter_roots is None:
        raise APIError(404, "runtime adapter loading is off; start the server with --allow-runtime-adapters and "
                       "--adapter-root DIR", code="not_found")  # fmt: skip
    return state.adapter_roots


def allowed_adapter_path(roots: Sequence[Path], path: str) -> Path | None:
    """`path` (symbolic links and `..` resolved) when it is an adapter folder under one of `roots`, else None:
    the caller answers every refused path alike, so nothing tells whether a path exists or what it holds."""
    try:
        real = Path(os.path.realpath(path))
        inside = any(real.is_relative_to(root) for root in roots)
        return real if inside and real.is_dir() and is_adapter(real) else None
    except (OSError, ValueError):  # a path the system cannot take (a NUL byte, too long, unreadable)
        return None


def _add_adapter(engine: Engine, name: str, path: Path) -> None:
    """Read the adapter in `path` (once the engine would take its name) and hand the engine its weights."""
    engine.check_adapter_name(name)
    engine.add_adapter(name, read_adapter(name, path, engine.cfg))


async def load_adapter(body: LoadAdapterRequest, request: HTTPRequest) -> Response:
    """vLLM's runtime adapter loading, when the server allows it (--allow-runtime-adapters), from folders under
    its --adapter-root folders: the adapter is read now and takes a device slot on first use (nothing compiles).
    400 for a path that is not an adapter folder under the roots (one message for all of them), an adapter that
    does not fit this base or the slots' rank, a malformed adapter_config.json, a name in use."""
    state = state_of(request)
    roots = check_runtime_adapters(state)
    if body.lora_name == state.model_name:
        raise APIError(400, f"lora_name: {body.lora_name!r} is the served model's name", param="lora_name")
    path = await off_loop(allowed_adapter_path, roots, body.lora_path)
    if path is None:
        raise APIError(400, REFUSED_ADAPTER_PATH, param="lora_path")
    try:
        await asyncio.to_thread(_add_adapter, state.engine, body.lora_name, path)
    except (InputError, ConfigError, DataError) as e:
        raise APIError(400, str(e), param=getattr(e, "param", None) or "lora_path") from None
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")


async def unload_adapter(body: UnloadAdapterRequest, request: HTTPRequest) -> Response:
    """vLLM's runtime adapter unloading: 404 for a name not loaded, 400 while requests run the adapter."""
    state = state_of(request)
    check_runtime_adapters(state)
    if body.lora_name not in state.engine.adapter_sources():
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                       code="model_not_found")  # fmt: skip
    try:
        state.engine.unload_adapter(body.lora_name)
    except InputError as e:
        raise APIError(400, str(e), param="lora_name") from None
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")


ROUTES: list[tuple[str, str, Callable[..., Awaitable[Any]]]] = [
    ("GET", "/health", health),
    ("GET", "/metrics", prometheus),
    ("GET", "/v1/models", models),
    ("GET", "/v1/models/{model_id:path}", model_card),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
    ("GET", "/tokenizer_info", tokenizer_info),
    ("POST", "/complete", complete),
    ("POST", "/v1/load_lora_adapter", load_adapter),
    ("POST", "/v1/unload_lora_adapter", unload_adapter),
]


def create_app(
    lm: LanguageModel,
    engine: Engine,
    model_name: str,
    api_key: str | None = None,
    request_timeout: float | None = None,
    chat_template: ChatTemplate | str | Path | None = None,
    adapter_roots: Sequence[str | Path] | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> FastAPI:
    """The HTTP API over an engine stepping on its own thread (`engine.start`). With `api_key`, every route but
    /health needs `Authorization: Bearer <api_key>`; a request running past `request_timeout` seconds is stopped
    (408). Chats render with `chat_template` (a ChatTemplate or a Jinja file), else the model's own template, if
    it has one. `adapter_roots` (None: off) turns on /v1/load_lora_adapter and /v1/unload_lora_adapter for
    adapter folders under them. A body over `max_request_bytes` is refused (413). `app.state.stop()` answers
    every request in flight 503 and refuses new ones (the server is stopping)."""
    if request_timeout is not None and not request_timeout > 0:
        raise InputError(f"request_timeout must be a number of seconds > 0, got {request_timeout!r}")
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise InputError(f"max_request_bytes must be an integer >= 1, got {max_request_bytes!r}")
    if model_name in engine.adapter_sources():
        raise ConfigError(f"adapter {model_name!r} has the served model's own name; name it otherwise")
    roots = None
    if adapter_roots is not None:
        roots = tuple(Path(os.path.realpath(root)) for root in adapter_roots)
        if not roots or not all(root.is_dir() for root in roots):
            missing = next((str(r) for r in adapter_roots if not Path(r).is_dir()), None)
            raise ConfigError(f"--adapter-root {missing}: no such folder" if missing else
                              "runtime adapters need at least one --adapter-root DIR to load them from")  # fmt: skip
    tok = lm.tokenizer
    chat = chat_template if isinstance(chat_template, ChatTemplate) else load_chat_template(tok, chat_template)
    app = FastAPI(title="meshlm", description="OpenAI-compatible completions over a meshlm model")
    state = ServerState(lm, engine, model_name, api_key, request_timeout, chat, Metrics(engine), tok, roots,
                        max_request_bytes)  # fmt: skip
    app.state.server = state
    app.state.stop = state.stop
    app.add_middleware(LimitBody, state=state)  # inside `authorize`, whose task group would wrap its 413
    app.middleware("http")(authorize)
    for error, handler in ((APIError, on_api_error), (RequestValidationError, on_invalid), (HTTPException, on_http),
                           (Exception, on_crash)):  # fmt: skip
        app.add_exception_handler(error, handler)
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method], response_model=None)
    return app


# ---------------------------------------------------------------------------------------------------
# Metrics


class Metrics:
    """Prometheus metrics: the engine's state read at scrape time, and the latencies of finished requests."""

    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        self.engine = engine
        self.ttft = Histogram(
            "meshlm_time_to_first_token_seconds", "From submission to the first token", registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )  # fmt: skip
        self.latency = Histogram(
            "meshlm_request_seconds", "From submission to the last token", registry=self.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )  # fmt: skip
        self.registry.register(self)

    def observe(self, group: Group) -> None:
        now = time.perf_counter()
        for row in group.rows:
            if row.first_token is not None and not row.cancelled:
                self.ttft.observe(row.first_token - row.submitted)
                self.latency.observe(now - row.submitted)

    def collect(self) -> Iterator[Any]:
        s = self.engine.snapshot()
        gauges = {
            "meshlm_queue_depth": ("Rows waiting for a slot", s.queued),
            "meshlm_running_rows": ("Rows being generated", s.running),
            "meshlm_kv_pages_used": ("KV cache pages held by rows", s.kv_pages_used),
            "meshlm_kv_pages_total": ("KV cache pages", s.kv_pages),
            "meshlm_tokens_per_second": ("Generated tokens per second over the last few seconds", s.tokens_per_second),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "meshlm_generated_tokens": ("Tokens generated", s.tokens_generated),
            "meshlm_prompt_tokens": ("Prompt tokens taken in", s.prompt_tokens),
            "meshlm_prefix_cache_lookup_tokens": (
                "Prompt tokens looked up in the prefix cache",
                s.prefix_cache_lookups,
            ),
            "meshlm_prefix_cache_hit_tokens": ("Prompt tokens found in the prefix cache", s.prefix_cache_hits),
            "meshlm_decode_calls": ("Decode chunks run", s.decode_calls),
            "meshlm_prefill_calls": ("Prefills run", s.prefill_calls),
            "meshlm_compiles_since_warm_up": (
                "XLA compilations since the engine was warmed up",
                s.compiles_since_warm_up,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ---------------------------------------------------------------------------------------------------
# Serving


def _address(host: str, port: int) -> str:
    """host:port as a URL writes it ([host]:port for IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: any free one), not listening yet. `meshlm serve` binds before
    it loads the model: a port that is taken, privileged or out of range is reported in a second, not after
    minutes of loading and compiling, and no other server can take it meanwhile. Until `serve` listens,
    connections are refused rather than left hanging."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"port must be in 0..65535 (0: any free port), got {port!r}")
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]  # fmt: skip
    except socket.gaierror as e:
        raise ConfigError(f"cannot listen on {_address(host, port)}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        sock.bind(sockaddr)
    except OSError as e:
        sock.close()
        raise _listen_error(e, _address(host, port)) from None
    return sock


def bind_unix(path: str | Path) -> socket.socket:
    """A unix socket bound at `path`, not listening yet: for hosts that allow no TCP (vLLM's and uvicorn's
    --uds). A socket file left by a server that is gone is replaced; one a live server listens on, or any
    other file, is refused in one line. `serve` removes the file when it stops."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        if not path.is_socket():
            raise ConfigError(f"cannot listen on unix:{path}: it exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink(missing_ok=True)  # stale: its server is gone
            else:
                raise ConfigError(f"unix:{path} is already in use by a listening server")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on unix:{path}: {e.strerror or e}") from None
    return sock


def _where(sock: socket.socket) -> str:
    """Where a bound socket listens, as the start-up line names it."""
    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}"
    return "http://" + _address(*sock.getsockname()[:2])


def _listen_error(e: OSError, where: str) -> ConfigError:
    """One line naming the address and what is wrong with it."""
    reasons = {
        errno.EADDRINUSE: "is already in use",
        errno.EACCES: "needs privileges (ports below 1024 do)",
        errno.EADDRNOTAVAIL: "is not an address of this host",
    }
    return ConfigError(f"{where} {reasons[e.errno]}" if e.errno in reasons else f"cannot listen on {where}: {e}")


def serve(
    lm: LanguageModel,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = 8,
    max_queue: int = 64,
    chunk: int = 4,
    model_name: str = "meshlm",
    max_len: int | None = None,
    kv_tokens: int | None = None,
    prefix_caching: bool = True,
    ngram: int = 0,
    speculate: int = 4,
    api_key: str | None = None,
    request_timeout: float | None = None,
    draft: LanguageModel | None = None,
    attention: str | None = None,
    kv_cache_dtype: str | None = None,
    sock: socket.socket | None = None,
    chat_template: str | Path | None = None,
    adapters: dict[str, str | Path] | None = None,
    max_adapters: int | None = None,
    max_lora_rank: int | None = None,
    adapter_roots: Sequence[str | Path] | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> None:
    """Compile every shape the engine can use, then serve until interrupted (Ctrl-C: KeyboardInterrupt).
    `sock`: a socket from `bind` or `bind_unix` (closed on return; a unix socket's file removed); by default
    host:port is bound before anything else.
    `chat_template`: a Jinja file for /v1/chat/completions (default: the model's own template, if any).
    `adapters` (name -> folder), `max_adapters` and `max_lora_rank`: LoRA adapters served by name beside the
    model, as in `Engine`; `adapter_roots` (None: off) lets /v1/load_lora_adapter add more while serving, from
    folders under them (into max_adapters slots). `max_request_bytes`: the largest request body (413 past it)."""
    with sock or bind(host, port) as sock:
        chat = load_chat_template(lm.tokenizer, chat_template)  # a bad file fails before anything compiles
        engine = lm.engine(
            draft=draft,
            attention=attention,
            kv_cache_dtype=kv_cache_dtype,
            max_batch=max_batch,
            max_len=max_len,
            kv_tokens=kv_tokens,
            prefix_caching=prefix_caching,
            ngram=ngram,
            speculate=speculate,
            adapters=adapters,
            max_adapters=max_adapters,
            max_lora_rank=max_lora_rank,
        )
        app = create_app(lm, engine, model_name, api_key=api_key, request_timeout=request_timeout, chat_template=chat,
                         adapter_roots=adapter_roots, max_request_bytes=max_request_bytes)  # fmt: skip
        state = engine.snapshot()
        print(
            f"meshlm serve: {engine.max_batch} rows, {state.kv_tokens} KV tokens "
            f"({state.kv_bytes_per_token * state.page_size * (state.kv_pages + 1) / 2**30:.2f} GiB per device), "
            f"context {engine.max_len}; compiling ...",
            flush=True,
        )
        shapes, seconds = engine.warm_up()
        print(f"meshlm serve: compiled {shapes} shapes in {seconds:.1f} s", flush=True)
        where = _where(sock)
        try:
            sock.listen(BACKLOG)
        except OSError as e:  # another socket bound the port with SO_REUSEADDR too, and listened first
            raise _listen_error(e, where) from None
        config = uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=SHUTDOWN_TIMEOUT)
        engine.start(chunk=chunk, max_queue=max_queue)
        print(f"meshlm serve: {lm} as {model_name!r} on {where}", flush=True)
        unix = Path(sock.getsockname()) if sock.family == socket.AF_UNIX else None
        try:
            asyncio.run(_Server(config, app.state.stop, unix).serve(sockets=[sock]))
        finally:
            engine.stop()
            if unix is not None:
                unix.unlink(missing_ok=True)


class _Server(uvicorn.Server):
    """uvicorn's server, which answers the requests in flight (503) as soon as it starts to stop (Ctrl-C,
    SIGTERM): a generation can run for minutes, and uvicorn would cancel it, logging a traceback."""

    def __init__(self, config: uvicorn.Config, stop_requests: Callable[[], None], unix: Path | None = None):
        super().__init__(config)
        self.stop_requests, self.unix = stop_requests, unix

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.stop_requests()
        await super().shutdown(sockets)
        if self.unix is not None:  # now: uvicorn re-raises Ctrl-C next, and `meshlm serve` exits on it at once
            self.unix.unlink(missing_ok=True)
