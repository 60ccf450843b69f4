"""Convert a Pythia-6.9B-shaped Hugging Face checkpoint (GPTNeoXForCausalLM, fp16, ~13 GiB) to meshlm
format and that back to Hugging Face, with each step's wall time and peak RSS.

The random source is written as Hugging Face writes it (sharded safetensors, an index, config.json)
through meshlm's streamed writer, one tensor at a time cut from a shared random pool: the model is never
in memory. Every step (writing the source, each `meshlm convert`) runs in a process of its own, whose
wall time and peak RSS (wait4) are reported. The peer, measured in the same run, is `cp -r` of the
source: the disk's own floor for those bytes. The last layer's tensors must come back bit for bit.
Everything is deleted at the end (unless --keep).

    python benchmarks/convert_pythia.py [--workdir /tmp] [--preset pythia-6.9b] [--layers 32] [--dtype float16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from convert_common import check_disk, folder_bytes, meshlm_convert, print_table, run  # beside this script

from meshlm import model
from meshlm.config import ModelConfig, dtype_of, preset
from meshlm.formats import hf
from meshlm.formats.slices import Index, SliceReader, SliceSource

POOL = 1 << 24  # random values every tensor is cut from (32 MiB in fp16)


def random_source(dtype: str, seed: int = 0) -> SliceSource:
    """Random weights in `dtype`: each slice starts at a random offset of one shared pool (repeating it
    when larger), so generating a tensor costs no more than copying it."""
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(POOL, np.float32) * 0.02).astype(dtype_of(dtype))

    def source(name: str, shape: tuple[int, ...]) -> SliceReader:
        def read(index: Index) -> np.ndarray:
            sizes = [len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True)]
            start = int(rng.integers(0, POOL))
            return np.resize(pool[start:], sizes)

        return read

    return source


def write_source(folder: Path, cfg: ModelConfig, dtype: str) -> None:
    """A random Hugging Face checkpoint of `cfg` in `dtype`, streamed."""
    hf.write(folder, cfg, dtype, random_source(dtype))


def last_layer(folder: Path, n_layer: int) -> dict[str, np.ndarray]:
    """The tensors of the last layer in a Hugging Face folder (the names hold `.{n_layer - 1}.`)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    tensors = {}
    for name in sorted(files):
        with safe_open(str(folder / name), framework="np") as st:
            tensors |= {k: st.get_tensor(k) for k in st.keys() if f".{n_layer - 1}." in k}  # noqa: SIM118
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp")
    parser.add_argument("--preset", default="pythia-6.9b", help="the architecture and sizes (default pythia-6.9b)")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers for a quicker, smaller run")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--keep", action="store_true", help="leave the files in place")
    parser.add_argument("--write-source", metavar="DIR", help="only write the random source into DIR (the first step)")
    args = parser.parse_args()

    cfg = preset(args.preset)
    cfg = cfg.replace(n_layer=args.layers or cfg.n_layer)
    if args.write_source:
        write_source(Path(args.write_source), cfg, args.dtype)
        return
    itemsize = np.dtype(dtype_of(args.dtype)).itemsize
    params = model.count_params(cfg)
    check_disk(args.workdir, params * itemsize * 3.2)  # the source, the meshlm output and its HF copy (+ margin)
    work = Path(tempfile.mkdtemp(prefix="convert_pythia_", dir=args.workdir))
    source = work / "hf"
    rows = []
    try:
        sizes = ["--preset", args.preset, "--layers", str(cfg.n_layer), "--dtype", args.dtype]
        wall_source, rss_source = run([sys.executable, __file__, *sizes, "--write-source", str(source)])
        gib = folder_bytes(source) / 2**30
        print(f"wrote {gib:.2f} GiB Hugging Face checkpoint ({params:,} params) in {wall_source:.0f}s")

        wall, rss = run(["cp", "-r", str(source), str(work / "copy")])
        shutil.rmtree(work / "copy")
        rows.append(("cp -r (peer: the disk's floor)", wall, rss, gib))
        rows.append(("write the random source (streamed)", wall_source, rss_source, gib))

        wall, rss = meshlm_convert(source, work / "meshlm", "meshlm", args.dtype)
        rows.append(("meshlm convert --to meshlm (streamed)", wall, rss, folder_bytes(work / "meshlm") / 2**30))
        wall, rss = meshlm_convert(work / "meshlm", work / "back", "hf", args.dtype)
        rows.append(("that meshlm checkpoint --to hf (streamed)", wall, rss, folder_bytes(work / "back") / 2**30))

        expected, got = last_layer(source, cfg.n_layer), last_layer(work / "back", cfg.n_layer)
        assert expected and expected.keys() == got.keys(), "the round trip lost tensors"
        for name, array in expected.items():
            assert np.array_equal(got[name], array), f"{name} changed in the round trip"
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    title = f"{args.preset}-shaped ({cfg.n_layer} layers), {args.dtype} Hugging Face checkpoint of {gib:.2f} GiB"
    print_table(title, rows)


if __name__ == "__main__":
    main()
