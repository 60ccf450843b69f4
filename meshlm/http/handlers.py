"""The routes: OpenAI's `/v1/completions` (with prompt scoring) and `/v1/chat/completions`, `/v1/models`, vLLM's
tokenizer endpoints (`/tokenize`, `/detokenize`, `/tokenizer_info`) and runtime LoRA adapters, `/health`,
Prometheus `/metrics`, and the seed's `/complete`. Each handler validates, adds rows through `meshlm.http.rows`
and answers in OpenAI's shapes (`meshlm.http.openai_format`); `ROUTES` lists them."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from meshlm.api import is_adapter, read_adapter
from meshlm.chat import check_messages
from meshlm.config import ConfigError, DataError, InputError
from meshlm.http.constraints import tool_constraint
from meshlm.http.metrics import MEDIA_TYPE
from meshlm.http.openai_format import (
    assistant_message,
    chat_logprobs,
    legacy_logprobs,
    prompt_logprobs_of,
    prompt_scores,
    sse,
    tool_delta,
    usage,
)
from meshlm.http.protocol import (
    UNSUPPORTED,
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    LegacyRequest,
    LoadAdapterRequest,
    TokenizeRequest,
    UnloadAdapterRequest,
    error_body,
    error_kind,
)
from meshlm.http.rows import (
    add_rows,
    alternatives,
    answering,
    budget,
    check_stream_options,
    check_unsupported,
    encode,
    off_loop,
    output_constraint,
    pieces,
    sampling_params,
    vet_constraint,
    wait,
)
from meshlm.http.state import Group, ServerState, state_of
from meshlm.serve.engine import Engine

# chat_template_kwargs a request may not set: the server's own arguments to the template
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "continue_final_message")
# what a template variable the server also fills must be, when a request's chat_template_kwargs gives it
LIST_TEMPLATE_KWARGS = ("tools", "documents")
REFUSED_ADAPTER_PATH = "lora_path: not an adapter folder under the server's --adapter-root"


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
        "cached_shapes": s.cached_shapes,
        "compiles_since_warm_up": s.compiles_since_warm_up,
    }


async def prometheus(request: HTTPRequest) -> Response:
    return Response(state_of(request).metrics.render(), media_type=MEDIA_TYPE)


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
                prompt_lps, prompt_tops = prompt_scores(row)
                tokens, lps, tops = row.prompt + tokens, [*prompt_lps, *lps], [*prompt_tops, *tops]
            lp = legacy_logprobs(state.token_text, tokens, lps, tops, body.logprobs, 0 if scored else len(echo))
        choice = {"index": i, "text": echo + out.text, "logprobs": lp, "finish_reason": out.finish_reason}
        if body.prompt_logprobs is not None:
            prompt_scores(row)
            choice["prompt_logprobs"] = prompt_logprobs_of(state.token_text, row, body.prompt_logprobs)
        choices.append(choice)
    # a JSONResponse is written as is: FastAPI would walk a scored prompt's thousands of entries first
    model = body.model or state.model_name
    return JSONResponse({"id": cid, "object": "text_completion", "created": now, "model": model, "choices": choices,
                         "usage": usage(group.rows, prompts, state.engine.speculate)})  # fmt: skip


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
                    yield sse(error_body(piece.error, error_kind(piece.error_status)))
                    continue
                if piece.first and (scored or body.prompt_logprobs is not None):  # the prefill scored the prompt
                    row = rows[i]
                    prompt_lps, prompt_tops = prompt_scores(row)
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
                           "usage": usage(group.rows, prompts, state.engine.speculate)})  # fmt: skip
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
        choice = {"index": i, "message": assistant_message(out.text, body.tools, body.tool_choice), "logprobs": lp,
                  "finish_reason": out.finish_reason}  # fmt: skip
        if body.prompt_logprobs is not None:
            prompt_scores(row)
            choice["prompt_logprobs"] = prompt_logprobs_of(state.token_text, row, body.prompt_logprobs)
        choices.append(choice)
    model = body.model or state.model_name
    return JSONResponse({"id": cid, "object": "chat.completion", "created": now, "model": model, "choices": choices,
                         "usage": usage(group.rows, [prompt], state.engine.speculate)})  # fmt: skip


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
                    yield sse(error_body(piece.error, error_kind(piece.error_status)))
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
                    delta = tool_delta(texts[piece.index], body.tools, body.tool_choice)
                choice = {"index": piece.index, "delta": delta, "logprobs": lp, "finish_reason": piece.finish_reason}
                yield chunk([choice], **extra)
        except APIError as e:
            yield sse(error_body(e.message, e.kind))
        else:
            if include_usage:
                yield chunk([], usage=usage(group.rows, [prompt], state.engine.speculate))
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
