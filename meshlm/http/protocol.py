"""What travels over the wire into the server, and its errors in OpenAI's shape: the request bodies, which mirror
OpenAI's (and vLLM's extensions) field for field and refuse a field they do not know, and the error body every
refusal is answered with."""

from __future__ import annotations

import sys
import traceback
from typing import Annotated, Any

from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 5
SEED_RANGE = (-(2**63), 2**63 - 1)  # a request's seed: a 64-bit integer, as vLLM takes it (torch.long)
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
    # output constraints: OpenAI's, and vLLM's extensions (checked by `meshlm.http.constraints.request_constraint`)
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


def error_kind(status: int) -> str:
    """OpenAI's error type for an HTTP status."""
    return "server_error" if status >= 500 else "invalid_request_error"


# ---------------------------------------------------------------------------------------------------
# Exception handlers: every refusal and failure answered in OpenAI's error shape


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
