"""Packing efficiency: the share of a packed dataset's tokens that are not padding, meshlm against trl.

    PYTHONPATH=. python benchmarks/packing.py [--examples 20000] [--seq-len 2048] [--median 250] [--sigma 1.0]

The same examples on both sides: token counts drawn from a lognormal distribution (long-tailed: most examples
short, a few filling a row), cut to the row length. meshlm packs them as `meshlm prepare` does (`BestFit`:
best-fit decreasing over a bounded buffer of about 1024 rows' worth of examples, the emptiest rows' examples
held back for the next round), and once more over all examples at once, the bound the buffer approaches. trl
packs them with `trl.data_utils.pack_dataset` and its default strategy ("bfd", best-fit decreasing within
each `datasets.map` batch of 1000 examples). Efficiency = tokens / (rows x row length): every row padded to
the row length, as a compiled training step needs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from meshlm.prepare import PACK_BUFFER_ROWS, BestFit, best_fit


def lengths(n: int, capacity: int, median: float, sigma: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), sigma, n).astype(np.int64), 2, capacity)


def meshlm_rows(sizes: np.ndarray, capacity: int) -> int:
    packer = BestFit(capacity, PACK_BUFFER_ROWS * capacity)
    rows = sum(len(packer.add(i, int(n))) for i, n in enumerate(sizes))
    return rows + len(packer.finish())


def trl_rows(sizes: np.ndarray, capacity: int) -> int:
    from datasets import Dataset, disable_progress_bars
    from trl.data_utils import pack_dataset

    disable_progress_bars()
    dataset = Dataset.from_dict({"input_ids": [np.ones(n, np.int32) for n in sizes]})
    packed = pack_dataset(dataset, capacity)
    assert sum(sum(s) for s in packed["seq_lengths"]) == sizes.sum()  # every token kept (none longer than a row)
    return len(packed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=20000)
    parser.add_argument("--seq-len", type=int, default=2048, help="row length in tokens, the same on both sides")
    parser.add_argument("--median", type=float, default=250.0, help="median example length in tokens")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma: the tail's weight")
    args = parser.parse_args()
    sizes = lengths(args.examples, args.seq_len, args.median, args.sigma)
    total = int(sizes.sum())
    print(f"{args.examples} examples, {total} tokens, lengths: median {np.median(sizes):.0f}, mean {sizes.mean():.0f}, "
          f"p99 {np.percentile(sizes, 99):.0f}, max {sizes.max()}; rows of {args.seq_len} tokens")  # fmt: skip
    results = {}
    for name, pack in [
        ("meshlm BestFit (bounded buffer, as `meshlm prepare`)", lambda: meshlm_rows(sizes, args.seq_len)),
        ("meshlm best_fit over all examples at once", lambda: len(best_fit(sizes.tolist(), args.seq_len))),
        ("trl pack_dataset, strategy 'bfd' (its default)", lambda: trl_rows(sizes, args.seq_len)),
    ]:
        start = time.perf_counter()
        rows = pack()
        seconds = time.perf_counter() - start
        results[name] = total / (rows * args.seq_len)
        print(f"{name:55s} {rows:7d} rows  efficiency {results[name]:.2%}  ({seconds:.2f} s)")
    meshlm, _, trl = results.values()
    print(f"meshlm / trl efficiency: {meshlm / trl:.3f}x (padding {1 - meshlm:.2%} vs {1 - trl:.2%})")


if __name__ == "__main__":
    main()
