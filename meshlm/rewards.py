"""Verifiable rewards for reinforcement learning (GRPO): trl's reward-function contract, the built-ins,
and the checks that stop a run in one line.

A reward function takes trl's arguments, `(prompts, completions, completion_ids=..., **columns)`, one entry
per completion: a prompt and its completion as strings (or, for chats, message lists: the completion is
`[{"role": "assistant", "content": ...}]`), the completion's token ids, and every other column of the
prompt's record. It returns one reward per completion, a float or None (not applicable: it counts as 0 in
the weighted sum, as trl's `nansum`). A config lists them as `rewards: [{function: module:name, weight:
1.0, ...}]`; a built-in is named alone (`exact_match`, `regex_format`, `json_schema`, `overlong_penalty`)
and takes its options beside `function` and `weight`.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshlm.config import ConfigError, MeshlmError

RewardFunction = Callable[..., Sequence[float | None]]


class RewardError(MeshlmError):
    """A reward function raised, returned the wrong number of rewards, or returned NaN or inf."""


def text_of(completion: str | list[dict[str, Any]]) -> str:
    """A completion's text: the string, or a chat completion's last message's content."""
    return completion if isinstance(completion, str) else str(completion[-1]["content"]) if completion else ""


# ---------------------------------------------------------------------------------------------------
# Built-ins: factories from a config entry's options to a reward function


def exact_match(column: str = "answer", extract: str | None = None, ignore_case: bool = False) -> RewardFunction:
    """1.0 where the completion's answer equals the record's `column`, else 0.0. `extract`: a regular
    expression whose first group (or whole match) is the answer, the last match in the text (a model's
    final answer follows its reasoning); none found scores 0. Both sides are stripped of whitespace."""
    pattern = _regex(extract, "extract") if extract is not None else None

    def reward(prompts: list, completions: list, **columns: Any) -> list[float]:
        wanted = _column(columns, column, "exact_match")
        scores = []
        for completion, answer in zip(completions, wanted, strict=True):
            got = text_of(completion)
            if pattern is not None:
                found = list(pattern.finditer(got))
                got = (found[-1].group(1) if pattern.groups else found[-1].group(0)) if found else None
            same = got is not None and _fold(got, ignore_case) == _fold(str(answer), ignore_case)
            scores.append(1.0 if same else 0.0)
        return scores

    return reward


def regex_format(pattern: str, full: bool = True) -> RewardFunction:
    """1.0 where the completion's text matches `pattern` (the whole text with `full`, else anywhere)."""
    compiled = _regex(pattern, "pattern")
    match = compiled.fullmatch if full else compiled.search

    def reward(prompts: list, completions: list, **columns: Any) -> list[float]:
        return [1.0 if match(text_of(c)) else 0.0 for c in completions]

    return reward


def json_schema(schema: Mapping[str, Any] | str) -> RewardFunction:
    """1.0 where the completion's text is JSON valid against `schema` (the schema, or a path to a JSON
    file of it), else 0.0. Needs the `jsonschema` package (`pip install 'meshlm[rl]'`)."""
    try:
        import jsonschema
    except ImportError as e:
        raise ConfigError("the json_schema reward needs the jsonschema package: pip install 'meshlm[rl]'") from e
    if isinstance(schema, str):
        try:
            with open(schema) as f:
                schema = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"json_schema reward: cannot read the schema {schema}: {e}") from e
    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ConfigError(f"json_schema reward: the schema is invalid: {e.message}") from e

    def valid(text: str) -> bool:
        try:
            return validator.is_valid(json.loads(text))
        except ValueError:
            return False

    def reward(prompts: list, completions: list, **columns: Any) -> list[float]:
        return [1.0 if valid(text_of(c)) else 0.0 for c in completions]

    return reward


def overlong_penalty(max_completion_len: int, soft_punish_cache: int) -> RewardFunction:
    """DAPO's soft overlong punishment (Eq. 13; trl's `get_soft_overlong_punishment`): 0 up to
    max_completion_len - soft_punish_cache tokens, then falling linearly to -1 at max_completion_len, and -1
    beyond it."""
    if not (isinstance(max_completion_len, int) and isinstance(soft_punish_cache, int)):
        raise ConfigError("overlong_penalty: max_completion_len and soft_punish_cache must be integers")
    if not 0 <= soft_punish_cache <= max_completion_len:
        raise ConfigError("overlong_penalty: soft_punish_cache must be between 0 and max_completion_len")
    free = max_completion_len - soft_punish_cache

    def reward(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float]:
        scores = []
        for ids in completion_ids:
            n = len(ids)
            scores.append(0.0 if n <= free else (free - n) / soft_punish_cache if n <= max_completion_len else -1.0)
        return scores

    return reward


BUILT_INS: dict[str, Callable[..., RewardFunction]] = {
    "exact_match": exact_match,
    "regex_format": regex_format,
    "json_schema": json_schema,
    "overlong_penalty": overlong_penalty,
}


def _regex(pattern: str, field: str) -> re.Pattern:
    try:
        return re.compile(pattern, re.DOTALL)
    except (re.error, TypeError) as e:
        raise ConfigError(f"reward option {field}={pattern!r} is not a regular expression: {e}") from e


def _fold(text: str, ignore_case: bool) -> str:
    text = text.strip()
    return text.casefold() if ignore_case else text


def _column(columns: Mapping[str, Any], name: str, reward: str) -> list:
    if name not in columns:
        raise ValueError(f"{reward} reads the column {name!r}, which the prompt records lack")
    return columns[name]


# ---------------------------------------------------------------------------------------------------
# A config's list of rewards


@dataclass(frozen=True)
class Reward:
    """One entry of a config's `rewards`: its name (for metrics: `rewards/<name>/mean`), function and weight."""

    name: str
    function: RewardFunction
    weight: float


def load(entries: Sequence[Mapping[str, Any]]) -> list[Reward]:
    """The rewards a config lists: `{function: "module:name" | built-in, weight: 1.0, **options}` each."""
    if not isinstance(entries, Sequence) or isinstance(entries, str) or not entries:
        raise ConfigError("rewards must be a non-empty list of {function: module:name, weight: 1.0} entries")
    rewards = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("function"), str):
            raise ConfigError(f"rewards[{i}] needs a function: a built-in ({', '.join(BUILT_INS)}) or module:name")
        options = {k: v for k, v in entry.items() if k not in ("function", "weight")}
        name, weight = entry["function"], entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise ConfigError(f"rewards[{i}] ({name}): weight must be a finite number, got {weight!r}")
        rewards.append(Reward(_name(name, rewards), _function(name, options, i), float(weight)))
    return rewards


def _name(function: str, taken: list[Reward]) -> str:
    """The metric name: the function's own name, with _2, _3... when entries share it."""
    base = function.rpartition(":")[2]
    same = sum(r.name == base or r.name.startswith(f"{base}_") for r in taken)
    return base if not same else f"{base}_{same + 1}"


def _function(name: str, options: dict[str, Any], i: int) -> RewardFunction:
    if name in BUILT_INS:
        try:
            return BUILT_INS[name](**options)
        except TypeError as e:
            raise ConfigError(f"rewards[{i}] ({name}): {e}") from e
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ConfigError(f"rewards[{i}]: {name!r} is neither a built-in ({', '.join(BUILT_INS)}) nor module:name")
    if options:
        raise ConfigError(f"rewards[{i}] ({name}): options {sorted(options)} are for built-ins only")
    try:
        function = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"rewards[{i}]: cannot load {name}: {e}") from e
    if not callable(function):
        raise ConfigError(f"rewards[{i}]: {name} is not callable")
    return function


# ---------------------------------------------------------------------------------------------------
# Scoring a batch of completions


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]],
    records: Sequence[int],
) -> tuple[np.ndarray, np.ndarray]:
    """Each reward function's scores [N, len(rewards)] (NaN where it returned None) and their weighted sum
    [N] (NaN counted as 0, as trl's nansum). `records[i]`: the index of completion i's prompt record, which a
    failure names."""
    n = len(completions)
    per_function = np.zeros((n, len(rewards)), np.float32)
    for j, reward in enumerate(rewards):
        try:
            out = list(reward.function(prompts=list(prompts), completions=list(completions),
                                       completion_ids=[list(c) for c in completion_ids], **columns))  # fmt: skip
        except Exception as e:
            at = _first_failing(reward, prompts, completions, completion_ids, columns)
            where = f"on record {records[at]}" if at is not None else "on this batch"
            raise RewardError(f"reward {reward.name} raised {where}: {type(e).__name__}: {e}") from e
        if len(out) != n:
            raise RewardError(f"reward {reward.name} returned {len(out)} rewards for {n} completions")
        for i, value in enumerate(out):
            if value is not None and (not isinstance(value, int | float | np.number) or not math.isfinite(value)):
                raise RewardError(
                    f"reward {reward.name} returned {value!r} on record {records[i]}: not a finite number"
                )
            per_function[i, j] = np.nan if value is None else value
    weights = np.array([r.weight for r in rewards], np.float32)
    return per_function, np.nansum(per_function * weights, axis=1)


def _first_failing(reward: Reward, prompts, completions, completion_ids, columns) -> int | None:
    """The first completion the function raises on alone (None: it fails only on the whole batch)."""
    for i in range(len(completions)):
        try:
            one = {k: [v[i]] for k, v in columns.items()}
            reward.function(
                prompts=[prompts[i]], completions=[completions[i]], completion_ids=[completion_ids[i]], **one
            )
        except Exception:
            return i
    return None
