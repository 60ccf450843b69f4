"""Serving beyond one model: many LoRA adapters in one batch, and output constrained to a JSON schema.

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/serve_multi.py [--requests 64 --new 48 --max-batch 16
                                                                     --rank 16 --repeats 3]

A random `gptj-tiny` (d_model 256, 4 layers, vocab 50400, context cut to 256) and four random PEFT adapters of
`--rank` on every projection, in one engine of `--max-batch` rows, all in this process, on the same seeded
prompts (16 to 96 tokens; `--new` generated tokens each, greedy):

1. **Adapters.** Generated tokens/s, best of `--repeats`, for the same requests served as
   - *one adapter*: every request names adapter 0;
   - *a mix of four*: request i names adapter i % 4, all in one batch;
   - *each in turn*: the four adapters' requests one group after another, as a server of one adapter at a
     time must batch them.
   Ratios: mix / one (goal >= 0.8x) and mix / in turn (goal >= 2x). The base alone, on an engine without
   adapter slots, gives what the slots cost.
2. **Schema.** Decode tokens/s of the same requests (sampled at temperature 1, `--new` tokens at most) under a
   JSON schema against without (goal >= 0.8x); the schema's compile time against a request's first-token
   latency.
3. **Memory.** The adapter slots' bytes per device against the weights', from the planner's serve plan (XLA's
   compiled decode step), for GPT-J-6B on one 80 GiB GPU-sized device.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

import meshlm
from meshlm import lora, model
from meshlm.config import LoraConfig
from meshlm.formats import adapters as adapter_files
from meshlm.formats import hf
from meshlm.serve.config import EngineConfig
from meshlm.serve.grammar import Constraint, Grammars
from meshlm.serve.params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "tags", "count"],
    "additionalProperties": False,
}


def write_adapters(lm: meshlm.LanguageModel, root: Path, n: int, rank: int) -> dict[str, Path]:
    """n random PEFT adapters of `rank` on every projection (A and B both random, so each changes the output)."""
    projections = model.projections(lm.config)
    rng = np.random.default_rng(0)
    folders = {}
    for i in range(n):
        table = lora.adapter_table(projections, LoraConfig(rank=rank, alpha=rank, targets=tuple(projections)))
        weights = {
            role: {"a": rng.normal(0, 0.05, p["a"].shape).astype(np.float32),
                   "b": rng.normal(0, 0.05, p["b"].shape).astype(np.float32),
                   "scale": np.ones(p["scale"].shape, np.float32)}
            for role, p in table.items()
        }  # fmt: skip
        folders[f"adapter{i}"] = root / f"adapter{i}"
        adapter_files.write_peft(folders[f"adapter{i}"], weights, lm.config, hf.export_arch(lm.config))
    return folders


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(16, 97))).tolist() for _ in range(n)]


def throughput(engine, batch: list[list[int]], params: list[SamplingParams], names, repeats: int) -> float:
    """Generated tokens/s of one `generate` of the batch, best of `repeats` (after one untimed run)."""
    best = float("inf")
    tokens = 0
    for i in range(repeats + 1):
        began = time.perf_counter()
        out = engine.generate(batch, params, adapters=names)
        took = time.perf_counter() - began
        tokens = sum(len(o.tokens) for o in out)
        best = took if i and took < best else best
    return tokens / best


def in_turn(engine, batch, params, names, repeats: int) -> float:
    """The same requests, one adapter's group at a time."""
    best = float("inf")
    tokens = 0
    groups = sorted(set(names))
    for i in range(repeats + 1):
        began, tokens = time.perf_counter(), 0
        for name in groups:
            rows = [j for j, n in enumerate(names) if n == name]
            out = engine.generate([batch[j] for j in rows], [params[j] for j in rows], adapters=[name] * len(rows))
            tokens += sum(len(o.tokens) for o in out)
        took = time.perf_counter() - began
        best = took if i and took < best else best
    return tokens / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", default="", help="comma-separated: adapters, schema, memory")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    cfg = meshlm.preset("gptj-tiny").replace(max_seq_len=256)
    lm = meshlm.from_config(cfg, seed=0)
    batch = prompts(args.requests, cfg.n_vocab_used)
    greedy = [SamplingParams(max_new_tokens=args.new, temperature=0) for _ in batch]

    if "adapters" not in skip:
        with tempfile.TemporaryDirectory() as tmp:
            folders = write_adapters(lm, Path(tmp), 4, args.rank)
            engine = lm.engine(adapters=folders, max_batch=args.max_batch, max_len=cfg.max_seq_len)
            engine.warm_up()
            one = throughput(engine, batch, greedy, ["adapter0"] * len(batch), args.repeats)
            mixed_names = [f"adapter{i % 4}" for i in range(len(batch))]
            mix = throughput(engine, batch, greedy, mixed_names, args.repeats)
            turn = in_turn(engine, batch, greedy, mixed_names, args.repeats)
            plain = lm.engine(max_batch=args.max_batch, max_len=cfg.max_seq_len)
            plain.warm_up()
            base = throughput(plain, batch, greedy, None, args.repeats)
        print(f"adapters: one {one:.0f} tok/s, mix of four {mix:.0f}, each in turn {turn:.0f}, base without slots "
              f"{base:.0f}")  # fmt: skip
        print(f"  mix / one {mix / one:.2f}x (goal >= 0.8x); mix / in turn {mix / turn:.2f}x (goal >= 2x); "
              f"one adapter / base {one / base:.2f}x")  # fmt: skip

    if "schema" not in skip:
        engine = lm.engine(max_batch=args.max_batch, max_len=cfg.max_seq_len, tokenizer=lm.tokenizer)
        engine.warm_up()
        constraint = Constraint.json_schema(SCHEMA)
        sampled = [SamplingParams(max_new_tokens=args.new, temperature=1.0, seed=i) for i in range(len(batch))]
        constrained = [sp.replace(constraint=constraint) for sp in sampled]
        free = throughput(engine, batch, sampled, None, args.repeats)
        under = throughput(engine, batch, constrained, None, args.repeats)
        print(f"schema: {under:.0f} tok/s under a JSON schema, {free:.0f} without: {under / free:.2f}x (goal >= 0.8x)")
        began = time.perf_counter()
        Grammars(lm.tokenizer, cfg.vocab_size).check(Constraint.json_schema({**SCHEMA, "title": "fresh"}))
        compile_s = time.perf_counter() - began
        began = time.perf_counter()
        engine.generate([batch[0]], [SamplingParams(max_new_tokens=1, temperature=0)])
        first = time.perf_counter() - began
        print(f"  compiling a schema {compile_s * 1e3:.2f} ms; a request's first token {first * 1e3:.1f} ms")

    if "memory" not in skip:
        from meshlm import planner

        six_b = meshlm.preset("gptj-6b")
        engine, kw = EngineConfig(max_batch=8, max_len=2048), dict(search=False, capacity=80 * 2**30)
        base = planner.plan_serve(six_b, "cpu", engine, **kw)
        slots = planner.plan_serve(six_b, "cpu", engine.replace(max_adapters=8, max_lora_rank=args.rank), **kw)
        extra = slots.config.adapters
        print(f"memory (GPT-J-6B, bf16, 8 rows x 2048): weights {base.config.weights / 2**30:.2f} GiB; 8 adapter "
              f"slots of rank {args.rank} {extra / 2**20:.0f} MiB ({extra / base.config.weights:.2%} of the weights); "
              f"compiled total {base.config.total / 2**30:.2f} -> {slots.config.total / 2**30:.2f} GiB")  # fmt: skip


if __name__ == "__main__":
    main()
