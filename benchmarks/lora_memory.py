"""What fits: GPT-J-6B's LoRA train step compiled ahead of time for one TPU v5e chip (16 GiB HBM, of which
XLA makes 15.75 GiB available) on this machine, which has no TPU, with the figures from XLA's own
compiler; and the same step for a small model on this CPU, its compiled figures beside the memory it
actually used when run.

The step is `meshlm train`'s (`train_step.step_program`) for rank 16 on q, k, v, out, an fp32 adapter with
AdamW, bf16 compute, full remat, over a frozen base stored as bf16, int8 or NF4 (its other weights in
bf16). The TPU part is `meshlm plan` (`planner.plan_train`) on a one-chip topology: the micro-batch
doubles from 1 until XLA refuses the program (RESOURCE_EXHAUSTED names the bytes it needs), then bisects
to the exact largest that fits. Total = arguments + outputs - aliased (the donated state) + temporaries.
One-chip topologies (`v5e:1x1`) need libtpu 0.0.52 or newer.

    PYTHONPATH=. python benchmarks/lora_memory.py [--parts tpu cpu] [--bases bfloat16 int8 nf4] [--max-batch 32]
        [--cpu-preset gptj-tiny --cpu-batch 4 --cpu-seq 512 --cpu-steps 3]
"""

from __future__ import annotations

import argparse
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from meshlm import api, config, model, planner, train_step
from meshlm.config import TRAINABLE_QUANTIZED
from meshlm.data import default_weights
from meshlm.footprint import Footprint, gib
from meshlm.lora import init_adapter
from meshlm.sharding import make_mesh

GIB = 2**30


def token_batch(tokens: np.ndarray) -> dict[str, np.ndarray]:
    """The step's batch for rows cut from one stream, [micro_batches, rows, seq_len + 1]: every token a
    target but column 0, one document per row."""
    tokens = np.asarray(tokens, np.int32)
    return {"tokens": tokens, "weights": default_weights(tokens).astype(np.float32), "segments": np.ones_like(tokens)}


def lora_config(
    cfg: config.ModelConfig, lora: config.LoraConfig, base_dtype: str, micro_batch: int, seq: int
) -> config.TrainConfig:
    return config.TrainConfig(
        model=cfg,
        batch_size=micro_batch,
        seq_len=seq,
        lora=lora,
        base_dtype=base_dtype,
        param_dtype="float32",
        compute_dtype="bfloat16",
        remat="full",
    )


def table(fits: dict[str, list[planner.TrainFit]], seq: int, budget: str) -> str:
    rows = [
        "| base | micro-batch x seq | arguments GiB | outputs - aliased GiB | temp GiB | code MiB | total GiB "
        f"| {budget} |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for base, tried in fits.items():
        for f in sorted(tried, key=lambda f: f.micro_batch):
            if f.compiled is None:
                rows.append(f"| {base} | {f.micro_batch} x {seq} | | | | | | no: needs {gib(f.total)} |")
                continue
            c = f.compiled
            rows.append(
                f"| {base} | {f.micro_batch} x {seq} | {c.arguments / GIB:.2f} | {(c.outputs - c.aliased) / GIB:.3f} "
                f"| {c.temporaries / GIB:.2f} | {c.code / 2**20:.1f} | {c.total / GIB:.2f} | yes |"
            )
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------------
# The same step on this CPU: compiled figures against what the process used


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The highest resident memory of this process while the block runs, sampled every millisecond on a
    thread (XLA releases the GIL while it executes, so the sampler sees the step's own allocations)."""

    def __enter__(self) -> PeakRSS:
        self.peak, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def cpu_run(cfg: config.ModelConfig, lora: config.LoraConfig, base: str, micro_batch: int, seq: int, steps: int) -> str:
    """One markdown row: the CPU-compiled step's memory analysis, then the resident memory growth while
    the same compiled program runs `steps` times on real inputs built as `meshlm train` builds them."""
    mesh = make_mesh(None)
    program = train_step.step_program(lora_config(cfg, lora, base, micro_batch, seq), cfg, mesh, seq)
    compiled = program.compile()
    used = Footprint.of(compiled)
    quantize = base if base in TRAINABLE_QUANTIZED else None
    frozen = jax.device_put(
        api.from_config(cfg, mesh, "bfloat16", seed=0, quantize=quantize).params, program.frozen_shardings
    )
    shardings = program.shardings
    init = jax.jit(lambda k: init_adapter(model.projections(cfg), lora, k), out_shardings=shardings.params)
    adapter = init(jax.random.key(1))
    opt_state = jax.jit(program.optimizer.init, out_shardings=shardings.opt_state)(adapter)
    state = train_step.TrainState(jax.device_put(jnp.int32(0), shardings.step), adapter, opt_state)
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab_used, (1, micro_batch, seq + 1))
    batch = jax.device_put(token_batch(tokens), jax.tree.map(lambda a: a.sharding, program.inputs[1]))
    jax.block_until_ready((frozen, state, batch))
    before = rss()
    with PeakRSS() as watch:
        for _ in range(steps):
            state, metrics = compiled(state, batch, frozen)
            metrics["loss"].block_until_ready()
    expected = used.outputs - used.aliased + used.temporaries
    return (
        f"| {base} | {micro_batch} x {seq} | {mib(used.arguments)} | {mib(used.temporaries)} | "
        f"{mib(expected)} | {mib(watch.peak - before)} | {mib(rss() - before)} |"
    )


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["tpu", "cpu"], choices=["tpu", "cpu"])
    parser.add_argument("--preset", default="gptj-6b")
    parser.add_argument("--topology", default="v5e:1x1", help="a one-chip TPU topology")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=["q", "k", "v", "out"], choices=list(config.PROJECTIONS))
    bases = ["bfloat16", *TRAINABLE_QUANTIZED]
    parser.add_argument("--bases", nargs="+", default=bases, choices=bases)
    parser.add_argument("--max-batch", type=int, default=32, help="largest micro-batch tried by doubling")
    parser.add_argument("--cpu-preset", default="gptj-tiny")
    parser.add_argument("--cpu-batch", type=int, default=4)
    parser.add_argument("--cpu-seq", type=int, default=512)
    parser.add_argument("--cpu-steps", type=int, default=3)
    args = parser.parse_args()
    lora = config.LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=tuple(args.targets))
    settings = f"LoRA rank {lora.rank} on {', '.join(lora.targets)}, fp32 adapter + AdamW, bf16 compute, remat full"

    if "tpu" in args.parts:
        cfg = config.preset(args.preset).replace(max_seq_len=max(config.preset(args.preset).max_seq_len, args.seq))
        target = f"tpu:{args.topology}"
        print(f"{args.preset} ({model.count_params(cfg):,} params), {settings}; {target}, compiled ahead of time")
        print(f"on this machine's {os.cpu_count()} CPUs")
        fits = {}
        for base in args.bases:
            p = planner.plan_train(
                lora_config(cfg, lora, base, 1, args.seq),
                target,
                mesh="data=1",
                max_micro_batch=args.max_batch,
                suggest=False,
                progress=print,
            )
            fits[base] = p.tried
            print(f"{base}: largest micro-batch that fits: {p.largest or 'none'} x {args.seq}", flush=True)
        print(table(fits, args.seq, f"fits one {target} chip"))

    if "cpu" in args.parts:
        cfg = config.preset(args.cpu_preset).replace(
            max_seq_len=max(config.preset(args.cpu_preset).max_seq_len, args.cpu_seq)
        )
        print(f"\n{args.cpu_preset} ({model.count_params(cfg):,} params) on this CPU, {settings}; the compiled step")
        print(f"run {args.cpu_steps} times; CPU memory_stats(): {jax.devices('cpu')[0].memory_stats()}")
        print("| base | micro-batch x seq | arguments MiB | temp MiB | outputs - aliased + temp MiB "
              "| measured peak RSS growth MiB | RSS kept after MiB |")  # fmt: skip
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for base in args.bases:
            print(cpu_run(cfg, lora, base, args.cpu_batch, args.cpu_seq, args.cpu_steps), flush=True)


if __name__ == "__main__":
    main()
