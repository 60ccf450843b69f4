"""Many LoRA adapters over one base in one engine: which adapters are registered, which device slot holds
which, and which a slot may be taken from.

An engine with adapter slots keeps every registered adapter on the host (by name, padded to the slots'
rank: `lora.fill_slot`) and the ones requests are running in `n` device slots (`runner.Runner`'s
`params["adapters"]`; slot 0 is the base's, all zeros). A request for an adapter that is not in a slot
takes a free one, or the least recently used one no live request runs (that adapter stays registered and
comes back when asked for); when every slot is in use, the request is refused. This module is the
bookkeeping only: the engine writes the slots and decides which adapters are in use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import count
from typing import Any, NamedTuple

from meshlm.config import InputError

_keys = count(1)  # 0 is the base's


class Adapter(NamedTuple):
    """A LoRA adapter as the engine takes it: its weights (host arrays in `lora`'s layout), read from its
    folder at the front door (`meshlm.api.read_adapter`), and where they came from (for /v1/models)."""

    weights: Any
    source: str


class SlotsBusy(Exception):
    """Every adapter slot holds an adapter that live requests run; the client should retry later."""


@dataclass
class Registered:
    """One registered adapter: its slot contents on the host and, while it is in a device slot, the slot."""

    name: str
    source: str  # where it was read from, for /v1/models
    weights: Any  # host arrays, one slot's contents
    key: int = field(default_factory=lambda: next(_keys))  # unique per registration: its prefix-cache salt
    slot: int = 0  # its device slot, 0 while it has none
    used: float = 0.0  # when a request last asked for it


class AdapterSlots:
    """The registered adapters and `n` device slots (numbered 1..n; 0 is the base's)."""

    def __init__(self, n: int, rank: int):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InputError(f"max_adapters must be an integer >= 1, got {n!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise InputError(f"max_lora_rank must be an integer >= 1, got {rank!r}")
        self.n, self.rank = n, rank
        self.registered: dict[str, Registered] = {}

    def get(self, name: str) -> Registered:
        if (adapter := self.registered.get(name)) is None:
            raise InputError(f"no adapter named {name!r} is loaded", param="model")
        return adapter

    def register(self, adapter: Registered) -> None:
        if adapter.name in self.registered:
            raise InputError(f"an adapter named {adapter.name!r} is loaded already; unload it first", param="lora_name")
        self.registered[adapter.name] = adapter

    def unregister(self, name: str, busy: set[int]) -> Registered:
        """Forget adapter `name`; refused while a live request runs it (`busy`: the keys live requests run)."""
        adapter = self.get(name)
        if adapter.key in busy:
            raise InputError(f"adapter {name!r} is in use by running requests; unload it when they finish",
                             param="lora_name")  # fmt: skip
        return self.registered.pop(name)

    def place(self, name: str, busy: set[int]) -> tuple[Registered, bool]:
        """Adapter `name` in a slot: (it, whether its weights must be written there now). It takes a free slot,
        else the least recently used one whose adapter no live request runs (`busy`), else SlotsBusy."""
        adapter = self.get(name)
        adapter.used = time.monotonic()
        if adapter.slot:
            return adapter, False
        holders = {a.slot: a for a in self.registered.values() if a.slot}
        free = [s for s in range(1, self.n + 1) if s not in holders]
        if not free:
            idle = [a for a in holders.values() if a.key not in busy]
            if not idle:
                raise SlotsBusy(f"all {self.n} adapter slots run adapters of live requests; retry later")
            evicted = min(idle, key=lambda a: a.used)
            free, evicted.slot = [evicted.slot], 0
        adapter.slot = free[0]
        return adapter, True
