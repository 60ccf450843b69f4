"""GPT-J-6B fine-tuning on one accelerator (issue 37, item 4): LoRA on a bf16 base, QLoRA on int8 and
NF4 bases, and DPO over an NF4 base, at sequence 2048 with full rematerialisation and bf16 compute.

Each case builds its frozen base from random weights with `meshlm.from_config(..., quantize=...)`, or, with
`--folder`, loads it the user's way, `meshlm.load(folder, quantize=...)`, from a Hugging Face folder (one
that meshlm writes there from random bf16 weights first if it holds no model). Both stream (one parameter,
and each projection one layer, at a time: the devices never hold more than the quantized model plus one
layer of one projection in float). Then it compiles `meshlm train`'s own step
(`train_step.step_program`) for the largest batch of `--batches` that the compiler accepts, and times it.
MFU counts the frozen base's forward pass and its backward pass to the activations (4 x its matmul
weights per token), the adapter's 6 x, causal attention, and for DPO the reference forward pass
(`metrics.flops_per_token` with the LoRA config). Nothing is written to disk but the report (and the
folder).

    python benchmarks/gptj6b_tpu.py --out /tmp/gptj6b               # GPT-J-6B on a 16 GiB TPU v5e chip
    python benchmarks/gptj6b_tpu.py --folder /tmp/gptj6b-hf          # the same from a Hugging Face folder
    python benchmarks/gptj6b_tpu.py --model gptj-tiny --seq-len 128  # the CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import meshlm
from meshlm import metrics, model, train_step
from meshlm.config import LoraConfig, TrainConfig, preset
from meshlm.footprint import Footprint, OutOfMemory, device_capacity, gib, is_out_of_memory
from meshlm.lora import base_storage, init_adapter
from meshlm.sharding import make_mesh

# name -> (base storage, objective)
CASES = {
    "lora-bf16": ("bfloat16", "lm"),
    "qlora-int8": ("int8", "lm"),
    "qlora-nf4": ("nf4", "lm"),
    "dpo-nf4": ("nf4", "dpo"),
}
LORA = LoraConfig(rank=16, alpha=32.0, targets=("q", "k", "v", "out", "fc_in", "fc_out"))


def train_config(args: argparse.Namespace, base: str, objective: str, batch: int) -> TrainConfig:
    cfg = preset(args.model)
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, args.seq_len))
    return TrainConfig(
        model=cfg,
        lora=LORA,
        base_dtype=base,
        objective=objective,
        batch_size=batch,  # examples: a DPO pair is two rows
        seq_len=args.seq_len,
        remat="full",
        compute_dtype="bfloat16",
        param_dtype="float32",  # the adapter and its Adam moments
        warmup_steps=0,
        anneal_steps=10,
    )


def batch_of(tcfg: TrainConfig, abstract: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """Random token rows shaped as the step's batch: every token a target but column 0, one document per row."""
    out = {}
    for key, a in abstract.items():
        if key == "tokens":
            x = jax.random.randint(jax.random.key(1), a.shape, 0, tcfg.model.n_vocab_used, a.dtype)
        elif key == "weights":
            x = jnp.ones(a.shape, a.dtype).at[..., 0].set(0)
        else:
            x = jnp.ones(a.shape, a.dtype)
        out[key] = jax.device_put(x, a.sharding)
    return out


def run_case(name: str, args: argparse.Namespace, mesh: Any) -> dict[str, Any]:
    base_kind, objective = CASES[name]
    result: dict[str, Any] = {"base": base_kind, "objective": objective, "tried": {}}
    tcfg0 = train_config(args, base_kind, objective, args.batches[0])
    dtype, quantize = base_storage(tcfg0)
    start = time.perf_counter()
    if args.folder:
        lm = meshlm.load(args.folder, mesh, dtype, quantize=quantize)
        if model.param_shapes(lm.config) != model.param_shapes(tcfg0.model):
            raise ValueError(f"{args.folder} holds another model than the {args.model} preset")
    else:
        lm = meshlm.from_config(tcfg0.model, mesh, dtype, seed=0, quantize=quantize)
    base = lm.params
    jax.block_until_ready(base)
    result["base_init_s"] = time.perf_counter() - start
    result["base_gb"] = sum(x.nbytes for x in jax.tree.leaves(base)) / 1e9
    result["peak_gb_after_base"] = _peak_gb()
    print(f"  {name}: {base_kind} base of {result['base_gb']:.2f} GB in {result['base_init_s']:.0f} s", flush=True)
    del lm
    for batch in args.batches:
        tcfg = train_config(args, base_kind, objective, batch)
        program = train_step.step_program(tcfg, tcfg.model, mesh, args.seq_len)
        try:
            start = time.perf_counter()
            compiled = program.compile()
            compile_s = time.perf_counter() - start
            used = Footprint.of(compiled)
            print(f"  {name}: batch {batch} compiled in {compile_s:.0f} s, {gib(used.total)}", flush=True)
            capacity = device_capacity(mesh.devices.flat[0])
            if capacity is not None and used.total > capacity:
                raise OutOfMemory(f"the step needs {gib(used.total)}", used.total, capacity)
            shardings = program.shardings
            with jax.set_mesh(mesh):
                init = lambda k, tcfg=tcfg: init_adapter(model.projections(tcfg.model), tcfg.lora, k, "float32")
                params = jax.jit(init, out_shardings=shardings.params)(jax.random.key(2))
                opt_state = jax.jit(program.optimizer.init, out_shardings=shardings.opt_state)(params)
                state = train_step.TrainState(
                    jax.device_put(jnp.zeros((), jnp.int32), shardings.step), params, opt_state
                )
                data = batch_of(tcfg, program.inputs[1])
                state, stats = compiled(state, data, base)  # warm-up; the step donates the state
                first_loss = float(stats["loss"])
                start = time.perf_counter()
                for _ in range(args.steps):
                    state, stats = compiled(state, data, base)
                loss = float(stats["loss"])
                step_s = (time.perf_counter() - start) / args.steps
        except Exception as err:  # an OOM tries the next batch; anything else is the case's error
            if not is_out_of_memory(err):
                raise
            result["tried"][batch] = str(err).strip().splitlines()[0][:300]
            gc.collect()
            continue
        rows = train_step.rows_per_micro_batch(tcfg) * tcfg.micro_batches
        tokens_per_s = rows * args.seq_len / step_s
        per_token = metrics.flops_per_token(
            tcfg.model, args.seq_len, lora=tcfg.lora, reference_pass=train_step.reference_in_step(tcfg)
        )
        flops = per_token * tokens_per_s
        result["tried"][batch] = "ok"
        result |= {
            "batch": batch,
            "rows_per_step": rows,
            "compile_s": compile_s,
            "compiled_gb": used.total / 1e9,
            "step_s": step_s,
            "tokens_per_s": tokens_per_s,
            "model_tflops": flops / 1e12,
            "mfu": flops / metrics.peak_flops(mesh, "bfloat16"),
            "first_loss": first_loss,
            "loss": loss,
            "peak_gb": _peak_gb(),
        }
        del state, base
        return result
    raise RuntimeError(f"no batch of {args.batches} fits: {result['tried']}")


def write_random_folder(folder: Path, cfg: Any, mesh: Any) -> float:
    """A Hugging Face folder of `cfg` from random bf16 weights (made on the device, written one tensor at a
    time), unless `folder` already holds a model: the seconds it took."""
    if (folder / "config.json").exists():
        return 0.0
    start = time.perf_counter()
    lm = meshlm.from_config(cfg, mesh, "bfloat16", seed=0)
    lm.save(folder, format="hf")
    del lm
    gc.collect()
    return time.perf_counter() - start


def _peak_gb() -> float:
    """The device's peak bytes in use so far (where the backend reports it), in GB."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", float("nan")) / 1e9


def summary(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"# {report['model']} fine-tuning on {m['device']} ({m['platform']}), JAX {m['jax']}", ""]
    if "folder" in report:
        lines += [f"Every base loaded with `meshlm.load` from the Hugging Face folder {report['folder']}.", ""]
    lines.append(f"`{report['command']}`")
    lines.append("")
    for name, r in report["cases"].items():
        if r.get("status") != "ok":
            lines.append(f"- **{name}**: {r.get('status')} {r.get('error', '')}")
            continue
        lines.append(
            f"- **{name}** ({r['objective']}, {r['base']} base {r['base_gb']:.2f} GB ready in "
            f"{r['base_init_s']:.0f} s): batch {r['batch']} ({r['rows_per_step']} rows) x {report['seq_len']}, "
            f"remat full: {r['tokens_per_s']:,.0f} tokens/s, step {r['step_s']:.3f} s, "
            f"MFU {100 * r['mfu']:.1f}% of the spec peak, compiled {r['compiled_gb']:.2f} GB, "
            f"compile {r['compile_s']:.0f} s, loss {r['first_loss']:.3f} -> {r['loss']:.3f}"
        )
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gptj-6b", help="a preset (gptj-tiny for the CPU smoke)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {','.join(CASES)}")
    p.add_argument(
        "--batches", default="8,4,2,1", help="examples per step to try, largest first (a DPO example: two rows)"
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gptj6b.json and gptj6b.md")
    p.add_argument(
        "--folder", type=Path, help="load each base from this Hugging Face folder (written from random weights first)"
    )
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        p.error(f"unknown cases {unknown}; choose from {','.join(CASES)}")
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    device = jax.devices()[0]
    report: dict[str, Any] = {
        "machine": {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__},
        "model": args.model,
        "params": model.count_params(preset(args.model)),
        "seq_len": args.seq_len,
        "command": "python benchmarks/gptj6b_tpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cases": {},
    }
    print(f"JAX {jax.__version__} on {device.device_kind} ({device.platform})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mesh = make_mesh(None)
    if args.folder:
        report["folder_written_s"] = write_random_folder(args.folder, preset(args.model), mesh)
        report["folder"] = str(args.folder)
        print(f"Hugging Face folder {args.folder} ready ({report['folder_written_s']:.0f} s)", flush=True)
    for name in args.cases.split(","):
        start = time.monotonic()
        try:
            result = {"status": "ok", **run_case(name, args, mesh)}
        except Exception as err:  # one case's failure must not stop the others
            text = str(err).strip().splitlines()
            result = {"status": "error", "error": f"{type(err).__name__}: {text[0] if text else ''}"[:500]}
        result["wall_s"] = time.monotonic() - start
        report["cases"][name] = result
        jax.clear_caches()
        gc.collect()
        (out / "gptj6b.json").write_text(json.dumps(report, indent=2, default=str))
        (out / "gptj6b.md").write_text(summary(report))
        line = summary({**report, "cases": {name: result}}).splitlines()[-1]
        print(line, flush=True)
    return report


if __name__ == "__main__":
    main()
