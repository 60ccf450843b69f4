"""What fits: GPT-J-6B's LoRA train step compiled ahead of time for one TPU v5e chip (16 GiB HBM, of which
XLA makes 15.75 GiB available) on this machine, which has no TPU, with the figures from XLA's own
compiler; and the same step for a small model on this CPU, its compiled figures beside the memory it
actually used when run.

The step is `meshlm train`'s: `train.make_train_step` for rank 16 on q, k, v, out, an fp32 adapter with
AdamW, bf16 compute, full remat, over a frozen base stored as bf16, int8 or NF4 (its other weights in
bf16). Every input is a ShapeDtypeStruct with its sharding on a one-device mesh over the topology's
first chip, so nothing is allocated. For each base the micro-batch doubles from 1 until XLA refuses the
program (RESOURCE_EXHAUSTED names the bytes it needs), then bisects between the last fit and the first
refusal. Total = arguments + outputs - aliased (the donated state) + temporaries, as benchmarks/gpu.py
counts a compiled step; generated code is listed apart.

    PYTHONPATH=. python benchmarks/lora_memory.py [--parts tpu cpu] [--bases bfloat16 int8 nf4] [--max-batch 32]
        [--bisect 3] [--cpu-preset gptj-tiny --cpu-batch 4 --cpu-seq 512 --cpu-steps 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshlm import api, config, model, train
from meshlm.config import QUANTIZED
from meshlm.sharding import make_mesh, named_sharding, plan

GIB = 2**30
# XLA's "G" in RESOURCE_EXHAUSTED is GiB: a 15.61 GiB program fits in its "15.75G available"
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclass(frozen=True)
class Fit:
    """One compile's outcome: XLA's memory analysis, or the bytes it said an over-budget program needs."""

    base: str
    micro_batch: int
    seconds: float
    stats: Any = None  # CompiledMemoryStats when the program fits
    needed: int | None = None
    error: str = ""

    @property
    def total(self) -> int:
        s = self.stats
        return s.argument_size_in_bytes + s.output_size_in_bytes - s.alias_size_in_bytes + s.temp_size_in_bytes


def lora_step(
    cfg: config.ModelConfig, lora: config.LoraConfig, base_dtype: str, micro_batch: int, seq: int, mesh: Any
) -> tuple[Callable, tuple[Any, Any, Any], Any]:
    """`meshlm train`'s jitted LoRA step, ShapeDtypeStructs (with shardings) of its (state, batch, base),
    and its optimizer."""
    quantize = base_dtype if base_dtype in QUANTIZED else None
    tcfg = config.TrainConfig(
        model=cfg,
        batch_size=micro_batch,
        lora=lora,
        base_dtype=base_dtype,
        param_dtype="float32",
        compute_dtype="bfloat16",
        remat="full",
    )
    opt = train.make_optimizer(tcfg, cfg)
    shardings = train.state_shardings(cfg, opt, mesh, lora)
    params, opt_state = train.abstract_state(shardings, cfg, opt, lora)
    state = train.TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings.step), params, opt_state)
    base = model.abstract_params(cfg, "bfloat16")  # a quantized base keeps its other weights in compute dtype
    if quantize:
        base = jax.eval_shape(lambda p: model.quantize(p, quantize), base)
    base_shardings = plan(base, model.logical_axes(cfg, quantize=quantize), mesh)
    base = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), base, base_shardings)
    batch_sharding = named_sharding(mesh, (None, "batch", "seq"))
    batch = jax.ShapeDtypeStruct((1, micro_batch, seq + 1), jnp.int32, sharding=batch_sharding)
    return train.make_train_step(tcfg, cfg, opt, shardings, base_shardings), (state, batch, base), opt


def compile_step(step_fn: Callable, inputs: tuple[Any, ...], mesh: Any) -> Any:
    with jax.set_mesh(mesh):  # the activation constraints apply inside the mesh, as in `meshlm train`
        return step_fn.lower(*inputs).compile()


def needed_bytes(message: str) -> int | None:
    """The bytes an over-budget program needs, from XLA's RESOURCE_EXHAUSTED message (None: not stated)."""
    m = re.search(r"(?:required[^(]*\(|Used )([\d.]+)([KMGT])", message)
    return None if m is None else int(float(m.group(1)) * UNITS[m.group(2)])


def try_fit(cfg: config.ModelConfig, lora: config.LoraConfig, base: str, micro_batch: int, seq: int, mesh: Any) -> Fit:
    start = time.perf_counter()
    step_fn, inputs, _ = lora_step(cfg, lora, base, micro_batch, seq, mesh)
    try:
        compiled = compile_step(step_fn, inputs, mesh)
    except Exception as e:  # XLA raises JaxRuntimeError (or ValueError) for a program over the HBM
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        message = str(e).splitlines()[0]
        return Fit(base, micro_batch, time.perf_counter() - start, needed=needed_bytes(message), error=message)
    return Fit(base, micro_batch, time.perf_counter() - start, stats=compiled.memory_analysis())


def largest_fit(try_batch: Callable[[int], Fit], max_batch: int, bisect: int) -> list[Fit]:
    """Micro-batches 1, 2, 4, ... up to `max_batch` until one does not fit, then up to `bisect` compiles
    between the last that fit and the first that did not. Every compile's outcome, in order."""
    fits, good, bad = [], 0, None
    batch = 1
    while batch <= max_batch:
        fits.append(try_batch(batch))
        print(describe(fits[-1]), flush=True)
        if fits[-1].stats is None:
            bad = batch
            break
        good, batch = batch, batch * 2
    while bad is not None and good and bad - good > 1 and bisect > 0:
        mid = (good + bad) // 2
        fits.append(try_batch(mid))
        print(describe(fits[-1]), flush=True)
        good, bad = (mid, bad) if fits[-1].stats is not None else (good, mid)
        bisect -= 1
    return fits


def describe(fit: Fit) -> str:
    what = f"  {fit.base} x micro-batch {fit.micro_batch}: "
    if fit.stats is None:
        needs = f"needs {fit.needed / GIB:.2f} GiB; " if fit.needed else ""
        return what + f"does not fit: {needs}XLA: {fit.error} (compile {fit.seconds:.0f} s)"
    return what + f"fits, {fit.total / GIB:.2f} GiB (compile {fit.seconds:.0f} s)"


def table(fits: list[Fit], seq: int, budget: str) -> str:
    rows = [
        "| base | micro-batch x seq | arguments GiB | outputs - aliased GiB | temp GiB | code MiB | total GiB "
        f"| {budget} |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for f in sorted(fits, key=lambda f: (f.base, f.micro_batch)):
        if f.stats is None:
            needs = f"needs {f.needed / GIB:.2f} GiB" if f.needed else f.error
            rows.append(f"| {f.base} | {f.micro_batch} x {seq} | | | | | | no: {needs} |")
            continue
        s = f.stats
        rows.append(
            f"| {f.base} | {f.micro_batch} x {seq} | {s.argument_size_in_bytes / GIB:.2f} | "
            f"{(s.output_size_in_bytes - s.alias_size_in_bytes) / GIB:.3f} | {s.temp_size_in_bytes / GIB:.2f} | "
            f"{s.generated_code_size_in_bytes / 2**20:.1f} | {f.total / GIB:.2f} | yes |"
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
    step_fn, inputs, opt = lora_step(cfg, lora, base, micro_batch, seq, mesh)
    compiled = compile_step(step_fn, inputs, mesh)
    s = compiled.memory_analysis()
    quantize = base if base in QUANTIZED else None
    frozen = api.from_config(cfg, mesh, "bfloat16", seed=0, quantize=quantize).params
    state_shardings = jax.tree.map(lambda a: a.sharding, inputs[0])
    adapter = jax.jit(lambda k: model.init_adapter(cfg, lora, k), out_shardings=state_shardings.params)(
        jax.random.key(1)
    )
    opt_state = jax.jit(opt.init, out_shardings=state_shardings.opt_state)(adapter)
    state = train.TrainState(jax.device_put(jnp.int32(0), state_shardings.step), adapter, opt_state)
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab_used, (1, micro_batch, seq + 1)).astype(np.int32)
    batch = jax.device_put(tokens, inputs[1].sharding)
    jax.block_until_ready((frozen, state, batch))
    before = rss()
    with PeakRSS() as watch:
        for _ in range(steps):
            state, metrics = compiled(state, batch, frozen)
            metrics["loss"].block_until_ready()
    expected = s.output_size_in_bytes - s.alias_size_in_bytes + s.temp_size_in_bytes
    return (
        f"| {base} | {micro_batch} x {seq} | {mib(s.argument_size_in_bytes)} | {mib(s.temp_size_in_bytes)} | "
        f"{mib(expected)} | {mib(watch.peak - before)} | {mib(rss() - before)} |"
    )


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["tpu", "cpu"], choices=["tpu", "cpu"])
    parser.add_argument("--preset", default="gptj-6b")
    parser.add_argument("--topology", default="v5e:2x2", help="a TPU slice; the mesh is its first chip alone")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=["q", "k", "v", "out"], choices=list(config.PROJECTIONS))
    parser.add_argument("--bases", nargs="+", default=["bfloat16", "int8", "nf4"], choices=["bfloat16", *QUANTIZED])
    parser.add_argument("--max-batch", type=int, default=32, help="largest micro-batch tried by doubling")
    parser.add_argument("--bisect", type=int, default=3, help="compiles between the last fit and the first refusal")
    parser.add_argument("--cpu-preset", default="gptj-tiny")
    parser.add_argument("--cpu-batch", type=int, default=4)
    parser.add_argument("--cpu-seq", type=int, default=512)
    parser.add_argument("--cpu-steps", type=int, default=3)
    args = parser.parse_args()
    lora = config.LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=tuple(args.targets))
    settings = f"LoRA rank {lora.rank} on {', '.join(lora.targets)}, fp32 adapter + AdamW, bf16 compute, remat full"

    if "tpu" in args.parts:
        from jax.experimental import topologies

        chip = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices[0]
        mesh = make_mesh("data=1", devices=[chip])
        cfg = config.preset(args.preset).replace(max_seq_len=max(config.preset(args.preset).max_seq_len, args.seq))
        print(f"{args.preset} ({model.count_params(cfg):,} params), {settings}; one {chip.device_kind} chip of")
        print(f"{args.topology}, compiled ahead of time on this machine's {os.cpu_count()} CPUs")
        fits = []
        for base in args.bases:
            attempt = functools.partial(try_fit, cfg, lora, base, seq=args.seq, mesh=mesh)
            fits += largest_fit(attempt, args.max_batch, args.bisect)
        print(table(fits, args.seq, f"fits one {chip.device_kind} chip"))
        for base in args.bases:
            largest = max((f.micro_batch for f in fits if f.base == base and f.stats is not None), default=0)
            print(f"{base}: largest micro-batch that fits: {largest or 'none'} x {args.seq}")

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
