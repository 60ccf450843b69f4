"""GRPO's rollouts: the policy's completions of a step's prompts, sampled by meshlm's own engine in the training
process, scored by the run's rewards and turned into the batch a GRPO step trains on (`meshlm.objectives.grpo`).

As trl 1.16's GRPOTrainer with its defaults (steps_per_generation = gradient_accumulation_steps): a batch of
rollouts is `batch_size` completions, `num_generations` of each of `batch_size / num_generations` prompts, and
it feeds `num_iterations` optimizer steps. The engine generates with the policy's current weights, handed over
in place (`Engine.update_weights`: the weights the step trains, not a copy), or, in a LoRA run, over the frozen
base with the current adapter written into its one adapter slot. The log-probs under the rollout's weights
(num_iterations > 1) and the reference's (beta > 0: the frozen starting model, or a LoRA run's base with the
adapter off) come from `train_step.token_logps`, the function the step differentiates.

Each completion's sampling seed is drawn from (the run's seed, the step, the row): a resumed run samples the
completions an uninterrupted run did, with no generator state to save.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from meshlm import grpo, model, rewards
from meshlm.config import ConfigError, InputError, TrainConfig
from meshlm.data import Batch, TokenDataset, read_prompt_records
from meshlm.serve.adapter_slots import Adapter
from meshlm.serve.config import EngineConfig
from meshlm.serve.engine import Engine
from meshlm.serve.grammar import Constraint
from meshlm.serve.outputs import Completion
from meshlm.serve.params import SAMPLING_FIELDS, SamplingParams, check_token_ids
from meshlm.sharding import TRAINING
from meshlm.tokenizer import Tokenizer
from meshlm.train_step import ROW_TOKENS, batch_shardings, make_logps_step

POLICY_ADAPTER = "policy"  # the engine's name for a LoRA run's adapter
# The parts of making a batch of rollouts that `time/<part>_s` measure: the engine's sampling (with the policy's
# hand-over to it), the reward functions, the step's rows with their advantages, and their old and reference log-probs
TIMED = ("generate", "rewards", "batch", "logps")
VALIDATION_STEP = -1  # the "step" validation seeds are drawn from: the same completions' seeds at every validation


def step_seq_len(cfg: TrainConfig, prompt_seq_len: int) -> int:
    """A GRPO step's rows: the longest prompt (a prompts dataset's row) and max_completion_tokens after it."""
    return prompt_seq_len + cfg.grpo.max_completion_tokens


def prompts_per_step(cfg: TrainConfig) -> int:
    return cfg.batch_size // cfg.grpo.num_generations


def sampling_seed(seed: int, step: int, row: int) -> int:
    """A completion's sampling seed: a function of where it is in the run, so a resumed run draws it again."""
    return int(np.random.SeedSequence([seed, step + 1, row]).generate_state(1)[0])


@dataclass
class Rollout:
    """One batch of rollouts: the step's arrays [micro_batches, rows, seq_len + 1] (numpy, by `batch_keys`),
    the metrics trl logs at generation (rewards, completion lengths), and a table of its completions."""

    batch: dict[str, np.ndarray]
    metrics: dict[str, jax.Array]
    table: list[dict[str, Any]]


class Rollouts:
    """The engine over the policy's weights, the prompts' records and the rewards of one GRPO run."""

    def __init__(
        self,
        cfg: TrainConfig,
        mesh: Mesh,
        train_ds: TokenDataset,
        val_sets: dict[str, TokenDataset],
        weights: model.Params,
        tokenizer: Tokenizer,
    ):
        if jax.process_count() > 1:
            raise ConfigError("objective grpo: the rollout loop runs in one process (multi-host runs: not built yet)")
        self.cfg, self.mesh, self.tokenizer = cfg, mesh, tokenizer
        self.rewards = rewards.load(cfg.grpo.rewards)
        self.weights = np.array([r.weight for r in self.rewards], np.float32)
        self.datasets = {"train": train_ds, **{f"val/{name}": ds for name, ds in val_sets.items()}}
        self.records = {name: read_prompt_records(ds.folder, ds.split) for name, ds in self.datasets.items()}
        self.eos = train_ds.eos_id
        first = rollout_sampling(cfg, self.eos, 0, 0)  # a setting the sampler refuses stops the run here, in one line
        self.width = step_seq_len(cfg, train_ds.seq_len) + 1
        lora = {} if cfg.lora is None else {"max_adapters": 1, "max_lora_rank": cfg.lora.rank}
        policy = dataclasses.replace(cfg.policy, remat="none", lora_dropout=0.0)
        config = EngineConfig(max_batch=cfg.batch_size, max_len=self.width, **lora)
        self.engine = Engine(weights, cfg.model, policy, mesh, config, tokenizer=tokenizer, rules=TRAINING)
        try:  # what the engine would refuse at the first rollouts, refused before them
            check_token_ids(first.stop_token_ids, cfg.model.n_vocab_used, "stop_token_ids")
            if first.constraint is not None:
                self.engine.check_constraint(first.constraint, tokenizer)
        except InputError as e:
            raise ConfigError(f"train config: grpo's sampling settings: {e}") from None
        self.logps = make_logps_step(cfg, cfg.model, mesh)

    def use_policy(self, params: model.Params) -> None:
        """Generate with the policy's current trained parameters: the full weights, or a LoRA run's adapter."""
        if self.cfg.lora is None:
            self.engine.update_weights(params)
            return
        if POLICY_ADAPTER in self.engine.adapter_sources():
            self.engine.unload_adapter(POLICY_ADAPTER)
        self.engine.add_adapter(POLICY_ADAPTER, Adapter(jax.device_get(params), "the policy being trained"))

    def generate(self, prompts: list[list[int]], step: int) -> list[Completion]:
        """Completions of `prompts` by the policy the engine holds, seeded by their place in the run."""
        params = [rollout_sampling(self.cfg, self.eos, step, i) for i in range(len(prompts))]
        adapters = None if self.cfg.lora is None else [POLICY_ADAPTER] * len(prompts)
        return self.engine.generate(prompts, params, self.tokenizer, adapters=adapters)

    def score(
        self, name: str, rows: np.ndarray, completions: list[Completion], generations: int
    ) -> tuple[np.ndarray, list[list[int]], list[Any], list[Any]]:
        """Each completion's rewards [N, functions]; its ids (its EOS included, as trl's), and the prompts and
        completions as the reward functions see them (a chat prompt's completion is an assistant message)."""
        records = [self.records[name][r] for r in np.repeat(rows, generations)]
        ids = [completion_ids(c) for c in completions]
        prompts = [r["prompt"] for r in records]
        texts = [
            c.text if isinstance(p, str) else [{"role": "assistant", "content": c.text}]
            for p, c in zip(prompts, completions, strict=True)
        ]
        columns = {key: [r["columns"].get(key) for r in records] for key in records[0]["columns"]}
        per_function, _ = rewards.score(self.rewards, prompts, texts, ids, columns, np.repeat(rows, generations))
        return per_function, ids, prompts, texts

    def make(
        self, params: model.Params, full: model.Params, reference: model.Params | None, prompts: Batch, step: int
    ) -> Rollout:
        """The batch of rollouts for `prompts` (the loader's rows of the prompts dataset) at `step`: sampled by
        the policy (`params`: what the step trains; `full`: the model they are part of; `reference`: the model
        whose log-probs the KL is to, where beta > 0)."""
        cfg, s = self.cfg, self.cfg.grpo
        G = s.num_generations
        rows = prompts.rows.reshape(-1)
        prompt_ids = rollout_prompts(prompts)
        # the previous update's wait is the update's time, not the rollouts' (the hand-over waits for it anyway)
        jax.block_until_ready(params)
        clock = [time.perf_counter()]
        self.use_policy(params)
        completions = self.generate([p for p in prompt_ids for _ in range(G)], step)
        clock.append(time.perf_counter())
        per_function, ids, texts_prompts, texts = self.score("train", rows, completions, G)
        clock.append(time.perf_counter())
        n = len(completions)
        tokens, weights, segments = (np.zeros((n, self.width), np.int32) for _ in range(3))
        truncated = np.array([c.finish_reason == "length" for c in completions])
        for i, completion in enumerate(ids):
            prompt = prompt_ids[i // G]
            end = len(prompt) + len(completion)
            tokens[i, : len(prompt)], tokens[i, len(prompt) : end] = prompt, completion
            weights[i, len(prompt) : end] = 0 if s.mask_truncated_completions and truncated[i] else 1
            segments[i, :end] = 1
        total = grpo.total_rewards(jnp.asarray(per_function), jnp.asarray(self.weights))
        advantages = np.asarray(grpo.group_advantages(total, G, s.scale_rewards))
        M = cfg.micro_batches
        arrays = {"tokens": tokens, "weights": weights.astype(np.float32), "segments": segments,
                  "advantages": advantages, "dapo_tokens": np.full(n, weights.sum() / M, np.float32)}  # fmt: skip
        arrays = {k: v.reshape(M, n // M, *v.shape[1:]) for k, v in arrays.items()}
        clock.append(time.perf_counter())
        if s.num_iterations > 1:
            arrays["old_logps"] = self._logps(full, arrays)
        if s.beta:
            arrays["ref_logps"] = self._logps(reference, arrays)
        clock.append(time.perf_counter())
        lengths = np.array([len(c) for c in ids])
        names = [r.name for r in self.rewards]
        metrics = {
            **grpo.reward_metrics(jnp.asarray(per_function), jnp.asarray(self.weights), names, G, s.scale_rewards),
            **grpo.completion_metrics(jnp.asarray(lengths), jnp.asarray(truncated)),
            # where a batch of rollouts' time goes, beside the steps' (the log's tokens_per_s counts both)
            **{f"time/{part}_s": jnp.asarray(dt) for part, dt in zip(TIMED, np.diff(clock), strict=True)},
        }
        table = [
            {"prompt": p, "completion": t, "rewards": dict(zip(names, map(_value, f), strict=True)),
             "reward": _value(r), "advantage": float(a)}
            for p, t, f, r, a in zip(texts_prompts, texts, per_function, np.asarray(total), advantages, strict=True)
        ]  # fmt: skip
        return Rollout(arrays, metrics, table)

    def _logps(self, params: model.Params, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """`train_step.token_logps` of every row under `params`, a micro-batch at a time, as the step's rows lie."""
        shardings = batch_shardings(self.mesh, tuple(ROW_TOKENS))
        out = [
            np.asarray(self.logps(params, jax.device_put({k: arrays[k][m] for k in ROW_TOKENS}, shardings)))
            for m in range(arrays["tokens"].shape[0])
        ]
        return np.stack(out)

    def validate(self, params: model.Params) -> dict[str, float]:
        """Each validation set's mean reward over its first `val_batches` steps' worth of prompts (all, if fewer),
        `num_generations` completions each, sampled as in training with the same seeds at every validation:
        `val/<name>/reward` and `val/<name>/rewards/<function>/mean`."""
        values, G = {}, self.cfg.grpo.num_generations
        self.use_policy(params)
        for name, ds in self.datasets.items():
            if name == "train":
                continue
            rows = np.arange(min(len(ds), self.cfg.val_batches * prompts_per_step(self.cfg)))
            prompts = [p for p in rollout_prompts(ds[rows]) for _ in range(G)]
            per_function, *_ = self.score(name, rows, self.generate(prompts, VALIDATION_STEP), G)
            total = grpo.total_rewards(jnp.asarray(per_function), jnp.asarray(self.weights))
            values[f"{name}/reward"] = float(jnp.nanmean(total))
            for i, reward in enumerate(self.rewards):
                values[f"{name}/rewards/{reward.name}/mean"] = float(np.nanmean(per_function[:, i]))
        return values


# SamplingParams' fields a rollout sets itself: the grpo section's own settings decide them
# (temperature too: the log-probs the loss compares are of the logits divided by grpo.temperature)
ROLLOUT_MANAGED = frozenset({"max_new_tokens", "temperature", "seed", "logprobs", "prompt_logprobs", "constraint"})


def rollout_sampling(cfg: TrainConfig, eos: int, step: int, row: int) -> SamplingParams:
    """How the engine samples the completion of `row` at `step`: the grpo section's settings (its `generation_kwargs`
    last, overriding, as trl's), stopping at EOS, and seeded by the row's place in the run. ConfigError, in one line,
    for a setting the sampler does not take or refuses."""
    s = cfg.grpo
    given = s.generation_kwargs or {}
    if unknown := sorted(given.keys() - (SAMPLING_FIELDS - ROLLOUT_MANAGED)):
        named = {"max_new_tokens": "max_completion_tokens", "constraint": "structured_outputs_regex",
                 "temperature": "temperature"}  # fmt: skip
        hint = "".join(f"; for {k}, set grpo.{named[k]}" for k in unknown if k in named)
        raise ConfigError(
            f"train config: grpo.generation_kwargs {', '.join(map(repr, unknown))}: not a setting a rollout takes "
            f"(SamplingParams' fields but {', '.join(sorted(ROLLOUT_MANAGED))}){hint}"
        )
    settings = dict(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p or 0.0,
                    repetition_penalty=s.repetition_penalty) | given  # fmt: skip
    constraint = None if s.structured_outputs_regex is None else Constraint.regex(s.structured_outputs_regex)
    seed = sampling_seed(cfg.seed, step, row)
    try:
        ids = (eos, *settings.pop("stop_token_ids", ()))
        stop = settings.pop("stop", ())
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        return SamplingParams(max_new_tokens=s.max_completion_tokens, stop=stop, stop_token_ids=ids, seed=seed,
                              logprobs=0, constraint=constraint, **settings)  # fmt: skip
    except (InputError, TypeError, ValueError) as e:
        raise ConfigError(f"train config: grpo's sampling settings: {e}") from None


def completion_ids(c: Completion) -> list[int]:
    """The ids a completion is trained on: its tokens, and the stop token that ended it (EOS, as trl keeps it); one
    cut by a stop string ends with the token the string starts in (the engine's tokens up to the text it keeps)."""
    return c.tokens + [c.stop_reason] * isinstance(c.stop_reason, int)


def rollout_prompts(rows: Batch) -> list[list[int]]:
    """The prompts of a prompts dataset's rows (of any leading shape): each row's tokens of segment 1 (what
    `Rollouts.generate` takes, each repeated num_generations times)."""
    width = rows.tokens.shape[-1]
    tokens, segments = rows.tokens.reshape(-1, width), rows.segments.reshape(-1, width)
    return [[int(t) for t in row[seg == 1]] for row, seg in zip(tokens, segments, strict=True)]


def _value(x: Any) -> float | None:
    """A reward as JSON has it: NaN (a function's None) as null."""
    return None if np.isnan(x) else float(x)


def write_table(folder: Path, step: int, table: list[dict[str, Any]]) -> Path:
    """The completions a step trained on, as JSON lines, to `completions/step_<step>.jsonl` in the run's log folder."""
    path = folder / "completions" / f"step_{step:08d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": step, **row}) + "\n" for row in table))
    return path
