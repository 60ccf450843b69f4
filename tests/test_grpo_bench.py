"""benchmarks/grpo_step.py at a tiny shape on the CPU, so the script cannot rot (no speed asserted)."""

import json

import pytest

from benchmarks import grpo_step

PARTS = ("generate", "rewards", "batch", "logps", "host", "update")


@pytest.mark.slow  # ~45 s on 2 cores: the step, the log-prob program and two engines' programs compile
def test_grpo_step_benchmark_prints_and_writes_the_split_and_the_engine_alone(tmp_path, capsys):
    path = tmp_path / "figures.json"
    args = ["--preset", "test-tiny", "--prompts", "2", "--num-generations", "2", "--max-completion-tokens", "8",
            "--micro-batches", "2", "--lora-rank", "4", "--warmup", "1", "--steps", "1",
            "--json", str(path)]  # fmt: skip
    returned = grpo_step.main(args)
    out = capsys.readouterr().out
    figures = json.loads(path.read_text())
    assert figures == json.loads(json.dumps(returned))
    assert figures["preset"] == "test-tiny" and figures["jax"] and figures["device"]
    split = figures["step_s"]
    assert all(split[part] >= 0 for part in PARTS) and split["total"] > 0
    assert split["generate"] > 0 and split["update"] > 0 and split["logps"] > 0  # beta > 0 by default
    assert 0.9 * split["total"] <= sum(split[part] for part in PARTS) <= split["total"] * (1 + 1e-9)
    assert 0 < figures["completion_tokens_per_step"] <= 2 * 2 * 8
    for key in ("rollout_tokens_per_s_inside_training", "engine_alone_tokens_per_s", "inside_vs_alone"):
        assert figures[key] > 0, key
    assert figures["engine_alone_tokens"] == figures["inside_tokens"]  # the same completions sampled again
    for line in ("jax ", "preset test-tiny", "rollouts: generation", "update(s)", "the engine alone:",
                 "inside training / alone:", "no ignore_eos"):  # fmt: skip
        assert line in out, line
