"""Peak host memory and speed of `meshlm prepare` on generated text files of growing size.

    python benchmarks/prepare_memory.py [--sizes 100M 1G] [--seq-len 2048] [--workers N]

For each size, writes a text file of random English paragraphs (sentences drawn from the Python
docs that ship with every install) into a temporary folder, runs `python -m meshlm prepare` on it in
a subprocess and reports wall time, tokens/s and peak resident memory: the largest single process
(sampled, and the kernel's rusage of the subprocess and what it reaped) and the whole process tree
(resident memory of every process summed, sampled with psutil every 50 ms). Peer in the same run:
the GPT-2 tokenizer alone, one process, in memory, on a sample of the same text. Everything
generated is deleted afterwards. Streaming means the peak memory of the largest run is about that
of the smallest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size_arg(text: str) -> int:
    return int(float(text[:-1]) * UNITS[text[-1].upper()]) if text[-1].upper() in UNITS else int(text)


def paragraphs(n: int, seed: int = 0) -> list[bytes]:
    """n random paragraphs of 3-9 sentences from pydoc's topic texts (real English and code vocabulary)."""
    from pydoc_data.topics import topics

    sentences = [s.strip() for t in topics.values() for s in re.split(r"(?<=[.!?])\s+", t) if 20 < len(s) < 400]
    rng = np.random.default_rng(seed)
    return [
        (" ".join(sentences[i] for i in rng.integers(0, len(sentences), rng.integers(3, 10))) + "\n\n").encode()
        for _ in range(n)
    ]


def write_text(path: Path, size: int, pool: list[bytes], seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    written = 0
    with open(path, "wb") as f:
        while written < size:
            block = b"".join(pool[i] for i in rng.integers(0, len(pool), 4096))[: size - written]
            f.write(block)
            written += len(block)


def tree_rss(proc: psutil.Process) -> tuple[int, int]:
    """(sum, max) resident bytes of a process and its descendants."""
    rss = []
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            rss.append(p.memory_info().rss)
    return sum(rss), max(rss, default=0)


def run_prepare(src: Path, out: Path, seq_len: int, workers: int | None) -> dict:
    cmd = [sys.executable, "-m", "meshlm", "prepare", str(src), "--out", str(out), "--seq-len", str(seq_len)]
    if workers:
        cmd += ["--workers", str(workers)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak = [0, 0]
    done = threading.Event()

    def sample() -> None:
        ps = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                total, largest = tree_rss(ps)
            except psutil.Error:
                break
            peak[0], peak[1] = max(peak[0], total), max(peak[1], largest)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout = proc.stdout.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"meshlm prepare failed:\n{stdout}")
    index = json.loads((out / "index.json").read_text())
    tokens = index["splits"]["train"]["tokens"]
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "rusage_max_mib": usage.ru_maxrss / 1024,  # kilobytes on Linux
        "tree_peak_mib": peak[0] / 2**20,
        "largest_peak_mib": peak[1] / 2**20,
    }


def tokenizer_alone(sample: bytes) -> float:
    """Tokens/s of the GPT-2 tokenizer in this process, no files, no packing: the peer."""
    sys.path.insert(0, str(ROOT))
    from meshlm.tokenizer import load_tokenizer

    tok = load_tokenizer()
    text = sample.decode()
    start = time.perf_counter()
    n = len(tok.encode(text))
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["100M", "1G"], help="file sizes to run, e.g. 100M 1G")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=None, help="meshlm prepare --workers (default: every core)")
    args = ap.parse_args()

    pool = paragraphs(2000)
    peer = tokenizer_alone(b"".join(pool[:400]) * 10)
    print(f"machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
          f"workers: {args.workers or os.cpu_count()}; seq_len {args.seq_len}")  # fmt: skip
    print(f"peer: GPT-2 tokenizer alone, one process, in memory: {peer:,.0f} tokens/s")
    print(f"{'input':>8} {'seconds':>8} {'tokens':>13} {'tokens/s':>10} {'vs peer':>8} "
          f"{'rusage MiB':>10} {'largest MiB':>11} {'tree MiB':>9}")  # fmt: skip
    results = []
    for size_text in args.sizes:
        size = size_arg(size_text)
        with tempfile.TemporaryDirectory(prefix="meshlm-prepare-bench-") as tmp:
            src = Path(tmp) / "corpus.txt"
            write_text(src, size, pool)
            r = run_prepare(src, Path(tmp) / "out", args.seq_len, args.workers)
        results.append(r)
        print(f"{size_text:>8} {r['seconds']:8.1f} {r['tokens']:13,} {r['tokens_per_s']:10,.0f} "
              f"{r['tokens_per_s'] / peer:7.2f}x {r['rusage_max_mib']:10.0f} {r['largest_peak_mib']:11.0f} "
              f"{r['tree_peak_mib']:9.0f}")  # fmt: skip
    if len(results) > 1:
        first, last = results[0], results[-1]
        print(f"input {args.sizes[-1]} / {args.sizes[0]}: peak tree memory ratio "
              f"{last['tree_peak_mib'] / first['tree_peak_mib']:.2f}, largest-process ratio "
              f"{last['rusage_max_mib'] / first['rusage_max_mib']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
