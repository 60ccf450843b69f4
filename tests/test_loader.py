"""The loader: deterministic shuffles, exact resume, per-process slices, ordered validation."""

import numpy as np
import pytest

from meshlm import data
from meshlm.config import ConfigError
from meshlm.loader import LoaderState, TrainLoader, eval_batches


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loader_data")
    rows = np.arange(22 * 5).reshape(22, 5) % 50000  # row r starts with token 5r: rows are recognisable
    data.write_index(folder, 4, {"train": data.write_split(folder, "train", [rows[:10], rows[10:]], 4)})
    return data.TokenDataset(folder)


def row_ids(batch):
    return (batch.tokens[..., 0] // 5).tolist()


def test_each_epoch_is_a_seeded_permutation_without_repeats(dataset):
    loader = TrainLoader(dataset, batch_size=4, micro_batches=2, seed=7)
    epoch0 = [row_ids(next(loader)) for _ in range(5)]  # 22 rows: 5 full batches, 2 rows skipped
    flat = np.ravel(epoch0)
    assert len(set(flat)) == 20 and flat.max() < 22
    assert np.shape(epoch0) == (5, 2, 2)
    assert loader.state == LoaderState(0, 20)
    next(loader)
    assert loader.state == LoaderState(1, 4)
    again = TrainLoader(dataset, batch_size=4, micro_batches=2, seed=7)
    assert [row_ids(next(again)) for _ in range(5)] == epoch0
    other_seed = TrainLoader(dataset, batch_size=4, micro_batches=2, seed=8)
    assert [row_ids(next(other_seed)) for _ in range(5)] != epoch0


def test_resumed_loader_continues_with_the_same_batches(dataset):
    loader = TrainLoader(dataset, batch_size=6, seed=3)
    for _ in range(5):
        next(loader)
    saved = LoaderState.from_dict(loader.state.to_dict())
    expected = [next(loader) for _ in range(6)]
    resumed = TrainLoader(dataset, batch_size=6, seed=3, state=saved)
    for want in expected:
        for got, wanted in zip(next(resumed), want, strict=True):
            np.testing.assert_array_equal(got, wanted)


def test_processes_read_disjoint_slices_that_make_up_the_global_batch(dataset):
    whole = next(TrainLoader(dataset, batch_size=8, micro_batches=2, seed=1))
    parts = [next(TrainLoader(dataset, 8, 2, seed=1, process_index=p, process_count=2)) for p in range(2)]
    assert parts[0].tokens.shape == (2, 2, 5) and parts[0].rows.shape == (2, 2)
    for p, field in enumerate(whole):
        np.testing.assert_array_equal(np.concatenate([part[p] for part in parts], axis=1), field)


def test_validation_is_in_order_and_pads_the_last_batch_with_zero_weight(dataset):
    batches = list(eval_batches(dataset, batch_size=8, max_batches=10))
    assert [row_ids(t) for t, _ in batches][:2] == [list(range(8)), list(range(8, 16))]
    tokens, weights = batches[-1]
    assert row_ids(tokens)[:6] == list(range(16, 22)) and weights.tolist() == [1] * 6 + [0] * 2
    assert len(list(eval_batches(dataset, batch_size=8, max_batches=1))) == 1


def test_too_little_data_for_one_batch_is_named(dataset):
    with pytest.raises(ConfigError, match="holds 22 sequences, fewer than one batch"):
        TrainLoader(dataset, batch_size=32)
