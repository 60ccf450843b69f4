"""W&B logging (`wandb_project`): off by default; in wandb's offline mode the run's history holds what
metrics.jsonl holds, and a resumed run continues the same W&B run."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from meshlm import cli, train
from meshlm.config import ConfigError, TrainConfig
from meshlm.metrics import MetricsLog
from tests.helpers.training import CFG8, SEQ, write_dataset

pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")


def wandb_history(run_file: Path) -> list[dict]:
    """The history records of a `.wandb` file: LevelDB-style log blocks of 32 KiB, each record a 7-byte
    header (crc32, little-endian length, type) and a chunk of a protobuf `Record`."""
    data, pos, chunks, rows = run_file.read_bytes(), 7, b"", []  # the file header: ":W&B", magic, version
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if length == 0 and kind == 0:
            break
        chunks, pos = chunks + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.fixture
def run_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = np.random.default_rng(0).integers(1, 250, (32, SEQ + 1))
    data = write_dataset(tmp_path / "data", rows)
    return TrainConfig(
        model=CFG8, data=str(data), out_dir=str(tmp_path / "run"), batch_size=8, total_steps=3, val_every=0,
        ckpt_every=0, log_every=1, sample_tokens=0, wandb_project="meshlm-test",
    )  # fmt: skip


@pytest.mark.slow
def test_offline_wandb_run_holds_the_logged_metrics_and_resumes(run_config):
    out = Path(run_config.out_dir)
    train.train(run_config, progress=False, sample=False)
    run_id = (out / "wandb_run_id").read_text().strip()
    (run_file,) = out.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    history = {row["_step"]: row for row in wandb_history(run_file) if "loss" in row}
    assert sorted(history) == [r["step"] for r in logged] == [1, 2, 3]
    for record in logged:
        assert history[record["step"]]["loss"] == pytest.approx(record["loss"])
        assert history[record["step"]]["lr"] == pytest.approx(record["lr"])

    train.train(run_config.replace(total_steps=5), progress=False, sample=False)  # resumes the folder
    assert (out / "wandb_run_id").read_text().strip() == run_id
    runs = sorted(out.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    steps = {row["_step"] for f in runs for row in wandb_history(f) if "loss" in row}
    assert steps == {1, 2, 3, 4, 5}


def test_wandb_is_off_by_default_and_bad_values_fail_in_one_line(run_config, capsys):
    out = Path(run_config.out_dir)
    out.mkdir(parents=True)
    log = MetricsLog(out, TrainConfig().wandb_project)
    log.write(1, {"loss": 1.0})
    log.close()
    assert not (out / "wandb").exists() and not (out / "wandb_run_id").exists()
    with pytest.raises(ConfigError, match="wandb_project must be a name"):
        run_config.replace(wandb_project="")
    assert cli.main(["train", "--set", "wandb_project=[1]", "--out-dir", str(out / "x")]) == 1
    assert "wandb_project must be a name" in capsys.readouterr().err
