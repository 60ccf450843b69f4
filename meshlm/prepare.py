"""`meshlm prepare`: text, JSONL, Parquet or token files -> a prepared dataset (`meshlm.data`'s format on disk).

Documents and records are read by `meshlm.corpus` and tokenised (in worker processes when there are several
cores). Text documents are ended with the end-of-text token and cut from one stream into rows of
seq_len + 1 tokens, as pretraining text always was. Instruction records (prompt/completion, chats) become
examples with a loss mask, packed whole into rows best-fit (or one per row); preference pairs become two
padded rows each. Rows are written shard by shard, so memory stays bounded whatever the input's size.
"""

from __future__ import annotations

import bisect
import json
import multiprocessing as mp
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from meshlm import corpus
from meshlm.chat import ChatTemplate, check_messages, common_prefix, load_chat_template
from meshlm.config import GPT2_VOCAB, ConfigError, DataError, one_line
from meshlm.data import DTYPES, INDEX, PROMPT_RECORDS, ShardWriter, write_index
from meshlm.tokenizer import EOT_ID, EOT_TEXT, Tokenizer, load_tokenizer, pad_id, special_token_id

SHARD_BYTES = 128 << 20  # a new shard file starts after about this many bytes
SPLITS = ("train", "val")
TRAIN_ON = ("completion", "all")
TRUNCATE = ("right", "left", "drop")
OBJECTIVES = ("dpo", "orpo", "grpo")
RECORD_BATCH = 64  # records tokenized per work item
PACK_BUFFER_ROWS = 1024  # examples of about this many rows are packed together (the memory bound of packing)
WRITE_TOKENS = 1 << 24  # padded example rows are assembled and written once they hold about this many tokens
MAX_SEQ_LEN = 1 << 20  # a row of 2^20 + 1 tokens; far beyond any GPT-J-class context, and a few MB a row


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
    record_format: str | None = None,
    chat_template: str | Path | None = None,
    train_on: str = "completion",
    pack: bool = True,
    truncate: str = "right",
    objective: str | None = None,
) -> dict[str, Any]:
    """Tokenize and pack raw corpora into a prepared dataset folder; returns a summary of what was written.

    Text documents (a text file, a `{"text"}` record) are tokenized with `tokenizer` (a tokenizer.json or
    .tiktoken file, or a model folder for that model's tokenizer; default GPT-2 BPE, see `meshlm.tokenizer`)
    and followed by the end-of-text id; the seed's TFRecord records are taken as the packed ids they already
    are. That stream is cut into rows of `seq_len + 1` tokens in input order (rows are not shuffled: the
    loader shuffles) and the tail shorter than a row is dropped.

    Records of the other formats (`record_format` forces one; else each file's first record decides) are
    tokenized as trl does (`RecordEncoder`), chats with the model's chat template or `chat_template` (a
    Jinja file). Only completion and assistant tokens carry loss unless `train_on="all"`. Each example is
    one document: packed whole into rows best-fit, or one per row if not `pack`; an example longer than a
    row is cut (`truncate` "right" keeps its start, "left" its end) or dropped ("drop"), and one left
    without a completion token is dropped. Preference files make a preference dataset (kind "preference",
    no other formats with them): each pair is two padded rows, chosen then rejected, tokenized as trl's
    DPOTrainer does or, with `objective="orpo"`, its ORPOTrainer. With `objective="grpo"` every record is a
    prompt for reinforcement learning (`{"prompt": ...}` and the columns its rewards read): a prompts dataset,
    one prompt per row tokenized as trl's GRPOTrainer does, and each row's record in `<split>/prompts.jsonl`.

    `val_fraction` sends each document or record to the validation split with that probability (drawn
    from `seed` in input order); `val_inputs` gives the validation split its own files instead. Memory
    stays bounded whatever the input size: text is read and tokenized in pieces by `workers` processes
    (default: every core), at most a few pieces ahead of the writer.

    The dataset is written into the sibling folder `<out>.prepare-unfinished` and moved to `out` only when
    complete, so a failed or killed run never leaves a half-written dataset at `out`. `out` must be absent or
    empty unless `overwrite`, which replaces the dataset's own entries there (index.json, train/, val/).
    """
    workers = (os.cpu_count() or 1) if workers is None else workers
    _check_settings(seq_len, val_fraction, val_inputs, workers, shard_rows,
                    format=record_format, train_on=train_on, truncate=truncate, objective=objective)  # fmt: skip
    out = Path(out_dir)
    target = out.resolve()  # a symlinked --out: the folder it names is the one replaced
    partial = target.with_name(target.name + ".prepare-unfinished")
    _check_out(out, target, partial, overwrite)
    sources = _sources(inputs, val_inputs)
    if objective == "grpo":  # every record is a prompt, whatever else it holds (its other columns go to the rewards)
        record_format = record_format or "prompt"
    formats = _file_formats([f for files in sources.values() for f in files], record_format, text_field)
    kind = _dataset_kind(formats, train_on, objective)
    pack = pack and kind != "prompts"  # a prompt is generated from alone
    tok, eos, pad, dtype = _vocabulary(sources, tokenizer)
    if shard_rows is None:
        shard_rows = max(1, SHARD_BYTES // ((seq_len + 1) * DTYPES[dtype].itemsize))
    recipe = Recipe(formats, record_format is not None, text_field, chat_template, train_on, objective or "dpo")

    split_names = SPLITS if (val_fraction or val_inputs) else SPLITS[:1]
    if partial.exists():  # left by a killed run: only reached with overwrite
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    start = time.perf_counter()
    try:  # whatever stops the run from here on, the unfinished folder goes with it
        outputs = {
            name: _SplitOutput.open(ShardWriter(partial, name, seq_len, dtype, shard_rows), pack, truncate, pad)
            for name in split_names
        }
        total_bytes = sum(path.stat().st_size for files in sources.values() for path, _ in files)
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare", smoothing=0.1) as bar:
            stream = _TokenStream(tok, tokenizer, dtype, eos, recipe, workers, bar.update)
            _route(stream, sources, outputs, val_fraction, seed)
        splits = {name: output.close() for name, output in outputs.items()}
        _check_splits(splits, len(sources["train"]), seq_len)
        write_index(
            partial, seq_len, splits, dtype=dtype, eos_id=eos, kind=kind, pad_id=pad,
            tokenizer=tok.name if tok else None, row_order="input order (not shuffled)",
            inputs={name: [str(p) for p, _ in files] for name, files in sources.items()},
            formats={str(p): f for p, (f, _) in formats.items()}, val_fraction=val_fraction, seed=seed,
            train_on=train_on, pack=pack, truncate=truncate,
            objective=recipe.objective if kind != "lm" else None,
        )  # fmt: skip
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _publish(partial, target)
    return _summary(out, seq_len, kind, splits, time.perf_counter() - start)


def _check_settings(
    seq_len: int,
    val_fraction: float,
    val_inputs: list | None,
    workers: int,
    shard_rows: int | None,
    **choices: str | None,
) -> None:
    """Refuse bad settings before anything is read or made; `choices` are the named ones with a fixed set of
    values."""
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ConfigError(f"seq_len must be a positive integer, got {seq_len!r}")
    if seq_len > MAX_SEQ_LEN:
        raise ConfigError(
            f"seq_len {seq_len:,} is beyond {MAX_SEQ_LEN:,} tokens, longer than any model this data could train "
            "(each row holds seq_len + 1 tokens)"
        )
    if shard_rows is not None and (not isinstance(shard_rows, int) or shard_rows <= 0):
        raise ConfigError(f"shard_rows must be a positive integer, got {shard_rows!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_fraction and val_inputs:
        raise ConfigError("give either a validation fraction or validation files, not both")
    if workers < 1:
        raise ConfigError(f"workers must be at least 1, got {workers}")
    allowed = {"format": tuple(corpus.FORMATS), "train_on": TRAIN_ON, "truncate": TRUNCATE, "objective": OBJECTIVES}
    for name, value in choices.items():
        if value not in allowed[name] and not (value is None and name in ("format", "objective")):
            raise ConfigError(f"{name} must be one of {list(allowed[name])}, got {value!r}")


def _sources(inputs: str | Path | list[str | Path], val_inputs: list[str | Path] | None) -> dict[str, list]:
    """The (path, kind) of each split's input files: "train", and "val" when validation files are given."""
    if isinstance(inputs, str | Path):
        inputs = [inputs]
    sources = {"train": corpus.expand(inputs)}
    if val_inputs:
        sources["val"] = corpus.expand(val_inputs)
    if not sources["train"]:
        raise DataError("no input files given")
    return sources


def _dataset_kind(formats: dict[Path, tuple[str, str]], train_on: str, objective: str | None) -> str:
    """ "preference" when the inputs are preference pairs, "prompts" when they are prompts alone, else "lm";
    settings that do not fit the kind are refused."""
    found = {fmt for fmt, _ in formats.values()}
    kind = "preference" if "preference" in found else "prompts" if "prompt" in found else "lm"
    if kind == "prompts" and objective != "grpo":
        raise ConfigError("prompt records without a completion are prompts for reinforcement learning: "
                          "prepare them with objective grpo")  # fmt: skip
    if objective == "grpo" and kind != "prompts":
        raise ConfigError(f"objective grpo reads every record as a prompt, not as {sorted(found)} (drop --format)")
    if kind == "preference" and train_on == "all":
        raise ConfigError("train_on 'all' is for prompt/completion and chat data; DPO and ORPO weigh the completions")
    if objective in ("dpo", "orpo") and kind != "preference":
        raise ConfigError(f"objective {objective!r} chooses how preference pairs are tokenized; the input has none")
    return kind


def _vocabulary(sources: dict[str, list], tokenizer: str | Path | None) -> tuple[Tokenizer | None, int, int, str]:
    """The tokenizer (None when every input is TFRecord ids, tokenized already), the end-of-text and padding ids,
    and the row dtype that holds every id."""
    needs_text = any(file_kind != "tfrecord" for files in sources.values() for _, file_kind in files)
    tok = load_tokenizer(tokenizer) if needs_text else None
    eos = tok.eot_id if tok else EOT_ID
    pad = pad_id(tok) if tok else EOT_ID
    dtype = "uint16" if (tok.vocab_size if tok else GPT2_VOCAB) <= 1 << 16 else "uint32"
    return tok, eos, pad, dtype


def _route(
    stream: _TokenStream, sources: dict[str, list], outputs: dict[str, _SplitOutput], val_fraction: float, seed: int
) -> None:
    """Send each document or example of each split's files to that split's output, or to validation with
    probability `val_fraction` (drawn from `seed` in input order)."""
    rng = np.random.default_rng(seed)
    for name, files in sources.items():
        split = None  # where the document or example being read goes
        for item in stream(files):
            if split is None:
                held_out = val_fraction and rng.random() < val_fraction
                split = "val" if held_out else name
            outputs[split].add(item)
            if isinstance(item, Sample) or item[1]:  # an example, or a document's last piece
                split = None


def _summary(out: Path, seq_len: int, kind: str, splits: dict[str, dict], seconds: float) -> dict[str, Any]:
    n_tokens = sum(s["tokens"] for s in splits.values())
    return {
        "out": str(out),
        "seq_len": seq_len,
        "kind": kind,
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


def _file_formats(files: list[tuple[Path, str]], forced: str | None, text_field: str) -> dict[Path, tuple[str, str]]:
    """Each input's record format and where that was decided (its first record), read before any work; a
    preference file mixed with files of another format is refused."""
    formats: dict[Path, tuple[str, str]] = {}
    for path, kind in files:
        if kind not in corpus.RECORD_FILES:
            if forced not in (None, "text"):
                raise DataError(f"{path}: --format {forced} reads records of .jsonl, .jsonl.zst or .parquet files")
            formats[path] = ("text", str(path))
            continue
        first = corpus.first_record(path, kind)
        if forced or first is None:
            formats[path] = (forced or "text", first[0] if first else str(path))
        else:
            formats[path] = (corpus.detect_format(*first, text_field), first[0])
    preference = next((where for fmt, where in formats.values() if fmt == "preference"), None)
    other = next(((fmt, where) for fmt, where in formats.values() if fmt != "preference"), None)
    if preference and other:
        raise DataError(f"{other[1]}: {other[0]} records mixed with the preference records of {preference}; "
                        "prepare preference pairs on their own")  # fmt: skip
    return formats


def _check_splits(splits: dict[str, dict], n_files: int, seq_len: int) -> None:
    for name, entry in splits.items():
        if entry["sequences"]:
            continue
        if entry["dropped"]:
            raise DataError(
                f"the {name} split has no rows: all {entry['dropped']} of its examples were dropped (longer than a "
                f"row of seq_len + 1 = {seq_len + 1} with --truncate drop, or left without a completion token); "
                "raise --seq-len"
            )
        if name == "train" and not entry["tokens"]:
            raise DataError(f"no tokens in the input: every document of {n_files} file(s) is empty")
        raise DataError(
            f"the {name} split holds {entry['tokens']} tokens in {entry['documents']} document(s), fewer "
            f"than one row of seq_len + 1 = {seq_len + 1}; add data or lower the sequence length"
        )


class Recipe(NamedTuple):
    """How records become examples: what the reader needs (formats, text_field) and what the workers need."""

    formats: dict[Path, tuple[str, str]]  # file -> (record format, where it was decided)
    forced: bool  # the format came from --format, not from each file's first record
    text_field: str
    chat_template: str | Path | None
    train_on: str
    objective: str


class Example(NamedTuple):
    """One tokenized sequence: ids, and for each whether it carries loss (when it has a predecessor)."""

    ids: np.ndarray  # int64 [n]
    mask: np.ndarray  # bool [n]


class Sample(NamedTuple):
    """What one record becomes: one example, or a preference pair's (chosen, rejected); a prompt's example
    comes with what the rewards read of its record (`RecordEncoder._prompt`)."""

    sequences: tuple[Example, ...]
    record: dict[str, Any] | None = None


class RecordEncoder:
    """Records -> examples, with the token ids trl 1.16 builds for the same record and tokenizer.

    prompt/completion (trl's SFTTrainer): text fields: the completion gets the tokenizer's `eos_token` text
    appended (unless it ends with it); the ids are those of `prompt + completion` tokenized as one string
    with the tokenizer's own special tokens (`add_special_tokens=True`: a BOS where its tokenizer.json's
    post-processor adds one, as Llama's; none for GPT-2 and GPT-NeoX), and the completion starts where they stop
    agreeing with the ids of `prompt` alone (`common_prefix_length`). Message lists: the ids of the chat
    template over `prompt + completion`, the completion starting after the common prefix with the template
    over `prompt` with `add_generation_prompt=True`; no EOS is added (the template ends the turn). Loss:
    the completion tokens (trl's default `completion_only_loss`), everything with `train_on="all"`.

    messages (trl's SFTTrainer): the chat template over the messages, loss on the assistant tokens
    (`ChatTemplate.encode_with_mask`: trl's `assistant_only_loss=True` where the template has
    `{% generation %}` blocks), or on everything with `train_on="all"` (trl's default for chats).

    prompt/chosen/rejected, objective "dpo" (trl's DPOTrainer): as prompt/completion for each of chosen and
    rejected (EOS text appended to each, or the chat template), the prompt ending at the shorter of the two
    common prefixes; loss on the completions. Objective "orpo" (trl.experimental's ORPOTrainer): message
    lists are first rendered to text (the prompt with the generation prompt, cut to its common prefix with
    both whole chats; each completion the rest of its chat), then prompt and `prompt + answer` are tokenized
    without special tokens, the prompt's ids are those of the whole minus the answer's (one fewer where the
    last prompt token merges into the answer), the `bos_token` id is put first unless there, and the
    `eos_token` id last unless there.

    Record fields may also carry trl's `tools` and `chat_template_kwargs`, passed to the template. The
    tokenizer's `eos_token` / `bos_token` come from its tokenizer_config.json (GPT-2 BPE: `<|endoftext|>`).
    """

    def __init__(self, tok: Tokenizer, chat_template: str | Path | None, train_on: str, objective: str):
        self.tok, self.train_on, self.objective = tok, train_on, objective
        self._template_file, self._template = chat_template, None
        self.eos_text = tok.special_tokens.get("eos_token", EOT_TEXT)
        found = tok.token_id(self.eos_text)
        self.eos_id = tok.eot_id if found is None else found
        self.bos_id = special_token_id(tok, "bos_token")

    @property
    def template(self) -> _GuardedTemplate:
        if self._template is None:
            template = load_chat_template(self.tok, self._template_file)
            if template is None:
                raise DataError(
                    f"a chat record, but the tokenizer {self.tok.name} has no chat template (chat_template.jinja, "
                    "or chat_template in tokenizer_config.json beside it); give one with --chat-template FILE"
                )
            self._template = _GuardedTemplate(template)
        return self._template

    def __call__(self, fmt: str, record: dict[str, Any]) -> Sample:
        chat_kwargs = _chat_kwargs(record)
        if fmt == "messages":
            messages = check_messages(record["messages"])
            if not any(m["role"] == "assistant" for m in messages):
                raise DataError("a chat with no assistant turn: nothing to train on")
            ids, mask = self.template.encode_with_mask(messages, self.tok, **chat_kwargs)
            if not any(mask):
                raise DataError("the chat template renders no assistant tokens for this chat")
            return Sample((self._example(ids, mask),))
        if fmt == "prompt":
            return self._prompt(record, chat_kwargs)
        if fmt == "prompt-completion":
            prompt, (completion,) = _fields(record, "completion")
            ids, start = self._with_prompt(prompt, [completion], chat_kwargs)
            return Sample((self._example(ids[0], start),))
        prompt, answers = _fields(record, "chosen", "rejected")
        if self.objective == "orpo":
            return Sample(tuple(self._orpo(prompt, answers, chat_kwargs)))
        ids, start = self._with_prompt(prompt, answers, chat_kwargs)
        return Sample(tuple(self._example(seq, start) for seq in ids))

    def _prompt(self, record: dict[str, Any], chat_kwargs: dict) -> Sample:
        """trl's GRPOTrainer: a text prompt is tokenized with the tokenizer's special tokens, a chat rendered by
        the template with the generation prompt. The record's prompt and other columns ride along for the
        rewards (trl passes every column but the prompt to its reward functions)."""
        prompt = record["prompt"]
        if isinstance(prompt, list):
            messages = check_messages(prompt, "prompt")
            ids = self.template.encode(messages, self.tok, add_generation_prompt=True, **chat_kwargs)
        elif isinstance(prompt, str):
            ids = self.tok.encode(prompt, add_special_tokens=True)
        else:
            raise DataError(f"field 'prompt' is {type(prompt).__name__}, expected a string or a list of messages")
        if not ids:
            raise DataError("the prompt is empty")
        columns = {k: v for k, v in record.items() if k != "prompt"}
        example = Example(np.asarray(ids, np.int64), np.ones(len(ids), bool))
        return Sample((example,), {"prompt": prompt, "columns": columns})

    def _with_prompt(self, prompt: str | list, answers: list, chat_kwargs: dict) -> tuple[list[list[int]], int]:
        """trl's SFT and DPO tokenization: the ids of each prompt + answer, and where the answers start."""
        if isinstance(prompt, list):
            prompt_ids = self.template.encode(prompt, self.tok, add_generation_prompt=True, **chat_kwargs)
            ids = [self.template.encode(prompt + answer, self.tok, **chat_kwargs) for answer in answers]
        else:
            prompt_ids = self.tok.encode(prompt, add_special_tokens=True)
            ends = [a if a.endswith(self.eos_text) else a + self.eos_text for a in answers]
            ids = [self.tok.encode(prompt + answer, add_special_tokens=True) for answer in ends]
        return ids, min(common_prefix(prompt_ids, seq) for seq in ids)

    def _orpo(self, prompt: str | list, answers: list, chat_kwargs: dict) -> Iterator[Example]:
        """trl.experimental's ORPOTrainer tokenization (`tokenize_row`, `build_tokenized_answer`)."""
        if isinstance(prompt, list):
            if prompt[-1]["role"] != "user":
                raise DataError("for orpo, a chat prompt must end with a user message (trl adds the generation prompt)")
            chats = [self.template.render(prompt + answer, **chat_kwargs) for answer in answers]
            prompt = self.template.render(prompt, True, **chat_kwargs)
            prompt = prompt[: min(common_prefix(prompt, chat) for chat in chats)]
            answers = [chat[len(prompt) :] for chat in chats]
        prompt_ids = self.tok.encode(prompt)
        for answer in answers:
            whole = self.tok.encode(prompt + answer)
            start = len(prompt_ids) - (prompt_ids != whole[: len(prompt_ids)])
            head, tail = whole[:start], whole[start:]
            if self.bos_id is not None and (not head or head[0] != self.bos_id):
                head = [self.bos_id, *head]
            if not tail or tail[-1] != self.eos_id:
                tail = [*tail, self.eos_id]
            yield self._example(head + tail, len(head))

    def _example(self, ids: Sequence[int], loss: int | Sequence[bool]) -> Example:
        """An example whose loss covers the tokens from index `loss` on, or those `loss` marks; all of them
        with train_on "all"."""
        ids = np.asarray(ids, np.int64)
        if self.train_on == "all":
            return Example(ids, np.ones(len(ids), bool))
        mask = np.arange(len(ids)) >= loss if isinstance(loss, int) else np.asarray(loss, bool)
        return Example(ids, mask)


def _fields(record: dict[str, Any], *answers: str) -> tuple[str | list, list[str | list]]:
    """A record's prompt and its answers (completion, or chosen and rejected): all strings or all message
    lists, the answers not empty; DataError says what is wrong."""
    prompt, values = record["prompt"], [record[name] for name in answers]
    for name, value in zip(("prompt", *answers), (prompt, *values), strict=True):
        if name != "prompt" and value in ("", []):
            raise DataError(f"empty completion: {name!r} is empty")
        if isinstance(value, list):
            check_messages(value, name)
        elif not isinstance(value, str):
            raise DataError(f"field {name!r} is {type(value).__name__}, expected a string or a list of messages")
    if len({isinstance(v, list) for v in (prompt, *values)}) > 1:
        shapes = ", ".join(f"{n} {'messages' if isinstance(v, list) else 'text'}"
                           for n, v in zip(("prompt", *answers), (prompt, *values), strict=True))  # fmt: skip
        raise DataError(f"fields mix text and message lists ({shapes}); give all as text or all as messages")
    return prompt, values


# Template variables that the rendering sets itself (and the names of its own arguments): a record's
# `chat_template_kwargs` may not set them.
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "tokenizer", "self")


def _chat_kwargs(record: dict[str, Any]) -> dict[str, Any]:
    """trl's per-record template arguments: `tools` (a list, or its JSON text) and `chat_template_kwargs`."""
    tools, extra = record.get("tools"), record.get("chat_template_kwargs") or {}
    try:
        tools = json.loads(tools) if isinstance(tools, str) else tools
    except ValueError:
        raise DataError("'tools' is a string that is not JSON") from None
    if not isinstance(extra, dict) or not isinstance(tools, list | None):
        raise DataError("'tools' must be a list and 'chat_template_kwargs' an object")
    reserved = [key for key in RESERVED_TEMPLATE_KWARGS if key in extra]
    if reserved:
        raise DataError(
            f"chat_template_kwargs sets {reserved[0]!r}, which the chat template is given by the record itself; "
            "remove it"
        )
    return {"tools": tools, **extra} if tools is not None else extra


class _GuardedTemplate:
    """A chat template whose every failure on a record is a DataError: its own `raise_exception` already is;
    a runtime error in the template's code (`{{ 1 // 0 }}`, a filter given the wrong type, recursion without
    end) becomes one too, so that the record is named in one line rather than in a traceback."""

    def __init__(self, template: ChatTemplate):
        self._template = template

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._template, name)
        if not callable(method):
            return method

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except DataError:
                raise
            except Exception as e:  # the template is the user's code: any error in it is the record's
                raise DataError(f"the chat template failed on this chat: {type(e).__name__}: {one_line(e)}") from None

        return guarded


def best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: the indices of `lengths`, longest first (ties in input order), each put in the
    bin with the least room it fits in, a new bin when none has room. Bins in the order they were opened."""
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin), sorted: the best fit is the first with enough room
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(room, (lengths[i], -1))
        if k < len(room):
            left, b = room.pop(k)
            bins[b].append(i)
        else:
            left, b = capacity, len(bins)
            bins.append([i])
        if left > lengths[i]:
            bisect.insort(room, (left - lengths[i], b))
    return bins


class BestFit:
    """Best-fit-decreasing packing of a stream of items into bins of `capacity` tokens, in bounded memory:
    items are gathered until they hold about `buffer` tokens and packed together (`best_fit`); the bins are
    handed out but the emptiest, whose items (an eighth of the buffer at most) wait to be packed with the
    next ones. The same items in the same order give the same bins."""

    def __init__(self, capacity: int, buffer: int):
        self.capacity, self.buffer = capacity, buffer
        self._items: list[tuple[Any, int]] = []
        self._held = 0

    def add(self, item: Any, length: int) -> list[list[Any]]:
        """Take an item of `length` tokens (at most `capacity`); returns the bins completed by it, often none."""
        self._items.append((item, length))
        self._held += length
        return self._pack(final=False) if self._held >= self.buffer else []

    def finish(self) -> list[list[Any]]:
        """The bins of every item still held."""
        return self._pack(final=True)

    def _pack(self, final: bool) -> list[list[Any]]:
        bins = best_fit([n for _, n in self._items], self.capacity)
        fill = [sum(self._items[i][1] for i in b) for b in bins]
        held: set[int] = set()
        spare = 0 if final else self.buffer // 8
        for b in sorted(range(len(bins)), key=lambda b: (fill[b], b)):
            if fill[b] > spare or fill[b] == self.capacity:
                break
            spare -= fill[b]
            held.add(b)
        out = [[self._items[i][0] for i in b] for k, b in enumerate(bins) if k not in held]
        self._items = [self._items[i] for i in sorted(i for k in held for i in bins[k])]
        self._held = sum(n for _, n in self._items)
        return out


class _ExamplePacker:
    """One split's examples -> padded rows: packed whole (`BestFit` over about PACK_BUFFER_ROWS rows of
    examples), or one per row (`pack` False, and each sequence of a preference pair). Examples longer than a
    row are truncated or dropped; those left without a target are dropped."""

    WRITE_ROWS = 1024  # rows gathered before they are assembled and written (fewer where rows are long)

    def __init__(self, writer: ShardWriter, pack: bool, truncate: str, pad: int):
        self.writer, self.row, self.truncate, self.pad = writer, writer.row, truncate, pad
        self.write_rows = max(1, min(self.WRITE_ROWS, WRITE_TOKENS // self.row))
        self._packing = BestFit(self.row, PACK_BUFFER_ROWS * self.row) if pack else None
        self._rows: list[list[Example]] = []  # each row's documents, not yet written
        self._records: list[dict[str, Any]] = []  # a prompt row's record, for each of `_rows` (prompts only)
        self.examples = self.truncated = self.dropped = self.tokens = self.padding = 0

    def add(self, sample: Sample) -> None:
        cut = [self._fit(seq) for seq in sample.sequences]
        if any(seq is None or (sample.record is None and not seq.mask[1:].any()) for seq in cut):
            self.dropped += 1  # too long with truncate "drop", or nothing left to train on (a prompt needs no target)
            return
        if sample.record is not None:
            self._records.append(sample.record)
        self.examples += 1
        self.truncated += any(len(seq.ids) > self.row for seq in sample.sequences)
        if self._packing is None or len(cut) > 1:
            self._rows += [[seq] for seq in cut]
        else:
            self._rows += self._packing.add(cut[0], len(cut[0].ids))
        if len(self._rows) >= self.write_rows:
            self._write()

    def _fit(self, seq: Example) -> Example | None:
        if len(seq.ids) <= self.row:
            return seq
        if self.truncate == "drop":
            return None
        keep = slice(None, self.row) if self.truncate == "right" else slice(-self.row, None)
        return Example(seq.ids[keep], seq.mask[keep])

    def _write(self) -> None:
        """The gathered rows, padded: segments 1..k (0 for padding), weights the mask but at each document's
        first token."""
        shape = (len(self._rows), self.row)
        tokens = np.full(shape, self.pad, np.int64)
        weights, segments = np.zeros(shape, np.uint8), np.zeros(shape, np.uint16)
        for r, docs in enumerate(self._rows):
            t = 0
            for s, doc in enumerate(docs, 1):
                n = len(doc.ids)
                tokens[r, t : t + n], segments[r, t : t + n] = doc.ids, s
                weights[r, t + 1 : t + n] = doc.mask[1:]
                t += n
            self.tokens += t
            self.padding += self.row - t
        self.writer.write(tokens, weights, segments)
        self._rows = []
        if self._records:
            with open(self.writer.folder / self.writer.split / PROMPT_RECORDS, "a") as f:
                f.writelines(json.dumps(record, default=str) + "\n" for record in self._records)
            self._records = []

    def close(self) -> dict:
        if self._packing is not None:
            self._rows += self._packing.finish()
        if self._rows:
            self._write()
        return {"examples": self.examples, "truncated": self.truncated, "dropped": self.dropped,
                "example_tokens": self.tokens, "padding": self.padding}  # fmt: skip


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
        if n:
            self.writer.write(ids[:n].reshape(-1, self.row))
        self._pending, self._held = [ids[n:].copy()], len(ids) - n

    def close(self) -> dict:
        if self._pending:
            self._flush()
        return {"tokens": self.tokens, "documents": self.documents, "dropped_tokens": self._held}


class _SplitOutput(NamedTuple):
    """One split's output: its shard writer, fed by a packer of text documents and one of examples."""

    writer: ShardWriter
    texts: _Packer
    examples: _ExamplePacker

    @classmethod
    def open(cls, writer: ShardWriter, pack: bool, truncate: str, pad: int) -> _SplitOutput:
        return cls(writer, _Packer(writer), _ExamplePacker(writer, pack, truncate, pad))

    def add(self, item: tuple[np.ndarray, bool] | Sample) -> None:
        if isinstance(item, Sample):
            self.examples.add(item)
        else:
            self.texts.add(*item)

    def close(self) -> dict:
        """The split's entry of the index: its shards, text and example counts, and its tokens in all."""
        text, example = self.texts.close(), self.examples.close()
        return self.writer.close() | text | example | {"tokens": text["tokens"] + example["example_tokens"]}


class _TokenStream:
    """Text pieces (ids, ends_document) and records' Samples for a list of files, in input order: the work
    is done in worker processes, a bounded number of items ahead of the consumer, so memory does not grow
    with the input."""

    def __init__(
        self,
        tok: Tokenizer | None,
        tokenizer: str | Path | None,
        dtype: str,
        eos: int,
        recipe: Recipe,
        workers: int,
        progress: Callable[[int], Any],
    ):
        self.tok, self.init_args = tok, (tokenizer, dtype, eos, recipe)
        self.vocab = tok.vocab_size if tok else GPT2_VOCAB
        self.recipe, self.workers, self.progress = recipe, workers, progress
        self.dtype = DTYPES[dtype]

    def __call__(self, files: list[tuple[Path, str]]) -> Iterator[tuple[np.ndarray, bool] | Sample]:
        if self.workers == 1 or self.tok is None:  # in this process (no text to tokenize: no workers needed)
            encoder = _Encoder(self.tok, self.dtype, self.init_args[2], self.recipe)
            for item in self._work(files):
                yield from item if isinstance(item, list) else _unpack(getattr(encoder, item[0])(*item[1:]))
            return
        ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
        with ctx.Pool(self.workers, initializer=_init_worker, initargs=self.init_args) as pool:
            pending: deque = deque()
            for item in self._work(files):
                pending.append(item if isinstance(item, list) else pool.apply_async(_in_worker, item))
                while len(pending) > 2 * self.workers:
                    yield from _result(pending.popleft())
            while pending:
                yield from _result(pending.popleft())

    def _work(self, files: list[tuple[Path, str]]) -> Iterator[list | tuple]:
        """Work items, each an `_Encoder` method and its arguments: ("text", text pieces of about READ_CHARS
        characters, their ends), ("records", format, a batch of records); or a list of what is ready (TFRecord
        ids)."""
        texts: list[str] = []
        ends: list[bool] = []
        size = 0
        for path, kind in files:
            fmt, _ = self.recipe.formats[path]
            if kind in corpus.RECORD_FILES and fmt != "text":
                if texts:
                    yield "text", texts, ends
                    texts, ends, size = [], [], 0
                yield from self._record_batches(path, kind, fmt)
                continue
            for content, end in self._documents(path, kind):
                if isinstance(content, str):
                    texts.append(content)
                    ends.append(end)
                    size += len(content)
                    if size >= corpus.READ_CHARS:
                        yield "text", texts, ends
                        texts, ends, size = [], [], 0
                    continue
                if texts:
                    yield "text", texts, ends
                    texts, ends, size = [], [], 0
                if content.min() < 0 or content.max() >= self.vocab:
                    bad = content[(content < 0) | (content >= self.vocab)][0]
                    raise DataError(f"{path}: holds token id {bad}, outside the tokenizer's 0..{self.vocab - 1}")
                yield [(content.astype(self.dtype), end)]
        if texts:
            yield "text", texts, ends

    def _documents(self, path: Path, kind: str) -> Iterator[tuple[str | np.ndarray, bool]]:
        """The pieces of the text documents of a file: its text, its TFRecords, or its {"text"} records."""
        if kind not in corpus.RECORD_FILES:
            yield from corpus.documents(path, kind, self.recipe.text_field, self.progress)
            return
        for where, record in corpus.records(path, kind, self.progress):
            corpus.check_record(where, record, "text", self.recipe.forced, self.recipe.text_field)
            if record[self.recipe.text_field]:
                yield from corpus.split_text(record[self.recipe.text_field])

    def _record_batches(self, path: Path, kind: str, fmt: str) -> Iterator[tuple]:
        batch: list[tuple[str, Any]] = []
        for where, record in corpus.records(path, kind, self.progress):
            corpus.check_record(where, record, fmt, self.recipe.forced, self.recipe.text_field)
            batch.append((where, record))
            if len(batch) == RECORD_BATCH:
                yield "records", fmt, batch
                batch = []
        if batch:
            yield "records", fmt, batch


def _result(item: Any) -> list:
    return item if isinstance(item, list) else _unpack(item.get())


def _unpack(result: tuple | list) -> list:
    """A work item's result as the stream's items: text pieces are sent as one array with their lengths."""
    return _segments(*result) if isinstance(result, tuple) else result


def _segments(ids: np.ndarray, lengths: np.ndarray, ends: list[bool]) -> list[tuple[np.ndarray, bool]]:
    return list(zip(np.split(ids, np.cumsum(lengths)[:-1]), ends, strict=True))


class _Encoder:
    """Tokenizes the stream's work: text pieces, and records (through a RecordEncoder made for the first)."""

    def __init__(self, tok: Tokenizer | None, dtype: np.dtype, eos: int, recipe: Recipe):
        self.tok, self.dtype, self.eos, self.recipe = tok, dtype, eos, recipe
        self._records: RecordEncoder | None = None

    def text(self, texts: list[str], ends: list[bool]) -> tuple[np.ndarray, np.ndarray, list[bool]]:
        """Tokenize text pieces; a document's last piece gets the end-of-text id after it. Returns the ids of
        all pieces in one array (one array pickles far faster than thousands) with each piece's length."""
        ids: list[int] = []
        lengths = np.empty(len(texts), np.int64)
        for i, (text, end) in enumerate(zip(texts, ends, strict=True)):
            piece = self.tok.encode(text)
            lengths[i] = len(piece) + end
            ids += piece
            if end:
                ids.append(self.eos)
        return np.array(ids, self.dtype), lengths, ends

    def records(self, fmt: str, batch: list[tuple[str, Any]]) -> list[Sample]:
        """Tokenize records of one format; an error names the record's file and line (or row)."""
        if self._records is None:
            recipe = self.recipe
            self._records = RecordEncoder(self.tok, recipe.chat_template, recipe.train_on, recipe.objective)
        samples = []
        for where, record in batch:
            try:
                samples.append(self._records(fmt, record))
            except DataError as e:
                raise DataError(f"{where}: {e}") from None
        return samples


# A worker process's encoder: the pool's initializer makes it, and it lives as long as that process. The main
# process never sets it (with one worker it uses an _Encoder of its own).
_WORKER: _Encoder | None = None


def _init_worker(tokenizer: str | Path | None, dtype: str, eos: int, recipe: Recipe) -> None:
    global _WORKER
    _WORKER = _Encoder(load_tokenizer(tokenizer), DTYPES[dtype], eos, recipe)


def _in_worker(method: str, *args: Any) -> Any:
    """A work item, run by this worker process's encoder."""
    return getattr(_WORKER, method)(*args)
