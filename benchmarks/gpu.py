"""Speed on one accelerator against the hardware's own limits, measured in one run.

Sections, each guarded (a failure such as an OOM is recorded and the rest still run) and skipped once
the time budget is spent:
  matmul    bf16 square matmul: the achievable TFLOP/s, the peer of every MFU figure below;
  copy      device memory copy: the achievable GB/s, the peer of the decode roofline;
  train     GPT-J-shaped training (random init, fp32 master weights, bf16 compute, fp32 or (where memory
            requires) bf16 Adam moments, remat, seq 2048,
            the largest batch of a list that fits): tokens/s, MFU, step and compile time;
  generate  bf16 generation: prefill tokens/s of a 2048-token prompt, decode tokens/s at batch 1/16/64,
            batch-1 decode as a fraction of the roofline (weight + KV-cache bytes per step / copy GB/s);
for the gptj-6b and the gptj-1b presets (`--models` names others, `--sections` picks sections; `--micro-batches`,
`--param-dtype` and `--optimizer-memory host` (Adam's state in pinned host memory between steps) shape the training
step). `--tiny` shrinks every shape so the same code runs on a CPU.

    bash benchmarks/gpu.sh            # writes $OUT/gpu.json and $OUT/gpu.md
    python benchmarks/gpu.py --tiny --out /tmp/gpu
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from meshlm import config, kv_cache, metrics, model, optim, train_step
from meshlm.footprint import Footprint, device_capacity, host_memory, is_out_of_memory
from meshlm.serve.config import EngineConfig
from meshlm.sharding import make_mesh


@dataclass(frozen=True)
class Shapes:
    models: tuple[str, ...] = ("gptj-6b", "gptj-1b")
    matmul_n: int = 8192
    copy_bytes: int = 4 << 30
    seq_len: int = 2048
    train_batches: tuple[int, ...] = (8, 6, 4, 2, 1)  # tried largest first until one fits
    train_steps: int = 5
    prompt_len: int = 2048
    decode_batches: tuple[int, ...] = (1, 16, 64)
    decode_context: int = 512  # cache slots already filled when decoding starts
    decode_steps: int = 128
    repeats: int = 10


# One toy model: the second preset of a full run goes through exactly the same functions.
TINY = Shapes(
    models=("test-tiny",),
    matmul_n=128,
    copy_bytes=1 << 20,
    seq_len=32,
    train_batches=(2,),
    train_steps=2,
    prompt_len=32,
    decode_batches=(1, 2),
    decode_context=8,
    decode_steps=4,
    repeats=2,
)


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Seconds per call after one warm-up call; the device is synchronised only at the ends."""
    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


# ---------------------------------------------------------------------------------------------------
# Hardware probes


def probe_matmul(shapes: Shapes) -> dict[str, float]:
    n = shapes.matmul_n
    flops = metrics.measure_matmul_peak("bfloat16", n=n, repeats=shapes.repeats)
    return {"n": n, "tflops": flops / 1e12}


def probe_copy(shapes: Shapes) -> dict[str, float]:
    """Read + write of one large bf16 buffer (`x + 1`, which XLA cannot elide)."""
    x = jnp.ones((shapes.copy_bytes // 2,), jnp.bfloat16)
    step = jax.jit(lambda x: x + 1)
    seconds = timed(lambda: step(x), shapes.repeats)
    return {"bytes": shapes.copy_bytes, "gb_per_s": 2 * shapes.copy_bytes / seconds / 1e9}


# ---------------------------------------------------------------------------------------------------
# Training


def optimizer_dtype(cfg: config.ModelConfig, memory: int, optimizer_memory: str = "device") -> str:
    """fp32 Adam moments if the state (fp32 weights, gradients, moments: 16 bytes/param) plus the
    optimizer's fp32 update (4) leaves 15% of memory for activations; bf16 moments (4 bytes/param less)
    otherwise. Moments kept in host memory take none of the device's between steps: fp32."""
    need = metrics.state_bytes_per_device(cfg, {}, bytes_per_param=20)
    return "float32" if optimizer_memory == "host" or need <= 0.85 * memory else "bfloat16"


def token_batch(tokens: jax.Array) -> dict[str, jax.Array]:
    """The step's batch for rows cut from one stream, [micro_batches, rows, seq_len + 1]: every token a
    target but column 0 (as `meshlm.data.default_weights`), one document per row."""
    weights = jnp.ones(tokens.shape, jnp.float32).at[..., 0].set(0)
    return {"tokens": tokens.astype(jnp.int32), "weights": weights, "segments": jnp.ones(tokens.shape, jnp.int32)}


def bench_train(
    cfg: config.ModelConfig,
    shapes: Shapes,
    args: argparse.Namespace,
    matmul_tflops: float,
    deadline: float,
    attention: str,
) -> dict:
    mesh = make_mesh(None)
    memory = device_capacity(jax.devices()[0]) or host_memory()
    remat, micro = args.remat, args.micro_batches
    host = args.optimizer_memory == "host"
    auto = args.optimizer_state == "auto"
    state_dtype = optimizer_dtype(cfg, memory, args.optimizer_memory) if auto else args.optimizer_state
    param_bytes = 4 if args.param_dtype == "float32" else 2  # weights and gradients, each
    moment_bytes = 8 if state_dtype == "float32" else 4
    result: dict[str, Any] = {
        "params": model.count_params(cfg),
        "seq_len": shapes.seq_len,
        "remat": remat,
        "attention": attention,
        "param_dtype": args.param_dtype,
        "micro_batches": micro,
        "optimizer_state": state_dtype,
        "optimizer_memory": args.optimizer_memory,
        # on the device between steps: weights and gradients, and the moments unless they are on the host
        "state_gb": metrics.state_bytes_per_device(
            cfg, {}, bytes_per_param=2 * param_bytes + (0 if host else moment_bytes)
        )
        / 1e9,
        "device_memory_gb": memory / 1e9,
        "tried": {},
    }
    for batch_size in shapes.train_batches:  # sequences per micro-batch
        if time.monotonic() > deadline:
            result["tried"][batch_size] = "skipped: time budget"
            continue
        tcfg = config.TrainConfig(
            model=cfg,
            param_dtype=args.param_dtype,
            optimizer_memory=args.optimizer_memory,
            compute_dtype="bfloat16",
            remat=remat,
            attention=attention,
            batch_size=batch_size * micro,
            micro_batches=micro,
            warmup_steps=0,
            anneal_steps=10,
        )
        opt = optim.make_optimizer(tcfg, cfg, state_dtype=state_dtype)
        shardings = train_step.state_shardings(cfg, opt, mesh, memory=args.optimizer_memory)
        step_fn = train_step.make_train_step(tcfg, cfg, opt, shardings)

        def init_state(key: jax.Array, opt: Any = opt) -> train_step.TrainState:
            params = model.init(cfg, key, args.param_dtype)
            return train_step.TrainState(jnp.zeros((), jnp.int32), params, opt.init(params))

        state = jax.jit(init_state, out_shardings=shardings)(jax.random.key(0))
        shape = (micro, batch_size, shapes.seq_len + 1)
        batch = token_batch(jax.random.randint(jax.random.key(1), shape, 0, cfg.n_vocab_used))
        try:
            start = time.perf_counter()
            compiled = step_fn.lower(state, batch).compile()
            compile_s = time.perf_counter() - start
            used = Footprint.of(compiled)
            footprint = used.total
            if footprint > memory:  # fail fast instead of an allocation error part-way through the step
                raise MemoryError(f"out of memory: the compiled step needs {footprint / 1e9:.1f} GB")
            state, stats = compiled(state, batch)  # warm-up; each step donates and replaces the state
            first_loss = float(stats["loss"])
            start = time.perf_counter()
            for _ in range(shapes.train_steps):
                state, stats = compiled(state, batch)
            loss = float(stats["loss"])
            step_s = (time.perf_counter() - start) / shapes.train_steps
            if args.profile:  # two more steps under JAX's profiler, for xprof's op statistics
                with jax.profiler.trace(args.profile):
                    for _ in range(2):
                        state, stats = compiled(state, batch)
                    jax.block_until_ready(stats)
        except Exception as err:  # an OOM tries the next batch; anything else is the section's error
            if not is_out_of_memory(err):
                raise
            result["tried"][batch_size] = one_line(err)
            del state
            gc.collect()
            continue
        tokens_per_s = micro * batch_size * shapes.seq_len / step_s
        flops = metrics.flops_per_token(cfg, shapes.seq_len) * tokens_per_s
        result["tried"][batch_size] = "ok"
        result["stored_param_dtypes"] = sorted({str(x.dtype) for x in jax.tree.leaves(state.params)})
        result["optimizer_memory_kinds"] = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)})
        result |= {
            "batch": batch_size,
            "tokens_per_step": micro * batch_size * shapes.seq_len,
            "first_loss": first_loss,
            "loss": loss,  # after the timed steps, all on the same batch
            "compile_s": compile_s,
            "compiled_gb": footprint / 1e9,
            "compiled_host_gb": used.host / 1e9,  # host memory the step reads and writes (the offloaded state)
            "step_s": step_s,
            "tokens_per_s": tokens_per_s,
            "model_tflops": flops / 1e12,
            "mfu": flops / metrics.peak_flops(mesh, "bfloat16"),
            "mfu_vs_matmul": flops / (matmul_tflops * 1e12),
        }
        return result
    raise RuntimeError(f"no batch of {list(shapes.train_batches)} fits: {result['tried']}")


# ---------------------------------------------------------------------------------------------------
# Generation


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def bench_generate(
    cfg: config.ModelConfig, shapes: Shapes, matmul_tflops: float, copy_gbs: float, deadline: float, attention: str
) -> dict:
    policy = config.Policy(param_dtype="bfloat16", compute_dtype="bfloat16", attention=attention)
    params = jax.jit(lambda k: model.init(cfg, k, "bfloat16"))(jax.random.key(0))
    weight_bytes = tree_bytes(params)

    def pages(rows: int, tokens: int) -> tuple[kv_cache.KVCache, jax.Array]:
        """A pool with `tokens` slots for each row, and tables giving each row its own consecutive pages."""
        page = EngineConfig().tokens_per_page(jax.default_backend())  # the engine's pages on this backend
        per_row = -(-tokens // page)
        table = 1 + jnp.arange(rows * per_row, dtype=jnp.int32).reshape(rows, per_row)  # page 0: padding
        return kv_cache.init_cache(cfg, rows * per_row + 1, page, "bfloat16"), table

    @jax.jit
    def prefill(params: model.Params, tokens: jax.Array, cache: kv_cache.KVCache, table: jax.Array) -> tuple:
        at = jnp.full((tokens.shape[0],), tokens.shape[1] - 1)
        start = jnp.zeros((tokens.shape[0],), jnp.int32)
        return model.decode(params, tokens, cache, table, start, cfg, policy, at=at)

    T = shapes.prompt_len
    prompt = jax.random.randint(jax.random.key(1), (1, T), 0, cfg.n_vocab_used)
    empty, table = pages(1, T)
    seconds = timed(lambda: prefill(params, prompt, empty, table), shapes.repeats)
    prefill_flops = metrics.flops_per_token(cfg, T) / 3 * T / seconds  # the forward third of the training count
    result: dict[str, Any] = {
        "params": model.count_params(cfg),
        "weight_gb": weight_bytes / 1e9,
        "attention": attention,
        "prefill_len": T,
        "prefill_s": seconds,
        "prefill_tokens_per_s": T / seconds,
        "prefill_mfu_vs_matmul": prefill_flops / (matmul_tflops * 1e12),
        "decode_context": shapes.decode_context,
        "decode_steps": shapes.decode_steps,
        "decode": {},
    }

    def loop(
        params: model.Params, cache: kv_cache.KVCache, table: jax.Array, token: jax.Array, length: jax.Array
    ) -> tuple[jax.Array, kv_cache.KVCache, jax.Array]:
        """`decode_steps` greedy tokens on the device: no host round-trip between steps."""

        def body(_: int, carry: tuple) -> tuple:
            cache, token, length = carry
            logits, cache = model.decode(params, token[:, None], cache, table, length, cfg, policy)
            return cache, jnp.argmax(logits[:, -1, : cfg.n_vocab_used], -1).astype(jnp.int32), length + 1

        cache, token, length = jax.lax.fori_loop(0, shapes.decode_steps, body, (cache, token, length))
        return token, cache, length

    loop = jax.jit(loop, donate_argnums=1)
    # A decode step's cost depends on how many tokens each row holds, not on what they are: start each
    # row at `decode_context` tokens instead of prefilling them.
    slots = shapes.decode_context + 2 * shapes.decode_steps
    for batch in shapes.decode_batches:
        if time.monotonic() > deadline:
            result["decode"][batch] = {"status": "skipped: time budget"}
            continue
        try:
            cache, table = pages(batch, slots)
            length = jnp.full((batch,), shapes.decode_context, jnp.int32)
            token = jnp.zeros((batch,), jnp.int32)
            token, cache, length = loop(params, cache, table, token, length)  # compiles
            jax.block_until_ready(token)
            start = time.perf_counter()
            token, cache, length = loop(params, cache, table, token, length)
            jax.block_until_ready(token)
            step_s = (time.perf_counter() - start) / shapes.decode_steps
            cache_bytes = tree_bytes((cache.k, cache.v))
            del cache
        except Exception as err:  # recorded per batch, the other batches still run
            if not is_out_of_memory(err):
                raise
            result["decode"][batch] = {"status": "out of memory"}
            continue
        roofline_s = (weight_bytes + cache_bytes) / (copy_gbs * 1e9)
        result["decode"][batch] = {
            "status": "ok",
            "cache_slots": slots,
            "step_ms": step_s * 1e3,
            "tokens_per_s": batch / step_s,
            "bytes_per_step_gb": (weight_bytes + cache_bytes) / 1e9,
            "roofline_fraction": roofline_s / step_s,
        }
    one = result["decode"].get(shapes.decode_batches[0], {})
    result["batch1_roofline_fraction"] = one.get("roofline_fraction", float("nan"))
    return result


# ---------------------------------------------------------------------------------------------------
# Driver and report


def machine() -> dict[str, Any]:
    device = jax.devices()[0]
    return {
        "device": device.device_kind,
        "platform": device.platform,
        "n_devices": jax.device_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }


def one_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:500]


def run(args: argparse.Namespace) -> dict[str, Any]:
    shapes = TINY if args.tiny else Shapes()
    if args.train_batches:
        shapes = replace(shapes, train_batches=tuple(int(b) for b in args.train_batches.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = start + args.budget_s
    report: dict[str, Any] = {
        "machine": machine(),
        "tiny": args.tiny,
        "budget_s": args.budget_s,
        "command": "python benchmarks/gpu.py " + " ".join(args.argv),
        "sections": {},
    }

    def section(name: str, fn: Callable[[str], dict]) -> dict:
        """Run `fn(attention implementation)` as one guarded section of the report."""
        if time.monotonic() > deadline:
            result = {"status": "skipped", "reason": "time budget spent"}
        else:
            t0 = time.monotonic()
            try:
                result = {"status": "ok", **fn(args.attention)}
            except Exception as err:  # one section's failure must not stop the others
                result = {"status": "error", "error": one_line(err)}
                if args.attention == "auto" and jax.default_backend() == "gpu" and not is_out_of_memory(err):
                    # cuDNN may refuse a shape only when XLA compiles it: rerun on XLA's attention.
                    try:
                        result = {"status": "ok", "cudnn_error": result["error"], **fn("xla")}
                    except Exception as retry_err:
                        result["error_with_xla_attention"] = one_line(retry_err)
            result["wall_s"] = time.monotonic() - t0
            jax.clear_caches()
            gc.collect()
        report["sections"][name] = result
        report["elapsed_s"] = time.monotonic() - start
        write(report, out)
        print(f"{name}: {result['status']} ({result.get('wall_s', 0):.1f} s)", flush=True)
        return result

    wanted = set(args.sections.split(","))
    matmul = section("matmul", lambda _: probe_matmul(shapes)) if "matmul" in wanted else {}
    copy = section("copy", lambda _: probe_copy(shapes)) if "copy" in wanted else {}
    tflops = matmul.get("tflops", float("nan"))
    gbs = copy.get("gb_per_s", float("nan"))
    for name in args.models.split(",") if args.models else shapes.models:
        cfg = config.preset(name).replace(max_seq_len=max(shapes.seq_len, shapes.prompt_len))
        if "train" in wanted:
            section(f"train/{name}", lambda attn, cfg=cfg: bench_train(cfg, shapes, args, tflops, deadline, attn))
        if "generate" in wanted:
            section(f"generate/{name}", lambda attn, cfg=cfg: bench_generate(cfg, shapes, tflops, gbs, deadline, attn))
    return report


def write(report: dict[str, Any], out: Path) -> None:
    """Rewritten after every section, so a run stopped from outside still leaves its figures."""
    (out / "gpu.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu.md").write_text(summary(report))


def fmt(x: Any, digits: int = 1) -> str:
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:,.{digits}f}"
    return str(x)


def of_matmul(share: float) -> str:
    """', N% of measured matmul', or nothing where this run measured no matmul (its sections left it out)."""
    return "" if math.isnan(share) else f", {fmt(100 * share)}% of measured matmul"


def summary(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["sections"]
    lines = [
        f"# meshlm on {m['device']} ({m['platform']}), JAX {m['jax']}",
        "",
        f"`{report['command']}`, {fmt(report.get('elapsed_s', 0.0), 0)} s",
        "",
    ]
    for name, r in s.items():
        if r["status"] != "ok":
            lines.append(f"- **{name}**: {r['status']} {r.get('error', r.get('reason', ''))}")
        elif name == "matmul":
            lines.append(f"- **matmul** bf16 {r['n']}x{r['n']}: {fmt(r['tflops'])} TFLOP/s")
        elif name == "copy":
            lines.append(f"- **copy** {r['bytes'] >> 20} MiB: {fmt(r['gb_per_s'])} GB/s")
        elif name.startswith("train/"):
            lines.append(
                f"- **{name}** batch {r['micro_batches']} x {r['batch']} x {r['seq_len']}, remat {r['remat']}, "
                f"weights {r['param_dtype']}, Adam state "
                f"{r['optimizer_state']}{' in host memory' if r['optimizer_memory'] == 'host' else ''}: "
                f"{fmt(r['tokens_per_s'], 0)} tokens/s, step {fmt(r['step_s'], 3)} s, "
                f"MFU {fmt(100 * r['mfu'])}% (of spec peak{of_matmul(r['mfu_vs_matmul'])}), "
                f"compile {fmt(r['compile_s'])} s"
            )
        else:
            decode = ", ".join(
                f"batch {b}: " + (f"{fmt(d['tokens_per_s'], 0)} tokens/s" if d["status"] == "ok" else d["status"])
                for b, d in r["decode"].items()
            )
            lines.append(
                f"- **{name}**: prefill {r['prefill_len']} tokens {fmt(r['prefill_tokens_per_s'], 0)} tokens/s"
                f"{of_matmul(r['prefill_mfu_vs_matmul'])}; decode ({r['decode_context']} context) "
                f"{decode}; batch-1 decode {fmt(100 * r['batch1_roofline_fraction'])}% of the bandwidth roofline"
            )
    return "\n".join(lines) + "\n"


SECTIONS = ("matmul", "copy", "train", "generate")


def sections(value: str) -> str:
    """--sections: a comma-separated subset of SECTIONS."""
    unknown = [s for s in value.split(",") if s not in SECTIONS]
    if unknown or not value:
        raise argparse.ArgumentTypeError(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    return value


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", default=os.environ.get("MESHLM_GPU_TINY") == "1")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu.json and gpu.md")
    p.add_argument("--budget-s", type=float, default=420.0, help="sections starting after this are skipped")
    p.add_argument("--remat", default="dots_no_batch", choices=sorted(model.REMAT_POLICIES))
    p.add_argument("--attention", default="auto", choices=config.ATTENTION_IMPLS)
    p.add_argument(
        "--train-batches", default="", help="comma-separated sequences per micro-batch to try, largest first"
    )
    p.add_argument("--models", default="", help="comma-separated presets (default: gptj-6b,gptj-1b; --tiny: test-tiny)")
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        type=sections,
        help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default: all)",
    )
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches (gradient accumulation) per step")
    p.add_argument("--profile", default="", help="a folder for a profile of two training steps (xprof reads it)")
    p.add_argument(
        "--param-dtype", default="float32", choices=list(config.DTYPES), help="the trained weights' storage dtype"
    )
    p.add_argument(
        "--optimizer-state",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="Adam moments' storage; auto: fp32 unless memory requires bf16",
    )
    p.add_argument(
        "--optimizer-memory",
        default="device",
        choices=list(config.OPTIMIZER_MEMORY),
        help="where Adam's state stays between steps (host: pinned host memory, to the device and back each step)",
    )
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    return args


if __name__ == "__main__":
    run(parse())
