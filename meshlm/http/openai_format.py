"""The server's answers in the shapes OpenAI's clients read: logprobs (legacy completions', chat's and vLLM's
prompt logprobs), usage, server-sent events, and an assistant message or delta holding a forced tool call."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from meshlm.http.constraints import tool_calls
from meshlm.http.protocol import APIError
from meshlm.serve.engine import Request
from meshlm.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # what a logprob of -inf is reported as (JSON has no infinity), as vLLM reports it


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: a JSON payload, or the closing "[DONE]"."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def usage(rows: Sequence[Request], prompts: Sequence[Sequence[int]], speculate: int) -> dict[str, Any]:
    """OpenAI's usage: each prompt counted once, however many completions it has; with speculative decoding,
    (`speculate` tokens a step) OpenAI's names for the predicted tokens kept and thrown away."""
    n_prompt = sum(map(len, prompts))
    n_out = sum(len(r.output.tokens) for r in rows)
    counts: dict[str, Any] = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    if speculate:
        counts["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(r.accepted for r in rows),
            "rejected_prediction_tokens": sum(r.proposed - r.accepted for r in rows),
        }
    return counts


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


def prompt_scores(row: Request) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """A row's prompt logprobs and their alternatives, which its prefill must have scored (else a 500)."""
    out = row.output
    if out.prompt_logprobs is None or out.prompt_top_logprobs is None:
        raise APIError(500, "the engine did not score the prompt", kind="server_error")
    return out.prompt_logprobs, out.prompt_top_logprobs


# ---------------------------------------------------------------------------------------------------
# Tool calls in a reply


def assistant_message(text: str, tools: Any, tool_choice: Any) -> dict[str, Any]:
    """The reply as a message: its text, or the tool calls a forced `tool_choice` made (as vLLM, the
    finish_reason stays the row's own)."""
    calls = tool_calls(text, tools, tool_choice)
    if calls:
        return {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}
    return {"role": "assistant", "content": text, "refusal": None}


def tool_delta(text: str, tools: Any, tool_choice: Any) -> dict[str, Any]:
    """A streamed choice's last delta under a forced `tool_choice`: its calls (indexed), or its text."""
    message = assistant_message(text, tools, tool_choice)
    if "tool_calls" not in message:
        return {"content": text}
    return {"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]}
