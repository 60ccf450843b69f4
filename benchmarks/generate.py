"""Generation speed: meshlm (KV cache, compiled decode loop) vs transformers' `generate`, same weights and prompts.

    python benchmarks/generate.py [--d-model 256 --layers 4 --heads 4 --prompt 64 --new 128 --batches 1 16]

Both decode greedily in float32 on this machine's CPU, one after the other in the same process.
Time to first token is a generation of one new token (prefill plus the first choice); decode speed
is the extra new tokens per second of a `--new`-token generation beyond that first one; end to end
is all new tokens over the whole `--new`-token generation.

With `--profile`, what bounds a meshlm decode step at each batch: the device time of one paged decode step
through the layers alone (final hidden states), with the LM head, and with the head and the sampler's
`choose`, against the step time the engine achieved; the rest is the engine's host work per step.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from timing import best_time  # benchmarks/timing.py, beside this script
from transformers import GPTJConfig, GPTJForCausalLM

import meshlm
from meshlm import kv_cache, model
from meshlm.serve import sampler
from meshlm.serve.batch import settings_for
from meshlm.serve.params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50400)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--new", type=int, default=128, help="new tokens per row")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="split a meshlm decode step into its parts")
    args = ap.parse_args()

    hf_config = GPTJConfig(
        n_embd=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
        rotary_dim=min(64, args.d_model // args.heads),
        vocab_size=args.vocab,
        n_positions=2048,
        bos_token_id=50256,
        eos_token_id=50256,
    )
    torch_model = GPTJForCausalLM(hf_config).eval()
    with tempfile.TemporaryDirectory() as folder:
        torch_model.save_pretrained(folder)
        lm = meshlm.load(folder)
    print(
        f"config: d_model {args.d_model}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, "
        f"prompt {args.prompt}, {args.new} new tokens, greedy, float32, torch threads {torch.get_num_threads()}"
    )

    rng = np.random.default_rng(0)
    for batch in args.batches:
        prompts = rng.integers(0, 50257, (batch, args.prompt))
        rows = {
            "meshlm": measure(lambda new, p=prompts: run_meshlm(lm, p, new), batch, args),
            "transformers": measure(lambda new, p=prompts: run_torch(torch_model, p, new), batch, args),
        }
        print(f"\nbatch {batch}")
        for name, (first, rate, total) in rows.items():
            print(
                f"  {name:<13} time to first token {first * 1e3:8.1f} ms   decode {rate:7.0f} tokens/s   "
                f"end to end {total:7.0f} tokens/s"
            )
        (m_first, m_rate, m_total), (t_first, t_rate, t_total) = rows["meshlm"], rows["transformers"]
        print(
            f"  ratio meshlm / transformers: decode {m_rate / t_rate:.2f}x, first token {t_first / m_first:.2f}x, "
            f"end to end {m_total / t_total:.2f}x"
        )
        if args.profile:
            profile(lm, batch, args.prompt + args.new // 2, batch / m_rate, args.repeats)


def profile(lm: meshlm.LanguageModel, batch: int, cached: int, engine_step: float, repeats: int) -> None:
    """Device milliseconds of one decode step of `batch` rows with `cached` tokens each, in parts."""
    cfg, policy, page = lm.config, lm.policy, 16
    pages = -(-(cached + 1) // page)
    cache = kv_cache.init_cache(cfg, batch * pages + 1, page, policy.compute_dtype)
    table = jnp.arange(1, batch * pages + 1, dtype=jnp.int32).reshape(batch, pages)
    tokens, length = jnp.zeros((batch, 1), jnp.int32), jnp.full(batch, cached, jnp.int32)
    greedy = SamplingParams(temperature=0.0, logprobs=0)  # as run_meshlm's rows
    settings = jax.tree.map(jnp.asarray, settings_for([greedy] * batch, batch))
    seen, count = jnp.zeros((batch, cfg.vocab_size), bool), jnp.zeros(batch, jnp.int32)

    def step(p, c, hidden: bool, sample: bool):
        out = model.decode(p, tokens, c, table, length, cfg, policy, hidden=hidden)[0][:, 0]
        return sampler.choose(out, seen, count, settings, cfg.n_vocab_used) if sample else out  # all outputs

    parts = {}
    for name, hidden, sample in (("layers", True, False), ("+ head", False, False), ("+ choose", False, True)):
        f = jax.jit(lambda p, c, h=hidden, s=sample: step(p, c, h, s))
        parts[name] = best_time(lambda f=f: jax.block_until_ready(f(lm.params, cache)), repeats * 4)
    head_bytes = sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(lm.params["head"]))
    print(f"  profile, batch {batch} ({cached} tokens cached): layers {parts['layers'] * 1e3:.2f} ms, "
          f"LM head {(parts['+ head'] - parts['layers']) * 1e3:.2f} ms (reads {head_bytes / 1e6:.1f} MB), "
          f"choose {(parts['+ choose'] - parts['+ head']) * 1e3:.2f} ms; device step {parts['+ choose'] * 1e3:.2f} ms "
          f"of the engine's {engine_step * 1e3:.2f} ms per step")  # fmt: skip


def run_meshlm(lm: meshlm.LanguageModel, prompts: np.ndarray, new: int) -> None:
    # the chosen tokens' logprobs but no top alternatives: transformers' generate computes neither
    lm.generate_tokens(prompts, SamplingParams(max_new_tokens=new, temperature=0.0, logprobs=0))


def run_torch(torch_model: GPTJForCausalLM, prompts: np.ndarray, new: int) -> None:
    tokens = torch.as_tensor(prompts)
    with torch.inference_mode():
        torch_model.generate(
            tokens,
            attention_mask=torch.ones_like(tokens),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=50256,
        )


def measure(run: Callable[[int], None], batch: int, args: argparse.Namespace) -> tuple[float, float, float]:
    """(time to first token in seconds, decode tokens/s, end-to-end tokens/s), over the batch."""
    first = best_time(lambda: run(1), args.repeats)
    whole = best_time(lambda: run(args.new), args.repeats)
    return first, batch * (args.new - 1) / (whole - first), batch * args.new / whole


if __name__ == "__main__":
    main()
