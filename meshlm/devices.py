"""The device table: each accelerator's dense bf16 peak FLOP/s and memory per JAX device.

One table serves the MFU a training run reports (`metrics.peak_flops`) and the targets `meshlm plan` plans
for (`planner.target`). A figure is per JAX device, which is not always a chip:
- TPU v2, v3 and TPU7x list each of a chip's two TensorCores as a device (half the chip);
- TPU v4 and v5p join a chip's two TensorCores into one device (megacore), unless they are listed by core
  (`num_cores` 1, as libtpu's ahead-of-time v4 topologies are): then a device is half the chip;
- v4 lite, v5e and v6e chips have one TensorCore.

A live device is found by its `device_kind`: a TPU by its exact string ("TPU v5 lite" is v5e, "TPU v5" is
v5p, "TPU v6 lite" is v6e), a GPU by the words of its name ("NVIDIA A100-SXM4-80GB" -> A100, 80 GB), where
a word the table does not know (Ti, MIG, NVL on an H200) leaves the device unknown, not taken for another.
An unknown device's peak is NaN: its MFU reads NaN rather than a wrong figure.

Peaks are dense: NVIDIA's datasheets print bf16 "with sparsity", twice the dense figure. GPU memory is in
decimal GB as sold (what the planner plans against); TPU memory is HBM as Google states it, in GiB.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Device:
    """One accelerator as JAX lists it: its dense bf16 peak FLOP/s and memory per JAX device."""

    name: str  # the planner's name: gpu:<name> ("h100-80gb"), or the TPU generation ("v5p")
    platform: str  # "gpu" or "tpu"
    peak_flops: float  # dense bf16 FLOP/s of one JAX device
    memory: float  # bytes of one JAX device
    kinds: tuple[str, ...]  # TPU: its device_kind strings; GPU: the words that name it in a device_kind
    cores: int = 1  # TPU TensorCores in one JAX device, as JAX lists the chip by default


GiB = 2**30
_TPUS = [
    # Cloud TPU v2 (180 TFLOP/s per four-chip board); jax's pallas tpu_info: two TensorCores per chip
    Device("v2", "tpu", 45e12 / 2, 16 * GiB / 2, ("TPU v2",)),
    # cloud.google.com/tpu/docs/v3: 123 TFLOP/s and 32 GiB per chip, two TensorCores
    Device("v3", "tpu", 123e12 / 2, 32 * GiB / 2, ("TPU v3",)),
    # cloud.google.com/tpu/docs/v4: 275 TFLOP/s and 32 GiB per chip, two TensorCores as one device
    Device("v4", "tpu", 275e12, 32 * GiB, ("TPU v4",), cores=2),
    # jax's pallas tpu_info (TPU_V4I): 1.37e14 FLOP/s and 8 GiB, one TensorCore (an inference chip)
    Device("v4i", "tpu", 137e12, 8 * GiB, ("TPU v4 lite",)),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s and 16 GiB per chip, one TensorCore
    Device("v5e", "tpu", 197e12, 16 * GiB, ("TPU v5 lite", "TPU v5e")),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s and 95 GiB per chip, two TensorCores as one device
    Device("v5p", "tpu", 459e12, 95 * GiB, ("TPU v5", "TPU v5p"), cores=2),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOP/s and 32 GiB per chip, one TensorCore
    Device("v6e", "tpu", 918e12, 32 * GiB, ("TPU v6 lite", "TPU v6e")),
    # cloud.google.com/tpu/docs/tpu7x: 2307 TFLOP/s and 192 GiB per chip, two TensorCores listed apart
    Device("tpu7x", "tpu", 2307e12 / 2, 192 * GiB / 2, ("TPU7x",)),
]
_GPUS = [
    # NVIDIA datasheets (dense bf16 Tensor Core; half the "with sparsity" figure)
    Device("b200-180gb", "gpu", 2250e12, 180e9, ("B200",)),  # HGX B200: 4.5 PFLOP/s sparse
    Device("h200-141gb", "gpu", 989e12, 141e9, ("H200",)),  # H200 SXM: 1979 sparse
    Device("h100-80gb", "gpu", 989e12, 80e9, ("H100",)),  # H100 SXM: 1979 sparse
    Device("h100pcie-80gb", "gpu", 756e12, 80e9, ("H100", "PCIE")),  # H100 PCIe: 1513 sparse
    Device("h100nvl-94gb", "gpu", 835e12, 94e9, ("H100", "NVL")),  # H100 NVL: 1671 sparse
    Device("a100-80gb", "gpu", 312e12, 80e9, ("A100",)),  # A100 SXM and PCIe: 312 dense
    Device("a100-40gb", "gpu", 312e12, 40e9, ("A100",)),
    Device("l40s-48gb", "gpu", 362e12, 48e9, ("L40S",)),  # L40S: 362.05 dense
    Device("l40-48gb", "gpu", 181e12, 48e9, ("L40",)),  # L40: 181.05 dense
    Device("a6000-48gb", "gpu", 155e12, 48e9, ("RTX", "A6000")),  # RTX A6000: 309.7 sparse
    Device("l4-24gb", "gpu", 121e12, 24e9, ("L4",)),  # L4: 242 sparse
    Device("a10-24gb", "gpu", 125e12, 24e9, ("A10",)),  # A10: 125 dense
    Device("a10g-24gb", "gpu", 70e12, 24e9, ("A10G",)),  # AWS's A10G: 70 (no NVIDIA datasheet)
    # consumer cards: bf16 with fp32 accumulation, as XLA runs it (Ada and GA102 whitepapers)
    Device("rtx4090-24gb", "gpu", 165e12, 24e9, ("RTX", "4090")),  # 165.2
    Device("rtx3090-24gb", "gpu", 71e12, 24e9, ("RTX", "3090")),
    # Volta and Turing have no bf16 units: their fp16 Tensor Core peak
    Device("v100-32gb", "gpu", 125e12, 32e9, ("V100",)),  # V100 SXM2
    Device("v100-16gb", "gpu", 125e12, 16e9, ("V100",)),
    Device("v100pcie-32gb", "gpu", 112e12, 32e9, ("V100", "PCIE")),
    Device("v100pcie-16gb", "gpu", 112e12, 16e9, ("V100", "PCIE")),
    Device("t4-16gb", "gpu", 65e12, 16e9, ("T4",)),
]
DEVICES: dict[str, Device] = {d.name: d for d in _TPUS + _GPUS}
GPUS: dict[str, Device] = {d.name: d for d in _GPUS}  # `gpu:<name>` targets of the planner
_TPU_KINDS = {kind: d for d in _TPUS for kind in d.kinds}
# words of a GPU's device_kind that say nothing about its peak: the maker, the brand, the form factor
_NOISE = re.compile(r"NVIDIA|TESLA|GEFORCE|QUADRO|SXM\d*|PCIE|HBM\d*E?|\d+GB")


def find(device_kind: str) -> Device | None:
    """The table's entry for a `device_kind`, or None if it has none (or cannot tell which)."""
    if device_kind in _TPU_KINDS:
        return _TPU_KINDS[device_kind]
    if device_kind.upper().startswith("TPU"):
        return None
    words = set(re.findall(r"[A-Z0-9]+", device_kind.upper()))
    # an entry names the device if its words are there and every other word is noise
    fits = [d for d in _GPUS if set(d.kinds) <= words and all(_NOISE.fullmatch(w) for w in words - set(d.kinds))]
    if not fits:
        return None
    most = max(len(d.kinds) for d in fits)  # "H100 PCIe" is the PCIe card, not the SXM one
    fits = [d for d in fits if len(d.kinds) == most]
    sized = [d for d in fits if f"{round(d.memory / 1e9)}GB" in words]  # "A100-SXM4-80GB": the 80 GB one
    fits = sized or fits
    return fits[0] if len({d.peak_flops for d in fits}) == 1 else None


def peak_flops(device: Any) -> float:
    """Dense bf16 peak FLOP/s of one JAX device (anything with a `device_kind`); NaN if the table lacks it.

    A TPU device that holds fewer TensorCores than the table's (`num_cores` 1 on a v4 or v5p chip listed by
    core) has that share of the chip's peak.
    """
    entry = find(getattr(device, "device_kind", ""))
    if entry is None:
        return math.nan
    cores = getattr(device, "num_cores", None)
    if entry.platform == "tpu" and isinstance(cores, int) and 1 <= cores < entry.cores:
        return entry.peak_flops * cores / entry.cores
    return entry.peak_flops
