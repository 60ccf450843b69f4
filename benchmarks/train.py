"""Training throughput: meshlm's jitted AdamW step vs a transformers model + torch AdamW step.

Same config, batch, sequence length, optimizer settings and fp32 on this machine, measured in one run;
MFU is against the best square-matmul FLOP/s (JAX or torch) measured in the same run. `--arch` trains
GPT-J, GPT-NeoX/Pythia or GPT-Neo at the preset's sizes (the peer: that architecture's transformers class).
The two sides' steps are taken in turn after two warm-up steps each (the first compiles), and each side's
fastest step counts: other work on a shared machine then slows both alike. The load average is printed
before and after.

    python benchmarks/train.py [--arch gptj|neox|neo] [--preset gptj-tiny] [--batch 4] [--seq 128] [--steps 5]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from family import ARCHS, shaped_as, torch_model  # benchmarks/family.py, beside this script
from timing import best_times, load_average  # benchmarks/timing.py, beside this script

from meshlm import config, metrics, model, optim, train_step
from meshlm.data import default_weights
from meshlm.sharding import make_mesh


def token_batch(tokens: np.ndarray) -> dict[str, np.ndarray]:
    """The step's batch for rows cut from one stream, [micro_batches, rows, seq_len + 1]: every token a
    target but column 0, one document per row."""
    tokens = np.asarray(tokens, np.int32)
    return {"tokens": tokens, "weights": default_weights(tokens).astype(np.float32), "segments": np.ones_like(tokens)}


def meshlm_step(cfg: config.ModelConfig, tokens: np.ndarray) -> callable:
    tcfg = config.TrainConfig(model=cfg, batch_size=len(tokens), warmup_steps=0, anneal_steps=10)
    mesh = make_mesh(None)
    opt = optim.make_optimizer(tcfg, cfg)
    shardings = train_step.state_shardings(cfg, opt, mesh)
    step_fn = train_step.make_train_step(tcfg, cfg, opt, shardings)
    params = jax.jit(lambda k: model.init(cfg, k), out_shardings=shardings.params)(jax.random.key(0))
    opt_state = jax.jit(opt.init, out_shardings=shardings.opt_state)(params)
    # the state on its shardings, as the step returns it: unplaced counters would compile the step twice
    state = train_step.TrainState(jax.device_put(jnp.int32(0), shardings.step), params, opt_state)
    batch = token_batch(tokens[None])

    def step() -> None:
        nonlocal state
        state, metrics = step_fn(state, batch)
        metrics["loss"].block_until_ready()

    return step


def torch_step(cfg: config.ModelConfig, tokens: np.ndarray) -> callable:
    m = torch_model(cfg).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    inputs = torch.as_tensor(tokens[:, :-1], dtype=torch.long)
    labels = torch.as_tensor(tokens[:, 1:], dtype=torch.long)

    def step() -> None:
        logits = m(inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def torch_matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    a = torch.ones(n, n)
    a @ a
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="gptj", choices=sorted(ARCHS))
    parser.add_argument("--preset", default="gptj-tiny", help="the sizes (any architecture's preset)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    cfg = shaped_as(args.arch, config.preset(args.preset))
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab_used, (args.batch, args.seq + 1)).astype(np.int32)
    n_tokens = args.batch * args.seq
    flops = metrics.flops_per_token(cfg, args.seq) * n_tokens
    print(
        f"config {args.arch} at {args.preset}'s sizes: {model.count_params(cfg):,} params, "
        f"batch {args.batch} x seq {args.seq}, fp32, torch threads {torch.get_num_threads()}, "
        f"{jax.devices()[0].platform}; load average {load_average()}"
    )

    peak = max(metrics.measure_matmul_peak(), torch_matmul_peak())
    steps = {"meshlm": meshlm_step(cfg, tokens), "torch": torch_step(cfg, tokens)}
    for step in steps.values():  # the first warm-up step: best_times runs the second
        step()
    best = best_times(steps, args.steps)
    t_meshlm, t_torch = best["meshlm"], best["torch"]
    print(f"matmul peak (best of JAX, torch): {peak / 1e9:.1f} GFLOP/s")
    for name, t in (("meshlm", t_meshlm), ("torch", t_torch)):
        print(f"{name:>7}: {t * 1e3:8.1f} ms/step  {n_tokens / t:9,.0f} tokens/s  MFU {flops / t / peak:.1%}")
    print(f"meshlm / torch throughput: {t_torch / t_meshlm:.2f}x (fastest of {args.steps} steps each)")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
