"""Where a profiled program's device time goes: the ops of a JAX profile, summed by op and by category.

Reads the `.xplane.pb` that `jax.profiler.trace(folder)` wrote (as `benchmarks/gpu.py --profile` and
`benchmarks/decode_rows.py --profile` do) with JAX's own `jax.profiler.ProfileData`, so that a profile taken
on a machine without xprof or TensorBoard can still be read there. Prints the device's busy time, then the
ops that took the most of it (with XLA's category, FLOPs and bytes where the profiler records them, and the
JAX source name), then the time by category.

    python benchmarks/profile_ops.py /tmp/profile --top 40
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

from jax.profiler import ProfileData

DETAIL_STATS = ("hlo_category", "flops", "bytes_accessed", "tf_op", "long_name", "source")


def device_ops(path: Path) -> tuple[str, list[tuple[str, float, dict[str, Any]]]]:
    """The device plane's name and its op events as (name, nanoseconds, stats)."""
    data = ProfileData.from_file(str(path))
    planes = [p for p in data.planes if p.name.startswith("/device:") and "CUSTOM" not in p.name]
    if not planes:  # a CPU run: its ops are events of the XLA client's threads
        planes = [p for p in data.planes if p.name == "/host:CPU"]
    plane = planes[0]
    on_device = plane.name.startswith("/device:")  # a device's ops are its "XLA Ops" line; a CPU's carry hlo_op
    events = []
    for line in plane.lines:
        for ev in line.events if not on_device or line.name == "XLA Ops" else ():
            stats = dict(ev.stats)
            if on_device or "hlo_op" in stats:
                events.append((ev.name, ev.duration_ns, stats))
    if not events:
        raise SystemExit(f"profile_ops: no op events on {plane.name} (its lines: {[x.name for x in plane.lines]})")
    return plane.name, events


def summarize(folder: Path, top: int) -> dict[str, Any]:
    files = sorted(folder.rglob("*.xplane.pb"))
    if not files:
        raise SystemExit(f"profile_ops: no .xplane.pb under {folder}")
    plane, events = device_ops(files[-1])
    by_op: dict[str, dict[str, Any]] = {}
    by_category: collections.Counter[str] = collections.Counter()
    for name, ns, stats in events:
        op = by_op.setdefault(name, {"ns": 0.0, "count": 0, **{k: stats[k] for k in DETAIL_STATS if k in stats}})
        op["ns"] += ns
        op["count"] += 1
        by_category[str(stats.get("hlo_category", "?"))] += ns
    busy = sum(op["ns"] for op in by_op.values())
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1]["ns"])
    print(f"{files[-1].name}: plane {plane}, {len(events)} op events, busy {busy / 1e6:.2f} ms")
    print(f"{'ms':>9} {'%':>6} {'n':>5} {'category':<22} {'TFLOP/s':>8} {'GB/s':>7}  op / source")
    for name, op in ranked[:top]:
        secs = op["ns"] / 1e9
        flops = float(op.get("flops", 0) or 0) * op["count"]
        moved = float(op.get("bytes_accessed", 0) or 0) * op["count"]
        where = str(op.get("tf_op") or op.get("source") or "")[-90:]
        print(
            f"{op['ns'] / 1e6:>9.3f} {100 * op['ns'] / busy:>6.2f} {op['count']:>5} "
            f"{str(op.get('hlo_category', '?'))[:22]:<22} {flops / secs / 1e12 if secs else 0:>8.1f} "
            f"{moved / secs / 1e9 if secs else 0:>7.0f}  {name} {where}"
        )
    print("by category:")
    for cat, ns in by_category.most_common():
        print(f"{ns / 1e6:>9.3f} {100 * ns / busy:>6.2f}  {cat}")
    return {"plane": plane, "busy_ns": busy, "ops": dict(ranked[:top]), "categories": dict(by_category)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="the folder jax.profiler.trace wrote")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--json", type=Path, help="also write the summary here")
    args = p.parse_args()
    report = summarize(args.folder, args.top)
    if args.json:
        for op in report["ops"].values():
            op.pop("long_name", None)
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
