"""A server's start with and without the programs an earlier start compiled: `meshlm serve` keeps XLA's compiled
programs in meshlm's cache folder (JAX's persistent compilation cache), so a restart reads back the shapes it
compiled before it answers.

    python benchmarks/restart.py [CHECKPOINT] [--max-batch 32 --max-len 1280]

Three starts of `meshlm serve` on the same model and settings, each timed from launch to its first healthy
/health, with the server's own count of what it compiled: with no cache kept (`JAX_COMPILATION_CACHE_DIR` empty,
as before meshlm kept one), then twice with a cache folder of its own, empty at first (cold, then warm). Without
CHECKPOINT, serve.py's random GPT-J (d_model 256, 4 layers) in a temporary folder. The JAX version and the load
are printed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve import REPO, Server, write_random_model
from benchmarks.timing import load_average


def start(checkpoint: str, args: list[str], cache: str | None) -> tuple[float, str]:
    """Seconds from launch to a healthy server, and its line saying what it compiled."""
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache or ""  # where meshlm serve keeps them (default: MESHLM_CACHE's)
    server = Server(checkpoint, REPO, *args)
    server.close()
    compiled = re.search(r"compiled .*", server.proc.stdout.read())
    return server.start_seconds, compiled.group(0) if compiled else "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-len", type=int, default=1280)
    a = p.parse_args()
    import jax  # its version only: the servers, not this process, take the device

    print(f"JAX {jax.__version__}; load average {load_average()}", flush=True)
    args = ["--max-batch", str(a.max_batch), "--max-len", str(a.max_len)]
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = a.checkpoint or f"{folder}/model"
        if not a.checkpoint:
            write_random_model(checkpoint, 256, 4)
        runs = {"no cache kept": None, "cold cache": f"{folder}/xla", "warm cache": f"{folder}/xla"}
        seconds = {}
        for name, cache in runs.items():
            seconds[name], compiled = start(checkpoint, args, cache)
            print(f"{name:>14}: healthy after {seconds[name]:6.1f} s ({compiled})", flush=True)
    print(f"warm / no cache kept: {seconds['warm cache'] / seconds['no cache kept']:.2f}x")


if __name__ == "__main__":
    main()
