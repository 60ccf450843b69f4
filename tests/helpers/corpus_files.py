"""The files `meshlm prepare` reads, written here independently, and the rows it must write."""

import json
import struct
from pathlib import Path

import numpy as np
import zstandard

from meshlm import data
from meshlm.tokenizer import EOT_ID

SEQ = 16

ROW = SEQ + 1


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def example(ids: list[int], packed: bool = True, name: str = "text") -> bytes:
    """tf.train.Example{features{feature{key: name, value{int64_list{value: ids}}}}}, plus a bytes feature."""
    if packed:
        int64_list = field(1, b"".join(varint(i) for i in ids))
    else:
        int64_list = b"".join(varint(1 << 3 | 0) + varint(i) for i in ids)
    other = field(1, b"meta") + field(2, field(1, field(1, b"not tokens")))  # a bytes_list feature named "meta"
    text = field(1, name.encode()) + field(2, field(3, int64_list))
    return field(1, field(1, other) + field(1, text))


def write_tfrecord(path: Path, records: list[bytes]) -> None:
    with open(path, "wb") as f:
        for rec in records:
            length = struct.pack("<Q", len(rec))
            f.write(length + struct.pack("<I", masked(length)) + rec + struct.pack("<I", masked(rec)))


def stream_of(tok, docs: list) -> list[int]:
    """Text documents are followed by EOS; TFRecord records (lists of ids) are taken as they are."""
    out: list[int] = []
    for doc in docs:
        out += doc if isinstance(doc, list) else [*tok.encode(doc), EOT_ID]
    return out


def rows_of(ids: list[int]) -> np.ndarray:
    n = len(ids) // ROW * ROW
    return np.array(ids[:n]).reshape(-1, ROW)


def read_rows(folder: Path, split: str = "train") -> np.ndarray:
    ds = data.TokenDataset(folder, split)
    return ds[np.arange(len(ds))].tokens


def write_jsonl(path: Path, texts: list[str], compress: bool = False) -> None:
    lines = "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)).encode()
    if compress:  # two zstd frames, as concatenated or multi-threaded writers produce
        half = len(lines) // 2
        lines = zstandard.compress(lines[:half]) + zstandard.compress(lines[half:])
    path.write_bytes(lines)
