"""`meshlm prepare`: the rows it writes equal the token stream computed here from the tokenizer directly."""

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from meshlm import cli, corpus, data
from meshlm import prepare as preparing
from meshlm.config import ConfigError
from meshlm.tokenizer import EOT_ID, load_tokenizer
from tests.helpers.corpus_files import (
    ROW,
    SEQ,
    crc32c,
    example,
    read_rows,
    rows_of,
    stream_of,
    write_jsonl,
    write_tfrecord,
)

TRICKY = (
    "First line of a plain text file.\nSecond line,   with   runs of spaces and\ttabs.\r\n"
    "naïve café 日本語 🙂👍🏽 e\u0301 — “quoted” 3.14159\n\n\nA paragraph after blank lines.  \n"
    "It's a test<|endoftext|>of the special token inside a file, and code:\n    return x ** 2  # c\n"
)


@pytest.fixture(scope="module")
def tok(gpt2_bpe_file):
    return load_tokenizer(gpt2_bpe_file)


@pytest.fixture(scope="module")
def prepare(gpt2_bpe_file):
    """`meshlm.prepare.prepare` with the test tokenizer, in-process unless a test asks for workers."""
    return functools.partial(preparing.prepare, tokenizer=gpt2_bpe_file)


@pytest.fixture
def small_pieces(monkeypatch):
    """Text goes to the tokenizer in pieces of ~64 characters, so many cut points are exercised."""
    monkeypatch.setattr(corpus, "READ_CHARS", 64)
    monkeypatch.setattr(corpus, "MAX_PIECE_CHARS", 1024)


# --- an independent TFRecord writer: framing, CRC32C and protobuf bytes written out by hand ---


def test_crc32c_oracle_matches_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283


# --- the expected output, computed from the tokenizer ---


@pytest.fixture
def corpus_dir(tmp_path):
    """A folder with every input kind; sorted order: a.txt, b/c.jsonl, b/empty.txt, d.jsonl.zst, e.tfrecord."""
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / "a.txt").write_text(TRICKY * 3, newline="")
    jsonl_docs = ["short doc", TRICKY, "", "x" * 150 + " tail words " * 20]
    write_jsonl(root / "b" / "c.jsonl", jsonl_docs)
    (root / "b" / "empty.txt").write_text("")
    zst_docs = [f"compressed document {i}: " + "words and more words " * i for i in range(6)]
    write_jsonl(root / "d.jsonl.zst", zst_docs, compress=True)
    records = [list(range(100, 137)), [EOT_ID, 5, 6, 7], list(range(50000, 50257))]
    write_tfrecord(root / "e.tfrecord", [example(records[0]), example(records[1], packed=False), example(records[2])])
    (root / ".hidden").write_bytes(b"\0binary that must be skipped")
    docs = [TRICKY * 3, *[d for d in jsonl_docs if d], *zst_docs, *records]
    return root, docs


@pytest.mark.usefixtures("small_pieces")
def test_every_input_kind_gives_exactly_the_expected_rows(tok, prepare, corpus_dir, tmp_path):
    root, docs = corpus_dir
    summary = prepare([root], tmp_path / "out", SEQ, shard_rows=7)
    expected = stream_of(tok, docs)
    np.testing.assert_array_equal(read_rows(tmp_path / "out"), rows_of(expected))
    train = summary["splits"]["train"]
    assert train["tokens"] == len(expected) and train["documents"] == len(docs)
    assert train["dropped_tokens"] == len(expected) % ROW and train["rows"] == len(expected) // ROW
    index = data.read_index(tmp_path / "out")
    assert index["dtype"] == "uint16" and all(n <= 7 for n in index["splits"]["train"]["sequences"])
    assert len(index["splits"]["train"]["files"]) == -(-train["rows"] // 7)


@pytest.mark.usefixtures("small_pieces")
def test_two_runs_are_byte_identical_whatever_the_worker_count(prepare, corpus_dir, tmp_path):
    root, _ = corpus_dir
    prepare([root], tmp_path / "one", SEQ, val_fraction=0.3, seed=1)
    prepare([root], tmp_path / "two", SEQ, val_fraction=0.3, seed=1, workers=2)
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    shards = [f"{split}/00000.{part}bin" for split in ("train", "val") for part in ("", "segments.", "weights.")]
    assert [str(f) for f in files] == ["index.json", *shards]
    for f in files:
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f


def test_val_fraction_sends_whole_documents_by_a_seeded_draw(tok, prepare, tmp_path):
    texts = [f"document {i} says " + "hello " * (i % 7) for i in range(200)]
    write_jsonl(tmp_path / "docs.jsonl", texts)
    summary = prepare([tmp_path / "docs.jsonl"], tmp_path / "out", SEQ, val_fraction=0.25, seed=3)
    to_val = np.random.default_rng(3).random(len(texts)) < 0.25
    val_docs = [t for t, v in zip(texts, to_val, strict=True) if v]
    train_docs = [t for t, v in zip(texts, to_val, strict=True) if not v]
    np.testing.assert_array_equal(read_rows(tmp_path / "out"), rows_of(stream_of(tok, train_docs)))
    np.testing.assert_array_equal(read_rows(tmp_path / "out", "val"), rows_of(stream_of(tok, val_docs)))
    assert summary["splits"]["val"]["documents"] == to_val.sum() and 30 < to_val.sum() < 70


def test_val_files_form_the_validation_split(tok, prepare, tmp_path):
    (tmp_path / "train.txt").write_text("training text, " * 40)
    (tmp_path / "val.txt").write_text("held out text, " * 30)
    prepare([tmp_path / "train.txt"], tmp_path / "out", SEQ, val_inputs=[tmp_path / "val.txt"])
    np.testing.assert_array_equal(read_rows(tmp_path / "out"), rows_of(stream_of(tok, ["training text, " * 40])))
    np.testing.assert_array_equal(read_rows(tmp_path / "out", "val"), rows_of(stream_of(tok, ["held out text, " * 30])))


def test_cli_prepares_and_reports(tok, gpt2_bpe_file, tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text for the command line " * 20)
    args = ["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--seq-len", "16"]
    assert cli.main([*args, "--workers", "1", "--tokenizer", gpt2_bpe_file]) == 0
    assert "train: " in capsys.readouterr().out
    expected = rows_of(stream_of(tok, ["some text for the command line " * 20]))
    np.testing.assert_array_equal(read_rows(tmp_path / "out"), expected)
    assert cli.main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshlm prepare: error: ") and "already holds a prepared dataset" in err
    assert "\n" not in err


def bad_inputs(tmp_path: Path) -> dict[str, tuple[list, str]]:
    """name -> (inputs, expected error) for inputs that must be refused with a one-line message."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.jsonl").write_text("\n" + json.dumps({"text": ""}) + "\n")
    (tmp_path / "few.txt").write_text("too short")
    (tmp_path / "long.txt").write_text("plenty of good text " * 50)
    (tmp_path / "data.gz").write_bytes(b"\x1f\x8b\x08\x00")
    (tmp_path / "blob").write_bytes(b"\x00\x01\x02 binary")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (tmp_path / "nofield.jsonl").write_text('{"content": "wrong field"}\n')
    (tmp_path / "notstr.jsonl").write_text('{"text": ["a", "b"]}\n')
    (tmp_path / "bad.jsonl.zst").write_bytes(b"this is not zstandard data")
    (tmp_path / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    good = [example(list(range(40))), example(list(range(40)))]
    write_tfrecord(tmp_path / "corrupt.tfrecord", good)
    raw = bytearray((tmp_path / "corrupt.tfrecord").read_bytes())
    raw[len(raw) - 10] ^= 0xFF  # a byte inside the second record's data
    (tmp_path / "corrupt.tfrecord").write_bytes(bytes(raw))
    write_tfrecord(tmp_path / "truncated.tfrecord", good)
    (tmp_path / "truncated.tfrecord").write_bytes((tmp_path / "truncated.tfrecord").read_bytes()[:-20])
    write_tfrecord(tmp_path / "wrongname.tfrecord", [example([1, 2, 3], name="tokens")])
    write_tfrecord(tmp_path / "range.tfrecord", [example([1, 2, 60000])])
    p = tmp_path
    return {
        "missing": ([p / "nope.txt"], "nope.txt: no such file or directory"),
        "empty": ([p / "empty.txt", p / "empty.jsonl"], "no tokens in the input"),
        "short": ([p / "few.txt"], "train split holds 3 tokens in 1 document(s), fewer than one row"),
        "gz": ([p / "data.gz"], "data.gz: unknown file type"),
        "binary": ([p / "blob"], "blob: unknown file type"),
        "json": ([p / "bad.jsonl"], "bad.jsonl:2: not valid JSON"),
        "json_after_rows_were_written": ([p / "long.txt", p / "bad.jsonl"], "bad.jsonl:2: not valid JSON"),
        "field": ([p / "nofield.jsonl"], "nofield.jsonl:1: no 'text' field"),
        "notstr": ([p / "notstr.jsonl"], "notstr.jsonl:1: field 'text' is list, expected a string"),
        "zst": ([p / "bad.jsonl.zst"], "bad.jsonl.zst: truncated or corrupt zstd stream"),
        "utf8": ([p / "latin1.txt"], "latin1.txt: not UTF-8 text"),
        "crc": ([p / "corrupt.tfrecord"], "corrupt.tfrecord: record 1: data checksum mismatch"),
        "truncated": ([p / "truncated.tfrecord"], "truncated.tfrecord: record 1: truncated"),
        "feature": ([p / "wrongname.tfrecord"], "record 0: no feature 'text'"),
        "range": ([p / "range.tfrecord"], "range.tfrecord: holds token id 60000, outside"),
    }


def test_bad_inputs_are_refused_with_a_clear_message(prepare, tmp_path, monkeypatch):
    monkeypatch.setattr(preparing._Packer, "FLUSH", 1)  # rows reach the disk at once, so clean-up is tested too
    for name, (inputs, message) in bad_inputs(tmp_path).items():
        out = tmp_path / f"out-{name}"
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
            prepare(inputs, out, SEQ)
        assert "\n" not in str(info.value), name
        assert not out.exists(), name  # nothing left behind


def test_bad_settings_are_refused(prepare, tmp_path):
    (tmp_path / "a.txt").write_text("text " * 100)
    for kwargs, message in [
        ({"seq_len": 0}, "seq_len must be a positive integer, got 0"),
        ({"seq_len": SEQ, "val_fraction": 1.0}, r"val_fraction must be in \[0, 1\)"),
        ({"seq_len": SEQ, "val_fraction": 0.1, "val_inputs": [tmp_path / "a.txt"]}, "not both"),
        ({"seq_len": SEQ, "workers": 0}, "workers must be at least 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            prepare([tmp_path / "a.txt"], tmp_path / "out", **kwargs)
    prepare([tmp_path / "a.txt"], tmp_path / "out", SEQ)
    with pytest.raises(ConfigError, match="out: already holds a prepared dataset"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", SEQ)


def test_safe_cuts_never_change_the_tokens(tok):
    """Cutting text at every safe point and tokenizing the pieces gives the ids of the whole text."""
    text = TRICKY * 4
    cuts = [m.start() for m in corpus._SAFE_CUT.finditer(text)]
    assert len(cuts) > 40
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert [i for p in pieces for i in tok.encode(p)] == tok.encode(text)
