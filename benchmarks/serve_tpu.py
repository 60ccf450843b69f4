"""Serving on one accelerator, in one command (issue 38, item 5): the engine in-process, then the real server over
a unix socket, on the same Hugging Face folder.

    python benchmarks/serve_tpu.py --folder /tmp/gptj6b-hf --quantize int8 --out $OUT        # GPT-J-6B, a v5e
    python benchmarks/serve_tpu.py --model test-tiny --folder /tmp/tiny --dtype float32 \\
        --rows 1,2 --context 32 --new 8 --requests 8 --max-len 128 --rate 4                  # the CPU smoke

1. **Engine.** For each of `--rows` R: R prompts of `--context` tokens generate `--new` tokens each (greedy,
   `ignore_eos`) through `LanguageModel.engine(max_batch=R).generate`: the scheduler, the sampler and the host
   loop as a server runs them, `--chunk` steps per device call. A run of one new token (the prefill and the
   first choice) is timed too. The engine admits a few prompts a step and decodes the admitted rows meanwhile,
   so the decode step is timed over the engine steps in which every row decoded (after the last prefill,
   before the first row finished; R x (new - 1) over the difference of the runs where `--new` leaves none),
   and tokens/s over the whole run is printed beside it; best of `--repeats`.
2. **Served.** `meshlm serve FOLDER --uds PATH` with the same weights options and `--max-batch` the largest
   R, and `benchmarks/serve.py`'s mixed workload (log-normal prompt and output lengths, Poisson arrivals at
   `--rate` requests/s, streamed): output tokens/s, time to first token and latency, p50 and p99.

Without `--folder` (and with `--requests 0`) the engine part alone runs, on random weights made in place by
`meshlm.from_config` (quantized as they are made), which skips writing and reading 12 GB on a chip's host.

Each part runs in a process of its own (a TPU chip is opened by one process at a time); this one only
writes the folder's weights when it holds none (from random bf16 weights, `gptj6b_tpu.write_random_folder`),
sends the requests and prints. The JAX version and the device are printed; `--out` gets serve_tpu.json and
serve_tpu.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.serve import Server, poisson, workload  # noqa: E402
from benchmarks.timing import load_average  # noqa: E402


def weights_options(args: argparse.Namespace) -> list[str]:
    """The options `meshlm serve` and this script's engine part share."""
    out = ["--dtype", args.dtype]
    if args.quantize:
        out += ["--quantize", args.quantize]
    if args.kv_cache_dtype != "auto":
        out += ["--kv-cache-dtype", args.kv_cache_dtype]
    return out


def engine_part(args: argparse.Namespace) -> dict[str, Any]:
    """In this process: the folder (written if it holds no model), then the engine's decode tokens/s per row count."""
    import gc

    import jax
    import numpy as np

    import meshlm
    from benchmarks.gptj6b_tpu import write_random_folder
    from benchmarks.profile_ops import summarize
    from meshlm import model
    from meshlm.config import preset
    from meshlm.sharding import make_mesh

    device = jax.devices()[0]
    out: dict[str, Any] = {"jax": jax.__version__, "device": device.device_kind, "platform": device.platform}
    if args.folder:
        out["folder_written_s"] = write_random_folder(args.folder, preset(args.model), make_mesh(None))
        gc.collect()
    if args.served_only:  # the server alone opens the chip, after this process
        return out | {"vocab": preset(args.model).n_vocab_used, "rows": {}}
    start = time.perf_counter()
    kv = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    if args.folder:
        lm = meshlm.load(args.folder, None, args.dtype, quantize=args.quantize)
    else:  # random weights made on the device, streamed into their quantized form as a folder's would be
        lm = meshlm.from_config(preset(args.model), make_mesh(None), args.dtype, seed=0, quantize=args.quantize)
    out["load_s"] = time.perf_counter() - start
    if model.param_shapes(lm.config) != model.param_shapes(preset(args.model)):
        raise SystemExit(f"{args.folder} holds another model than the {args.model} preset")
    out["vocab"] = lm.config.n_vocab_used
    rng = np.random.default_rng(0)
    out["rows"] = {}
    for rows in args.rows:
        engine = lm.engine(max_batch=rows, max_len=args.context + args.new, kv_cache_dtype=kv, prefix_caching=False)
        prompts = [rng.integers(1, lm.config.n_vocab_used, args.context).tolist() for _ in range(rows)]

        def run(new: int, prompts: list[list[int]] = prompts, engine: Any = engine) -> tuple[float, list[Mark]]:
            """Seconds of the whole generation, and the marks of its steps."""
            params = [lm.sampling(new, ignore_eos=True, temperature=0.0)] * len(prompts)
            began = time.perf_counter()
            marks = [(time.perf_counter(), [len(o.tokens) for o in outputs])
                     for outputs in engine.run(prompts, params, chunk=args.chunk)]  # fmt: skip
            assert all(n == new for n in marks[-1][1]), "a row stopped early"
            return time.perf_counter() - began, marks

        run(1), run(args.new)  # compiles the prefill and the decode programs
        first = min(run(1)[0] for _ in range(args.repeats))
        runs = [run(args.new) for _ in range(args.repeats)]
        whole = min(seconds for seconds, _ in runs)
        steady = [step for _, marks in runs if (step := steady_step(marks, args.new)) is not None]
        step = min(steady) if steady else (whole - first) / (args.new - 1)  # too few tokens for a steady step
        how = "every row decoding" if steady else "whole - first token (no step had every row decoding)"
        if args.profile and rows == max(args.rows):
            with jax.profiler.trace(str(args.profile)):
                out["profiled_s"] = run(args.new)[0]
            print(f"profiled: prefill and {args.new} tokens of {rows} rows, {out['profiled_s']:.3f} s", flush=True)
            summarize(args.profile, top=25)
        out["rows"][rows] = {"first_s": first, "whole_s": whole, "step_ms": 1e3 * step, "tokens_per_s": rows / step,
                             "whole_tokens_per_s": rows * args.new / whole, "step_timed": how}  # fmt: skip
        print(
            f"engine, {rows} rows: prefill + first token {first:.3f} s, decode step {1e3 * step:.2f} ms, "
            f"{rows / step:,.0f} tokens/s ({rows * args.new / whole:,.0f} over the whole run)",
            flush=True,
        )
        engine.stop()
        del engine
        gc.collect()
    return out


Mark = tuple[float, list[int]]  # after an engine step: the time, and the tokens each row has


def steady_step(marks: list[Mark], new: int) -> float | None:
    """Seconds per decode step over the engine steps in which every row decoded: after the last row's prefill
    (the engine admits a few rows a step and decodes the admitted ones meanwhile, so that a prompt does not
    stall them) and before the first row finished; None where no step was such."""
    begin = next(i for i, (_, n) in enumerate(marks) if min(n) >= 1)
    end = max((i for i, (_, n) in enumerate(marks) if max(n) < new), default=begin)
    (t0, n0), (t1, n1) = marks[begin], marks[end]
    return (t1 - t0) / (min(n1) - min(n0)) if min(n1) > min(n0) else None


def served_part(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The real server over a unix socket, the mixed workload at `--rate` (prompts of tokens below `vocab`)."""
    requests = workload(args.requests, args.max_len, vocab=vocab)
    with tempfile.TemporaryDirectory() as where:
        sizes = ["--max-batch", str(max(args.rows)), "--max-len", str(args.max_len), "--chunk", str(args.chunk)]
        sizes += ["--max-queue", str(max(64, args.requests + 8))]  # every request queued (the 8 warm-ups too)
        server = Server(str(args.folder), REPO, *sizes, *weights_options(args), uds=f"{where}/meshlm.sock")
        try:
            warm = workload(8, args.max_len, seed=1, vocab=vocab)  # other prompts: the prefix cache must not flatter
            asyncio.run(poisson(server, warm, args.rate, args.time_limit, []))  # compiles the shapes
            result = asyncio.run(poisson(server, requests, args.rate, args.time_limit, []))
        finally:
            server.close()
    result["start_s"] = server.start_seconds
    return result


def summary(report: dict[str, Any]) -> str:
    e, s, a = report["engine"], report["served"], report["args"]
    weights = a["dtype"] + (f", {a['quantize']} projections" if a["quantize"] else "")
    source = a["folder"] or "random weights made in place"
    lines = [
        f"# Serving {a['model']} on {e['device']} ({e['platform']}), JAX {e['jax']}",
        "",
        f"`{report['command']}`",
        "",
        f"Weights {weights}, KV cache {a['kv_cache_dtype']}; from {source}"
        + (f", loaded in {e['load_s']:.0f} s." if "load_s" in e else "."),
        "",
    ]
    if e["rows"]:
        lines += [
            f"Engine in-process, {a['context']} prompt tokens a row, {a['new']} new tokens, chunk {a['chunk']}:",
            "",
            f"| rows | prefill + first token | decode step | step / {min(a['rows'])} rows' | tokens/s | "
            "tokens/s over the whole run | step timed over |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        least = e["rows"][str(min(a["rows"]))]["step_ms"]
    else:
        lines.append("Engine in-process: not run (--served-only).")
    for rows, r in e["rows"].items():
        lines.append(f"| {rows} | {r['first_s']:.3f} s | {r['step_ms']:.2f} ms | {r['step_ms'] / least:.2f}x | "
                     f"{r['tokens_per_s']:,.0f} | {r['whole_tokens_per_s']:,.0f} | {r['step_timed']} |")  # fmt: skip
    lines.append("")
    if "skipped" in s:
        lines.append(f"Served over a unix socket: not run ({s['skipped']}).")
    elif "error" in s:
        lines.append(f"Served over a unix socket: failed ({s['error']}).")
    else:
        lines.append(
            f"Served over a unix socket (start {s['start_s']:.0f} s, compiling included), --max-batch "
            f"{max(a['rows'])}, {s['requests']} mixed requests at {a['rate']:g}/s: **{s['tok_s']:,.1f} output "
            f"tokens/s**, TTFT p50 {s['ttft_p50']:.3f} s p99 {s['ttft_p99']:.3f} s, latency p50 {s['p50']:.2f} s "
            f"p99 {s['p99']:.2f} s."
        )
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gptj-6b", help="the preset the folder holds (written from it if empty)")
    p.add_argument("--folder", type=Path, help="a Hugging Face folder (random weights written if none); without it, "
                   "the engine part's weights are random, made in place, and --requests must be 0")  # fmt: skip
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", default=None, help="int8, w8a8 or nf4 projections, as meshlm serve's --quantize")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the compute dtype) or int8")
    p.add_argument("--rows", default="1,8,16", help="engine part: concurrent rows, comma-separated")
    p.add_argument("--context", type=int, default=512, help="engine part: prompt tokens per row")
    p.add_argument("--new", type=int, default=64, help="engine part: new tokens per row")
    p.add_argument("--chunk", type=int, default=8, help="decode steps per device call")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--requests", type=int, default=256, help="served part: mixed requests (0: no served part)")
    p.add_argument("--rate", type=float, default=32.0, help="served part: Poisson arrivals per second")
    p.add_argument("--max-len", type=int, default=1280, help="served part: prompt + output tokens per request")
    p.add_argument("--time-limit", type=float, default=120.0, help="served part: seconds of arrivals at most")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--served-only", action="store_true", help="no engine part: the folder, then the server")
    p.add_argument("--profile", type=Path, help="engine part: a folder for a profile of the most rows' generation")
    p.add_argument("--part", choices=["engine"], help=argparse.SUPPRESS)  # the child process's work
    args = p.parse_args(argv)
    if args.requests and not args.folder:
        p.error("the served part loads a folder: give --folder, or --requests 0 for the engine part alone")
    args.rows = [int(r) for r in str(args.rows).split(",")]
    if args.new < 2:
        p.error("--new must be at least 2 (one step beyond the first token)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.part == "engine":
        (args.out / "engine.json").write_text(json.dumps(engine_part(args)))
        return {}
    print(f"load average before: {load_average()}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    child = [sys.executable, __file__, *argv, "--part", "engine"]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    subprocess.run(child, check=True, env={**os.environ, "PYTHONPATH": path})
    engine = json.loads((args.out / "engine.json").read_text())
    print(f"JAX {engine['jax']} on {engine['device']} ({engine['platform']})", flush=True)
    try:
        served = served_part(args, engine["vocab"]) if args.requests else {"skipped": "--requests 0"}
    except (SystemExit, Exception) as err:  # the engine's figures are kept whatever the server does
        lines = str(err).strip().splitlines() or [type(err).__name__]
        served = {"error": next((line for line in reversed(lines) if "error" in line.lower()), lines[-1])[:300],
                  "output": lines[-40:]}  # a failed start's last lines: JAX's note often ends them  # fmt: skip
        print("served part failed:", *served["output"], sep="\n", flush=True)
    report = {
        "command": "python benchmarks/serve_tpu.py " + " ".join(argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "engine": engine,
        "served": served,
    }
    (args.out / "serve_tpu.json").write_text(json.dumps(report, indent=2))
    (args.out / "serve_tpu.md").write_text(summary(report))
    print(summary(report), flush=True)
    return report


if __name__ == "__main__":
    main()
