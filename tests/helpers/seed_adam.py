"""The seed's AdamW in numpy, and the optimizer state a meshlm run saved: the oracle of resumed seed runs."""

from pathlib import Path

import jax
import numpy as np

import meshlm
from meshlm import optim, train_step
from meshlm.config import TrainConfig
from meshlm.formats import native
from meshlm.sharding import make_mesh

# The schedule is mid-anneal at the seed's Adam count (1227), so count and step (1234) give different rates.
# eps 1 keeps each update smooth in the gradient (as `smooth` in tests/helpers/training.py): with 1e-8, where a second
# moment is near 0 the update follows 1 / |g| and the mesh's summation order shows at fp32.
LR, END_LR, ANNEAL, WD, EPS = 1e-2, 1e-3, 2000, 0.1, 1.0


def lr_at(count: int) -> float:
    return END_LR + (LR - END_LR) * (1 + np.cos(np.pi * count / ANNEAL)) / 2  # no warmup, mid-anneal


def adamw_step(params, grads, mu, nu, count: int, mask):
    """One step of the seed's optimizer in numpy (float64): clip to global norm 1, Adam, decay on matrices."""
    norm = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in jax.tree.leaves(grads)))
    g = jax.tree.map(lambda x: x.astype(np.float64) * min(1.0, 1.0 / norm), grads)
    mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, mu, g)
    nu = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g**2, nu, g)
    c = count + 1

    def update(p, m, v, decay):
        return p - lr_at(count) * ((m / (1 - 0.9**c)) / (np.sqrt(v / (1 - 0.999**c)) + EPS) + (WD * p if decay else 0))

    return jax.tree.map(update, params, mu, nu, mask), mu, nu


def saved_opt_state(run: Path, step: int, cfg: TrainConfig):
    model_cfg = meshlm.load(run).config
    opt = optim.make_optimizer(cfg, model_cfg)
    params_target, opt_target = train_step.abstract_state(
        train_step.state_shardings(model_cfg, opt, make_mesh(None)), model_cfg, opt
    )
    ckpts = native.TrainCheckpoints(run / "checkpoints")
    try:
        return ckpts.restore(step, params_target, opt_target)[1]
    finally:
        ckpts.close()
