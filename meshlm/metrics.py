"""What a training run reports beside its loss: FLOPs per token, throughput and MFU against the devices'
peak, the gradient noise scale, and the metrics log (JSON lines and TensorBoard)."""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from meshlm import devices, model
from meshlm.config import ConfigError, LoraConfig, ModelConfig, dtype_of
from meshlm.corpus import masked_crc32c
from meshlm.lora import adapter_size
from meshlm.paths import cache_dir
from meshlm.sharding import MESH_AXES, param_shardings, shard_bytes, with_shardings


def flops_per_token(
    model_cfg: ModelConfig, seq_len: int, lora: LoraConfig | None = None, reference_pass: bool = False
) -> float:
    """Training FLOPs per token: 6 x (parameters used in matmuls) + 6 x layers x d_model x seq (attention).

    Attention is counted as MaxText counts it, causal: the scores and the weighted values cost 12 x d_model
    FLOPs per (query, key) pair in a training step (4 x forward, 8 x backward), and a causal query sees
    seq / 2 keys on average, half of the full map. A `local` layer's query sees fewer, w - w^2 / (2 x seq)
    on average for its window w = min(local_window, seq), and costs 12 x d_model x that.

    With `lora` the frozen weights cost 4 x, not 6 x: the forward and the activations' gradient, but no
    gradient of their own; the adapter's matmuls cost 6 x its parameters like any trained weight. A
    `reference_pass` (DPO's reference model run in each step) adds one forward: a third of the full count.
    """
    # the embedding and learned positions are gathers (a tied embedding is the head's matmul too)
    gathered = 0 if model_cfg.tie_embeddings else model_cfg.vocab_size * model_cfg.d_model
    if model_cfg.position == "learned":
        gathered += model_cfg.max_seq_len * model_cfg.d_model
    matmul_params = model.count_params(model_cfg) - gathered
    keys = sum(_keys_per_query(kind, model_cfg, seq_len) for kind in model_cfg.layer_kinds)  # seq/2 a global layer
    attention = 12 * model_cfg.d_model * keys
    reference = (2 * matmul_params + attention / 3) if reference_pass else 0.0
    if lora is None:
        return 6 * matmul_params + attention + reference
    return 4 * matmul_params + 6 * adapter_size(model.projections(model_cfg), lora) + attention + reference


def _keys_per_query(kind: str, model_cfg: ModelConfig, seq_len: int) -> float:
    """Keys a query of a `kind` layer attends to, on average over a causal sequence of `seq_len`."""
    window = seq_len if kind == "global" else min(model_cfg.local_window, seq_len)
    return window - window**2 / (2 * seq_len)


def state_bytes_per_device(model_cfg: ModelConfig, mesh_sizes: dict[str, int], bytes_per_param: int = 16) -> int:
    """Bytes of training state on one device of a mesh of `mesh_sizes` (an abstract mesh: no devices needed).

    The default 16 bytes per parameter is fp32 weights (4) + fp32 gradients (4) + Adam's two fp32
    moments (8); gradients and moments are sharded exactly like the weights. Activations come on top.
    """
    mesh = AbstractMesh(tuple(mesh_sizes.get(a, 1) for a in MESH_AXES), MESH_AXES)
    shardings = param_shardings(model.logical_axes(model_cfg), mesh)
    return shard_bytes(with_shardings(model.abstract_params(model_cfg), shardings), itemsize=bytes_per_param)


@functools.cache  # a host's peak does not change: measured once per process, not once per run
def measure_matmul_peak(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large square matmul on the default device: the achievable peak of a host or accelerator."""
    dt = dtype_of(dtype)
    a = jnp.ones((n, n), dt)
    mm = jax.jit(jnp.matmul)
    mm(a, a).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = mm(a, a)
    out.block_until_ready()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def host_matmul_peak(dtype: str) -> float:
    """`measure_matmul_peak(dtype)` of this machine, measured once and kept in meshlm's cache folder
    (`MESHLM_CACHE`, else ~/.cache/meshlm; `matmul_peak.json`, one figure per host, core count, JAX version
    and dtype): the measurement takes a second or more of a CPU host at every run's start. Delete the file to
    measure again (after a measurement disturbed by other work, say)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = f"{socket.gethostname()} cores={cores} jax={jax.__version__} {dtype}"
    path = cache_dir() / "matmul_peak.json"
    try:
        known = json.loads(path.read_text())
        if isinstance(known.get(key), float) and known[key] > 0:
            return known[key]
    except (OSError, ValueError, AttributeError):  # none yet, or unreadable: measured again and rewritten
        known = {}
    peak = measure_matmul_peak(dtype)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**known, key: peak}, indent=1))
        tmp.replace(path)  # atomic: a process reading at the same time sees the old file or the new one
    except OSError:  # a read-only home: measured at each start, as before
        pass
    return peak


def peak_flops(mesh: Mesh, dtype: str) -> float:
    """Peak FLOP/s of the whole mesh: the device table's bf16 peak for accelerators (NaN for one it lacks), a
    measured matmul in `dtype` for a CPU host (`host_matmul_peak`: once per machine)."""
    device = mesh.devices.flat[0]
    if device.platform == "cpu":  # simulated CPU devices share one host's cores
        return host_matmul_peak(dtype)
    return devices.peak_flops(device) * mesh.devices.size


@dataclass
class NoiseScale:
    """The gradient noise scale B_simple = S / |G|^2 (McCandlish et al. 2018, appendix A), as the seed logged
    it: unbiased |G|^2 and S from the micro-batch and full-batch gradient norms, each an EMA."""

    b_small: int
    b_big: int
    alpha: float
    g2: float | None = None
    s: float | None = None

    def update(self, micro_grad_sq: float, grad_norm: float) -> dict[str, float]:
        if self.b_big == self.b_small:
            return {}
        big_sq = grad_norm**2
        g2 = (self.b_big * big_sq - self.b_small * micro_grad_sq) / (self.b_big - self.b_small)
        s = (micro_grad_sq - big_sq) / (1 / self.b_small - 1 / self.b_big)
        self.g2 = g2 if self.g2 is None else (1 - self.alpha) * self.g2 + self.alpha * g2
        self.s = s if self.s is None else (1 - self.alpha) * self.s + self.alpha * s
        # no gradient at all (a GRPO batch whose every advantage is 0, say): no scale to speak of, not a crash
        b_simple = self.s / self.g2 if self.g2 else float("nan")
        return {"noise/G2": self.g2, "noise/S": self.s, "noise/B_simple": b_simple}


class MetricsLog:
    """One record per logged step, to `metrics.jsonl`, TensorBoard (`tb/`) and, with a `wandb_project`,
    Weights & Biases; written by process 0. A resumed run continues its W&B run: the run's id is kept in
    the run folder (`wandb_run_id`), and `metrics.jsonl` drops the records past the step it resumes from
    (steps that ran after the last checkpoint run again), so each step is recorded once."""

    def __init__(
        self,
        out_dir: Path,
        wandb_project: str | None = None,
        wandb_run: str | None = None,
        config: dict[str, Any] | None = None,
        resumed_from: int | None = None,
    ):
        self.enabled = jax.process_index() == 0
        self._wandb = None
        if self.enabled:
            if wandb_project:  # first: a W&B run that cannot start stops the run before anything is written
                self._wandb = start_wandb(out_dir, wandb_project, wandb_run, config or {})
            if resumed_from is not None:
                _drop_records_after(out_dir / "metrics.jsonl", resumed_from)
            self._jsonl = (out_dir / "metrics.jsonl").open("a")
            self._tb = EventFile(out_dir / "tb")

    def write(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        try:
            self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
            self._jsonl.flush()
        except OSError as e:  # a full disk: say which file (a file object's error names none)
            raise OSError(e.errno, e.strerror, self._jsonl.name) from None
        self._tb.write(step, values)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()
            if self._wandb is not None:
                self._wandb.finish()


class EventFile:
    """A TensorBoard event file of scalars (`events.out.tfevents.*`, as TensorBoard and tensorboardX name it),
    written here: tensorboardX's import takes torch's (2-3 s at every `meshlm train` start) to write what is a
    TFRecord of a few protobuf fields. Each `write` is one `Event` (wall_time, step, a `Summary` of one
    `simple_value` per tag), flushed at once."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = folder / f"events.out.tfevents.{int(now)}.{socket.gethostname()}"
        self._file = self.path.open("ab")
        self._record(_field(1, 1, struct.pack("<d", now)) + _field(3, 2, b"brain.Event:2"))  # file_version

    def write(self, step: int, values: dict[str, float]) -> None:
        summary = b"".join(
            _field(1, 2, _field(1, 2, k.encode()) + _field(2, 5, _float32(v))) for k, v in values.items()
        )
        self._record(_field(1, 1, struct.pack("<d", time.time())) + _field(2, 0, step) + _field(5, 2, summary))

    def _record(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._file.write(
            header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))
        )
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _field(number: int, wire_type: int, value: bytes | int) -> bytes:
    """One protobuf field: a varint (wire type 0), 8 or 4 fixed bytes (1, 5), or length-delimited bytes (2)."""
    if wire_type == 0:
        return _varint(number << 3) + _varint(value)
    if wire_type == 2:
        return _varint(number << 3 | 2) + _varint(len(value)) + value
    return _varint(number << 3 | wire_type) + value


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # a negative int64 is its two's complement, ten bytes
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes([*out, n])


def _float32(value: float) -> bytes:
    """A float32's bytes; a value past float32's range is its infinity (as numpy rounds it)."""
    try:
        return struct.pack("<f", value)
    except OverflowError:
        return struct.pack("<f", math.copysign(math.inf, value))


def _drop_records_after(path: Path, step: int) -> None:
    """Rewrite a metrics file without its records past `step`, atomically: a kill midway keeps the old file."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if (s := _step_of(line)) is not None and s <= step]
    if len(kept) < len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


def _step_of(line: str) -> int | None:
    """A record's step; a line torn by a kill mid-write has none (and is dropped)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


def start_wandb(out_dir: Path, project: str, name: str | None, config: dict[str, Any]) -> Any:
    """A W&B run for the run folder `out_dir`: the same one again when the folder is resumed."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("wandb_project is set, but wandb is not installed: pip install 'meshlm[wandb]'") from None
    id_file = out_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
    try:
        run = wandb.init(
            project=project, name=name or out_dir.name, id=run_id, resume="allow", dir=str(out_dir), config=config
        )
    except Exception as e:  # wandb's own: no API key, no network; its messages are long
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"W&B run for project {project!r} did not start ({why}); log in (wandb login or WANDB_API_KEY), "
            "or set WANDB_MODE=offline to keep the run in the run folder and `wandb sync` it later"
        ) from None
    id_file.write_text(run_id)
    return run
