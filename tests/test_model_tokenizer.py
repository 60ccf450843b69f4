"""A model folder's own tokenizer.json (here a GPT-NeoX-style BPE, `<|endoftext|>` = id 0) is the model's
tokenizer everywhere: load, generate, save, convert, eval, prepare and train; GPT-2 BPE stays the default."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

import meshlm
from meshlm import cli, data, evaluate, train
from meshlm.config import ConfigError, TrainConfig, preset
from meshlm.formats import hf, native, registry
from meshlm.tokenizer import EOT_ID, TOKENIZER_FILES, tokenizer_json

TEXT = "How do you keep bread fresh for longer? Store it in a sealed bag."


@pytest.fixture(scope="module")
def folder(hf_tiny, neox_style_tokenizer, tmp_path_factory) -> Path:
    """hf_tiny's random GPT-J (512 ids) with the NeoX-style tokenizer files beside its weights."""
    dst = tmp_path_factory.mktemp("with_tokenizer") / "model"
    shutil.copytree(hf_tiny.path, dst)
    for f in neox_style_tokenizer.iterdir():
        shutil.copy(f, dst)
    return dst


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' own reading of the folder's tokenizer."""
    return AutoTokenizer.from_pretrained(folder)


def tokenizer_bytes(path: Path) -> dict[str, bytes]:
    return {n: (path / n).read_bytes() for n in TOKENIZER_FILES if (path / n).is_file()}


def run_cli(*argv: str) -> int:
    return cli.main([str(a) for a in argv])


def test_load_reads_the_folders_tokenizer(folder, reference):
    tok = meshlm.load(folder).tokenizer
    assert tok.eot_id == 0 == reference.eos_token_id
    assert tok.encode(TEXT) == reference.encode(TEXT)
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_an_explicit_tokenizer_wins_and_gpt2_stays_the_default(folder, hf_tiny, gpt2_bpe_file):
    assert meshlm.load(folder, tokenizer=gpt2_bpe_file).tokenizer.eot_id == EOT_ID
    assert tokenizer_json(model=hf_tiny.path) is None  # no tokenizer.json: GPT-2 BPE
    assert tokenizer_json(folder) == folder / "tokenizer.json"  # a model folder names its tokenizer


@pytest.mark.slow
def test_generation_encodes_decodes_and_stops_with_the_models_tokenizer(folder, hf_tiny, reference):
    lm = meshlm.load(folder)
    assert lm.sampling().stop_token_ids == (0,)
    tokens = reference.encode(TEXT)
    new = []
    for _ in range(12):  # greedy decoding with transformers' logits, ending at the model's end-of-text
        token = int(hf_tiny.logits(np.array([tokens + new]))[0, -1].argmax())
        if token == 0:
            break
        new.append(token)
    assert lm.generate(TEXT, max_new_tokens=12, temperature=0) == [reference.decode(new)]


@pytest.mark.parametrize(("first", "then"), [("meshlm", "hf"), ("hf", "meshlm")])
def test_save_and_convert_carry_the_tokenizer_files(folder, reference, tmp_path, first, then):
    expected = tokenizer_bytes(folder)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(expected)
    lm = meshlm.load(folder)
    lm.save(tmp_path / "saved", format=first)
    meshlm.convert(tmp_path / "saved", tmp_path / "converted", to=then)
    for out in (tmp_path / "saved", tmp_path / "converted"):
        assert tokenizer_bytes(out) == expected
        assert meshlm.load(out).tokenizer.encode(TEXT) == reference.encode(TEXT)
    hf_out = tmp_path / ("saved" if first == "hf" else "converted")
    assert AutoTokenizer.from_pretrained(hf_out).encode(TEXT) == reference.encode(TEXT)


@pytest.mark.parametrize("fmt", ["meshlm", "hf"])
def test_a_save_never_overwrites_and_an_interrupted_one_is_no_checkpoint(folder, tmp_path, monkeypatch, fmt):
    lm = meshlm.load(folder)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        lm.save(tmp_path / "taken", format=fmt)
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]

    def crash(*args, **kwargs):
        raise OSError("disk full")

    # The weights fail after the tokenizer files are in: the folder holds no marker, so it is no checkpoint.
    monkeypatch.setattr(*((hf, "write_folder", crash) if fmt == "hf" else (native, "_write_marker", crash)))
    with pytest.raises(OSError, match="disk full"):
        lm.save(tmp_path / "partial", format=fmt)
    assert (tmp_path / "partial" / "tokenizer.json").is_file()
    with pytest.raises(ConfigError, match="not a checkpoint meshlm can read"):
        registry.detect(tmp_path / "partial")


def test_an_explicit_tokenizer_is_saved_and_a_config_no_hf_class_represents_writes_nothing(
    neox_style_tokenizer, tmp_path
):
    lm = meshlm.from_config(preset("test-tiny").replace(norm="rmsnorm"), tokenizer=neox_style_tokenizer)
    lm.save(tmp_path / "meshlm")
    assert tokenizer_bytes(tmp_path / "meshlm") == tokenizer_bytes(neox_style_tokenizer)
    with pytest.raises(ConfigError, match="rmsnorm"):
        lm.save(tmp_path / "hf", format="hf")
    assert not (tmp_path / "hf").exists()


def test_a_malformed_tokenizer_json_is_a_one_line_error_naming_the_file(folder, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    lm = meshlm.load(bad)  # the weights load; the tokenizer is read when text needs it
    with pytest.raises(ConfigError, match=f"{bad / 'tokenizer.json'}: not a readable tokenizer.json"):
        _ = lm.tokenizer
    (tmp_path / "t.txt").write_text(TEXT)
    for argv in (
        ["sample", bad, "--prompt", "Hi", "--max-new-tokens", "1"],
        ["prepare", tmp_path / "t.txt", "--out", tmp_path / "out", "--seq-len", "4", "--tokenizer", bad],
    ):
        assert run_cli(*argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{bad / 'tokenizer.json'}: not a readable tokenizer.json (" in err


def test_perplexity_and_lm_eval_score_with_the_models_tokenizer(folder, reference, tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    assert run_cli("eval", folder, "--perplexity", tmp_path / "t.txt", "--output", tmp_path / "ppl.json") == 0
    assert json.loads((tmp_path / "ppl.json").read_text())["tokens"] == len(reference.encode(TEXT))
    model = evaluate.MeshLM(meshlm.load(folder))
    assert model.eot_token_id == 0 and model.tok_encode(TEXT) == reference.encode(TEXT)


def test_prepare_tokenizes_with_a_model_folders_tokenizer(folder, reference, tmp_path):
    docs = [TEXT, "A screwdriver tightens a loose screw.", "Add a few ice cubes to it."]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "prepared"
    argv = ["prepare", tmp_path / "docs.jsonl", "--out", out, "--seq-len", "7", "--workers", "1"]
    assert run_cli(*argv, "--tokenizer", folder) == 0
    stream = [t for d in docs for t in [*reference.encode(d), 0]]
    ds = data.TokenDataset(out)
    assert ds.eos_id == 0
    rows = ds[list(range(len(ds)))].tokens
    np.testing.assert_array_equal(rows.reshape(-1), stream[: rows.size])


@pytest.mark.slow
def test_fine_tuning_uses_and_keeps_the_init_models_tokenizer(folder, reference, tmp_path):
    cfg = TrainConfig(
        init_from=str(folder), out_dir=str(tmp_path / "run"), seq_len=32, batch_size=8, total_steps=1,
        warmup_steps=0, anneal_steps=1, val_every=0, ckpt_every=0, sample_tokens=0,
    )  # fmt: skip
    result = train.train(cfg, progress=False)  # no data: the demo corpus, tokenized with the model's tokenizer
    assert data.read_index(tmp_path / "run" / "data")["eos_id"] == 0
    assert tokenizer_bytes(tmp_path / "run") == tokenizer_bytes(folder)  # the run's checkpoints load with it
    for lm in (result.lm, meshlm.load(tmp_path / "run")):
        assert lm.tokenizer.encode(TEXT) == reference.encode(TEXT)

    rows = np.random.default_rng(0).integers(0, 500, (8, 33))
    gpt2_data = tmp_path / "gpt2_data"
    data.write_index(gpt2_data, 32, {"train": data.write_split(gpt2_data, "train", [rows], 32)}, eos_id=EOT_ID)
    with pytest.raises(ConfigError, match=f"prepare the data with `meshlm prepare --tokenizer {folder}`"):
        train.train(cfg.replace(data=str(gpt2_data), out_dir=str(tmp_path / "run2")), progress=False)
