"""`meshlm prepare` on instruction and preference records: the token ids and loss masks trl 1.16 builds (its own
tokenization code is the oracle), packing that never splits an example, the version-2 folder read back through
TokenDataset and TrainLoader, and one-line errors for bad records."""

import functools
import json
import os
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from meshlm import cli, data
from meshlm import prepare as preparing
from meshlm.config import ConfigError
from meshlm.loader import TrainLoader, eval_batches
from meshlm.tokenizer import load_tokenizer
from tests.helpers.chat_templates import CHATML, CHATML_GENERATION, LLAMA2, tokenizer_folder

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # ORPOTrainer lives in trl.experimental

SEQ = 127
ROW = SEQ + 1
WORDS = ["the", "sky", "is", "blue", "and", "grass", "green", "while", "a", "list", "holds", "items", "in", "order",
         "tuples", "do", "not", "change"]  # fmt: skip


def sentence(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, n))


def text_records(n: int = 12, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt": f"Q{i}: {sentence(rng, 3 + i % 4)}?", "completion": f" {sentence(rng, 2 + i % 5)}."}
            for i in range(n)]  # fmt: skip


def chat(user: str, assistant: str, system: str | None = None) -> list[dict]:
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def chat_records(n: int = 10, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        turns = chat(sentence(rng, 4), sentence(rng, 3 + i % 3), "Be brief." if i % 2 else None)
        if i % 3 == 0:  # two exchanges
            turns += chat(sentence(rng, 2), sentence(rng, 4))
        records.append({"messages": turns})
    return records


def conversational_pc(n: int = 8) -> list[dict]:
    return [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in chat_records(n)]


def pairs(n: int = 10, seed: int = 2, conversational: bool = False) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt, good, bad = f"Q{i}: {sentence(rng, 3)}?", f" {sentence(rng, 2 + i % 3)}.", f" {sentence(rng, 4)}!"
        if conversational:
            prompt, good, bad = [{"role": "user", "content": prompt}], *([{"role": "assistant", "content": a}]
                                                                         for a in (good, bad))  # fmt: skip
        out.append({"prompt": prompt, "chosen": good, "rejected": bad})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer folders: ChatML; Llama-2's template with a BOS before every text (as Llama's tokenizer adds); ChatML
    with {% generation %} blocks; none."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "chatml": tokenizer_folder(root / "chatml", CHATML),
        "llama": tokenizer_folder(root / "llama", LLAMA2, bos=True),
        "generation": tokenizer_folder(root / "generation", CHATML_GENERATION),
        "plain": tokenizer_folder(root / "plain"),
    }


@pytest.fixture
def prepare(tmp_path):
    """prepare(records or files, **options) -> (summary, folder), in-process, into a fresh folder."""
    count = iter(range(1000))

    def run(inputs, tokenizer: Path, **kwargs):
        n = next(count)
        if isinstance(inputs[0], dict):
            inputs = [write_jsonl(tmp_path / f"in{n}.jsonl", inputs)]
        out = tmp_path / f"out{n}"
        summary = preparing.prepare(inputs, out, kwargs.pop("seq_len", SEQ), tokenizer=tokenizer, workers=1, **kwargs)
        return summary, out

    return run


def all_rows(folder: Path, split: str = "train") -> data.Batch:
    ds = data.TokenDataset(folder, split)
    return ds[np.arange(ds.rows)]


def unpadded(batch: data.Batch, i: int) -> tuple[list[int], list[int]]:
    """Row i's tokens and weights where its segment is not padding."""
    keep = batch.segments[i] > 0
    return batch.tokens[i][keep].tolist(), batch.weights[i][keep].astype(int).tolist()


# --- trl's own tokenization, run on the same records ---


@functools.cache
def hf(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def trl_args(config_class, **kwargs):
    return config_class(output_dir="/tmp/unused", report_to="none", bf16=False, use_cpu=True, **kwargs)


def trl_sft(folder: Path, records: list[dict], **kwargs) -> list[tuple[list[int], list[int]]]:
    """(input_ids, weights) per record from SFTTrainer's dataset preparation; a token's weight is 1 where its label
    is kept (the first token has no prediction: 0)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    completion_only = kwargs.pop("completion_only_loss", True)
    args = trl_args(SFTConfig, max_length=None, completion_only_loss=completion_only, **kwargs)
    trainer = types.SimpleNamespace(_tokenizer=hf(folder), completion_only_loss=completion_only, chat_template=None)
    prepared = SFTTrainer._prepare_dataset(trainer, Dataset.from_list(records), hf(folder), args, False, None, "t")
    return [(r["input_ids"], [0] + [int(x != -100) for x in r["labels"][1:]]) for r in prepared]


def trl_dpo(folder: Path, records: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(ids, weights) of chosen then rejected for each pair, from DPOTrainer's dataset preparation and collator."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    trainer = types.SimpleNamespace(_tokenizer=hf(folder))
    prepared = DPOTrainer._prepare_dataset(trainer, Dataset.from_list(records), hf(folder), trl_args(DPOConfig), "t")
    rows = []
    for r in prepared:
        for answer in (r["chosen_ids"], r["rejected_ids"]):
            rows.append((r["prompt_ids"] + answer, [0] * len(r["prompt_ids"]) + [1] * len(answer)))
    return [(ids, [0, *w[1:]]) for ids, w in rows]


def trl_orpo(folder: Path, records: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(ids, weights) of chosen then rejected for each pair, from ORPOTrainer's `tokenize_row`."""
    from trl.data_utils import maybe_apply_chat_template
    from trl.experimental.orpo import ORPOTrainer

    trainer = types.SimpleNamespace(is_encoder_decoder=False, processing_class=hf(folder), max_length=1024)
    trainer.build_tokenized_answer = functools.partial(ORPOTrainer.build_tokenized_answer, trainer)
    rows = []
    for record in records:
        row = ORPOTrainer.tokenize_row(trainer, maybe_apply_chat_template(record, hf(folder)))
        for side in ("chosen", "rejected"):
            labels = row[f"{side}_labels"]
            rows.append((row[f"{side}_input_ids"], [0] + [int(x != -100) for x in labels[1:]]))
    return rows


def assert_rows(batch: data.Batch, expected: list[tuple[list[int], list[int]]]) -> None:
    """One example per row, in order: its tokens and weights, then padding."""
    assert len(batch.tokens) == len(expected)
    for i, (ids, weights) in enumerate(expected):
        assert unpadded(batch, i) == (ids, weights), i
        assert (batch.segments[i] == np.r_[np.ones(len(ids)), np.zeros(ROW - len(ids))]).all()


# --- the token ids and masks trl builds ---


@pytest.mark.parametrize("folder", ["chatml", "llama"])
def test_prompt_completion_text_equals_trl_sft(folders, prepare, folder):
    """EOS text appended to the completion, prompt + completion tokenized as one string with the tokenizer's own BOS
    (the Llama-style folder adds one), the completion from where the prompt's ids stop agreeing."""
    records = text_records()
    summary, out = prepare(records, folders[folder], pack=False)
    assert summary["kind"] == "lm" and summary["splits"]["train"]["examples"] == len(records)
    assert_rows(all_rows(out), trl_sft(folders[folder], records))
    if folder == "llama":
        assert all(all_rows(out).tokens[:, 0] == hf(folders[folder]).bos_token_id)
    _, everything = prepare(records, folders[folder], pack=False, train_on="all")
    assert_rows(all_rows(everything), trl_sft(folders[folder], records, completion_only_loss=False))


def test_prompt_completion_chats_equal_trl_sft(folders, prepare):
    records = conversational_pc()
    _, out = prepare(records, folders["chatml"], pack=False)
    assert_rows(all_rows(out), trl_sft(folders["chatml"], records))


def test_messages_equal_trl_assistant_only_loss(folders, prepare):
    """With {% generation %} blocks the mask is trl's `assistant_only_loss=True`; `--train-on all` is trl's default."""
    records = chat_records()
    _, out = prepare(records, folders["generation"], pack=False)
    assert_rows(all_rows(out), trl_sft(folders["generation"], records, assistant_only_loss=True))
    _, everything = prepare(records, folders["generation"], pack=False, train_on="all")
    assert_rows(all_rows(everything), trl_sft(folders["generation"], records))


def test_messages_without_generation_blocks_train_on_the_assistant_turns(folders, prepare):
    """trl refuses assistant_only_loss here; meshlm masks each assistant message and its end of turn."""
    records = chat_records()
    _, out = prepare(records, folders["chatml"], pack=False)
    batch, tok = all_rows(out), load_tokenizer(folders["chatml"])
    for i, (ids, _) in enumerate(trl_sft(folders["chatml"], records)):
        tokens, weights = unpadded(batch, i)
        assert tokens == ids
        trained = "".join(tok.decode([t]) for t, w in zip(tokens, weights, strict=True) if w)
        turns = [m["content"] + "<|im_end|>\n" for m in records[i]["messages"] if m["role"] == "assistant"]
        assert trained == "".join(turns)


@pytest.mark.parametrize("conversational", [False, True])
def test_preference_pairs_equal_trl_dpo(folders, prepare, conversational):
    records = pairs(conversational=conversational)
    summary, out = prepare(records, folders["llama" if not conversational else "chatml"])
    assert summary["kind"] == "preference" and summary["splits"]["train"]["rows"] == 2 * len(records)
    assert_rows(all_rows(out), trl_dpo(folders["llama" if not conversational else "chatml"], records))
    assert data.read_index(out)["objective"] == "dpo"


@pytest.mark.parametrize("conversational", [False, True])
def test_preference_pairs_equal_trl_orpo(folders, prepare, conversational):
    """ORPO tokenizes otherwise: no special tokens, then the BOS id first and the EOS id last (GPT-J-style
    tokenizers have a BOS that DPO never adds), and chats rendered to text first."""
    folder = folders["chatml"]
    records = pairs(conversational=conversational)
    _, out = prepare(records, folder, objective="orpo")
    expected = trl_orpo(folder, records)
    assert_rows(all_rows(out), expected)
    assert expected[0][0][0] == hf(folder).bos_token_id and expected[0] != trl_dpo(folder, records)[0]


# --- the dataset read back ---


def test_pairs_stay_together_and_batch_size_counts_them(folders, prepare):
    records = pairs(12)
    _, out = prepare(records, folders["chatml"])
    ds = data.TokenDataset(out)
    assert ds.kind == "preference" and len(ds) == 12 and ds.rows == 24
    rows = all_rows(out)
    chosen_of = {tuple(unpadded(rows, 2 * j)[0]): j for j in range(12)}

    loader = TrainLoader(ds, batch_size=4, micro_batches=2, seed=3)
    batch = next(loader)
    assert batch.tokens.shape == (2, 4, ROW) and batch.rows.shape == (2, 4) and batch.weights.dtype == np.float32
    assert (batch.rows[..., 1::2] == batch.rows[..., ::2] + 1).all() and (batch.rows[..., ::2] % 2 == 0).all()
    for m in range(2):
        for k in range(0, 4, 2):  # the pair: chosen then rejected of the same record
            j = chosen_of[tuple(batch.tokens[m, k][batch.segments[m, k] > 0].tolist())]
            np.testing.assert_array_equal(batch.tokens[m, k + 1], rows.tokens[2 * j + 1])
    assert loader.state.position == 4  # pairs consumed
    halves = [next(TrainLoader(ds, 4, 2, seed=3, process_index=p, process_count=2)) for p in range(2)]
    assert halves[0].tokens.shape == (2, 2, ROW)
    np.testing.assert_array_equal(np.concatenate([h.rows for h in halves], axis=1), batch.rows)

    (tokens, weights), *_ = batches = list(eval_batches(ds, batch_size=5, max_batches=3))
    assert tokens.rows.tolist() == list(range(10)) and weights.tolist() == [1] * 10
    assert batches[-1][0].rows.tolist() == [20, 21, 22, 23] + [0, 1] * 3
    assert batches[-1][1].tolist() == [1] * 4 + [0] * 6


def test_version_1_folders_still_load(tmp_path):
    """A folder written before weights and segments: one document per row, every token but the first trained."""
    tokens = np.arange(6 * ROW).reshape(6, ROW) % 500
    (tmp_path / "train").mkdir()
    tokens.astype("<u2").tofile(tmp_path / "train" / "00000.bin")
    index = {"format": "meshlm-tokens", "version": 1, "seq_len": SEQ, "dtype": "uint16", "eos_id": 0,
             "splits": {"train": {"files": ["train/00000.bin"], "sequences": [6]}}}  # fmt: skip
    (tmp_path / "index.json").write_text(json.dumps(index))
    ds = data.TokenDataset(tmp_path)
    assert ds.kind == "lm" and len(ds) == ds.rows == 6
    batch = ds[[4, 1]]
    np.testing.assert_array_equal(batch.tokens, tokens[[4, 1]])
    assert (batch.segments == 1).all() and (batch.weights[:, 0] == 0).all() and (batch.weights[:, 1:] == 1).all()
    assert next(TrainLoader(ds, batch_size=2)).weights.shape == (1, 2, ROW)


def test_parquet_and_zstd_read_like_jsonl(folders, prepare, tmp_path):
    """Parquet row groups of 3 rows are streamed one at a time, messages as lists of structs; .jsonl.zst in two
    frames."""
    records = chat_records(10)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chats.parquet", row_group_size=3)
    assert pq.ParquetFile(tmp_path / "chats.parquet").num_row_groups == 4
    lines = write_jsonl(tmp_path / "chats.jsonl", records).read_bytes()
    half = len(lines) // 2
    (tmp_path / "chats.jsonl.zst").write_bytes(zstandard.compress(lines[:half]) + zstandard.compress(lines[half:]))
    _, from_jsonl = prepare(records, folders["chatml"])
    for other in ("chats.parquet", "chats.jsonl.zst"):
        _, out = prepare([tmp_path / other], folders["chatml"])
        for a, b in zip(all_rows(out), all_rows(from_jsonl), strict=True):
            np.testing.assert_array_equal(a, b)
    texts = [{"text": sentence(np.random.default_rng(i), 30)} for i in range(8)]
    pq.write_table(pa.Table.from_pylist(texts), tmp_path / "texts.parquet", row_group_size=3)
    _, text_parquet = prepare([tmp_path / "texts.parquet"], folders["chatml"])
    _, text_jsonl = prepare(texts, folders["chatml"])
    np.testing.assert_array_equal(all_rows(text_parquet).tokens, all_rows(text_jsonl).tokens)


# --- packing ---


def varied_records(n: int, seed: int = 5) -> list[dict]:
    """Prompt/completion records of long-tailed lengths, some longer than a row."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(2.3, 0.8, n).astype(int), 1, 80)
    return [{"prompt": f"Q{i}: {sentence(rng, 1 + k // 3)}?", "completion": f" {sentence(rng, 1 + k - k // 3)}."}
            for i, k in enumerate(lengths)]  # fmt: skip


def documents(batch: data.Batch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every packed document (tokens, weights), checking the row layout on the way: segments 1..k in order, then only
    padding (0); weight 0 at each document's first token (column 0 among them) and on padding."""
    docs = []
    for tokens, weights, segments in zip(batch.tokens, batch.weights, batch.segments, strict=True):
        used = segments[segments > 0]
        assert (segments[len(used) :] == 0).all() and used[0] == 1 and set(np.diff(used)) <= {0, 1}
        firsts = np.flatnonzero(np.diff(segments, prepend=-1))
        assert (weights[firsts] == 0).all() and (weights[segments == 0] == 0).all()
        for s in range(1, used[-1] + 1):
            docs.append((tuple(tokens[segments == s].tolist()), tuple(weights[segments == s].astype(int).tolist())))
    return docs


@pytest.mark.parametrize("buffer_rows", [1024, 4])
def test_packing_keeps_every_example_whole_and_fills_rows(folders, prepare, monkeypatch, buffer_rows):
    """Each example is one document of one row (the --no-pack rows hold them one by one); rows are packed best-fit:
    no more rows than first-fit-decreasing needs. A small buffer (4 rows) packs in many rounds, holding back."""
    monkeypatch.setattr(preparing, "PACK_BUFFER_ROWS", buffer_rows)
    records = varied_records(300)
    summary, packed = prepare(records, folders["chatml"], truncate="drop")
    _, single = prepare(records, folders["chatml"], truncate="drop", pack=False)
    alone = documents(all_rows(single))
    assert sorted(documents(all_rows(packed))) == sorted(alone)
    lengths = sorted((len(t) for t, _ in alone), reverse=True)
    bins: list[int] = []  # first-fit decreasing over all the examples at once
    for n in lengths:
        for b, used in enumerate(bins):
            if used + n <= ROW:
                bins[b] += n
                break
        else:
            bins.append(n)
    train = summary["splits"]["train"]
    assert train["rows"] <= len(bins) + (0 if buffer_rows > 100 else len(bins) // 10)
    efficiency = train["tokens"] / (train["tokens"] + train["padding"])
    assert train["tokens"] == sum(lengths) and efficiency > (0.95 if buffer_rows > 100 else 0.85), efficiency


def test_packing_is_deterministic_whatever_the_worker_count(folders, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", varied_records(200))
    write_jsonl(tmp_path / "b.jsonl", [{"text": sentence(np.random.default_rng(i), 40)} for i in range(30)])
    common = dict(tokenizer=folders["chatml"], val_fraction=0.2, seed=4)
    preparing.prepare([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "one", SEQ, workers=1, **common)
    preparing.prepare([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "two", SEQ, workers=2, **common)
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert len(files) == 7
    for f in files:
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f


def test_no_pack_pads_each_example_alone(folders, prepare):
    records = text_records(5)
    _, out = prepare(records, folders["chatml"], pack=False)
    batch = all_rows(out)
    pad = hf(folders["chatml"]).pad_token_id
    for i in range(5):
        n = int((batch.segments[i] == 1).sum())
        assert (batch.tokens[i, n:] == pad).all() and (batch.segments[i, n:] == 0).all() and n > 5
        assert (batch.weights[i, n:] == 0).all()


def test_text_records_keep_their_stream_packing(folders, prepare, tmp_path):
    """{"text"} rows are cut from one stream as before, whatever --train-on, --no-pack and --truncate say, and sit
    beside packed chat rows in one dataset."""
    texts = [{"text": sentence(np.random.default_rng(i), 50)} for i in range(6)]
    _, plain = prepare(texts, folders["chatml"])
    _, other = prepare(texts, folders["chatml"], train_on="all", pack=False, truncate="drop")
    for name in ("00000.bin", "00000.weights.bin", "00000.segments.bin"):
        assert (plain / "train" / name).read_bytes() == (other / "train" / name).read_bytes()
    batch = all_rows(plain)
    tok = load_tokenizer(folders["chatml"])
    stream = [i for t in texts for i in [*tok.encode(t["text"]), tok.eot_id]]
    np.testing.assert_array_equal(batch.tokens.ravel(), stream[: batch.tokens.size])
    assert (batch.segments == 1).all() and (batch.weights[:, 0] == 0).all() and (batch.weights[:, 1:] == 1).all()
    text_file, chats_file = write_jsonl(tmp_path / "t.jsonl", texts), write_jsonl(tmp_path / "c.jsonl", chat_records())
    summary, mixed = prepare([text_file, chats_file], folders["chatml"])
    chats_alone, _ = prepare([chats_file], folders["chatml"])
    train = summary["splits"]["train"]
    assert train["examples"] == 10 and train["documents"] == 6
    assert train["rows"] == len(batch.tokens) + chats_alone["splits"]["train"]["rows"]
    assert data.read_index(mixed)["formats"] == {str(text_file): "text", str(chats_file): "messages"}
    both = [{**record, **text_records(1)[0]} for record in texts]  # text, prompt and completion
    detected, _ = prepare(both, folders["chatml"])
    forced, as_text = prepare(both, folders["chatml"], record_format="text")
    assert detected["splits"]["train"]["examples"] == 6 and forced["splits"]["train"]["examples"] == 0
    np.testing.assert_array_equal(all_rows(as_text).tokens, batch.tokens)


# --- truncation ---


def keep_end(ids: list[int], weights: list[int]) -> tuple[list[int], list[int]]:
    """trl's `truncation_mode="keep_end"` to a row; the new first token has no prediction."""
    return (ids, weights) if len(ids) <= ROW else (ids[-ROW:], [0, *weights[-ROW + 1 :]])


def test_truncation_modes_and_counts(folders, prepare):
    rng = np.random.default_rng(9)
    short = {"prompt": "Q: hi?", "completion": " the sky is blue."}
    long = {"prompt": "Q: long?", "completion": " " + sentence(rng, 150)}  # a long completion
    buried = {"prompt": "Q: " + sentence(rng, 150), "completion": " yes."}  # a prompt filling the row
    records = [short, long, buried]
    sft = trl_sft(folders["chatml"], records)
    assert len(sft[1][0]) > ROW and len(sft[2][0]) > ROW

    summary, right = prepare(records, folders["chatml"], pack=False)
    assert {k: summary["splits"]["train"][k] for k in ("examples", "truncated", "dropped")} == {
        "examples": 2,
        "truncated": 1,
        "dropped": 1,
    }  # fmt: skip (the buried completion is cut away: dropped)
    assert_rows(all_rows(right), [sft[0], (sft[1][0][:ROW], sft[1][1][:ROW])])

    summary, left = prepare(records, folders["chatml"], pack=False, truncate="left")
    assert summary["splits"]["train"]["truncated"] == 2 and summary["splits"]["train"]["dropped"] == 0
    assert_rows(all_rows(left), [keep_end(*example) for example in sft])

    summary, dropped = prepare(records, folders["chatml"], pack=False, truncate="drop")
    assert summary["splits"]["train"]["dropped"] == 2 and summary["splits"]["train"]["truncated"] == 0
    assert_rows(all_rows(dropped), sft[:1])


def test_preference_truncation_cuts_each_sequence_as_trl_collates(folders, prepare):
    rng = np.random.default_rng(3)
    records = [*pairs(2), {"prompt": "Q: " + sentence(rng, 90) + "?", "chosen": " " + sentence(rng, 60),
                           "rejected": " no."}]  # fmt: skip
    dpo = trl_dpo(folders["chatml"], records)
    summary, out = prepare(records, folders["chatml"], truncate="left")
    assert summary["splits"]["train"]["truncated"] == 1
    assert_rows(all_rows(out), [keep_end(*sequence) for sequence in dpo])


# --- bad input ---


def bad_inputs(tmp_path: Path) -> dict[str, tuple[list[Path], str]]:
    """name -> (inputs, the start of the one-line error) for records that must be refused."""
    good = text_records(3)

    def jsonl(name: str, *records) -> Path:
        return write_jsonl(tmp_path / name, [*good, *records] if "pc" in name else list(records))

    talk = chat("hello", "hi there")
    messages = [{"messages": talk}] * 2
    robot = [{"role": "robot", "content": "beep"}, *talk]
    pq.write_table(pa.Table.from_pylist([{"messages": talk}, {"messages": talk[:1]}]), tmp_path / "bad.parquet")
    files = {
        "missing": jsonl("missing_pc.jsonl", {"prompt": "where is the completion?"}),
        "type": jsonl("type_pc.jsonl", {"prompt": 3, "completion": "x"}),
        "mixed_fields": jsonl("mixed_pc.jsonl", {"prompt": talk[:1], "completion": "text"}),
        "empty": jsonl("empty_pc.jsonl", {"prompt": "q", "completion": ""}),
        "role": jsonl("role.jsonl", *messages, {"messages": robot}),
        "content": jsonl("content.jsonl", {"messages": [{"role": "user", "content": ["a"]}, talk[1]]}),
        "no_assistant": jsonl("lonely.jsonl", *messages, {"messages": talk[:1]}),
        "parquet": tmp_path / "bad.parquet",
        "mixed_kinds": jsonl("kinds_pc.jsonl", {"messages": talk}),
        "not_an_object": jsonl("list.jsonl", *messages, ["a", "list"]),
        "no_format": jsonl("nothing.jsonl", {"question": "what?", "answer": "this"}),
    }
    prefs = write_jsonl(tmp_path / "prefs.jsonl", pairs(3))
    p = tmp_path
    return {
        "missing": ([files["missing"]], f"{files['missing']}:4: no 'completion' field, which prompt-completion"),
        "type": ([files["type"]], f"{files['type']}:4: field 'prompt' is int, expected a string or a list"),
        "mixed_fields": ([files["mixed_fields"]], f"{files['mixed_fields']}:4: fields mix text and message lists"),
        "empty": ([files["empty"]], f"{files['empty']}:4: empty completion: 'completion' is empty"),
        "role": ([files["role"]], f"{files['role']}:3: messages[0] has unknown role 'robot'"),
        "content": ([files["content"]], f"{files['content']}:1: messages[0].content is list, expected a string"),
        "no_assistant": ([files["no_assistant"]], f"{files['no_assistant']}:3: a chat with no assistant turn"),
        "parquet": ([files["parquet"]], f"{files['parquet']}: row 1: a chat with no assistant turn"),
        "mixed_kinds": (
            [files["mixed_kinds"]],
            f"{files['mixed_kinds']}:4: a messages record in a file of prompt-completion records",
        ),
        "not_an_object": ([files["not_an_object"]], f"{files['not_an_object']}:3: a record must be a JSON object"),
        "no_format": ([files["no_format"]], f"{files['no_format']}:1: no 'text' field"),
        "preference_mixed": (
            [prefs, files["role"]],
            f"{files['role']}:1: messages records mixed with the preference records of {prefs}:1",
        ),
        "preference_after": ([p / "role.jsonl", prefs], f"{files['role']}:1: messages records mixed"),
    }


def test_bad_records_are_refused_in_one_line_naming_file_and_line(folders, tmp_path, monkeypatch):
    monkeypatch.setattr(preparing, "RECORD_BATCH", 1)  # rows reach the disk record by record: clean-up is tested too
    monkeypatch.setattr(preparing, "PACK_BUFFER_ROWS", 1)
    monkeypatch.setattr(preparing._ExamplePacker, "WRITE_ROWS", 1)
    for name, (inputs, message) in bad_inputs(tmp_path).items():
        out = tmp_path / f"out-{name}"
        with pytest.raises(ConfigError) as info:
            preparing.prepare(inputs, out, SEQ, tokenizer=folders["chatml"], workers=1)
        assert str(info.value).startswith(message), (name, str(info.value))
        assert "\n" not in str(info.value), name
        assert not out.exists() and not out.with_name(out.name + ".prepare-unfinished").exists(), name


def test_a_chat_file_needs_a_chat_template(folders, tmp_path, capsys):
    """Named in one line by the command, with the file and line; --chat-template supplies one."""
    chats = write_jsonl(tmp_path / "chats.jsonl", chat_records(3))
    args = ["prepare", str(chats), "--out", str(tmp_path / "out"), "--seq-len", str(SEQ), "--workers", "1",
            "--tokenizer", str(folders["plain"])]  # fmt: skip
    assert cli.main(args) == 1
    err = capsys.readouterr().err.strip().rpartition("\n")[2]
    assert (
        err.startswith(f"meshlm prepare: error: {chats}:1: a chat record, but the tokenizer ")
        and "--chat-template" in err
    )
    assert not (tmp_path / "out").exists()
    (tmp_path / "chatml.jinja").write_text(CHATML)
    assert cli.main([*args, "--chat-template", str(tmp_path / "chatml.jinja")]) == 0
    preparing.prepare([chats], tmp_path / "reference", SEQ, tokenizer=folders["chatml"], workers=1)
    np.testing.assert_array_equal(all_rows(tmp_path / "out").tokens, all_rows(tmp_path / "reference").tokens)


def test_bad_settings_are_refused(folders, tmp_path):
    prefs = write_jsonl(tmp_path / "prefs.jsonl", pairs(2))
    chats = write_jsonl(tmp_path / "chats.jsonl", chat_records(2))
    for inputs, kwargs, message in [
        ([prefs], {"train_on": "all"}, "train_on 'all' is for prompt/completion and chat data"),
        ([chats], {"objective": "orpo"}, "objective 'orpo' chooses how preference pairs are tokenized"),
        ([chats], {"truncate": "middle"}, r"truncate must be one of \['right', 'left', 'drop'\]"),
        ([chats], {"record_format": "chat"}, "format must be one of"),
        ([tmp_path / "prefs.jsonl"], {"record_format": "messages"}, "prefs.jsonl:1: no 'messages' field"),
    ]:
        with pytest.raises(ConfigError, match=message):
            preparing.prepare(inputs, tmp_path / "out", SEQ, tokenizer=folders["chatml"], workers=1, **kwargs)
        assert not (tmp_path / "out").exists()


def test_cli_flags_and_report(folders, tmp_path, capsys):
    records = write_jsonl(tmp_path / "r.jsonl", [*varied_records(40), *text_records(3)])
    args = ["prepare", str(records), "--out", str(tmp_path / "out"), "--seq-len", str(SEQ), "--workers", "1",
            "--tokenizer", str(folders["chatml"]), "--format", "prompt-completion", "--train-on", "all", "--no-pack",
            "--truncate", "left"]  # fmt: skip
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    index = data.read_index(tmp_path / "out")
    assert (index["version"], index["kind"], index["train_on"], index["pack"], index["truncate"]) == (
        2, "lm", "all", False, "left")  # fmt: skip
    assert "43 examples" in out and "truncated" in out and "padding" in out
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["prepare"].format_help()
    for flag in ("--format", "--chat-template", "--train-on", "--no-pack", "--truncate", "--objective"):
        assert flag in help_text


# --- prompts for reinforcement learning (issue 41) ---


def trl_grpo_prompts(folder: Path, prompts: list) -> list[list[int]]:
    """The prompt ids GRPOTrainer 1.16 generates from: its own `_tokenize_prompts`, on the same tokenizer."""
    from trl import GRPOTrainer

    trainer = types.SimpleNamespace(processing_class=hf(folder), _is_vlm=False, environment_factories=None,
                                    tools=None, chat_template=None, chat_template_kwargs={})  # fmt: skip
    return [list(ids) for ids in GRPOTrainer._tokenize_prompts(trainer, prompts)[0]]


def prompt_records(conversational: bool) -> list[dict]:
    if conversational:
        return [{"prompt": r["messages"][:-1], "answer": r["messages"][-1]["content"], "n": i}
                for i, r in enumerate(chat_records())]  # fmt: skip
    return [{"prompt": r["prompt"], "answer": r["completion"].strip(), "n": i} for i, r in enumerate(text_records())]


@pytest.mark.parametrize("folder, conversational", [("chatml", False), ("llama", False), ("chatml", True)])
def test_prompts_equal_trl_grpo_and_keep_their_records_columns(folders, prepare, folder, conversational):
    """One prompt per row, its ids those trl's GRPOTrainer generates from (text with the tokenizer's own BOS, chats
    by the template with the generation prompt); each row's record (prompt and other columns) beside the rows."""
    records = prompt_records(conversational)
    summary, out = prepare(records, folders[folder], objective="grpo")
    assert summary["kind"] == "prompts" and data.read_index(out)["objective"] == "grpo"
    batch = all_rows(out)
    want = trl_grpo_prompts(folders[folder], [r["prompt"] for r in records])
    assert [unpadded(batch, i)[0] for i in range(len(records))] == want
    want_records = [{"prompt": r["prompt"], "columns": {k: v for k, v in r.items() if k != "prompt"}} for r in records]
    assert data.read_prompt_records(out) == want_records


def test_dropped_prompts_take_their_records_with_them_in_each_split(folders, prepare):
    records = prompt_records(False)
    lengths = [len(ids) for ids in trl_grpo_prompts(folders["chatml"], [r["prompt"] for r in records])]
    seq_len = sorted(lengths)[len(lengths) // 2] - 1  # a row holds seq_len + 1 tokens: the longer half is dropped
    summary, out = prepare(records, folders["chatml"], objective="grpo", truncate="drop", seq_len=seq_len,
                           val_fraction=0.4, seed=3)  # fmt: skip
    kept = 0
    for split in ("train", "val"):
        batch, rows = all_rows(out, split), data.read_prompt_records(out, split)
        assert len(rows) == len(batch.tokens) == summary["splits"][split]["examples"]
        for i, row in enumerate(rows):
            n = row["columns"]["n"]
            assert (
                lengths[n] <= seq_len + 1
                and unpadded(batch, i)[0] == trl_grpo_prompts(folders["chatml"], [records[n]["prompt"]])[0]
            )
        kept += len(rows)
    assert kept == sum(n <= seq_len + 1 for n in lengths) and 0 < kept < len(records)


def test_prompt_records_need_objective_grpo_and_grpo_needs_records(folders, prepare, tmp_path):
    with pytest.raises(ConfigError, match="prompts for reinforcement learning: prepare them with objective grpo"):
        prepare([{"prompt": "What is 2 + 2?", "answer": "4"}], folders["chatml"])
    text = tmp_path / "plain.txt"
    text.write_text("some text")
    with pytest.raises(ConfigError, match="--format prompt reads records"):
        prepare([text], folders["chatml"], objective="grpo")
    records = [{"prompt": "What is 2 + 2?", "completion": " 4"}]
    with pytest.raises(
        ConfigError, match=r"objective grpo reads every record as a prompt, not as \['prompt-completion'\]"
    ):
        prepare(records, folders["chatml"], objective="grpo", record_format="prompt-completion")
