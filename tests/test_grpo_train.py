"""GRPO's rollout loop (`meshlm.rollout`, objective grpo in `meshlm.train`): the engine samples the policy's completions
in the training process, the rewards score them, and the step trains on them with `meshlm.grpo`'s loss.

The oracles: the engine's own log-probs of the tokens it sampled (its decode programs) against the old log-probs the
training program computes for them; `grpo.policy_loss` recomputed here on a rollout's rows against the loss the run
logged; an uninterrupted run against one stopped and resumed.
"""

import itertools
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import data, grpo, lora, model, prepare, rewards, rollout, train
from meshlm.config import ConfigError, ModelConfig, TrainConfig
from meshlm.data import TokenDataset
from meshlm.loader import TrainLoader
from meshlm.serve.runner import place
from meshlm.sharding import TRAINING, make_mesh
from meshlm.tokenizer import load_tokenizer
from meshlm.train_step import ROW_TOKENS, token_logps
from tests.helpers.chat_templates import tokenizer_folder
from tests.helpers.training import REPO, run_cli_error, start_run, wait_until

PROMPT_LEN = 28  # the prompts dataset's seq_len: prompts of up to 29 tokens (these take 23 to 27: more than a KV page)
MAX_TOKENS = 6
CFG = ModelConfig(
    n_layer=2, d_model=64, n_head=4, d_ff=128, rotary_dim=8, vocab_size=600, n_vocab_used=600, max_seq_len=40
)
REWARDS = [{"function": "regex_format", "pattern": "e", "full": False}, {"function": "exact_match", "weight": 0.5}]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """A prompts dataset as `meshlm prepare --objective grpo` makes it (train and val), with its tokenizer (a BPE
    of 600 ids whose EOS is </s>)."""
    root = tmp_path_factory.mktemp("grpo")
    tok = tokenizer_folder(root / "tokenizer")
    for split, n in (("train", 8), ("val", 4)):
        first = 8 * (split == "val")
        prompt = "Add the numbers {0} and {1}; the sum of {0} and {1} is"
        records = [{"prompt": prompt.format(i, i + 1), "answer": str(2 * i + 1)} for i in range(first, first + n)]
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare.prepare([root / "train.jsonl"], root / "data", PROMPT_LEN, tokenizer=str(tok), workers=1,
                    objective="grpo", val_inputs=[root / "val.jsonl"])  # fmt: skip
    return root


def run_config(prompts, out_dir, grpo_changes: dict | None = None, **changes) -> TrainConfig:
    """A run of 2 prompts x 4 completions a step in 2 micro-batches, each batch of rollouts trained twice, against a
    reference (beta > 0), with its tokenizer in the run folder (where a run keeps its own)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(prompts / "tokenizer" / "tokenizer.json", out_dir / "tokenizer.json")
    grpo_settings = dict(num_generations=4, max_completion_tokens=MAX_TOKENS, beta=0.04, num_iterations=2,
                         loss_type="bnpo", rewards=REWARDS, log_completions_every=1)  # fmt: skip
    grpo_settings |= grpo_changes or {}
    base = dict(
        model=CFG, data=str(prompts / "data"), out_dir=str(out_dir), batch_size=8, micro_batches=2, total_steps=4,
        lr=3e-3, end_lr=3e-3, warmup_steps=0, anneal_steps=10, weight_decay=0.0, val_every=0, ckpt_every=2,
        log_every=1000, sample_tokens=0, objective="grpo", grpo=grpo_settings,
    )  # fmt: skip
    return TrainConfig(**{**base, **changes})


def logged(out_dir) -> dict[int, dict]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}


def test_sampling_seeds_depend_on_the_run_seed_step_and_row_alone():
    seeds = {rollout.sampling_seed(seed, step, row) for seed in (0, 1) for step in (0, 1, -1) for row in (0, 1)}
    assert len(seeds) == 12
    assert rollout.sampling_seed(3, 5, 7) == rollout.sampling_seed(3, 5, 7)


def test_config_refuses_batches_that_split_a_group_or_a_batch_of_rollouts():
    grpo_settings = {"num_generations": 4, "num_iterations": 2}
    with pytest.raises(ConfigError, match=r"batch_size \(6\) counts completions"):
        TrainConfig(objective="grpo", batch_size=6, grpo=grpo_settings, ckpt_every=2)
    with pytest.raises(ConfigError, match=r"total_steps \(3\) must be a multiple of grpo.num_iterations"):
        TrainConfig(objective="grpo", total_steps=3, grpo=grpo_settings, ckpt_every=2)
    with pytest.raises(ConfigError, match="grpo.rewards must be a list"):
        TrainConfig(objective="grpo", grpo={"rewards": "exact_match"})


def _random_model(seed: int, eos: int) -> model.Params:
    """A random model that ends about one completion token in five with EOS: completions stop and are cut off."""
    params = model.init(CFG, jax.random.key(seed))
    params["head"]["b"] = params["head"]["b"].at[eos].add(5.0)
    return params


def _policies(kind: str, base: model.Params, cfg: TrainConfig, eos: int) -> list[tuple[model.Params, model.Params]]:
    """Two policies, each as (what a step trains, the whole model): two full models, or two adapters far from zero
    over `base`."""
    if kind == "full":
        return [(base, base), (other := _random_model(1, eos), other)]
    policies = []
    for seed in (1, 2):
        adapter = lora.init_adapter(model.projections(CFG), cfg.lora, jax.random.key(seed))
        for i, parts in enumerate(adapter.values()):
            parts["b"] = jax.random.normal(jax.random.key(10 * seed + i), parts["b"].shape) * 0.3
        policies.append((adapter, {**base, "lora": adapter}))
    return policies


@pytest.mark.slow  # ~20 s each on 2 cores: the engine's programs and the log-prob program compile
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_rollouts_obey_the_limits_and_their_old_logps_are_the_engines(prompts, tmp_path, kind):
    """Rollouts by the engine at temperature 1, for one policy and then another handed over to the same engine (the
    full weights in place, their very buffers, or a LoRA adapter into its slot): every completion stops at EOS (kept
    as its last token, as trl keeps it) or at max_completion_tokens; the advantages are `grpo`'s of the rewards; and
    the old log-probs the training program computes under the policy equal the log-probs the engine's sampler
    reported for the very tokens it drew (two programs, one distribution), for the second policy too: nothing of the
    first one (weights, adapter, prefix cache) is left in the engine. The full run's mesh splits the weights over
    fsdp: the engine decodes from the trainer's own shards (laid out by the training rules), not a gathered copy."""
    cfg = run_config(prompts, tmp_path, {"temperature": 1.0}, **({"lora": {"rank": 4}} if kind == "lora" else {}))
    mesh = make_mesh("data=1,fsdp=2", jax.devices()[:2]) if kind == "full" else make_mesh(None)
    train_ds, val = TokenDataset(cfg.data, "train"), TokenDataset(cfg.data, "val")
    eos = train_ds.eos_id
    base = _random_model(0, eos)
    tokenizer = load_tokenizer(None, tmp_path)
    rollouts = rollout.Rollouts(cfg, mesh, train_ds, {"val": val}, base, tokenizer)
    prompts_batch = next(TrainLoader(train_ds, rollout.prompts_per_step(cfg), 1, seed=0))
    generate = rollouts.generate
    sampled = []
    rollouts.generate = lambda p, step: sampled.extend(generate(p, step)) or sampled
    first = None
    for params, full in _policies(kind, base, cfg, eos):
        if kind == "full":  # laid out as the trainer lays out its state
            params = full = place(params, CFG, mesh, TRAINING)
        sampled.clear()
        with jax.set_mesh(mesh):
            made = rollouts.make(params, full, base, prompts_batch, step=0)
        batch = {k: v.reshape(8, *v.shape[2:]) for k, v in made.batch.items()}  # the micro-batches' rows together
        assert {c.finish_reason for c in sampled} == {"stop", "length"}
        lengths = batch["weights"].sum(1).astype(int)
        assert 0 < lengths.min() and lengths.max() <= MAX_TOKENS
        for i, completion in enumerate(sampled):
            w = batch["weights"][i].astype(bool)
            stopped = completion.finish_reason == "stop"
            assert batch["tokens"][i][w].tolist() == completion.tokens + [eos] * stopped
            assert stopped or len(completion.tokens) == MAX_TOKENS
            engine = completion.logprobs
            np.testing.assert_allclose(batch["old_logps"][i][w][: len(engine)], engine, atol=2e-5, err_msg=str(i))
        per_function = np.array([[r["rewards"][k] for k in ("regex_format", "exact_match")] for r in made.table])
        total = grpo.total_rewards(jnp.asarray(per_function), jnp.asarray([1.0, 0.5]))
        np.testing.assert_allclose(batch["advantages"], grpo.group_advantages(total, 4, "group"), rtol=1e-6)
        assert float(made.metrics["completions/max_length"]) == lengths.max()
        assert first is None or made.table != first  # the same seeds, another policy: other completions
        first = made.table
        if kind == "full":  # handed over in place: the engine holds the very buffers the step trains
            held = {k: v for k, v in rollouts.engine.runner.params.items() if k != "adapters"}
            pointers = lambda tree: [
                s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for s in x.addressable_shards
            ]
            assert pointers(held) == pointers(params)


@pytest.mark.slow  # ~20-40 s on 2 cores: a GRPO run of 4 steps, and the same rollout made again
def test_a_grpo_run_logs_trls_metrics_and_its_first_loss_is_policy_loss_of_its_rollouts(prompts, tmp_path):
    """`meshlm train`'s library call, objective grpo: 4 steps (2 batches of rollouts, each trained twice, in 2
    micro-batches). Step 1's logged loss equals `grpo.policy_loss` recomputed here, micro-batch by micro-batch (trl's
    accumulation: their mean), on the rollout the starting model makes again from the same seeds; the metrics carry
    trl's names; each step's completions are in the run folder. The engine's output constraint and stop strings
    apply to the rollouts: every completion is inside the regex (or a prefix of it, cut by the length or the stop
    string) and holds no stop string."""
    sampling = {"structured_outputs_regex": "[a-z]{1,8}\\.", "generation_kwargs": {"stop": ["e"]}}
    cfg = run_config(prompts, tmp_path / "run", sampling)
    train.train(cfg, progress=False)
    got = logged(tmp_path / "run")
    assert sorted(got) == [1, 2, 3, 4]
    for name in ("reward", "reward_std", "rewards/regex_format/mean", "rewards/exact_match/mean",
                 "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio", "time/generate_s",
                 "time/rewards_s", "time/batch_s", "time/logps_s"):  # fmt: skip
        assert name in got[1] and name in got[3] and name not in got[2], name  # logged with their rollout's first step
    for name in ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_max", "clip_ratio/region_mean", "grad_norm"):
        assert all(np.isfinite(got[step][name]) for step in got), name
    assert got[1]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is its reference until the first update
    assert got[1]["clip_ratio/region_mean"] == 0.0  # the first step's ratio is exactly 1
    table = [json.loads(line) for line in (tmp_path / "run" / "completions" / "step_00000001.jsonl").open()]
    assert len(table) == 8 and set(table[0]) == {"step", "prompt", "completion", "rewards", "reward", "advantage"}
    texts = [row["completion"] for row in table]
    assert all(re.fullmatch(r"[a-df-z]*\.?", text) for text in texts) and any(texts), texts

    # the starting model's rollout at step 0, made again, and the loss of step 1 on it
    mesh = make_mesh(None)
    train_ds = TokenDataset(cfg.data, "train")
    params = model.init(CFG, jax.random.key(cfg.seed))
    rollouts = rollout.Rollouts(cfg, mesh, train_ds, {}, params, load_tokenizer(None, tmp_path / "run"))
    with jax.set_mesh(mesh):
        made = rollouts.make(params, params, params, next(TrainLoader(train_ds, 2, 1, seed=cfg.seed)), step=0)
    assert [r["completion"] for r in made.table] == [r["completion"] for r in table]
    losses = []
    for m in range(cfg.micro_batches):
        rows = {k: jnp.asarray(v[m]) for k, v in made.batch.items()}
        logps, entropy = token_logps(params, {k: rows[k] for k in ROW_TOKENS}, CFG, cfg.policy, cfg.grpo.temperature)
        mask = rows["weights"][:, 1:]
        loss, _ = grpo.policy_loss(cfg.grpo, logps, entropy, rows["advantages"], mask,
                                   rows["old_logps"][:, 1:], rows["ref_logps"][:, 1:])  # fmt: skip
        losses.append(float(loss))
    assert got[1]["loss"] == pytest.approx(np.mean(losses), rel=1e-5, abs=1e-7)
    assert got[1]["reward"] == pytest.approx(float(made.metrics["reward"]), rel=1e-6)


HOLD = "MESHLM_TEST_HOLD_FILE"  # see exact_match_or_hold
_held_scorings = itertools.count()


def exact_match_or_hold(**kwargs):
    """The built-in exact_match; in a process started with $MESHLM_TEST_HOLD_FILE set, the second batch of rollouts
    it scores (step 3's, the first after the checkpoint at step 2) is held: it writes that file and waits, to be
    killed there."""
    if os.environ.get(HOLD) and next(_held_scorings) == 1:
        Path(os.environ[HOLD]).touch()
        time.sleep(600)
        raise RuntimeError("held 600 s and not killed")
    return rewards.BUILT_INS["exact_match"]()(**kwargs)


@pytest.mark.slow  # three GRPO runs, one a `meshlm train` subprocess: ~35-45 s a case on 2 cores (before: 25-40 s)
@pytest.mark.parametrize("kind, stop", [("full", "sigterm"), ("lora", "sigkill")])
def test_a_grpo_run_stopped_by_sigterm_or_killed_resumes_to_the_uninterrupted_completions_and_losses(
    prompts, tmp_path, monkeypatch, kind, stop
):
    """A run stopped and resumed samples the same completions and logs the same losses, rewards and metrics as an
    uninterrupted run: the sampling seeds come from the step, the prompts from the loader's saved position, the
    reference (the starting model, or a LoRA run's base) is rebuilt from the seed, and the engine gets the restored
    weights (or adapter). Two cases, one uninterrupted run each:
    - full, SIGTERM (in-process): the signal comes while the first batch of rollouts is scored; the run trains that
      batch's two steps, saves at step 2 (a run stops between batches of rollouts, which it does not save);
    - lora, kill -9: `meshlm train` as a subprocess is killed while it scores step 3's rollouts, once its checkpoint
      at step 2 is in place (nothing after it saved, those rollouts lost), and resumed by the library call.
    Steps 1 and 2 compare too: the first process's, before the stop, equal the uninterrupted run's."""
    changes = {"lora": {"rank": 4}} if kind == "lora" else {}
    grpo_changes = {"rewards": [REWARDS[0], {"function": "tests.test_grpo_train:exact_match_or_hold", "weight": 0.5}]}
    grpo_changes = grpo_changes if stop == "sigkill" else None
    train.train(run_config(prompts, tmp_path / "whole", grpo_changes, **changes), progress=False)
    run_dir = tmp_path / "resumed"
    cfg = run_config(prompts, run_dir, grpo_changes, **changes)
    if stop == "sigterm":
        score = rewards.score

        def score_then_stop(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            monkeypatch.setattr(rewards, "score", score)
            return score(*args, **kwargs)

        monkeypatch.setattr(rewards, "score", score_then_stop)
        stopped = train.train(cfg, progress=False)
        assert (stopped.step, stopped.stopped_by_signal, stopped.signal) == (2, True, signal.SIGTERM)
        train.train(cfg, progress=False)
    else:
        config = tmp_path / "resumed.json"
        config.write_text(json.dumps(cfg.to_dict()))
        monkeypatch.setenv(HOLD, str(held := tmp_path / "held"))
        proc = start_run(config)  # with the session's compilation cache: the uninterrupted run's programs
        try:
            ckpt = run_dir / "checkpoints" / "2"  # orbax renames a step's folder into place once it is complete
            wait_until(proc, lambda: held.exists() and ckpt.exists(), "hold at step 3 past checkpoint 2", 300)
        finally:
            proc.kill()
            proc.wait()
        assert sorted(p.name for p in ckpt.parent.iterdir() if p.name.isdigit()) == ["2"]
        assert sorted(logged(run_dir)) == [1, 2]
        monkeypatch.delenv(HOLD)
        train.train(cfg, progress=False)  # resumed here: what it knows of the killed run is what that left on disk
    whole, resumed = logged(tmp_path / "whole"), logged(run_dir)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):  # every metric but the clocks' and the noise scale's running averages, which restart
        for name, value in whole[step].items():
            if name not in ("tokens_per_s", "mfu") and not name.startswith(("noise/", "time/")):
                assert resumed[step][name] == pytest.approx(value, rel=1e-6, nan_ok=True), (step, name)
    for step in (1, 2, 3, 4):
        name = f"completions/step_{step:08d}.jsonl"
        assert (run_dir / name).read_text() == (tmp_path / "whole" / name).read_text()


def refusing_reward(prompts, completions, answer, **columns):
    """A reward function that fails on the record whose answer is 5 (its prompt asks for 2 + 3)."""
    if "5" in answer:
        raise ValueError("no reward for this one")
    return [1.0] * len(completions)


@pytest.mark.slow  # ~15 s on 2 cores: a GRPO run up to its first rollouts
def test_a_reward_function_that_raises_stops_meshlm_train_in_one_line_naming_it_and_the_record(
    prompts, tmp_path, capsys
):
    """`meshlm train` on a config whose reward raises on one record: one line names the function and the record (the
    row of the prompts dataset), the exception after them; no checkpoint is written. The run's batch is the other
    runs' here (their compiled programs): its first step's 2 prompts are records 2 and 4 (the loader's order at seed
    0), so the refused record is scored in the first batch of rollouts, beside one that is not refused."""
    cfg = run_config(prompts, tmp_path / "run", {"rewards": [{"function": "tests.test_grpo_train:refusing_reward"}]})
    assert next(TrainLoader(TokenDataset(cfg.data, "train"), 2, 1, seed=cfg.seed)).rows.ravel().tolist() == [2, 4]
    config = tmp_path / "run.json"
    config.write_text(json.dumps(cfg.to_dict()))
    err = run_cli_error(capsys, str(config), "--no-progress")
    assert err == "meshlm train: error: reward refusing_reward raised on record 2: ValueError: no reward for this one"
    assert not list((tmp_path / "run" / "checkpoints").glob("[0-9]*"))


def test_the_demos_prompts_are_each_question_once_and_its_rewards_check_fact_and_form(gpt2_bpe_file, tmp_path):
    """configs/demo-grpo.yaml's data and rewards: demo:prompts holds every wording of every fact once (the held-out
    questions are not asked in training), with its answer for the rewards; the full correct sentence earns 1, the
    bare correct word or a full sentence with a wrong fact 0.5, a bare wrong word or a sentence of another form 0."""
    from meshlm.demo_corpus import prepare_demo_records
    from meshlm.run_start import load_train_config

    folder = prepare_demo_records(tmp_path / "data", "demo:prompts", 32, load_tokenizer(gpt2_bpe_file))
    train_records, val_records = (data.read_prompt_records(folder, split) for split in ("train", "val"))
    questions = [r["prompt"][0]["content"] for r in train_records + val_records]
    assert len(questions) == len(set(questions)) == 174 and len(val_records) >= 10
    assert TokenDataset(folder, "val").kind == "prompts"
    cfg = load_train_config(REPO / "configs" / "demo-grpo.yaml")
    assert (cfg.data, cfg.objective, cfg.init_from) == ("demo:prompts", "grpo", "runs/demo-sft")
    answers = [" The capital of Kenya is Nairobi.", " Nairobi.", " The capital of Kenya is Lima.", " Lima",
               " The capital is dry is dry."]  # fmt: skip
    completions = [[{"role": "assistant", "content": a}] for a in answers]
    prompt = [{"role": "user", "content": "What is the capital of Kenya?"}]
    _, total = rewards.score(rewards.load(cfg.grpo.rewards), [prompt] * 5, completions, [[1]] * 5,
                             {"answer": ["Nairobi"] * 5}, [0] * 5)  # fmt: skip
    np.testing.assert_array_equal(total, [1.0, 0.5, 0.5, 0.0, 0.0])
