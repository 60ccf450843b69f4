"""What a compiled program needs per device, and what a device has: the figures `meshlm train` checks
before it loads a model and `meshlm plan` reports, read from XLA's own compiler.

A program's footprint is XLA's `memory_analysis()` of the compiled executable: its arguments, its outputs
less those aliased to donated arguments, and its temporaries; host memory (an optimizer state kept there)
apart. For a TPU the compiler also refuses a program
that exceeds the chip's HBM (RESOURCE_EXHAUSTED), naming the bytes it needed and the bytes available;
both are parsed here, so the capacity of a TPU comes from the compiler too.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

import jax

from meshlm.config import MeshlmError

GIB = 2**30
# XLA's "G" is GiB: a 15.61G program fits in "15.75G available"
_UNITS = {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_NEEDED = re.compile(r"(?:required for [^(]*\(|Used )([\d.]+)([BKMGT])")
_AVAILABLE = re.compile(r"(?:available HBM \(|of )([\d.]+)([BKMGT])")


class OutOfMemory(MeshlmError):
    """A program does not fit the device: the compiler said so, or its footprint exceeds the capacity."""

    def __init__(self, message: str, needed: int | None = None, capacity: int | None = None):
        super().__init__(message)
        self.needed, self.capacity = needed, capacity


@dataclass(frozen=True)
class Footprint:
    """Bytes per device of one compiled program, as XLA's memory analysis reports them."""

    arguments: int
    outputs: int
    aliased: int  # outputs written into donated arguments: counted once, with the arguments
    temporaries: int
    code: int  # generated code, apart from the data
    # Host memory the program reads and writes in place (arrays whose sharding names `pinned_host`): apart from
    # the device's, where the compiler counts it apart (TPU, GPU); a CPU's counts it with the device's, 0 here.
    host: int = 0

    @classmethod
    def of(cls, compiled: Any) -> Footprint:
        s = compiled.memory_analysis()
        return cls(
            s.argument_size_in_bytes,
            s.output_size_in_bytes,
            s.alias_size_in_bytes,
            s.temp_size_in_bytes,
            s.generated_code_size_in_bytes,
            s.host_argument_size_in_bytes
            + s.host_output_size_in_bytes
            - s.host_alias_size_in_bytes
            + s.host_temp_size_in_bytes,
        )

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries


def is_out_of_memory(err: BaseException) -> bool:
    """A program or an allocation refused for want of device memory: XLA's RESOURCE_EXHAUSTED, a MemoryError,
    or meshlm's own OutOfMemory (a compiled footprint over the device's capacity)."""
    text = str(err)
    if isinstance(err, (MemoryError, OutOfMemory)):
        return True
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def compile_for(lowered: Any) -> Any:
    """`lowered.compile()`, with the compiler's refusal of an over-budget program as `OutOfMemory`."""
    try:
        return lowered.compile()
    except Exception as e:  # XLA raises JaxRuntimeError (or ValueError) for a program over the HBM
        if not is_out_of_memory(e):
            raise
        message = str(e).splitlines()[0]
        raise OutOfMemory(message, needed_bytes(message), available_bytes(message)) from None


def needed_bytes(message: str) -> int | None:
    """The bytes an over-budget program needs, from XLA's RESOURCE_EXHAUSTED message (None: not stated)."""
    return _bytes(_NEEDED.search(message))


def available_bytes(message: str) -> int | None:
    """The bytes the device has for a program, from XLA's RESOURCE_EXHAUSTED message (None: not stated)."""
    return _bytes(_AVAILABLE.search(message))


def _bytes(m: re.Match | None) -> int | None:
    return None if m is None else int(float(m.group(1)) * _UNITS[m.group(2)])


def host_memory() -> int:
    """Physical memory of this host."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_available() -> int:
    """The kernel's estimate of what can be allocated without swapping (MemAvailable: free memory and
    reclaimable caches); where /proc/meminfo is missing, the free pages alone."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cpu_share(host_bytes: int) -> int:
    """A CPU device's share of host memory: simulated CPU devices share one host."""
    return host_bytes // max(sum(d.platform == "cpu" for d in jax.local_devices(backend="cpu")), 1)


def device_capacity(device: Any) -> int | None:
    """Bytes a program may use on `device`: the runtime's own limit where it reports one (GPUs, TPUs),
    a share of host memory for a CPU device. None: unknown. A TPU known only by its topology has no
    runtime: `compiler_capacity` asks its compiler."""
    if device.platform == "cpu":
        return _cpu_share(host_memory())
    stats = device.memory_stats()
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def free_memory(device: Any) -> int | None:
    """Bytes new arrays on `device` can still take: the runtime's limit less what is in use (GPUs, TPUs);
    for a CPU device its share of what the host has available, not of its physical memory, which other
    processes use too. None: unknown."""
    if device.platform == "cpu":
        return _cpu_share(host_available())
    stats = device.memory_stats()
    if not stats or not stats.get("bytes_limit"):
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def compiler_capacity(device: Any) -> int | None:
    """The HBM a TPU chip makes available to one program, as its compiler states it when it refuses a
    program far larger than any chip (compiled ahead of time: nothing is allocated)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh([device], ("d",)), PartitionSpec())
    huge = jax.ShapeDtypeStruct((2**38,), "float32", sharding=sharding)  # 1 TiB
    try:
        compile_for(jax.jit(lambda a: a * 2 + 1, out_shardings=sharding).lower(huge))
    except OutOfMemory as e:
        return e.capacity
    return None


def gib(n: float | None) -> str:
    return "?" if n is None or (isinstance(n, float) and math.isnan(n)) else f"{n / GIB:.2f} GiB"
