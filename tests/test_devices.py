"""The device table: each device kind JAX reports reads as its own peak per JAX device, one a table lacks
reads NaN (never another's figure), and MFU and the planner's targets take their peaks from it."""

import importlib.util
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from meshlm import devices, metrics, planner
from meshlm.config import preset

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None

# device_kind as JAX reports it -> dense bf16 peak FLOP/s of one JAX device
PEAKS = {
    "TPU v2": 22.5e12,  # one TensorCore: half a 45 TFLOP/s chip
    "TPU v3": 61.5e12,  # one TensorCore: half a 123 TFLOP/s chip
    "TPU v4": 275e12,  # megacore: the whole chip
    "TPU v4 lite": 137e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5": 459e12,  # v5p, not v5e
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,  # v6e
    "TPU v6e": 918e12,
    "TPU7x": 1153.5e12,  # one TensorCore: half a 2307 TFLOP/s chip
    "NVIDIA B200": 2250e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA L40": 181e12,
    "NVIDIA L4": 121e12,
    "NVIDIA A10": 125e12,
    "NVIDIA A10G": 70e12,
    "NVIDIA RTX A6000": 155e12,
    "NVIDIA GeForce RTX 4090": 165e12,
    "NVIDIA GeForce RTX 3090": 71e12,
    "Tesla V100-SXM2-16GB": 125e12,
    "Tesla V100-SXM2-32GB": 125e12,
    "Tesla V100-PCIE-32GB": 112e12,
    "Tesla T4": 65e12,
}


@pytest.mark.parametrize("kind,peak", PEAKS.items())
def test_each_device_kind_reads_as_its_own_peak(kind, peak):
    assert devices.peak_flops(SimpleNamespace(device_kind=kind)) == peak


@pytest.mark.parametrize(
    "kind",
    [
        "TPU v9",
        "TPU v5 super",
        "cpu",
        "",
        "NVIDIA GeForce RTX 3090 Ti",  # not a 3090
        "NVIDIA H200 NVL",  # not the SXM H200
        "NVIDIA A100-SXM4-40GB MIG 1g.5gb",  # a slice of an A100
        "Tesla V100S-PCIE-32GB",
        "NVIDIA RTX 6000 Ada Generation",  # not an RTX A6000
        "NVIDIA GH200 480GB",
    ],
)
def test_a_device_the_table_lacks_reads_nan(kind):
    assert devices.find(kind) is None
    assert math.isnan(devices.peak_flops(SimpleNamespace(device_kind=kind)))


def test_names_that_share_letters_are_told_apart():
    assert [devices.find(f"NVIDIA {m}").name for m in ("A10", "A10G", "A100-SXM4-80GB")] == [
        "a10-24gb",
        "a10g-24gb",
        "a100-80gb",
    ]
    assert [devices.find(f"NVIDIA {m}").name for m in ("L4", "L40", "L40S")] == ["l4-24gb", "l40-48gb", "l40s-48gb"]
    assert devices.find("NVIDIA A100-SXM4-40GB").name == "a100-40gb"  # the memory in the name picks the entry
    assert devices.find("TPU v5").name == "v5p" and devices.find("TPU v5 lite").name == "v5e"


def test_a_megacore_chip_listed_by_core_has_half_its_peak():
    assert devices.peak_flops(SimpleNamespace(device_kind="TPU v4", num_cores=2)) == 275e12
    assert devices.peak_flops(SimpleNamespace(device_kind="TPU v4", num_cores=1)) == 137.5e12
    assert devices.peak_flops(SimpleNamespace(device_kind="TPU v5", num_cores=1)) == 229.5e12
    # a chip whose cores are always listed apart is the table's figure already
    assert devices.peak_flops(SimpleNamespace(device_kind="TPU v3", num_cores=1)) == 61.5e12


def test_memory_is_per_jax_device():
    assert devices.DEVICES["v3"].memory == 16 * 2**30  # half a 32 GiB chip
    assert devices.DEVICES["v4"].memory == 32 * 2**30
    assert devices.DEVICES["h100-80gb"].memory == 80e9


def test_every_gpu_is_a_planner_target_with_its_table_figures():
    for name, entry in devices.GPUS.items():
        tgt = planner.target(f"gpu:{name}")
        assert tgt.peak_flops == entry.peak_flops
        assert tgt.capacity == int(entry.memory * planner.GPU_MEMORY_FRACTION)
        assert int(re.fullmatch(r".*-(\d+)gb", name).group(1)) * 1e9 == entry.memory  # the name states it
    assert math.isnan(planner.target("gpu:mystery-12gb").peak_flops)


@pytest.mark.skipif(not HAS_LIBTPU, reason="TPU topologies come from libtpu (pip install 'meshlm[tpu]')")
def test_libtpu_device_kinds_read_as_their_generation(monkeypatch):
    from jax.experimental import topologies

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # not the lock of a libtpu in another test process
    # ahead-of-time topologies list v2, v3, v4 and TPU7x by core, v5p by megacore chip
    expected = {
        "v2:2x2": ("TPU v2", 22.5e12),
        "v3:2x2": ("TPU v3", 61.5e12),
        "v4:2x2x1": ("TPU v4", 137.5e12),
        "v5e:2x2": ("TPU v5 lite", 197e12),
        "v5p:2x2x1": ("TPU v5", 459e12),
        "v6e:2x2": ("TPU v6 lite", 918e12),
        "tpu7x:2x2x1": ("TPU7x", 1153.5e12),
    }
    for topology, (kind, peak) in expected.items():
        device = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
        assert (device.device_kind, devices.peak_flops(device)) == (kind, peak), topology
    assert planner.target("tpu:v5p:2x2x1").peak_flops == 459e12


def test_mfu_peak_of_an_accelerator_mesh_is_the_table_times_its_devices():
    mesh = SimpleNamespace(devices=np.array([SimpleNamespace(platform="tpu", device_kind="TPU v5")] * 8))
    assert metrics.peak_flops(mesh, "bfloat16") == 8 * 459e12
    mesh = SimpleNamespace(devices=np.array([SimpleNamespace(platform="gpu", device_kind="NVIDIA A10G")] * 2))
    assert metrics.peak_flops(mesh, "bfloat16") == 2 * 70e12


def test_attention_flops_are_the_causal_half():
    cfg = preset("test-tiny")
    seq = 64
    matmul = metrics.flops_per_token(cfg, 1) - 6 * cfg.n_layer * cfg.d_model * 1  # the weights' share
    assert metrics.flops_per_token(cfg, seq) - matmul == 6 * cfg.n_layer * cfg.d_model * seq
    # a local layer's query sees w - w^2 / (2 seq) keys: the full causal half when the window is the sequence
    local = cfg.replace(attention_layers=("global", "local"), local_window=16)
    per_layer = {"global": seq / 2, "local": 16 - 16**2 / (2 * seq)}
    keys = sum(per_layer[kind] for kind in local.layer_kinds)
    assert metrics.flops_per_token(local, seq) - matmul == pytest.approx(12 * cfg.d_model * keys)
    wide = cfg.replace(attention_layers=("local",), local_window=seq)
    assert metrics.flops_per_token(wide, seq) == metrics.flops_per_token(cfg, seq)


def test_a_cpu_hosts_matmul_peak_is_measured_once_per_machine_and_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))
    measured = []
    monkeypatch.setattr(metrics, "measure_matmul_peak", lambda dtype: measured.append(dtype) or 1e11 * len(measured))
    mesh = SimpleNamespace(devices=np.array([SimpleNamespace(platform="cpu", device_kind="cpu")] * 8))
    assert metrics.peak_flops(mesh, "float32") == metrics.peak_flops(mesh, "float32") == 1e11  # the second: read
    assert metrics.peak_flops(mesh, "bfloat16") == 2e11 and measured == ["float32", "bfloat16"]
    (tmp_path / "cache" / "matmul_peak.json").write_text("{not json")  # a torn file is measured again
    assert metrics.peak_flops(mesh, "float32") == 3e11 and metrics.peak_flops(mesh, "float32") == 3e11
    assert len(measured) == 3
