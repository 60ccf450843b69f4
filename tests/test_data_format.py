import numpy as np
import pytest

from meshlm import data
from meshlm.config import ConfigError


def make(folder, seq_len=8, blocks=((3,), (5,))):
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 50257, (n, seq_len + 1)) for (n,) in blocks]
    data.write_index(folder, seq_len, {"train": data.write_split(folder, "train", rows, seq_len)})
    return np.concatenate(rows)


def test_rows_read_back_across_shards_in_the_order_asked(tmp_path):
    rows = make(tmp_path)
    ds = data.TokenDataset(tmp_path)
    assert len(ds) == 8 and ds.seq_len == 8
    pick = [7, 0, 3, 2, 5]
    np.testing.assert_array_equal(ds[pick].tokens, rows[pick])


def test_damaged_or_missing_data_is_named(tmp_path):
    with pytest.raises(ConfigError, match="not a prepared dataset"):
        data.TokenDataset(tmp_path)
    make(tmp_path)
    with pytest.raises(ConfigError, match="no split 'val'"):
        data.TokenDataset(tmp_path, "val")
    (tmp_path / "train" / "00001.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ConfigError, match="00001.bin: holds 10 bytes"):
        data.TokenDataset(tmp_path)
