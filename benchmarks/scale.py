"""The scale figures: what meshlm's train step needs per device on TPU slices, from XLA's own compiler
(`meshlm plan`, compiled ahead of time with libtpu on this CPU machine; no TPU is used).

Each scenario is one `meshlm.planner.plan_train` call: the step `meshlm train` would run (fp32 parameters
and AdamW moments, bf16 compute, full remat, 2048-token sequences), compiled for every chip of the slice.
Micro-batches are searched (doubling, then bisection) only where `search` is set; otherwise the step is
compiled at one sequence per data-parallel way. Step time is predicted from the model's FLOPs at the
chips' peak and at 40% MFU; XLA's own FLOP count is listed too (it counts a scanned layer once).

    PYTHONPATH=. python benchmarks/scale.py [--only NAME ...] [--list]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from meshlm import metrics, model, planner
from meshlm.config import ModelConfig, TrainConfig, preset
from meshlm.footprint import gib


def gptj_shaped(n_layer: int, d_model: int, n_head: int) -> ModelConfig:
    """A GPT-J block stack of another size: d_ff = 4 d_model, rotary on a quarter of each head."""
    return ModelConfig(
        n_layer=n_layer, d_model=d_model, n_head=n_head, d_ff=4 * d_model, rotary_dim=d_model // n_head // 4
    )


@dataclass(frozen=True)
class Scenario:
    name: str
    model: ModelConfig
    target: str
    mesh: str
    search: bool = False
    max_micro_batch: int = 64


SCENARIOS = [
    # the seed's own hardware and layout (cores_per_replica 8: all tensor parallel), then meshlm's ZeRO-3
    Scenario("gptj-6b-v3-8-seed", preset("gptj-6b"), "tpu:v3:2x2", "model=8", search=True),
    Scenario("gptj-6b-v3-8-fsdp", preset("gptj-6b"), "tpu:v3:2x2", "fsdp=8", search=True),
    # the seed's stated limit, ~40B GPT-J-shaped, on v3 slices
    Scenario("gptj-40b-v3-32", gptj_shaped(48, 8192, 64), "tpu:v3:4x4", "fsdp=8,model=4"),
    Scenario("gptj-40b-v3-64", gptj_shaped(48, 8192, 64), "tpu:v3:4x8", "fsdp=16,model=4"),
    # beyond it: GPT-3-175B-shaped on v5p, GPT-NeoX-20B on v4 and v5p
    Scenario("gptj-175b-v5p-128", gptj_shaped(96, 12288, 96), "tpu:v5p:4x4x8", "fsdp=16,model=8"),
    Scenario("gptj-175b-v5p-512", gptj_shaped(96, 12288, 96), "tpu:v5p:8x8x8", "fsdp=64,model=8"),
    Scenario("gptj-805b-v5p-512", gptj_shaped(160, 20480, 160), "tpu:v5p:8x8x8", "fsdp=32,model=16"),
    Scenario("neox-20b-v4-32", preset("gpt-neox-20b"), "tpu:v4:2x2x4", "fsdp=8,model=4"),
    Scenario("neox-20b-v5p-8", preset("gpt-neox-20b"), "tpu:v5p:2x2x2", "fsdp=8"),
]


def run(s: Scenario) -> str:
    cfg = TrainConfig(
        model=s.model, mesh=s.mesh, batch_size=1, param_dtype="float32", compute_dtype="bfloat16", remat="full"
    )
    start = time.perf_counter()
    tgt = planner.target(s.target)
    ways = planner.batch_ways(tgt.mesh(s.mesh))
    cfg = cfg.replace(batch_size=ways)
    p = planner.plan_train(
        cfg, s.target, seq_len=2048, search=s.search, suggest=False, max_micro_batch=s.max_micro_batch, progress=print
    )
    seconds = time.perf_counter() - start
    fit = p.config
    print(planner.describe_train(p, cfg), flush=True)
    peak = tgt.peak_flops * tgt.n_devices
    tokens = (p.largest or fit.micro_batch) * 2048
    step_flops = metrics.flops_per_token(s.model, 2048) * tokens
    at_40 = step_flops / peak / planner.STATED_MFU
    largest = p.largest if s.search else "-"
    verdict = "yes" if fit.fits else f"no ({fit.refused[:60]})" if fit.refused else "no"
    return (
        f"| {s.name} | {model.count_params(s.model) / 1e9:.1f}B | {s.target} ({tgt.n_devices} x {tgt.device_kind}) "
        f"| {p.mesh} | {fit.micro_batch} | {gib(fit.params)} | {gib(fit.optimizer)} | {gib(fit.total)} "
        f"| {gib(fit.capacity)} | {verdict} | {largest} | {step_flops:.2e} | {at_40:.2f} s "
        f"| {f'{p.xla_flops:.2e}' if p.xla_flops else '-'} | {seconds:.0f} s |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", help="scenario names")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only]
    if args.list:
        print("\n".join(s.name for s in SCENARIOS))
        return
    rows = []
    for s in chosen:
        print(f"\n## {s.name}", flush=True)
        rows.append(run(s))
        print(rows[-1], flush=True)
    print(
        "\n| scenario | params | target | mesh | micro-batch | params/device | Adam/device | total/device | capacity "
        "| fits | largest micro-batch | model FLOPs/step at that batch | step at 40% MFU | XLA FLOPs/device | "
        "compile |"
    )
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
