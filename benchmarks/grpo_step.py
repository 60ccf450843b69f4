"""A GRPO step on one accelerator, with its split, and the rollouts' tokens/s inside training against the same engine
alone (issue 41's goals: "one v5e chip, 1B GPT-J, LoRA: rollout tokens/s inside training vs the engine alone: >= 0.7x"
and "one v5e chip: a full GRPO step (rollouts + update): time recorded, with its split").

The run is `meshlm train`'s with `objective: grpo`, built by the library's own start (`train.start_run`: the compiled
step, the LoRA adapter over a frozen random base of `--preset`, the engine over that base with the adapter in its
slot), on the built-in `demo:prompts` questions scored by the demo's two rewards (configs/demo-grpo.yaml). Each GRPO
step is the loop's own two calls, `run.next_batch` (the rollouts: `Rollouts.make`, which times its parts as the
`time/generate_s`, `time/rewards_s`, `time/batch_s` and `time/logps_s` metrics) and the compiled step
(`num_iterations` updates), each waited for; after `--warmup` steps (compiling) `--steps` are timed and their mean
split printed.

The engine alone is a fresh engine built as the trainer builds it (`rollout.Rollouts`, after the run is freed),
replaying each timed step's prompts, sampling seeds and adapter through `Rollouts.generate`: the very completions
the step sampled (the token counts are compared), timed without the training loop around it (nor the adapter's
hand-over, which the step's generation time includes). Completions end at EOS or at `--max-completion-tokens`, as in
training (no ignore_eos): a random model rarely samples EOS, and both sides generate the same tokens.

The prompts are tokenized by a byte-level tokenizer of 256 bytes and <|endoftext|> written into the run folder (no
download, so it runs offline): the model samples from its whole vocabulary, and ids past 256 decode to nothing.

    python benchmarks/grpo_step.py --json /tmp/grpo_step.json                 # gptj-1b on one TPU v5e chip
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/grpo_step.py --preset gptj-tiny --prompts 2 \\
        --num-generations 4 --max-completion-tokens 16 --micro-batches 1 --warmup 1 --steps 2   # the CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from meshlm import model, rollout, run_start, train
from meshlm.config import RUN_CHECKPOINTS, TrainConfig, preset
from meshlm.formats import native
from meshlm.sharding import make_mesh
from meshlm.tokenizer import load_tokenizer
from meshlm.train_step import check_batch

# configs/demo-grpo.yaml's rewards: the fact (the answer's last word) and the sentence's form
REWARDS = [
    {"function": "exact_match", "weight": 0.5, "column": "answer", "extract": r"(\w+)\.?\s*$", "ignore_case": True},
    {"function": "regex_format", "weight": 0.5,
     "pattern": r"\s*(The (capital|opposite) of \w+ is \w+|[A-Z]\w*( \w+)? is \w+)\.\s*"},
]  # fmt: skip
PARTS = {  # the split of a GRPO step, as printed
    "generate": "rollouts: generation (the adapter handed over, the engine sampling)",
    "rewards": "rollouts: rewards",
    "batch": "rollouts: rows and advantages",
    "logps": "rollouts: old and reference log-probs",
    "host": "other host work (the loader, placing the batch)",
    "update": "update(s)",
}


def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level BPE without merges (256 byte tokens, then <|endoftext|>) as the run's own tokenizer.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tok.to_str())


def run_config(args: argparse.Namespace, out_dir: Path) -> TrainConfig:
    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "tpu" else "float32")
    batches = args.warmup + args.steps
    return TrainConfig(
        model=preset(args.preset),
        data="demo:prompts",
        seq_len=args.prompt_len,
        out_dir=str(out_dir),
        seed=args.seed,
        batch_size=args.prompts * args.num_generations,
        micro_batches=args.micro_batches,
        total_steps=batches * args.num_iterations,
        lr=args.lr,
        end_lr=args.lr,
        warmup_steps=0,
        anneal_steps=batches * args.num_iterations,
        weight_decay=0.0,
        lora={"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank, "targets": args.lora_targets.split(",")},
        base_dtype=dtype,
        param_dtype="float32",  # the adapter and its Adam moments
        compute_dtype=dtype,
        remat=args.remat,
        val_every=0,
        ckpt_every=0,
        log_every=1000,
        sample_tokens=0,
        objective="grpo",
        grpo={
            "num_generations": args.num_generations,
            "max_completion_tokens": args.max_completion_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "beta": args.beta,
            "num_iterations": args.num_iterations,
            "rewards": REWARDS,
            "log_completions_every": 0,
        },
    )


class Recorded:
    """The run's loader, keeping each batch of prompts it hands out (for the engine alone to replay)."""

    def __init__(self, loader: Any):
        self.loader, self.batches = loader, []

    def __next__(self) -> Any:
        self.batches.append(next(self.loader))
        return self.batches[-1]


def completion_tokens(metrics: dict[str, Any], n: int) -> int:
    """The tokens a batch of rollouts sampled (its EOS included where sampled), from its logged mean length."""
    return round(float(metrics["completions/mean_length"]) * n)


def time_training(cfg: TrainConfig, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """The run's warm-up and timed GRPO steps: each one's split, completion tokens, prompts, step (its seeds') and
    adapter (its rollouts')."""
    mesh = make_mesh(cfg.mesh)
    check_batch(cfg, mesh)
    train_ds, val_sets = run_start.open_datasets(cfg, out_dir, run_start.run_tokenizer(cfg, out_dir))
    ckpts = native.TrainCheckpoints(out_dir / RUN_CHECKPOINTS, cfg.keep_last, cfg.keep_every)
    began = time.perf_counter()
    run, step_fn, seq_len, _ = train.start_run(cfg, mesh, train_ds, val_sets, ckpts)
    print(f"started in {time.perf_counter() - began:.1f} s (the step compiled, the base and the engine built); "
          f"rows of {seq_len + 1} tokens")  # fmt: skip
    run.loader = Recorded(run.loader)
    steps, n = [], cfg.batch_size
    with jax.set_mesh(mesh):
        for b in range(args.warmup + args.steps):
            step = b * cfg.grpo.num_iterations
            adapter = jax.device_get(run.state.params)  # what this step's rollouts sample with
            split = dict.fromkeys(PARTS, 0.0)
            start = time.perf_counter()
            for i in range(cfg.grpo.num_iterations):
                t0 = time.perf_counter()
                batch, made = run.next_batch(step + i)
                jax.block_until_ready(batch)
                t1 = time.perf_counter()
                run.state, metrics = step_fn(run.state, batch, *run.frozen_args)
                jax.block_until_ready((run.state, metrics))
                split["update"] += time.perf_counter() - t1
                parts = {part: float(made.get(f"time/{part}_s", 0.0)) for part in rollout.TIMED}
                split["host"] += (t1 - t0) - sum(parts.values())
                for part, dt in parts.items():
                    split[part] += dt
                if i == 0:
                    tokens = completion_tokens(made, n)
            split["total"] = time.perf_counter() - start
            kind = "warm-up" if b < args.warmup else "timed"
            print(f"  GRPO step {b + 1} ({kind}): {split['total']:.3f} s, generation {split['generate']:.3f} s, "
                  f"update {split['update']:.3f} s, {tokens:,} completion tokens")  # fmt: skip
            steps.append({"split": split, "tokens": tokens, "step": step, "adapter": adapter, "timed": b >= args.warmup,
                          "prompts": rollout.rollout_prompts(run.loader.batches[b])})  # fmt: skip
    base = run.frozen
    ckpts.close()
    del run, step_fn, batch, metrics
    gc.collect()  # the run's engine and state go before the engine alone is built
    return {"steps": steps, "base": base, "train_ds": train_ds, "val_sets": val_sets, "mesh": mesh}


def time_engine_alone(cfg: TrainConfig, trained: dict[str, Any], out_dir: Path) -> tuple[float, int]:
    """Seconds and tokens of a fresh engine, built as the trainer builds it, sampling each timed step's completions
    again (its prompts, seeds and adapter), after the last warm-up step's, untimed (compiling; other prompts than the
    timed ones, whose prefixes the engine then meets for the first time, as in training)."""
    mesh, G = trained["mesh"], cfg.grpo.num_generations
    alone = rollout.Rollouts(
        cfg, mesh, trained["train_ds"], trained["val_sets"], trained["base"], load_tokenizer(None, out_dir)
    )
    seconds, tokens = 0.0, 0
    with jax.set_mesh(mesh):
        warmup, timed = ([st for st in trained["steps"] if st["timed"] == t] for t in (False, True))
        for k, st in enumerate([warmup[-1], *timed]):
            alone.use_policy(st["adapter"])
            prompts = [p for p in st["prompts"] for _ in range(G)]
            start = time.perf_counter()
            completions = alone.generate(prompts, st["step"])
            elapsed = time.perf_counter() - start
            if k:  # the first call warms up
                seconds += elapsed
                tokens += sum(len(rollout.completion_ids(c)) for c in completions)
    return seconds, tokens


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gptj-1b", help="the model (random weights); gptj-tiny on a CPU")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-targets", default="q,k,v,out", help="comma-separated projections")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per GRPO step")
    parser.add_argument("--num-generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-completion-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64, help="the prompts dataset's seq_len (prompts <= it + 1)")
    parser.add_argument("--micro-batches", type=int, default=8, help="of the update's batch (its logits are whole)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--beta", type=float, default=0.04, help="> 0: the reference log-probs (the base's) are made")
    parser.add_argument("--num-iterations", type=int, default=1, help="updates per batch of rollouts")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--remat", default="none")
    parser.add_argument("--dtype", default=None, help="the base's and the compute's (default: bfloat16 on a TPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2, help="GRPO steps before the timed ones (compiling)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps timed")
    parser.add_argument("--out", default=None, help="the run folder (default: a temporary one, removed)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1")

    device = jax.devices()[0]
    print(f"jax {jax.__version__}; device {device.device_kind} ({device.platform}) x {jax.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.out or tmp)
        write_byte_tokenizer(out_dir)
        cfg = run_config(args, out_dir)
        s = cfg.grpo
        print(
            f"preset {args.preset}, {model.count_params(cfg.model):,} params, random; LoRA rank {args.lora_rank} on "
            f"{args.lora_targets} over a {cfg.base_dtype} base, compute {cfg.compute_dtype}; {args.prompts} prompts x "
            f"{s.num_generations} generations x {s.max_completion_tokens} completion tokens (prompts of up to "
            f"{args.prompt_len + 1} tokens), temperature {s.temperature}, top_p {s.top_p}, beta {s.beta}, "
            f"num_iterations {s.num_iterations}, {cfg.micro_batches} micro-batches; {args.warmup} warm-up + "
            f"{args.steps} timed GRPO steps"
        )
        print(
            "completions end at EOS or max_completion_tokens, as in training (no ignore_eos; a random model rarely "
            "samples EOS); the engine alone replays each timed step's prompts, seeds and adapter"
        )
        trained = time_training(cfg, args, out_dir)
        alone_s, alone_tokens = time_engine_alone(cfg, trained, out_dir)
        del trained["base"]
    steps = [st for st in trained["steps"] if st["timed"]]
    split = {k: float(np.mean([st["split"][k] for st in steps])) for k in (*PARTS, "total")}
    tokens = int(np.mean([st["tokens"] for st in steps]))
    inside = sum(st["tokens"] for st in steps) / sum(st["split"]["generate"] for st in steps)
    alone = alone_tokens / alone_s
    total_tokens = sum(st["tokens"] for st in steps)
    print(f"a GRPO step (mean of {len(steps)}; {s.num_iterations} update(s) of {cfg.batch_size} completions):")
    for key, what in (*PARTS.items(), ("total", "total")):
        print(f"  {what:<66} {split[key]:8.3f} s {100 * split[key] / split['total']:6.1f}%")
    print(f"completion tokens per step: {tokens:,} (of {cfg.batch_size * s.max_completion_tokens:,} at most)")
    print(f"rollout tokens/s inside training (the generation phase): {inside:,.0f}")
    print(f"  over the whole GRPO step: {tokens / split['total']:,.0f}")
    same = "the same" if alone_tokens == total_tokens else f"NOT the same: {total_tokens:,} inside training"
    print(f"the engine alone: {alone:,.0f} tokens/s ({alone_tokens:,} tokens in {alone_s:.3f} s; {same})")
    print(f"inside training / alone: {inside / alone:.2f}x (goal >= 0.7x)")
    figures = {
        "jax": jax.__version__,
        "device": device.device_kind,
        "platform": device.platform,
        "preset": args.preset,
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "out")} | {"dtype": cfg.compute_dtype},
        "step_s": split,
        "completion_tokens_per_step": tokens,
        "rollout_tokens_per_s_inside_training": inside,
        "step_tokens_per_s": tokens / split["total"],
        "engine_alone_tokens_per_s": alone,
        "engine_alone_tokens": alone_tokens,
        "inside_tokens": total_tokens,
        "inside_vs_alone": inside / alone,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
