"""GRPO's math (meshlm.grpo) and its config against trl 1.16's GRPOTrainer, the independent oracle.

trl runs its own advantage and loss code (`_generate_and_score_completions`, `_compute_loss`) on completions, rewards
and log-probs supplied to it (tests/trl_oracle.py `grpo_step`); meshlm's functions get the same arrays. They must
agree to 1e-5 on the advantages, the loss, its gradient with respect to each token's log-prob (the per-token loss's
slope: what trains the model) and every metric trl logs, for each loss type, both importance-sampling levels, beta 0
and 0.04, and num_iterations 1 (old log-probs = the current ones, detached) and 2 (old log-probs differ); with
every scale_rewards, with and without mask_truncated_completions, and with a generation batch split over two
optimizer steps (DAPO's normalizer). Through a tiny GPT-J, one step's whole gradient equals trl's (marked slow).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import cli, grpo, model
from meshlm.config import ConfigError, GrpoConfig, TrainConfig, apply_overrides
from tests import trl_oracle

N_GEN = 4
WIDTH = 5  # the longest completion; one not ending in EOS (id 0) counts as cut off, as trl judges by the last token
# max_completion_tokens: above the batch's width, as in a batch where nothing reached the limit, so that dr_grpo's
# constant differs from the padded width
MAX_TOKENS = 6
PROMPTS = ["Hello there", "What is", "The sky is"]  # 3 tokens each: one prompt length, no left padding
COMPLETIONS = [
    [5, 6, 7, 0],
    [8, 9, 10, 11, 12],
    [13, 0],
    [14, 15, 16, 17, 18],
    [5, 0],
    [6, 7, 8, 9, 10],
    [11, 12, 0],
    [13, 14, 15, 0],
    [20, 21, 22, 0],
    [23, 24, 0],
    [25, 26, 27, 28, 29],
    [30, 0],
]
REWARD_NAMES = ["exact", "format"]
REWARD_WEIGHTS = [1.0, 0.5]


def _rewards() -> np.ndarray:
    """[12, 2]: group 0 plain; group 1 with a reward trl's None (NaN) and a completion no function scored; group 2
    all alike, so its std is 0 (frac_reward_zero_std, and the 1e-4 trl adds before dividing)."""
    r = np.random.default_rng(1).normal(size=(len(COMPLETIONS), 2)).astype(np.float32)
    r[5, 1] = np.nan
    r[6] = np.nan
    r[8:] = [1.0, 0.25]
    return r


def _token_arrays(seed: int = 2) -> dict[str, np.ndarray]:
    """Per-token log-probs [12, 5]: the policy's, the ones the completions were sampled with (ratios spread across
    both clip bounds, per token and per sequence), the reference's, and entropies; zero on padding, as trl pads."""
    rng = np.random.default_rng(seed)
    shape = (len(COMPLETIONS), WIDTH)
    logps = -rng.uniform(0.5, 3.0, size=shape)
    out = {
        "logps": logps,
        "old_logps": logps + rng.uniform(-0.6, 0.6, size=(shape[0], 1)) + rng.normal(scale=0.2, size=shape),
        "ref_logps": logps + rng.normal(scale=0.5, size=shape),
        "entropy": rng.uniform(0.1, 2.0, size=shape),
    }
    mask = _lengths()[:, None] > np.arange(WIDTH)
    return {key: np.where(mask, value, 0.0).astype(np.float32) for key, value in out.items()}


def _lengths() -> np.ndarray:
    return np.array([len(c) for c in COMPLETIONS])


def _truncated() -> np.ndarray:
    return np.array([c[-1] != 0 for c in COMPLETIONS])


def _trl_settings(s: GrpoConfig) -> dict:
    """meshlm's settings under trl's names (the rewards and the completions' log are the trainer's arguments in trl)."""
    settings = dataclasses.asdict(s)
    settings["max_completion_length"] = settings.pop("max_completion_tokens")
    settings["vllm_structured_outputs_regex"] = settings.pop("structured_outputs_regex")
    for meshlm_only in ("rewards", "log_completions_every"):
        settings.pop(meshlm_only)
    return settings


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random GPT-J with its tokenizer (EOS = pad = id 0), as trl and meshlm.load both read it."""
    return trl_oracle.write_hf_folder(tmp_path_factory.mktemp("grpo-gptj"))


def _meshlm_step(s: GrpoConfig, arrays: dict[str, np.ndarray], rows: slice = slice(None), steps: int = 1) -> dict:
    """meshlm's advantages, mask, loss, d loss / d logps and metrics of the same batch; the loss and its metrics of
    `rows`, one of the `steps` optimizer steps the batch is split into."""
    rewards, weights = jnp.asarray(_rewards()), jnp.asarray(REWARD_WEIGHTS)
    advantages = grpo.group_advantages(grpo.total_rewards(rewards, weights), s.num_generations, s.scale_rewards)
    truncated = jnp.asarray(_truncated())
    mask = grpo.completion_mask(jnp.asarray(_lengths()), WIDTH, truncated, s.mask_truncated_completions)
    old = jnp.asarray(arrays["old_logps"])[rows] if s.num_iterations > 1 else None
    ref = jnp.asarray(arrays["ref_logps"])[rows] if s.beta else None
    dapo_tokens = mask.sum() / steps if steps > 1 else None
    entropy = jnp.asarray(arrays["entropy"])[rows]

    def loss(logps):
        return grpo.policy_loss(s, logps[rows], entropy, advantages[rows], mask[rows], old, ref, dapo_tokens)

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(arrays["logps"]))
    metrics = {
        **metrics,
        **grpo.reward_metrics(rewards, weights, REWARD_NAMES, s.num_generations, s.scale_rewards),
        **grpo.completion_metrics(jnp.asarray(_lengths()), truncated),
    }
    return {"advantages": advantages, "mask": mask, "loss": value, "grad": grad, "metrics": metrics}


def _trl_step(folder, s: GrpoConfig, arrays: dict[str, np.ndarray], **settings) -> trl_oracle.GrpoStep:
    settings = {**_trl_settings(s), **arrays, "reward_weights": REWARD_WEIGHTS, **settings}
    return trl_oracle.grpo_step(folder, PROMPTS, COMPLETIONS, _rewards(), REWARD_NAMES, **settings)


def _assert_same(ours: dict, theirs: trl_oracle.GrpoStep) -> None:
    np.testing.assert_allclose(ours["advantages"], theirs.advantages, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ours["mask"], theirs.mask)
    assert float(ours["loss"]) == pytest.approx(theirs.loss, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(ours["grad"], theirs.logps_grad, rtol=1e-5, atol=1e-7)
    assert sorted(set(ours["metrics"]) - {"loss"}) == sorted(set(theirs.metrics) - {"num_tokens"})
    _assert_metrics(ours["metrics"], theirs.metrics)


def _assert_metrics(ours: dict, theirs: dict) -> None:
    """Each of meshlm's metrics (but the loss, which trl's Trainer logs itself) equals trl's of that name."""
    for key, value in ours.items():
        if key != "loss":
            assert float(value) == pytest.approx(theirs[key], rel=1e-5, abs=1e-7, nan_ok=True), key


@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_and_metrics_equal_trl(folder, loss_type, level, beta, num_iterations):
    s = GrpoConfig(
        num_generations=N_GEN,
        max_completion_tokens=MAX_TOKENS,
        beta=beta,
        loss_type=loss_type,
        epsilon_high=0.28 if loss_type == "dapo" else None,  # DAPO's clip-higher
        num_iterations=num_iterations,
        importance_sampling_level=level,
    )
    arrays = _token_arrays()
    _assert_same(_meshlm_step(s, arrays), _trl_step(folder, s, arrays))


@pytest.mark.parametrize("mask_truncated", [False, True])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_and_masks_equal_trl(folder, scale_rewards, mask_truncated):
    s = GrpoConfig(
        num_generations=N_GEN,
        max_completion_tokens=MAX_TOKENS,
        beta=0.04,
        loss_type="bnpo",
        num_iterations=2,
        scale_rewards=scale_rewards,
        mask_truncated_completions=mask_truncated,
    )
    arrays = _token_arrays(seed=3)
    _assert_same(_meshlm_step(s, arrays), _trl_step(folder, s, arrays))


@pytest.mark.parametrize("step", [0, 1])
def test_dapo_divides_by_the_generation_batch_tokens(folder, step):
    """DAPO's normalizer spans the whole generation batch: split over two optimizer steps (trl's
    steps_per_generation 2), each step's loss is its tokens' sum over half the batch's loss tokens, whichever
    half holds more of them."""
    s = GrpoConfig(
        num_generations=N_GEN,
        max_completion_tokens=MAX_TOKENS,
        beta=0.04,
        num_iterations=2,
        mask_truncated_completions=True,
    )
    rows = slice(6 * step, 6 * step + 6)
    arrays = _token_arrays(seed=4)
    theirs = _trl_step(folder, s, arrays, rows=rows, steps_per_generation=2)
    _assert_same(_meshlm_step(s, arrays, rows, steps=2), theirs)


def _flat_grads(grads: model.Params) -> dict[str, np.ndarray]:
    return {model.param_name(path): np.asarray(g) for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]}


@pytest.mark.slow  # ~11 s on 2 cores: two XLA compiles of the model and its gradient, and trl's step
def test_model_gradient_equals_trl(folder):
    """One step's whole gradient through a tiny GPT-J: meshlm's model and `token_logps_and_entropy` at temperature
    0.7, then `policy_loss`, against trl's loss on the same transformers model (its fused LM head), each tensor
    compared in Hugging Face's layout (meshlm's exporter maps the gradient as it maps the weights). Both run fp32 with
    different op orders and kernels; their gradients differ by at most 2.5e-6 of each tensor's largest entry (measured
    2026-12-05), so 2e-5 leaves room for other BLAS builds while a wrong term (a missing temperature, the KL without
    its ratio) moves whole tensors by percents. The step's metrics (entropy at the temperature, kl, clip ratios)
    agree too."""
    from meshlm import api
    from meshlm.formats.hf import iter_hf_tensors

    s = GrpoConfig(
        num_generations=N_GEN,
        max_completion_tokens=MAX_TOKENS,
        temperature=0.7,
        beta=0.04,
        loss_type="dapo",
        num_iterations=2,
    )
    lm = api.load(folder)
    prompt = np.asarray(trl_oracle.load_tokenizer(folder)(PROMPTS)["input_ids"])
    completion = np.array([c + [0] * (WIDTH - len(c)) for c in COMPLETIONS])
    tokens = jnp.asarray(np.concatenate([np.repeat(prompt, N_GEN, axis=0), completion], axis=1))
    P = prompt.shape[1]
    advantages = grpo.group_advantages(
        grpo.total_rewards(jnp.asarray(_rewards()), jnp.asarray(REWARD_WEIGHTS)), N_GEN, s.scale_rewards
    )
    mask = grpo.completion_mask(jnp.asarray(_lengths()), WIDTH, jnp.asarray(_truncated()), False)

    def logps_and_entropy(params):
        logits = model.forward(params, tokens[:, :-1], lm.config)[:, P - 1 :]
        return grpo.token_logps_and_entropy(logits, tokens[:, P:], s.temperature)

    noise = _token_arrays()
    start = np.asarray(jax.jit(logps_and_entropy)(lm.params)[0]) * np.asarray(mask)
    old, ref = start + noise["old_logps"] - noise["logps"], start + noise["ref_logps"] - noise["logps"]

    def loss(params):
        logps, entropy = logps_and_entropy(params)
        return grpo.policy_loss(s, logps, entropy, advantages, mask, jnp.asarray(old), jnp.asarray(ref))

    (value, metrics), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(lm.params)
    flat = _flat_grads(grad)
    read = lambda key, layer: flat[key] if layer is None else flat[key][layer]
    ours = dict(iter_hf_tensors(lm.config, read, "float32"))
    theirs = _trl_step(folder, s, {"old_logps": old, "ref_logps": ref})
    np.testing.assert_array_equal(theirs.prompt_ids, np.repeat(prompt, N_GEN, axis=0))
    assert float(value) == pytest.approx(theirs.loss, rel=1e-5)
    _assert_metrics(metrics, theirs.metrics)  # the entropy at the temperature, kl and the clip ratios
    grads = {name: p.grad.numpy() for name, p in theirs.model.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(ours)
    for name, grad in grads.items():
        np.testing.assert_allclose(ours[name], grad, rtol=0, atol=2e-5 * np.abs(grad).max(), err_msg=name)


def test_config_defaults_are_trls():
    from trl import GRPOConfig as TrlGrpoConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TrlGrpoConfig)}
    assert _trl_settings(GrpoConfig()) == {key: defaults[key] for key in _trl_settings(GrpoConfig())}


def test_config_reads_trl_forms_and_refuses_bad_values():
    values = apply_overrides({"objective": "grpo"}, ["grpo.beta=4e-2", "grpo.scale_rewards=false"])
    cfg = TrainConfig.from_dict(values)
    assert (cfg.grpo.beta, cfg.grpo.scale_rewards, cfg.grpo.upper_epsilon) == (0.04, "none", 0.2)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert GrpoConfig(scale_rewards=True).scale_rewards == "group"
    bad = {
        "num_generations": 1,
        "loss_type": "cispo",
        "scale_rewards": "yes",
        "importance_sampling_level": "seq",
        "epsilon": 1.0,
        "epsilon_high": -0.1,
        "top_p": 0.0,
        "temperature": 0,
        "mask_truncated_completions": "no",
        "top_k": -1,
        "min_p": 2.0,
        "repetition_penalty": 0.0,
        "generation_kwargs": ["stop"],
        "structured_outputs_regex": 5,
    }
    for key, value in bad.items():
        with pytest.raises(ConfigError, match=f"grpo.{key}") as error:
            TrainConfig(objective="grpo", grpo={key: value})
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="grpo settings apply to objective grpo"):
        TrainConfig(grpo={"beta": 0.1})


def test_rollouts_sample_with_the_sections_settings_then_generation_kwargs_over_them():
    """trl's sampling settings reach the engine's SamplingParams, `generation_kwargs` last (overriding, as trl's; its
    stop_token_ids add to EOS), the regex constrains the output; a setting the sampler does not take, or one it
    refuses, stops the run in one line."""
    from meshlm import rollout
    from meshlm.serve.grammar import Constraint

    kwargs = {"stop": "\n", "stop_token_ids": [13], "top_k": 5, "presence_penalty": 0.5}
    grpo_section = dict(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
                        structured_outputs_regex="(yes|no)\\.", max_completion_tokens=12,
                        generation_kwargs=kwargs)  # fmt: skip
    cfg = TrainConfig(objective="grpo", seed=3, grpo=grpo_section)
    sp = rollout.rollout_sampling(cfg, 50256, step=2, row=1)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty, sp.presence_penalty) == (
        0.7, 0.9, 5, 0.05, 1.1, 0.5,
    )  # fmt: skip
    assert (sp.stop, sp.stop_token_ids, sp.max_new_tokens, sp.logprobs) == (("\n",), (50256, 13), 12, 0)
    assert sp.constraint == Constraint.regex("(yes|no)\\.") and sp.seed == rollout.sampling_seed(3, 2, 1)
    for kwargs, refusal in (
        ({"max_new_tokens": 4}, "'max_new_tokens': not a setting a rollout takes .*; for max_new_tokens, set "
         "grpo.max_completion_tokens$"),
        ({"stop_words": ["x"]}, "'stop_words': not a setting a rollout takes"),
        ({"temperature": 0.0}, "'temperature': not a setting .*; for temperature, set grpo.temperature$"),
        ({"top_k": -2}, "grpo's sampling settings: top_k"),
        ({"stop_token_ids": None}, "grpo's sampling settings: "),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=refusal) as error:
            rollout.rollout_sampling(TrainConfig(objective="grpo", grpo={"generation_kwargs": kwargs}), 0, 0, 0)
        assert "\n" not in str(error.value)


def test_a_completion_is_trained_on_its_tokens_and_the_stop_token_that_ended_it():
    """EOS (or a stop token id) that ended a completion is its last id, as trl keeps it; a stop string's cut keeps the
    tokens before it; a completion at its length limit has none."""
    from meshlm.rollout import completion_ids
    from meshlm.serve.outputs import Completion

    def completion(stop_reason):
        return Completion([5, 6], [-1.0, -2.0], [[], []], "length" if stop_reason is None else "stop", "ab", None, None,
                          stop_reason)  # fmt: skip

    assert [completion_ids(completion(r)) for r in (50256, 13, "\n", None)] == [
        [5, 6, 50256],
        [5, 6, 13],
        [5, 6],
        [5, 6],
    ]


def test_plan_refuses_grpo_in_one_line(tmp_path, capsys):
    config = tmp_path / "grpo.yaml"
    config.write_text(f"objective: grpo\nout_dir: {tmp_path / 'run'}\ngrpo:\n  num_generations: 4\n")
    refusal = (
        "objective grpo: a plan measures the train step alone, not GRPO's rollout engine beside it (not built yet)"
    )
    assert cli.main(["plan", str(config), "--target", "cpu"]) == 1
    assert capsys.readouterr().err == f"meshlm plan: error: {refusal}\n"
