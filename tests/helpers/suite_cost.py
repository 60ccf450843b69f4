"""Where the suite's time goes: `python -m pytest -q --suite-cost` (docs/testing.md).

A pytest plugin that conftest.py registers for `--suite-cost`. Per test file it sums the CPU seconds of the test
processes and of the subprocesses they waited for (a server's are counted when its fixture stops it), and the
seconds JAX timed on the test's thread for tracing, lowering to MLIR and compiling (wall seconds: a wait for a
busy core counts, XLA's compiler threads do not), with the programs compiled or loaded and how many of them came
from the persistent cache. On two busy cores the CPU seconds, not the wall clock, say what a cut saves: two
workers share the cores. Under xdist each worker sends its table to the main process.
"""

from __future__ import annotations

import collections
import resource

import pytest

KEY = "suite_cost"
JAX_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
CACHE_HITS = "/jax/compilation_cache/cache_hits"
# cpu: the test process's CPU seconds; children: its subprocesses'; trace, lower, compile: JAX's wall seconds
COLUMNS = ("cpu", "children", "trace", "lower", "compile", "programs", "cached")

_costs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_current = ["(outside any test)"]


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds of this process (all its threads), and of the children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _on_duration(event: str, seconds: float, **_: object) -> None:
    if event in JAX_EVENTS:
        _costs[_current[0]][JAX_EVENTS[event]] += seconds
        _costs[_current[0]]["programs"] += event.endswith("backend_compile_duration")


def _on_event(event: str, **_: object) -> None:
    if event == CACHE_HITS:
        _costs[_current[0]]["cached"] += 1


def pytest_configure(config: pytest.Config) -> None:
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _current[0] = item.nodeid.split("::")[0]
    own, children = cpu_seconds()
    yield
    own_after, children_after = cpu_seconds()
    _costs[_current[0]]["cpu"] += own_after - own
    _costs[_current[0]]["children"] += children_after - children


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its main process prints
        session.config.workeroutput[KEY] = {f: dict(c) for f, c in _costs.items()}


@pytest.hookimpl(optionalhook=True)  # xdist's hook (a worker's table arrives): absent under -p no:xdist
def pytest_testnodedown(node, error) -> None:
    for f, c in getattr(node, "workeroutput", {}).get(KEY, {}).items():
        _costs[f].update(c)


def _row(c: collections.Counter, name: str) -> str:
    return " ".join(f"{c[k]:9d}" if k in ("programs", "cached") else f"{c[k]:9.1f}" for k in COLUMNS) + f"  {name}"


def pytest_terminal_summary(terminalreporter) -> None:
    if hasattr(terminalreporter.config, "workeroutput") or not _costs:
        return
    write = terminalreporter.write_line
    terminalreporter.section("seconds by test file (tests/helpers/suite_cost.py)")
    write(" ".join(f"{c:>9}" for c in COLUMNS) + "  file")
    total: collections.Counter = collections.Counter()
    for f, c in sorted(_costs.items(), key=lambda fc: -(fc[1]["cpu"] + fc[1]["children"])):
        total.update(c)
        write(_row(c, f))
    write(_row(total, "all"))
