"""GPT-2 BPE, byte-exact with GPT-J's tokenizer (tiktoken `r50k_base`, `<|endoftext|>` = 50256).

Where the BPE file comes from, in order: an explicit path (a `.tiktoken` file or a Hugging Face
`tokenizer.json`), `$MESHLM_TOKENIZER`, meshlm's cache (`~/.cache/meshlm/r50k_base.tiktoken`, filled
by `meshlm fetch-tokenizer` from the copy PyPI ships inside openai-whisper's source), then tiktoken's
own download and cache.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Protocol

from meshlm.config import ConfigError

EOT_ID = 50256
EOT_TEXT = "<|endoftext|>"
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# The same bytes ship as whisper/assets/gpt2.tiktoken in this source distribution on PyPI.
WHISPER_SDIST = "openai-whisper==20250625"
CACHE_FILE = Path(os.environ.get("MESHLM_CACHE", Path.home() / ".cache" / "meshlm")) / "r50k_base.tiktoken"


class Tokenizer(Protocol):
    eot_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...
    def decode_bytes(self, ids: list[int]) -> bytes: ...


class TiktokenTokenizer:
    """GPT-2 BPE through tiktoken. `<|endoftext|>` in text becomes the EOT id; no other special tokens."""

    eot_id = EOT_ID

    def __init__(self, encoding: object):
        self._enc = encoding
        self.vocab_size = encoding.n_vocab  # type: ignore[attr-defined]

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special={EOT_TEXT})  # type: ignore[attr-defined]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_batch(texts, allowed_special={EOT_TEXT})  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids))  # type: ignore[attr-defined]

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self._enc.decode_bytes(list(ids))  # type: ignore[attr-defined]


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (through the `tokenizers` library)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:
            raise ConfigError(f"{path}: reading tokenizer.json needs the 'tokenizers' package") from None
        self._tok = RustTokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        eot = self._tok.token_to_id(EOT_TEXT)
        self.eot_id = EOT_ID if eot is None else eot

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.decode(ids).encode("utf-8")


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


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The GPT-2 tokenizer from `path`, or from the first place in the module docstring's order."""
    if path is None and os.environ.get("MESHLM_TOKENIZER"):
        path = os.environ["MESHLM_TOKENIZER"]
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"tokenizer file {path} not found")
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
        subprocess.run([*cmd, WHISPER_SDIST], check=True)
        (sdist,) = Path(tmp).glob("openai*whisper-*.tar.gz")
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
    digest = hashlib.sha256(data).hexdigest()
    if digest != R50K_SHA256:
        raise ConfigError(f"gpt2.tiktoken from {WHISPER_SDIST} has sha256 {digest}, expected {R50K_SHA256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp_dest = dest.with_suffix(".tmp")
    tmp_dest.write_bytes(data)
    tmp_dest.replace(dest)
    return dest
