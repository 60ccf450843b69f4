"""DPO training throughput: meshlm's jitted DPO step vs trl 1.16's DPOTrainer (transformers + torch), on CPU.

Same GPT-J shape and the same random weights (fp32), the same preference pairs (random token prompts of seq/2 tokens
and completions of seq/2, the last one EOS: the same ids on both sides), sigmoid DPO at beta 0.1, AdamW (constant
lr, no weight decay) with the global norm clipped at 1.0, measured in one run. `--modes`:
- full: full fine-tuning against reference log-probs computed once before training (meshlm's default
  `dpo.reference: precompute`, trl's `precompute_ref_log_probs=True`), outside the timing;
- lora: a LoRA adapter (peft on trl's side, both starting from peft's adapter), the reference the base with the
  adapter off, run inside every step on both sides.

trl's steps are timed between consecutive `on_step_end` callbacks, so they include the Trainer's own per-step work
(collation, logging); the best step after two warm-up steps counts. meshlm's step is the mean step of the best of
`--repeats` runs of `--steps` steps after one warm-up run, as `meshlm train` runs it (the compiled step, each batch
placed on the device).
`loss@1` and `loss@2` are each side's logged DPO loss at its first two steps: step 1 is log 2 wherever the policy
starts as its reference; step 2, after one update, shows the two sides compute the same step.

    python benchmarks/dpo.py [--modes full lora] [--preset gptj-tiny] [--pairs 8] [--seq 256] [--rank 16]
        [--steps 6] [--repeats 3]
"""

from __future__ import annotations

import os

# jax, trl, transformers and datasets read these at import: the CPU, no Hub calls, no progress bars
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU benchmark, like trl's side (`use_cpu`)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import argparse
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import peft
import torch
from timing import best_time  # benchmarks/timing.py, beside this script
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from transformers.trainer_callback import PrinterCallback
from transformers.utils import logging as hf_logging
from trl import DPOConfig, DPOTrainer

from meshlm import api, config, model, train_step
from meshlm.formats import adapters, hf
from meshlm.formats.slices import Placed
from meshlm.lora import adapter_size
from meshlm.sharding import make_mesh

BETA, LR, CLIP = 0.1, 1e-4, 1.0
TRL_WARMUP = 2  # trl's first steps, warm-up left out of its timing (the first has no earlier step end anyway)
EOS_TEXT = "<|endoftext|>"
HF_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "out": "out_proj", "fc_in": "fc_in", "fc_out": "fc_out"}


def preference_rows(pairs: int, seq: int, prompt_len: int, eos: int) -> np.ndarray:
    """Rows [2 * pairs, seq] interleaved chosen_0, rejected_0, ...: a pair's two rows share a prompt of `prompt_len`
    random tokens, then each has its own random completion ending in EOS (trl appends one to every completion)."""
    rng = np.random.default_rng(0)
    rows = rng.integers(0, eos, (2 * pairs, seq)).astype(np.int32)
    rows[1::2, :prompt_len] = rows[0::2, :prompt_len]
    rows[:, -1] = eos
    return rows


def meshlm_batch(rows: np.ndarray, prompt_len: int, eos: int) -> dict[str, np.ndarray]:
    """The step's batch [1, rows, seq + 1] as `meshlm prepare` lays out preference rows: the completion tokens
    weighted, one padding token after each row (segment 0), so the model runs over the same `seq` positions as
    trl's."""
    n, seq = rows.shape
    tokens = np.full((n, seq + 1), eos, np.int32)
    tokens[:, :seq] = rows
    weights = np.zeros(tokens.shape, np.float32)
    weights[:, prompt_len:seq] = 1
    segments = np.zeros(tokens.shape, np.int32)
    segments[:, :seq] = 1
    return {"tokens": tokens[None], "weights": weights[None], "segments": segments[None]}


class Meshlm:
    """meshlm's DPO step for one mode, from `base` (and a LoRA run's starting `adapter`): `step()` runs one
    optimizer step and returns its logged loss, which waits for it."""

    def __init__(
        self,
        cfg: config.ModelConfig,
        lora: config.LoraConfig | None,
        base: model.Params,
        batch: dict[str, np.ndarray],
        adapter: adapters.Adapter | None = None,
    ):
        rows, seq = batch["tokens"].shape[1], batch["tokens"].shape[2] - 1
        tcfg = config.TrainConfig(
            model=cfg, batch_size=rows // 2, objective="dpo", dpo=config.DpoConfig(beta=BETA), lora=lora,
            lr=LR, end_lr=LR, warmup_steps=0, weight_decay=0.0, clip_norm=CLIP,
        )  # fmt: skip
        mesh = make_mesh(None)
        program = train_step.step_program(tcfg, cfg, mesh, seq)
        self.compiled, self.mesh, self.batch_spec = program.compile(), mesh, program.inputs[1]
        self.batch, self.frozen = dict(batch), ()
        shardings = program.shardings
        with jax.set_mesh(mesh):
            if lora is None:
                # the reference log-probs of every row, once before training, by the code `meshlm train` uses
                reference = train_step.make_reference_step(tcfg, cfg, mesh)
                rows_only = {k: v[0] for k, v in batch.items()} | {"rows": np.arange(rows, dtype=np.int32)}
                self.batch["reference"] = np.asarray(reference(base, rows_only)[0])[None]
                # a copy: the step donates its state, and `base` serves the other modes
                params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings.params)(base)
            else:
                params = jax.device_put(adapter, shardings.params)
                self.frozen = (jax.device_put(base, program.frozen_shardings),)
            opt_state = jax.jit(program.optimizer.init, out_shardings=shardings.opt_state)(params)
        self.state = train_step.TrainState(jax.device_put(jnp.int32(0), shardings.step), params, opt_state)

    def step(self) -> float:
        placed = {k: jax.device_put(self.batch[k], s.sharding) for k, s in self.batch_spec.items()}
        with jax.set_mesh(self.mesh):
            self.state, metrics = self.compiled(self.state, placed, *self.frozen)
        return float(metrics["loss"])


def meshlm_run(side: Meshlm, steps: int, repeats: int) -> tuple[float, list[float]]:
    """Seconds per step, the best of `repeats` runs of `steps` steps after a warm-up run; and every step's loss,
    from step 1 on."""
    losses: list[float] = []

    def run() -> None:
        for _ in range(steps):
            losses.append(side.step())

    return best_time(run, repeats) / steps, losses


def word_tokenizer(n_vocab: int, eos: int) -> PreTrainedTokenizerFast:
    """Id i is the word `t{i}` (`eos` is EOS_TEXT), words split at spaces, nothing added: a string written from ids
    tokenizes to exactly those ids, so trl's own tokenization of the records gives it the rows meshlm gets."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(n_vocab)} | {EOS_TEXT: eos}
    del vocab[f"t{eos}"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS_TEXT))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TEXT, unk_token=EOS_TEXT)


def preference_records(rows: np.ndarray, prompt_len: int) -> list[dict[str, str]]:
    """trl's {"prompt", "chosen", "rejected"} text of each pair; the completions without their EOS, which trl adds."""
    words = lambda ids: "".join(f" t{i}" for i in ids)
    return [
        {
            "prompt": words(c[:prompt_len]).lstrip(),
            "chosen": words(c[prompt_len:-1]),
            "rejected": words(r[prompt_len:-1]),
        }
        for c, r in zip(rows[0::2], rows[1::2], strict=True)
    ]


class StepClock(TrainerCallback):
    """When each optimizer step ended, and the loss trl logged for it."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.losses: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ends.append(time.perf_counter())

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs and "train_runtime" not in logs:
            self.losses.append(logs["loss"])


def trl_run(
    cfg: config.ModelConfig,
    folder: Path,
    tokenizer: PreTrainedTokenizerFast,
    rows: np.ndarray,
    prompt_len: int,
    lora: config.LoraConfig | None,
    steps: int,
    out: Path,
) -> tuple[float, list[float], adapters.Adapter | None]:
    """`steps` timed DPOTrainer steps over the same pairs every step: the best step's seconds, the logged losses,
    and for LoRA the adapter peft started from (saved under `out` before the first step)."""
    pairs = len(rows) // 2
    peft_cfg = None
    if lora is not None:
        peft_cfg = peft.LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=[HF_NAMES[t] for t in lora.targets],
            bias="none",
            task_type="CAUSAL_LM",
        )
    args = DPOConfig(
        output_dir=str(out / "trl"),
        max_steps=steps + TRL_WARMUP,
        per_device_train_batch_size=pairs,
        learning_rate=LR,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.0,
        max_grad_norm=CLIP,
        bf16=False,  # trl's configs default to bf16
        use_cpu=True,
        gradient_checkpointing=False,  # trl's default; meshlm's remat is off by default
        train_sampling_strategy="sequential",
        dataloader_pin_memory=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=None,
        precompute_ref_log_probs=lora is None,
        disable_dropout=True,
    )
    torch_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    records = preference_records(rows, prompt_len) * (steps + TRL_WARMUP)  # one epoch, the same pairs every step
    clock = StepClock()
    trainer = DPOTrainer(
        model=torch_model,
        args=args,
        train_dataset=datasets.Dataset.from_list(records),
        processing_class=tokenizer,
        peft_config=peft_cfg,
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # it prints every step's log
    for j, example in enumerate(trainer.train_dataset.select(range(pairs))):
        for row, completion in ((rows[2 * j], "chosen_ids"), (rows[2 * j + 1], "rejected_ids")):
            if example["prompt_ids"] + example[completion] != row.tolist():
                raise RuntimeError(f"trl tokenized pair {j} to other ids than meshlm's rows")
    adapter = None
    if lora is not None:
        trainer.model.save_pretrained(str(out / "peft"))
        adapter = adapters.read_peft(out / "peft", cfg)
    trainer.train()
    seconds = min(np.diff(clock.ends)[TRL_WARMUP - 1 :])
    return float(seconds), clock.losses, adapter


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--preset", default="gptj-tiny", help="GPT-J sizes")
    parser.add_argument(
        "--d-model",
        type=int,
        help="override the preset's d_model (d_ff 4x; heads keep their count, rotary at most a head)",
    )
    parser.add_argument("--layers", type=int, help="override the preset's n_layer")
    parser.add_argument("--pairs", type=int, default=8, help="preference pairs per step (two rows each)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per row: half prompt, half completion")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--targets", nargs="+", default=["q", "k", "v", "out"], choices=list(HF_NAMES))
    parser.add_argument("--steps", type=int, default=6, help="timed steps of trl; steps per timed run of meshlm")
    parser.add_argument("--repeats", type=int, default=3, help="meshlm's timed runs; the best counts")
    args = parser.parse_args()

    cfg = config.preset(args.preset)
    if args.d_model:
        rotary_dim = min(cfg.rotary_dim, args.d_model // cfg.n_head)  # rotary never wider than a head
        cfg = cfg.replace(d_model=args.d_model, d_ff=4 * args.d_model, rotary_dim=rotary_dim)
    cfg = cfg.replace(n_layer=args.layers or cfg.n_layer, max_seq_len=max(cfg.max_seq_len, args.seq))
    lora = config.LoraConfig(rank=args.rank, alpha=args.alpha, targets=tuple(args.targets))
    eos = cfg.n_vocab_used - 1  # GPT-2's <|endoftext|>
    prompt_len = args.seq // 2
    rows = preference_rows(args.pairs, args.seq, prompt_len, eos)
    batch = meshlm_batch(rows, prompt_len, eos)

    hf_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore")
    base = api.from_config(cfg, seed=0).params
    tokenizer = word_tokenizer(cfg.n_vocab_used, eos)
    print(
        f"GPT-J {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, d_ff {cfg.d_ff}, vocab "
        f"{cfg.vocab_size}: {model.count_params(cfg):,} params; LoRA rank {lora.rank} alpha {lora.alpha:g} on "
        f"{', '.join(lora.targets)}: {adapter_size(model.projections(cfg), lora):,}; {args.pairs} pairs = "
        f"{2 * args.pairs} rows x seq {args.seq} (prompt {prompt_len}); DPO sigmoid beta {BETA}; fp32; torch "
        f"threads {torch.get_num_threads()}; {jax.devices()[0].platform}"
    )
    print(f"load average before: {load()}")
    results = []
    with tempfile.TemporaryDirectory(prefix="meshlm-dpo-bench-") as tmp:
        folder = Path(tmp) / "model"
        hf.write(folder, cfg, "float32", Placed(base))  # the same weights for transformers
        for mode in args.modes:
            mode_lora = lora if mode == "lora" else None
            t_trl, trl_losses, adapter = trl_run(
                cfg, folder, tokenizer, rows, prompt_len, mode_lora, args.steps, Path(tmp) / mode
            )
            t_meshlm, losses = meshlm_run(Meshlm(cfg, mode_lora, base, batch, adapter), args.steps, args.repeats)
            results.append((mode, t_trl, t_meshlm, trl_losses, losses))
    print(f"load average after: {load()}")
    print(
        f"{'mode':<6} {'trl ms/step':>11} {'meshlm ms/step':>14} {'trl pairs/s':>11} {'meshlm pairs/s':>14} "
        f"{'x vs trl':>8}  {'loss@1 trl, meshlm':>19}  {'loss@2 trl, meshlm':>19}"
    )
    for mode, t_trl, t_meshlm, trl_losses, meshlm_losses in results:
        step_1, step_2 = (f"{trl_losses[i]:.6f} {meshlm_losses[i]:.6f}" for i in (0, 1))
        print(
            f"{mode:<6} {t_trl * 1e3:>11.1f} {t_meshlm * 1e3:>14.1f} {args.pairs / t_trl:>11.2f} "
            f"{args.pairs / t_meshlm:>14.2f} {t_trl / t_meshlm:>7.2f}x  {step_1:>19}  {step_2:>19}"
        )


if __name__ == "__main__":
    main()
