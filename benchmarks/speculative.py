"""Speculative decoding with a draft that knows the target: acceptance and speed-up against plain decoding.

    PYTHONPATH=. python benchmarks/speculative.py [TARGET --draft DRAFT] [--speculate 3 --new-tokens 128]
                                                  [--batches 1,4 --temperatures 0,0.8 --repeats 3]

Without TARGET, a target and a draft that knows it are trained (`meshlm train`, GPT-2 vocabulary) and cached
under benchmarks/.cache/speculative/ for later runs:

- target: GPT-J, 4 layers, d_model 256, 200 steps on the built-in demo corpus (about 10 minutes on 2 CPU cores);
- draft: GPT-J, 1 layer, d_model 64, distilled: 300 steps on 1,024 passages the target wrote at
  temperature 1 from the corpus's openings (sequence-level distillation; about 5 minutes). A draft trained
  on the corpus alone for 200 steps kept 12% of its proposals at batch 1, greedy: it learns the corpus, not
  the target's habits.

With TARGET and no `--draft`, the target is its own draft (every proposal kept, at the target's cost: the
engine's overhead at full acceptance). Prompts are 32-token passages of the demo corpus, one per row. For
each batch size and temperature, best tokens/s of `--repeats` runs (compiling excluded) of:

1. plain decoding (chunks of 16 steps per device call), and prompt lookup (`ngram=3`) for reference;
2. the draft proposing `--speculate` tokens per step, with the share of proposals the target kept;
3. the bound: one forward pass over k + 1 tokens (a verification) against one over 1 token (a plain step),
   and the speed-up a free draft that is always right would give, (k + 1) / that ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import meshlm
from meshlm import kv_cache, model
from meshlm.demo_corpus import documents, gpt2_tokenizer
from meshlm.serve.params import SamplingParams

CACHE = Path(__file__).parent / ".cache" / "speculative"
DRAFT_STEPS = ["total_steps=300", "anneal_steps=280"]
PAIR = {  # what each model overrides of the demo run (configs/demo-tiny.yaml)
    "target": ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.d_ff=1024"],
    "draft": ["model.n_layer=1", "model.d_model=64", "model.n_head=2", "model.d_ff=256", *DRAFT_STEPS],
}
DISTILLED = 1024  # passages the target writes for the draft to learn from
PASSAGE = 128  # tokens of each, after a 16-token opening


def meshlm_command(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "meshlm", *args], check=True)


def trained(name: str, *more: str) -> Path:
    """The run folder of one model of the pair (`more`: further overrides). `meshlm train` resumes a run
    folder: a finished run only loads, an interrupted one goes on."""
    folder = CACHE / name
    print(f"the {name} ({' '.join(PAIR[name] + list(more))}) in {folder}", flush=True)
    sets = [arg for kv in PAIR[name] + list(more) + ["sample_tokens=0"] for arg in ("--set", kv)]
    meshlm_command("train", *sets, "--out-dir", str(folder), "--no-progress")
    return folder


def distilled(target: Path) -> Path:
    """A prepared dataset of passages the target wrote at temperature 1 after openings of the demo corpus."""
    folder = CACHE / "distilled"
    if not (folder / "index.json").exists():
        lm = meshlm.load(target)
        print(f"the target writes {DISTILLED} passages of {PASSAGE} tokens for the draft", flush=True)
        openings = [ids[:16] for ids in corpus_tokens(lm) if len(ids) >= 16]
        openings = [openings[i * len(openings) // DISTILLED] for i in range(DISTILLED)]
        params = [SamplingParams(max_new_tokens=PASSAGE, temperature=1.0, seed=i) for i in range(DISTILLED)]
        done = lm.generate_tokens(openings, params)
        texts = CACHE / "distilled.jsonl"
        with open(texts, "w") as f:
            for opening, d in zip(openings, done, strict=True):
                f.write(json.dumps({"text": lm.tokenizer.decode(opening + list(d.tokens))}) + "\n")
        meshlm_command("prepare", str(texts), "--out", str(folder), "--seq-len", "128")
    return folder


def corpus_tokens(lm) -> list[list[int]]:
    """The demo corpus's documents, tokenized."""
    tokenizer = lm.tokenizer or gpt2_tokenizer()
    return [tokenizer.encode(d) for d in documents()]


def prompts(docs: list[list[int]], rows: int, length: int = 32) -> list[list[int]]:
    """`rows` passages of `length` tokens from tokenized documents `docs`, one per document."""
    long = [ids for ids in docs if len(ids) >= 4 * length]
    return [long[i * len(long) // rows][length : 2 * length] for i in range(rows)]


def decode_speed(lm, rows: list[list[int]], new_tokens: int, temperature: float, repeats: int, **options):
    """Best tokens/s over all rows, and the share of proposals kept."""
    engine = lm.engine(max_batch=len(rows), max_len=max(map(len, rows)) + new_tokens + 64, **options)
    engine.warm_up()
    params = [SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=i, stop_token_ids=())
              for i in range(len(rows))]  # fmt: skip
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        done = engine.generate(rows, params, chunk=16)
        best = max(best, sum(len(d.tokens) for d in done) / (time.perf_counter() - t0))
    stats = engine.snapshot()
    return best, stats.accepted / max(stats.proposed, 1)


def forward_ms(lm, tokens: int, repeats: int = 50) -> float:
    """Milliseconds of one paged forward pass over `tokens` new tokens of one row, 128 cached."""
    cfg = lm.config
    cache = kv_cache.init_cache(cfg, 16, 16, lm.policy.compute_dtype)
    step = jax.jit(lambda p, c, t, table, n: model.decode(p, t, c, table, n, cfg, lm.policy)[0])
    args = (jnp.zeros((1, tokens), jnp.int32), jnp.arange(1, 16, dtype=jnp.int32)[None], jnp.full(1, 128, jnp.int32))
    jax.block_until_ready(step(lm.params, cache, *args))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = step(lm.params, cache, *args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / repeats * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", nargs="?", default=None, help="the target's checkpoint (default: the trained pair)")
    ap.add_argument("--draft", default=None, help="the draft's checkpoint (default: the trained pair's draft)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--speculate", type=int, default=3, help="tokens proposed per step (k)")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    target = args.target or trained("target")
    draft_path = args.draft or (None if args.target else trained("draft", f"data={distilled(target)}"))
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs", flush=True)
    lm = meshlm.load(target)
    draft = meshlm.load(draft_path, mesh=lm.mesh) if draft_path else lm
    print(f"target: {lm}; draft: {'the target itself' if draft is lm else draft}")
    print(f"{args.new_tokens} new tokens per row, k = {args.speculate}, best of {args.repeats}:")
    docs = corpus_tokens(lm)
    for batch in map(int, args.batches.split(",")):
        rows = prompts(docs, batch)
        for temperature in map(float, args.temperatures.split(",")):
            run = lambda **o: decode_speed(lm, rows, args.new_tokens, temperature, args.repeats, **o)  # noqa: B023
            plain, _ = run()
            ngram, ngram_kept = run(ngram=3, speculate=args.speculate)
            drafted, kept = run(draft=draft, speculate=args.speculate)
            print(f"  batch {batch}, temperature {temperature}: plain {plain:7.1f} tokens/s; "
                  f"draft {drafted:7.1f} ({drafted / plain:.2f}x, {kept:.0%} of proposals kept); "
                  f"prompt lookup {ngram:7.1f} ({ngram / plain:.2f}x, {ngram_kept:.0%} kept)", flush=True)  # fmt: skip
    one, verify = forward_ms(lm, 1), forward_ms(lm, args.speculate + 1)
    ratio, k = verify / one, args.speculate
    draft_one = forward_ms(draft, 1)
    print(f"a target pass over {k + 1} tokens takes {verify:.2f} ms, over 1 token {one:.2f} ms ({ratio:.2f}x), "
          f"a draft step {draft_one:.2f} ms; a free draft always right would give {(k + 1) / ratio:.2f}x")  # fmt: skip
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
