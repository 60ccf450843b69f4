"""One process of a multi-process test job (started by tests/test_multihost.py through `meshlm launch`).

    python -m tests.multihost_worker OUT_DIR TASK[=ARG] ...

Tasks, run in order: "grads" (loss and gradients of a tiny GPT-J on mesh data=2,fsdp=2,model=2, each
process feeding only its own rows of the global batch), "train=DATASET" (a few optimizer steps of
`meshlm.train` on that mesh), "save=CKPT" and "restore=CKPT" (write / read a meshlm checkpoint and
record its logits). Process 0 writes results into OUT_DIR.
"""

import sys

import jax
import numpy as np

import meshlm
from meshlm import distributed, model, sharding, train
from meshlm.config import TrainConfig

CFG = meshlm.preset("test-tiny")
MESH = "data=2,fsdp=2,model=2"
TOKENS = np.random.default_rng(0).integers(0, CFG.n_vocab_used, (8, 17))


def grads(out_dir: str) -> None:
    lm = meshlm.from_config(CFG, mesh=MESH, seed=1)
    batch = sharding.named_sharding(lm.mesh, ("batch", "seq"))
    rows = TOKENS.shape[0] // jax.process_count()
    mine = TOKENS[jax.process_index() * rows : (jax.process_index() + 1) * rows]
    tokens = jax.make_array_from_process_local_data(batch, mine, TOKENS.shape)
    with jax.set_mesh(lm.mesh):
        loss, g = jax.jit(jax.value_and_grad(lambda p, t: model.loss(p, t, CFG)[0]))(lm.params, tokens)
    flat = {jax.tree_util.keystr(k): sharding.to_host(v) for k, v in jax.tree_util.tree_flatten_with_path(g)[0]}
    if distributed.is_main_process():
        np.savez(f"{out_dir}/grads.npz", loss=sharding.to_host(loss), **flat)


def train_steps(out_dir: str, dataset: str) -> None:
    # eps=1 makes each Adam update ~ lr * gradient, so parameters compare at fp32 tolerance (with eps=1e-8 an
    # early update is ~ lr * sign(g), and rounding can flip the sign of a 1e-9 gradient).
    cfg = TrainConfig(
        model=CFG, data=dataset, out_dir=f"{out_dir}/run", mesh=MESH, batch_size=8, total_steps=4, lr=1.0,
        end_lr=1.0, eps=1.0, warmup_steps=0, anneal_steps=10, val_every=0, ckpt_every=0, log_every=1000,
        sample_tokens=0,
    )  # fmt: skip
    result = train.train(cfg, progress=False, sample=False)
    assert result.lm is not None
    flat = {
        jax.tree_util.keystr(k): sharding.to_host(v)
        for k, v in jax.tree_util.tree_flatten_with_path(result.lm.params)[0]
    }
    if distributed.is_main_process():
        np.savez(f"{out_dir}/trained.npz", losses=np.array([result.losses[s] for s in sorted(result.losses)]), **flat)


def save(out_dir: str, ckpt: str) -> None:
    lm = meshlm.from_config(CFG, mesh=MESH, seed=2 + jax.process_count())
    lm.save(ckpt)
    logits = lm.logits(TOKENS)
    if distributed.is_main_process():
        np.save(f"{out_dir}/saved_logits.npy", logits)


def restore(out_dir: str, ckpt: str) -> None:
    logits = meshlm.load(ckpt, mesh=MESH).logits(TOKENS)
    if distributed.is_main_process():
        np.save(f"{out_dir}/restored_logits.npy", logits)


if __name__ == "__main__":
    distributed.initialize(heartbeat_timeout_s=10)
    out_dir, *tasks = sys.argv[1:]
    for task in tasks:
        name, *arg = task.split("=", 1)
        {"grads": grads, "train": train_steps, "save": save, "restore": restore}[name](out_dir, *arg)
