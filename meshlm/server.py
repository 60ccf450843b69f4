"""HTTP serving: OpenAI-compatible `/v1/completions` (plus `/v1/models`, `/health`, Prometheus `/metrics`)
and the seed's `/complete`.

The generation engine (`meshlm.engine`) steps on its own thread: requests become rows in its bounded
queue, join the running batch between decode chunks and leave as soon as they finish. The HTTP side
(FastAPI on uvicorn) only validates, adds requests and relays their outputs; it never compiles anything,
since the engine compiled every shape it can use before the server started listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import secrets
import socket
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Annotated, Any

import numpy as np
import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from meshlm.api import LanguageModel
from meshlm.config import ConfigError, InputError
from meshlm.engine import Engine, QueueFull, Request
from meshlm.generate import SamplingParams
from meshlm.tokenizer import Tokenizer

MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 5
# OpenAI fields meshlm does not implement, with the values that mean "off"; anything else is refused
UNSUPPORTED = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
}
BACKLOG = 2048  # connections the kernel queues before the server accepts them (uvicorn's default)
STOPPING = -1  # the update that tells a handler the server is stopping
SHUTDOWN_TIMEOUT = 5.0  # seconds uvicorn waits for requests to answer once stopping, then cancels them


# ---------------------------------------------------------------------------------------------------
# Request bodies


class CompletionRequest(BaseModel):
    """POST /v1/completions, as OpenAI defines it (plus top_k and repetition_penalty)."""

    model_config = ConfigDict(extra="allow", strict=True)  # other fields (user, ...) are ignored

    prompt: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    n: Annotated[int, Field(ge=1, le=64)] = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    stream: bool = False


class LegacyRequest(BaseModel):
    """POST /complete, the seed's endpoint: {"context", "top_p", "temp"} and optionally "gen_len"."""

    model_config = ConfigDict(extra="ignore")

    context: str
    top_p: Annotated[float, Field(gt=0, le=1)] = 0.9
    temp: Annotated[float, Field(ge=0, le=2)] = 1.0
    gen_len: Annotated[int, Field(ge=1)] = 512


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------------
# The app


class Group:
    """The rows of one HTTP request and the queue that wakes its handler (with a row's index) on every change."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.updates: asyncio.Queue[int] = asyncio.Queue()
        self.rows: list[Request] = []

    def add(self, prompts: list[list[int]], params: list[SamplingParams], tokenizer: Tokenizer) -> None:
        """Add the rows to the engine (all or none)."""
        self.rows = self.engine.add_requests(prompts, params, on_update=self._changed, tokenizer=tokenizer)

    def _changed(self, index: int) -> None:
        """Wake the handler; called from the engine's thread, which may outlive the event loop at shutdown."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for this row any more
            self.loop.call_soon_threadsafe(self.updates.put_nowait, index)

    def cancel(self) -> None:
        """Stop every row still running (client gone, timeout, or done): the engine frees them at its next step."""
        for row in self.rows:
            self.engine.abort(row.id)


def create_app(
    lm: LanguageModel,
    engine: Engine,
    model_name: str,
    api_key: str | None = None,
    request_timeout: float | None = None,
) -> FastAPI:
    """The HTTP API over an engine stepping on its own thread (`engine.start`). With `api_key`, every route but
    /health needs `Authorization: Bearer <api_key>`; a request running past `request_timeout` seconds is stopped (408).
    `app.state.stop()` answers every request in flight 503 and refuses new ones (the server is stopping)."""
    if request_timeout is not None and not request_timeout > 0:
        raise InputError(f"request_timeout must be a number of seconds > 0, got {request_timeout!r}")
    app = FastAPI(title="meshlm", description="OpenAI-compatible completions over a meshlm model")
    tok = lm.tokenizer
    ctx = engine.max_len
    created = int(time.time())
    metrics = Metrics(engine)
    open_paths = {"/health"}
    in_flight: set[Group] = set()
    app.state.stopping = False

    def stop() -> None:
        app.state.stopping = True
        for group in in_flight:
            group.updates.put_nowait(STOPPING)

    app.state.stop = stop

    @app.middleware("http")
    async def authorize(request: HTTPRequest, call_next: Callable[[HTTPRequest], Awaitable[Any]]) -> Any:
        if api_key is not None and request.url.path not in open_paths:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                body = error_body("a valid API key is needed: Authorization: Bearer <key>", "invalid_request_error")
                body["error"]["code"] = "invalid_api_key"
                return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    @app.exception_handler(APIError)
    async def on_api_error(request: HTTPRequest, e: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(error_body(e.message, e.kind, e.param), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: HTTPRequest, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        message = f"{where}: {first['msg']}" if where else first["msg"]
        return JSONResponse(error_body(message, "invalid_request_error", where or None), status_code=400)

    @app.exception_handler(HTTPException)
    async def on_http(request: HTTPRequest, e: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def on_crash(request: HTTPRequest, e: Exception) -> JSONResponse:
        traceback.print_exc()
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        s = engine.snapshot()
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

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "meshlm", "max_model_len": ctx}
        return {"object": "list", "data": [card]}

    def encode(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return lm.encode_prompt(prompt)
        if not prompt:
            raise APIError(400, "prompt: a token list must not be empty", param="prompt")
        if min(prompt) < 0 or max(prompt) >= lm.config.n_vocab_used:
            raise APIError(400, f"prompt: token ids must lie in [0, {lm.config.n_vocab_used})", param="prompt")
        return prompt

    def make_group(prompts: list[list[int]], body: CompletionRequest) -> Group:
        """The request's rows (`n` per prompt) added to the engine."""
        if app.state.stopping:
            raise APIError(503, "the server is shutting down", kind="server_error")
        max_tokens = body.max_tokens if body.max_tokens is not None else ctx - max(map(len, prompts))
        for p in prompts:
            if len(p) + max_tokens > ctx:
                raise APIError(
                    400,
                    f"this model's context is {ctx} tokens; the prompt has {len(p)} and max_tokens is {max_tokens}",
                    param="max_tokens" if len(p) < ctx else "prompt",
                )
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        group = Group(engine)
        seed = secrets.randbits(31) if body.seed is None else body.seed
        try:
            base = SamplingParams(
                max_new_tokens=max_tokens,
                temperature=body.temperature,
                top_k=body.top_k,
                top_p=body.top_p,
                repetition_penalty=body.repetition_penalty,
                stop=tuple(s for s in stop if s),
                stop_token_ids=(tok.eot_id,),
            )
            group.add([p for p in prompts for _ in range(body.n)],
                      [base.replace(seed=seed + j) for _ in prompts for j in range(body.n)], tok)  # fmt: skip
        except ValueError as e:  # InputError among them: a request that can never run
            raise APIError(400, str(e)) from None
        except QueueFull:
            raise APIError(503, "the server is busy (queue full); retry shortly", kind="server_overloaded") from None
        return group

    async def next_update(group: Group, deadline: float | None) -> int:
        """The index of the next row that changed; 408 once the request's time is up, 503 once the server stops."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            index = await asyncio.wait_for(group.updates.get(), timeout)
        except TimeoutError:
            raise APIError(408, f"the request ran past the server's timeout of {request_timeout:g} s",
                           kind="timeout") from None  # fmt: skip
        if index == STOPPING:
            raise APIError(503, "the server is shutting down", kind="server_error")
        return index

    @contextlib.contextmanager
    def answering(group: Group) -> Iterator[None]:
        """While a request is answered `stop` reaches it; once it is (or its client has gone), its rows stop
        and its latencies are recorded."""
        in_flight.add(group)
        try:
            yield
        finally:
            in_flight.discard(group)
            group.cancel()
            metrics.observe(group)

    def deadline() -> float | None:
        return None if request_timeout is None else time.monotonic() + request_timeout

    async def wait(group: Group, request: HTTPRequest) -> None:
        """Until every row of a request has finished; a client that goes away cancels its rows at once."""
        until = deadline()
        watcher = asyncio.create_task(_disconnected(request))
        with answering(group):
            try:
                while not all(r.output.finished or r.error for r in group.rows):
                    update = asyncio.create_task(next_update(group, until))
                    await asyncio.wait({update, watcher}, return_when=asyncio.FIRST_COMPLETED)
                    if watcher.done():
                        update.cancel()
                        return
                    update.result()
            finally:
                watcher.cancel()
        for row in group.rows:
            if row.error:
                raise APIError(500, row.error, kind="server_error")

    def logprobs_of(row: Request, start: int, n_top: int, offset: int) -> dict[str, Any]:
        """OpenAI's legacy logprobs object for the row's tokens from `start` on."""
        out = row.output
        tokens = out.tokens[start:]
        texts = [tok.decode([t]) for t in tokens]
        offsets = list(np.cumsum([0, *map(len, texts)])[:-1] + offset)
        tops = [{tok.decode([i]): lp for i, lp in alts[:n_top]} for alts in out.top_logprobs[start:]]
        return {
            "tokens": texts,
            "token_logprobs": out.logprobs[start:],
            "top_logprobs": tops if n_top else None,
            "text_offset": [int(o) for o in offsets],
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Any:
        for name, value in (body.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise APIError(400, f"{name} is not supported by this server", param=name)
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo together with logprobs (prompt scoring) is not supported", param="echo")
        if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)):
            raw = [body.prompt]
        else:
            raw = list(body.prompt)
        if not raw:
            raise APIError(400, "prompt: must not be an empty list", param="prompt")
        prompts = [encode(p) for p in raw]
        prefixes = [
            (p if isinstance(p, str) else tok.decode(p)) if body.echo else "" for p in raw for _ in range(body.n)
        ]
        group = make_group(prompts, body)
        cid = f"cmpl-{secrets.token_hex(12)}"
        now = int(time.time())

        if body.stream:
            return StreamingResponse(
                stream_rows(group, prefixes, body, cid, now),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        await wait(group, request)
        choices = []
        for i, (row, prefix) in enumerate(zip(group.rows, prefixes, strict=True)):
            lp = logprobs_of(row, 0, body.logprobs, len(prefix)) if body.logprobs is not None else None
            out = row.output
            choices.append({"text": prefix + out.text, "index": i, "logprobs": lp, "finish_reason": out.finish_reason})
        n_prompt = sum(len(p) for p in prompts) * body.n
        n_out = sum(len(r.output.tokens) for r in group.rows)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
        if engine.speculate:  # OpenAI's names for predicted tokens kept and thrown away
            accepted = sum(r.accepted for r in group.rows)
            rejected = sum(r.proposed - r.accepted for r in group.rows)
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": rejected,
            }
        return {"id": cid, "object": "text_completion", "created": now, "model": model_name, "choices": choices,
                "usage": usage}  # fmt: skip

    async def stream_rows(
        group: Group, prefixes: list[str], body: CompletionRequest, cid: str, now: int
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per piece of new text, a last chunk per row with its finish_reason.
        A client that goes away closes this generator, which cancels the rows."""

        def event(index: int, text: str, lp: dict | None, reason: str | None) -> str:
            choice = {"text": text, "index": index, "logprobs": lp, "finish_reason": reason}
            chunk = {"id": cid, "object": "text_completion", "created": now, "model": model_name, "choices": [choice]}
            return f"data: {json.dumps(chunk)}\n\n"

        rows = group.rows
        sent_tokens = [0] * len(rows)
        offsets = [len(p) for p in prefixes]
        until = deadline()
        with answering(group):
            for i, prefix in enumerate(prefixes):
                if prefix:
                    yield event(i, prefix, None, None)
            open_rows = set(range(len(rows)))
            while open_rows:
                try:
                    i = await next_update(group, until)
                except APIError as e:
                    yield f"data: {json.dumps(error_body(e.message, e.kind))}\n\n"
                    break
                if i not in open_rows:
                    continue
                row = rows[i]
                if row.error:
                    yield f"data: {json.dumps(error_body(row.error, 'server_error'))}\n\n"
                    open_rows.discard(i)
                    continue
                with row.lock:
                    text = row.output.take_text()
                    done = row.output.finished
                    lp = None
                    if body.logprobs is not None:
                        lp = logprobs_of(row, sent_tokens[i], body.logprobs, offsets[i])
                        sent_tokens[i] = len(row.output.tokens)
                offsets[i] += len(text)
                if text or done:
                    yield event(i, text, lp, row.output.finish_reason if done else None)
                if done:
                    open_rows.discard(i)
            yield "data: [DONE]\n\n"

    @app.post("/complete")
    async def complete(body: LegacyRequest, request: HTTPRequest) -> dict[str, str]:
        prompt = encode(body.context)
        if len(prompt) >= ctx:
            raise APIError(400, f"context has {len(prompt)} tokens; this model's context is {ctx}", param="context")
        try:
            completion = CompletionRequest(
                prompt=[prompt],
                max_tokens=min(body.gen_len, ctx - len(prompt)),
                temperature=body.temp,
                top_p=body.top_p,
            )
        except ValidationError as e:
            raise APIError(400, e.errors()[0]["msg"]) from None
        group = make_group([prompt], completion)
        await wait(group, request)
        return {"completion": group.rows[0].output.text}

    return app


async def _disconnected(request: HTTPRequest, every: float = 0.25) -> None:
    """Returns once the client has gone away."""
    while not await request.is_disconnected():
        await asyncio.sleep(every)


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
    sock: socket.socket | None = None,
) -> None:
    """Compile every shape the engine can use, then serve until interrupted (Ctrl-C: KeyboardInterrupt).
    `sock`: a socket from `bind` (closed on return); by default host:port is bound before anything else."""
    with sock or bind(host, port) as sock:
        engine = lm.engine(
            draft=draft,
            attention=attention,
            max_batch=max_batch,
            max_len=max_len,
            kv_tokens=kv_tokens,
            prefix_caching=prefix_caching,
            ngram=ngram,
            speculate=speculate,
        )
        app = create_app(lm, engine, model_name, api_key=api_key, request_timeout=request_timeout)
        state = engine.snapshot()
        print(
            f"meshlm serve: {engine.max_batch} rows, {state.kv_tokens} KV tokens "
            f"({state.kv_bytes_per_token * state.page_size * (state.kv_pages + 1) / 2**30:.2f} GiB per device), "
            f"context {engine.max_len}; compiling ...",
            flush=True,
        )
        shapes, seconds = engine.warm_up()
        print(f"meshlm serve: compiled {shapes} shapes in {seconds:.1f} s", flush=True)
        where = _address(*sock.getsockname()[:2])
        try:
            sock.listen(BACKLOG)
        except OSError as e:  # another socket bound the port with SO_REUSEADDR too, and listened first
            raise _listen_error(e, where) from None
        config = uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=SHUTDOWN_TIMEOUT)
        engine.start(chunk=chunk, max_queue=max_queue)
        print(f"meshlm serve: {lm} as {model_name!r} on http://{where}", flush=True)
        try:
            asyncio.run(_Server(config, app.state.stop).serve(sockets=[sock]))
        finally:
            engine.stop()


class _Server(uvicorn.Server):
    """uvicorn's server, which answers the requests in flight (503) as soon as it starts to stop (Ctrl-C,
    SIGTERM): a generation can run for minutes, and uvicorn would cancel it, logging a traceback."""

    def __init__(self, config: uvicorn.Config, stop_requests: Callable[[], None]):
        super().__init__(config)
        self.stop_requests = stop_requests

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.stop_requests()
        await super().shutdown(sockets)
