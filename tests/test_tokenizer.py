"""meshlm's GPT-2 tokenizer against tiktoken's own r50k_base definition and ids published for GPT-2."""

import hashlib
import shutil
from pathlib import Path

import pytest
import tiktoken

from meshlm.tokenizer import EOT_ID, R50K_SHA256, load_tokenizer, sha256

R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
SAMPLES = [
    "Hello world",
    "  leading, trailing and   inner   runs of spaces   ",
    "tabs\tand\t\ttabs, new\nlines\n\n\nand\r\nCRLF \n \n",
    "naïve café, Zürich, ½ · “quotes” — dash",
    "日本語のテキスト、中文文本和한국어",
    "emoji 🙂👍🏽 and combining e\u0301 and zero\u200bwidth",
    "numbers 1234567890 3.14159 -42 1e-9",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "contractions: it's, we're, they've, I'm, you'll, he'd",
    "two documents<|endoftext|>joined by the special token",
]


@pytest.fixture(scope="module")
def tok(gpt2_bpe_file):
    return load_tokenizer(gpt2_bpe_file)


@pytest.fixture(scope="module")
def r50k(gpt2_bpe_file, tmp_path_factory):
    """tiktoken's own `r50k_base` (its pattern, special tokens and vocabulary size), loaded offline: the
    verified BPE file is placed where tiktoken's download cache looks for it, and tiktoken checks its hash."""
    cache = tmp_path_factory.mktemp("tiktoken_cache")
    shutil.copy(gpt2_bpe_file, cache / hashlib.sha1(R50K_URL.encode()).hexdigest())
    mp = pytest.MonkeyPatch()
    mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    try:
        yield tiktoken.get_encoding("r50k_base")
    finally:
        mp.undo()


def test_the_bpe_file_is_the_published_one(gpt2_bpe_file):
    assert sha256(Path(gpt2_bpe_file)) == R50K_SHA256


def test_known_gpt2_ids(tok):
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("Hello, world!") == [15496, 11, 995, 0]
    assert tok.encode("a\n\nb") == [64, 198, 198, 65]
    assert tok.encode("<|endoftext|>") == [EOT_ID] == [50256]
    assert tok.vocab_size == 50257 and tok.eot_id == 50256


@pytest.mark.parametrize("text", SAMPLES)
def test_encodings_match_tiktoken_r50k_and_round_trip(tok, r50k, text):
    ids = tok.encode(text)
    assert ids == r50k.encode(text, allowed_special="all")
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode()


def test_special_token_is_one_id_inside_text(tok):
    ids = tok.encode("a<|endoftext|>b")
    assert ids.count(EOT_ID) == 1 and tok.decode(ids) == "a<|endoftext|>b"


def test_hf_tokenizer_json_encodes_identically(tok, r50k, gpt2_bpe_file, tmp_path):
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converted = TikTokenConverter(
        vocab_file=gpt2_bpe_file, pattern=r50k._pat_str, extra_special_tokens={"<|endoftext|>": EOT_ID}
    ).converted()
    converted.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(tmp_path / "tokenizer.json")
    assert hf.eot_id == EOT_ID
    for text in SAMPLES:
        assert hf.encode(text) == tok.encode(text), text
        assert hf.decode(hf.encode(text)) == text


def test_a_failed_download_is_one_line_naming_the_way_out(tmp_path, monkeypatch):
    from meshlm import tokenizer
    from meshlm.config import ConfigError

    monkeypatch.setattr(tokenizer, "WHISPER_SDIST", "openai-whisper==0.0.0.dev0")  # a release that never existed
    with pytest.raises(ConfigError, match=r"could not download openai-whisper==0\.0\.0\.dev0 from PyPI .* --tokenizer"):
        tokenizer.fetch_from_pypi(tmp_path / "r50k_base.tiktoken")
    assert not (tmp_path / "r50k_base.tiktoken").exists()
