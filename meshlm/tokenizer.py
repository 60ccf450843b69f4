"""Tokenizers: GPT-2 BPE (byte-exact with GPT-J's: tiktoken `r50k_base`, `<|endoftext|>` = 50256) and a
model folder's own Hugging Face `tokenizer.json` (GPT-NeoX/Pythia's BPE, whose `<|endoftext|>` is id 0).

Which tokenizer a model uses, in order: one given explicitly (a `.tiktoken` or `tokenizer.json` file,
or a model folder, meaning that model's tokenizer); the `tokenizer.json` in the model's own folder (for
a training run's checkpoint: in the run folder, where `meshlm train` copies its `init_from`'s); else
GPT-2 BPE, from `$MESHLM_TOKENIZER`, meshlm's cache (`~/.cache/meshlm/r50k_base.tiktoken`, filled by
`meshlm fetch-tokenizer` from the copy PyPI ships inside openai-whisper's source), then tiktoken's own
download and cache. `load_tokenizer` is that one resolution path for the API, the CLI, evaluation,
data preparation and training.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Protocol

from meshlm.config import RUN_CHECKPOINTS, ConfigError
from meshlm.paths import as_path, cache_dir, has_path

EOT_ID = 50256
EOT_TEXT = "<|endoftext|>"
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# The same bytes ship as whisper/assets/gpt2.tiktoken in this source distribution on PyPI.
WHISPER_SDIST = "openai-whisper==20250625"
CACHE_FILE = cache_dir() / "r50k_base.tiktoken"


# A model folder's tokenizer: tokenizer.json is what meshlm reads; the rest travel with it when a model is
# saved or converted, so `transformers.AutoTokenizer` (and its chat template) keeps working on the copy.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "vocab.json",
    "merges.txt",
)  # fmt: skip
# transformers' named special tokens (`special_tokens_map`): chat templates see them as variables.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GPT2_SPECIAL_TOKENS = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT}  # as GPT-2's own


class Tokenizer(Protocol):
    name: str
    eot_id: int
    vocab_size: int
    special_tokens: dict[str, str]  # named special tokens (bos_token, eos_token, ...), as transformers reads them
    # whether decode(ids) is the tokens' bytes in order, read as UTF-8 ('replace'): text may then be decoded
    # piece by piece, split where a character ends (`meshlm.serve.outputs.Detokenizer`)
    byte_level: bool

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...
    def decode_bytes(self, ids: list[int]) -> bytes: ...
    def token_id(self, token: str) -> int | None: ...


def special_token_id(tok: Tokenizer, name: str) -> int | None:
    """The id of the named special token (`"eos_token"`, ...), None when the tokenizer has none."""
    token = tok.special_tokens.get(name)
    return None if token is None else tok.token_id(token)


def pad_id(tok: Tokenizer) -> int:
    """What fills the padding of a row: the pad token, else EOS (as trl pads), else the end-of-text id."""
    found = special_token_id(tok, "pad_token")
    found = special_token_id(tok, "eos_token") if found is None else found
    return tok.eot_id if found is None else found


class TiktokenTokenizer:
    """GPT-2 BPE through tiktoken. `<|endoftext|>` in text becomes the EOT id; no other special tokens, and
    nothing is added around a text (GPT-2's tokenizer adds no BOS)."""

    name = "gpt2-r50k_base"
    eot_id = EOT_ID
    special_tokens = GPT2_SPECIAL_TOKENS
    byte_level = True  # tiktoken decodes the tokens' bytes with errors="replace"

    def __init__(self, encoding: object):
        self._enc = encoding
        self.vocab_size = encoding.n_vocab  # type: ignore[attr-defined]

    @property
    def encoding(self) -> object:
        """The tiktoken Encoding (its byte tables, for a grammar's token trie)."""
        return self._enc

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._enc.encode(text, allowed_special={EOT_TEXT})  # type: ignore[attr-defined]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each token's character span in `text`: a token holding part of a multi-byte character
        spans that character, so it overlaps whatever the character does."""
        ids = self.encode(text)
        _, starts = self._enc.decode_with_offsets(ids)  # type: ignore[attr-defined]
        pieces = self._enc.decode_tokens_bytes(ids)  # type: ignore[attr-defined]
        continues = [0x80 <= piece[0] < 0xC0 for piece in pieces[1:]]  # the next token starts inside a character
        ends = [start + cont for start, cont in zip(starts[1:], continues, strict=True)] + [len(text)] * bool(ids)
        return ids, list(zip(starts, ends, strict=True))

    def token_id(self, token: str) -> int | None:
        try:
            return self._enc.encode_single_token(token)  # type: ignore[attr-defined]
        except KeyError:
            return None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_batch(texts, allowed_special={EOT_TEXT})  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids))  # type: ignore[attr-defined]

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self._enc.decode_bytes(list(ids))  # type: ignore[attr-defined]


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (through the `tokenizers` library); its `<|endoftext|>` ends documents.

    The `tokenizer_config.json` (and `special_tokens_map.json`) beside it name the special tokens (bos_token,
    eos_token, ...). `encode(text, add_special_tokens=True)` adds what the file's post-processor adds (a BOS
    for Llama's, nothing for GPT-2's or GPT-NeoX's), as transformers 5 does whatever the config's
    `add_bos_token` says: the ids trl's trainers tokenize a text with."""

    byte_level = False  # a tokenizer.json's decoder may strip or join pieces: a row's text is decoded whole

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:
            raise ConfigError(f"{path}: reading tokenizer.json needs the 'tokenizers' package") from None
        try:
            self._tok = RustTokenizer.from_str(as_path(path).read_text())  # a local file or a URL
        except Exception as e:  # the library's messages are one line, but be sure: errors here are one line
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"{path}: not a readable tokenizer.json ({reason})") from None
        eot = self._tok.token_to_id(EOT_TEXT)
        if eot is None:
            raise ConfigError(f"{path}: has no {EOT_TEXT} token, which meshlm needs to end documents and generation")
        self.path = Path(path)
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size()
        self.eot_id = eot
        self.special_tokens = named_special_tokens(tokenizer_config(as_path(path).parent))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each token's character span in `text`."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.decode(ids).encode("utf-8")

    def to_json(self) -> str:
        """The tokenizer.json text (for a grammar's token trie)."""
        return self._tok.to_str()


def tokenizer_config(folder: str | Path) -> dict[str, Any]:
    """A model folder's tokenizer_config.json with its special_tokens_map.json over it, as transformers reads
    them; {} for files that are absent or unreadable."""
    config: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            found = json.loads((as_path(folder) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        config |= found if isinstance(found, dict) else {}
    return config


def named_special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The named special tokens of a tokenizer config: a string each, or an AddedToken dict with its content."""
    text = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items() if k in SPECIAL_TOKEN_NAMES}
    return {k: v for k, v in text.items() if isinstance(v, str)}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _from_tiktoken_file(path: Path) -> TiktokenTokenizer:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str

    try:
        ranks = load_tiktoken_bpe(str(path))
    except Exception as e:
        raise ConfigError(f"{path}: not a readable .tiktoken BPE file ({e})") from None
    encoding = tiktoken.Encoding(
        name="r50k_base", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={EOT_TEXT: EOT_ID}
    )
    return TiktokenTokenizer(encoding)


def model_tokenizer_json(folder: str | Path) -> Path | None:
    """The tokenizer.json of the model in `folder`: in the folder itself, or, for a training run (its
    `checkpoints/` folder or one step in it), in the run folder. None: the model uses GPT-2 BPE."""
    if not has_path(folder):  # a URL only fsspec reads (the seed's checkpoints): no tokenizer.json there
        return None
    folder = as_path(folder)
    candidates = [folder]
    if folder.name == RUN_CHECKPOINTS:
        candidates.append(folder.parent)
    elif folder.name.isdigit() and folder.parent.name == RUN_CHECKPOINTS:
        candidates.append(folder.parent.parent)
    return next((c / "tokenizer.json" for c in candidates if (c / "tokenizer.json").is_file()), None)


TokenizerSpec = str | Path | Tokenizer | None


def tokenizer_json(spec: TokenizerSpec = None, model: str | Path | None = None) -> Path | None:
    """The tokenizer.json in effect for `spec` (see `load_tokenizer`) and the model folder `model`, found
    without reading it; None means GPT-2 BPE (a .tiktoken file, or the default)."""
    if isinstance(spec, HFTokenizer):
        return spec.path
    if spec is None:
        return model_tokenizer_json(model) if model is not None else None
    if not isinstance(spec, str | Path):  # another Tokenizer object: nothing on disk
        return None
    path = Path(spec)
    if path.is_dir():
        return model_tokenizer_json(path)
    if not path.is_file():
        raise ConfigError(f"tokenizer {path} not found (give a .tiktoken or tokenizer.json file, or a model folder)")
    return path if path.suffix == ".json" else None


def load_tokenizer(spec: TokenizerSpec = None, model: str | Path | None = None) -> Tokenizer:
    """The tokenizer `spec` names, else the model folder `model`'s own, else GPT-2 BPE (module docstring).

    `spec` is a Tokenizer, a `.tiktoken` file, a `tokenizer.json` file, or a model folder (meshlm
    checkpoint, training run, Hugging Face folder: whatever tokenizer that model uses)."""
    if spec is not None and not isinstance(spec, str | Path):
        return spec
    path = tokenizer_json(spec, model)
    if path is not None:
        return HFTokenizer(path)
    if spec is not None and Path(spec).is_file():
        return _from_tiktoken_file(Path(spec))
    return _gpt2()


def local_gpt2() -> Path | None:
    """The GPT-2 BPE file the resolution path takes on this machine: `$MESHLM_TOKENIZER` (where set, even
    to a file that is missing, which `load_tokenizer` then names), else meshlm's cache; None: neither."""
    if os.environ.get("MESHLM_TOKENIZER"):
        return Path(os.environ["MESHLM_TOKENIZER"])
    return CACHE_FILE if CACHE_FILE.is_file() else None


def _gpt2() -> Tokenizer:
    """GPT-2 BPE from `$MESHLM_TOKENIZER`, meshlm's cache, or tiktoken."""
    if os.environ.get("MESHLM_TOKENIZER"):
        path = Path(os.environ["MESHLM_TOKENIZER"])
        if not path.is_file():
            raise ConfigError(f"MESHLM_TOKENIZER: tokenizer file {path} not found")
        return HFTokenizer(path) if path.suffix == ".json" else _from_tiktoken_file(path)
    if CACHE_FILE.is_file():
        return _from_tiktoken_file(CACHE_FILE)
    try:
        import tiktoken

        return TiktokenTokenizer(tiktoken.get_encoding("r50k_base"))
    except Exception as e:
        raise ConfigError(
            f"no GPT-2 tokenizer available offline and tiktoken could not download one ({type(e).__name__}). "
            f"Run `meshlm fetch-tokenizer` (it takes it from PyPI's {WHISPER_SDIST}), or pass a .tiktoken / "
            "tokenizer.json path, or set MESHLM_TOKENIZER"
        ) from None


def tokenizer_files(spec: TokenizerSpec = None, model: str | Path | None = None) -> dict[str, Path]:
    """The files that carry a model's tokenizer (name in the destination -> source file): its
    tokenizer.json and, beside a file of that name, the other `TOKENIZER_FILES` present. Empty for GPT-2
    BPE, which every meshlm model without a tokenizer.json uses anyway."""
    path = tokenizer_json(spec, model)
    if path is None:
        return {}
    files = {"tokenizer.json": path}
    if path.name == "tokenizer.json":
        files |= {n: path.parent / n for n in TOKENIZER_FILES[1:] if (path.parent / n).is_file()}
    return files


def copy_files(files: dict[str, Path], folder: str | Path) -> None:
    """Copy `files` (name -> source) into `folder`, each written under a temporary name and renamed, so a
    file is either whole or absent; a file already there is kept (processes sharing a folder may all copy)."""
    folder = as_path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        dest = folder / name
        if dest.exists():
            continue
        tmp = folder / f"{name}.tmp{os.getpid()}"
        tmp.write_bytes(as_path(source).read_bytes())  # small files; either side may be a URL
        tmp.replace(dest)


def save_hf_tokenizer(folder: str | Path, path: str | Path | None = None) -> None:
    """Write the GPT-2 BPE as a Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) into `folder`,
    built offline from the BPE ranks, so a model folder loads with `transformers.AutoTokenizer`."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = load_tokenizer(path)
    if not isinstance(tok, TiktokenTokenizer):
        raise ConfigError("save_hf_tokenizer needs a .tiktoken BPE file, not a tokenizer.json")
    enc = tok._enc
    with tempfile.TemporaryDirectory() as tmp:
        bpe = Path(tmp) / "r50k_base.tiktoken"
        ranks = sorted(enc._mergeable_ranks.items(), key=lambda item: item[1])  # type: ignore[attr-defined]
        bpe.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks))
        pattern = enc._pat_str  # type: ignore[attr-defined]
        converter = TikTokenConverter(vocab_file=str(bpe), pattern=pattern, extra_special_tokens={EOT_TEXT: EOT_ID})
        converted = converter.converted()
    special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT}
    PreTrainedTokenizerFast(tokenizer_object=converted, **special).save_pretrained(str(folder))


def fetch_from_pypi(dest: Path = CACHE_FILE) -> Path:
    """Download openai-whisper's source distribution with pip, extract gpt2.tiktoken, check its sha256."""
    if dest.is_file() and sha256(dest) == R50K_SHA256:
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp]
        try:
            subprocess.run([*cmd, WHISPER_SDIST], check=True)
        except subprocess.CalledProcessError as e:
            raise ConfigError(
                f"could not download {WHISPER_SDIST} from PyPI (pip exited with {e.returncode}; see its message "
                f"above); without network access, pass a GPT-2 BPE file with --tokenizer or $MESHLM_TOKENIZER"
            ) from None
        (sdist,) = Path(tmp).glob("openai*whisper-*.tar.gz")
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
    digest = hashlib.sha256(data).hexdigest()
    if digest != R50K_SHA256:
        raise ConfigError(f"gpt2.tiktoken from {WHISPER_SDIST} has sha256 {digest}, expected {R50K_SHA256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp_dest = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")  # processes fetching at once never share it
    tmp_dest.write_bytes(data)
    tmp_dest.replace(dest)
    return dest
