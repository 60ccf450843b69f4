"""A tiny preference dataset and the DPO run config that trains on it."""

import json
from pathlib import Path

import numpy as np

from meshlm import data
from meshlm.config import ModelConfig, TrainConfig

SEQ = 16

CFG = ModelConfig(
    n_layer=2, d_model=64, n_head=4, d_ff=128, rotary_dim=8, vocab_size=256, n_vocab_used=256, max_seq_len=32
)


TRL_DPO_METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                   "logps/rejected"]  # fmt: skip


def preference_rows(pairs: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs of rows [prompt | completion | padding]: a chosen completion counts up from the prompt's last
    token, a rejected one repeats it; the two have different lengths."""
    rng = np.random.default_rng(seed)
    shape = (2 * pairs, SEQ + 1)
    tokens, weights, segments = np.zeros(shape, np.int32), np.zeros(shape, np.uint8), np.zeros(shape, np.int32)
    for j in range(pairs):
        prompt = list(rng.integers(10, 200, 4))
        for row, completion in ((2 * j, [prompt[-1] + i + 1 for i in range(6)]), (2 * j + 1, [prompt[-1]] * 4)):
            sequence = prompt + completion
            tokens[row, : len(sequence)] = sequence
            weights[row, len(prompt) : len(sequence)] = 1
            segments[row, : len(sequence)] = 1
    return tokens, weights, segments


def write_preferences(folder: Path, pairs: int = 16, seed: int = 0) -> Path:
    splits = {"train": data.write_split(folder, "train", [preference_rows(pairs, seed)], SEQ),
              "val": data.write_split(folder, "val", [preference_rows(4, seed + 100)], SEQ)}  # fmt: skip
    data.write_index(folder, SEQ, splits, eos_id=0, kind="preference")
    return folder


def run_config(folder: Path, out_dir: Path, **changes) -> TrainConfig:
    base = dict(
        model=CFG, data=folder and str(folder), out_dir=str(out_dir), batch_size=4, micro_batches=2, total_steps=6,
        lr=3e-3, end_lr=3e-3, warmup_steps=0, anneal_steps=10, weight_decay=0.0, val_every=0, ckpt_every=0,
        log_every=1000, sample_tokens=0, objective="dpo", dpo={"beta": 0.5},
    )  # fmt: skip
    return TrainConfig(**{**base, **changes})


def logged(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
