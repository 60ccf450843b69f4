"""`meshlm convert` and the reading of meshlm checkpoints meeting faults: a damaged chunk, a path through `..`,
a full disk, a killed conversion. Each failure is one line naming what failed, and nothing is left at the
destination that looks like a checkpoint but is not one."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import meshlm
from meshlm import cli, model
from meshlm.config import CheckpointError, LoraConfig, preset
from meshlm.formats import adapters, hf
from meshlm.lora import init_adapter
from tests.small_disk import tmpfs

TOKENS = np.arange(24).reshape(2, 12)
LAYOUTS = ["zarr", "ocdbt"]  # meshlm's two layouts: a streamed write's (convert --to meshlm) and orbax's (lm.save)
DAMAGES = ["missing", "truncated", "garbage"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """One tiny random GPT-J in both meshlm layouts and as a Hugging Face folder."""
    root = tmp_path_factory.mktemp("faults_convert")
    lm = meshlm.from_config(preset("test-tiny"))
    lm.save(root / "ocdbt")
    meshlm.convert(root / "ocdbt", root / "zarr", to="meshlm")
    lm.save(root / "hf", format="hf")
    return {"ocdbt": root / "ocdbt", "zarr": root / "zarr", "hf": root / "hf"}


@pytest.fixture(scope="module")
def logits(folders) -> np.ndarray:
    return meshlm.load(folders["zarr"]).logits(TOKENS)


def damage(source: Path, layout: str, how: str, folder: Path) -> Path:
    """A copy of `source` with one chunk damaged `how`: q's zarr chunk, or OCDBT's largest data file."""
    shutil.copytree(source, folder)
    if layout == "zarr":
        chunk = folder / "params" / "layers.attn.q" / "0.0.0.0"
    else:
        chunk = max((folder / "params").rglob("d/*"), key=lambda p: p.stat().st_size)
    data = chunk.read_bytes()
    if how == "missing":
        chunk.unlink()
    else:
        chunk.write_bytes(data[: len(data) // 2] if how == "truncated" else os.urandom(len(data)))
    return folder


def damage_message(folder: Path, layout: str) -> str:
    """What a damaged chunk reads as: the parameter, and the chunk's file or its key in the OCDBT database."""
    params = re.escape(str(folder / "params"))
    if layout == "zarr":
        return rf"parameter layers\.attn\.q: chunk missing or corrupt \({params}/layers\.attn\.q/0\.0\.0\.0\)"
    return rf"parameter ([\w.]+): chunk missing or corrupt \(\1/[\d.]+ in the OCDBT database {params}/\)"


def run(capsys, *args: str | Path) -> tuple[int, str]:
    """`meshlm ARGS` in this process: its exit status and its stderr, which must be one line (what a terminal
    shows once the progress bar has erased itself) without a traceback."""
    capsys.readouterr()
    code = cli.main([str(a) for a in args])
    err = capsys.readouterr().err
    shown = err.split("\r")[-1].strip()
    assert "Traceback" not in err and "\n" not in shown, err
    return code, shown


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_converting_a_damaged_chunk_is_refused_in_one_line_naming_it(folders, layout, how, tmp_path, capsys):
    """A missing chunk used to be read as zeros (q_proj all zeros in a checkpoint "written" with exit 0)."""
    folder = damage(folders[layout], layout, how, tmp_path / "damaged")
    for to in ("hf", "meshlm"):
        code, err = run(capsys, "convert", folder, tmp_path / "out", "--to", to)
        assert code == 1
        assert re.fullmatch("meshlm convert: error: " + damage_message(folder, layout), err)
        assert leftovers(tmp_path) == ["damaged"]


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_loading_a_damaged_chunk_is_one_line_naming_it(folders, layout, how, tmp_path, capfd):
    folder = damage(folders[layout], layout, how, tmp_path / "damaged")
    with pytest.raises(CheckpointError) as e:
        meshlm.load(folder)
    assert re.fullmatch(damage_message(folder, layout), str(e.value))
    assert capfd.readouterr().err == ""


def test_sampling_from_a_damaged_chunk_prints_one_line_and_no_late_tracebacks(folders, tmp_path):
    """orbax leaves its other reads running when one fails; they used to print tracebacks until the process ended."""
    folder = damage(folders["zarr"], "zarr", "garbage", tmp_path / "damaged")
    done = subprocess.run(
        [sys.executable, "-m", "meshlm", "sample", str(folder), "--prompt", "hi"], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert re.fullmatch("meshlm sample: error: " + damage_message(folder, "zarr") + "\n", done.stderr)


def test_paths_through_dotdot_convert_both_ways(folders, logits, tmp_path, monkeypatch, capsys):
    """tensorstore's file driver refuses `..`: converting from or to such a path used to fail half-way."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    up = {name: os.path.relpath(path, here) for name, path in folders.items()}
    assert all(p.startswith("..") for p in up.values())
    assert run(capsys, "convert", up["hf"], "../from-hf", "--to", "meshlm")[0] == 0
    assert run(capsys, "convert", up["zarr"], "zarr-hf", "--to", "hf")[0] == 0
    assert run(capsys, "convert", up["ocdbt"], "../ocdbt-hf", "--to", "hf")[0] == 0
    for name in ("../from-hf", "zarr-hf", "../ocdbt-hf"):
        np.testing.assert_allclose(meshlm.load(name).logits(TOKENS), logits, atol=1e-5)
    assert leftovers(tmp_path) == ["from-hf", "here", "ocdbt-hf"]


def test_an_empty_destination_folder_becomes_the_checkpoint(folders, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert run(capsys, "convert", folders["zarr"], tmp_path / "out", "--to", "hf")[0] == 0
    assert leftovers(tmp_path) == ["out"] and leftovers(tmp_path / "out") == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("to", ["hf", "meshlm"])
def test_a_full_disk_is_one_line_with_the_bytes_and_leaves_nothing(folders, to, tmp_path, capsys):
    with tmpfs(tmp_path / "disk", "256k") as disk:  # the model takes 661,504 bytes
        code, err = run(capsys, "convert", folders["zarr"], disk / "out", "--to", to)
        assert code == 1
        assert re.fullmatch(
            rf"meshlm convert: error: {disk}/out: No space left on device "
            r"\(it needs about 661,504 bytes, [\d,]+ bytes were free\)",
            err,
        )
        assert leftovers(disk) == []


# `meshlm convert` whose last parameter never comes: it is killed (kill -9) while it waits
STALLED_CONVERT = """
import sys, time
from pathlib import Path
from meshlm import cli, model
from meshlm.formats import registry

opened = registry.open

def stalling(*args, **kwargs):
    cfg, source = opened(*args, **kwargs)
    last = list(model.param_shapes(cfg))[-1]

    def stalled(name, shape):
        if name == last:
            Path(sys.argv[1]).touch()
            time.sleep(600)
        return source(name, shape)

    return cfg, stalled

registry.open = stalling
sys.exit(cli.main(sys.argv[2:]))
"""


def test_a_killed_conversion_leaves_no_half_folder_and_the_rerun_says_what_is_left(folders, logits, tmp_path, capsys):
    out, waiting = tmp_path / "out", tmp_path / "waiting"
    command = ["convert", str(folders["hf"]), str(out), "--to", "meshlm"]
    convert = subprocess.Popen([sys.executable, "-c", STALLED_CONVERT, str(waiting), *command])
    deadline = time.monotonic() + 120
    while not waiting.exists() and convert.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    convert.kill()
    convert.wait()
    assert waiting.exists()
    unfinished = tmp_path / "out.convert-unfinished"
    assert not out.exists() and len(leftovers(unfinished / "params")) > 1  # the parameters written so far

    code, err = run(capsys, *command)
    assert (code, err) == (
        1,
        f"meshlm convert: error: {unfinished}: left by a `meshlm convert` to {out} that did not finish "
        "(killed, or still running); remove it or pass --overwrite",
    )
    assert run(capsys, *command, "--overwrite")[0] == 0
    assert leftovers(tmp_path) == ["out", "waiting"]
    np.testing.assert_allclose(meshlm.load(out).logits(TOKENS), logits, atol=1e-5)


def test_an_unfinished_checkpoint_at_dst_is_named_and_overwrite_replaces_it(folders, logits, tmp_path, capsys):
    """What an interrupted `lm.save` (or an older meshlm's killed convert) leaves: meshlm's files, no marker."""
    out = tmp_path / "out"
    shutil.copytree(folders["zarr"], out)
    (out / "meshlm.json").unlink()
    code, err = run(capsys, "convert", folders["ocdbt"], out, "--to", "hf")
    assert (code, err) == (
        1,
        f"meshlm convert: error: {out}: an unfinished save or conversion (no meshlm.json / config.json); "
        "remove it or pass --overwrite",
    )
    assert run(capsys, "convert", folders["ocdbt"], out, "--to", "hf", "--overwrite")[0] == 0
    assert leftovers(out) == ["config.json", "model.safetensors"]
    np.testing.assert_allclose(meshlm.load(out).logits(TOKENS), logits, atol=1e-5)


def test_overwrite_replaces_a_finished_checkpoint_but_nothing_else(folders, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(capsys, "convert", folders["zarr"], out, "--to", "hf")[0] == 0
    code, err = run(capsys, "convert", folders["zarr"], out, "--to", "hf", "--dtype", "bfloat16")
    assert (code, err) == (
        1,
        f"meshlm convert: error: {out}: already holds a checkpoint; choose a new folder or pass --overwrite "
        "to replace it",
    )
    assert run(capsys, "convert", folders["zarr"], out, "--to", "hf", "--dtype", "bfloat16", "--overwrite")[0] == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"

    (out / "notes.txt").write_text("mine")
    code, err = run(capsys, "convert", folders["zarr"], out, "--to", "meshlm", "--overwrite")
    assert (code, err) == (
        1,
        f"meshlm convert: error: {out}: already exists and is not empty (it holds notes.txt, which meshlm does "
        "not write); choose a new folder",
    )
    assert leftovers(out) == ["config.json", "model.safetensors", "notes.txt"]


def test_merge_takes_overwrite_too(folders, tmp_path, capsys):
    cfg = meshlm.load(folders["zarr"]).config
    adapter = jax.tree.map(np.asarray, init_adapter(model.projections(cfg), LoraConfig(rank=2), jax.random.key(0)))
    adapters.write_peft(tmp_path / "adapter", adapter, cfg, hf.export_arch(cfg))
    merge = ["merge", folders["zarr"], tmp_path / "adapter", tmp_path / "merged"]
    assert run(capsys, *merge)[0] == 0
    assert run(capsys, *merge)[0] == 1
    assert run(capsys, *merge, "--overwrite")[0] == 0
    assert leftovers(tmp_path) == ["adapter", "merged"]
