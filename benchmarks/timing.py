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


def best_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """`best_time` of each of `fns`, their runs taken in turn (after one warm-up run each): load from other
    work on a shared machine then slows every variant alike, and their ratios stay meaningful."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages (`/proc/loadavg`), to print beside a timing."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])
