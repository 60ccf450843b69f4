"""Prepared training data: packed token rows in compact shards, with per-token loss weights and document
(segment) ids, and a small JSON index.

Layout of a prepared dataset folder (version 2):

    index.json                {"format": "meshlm-tokens", "version": 2, "kind": "lm" | "preference" | "prompts",
                               "seq_len": S, "dtype": "uint16", "eos_id": 50256, "pad_id": 50256,
                               "splits": {"train": {"files": [...], "sequences": [...], "max_token": 50256}, ...}}
    train/00000.bin           tokens: raw little-endian uint16 (or uint32), row-major [n, S + 1]
    train/00000.weights.bin   loss weights: uint8 0/1, [n, S + 1]
    train/00000.segments.bin  segment ids: little-endian uint16, [n, S + 1]

Each row holds `seq_len + 1` tokens, so one row gives `seq_len` next-token predictions. Segment 0 is
padding and 1..k are the k documents packed in the row, in order: attention and positions stay within a
document. `weights[i, t]` is 1 exactly when token t of row i is a training target predicted from token
t - 1 of the same document: column 0, the first token of every document and padding are always 0. Kind
"preference" holds pairs: rows 2j and 2j + 1 are pair j's chosen and rejected sequences, their weights the
completion tokens. Kind "prompts" holds one prompt per row (segment 1, then padding), for reinforcement
learning; `train/prompts.jsonl` gives row i's prompt as the record had it (text or messages) and the record's
other columns, which the reward functions read (`read_prompt_records`). `max_token` (the largest id in the
split) lets training refuse data of another vocabulary before its first step; folders written before it
existed are scanned instead.

Version-1 folders (tokens only) still load: every row one document (segments 1), weights 1 but in column 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from meshlm.config import ConfigError, DataError
from meshlm.paths import read_json

FORMAT = "meshlm-tokens"
FORMAT_VERSION = 2
READS = (1, 2)  # index versions this meshlm reads
INDEX = "index.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
KINDS = ("lm", "preference", "prompts")
PROMPT_RECORDS = "prompts.jsonl"  # beside a "prompts" split's shards: each row's prompt and its record's columns
WEIGHTS_DTYPE, SEGMENTS_DTYPE = np.dtype("u1"), np.dtype("<u2")
MAX_SEGMENTS = np.iinfo(SEGMENTS_DTYPE).max  # documents one row can hold


class Batch(NamedTuple):
    """Rows of a dataset: tokens int32, loss weights float32 and segment ids int32, each [..., seq_len + 1],
    and the global row ids they were read from (int64, [...])."""

    tokens: np.ndarray
    weights: np.ndarray
    segments: np.ndarray
    rows: np.ndarray


def companion(token_file: str, what: str) -> str:
    """The weights or segments file beside a token shard: `train/00000.bin` -> `train/00000.weights.bin`."""
    return token_file.removesuffix(".bin") + f".{what}.bin"


def default_weights(tokens: np.ndarray) -> np.ndarray:
    """Weights of rows cut from one stream (a version-1 row): every token is a target except column 0."""
    weights = np.ones(tokens.shape, WEIGHTS_DTYPE)
    weights[..., 0] = 0
    return weights


def read_index(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / INDEX
    index = read_json(path, f"{folder}: not a prepared dataset (no {INDEX}); create one with `meshlm prepare`")
    if index.get("format") != FORMAT or index.get("version") not in READS:
        raise DataError(f"{path}: not a {FORMAT} index of version {' or '.join(map(str, READS))}")
    if index.get("dtype") not in DTYPES:
        raise DataError(f"{path}: unsupported token dtype {index.get('dtype')!r}; expected one of {sorted(DTYPES)}")
    if index.get("kind", "lm") not in KINDS:
        raise DataError(f"{path}: unknown dataset kind {index.get('kind')!r}; expected one of {list(KINDS)}")
    return index


def read_prompt_records(folder: str | Path, split: str = "train") -> list[dict[str, Any]]:
    """A "prompts" split's records, one per row: {"prompt": text or messages, "columns": {name: value}}."""
    path = Path(folder) / split / PROMPT_RECORDS
    if not path.is_file():
        raise DataError(f"{folder}: split {split!r} has no {PROMPT_RECORDS}; is it a prompts dataset?")
    with open(path) as f:
        return [json.loads(line) for line in f]


class TokenDataset:
    """Random access to the rows of one split, memory-mapped: nothing is read until a row is asked for.

    `len()` counts examples (rows for kind "lm", pairs of rows for "preference"); `rows` counts rows."""

    def __init__(self, folder: str | Path, split: str = "train"):
        self.folder = Path(folder)
        index = read_index(self.folder)
        if split not in index["splits"]:
            raise DataError(f"{self.folder}: no split {split!r}; available: {sorted(index['splits'])}")
        self.split = split
        self.seq_len: int = index["seq_len"]
        self.eos_id: int = index.get("eos_id", 50256)
        self.kind: str = index.get("kind", "lm")
        self.objective: str | None = index.get("objective")  # the trainer whose tokenization pairs follow
        self.version: int = index["version"]
        info = index["splits"][split]
        self._shards: list[tuple[np.memmap, np.memmap | None, np.memmap | None]] = []
        for fname, n in zip(info["files"], info["sequences"], strict=True):
            if not n:
                continue
            parts = [(fname, DTYPES[index["dtype"]], index["dtype"])]
            if self.version >= 2:
                parts += [(companion(fname, "weights"), WEIGHTS_DTYPE, "uint8"),
                          (companion(fname, "segments"), SEGMENTS_DTYPE, "uint16")]  # fmt: skip
            maps = [self._open(name, dtype, label, n) for name, dtype, label in parts]
            self._shards.append((maps[0], *(maps[1:] or [None, None])))
        self._offsets = np.cumsum([0] + [len(s[0]) for s in self._shards])
        if self.rows == 0:
            raise DataError(f"{self.folder}: split {split!r} holds no sequences")
        if self.kind == "preference" and self.rows % 2:
            raise DataError(
                f"{self.folder}: split {split!r} holds {self.rows} rows, not whole (chosen, rejected) pairs"
            )
        self._max_token: int | None = info.get("max_token")

    def _open(self, fname: str, dtype: np.dtype, label: str, n: int) -> np.memmap:
        path, row = self.folder / fname, self.seq_len + 1
        if not path.is_file():
            raise DataError(f"{self.folder}: {INDEX} lists {fname}, which is missing")
        expected = n * row * dtype.itemsize
        if path.stat().st_size != expected:
            raise DataError(
                f"{path}: holds {path.stat().st_size} bytes, {INDEX} implies {expected} "
                f"({n} rows of {row} {label} values); the file is damaged or of another dtype"
            )
        return np.memmap(path, dtype=dtype, mode="r", shape=(n, row))

    @property
    def rows(self) -> int:
        """Sequence rows in the split (twice the examples for preference data)."""
        return int(self._offsets[-1])

    @property
    def rows_per_example(self) -> int:
        return 2 if self.kind == "preference" else 1

    def example_rows(self, examples: np.ndarray) -> np.ndarray:
        """Row ids of example ids [..., k]: [..., k] for lm data, [..., 2k] (chosen_0, rejected_0, ...) for pairs."""
        examples = np.asarray(examples, np.int64)
        if self.rows_per_example == 1:
            return examples
        return np.stack([2 * examples, 2 * examples + 1], axis=-1).reshape(*examples.shape[:-1], -1)

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse ids the model has no embedding for: they train to NaN. Read from the index, or scanned."""
        if self._max_token is None:
            self._max_token = max(_chunked_max(shard[0]) for shard in self._shards)
        if self._max_token >= vocab_size:
            raise DataError(
                f"{self.folder}: split {self.split!r} holds token id {self._max_token}, beyond the model's "
                f"vocab_size {vocab_size}; the data was tokenized for another vocabulary"
            )

    def __len__(self) -> int:
        return self.rows // self.rows_per_example

    def __getitem__(self, rows: np.ndarray | list[int]) -> Batch:
        """Rows [k, seq_len + 1] (row ids, not examples), in the order asked."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.rows):
            raise IndexError(f"row index out of range [0, {self.rows})")
        shard = np.searchsorted(self._offsets, rows, side="right") - 1
        shape = (len(rows), self.seq_len + 1)
        tokens, segments = np.empty(shape, np.int32), np.ones(shape, np.int32)
        weights = np.empty(shape, np.float32)
        for s in np.unique(shard):
            pick = shard == s
            local = rows[pick] - self._offsets[s]
            token_map, weight_map, segment_map = self._shards[s]
            tokens[pick] = token_map[local]
            weights[pick] = default_weights(tokens[pick]) if weight_map is None else weight_map[local]
            if segment_map is not None:
                segments[pick] = segment_map[local]
        return Batch(tokens, weights, segments, rows)


def _chunked_max(shard: np.memmap, rows: int = 1 << 16) -> int:
    """The largest token of a memory-mapped shard, read a block of rows at a time."""
    return max(int(shard[i : i + rows].max()) for i in range(0, len(shard), rows))


class ShardWriter:
    """Appends rows (tokens, weights, segments) to one split's shard files, starting new files every
    `shard_rows` rows (None: only on request)."""

    def __init__(self, folder: Path, split: str, seq_len: int, dtype: str = "uint16", shard_rows: int | None = None):
        if shard_rows is not None and shard_rows <= 0:
            raise ConfigError(f"shard_rows must be a positive integer, got {shard_rows}")
        self.folder, self.split, self.row, self.dtype = Path(folder), split, seq_len + 1, DTYPES[dtype]
        self.shard_rows = shard_rows
        self.files: list[str] = []
        self.counts: list[int] = []
        self.max_token = -1
        self._files: list[Any] = []  # the open shard's token, weights and segments files

    def write(self, tokens: np.ndarray, weights: np.ndarray | None = None, segments: np.ndarray | None = None) -> None:
        """Rows [n, seq_len + 1]; without weights and segments, rows cut from one stream (`default_weights`,
        segments 1)."""
        if tokens.ndim != 2 or tokens.shape[1] != self.row:
            raise ValueError(f"row block has shape {tokens.shape}, expected [n, {self.row}]")
        if weights is None:
            weights = default_weights(tokens)
        if segments is None:
            segments = np.ones(tokens.shape, SEGMENTS_DTYPE)
        done = 0
        while done < len(tokens):
            if not self._files:
                fname = f"{self.split}/{len(self.files):05d}.bin"
                (self.folder / self.split).mkdir(parents=True, exist_ok=True)
                names = (fname, companion(fname, "weights"), companion(fname, "segments"))
                self._files = [open(self.folder / name, "wb") for name in names]  # noqa: SIM115 - open across writes
                self.files.append(fname)
                self.counts.append(0)
            room = len(tokens) if self.shard_rows is None else self.shard_rows - self.counts[-1]
            n = min(room, len(tokens) - done)
            block = slice(done, done + n)
            self.max_token = max(self.max_token, int(tokens[block].max()))
            for file, array, dtype in zip(self._files, (tokens, weights, segments),
                                          (self.dtype, WEIGHTS_DTYPE, SEGMENTS_DTYPE), strict=True):  # fmt: skip
                array[block].astype(dtype).tofile(file)
            self.counts[-1] += n
            done += n
            if self.counts[-1] == self.shard_rows:
                self.end_shard()

    def end_shard(self) -> None:
        for file in self._files:
            file.close()
        self._files = []

    def close(self) -> dict:
        """Finish the last shard; returns the split's index entry."""
        self.end_shard()
        return {"files": self.files, "sequences": self.counts, "max_token": self.max_token}


def write_split(
    folder: Path, split: str, rows: list[np.ndarray | Batch | tuple], seq_len: int, dtype: str = "uint16"
) -> dict:
    """Write row blocks as shards of `split`, one per block; returns that split's index entry. A block is
    tokens [n_i, seq_len + 1] (rows cut from one stream) or (tokens, weights, segments)."""
    writer = ShardWriter(folder, split, seq_len, dtype)
    for block in rows:
        writer.write(*(block[:3] if isinstance(block, tuple) else (block,)))
        writer.end_shard()
    return writer.close()


def write_index(
    folder: Path,
    seq_len: int,
    splits: dict[str, dict],
    dtype: str = "uint16",
    eos_id: int = 50256,
    kind: str = "lm",
    **extra: Any,
) -> None:
    """Write index.json last, atomically: a folder without it is never read as a dataset."""
    if kind not in KINDS:
        raise ConfigError(f"dataset kind must be one of {list(KINDS)}, got {kind!r}")
    index = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "kind": kind,
        "seq_len": seq_len,
        "dtype": dtype,
        "eos_id": eos_id,
        "splits": splits,
        **extra,
    }
    tmp = folder / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=2))
    tmp.replace(folder / INDEX)
