"""Raw corpora for `meshlm prepare`, streamed as documents or records without ever holding a whole file in memory.

Accepted inputs: plain text files (one file = one document), directories (every non-hidden file below,
in sorted path order), JSON Lines (`.jsonl`, one record per line), zstandard-compressed JSON Lines
(`.jsonl.zst`), Parquet files (`.parquet`, one record per row, read a row group at a time) and the seed's
TFRecord files (`.tfrecord`/`.tfrecords`, each record a `tf.train.Example` whose int64-list feature `text`
holds already-tokenized ids, as mesh-transformer-jax's `create_finetune_tfrecords.py` wrote them).
TFRecords are parsed here directly (framing, masked CRC32C, the few protobuf fields needed), so TensorFlow
is not needed.

A record file holds one of four formats, told apart by the keys of its first record (`record_format`):
`{"text"}` (a document, its field chosen by `--text-field`), `{"prompt", "completion"}`, `{"messages"}`
and `{"prompt", "chosen", "rejected"}`. Text documents are streamed in pieces (`documents`); the other
formats are handed on whole (`records`) to be tokenized by `meshlm.prepare`.
"""

from __future__ import annotations

import codecs
import io
import json
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from meshlm.config import DataError

READ_CHARS = 1 << 20  # text goes to the tokenizer in pieces of about this many characters
MAX_PIECE_CHARS = 16 * READ_CHARS  # a piece without any safe cut point is cut here regardless
PARQUET_BATCH = 1024  # rows of a Parquet row group decoded at a time
KINDS = "text files, directories, .jsonl, .jsonl.zst, .parquet and .tfrecord(s)"
RECORD_FILES = ("jsonl", "jsonl.zst", "parquet")  # file kinds whose records may be of any format
# Extensions of formats that are not text; reading them as text would silently train on garbage.
NOT_TEXT = (".json", ".zst", ".gz", ".xz", ".bz2", ".zip", ".tar", ".7z", ".arrow", ".npy", ".npz",
            ".bin", ".pkl", ".pt", ".safetensors", ".pdf")  # fmt: skip
# Record formats, each with the keys that make it (a record with keys of several is the first listed here).
# "prompt": a prompt alone (with any other columns), for reinforcement learning (`meshlm prepare --objective grpo`).
FORMATS = {"preference": ("prompt", "chosen", "rejected"), "messages": ("messages",),
           "prompt-completion": ("prompt", "completion"), "prompt": ("prompt",), "text": ()}  # fmt: skip
# A cut before a space or newline that sits between two non-whitespace characters is a boundary of GPT-2's
# pre-tokenizer regex whatever surrounds it, so tokenizing the pieces separately gives the same ids as the whole.
_SAFE_CUT = re.compile(r"(?<=\S)[ \n](?=\S)")

Piece = tuple["str | np.ndarray", bool]  # (text, or ids already tokenized; is it the last piece of its document)


def expand(inputs: list[str | Path]) -> list[tuple[Path, str]]:
    """(file, kind) for every input, directories recursed in sorted order; errors name the offending path."""
    files: list[tuple[Path, str]] = []
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not found:
                raise DataError(f"{path}: directory holds no input files")
            files.extend((p, kind_of(p)) for p in found)
        elif path.is_file():
            files.append((path, kind_of(path)))
        else:
            raise DataError(f"{path}: no such file or directory")
    return files


def kind_of(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".jsonl.zst"):
        return "jsonl.zst"
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith((".tfrecord", ".tfrecords")):
        return "tfrecord"
    if name.endswith(".parquet"):
        return "parquet"
    with open(path, "rb") as f:
        binary = b"\0" in f.read(8192)
    if name.endswith(NOT_TEXT) or binary:
        raise DataError(f"{path}: unknown file type; meshlm prepare reads {KINDS}")
    return "text"


def documents(path: Path, kind: str, text_field: str, progress: Callable[[int], None]) -> Iterator[Piece]:
    """The pieces of every document of a text or TFRecord file, in order; `progress` hears how many bytes
    were consumed. (Record files are read with `records`.)"""
    with open(path, "rb") as raw:
        reader = _text_file if kind == "text" else _tfrecord
        done = 0
        for piece in reader(path, raw, text_field):
            progress(raw.tell() - done)
            done = raw.tell()
            yield piece
        progress(raw.tell() - done)


def records(path: Path, kind: str, progress: Callable[[int], None]) -> Iterator[tuple[str, Any]]:
    """(where, record) for every record of a JSONL or Parquet file, in order: `where` names the file and
    the line (JSONL, from 1) or row (Parquet, from 0) for messages about the record."""
    if kind == "parquet":
        yield from _parquet(path, progress)
        return
    with open(path, "rb") as raw:
        stream = io.BufferedReader(_ZstdFrames(raw, path)) if kind == "jsonl.zst" else raw
        done = 0
        for item in _jsonl(path, stream):
            progress(raw.tell() - done)
            done = raw.tell()
            yield item
        progress(raw.tell() - done)


def record_format(record: Any, text_field: str = "text") -> str | None:
    """The format a record's keys make (the first of FORMATS it has all the keys of), None for none."""
    if not isinstance(record, dict):
        return None
    for name, keys in FORMATS.items():
        if all(k in record for k in keys or (text_field,)):
            return name
    return None


def first_record(path: Path, kind: str) -> tuple[str, Any] | None:
    """The first record of a record file (where, record), None for a file without any."""
    return next(records(path, kind, lambda n: None), None)


def detect_format(where: str, record: Any, text_field: str = "text") -> str:
    """The format of a record (`record_format`); DataError for a record of none."""
    found = record_format(_object(where, record), text_field)
    if found is None:
        raise DataError(
            f"{where}: no {text_field!r} field (choose the field with --text-field), nor the fields of "
            "another record format (prompt/completion, messages, prompt/chosen/rejected, prompt)"
        )
    return found


def check_record(where: str, record: Any, fmt: str, forced: bool, text_field: str = "text") -> None:
    """Refuse a record that is not of its file's format `fmt` (its first record's, or the one `forced` by
    --format): keys missing, or those of another format (a file holds one format). A text record's text
    must be a string; the other formats' fields are checked where they are tokenized."""
    found = record_format(_object(where, record), text_field)
    partial = found is not None and 0 < len(FORMATS[found]) and set(FORMATS[found]) < set(FORMATS[fmt])
    if not forced and found not in (None, fmt) and not partial:  # a record lacking some of fmt's keys: named below
        raise DataError(f"{where}: a {found} record in a file of {fmt} records (its first record's); a file "
                        "holds records of one format")  # fmt: skip
    missing = [k for k in FORMATS[fmt] or (text_field,) if k not in record]
    if missing:
        hint = " (choose the field with --text-field)" if fmt == "text" else ""
        raise DataError(f"{where}: no {missing[0]!r} field{hint}, which {fmt} records have")
    if fmt == "text" and not isinstance(record[text_field], str):
        raise DataError(f"{where}: field {text_field!r} is {type(record[text_field]).__name__}, expected a string")


def _object(where: str, record: Any) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    return record


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a file of concatenated zstd frames. zstandard's own readers end quietly where
    a file is cut inside a frame, dropping the rest of a truncated file without a word; this one refuses it."""

    CHUNK = 1 << 17  # compressed bytes decompressed at a time (zstd's recommended input size)

    def __init__(self, raw: BinaryIO, path: Path):
        import zstandard

        self._raw, self._path, self._errors = raw, path, zstandard.ZstdError
        self._dctx = zstandard.ZstdDecompressor()
        self._frame: Any = None  # the decompressor of the frame being read; None between frames
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while self._pos == len(self._out):
            data = self._raw.read(self.CHUNK)
            if not data:
                if self._frame is not None:
                    raise self._corrupt("the file ends inside a frame")
                return 0
            self._out, self._pos = self._decompress(data), 0
        n = min(len(buf), len(self._out) - self._pos)
        buf[:n] = memoryview(self._out)[self._pos : self._pos + n]
        self._pos += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._frame is None:
                self._frame = self._dctx.decompressobj()
            try:
                out.append(self._frame.decompress(data))
            except self._errors as e:
                raise self._corrupt(str(e)) from None
            if not self._frame.eof:
                break
            data, self._frame = self._frame.unused_data, None
        return b"".join(out)

    def _corrupt(self, why: str) -> DataError:
        return DataError(f"{self._path}: truncated or corrupt zstd stream ({why})")


def split_text(text: str) -> Iterator[Piece]:
    """One document's `text` in pieces of about READ_CHARS characters, cut where the tokenization is unaffected."""
    while len(text) > READ_CHARS:
        cut = _last_cut(text, READ_CHARS) or _last_cut(text, min(len(text), MAX_PIECE_CHARS)) or MAX_PIECE_CHARS
        yield text[:cut], False
        text = text[cut:]
    yield text, True


def _last_cut(text: str, end: int) -> int:
    """The last safe cut position in text[:end] (0 if none), looking back from the end in growing windows."""
    window = 4096
    while True:
        start = max(1, end - window)
        cuts = [m.start() for m in _SAFE_CUT.finditer(text, start, end + 1) if m.start() < end]
        if cuts:
            return cuts[-1]
        if start == 1:
            return 0
        window *= 4


def _text_file(path: Path, stream: io.BufferedIOBase, text_field: str) -> Iterator[Piece]:
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    buf, offset, emitted = "", 0, False
    while True:
        raw = stream.read(READ_CHARS)
        try:
            buf += decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (bad byte near offset {offset + max(e.start, 0)})") from None
        offset += len(raw)
        if not raw:
            break
        if len(buf) >= READ_CHARS:
            cut = _last_cut(buf, len(buf))
            if not cut and len(buf) < MAX_PIECE_CHARS:
                continue
            piece, buf = (buf[:cut], buf[cut:]) if cut else (buf, "")
            emitted = True
            yield piece, False
    if buf or emitted:
        yield buf, True


def _jsonl(path: Path, stream: io.BufferedIOBase) -> Iterator[tuple[str, Any]]:
    for lineno, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:  # e.msg may end in "at" ("Unterminated string starting at")
            cut = "" if line.endswith(b"\n") else "; the file ends inside this line: is it truncated?"
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}: column {e.colno}){cut}") from None
        except UnicodeDecodeError:
            raise DataError(f"{path}:{lineno}: not valid UTF-8") from None
        except RecursionError:
            raise DataError(
                f"{path}:{lineno}: JSON nested too deeply to read (arrays or objects in one another)"
            ) from None
        yield f"{path}:{lineno}", record


def _parquet(path: Path, progress: Callable[[int], None]) -> Iterator[tuple[str, Any]]:
    """Rows as dicts, one row group at a time (a batch of its rows decoded at once), so memory stays bounded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        row = done = 0
        for group in range(file.num_row_groups):
            for batch in file.iter_batches(batch_size=PARQUET_BATCH, row_groups=[group]):
                for record in batch.to_pylist():
                    yield f"{path}: row {row}", record
                    row += 1
            meta = file.metadata.row_group(group)
            size = sum(meta.column(c).total_compressed_size for c in range(meta.num_columns))
            progress(size)
            done += size
        progress(max(0, path.stat().st_size - done))  # the footer and headers
    except (pa.ArrowException, OSError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"{path}: not a readable Parquet file ({reason})") from None


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC32C, rotated right by 15 bits plus a constant."""
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _tfrecord(path: Path, stream: io.BufferedIOBase, feature: str) -> Iterator[Piece]:
    """Each record's ids, as is: the seed packed them already, with its end-of-text separators inside."""
    n = 0
    while header := stream.read(12):
        where = f"{path}: record {n}"
        if len(header) < 12:
            raise DataError(f"{where}: truncated (the file ends inside a record header)")
        length, length_crc = struct.unpack("<QI", header)
        if masked_crc32c(header[:8]) != length_crc:
            raise DataError(f"{where}: length checksum mismatch; the file is corrupt or not a TFRecord file")
        body = stream.read(length + 4)
        if len(body) < length + 4:
            raise DataError(f"{where}: truncated (the file ends inside a record)")
        data, (data_crc,) = body[:length], struct.unpack("<I", body[length:])
        if masked_crc32c(data) != data_crc:
            raise DataError(f"{where}: data checksum mismatch; the file is corrupt")
        try:
            ids = example_int64_feature(data, feature)
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        if len(ids):
            yield ids, True
        n += 1


def example_int64_feature(example: bytes, name: str) -> np.ndarray:
    """The int64 list feature `name` of a serialized tf.train.Example (Example.features.feature[name])."""
    for field, features in _fields(example):
        if field != 1:
            continue
        for entry_field, entry in _fields(features):
            if entry_field != 1:
                continue
            entry_fields = dict(_fields(entry))
            if bytes(entry_fields.get(1, b"")) != name.encode():
                continue
            kinds = dict(_fields(entry_fields.get(2, b"")))
            if 3 not in kinds:
                have = {1: "a bytes list", 2: "a float list"}.get(next(iter(kinds), 0), "empty")
                raise ValueError(f"feature {name!r} is {have}, expected an int64 list of token ids")
            return _int64_list(kinds[3])
    raise ValueError(f"no feature {name!r} in the tf.train.Example (choose the feature with --text-field)")


def _int64_list(message: memoryview) -> np.ndarray:
    """Int64List.value, packed (how TensorFlow writes it) or one varint per field."""
    parts = []
    for field, wire, value in _raw_fields(message):
        if field == 1 and wire == 2:
            parts.append(_varints(value))
        elif field == 1 and wire == 0:
            parts.append(np.array([value], np.uint64).view(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _fields(message: bytes | memoryview) -> Iterator[tuple[int, memoryview]]:
    """(field number, payload) of the length-delimited fields of a protobuf message."""
    for field, wire, value in _raw_fields(message):
        if wire == 2:
            yield field, value


def _raw_fields(message: bytes | memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    buf, pos = memoryview(message), 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield field, wire, value
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError("malformed tf.train.Example (a field runs past the end)")
            yield field, wire, buf[pos : pos + size]
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"malformed tf.train.Example (wire type {wire})")


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("malformed tf.train.Example (bad varint)")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def _varints(packed: memoryview) -> np.ndarray:
    """Decode a run of packed varints at once (a record holds thousands of ids)."""
    b = np.frombuffer(packed, np.uint8)
    if not b.size:
        return np.zeros(0, np.int64)
    ends = np.flatnonzero(b < 0x80)
    if not ends.size or ends[-1] != b.size - 1:
        raise ValueError("malformed tf.train.Example (truncated packed varint)")
    starts = np.concatenate(([0], ends[:-1] + 1))
    if (ends - starts).max() >= 10:
        raise ValueError("malformed tf.train.Example (varint longer than 10 bytes)")
    shift = 7 * (np.arange(b.size) - np.repeat(starts, ends - starts + 1))
    values = (b & 0x7F).astype(np.uint64) << shift.astype(np.uint64)
    return np.bitwise_or.reduceat(values, starts).view(np.int64)
