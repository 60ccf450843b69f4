"""Training: the seed's optimizer and schedule, one jitted sharded step with gradient accumulation,
validation, metrics, checkpoints and resume.

The recipe is the one GPT-J was trained with: AdamW (b1 0.9, b2 0.999, eps 1e-8), global-norm clipping
at 1.0, decoupled weight decay on matrices only, learning rate warmed up linearly and then annealed
along a half cosine to `end_lr` over `anneal_steps`, flat after that. Parameters are kept in fp32
(`param_dtype`) and cast to `compute_dtype` inside the model; optimizer state takes the parameters'
shardings, so with an `fsdp` axis it is sharded ZeRO-3 style.

With a `lora` section only a LoRA adapter trains (its gradients and optimizer state alone) over a frozen
base stored as `base_dtype`: float, int8 or NF4. The base is rebuilt, never saved: checkpoints hold the
adapter and its optimizer state, and record what the base was built from.
"""

from __future__ import annotations

import functools
import json
import math
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from meshlm import api, checkpoint, footprint, model
from meshlm.config import QUANTIZED, ConfigError, LoraConfig, ModelConfig, TrainConfig, dtype_of
from meshlm.data import TokenDataset
from meshlm.formats import mtj, registry
from meshlm.loader import LoaderState, TrainLoader, eval_batches
from meshlm.sharding import batch_ways, describe, make_mesh, named_sharding, plan, spec_for
from meshlm.tokenizer import HFTokenizer, Tokenizer, copy_files, model_tokenizer_json, tokenizer_files

# ---------------------------------------------------------------------------------------------------
# Optimizer


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """The seed's `gpt3_schedule`: linear warmup from 0, half-cosine to `end_lr` over `anneal_steps`, then flat."""
    warmup, anneal, peak, end = cfg.warmup_steps, cfg.anneal_steps, cfg.lr, cfg.end_lr

    def schedule(step: jax.Array) -> jax.Array:
        step = jnp.asarray(step, jnp.float32)
        warm = jnp.clip(step, 0, warmup) / warmup if warmup else 1.0
        anneal_pct = jnp.clip(step - warmup, 0, anneal) / anneal
        return warm * peak - (peak - end) * (1 - jnp.cos(jnp.pi * anneal_pct)) / 2

    return schedule


def trainable_axes(model_cfg: ModelConfig, lora: LoraConfig | None = None) -> model.Params:
    """Logical axes of what a run trains: the whole model, or with `lora` only the adapter."""
    return model.logical_axes(model_cfg) if lora is None else model.logical_axes(model_cfg, lora)["lora"]


def trainable_abstract(model_cfg: ModelConfig, lora: LoraConfig | None = None, dtype: str = "float32") -> Any:
    """ShapeDtypeStructs of what a run trains (see `trainable_axes`)."""
    if lora is None:
        return model.abstract_params(model_cfg, dtype)
    return jax.eval_shape(lambda: model.init_adapter(model_cfg, lora, jax.random.key(0), dtype))


def decay_mask(cfg: ModelConfig, lora: LoraConfig | None = None) -> model.Params:
    """True for weight matrices (two or more axes besides the stacked `layers` axis, LoRA's A and B
    included); biases, norms and adapter scales: False."""
    return jax.tree.map(
        lambda axes: sum(a != "layers" for a in axes) >= 2,
        trainable_axes(cfg, lora),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def make_optimizer(
    cfg: TrainConfig, model_cfg: ModelConfig, state_dtype: str | None = None
) -> optax.GradientTransformation:
    """The seed's AdamW. `state_dtype` (default: the config's `adam_dtype`) "bfloat16" stores both moments in
    bf16 between steps (they are updated in fp32), which saves 4 bytes per parameter where memory is short."""
    adamw = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(
            lr_schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask(model_cfg, cfg.lora),
        ),
    )
    state_dtype = state_dtype or cfg.adam_dtype
    return adamw if state_dtype == "float32" else stored_as(adamw, dtype_of(state_dtype))


def stored_as(inner: optax.GradientTransformation, dtype: jnp.dtype) -> optax.GradientTransformation:
    """`inner` with its floating-point state kept in `dtype` between steps and computed in fp32."""

    def cast(tree: Any, dt: jnp.dtype) -> Any:
        return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(lambda params: cast(inner.init(params), dtype), update)


# ---------------------------------------------------------------------------------------------------
# The sharded train state and step


def schedule_count(opt_state: Any) -> jax.Array:
    """The count the learning rate is taken at: the step in a meshlm run; a continued seed run's may differ."""
    return optax.tree_utils.tree_get(
        opt_state, "count", filtering=lambda path, _: path[-1].tuple_name == "ScaleByScheduleState"
    )


class TrainState(NamedTuple):
    step: jax.Array
    params: model.Params  # what is trained: the model, or a LoRA run's adapter
    opt_state: Any


def state_shardings(
    model_cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh, lora: LoraConfig | None = None
) -> TrainState:
    """Trained parameters by the sharding rules; each optimizer moment like its parameter; counters replicated."""
    abstract = trainable_abstract(model_cfg, lora)
    params = plan(abstract, trainable_axes(model_cfg, lora), mesh)
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_abstract = jax.eval_shape(optimizer.init, abstract)
    opt = optax.tree_map_params(
        optimizer, lambda _, s: s, opt_abstract, params, transform_non_params=lambda _: replicated
    )
    return TrainState(replicated, params, opt)


def abstract_state(
    shardings: TrainState,
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    lora: LoraConfig | None = None,
    dtype: str = "float32",
) -> Any:
    """ShapeDtypeStructs with shardings of the trained parameters (stored as `dtype`) and their optimizer
    state: the target that restores a checkpoint onto this mesh."""
    abstract = trainable_abstract(model_cfg, lora, dtype)
    opt = jax.eval_shape(optimizer.init, abstract)

    def attach(a: Any, s: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)

    return jax.tree.map(attach, abstract, shardings.params), jax.tree.map(attach, opt, shardings.opt_state)


def make_train_step(
    cfg: TrainConfig,
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    shardings: TrainState,
    base_shardings: Any = None,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
    """One optimizer step over a batch [micro_batches, micro_batch_size, seq_len + 1]: `step(state, batch)`,
    or for a LoRA run `step(state, batch, base)`, where `base` is the frozen model (laid out as
    `base_shardings`): only the adapter in `state.params` has gradients and optimizer state.

    Gradients of the micro-batches are summed inside a `lax.scan`, so accumulation costs one compiled
    step and one micro-batch of activation memory. The state's buffers are donated; the base's are not.
    """
    policy = cfg.policy
    schedule = lr_schedule(cfg)

    def objective(params: model.Params, tokens: jax.Array, base: model.Params | None, key: jax.Array) -> Any:
        full = params if base is None else {**base, "lora": params}
        return model.loss(full, tokens, model_cfg, policy, z_loss=cfg.z_loss, dropout_key=key)

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def step(state: TrainState, batch: jax.Array, base: model.Params | None) -> tuple[TrainState, dict[str, Any]]:
        keys = jax.random.split(jax.random.fold_in(jax.random.key(cfg.seed), state.step), batch.shape[0])

        def micro(acc: model.Params, xs: tuple[jax.Array, jax.Array]) -> tuple[model.Params, tuple[jax.Array, ...]]:
            tokens, key = xs
            (total, aux), grads = grad_fn(state.params, tokens, base, key)
            acc = jax.tree.map(jnp.add, acc, grads)
            acc = jax.lax.with_sharding_constraint(acc, shardings.params)
            return acc, (total, aux["ce"], jnp.square(optax.tree.norm(grads)))

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, (totals, ces, micro_sq) = jax.lax.scan(micro, zeros, (batch, keys))
        grads = jax.tree.map(lambda g: g / batch.shape[0], grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": ces.mean(),
            "loss_with_z": totals.mean(),
            "grad_norm": optax.tree.norm(grads),
            "micro_grad_sq": micro_sq.mean(),
            "lr": schedule(schedule_count(state.opt_state)),
        }
        return TrainState(state.step + 1, params, opt_state), metrics

    batch_sharding = named_sharding(shardings.step.mesh, (None, "batch", "seq"))
    if cfg.lora is None:
        return jax.jit(
            lambda state, batch: step(state, batch, None),
            in_shardings=(shardings, batch_sharding),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
    return jax.jit(
        step,
        in_shardings=(shardings, batch_sharding, base_shardings),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )


def base_storage(cfg: TrainConfig) -> tuple[str, str | None]:
    """How a LoRA run keeps its frozen base: (dtype, quantize). A quantized base keeps its other weights
    (embedding, norms, head) in the compute dtype."""
    if cfg.frozen_dtype in QUANTIZED:
        return cfg.compute_dtype, cfg.frozen_dtype
    return cfg.frozen_dtype, None


@dataclass(frozen=True)
class StepProgram:
    """`meshlm train`'s step for one config on one mesh before anything is allocated: the jitted step,
    ShapeDtypeStructs (with their shardings) of its arguments, and what it was built from. `meshlm train`
    runs what `compile()` returns; `meshlm plan` reports its footprint."""

    fn: Callable[..., Any]
    inputs: tuple[Any, ...]  # (state, batch), or (state, batch, base) for a LoRA run
    optimizer: optax.GradientTransformation
    shardings: TrainState
    mesh: Mesh

    def compile(self) -> Any:
        """The compiled step (`footprint.OutOfMemory` where the compiler refuses it for the device's memory)."""
        with jax.set_mesh(self.mesh):  # the activation constraints apply inside the mesh
            return footprint.compile_for(self.fn.lower(*self.inputs))

    @property
    def base_shardings(self) -> Any:
        return None if len(self.inputs) < 3 else jax.tree.map(lambda a: a.sharding, self.inputs[2])


def step_program(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh, seq_len: int) -> StepProgram:
    """The train step of `cfg` for `model_cfg` on `mesh` over sequences of `seq_len` tokens."""
    optimizer = make_optimizer(cfg, model_cfg)
    shardings = state_shardings(model_cfg, optimizer, mesh, cfg.lora)
    params, opt_state = abstract_state(shardings, model_cfg, optimizer, cfg.lora, cfg.param_dtype)
    state = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings.step), params, opt_state)
    batch_shape = (cfg.micro_batches, cfg.micro_batch_size, seq_len + 1)
    batch = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=named_sharding(mesh, (None, "batch", "seq")))
    inputs: tuple[Any, ...] = (state, batch)
    base_shardings = None
    if cfg.lora is not None:
        dtype, quantize = base_storage(cfg)
        base = model.abstract_params(model_cfg, dtype)
        if quantize:
            base = jax.eval_shape(lambda p: model.quantize(p, quantize), base)
        base_shardings = plan(base, model.logical_axes(model_cfg, quantize=quantize), mesh)
        inputs += (jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), base, base_shardings),)
    fn = make_train_step(cfg, model_cfg, optimizer, shardings, base_shardings)
    return StepProgram(fn, inputs, optimizer, shardings, mesh)


def check_fits(compiled: Any, mesh: Mesh, cfg: TrainConfig) -> footprint.Footprint:
    """The compiled step's footprint per device, once it is known to fit the devices' memory."""
    used = footprint.Footprint.of(compiled)
    capacity = footprint.device_capacity(mesh.devices.flat[0])
    if capacity is not None and used.total > capacity:
        raise footprint.OutOfMemory(out_of_memory(cfg, mesh, used.total, capacity), used.total, capacity)
    return used


def out_of_memory(cfg: TrainConfig, mesh: Mesh, needed: int | None, capacity: int | None) -> str:
    """One line: what the step needs, what the device has, and the first settings worth trying."""
    tries = []
    if cfg.remat != "full":
        tries.append("remat=full")
    sizes = dict(mesh.shape)
    if sizes["data"] > 1:
        tries.append(f'mesh "fsdp={sizes["data"] * sizes["fsdp"]},model={sizes["model"]}"')
    if cfg.micro_batch_size > batch_ways(mesh) and (cfg.batch_size // (2 * cfg.micro_batches)) % batch_ways(mesh) == 0:
        tries.append(f"micro_batches={2 * cfg.micro_batches}")
    if cfg.lora is None and cfg.adam_dtype == "float32":
        tries.append("adam_dtype=bfloat16")
    if cfg.lora is None:
        tries.append("a lora section")
    needs = "more memory than the device has" if needed is None else f"{footprint.gib(needed)} per device"
    has = "" if capacity is None else f", the device has {footprint.gib(capacity)}"
    try_line = f"; try {' or '.join(tries[:3])}" if tries else ""
    return f"the train step needs {needs}{has}{try_line} (`meshlm plan` finds a setting that fits)"


def make_eval_step(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh) -> Callable:
    """Summed target loss and target count over rows [B, seq_len + 1] weighted per row."""
    policy = replace(cfg.policy, remat="none")

    def evaluate(params: model.Params, tokens: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
        mask = jnp.broadcast_to(weights[:, None], (tokens.shape[0], tokens.shape[1] - 1))
        _, aux = model.loss(params, tokens, model_cfg, policy, loss_mask=mask)
        return aux["ce"] * aux["tokens"], aux["tokens"]

    shard = named_sharding(mesh, ("batch", "seq"))
    return jax.jit(evaluate, in_shardings=(None, shard, named_sharding(mesh, ("batch",))))


# ---------------------------------------------------------------------------------------------------
# Throughput and the gradient noise scale


def adapter_size(model_cfg: ModelConfig, lora: LoraConfig) -> int:
    """The parameters a LoRA run trains: its As and Bs (the per-layer scales are constants)."""
    table = model.adapter_table(model_cfg, lora)
    return sum(math.prod(p["a"].shape) + math.prod(p["b"].shape) for p in table.values())


def flops_per_token(model_cfg: ModelConfig, seq_len: int, lora: LoraConfig | None = None) -> float:
    """Training FLOPs per token: 6 x (parameters used in matmuls) + 12 x layers x d_model x seq (attention).

    With `lora` the frozen weights cost 4 x, not 6 x: the forward and the activations' gradient, but no
    gradient of their own; the adapter's matmuls cost 6 x its parameters like any trained weight.
    """
    # the embedding and learned positions are gathers (a tied embedding is the head's matmul too)
    gathered = 0 if model_cfg.tie_embeddings else model_cfg.vocab_size * model_cfg.d_model
    if model_cfg.position == "learned":
        gathered += model_cfg.max_seq_len * model_cfg.d_model
    matmul_params = model.count_params(model_cfg) - gathered
    attention = 12 * model_cfg.n_layer * model_cfg.d_model * seq_len
    if lora is None:
        return 6 * matmul_params + attention
    return 4 * matmul_params + 6 * adapter_size(model_cfg, lora) + attention


def state_bytes_per_device(model_cfg: ModelConfig, mesh_sizes: dict[str, int], bytes_per_param: int = 16) -> int:
    """Bytes of training state on one device, from shapes and the sharding rules alone (no devices needed).

    The default 16 bytes per parameter is fp32 weights (4) + fp32 gradients (4) + Adam's two fp32
    moments (8); gradients and moments are sharded exactly like the weights. Activations come on top.
    """
    total = 0
    abstract = jax.tree.leaves(model.abstract_params(model_cfg))
    axes = jax.tree.leaves(model.logical_axes(model_cfg), is_leaf=lambda x: isinstance(x, tuple))
    for leaf, names in zip(abstract, axes, strict=True):
        shard = 1
        for size, rule in zip(leaf.shape, spec_for(names), strict=True):
            mesh_axes = () if rule is None else (rule,) if isinstance(rule, str) else rule
            shard *= -(-size // math.prod(mesh_sizes.get(a, 1) for a in mesh_axes))
        total += shard
    return total * bytes_per_param


# Dense peak FLOP/s per device (bf16) of accelerators, by device_kind substring.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "v5p": 459e12, "v5": 197e12}
PEAK_FLOPS |= {"v4": 275e12, "v3": 123e12, "v2": 45e12}


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


def peak_flops(mesh: Mesh, dtype: str) -> float:
    """Peak FLOP/s of the whole mesh: the table for accelerators, a measured matmul for a CPU host."""
    device = mesh.devices.flat[0]
    if device.platform == "cpu":  # simulated CPU devices share one host's cores
        return measure_matmul_peak(dtype)
    for kind, flops in PEAK_FLOPS.items():
        if kind.lower() in device.device_kind.lower():
            return flops * mesh.devices.size
    return float("nan")


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
        return {"noise/G2": self.g2, "noise/S": self.s, "noise/B_simple": self.s / self.g2}


# ---------------------------------------------------------------------------------------------------
# Metrics


class MetricsLog:
    """One record per logged step, to `metrics.jsonl` and TensorBoard (`tb/`), written by process 0."""

    def __init__(self, out_dir: Path):
        self.enabled = jax.process_index() == 0
        if self.enabled:
            from tensorboardX import SummaryWriter

            self._jsonl = (out_dir / "metrics.jsonl").open("a")
            self._tb = SummaryWriter(str(out_dir / "tb"))

    def write(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self._jsonl.flush()
        for key, value in values.items():
            self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


# ---------------------------------------------------------------------------------------------------
# The loop


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss, this invocation's steps
    val_losses: dict[int, dict[str, float]] = field(default_factory=dict)
    stopped_by_signal: bool = False
    lm: api.LanguageModel | None = None
    memory: footprint.Footprint | None = None  # the compiled step's memory per device


@contextmanager
def _stop_on_signals() -> Iterator[list[int]]:
    """SIGTERM/SIGINT set a flag instead of killing: the loop saves a final checkpoint and returns."""
    received: list[int] = []
    handler = lambda signum, _frame: received.append(signum)
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _split_spec(spec: str) -> tuple[str, str]:
    folder, sep, split = spec.rpartition(":")
    return (folder, split) if sep and split and not Path(spec).exists() else (spec, "val")


def run_tokenizer(cfg: TrainConfig, out_dir: Path) -> Tokenizer | None:
    """The run's own tokenizer, kept in the run folder so its checkpoints load with it: `init_from`'s
    tokenizer files are copied in when the run folder has none yet. None: GPT-2 BPE."""
    if cfg.init_from and model_tokenizer_json(out_dir) is None:
        copy_files(tokenizer_files(model=cfg.init_from), out_dir)
    path = model_tokenizer_json(out_dir)
    return None if path is None else HFTokenizer(path)


def open_datasets(
    cfg: TrainConfig, out_dir: Path, tokenizer: Tokenizer | None = None
) -> tuple[TokenDataset, dict[str, TokenDataset]]:
    """The training split and the named validation sets (the data folder's `val` split by default). The
    demo corpus is tokenized with `tokenizer` (default GPT-2 BPE); prepared data must end its documents
    with that tokenizer's end-of-text id, the sign that it was prepared with the same tokenizer."""
    if cfg.data is None:
        from meshlm.demo_corpus import prepare_demo_corpus

        folder = prepare_demo_corpus(out_dir / "data", cfg.seq_len or 128, tokenizer)
        return TokenDataset(folder, "train"), {"val": TokenDataset(folder, "val")}
    if not Path(cfg.data).exists():
        raise ConfigError(f"data folder {cfg.data} does not exist; create it with `meshlm prepare`")
    train_ds = TokenDataset(cfg.data, "train")
    if cfg.seq_len is not None and cfg.seq_len != train_ds.seq_len:
        raise ConfigError(
            f"seq_len {cfg.seq_len} is set, but {cfg.data} was prepared with seq_len {train_ds.seq_len} "
            "(seq_len applies to the built-in corpus only; leave it unset)"
        )
    specs = dict(cfg.val_data)
    if not specs and "val" in _splits(cfg.data):
        specs = {"val": f"{cfg.data}:val"}
    vals = {}
    for name, spec in specs.items():
        folder, split = _split_spec(spec)
        vals[name] = TokenDataset(folder, split)
        if vals[name].seq_len != train_ds.seq_len:
            raise ConfigError(f"val_data {name}: seq_len {vals[name].seq_len} differs from the training data's")
    for ds in (train_ds, *vals.values()):
        if tokenizer is not None and ds.eos_id != tokenizer.eot_id:
            raise ConfigError(
                f"{ds.folder}: prepared with end-of-text id {ds.eos_id}, but the model's tokenizer ({tokenizer.name}) "
                f"has {tokenizer.eot_id}; prepare the data with `meshlm prepare --tokenizer {cfg.init_from or out_dir}`"
            )
    return train_ds, vals


def _splits(folder: str) -> list[str]:
    from meshlm.data import read_index

    return list(read_index(folder)["splits"])


def check_batch(cfg: TrainConfig, mesh: Mesh) -> None:
    ways = batch_ways(mesh)
    if cfg.micro_batch_size % ways:
        raise ConfigError(
            f"batch_size {cfg.batch_size} / micro_batches {cfg.micro_batches} = {cfg.micro_batch_size} sequences per "
            f"micro-batch, not divisible by the mesh's batch axes data x fsdp = {ways}"
        )


def _global_batch(local: np.ndarray, sharding: NamedSharding, global_shape: tuple[int, ...]) -> jax.Array:
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


def train(cfg: TrainConfig, progress: bool = True, sample: bool = True) -> TrainResult:
    """Train (or resume, when `out_dir` holds checkpoints) until `total_steps` or a SIGTERM/SIGINT."""
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mesh = make_mesh(cfg.mesh)
    check_batch(cfg, mesh)
    train_ds, val_sets = open_datasets(cfg, out_dir, run_tokenizer(cfg, out_dir))
    ckpts = checkpoint.TrainCheckpoints(out_dir / "checkpoints", cfg.keep_last, cfg.keep_every)
    try:  # the manager's background threads must be stopped on every way out
        return _train(cfg, mesh, train_ds, val_sets, ckpts, progress, sample)
    finally:
        ckpts.close()


def _train(
    cfg: TrainConfig,
    mesh: Mesh,
    train_ds: TokenDataset,
    val_sets: dict[str, TokenDataset],
    ckpts: checkpoint.TrainCheckpoints,
    progress: bool,
    sample: bool,
) -> TrainResult:
    from tqdm import tqdm

    out_dir = Path(cfg.out_dir)
    latest = ckpts.latest_step()
    if cfg.lora is not None and cfg.resume_optimizer:
        raise ConfigError(
            "resume_optimizer continues a full seed run's Adam state; a LoRA run trains a new adapter with a new "
            "optimizer (drop one of the two)"
        )

    seed_opt = None
    model_cfg = cfg.model
    base_ref = base_reference(cfg) if cfg.lora is not None else None
    if latest is not None:  # the run's own checkpoints come first, also in a run that continued a seed run
        desc = checkpoint.read_description(ckpts.folder / str(latest))
        model_cfg = ModelConfig.from_dict(desc["model"])
        base_ref = resumed_base(cfg, desc, ckpts.folder / str(latest))
    elif cfg.init_from and cfg.lora is None:
        if cfg.resume_optimizer:  # read first: a wrong checkpoint fails before the parameters are loaded
            seed_opt = load_seed_optimizer(cfg, mesh)
        model_cfg = api.read_config(cfg.init_from, cfg.seed_config)
    if base_ref is not None:  # a LoRA run's frozen model, which never enters the optimizer
        if base_ref["init_from"]:
            base_cfg = api.read_config(base_ref["init_from"], base_ref["seed_config"])
            if latest is not None and base_cfg != model_cfg:
                raise ConfigError(f"{base_ref['init_from']} is no longer the model the run's adapter was trained on")
            model_cfg = base_cfg
        # the train config the checkpoints record names the base as resolved (a resume rebuilds that one)
        cfg = cfg.replace(
            init_from=base_ref["init_from"], seed_config=base_ref["seed_config"], base_dtype=base_ref["dtype"]
        )
    if train_ds.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"data seq_len {train_ds.seq_len} exceeds the model's max_seq_len {model_cfg.max_seq_len}")
    if train_ds.eos_id >= model_cfg.vocab_size:
        raise ConfigError(
            f"the data's end-of-text id is {train_ds.eos_id}, beyond the model's vocab_size {model_cfg.vocab_size}; "
            "the data was tokenized for another vocabulary"
        )
    cfg = cfg.replace(model=model_cfg)

    main = jax.process_index() == 0  # only process 0 prints
    show = print if main else lambda *_: None
    # The step is compiled, and checked against the devices' memory, before any weights are read.
    program = step_program(cfg, model_cfg, mesh, train_ds.seq_len)
    compile_start = time.perf_counter()
    try:
        step_fn = program.compile()
    except footprint.OutOfMemory as e:
        raise footprint.OutOfMemory(out_of_memory(cfg, mesh, e.needed, e.capacity), e.needed, e.capacity) from None
    used = check_fits(step_fn, mesh, cfg)
    show(
        f"meshlm train: step compiled in {time.perf_counter() - compile_start:.1f} s; it needs "
        f"{footprint.gib(used.total)} per device"
    )
    optimizer, shardings = program.optimizer, program.shardings
    base_lm = None if base_ref is None else load_base(base_ref, model_cfg, mesh, cfg)
    loader_state = LoaderState()
    with jax.set_mesh(mesh):
        if latest is not None:
            params_target, opt_target = program.inputs[0].params, program.inputs[0].opt_state
            params, opt_state, desc = ckpts.restore(latest, params_target, opt_target)
            loader_state = LoaderState.from_dict(desc["loader"])
            start = latest
        else:
            if cfg.lora is not None:
                init = jax.jit(
                    lambda k: model.init_adapter(model_cfg, cfg.lora, k, cfg.param_dtype),
                    out_shardings=shardings.params,
                )
                params = init(jax.random.fold_in(jax.random.key(cfg.seed), ADAPTER_KEY))
            elif cfg.init_from:
                params = api.load(cfg.init_from, mesh=mesh, dtype=cfg.param_dtype, seed_config=cfg.seed_config).params
                params = jax.device_put(params, shardings.params)
            else:
                init = jax.jit(lambda k: model.init(model_cfg, k, cfg.param_dtype), out_shardings=shardings.params)
                params = init(jax.random.key(cfg.seed))
            opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
            start = 0
            if seed_opt is not None:
                opt_state = jax.device_put(seed_opt.into(opt_state), shardings.opt_state)
                start = seed_opt.step
        state = TrainState(jax.device_put(jnp.asarray(start, jnp.int32), shardings.step), params, opt_state)

    loader = TrainLoader(
        train_ds, cfg.batch_size, cfg.micro_batches, cfg.seed, jax.process_index(), jax.process_count(), loader_state
    )
    base = None if base_lm is None else jax.device_put(base_lm.params, program.base_shardings)
    eval_fn = make_eval_step(cfg, model_cfg, mesh)
    batch_sharding = named_sharding(mesh, (None, "batch", "seq"))
    global_shape = (cfg.micro_batches, cfg.micro_batch_size, train_ds.seq_len + 1)
    tokens_per_step = cfg.batch_size * train_ds.seq_len
    flops_per_step = flops_per_token(model_cfg, train_ds.seq_len, cfg.lora) * tokens_per_step
    peak = peak_flops(mesh, cfg.compute_dtype)
    noise = NoiseScale(cfg.micro_batch_size, cfg.batch_size, cfg.noise_scale_alpha)
    log = MetricsLog(out_dir)
    result = TrainResult(out_dir, start, memory=used)

    last_saved = start
    # a LoRA run's checkpoints hold the adapter alone, with the settings and the base it was trained on
    lora_desc = {} if cfg.lora is None else {"lora": cfg.lora.to_dict(), "base": base_ref}

    def full(params: model.Params) -> model.Params:
        """The model the trained parameters are part of: themselves, or the base with them as its adapter."""
        return params if base is None else {**base, "lora": params}

    def language_model() -> api.LanguageModel:
        if base_lm is None:
            return api.LanguageModel(model_cfg, state.params, mesh, cfg.param_dtype, folder=out_dir)
        return api.LanguageModel(
            model_cfg, full(state.params), mesh, base_lm.dtype, folder=out_dir, quantized=base_lm.quantized
        )

    def save(step: int) -> None:
        nonlocal last_saved
        desc = checkpoint.description(
            model_cfg, state.params, step=step, loader=loader.state.to_dict(), train_config=_jsonable(cfg), **lora_desc
        )
        ckpts.save(step, state.params, state.opt_state, desc)
        last_saved = step

    def validate(step: int) -> None:
        values = {}
        rows, weights_sharding = named_sharding(mesh, ("batch", "seq")), named_sharding(mesh, ("batch",))
        for name, ds in val_sets.items():
            total = count = 0.0
            for tokens, weights in eval_batches(
                ds, cfg.micro_batch_size, cfg.val_batches, jax.process_index(), jax.process_count()
            ):
                t = _global_batch(tokens, rows, (cfg.micro_batch_size, ds.seq_len + 1))
                w = _global_batch(weights, weights_sharding, (cfg.micro_batch_size,))
                s, c = eval_fn(full(state.params), t, w)
                total, count = total + _scalar(s), count + _scalar(c)
            values[f"val/{name}"] = total / count
        result.val_losses[step] = values
        log.write(step, values)
        say(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()))

    def run_eval_tasks(step: int) -> None:
        from meshlm.evaluate import evaluate_tasks

        lm = language_model()
        metrics = evaluate_tasks(lm, cfg.eval_tasks, limit=cfg.eval_limit, include_path=cfg.eval_include_path)
        values = {f"eval/{k}": v for k, v in metrics.items()}
        log.write(step, values)
        say(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()))

    say = tqdm.write if main else lambda *_: None
    n_params = model.count_params(model_cfg)
    what = f"{n_params:,} params"
    if cfg.lora is not None:
        what = (
            f"LoRA rank {cfg.lora.rank} on {', '.join(cfg.lora.targets)}: {adapter_size(model_cfg, cfg.lora):,} "
            f"trainable of {what}; base {base_ref['dtype']}"
        )
    show(f"meshlm train: {what} on {describe(mesh)}; {len(train_ds):,} train sequences")
    bar = tqdm(total=cfg.total_steps, initial=start, desc="train", unit="step", disable=not (progress and main))
    pending: tuple[int, dict[str, jax.Array]] | None = None
    last_time = time.perf_counter()

    def record(step: int, metrics: dict[str, jax.Array]) -> None:
        nonlocal last_time
        values = {k: _scalar(v) for k, v in metrics.items()}
        now = time.perf_counter()
        dt, last_time = now - last_time, now
        values["tokens_per_s"] = tokens_per_step / dt
        values["mfu"] = flops_per_step / dt / peak
        values |= noise.update(values.pop("micro_grad_sq"), values["grad_norm"])
        result.losses[step] = values["loss"]
        log.write(step, values)
        bar.set_postfix(loss=f"{values['loss']:.3f}", lr=f"{values['lr']:.2e}")
        bar.update(1)
        if step % cfg.log_every == 0:
            say(
                f"step {step}: loss {values['loss']:.4f}, lr {values['lr']:.3e}, grad norm {values['grad_norm']:.3f}, "
                f"{values['tokens_per_s']:,.0f} tokens/s, MFU {values['mfu']:.1%}"
            )

    step = start
    with _stop_on_signals() as signals, jax.set_mesh(mesh):
        while step < cfg.total_steps and not _any_process(bool(signals)):
            batch = _global_batch(next(loader), batch_sharding, global_shape)
            state, metrics = step_fn(state, batch) if base is None else step_fn(state, batch, base)
            step += 1
            if pending:
                record(*pending)
            pending = (step, metrics)
            evaluate_now = bool(cfg.eval_tasks and cfg.eval_every and step % cfg.eval_every == 0)
            validate_now = bool(cfg.val_every and step % cfg.val_every == 0)
            if validate_now or evaluate_now or (cfg.ckpt_every and step % cfg.ckpt_every == 0):
                record(*pending)
                pending = None
                if validate_now and val_sets:
                    validate(step)
                if evaluate_now:
                    run_eval_tasks(step)
                if cfg.ckpt_every and step % cfg.ckpt_every == 0:
                    save(step)
                last_time = time.perf_counter()  # throughput counts training only
        if pending:
            record(*pending)
        if step != last_saved:
            save(step)
        bar.close()
        ckpts.wait()
        log.close()
    result.step = step
    result.stopped_by_signal = step < cfg.total_steps
    if result.stopped_by_signal:
        why = f"signal {signals[0]}" if signals else "a signal to another process"
        show(f"meshlm train: stopped by {why} at step {step}; checkpoint saved in {ckpts.folder}")
    result.lm = language_model()
    if sample and cfg.sample_tokens and not result.stopped_by_signal and cfg.data is None and jax.process_count() == 1:
        print_sample(result.lm, cfg.sample_prompt, cfg.sample_tokens)
    return result


ADAPTER_KEY = 2**32 - 1  # folded into the seed's key for a new adapter: apart from the base's and dropout's keys


def base_reference(cfg: TrainConfig) -> dict[str, Any]:
    """What a LoRA run's frozen base is built from, as its checkpoints record it so that a resume rebuilds
    the same base: `init_from` as an absolute path (a run folder resolved to its latest step, which would
    otherwise move on), else the random model of `seed`; `dtype` is how the base is stored."""

    def absolute(path: str | None) -> str | None:
        return None if path is None else str(Path(checkpoint.resolve(path)).absolute())

    return {
        "init_from": absolute(cfg.init_from),
        "seed_config": absolute(cfg.seed_config),
        "dtype": cfg.frozen_dtype,
        "seed": None if cfg.init_from else cfg.seed,
    }


def resumed_base(cfg: TrainConfig, desc: dict[str, Any], folder: Path) -> dict[str, Any] | None:
    """The base that the run's checkpoint `folder` (description `desc`) records (None: a full run's),
    once the config is checked to train what the checkpoint holds. The run's base comes from its
    checkpoints, like its model: a config that leaves init_from or base_dtype out resumes with them,
    one that names another is refused rather than ignored."""
    saved = LoraConfig.from_dict(desc["lora"]) if "lora" in desc else None
    if saved is None and cfg.lora is None:
        return None
    if saved is None:
        raise ConfigError(
            f"{folder} is a full training run's checkpoint, but the config has a lora section; train the adapter "
            f"in a new out_dir, with init_from {folder.parent.parent} to start from this run's model"
        )
    if cfg.lora is None:
        raise ConfigError(
            f"{folder} holds a LoRA adapter (rank {saved.rank} on {', '.join(saved.targets)}), but the config has "
            "no lora section; resume with the run's lora settings, or train in a new out_dir"
        )
    if saved != cfg.lora:
        raise ConfigError(
            f"lora {cfg.lora.to_dict()} differs from {saved.to_dict()}, which {folder} was trained with; resume "
            "with the run's lora settings, or train in a new out_dir"
        )
    base, named = desc["base"], base_reference(cfg)
    if cfg.init_from and named["init_from"] != base["init_from"]:
        trained_on = base["init_from"] or f"a random model of seed {base['seed']}"
        raise ConfigError(
            f"init_from {named['init_from']} is not the base the adapter in {folder} was trained on ({trained_on})"
        )
    if cfg.base_dtype and cfg.base_dtype != base["dtype"]:
        raise ConfigError(f"base_dtype {cfg.base_dtype} differs from {base['dtype']}, the base of {folder}")
    return base


def load_base(base: dict[str, Any], model_cfg: ModelConfig, mesh: Mesh, cfg: TrainConfig) -> api.LanguageModel:
    """A LoRA run's frozen base on `mesh`, as `base_reference` describes it (`model_cfg`: a random
    base's config), stored as `base_storage(cfg)` says."""
    dtype, quantize = base_storage(cfg)
    if base["init_from"]:
        return api.load(base["init_from"], mesh, dtype, seed_config=base["seed_config"], quantize=quantize)
    return api.from_config(model_cfg, mesh, dtype, base["seed"], quantize=quantize)


def load_seed_optimizer(cfg: TrainConfig, mesh: Mesh) -> mtj.SeedOptimizerState:
    """Adam's state and the step of the full seed checkpoint `cfg.init_from`, which the run then continues.

    `total_steps` counts from the seed run's start, as in the seed's own config, so it must exceed the
    checkpoint's step.
    """
    if registry.detect(cfg.init_from) != "mtj":
        raise ConfigError(
            f"resume_optimizer: {cfg.init_from} is not a seed checkpoint; only a full seed (mesh-transformer-jax) "
            "checkpoint carries Adam's moments to resume"
        )
    # Moments take the parameters' dtype, as optax's Adam keeps them (adam_dtype is float32 with resume_optimizer).
    seed = mtj.load_optimizer_moments(cfg.init_from, mesh, cfg.param_dtype, cfg.seed_config)
    if seed.step >= cfg.total_steps:
        raise ConfigError(
            f"resume_optimizer: {cfg.init_from} is at step {seed.step}, total_steps is {cfg.total_steps}; "
            "total_steps counts from the seed run's start, so set it above the checkpoint's step"
        )
    return seed


def _scalar(x: jax.Array) -> float:
    """A replicated scalar's value, read from this process's own copy (works across hosts)."""
    return float(np.asarray(x.addressable_data(0)))


def _any_process(flag: bool) -> bool:
    """True on every process when any process has it: a signal to one host stops all of them together."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def _jsonable(cfg: TrainConfig) -> dict[str, Any]:
    return json.loads(json.dumps(cfg.to_dict()))


def print_sample(lm: api.LanguageModel, prompt: str, n: int) -> None:
    (text,) = lm.generate([prompt], max_new_tokens=n, temperature=0.0, repetition_penalty=1.2)
    print(f"sample (greedy, repetition penalty 1.2): {prompt + text!r}")
