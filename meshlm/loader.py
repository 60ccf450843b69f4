"""Deterministic, resumable batches over a prepared dataset, each process reading only its own rows.

Every epoch visits the examples in a fresh permutation drawn from (seed, epoch); a step takes the next
`batch_size` examples of it (a partial batch at the end of an epoch is skipped, so every step has the
same shape). The whole position is two integers, (epoch, position), saved in every checkpoint: a
resumed run continues with exactly the batches the uninterrupted run would have seen.

An example is one row of kind "lm" data, and a (chosen, rejected) pair of rows of "preference" data:
`batch_size` counts examples, and a pair stays together, chosen then rejected, so a batch's rows are
[chosen_0, rejected_0, chosen_1, rejected_1, ...]. A step's batch is laid out [micro_batches,
rows_per_process, seq_len + 1]. Process p of P holds the p-th contiguous block of the examples of every
micro-batch, which is the block its devices own when the batch dimension is sharded over the mesh.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from meshlm.config import DataError, InputError
from meshlm.data import Batch, TokenDataset


@dataclass
class LoaderState:
    epoch: int = 0
    position: int = 0  # examples of this epoch's permutation already consumed

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    @classmethod
    def from_dict(cls, values: dict[str, int]) -> LoaderState:
        return cls(int(values["epoch"]), int(values["position"]))


class TrainLoader:
    """Shuffled training batches: `next(loader)` -> a Batch of [micro_batches, rows_per_process, seq_len + 1]
    (rows [micro_batches, rows_per_process])."""

    def __init__(
        self,
        dataset: TokenDataset,
        batch_size: int,
        micro_batches: int = 1,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        state: LoaderState | None = None,
    ):
        if batch_size % micro_batches:
            raise DataError(f"batch_size ({batch_size}) must be a multiple of micro_batches ({micro_batches})")
        micro = batch_size // micro_batches
        if micro % process_count:
            raise DataError(f"micro-batch of {micro} examples cannot be split evenly over {process_count} processes")
        if len(dataset) < batch_size:
            what = "pairs" if dataset.kind == "preference" else "sequences"
            raise DataError(
                f"{dataset.folder}: split {dataset.split!r} holds {len(dataset)} {what}, fewer than one batch "
                f"({batch_size}); use a smaller batch_size or more data"
            )
        if not 0 <= process_index < process_count:
            raise InputError(f"process_index {process_index} is not in [0, {process_count})")
        self.dataset = dataset
        self.batch_size = batch_size
        self.micro_batches = micro_batches
        self.seed = seed
        self.process_index = process_index
        self.process_count = process_count
        self.state = state or LoaderState()
        self._perm_epoch = -1
        self._perm = np.empty(0, np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
            self._perm_epoch = epoch
        return self._perm

    def examples_of_next_batch(self) -> np.ndarray:
        """Global example ids of the next step [micro_batches, micro_batch_size]; advances the state."""
        if self.state.position + self.batch_size > len(self.dataset):
            self.state = LoaderState(self.state.epoch + 1, 0)
        start = self.state.position
        examples = self._permutation(self.state.epoch)[start : start + self.batch_size]
        self.state = LoaderState(self.state.epoch, start + self.batch_size)
        return examples.reshape(self.micro_batches, -1)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        examples = self.examples_of_next_batch()
        per = examples.shape[1] // self.process_count
        mine = self.dataset.example_rows(examples[:, self.process_index * per : (self.process_index + 1) * per])
        batch = self.dataset[mine.reshape(-1)]
        return Batch(*(a.reshape(*mine.shape, *a.shape[1:]) for a in batch))


def eval_batches(
    dataset: TokenDataset, batch_size: int, max_batches: int, process_index: int = 0, process_count: int = 1
) -> Iterator[tuple[Batch, np.ndarray]]:
    """Validation examples in order: (a Batch of [rows_per_process, seq_len + 1], example weights
    [rows_per_process]); `batch_size` counts examples, and a pair's two rows share its weight.

    The last batch is padded with weight-0 copies of example 0 so every batch has the same shape.
    """
    per = batch_size // process_count
    n = min(len(dataset), batch_size * max_batches)
    for start in range(0, n, batch_size):
        examples = np.arange(start, start + batch_size)[process_index * per : (process_index + 1) * per]
        weights = (examples < n).astype(np.float32)
        examples = np.where(examples < n, examples, 0)
        yield dataset[dataset.example_rows(examples)], np.repeat(weights, dataset.rows_per_example)
