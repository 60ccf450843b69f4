"""The HTTP server's app and its life, as vLLM's OpenAI-compatible server serves: `create_app` wires the routes
(`meshlm.http.handlers`), the API key, the body limit and the error handlers over an engine stepping on its own
thread; `serve` binds, compiles every shape the engine can use, listens, and stops cleanly (requests in flight
answered 503). The server never compiles anything while it listens, and drives the engine through its public
methods alone (`add_requests`, `abort`, `snapshot`, the adapter methods)."""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from meshlm.api import LanguageModel
from meshlm.chat import ChatTemplate, load_chat_template
from meshlm.config import ConfigError, InputError
from meshlm.http.handlers import ROUTES
from meshlm.http.metrics import Metrics
from meshlm.http.protocol import APIError, error_body, on_api_error, on_crash, on_http, on_invalid
from meshlm.http.state import MAX_REQUEST_BYTES, ServerState, state_of
from meshlm.serve.config import EngineConfig
from meshlm.serve.engine import Engine

BACKLOG = 2048  # connections the kernel queues before the server accepts them (uvicorn's default)
SHUTDOWN_TIMEOUT = 5.0  # seconds uvicorn waits for requests to answer once stopping, then cancels them


# ---------------------------------------------------------------------------------------------------
# Middleware


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


# ---------------------------------------------------------------------------------------------------
# The app


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
    config: EngineConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    model_name: str = "meshlm",
    api_key: str | None = None,
    request_timeout: float | None = None,
    draft: LanguageModel | None = None,
    chat_template: str | Path | None = None,
    adapters: dict[str, str | Path] | None = None,
    adapter_roots: Sequence[str | Path] | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> None:
    """Compile every shape the engine can use, then serve until interrupted (Ctrl-C: KeyboardInterrupt).
    `config`: the engine's settings (`EngineConfig`: rows, lengths, the KV pool, speculation with `draft`,
    adapter slots, the loop's chunk and queue). `sock`: a socket from `bind` or `bind_unix` (closed on return; a
    unix socket's file removed); by default host:port is bound before anything else.
    `chat_template`: a Jinja file for /v1/chat/completions (default: the model's own template, if any).
    `adapters` (name -> folder): LoRA adapters served by name beside the model, in the config's adapter slots;
    `adapter_roots` (None: off) lets /v1/load_lora_adapter add more while serving, from folders under them.
    `max_request_bytes`: the largest request body (413 past it)."""
    with sock or bind(host, port) as sock:
        chat = load_chat_template(lm.tokenizer, chat_template)  # a bad file fails before anything compiles
        engine = lm.engine(config, draft=draft, adapters=adapters)
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
        cached = engine.snapshot().cached_shapes
        read_back = f" ({cached} read back from the compilation cache)" if cached else ""
        print(f"meshlm serve: compiled {shapes} shapes in {seconds:.1f} s{read_back}", flush=True)
        where = _where(sock)
        try:
            sock.listen(BACKLOG)
        except OSError as e:  # another socket bound the port with SO_REUSEADDR too, and listened first
            raise _listen_error(e, where) from None
        server = uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=SHUTDOWN_TIMEOUT)
        engine.start()
        print(f"meshlm serve: {lm} as {model_name!r} on {where}", flush=True)
        unix = Path(sock.getsockname()) if sock.family == socket.AF_UNIX else None
        try:
            asyncio.run(_Server(server, app.state.stop, unix).serve(sockets=[sock]))
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
