"""Prepared training data: packed token sequences in compact uint16 shards with a small JSON index.

Layout of a prepared dataset folder:

    index.json        {"format": "meshlm-tokens", "version": 1, "seq_len": S, "dtype": "uint16",
                       "eos_id": 50256,
                       "splits": {"train": {"files": [...], "sequences": [...], "max_token": 50256}, ...}}
    train/00000.bin   raw little-endian uint16, row-major [n, S + 1] (inputs and the shifted targets)

Each row holds `seq_len + 1` tokens so that one row gives `seq_len` next-token predictions. `max_token`
(the largest id in the split) lets training refuse data of another vocabulary before its first step;
folders written before it existed are scanned instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from meshlm.config import ConfigError, DataError, read_json

FORMAT = "meshlm-tokens"
FORMAT_VERSION = 1
INDEX = "index.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def read_index(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / INDEX
    index = read_json(path, f"{folder}: not a prepared dataset (no {INDEX}); create one with `meshlm prepare`")
    if index.get("format") != FORMAT or index.get("version") != FORMAT_VERSION:
        raise DataError(f"{path}: not a {FORMAT} v{FORMAT_VERSION} index")
    if index.get("dtype") not in DTYPES:
        raise DataError(f"{path}: unsupported token dtype {index.get('dtype')!r}; expected one of {sorted(DTYPES)}")
    return index


class TokenDataset:
    """Random access to the rows of one split, memory-mapped: nothing is read until a row is asked for."""

    def __init__(self, folder: str | Path, split: str = "train"):
        self.folder = Path(folder)
        index = read_index(self.folder)
        if split not in index["splits"]:
            raise DataError(f"{self.folder}: no split {split!r}; available: {sorted(index['splits'])}")
        self.split = split
        self.seq_len: int = index["seq_len"]
        self.eos_id: int = index.get("eos_id", 50256)
        dtype = DTYPES[index["dtype"]]
        row = self.seq_len + 1
        info = index["splits"][split]
        self._shards: list[np.memmap] = []
        for fname, n in zip(info["files"], info["sequences"], strict=True):
            path = self.folder / fname
            if not path.is_file():
                raise DataError(f"{self.folder}: {INDEX} lists {fname}, which is missing")
            expected = n * row * dtype.itemsize
            if path.stat().st_size != expected:
                raise DataError(
                    f"{path}: holds {path.stat().st_size} bytes, {INDEX} implies {expected} "
                    f"({n} rows of {row} {index['dtype']} tokens); the file is damaged or of another dtype"
                )
            if n:
                self._shards.append(np.memmap(path, dtype=dtype, mode="r", shape=(n, row)))
        self._offsets = np.cumsum([0] + [len(s) for s in self._shards])
        if len(self) == 0:
            raise DataError(f"{self.folder}: split {split!r} holds no sequences")
        self._max_token: int | None = info.get("max_token")

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse ids the model has no embedding for: they train to NaN. Read from the index, or scanned."""
        if self._max_token is None:
            self._max_token = max(_chunked_max(shard) for shard in self._shards)
        if self._max_token >= vocab_size:
            raise DataError(
                f"{self.folder}: split {self.split!r} holds token id {self._max_token}, beyond the model's "
                f"vocab_size {vocab_size}; the data was tokenized for another vocabulary"
            )

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, rows: np.ndarray | list[int]) -> np.ndarray:
        """Rows [k, seq_len + 1] as int32, in the order asked."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"row index out of range [0, {len(self)})")
        shard = np.searchsorted(self._offsets, rows, side="right") - 1
        out = np.empty((len(rows), self.seq_len + 1), np.int32)
        for s in np.unique(shard):
            pick = shard == s
            out[pick] = self._shards[s][rows[pick] - self._offsets[s]]
        return out


def _chunked_max(shard: np.memmap, rows: int = 1 << 16) -> int:
    """The largest token of a memory-mapped shard, read a block of rows at a time."""
    return max(int(shard[i : i + rows].max()) for i in range(0, len(shard), rows))


class ShardWriter:
    """Appends rows to one split's shard files, starting a new file every `shard_rows` rows (None: only on request)."""

    def __init__(self, folder: Path, split: str, seq_len: int, dtype: str = "uint16", shard_rows: int | None = None):
        if shard_rows is not None and shard_rows <= 0:
            raise ConfigError(f"shard_rows must be a positive integer, got {shard_rows}")
        self.folder, self.split, self.row, self.dtype = Path(folder), split, seq_len + 1, DTYPES[dtype]
        self.shard_rows = shard_rows
        self.files: list[str] = []
        self.counts: list[int] = []
        self.max_token = -1
        self._file: Any = None

    def write(self, rows: np.ndarray) -> None:
        if rows.ndim != 2 or rows.shape[1] != self.row:
            raise ValueError(f"row block has shape {rows.shape}, expected [n, {self.row}]")
        while len(rows):
            if self._file is None:
                fname = f"{self.split}/{len(self.files):05d}.bin"
                (self.folder / self.split).mkdir(parents=True, exist_ok=True)
                self._file = open(self.folder / fname, "wb")  # noqa: SIM115 - stays open across write() calls
                self.files.append(fname)
                self.counts.append(0)
            room = len(rows) if self.shard_rows is None else self.shard_rows - self.counts[-1]
            block, rows = rows[:room], rows[room:]
            if len(block):
                self.max_token = max(self.max_token, int(block.max()))
            block.astype(self.dtype).tofile(self._file)
            self.counts[-1] += len(block)
            if self.counts[-1] == self.shard_rows:
                self.end_shard()

    def end_shard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> dict:
        """Finish the last shard; returns the split's index entry."""
        self.end_shard()
        return {"files": self.files, "sequences": self.counts, "max_token": self.max_token}


def write_split(folder: Path, split: str, rows: list[np.ndarray], seq_len: int, dtype: str = "uint16") -> dict:
    """Write row blocks [n_i, seq_len + 1] as shards of `split`, one per block; returns that split's index entry."""
    writer = ShardWriter(folder, split, seq_len, dtype)
    for block in rows:
        writer.write(block)
        writer.end_shard()
    return writer.close()


def write_index(
    folder: Path, seq_len: int, splits: dict[str, dict], dtype: str = "uint16", eos_id: int = 50256, **extra: Any
) -> None:
    """Write index.json last, atomically: a folder without it is never read as a dataset."""
    index = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "seq_len": seq_len,
        "dtype": dtype,
        "eos_id": eos_id,
        "splits": splits,
        **extra,
    }
    tmp = folder / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=2))
    tmp.replace(folder / INDEX)
