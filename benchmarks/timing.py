"""Wall-clock timing shared by the CPU benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Fastest seconds of `fn` over `repeats` runs, after one warm-up (compilation) run: the figure least
    disturbed by other work on a shared machine."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
