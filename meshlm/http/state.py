"""What the handlers share: one `ServerState` per app (the model, its engine, the names served, the key, the
timeout, the chat template, the requests in flight, the metrics) and, per HTTP request, the `Group` of its
rows, which the engine's thread wakes on every change."""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request as HTTPRequest

from meshlm.api import LanguageModel
from meshlm.chat import ChatTemplate
from meshlm.http.metrics import Metrics
from meshlm.http.protocol import APIError
from meshlm.serve.engine import Engine, Request
from meshlm.serve.grammar import Constraint
from meshlm.serve.params import SamplingParams
from meshlm.tokenizer import Tokenizer

STOPPING = -1  # the update that tells a handler the server is stopping
MAX_REQUEST_BYTES = 4 * 2**20  # a request body's default limit (413 past it): a 128k-token prompt is ~1 MB
GRAMMAR_WORKERS = 2  # threads compiling constraints: a slow one (up to its budget) leaves the other free


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
