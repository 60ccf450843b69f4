"""GRPO's rewards (issue 41): trl's reward-function contract, the built-ins against their definitions (the
overlong penalty against trl's own), the weighted sum as trl's nansum, and a failing function stopping the
run in one line that names it and the record."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from trl.rewards import get_soft_overlong_punishment

from meshlm import ConfigError
from meshlm.rewards import RewardError, load, score


def correct_length(prompts, completions, **columns):
    """A user's reward in trl's shape: 1.0 when the completion has the length the record asks for."""
    return [float(len(c) == n) for c, n in zip(completions, columns["length"], strict=True)]


def abstains(prompts, completions, **columns):
    return [None if "?" in c else 0.5 for c in completions]


def fails_on_bad(prompts, completions, **columns):
    return [1.0 / (c != "bad") for c in completions]


def one_too_few(prompts, completions, **columns):
    return [0.0] * (len(completions) - 1)


def nan_on_x(prompts, completions, **columns):
    return [float("nan") if c == "x" else 0.0 for c in completions]


def run(entries: list[dict], completions: list, **columns) -> tuple[np.ndarray, np.ndarray]:
    n = len(completions)
    ids = [list(range(len(c) if isinstance(c, str) else 1)) for c in completions]
    return score(load(entries), ["p"] * n, completions, ids, columns, records=list(range(100, 100 + n)))


def test_exact_match_extracts_the_last_answer_and_compares_it_whole():
    completions = ["so 3, then the answer is 41 ... the answer is 42", "the answer is 420", "no answer", " 42 "]
    entries = [{"function": "exact_match", "extract": r"answer is (\d+)"}, {"function": "exact_match"}]
    per_function, _ = run(entries, completions, answer=["42"] * 4)
    np.testing.assert_array_equal(per_function, [[1, 0], [0, 0], [0, 0], [0, 1]])
    chat = [[{"role": "assistant", "content": "Paris"}], [{"role": "assistant", "content": "paris"}]]
    case, _ = run([{"function": "exact_match"}], chat, answer=["Paris"] * 2)
    assert list(case[:, 0]) == [1, 0]
    folded, _ = run([{"function": "exact_match", "ignore_case": True}], chat, answer=["Paris"] * 2)
    assert list(folded[:, 0]) == [1, 1]


def test_regex_format_matches_the_whole_text_or_anywhere():
    completions = ["<think>x</think> 5", "text <think>x</think> 5", "5"]
    pattern = r"<think>.*</think> \d+"
    full, _ = run([{"function": "regex_format", "pattern": pattern}], completions)
    anywhere, _ = run([{"function": "regex_format", "pattern": pattern, "full": False}], completions)
    assert list(full[:, 0]) == [1, 0, 0] and list(anywhere[:, 0]) == [1, 1, 0]


def test_json_schema_scores_valid_json_only(tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    completions = ['{"n": 3}', '{"n": "3"}', '{"m": 1}', "{n: 3}", "3"]
    for source in (schema, str(tmp_path / "schema.json")):
        per_function, _ = run([{"function": "json_schema", "schema": source}], completions)
        assert list(per_function[:, 0]) == [1, 0, 0, 0, 0]
    with pytest.raises(ConfigError, match="schema is invalid"):
        load([{"function": "json_schema", "schema": {"type": "no such type"}}])


def test_overlong_penalty_is_trls_soft_overlong_punishment():
    lengths = list(range(0, 131, 3))
    ids = [[7] * n for n in lengths]
    want = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)(completion_ids=ids)
    rewards = load([{"function": "overlong_penalty", "max_completion_len": 100, "soft_punish_cache": 20}])
    got, _ = score(rewards, ["p"] * len(ids), ["c"] * len(ids), ids, {}, records=list(range(len(ids))))
    np.testing.assert_allclose(got[:, 0], want, rtol=0, atol=1e-7)
    assert min(want) == -1 and max(want) == 0 and any(-1 < w < 0 for w in want)


def test_the_weighted_sum_is_trls_nansum_and_user_functions_get_the_records_columns():
    entries = [
        {"function": "tests.test_rewards:correct_length", "weight": 2.0},
        {"function": "tests.test_rewards:abstains", "weight": -0.5},
        {"function": "tests.test_rewards:correct_length"},
    ]
    completions = ["ab", "abc?", "a"]
    per_function, total = run(entries, completions, length=[2, 4, 3])
    np.testing.assert_array_equal(per_function[:, 0], [1, 1, 0])
    assert np.isnan(per_function[1, 1])
    weights = torch.tensor([2.0, -0.5, 1.0])
    want = (torch.as_tensor(per_function) * weights.unsqueeze(0)).nansum(dim=1)  # trl's _generate_and_score
    np.testing.assert_allclose(total, want.numpy(), rtol=0, atol=1e-7)
    assert [r.name for r in load(entries)] == ["correct_length", "abstains", "correct_length_2"]


@pytest.mark.parametrize(
    "function, words",
    [
        ("tests.test_rewards:fails_on_bad", "reward fails_on_bad raised on record 101: ZeroDivisionError"),
        ("tests.test_rewards:one_too_few", "reward one_too_few returned 2 rewards for 3 completions"),
        ("tests.test_rewards:nan_on_x", "reward nan_on_x returned nan on record 102: not a finite number"),
    ],
)
def test_a_failing_reward_stops_in_one_line_naming_it_and_the_record(function, words):
    with pytest.raises(RewardError) as e:
        run([{"function": function}], ["good", "bad", "x"])
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "entries, words",
    [
        ([], "non-empty list"),
        ([{"weight": 1}], "needs a function"),
        ([{"function": "no_such_reward"}], "neither a built-in"),
        ([{"function": "tests.no_such_module:f"}], "cannot load tests.no_such_module:f"),
        ([{"function": "tests.test_rewards:json"}], "is not callable"),
        ([{"function": "exact_match", "weight": "high"}], "weight must be a finite number"),
        ([{"function": "exact_match", "colum": "answer"}], "unexpected keyword argument 'colum'"),
        ([{"function": "regex_format", "pattern": "("}], "is not a regular expression"),
        ([{"function": "tests.test_rewards:abstains", "pattern": "x"}], "options ['pattern'] are for built-ins"),
        ([{"function": "overlong_penalty", "max_completion_len": 10, "soft_punish_cache": 20}], "between 0 and"),
    ],
)
def test_bad_reward_entries_are_one_line_config_errors(entries, words):
    with pytest.raises(ConfigError, match=None) as e:
        load(entries)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_built_in_reading_a_missing_column_names_it():
    with pytest.raises(RewardError, match="reads the column 'answer', which the prompt records lack"):
        run([{"function": "exact_match"}], ["a"])
