"""Remote run folders: a training run whose out_dir is a gs:// URL, end to end against a local GCS
emulator (gcp-storage-emulator: no network, no credentials). Orbax writes the arrays through
tensorstore's GCS driver and meshlm the rest through etils.epath (gcsfs), both pointed at the emulator."""

import numpy as np
import pytest

import meshlm
from meshlm import data, train
from meshlm.config import TrainConfig


@pytest.mark.slow
def test_a_run_in_a_bucket_saves_resumes_and_loads(bucket, tmp_path):
    rows = np.random.default_rng(0).integers(0, 500, (32, 17))
    data.write_index(
        tmp_path / "data", 16, {"train": data.write_split(tmp_path / "data", "train", [rows], 16)}, eos_id=0
    )
    run = f"{bucket}/runs/tiny"
    base = dict(model=meshlm.preset("test-tiny"), data=str(tmp_path / "data"), out_dir=run, batch_size=4, lr=1e-3,
                warmup_steps=0, val_every=0, ckpt_every=2, log_every=1000, sample_tokens=0)  # fmt: skip
    base["log_dir"] = str(tmp_path / "logs")
    first = train.train(TrainConfig(total_steps=2, **base), progress=False, sample=False)
    assert not (tmp_path / "gs:").exists() and (tmp_path / "logs" / "metrics.jsonl").is_file()
    resumed = train.train(TrainConfig(total_steps=4, **base), progress=False, sample=False)
    assert sorted(resumed.losses) == [3, 4]  # went on from the bucket's step 2
    whole = train.train(TrainConfig(total_steps=4, **{**base, "out_dir": str(tmp_path / "local")}), progress=False,
                        sample=False)  # fmt: skip
    np.testing.assert_allclose([resumed.losses[s] for s in (3, 4)], [whole.losses[s] for s in (3, 4)], rtol=1e-5)

    tokens = rows[:2, :8]
    loaded = meshlm.load(run)  # the run's latest step, read back from the bucket
    np.testing.assert_array_equal(loaded.logits(tokens), resumed.lm.logits(tokens))
    loaded.save(f"{bucket}/ckpt")  # a plain checkpoint written to the bucket, and read back
    np.testing.assert_array_equal(meshlm.load(f"{bucket}/ckpt").logits(tokens), resumed.lm.logits(tokens))
    assert first.step == 2
