"""LoRA training throughput: meshlm's jitted adapter-only AdamW step vs peft + transformers + torch AdamW.

Same GPT-J shape, batch, sequence length, LoRA targets, rank and alpha, fp32 on this machine, measured
in one run. The peer is `peft.get_peft_model(GPTJForCausalLM(config), LoraConfig(...))` with
`torch.optim.AdamW` over the trainable parameters only: forward, loss, backward, clipping, step. Both
clip the global norm at 1.0 and decay the adapter's matrices by 0.1, as meshlm's recipe does.
`--base-dtype` lists how meshlm stores the frozen base: float32 is the like-for-like comparison;
bfloat16, int8 and nf4 (QLoRA-style, dequantized per layer inside the step) are meshlm-only figures,
each printed against the same fp32 peft step (bitsandbytes' 4-bit training on CPU is not the peer).

    python benchmarks/lora.py [--preset gptj-tiny] [--batch 8] [--seq 256] [--rank 16]
        [--base-dtype float32 int8 nf4] [--steps 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import peft
import torch
from family import torch_model  # benchmarks/family.py and timing.py, beside this script
from timing import best_time

from meshlm import api, config, model, optim, train_step
from meshlm.config import TRAINABLE_QUANTIZED
from meshlm.data import default_weights
from meshlm.lora import adapter_size, init_adapter
from meshlm.sharding import make_mesh

HF_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "out": "out_proj", "fc_in": "fc_in", "fc_out": "fc_out"}


def token_batch(tokens: np.ndarray) -> dict[str, np.ndarray]:
    """The step's batch for rows cut from one stream, [micro_batches, rows, seq_len + 1]: every token a
    target but column 0, one document per row."""
    tokens = np.asarray(tokens, np.int32)
    return {"tokens": tokens, "weights": default_weights(tokens).astype(np.float32), "segments": np.ones_like(tokens)}


def meshlm_step(
    cfg: config.ModelConfig, lora: config.LoraConfig, base_dtype: str, tokens: np.ndarray
) -> tuple[Callable[[], None], int]:
    """One LoRA optimizer step over the whole batch as `meshlm train` runs it, and the trainable count."""
    quantize = base_dtype if base_dtype in TRAINABLE_QUANTIZED else None
    tcfg = config.TrainConfig(
        model=cfg, batch_size=len(tokens), lora=lora, base_dtype=base_dtype, warmup_steps=0, anneal_steps=10
    )
    mesh = make_mesh(None)
    # a quantized base keeps its other weights in the compute dtype, as run_start.load_base builds it
    base = api.from_config(cfg, mesh, "float32" if quantize else base_dtype, seed=0, quantize=quantize).params
    opt = optim.make_optimizer(tcfg, cfg)
    shardings = train_step.state_shardings(cfg, opt, mesh, lora)
    step_fn = train_step.make_train_step(tcfg, cfg, opt, shardings, jax.tree.map(lambda x: x.sharding, base))
    init = jax.jit(lambda k: init_adapter(model.projections(cfg), lora, k, "float32"), out_shardings=shardings.params)
    adapter = init(jax.random.key(1))
    opt_state = jax.jit(opt.init, out_shardings=shardings.opt_state)(adapter)
    # the counter on its sharding, as the step returns it: an unplaced one would compile the step twice
    state = train_step.TrainState(jax.device_put(jnp.int32(0), shardings.step), adapter, opt_state)
    batch = token_batch(tokens[None])

    def step() -> None:
        nonlocal state
        with jax.set_mesh(mesh):
            state, metrics = step_fn(state, batch, base)
        metrics["loss"].block_until_ready()

    return step, adapter_size(model.projections(cfg), lora)


def peft_step(cfg: config.ModelConfig, lora: config.LoraConfig, tokens: np.ndarray) -> tuple[Callable[[], None], int]:
    """The same step in peft: a LoRA-wrapped GPTJForCausalLM and AdamW over its trainable parameters."""
    peft_cfg = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=[HF_NAMES[t] for t in lora.targets],
        use_rslora=lora.rslora,
        bias="none",
    )
    m = peft.get_peft_model(torch_model(cfg), peft_cfg).train()
    trainable = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    inputs = torch.as_tensor(tokens[:, :-1], dtype=torch.long)
    labels = torch.as_tensor(tokens[:, 1:], dtype=torch.long)

    def step() -> None:
        logits = m(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in trainable)


def seconds_per_step(step: Callable[[], None], steps: int, repeats: int) -> float:
    """Best of `repeats` timed runs of `steps` steps each, after one warm-up run (which compiles)."""

    def run() -> None:
        for _ in range(steps):
            step()

    return best_time(run, repeats) / steps


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gptj-tiny", help="GPT-J sizes (train.py's GPT-J row)")
    parser.add_argument("--d-model", type=int, help="override the preset's d_model (d_ff 4x; heads keep their count)")
    parser.add_argument("--layers", type=int, help="override the preset's n_layer")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--targets", nargs="+", default=["q", "k", "v", "out"], choices=list(HF_NAMES))
    parser.add_argument(
        "--base-dtype",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16", *TRAINABLE_QUANTIZED],
        help="meshlm's frozen base storage, one run each (the peft peer is always fp32)",
    )
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side; the best counts")
    args = parser.parse_args()

    cfg = config.preset(args.preset)
    if args.d_model:
        cfg = cfg.replace(d_model=args.d_model, d_ff=4 * args.d_model)
    cfg = cfg.replace(n_layer=args.layers or cfg.n_layer, max_seq_len=max(cfg.max_seq_len, args.seq))
    lora = config.LoraConfig(rank=args.rank, alpha=args.alpha, targets=tuple(args.targets))
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab_used, (args.batch, args.seq + 1)).astype(np.int32)
    n_tokens = args.batch * args.seq
    print(
        f"GPT-J {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, d_ff {cfg.d_ff}, vocab "
        f"{cfg.vocab_size}: {model.count_params(cfg):,} params; LoRA rank {lora.rank} alpha {lora.alpha:g} on "
        f"{', '.join(lora.targets)}; batch {args.batch} x seq {args.seq}; fp32 compute; torch threads "
        f"{torch.get_num_threads()}; {jax.devices()[0].platform}"
    )
    print(f"load average before: {load()}")
    peft_fn, peft_trainable = peft_step(cfg, lora, tokens)
    t_peft = seconds_per_step(peft_fn, args.steps, args.repeats)
    rows = []
    for base_dtype in args.base_dtype:
        fn, trainable = meshlm_step(cfg, lora, base_dtype, tokens)
        rows.append((f"meshlm, base {base_dtype}", trainable, seconds_per_step(fn, args.steps, args.repeats)))
        del fn  # frees this base before the next one is built
    print(f"load average after: {load()}")
    print(f"{'':<24} {'trainable':>10} {'ms/step':>9} {'tokens/s':>9} {'vs peft':>8}")
    print(f"{'peft (fp32 base)':<24} {peft_trainable:>10,} {t_peft * 1e3:>9.1f} {n_tokens / t_peft:>9,.0f}")
    for name, trainable, t in rows:
        print(f"{name:<24} {trainable:>10,} {t * 1e3:>9.1f} {n_tokens / t:>9,.0f} {t_peft / t:>7.2f}x")


if __name__ == "__main__":
    main()
