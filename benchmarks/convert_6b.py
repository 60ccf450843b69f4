"""Convert a GPT-J-6B-shaped seed checkpoint (8 shards, bf16, ~12 GB) to Hugging Face and meshlm format,
and that meshlm checkpoint on to Hugging Face.

Writes random weights in the seed's exact layout (generated chunk by chunk, never the whole model in
memory), then times each `meshlm convert` in a child process and reports each
one's wall time and peak RSS (from wait4, so only that child counts). The peer, measured in the same
run, is `cp -r` of the same folder: the disk's own floor for reading and writing those bytes.
Everything is deleted at the end (unless --keep).

    python benchmarks/convert_6b.py [--workdir /tmp] [--layers 28] [--skip-meshlm]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from convert_common import check_disk, folder_bytes, meshlm_convert, print_table, run  # beside this script

from meshlm import model
from meshlm.config import preset
from meshlm.formats import mtj

SHARDS = 8


def write_seed_checkpoint(step_dir: Path, n_layer: int, step: int = 383500) -> int:
    """GPT-J-6B-shaped random bf16 weights in the seed's slim layout; returns the bytes written."""
    cfg = preset("gptj-6b").replace(n_layer=n_layer)
    shapes = list(mtj.shard_shapes(cfg, SHARDS).values())
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(1 << 26, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    k, m = divmod(len(shapes) + 1, mtj.CHUNKS)  # + the step scalar
    written = 0
    for s in range(SHARDS):
        folder = step_dir / f"shard_{s}"
        folder.mkdir(parents=True)
        leaves = [*shapes, ()]
        for i in range(mtj.CHUNKS):
            arrays = []
            for shape in leaves[i * k + min(i, m) : (i + 1) * k + min(i + 1, m)]:
                if shape == ():
                    arrays.append(np.array(step, np.int32))
                    continue
                n = int(np.prod(shape))
                start = int(rng.integers(0, pool.size - n + 1))
                arrays.append(pool[start : start + n].reshape(shape).view(np.dtype("V2")))
            with open(folder / f"{i}.npz", "wb") as f:
                np.savez(f, *arrays)
            written += (folder / f"{i}.npz").stat().st_size
    return written


def summed_fc_out_bias(step_dir: Path, n_layer: int) -> np.ndarray:
    """The seed sums fc_out's bias over shards: what both exports must hold (rounded to bf16)."""
    ckpt = mtj.SeedCheckpoint(step_dir)
    seed_name = f"{mtj.ROOT}layer_{n_layer - 1}/~/linear_5/b"
    parts = [ckpt.member("params", seed_name, s).array().astype(np.float32) for s in range(SHARDS)]
    return np.sum(parts, axis=0, dtype=np.float32).astype(ml_dtypes.bfloat16)


def check_hf(hf_dir: Path, expected: np.ndarray, n_layer: int) -> None:
    from safetensors import safe_open

    name = f"transformer.h.{n_layer - 1}.mlp.fc_out.bias"
    for f in hf_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="np") as st:
            if name in st.keys():  # noqa: SIM118
                assert np.array_equal(st.get_tensor(name), expected), "fc_out bias is not the sum over shards"
                return
    raise AssertionError(f"{name} not in the export")


def check_meshlm(folder: Path, expected: np.ndarray) -> None:
    import tensorstore as ts

    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(folder / "params" / "layers.mlp.fc_out.b")}}
    array = ts.open(spec).result()
    got = array[array.shape[0] - 1].read().result()
    assert np.array_equal(got, expected), "meshlm fc_out bias is not the sum over shards"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp")
    parser.add_argument("--layers", type=int, default=28, help="fewer layers for a quicker, smaller run")
    parser.add_argument("--skip-meshlm", action="store_true", help="only the Hugging Face conversion")
    parser.add_argument("--keep", action="store_true", help="leave the files in place")
    args = parser.parse_args()

    params = model.count_params(preset("gptj-6b").replace(n_layer=args.layers))
    check_disk(args.workdir, params * 2 * 3.2)  # the seed folder, the meshlm output and its HF copy (+ margin)
    work = Path(tempfile.mkdtemp(prefix="convert_6b_", dir=args.workdir))
    step_dir = work / "step_383500"
    rows = []
    try:
        start = time.perf_counter()
        size = write_seed_checkpoint(step_dir, args.layers)
        gib = size / 2**30
        print(f"wrote {gib:.2f} GiB seed checkpoint ({params:,} params) in {time.perf_counter() - start:.0f}s")

        wall, rss = run(["cp", "-r", str(step_dir), str(work / "copy")])
        shutil.rmtree(work / "copy")
        rows.append(("cp -r (peer: the disk's floor)", wall, rss, gib))

        wall, rss = meshlm_convert(step_dir, work / "hf", "hf", "bfloat16")
        expected = summed_fc_out_bias(step_dir, args.layers)
        check_hf(work / "hf", expected, args.layers)
        rows.append(("meshlm convert --to hf (streamed)", wall, rss, folder_bytes(work / "hf") / 2**30))
        shutil.rmtree(work / "hf")

        if not args.skip_meshlm:
            wall, rss = meshlm_convert(step_dir, work / "meshlm", "meshlm", "bfloat16")
            check_meshlm(work / "meshlm", expected)
            rows.append(("meshlm convert --to meshlm (streamed)", wall, rss, folder_bytes(work / "meshlm") / 2**30))
            wall, rss = meshlm_convert(work / "meshlm", work / "hf2", "hf", "bfloat16")
            check_hf(work / "hf2", expected, args.layers)
            rows.append(("that meshlm checkpoint --to hf (streamed)", wall, rss, folder_bytes(work / "hf2") / 2**30))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print_table(f"GPT-J-6B-shaped ({args.layers} layers), {SHARDS} shards, bf16 seed checkpoint of {gib:.2f} GiB", rows)


if __name__ == "__main__":
    main()
