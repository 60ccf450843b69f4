import pytest

import meshlm
from meshlm import config, model
from meshlm.config import ConfigError, ModelConfig


def test_gptj_6b_parameter_count_from_shapes():
    assert model.count_params(config.preset("gptj-6b")) == 6_050_882_784


def test_gptj_6b_preset_matches_the_published_shape():
    c = config.preset("gptj-6b")
    assert (c.n_layer, c.d_model, c.d_ff, c.n_head, c.d_head, c.rotary_dim) == (28, 4096, 16384, 16, 256, 64)
    assert (c.vocab_size, c.n_vocab_used, c.max_seq_len) == (50400, 50257, 2048)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n_head": 5}, "n_head (5) must divide d_model (64)"),
        ({"rotary_dim": 7}, "rotary_dim must be a non-negative even integer"),
        ({"rotary_dim": 32}, "rotary_dim (32) must be <= d_head"),
        ({"n_vocab_used": 600}, "n_vocab_used (600) must be <= vocab_size (512)"),
        ({"n_layer": 0}, "n_layer must be a positive integer"),
        ({"d_ff": "big"}, "d_ff must be a positive integer"),
    ],
)
def test_bad_model_config_is_refused_with_the_key_named(changes, message):
    base = config.preset("test-tiny").to_dict()
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_dict({**base, **changes})


def test_unknown_and_missing_keys_are_named():
    base = config.preset("test-tiny").to_dict()
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['n_heads'\]"):
        ModelConfig.from_dict({**base, "n_heads": 4})
    del base["d_ff"]
    with pytest.raises(ConfigError, match=r"missing key\(s\) \['d_ff'\]"):
        ModelConfig.from_dict(base)


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ConfigError, match="unknown model preset 'gptj-7b'; available: .*gptj-6b"):
        config.preset("gptj-7b")


def test_every_meshlm_error_is_a_meshlm_error_and_a_value_error():
    """The command line prints MeshlmErrors in one line; code that caught ValueError before still does."""
    for error in (meshlm.ConfigError, meshlm.CheckpointError, meshlm.DataError, meshlm.InputError):
        assert issubclass(error, meshlm.MeshlmError) and issubclass(error, ValueError)
    assert issubclass(meshlm.CheckpointError, meshlm.ConfigError) and issubclass(meshlm.DataError, meshlm.ConfigError)


def test_the_command_line_prints_file_errors_in_one_line_and_lets_bugs_through(tmp_path, capsys, monkeypatch):
    from meshlm import cli

    folder = tmp_path / "a-folder"
    folder.mkdir()
    assert cli.main(["prepare", str(folder), "--out", str(tmp_path / "out"), "--seq-len", "8"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshlm prepare: error: ") and "\n" not in err

    def bug(args):
        raise ValueError("a programming error, not the user's")

    monkeypatch.setattr(cli, "cmd_fetch_tokenizer", bug)
    with pytest.raises(ValueError, match="programming error"):
        cli.main(["fetch-tokenizer"])


def test_urls_are_refused_where_meshlm_writes_only_locally_instead_of_becoming_local_folders(tmp_path, monkeypatch):
    """`gs://b/run` through a local path would be a folder `gs:/b/run` on every host. A run in a bucket needs a
    local folder for its metrics and prepared data (tests/test_remote.py runs one); a Hugging Face folder is
    written locally. Refused, nothing made."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="out_dir gs://bucket/run is a URL; set log_dir to a local folder"):
        config.TrainConfig(out_dir="gs://bucket/run", data="data/mine")
    with pytest.raises(ConfigError, match="out_dir gs://bucket/run is a URL; set data"):
        config.TrainConfig(out_dir="gs://bucket/run", log_dir="logs")
    lm = meshlm.from_config(meshlm.preset("test-tiny"))
    with pytest.raises(ConfigError, match="Hugging Face folder gs://bucket/hf: remote URLs"):
        lm.save("gs://bucket/hf", format="hf")
    assert list(tmp_path.iterdir()) == []
