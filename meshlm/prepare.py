"""`meshlm prepare`: text, JSONL or token files -> a prepared dataset (`meshlm.data`'s format on disk).

Documents are read by `meshlm.corpus`, tokenised (in worker processes when there are several cores),
ended with the end-of-text token, packed into rows of seq_len + 1 tokens and written shard by shard, so
memory stays bounded whatever the input's size.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from meshlm.config import GPT2_VOCAB, ConfigError, DataError
from meshlm.data import DTYPES, INDEX, ShardWriter, write_index
from meshlm.tokenizer import EOT_ID, Tokenizer, load_tokenizer

SHARD_BYTES = 128 << 20  # a new shard file starts after about this many bytes
SPLITS = ("train", "val")


def prepare(
    inputs: list[str | Path],
    out_dir: str | Path,
    seq_len: int,
    *,
    tokenizer: str | Path | None = None,
    text_field: str = "text",
    val_fraction: float = 0.0,
    val_inputs: list[str | Path] | None = None,
    seed: int = 0,
    workers: int | None = None,
    shard_rows: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize and pack raw corpora into a prepared dataset folder; returns a summary of what was written.

    Text documents (a text file, a JSONL line) are tokenized with `tokenizer` (a tokenizer.json or .tiktoken
    file, or a model folder for that model's tokenizer; default GPT-2 BPE, see `meshlm.tokenizer`) and
    followed by the end-of-text id; the
    seed's TFRecord records are taken as the packed ids they already are. The stream is cut into rows of
    `seq_len + 1` tokens in input order (rows are not shuffled: the loader shuffles) and the tail shorter
    than a row is dropped. `val_fraction` sends each document to the validation split with that
    probability (drawn from `seed` in document order); `val_inputs` gives the validation split its own
    files instead. Memory stays bounded whatever the input size: text is read and tokenized in pieces
    by `workers` processes (default: every core), at most a few pieces ahead of the writer.

    The dataset is written into the sibling folder `<out>.prepare-unfinished` and moved to `out` only when
    complete, so a failed or killed run never leaves a half-written dataset at `out`. `out` must be absent or
    empty unless `overwrite`, which replaces the dataset's own entries there (index.json, train/, val/).
    """
    from meshlm import corpus

    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ConfigError(f"seq_len must be a positive integer, got {seq_len!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_fraction and val_inputs:
        raise ConfigError("give either a validation fraction or validation files, not both")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise ConfigError(f"workers must be at least 1, got {workers}")
    out = Path(out_dir)
    target = out.resolve()  # a symlinked --out: the folder it names is the one replaced
    partial = target.with_name(target.name + ".prepare-unfinished")
    _check_out(out, target, partial, overwrite)
    if isinstance(inputs, str | Path):
        inputs = [inputs]
    sources = {"train": corpus.expand(inputs)}
    if val_inputs:
        sources["val"] = corpus.expand(val_inputs)
    if not sources["train"]:
        raise DataError("no input files given")
    needs_text = any(kind != "tfrecord" for files in sources.values() for _, kind in files)
    tok = load_tokenizer(tokenizer) if needs_text else None
    eos = tok.eot_id if tok else EOT_ID
    dtype = "uint16" if (tok.vocab_size if tok else GPT2_VOCAB) <= 1 << 16 else "uint32"
    if shard_rows is None:
        shard_rows = max(1, SHARD_BYTES // ((seq_len + 1) * DTYPES[dtype].itemsize))

    split_names = SPLITS if (val_fraction or val_inputs) else SPLITS[:1]
    if partial.exists():  # left by a killed run: only reached with overwrite
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    packers = {name: _Packer(ShardWriter(partial, name, seq_len, dtype, shard_rows)) for name in split_names}
    total_bytes = sum(path.stat().st_size for files in sources.values() for path, _ in files)
    start = time.perf_counter()
    try:
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", smoothing=0.1) as bar:
            tokens = _TokenStream(tok, tokenizer, dtype, eos, text_field, workers, bar.update)
            if val_inputs:
                for name in ("train", "val"):
                    for ids, end in tokens(sources[name]):
                        packers[name].add(ids, end)
            else:
                rng = np.random.default_rng(seed)
                split = None
                for ids, end in tokens(sources["train"]):
                    if split is None:
                        split = "val" if val_fraction and rng.random() < val_fraction else "train"
                    packers[split].add(ids, end)
                    if end:
                        split = None
        splits = {name: packer.close() for name, packer in packers.items()}
        if not splits["train"]["tokens"]:
            raise DataError(f"no tokens in the input: every document of {len(sources['train'])} file(s) is empty")
        for name, entry in splits.items():
            if not entry["sequences"]:
                raise DataError(
                    f"the {name} split holds {entry['tokens']} tokens in {entry['documents']} document(s), fewer "
                    f"than one row of seq_len + 1 = {seq_len + 1}; add data or lower the sequence length"
                )
        write_index(
            partial, seq_len, splits, dtype=dtype, eos_id=eos, tokenizer=tok.name if tok else None,
            row_order="input order (not shuffled)",
            inputs={name: [str(p) for p, _ in files] for name, files in sources.items()},
            val_fraction=val_fraction, seed=seed,
        )  # fmt: skip
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _publish(partial, target)
    seconds = time.perf_counter() - start
    n_tokens = sum(s["tokens"] for s in splits.values())
    return {
        "out": str(out),
        "seq_len": seq_len,
        "splits": {name: {k: v for k, v in s.items() if k != "files"} | {"rows": sum(s["sequences"])}
                   for name, s in splits.items()},
        "seconds": seconds,
        "tokens_per_s": n_tokens / seconds if seconds else 0.0,
    }  # fmt: skip


def _check_out(out: Path, target: Path, partial: Path, overwrite: bool) -> None:
    """Refuse, before any work, an --out whose contents the run would replace, unless told to overwrite."""
    if target.exists() and not target.is_dir():
        raise DataError(f"{out}: exists and is not a folder")
    if overwrite:
        return
    hint = "pass --overwrite to write over it, or choose another folder"
    if (target / INDEX).exists():
        raise DataError(f"{out}: already holds a prepared dataset; {hint}")
    if target.is_dir() and any(target.iterdir()):
        raise DataError(f"{out}: exists and is not empty; {hint}")
    if partial.exists():
        raise DataError(
            f"{partial}: an unfinished prepare of {out} (killed, or still running); pass --overwrite to start again"
        )


def _publish(partial: Path, target: Path) -> None:
    """Move the finished dataset from `partial` to `target`: one rename when `target` is absent or empty. Else
    (overwrite) the old index goes first and index.json comes last, so no moment shows an index beside shards
    it does not describe; files of `target` that are not the dataset's own stay."""
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    if not target.exists():
        partial.rename(target)
        return
    (target / INDEX).unlink(missing_ok=True)
    for name in SPLITS:
        if (target / name).exists():
            shutil.rmtree(target / name)
    for entry in sorted(partial.iterdir(), key=lambda entry: entry.name == INDEX):
        entry.rename(target / entry.name)
    partial.rmdir()


class _Packer:
    """Concatenates one split's ids and hands full rows to its writer, holding back less than a row between calls."""

    FLUSH = 1 << 20  # ids gathered before rows are cut and written

    def __init__(self, writer: ShardWriter):
        self.writer = writer
        self.row = writer.row
        self._pending: list[np.ndarray] = []
        self._held = 0
        self.tokens = self.documents = 0

    def add(self, ids: np.ndarray, ends_document: bool) -> None:
        self._pending.append(ids)
        self._held += len(ids)
        self.tokens += len(ids)
        self.documents += ends_document
        if self._held >= max(self.row, self.FLUSH):
            self._flush()

    def _flush(self) -> None:
        ids = np.concatenate(self._pending)
        n = len(ids) // self.row * self.row
        self.writer.write(ids[:n].reshape(-1, self.row))
        self._pending, self._held = [ids[n:].copy()], len(ids) - n

    def close(self) -> dict:
        if self._pending:
            self._flush()
        return self.writer.close() | {"tokens": self.tokens, "documents": self.documents, "dropped_tokens": self._held}


class _TokenStream:
    """(ids, ends_document) for a list of files, in input order: text is tokenized in worker processes,
    a bounded number of pieces ahead of the consumer, so memory does not grow with the input."""

    def __init__(
        self,
        tok: Tokenizer | None,
        tokenizer: str | Path | None,
        dtype: str,
        eos: int,
        text_field: str,
        workers: int,
        progress: Callable[[int], Any],
    ):
        self.tok, self.init_args = tok, (tokenizer, dtype, eos)
        self.vocab = tok.vocab_size if tok else GPT2_VOCAB
        self.text_field, self.workers, self.progress = text_field, workers, progress
        self.dtype = DTYPES[dtype]

    def __call__(self, files: list[tuple[Path, str]]) -> Iterator[tuple[np.ndarray, bool]]:
        if self.workers == 1 or self.tok is None:  # in this process (no text to tokenize: no workers needed)
            _WORKER.update(tokenizer=self.tok, dtype=self.dtype, eos=self.init_args[2])
            for item in self._work(files):
                yield from item if isinstance(item, list) else _segments(*_encode(*item))
            return
        ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
        with ctx.Pool(self.workers, initializer=_init_worker, initargs=self.init_args) as pool:
            pending: deque = deque()
            for item in self._work(files):
                pending.append(item if isinstance(item, list) else pool.apply_async(_encode, item))
                while len(pending) > 2 * self.workers:
                    yield from _result(pending.popleft())
            while pending:
                yield from _result(pending.popleft())

    def _work(self, files: list[tuple[Path, str]]) -> Iterator[list | tuple[list[str], list[bool]]]:
        """Work items: batches of text pieces of about READ_CHARS characters (to tokenize), or ready ids."""
        from meshlm import corpus

        texts: list[str] = []
        ends: list[bool] = []
        size = 0
        for path, kind in files:
            for content, end in corpus.documents(path, kind, self.text_field, self.progress):
                if isinstance(content, str):
                    texts.append(content)
                    ends.append(end)
                    size += len(content)
                    if size >= corpus.READ_CHARS:
                        yield texts, ends
                        texts, ends, size = [], [], 0
                    continue
                if texts:
                    yield texts, ends
                    texts, ends, size = [], [], 0
                if content.min() < 0 or content.max() >= self.vocab:
                    bad = content[(content < 0) | (content >= self.vocab)][0]
                    raise DataError(f"{path}: holds token id {bad}, outside the tokenizer's 0..{self.vocab - 1}")
                yield [(content.astype(self.dtype), end)]
        if texts:
            yield texts, ends


def _result(item: Any) -> list[tuple[np.ndarray, bool]]:
    return item if isinstance(item, list) else _segments(*item.get())


def _segments(ids: np.ndarray, lengths: np.ndarray, ends: list[bool]) -> list[tuple[np.ndarray, bool]]:
    return list(zip(np.split(ids, np.cumsum(lengths)[:-1]), ends, strict=True))


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: str | Path | None, dtype: str, eos: int) -> None:
    _WORKER.update(tokenizer=load_tokenizer(tokenizer), dtype=DTYPES[dtype], eos=eos)


def _encode(texts: list[str], ends: list[bool]) -> tuple[np.ndarray, np.ndarray, list[bool]]:
    """Tokenize text pieces; a document's last piece gets the end-of-text id after it. Returns the ids of all
    pieces in one array (one array pickles far faster than thousands) with each piece's length."""
    tok, eos = _WORKER["tokenizer"], _WORKER["eos"]
    ids: list[int] = []
    lengths = np.empty(len(texts), np.int64)
    for i, (text, end) in enumerate(zip(texts, ends, strict=True)):
        piece = tok.encode(text)
        lengths[i] = len(piece) + end
        ids += piece
        if end:
            ids.append(eos)
    return np.array(ids, _WORKER["dtype"]), lengths, ends
