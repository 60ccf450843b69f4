"""`meshlm plan`: what a training run or a server needs per device on some hardware, and what fits.

The figures come from XLA's own compiler, for the very step `meshlm train` runs (`train_step.step_program`):
- a TPU slice (`tpu:v5e:2x2`, `tpu:v3:8x16`, ...) is compiled ahead of time with `libtpu` on any machine,
  and its compiler states each chip's capacity;
- `cpu` compiles for this machine's devices;
- a GPU (`gpu:h100-80gb`, `gpu:rtx4090-24gb`, any `gpu:NAME-<N>gb`) has no compiler without a GPU, so its
  figures are an estimate from the shapes, the optimizer and the remat policy (`estimate_train`), calibrated
  against compiled CPU and TPU figures and labelled as an estimate.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from meshlm import footprint, fused_ce, metrics, model, train_step
from meshlm.config import QUANTIZED, ConfigError, LoraConfig, ModelConfig, TrainConfig, dtype_of, remat_names
from meshlm.devices import GPUS, peak_flops
from meshlm.footprint import Footprint, OutOfMemory, gib
from meshlm.lora import adapter_size
from meshlm.serve import runner
from meshlm.serve.batch import Shapes
from meshlm.serve.config import EngineConfig
from meshlm.serve.engine import DEFAULT_LORA_RANK
from meshlm.serve.pages import pages_for
from meshlm.sharding import (
    MESH_AXES,
    SERVING,
    batch_ways,
    make_mesh,
    parse_mesh_spec,
    shard_bytes,
)

# JAX preallocates this share of a GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION) and runs programs within it.
GPU_MEMORY_FRACTION = 0.75


@dataclass(frozen=True)
class Target:
    """Where a plan is for: devices to compile for (None: a GPU, estimated), and each device's memory."""

    spec: str
    platform: str  # "tpu", "cpu" or "gpu"
    device_kind: str
    n_devices: int | None  # None: as many as the mesh asks for (GPUs)
    devices: list[Any] | None = None
    capacity: int | None = None  # bytes per device (TPU: as its compiler states it)
    peak_flops: float = float("nan")  # per device, bf16

    @property
    def estimated(self) -> bool:
        return self.devices is None

    def mesh(self, spec: str | None) -> Mesh | AbstractMesh:
        """The mesh `spec` over this target's devices (default: every device on fsdp, ZeRO-3)."""
        if self.n_devices is None:
            sizes = parse_mesh_spec(spec or "data=1", math.prod(_sizes_of(spec or "data=1")))
            return AbstractMesh(tuple(sizes.values()), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
        devices = self.devices
        if spec and -1 not in _sizes_of(spec):  # a mesh over some of the devices (one chip of a v5e slice)
            devices = devices[: math.prod(_sizes_of(spec))]
            spec = spec if "data" in spec else f"{spec},data=1"
        spec = spec or f"fsdp={self.n_devices}"
        try:
            return make_mesh(spec, devices)
        except ConfigError as e:
            raise ConfigError(f"{e} (target {self.spec} has {self.n_devices} devices)") from None
        except (AssertionError, NotImplementedError):  # shapes jax.make_mesh cannot lay out on the torus (v4 cores)
            sizes = parse_mesh_spec(spec, len(devices))
            shape = tuple(sizes[a] for a in MESH_AXES)
            return Mesh(np.array(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _sizes_of(spec: str) -> list[int]:
    return [int(m) for m in re.findall(r"=\s*(-?\d+)", spec)] or [1]


def target(spec: str) -> Target:
    """A target from its name: `tpu:<generation>:<topology>`, `cpu`, or `gpu:<name>-<N>gb`."""
    kind, _, rest = spec.partition(":")
    if kind == "cpu" and not rest:
        devices = jax.devices("cpu")
        return Target(spec, "cpu", devices[0].device_kind, len(devices), devices, footprint.device_capacity(devices[0]))
    if kind == "tpu" and rest:
        if importlib.util.find_spec("libtpu") is None:
            raise ConfigError(
                f"target {spec}: TPU programs are compiled with libtpu, which is not installed; "
                "pip install 'meshlm[tpu]' (it works on a machine without a TPU)"
            )
        from jax.experimental import topologies

        try:
            devices = topologies.get_topology_desc(platform="tpu", topology_name=rest).devices
        except Exception as e:  # libtpu's error: a name it does not know, or its lock held by another process
            why = str(e).splitlines()[0][:200]
            if "lockfile" in why:
                raise ConfigError(f"target {spec}: libtpu is in use by another process ({why})") from None
            raise ConfigError(
                f"target {spec}: not a TPU topology libtpu knows ({why}); "
                "e.g. tpu:v5e:2x2, tpu:v4:2x2x1, tpu:v5p:4x4x4, tpu:v3:8x16"
            ) from None
        kind_name = devices[0].device_kind
        peak = peak_flops(devices[0])  # a v4 slice is listed by core: half a chip's peak
        capacity = footprint.compiler_capacity(devices[0])  # once per target: every chip of a slice is alike
        return Target(spec, "tpu", kind_name, len(devices), list(devices), capacity, peak)
    if kind == "gpu" and rest:
        name = rest.lower()
        m = re.fullmatch(r"[a-z0-9_.]+-(\d+(?:\.\d+)?)gb", name)
        if m is None:
            raise ConfigError(
                f"target {spec}: a GPU is named NAME-<memory>gb, e.g. gpu:h100-80gb; known: "
                + ", ".join(f"gpu:{g}" for g in GPUS)
            )
        known = GPUS.get(name)
        memory, peak = (known.memory, known.peak_flops) if known else (float(m.group(1)) * 1e9, float("nan"))
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION))
        return Target(spec, "gpu", name, None, None, int(memory * fraction), peak)
    raise ConfigError(f"unknown target {spec!r}; expected tpu:<generation>:<topology> (e.g. tpu:v5e:2x2), cpu, "
                      "or gpu:<name>-<N>gb (e.g. gpu:h100-80gb)")  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Training


def within(total: int | None, capacity: int | None, refused: str = "") -> bool:
    """Whether a program fits: not refused by its compiler, and its total within the capacity (if known)."""
    return not refused and total is not None and (capacity is None or total <= capacity)


@dataclass
class TrainFit:
    """One train step at one micro-batch on one mesh: what it holds per device and whether it fits."""

    micro_batch: int  # sequences per micro-batch, over all devices
    params: int  # trained parameters (a LoRA run: the adapter)
    optimizer: int  # its state, wherever it is kept
    gradients: int  # held by the step while it runs (part of its temporaries)
    base: int  # a LoRA run's frozen model
    batch: int
    total: int | None  # per device: compiled (arguments + outputs - aliased + temporaries), or estimated
    capacity: int | None
    compiled: Footprint | None = None
    estimated: bool = False
    refused: str = ""  # the compiler's words when it refused the program
    # Host memory per device that the step reads and writes, outside `total`: the compiler's figure (TPU; a
    # GPU's estimate: the optimizer state), the optimizer state with `optimizer_memory: host` and activations
    # that a remat policy offloads. A CPU's compiler counts host memory in the total, its device memory alike.
    host: int = 0
    optimizer_on_host: bool = False  # the optimizer state is in `host`, not in `total`

    @property
    def fits(self) -> bool:
        return within(self.total, self.capacity, self.refused)

    @property
    def device_optimizer(self) -> int:
        """The optimizer state's share of `total`: none when it is kept in host memory."""
        return 0 if self.optimizer_on_host else self.optimizer

    @property
    def temporaries(self) -> int | None:
        """What the step holds beyond its arguments (trained parameters, optimizer state on the device,
        frozen base, batch): the gradients, the activations, an offloaded state while it is updated, and every
        other temporary."""
        if self.total is None:
            return None
        return max(self.total - self.params - self.device_optimizer - self.base - self.batch, 0)

    @property
    def held_gradients(self) -> int:
        """The gradients' share of the temporaries: the count from the shapes, but never more than the
        compiler's temporaries (XLA may fuse the accumulation into the update, holding fewer)."""
        temporaries = self.temporaries
        return self.gradients if temporaries is None else min(self.gradients, temporaries)

    @property
    def activations(self) -> int | None:
        """Activations and every other temporary: the rest of the temporaries, so that the parts of the
        breakdown are non-negative and sum to the total."""
        temporaries = self.temporaries
        return None if temporaries is None else temporaries - self.held_gradients


@dataclass
class TrainPlan:
    """`plan_train`'s answer: the config's own micro-batch, the largest that fits, and a change that would
    make it fit when nothing does."""

    target: Target
    mesh: str
    seq_len: int
    config: TrainFit
    largest: int | None  # largest micro-batch that fits (None: not searched, 0: none)
    tried: list[TrainFit] = field(default_factory=list)
    suggestion: str | None = None
    flops_per_step: float = 0.0  # the model's FLOPs for one step of the config's batch
    xla_flops: float | None = None  # XLA's count for one device (a scanned layer counted once)
    limit: int = 0  # the largest micro-batch the search tried


def seq_len_of(cfg: TrainConfig, seq_len: int | None = None) -> int:
    """The sequence length a run trains on: given, the prepared dataset's, the config's, or the model's."""
    if seq_len is not None:
        return seq_len
    if cfg.data is not None:
        from meshlm.data import read_index

        try:
            return int(read_index(cfg.data)["seq_len"])
        except (OSError, KeyError):
            pass
    return cfg.seq_len or cfg.model.max_seq_len


def fit_train(cfg: TrainConfig, tgt: Target, mesh: Mesh | AbstractMesh, seq_len: int) -> tuple[TrainFit, Any]:
    """Compile (or, for a GPU, estimate) `cfg`'s train step on `mesh`: its fit, and the compiled step."""
    program = train_step.step_program(cfg, cfg.model, mesh, seq_len)
    state, batch = program.inputs[:2]
    parts = dict(
        micro_batch=cfg.micro_batch_size,
        params=shard_bytes(state.params),
        optimizer=shard_bytes(state.opt_state) + shard_bytes(state.step),
        gradients=2 * shard_bytes(state.params),  # the micro-batch's and their sum, in the parameters' dtype
        base=shard_bytes(program.inputs[2]) if cfg.lora is not None else 0,
        batch=shard_bytes(batch),
        capacity=tgt.capacity,
    )
    # a state kept in host memory is apart from the device's where the compiler counts it apart (not a CPU's)
    on_host = cfg.optimizer_memory == "host" and tgt.platform != "cpu"
    parts |= dict(host=parts["optimizer"] if on_host else 0, optimizer_on_host=on_host)
    if tgt.estimated:
        return TrainFit(total=estimate_train(cfg, mesh, seq_len, **parts), estimated=True, **parts), None
    try:
        compiled = program.compile()
    except OutOfMemory as e:
        return TrainFit(total=e.needed, refused=str(e), **{**parts, "capacity": e.capacity or parts["capacity"]}), None
    used = Footprint.of(compiled)
    return TrainFit(total=used.total, compiled=used, **{**parts, "host": used.host}), compiled


def estimate_train(cfg: TrainConfig, mesh: Any, seq_len: int, **parts: int) -> int:
    """Bytes per device of `cfg`'s train step where no compiler can say (a GPU): the arguments exactly
    (from the shardings), then the temporaries. The summed gradient lives through the whole step; the
    micro-batch's gradient is produced layer by layer while the activations are freed, so the two share
    memory: temporaries = one gradient + max(one gradient, activations). A gradient is counted in float32
    whatever the parameters' dtype, as the compiled figures it is checked against hold it (XLA widens
    bfloat16 sums in flight). An optimizer state kept in host memory is no argument of the device's; the
    update, after the activations are freed, brings it in array by array, but XLA overlaps the transfers,
    so it is counted as if all of it came in with one more gradient beside it: temporaries = one gradient +
    max(one gradient, activations, state + one gradient), an upper bound (gptj-1b, one sequence of 2048 on
    a v5e: 18.85 GiB estimated, 16.10 GiB compiled)."""
    host = parts.get("optimizer_on_host", False)
    arguments = parts["params"] + (0 if host else parts["optimizer"]) + parts["base"] + parts["batch"]
    one_gradient = parts["gradients"] // 2 * 4 // jnp.dtype(dtype_of(cfg.param_dtype)).itemsize
    update = parts["optimizer"] + one_gradient if host else 0
    return arguments + one_gradient + max(one_gradient, activation_bytes(cfg, dict(mesh.shape), seq_len), update)


def activation_bytes(cfg: TrainConfig, sizes: dict[str, int], seq_len: int) -> int:
    """Activation memory per device of one micro-batch under the remat policy, from the shapes.

    Per layer and token, the backward pass keeps what the policy saves: `full` the block's input;
    `dots_no_batch` the outputs of q, k, v, out and fc_in; `dots` those, the block's input and the
    attention probabilities; `none` every intermediate; a policy by name (`minimal`, `save_qkv`, ...)
    the block's input and the named activations it keeps on the device (offloaded ones cost none). On
    top come one block's intermediates while it is recomputed (float32 attention scores among them) and
    the LM head's float32 logits with their softmax and gradient, for the positions `fused_ce` computes
    at once. The coefficients are counts of
    XLA's buffers, checked against compiled CPU and TPU figures by `tests/test_planner.py`.
    """
    m = cfg.model
    c = jnp.dtype(dtype_of(cfg.compute_dtype)).itemsize
    rows = max(train_step.rows_per_micro_batch(cfg) // (sizes["data"] * sizes["fsdp"]), 1)
    tokens = rows * seq_len
    tp = sizes["model"]
    d, f = m.d_model, m.d_ff // tp
    a = max(m.n_head // tp, 1) * m.d_head  # one device's attention width
    s = max(m.n_head // tp, 1) * seq_len  # one device's attention probabilities per query
    named = remat_names(cfg.remat)
    if named is not None:  # the layer's input, and the named activations kept on the device
        width = {"q": a, "k": a, "v": a, "attn": a, "mlp": f}
        saved = (d + sum(width[name] for name in named[0])) * c
    else:
        saved = {
            "full": d * c,
            "dots_no_batch": (4 * a + f) * c,
            "dots": (d + 4 * a + f) * c + s * 4,
            "none": (3 * d + 5 * a + 3 * f) * c + 3 * s * 4,
        }[cfg.remat]
    block = (d + a + 2 * f) * c + 3 * s * 4
    chunk = rows * fused_ce.chunk_positions(rows, seq_len)
    head = chunk * 7 * (m.vocab_size // tp)
    adam = 2 if cfg.adam_dtype == "bfloat16" else 0  # moments widened to float32 in flight
    trained = adapter_size(model.projections(m), cfg.lora) if cfg.lora else model.count_params(m)
    return tokens * (m.n_layer * saved + block) + head + adam * trained // math.prod(sizes.values())


def stream_layer_bytes(cfg: ModelConfig, devices: int) -> int:
    """What loading a quantized base holds beside it, per device: one layer of its largest projection in
    float32 (`meshlm.formats.slices.projection_streams` makes and quantizes one layer at a time), split
    over the devices at best. XLA's temporaries for that layer's quantization come to a few times it on a
    CPU (tests/test_stream_quant.py); the bound here is the layer itself."""
    largest = max(
        math.prod(model.projection(model.param_table(cfg), role).shape[1:]) for role in model.PROJECTION_PATHS
    )
    return 4 * largest // devices


def plan_train(
    cfg: TrainConfig,
    target_spec: str,
    *,
    mesh: str | None = None,
    seq_len: int | None = None,
    search: bool = True,
    max_micro_batch: int = 1024,
    suggest: bool = True,
    capacity: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> TrainPlan:
    """What `cfg`'s train step needs per device on `target_spec`; with `search`, the largest micro-batch
    that fits (bisection over compiles); with `suggest`, when not even the smallest fits, the first of
    these that makes it fit: remat=full, bf16 Adam moments, Adam's state in host memory, every data-parallel
    device on fsdp, tensor parallelism, LoRA, QLoRA (NF4). `capacity` (bytes per device) replaces the target's own."""
    if cfg.objective == "grpo":
        raise ConfigError(
            "objective grpo: a plan measures the train step alone, not GRPO's rollout engine beside it (not built yet)"
        )
    tgt = target(target_spec) if capacity is None else replace(target(target_spec), capacity=capacity)
    mesh_spec = mesh or cfg.mesh
    device_mesh = tgt.mesh(mesh_spec)
    seq = seq_len_of(cfg, seq_len)
    if seq > cfg.model.max_seq_len:
        raise ConfigError(f"seq_len {seq} exceeds the model's max_seq_len {cfg.model.max_seq_len}")
    train_step.check_batch(cfg, device_mesh)
    say = progress or (lambda _: None)
    own, compiled = fit_train(cfg, tgt, device_mesh, seq)
    say(describe_fit(own))
    result = TrainPlan(tgt, _mesh_spec(device_mesh), seq, own, None, [own], limit=max_micro_batch)
    rows = train_step.rows_per_micro_batch(cfg) * cfg.micro_batches  # a preference pair is two sequences
    per_token = metrics.flops_per_token(cfg.model, seq, cfg.lora, train_step.reference_in_step(cfg))
    result.flops_per_step = per_token * rows * seq
    if compiled is not None:
        result.xla_flops = _flops(compiled)
    if search:
        ways = batch_ways(device_mesh)

        def fits(m: int) -> bool:
            if m == cfg.micro_batch_size:
                return own.fits
            fit, _ = fit_train(cfg.replace(batch_size=m * cfg.micro_batches), tgt, device_mesh, seq)
            result.tried.append(fit)
            say(describe_fit(fit))
            return fit.fits

        result.largest = ways * largest(lambda k: fits(k * ways), max_micro_batch // ways)
    if suggest and not (result.largest if search else own.fits):
        result.suggestion = suggest_change(cfg, tgt, device_mesh, seq, say)
    return result


def largest(fits: Callable[[int], bool], limit: int) -> int:
    """The largest k in [1, limit] with fits(k) and not fits(k + 1) (0 if even 1 does not fit), by
    doubling and then bisection; `fits` is taken to be monotone."""
    if limit < 1 or not fits(1):
        return 0
    good, bad = 1, None
    while bad is None:
        k = min(2 * good, limit)
        if k == good:
            return good
        if fits(k):
            good = k
        else:
            bad = k
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def suggest_change(cfg: TrainConfig, tgt: Target, mesh: Any, seq: int, say: Callable[[str], None]) -> str | None:
    """The first change, smallest first, under which one micro-batch per data-parallel way fits."""
    sizes = dict(mesh.shape)
    n = math.prod(sizes.values())
    candidates: list[tuple[str, TrainConfig, str | None]] = []
    if cfg.remat != "full":
        candidates.append(("remat=full", cfg.replace(remat="full"), None))
    if cfg.lora is None and cfg.adam_dtype == "float32":
        candidates.append(("adam_dtype=bfloat16", cfg.replace(adam_dtype="bfloat16", remat="full"), None))
    if cfg.lora is None and cfg.optimizer_memory == "device" and tgt.platform != "cpu":  # a CPU's device is the host
        changed = cfg.replace(optimizer_memory="host", remat="full")
        candidates.append(("optimizer_memory=host (Adam's state in host memory between steps)", changed, None))
    for model_ways in _divisors(n):
        if model_ways < sizes["model"] or cfg.model.n_head % model_ways:
            continue
        spec = f"fsdp={n // model_ways},model={model_ways}"
        if (n // model_ways, model_ways) != (sizes["fsdp"], sizes["model"]):
            remat = "" if cfg.remat == "full" else " with remat=full"
            candidates.append((f'mesh "{spec}"{remat}', cfg.replace(remat="full"), spec))
    if cfg.lora is None:
        lora = LoraConfig(rank=16, alpha=32.0, targets=("q", "k", "v", "out"))
        candidates.append(("LoRA (a lora section, rank 16 on q, k, v, out; bf16 base)",
                           cfg.replace(lora=lora, base_dtype="bfloat16", remat="full"), None))  # fmt: skip
        candidates.append(("QLoRA (a lora section with base_dtype=nf4)",
                           cfg.replace(lora=lora, base_dtype="nf4", remat="full"), None))  # fmt: skip
    for what, changed, spec in candidates:
        try:
            changed_mesh = tgt.mesh(spec) if spec else mesh
            changed = changed.replace(batch_size=batch_ways(changed_mesh) * changed.micro_batches)
        except ConfigError:
            continue
        fit, _ = fit_train(changed, tgt, changed_mesh, seq)
        say(f"  with {what}: " + describe_fit(fit).strip())
        if fit.fits:
            return f"{what}: {gib(fit.total)} per device at micro-batch {fit.micro_batch}"
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mesh_spec(mesh: Any) -> str:
    return ",".join(f"{a}={s}" for a, s in dict(mesh.shape).items() if s > 1) or "data=1"


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # not every backend reports costs
        return None
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0)) if cost else None


def describe_fit(fit: TrainFit) -> str:
    what = f"  micro-batch {fit.micro_batch}: "
    if fit.refused:
        needs = f"needs {gib(fit.total)}; " if fit.total else ""
        return what + f"does not fit ({needs}the compiler: {fit.refused})"
    label = "estimated " if fit.estimated else ""
    verdict = "fits" if fit.fits else "does not fit"
    return what + f"{verdict}: {label}{gib(fit.total)} of {gib(fit.capacity)} per device"


# ---------------------------------------------------------------------------------------------------
# Serving


@dataclass
class ServeFit:
    rows: int
    weights: int
    cache: int  # the rows' KV cache (and their other per-row state)
    adapters: int  # LoRA adapter slots
    total: int | None
    capacity: int | None
    estimated: bool = False
    refused: str = ""

    @property
    def fits(self) -> bool:
        return within(self.total, self.capacity, self.refused)


@dataclass
class ServePlan:
    target: Target
    mesh: str
    context: int
    dtype: str
    quantize: str | None
    config: ServeFit
    largest: int | None


def fit_serve(
    cfg: ModelConfig, tgt: Target, mesh: Any, engine: EngineConfig, dtype: str, quantize: str | None
) -> ServeFit:
    """The server's resident state for an engine of `engine`'s settings: its decode step (weights,
    `max_adapters` LoRA slots of `max_lora_rank`, slots and a KV pool in `kv_cache_dtype`, of pages of the
    target's size, that holds `max_batch` rows' whole `max_len` tokens) plus, on top, a prefill of one whole
    context (its output and temporaries)."""
    rows, context = engine.max_batch, engine.context(cfg.max_seq_len)
    adapters, lora_rank = engine.max_adapters or 0, engine.max_lora_rank or DEFAULT_LORA_RANK
    page_size = engine.tokens_per_page(tgt.platform)
    policy = model.Policy(param_dtype=dtype, compute_dtype=dtype, kv_cache_dtype=engine.kv_cache_dtype)
    params = model.placed_params(cfg, mesh, dtype, quantize, SERVING)
    slots = runner.abstract_adapter_slots(cfg, policy, mesh, adapters + 1, lora_rank) if adapters else {}
    params = {**params, "adapters": slots} if slots else params
    ways = batch_ways(mesh)
    n_rows = Shapes.of(rows, context, page_size, ways).max_batch  # the slots and decode batch, as the engine rounds
    width = pages_for(context, page_size)
    pages = rows * width + 1  # whole pages for the rows that run at once, as the engine's default pool
    cache, rows_state = runner.abstract_state(cfg, policy, mesh, pages, page_size, n_rows)
    adapter_bytes = shard_bytes(slots)
    weights, capacity = shard_bytes(params) - adapter_bytes, tgt.capacity
    state = shard_bytes((cache, rows_state))
    if tgt.estimated:
        one = 2 * context * cfg.d_model * 4 * 4 + context * (cfg.vocab_size // dict(mesh.shape)["model"]) * 4
        total = weights + adapter_bytes + state + one
        return ServeFit(rows, weights, state, adapter_bytes, total, capacity, estimated=True)
    try:
        with jax.set_mesh(mesh):
            shapes = dict(pages=pages, width=width, params=params, page_size=page_size)
            decode = runner.lower("decode", cfg, policy, mesh, rows=n_rows, **shapes)
            prefill = runner.lower("prefill", cfg, policy, mesh, rows=ways, length=context, **shapes)
            decode, prefill = footprint.compile_for(decode), footprint.compile_for(prefill)
    except OutOfMemory as e:
        return ServeFit(rows, weights, state, adapter_bytes, e.needed, e.capacity or capacity, refused=str(e))
    decoding, prefilling = Footprint.of(decode), Footprint.of(prefill)
    total = decoding.total + prefilling.total - prefilling.arguments  # a prefill runs beside the rows
    return ServeFit(rows, weights, state, adapter_bytes, total, capacity)


def plan_serve(
    cfg: ModelConfig,
    target_spec: str,
    engine: EngineConfig | None = None,
    *,
    mesh: str | None = None,
    dtype: str = "bfloat16",
    quantize: str | None = None,
    search: bool = True,
    max_rows: int = 4096,
    capacity: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> ServePlan:
    """Weights and KV cache per device for an engine of `engine`'s settings, the `EngineConfig` that `meshlm
    serve` and `LanguageModel.engine` take (None: its defaults): `max_batch` concurrent rows of `max_len` tokens
    (None: the model's context), `max_adapters` LoRA slots of `max_lora_rank` beside the weights, the KV pool
    in `kv_cache_dtype` (None: `dtype`). With `search`, the most rows that fit. `capacity` (bytes per device)
    replaces the target's."""
    engine = engine or EngineConfig()
    rows, context = engine.max_batch, engine.max_len
    tgt = target(target_spec) if capacity is None else replace(target(target_spec), capacity=capacity)
    if mesh is None and tgt.n_devices and tgt.n_devices > 1:  # tensor parallel as far as the heads allow
        ways = max(d for d in _divisors(tgt.n_devices) if cfg.n_head % d == 0)
        mesh = f"fsdp={tgt.n_devices // ways},model={ways}"
    device_mesh = tgt.mesh(mesh)
    ctx = context or cfg.max_seq_len
    if ctx > cfg.max_seq_len:
        raise ConfigError(f"context {ctx} exceeds the model's max_seq_len {cfg.max_seq_len}")
    say = progress or (lambda _: None)

    def fit(n: int) -> ServeFit:
        f = fit_serve(cfg, tgt, device_mesh, engine.replace(max_batch=n, max_len=ctx), dtype, quantize)
        say(f"  {n} rows x {ctx} tokens: {'fits' if f.fits else 'does not fit'}, {gib(f.total)} of {gib(f.capacity)}")
        return f

    own = fit(rows)
    found = None
    if search:
        found = largest(lambda n: own.fits if n == rows else fit(n).fits, max_rows)
    return ServePlan(tgt, _mesh_spec(device_mesh), ctx, dtype, quantize, own, found)


# ---------------------------------------------------------------------------------------------------
# Reports

STATED_MFU = 0.4  # the utilisation a predicted step time is also given at


def describe_train(p: TrainPlan, cfg: TrainConfig) -> str:
    fit = p.config
    how = "estimated from the shapes (no GPU compiler runs without a GPU)" if p.target.estimated else "compiled by XLA"
    devices = p.target.n_devices or math.prod(_sizes_of(p.mesh))
    what = "full fine-tune" if cfg.lora is None else (
        f"LoRA rank {cfg.lora.rank} on {', '.join(cfg.lora.targets)} over a {cfg.frozen_dtype} base")  # fmt: skip
    adam = cfg.adam_dtype + (" in host memory" if cfg.optimizer_memory == "host" else "")
    lines = [
        f"meshlm plan: {model.count_params(cfg.model):,} params, {what}, remat {cfg.remat}, adam {adam}, "
        f"micro-batch {fit.micro_batch} x {p.seq_len} tokens",
        f"target {p.target.spec}: {devices} x {p.target.device_kind}, mesh {p.mesh}; {how}",
        "per device:",
        f"  parameters (trained)        {gib(fit.params)}",
        f"  optimizer state             {gib(fit.device_optimizer)}"
        + (" (in host memory: below)" if fit.optimizer_on_host else ""),
    ]
    if fit.base:
        lines.append(f"  frozen base                 {gib(fit.base)}")
        if cfg.frozen_dtype in QUANTIZED:
            peak = fit.base + stream_layer_bytes(cfg.model, math.prod(_sizes_of(p.mesh)))
            lines.append(f"    loading it (streamed)     {gib(peak)} at the peak: the base and one layer in float32")
    lines.append(f"  batch                       {gib(fit.batch)}")
    if fit.total is not None and not fit.refused:
        lines.append(f"  gradients (x2)              {gib(fit.held_gradients)}")
        lines.append(f"  activations, other temps    {gib(fit.activations)}")
    verdict = "fits" if fit.fits else "does NOT fit"
    lines.append(f"  total                       {gib(fit.total)} of {gib(fit.capacity)}: {verdict}")
    if fit.refused:
        lines.append(f"  the compiler: {fit.refused}")
    if cfg.optimizer_memory == "host" or fit.host:
        lines.append("host memory per device (pinned; the step reads and writes it there):")
    if cfg.optimizer_memory == "host":
        shared = "" if fit.optimizer_on_host else " (a CPU device's memory is the host's: counted in the total above)"
        lines.append(f"  optimizer state             {gib(fit.optimizer)}{shared}")
    offloads = (remat_names(cfg.remat) or ((), ()))[1]
    if offloads and fit.host:  # the compiler's host figure, less the state (with the chip's padding)
        lines.append(f"  offloaded activations       {gib(fit.host - (fit.optimizer if fit.optimizer_on_host else 0))}")
    if p.largest is not None:
        lines.append(
            f"largest micro-batch that fits: {p.largest} x {p.seq_len} tokens"
            if p.largest
            else "not even the smallest micro-batch fits"
        )
    if p.suggestion:
        lines.append(f"what would fit: {p.suggestion}")
    elif p.largest == 0 or (p.largest is None and not fit.fits):
        lines.append("what would fit: nothing tried fits; add devices (a larger slice or more GPUs)")
    peak = p.target.peak_flops * devices
    if p.flops_per_step and not math.isnan(peak):
        at_peak = p.flops_per_step / peak
        sequences = train_step.rows_per_micro_batch(cfg) * cfg.micro_batches
        lines.append(
            f"step of {sequences} sequences: {p.flops_per_step:.3e} model FLOPs; {_seconds(at_peak)} at the "
            f"chips' peak, {_seconds(at_peak / STATED_MFU)} at {STATED_MFU:.0%} MFU"
        )
    if p.xla_flops:
        lines.append(f"XLA's FLOP count for one device: {p.xla_flops:.3e} (a scanned layer is counted once)")
    return "\n".join(lines)


def describe_serve(p: ServePlan, cfg: ModelConfig) -> str:
    fit = p.config
    how = "estimated" if p.target.estimated else "compiled by XLA"
    weights = p.quantize or p.dtype
    lines = [
        f"meshlm plan --serve: {model.count_params(cfg):,} params in {weights}, context {p.context}",
        f"target {p.target.spec}: {p.target.device_kind}, mesh {p.mesh}; {how}",
        "per device:",
        f"  weights                     {gib(fit.weights)}",
        *([f"  LoRA adapter slots          {gib(fit.adapters)}"] if fit.adapters else []),
        f"  {fit.rows} rows' KV cache and state {gib(fit.cache)}",
        f"  total (decode + a prefill)  {gib(fit.total)} of {gib(fit.capacity)}: "
        + ("fits" if fit.fits else "does NOT fit"),
    ]
    if p.largest is not None:
        lines.append(f"concurrent {p.context}-token rows that fit: {p.largest}")
    return "\n".join(lines)


def _seconds(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"
