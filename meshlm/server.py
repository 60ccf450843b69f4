"""HTTP serving: OpenAI-compatible `/v1/completions` (plus `/v1/models`, `/health`) and the seed's `/complete`.

One background thread (`Engine`) owns the batch on the devices. Requests become rows in a bounded
queue; between decode chunks the engine prefills queued rows into free slots of the running batch,
and rows leave as soon as they finish, so requests that arrive together decode together without
waiting for each other. The HTTP side (FastAPI on uvicorn) only validates, enqueues and relays.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from meshlm.api import LanguageModel
from meshlm.config import InputError
from meshlm.generate import RowOutput, SamplingParams, any_sampling, check_chunk

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


class QueueFull(Exception):
    """The engine's queue is full; the client should retry later."""


@dataclass(eq=False)
class Row:
    """One completion being generated, shared by the engine thread and the request handler."""

    prompt: list[int]
    seq: RowOutput
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue  # shared by the rows of one request: receives `index` on every change
    index: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards `seq` between the two threads
    cancelled: bool = False
    error: str | None = None

    def notify(self) -> None:
        """Wake the handler (from the engine thread)."""
        self.loop.call_soon_threadsafe(self.updates.put_nowait, self.index)


class Engine:
    """The decode loop: a fixed batch of `max_batch` slots on the devices that rows join and leave."""

    def __init__(
        self, lm: LanguageModel, max_batch: int = 8, max_queue: int = 64, chunk: int = 4, max_len: int | None = None
    ):
        for name, value in (("max_batch", max_batch), ("max_queue", max_queue)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be an integer >= 1, got {value!r}")
        self.chunk = check_chunk(chunk)
        self.lm = lm
        self.gen = lm.generator
        self.max_batch = self.gen.batch_bucket(max_batch) if max_batch % self.gen.batch_ways else max_batch
        self.max_queue = max_queue
        if max_len is not None and not 0 < max_len <= lm.config.max_seq_len:
            raise InputError(f"max_len must be in [1, {lm.config.max_seq_len}] (the model's context), got {max_len}")
        self.cache_len = max_len or lm.config.max_seq_len  # every decode step reads all of it: smaller is faster
        self.pending: deque[Row] = deque()
        self.slots: list[Row | None] = [None] * self.max_batch
        self.wake = threading.Condition()
        self.stopped = False
        self.tokens_generated = 0
        self.decode_calls = 0  # device calls of the decode loop: what batching saves
        self.rows = self.gen.empty(self.max_batch, self.cache_len)
        self.thread = threading.Thread(target=self._loop, name="meshlm-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.wake:
            self.stopped = True
            self.wake.notify()
        self.thread.join(timeout=10)

    def warm_up(self) -> None:
        """Compile the decode loop and a one-row prefill before the first request needs them."""
        loop = asyncio.new_event_loop()
        row = Row([self.lm.tokenizer.eot_id], RowOutput(SamplingParams(max_new_tokens=2)), loop, asyncio.Queue())
        self._admit([row])
        self._decode()
        self.slots = [None] * self.max_batch
        loop.close()

    @property
    def active(self) -> int:
        return sum(r is not None for r in self.slots)

    def submit(self, rows: list[Row]) -> None:
        with self.wake:
            if len(self.pending) + len(rows) > self.max_queue:
                raise QueueFull
            self.pending.extend(rows)
            self.wake.notify()

    # the engine thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.wake:
                while not self.stopped and not self.pending and not self.active:
                    self.wake.wait()
                if self.stopped:
                    return
                batch = self._take_pending()
            try:
                if batch:
                    self._admit(batch)
                if self.active:
                    self._decode()
            except Exception as e:  # a device failure fails the rows in flight, never the server
                traceback.print_exc()
                message = f"generation failed: {type(e).__name__}: {e}"
                for row in batch:
                    self._fail(row, message)
                self._fail_all(message)

    def _take_pending(self) -> list[Row]:
        """Queued rows for the free slots."""
        batch: list[Row] = []
        while self.pending and len(batch) < self.max_batch - self.active:
            row = self.pending.popleft()
            if not row.cancelled:
                batch.append(row)
        return batch

    def _prefill_rows(self, n: int) -> int:
        """Rows of a prefill for n new rows: powers of 4 (1, 4, 16, ...), so few prefill shapes compile."""
        rows = 1
        while rows < n:
            rows *= 4
        return min(self.gen.batch_bucket(rows), self.max_batch)

    def _admit(self, batch: list[Row]) -> None:
        free = [i for i, r in enumerate(self.slots) if r is None][: len(batch)]
        prompts, params = [r.prompt for r in batch], [r.seq.sampling for r in batch]
        new, step = self.gen.prefill(prompts, params, self._prefill_rows(len(batch)), self.cache_len)
        self.rows = self.gen.insert(self.rows, new, free)
        for i, (slot, row) in enumerate(zip(free, batch, strict=True)):
            self.slots[slot] = row
            self._deliver(slot, row, step, i)

    def _decode(self) -> None:
        finished = np.array([r is None or r.seq.finished or r.cancelled for r in self.slots])
        self.rows = self.gen.finish(self.rows, finished)
        sampling = any_sampling([r.seq.sampling for r in self.slots if r is not None])
        self.rows, step = self.gen.decode(self.rows, self.chunk, sampling)
        self.decode_calls += 1
        for slot, row in enumerate(self.slots):
            if row is not None:
                self._deliver(slot, row, step, slot)

    def _deliver(self, slot: int, row: Row, step: Any, index: int) -> None:
        if row.cancelled:
            self.slots[slot] = None
            return
        with row.lock:
            before = len(row.seq.tokens)
            row.seq.add(step, index)
            self.tokens_generated += len(row.seq.tokens) - before
        if row.seq.finished:
            self.slots[slot] = None
        row.notify()

    def _fail(self, row: Row, error: str) -> None:
        row.error = error
        row.notify()

    def _fail_all(self, error: str) -> None:
        for slot, row in enumerate(self.slots):
            if row is not None:
                self._fail(row, error)
                self.slots[slot] = None
        self.rows = self.gen.empty(self.max_batch, self.cache_len)


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


def create_app(lm: LanguageModel, engine: Engine, model_name: str) -> FastAPI:
    app = FastAPI(title="meshlm", description="OpenAI-compatible completions over a meshlm model")
    tok = lm.tokenizer
    ctx = engine.cache_len
    created = int(time.time())

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(error_body(e.message, e.kind, e.param), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        message = f"{where}: {first['msg']}" if where else first["msg"]
        return JSONResponse(error_body(message, "invalid_request_error", where or None), status_code=400)

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, e: Exception) -> JSONResponse:
        traceback.print_exc()
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "active": engine.active,
            "queued": len(engine.pending),
            "max_batch": engine.max_batch,
            "tokens_generated": engine.tokens_generated,
            "decode_calls": engine.decode_calls,
        }

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

    def make_rows(prompts: list[list[int]], body: CompletionRequest) -> list[Row]:
        max_tokens = body.max_tokens if body.max_tokens is not None else ctx - max(map(len, prompts))
        for p in prompts:
            if len(p) + max_tokens > ctx:
                raise APIError(
                    400,
                    f"this model's context is {ctx} tokens; the prompt has {len(p)} and max_tokens is {max_tokens}",
                    param="max_tokens" if len(p) < ctx else "prompt",
                )
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
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
        except ValueError as e:
            raise APIError(400, str(e)) from None
        loop, updates = asyncio.get_running_loop(), asyncio.Queue()
        seed = secrets.randbits(31) if body.seed is None else body.seed
        rows = []
        for p in prompts:
            for j in range(body.n):
                sampling = base.replace(seed=seed + j)
                rows.append(Row(p, RowOutput(sampling, tok), loop, updates, index=len(rows)))
        return rows

    def submit(rows: list[Row]) -> None:
        if len(rows) > engine.max_queue:
            raise APIError(
                400, f"request asks for {len(rows)} completions; this server takes at most {engine.max_queue}"
            )
        try:
            engine.submit(rows)
        except QueueFull:
            raise APIError(503, "the server is busy (queue full); retry shortly", kind="server_overloaded") from None

    async def wait(rows: list[Row]) -> None:
        """Until every row of a request has finished."""
        while not all(r.seq.finished or r.error for r in rows):
            await rows[0].updates.get()
        for row in rows:
            if row.error:
                raise APIError(500, row.error, kind="server_error")

    def logprobs_of(row: Row, start: int, n_top: int, offset: int) -> dict[str, Any]:
        """OpenAI's legacy logprobs object for the row's tokens from `start` on."""
        seq = row.seq
        tokens = seq.tokens[start:]
        texts = [tok.decode([t]) for t in tokens]
        offsets = list(np.cumsum([0, *map(len, texts)])[:-1] + offset)
        tops = [{tok.decode([i]): lp for i, lp in alts[:n_top]} for alts in seq.top_logprobs[start:]]
        return {
            "tokens": texts,
            "token_logprobs": seq.logprobs[start:],
            "top_logprobs": tops if n_top else None,
            "text_offset": [int(o) for o in offsets],
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
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
        rows = make_rows(prompts, body)
        prefixes = [
            (p if isinstance(p, str) else tok.decode(p)) if body.echo else "" for p in raw for _ in range(body.n)
        ]
        submit(rows)
        cid = f"cmpl-{secrets.token_hex(12)}"
        now = int(time.time())

        if body.stream:
            return StreamingResponse(
                stream_rows(rows, prefixes, body, cid, now),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            await wait(rows)
        finally:
            for row in rows:
                row.cancelled = not row.seq.finished
        choices = []
        for i, (row, prefix) in enumerate(zip(rows, prefixes, strict=True)):
            lp = logprobs_of(row, 0, body.logprobs, len(prefix)) if body.logprobs is not None else None
            choices.append(
                {"text": prefix + row.seq.text, "index": i, "logprobs": lp, "finish_reason": row.seq.finish_reason}
            )
        n_prompt = sum(len(p) for p in prompts) * body.n
        n_out = sum(len(r.seq.tokens) for r in rows)
        return {
            "id": cid,
            "object": "text_completion",
            "created": now,
            "model": model_name,
            "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
        }

    async def stream_rows(
        rows: list[Row], prefixes: list[str], body: CompletionRequest, cid: str, now: int
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per piece of new text, a last chunk per row with its finish_reason."""

        def event(index: int, text: str, lp: dict | None, reason: str | None) -> str:
            choice = {"text": text, "index": index, "logprobs": lp, "finish_reason": reason}
            chunk = {"id": cid, "object": "text_completion", "created": now, "model": model_name, "choices": [choice]}
            return f"data: {json.dumps(chunk)}\n\n"

        sent_tokens = [0] * len(rows)
        offsets = [len(p) for p in prefixes]
        try:
            for i, prefix in enumerate(prefixes):
                if prefix:
                    yield event(i, prefix, None, None)
            open_rows = set(range(len(rows)))
            while open_rows:
                i = await rows[0].updates.get()
                if i not in open_rows:
                    continue
                row = rows[i]
                if row.error:
                    yield f"data: {json.dumps(error_body(row.error, 'server_error'))}\n\n"
                    open_rows.discard(i)
                    continue
                with row.lock:
                    text = row.seq.take_text()
                    done = row.seq.finished
                    lp = None
                    if body.logprobs is not None:
                        lp = logprobs_of(row, sent_tokens[i], body.logprobs, offsets[i])
                        sent_tokens[i] = len(row.seq.tokens)
                offsets[i] += len(text)
                if text or done:
                    yield event(i, text, lp, row.seq.finish_reason if done else None)
                if done:
                    open_rows.discard(i)
            yield "data: [DONE]\n\n"
        finally:  # the client went away or everything finished: stop any row still running
            for row in rows:
                if not row.seq.finished:
                    row.cancelled = True

    @app.post("/complete")
    async def complete(body: LegacyRequest) -> dict[str, str]:
        prompt = encode(body.context)
        if len(prompt) >= ctx:
            raise APIError(400, f"context has {len(prompt)} tokens; this model's context is {ctx}", param="context")
        request = CompletionRequest(
            prompt=[prompt], max_tokens=min(body.gen_len, ctx - len(prompt)), temperature=body.temp, top_p=body.top_p
        )
        (row,) = make_rows([prompt], request)
        submit([row])
        try:
            await wait([row])
        finally:
            row.cancelled = not row.seq.finished
        return {"completion": row.seq.text}

    return app


def serve(
    lm: LanguageModel,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = 8,
    max_queue: int = 64,
    chunk: int = 4,
    model_name: str = "meshlm",
    max_len: int | None = None,
) -> None:
    """Compile, then serve until interrupted."""
    import uvicorn

    engine = Engine(lm, max_batch=max_batch, max_queue=max_queue, chunk=chunk, max_len=max_len)
    print(f"meshlm serve: compiling for a batch of {engine.max_batch} x {engine.cache_len} tokens ...", flush=True)
    engine.warm_up()
    engine.start()
    app = create_app(lm, engine, model_name)
    print(f"meshlm serve: {lm} as {model_name!r} on http://{host}:{port}", flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        engine.stop()
