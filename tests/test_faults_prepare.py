"""`meshlm prepare` faults: an output folder is never written over unasked nor left half-written, even by a
killed run, and an input cut short is refused with one line naming the file rather than read up to the cut."""

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zstandard

from meshlm import cli
from meshlm.tokenizer import load_tokenizer
from tests.helpers.corpus_files import SEQ, example, read_rows, rows_of, stream_of, write_jsonl, write_tfrecord

DOCS = [f"document {i}: " + "some words of text " * (i % 7 + 1) for i in range(60)]
UNFINISHED = ".prepare-unfinished"

Prepare = Callable[..., tuple[int, str]]


@pytest.fixture(scope="module")
def expected(gpt2_bpe_file: str) -> np.ndarray:
    """The rows of DOCS, from the tokenizer directly."""
    return rows_of(stream_of(load_tokenizer(gpt2_bpe_file), DOCS))


@pytest.fixture
def prepare(gpt2_bpe_file: str, capsys: pytest.CaptureFixture) -> Prepare:
    """`meshlm prepare ARGS` in-process; returns its exit code and stderr."""

    def run(*args: object) -> tuple[int, str]:
        common = ["--seq-len", str(SEQ), "--workers", "1", "--tokenizer", gpt2_bpe_file]
        code = cli.main(["prepare", *map(str, args), *common])
        return code, capsys.readouterr().err

    return run


def assert_refused(code: int, err: str, *words: str) -> None:
    """Exit 1 and one line of error after the progress bar, no traceback, holding every word."""
    assert code == 1, err
    line = err.rstrip("\n").rpartition("\n")[2]
    assert line.startswith("meshlm prepare: error: ") and err.count("error:") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in line, (word, line)


def unfinished(out: Path) -> Path:
    return out.with_name(out.name + UNFINISHED)


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "docs.jsonl", DOCS)
    return tmp_path / "docs.jsonl"


# --- 2: an existing folder is written over only with --overwrite ---


def test_a_folder_that_is_not_empty_is_written_over_only_when_asked(prepare, docs, expected, tmp_path):
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / "train" / "00000.bin").write_bytes(b"someone else's shard")
    (out / "notes.txt").write_text("keep me")
    assert_refused(*prepare(docs, "--out", out), f"{out}: exists and is not empty", "--overwrite")
    assert (out / "train" / "00000.bin").read_bytes() == b"someone else's shard"
    assert not unfinished(out).exists()

    assert prepare(docs, "--out", out, "--overwrite")[0] == 0
    np.testing.assert_array_equal(read_rows(out), expected)
    assert (out / "notes.txt").read_text() == "keep me"  # only the dataset's own entries are replaced
    assert not unfinished(out).exists()
    assert_refused(*prepare(docs, "--out", out), f"{out}: already holds a prepared dataset", "--overwrite")

    (tmp_path / "empty").mkdir()  # an empty folder holds nothing to overwrite
    assert prepare(docs, "--out", tmp_path / "empty")[0] == 0
    np.testing.assert_array_equal(read_rows(tmp_path / "empty"), expected)


def test_a_failed_overwrite_keeps_the_old_dataset(prepare, docs, expected, tmp_path):
    out = tmp_path / "out"
    assert prepare(docs, "--out", out)[0] == 0
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    assert_refused(*prepare(docs, tmp_path / "bad.jsonl", "--out", out, "--overwrite"), "bad.jsonl:2: not valid JSON")
    np.testing.assert_array_equal(read_rows(out), expected)
    assert not unfinished(out).exists()


# --- 3 and 16: an input cut short is refused, naming the file ---


def cut_inputs(tmp_path: Path) -> dict[str, tuple[list[Path], str]]:
    """name -> (inputs, expected error) for inputs cut short; each holds whole rows before the cut."""
    write_jsonl(tmp_path / "whole.jsonl", DOCS)
    lines = (tmp_path / "whole.jsonl").read_bytes()
    rows = lines.splitlines(keepends=True)
    frames = [zstandard.compress(b"".join(rows[i : i + 20])) for i in range(0, len(rows), 20)]  # whole lines each

    def cut(frame: int, size: int) -> bytes:
        """The frames, ending `size` bytes into frame number `frame` (0-based)."""
        return b"".join(frames[:frame]) + frames[frame][:size]

    (tmp_path / "multi.jsonl.zst").write_bytes(cut(1, 8))  # zstandard's reader gave frame 0 alone, with exit 0
    (tmp_path / "mid_block.jsonl.zst").write_bytes(cut(1, len(frames[1]) // 2))
    (tmp_path / "single.jsonl.zst").write_bytes(zstandard.compress(lines)[:-20])
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", DOCS)
    (folder / "b.jsonl.zst").write_bytes(cut(2, 8))
    (folder / "c.txt").write_text(DOCS[0])
    (tmp_path / "cut.jsonl").write_bytes(lines[: lines.rindex(b"some words")])
    write_tfrecord(tmp_path / "whole.tfrecord", [example(list(range(40)))] * 3)
    records = (tmp_path / "whole.tfrecord").read_bytes()
    (tmp_path / "record.tfrecord").write_bytes(records[:-20])
    (tmp_path / "header.tfrecord").write_bytes(records[: len(records) // 3 * 2 + 5])  # 5 bytes of the 3rd header
    zstd = "truncated or corrupt zstd stream (the file ends inside a frame)"
    p = tmp_path
    return {
        "zst_multi_frame": ([p / "multi.jsonl.zst"], f"{p / 'multi.jsonl.zst'}: {zstd}"),
        "zst_mid_block": ([p / "mid_block.jsonl.zst"], f"{p / 'mid_block.jsonl.zst'}: {zstd}"),
        "zst_single_frame": ([p / "single.jsonl.zst"], f"{p / 'single.jsonl.zst'}: {zstd}"),
        "zst_in_a_folder": ([folder], f"{folder / 'b.jsonl.zst'}: {zstd}"),
        "jsonl": (
            [p / "cut.jsonl"],
            f"{p / 'cut.jsonl'}:{len(DOCS)}: not valid JSON (Unterminated string starting at: column 20); "
            "the file ends inside this line: is it truncated?",
        ),
        "tfrecord": ([p / "record.tfrecord"], f"{p / 'record.tfrecord'}: record 2: truncated"),
        "tfrecord_header": ([p / "header.tfrecord"], f"{p / 'header.tfrecord'}: record 2: truncated"),
    }


def test_an_input_cut_short_is_refused_naming_the_file(prepare, tmp_path):
    for name, (inputs, message) in cut_inputs(tmp_path).items():
        out = tmp_path / f"out-{name}"
        code, err = prepare(*inputs, "--out", out)
        assert_refused(code, err, message)
        assert "at at" not in err
        assert not out.exists() and not unfinished(out).exists(), name


# --- 15: a killed run leaves nothing at --out, and a rerun says what it left ---

KILLED_MID_RUN = """
import os, signal, sys
from meshlm import cli, data, prepare

prepare._Packer.FLUSH = 1  # rows reach the disk document by document
end_shard = data.ShardWriter.end_shard


def end_shard_then_die(self):
    end_shard(self)
    if len(self.files) == 5:  # five whole shards on disk, more to come: killed as kill -9 would
        os.kill(os.getpid(), signal.SIGKILL)


data.ShardWriter.end_shard = end_shard_then_die
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_killed_prepare_leaves_nothing_at_out_and_a_rerun_says_so(prepare, docs, expected, gpt2_bpe_file, tmp_path):
    """The child kills itself with SIGKILL once its fifth shard is written: the same as kill -9 from outside
    (no handler runs), at a point that does not depend on timing."""
    out = tmp_path / "out"
    args = [docs, "--out", out, "--shard-rows", "2"]
    common = ["--seq-len", SEQ, "--workers", "1", "--tokenizer", gpt2_bpe_file]
    child = [sys.executable, "-c", KILLED_MID_RUN, "prepare", *map(str, args + common)]
    assert subprocess.run(child, capture_output=True, timeout=120).returncode == -signal.SIGKILL
    assert not out.exists()
    assert len(list((unfinished(out) / "train").glob("*.bin"))) >= 5

    assert_refused(*prepare(*args), f"{unfinished(out)}: an unfinished prepare of {out}", "--overwrite")
    assert prepare(*args, "--overwrite")[0] == 0
    np.testing.assert_array_equal(read_rows(out), expected)
    assert not unfinished(out).exists()


# --- issue 42: bad settings and bad records are one line, and leave nothing behind ---


def test_a_bad_shard_rows_is_refused_before_anything_is_made(prepare, docs, expected, tmp_path):
    out = tmp_path / "out"
    assert_refused(*prepare(docs, "--out", out, "--shard-rows", 0), "shard_rows must be a positive integer, got 0")
    assert not out.exists() and not unfinished(out).exists()
    assert prepare(docs, "--out", out)[0] == 0  # not refused as an unfinished run
    np.testing.assert_array_equal(read_rows(out), expected)


def test_an_absurd_seq_len_is_refused_in_one_line(docs, gpt2_bpe_file, capsys, tmp_path):
    out = tmp_path / "out"
    args = ["prepare", str(docs), "--out", str(out), "--workers", "1", "--tokenizer", gpt2_bpe_file]
    code = cli.main([*args, "--seq-len", "2000000000"])  # a row of it would take 15 GiB to assemble
    assert_refused(code, capsys.readouterr().err, "seq_len 2,000,000,000 is beyond 1,048,576 tokens")
    assert not out.exists() and not unfinished(out).exists()


PLAIN = "{% for m in messages %}{{ m.content }}{% endfor %}"
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize(
    ("record", "template", "message"),
    [
        (CHAT, "{% for m in messages %}{{ m.content }}{{ 1 // 0 }}{% endfor %}",
         "the chat template failed on this chat: ZeroDivisionError: integer division or modulo by zero"),
        ({**CHAT, "chat_template_kwargs": {"messages": []}}, PLAIN,
         "chat_template_kwargs sets 'messages', which the chat template is given by the record itself"),
        ({**CHAT, "chat_template_kwargs": {"add_generation_prompt": True}}, PLAIN,
         "chat_template_kwargs sets 'add_generation_prompt'"),
        ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", None,
         "JSON nested too deeply to read"),
    ],
    ids=["template-runtime-error", "kwargs-messages", "kwargs-add-generation-prompt", "deeply-nested-json"],
)  # fmt: skip
@pytest.mark.parametrize("workers", [1, 2])
def test_a_record_that_cannot_be_encoded_is_one_line_naming_it(
    record, template, message, workers, gpt2_bpe_file, capsys, tmp_path
):
    records = tmp_path / "records.jsonl"
    line = record if isinstance(record, str) else json.dumps(record)
    records.write_text(json.dumps(CHAT if template else {"text": "fine"}) + "\n" + line + "\n")
    args = ["prepare", str(records), "--out", str(tmp_path / "out"), "--seq-len", str(SEQ)]
    args += ["--workers", str(workers), "--tokenizer", gpt2_bpe_file]
    if template:
        (tmp_path / "chat.jinja").write_text(template)
        args += ["--chat-template", str(tmp_path / "chat.jinja")]
    code = cli.main(args)
    where = f"{records}:1: " if template and "1 // 0" in template else f"{records}:2: "
    assert_refused(code, capsys.readouterr().err, where + message)
    assert not (tmp_path / "out").exists() and not unfinished(tmp_path / "out").exists()
